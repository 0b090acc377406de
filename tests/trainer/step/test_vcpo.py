"""VCPO's ESS-scaled learning rate (docs/algorithms.md, VCPO): the pure functions against hand
computations and the authors' code (tests/data/vcpo_golden.json), the spec's rules, and a real
trainer step whose update is exactly the scaled one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from asyncrl.api.spec import AlgorithmSpec
from asyncrl.api.spec.families import VcpoSpec
from asyncrl.trainer.step.losses import (
    VCPO_STAT_KEYS,
    LossConfig,
    opob_advantages,
    policy_loss,
    vcpo_ess_scale,
    vcpo_weight_sums,
)
from tests.support.jobs import JobBuilder
from tests.support.paths import TESTS
from tests.support.trainer_support import model_and_tokenizer, own_behaviour_groups, tiny_model

GOLDEN = json.loads((TESTS / "data" / "vcpo_golden.json").read_text())
BASELINE_GOLDEN = json.loads((TESTS / "data" / "vcpo_baseline_golden.json").read_text())
JOB = "t-vcpo"


def test_lr_scale_by_hand() -> None:
    # equal weights: ESS = n, ratio 1 (less the 1e-8 guard), no reduction
    assert vcpo_ess_scale(4.0, 4.0, 4.0) == pytest.approx(1.0, abs=1e-8)
    # w = (1, 3): ESS = 16 / 10, ratio 0.8; sqrt rule 0.8944, linear 0.8; base 0.5 caps at 1
    assert vcpo_ess_scale(4.0, 10.0, 2.0) == pytest.approx(math.sqrt(0.8))
    assert vcpo_ess_scale(4.0, 10.0, 2.0, scaling="linear") == pytest.approx(0.8)
    assert vcpo_ess_scale(4.0, 10.0, 2.0, base_ess_ratio=0.5) == 1.0
    assert vcpo_ess_scale(4.0, 10.0, 2.0, base_ess_ratio=0.9, scaling="linear") == pytest.approx(0.8 / 0.9)
    assert vcpo_ess_scale(0.0, 0.0, 0.0) == 0.0  # no sequence: the code's 0
    with pytest.raises(ValueError, match="sqrt"):
        vcpo_ess_scale(1.0, 1.0, 1.0, scaling="cube")


def test_weight_sums_by_hand() -> None:
    # sequence log-weights: row 0 sums 0.5 + 0.2 (the masked -9 ignored), row 1 -0.3, row 2 has no token
    log_w = torch.tensor([[0.5, 0.2, -9.0], [-0.3, 0.0, 0.0], [4.0, 4.0, 4.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    s, q, n = vcpo_weight_sums(log_w, mask)
    w = [math.exp(0.7), math.exp(-0.3)]
    assert (s, q, n) == pytest.approx((sum(w), sum(x * x for x in w), 2.0))
    # a huge sequence log-weight stays finite (clamped in float64)
    s, q, _ = vcpo_weight_sums(torch.full((1, 4), 200.0), torch.ones(1, 4, dtype=torch.bool))
    assert math.isfinite(s) and math.isfinite(q)


@pytest.mark.parametrize("case", range(len(GOLDEN["cases"])))
def test_matches_authors_code(case: int) -> None:
    c = GOLDEN["cases"][case]
    old, roll = torch.tensor(c["old_logprobs"], dtype=torch.float64), torch.tensor(c["rollout_logprobs"],
                                                                                   dtype=torch.float64)
    s, q, n = vcpo_weight_sums(old - roll, torch.tensor(c["mask"]))
    assert (s * s / (q + 1e-8)) / n == pytest.approx(c["ess_ratio"], abs=1e-6)
    for key, want in c["lr"].items():
        scaling, base = key.split("/")
        assert vcpo_ess_scale(s, q, n, base_ess_ratio=float(base), scaling=scaling) == pytest.approx(want, abs=1e-6)


def test_policy_loss_reports_the_sums_only_with_vcpo() -> None:
    g = torch.Generator().manual_seed(1)
    lp, lp_b = -torch.rand(3, 5, generator=g), -torch.rand(3, 5, generator=g)
    prox = -torch.rand(3, 5, generator=g)
    mask, adv = torch.ones(3, 5, dtype=torch.bool), torch.tensor([1.0, -1.0, 0.5])
    kw = dict(prox_logprobs=prox, versions=torch.zeros(3, 5, dtype=torch.long), current_version=1)
    _, plain = policy_loss(lp, lp_b, adv, mask, config=LossConfig(proximal="recompute"), **kw)
    _, on = policy_loss(lp, lp_b, adv, mask, config=LossConfig(proximal="recompute", vcpo=VcpoSpec(ess_scaling=True)),
                        **kw)
    assert not set(VCPO_STAT_KEYS) & set(plain)
    assert [on[k] for k in VCPO_STAT_KEYS] == pytest.approx(list(vcpo_weight_sums(prox - lp_b, mask)))


def test_spec_rules() -> None:
    on = {"essScaling": True}
    assert AlgorithmSpec(vcpo={**on, "scaling": "linear", "baseEssRatio": 0.5}).vcpo.ess_scaling
    assert LossConfig.from_spec(AlgorithmSpec(vcpo=on)).vcpo.ess_scaling
    with pytest.raises(ValidationError, match=r"vcpo.essScaling requires loss 'decoupled'"):
        AlgorithmSpec(vcpo=on, loss="ppo", proximal="recompute")
    with pytest.raises(ValidationError, match=r"only apply with vcpo.essScaling true"):
        AlgorithmSpec(vcpo={"scaling": "linear"})
    with pytest.raises(ValidationError, match="sqrt"):
        AlgorithmSpec(vcpo={**on, "scaling": "cube"})
    with pytest.raises(ValidationError, match=r"baseEssRatio|base_ess_ratio"):
        AlgorithmSpec(vcpo={**on, "baseEssRatio": 0.0})
    with pytest.raises(ValidationError, match=r"algorithm.vcpo is now an object: use algorithm.vcpo.essScaling"):
        AlgorithmSpec.model_validate({"vcpo": True})


def _stale_groups(model: torch.nn.Module) -> list:
    """Two groups whose behaviour log-probs are the model's own plus noise: sequence weights differ."""
    return own_behaviour_groups(model, JOB, 2, noise=0.7)


def test_trainer_step_takes_the_scaled_step() -> None:
    """With plain SGD, VCPO's update is the plain update times the reported scale; the lr is restored."""
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig

    _, tok = model_and_tokenizer()
    deltas, records, optimizers = [], [], []
    for vcpo in (False, True):
        model = tiny_model()
        groups = _stale_groups(model)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        job = JobBuilder.small(name=JOB, batch_size=2,
                               algorithm={"proximal": "recompute", "vcpo": {"essScaling": vcpo}}).job()
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        trainer = Trainer(job, RunConfig(engine_kind="hf"), DistContext(), model, opt, tok)
        records.append(trainer.train_step(groups))
        deltas.append({k: v - before[k] for k, v in model.state_dict().items()})
        optimizers.append(opt)
    scale = records[1].vcpo_lr_scale
    assert records[0].vcpo_lr_scale == 1.0 and 0.0 < scale < 0.99
    assert optimizers[1].param_groups[0]["lr"] == 1e-2  # checkpoints keep the base lr
    # (float32 weights round each small difference, so compare the update as one vector)
    plain = torch.cat([v.flatten().double() for v in deltas[0].values()])
    scaled = torch.cat([v.flatten().double() for v in deltas[1].values()])
    assert plain.norm() > 0
    assert scaled.norm() / plain.norm() == pytest.approx(scale, rel=1e-3)
    assert torch.nn.functional.cosine_similarity(scaled, plain, dim=0) > 0.999


def test_two_real_steps_with_vcpo_adamw(tmp_path: Path) -> None:
    """Two AdamW steps with vcpo on train, and the scale reaches the step's metrics.jsonl line."""
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.report.metrics_file import append_metrics_line
    from asyncrl.trainer.run_config import RunConfig

    _, tok = model_and_tokenizer()
    model = tiny_model()
    groups = _stale_groups(model)
    job = JobBuilder.small(name=JOB, batch_size=2, algorithm={"vcpo": {"essScaling": True, "scaling": "linear"}}).job()
    trainer = Trainer(job, RunConfig(engine_kind="hf"), DistContext(), model,
                      torch.optim.AdamW(model.parameters(), lr=1e-3), tok)
    records = [trainer.train_step(groups) for _ in range(2)]
    assert all(np.isfinite(r.loss) and 0.0 < r.vcpo_lr_scale <= 1.0 for r in records)
    append_metrics_line(tmp_path / "metrics.jsonl", records[1])
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["vcpo_lr_scale"] == records[1].vcpo_lr_scale


# ---------------------------------------------------------------- the off-policy optimal baseline


@pytest.mark.parametrize("case", range(len(BASELINE_GOLDEN["cases"])))
def test_baseline_matches_authors_code(case: int) -> None:
    """The authors accumulate (R_i / std) g_i and g_i / std per trajectory, then subtract the group's
    OPOB times the latter: our advantages applied to the same g_i give the same gradient, and the
    same baselines."""
    c = BASELINE_GOLDEN["cases"][case]
    grads = torch.tensor(c["grads"], dtype=torch.float64)
    adv, baselines = opob_advantages(c["rewards"], grads.pow(2).sum(dim=1).tolist(), c["is_weights"],
                                     c["group_sizes"])
    assert baselines == pytest.approx(c["baselines"], abs=1e-6)
    total = (torch.tensor(adv, dtype=torch.float64)[:, None] * grads).sum(dim=0)
    assert total.tolist() == pytest.approx(c["accumulated_gradient"], abs=1e-6)


def test_baseline_by_hand() -> None:
    # equal weights and norms: the plain mean, i.e. GRPO's advantages (R - mean) / std
    adv, (b,) = opob_advantages([1.0, 0.0, 1.0, 0.0], [2.0] * 4, [1.0] * 4, [4])
    assert b == pytest.approx(0.5) and adv == pytest.approx([1.0, -1.0, 1.0, -1.0])
    # one trajectory with 9x the weight (w = 3): b = (9*1 + 0 + 0) / 11; std 0.4714 (R = 1, 0, 0)
    adv, (b,) = opob_advantages([1.0, 0.0, 0.0], [1.0, 1.0, 1.0], [3.0, 1.0, 1.0], [3])
    std = float(np.std([1.0, 0.0, 0.0]))
    assert b == pytest.approx(9 / 11) and adv == pytest.approx([(1 - 9 / 11) / std, -(9 / 11) / std, -(9 / 11) / std])
    # equal rewards: no signal, nothing divided by a zero std
    adv, _ = opob_advantages([1.0, 1.0], [1.0, 5.0], [1.0, 2.0], [2])
    assert adv == pytest.approx([0.0, 0.0], abs=1e-6)
    # a non-finite weight: that group falls back to its plain mean
    adv, (b,) = opob_advantages([1.0, 0.0], [float("inf"), 1.0], [1.0, 1.0], [2])
    assert b == 0.5 and adv == pytest.approx([1.0, -1.0])
    with pytest.raises(ValueError, match="one entry per sequence"):
        opob_advantages([1.0], [1.0, 2.0], [1.0], [1])


@pytest.mark.parametrize("change, says", [
    ({}, "needs a per-sequence aggregation"),
    ({"aggregation": "seq-mean-token-mean", "advantage_estimator": "rloo"}, "advantageEstimator 'grpo'"),
    ({"aggregation": "seq-mean-token-mean", "batch_normalize_advantages": True}, "batchNormalizeAdvantages"),
])
def test_baseline_spec_rules(change: dict, says: str) -> None:
    assert AlgorithmSpec(vcpo={"baseline": True}, aggregation="seq-mean-token-sum-norm").vcpo.baseline
    with pytest.raises(ValidationError, match=says):
        AlgorithmSpec(vcpo={"baseline": True}, **change)


def test_baseline_needs_one_trainer_process() -> None:
    algorithm = {"vcpo": {"baseline": True}, "aggregation": "seq-mean-token-mean"}
    assert JobBuilder.small(algorithm=algorithm).job().spec.algorithm.vcpo.baseline
    with pytest.raises(ValidationError, match="needs one trainer process"):
        JobBuilder.small(algorithm=algorithm, trainer={"gpusPerReplica": 2, "device": "cuda"}).job()


def test_trainer_step_uses_the_gradient_weighted_baseline() -> None:
    """A real step (loss 'ppo', behaviour = the model's own log-probs, so each trajectory's gradient
    at advantage 1 is -grad sum_t log pi): the advantages the trainer trains with are the OPOB ones
    computed here independently from the model's per-sequence gradient norms."""
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig
    from asyncrl.trainer.step.logprobs import token_logprobs

    _, tok = model_and_tokenizer()
    model = tiny_model()
    groups = own_behaviour_groups(model, JOB, 2)  # behaviour: the model's own (ratio 1 at the step's start)
    expected = []
    for g in groups:  # ||grad sum_t log pi(y_t)||^2 per sample, then b and (R - b) / std by hand
        norms = []
        for s in g.samples:
            model.zero_grad(set_to_none=True)
            full = torch.tensor(np.concatenate([g.prompt_ids, s.response_ids]), dtype=torch.long)[None]
            lp, _ = token_logprobs(model, full, torch.ones_like(full), 1.0, with_entropy=False)
            lp[0, len(g.prompt_ids) - 1:].sum().backward()
            norms.append(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters() if p.grad is not None))
        rewards = np.array([s.reward for s in g.samples])
        b = float((np.array(norms) * rewards).sum() / (sum(norms) + 1e-8))
        expected += list((rewards - b) / rewards.std())
    model.zero_grad(set_to_none=True)
    job = JobBuilder.small(name=JOB, batch_size=2, algorithm={"loss": "ppo", "proximal": "recompute",
                           "vcpo": {"baseline": True}, "minibatches": 1,
                           "aggregation": "seq-mean-token-mean"}).job()
    trainer = Trainer(job, RunConfig(engine_kind="hf"), DistContext(), model,
                      torch.optim.SGD(model.parameters(), lr=1e-3), tok)
    used: list[float] = []
    objective = trainer.objective
    real = objective.prepare_update

    def spy(m, plan):  # the advantages the minibatch then trains with
        out = real(m, plan)
        used.extend(objective.step.seqs[i].advantage for i in plan.rows)
        return out

    objective.prepare_update = spy  # type: ignore[method-assign]
    record = trainer.train_step(groups)
    assert used == pytest.approx(expected, rel=1e-4, abs=1e-5)
    assert np.isfinite(record.loss) and record.vcpo_baseline_shift > 0.0


@pytest.mark.parametrize("proximal", ["recompute", "loglinear"])
def test_baseline_with_the_decoupled_loss_and_stale_data(proximal: str) -> None:
    """Stale behaviour log-probs (weights away from 1) under the decoupled loss, with VCPO's lr scale
    too: the step trains (finite loss and weights), and the baselines moved off the plain means."""
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig

    _, tok = model_and_tokenizer()
    model = tiny_model()
    groups = _stale_groups(model)
    job = JobBuilder.small(name=JOB, batch_size=2, algorithm={
                           "proximal": proximal, "vcpo": {"essScaling": True, "baseline": True}, "minibatches": 2,
                           "aggregation": "seq-mean-token-sum-norm"}).job()
    trainer = Trainer(job, RunConfig(engine_kind="hf"), DistContext(), model,
                      torch.optim.AdamW(model.parameters(), lr=1e-3), tok)
    record = trainer.train_step(groups)
    assert np.isfinite(record.loss) and record.updates == 2 and record.skipped_updates == 0
    assert record.vcpo_baseline_shift > 0.0 and 0.0 < record.vcpo_lr_scale < 1.0
    assert all(torch.isfinite(p).all() for p in model.parameters())
