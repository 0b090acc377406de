"""Our policy objectives against verl 0.9.1's own code (tests/support/verl_oracle.py): value and gradient.

Same inputs (float64, masks with an empty row, both advantage signs, ratios inside and outside the
clip band), `loss: ppo` so that verl's `old_log_prob` is our behaviour log-prob, several
aggregations. The differences, each named in docs/algorithms.md ("Objectives"), and how the
tests account for them:

- seq-mean-token-mean: verl divides each row's sum by `count + 1e-8`, we by `count`, a relative
  1e-8 / count: that aggregation is compared to 1e-8 instead of 1e-10.
- seq-mean-token-sum-norm: verl divides by the non-empty rows x the padded width unless told
  otherwise; ours is every row x maxNewTokens (Dr. GRPO), which verl gets through
  `global_batch_info` (its knob for the same thing across data-parallel ranks).
- verl's vanilla always applies the dual clip (clip_ratio_c = 3 by default); ours only with
  dualClip set: dualClip 3 equals c = 3, no dualClip equals c = 1e12 (never binding).
- SAPO: verl always aggregates seq-mean-token-mean; ours follows `aggregation` (so the comparison
  uses seq-mean-token-mean, and token-mean is shown to differ).
- GSPO: verl clamps the log of the sequence ratio at +10 (above only), ours at +-20
  (LOG_RATIO_LIMIT, as for every ratio): they agree while |mean log-ratio| < 10 (tested both ways).
"""

from __future__ import annotations

import pytest
import torch

from asyncrl.api.spec.families import BehaviourCapSpec, SapoSpec
from asyncrl.trainer.step.losses import LossConfig, policy_loss
from tests.support import verl_oracle

F64 = torch.float64
B, T = 6, 9
AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
TOL = {"token-mean": 1e-10, "seq-mean-token-mean": 1e-8, "seq-mean-token-sum-norm": 1e-10}


@pytest.fixture(scope="module")
def verl() -> dict:
    return verl_oracle.load()


def make_inputs(seed: int, dtype: torch.dtype = F64) -> dict[str, torch.Tensor]:
    """Behaviour and current log-probs whose ratios span the band; one empty row; A of both signs."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([9, 5, 0, 7, 3, 8])
    mask = torch.arange(T).unsqueeze(0) < lengths.unsqueeze(1)
    lp_b = -torch.rand(B, T, generator=g, dtype=F64) * 3 - 0.05
    delta = torch.randn(B, T, generator=g, dtype=F64) * 0.25
    delta[0, 1], delta[1, 2], delta[3, 0], delta[5, 4] = 1.5, -1.5, 1.8, -2.0  # far outside the band
    # whole-row shifts, so GSPO's sequence ratio leaves the band too: up for A > 0, down for A < 0
    delta += torch.tensor([0.35, 0.0, 0.0, -0.4, 0.0, 0.05], dtype=F64).unsqueeze(1)
    adv = torch.tensor([1.3, -0.7, 0.4, -1.6, 0.0, 0.9], dtype=F64)
    return {"lp_b": lp_b.to(dtype), "lp": (lp_b + delta).to(dtype), "adv": adv.to(dtype), "mask": mask}


def ours(x: dict, objective: str, aggregation: str, **kw) -> tuple[torch.Tensor, torch.Tensor, dict]:
    lp = x["lp"].clone().requires_grad_(True)
    cfg = LossConfig(loss="ppo", objective=objective, aggregation=aggregation, max_new_tokens=12,
                     clip_eps=0.2, clip_eps_high=kw.pop("eps_high", 0.28), **kw)
    loss, stats = policy_loss(lp, x["lp_b"], x["adv"], x["mask"], config=cfg)
    loss.backward()
    return loss.detach(), lp.grad, stats


def theirs(verl: dict, x: dict, name: str, aggregation: str, *, old: torch.Tensor | None = None,
           weights: torch.Tensor | None = None, **cfg) -> tuple[torch.Tensor, torch.Tensor, dict]:
    lp = x["lp"].clone().requires_grad_(True)
    info = {"global_batch_size": B, "loss_scale_factor": 12} if aggregation == "seq-mean-token-sum-norm" else {}
    config = verl_oracle.ActorConfig(clip_ratio=0.2, clip_ratio_low=0.2, clip_ratio_high=cfg.pop("high", 0.28),
                                     global_batch_info=info, **cfg)
    adv = x["adv"].unsqueeze(1).expand(B, T) * x["mask"]
    old_lp = x["lp_b"] if old is None else old
    loss, metrics = verl[name](old_lp, lp, adv, x["mask"].to(lp.dtype), aggregation, config, weights)
    loss.backward()
    return loss.detach(), lp.grad, metrics


def assert_close(a: torch.Tensor, b: torch.Tensor, tol: float, what: str) -> None:
    diff = float((a - b).abs().max())
    assert diff <= tol * max(1.0, float(b.abs().max())), f"{what}: max |ours - verl| = {diff:.3g} > {tol}"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("objective", ["gspo", "cispo"])
def test_gspo_and_cispo_equal_verl(verl, objective, aggregation, seed):
    x = make_inputs(seed)
    loss, grad, stats = ours(x, objective, aggregation)
    v_loss, v_grad, v_metrics = theirs(verl, x, objective, aggregation)
    assert_close(loss, v_loss, TOL[aggregation], "loss")
    assert_close(grad, v_grad, TOL[aggregation], "grad")
    assert stats["clip_fraction"] == pytest.approx(v_metrics["actor/pg_clipfrac"], rel=1e-6)
    assert stats["clip_fraction"] > 0  # the band is really crossed
    assert stats["clip_fraction"] == pytest.approx(stats["clip_fraction_low"] + stats["clip_fraction_high"])


@pytest.mark.parametrize("seed", [0, 1])
def test_sapo_equals_verl_with_its_aggregation(verl, seed):
    x = make_inputs(seed)
    for taus in ({}, {"tau_pos": 0.7, "tau_neg": 2.0}):
        loss, grad, stats = ours(x, "sapo", "seq-mean-token-mean", eps_high=None, sapo=SapoSpec(**taus))
        verl_taus = {"tau_pos": taus.get("tau_pos", 1.0), "tau_neg": taus.get("tau_neg", 1.05)}
        # verl ignores the mode it is given: token-mean in, seq-mean-token-mean out
        v_loss, v_grad, _ = theirs(verl, x, "sapo", "token-mean", **verl_taus)
        assert_close(loss, v_loss, TOL["seq-mean-token-mean"], f"loss {taus}")
        assert_close(grad, v_grad, TOL["seq-mean-token-mean"], f"grad {taus}")
        assert stats["clip_fraction"] == stats["clip_fraction_low"] == stats["clip_fraction_high"] == 0.0
    token_mean, _, _ = ours(x, "sapo", "token-mean", eps_high=None)
    assert abs(float(token_mean - v_loss)) > 1e-3  # ours honours `aggregation`; verl does not


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("aggregation", AGGREGATIONS)
@pytest.mark.parametrize("dual_clip", [None, 3.0])
def test_ppo_clip_equals_verl_vanilla(verl, aggregation, dual_clip, seed):
    x = make_inputs(seed)
    loss, grad, stats = ours(x, "ppo-clip", aggregation, dual_clip=dual_clip)
    v_loss, v_grad, v_metrics = theirs(verl, x, "vanilla", aggregation,
                                       clip_ratio_c=1e12 if dual_clip is None else dual_clip)
    assert_close(loss, v_loss, TOL[aggregation], "loss")
    assert_close(grad, v_grad, TOL[aggregation], "grad")
    assert stats["clip_fraction"] == pytest.approx(v_metrics["actor/pg_clipfrac"], rel=1e-6)
    assert stats["dual_clip_fraction"] == pytest.approx(v_metrics["actor/pg_clipfrac_lower"], rel=1e-6)
    if dual_clip is not None:
        assert stats["dual_clip_fraction"] > 0  # the dual clip binds somewhere


@pytest.mark.parametrize("objective, name", [("ppo-clip", "vanilla"), ("gspo", "gspo"), ("cispo", "cispo"),
                                             ("sapo", "sapo")])
def test_decoupled_equals_verl_with_rollout_weights(verl, objective, name):
    """Decoupled: verl's function with old_log_prob = the proximal and rollout_is_weights = w."""
    x = make_inputs(3)
    g = torch.Generator().manual_seed(7)
    lp_p = x["lp_b"] + torch.randn(B, T, generator=g, dtype=F64) * 0.3
    w = (lp_p - x["lp_b"]).exp() * x["mask"]
    lp = x["lp"].clone().requires_grad_(True)
    cfg = LossConfig(loss="decoupled", proximal="recompute", objective=objective, aggregation="seq-mean-token-mean",
                     clip_eps_high=None if objective == "sapo" else 0.28,
                     behaviour_cap=BehaviourCapSpec(limit=1e9, mode="clamp"))
    loss, stats = policy_loss(lp, x["lp_b"], x["adv"], x["mask"], config=cfg, prox_logprobs=lp_p)
    loss.backward()
    extra = {"clip_ratio_c": 1e12} if name == "vanilla" else {}
    v_loss, v_grad, _ = theirs(verl, x, name, "seq-mean-token-mean", old=lp_p, weights=w, **extra)
    assert_close(loss.detach(), v_loss, TOL["seq-mean-token-mean"], "loss")
    assert_close(lp.grad, v_grad, TOL["seq-mean-token-mean"], "grad")
    assert stats["behav_weight_max"] > 1.2 and stats["behav_weight_min"] < 0.8  # w really is not 1


@pytest.mark.parametrize("objective, name", [("gspo", "gspo"), ("cispo", "cispo"), ("sapo", "sapo"),
                                             ("ppo-clip", "vanilla")])
def test_float32_equals_verl(verl, objective, name):
    x = make_inputs(5, torch.float32)
    loss, grad, _ = ours(x, objective, "seq-mean-token-mean", eps_high=None if objective == "sapo" else 0.28)
    extra = {"clip_ratio_c": 1e12} if name == "vanilla" else {}
    v_loss, v_grad, _ = theirs(verl, x, name, "seq-mean-token-mean", **extra)
    assert_close(loss, v_loss, 1e-6, "loss")
    assert_close(grad, v_grad, 1e-6, "grad")


def test_gspo_log_clamp_differs_only_beyond_10_nats(verl):
    """verl clamps the log sequence ratio at +10; ours saturates at +-20 (LOG_RATIO_LIMIT)."""
    x = make_inputs(0)
    x["lp"] = x["lp_b"] + torch.where(torch.arange(B).unsqueeze(1) == 0, 12.0, 9.0)  # row 0 at 12 nats
    loss, grad, _ = ours(x, "gspo", "token-mean", eps_high=0.28)
    v_loss, v_grad, _ = theirs(verl, x, "gspo", "token-mean")
    rows = torch.arange(B) != 0
    assert_close(grad[rows], v_grad[rows], 1e-10, "grad of rows under 10 nats")
    # row 0, A > 0, ratio e^12 far above the band: clipped in both, so no gradient in either
    assert float(grad[0].abs().max()) == float(v_grad[0].abs().max()) == 0.0
    assert_close(loss, v_loss, 1e-10, "loss (the clipped branch hides the clamp for A > 0)")
    x["adv"] = -x["adv"]  # A < 0 on row 0: the unclipped branch wins, e^12 (ours) vs e^10 (verl)
    loss, grad, _ = ours(x, "gspo", "token-mean", eps_high=0.28)
    v_loss, v_grad, _ = theirs(verl, x, "gspo", "token-mean")
    assert float(grad[0, 0]) != pytest.approx(float(v_grad[0, 0]), rel=0.5)
    assert float(v_grad[0, 0]) == 0.0  # verl's clamp cuts the gradient of a token past 10 nats


def test_missing_wheel_fails_with_the_setup_step(monkeypatch, tmp_path):
    monkeypatch.setattr(verl_oracle, "WHEEL", tmp_path / "verl-0.9.1-py3-none-any.whl")
    with pytest.raises(pytest.fail.Exception, match=r"scripts/setup.sh --tests.*pip download verl==0.9.1"):
        verl_oracle.load()
