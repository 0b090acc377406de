"""BAPO's adaptive clip bounds (algorithm.bapo): hand-computed cases, the authors' code as oracle, metrics.

The golden file tests/data/bapo_golden.json holds the outputs (bounds, loss, gradient, clip fraction) of
`compute_policy_loss_bapo` from WooooDyy/BAPO (recipe/bapo/policy_loss.py, the commit named in the file),
run on the inputs stored beside them, with verl 0.9.1's `agg_loss` (tests/data/README.md says how).
Their function is verl's ppo-clip with the dual clip c = 3 and the searched bounds, so ours runs
`loss: ppo`, `dualClip: 3`, `token-mean`.
"""

from __future__ import annotations

import json

import pytest
import torch

from asyncrl.api.spec.families import BapoSpec, BehaviourCapSpec, M2Spec
from asyncrl.trainer.step.losses import BAPO_STAT_KEYS, LossConfig, bapo_bounds, policy_loss
from tests.support.loss_support import step_over_micro_batches
from tests.support.paths import TESTS

F64 = torch.float64
GOLDEN = TESTS / "data" / "bapo_golden.json"
BAPO = LossConfig(loss="ppo", dual_clip=3.0, bapo=BapoSpec(), behaviour_cap=BehaviourCapSpec(limit=None))


def golden_cases() -> list[dict]:
    return json.loads(GOLDEN.read_text())["cases"]


@pytest.mark.parametrize("case", golden_cases(), ids=lambda c: c["name"])
def test_bounds_loss_and_gradient_equal_the_authors_code(case):
    lp = torch.tensor(case["logprobs"], dtype=F64, requires_grad=True)
    lp_b, adv = torch.tensor(case["behav_logprobs"], dtype=F64), torch.tensor(case["advantages"], dtype=F64)
    loss, stats = policy_loss(lp, lp_b, adv, torch.tensor(case["mask"]), config=BAPO)
    loss.backward()
    assert lp.grad is not None
    # the same Python-float walk: bounds equal to the last bit (0.8, 1.4500000000000002, ...)
    assert (stats["bapo_clip_low"], stats["bapo_clip_high"]) == (case["clip_low"], case["clip_high"])
    assert float(loss.detach()) == pytest.approx(case["loss"], abs=1e-6)
    assert float((lp.grad - torch.tensor(case["grad"], dtype=F64)).abs().max()) <= 1e-6
    assert stats["clip_fraction"] == pytest.approx(case["clip_fraction"], abs=1e-6)


def test_the_golden_cases_cover_every_branch_of_the_search():
    bounds = {(c["clip_low"], c["clip_high"]) for c in golden_cases()}
    assert (0.6, 1.2) in bounds  # met at the start
    assert (0.8, 2.0) in bounds  # never met: both bounds at their max
    assert any(c_low == 0.8 and 1.2 < c_high < 2.0 for c_low, c_high in bounds)  # met while raising c_high


def row(*values: float) -> torch.Tensor:
    return torch.tensor([values], dtype=F64)


def bounds_of(adv, u, w=None, keep=None, **bapo) -> tuple[float, float]:
    w = torch.ones_like(u) if w is None else w
    keep = torch.ones_like(u, dtype=torch.bool) if keep is None else keep
    return bapo_bounds(adv, u, w, keep, BapoSpec(**bapo))


def test_positive_share_met_at_the_start_keeps_the_start_bounds():
    # pos = 1.0 * min(1.0, 1.2) = 1.0, neg = 0.5 * max(1.0, 0.6) = 0.5: ratio 2 >= 1
    assert bounds_of(row(1.0, -0.5), row(1.0, 1.0)) == (0.6, 1.2)


def test_c_high_rises_until_the_clipped_positive_term_balances():
    # a positive token at u = 1.5 counts min(1.5, c_high): 1.2, 1.25, 1.3 fall short of neg = 1.3
    # (1.3 / (1.3 + 1e-8) < 1); c_low walks to its max first (it cannot help: no u below it)
    low, high = bounds_of(row(1.0, -1.3), row(1.5, 1.0))
    assert low == 0.8 and high == pytest.approx(1.35, abs=1e-12)


def test_a_negative_token_below_c_low_counts_at_c_low():
    # the code counts a clipped token at its bound: u = 0.5 counts max(0.5, c_low) = 0.6 at the start
    assert bounds_of(row(0.61, -1.0), row(1.0, 0.5)) == (0.6, 1.2)  # 0.61 / 0.6 >= 1
    assert bounds_of(row(0.59, -1.0), row(1.0, 0.5)) == (0.8, 2.0)  # unmet: raising c_low only adds to neg


def test_the_behaviour_weight_scales_each_contribution():
    adv, u = row(1.0, -1.5), row(1.0, 1.0)
    assert bounds_of(adv, u) == (0.8, 2.0)  # 1 / 1.5: never met (u = 1 is never clipped)
    assert bounds_of(adv, u, w=row(2.0, 1.0)) == (0.6, 1.2)  # 2 / 1.5: met


def test_only_kept_tokens_count_and_nothing_negative_is_met():
    adv, u = row(1.0, -5.0), row(1.0, 1.0)
    assert bounds_of(adv, u, keep=torch.tensor([[True, False]])) == (0.6, 1.2)
    assert bounds_of(adv, u, keep=torch.tensor([[False, False]])) == (0.6, 1.2)  # empty: infinite ratio


def test_target_share_and_ranges_are_honoured():
    adv, u = row(1.0, -1.5), row(1.0, 1.0)
    assert bounds_of(adv, u, positive_share=0.35) == (0.6, 1.2)  # 1/1.5 >= 0.35/0.65
    assert bounds_of(adv, u, clip_low_max=0.7, clip_high_max=1.3) == (0.7, 1.3)


def test_policy_loss_clips_at_the_adapted_bounds():
    # t0: A > 0, u = 1.5; t1: A < 0, u = 1: the search ends at c_high = 1.35 (see above)
    lp_b = row(-1.0, -1.0)
    lp = (lp_b + torch.log(row(1.5, 1.0))).requires_grad_(True)
    loss, stats = policy_loss(lp, lp_b, row(1.0, -1.3), torch.ones(1, 2, dtype=torch.bool),
                              config=LossConfig(loss="ppo", bapo=BapoSpec()))
    assert float(loss.detach()) == pytest.approx((-1.0 * 1.35 + 1.3 * 1.0) / 2)
    assert stats["clip_fraction_high"] == 0.5 and stats["bapo_clip_high"] == pytest.approx(1.35)
    fixed = policy_loss(lp, lp_b, row(1.0, -1.3), torch.ones(1, 2, dtype=torch.bool),
                        config=LossConfig(loss="ppo"))[1]
    assert not set(BAPO_STAT_KEYS) & set(fixed)


def test_decoupled_bounds_use_u_and_w():
    # decoupled, recomputed proximal: u = pi / pi_prox is clipped, w = pi_prox / pi_b weights the search
    lp_b = row(-1.0, -1.0)
    prox = lp_b + torch.log(row(2.0, 1.0))  # w = (2, 1)
    lp = prox.clone().requires_grad_(True)  # u = 1
    cfg = LossConfig(loss="decoupled", proximal="recompute", bapo=BapoSpec())
    _, stats = policy_loss(lp, lp_b, row(1.0, -1.5), torch.ones(1, 2, dtype=torch.bool),
                           config=cfg, prox_logprobs=prox)
    assert (stats["bapo_clip_low"], stats["bapo_clip_high"]) == (0.6, 1.2)  # 2 * 1 / 1.5 >= 1
    cfg_ppo = LossConfig(loss="ppo", bapo=BapoSpec())  # the same tokens without w: 1 / 1.5, unmet
    _, ppo = policy_loss(prox.clone(), prox, row(1.0, -1.5), torch.ones(1, 2, dtype=torch.bool),
                         config=cfg_ppo)
    assert (ppo["bapo_clip_low"], ppo["bapo_clip_high"]) == (0.8, 2.0)


@pytest.mark.parametrize("kw, says", [
    ({"objective": "gspo"}, "allowed: objective 'ppo-clip' with bapo"),
    ({"m2": M2Spec(threshold=0.04)}, "bapo adapts the clip that m2 replaces"),
])
def test_loss_config_rejects_what_bapo_cannot_honour(kw, says):
    with pytest.raises(ValueError, match=says):
        LossConfig(**kw, bapo=BapoSpec())


@pytest.mark.parametrize("kw, says", [
    ({"positive_share": 1.0}, "positive_share"), ({"clip_low_start": 1.0}, "clip_low_start"),
    ({"clip_high_max": 1.0}, "clip_high_max"), ({"step": 0.0}, "step"),
    ({"clip_low_start": 0.7, "clip_low_max": 0.65}, r"bapo.clipLowStart \(0.7\) must be <= bapo.clipLowMax"),
])
def test_bapo_settings_have_the_spec_bounds(kw, says):
    with pytest.raises(ValueError, match=says):
        BapoSpec(**kw)


def test_loss_config_from_spec_maps_the_bapo_fields():
    from asyncrl.api.spec import AlgorithmSpec

    spec = AlgorithmSpec.model_validate({"bapo": {"positiveShare": 0.4, "clipLowStart": 0.5, "clipLowMax": 0.9,
                                                  "clipHighStart": 1.1, "clipHighMax": 3.0, "step": 0.1}})
    bapo = LossConfig.from_spec(spec).bapo
    assert bapo is not None
    assert (bapo.positive_share, bapo.clip_low_start, bapo.clip_low_max, bapo.clip_high_start, bapo.clip_high_max,
            bapo.step) == (0.4, 0.5, 0.9, 1.1, 3.0, 0.1)


def test_the_adapted_bounds_reach_metrics_jsonl(tmp_path):
    """Per micro-batch bounds become token-weighted step means in metrics.jsonl (0 with fixed bounds)."""
    lp_b = row(-1.0, -1.0, -1.0)
    lp = lp_b + torch.log(row(1.5, 1.0, 1.0))
    adv, mask = row(1.0, -1.3, 5.0), torch.ones(1, 3, dtype=torch.bool)
    cfg = LossConfig(loss="ppo", bapo=BapoSpec())
    # (0.8, 1.35) over 2 tokens, then (0.6, 1.2) over 1
    parts = [(slice(None), slice(0, 2)), (slice(None), slice(2, 3))]
    _, line = step_over_micro_batches(tmp_path / "metrics.jsonl", lp, lp_b, adv, mask, cfg, parts)
    assert line["bapo_clip_low"] == pytest.approx((2 * 0.8 + 0.6) / 3)
    assert line["bapo_clip_high"] == pytest.approx((2 * 1.35 + 1.2) / 3)
