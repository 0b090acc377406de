"""Trajectory balance (objective tb) and TBA's replay buffer (algorithm.replay): the math against the
authors' own code (tests/data/tb_golden.json), the spec's rules, and real trainer steps."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from asyncrl.api.spec import TB_UNUSED, AlgorithmSpec
from asyncrl.trainer.step.replay import ReplayBuffer, softmax_priorities
from asyncrl.trainer.step.trajectory_balance import group_log_z, tb_beta, trajectory_balance_loss
from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample
from tests.support.jobs import JobBuilder
from tests.support.paths import TESTS
from tests.support.trainer_support import (
    chat_groups,
    model_and_tokenizer,
    own_behaviour_groups,
    read_jsonl,
    redis_query,
    run_trainer_on_groups,
    tiny_model,
)

GOLDEN = json.loads((TESTS / "data" / "tb_golden.json").read_text())
JOB = "tb-job"


def _case_tensors(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    lp = torch.tensor(case["logprobs"], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor(case["ref_logprobs"], dtype=torch.float64)
    mask = torch.arange(lp.shape[1])[None, :] < torch.tensor(case["lengths"])[:, None]
    return lp, ref, mask, torch.tensor(case["rewards"], dtype=torch.float64)


@pytest.mark.parametrize("case", range(len(GOLDEN["tb"])))
def test_loss_log_z_and_gradient_match_the_authors_code(case: int) -> None:
    c = GOLDEN["tb"][case]
    lp, ref, mask, rewards = _case_tensors(c)
    policy_sums = torch.where(mask, lp, 0.0).sum(1).tolist()
    ref_sums = torch.where(mask, ref, 0.0).sum(1)
    log_z = group_log_z(policy_sums, ref_sums.tolist(), rewards.tolist(), [c["group_size"]] * c["groups"], c["beta"])
    assert log_z == pytest.approx(c["log_z"], rel=1e-9, abs=1e-9)
    loss, stats = trajectory_balance_loss(lp, torch.zeros_like(lp), mask, ref_sums, rewards,
                                          torch.tensor(log_z, dtype=torch.float64), c["beta"],
                                          denominator=float(len(rewards)))
    loss.backward()
    assert float(loss.detach()) == pytest.approx(c["loss"], rel=1e-6)
    assert torch.allclose(lp.grad, torch.tensor(c["grad"], dtype=torch.float64), rtol=1e-6, atol=1e-9)
    assert stats["tokens"] == float(mask.sum())


def test_micro_batch_losses_add_up_to_the_minibatch_loss() -> None:
    c = GOLDEN["tb"][0]
    lp, ref, mask, rewards = _case_tensors(c)
    ref_sums = torch.where(mask, ref, 0.0).sum(1)
    log_z = torch.tensor(group_log_z(torch.where(mask, lp, 0.0).sum(1).tolist(), ref_sums.tolist(),
                                     rewards.tolist(), [c["group_size"]] * c["groups"], c["beta"]),
                         dtype=torch.float64)
    n = len(rewards)
    whole, _ = trajectory_balance_loss(lp, lp.detach(), mask, ref_sums, rewards, log_z, c["beta"], float(n))
    parts = [trajectory_balance_loss(lp[s], lp.detach()[s], mask[s], ref_sums[s], rewards[s], log_z[s],
                                     c["beta"], float(n))[0] for s in (slice(0, 3), slice(3, n))]
    assert float(sum(parts).detach()) == pytest.approx(float(whole.detach()), rel=1e-12)


def test_equal_rewards_still_pull_towards_the_reference() -> None:
    """Unlike a group-normalised policy gradient, a group of equal rewards has residuals (the policy's
    log-ratio to the reference, centred): dynamic sampling's premise does not hold, the spec rejects it."""
    lp = torch.tensor([[-1.0, -2.0], [-3.0, -0.5]], dtype=torch.float64, requires_grad=True)
    mask = torch.ones_like(lp, dtype=torch.bool)
    ref_sums, rewards = torch.tensor([-2.0, -2.0], dtype=torch.float64), torch.ones(2, dtype=torch.float64)
    log_z = torch.tensor(group_log_z([-3.0, -3.5], [-2.0, -2.0], [1.0, 1.0], [2], 0.5), dtype=torch.float64)
    loss, _ = trajectory_balance_loss(lp, lp.detach(), mask, ref_sums, rewards, log_z, 0.5, 2.0)
    loss.backward()
    # residuals: (S_i - ref_i) centred over the group = -3 - (-3.25), -3.5 - (-3.25) = 0.25, -0.25
    assert float(loss.detach()) == pytest.approx((0.25 ** 2 + 0.25 ** 2) / 2)
    assert lp.grad[0].tolist() == pytest.approx([0.25, 0.25]) and lp.grad[1].tolist() == pytest.approx([-0.25, -0.25])
    with pytest.raises(ValidationError, match=r"dynamicSampling \{\} does not apply to objective 'tb'"):
        AlgorithmSpec(objective="tb", dynamic_sampling={})


def test_beta_anneals_as_the_authors_kl_coef() -> None:
    assert tb_beta(1, 0.012, None, 500) == 0.012 and tb_beta(900, 0.012, None, 500) == 0.012
    # TBA's GSM8K: kl_coef = final (u-1)/500 + start (1 - (u-1)/500) for update u < 500, then final
    for u in (1, 2, 250, 499):
        assert tb_beta(u, 0.012, 0.004, 500) == pytest.approx(0.004 * (u - 1) / 500 + 0.012 * (1 - (u - 1) / 500))
    assert tb_beta(501, 0.012, 0.004, 500) == pytest.approx(0.004) and tb_beta(10_000, 0.012, 0.004, 500) == 0.004


# ---------------------------------------------------------------- the replay buffer


def _group(prompt: str, responses: list[list[int]], rewards: list[float], version: int) -> TrajectoryGroup:
    samples = [TrajectorySample(k, np.array(r, np.int32), np.full(len(r), -1.0, np.float32),
                                np.full(len(r), version, np.int32), w, "stop")
               for k, (r, w) in enumerate(zip(responses, rewards, strict=True))]
    return TrajectoryGroup(JOB, f"{prompt}-{version}", prompt, np.array([1, 2, 3], np.int32), samples, "e", 0.0, 0.0)


@pytest.mark.parametrize("case", range(len(GOLDEN["buffer"])))
def test_buffer_keeps_and_weighs_as_the_authors_buffer(case: int) -> None:
    c = GOLDEN["buffer"][case]
    buf = ReplayBuffer(job=JOB, group_size=2, capacity_per_prompt=c["capacity"], capacity=10_000,
                       reward_priority=c["inv_temp"])
    for version, items in enumerate(c["adds"]):
        g = _group("p", [x["response"] for x in items], [x["score"] for x in items], version)
        buf.add(g, [0.0] * len(items))
    kept = buf.prompts["p"].items
    assert [it.sample.response_ids.tolist() for it in kept] == c["kept"]
    assert [it.sample.reward for it in kept] == c["kept_scores"]
    assert softmax_priorities([it.sample.reward for it in kept], c["inv_temp"]).tolist() == pytest.approx(c["prob"])


def test_buffer_bounds_memory_and_replays_prompts_in_turn() -> None:
    buf = ReplayBuffer(job=JOB, group_size=3, capacity_per_prompt=4, capacity=6, reward_priority=1.0)
    buf.add(_group("a", [[1], [2], [3]], [0, 1, 0], 0), [-1.0, -2.0, -3.0])
    buf.add(_group("b", [[4]], [1], 1), [-4.0])
    buf.add(_group("c", [[6], [7]], [0, 0], 2), [-6.0, -7.0])
    assert len(buf) == 6 and buf.stats().prompts == 3
    buf.add(_group("c", [[8], [9]], [1, 0], 3), [-8.0, -9.0])  # two more: the two oldest (of a) go
    assert len(buf) == 6 and [it.sample.response_ids.tolist() for it in buf.prompts["a"].items] == [[3]]
    stats = buf.stats()
    assert stats.trajectories == 6 and stats.capacity == 6
    assert stats.bytes == sum(it.nbytes for e in buf.prompts.values() for it in e.items) + 3 * 3 * 4
    rng = np.random.default_rng(0)
    drawn = buf.sample_groups(3, rng, now=1.0)
    assert sorted(r.group.prompt_id for r in drawn) == ["a", "b", "c"]  # each once before any again
    for r in drawn:
        g = r.group
        assert len(g.samples) == 3 and [s.sample_index for s in g.samples] == [0, 1, 2]
        assert g.engine_id == "replay" and g.group_id.startswith("replay-")
        kept = {it.sample.response_ids.tobytes(): it.ref_sum for it in buf.prompts[g.prompt_id].items}
        assert r.ref_sums == [kept[s.response_ids.tobytes()] for s in g.samples]  # its own pi_ref travels along
    a = next(r for r in drawn if r.group.prompt_id == "a")
    assert [s.response_ids.tolist() for s in a.group.samples] == [[3]] * 3  # one kept: with replacement
    assert ReplayBuffer(job=JOB, group_size=2, capacity_per_prompt=1, capacity=1,
                        reward_priority=0.0).sample_groups(2, rng, now=0.0) == []


def test_reward_priority_prefers_rewarded_trajectories() -> None:
    buf = ReplayBuffer(job=JOB, group_size=1, capacity_per_prompt=10, capacity=10, reward_priority=3.0)
    buf.add(_group("a", [[1], [2]], [1.0, 0.0], 0), [0.0, 0.0])
    rng = np.random.default_rng(1)
    picks = [buf.sample_groups(1, rng, now=0.0)[0].group.samples[0].reward for _ in range(400)]
    assert np.mean(picks) == pytest.approx(math.exp(3) / (1 + math.exp(3)), abs=0.05)


# ---------------------------------------------------------------- the spec


NOT_DEFAULT = {"loss": "ppo", "proximal": "recompute", "loglinearOnPolicy": "current", "clipEps": 0.3,
               "clipEpsHigh": 0.3, "dualClip": 3.0, "behaviourCap": {"limit": 3.0, "mode": "clamp"},
               "m2": {"threshold": 0.04}, "aggregation": "seq-mean-token-mean", "advantageEstimator": "rloo",
               "batchNormalizeAdvantages": True, "bapo": {}, "vcpo": {"essScaling": True}, "dynamicSampling": {}}


@pytest.mark.parametrize(("camel", "name", "default"), TB_UNUSED)
def test_tb_rejects_every_setting_it_does_not_use(camel: str, name: str, default: object) -> None:
    """(m2, dualClip and bapo meet an earlier rule first; each error names the field)"""
    change = {camel: NOT_DEFAULT[camel]} | ({"proximal": "recompute"} if camel == "loss" else {})
    with pytest.raises(ValidationError, match=camel):
        AlgorithmSpec.model_validate({"objective": "tb", **change})


def test_tb_settings_need_tb_and_one_trainer_process() -> None:
    for change in ({"tb": {"beta": 0.1}}, {"tb": {"betaFinal": 0.004}}, {"tb": {"betaAnnealSteps": 10}},
                   {"replay": {}}):
        with pytest.raises(ValidationError, match="only applies to objective 'tb'"):
            AlgorithmSpec.model_validate(change)
    with pytest.raises(ValidationError, match=r"algorithm.tbBeta moved to algorithm.tb.beta"):
        AlgorithmSpec.model_validate({"objective": "tb", "tbBeta": 0.1})
    spec = AlgorithmSpec.model_validate({"objective": "tb", "tb": {"betaFinal": 0.004},
                                         "replay": {"onPolicyProb": 0.5}})
    assert spec.replay is not None and spec.replay.capacity_per_prompt == 100 and spec.replay.reward_priority == 1.0
    with pytest.raises(ValidationError, match="replay needs batchSize >= 2"):
        AlgorithmSpec.model_validate({"objective": "tb", "replay": {}, "batchSize": 1})
    with pytest.raises(ValidationError, match=r"onPolicyProb|on_policy_prob"):
        AlgorithmSpec.model_validate({"objective": "tb", "replay": {"onPolicyProb": 1.5}})
    with pytest.raises(ValidationError, match="objective 'tb' needs one trainer process"):
        JobBuilder.small(name=JOB, algorithm={"objective": "tb"}, trainer={"replicas": 2}).job()


# ---------------------------------------------------------------- real trainer steps


def _trainer(model: torch.nn.Module, reference: torch.nn.Module, opt: torch.optim.Optimizer, **algorithm: object):
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig

    _, tok = model_and_tokenizer()
    job = JobBuilder.small(name=JOB, batch_size=2,
                           algorithm={"objective": "tb", "tb": {"beta": 0.5}, **algorithm}).job()
    return Trainer(job, RunConfig(engine_kind="hf"), DistContext(), model, opt, tok, reference_model=reference)


def test_trainer_step_is_the_gradient_of_the_trajectory_balance_loss() -> None:
    """One SGD step moves the weights by -lr x the gradient of mean_i(log Z + log pi - log pi_ref - R/beta)^2,
    computed here independently from each whole sequence, with the reference model's log-probs."""
    from asyncrl.trainer.step.logprobs import token_logprobs

    model, reference = tiny_model(), tiny_model()
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(0.05 * torch.randn_like(p))
    groups = own_behaviour_groups(model, JOB, 2, noise=0.3)
    expected = copy.deepcopy(model)

    def logp(m: torch.nn.Module, g: TrajectoryGroup, s: TrajectorySample) -> torch.Tensor:
        full = torch.tensor(np.concatenate([g.prompt_ids, s.response_ids]), dtype=torch.long)[None]
        lp, _ = token_logprobs(m, full, torch.ones_like(full), 1.0, with_entropy=False)
        return lp[0, len(g.prompt_ids) - 1:].sum()

    beta, losses = 0.5, []
    for g in groups:
        pi = torch.stack([logp(expected, g, s) for s in g.samples])
        with torch.no_grad():
            ref = torch.stack([logp(reference, g, s) for s in g.samples])
        r = torch.tensor([s.reward for s in g.samples])
        log_z = (r / beta - pi.detach() + ref).mean()
        losses.append((log_z + pi - ref - r / beta).pow(2))
    loss = torch.cat(losses).mean()
    want_loss = float(loss.detach())
    loss.backward()
    lr = 1e-2
    with torch.no_grad():
        want = {k: p - lr * p.grad for k, p in expected.named_parameters()}

    trainer = _trainer(model, reference, torch.optim.SGD(model.parameters(), lr=lr))
    trainer.spec.algorithm.optimizer.grad_clip = 1e9  # (no clipping: compare the raw gradient step)
    record = trainer.train_step(groups)
    assert record.loss == pytest.approx(want_loss, rel=1e-4)
    assert record.tb_beta == beta and math.isfinite(record.tb_residual_rms)
    assert record.tb_residual_rms == pytest.approx(math.sqrt(want_loss), rel=1e-4)
    got = dict(model.named_parameters())
    delta_want = torch.cat([(want[k] - got[k].detach()).flatten() for k in want])
    assert float(delta_want.abs().max()) < 1e-5
    assert all(p.grad is None for p in reference.parameters())  # the reference stays frozen


def test_steps_with_replay_fill_the_buffer_and_train_replayed_groups() -> None:
    model, reference = tiny_model(), tiny_model()
    trainer = _trainer(model, reference, torch.optim.AdamW(model.parameters(), lr=1e-3),
                       replay={"onPolicyProb": 0.0, "capacityPerPrompt": 8})
    groups = chat_groups(JOB, 2)
    first = trainer.train_step(groups)
    assert first.replayed_groups == 0 and first.replay is not None
    assert first.replay.trajectories == 8 and first.replay.bytes > 0
    assert trainer.replay is not None
    assert trainer.replay.slots(trainer.state.step) == 1  # onPolicyProb 0: every slot but one kept for a fresh group
    replayed = trainer.replay.draw(trainer.state.step)
    assert len(replayed) == 1 and replayed[0].group.prompt_id in {g.prompt_id for g in groups}
    fresh = [dataclasses.replace(groups[0], group_id="g-fresh", samples=[
        dataclasses.replace(s, response_ids=s.response_ids + 1) for s in groups[0].samples])]
    second = trainer.train_step(fresh, replayed)
    assert second.replayed_groups == 1 and math.isfinite(second.loss)
    assert second.tokens == fresh[0].num_tokens()  # (throughput and rewards: of the fresh groups)
    assert second.replay is not None
    assert second.replay.trajectories == 12  # the fresh group's 4 new responses were kept too
    trainer.finish_step(fresh, second)
    report = trainer.get_report()
    held = report.last_step.replay if report.last_step is not None else None
    assert held is not None and held.trajectories == 12 and held.replayed_groups == 1
    assert report.last_step is not None and report.last_step.tb_beta == 0.5


def test_trajectory_balance_lowers_its_loss_on_a_fixed_batch() -> None:
    model, reference = tiny_model(), tiny_model()
    trainer = _trainer(model, reference, torch.optim.AdamW(model.parameters(), lr=1e-3))
    groups = chat_groups(JOB, 2)
    losses = [trainer.train_step(groups).loss for _ in range(6)]
    assert losses[-1] < 0.5 * losses[0], losses


def test_a_run_reads_fewer_fresh_groups_while_it_replays_and_acknowledges_only_those(tmp_path: Path,
                                                                                     redis_url: str) -> None:
    """Against a real Redis: onPolicyProb 0 gives every slot but one to the buffer once it holds
    something, so step 1 reads 2 fresh groups and steps 2-3 read 1 each and replay 1; only the 4 fresh
    groups are acknowledged, the fifth stays in the stream, and the report carries the buffer."""
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.transport.streams import trained_ids

    groups = chat_groups(JOB, 5)
    job = JobBuilder.small(name=JOB, batch_size=2, eta=8, max_steps=3, checkpoint_interval=1,
                           algorithm={"objective": "tb", "replay": {"onPolicyProb": 0.0}}).job()
    trainer, steps = run_trainer_on_groups(tmp_path, redis_url, job, groups, reference_model=tiny_model())
    assert [(len(fresh), len(replayed)) for fresh, replayed in steps] == [(2, 0), (1, 1), (1, 1)]
    assert {p for _, replayed in steps for p in replayed} <= {g.prompt_id for g in groups[:3]}
    trained = [gid for fresh, _ in steps for gid in fresh]
    assert trained == [g.group_id for g in groups[:4]]  # the oldest first, each once

    async def acked(r: Any) -> set[str]:
        return await trained_ids(r, StreamNames.for_job(JOB))

    assert redis_query(redis_url, acked) == set(trained)
    lines = read_jsonl(tmp_path / "metrics.jsonl")
    assert [x["replayed_groups"] for x in lines] == [0, 1, 1]
    assert [x["replay"]["trajectories"] for x in lines] == [8, 12, 16]
    report = trainer.get_report()
    held = report.last_step.replay if report.last_step is not None else None
    assert report.groups_trained == 4 and held is not None
    assert (held.trajectories, held.replayed_groups, held.capacity) == (16, 2, 16384)
