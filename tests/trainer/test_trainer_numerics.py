"""Bad numbers in the trainer: a non-finite gradient skips its update instead of destroying the
model, and the chunked LM head's activation checkpointing follows `model.gradientCheckpointing`."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tests.support.jobs import JobBuilder
from tests.support.trainer_support import make_groups, model_and_tokenizer, tiny_model

JOB = "t-numerics"


def _trainer(tmp_path: Path, job: Any, base: Any = None) -> Any:
    """A single-process Trainer on a fresh copy of `base` (default: the embedded model) with AdamW (no
    Redis: batches are fed)."""
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig

    embedded, tok = model_and_tokenizer()
    base = embedded if base is None else base
    model = type(base)(base.config)
    model.load_state_dict(base.state_dict())
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    cfg = RunConfig(engine_kind="hf", weights_dir=tmp_path / "weights", checkpoint_dir=tmp_path / "ckpt",
                    metrics_path=tmp_path / "metrics.jsonl")
    return Trainer(job, cfg, DistContext(), model, opt, tok)


def _feed(trainer: Any, batches: list[list[Any]]) -> None:
    """Rank 0's batches come from this list instead of Redis (None, a stop, when it runs out)."""
    it = iter(batches)

    async def next_batch() -> list[Any] | None:
        return next(it, None)

    trainer.next_batch = next_batch


def _poison_updates(model: Any, poisoned: set[int]) -> list[int]:
    """Put one NaN into one gradient element in the backward of each update number in `poisoned`
    (1-based, one micro-batch per update); returns the list of updates seen so far."""
    seen: list[int] = []
    param = model.model.layers[3].mlp.down_proj.weight

    def hook(grad: torch.Tensor) -> torch.Tensor:
        seen.append(len(seen) + 1)
        if seen[-1] not in poisoned:
            return grad
        grad = grad.clone()
        grad[0, 0] = float("nan")
        return grad

    param.register_hook(hook)
    return seen


def _snapshot(trainer: Any) -> dict[str, torch.Tensor]:
    """Copies of every weight and every AdamW state tensor."""
    out = {f"w.{k}": v.clone() for k, v in trainer.model.state_dict().items()}
    for i, state in trainer.optimizer.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": torch.as_tensor(v).clone() for k, v in state.items()})
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _record_changes(trainer: Any) -> list[bool]:
    """Whether each train_step from here on left weights and AdamW state exactly as they were."""
    unchanged: list[bool] = []
    last = [_snapshot(trainer)]
    step = trainer.train_step

    def recorded(groups: list[Any], replayed: Any = None) -> Any:
        record = step(groups, replayed)
        now = _snapshot(trainer)
        unchanged.append(_same(now, last[0]))
        last[0] = now
        return record

    trainer.train_step = recorded
    return unchanged


@pytest.mark.slow
def test_a_non_finite_gradient_skips_its_update_and_training_continues(tmp_path: Path) -> None:
    """Steps: NaN, fine, NaN, with maxNonFiniteSteps=2: the NaN steps leave weights and AdamW state
    exactly as they were, the finite step trains, the skips are counted, and two skips that are
    not consecutive do not end the run. (On a four-layer model of SmolLM2's architecture: what the
    trainer does around a non-finite gradient does not depend on the model's size.)"""
    job = JobBuilder.small(name=JOB, batch_size=1, group_size=2, max_steps=3, checkpoint_interval=10,
                           trainer={"maxNonFiniteSteps": 2}).job()
    groups = make_groups(JOB, 3, group_size=2, version=0)
    trainer = _trainer(tmp_path, job, tiny_model(layers=4))
    _feed(trainer, [[g] for g in groups])
    seen = _poison_updates(trainer.model, {1, 3})
    unchanged = _record_changes(trainer)

    phase = asyncio.run(trainer.run())

    assert phase == "Succeeded" and seen == [1, 2, 3]
    assert (trainer.state.step, trainer.state.version) == (3, 3)  # the policy version advances anyway
    # Steps 1 and 3 skipped: weights and AdamW state exactly as before; step 2 trained.
    assert unchanged == [True, False, True]
    assert trainer.optimizer.state  # (step 2 created AdamW's state, which step 3 left alone)
    weights = trainer.model.state_dict()
    assert all(bool(torch.isfinite(v).all()) for v in weights.values())
    assert trainer.state.skipped_updates == 2
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [x["skipped_updates"] for x in lines] == [1, 0, 1]
    assert [x["skipped_updates_total"] for x in lines] == [1, 1, 2]
    # Every group was consumed by a step (and is acknowledged at the commit like any other).
    from asyncrl.trainer.state.checkpoint import lineage_group_ids

    assert lineage_group_ids(tmp_path / "ckpt") == [g.group_id for g in groups]
    # The published weights of a skipped step are the unchanged (finite) weights.
    from safetensors.torch import load_file

    v2 = load_file(tmp_path / "weights" / "v2" / "model.safetensors")
    v3 = load_file(tmp_path / "weights" / "v3" / "model.safetensors")
    assert all(torch.equal(v3[k], v) and torch.equal(weights[k], v) for k, v in v2.items())


@pytest.mark.slow
def test_consecutive_skipped_steps_fail_the_job_naming_the_setting(tmp_path: Path) -> None:
    from asyncrl.infra.errors import TrainerError
    from asyncrl.trainer.weights.publisher import failure_reason

    job = JobBuilder.small(name=JOB, batch_size=1, group_size=2, max_steps=5, checkpoint_interval=10,
                           trainer={"maxNonFiniteSteps": 2}).job()
    groups = make_groups(JOB, 3, group_size=2, version=0)
    trainer = _trainer(tmp_path, job, tiny_model(layers=4))
    initial = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    _feed(trainer, [[g] for g in groups])
    _poison_updates(trainer.model, set(range(1, 100)))

    with pytest.raises(TrainerError, match="maxNonFiniteSteps=2") as err:
        asyncio.run(trainer.run())
    assert failure_reason(err.value) == "NonFiniteGradients"
    assert trainer.state.skipped_updates == 2
    assert trainer.state.step == 1  # the second skipped step ends the run before it is published
    assert _same(dict(trainer.model.state_dict()), initial)
    assert not trainer.optimizer.state  # AdamW never stepped


def test_max_non_finite_steps_is_validated() -> None:
    from pydantic import ValidationError

    assert JobBuilder.small(name=JOB).job().spec.trainer.max_non_finite_steps == 3
    with pytest.raises(ValidationError, match="maxNonFiniteSteps"):
        JobBuilder.small(name=JOB, trainer={"maxNonFiniteSteps": 0}).job()


def _logprobs_and_grads(model: Any, batch: Any, *, checkpoint_head: bool) -> tuple[torch.Tensor, dict[str, Any]]:
    from asyncrl.trainer.step.logprobs import token_logprobs

    model.zero_grad(set_to_none=True)
    lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, 0.7, mask=batch.loss_mask,
                           chunk_tokens=5, checkpoint_head=checkpoint_head)
    (lp * torch.linspace(-1.0, 1.0, lp.shape[-1])).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lp.detach(), grads


@pytest.mark.slow
def test_checkpointed_head_gives_the_same_logprobs_and_gradients() -> None:
    from asyncrl.trainer.step.batch import build_batch
    from asyncrl.trainer.step.plan import sequences_with_advantages

    groups = make_groups(JOB, 1, version=0)
    seqs = sequences_with_advantages(groups, JobBuilder.small(name=JOB).job().spec.algorithm)
    batch = build_batch(seqs, 0, advantages=[s.advantage for s in seqs])
    model, _ = model_and_tokenizer()
    lp_plain, g_plain = _logprobs_and_grads(model, batch, checkpoint_head=False)
    lp_ckpt, g_ckpt = _logprobs_and_grads(model, batch, checkpoint_head=True)
    assert torch.equal(lp_ckpt, lp_plain)
    assert g_ckpt.keys() == g_plain.keys() and len(g_plain) > 0
    for name, g in g_plain.items():
        torch.testing.assert_close(g_ckpt[name], g, rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_trainer_checkpoints_the_head_with_gradient_checkpointing(tmp_path: Path, monkeypatch: Any,
                                                                  gradient_checkpointing: bool) -> None:
    """`model.gradientCheckpointing` also recomputes the chunked LM head's logits in backward."""
    from asyncrl.trainer.step import logprobs

    calls: list[int] = []
    real = logprobs.checkpoint

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(logprobs, "checkpoint", spy)
    job = JobBuilder.small(name=JOB, batch_size=1, model={"gradientCheckpointing": gradient_checkpointing}).job()
    trainer = _trainer(tmp_path, job)
    record = trainer.train_step(make_groups(JOB, 1, version=0))
    assert record.tokens > 0
    assert bool(calls) == gradient_checkpointing


def test_a_non_finite_loss_is_shown_as_zero_in_the_strict_json_report() -> None:
    """A step whose loss was NaN (its updates were skipped) must not break /status (strict JSON)."""
    from asyncrl.api.status_report import StepMetrics
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig

    trainer = Trainer(JobBuilder.small(name=JOB).job(), RunConfig(engine_kind="hf"), DistContext(), None, None, None)
    nan = float("nan")
    record = StepMetrics(step=1, policy_version=0, tokens=4, reward_mean=0.5, staleness_mean=0.0, staleness_max=0,
                         staleness_histogram={"0": 4}, loss=nan, importance_weight_max=float("inf"),
                         importance_weight_mean=nan, full_ratio_max=nan, full_ratio_mean=nan, behav_ess=nan,
                         behav_kl=float("inf"), compute_seconds=1.0, updates=1, skipped_updates=1)
    trainer.finish_step([SimpleNamespace(group_id="g0", samples=[])], record)
    report = trainer.get_report()
    json.dumps(report.model_dump(mode="json"), allow_nan=False)  # what the status endpoint sends
    last = report.last_step
    assert report.history[-1].loss == 0.0 and last is not None and last.importance_weight_max == 0.0
    assert (last.full_ratio_max, last.behav_ess, last.behav_kl) == (0.0, 0.0, 0.0)


def test_with_one_minibatch_recompute_and_loglinear_take_the_same_step_on_stale_data(tmp_path: Path) -> None:
    """Issue 16: the two proximal methods differ only where a token is clipped or capped.

    With one minibatch the recomputed proximal is the current policy itself, so u = 1 and
    w = pi/pi_b; log-linear at d = 2 splits the same ratio into u = w = (pi/pi_b)^(1/2). Their
    gradients are both (pi/pi_b) A grad log pi on every token neither clips nor caps. This runs the
    trainer's real step (the recompute forward, build_batch, the loss, AdamW) on the same batch,
    2 versions stale, from identical weights and optimizer state: the updates must agree, so a
    difference in learning between the two in a run is sampling noise, not the method.
    """
    warmup = [make_groups(JOB, 1, version=v, seed=10 + v, prefix=f"w{v}-") for v in (0, 1)]
    stale = make_groups(JOB, 2, version=0, seed=3, prefix="s-")
    # a clip band too wide to bind: the test is of everything but the clip (whose effect is by design)
    wide = {"clipEps": 0.99, "clipEpsHigh": 100.0}
    loglinear = _trainer(tmp_path / "a", JobBuilder.small(name=JOB, proximal="loglinear", algorithm=wide).job())
    for group in loglinear.optimizer.param_groups:  # examples/local.yaml's rate: realistic staleness
        group["lr"] = 5e-6
    for version, groups in enumerate(warmup):  # two updates: the policy is now version 2
        loglinear.state.version = version
        loglinear.train_step(groups)
    recompute = _trainer(tmp_path / "b", JobBuilder.small(name=JOB, proximal="recompute", algorithm=wide).job())
    recompute.model.load_state_dict(loglinear.model.state_dict())
    # (a deep copy: load_state_dict keeps the very tensors it is given, and AdamW updates them in place)
    recompute.optimizer.load_state_dict(copy.deepcopy(loglinear.optimizer.state_dict()))
    start = [p.detach().clone() for p in loglinear.model.parameters()]

    records, deltas = [], []
    for trainer in (loglinear, recompute):
        trainer.state.version = 2
        records.append(trainer.train_step(stale))
        deltas.append(torch.cat([(p.detach() - s).reshape(-1) for p, s in zip(trainer.model.parameters(), start)]))
    a, b = records
    assert a.staleness_mean == b.staleness_mean == 2.0
    assert a.behav_filtered_fraction == b.behav_filtered_fraction == 0.0, (a, b)
    assert b.importance_weight_max == pytest.approx(1.0, abs=1e-5)  # recompute: u = 1 on every token
    # the full stale ratio pi / pi_b is the same in both, and it really moved (the data is stale)
    assert a.full_ratio_max == pytest.approx(b.full_ratio_max, rel=1e-5) and a.full_ratio_max > 1.01
    cosine = float(torch.nn.functional.cosine_similarity(deltas[0], deltas[1], dim=0))
    ratio = float(deltas[0].norm() / deltas[1].norm())
    assert a.clip_fraction == b.clip_fraction == 0.0
    assert cosine > 0.99999 and abs(ratio - 1) < 1e-4, (cosine, ratio)
