"""policy_loss: every branch against numbers derived by hand from docs/algorithms.md.

Conventions: tensors are float64 so the hand arithmetic can be compared tightly; `r` is the
ratio we want for a token, realised as `lp = lp_b + log(r)` with `lp_b = -1`.
"""

from __future__ import annotations

import math

import pytest
import torch

from asyncrl.api.spec import AlgorithmSpec
from asyncrl.api.spec.families import BapoSpec, BehaviourCapSpec, M2Spec, SapoSpec, VcpoSpec
from asyncrl.trainer.step.losses import (
    LOG_RATIO_LIMIT,
    STAT_KEYS,
    BehaviourWeight,
    LossConfig,
    LossTerms,
    M2Mask,
    PolicyInputs,
    Surrogate,
    aggregate,
    cap_behaviour_weight,
    clipped_surrogate,
    compute_ratios,
    loglinear_proximal,
    loss_metrics,
    m2po_mask,
    m2po_trust_region,
    policy_loss,
    prepare_inputs,
    proximal_logprobs,
)
from tests.support.loss_support import step_over_micro_batches

E = math.e
pytestmark = pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad")
PPO = LossConfig(loss="ppo")


def row(*values: float) -> torch.Tensor:
    return torch.tensor([list(values)], dtype=torch.float64)


def tokens_with_ratios(*ratios: float, base: float = -1.0):
    """(lp with grad, lp_b) for one row whose per-token ratios pi/pi_b are `ratios`."""
    lp_b = torch.full((1, len(ratios)), base, dtype=torch.float64)
    lp = (lp_b + torch.log(row(*ratios))).requires_grad_(True)
    return lp, lp_b


def ones_like(t: torch.Tensor) -> torch.Tensor:
    return torch.ones(t.shape, dtype=torch.bool)


# ------------------------------------------------------------------------------ coupled PPO


def test_ppo_clip_positive_advantage():
    # eps = 0.2, A = +1.  L = max(-A r, -A clip(r, 0.8, 1.2))
    # r = 1.5: max(-1.5, -1.2) = -1.2  (clipped branch wins strictly)
    # r = 1.1: max(-1.1, -1.1) = -1.1  (tie: not clipped)
    # r = 0.5: max(-0.5, -0.8) = -0.5  (unclipped wins)
    # token-mean = (-1.2 - 1.1 - 0.5) / 3 = -0.933333
    lp, lp_b = tokens_with_ratios(1.5, 1.1, 0.5)
    loss, stats = policy_loss(lp, lp_b, row(1, 1, 1), ones_like(lp), config=PPO)
    assert float(loss) == pytest.approx(-2.8 / 3, rel=1e-12)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    loss.backward()
    # dL/dlp = -A r / N where unclipped; 0 where the clipped (constant) branch won
    assert lp.grad.tolist()[0] == pytest.approx([0.0, -1.1 / 3, -0.5 / 3], rel=1e-12)


def test_ppo_clip_negative_advantage():
    # A = -1: r = 1.5: max(1.5, 1.2) = 1.5 ; r = 1.1: 1.1 ; r = 0.5: max(0.5, 0.8) = 0.8 (clipped)
    # token-mean = (1.5 + 1.1 + 0.8) / 3 = 1.133333
    lp, lp_b = tokens_with_ratios(1.5, 1.1, 0.5)
    loss, stats = policy_loss(lp, lp_b, row(-1, -1, -1), ones_like(lp), config=PPO)
    assert float(loss) == pytest.approx(3.4 / 3, rel=1e-12)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    assert stats["importance_weight_max"] == pytest.approx(1.5)
    assert stats["importance_weight_min"] == pytest.approx(0.5)
    assert stats["importance_weight_mean"] == pytest.approx(3.1 / 3)
    # coupled PPO: the proximal is the behaviour policy, so u = r and w = 1
    assert stats["full_ratio_max"] == pytest.approx(1.5) and stats["full_ratio_mean"] == pytest.approx(3.1 / 3)
    assert stats["behav_weight_min"] == stats["behav_weight_max"] == stats["behav_ess"] == 1.0


def test_clip_higher():
    # eps_lo = 0.2, eps_hi = 0.28, A = +1: bounds [0.8, 1.28]
    # r = 1.5 -> -1.28 (clipped) ; r = 1.25 -> -1.25 (inside; symmetric eps would clip at 1.2)
    # r = 0.7 -> max(-0.7, -0.8) = -0.7 ; mean = (-1.28 - 1.25 - 0.7) / 3 = -1.076667
    lp, lp_b = tokens_with_ratios(1.5, 1.25, 0.7)
    cfg = LossConfig(loss="ppo", clip_eps_high=0.28)
    loss, stats = policy_loss(lp, lp_b, row(1, 1, 1), ones_like(lp), config=cfg)
    assert float(loss) == pytest.approx(-3.23 / 3, rel=1e-12)
    assert stats["clip_fraction"] == pytest.approx(1 / 3)
    sym, sym_stats = policy_loss(lp, lp_b, row(1, 1, 1), ones_like(lp), config=PPO)
    assert float(sym) == pytest.approx((-1.2 - 1.2 - 0.7) / 3, rel=1e-12)
    assert sym_stats["clip_fraction"] == pytest.approx(2 / 3)


def test_dual_clip():
    # c = 3. tokens (r, A): (5, -1), (2, -1), (0.5, -1), (5, +1)
    # (5,-1): max(5, 1.2) = 5 -> min(5, 3*1) = 3  (dual-clipped; the eps-clip did not win)
    # (2,-1): max(2, 1.2) = 2 < 3 -> 2
    # (0.5,-1): max(0.5, 0.8) = 0.8 (eps-clipped)
    # (5,+1): max(-5, -1.2) = -1.2 (eps-clipped; dual clip only applies to A < 0)
    # mean = (3 + 2 + 0.8 - 1.2) / 4 = 1.15
    lp, lp_b = tokens_with_ratios(5, 2, 0.5, 5)
    cfg = LossConfig(loss="ppo", dual_clip=3.0)
    loss, stats = policy_loss(lp, lp_b, row(-1, -1, -1, 1), ones_like(lp), config=cfg)
    assert float(loss) == pytest.approx(1.15, rel=1e-12)
    assert stats["dual_clip_fraction"] == pytest.approx(0.25)
    assert stats["clip_fraction"] == pytest.approx(0.5)
    loss.backward()
    # only (2,-1) has a gradient: d(-A r)/dlp = r = 2, / 4 tokens = 0.5
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 0.5, 0.0, 0.0])


# ------------------------------------------------------------------------------ aggregation


def _aggregation_case():
    # r = 1 everywhere, so the per-token loss is -A.  T = 5.
    # row 0: A = 1, 2, 3 on 3 tokens -> -1, -2, -3 ; row 1: A = 4 on 1 token -> -4 ; row 2: empty
    lp = torch.zeros(3, 5, dtype=torch.float64, requires_grad=True)
    lp_b = torch.zeros(3, 5, dtype=torch.float64)
    adv = torch.tensor([[1, 2, 3, 9, 9], [4, 9, 9, 9, 9], [9, 9, 9, 9, 9]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    return lp, lp_b, adv, mask


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token-mean", -10 / 4),  # (-1 - 2 - 3 - 4) / 4 tokens
        ("seq-mean-token-mean", -3.0),  # mean(-6/3, -4/1) over the 2 non-empty rows
        ("seq-mean-token-sum-norm", -10 / 24),  # (-1 - 2 - 3 - 4) / (3 rows x norm_length 8), not / T
    ],
)
def test_aggregations(aggregation, expected):
    lp, lp_b, adv, mask = _aggregation_case()
    cfg = LossConfig(loss="ppo", aggregation=aggregation, max_new_tokens=8)
    loss, _ = policy_loss(lp, lp_b, adv, mask, config=cfg)
    assert float(loss) == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("aggregation", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_loss_denominator_makes_micro_batches_exact(aggregation):
    lp, lp_b, adv, mask = _aggregation_case()
    cfg = LossConfig(loss="ppo", aggregation=aggregation, max_new_tokens=8)
    full, _ = policy_loss(lp, lp_b, adv, mask, config=cfg)
    denom = {"token-mean": 4.0, "seq-mean-token-mean": 2.0, "seq-mean-token-sum-norm": 3 * 8.0}[aggregation]
    parts = [policy_loss(lp[rows], lp_b[rows], adv[rows], mask[rows], config=cfg,
                         loss_denominator=denom)[0] for rows in (slice(0, 1), slice(1, 3))]
    assert float(sum(parts)) == pytest.approx(float(full), rel=1e-12)
    # token-mean with an explicit global count: -10 / 8
    if aggregation == "token-mean":
        half, _ = policy_loss(lp, lp_b, adv, mask, config=cfg, loss_denominator=8.0)
        assert float(half) == pytest.approx(-1.25)


def test_advantages_may_be_per_sequence():
    lp, lp_b = tokens_with_ratios(1.0, 1.0)
    per_seq, _ = policy_loss(lp, lp_b, torch.tensor([2.0], dtype=torch.float64), ones_like(lp), config=PPO)
    per_tok, _ = policy_loss(lp, lp_b, row(2, 2), ones_like(lp), config=PPO)
    assert float(per_seq) == float(per_tok) == -2.0


# ------------------------------------------------------------------------------ decoupled + caps


def _decoupled_case():
    # lp_b = -1. tokens: (w, u, A)
    # t1: w = 2,   u = 1.1, A = +1 -> 2 * max(-1.1, -1.1) = -2.2
    # t2: w = 6,   u = 1.0, A = +1 -> w > cap 5: masked (mask mode) / w -> 5 (clamp mode): -5
    # t3: w = 0.5, u = 1.5, A = +1 -> 0.5 * max(-1.5, -1.2) = -0.6 (clipped)
    # t4: w = 1,   u = 0.5, A = -1 -> 1 * max(0.5, 0.8) = 0.8 (clipped)
    lp_b = torch.full((1, 4), -1.0, dtype=torch.float64)
    prox = lp_b + torch.log(row(2, 6, 0.5, 1))
    lp = (prox + torch.log(row(1.1, 1.0, 1.5, 0.5))).requires_grad_(True)
    return lp, lp_b, prox, row(1, 1, 1, -1)


def test_decoupled_token_mask_cap_keeps_original_denominator():
    lp, lp_b, prox, adv = _decoupled_case()
    cfg = LossConfig(loss="decoupled", proximal="recompute")
    loss, stats = policy_loss(lp, lp_b, adv, ones_like(lp), config=cfg, prox_logprobs=prox)
    # (-2.2 + 0 - 0.6 + 0.8) / 4 (t2 masked, but still counted in the denominator) = -0.5
    assert float(loss) == pytest.approx(-0.5, rel=1e-12)
    assert stats["behav_filtered_fraction"] == pytest.approx(0.25)
    assert stats["kept_tokens"] == 3
    assert stats["clip_fraction"] == pytest.approx(0.5)  # t3 and t4
    assert stats["clip_fraction_high"] == pytest.approx(0.25)  # t3: u = 1.5 > 1.2 with A > 0
    assert stats["clip_fraction_low"] == pytest.approx(0.25)  # t4: u = 0.5 < 0.8 with A < 0
    assert stats["behav_weight_max"] == pytest.approx(2.0)
    assert stats["behav_weight_min"] == pytest.approx(0.5)
    assert stats["behav_weight_mean"] == pytest.approx(3.5 / 3)  # (2 + 0.5 + 1) / 3 kept tokens
    # importance weight (AReaL's): the trust-region ratio u = pi/pi_prox: 1.1, 1.0, 1.5, 0.5
    assert stats["importance_weight_max"] == pytest.approx(1.5)
    assert stats["importance_weight_min"] == pytest.approx(0.5)
    assert stats["importance_weight_mean"] == pytest.approx((1.1 + 1.0 + 1.5 + 0.5) / 4)
    # full ratio pi/pi_b = w * u: 2.2, 6, 0.75, 0.5
    assert stats["full_ratio_max"] == pytest.approx(6.0)
    assert stats["full_ratio_min"] == pytest.approx(0.5)
    assert stats["full_ratio_mean"] == pytest.approx((2.2 + 6 + 0.75 + 0.5) / 4)
    loss.backward()
    # t1 unclipped: d(w * -A u)/dlp = -A w u / 4 = -2.2 / 4 ; t2 masked ; t3, t4 clipped
    assert lp.grad.tolist()[0] == pytest.approx([-0.55, 0.0, 0.0, 0.0], rel=1e-12)


def test_decoupled_token_clamp_cap():
    lp, lp_b, prox, adv = _decoupled_case()
    cfg = LossConfig(loss="decoupled", proximal="recompute", behaviour_cap=BehaviourCapSpec(mode="clamp"))
    loss, stats = policy_loss(lp, lp_b, adv, ones_like(lp), config=cfg, prox_logprobs=prox)
    # t2 now weighted by min(6, 5) = 5: (-2.2 - 5 - 0.6 + 0.8) / 4 = -1.75
    assert float(loss) == pytest.approx(-1.75, rel=1e-12)
    assert stats["behav_filtered_fraction"] == pytest.approx(0.25)  # truncated tokens
    assert stats["kept_tokens"] == 4
    assert stats["behav_weight_max"] == pytest.approx(5.0)


def test_decoupled_without_cap_has_no_behaviour_weight():
    lp, lp_b, prox, adv = _decoupled_case()
    cfg = LossConfig(loss="decoupled", proximal="recompute", behaviour_cap=BehaviourCapSpec(limit=None))
    loss, stats = policy_loss(lp, lp_b, adv, ones_like(lp), config=cfg, prox_logprobs=prox)
    # w = 1: (-1.1 - 1.0 - 1.2 + 0.8) / 4 = -0.625
    assert float(loss) == pytest.approx(-0.625, rel=1e-12)
    assert stats["behav_filtered_fraction"] == 0.0


def _sequence_case():
    # u = 1, A = +1, lp_b = -1. row 0: w = (2, 8) -> geometric mean sqrt(16) = 4
    #                           row 1: w = (6, 6) -> geometric mean 6 > cap 5
    lp_b = torch.full((2, 2), -1.0, dtype=torch.float64)
    prox = lp_b + torch.log(torch.tensor([[2.0, 8.0], [6.0, 6.0]], dtype=torch.float64))
    lp = prox.clone().requires_grad_(True)
    return lp, lp_b, prox, torch.ones(2, 2, dtype=torch.float64)


def test_sequence_level_mask_cap():
    lp, lp_b, prox, adv = _sequence_case()
    cfg = LossConfig(loss="decoupled", proximal="recompute", behaviour_cap=BehaviourCapSpec(level="sequence"))
    loss, stats = policy_loss(lp, lp_b, adv, ones_like(lp), config=cfg, prox_logprobs=prox)
    # row 0 kept with weight 4 on both tokens: -4 - 4 ; row 1 dropped; / 4 tokens = -2
    assert float(loss) == pytest.approx(-2.0, rel=1e-12)
    assert stats["behav_filtered_fraction"] == pytest.approx(0.5)
    # token level for contrast: row 0 t1 (w=2) -> -2, t2 (w=8) masked; row 1 masked: -2 / 4
    tok, _ = policy_loss(lp, lp_b, adv, ones_like(lp), config=LossConfig(loss="decoupled", proximal="recompute"),
                         prox_logprobs=prox)
    assert float(tok) == pytest.approx(-0.5, rel=1e-12)


def test_sequence_level_clamp_cap():
    lp, lp_b, prox, adv = _sequence_case()
    cfg = LossConfig(loss="decoupled", proximal="recompute",
                     behaviour_cap=BehaviourCapSpec(level="sequence", mode="clamp"))
    loss, stats = policy_loss(lp, lp_b, adv, ones_like(lp), config=cfg, prox_logprobs=prox)
    # row 0: weight 4 -> -8 ; row 1: weight min(6, 5) = 5 -> -10 ; (-8 - 10) / 4 = -4.5
    assert float(loss) == pytest.approx(-4.5, rel=1e-12)
    assert stats["behav_filtered_fraction"] == pytest.approx(0.5)


def test_ppo_kind_ignores_cap_and_proximal():
    # kind "ppo": proximal = behaviour, w = 1, so even a 10x ratio is not "filtered", only clipped
    lp, lp_b = tokens_with_ratios(10.0)
    loss, stats = policy_loss(lp, lp_b, row(1), ones_like(lp), config=LossConfig(loss="ppo", proximal="recompute"))
    assert float(loss) == pytest.approx(-1.2)
    assert stats["behav_filtered_fraction"] == 0.0


# ------------------------------------------------------------------------------ objectives on u (decoupled)


def _stale(ws: list[list[float]], us: list[list[float]]):
    """(lp with grad, lp_b, lp_p) with behaviour weights `ws` and trust-region ratios `us`, lp_b = -1."""
    lp_b = torch.full((len(ws), len(ws[0])), -1.0, dtype=torch.float64)
    prox = lp_b + torch.log(torch.tensor(ws, dtype=torch.float64))
    lp = (prox + torch.log(torch.tensor(us, dtype=torch.float64))).requires_grad_(True)
    return lp, lp_b, prox


def _objective(name: str, **kw) -> LossConfig:
    return LossConfig(loss="decoupled", proximal="recompute", objective=name, clip_eps_high=0.28, **kw)


def test_gspo_decoupled_uses_the_sequence_ratio_of_u_and_weights_each_token_by_w():
    # row 0, A = +1: w = 2, 0.5 ; u = e^.05, e^.15 -> s = exp(mean log u) = e^.1 (inside the band)
    #   per token -A w s: -2 e^.1, -0.5 e^.1 ; gradient -A w s / 4 on each token (s, not its own u)
    # row 1, A = -1: w = 1, 3 ; u = e^-.3 twice -> s = 0.741 < 0.8: the clipped branch -A 0.8 = 0.8 wins
    lp, lp_b, prox = _stale([[2.0, 0.5], [1.0, 3.0]], [[E ** 0.05, E ** 0.15], [E ** -0.3, E ** -0.3]])
    adv = torch.tensor([1.0, -1.0], dtype=torch.float64)
    loss, stats = policy_loss(lp, lp_b, adv, ones_like(lp), config=_objective("gspo"), prox_logprobs=prox)
    assert float(loss) == pytest.approx((-2.5 * E ** 0.1 + 4 * 0.8) / 4, rel=1e-12)
    loss.backward()
    assert lp.grad.flatten().tolist() == pytest.approx([-2 * E ** 0.1 / 4, -0.5 * E ** 0.1 / 4, 0.0, 0.0], rel=1e-12)
    assert (stats["clip_fraction"], stats["clip_fraction_low"], stats["clip_fraction_high"]) == (0.5, 0.5, 0.0)


def test_cispo_decoupled_weights_log_pi_by_the_clipped_detached_u_times_w():
    # (w, u, A): (2, 1.5, +1) u clipped to 1.28 ; (0.5, 0.5, -1) u clipped to 0.8 ; (1, 1.1, +1) inside.
    # per token -w clip(u) A lp with lp = -1 + log(w u); gradient -w clip(u) A / 3: clipped tokens keep theirs
    lp, lp_b, prox = _stale([[2.0, 0.5, 1.0]], [[1.5, 0.5, 1.1]])
    adv = row(1.0, -1.0, 1.0)
    loss, stats = policy_loss(lp, lp_b, adv, ones_like(lp), config=_objective("cispo"), prox_logprobs=prox)
    coef = [-2 * 1.28, 0.5 * 0.8, -1.1]
    lps = [-1 + math.log(3.0), -1 + math.log(0.25), -1 + math.log(1.1)]
    assert float(loss) == pytest.approx(sum(c * v for c, v in zip(coef, lps)) / 3, rel=1e-12)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx([c / 3 for c in coef], rel=1e-12)
    assert stats["clip_fraction_low"] == pytest.approx(1 / 3) and stats["clip_fraction_high"] == pytest.approx(1 / 3)
    assert stats["clip_fraction"] == pytest.approx(2 / 3) and stats["dual_clip_fraction"] == 0.0


def test_sapo_decoupled_gates_u_softly_with_a_temperature_per_sign():
    # (w, u, A): (2, 1.5, +1) tau 1 ; (0.5, 0.5, -1) tau 1.05 ; (3, 1, +1) tau 1: at u = 1 the
    # gradient is the plain -A w. Gate f(u) = 4/tau sigmoid(tau (u - 1)), df/dlp = 4 s (1 - s) u.
    lp, lp_b, prox = _stale([[2.0, 0.5, 3.0]], [[1.5, 0.5, 1.0]])
    adv = row(1.0, -1.0, 1.0)
    sapo = LossConfig(loss="decoupled", proximal="recompute", objective="sapo")
    loss, stats = policy_loss(lp, lp_b, adv, ones_like(lp), config=sapo, prox_logprobs=prox)

    def sig(z: float) -> float:
        return 1 / (1 + math.exp(-z))

    cases = [(2.0, 1.5, 1.0, 1.0), (0.5, 0.5, -1.0, 1.05), (3.0, 1.0, 1.0, 1.0)]  # (w, u, A, tau)
    values = [-a * w * 4 / tau * sig(tau * (u - 1)) for w, u, a, tau in cases]
    grads = [-a * w * 4 * sig(tau * (u - 1)) * (1 - sig(tau * (u - 1))) * u / 3 for w, u, a, tau in cases]
    assert float(loss) == pytest.approx(sum(values) / 3, rel=1e-12)
    loss.backward()
    assert lp.grad.tolist()[0] == pytest.approx(grads, rel=1e-12)
    assert grads[2] == pytest.approx(-3.0 / 3)  # u = 1: -A w / n
    assert stats["clip_fraction"] == stats["clip_fraction_low"] == stats["clip_fraction_high"] == 0.0
    hot = LossConfig(loss="decoupled", proximal="recompute", objective="sapo", sapo=SapoSpec(tau_pos=4.0))
    lp2, _, _ = _stale([[2.0, 0.5, 3.0]], [[1.5, 0.5, 1.0]])
    loss2, _ = policy_loss(lp2, lp_b, adv, ones_like(lp2), config=hot, prox_logprobs=prox)
    loss2.backward()
    # a hotter positive gate damps the off-policy positive token more: 4 s (1 - s) u = 0.63 at tau 4, 1.41 at tau 1
    assert abs(float(lp2.grad[0, 0])) < abs(float(lp.grad[0, 0])) and float(lp2.grad[0, 1]) == float(lp.grad[0, 1])


FRESH_DATA_STABILISERS = {
    "recompute": LossConfig(proximal="recompute"),
    "m2po": LossConfig(m2=M2Spec(threshold=0.04)),
    "bapo": LossConfig(bapo=BapoSpec()),
    "vcpo": LossConfig(vcpo=VcpoSpec(ess_scaling=True)),
    "gspo": LossConfig(objective="gspo", clip_eps=3e-4, clip_eps_high=4e-4),
    "cispo": LossConfig(objective="cispo", clip_eps=0.99, clip_eps_high=0.28),
    "sapo": LossConfig(objective="sapo"),
}


@pytest.mark.parametrize("name", FRESH_DATA_STABILISERS)
def test_on_fresh_data_every_stabiliser_takes_the_default_step(name):
    """At staleness 0, before the step's first update, every ratio is 1: no clip binds, M2 is 0, the
    ESS is 1 and each objective's gradient is the policy gradient. Why the staleness sweep's runs at
    staleness 0 coincide (docs/benchmarks.md); a stabiliser that changed fresh-data steps would show here."""
    g = torch.Generator().manual_seed(0)
    lp_b = -3.0 * torch.rand(4, 6, generator=g, dtype=torch.float64)
    mask = torch.arange(6) < torch.tensor([[6], [3], [5], [1]])
    adv = torch.randn(4, generator=g, dtype=torch.float64)
    versions = torch.where(mask, 7, -1)

    def gradient(config: LossConfig) -> torch.Tensor:
        lp = lp_b.clone().requires_grad_(True)
        loss, stats = policy_loss(lp, lp_b, adv, mask, config=config, versions=versions, current_version=7,
                                  prox_logprobs=lp_b.clone())
        loss.backward()
        assert stats["clip_fraction"] == 0.0 and stats["m2_masked_fraction"] == 0.0
        return lp.grad

    default = gradient(LossConfig())
    assert default.abs().sum() > 0
    assert torch.allclose(gradient(FRESH_DATA_STABILISERS[name]), default, rtol=1e-12, atol=1e-15)


def test_ppo_clip_objective_is_the_default_and_unchanged():
    lp, lp_b, prox, adv = _decoupled_case()
    cfg = LossConfig(loss="decoupled", proximal="recompute")
    explicit = LossConfig(loss="decoupled", proximal="recompute", objective="ppo-clip")
    a, _ = policy_loss(lp, lp_b, adv, ones_like(lp), config=cfg, prox_logprobs=prox)
    b, _ = policy_loss(lp, lp_b, adv, ones_like(lp), config=explicit, prox_logprobs=prox)
    assert cfg == explicit and float(a) == float(b) == pytest.approx(-0.5, rel=1e-12)


# ------------------------------------------------------------------------------ loglinear (A-3PO)


@pytest.mark.parametrize(
    ("staleness", "on_policy", "expected"),
    [
        # lp_b = -2, lp = -1: lp_p = lp_b + alpha (lp - lp_b), alpha = 1 - 1/d
        (0, "behave", -2.0),  # d = 0: the behaviour policy (= the policy at the step's start)
        (0, "current", -1.0),  # d = 0, "current": the policy being trained (minibatches 1 only)
        (1, "current", -2.0),  # alpha = 0
        (2, "current", -1.5),  # alpha = 1/2
        (4, "current", -1.25),  # alpha = 3/4
        (4, "behave", -1.25),  # the rule only matters at d = 0
    ],
)
def test_loglinear_proximal_values(staleness, on_policy, expected):
    prox = loglinear_proximal(row(-2.0), row(-1.0), torch.tensor([[10 - staleness]]), 10, on_policy=on_policy)
    assert float(prox) == pytest.approx(expected, rel=1e-12)


def test_loglinear_proximal_default_is_the_behaviour_policy_at_d0():
    assert float(loglinear_proximal(row(-2.0), row(-1.0), torch.tensor([[10]]), 10)) == -2.0


def test_loglinear_proximal_ignores_ungenerated_positions():
    prox = loglinear_proximal(row(-2.0, -2.0), row(-1.0, -1.0), torch.tensor([[-1, 8]]), 10)
    assert prox.tolist()[0] == pytest.approx([-2.0, -1.5])


@pytest.mark.parametrize(
    ("staleness", "on_policy", "expected"),
    [
        # one token, A = +1, lp - lp_b = 1 (pi/pi_b = e), eps = 0.2, cap 5
        (0, "behave", -1.2),  # w = 1, u = e -> max(-e, -1.2) = -1.2 (clipped, like d = 1)
        (0, "current", -E),  # w = e, u = 1 -> -e (not clipped: exact only before the step's 1st update)
        (1, "current", -1.2),  # same as behave: lp_p = lp_b
        (2, "current", -1.2 * math.exp(0.5)),  # lp_p = lp_b + 0.5: w = u = e^0.5; u clipped at 1.2
        (4, "current", -1.2 * math.exp(0.75)),  # w = e^0.75, u = e^0.25 = 1.284 -> clipped 1.2
    ],
)
def test_loglinear_loss_by_staleness(staleness, on_policy, expected):
    lp_b = row(-2.0)
    lp = row(-1.0).requires_grad_(True)
    cfg = LossConfig(loss="decoupled", proximal="loglinear", loglinear_on_policy=on_policy)
    loss, stats = policy_loss(lp, lp_b, row(1.0), ones_like(lp), config=cfg,
                              versions=torch.tensor([[7 - staleness]]), current_version=7)
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert stats["staleness_max"] == staleness
    assert stats["proximal_s"] >= 0.0


def test_partial_rollout_tokens_with_different_versions():
    # One response generated across a weight update: tokens 1-2 by version 3 with lp - lp_b = 1,
    # tokens 3-4 by version 5 (= current) with lp - lp_b = 0.1; A = +1.
    # d = 2: -1.2 e^0.5 = -1.978845 each (u = e^0.5 clipped) ; d = 0 (behaviour proximal): w = 1,
    # u = e^0.1 = 1.105 inside the band -> -e^0.1 each ; mean = (2 * -1.978845 + 2 * -1.105171) / 4
    lp_b = torch.full((1, 4), -2.0, dtype=torch.float64)
    lp = (lp_b + row(1.0, 1.0, 0.1, 0.1)).requires_grad_(True)
    cfg = LossConfig(loss="decoupled", proximal="loglinear")
    loss, stats = policy_loss(lp, lp_b, row(1, 1, 1, 1), ones_like(lp), config=cfg,
                              versions=torch.tensor([[3, 3, 5, 5]]), current_version=5)
    expected = (2 * -1.2 * math.exp(0.5) + 2 * -math.exp(0.1)) / 4
    assert float(loss) == pytest.approx(expected, rel=1e-12)
    assert stats["staleness_mean"] == 1.0 and stats["staleness_max"] == 2.0
    loss.backward()
    # d = 2 tokens are clipped (no grad); d = 0 tokens: -A * pi/pi_b / 4 = -e^0.1 / 4
    assert lp.grad.tolist()[0] == pytest.approx([0.0, 0.0, -math.exp(0.1) / 4, -math.exp(0.1) / 4], rel=1e-12)


def test_loglinear_unclipped_gradient_is_the_full_ratio():
    # Gaps small enough that u = exp((lp - lp_b) / d) stays inside [0.8, 1.2] for every token,
    # while w carries the rest: the gradient of -A w u / N is -A (pi / pi_b) / N exactly.
    gaps = torch.tensor([[0.4, -0.3, 0.2, 0.05, -0.6, 0.0]], dtype=torch.float64)
    staleness = torch.tensor([[4, 2, 3, 1, 8, 6]])
    adv = row(1.0, -2.0, 0.5, -1.0, 3.0, 1.0)
    lp_b = torch.full((1, 6), -1.5, dtype=torch.float64)
    lp = (lp_b + gaps).requires_grad_(True)
    cfg = LossConfig(loss="decoupled", proximal="loglinear")
    loss, stats = policy_loss(lp, lp_b, adv, ones_like(lp), config=cfg,
                              versions=20 - staleness, current_version=20)
    assert stats["clip_fraction"] == 0.0
    loss.backward()
    assert torch.allclose(lp.grad, -adv * gaps.exp() / 6, rtol=1e-12, atol=0)


# ------------------------------------------------------------------------------ M2PO


def _m2_case():
    # log r = 0.3, -0.6, 0.1, 0.0 with A = +1, +1, -1, +1 ; (log r)^2 = .09, .36, .01, 0
    lp, lp_b = tokens_with_ratios(*(math.exp(x) for x in (0.3, -0.6, 0.1, 0.0)))
    return lp, lp_b, row(1, 1, -1, 1)


def test_m2po_scope_all():
    # M2 = (.09 + .36 + .01 + 0) / 4 = .115 > .04 -> drop .36 (t2): (.09 + .01 + 0) / 3 = .0333 stop
    # loss = -(M r A) token-mean over the ORIGINAL 4 tokens, no eps-clip (r = e^.3 = 1.35 is kept):
    #   t1: -e^.3 = -1.349859 ; t3: +e^.1 = 1.105171 ; t4: -1  -> -1.244688 / 4 = -0.311172
    lp, lp_b, adv = _m2_case()
    cfg = LossConfig(loss="ppo", m2=M2Spec(threshold=0.04, scope="all"))
    loss, stats = policy_loss(lp, lp_b, adv, ones_like(lp), config=cfg)
    assert float(loss) == pytest.approx((-math.exp(0.3) + math.exp(0.1) - 1) / 4, rel=1e-12)
    assert stats["m2_before"] == pytest.approx(0.115)
    assert stats["m2_after"] == pytest.approx(0.1 / 3)
    assert stats["m2_masked_fraction"] == pytest.approx(0.25)
    assert stats["clip_fraction"] == 0.0
    loss.backward()
    # unclipped gradient -A r / 4 on kept tokens, 0 on the dropped one
    assert lp.grad.tolist()[0] == pytest.approx(
        [-math.exp(0.3) / 4, 0.0, math.exp(0.1) / 4, -0.25], rel=1e-12)


def test_m2po_scope_harmful():
    # harmful = (A > 0 and r > 1) or (A < 0 and r < 1): only t1 (A = +1, r = e^.3)
    # M2 = .09 > .04 -> drop t1, nothing left: M2 = 0
    # loss: t2: -e^-.6 = -0.548812 ; t3: +e^.1 ; t4: -1 -> -0.443641 / 4 = -0.110910
    lp, lp_b, adv = _m2_case()
    cfg = LossConfig(loss="ppo", m2=M2Spec(threshold=0.04, scope="harmful"))
    loss, stats = policy_loss(lp, lp_b, adv, ones_like(lp), config=cfg)
    assert float(loss) == pytest.approx((-math.exp(-0.6) + math.exp(0.1) - 1) / 4, rel=1e-12)
    assert stats["m2_before"] == pytest.approx(0.09)
    assert stats["m2_after"] == 0.0
    assert stats["m2_masked_fraction"] == pytest.approx(0.25)


def test_m2po_below_threshold_masks_nothing():
    lp, lp_b = tokens_with_ratios(1.1, 0.95)
    loss, stats = policy_loss(lp, lp_b, row(1, 1), ones_like(lp),
                              config=LossConfig(loss="ppo", m2=M2Spec(threshold=0.04)))
    # (log 1.1)^2 = .009084, (log .95)^2 = .002631 -> M2 = .005857 <= .04 ; loss = -(1.1 + .95) / 2
    assert float(loss) == pytest.approx(-1.025, rel=1e-12)
    assert stats["m2_before"] == stats["m2_after"] == pytest.approx((math.log(1.1) ** 2 + math.log(0.95) ** 2) / 2)
    assert stats["m2_masked_fraction"] == 0.0


def test_m2po_mask_drops_several_largest():
    # sq = 1, .5, .1, .01 ; tau = .04: 1.61/4 = .4025 -> .61/3 = .2033 -> .11/2 = .055 -> .01/1 = .01
    log_r = torch.tensor([[1.0, -math.sqrt(0.5), math.sqrt(0.1), 0.1]], dtype=torch.float64)
    dropped, before, after = m2po_mask(log_r, torch.ones(1, 4, dtype=torch.bool), 0.04)
    assert dropped.tolist() == [[True, True, True, False]]
    assert before == pytest.approx(0.4025) and after == pytest.approx(0.01)


def test_m2po_with_decoupled_applies_behaviour_weight():
    # decoupled + recompute: u = exp(lp - lp_p) = e^.1, w = exp(lp_p - lp_b) = e^.05; M2 is measured
    # on the full ratio: (log r)^2 = .15^2 = .0225 <= .04, kept ; loss = -(w u A) = -e^.15
    lp_b = row(-2.0)
    prox = lp_b + 0.05
    lp = (prox + 0.1).requires_grad_(True)
    cfg = LossConfig(loss="decoupled", proximal="recompute", m2=M2Spec(threshold=0.04))
    loss, stats = policy_loss(lp, lp_b, row(1.0), ones_like(lp), config=cfg, prox_logprobs=prox)
    assert float(loss) == pytest.approx(-math.exp(0.15), rel=1e-12)
    assert stats["m2_before"] == pytest.approx(0.15 ** 2, rel=1e-9)
    # w = 2 instead: log r = log 2 + .1, (log r)^2 = .629 > .04 -> masked, although (log u)^2 = .01
    far = lp_b + math.log(2.0)
    loss, stats = policy_loss((far + 0.1).requires_grad_(True), lp_b, row(1.0), ones_like(lp), config=cfg,
                              prox_logprobs=far)
    assert float(loss) == 0.0 and stats["m2_masked_fraction"] == 1.0


# ------------------------------------------------------------------------------ gradients


def test_gradient_flows_only_through_logprobs():
    torch.manual_seed(0)
    lp = (torch.randn(3, 5, dtype=torch.float64) - 2).requires_grad_(True)
    lp_b = (lp.detach() + 0.1 * torch.randn(3, 5, dtype=torch.float64)).requires_grad_(True)
    prox = (lp.detach() + 0.1 * torch.randn(3, 5, dtype=torch.float64)).requires_grad_(True)
    adv = torch.randn(3, 5, dtype=torch.float64).requires_grad_(True)
    mask = torch.rand(3, 5) > 0.3
    for cfg, kw in [
        (LossConfig(loss="decoupled", proximal="recompute"), dict(prox_logprobs=prox)),
        (LossConfig(loss="decoupled", proximal="loglinear"),
         dict(versions=torch.randint(0, 4, (3, 5)), current_version=4)),
        (LossConfig(loss="ppo", m2=M2Spec(threshold=0.001)), {}),
    ]:
        loss, _ = policy_loss(lp, lp_b, adv, mask, config=cfg, **kw)
        grads = torch.autograd.grad(loss, [lp, lp_b, prox, adv], allow_unused=True)
        assert grads[0] is not None and bool(torch.isfinite(grads[0]).all())
        assert grads[1] is None and grads[2] is None and grads[3] is None
        assert bool((grads[0][~mask] == 0).all())  # masked positions get no gradient


def test_gradcheck_decoupled_recompute():
    # Points away from the clip kinks (|u - 1| well inside or outside eps) so the loss is smooth.
    lp_b = torch.tensor([[-1.0, -2.0, -0.5], [-1.5, -3.0, -0.7]], dtype=torch.float64)
    prox = lp_b + torch.tensor([[0.2, -0.1, 0.3], [0.0, 0.4, -0.2]], dtype=torch.float64)
    lp = (prox + torch.tensor([[0.05, -0.5, 0.6], [0.1, -0.02, 0.0]], dtype=torch.float64)).requires_grad_(True)
    adv = torch.tensor([[1.0, -1.0, 2.0], [-0.5, 0.7, 1.5]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    cfg = LossConfig(loss="decoupled", proximal="recompute", dual_clip=3.0)
    assert torch.autograd.gradcheck(
        lambda x: policy_loss(x, lp_b, adv, mask, config=cfg, prox_logprobs=prox)[0], (lp,))


# ------------------------------------------------------------------------------ numerical safety


def test_fifty_nat_gaps_stay_finite():
    # pi/pi_b = e^50 and e^-50, A = -1 without dual clip: the unclipped branch would be ~5e21 x A;
    # log-ratios are clamped at +-20 nats, so loss and gradient stay finite in float32 too.
    for dtype in (torch.float32, torch.float64):
        lp_b = torch.tensor([[-60.0, -1.0, -5.0]], dtype=dtype)
        lp = torch.tensor([[-10.0, -51.0, -5.0]], dtype=dtype, requires_grad=True)
        adv = torch.tensor([[-1.0, 1.0, 1.0]], dtype=dtype)
        for cfg, kw in [
            (PPO, {}),
            (LossConfig(loss="decoupled", proximal="loglinear", behaviour_cap=BehaviourCapSpec(limit=None)),
             dict(versions=torch.tensor([[0, 1, 2]]), current_version=2)),
            (LossConfig(loss="decoupled", proximal="loglinear"),
             dict(versions=torch.tensor([[0, 1, 2]]), current_version=2)),
            (LossConfig(loss="ppo", m2=M2Spec(threshold=0.04)), {}),
        ]:
            loss, stats = policy_loss(lp, lp_b, adv, torch.ones(1, 3, dtype=torch.bool), config=cfg, **kw)
            (grad,) = torch.autograd.grad(loss, lp)
            assert math.isfinite(float(loss)) and bool(torch.isfinite(grad).all())
            assert all(math.isfinite(v) for v in stats.values())
        # t1: max(e^20, 1.2) (clamped from e^50) ; t2: max(-e^-20, -0.8) = -e^-20 ; t3: r = 1 -> -1
        expected = (math.exp(LOG_RATIO_LIMIT) - math.exp(-LOG_RATIO_LIMIT) - 1.0) / 3
        loss, _ = policy_loss(lp, lp_b, adv, torch.ones(1, 3, dtype=torch.bool), config=PPO)
        assert float(loss) == pytest.approx(expected, rel=1e-5)


def test_garbage_outside_mask_and_fully_masked_rows():
    lp = torch.tensor([[-1.0, float("nan")], [float("-inf"), float("inf")]], requires_grad=True)
    lp_b = torch.tensor([[-1.2, float("nan")], [float("nan"), -float("inf")]])
    adv = torch.tensor([[1.0, float("nan")], [float("nan"), 2.0]])
    mask = torch.tensor([[True, False], [False, False]])
    versions = torch.tensor([[2, -1], [-1, -1]])
    for cfg in [PPO, LossConfig(), LossConfig(aggregation="seq-mean-token-mean"),
                LossConfig(aggregation="seq-mean-token-sum-norm"), LossConfig(m2=M2Spec(threshold=0.01))]:
        loss, stats = policy_loss(lp, lp_b, adv, mask, config=cfg, versions=versions, current_version=3)
        (grad,) = torch.autograd.grad(loss, lp)
        assert math.isfinite(float(loss)) and bool(torch.isfinite(grad).all())
        assert all(math.isfinite(v) for v in stats.values()), stats
        assert grad[1].tolist() == [0.0, 0.0] and float(grad[0, 1]) == 0.0


@pytest.mark.parametrize("shape", [(0, 4), (3, 0), (2, 3)])
def test_empty_batches(shape):
    lp = torch.zeros(shape, requires_grad=True)
    mask = torch.zeros(shape, dtype=torch.bool)  # (2, 3): fully masked
    for cfg in [PPO, LossConfig(), LossConfig(aggregation="seq-mean-token-mean"),
                LossConfig(aggregation="seq-mean-token-sum-norm"), LossConfig(m2=M2Spec(threshold=0.04))]:
        loss, stats = policy_loss(lp, torch.zeros(shape), torch.zeros(shape), mask, config=cfg,
                                  versions=torch.full(shape, -1), current_version=0)
        assert float(loss) == 0.0
        loss.backward()  # still part of the graph, so a trainer can always call backward
        assert set(STAT_KEYS) <= set(stats) and all(v == 0.0 for k, v in stats.items() if k != "proximal_s")


# ------------------------------------------------------------------------------ errors


def _valid():
    return dict(logprobs=torch.zeros(2, 3), behav_logprobs=torch.zeros(2, 3),
                advantages=torch.zeros(2, 3), mask=torch.ones(2, 3, dtype=torch.bool))


@pytest.mark.parametrize(
    ("change", "config", "message"),
    [
        (dict(behav_logprobs=torch.zeros(2, 4)), PPO, "behav_logprobs has shape"),
        (dict(advantages=torch.zeros(3)), PPO, "advantages has shape"),
        (dict(mask=torch.ones(3, 2)), PPO, "mask has shape"),
        (dict(logprobs=torch.zeros(6)), PPO, r"logprobs must be \[B, T\]"),
        (dict(logprobs=torch.zeros(2, 3, dtype=torch.int64)), PPO, "logprobs must be a floating"),
        (dict(behav_logprobs=torch.zeros(2, 3, dtype=torch.int64)), PPO, "behav_logprobs must be a floating"),
        (dict(behav_logprobs=[[0.0] * 3] * 2), PPO, "behav_logprobs must be a torch.Tensor"),
        (dict(behav_logprobs=torch.zeros(2, 3, device="meta")), PPO, "behav_logprobs is on meta"),
        (dict(versions=torch.zeros(2, 3)), LossConfig(), "versions must be an integer"),
        (dict(versions=torch.zeros(2, 3, dtype=torch.int64)), LossConfig(), "current_version"),
        (dict(versions=torch.full((2, 3), -1), current_version=3), LossConfig(), "versions is -1"),
        (dict(versions=torch.zeros(2, 3, dtype=torch.int64), current_version=2.5), LossConfig(),
         "current_version must be an int"),
        ({}, LossConfig(proximal="recompute"), "prox_logprobs is required"),
        (dict(prox_logprobs=torch.zeros(2, 2)), LossConfig(proximal="recompute"), "prox_logprobs has shape"),
        (dict(loss_denominator=-1.0), PPO, "loss_denominator"),
        ({}, "ppo", "config must be a LossConfig"),
    ],
)
def test_clear_errors_name_the_argument(change, config, message):
    kwargs = {**_valid(), **change}
    with pytest.raises(ValueError, match=message):
        policy_loss(**kwargs, config=config)


def test_dtypes_are_promoted_not_rejected():
    # bfloat16 current log-probs against float32 behaviour log-probs: computed in float32
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.bfloat16, requires_grad=True)
    loss, _ = policy_loss(lp, torch.tensor([[-1.0, -2.0]]), torch.ones(1, 2), torch.ones(1, 2),
                          config=PPO)
    assert loss.dtype == torch.float32 and float(loss) == -1.0
    loss.backward()
    assert lp.grad.dtype == torch.bfloat16


# ------------------------------------------------------------------------------ config


def test_loss_config_defaults():
    cfg = LossConfig()
    assert cfg.to_dict() == {
        "loss": "decoupled", "proximal": "loglinear", "loglinear_on_policy": "behave",
        "clip_eps": 0.2, "clip_eps_high": None, "dual_clip": None,
        "behaviour_cap": {"limit": 5.0, "mode": "mask", "level": "token"}, "m2": None,
        "aggregation": "token-mean", "max_new_tokens": 256, "objective": "ppo-clip",
        "sapo": {"tauPos": 1.0, "tauNeg": 1.05}, "bapo": None,
        "vcpo": {"essScaling": False, "baseEssRatio": 1.0, "scaling": "sqrt", "baseline": False},
    }
    assert cfg.eps_high == 0.2 and LossConfig(clip_eps_high=0.28).eps_high == 0.28


@pytest.mark.parametrize(
    "kwargs",
    [dict(loss="grpo"), dict(proximal="forward"), dict(loglinear_on_policy="both"), dict(clip_eps=0.0),
     dict(clip_eps=1.5), dict(clip_eps_high=-0.1), dict(dual_clip=1.0), dict(behaviour_cap={"limit": 2.0}),
     dict(aggregation="sum"), dict(max_new_tokens=0), dict(max_new_tokens=8.0), dict(objective="grpo"),
     dict(objective="gspo", m2=M2Spec(threshold=0.04)), dict(objective="sapo", dual_clip=3.0),
     dict(objective="cispo", bapo=BapoSpec()), dict(m2=M2Spec(threshold=0.04), bapo=BapoSpec())],
)
def test_loss_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError, match="LossConfig"):
        LossConfig(**kwargs)


@pytest.mark.parametrize(
    "build",
    [lambda: BehaviourCapSpec(limit=0.5), lambda: BehaviourCapSpec(limit=1.0),
     lambda: BehaviourCapSpec(mode="drop"), lambda: BehaviourCapSpec(level="batch"), lambda: M2Spec(threshold=0.0),
     lambda: M2Spec(threshold=0.04, scope="some"), lambda: SapoSpec(tau_pos=0.0), lambda: SapoSpec(tau_neg=-1.0)],
)
def test_family_settings_reject_bad_values(build):
    # The loss takes the spec's own family models, so their bounds are the job's (pydantic's errors).
    with pytest.raises(ValueError):
        build()


def test_loss_config_from_spec():
    spec = AlgorithmSpec(
        loss="decoupled", proximal="recompute", loglinear_on_policy="behave", clip_eps=0.1,
        clip_eps_high=0.3, dual_clip=3.0, behaviour_cap=BehaviourCapSpec(limit=2.0, mode="clamp", level="sequence"),
        m2=M2Spec(threshold=0.04, scope="harmful"), aggregation="seq-mean-token-sum-norm", max_new_tokens=1024,
    )
    assert LossConfig.from_spec(spec) == LossConfig(
        loss="decoupled", proximal="recompute", loglinear_on_policy="behave", clip_eps=0.1, clip_eps_high=0.3,
        dual_clip=3.0, aggregation="seq-mean-token-sum-norm", max_new_tokens=1024,
        behaviour_cap=BehaviourCapSpec(limit=2.0, mode="clamp", level="sequence"),
        m2=M2Spec(threshold=0.04, scope="harmful"))
    defaults = LossConfig.from_spec(AlgorithmSpec())
    assert defaults == LossConfig()  # the job's defaults and the loss defaults agree
    ppo = LossConfig.from_spec(AlgorithmSpec(loss="ppo", proximal="recompute",
                                             behaviour_cap=BehaviourCapSpec(limit=None)))
    assert ppo.loss == "ppo" and ppo.behaviour_cap.limit is None
    with pytest.raises(ValueError, match="not an AlgorithmSpec"):
        LossConfig.from_spec(object())


@pytest.mark.parametrize(
    ("field", "value", "valid"),
    [
        ("clip_eps", 0.0, False), ("clip_eps", 0.5, True), ("clip_eps", 1.0, False),
        ("clip_eps_high", 0.0, False), ("clip_eps_high", 0.3, True),
        ("dual_clip", 1.0, False), ("dual_clip", 1.01, True),
        ("max_new_tokens", 0, False), ("max_new_tokens", 1, True),
        ("objective", "gspo", True), ("objective", "dapo", False),
    ],
)
def test_loss_config_bounds_agree_with_the_spec(field, value, valid):
    # LossConfig restates the spec's top-level bounds under the same names: a value is valid in both
    # or in neither (the family settings are the spec's own models).
    def accepts(build) -> bool:
        try:
            build()
        except ValueError:
            return False
        return True

    assert accepts(lambda: AlgorithmSpec(**{field: value})) is valid
    assert accepts(lambda: LossConfig(**{field: value})) is valid


# ------------------------------------------------------------------------------ stages of policy_loss
# Each stage on a tiny example computed by hand (policy_loss above exercises them together).


def test_stage_prepare_inputs_zeroes_garbage_and_promotes():
    lp = torch.tensor([[-1.0, float("nan")]], dtype=torch.bfloat16)
    x = prepare_inputs(lp, torch.tensor([[-2.0, float("-inf")]]), torch.tensor([3.0]), torch.tensor([[1, 0]]))
    assert x.lp.dtype == x.lp_b.dtype == x.adv.dtype == torch.float32  # promote(bf16, f32)
    assert x.mask.dtype == torch.bool and x.mask.tolist() == [[True, False]]
    assert x.lp.tolist() == [[-1.0, 0.0]] and x.lp_b.tolist() == [[-2.0, 0.0]]
    assert x.adv.tolist() == [[3.0, 0.0]]  # [B] advantages broadcast per sequence, then masked


def test_stage_proximal_logprobs():
    # lp = -1, lp_b = -2, staleness 2 (alpha = 1/2) -> lp_p = -1.5; a second, masked-out token
    x = prepare_inputs(row(-1.0, -1.0), row(-2.0, -2.0), row(1.0, 1.0), torch.tensor([[True, False]]))
    ppo = proximal_logprobs(x, LossConfig(loss="ppo"))
    assert ppo.logprobs is x.lp_b and ppo.seconds == 0.0  # coupled: the behaviour policy
    rec = proximal_logprobs(x, LossConfig(proximal="recompute"), prox_logprobs=row(-1.25, float("nan")))
    assert rec.logprobs.tolist() == [[-1.25, 0.0]] and rec.seconds == 0.0  # passed through, masked
    ll = proximal_logprobs(x, LossConfig(), versions=torch.tensor([[3, -1]]), current_version=5)
    assert ll.logprobs.tolist() == [[-1.5, 0.0]] and ll.seconds >= 0.0  # masked-out: sanitised lp_b
    with pytest.raises(ValueError, match="prox_logprobs is required"):
        proximal_logprobs(x, LossConfig(proximal="recompute"))


def test_stage_compute_ratios():
    # lp = -1, lp_p = -1.5, lp_b = -2: log u = 0.5, log w = 0.5 ; a 30-nat gap saturates u at e^20
    lp = row(-1.0, 10.0).requires_grad_(True)
    r = compute_ratios(lp, row(-1.5, -20.0), row(-2.0, -20.0))
    assert r.log_u.tolist() == [[0.5, 30.0]] and r.log_w.tolist() == [[0.5, 0.0]]
    assert r.log_r.tolist() == [[1.0, 30.0]] and not r.log_r.requires_grad  # the full ratio, log u + log w
    assert r.u.tolist()[0] == pytest.approx([math.exp(0.5), math.exp(LOG_RATIO_LIMIT)], rel=1e-15)
    assert r.u.requires_grad and not r.log_w.requires_grad
    (grad,) = torch.autograd.grad(r.u.sum(), lp)
    assert grad.tolist()[0] == pytest.approx([math.exp(0.5), 0.0])  # no gradient past the clamp


def test_stage_cap_behaviour_weight():
    # w = 2, 6, 0.5 with cap 5 ; the second row holds w = (2, 8): geometric mean 4
    log_w = torch.log(torch.tensor([[2.0, 6.0, 0.5], [2.0, 8.0, 1.0]], dtype=torch.float64))
    mask = torch.tensor([[True, True, True], [True, True, False]])
    masked = cap_behaviour_weight(log_w, mask, LossConfig())
    assert masked.keep.tolist() == [[True, False, True], [True, False, False]]
    assert masked.capped.tolist() == [[False, True, False], [False, True, False]]
    assert masked.w.tolist()[0] == pytest.approx([2.0, 0.0, 0.5])
    clamped = cap_behaviour_weight(log_w, mask, LossConfig(behaviour_cap=BehaviourCapSpec(mode="clamp")))
    assert clamped.keep.tolist() == mask.tolist() and clamped.capped.tolist() == masked.capped.tolist()
    assert clamped.w.tolist()[0] == pytest.approx([2.0, 5.0, 0.5])
    seq = cap_behaviour_weight(log_w, mask, LossConfig(behaviour_cap=BehaviourCapSpec(level="sequence", mode="clamp")))
    # row 0: (2 * 6 * 0.5)^(1/3) = 6^(1/3) < 5 ; row 1: sqrt(2 * 8) = 4 on its 2 tokens
    assert seq.w.tolist()[0] == pytest.approx([6 ** (1 / 3)] * 3) and seq.capped.sum() == 0
    assert seq.w.tolist()[1] == pytest.approx([4.0, 4.0, 0.0])
    for cfg in (LossConfig(loss="ppo"), LossConfig(behaviour_cap=BehaviourCapSpec(limit=None))):
        none = cap_behaviour_weight(log_w, mask, cfg)
        assert none.w.tolist() == [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]] and not none.capped.any()


def test_stage_clipped_surrogate():
    # eps 0.2, dual clip c = 3. (u, A): (1.5, +1) -> max(-1.5, -1.2) = -1.2 clipped ;
    # (1.1, +1) -> -1.1 tie ; (0.5, -1) -> max(0.5, 0.8) = 0.8 clipped ; (5, -1) -> min(5, 3) = 3 dual
    u, adv = row(1.5, 1.1, 0.5, 5.0), row(1.0, 1.0, -1.0, -1.0)
    keep = torch.tensor([[True, True, True, True]])
    s = clipped_surrogate(adv, u, keep, LossConfig(dual_clip=3.0))
    assert s.per_token.tolist()[0] == pytest.approx([-1.2, -1.1, 0.8, 3.0])
    assert s.clipped.tolist() == [[True, False, True, False]]
    assert s.clipped_low.tolist() == [[False, False, True, False]]  # u = 0.5 < 0.8 with A < 0
    assert s.clipped_high.tolist() == [[True, False, False, False]]  # u = 1.5 > 1.2 with A > 0
    assert s.dual_clipped.tolist() == [[False, False, False, True]]
    dropped = clipped_surrogate(adv, u, torch.tensor([[False, True, True, True]]), LossConfig())
    assert dropped.clipped.tolist() == [[False, False, True, False]]  # only kept tokens count
    m2 = clipped_surrogate(adv, u, keep, LossConfig(dual_clip=3.0, m2=M2Spec(threshold=0.04)))
    assert m2.per_token.tolist()[0] == pytest.approx([-1.5, -1.1, 0.5, 5.0])  # -A u, no clip at all
    assert not m2.clipped.any() and not m2.dual_clipped.any()


def test_stage_m2po_trust_region():
    # log r (full ratio pi/pi_b) = .3, -.6, .1, 0 ; A = +1, +1, -1, +1 (same as _m2_case)
    log_r, adv = row(0.3, -0.6, 0.1, 0.0), row(1.0, 1.0, -1.0, 1.0)
    keep = torch.ones(1, 4, dtype=torch.bool)
    every = m2po_trust_region(log_r, adv, keep, LossConfig(m2=M2Spec(threshold=0.04)))
    assert every.dropped.tolist() == [[False, True, False, False]]
    assert every.before == pytest.approx(0.115) and every.after == pytest.approx(0.1 / 3)
    harmful = m2po_trust_region(log_r, adv, keep, LossConfig(m2=M2Spec(threshold=0.04, scope="harmful")))
    assert harmful.dropped.tolist() == [[True, False, False, False]]  # only t1: A > 0 and r > 1
    assert harmful.before == pytest.approx(0.09) and harmful.after == 0.0
    off = m2po_trust_region(log_r, adv, keep, LossConfig())
    assert not off.dropped.any() and off.before == off.after == 0.0


def test_stage_aggregate():
    # per-token losses -1 -2 -3 | -4 | (empty row), T = 5
    per_token = torch.tensor([[-1.0, -2, -3, 0, 0], [-4, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [0, 0, 0, 0, 0]], dtype=torch.bool)
    assert float(aggregate(per_token, mask, "token-mean")) == -2.5  # -10 / 4 tokens
    assert float(aggregate(per_token, mask, "seq-mean-token-mean")) == -3.0  # mean(-2, -4)
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm", norm_length=5)) == -10 / 15  # 3 rows x 5
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm")) == -10 / (3 * 256)  # default length
    assert float(aggregate(per_token, mask, "token-mean", 8.0)) == -1.25
    assert float(aggregate(per_token, mask, "seq-mean-token-sum-norm", 20.0)) == -0.5
    lp = per_token.clone().requires_grad_(True)
    zero = aggregate(lp, mask, "token-mean", 0.0)
    assert float(zero) == 0.0 and zero.requires_grad  # an explicit 0 normaliser: 0, still in the graph


def test_stage_loss_metrics():
    # 4 masked tokens of 5: pi/pi_b = r = 2, 0.5, 1, 1.5 ; w before the cap = 2, 6, 0.8, 1, so
    # u = r / w = 1, 1/12, 1.25, 1.5. Token 2 capped (w = 6 > 5), token 4 dropped by M2PO: kept
    # tokens 1 and 3 with w = 2 and 0.8. Token 3 clipped. Staleness 0, 2, 3, 1.
    lp_b = row(-2.0, -2.0, -2.0, -2.0, -2.0)
    x = PolicyInputs(lp=lp_b + torch.log(row(2.0, 0.5, 1.0, 1.5, 1.0)), lp_b=lp_b, adv=row(1.0, 1.0, 1.0, 1.0, 0.0),
                     mask=torch.tensor([[True, True, True, True, False]]))
    ratios = compute_ratios(x.lp, lp_b + torch.log(row(2.0, 6.0, 0.8, 1.0, 1.0)), lp_b)
    no = torch.zeros(1, 5, dtype=torch.bool)
    weight = BehaviourWeight(w=row(2.0, 0.0, 0.8, 1.0, 0.0), keep=torch.tensor([[True, False, True, True, False]]),
                             capped=torch.tensor([[False, True, False, False, False]]))
    terms = LossTerms(
        loss=torch.tensor(-0.75, dtype=torch.float64), keep=torch.tensor([[True, False, True, False, False]]),
        ratios=ratios, weight=weight,
        surrogate=Surrogate(per_token=row(0, 0, 0, 0, 0), clipped=torch.tensor([[0, 0, 1, 0, 0]]) > 0,
                            dual_clipped=no, clipped_low=no, clipped_high=torch.tensor([[0, 0, 1, 0, 0]]) > 0),
        m2=M2Mask(dropped=torch.tensor([[False, False, False, True, False]]), before=0.5, after=0.25),
        proximal_s=0.125)
    stats = loss_metrics(x, terms, torch.tensor([[5, 3, 2, 4, -1]]), 5)
    assert set(stats) == set(STAT_KEYS)
    k3 = [(rho - 1) - math.log(rho) for rho in (1 / 2.0, 1 / 0.5, 1 / 1.0, 1 / 1.5)]  # rho = pi_b / pi
    expected = {
        "loss": -0.75, "tokens": 4.0, "kept_tokens": 2.0, "clip_fraction": 1 / 4, "clip_fraction_low": 0.0,
        "clip_fraction_high": 1 / 4, "dual_clip_fraction": 0.0,
        "behav_filtered_fraction": 1 / 4,
        "importance_weight_max": 1.5, "importance_weight_min": 1 / 12,
        "importance_weight_mean": (1 + 1 / 12 + 1.25 + 1.5) / 4,
        "full_ratio_max": 2.0, "full_ratio_min": 0.5, "full_ratio_mean": 5.0 / 4,
        "behav_weight_max": 2.0, "behav_weight_min": 0.8, "behav_weight_mean": 1.4,
        "behav_weight_sq_mean": (4 + 0.64) / 2, "behav_ess": 2.8 ** 2 / (2 * 4.64), "behav_kl": sum(k3) / 4,
        "staleness_mean": 6 / 4, "staleness_max": 3.0, "m2_before": 0.5, "m2_after": 0.25,
        "m2_masked_fraction": 1 / 4, "proximal_s": 0.125,
    }
    assert stats == pytest.approx(expected, rel=1e-12)
    without_versions = loss_metrics(x, terms, None, None)
    assert without_versions["staleness_mean"] == without_versions["staleness_max"] == 0.0


def test_clip_fractions_per_side_reach_the_step_metrics(tmp_path):
    """clip_fraction_low/high are token-weighted step means in metrics.jsonl, like clip_fraction."""
    lp, lp_b, prox, adv = _decoupled_case()  # t3 clipped high, t4 clipped low
    cfg = LossConfig(loss="decoupled", proximal="recompute")
    mask = ones_like(lp)
    _, whole = policy_loss(lp, lp_b, adv, mask, config=cfg, prox_logprobs=prox)
    parts = [(slice(None), slice(0, 3)), (slice(None), slice(3, 4))]  # two micro-batches of 3 and 1 tokens
    _, line = step_over_micro_batches(tmp_path / "metrics.jsonl", lp, lp_b, adv, mask, cfg, parts, prox=prox)
    for key in ("clip_fraction", "clip_fraction_low", "clip_fraction_high"):
        assert line[key] == pytest.approx(whole[key], rel=1e-12), key
    assert (line["clip_fraction_low"], line["clip_fraction_high"]) == (0.25, 0.25)
