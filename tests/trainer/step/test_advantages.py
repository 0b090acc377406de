"""Group advantage estimators and token-weighted batch normalisation, checked by hand."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.trainer.step.losses import compute_advantages, normalize_advantages


def _t(values, dtype=torch.float64):
    return torch.tensor(values, dtype=dtype)


def test_grpo_uses_unbiased_std():
    # group [1, 0, 0, 1]: mean 0.5; unbiased var = 4 * 0.25 / (4 - 1) = 1/3; std = 0.577350
    # A = +-0.5 / (0.577350 + 1e-6) = +-0.866024
    adv = compute_advantages(_t([1, 0, 0, 1]), group_size=4)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert adv.tolist() == pytest.approx([expected, -expected, -expected, expected], rel=1e-12)


def test_grpo_two_groups_are_independent():
    # group 1 [1, 2, 3]: mean 2, unbiased std sqrt((1 + 0 + 1) / 2) = 1 -> [-1, 0, 1] / (1 + eps)
    # group 2 [10, 10, 40]: mean 20, std sqrt((100 + 100 + 400) / 2) = sqrt(300) = 17.3205
    #   -> [-10, -10, 20] / 17.3205 = [-0.57735, -0.57735, 1.15470]
    adv = compute_advantages(_t([1, 2, 3, 10, 10, 40]), group_size=3, eps=0.0)
    s = math.sqrt(300)
    assert adv.tolist() == pytest.approx([-1, 0, 1, -10 / s, -10 / s, 20 / s], rel=1e-12)


def test_dr_grpo_is_mean_centred_only():
    # [1, 0, 0, 1]: mean 0.5 -> [0.5, -0.5, -0.5, 0.5]; [1, 2, 3] style groups are not scaled
    assert compute_advantages(_t([1, 0, 0, 1]), 4, "dr_grpo").tolist() == [0.5, -0.5, -0.5, 0.5]
    assert compute_advantages(_t([1, 2, 6]), 3, "dr_grpo").tolist() == pytest.approx([-2, -1, 3])


def test_rloo_subtracts_mean_of_the_others():
    # [1, 2, 3]: others' means 2.5, 2, 1.5 -> [1 - 2.5, 2 - 2, 3 - 1.5] = [-1.5, 0, 1.5]
    assert compute_advantages(_t([1, 2, 3]), 3, "rloo").tolist() == pytest.approx([-1.5, 0, 1.5])
    # [1, 0, 0, 0]: others' means 0, 1/3, 1/3, 1/3 -> [1, -1/3, -1/3, -1/3]
    assert compute_advantages(_t([1, 0, 0, 0]), 4, "rloo").tolist() == pytest.approx(
        [1, -1 / 3, -1 / 3, -1 / 3])


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_degenerate_groups_are_exactly_zero(estimator):
    # 0.1 is not representable: mean(0.1, 0.1, 0.1) - 0.1 can be ~1e-17, and divided by eps alone
    # it would become ~1e-11 noise. The all-equal rule must give exact zeros.
    rewards = torch.tensor([0.1, 0.1, 0.1, 1.0, 0.0, 1.0, 0.7, 0.7, 0.7], dtype=torch.float32)
    adv = compute_advantages(rewards, 3, estimator)
    assert adv[:3].tolist() == [0.0, 0.0, 0.0]
    assert adv[6:].tolist() == [0.0, 0.0, 0.0]
    assert bool((adv[3:6] != 0).all())


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_group_of_one_is_degenerate(estimator):
    assert compute_advantages(_t([3.0, -1.0]), 1, estimator).tolist() == [0.0, 0.0]


def test_dtypes_and_empty():
    assert compute_advantages(torch.tensor([1, 0]), 2).dtype == torch.float32  # int rewards
    assert compute_advantages(_t([1, 0]), 2).dtype == torch.float64
    assert compute_advantages(torch.tensor([1.0, 0.0], dtype=torch.bfloat16), 2).dtype == torch.bfloat16
    assert compute_advantages(torch.zeros(0), 4).shape == (0,)
    r = torch.tensor([1.0, 0.0], requires_grad=True)
    assert not compute_advantages(r, 2).requires_grad


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(rewards=torch.zeros(2, 2), group_size=2), "1-D"),
        (dict(rewards=torch.zeros(5), group_size=2), "multiple of group_size"),
        (dict(rewards=torch.zeros(4), group_size=0), "group_size"),
        (dict(rewards=torch.zeros(4), group_size=2, estimator="ppo"), "estimator"),
        (dict(rewards=torch.tensor([1.0, float("nan")]), group_size=2), "NaN"),
        (dict(rewards=[1.0, 0.0], group_size=2), "torch.Tensor"),
    ],
)
def test_invalid_inputs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        compute_advantages(**kwargs)


groups = st.integers(min_value=2, max_value=6).flatmap(
    lambda n: st.tuples(
        st.just(n),
        st.lists(st.floats(-10, 10, allow_nan=False).map(lambda x: round(x, 3)),
                 min_size=n, max_size=4 * n).map(lambda xs: xs[: len(xs) - len(xs) % n]),
    )
).filter(lambda t: len(t[1]) >= t[0])


@settings(max_examples=60, deadline=None)
@given(groups)
def test_estimator_properties(case):
    n, rewards = case
    r = _t(rewards)
    grpo = compute_advantages(r, n, "grpo", eps=0.0).view(-1, n)
    dr = compute_advantages(r, n, "dr_grpo").view(-1, n)
    rloo = compute_advantages(r, n, "rloo").view(-1, n)
    for g, row in enumerate(r.view(-1, n)):
        if bool((row == row[0]).all()):
            assert grpo[g].abs().sum() == 0 and dr[g].abs().sum() == 0 and rloo[g].abs().sum() == 0
            continue
        assert float(dr[g].sum()) == pytest.approx(0.0, abs=1e-9)  # centred
        assert float(grpo[g].std(unbiased=True)) == pytest.approx(1.0, rel=1e-9)  # unit unbiased std
        # RLOO: R_i - (S - R_i)/(n-1) = n/(n-1) * (R_i - mean)
        assert torch.allclose(rloo[g], dr[g] * n / (n - 1), atol=1e-9)
    shifted = compute_advantages(r + 7.0, n, "grpo", eps=0.0).view(-1, n)
    assert torch.allclose(shifted, grpo, atol=1e-7)  # shift invariance


def test_normalize_advantages_token_weighted():
    # per-sequence A = [1, -1] with 3 and 1 response tokens: the token-weighted mean is
    # (3*1 + 1*(-1)) / 4 = 0.5; var = (3*(0.5)^2 + 1*(1.5)^2) / 4 = (0.75 + 2.25) / 4 = 0.75
    # -> [(1 - 0.5) / 0.866025, (-1 - 0.5) / 0.866025] = [0.577350, -1.732051]
    out = normalize_advantages(_t([1.0, -1.0]), _t([3.0, 1.0]), eps=0.0)
    assert out.tolist() == pytest.approx([0.5 / math.sqrt(0.75), -1.5 / math.sqrt(0.75)], rel=1e-12)
    # the same numbers per token with a [B, T] mask as weights
    mask = _t([[1, 1, 1], [1, 0, 0]])
    per_token = _t([[1.0, 1.0, 1.0], [-1.0, -1.0, -1.0]])
    tok = normalize_advantages(per_token, mask, eps=0.0)
    assert tok[0].tolist() == pytest.approx([0.5 / math.sqrt(0.75)] * 3)
    assert float(tok[1, 0]) == pytest.approx(-1.5 / math.sqrt(0.75))


def test_normalize_advantages_edge_cases():
    assert normalize_advantages(_t([1.0, 2.0]), _t([0.0, 0.0])).tolist() == [0.0, 0.0]
    assert normalize_advantages(_t([2.0, 2.0]), _t([1.0, 5.0])).tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="weights shape"):
        normalize_advantages(_t([1.0, 2.0]), _t([1.0]))
    with pytest.raises(ValueError, match=">= 0"):
        normalize_advantages(_t([1.0, 2.0]), _t([1.0, -1.0]))
