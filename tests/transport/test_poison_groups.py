"""Issue 16: a group the trainer cannot train must never reach (or crash-loop) the training step.

`check_group` (asyncrl/transport/content.py) is the one content check; here: its reasons, that each
rule guards something the training step really raises on, that a group passing it cannot make the
step's group-dependent stages raise (property), and the crash-loop scenario itself against a real
Redis: a NaN-logprob group left pending by a trainer that died on it is dead-lettered by the
restarted trainer, which goes on to the next valid group.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.api.spec import AlgorithmSpec
from asyncrl.api.staleness import StalenessPolicy
from asyncrl.api.stream_names import StreamNames
from asyncrl.trainer.inbox import GroupInbox
from asyncrl.trainer.step.batch import build_batch
from asyncrl.trainer.step.plan import plan_step, sequences_with_advantages
from asyncrl.trainer.step.stats import staleness_counts
from asyncrl.transport.admission import Admission
from asyncrl.transport.content import REWARD_LIMIT, GroupLimits, check_group
from asyncrl.transport.streams import TrajectoryConsumer, TrajectoryProducer, read_dead_letters
from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample, decode_group

NAMES = StreamNames.for_job("job")
NAN = float("nan")
ESTIMATORS = ("grpo", "dr_grpo", "rloo")


def group(n_samples: int = 2, n_tokens: int = 4, prompt_len: int = 3) -> TrajectoryGroup:
    samples = [TrajectorySample(i, np.arange(n_tokens, dtype=np.int32) + 10 * i,
                                np.full(n_tokens, -0.5, dtype=np.float32), np.full(n_tokens, 2, dtype=np.int32),
                                float(i), "stop") for i in range(n_samples)]
    return TrajectoryGroup("job", "g", "p", np.arange(prompt_len, dtype=np.int32), samples, "engine-0", 1.0, 0.0)


def with_logprob(g: TrajectoryGroup, sample: int, token: int, value: float,
                 dtype: type = np.float32) -> TrajectoryGroup:
    lps = np.array(g.samples[sample].behav_logprobs, dtype=dtype)
    lps[token] = value
    g.samples[sample].behav_logprobs = lps
    return g


def step_stages(groups: list[TrajectoryGroup], estimator: str = "grpo", normalize: bool = False,
                vocab_size: int = 64) -> None:
    """What the training step does with group content before the model's loss: advantages, the plan,
    the padded batch, the embedding lookup of its token ids, the staleness histogram."""
    algo = AlgorithmSpec(advantage_estimator=estimator, batch_normalize_advantages=normalize)
    seqs = sequences_with_advantages(groups, algo)
    plan_step(groups, seqs, algo)
    staleness_counts(seqs, 3)
    if seqs:
        batch = build_batch(seqs, 0, advantages=[s.advantage for s in seqs])
        torch.nn.functional.embedding(batch.input_ids, torch.zeros(vocab_size, 2))


# ----------------------------------------------------------------------------------- check_group

def test_a_valid_group_passes_with_and_without_limits():
    assert check_group(group()) is None
    assert check_group(group(), GroupLimits(vocab_size=64, group_size=2, max_response_tokens=4)) is None
    assert check_group(group(n_tokens=0)) is None  # empty responses (e.g. an immediate stop) train fine


def _set(field: str, value, sample: int = 1):
    def mutate(g):
        setattr(g.samples[sample], field, value)
        return g
    return mutate


POISON = {
    # name: (mutation, limits, words the reason must contain)
    "nan logprob": (lambda g: with_logprob(g, 1, 2, NAN), None, ["'g'", "sample 1", "behav_logprobs[2]", "NaN"]),
    "-inf logprob": (lambda g: with_logprob(g, 0, 3, -math.inf), None, ["sample 0", "behav_logprobs[3]", "-inf"]),
    "+inf logprob": (lambda g: with_logprob(g, 1, 0, math.inf), None, ["sample 1", "behav_logprobs[0]", "inf"]),
    "logprob beyond float32": (lambda g: with_logprob(g, 1, 1, -1e39, np.float64), None,
                               ["behav_logprobs[1]", "-1e+39", "float32"]),
    "logprobs short": (_set("behav_logprobs", np.zeros(3, np.float32)), None,
                       ["sample 1", "4 response tokens but 3 behav_logprobs"]),
    "versions long": (_set("versions", np.zeros(5, np.int32)), None, ["sample 1", "5 versions"]),
    "negative version": (_set("versions", np.array([2, 2, -1, 2])), None, ["sample 1", "versions[2] = -1"]),
    "version beyond int32": (_set("versions", np.array([2, 2, 2, 2**40])), None, ["versions[3]", "2147483647"]),
    "float versions": (_set("versions", np.full(4, 2.0)), None, ["sample 1: versions", "dtype float64"]),
    "2-D token ids": (_set("response_ids", np.zeros((4, 1), np.int32)), None, ["response_ids", "one-dimensional"]),
    "nan reward": (_set("reward", NAN), None, ["sample 1", "reward is nan"]),
    "inf reward": (_set("reward", -math.inf), None, ["sample 1", "reward is -inf"]),
    "reward beyond float32 advantages": (_set("reward", 2e30), None, ["sample 1", "reward 2e+30", "float32"]),
    "finish reason": (_set("finish_reason", "eos"), None, ["sample 1", "'eos'"]),
    "no samples": (lambda g: TrajectoryGroup("job", "g", "p", g.prompt_ids, [], "e", 1.0, 0.0), None, ["no samples"]),
    "group size": (lambda g: g, GroupLimits(group_size=4), ["2 samples", "group size is 4"]),
    "duplicate sample index": (_set("sample_index", 0), None, ["position 1", "sample_index 0 appears twice"]),
    "sample index out of range": (_set("sample_index", 5), None, ["position 1", "outside 0..1"]),
    "empty prompt": (lambda g: TrajectoryGroup("job", "g", "p", np.zeros(0, np.int32), g.samples, "e", 1.0, 0.0),
                     None, ["empty prompt"]),
    "negative prompt id": (lambda g: setattr(g, "prompt_ids", np.array([1, -3])) or g, None,
                           ["prompt_ids[1] = -3", "negative"]),
    "prompt id beyond vocab": (lambda g: g, GroupLimits(vocab_size=2), ["prompt_ids[2] = 2", "vocabulary (size 2)"]),
    "negative token id": (_set("response_ids", np.array([10, 11, -1, 13])), None,
                          ["sample 1", "response_ids[2] = -1", "negative"]),
    "token id beyond vocab": (lambda g: g, GroupLimits(vocab_size=12), ["sample 1", "response_ids[2] = 12",
                                                                        "vocabulary (size 12)"]),
    "response too long": (lambda g: g, GroupLimits(max_response_tokens=3), ["sample 0", "4 response tokens", "3"]),
}


@pytest.mark.parametrize("name", sorted(POISON))
def test_poison_groups_are_named_with_sample_field_and_value(name):
    mutate, limits, words = POISON[name]
    reason = check_group(mutate(group()), limits)
    assert reason is not None
    for word in words:
        assert word in reason, f"{word!r} not in {reason!r}"


def _rewards(*values: float):
    def mutate(g):
        for sample, value in zip(g.samples, values):
            sample.reward = value
        return g
    return mutate


def _empty_response(g: TrajectoryGroup, sample: int) -> TrajectoryGroup:
    s = g.samples[sample]
    s.response_ids, s.behav_logprobs, s.versions = (np.zeros(0, np.int32), np.zeros(0, np.float32),
                                                    np.zeros(0, np.int32))
    return g


# Each of these makes a stage of the training step raise: why check_group has the rule.
STEP_RAISES = {
    "nan logprob": (POISON["nan logprob"][0], "grpo", ValueError, "behav_logprobs contain NaN or Inf"),
    "-inf logprob": (POISON["-inf logprob"][0], "grpo", ValueError, "NaN or Inf"),
    "logprob beyond float32": (POISON["logprob beyond float32"][0], "grpo", ValueError, "NaN or Inf"),
    "logprobs short": (POISON["logprobs short"][0], "grpo", ValueError, "response tokens but"),
    "negative version": (POISON["negative version"][0], "grpo", ValueError, "negative version"),
    "nan reward": (POISON["nan reward"][0], "grpo", ValueError, "rewards contain NaN or Inf"),
    "reward beyond float32": (_rewards(0.0, 1e39), "grpo", ValueError, "rewards contain NaN or Inf"),
    "rewards whose difference overflows float32": (_rewards(-3e38, 3e38), "rloo", ValueError, "finite"),
    # batch normalisation: a response without tokens has weight 0, the others' std is 0, so its
    # advantage difference is divided by eps = 1e-6
    "rewards that batch normalisation overflows": (lambda g: _rewards(4e32, 0.0)(_empty_response(g, 1)), "dr_grpo",
                                                   ValueError, "finite"),
    "no samples": (POISON["no samples"][0], "dr_grpo", ValueError, "group_size"),
    "empty prompt": (POISON["empty prompt"][0], "grpo", ValueError, "empty prompt"),
    "negative token id": (POISON["negative token id"][0], "grpo", IndexError, "out of range"),
    "token id beyond vocab": (POISON["token id beyond vocab"][0], "grpo", IndexError, "out of range"),
}


@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
@pytest.mark.parametrize("name", sorted(STEP_RAISES))
def test_each_rule_guards_a_real_crash_of_the_training_step(name):
    mutate, estimator, error, match = STEP_RAISES[name]
    g = mutate(group())
    assert check_group(g, GroupLimits(vocab_size=12)) is not None
    with pytest.raises(error, match=match):
        step_stages([g], estimator, normalize="normalisation" in name, vocab_size=12)


def _arrays(length: int, elements: st.SearchStrategy, dtype: type) -> st.SearchStrategy:
    return st.lists(elements, min_size=length, max_size=length).map(lambda xs: np.array(xs, dtype=dtype))


def mostly(good: st.SearchStrategy, bad: st.SearchStrategy) -> st.SearchStrategy:
    """`good` nine times in ten: most drawn groups pass the check, so the property is not vacuous."""
    return st.integers(0, 9).flatmap(lambda k: bad if k == 0 else good)


ANY_FLOAT = st.floats(allow_nan=True, allow_infinity=True) | st.sampled_from([-1e39, 3e38, NAN])
VALID_LOGPROB = st.floats(-30, 0) | st.floats(-3.4028234e38, 1.0) | st.sampled_from([-3.4028234e38, -1e-45, 0.5])


@st.composite
def any_group(draw) -> TrajectoryGroup:
    """Small groups, valid or wrong in the ways the step cares about, with valid extremes (huge
    finite logprobs and rewards, the largest version, empty responses, positive logprobs)."""
    n = draw(mostly(st.integers(1, 3), st.just(0)))
    samples = []
    for k in range(n):
        length = draw(st.integers(0, 4))
        skew = draw(mostly(st.just(0), st.sampled_from([-1, 1])))
        samples.append(TrajectorySample(
            sample_index=draw(mostly(st.just(k), st.sampled_from([0, n]))),
            response_ids=draw(mostly(_arrays(length, st.integers(0, 63), np.int64),
                                     _arrays(length, st.integers(-2, 70), np.int64))),
            behav_logprobs=draw(mostly(_arrays(max(length + skew, 0), VALID_LOGPROB, np.float64),
                                       _arrays(max(length + skew, 0), ANY_FLOAT, np.float64))),
            versions=draw(mostly(_arrays(length, st.integers(0, 2**31 - 1), np.int64),
                                 _arrays(length, st.integers(-2, 5) | st.just(2**31), np.int64))),
            reward=draw(mostly(st.floats(-REWARD_LIMIT, REWARD_LIMIT) | st.sampled_from([REWARD_LIMIT, -REWARD_LIMIT]),
                               ANY_FLOAT | st.sampled_from([4e32, -4e32]))),
            finish_reason=draw(st.sampled_from(["stop", "length", "abort"]))))
    prompt = draw(mostly(st.lists(st.integers(0, 63), min_size=1, max_size=3),
                         st.lists(st.integers(-1, 70), max_size=3)))
    return TrajectoryGroup("job", "g", "p", np.array(prompt, dtype=np.int64), samples, "e", 1.0, 0.0)


@settings(max_examples=300, deadline=None)
@given(any_group(), any_group())
def test_groups_that_pass_the_check_never_make_the_step_raise(a, b):
    limits = GroupLimits(vocab_size=64)
    groups = [g for g in (a, b) if check_group(g, limits) is None]
    for estimator in ESTIMATORS:
        for normalize in (False, True):
            step_stages(groups, estimator, normalize, vocab_size=64)


# ----------------------------------------------------------------------------------- crash loop

async def _publish_through_admission(r, admission: Admission, groups: list[TrajectoryGroup]) -> list[str]:
    """As the rollout worker does: lease, XADD, release as accepted."""
    ids = []
    for g in groups:
        lease = await admission.try_acquire("rollout-0")
        assert lease is not None
        ids.append(await TrajectoryProducer(r, NAMES).publish(g))  # the producer does not check content
        await admission.release(lease, accepted=True)
    return ids


async def _pending_ids(r) -> list[str]:
    rows = await r.xpending_range(NAMES.trajectories, NAMES.consumer_group, "-", "+", 10)
    return [row["message_id"].decode() for row in rows]


async def test_poison_group_pending_before_a_restart_is_dead_lettered_and_training_goes_on(transport_redis):
    r = transport_redis
    admission = Admission(r, NAMES, batch_size=1, staleness=StalenessPolicy.global_budget(0), max_concurrent=4)
    await admission.set_version(1)  # B=1, eta=0: room for exactly the two groups below
    poison = with_logprob(group(), 1, 2, NAN)
    poison.group_id = "poison"
    good = group()
    good.group_id = "good"
    poison_id, good_id = await _publish_through_admission(r, admission, [poison, good])

    # The trainer before the fix read the poison group, then its step raised and the process died:
    # the entry stays pending for its consumer name, and comes back first after a restart.
    await TrajectoryConsumer(r, NAMES, "trainer-0").ensure_group()
    await r.xreadgroup(NAMES.consumer_group, "trainer-0", {NAMES.trajectories: ">"}, count=1)
    assert await _pending_ids(r) == [poison_id]
    with pytest.raises(ValueError, match="NaN"):
        step_stages([poison])

    # The restarted trainer: a fresh consumer with the same (pod) name, its inbox, B = 1.
    consumer = TrajectoryConsumer(r, NAMES, "trainer-0")
    inbox = GroupInbox(consumer, admission, batch_size=1, read_block_ms=100)
    batch = None
    for _ in range(5):
        await inbox.read()
        batch = inbox.take_batch()
        if batch is not None:
            break
    assert batch is not None and [g.group_id for g in batch] == ["good"]
    step_stages(batch)  # the next valid group trains

    # The poison group: in the dead-letter stream with the reason and its raw bytes, acked, counted.
    [dead] = await read_dead_letters(r, NAMES)
    assert dead.source_id == poison_id and dead.consumer == "trainer-0"
    assert "untrainable" in dead.error and "'poison'" in dead.error
    assert "sample 1: behav_logprobs[2] is NaN" in dead.error
    assert decode_group(dead.payload).samples == poison.samples  # the raw payload, for inspection
    assert consumer.stats.dead_lettered == consumer.stats.untrainable == 1
    assert await _pending_ids(r) == [good_id]  # only the good group, until its step is committed
    # Admission got the poison group's slot back (it was accepted but will never be trained).
    snap = await admission.snapshot()
    assert (snap.accepted, snap.dead_lettered, snap.dropped) == (1, 1, 0)
    assert inbox.dead_lettered == 1

    # Another restart before the commit: the good group comes back, the poison group never does.
    again = TrajectoryConsumer(r, NAMES, "trainer-0")
    assert [d.group.group_id for d in await again.read(10, 100)] == ["good"]
    assert len(await read_dead_letters(r, NAMES)) == 1


async def test_the_consumer_checks_what_only_the_trainer_knows(transport_redis):
    """Limits the trainer knows (vocabulary, group size, longest response) reach the consumer's check."""
    r = transport_redis
    g = group()  # sample 1's token ids are 10..13
    await TrajectoryProducer(r, NAMES).publish(g)
    strict = TrajectoryConsumer(r, NAMES, "t", limits=GroupLimits(vocab_size=13, group_size=2))
    assert await strict.read(10, 100) == []
    [dead] = await read_dead_letters(r, NAMES)
    assert "sample 1: response_ids[3] = 13 is outside the vocabulary (size 13)" in dead.error
    g.group_id = "fits"
    await TrajectoryProducer(r, NAMES).publish(g)
    wide = TrajectoryConsumer(r, NAMES, "t", limits=GroupLimits(vocab_size=14, group_size=2, max_response_tokens=4))
    assert [d.group.group_id for d in await wide.read(10, 100)] == ["fits"]
