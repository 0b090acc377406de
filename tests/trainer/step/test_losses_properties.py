"""Property tests for the policy loss (hypothesis): invariants that must hold for any input."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.api.spec.families import BehaviourCapSpec, M2Spec
from asyncrl.trainer.step.losses import LossConfig, loglinear_proximal, m2po_mask, policy_loss

logprob = st.floats(min_value=-30.0, max_value=0.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(lp_b=logprob, lp=logprob, staleness=st.integers(0, 64),
       on_policy=st.sampled_from(["current", "behave"]))
def test_loglinear_proximal_lies_between_behaviour_and_current(lp_b, lp, staleness, on_policy):
    prox = float(loglinear_proximal(torch.tensor([[lp_b]], dtype=torch.float64),
                                    torch.tensor([[lp]], dtype=torch.float64),
                                    torch.tensor([[100 - staleness]]), 100, on_policy=on_policy))
    lo, hi = min(lp, lp_b), max(lp, lp_b)
    assert lo - 1e-12 <= prox <= hi + 1e-12
    if staleness == 1 or (staleness == 0 and on_policy == "behave"):
        assert prox == lp_b
    if staleness == 0 and on_policy == "current":
        assert prox == lp


@st.composite
def batches(draw):
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    seed = draw(st.integers(0, 2**31 - 1))
    gen = torch.Generator().manual_seed(seed)
    lp_b = -torch.rand(b, t, generator=gen, dtype=torch.float64) * 5
    lp = lp_b + torch.randn(b, t, generator=gen, dtype=torch.float64) * draw(st.sampled_from([0.05, 0.5, 3.0]))
    adv = torch.randn(b, t, generator=gen, dtype=torch.float64)
    mask = torch.rand(b, t, generator=gen) > draw(st.sampled_from([0.0, 0.3, 0.9]))
    return lp.clamp(max=0.0), lp_b, adv, mask


@settings(max_examples=100, deadline=None)
@given(data=batches(), aggregation=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
       dual=st.sampled_from([None, 3.0]), eps_high=st.sampled_from([None, 0.28]))
def test_recompute_with_proximal_equal_to_behaviour_is_plain_ppo(data, aggregation, dual, eps_high):
    # eta = 0 (synchronous) with recompute: the proximal forward equals the behaviour policy, w = 1,
    # and decoupled PPO must be exactly coupled PPO, value and gradient.
    lp, lp_b, adv, mask = data
    common = dict(aggregation=aggregation, dual_clip=dual, clip_eps_high=eps_high)
    lp1 = lp.clone().requires_grad_(True)
    lp2 = lp.clone().requires_grad_(True)
    dec, dec_stats = policy_loss(lp1, lp_b, adv, mask, prox_logprobs=lp_b.clone(),
                                 config=LossConfig(loss="decoupled", proximal="recompute", **common))
    ppo, ppo_stats = policy_loss(lp2, lp_b, adv, mask, config=LossConfig(loss="ppo", **common))
    assert torch.allclose(dec, ppo, rtol=1e-12, atol=1e-15)
    dec.backward()
    ppo.backward()
    assert torch.allclose(lp1.grad, lp2.grad, rtol=1e-12, atol=1e-15)
    for key in ("clip_fraction", "dual_clip_fraction", "importance_weight_mean"):
        assert math.isclose(dec_stats[key], ppo_stats[key], rel_tol=1e-12, abs_tol=1e-15)
    assert dec_stats["behav_filtered_fraction"] == 0.0


@settings(max_examples=60, deadline=None)
@given(data=batches(), staleness=st.integers(0, 8))
def test_loglinear_matches_recompute_given_the_same_proximal(data, staleness):
    # The loglinear path is the decoupled loss with lp_p = loglinear_proximal(...): feeding that
    # proximal through recompute must give the same loss.
    lp, lp_b, adv, mask = data
    versions = torch.full(lp.shape, 10 - staleness)
    prox = loglinear_proximal(lp_b, lp, versions, 10)
    a, _ = policy_loss(lp, lp_b, adv, mask, config=LossConfig(proximal="loglinear"),
                       versions=versions, current_version=10)
    b, _ = policy_loss(lp, lp_b, adv, mask, config=LossConfig(proximal="recompute"), prox_logprobs=prox)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-15)


@settings(max_examples=100, deadline=None)
@given(data=batches(), kind=st.sampled_from(["ppo", "decoupled"]),
       m2=st.sampled_from([None, 0.04]), scope=st.sampled_from(["all", "harmful"]),
       mode=st.sampled_from(["mask", "clamp"]), level=st.sampled_from(["token", "sequence"]))
def test_stats_are_finite_and_fractions_bounded(data, kind, m2, scope, mode, level):
    lp, lp_b, adv, mask = data
    cfg = LossConfig(loss=kind, proximal="loglinear", m2=None if m2 is None else M2Spec(threshold=m2, scope=scope),
                     behaviour_cap=BehaviourCapSpec(mode=mode, level=level))
    versions = torch.randint(0, 5, lp.shape, generator=torch.Generator().manual_seed(1))
    loss, stats = policy_loss(lp.requires_grad_(True), lp_b, adv, mask, config=cfg,
                              versions=versions, current_version=4)
    assert math.isfinite(float(loss.detach()))
    assert all(math.isfinite(v) for v in stats.values())
    for key in ("clip_fraction", "dual_clip_fraction", "behav_filtered_fraction", "m2_masked_fraction"):
        assert 0.0 <= stats[key] <= 1.0
    assert stats["m2_after"] <= max(stats["m2_before"], 0.0) + 1e-12
    if m2 is not None:
        assert stats["m2_after"] <= m2 + 1e-12
    assert stats["tokens"] == float(mask.sum())


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.floats(-3, 3, allow_nan=False), min_size=1, max_size=12),
       tau=st.sampled_from([0.01, 0.04, 0.5]))
def test_m2po_mask_equals_the_greedy_loop(values, tau):
    log_r = torch.tensor([values], dtype=torch.float64)
    dropped, _before, after = m2po_mask(log_r, torch.ones_like(log_r, dtype=torch.bool), tau)
    # the rule as written: while mean (log r)^2 > tau, drop the largest remaining one. A mean that
    # equals tau up to rounding may fall either way (the loop and the sort-based version sum in
    # different orders), so compare with a 1e-12 tolerance at the boundary.
    squares = sorted((v * v for v in values), reverse=True)
    mean = lambda xs: sum(xs) / len(xs) if xs else 0.0  # noqa: E731
    k = int(dropped.sum())
    assert mean(squares[k:]) <= tau + 1e-12, "stops only once M2 <= tau"
    assert k == 0 or mean(squares[k - 1:]) > tau - 1e-12, "does not drop more than the loop would"
    assert math.isclose(after, mean(squares[k:]), rel_tol=1e-9, abs_tol=1e-12)
    kept_sq = sorted(v * v for v, d in zip(values, dropped[0].tolist()) if not d)
    assert kept_sq == sorted(squares[k:]), "drops the largest ones"


@settings(max_examples=100, deadline=None)
@given(data=batches(), aggregation=st.sampled_from(["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]),
       pad=st.integers(1, 5), norm_length=st.integers(1, 64))
def test_padding_columns_never_change_the_loss(data, aggregation, pad, norm_length):
    # The width of a batch is set by its longest row, so padding must not move any aggregation.
    lp, lp_b, adv, mask = data
    cfg = LossConfig(loss="ppo", aggregation=aggregation, max_new_tokens=norm_length)
    narrow, _ = policy_loss(lp, lp_b, adv, mask, config=cfg)
    widen = lambda t, fill: torch.cat([t, torch.full((t.shape[0], pad), fill, dtype=t.dtype)], dim=1)  # noqa: E731
    wide, _ = policy_loss(widen(lp, float("nan")), widen(lp_b, float("-inf")), widen(adv, 1e9),
                          widen(mask, False), config=cfg)
    assert torch.allclose(wide, narrow, rtol=1e-12, atol=1e-15)


@settings(max_examples=100, deadline=None)
@given(data=batches(), kind=st.sampled_from(["ppo", "decoupled"]), staleness=st.integers(0, 16),
       proximal=st.sampled_from(["recompute", "loglinear"]))
def test_m2_is_the_second_moment_of_the_full_stale_ratio(data, kind, staleness, proximal):
    # M2PO measures (log pi/pi_b)^2 whatever the proximal: scope "all", no behaviour cap, so every
    # masked token is a candidate and M2 before masking is their plain mean.
    lp, lp_b, adv, mask = data
    cfg = LossConfig(loss=kind, proximal=proximal, m2=M2Spec(threshold=0.04),
                     behaviour_cap=BehaviourCapSpec(limit=None))
    versions = torch.full(lp.shape, 20 - staleness)
    prox = (lp_b + lp) / 2 if proximal == "recompute" else None
    _, stats = policy_loss(lp, lp_b, adv, mask, config=cfg, versions=versions, current_version=20,
                           prox_logprobs=prox)
    expected = float(((lp - lp_b)[mask] ** 2).mean()) if bool(mask.any()) else 0.0
    assert math.isclose(stats["m2_before"], expected, rel_tol=1e-9, abs_tol=1e-15)
