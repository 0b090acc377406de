"""Policy-gradient math for async RL: group advantages, (decoupled) PPO, A-3PO proximal, M2PO,
and the policy objectives PPO-clip, GSPO, CISPO and SAPO.

Everything here works on tensors that are already aligned (position t scores token t, see
`asyncrl.trainer.step.batch`) and is pure: no model, no I/O. The rules, and the choices made where
papers and reference code disagree, are written down in docs/algorithms.md.

Notation per token: `lp` current policy (with grad), `lp_b` behaviour (engine), `lp_p` proximal,
`A` advantage, `m` loss mask; `u = exp(lp - lp_p)` trust-region ratio, `w = exp(lp_p - lp_b)`
behaviour weight (always detached).

`policy_loss` is a sequence of small pure stages, one per phase of the objective: proximal
log-probs, ratios, behaviour-weight cap, objective (PPO-clip with fixed or BAPO's adaptive bounds,
GSPO, CISPO or SAPO, on u), M2PO mask, aggregation, metrics. Each stage returns a frozen record, so
the next one reads its inputs by name.
"""

from __future__ import annotations

import math
import operator
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

import torch
from torch import Tensor

from asyncrl.api.spec.base import SpecModel
from asyncrl.api.spec.families import BapoSpec, BehaviourCapSpec, M2Spec, SapoSpec, VcpoSpec

Estimator = Literal["grpo", "dr_grpo", "rloo"]
LossKind = Literal["ppo", "decoupled"]
ProximalMethod = Literal["recompute", "loglinear"]
OnPolicyRule = Literal["current", "behave"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
ObjectiveName = Literal["ppo-clip", "gspo", "cispo", "sapo"]

ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo")
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
OBJECTIVES: tuple[str, ...] = ("ppo-clip", "gspo", "cispo", "sapo")
VCPO_SCALINGS: tuple[str, ...] = ("sqrt", "linear")

# BAPO's search (arXiv 2510.18927; the released code WooooDyy/BAPO @ 7287044, recipe/bapo/config/
# bapo_trainer.yaml; the defaults are asyncrl.api.spec.families.BapoSpec's): explicit ratio bounds,
# c_low from 0.6 up to 0.8 and then c_high from 1.2 up to 2.0, in steps of 0.05, until positive /
# negative contribution >= 1 (a positive share rho0 of 0.5, the paper's value). BAPO_EPS is the
# code's guard on the division.
BAPO_EPS = 1e-8

# VCPO's ESS-scaled learning rate (arXiv 2602.17616; the released code mit-han-lab/vcpo @ c7f030f,
# verl/trainer/config/actor/actor.yaml ess_scaling, megatron_actor.py, staleness_utils.py
# compute_ess_info): lr = base_lr x sqrt(min(1, rho / rho_base)), rho the ESS ratio of the minibatch's
# unclipped sequence weights; VCPO_EPS is the code's guard on sum w^2. The sequence log-weight is
# clamped at VCPO_LOG_LIMIT so that w^2 stays finite in float64 (the code's float32 exp can overflow).
VCPO_BASE_ESS_RATIO = 1.0
VCPO_SCALING = "sqrt"
VCPO_EPS = 1e-8
VCPO_LOG_LIMIT = 300.0

# Log-ratios entering exp() with grad are clamped to +-LOG_RATIO_LIMIT nats (ratio ~4.9e8): beyond
# that a float32 loss (ratio x advantage x tokens) can overflow. Tokens past the limit get no
# gradient through the ratio; they are pathological and the behaviour cap drops them by default.
LOG_RATIO_LIMIT = 20.0

# Dr. GRPO's fixed length when none is given: the job spec's default maxNewTokens.
DEFAULT_NORM_LENGTH = 256

STAT_KEYS: tuple[str, ...] = (
    "loss", "tokens", "kept_tokens", "clip_fraction", "clip_fraction_low", "clip_fraction_high",
    "dual_clip_fraction", "behav_filtered_fraction", "importance_weight_max", "importance_weight_min",
    "importance_weight_mean", "full_ratio_max", "full_ratio_min", "full_ratio_mean",
    "behav_weight_max", "behav_weight_min", "behav_weight_mean", "behav_weight_sq_mean",
    "behav_ess", "behav_kl", "staleness_mean", "staleness_max", "m2_before", "m2_after",
    "m2_masked_fraction", "proximal_s",
)
BAPO_STAT_KEYS: tuple[str, ...] = ("bapo_clip_low", "bapo_clip_high")
"""Added to the stats with `bapo` set only: the ratio bounds the search chose for the call."""
VCPO_STAT_KEYS: tuple[str, ...] = ("vcpo_w_sum", "vcpo_w_sq_sum", "vcpo_sequences")
"""Added to the stats with `vcpo.ess_scaling` only: this call's sums of VCPO's sequence weights (`vcpo_weight_sums`)."""


# ------------------------------------------------------------------------------------ advantages


def _check_rewards(rewards: Any, group_size: Any, estimator: str, eps: float) -> None:
    """The argument checks of `compute_advantages`, kept apart so the estimator reads on its own."""
    if not isinstance(rewards, Tensor):
        raise ValueError(f"rewards must be a torch.Tensor, got {type(rewards).__name__}")
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (ordered group by group), got shape {tuple(rewards.shape)}")
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if estimator not in ESTIMATORS:
        raise ValueError(f"estimator must be one of {ESTIMATORS}, got {estimator!r}")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if rewards.numel() % group_size:
        raise ValueError(
            f"rewards has {rewards.numel()} entries, not a multiple of group_size={group_size}")
    if rewards.dtype == torch.bool or rewards.is_complex():
        raise ValueError(f"rewards must be real numbers, got dtype {rewards.dtype}")


def compute_advantages(
    rewards: Tensor, group_size: int, estimator: Estimator = "grpo", eps: float = 1e-6
) -> Tensor:
    """Per-sample advantages from outcome rewards laid out group by group (`[g0s0, g0s1, ...]`).

    grpo: `(R - mean_g) / (std_g + eps)` with the unbiased std; dr_grpo: `R - mean_g`;
    rloo: `R - mean of the other samples of the group`. A group whose rewards are all equal carries
    no signal and gets exactly 0 (not rounding noise divided by eps). Computed in float64, returned
    in the rewards' floating dtype (float32 for integer rewards), detached.
    """
    _check_rewards(rewards, group_size, estimator, eps)
    out_dtype = rewards.dtype if rewards.is_floating_point() else torch.float32
    r = rewards.detach().to(torch.float64)
    if not bool(torch.isfinite(r).all()):
        raise ValueError("rewards contain NaN or Inf")
    if r.numel() == 0:
        return torch.zeros(0, dtype=out_dtype, device=rewards.device)
    r = r.view(-1, group_size)
    mean = r.mean(dim=1, keepdim=True)
    degenerate = (r.amax(dim=1) == r.amin(dim=1)).unsqueeze(1)
    if estimator == "grpo":
        std = r.std(dim=1, unbiased=True, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
        adv = (r - mean) / (std + eps)
    elif estimator == "dr_grpo":
        adv = r - mean
    else:  # rloo: R_i - (sum - R_i)/(n-1)
        others = (r.sum(dim=1, keepdim=True) - r) / max(group_size - 1, 1)
        adv = r - others
    adv = torch.where(degenerate, torch.zeros_like(adv), adv)
    return adv.reshape(-1).to(out_dtype)


def normalize_advantages(advantages: Tensor, weights: Tensor, eps: float = 1e-6) -> Tensor:
    """Token-weighted batch normalisation `(A - mean_w) / (std_w + eps)`.

    `weights` has the shape of `advantages`: the loss mask for per-token advantages `[B, T]`, or
    the response token counts for per-sample advantages `[B]`, so every token counts once (a long
    answer is not under-weighted). The std is the weighted population std. Zero total weight
    returns zeros. Entries with zero weight are normalised too (they are masked later anyway).
    """
    for name, t in (("advantages", advantages), ("weights", weights)):
        if not isinstance(t, Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if weights.shape != advantages.shape:
        raise ValueError(
            f"weights shape {tuple(weights.shape)} != advantages shape {tuple(advantages.shape)}")
    if not advantages.is_floating_point():
        raise ValueError(f"advantages must be floating point, got {advantages.dtype}")
    a = advantages.detach().to(torch.float64)
    w = weights.detach().to(torch.float64)
    if bool((w < 0).any()):
        raise ValueError("weights must be >= 0")
    total = w.sum()
    if total <= 0:
        return torch.zeros_like(advantages)
    mean = (a * w).sum() / total
    var = (((a - mean) ** 2) * w).sum() / total
    return ((a - mean) / (var.sqrt() + eps)).to(advantages.dtype)


# ------------------------------------------------------------------------------------ config


@dataclass(frozen=True)
class LossConfig:
    """The settings of the policy objective, by the names `spec.algorithm` gives them.

    `loss="ppo"` ignores `proximal`/`loglinear_on_policy`/`behaviour_cap` (the behaviour policy is
    the proximal, w = 1); `behaviour_cap.limit=None` removes the behaviour weight entirely (w = 1).
    `max_new_tokens` is Dr. GRPO's fixed length: `seq-mean-token-sum-norm` divides the token sum by
    rows x max_new_tokens, so the loss does not depend on padding.

    Why a class of its own rather than `asyncrl.api.spec.AlgorithmSpec`: tests, benchmarks and other
    trainers build it from plain values, without the spec's sampling/batching/optimizer fields, and
    the spec's cross-field rules are job-setting rules, not restated here: `loss="ppo"` with the
    default `proximal="loglinear"` is fine (ppo ignores the proximal), and `clip_eps_high <
    clip_eps` is well-defined math; the spec rejects both in a job. The family settings are the
    spec's own models (asyncrl.api.spec.families), which carry their bounds; the top-level
    bounds are restated here (a test compares them). What it does reject across fields is what the
    math cannot honour: `m2` and `dual_clip` are parts of the PPO-clip objective, so another
    `objective` with either set would silently drop them, and `bapo` adapts that same clip.
    `from_spec` reads every field by its own name.
    """

    loss: LossKind = "decoupled"
    proximal: ProximalMethod = "loglinear"
    loglinear_on_policy: OnPolicyRule = "behave"
    clip_eps: float = 0.2
    clip_eps_high: float | None = None
    dual_clip: float | None = None
    behaviour_cap: BehaviourCapSpec = field(default_factory=BehaviourCapSpec)
    m2: M2Spec | None = None
    aggregation: Aggregation = "token-mean"
    max_new_tokens: int = DEFAULT_NORM_LENGTH
    objective: ObjectiveName = "ppo-clip"
    sapo: SapoSpec = field(default_factory=SapoSpec)
    bapo: BapoSpec | None = None
    vcpo: VcpoSpec = field(default_factory=VcpoSpec)

    def __post_init__(self) -> None:
        choices = {
            "loss": ("ppo", "decoupled"), "proximal": ("recompute", "loglinear"),
            "loglinear_on_policy": ("current", "behave"), "aggregation": AGGREGATIONS, "objective": OBJECTIVES,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"LossConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        # (family, whether None means off): the optional ones are on by being present
        families = {"behaviour_cap": (BehaviourCapSpec, False), "m2": (M2Spec, True), "sapo": (SapoSpec, False),
                    "bapo": (BapoSpec, True), "vcpo": (VcpoSpec, False)}
        for name, (family, optional) in families.items():
            value = getattr(self, name)
            if not (isinstance(value, family) or (optional and value is None)):
                raise ValueError(f"LossConfig.{name} must be an asyncrl.api.spec.families.{family.__name__}"
                                 f"{' or None' if optional else ''}, got {value!r}")
        if not 0 < self.clip_eps < 1:
            raise ValueError(f"LossConfig.clip_eps must be in (0, 1), got {self.clip_eps!r}")
        if self.clip_eps_high is not None and not self.clip_eps_high > 0:
            raise ValueError(f"LossConfig.clip_eps_high must be > 0, got {self.clip_eps_high!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"LossConfig.dual_clip must be > 1, got {self.dual_clip!r}")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"LossConfig.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")
        for name in ("m2", "dual_clip", "bapo"):
            if getattr(self, name) is not None and self.objective != "ppo-clip":
                raise ValueError(
                    f"LossConfig.{name} is part of the 'ppo-clip' objective only, got objective "
                    f"{self.objective!r}; allowed: objective 'ppo-clip' with {name}, or {name}=None")
        if self.bapo is not None and self.m2 is not None:
            raise ValueError("LossConfig.bapo adapts the clip that m2 replaces; allowed: bapo with m2=None, "
                             "or bapo=None")

    @property
    def eps_high(self) -> float:
        """Upper clip epsilon (clip-higher), `clip_eps` when unset."""
        return self.clip_eps if self.clip_eps_high is None else self.clip_eps_high

    @classmethod
    def from_spec(cls, spec: Any) -> LossConfig:
        """The config of an `asyncrl.api.spec.AlgorithmSpec` (or anything with its attribute names)."""
        missing = [f.name for f in fields(cls) if not hasattr(spec, f.name)]
        if missing:
            raise ValueError(
                f"{type(spec).__name__} is not an AlgorithmSpec: missing {', '.join(missing)}")
        return cls(**{f.name: getattr(spec, f.name) for f in fields(cls)})

    def to_dict(self) -> dict[str, Any]:
        """The fields by name, families as their wire form (for logs and reports)."""
        return {f.name: _plain(getattr(self, f.name)) for f in fields(self)}


def _plain(value: Any) -> Any:
    return value.to_wire() if isinstance(value, SpecModel) else value


# ------------------------------------------------------------------------------------ proximal


def loglinear_proximal(
    behav_logprobs: Tensor,
    logprobs: Tensor,
    versions: Tensor,
    current_version: int,
    *,
    on_policy: OnPolicyRule = "behave",
) -> Tensor:
    """A-3PO's staleness-aware proximal log-probs, detached: `lp_b + alpha * (lp - lp_b)`.

    d = current_version - version; alpha = 1 - 1/d for d >= 1 (d = 1 gives the behaviour policy,
    large d approaches the current policy). The proximal is the policy at the start of the step,
    so at d = 0 (a token of that very version) it is the behaviour policy (`on_policy="behave"`:
    the A-3PO paper and AReaL's code). `"current"` puts it at the current policy instead, which is
    the same thing only while no update of the step has happened yet: exact with one minibatch
    per step; from the second minibatch on it would leave fresh tokens unclipped (the job spec
    rejects it with minibatches > 1). Positions with a negative version (prompt, padding) get the
    behaviour log-prob. Cost: a few elementwise ops, no forward pass.
    """
    if on_policy not in ("current", "behave"):
        raise ValueError(f"on_policy must be 'current' or 'behave', got {on_policy!r}")
    lp = logprobs.detach()
    lp_b = behav_logprobs.detach().to(lp.dtype)
    # A token newer than the trainer (possible right after a restart from an older checkpoint)
    # counts as fresh: d is clamped at 0.
    d = (int(current_version) - versions.to(torch.int64)).clamp(min=0).to(lp.dtype)
    alpha = torch.where(d >= 1, 1.0 - 1.0 / d.clamp(min=1.0), torch.zeros_like(d))
    if on_policy == "current":
        alpha = torch.where(d == 0, torch.ones_like(alpha), alpha)
    alpha = torch.where(versions < 0, torch.zeros_like(alpha), alpha)
    # alpha = 1 returns lp itself (not lp_b + (lp - lp_b), which can round away tiny values)
    return torch.where(alpha == 1.0, lp, lp_b + alpha * (lp - lp_b))


# ------------------------------------------------------------------------------------ M2PO


def m2po_mask(log_ratio: Tensor, candidates: Tensor, threshold: float) -> tuple[Tensor, float, float]:
    """M2PO: drop the candidates with the largest `(log r)^2` until their mean is <= threshold.

    Returns `(dropped [same shape, bool], m2_before, m2_after)`. Sorting once makes it exact and
    O(n log n): after dropping the k largest, M2_k = (S - prefix_k) / (n - k); the smallest k with
    M2_k <= threshold is the answer of the greedy loop. M2 of an empty set is 0.
    """
    sq = log_ratio.detach().to(torch.float64).pow(2)
    flat_idx = candidates.reshape(-1).nonzero().squeeze(1)
    dropped = torch.zeros_like(candidates, dtype=torch.bool)
    n = flat_idx.numel()
    if n == 0:
        return dropped, 0.0, 0.0
    values = sq.reshape(-1)[flat_idx]
    order = torch.argsort(values, descending=True, stable=True)
    sorted_vals = values[order]
    total = sorted_vals.sum()
    before = float(total / n)
    if before <= threshold:
        return dropped, before, before
    removed = torch.cat([sorted_vals.new_zeros(1), sorted_vals.cumsum(0)])  # prefix_k, k = 0..n
    remaining = torch.arange(n, -1, -1, dtype=torch.float64, device=sorted_vals.device)  # n - k
    m2 = torch.where(remaining > 0, (total - removed).clamp(min=0) / remaining.clamp(min=1), 0.0)
    k = int((m2 <= threshold).nonzero()[0, 0])  # exists: m2[n] == 0
    flat = dropped.reshape(-1).clone()
    flat[flat_idx[order[:k]]] = True
    return flat.view_as(dropped), before, float(m2[k])


# ------------------------------------------------------------------------------------ policy loss: stages


def _clamped_exp(log_ratio: Tensor) -> Tensor:
    """`exp` of a log-ratio clamped at +-LOG_RATIO_LIMIT, so ratio x advantage x tokens stays finite."""
    return log_ratio.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()


def _bool_mask(mask: Tensor) -> Tensor:
    """The loss mask as bool (callers may pass 0/1 numbers)."""
    return mask if mask.dtype == torch.bool else mask != 0


@dataclass(frozen=True)
class PolicyInputs:
    """One call's `[B, T]` tensors after validation: bool mask, compute dtype, 0 outside the mask."""

    lp: Tensor  # current policy, the only tensor with grad
    lp_b: Tensor  # behaviour policy, detached
    adv: Tensor  # advantages broadcast to every token, detached
    mask: Tensor  # bool loss mask


def prepare_inputs(logprobs: Tensor, behav_logprobs: Tensor, advantages: Tensor, mask: Tensor) -> PolicyInputs:
    """Upcast to `promote(logprobs.dtype, float32)` and zero every position outside the mask.

    Masked-out positions may hold padding garbage (NaN, -inf); `where()` keeps it out of both the
    forward values and the gradient, so no later stage has to think about it.
    """
    m = _bool_mask(mask)
    cdtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=cdtype, device=logprobs.device)
    lp = torch.where(m, logprobs.to(cdtype), zero)
    lp_b = torch.where(m, behav_logprobs.detach().to(cdtype), zero)
    adv = advantages.detach().to(cdtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand(logprobs.shape)
    adv = torch.where(m, adv, zero)
    return PolicyInputs(lp=lp, lp_b=lp_b, adv=adv, mask=m)


@dataclass(frozen=True)
class Proximal:
    """The proximal log-probs `lp_p` (detached) and the wall seconds they cost."""

    logprobs: Tensor
    seconds: float


def proximal_logprobs(
    x: PolicyInputs,
    config: LossConfig,
    *,
    versions: Tensor | None = None,
    current_version: int | None = None,
    prox_logprobs: Tensor | None = None,
) -> Proximal:
    """`lp_p`, the trust-region anchor: behaviour (ppo), recomputed (passed in), or A-3PO log-linear.

    Timed because the cost of `lp_p` is a reported figure (`proximal_seconds`): the point of log-linear is that it needs
    no forward pass (`recompute` paid for its forward before this call, so it reports 0 here).
    """
    if config.loss != "decoupled":
        return Proximal(x.lp_b, 0.0)
    if config.proximal == "recompute":
        if prox_logprobs is None:
            raise ValueError("prox_logprobs is required for proximal='recompute'")
        return Proximal(torch.where(x.mask, prox_logprobs.detach().to(x.lp.dtype), x.lp.new_zeros(())), 0.0)
    if versions is None or current_version is None:
        raise ValueError("versions and current_version are required for proximal='loglinear'")
    t0 = time.perf_counter()
    lp_p = loglinear_proximal(x.lp_b, x.lp, versions, current_version, on_policy=config.loglinear_on_policy)
    return Proximal(lp_p, time.perf_counter() - t0)


@dataclass(frozen=True)
class Ratios:
    """The factors of `pi / pi_b = w * u`, in log space and (for u) as used."""

    log_u: Tensor  # lp - lp_p, with grad through lp
    u: Tensor  # exp(log_u), clamped: the trust-region ratio
    log_w: Tensor  # lp_p - lp_b, detached: the behaviour weight before its cap
    log_r: Tensor  # lp - lp_b = log u + log w, detached: the full stale ratio pi / pi_b


def compute_ratios(lp: Tensor, lp_p: Tensor, lp_b: Tensor) -> Ratios:
    """Split the importance ratio: u carries the gradient and the trust region, w corrects staleness.

    Only `u` is differentiated (`lp_p` is detached); `w` is a constant weight, as in AReaL's
    decoupled objective. Log-ratios are clamped before `exp` (`LOG_RATIO_LIMIT`). The full ratio
    `r = w u` is kept apart (detached) for M2PO and the metrics.
    """
    log_w = (lp_p - lp_b).detach()
    log_u = lp - lp_p.detach()
    return Ratios(log_u=log_u, u=_clamped_exp(log_u), log_w=log_w, log_r=(lp - lp_b).detach())


@dataclass(frozen=True)
class BehaviourWeight:
    """The behaviour weight as used, and which tokens its cap touched."""

    w: Tensor  # detached, 0 outside `keep`
    keep: Tensor  # the mask minus the tokens the cap dropped
    capped: Tensor  # tokens over the cap: dropped (mode "mask") or truncated (mode "clamp")


def _sequence_log_weight(log_w: Tensor, mask: Tensor) -> Tensor:
    """log of each response's geometric-mean w, on every token of it (0 outside the mask)."""
    seq_log_w = (log_w * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    return torch.where(mask, seq_log_w.unsqueeze(1).expand(mask.shape), log_w.new_zeros(()))


def cap_behaviour_weight(log_w: Tensor, mask: Tensor, config: LossConfig) -> BehaviourWeight:
    """`w = exp(log_w)` with AReaL's cap, so a few very stale tokens cannot dominate the update.

    mode "mask" drops tokens with `w > cap` (the denominator later keeps them); "clamp" truncates w
    (TIS). Level "sequence" caps each response's geometric mean, so it is kept or dropped whole.
    Coupled PPO or `behaviour_cap.limit=None`: w = 1 on the mask. The comparison is in log space.
    """
    zero = log_w.new_zeros(())
    cap = config.behaviour_cap
    if config.loss != "decoupled" or cap.limit is None:
        ones = torch.where(mask, torch.ones_like(log_w), zero)
        return BehaviourWeight(w=ones, keep=mask.clone(), capped=torch.zeros_like(mask))
    log_cap = math.log(cap.limit)
    if cap.level == "sequence":
        log_w = _sequence_log_weight(log_w, mask)
    over = mask & (log_w > log_cap)
    if cap.mode == "mask":
        keep = mask & ~over
    else:
        keep, log_w = mask.clone(), log_w.clamp(max=log_cap)
    return BehaviourWeight(w=torch.where(keep, _clamped_exp(log_w), zero), keep=keep, capped=over)


@dataclass(frozen=True)
class Surrogate:
    """The per-token objective before the behaviour weight, and where each clip won.

    `clipped = clipped_low | clipped_high` (disjoint): a kept token whose clipped branch won
    strictly, split by the bound that won, `1 - eps_lo` (only possible with A < 0) or `1 + eps_hi`
    (A > 0). For CISPO, whose clip only weights the gradient, it is the ratio outside the band, by
    side; SAPO has no clip (all False).
    """

    per_token: Tensor  # with grad; not yet weighted by w nor masked
    clipped: Tensor  # kept tokens where the eps-clipped branch won strictly
    dual_clipped: Tensor  # kept tokens with A < 0 where c|A| won strictly
    clipped_low: Tensor  # of `clipped`: the ratio was below 1 - eps_lo
    clipped_high: Tensor  # of `clipped`: the ratio was above 1 + eps_hi


def bapo_bounds(adv: Tensor, u: Tensor, w: Tensor, keep: Tensor, bapo: BapoSpec) -> tuple[float, float]:
    """BAPO's ratio bounds `(c_low, c_high)` for this call, chosen on detached tensors.

    The candidates are the released code's walk: c_low from its start up to its max, then c_high
    from its start up to its max, `bapo.step` at a time (each step `min(c + step, max)`, Python
    floats, so the bounds are the code's to the last bit). The first candidate whose positive /
    negative contribution reaches `rho0 / (1 - rho0)` wins, else the last one. A token's
    contribution is its term of the objective before the pessimistic max, `w A min(u, c_high)`
    for A >= 0 and `w A max(u, c_low)` for A < 0, over `keep` (w = 1 with loss ppo: the code's
    case). No negative contribution counts as an infinite ratio. All candidates are evaluated at
    once, with one device sync. See docs/algorithms.md ("BAPO") for the choices.
    """
    lo, hi = bapo.clip_low_start, bapo.clip_high_start
    candidates = [(lo, hi)]
    while lo < bapo.clip_low_max:
        lo = min(lo + bapo.step, bapo.clip_low_max)
        candidates.append((lo, hi))
    while hi < bapo.clip_high_max:
        hi = min(hi + bapo.step, bapo.clip_high_max)
        candidates.append((lo, hi))
    with torch.no_grad():
        a, uk, wk = adv[keep], u.detach()[keep], w.detach()[keep].to(u.dtype)
        bounds = torch.tensor(candidates, dtype=u.dtype, device=u.device)  # [K, 2]
        ratio = torch.where(a >= 0, torch.minimum(uk, bounds[:, 1:]), torch.maximum(uk, bounds[:, :1]))
        eff = wk * a * ratio  # [K, n]
        pos, neg = eff.clamp(min=0).sum(dim=1), (-eff.clamp(max=0)).sum(dim=1)
        balance = torch.where(neg <= 0, torch.full_like(pos, math.inf), pos / (neg + BAPO_EPS))
        met = (balance >= bapo.positive_share / (1.0 - bapo.positive_share)).tolist()
    return candidates[met.index(True) if True in met else len(candidates) - 1]


def clipped_surrogate(adv: Tensor, u: Tensor, keep: Tensor, config: LossConfig,
                      bounds: tuple[float, float] | None = None) -> Surrogate:
    """PPO's pessimistic `max(-A u, -A clip(u, 1-eps_lo, 1+eps_hi))`, then `min(., c|A|)` for A < 0.

    The dual clip bounds the loss of a negative-advantage token whose ratio exploded. Clip
    fractions count strict wins only (a tie, u inside the band or A = 0, is not clipped). With
    M2PO (`m2` set) its second-moment mask replaces clipping: the objective is `-A u`.
    GSPO uses it too, with its sequence-level ratio in place of `u`. `bounds` (BAPO's ratio bounds
    `(c_low, c_high)`) replaces `(1 - eps_lo, 1 + eps_hi)`.
    """
    none = torch.zeros_like(keep)
    if config.m2 is not None:
        return Surrogate(per_token=-adv * u, clipped=none, dual_clipped=none, clipped_low=none, clipped_high=none)
    lo, hi = bounds if bounds is not None else (1.0 - config.clip_eps, 1.0 + config.eps_high)
    unclipped = -adv * u
    clipped = -adv * u.clamp(lo, hi)
    per_token = torch.maximum(unclipped, clipped)
    clipped_strict = keep & (clipped > unclipped).detach()
    dual_strict = none
    if config.dual_clip is not None:
        bound = config.dual_clip * adv.abs()
        dual_strict = keep & (adv < 0) & (per_token > bound).detach()
        per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
    below = (u < lo).detach()
    return Surrogate(per_token=per_token, clipped=clipped_strict, dual_clipped=dual_strict,
                     clipped_low=clipped_strict & below, clipped_high=clipped_strict & ~below)


def gspo_ratio(log_u: Tensor, mask: Tensor) -> Tensor:
    """GSPO-token's ratio `s_it = sg[s_i] * u_t / sg[u_t]`, `s_i = exp(mean over the response of log u)`.

    Its value is the sequence's geometric-mean ratio on every token; its gradient is token t's own
    (`d s_it / d lp_t = s_i`), so the gradient of a token is `-A s_i` inside the band. The log is
    clamped at +-LOG_RATIO_LIMIT before `exp`, as every ratio here (verl clamps at +10 only).
    """
    seq_log = (log_u.detach() * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    log_s = seq_log.unsqueeze(1) + (log_u - log_u.detach())
    return _clamped_exp(log_s)


def cispo_surrogate(adv: Tensor, u: Tensor, lp: Tensor, keep: Tensor, config: LossConfig) -> Surrogate:
    """CISPO: `-sg(clip(u, 1-eps_lo, 1+eps_hi)) * A * log pi`; the clip weights the gradient, never zeroes it.

    The value carries `log pi` itself (as in the paper and verl), so the loss is a surrogate whose
    gradient, `-clip(u) A d(log pi)`, is what counts; `clipped_*` is the ratio outside the band.
    """
    lo, hi = 1.0 - config.clip_eps, 1.0 + config.eps_high
    weight = u.detach().clamp(lo, hi)
    low, high = keep & (u < lo).detach(), keep & (u > hi).detach()
    return Surrogate(per_token=-weight * adv * lp, clipped=low | high, dual_clipped=torch.zeros_like(keep),
                     clipped_low=low, clipped_high=high)


def sapo_surrogate(adv: Tensor, u: Tensor, keep: Tensor, config: LossConfig) -> Surrogate:
    """SAPO's soft gate: `-A * sigmoid(tau (u - 1)) * 4 / tau`, tau = tau_pos if A > 0 else tau_neg.

    The gate's slope at u is `4 sigma (1 - sigma)`, 1 at u = 1 (the plain policy gradient there)
    and decaying smoothly away from it, so there is no hard clip and no clip fraction.
    """
    tau = torch.where(adv > 0, torch.as_tensor(config.sapo.tau_pos, dtype=u.dtype, device=u.device),
                      torch.as_tensor(config.sapo.tau_neg, dtype=u.dtype, device=u.device))
    gate = torch.sigmoid(tau * (u - 1.0)) * (4.0 / tau)
    none = torch.zeros_like(keep)
    return Surrogate(per_token=-adv * gate, clipped=none, dual_clipped=none, clipped_low=none, clipped_high=none)


def policy_objective(x: PolicyInputs, ratios: Ratios, keep: Tensor, config: LossConfig,
                     bounds: tuple[float, float] | None = None) -> Surrogate:
    """The configured objective on the trust-region ratio u (the behaviour weight w multiplies it later).

    `bounds` are BAPO's adapted ratio bounds for ppo-clip (None: the fixed `1 -+ eps`)."""
    if config.objective == "gspo":
        return clipped_surrogate(x.adv, gspo_ratio(ratios.log_u, x.mask), keep, config)
    if config.objective == "cispo":
        return cispo_surrogate(x.adv, ratios.u, x.lp, keep, config)
    if config.objective == "sapo":
        return sapo_surrogate(x.adv, ratios.u, keep, config)
    return clipped_surrogate(x.adv, ratios.u, keep, config, bounds)


@dataclass(frozen=True)
class M2Mask:
    """The tokens M2PO dropped and the second moment before/after (0.0 when M2PO is off)."""

    dropped: Tensor
    before: float
    after: float


def m2po_trust_region(log_r: Tensor, adv: Tensor, keep: Tensor, config: LossConfig) -> M2Mask:
    """M2PO's trust region: mask the largest `(log r)^2` of the candidates until their mean <= tau.

    `log r = lp - lp_b` is the full stale ratio pi / pi_b in every loss kind (the paper, AReaL).
    Not `log u = lp - lp_p`: with the log-linear proximal that is `log r / d`, so M2 would shrink
    by d^2 and mask nothing at high staleness, and with a recomputed proximal and one minibatch it
    is exactly 0. Candidates are the kept tokens (scope "all", the paper) or only those whose full
    ratio already moved the way A pushes it (scope "harmful", the released code).
    """
    if config.m2 is None:
        return M2Mask(dropped=torch.zeros_like(keep), before=0.0, after=0.0)
    if config.m2.scope == "all":
        candidates = keep
    else:
        candidates = keep & (((adv > 0) & (log_r > 0)) | ((adv < 0) & (log_r < 0)))
    dropped, before, after = m2po_mask(log_r, candidates, config.m2.threshold)
    return M2Mask(dropped=dropped, before=before, after=after)


def aggregate(
    per_token: Tensor, mask: Tensor, aggregation: Aggregation, loss_denominator: float | None = None,
    *, norm_length: int = DEFAULT_NORM_LENGTH,
) -> Tensor:
    """Reduce the per-token losses; denominators count the original mask (dropped tokens count).

    `seq-mean-token-sum-norm` (Dr. GRPO) divides the sum over all tokens by rows x `norm_length`,
    a fixed length (the job's maxNewTokens), never by the padded width, which depends on the
    longest row of the batch. `loss_denominator` replaces this call's normaliser so micro-batch
    losses sum to the minibatch loss. Denominators stay tensors (no device sync). An empty batch,
    or an explicit 0 normaliser, gives 0 that is still in the graph, so a trainer can always call
    `backward()`.
    """
    row_tokens = mask.sum(dim=1)
    total = per_token.sum()
    denom: Tensor | float
    if aggregation == "token-mean":
        denom = mask.sum().clamp(min=1).to(per_token.dtype) if loss_denominator is None else loss_denominator
    elif aggregation == "seq-mean-token-mean":
        total = (per_token.sum(dim=1) / row_tokens.clamp(min=1).to(per_token.dtype)).sum()
        denom = ((row_tokens > 0).sum().clamp(min=1).to(per_token.dtype) if loss_denominator is None
                 else loss_denominator)
    else:  # seq-mean-token-sum-norm (Dr. GRPO): rows x a fixed length, whatever the padding
        denom = float(per_token.shape[0] * norm_length) if loss_denominator is None else loss_denominator
    return total / denom if (isinstance(denom, Tensor) or denom > 0) else total * 0.0


@dataclass(frozen=True)
class LossTerms:
    """What the loss was built from, handed to the metrics stage."""

    loss: Tensor
    keep: Tensor  # tokens in the numerator: the mask minus the behaviour cap and M2PO drops
    ratios: Ratios
    weight: BehaviourWeight
    surrogate: Surrogate
    m2: M2Mask
    proximal_s: float
    bounds: tuple[float, float] | None = None  # BAPO's ratio bounds (bapo set only)
    vcpo_sums: tuple[float, float, float] | None = None  # VCPO's weight sums (vcpo only)


# The stats computed on the device (in this order, one sync); m2_before/after and proximal_s follow.
_DEVICE_STAT_KEYS: tuple[str, ...] = (
    "loss", "tokens", "kept_tokens", "clip_fraction", "clip_fraction_low", "clip_fraction_high",
    "dual_clip_fraction", "behav_filtered_fraction", "importance_weight_max", "importance_weight_min",
    "importance_weight_mean", "full_ratio_max", "full_ratio_min", "full_ratio_mean",
    "behav_weight_max", "behav_weight_min", "behav_weight_mean", "behav_weight_sq_mean",
    "behav_ess", "behav_kl", "staleness_mean", "staleness_max", "m2_masked_fraction",
)

# exp() of float64 log-ratios for the metrics only: e^700 is finite in float64.
_METRIC_LOG_LIMIT = 700.0


def _masked_max(x: Tensor, sel: Tensor) -> Tensor:
    """float64 max of `x` over `sel`: -inf when `sel` is empty, 0 when `x` is (zeroed later)."""
    inf = torch.tensor(float("inf"), dtype=torch.float64, device=x.device)
    return torch.where(sel, x, -inf).amax() if x.numel() else inf.new_zeros(())


def _max_min_mean(x: Tensor, sel: Tensor) -> list[Tensor]:
    """[max, min, mean] of float64 `x` over `sel` (non-finite when `sel` is empty)."""
    count = sel.sum().to(torch.float64)
    return [_masked_max(x, sel), -_masked_max(-x, sel), torch.where(sel, x, 0.0).sum() / count]


def _ratio_exp(log_ratio: Tensor) -> Tensor:
    """A detached ratio in float64 for metrics (not clamped at LOG_RATIO_LIMIT: we want to see it)."""
    return log_ratio.detach().to(torch.float64).clamp(max=_METRIC_LOG_LIMIT).exp()


def behaviour_kl_k3(log_r: Tensor, mask: Tensor) -> Tensor:
    """Approximate KL between the current and the behaviour policy, k3 estimator, float64 scalar.

    `mean over mask of (rho - 1) - log rho` with `rho = pi_behav / pi = exp(-log_r)`: >= 0 on every
    token (no cancelling of signs as with the plain mean of log-ratios, k1) and `(log rho)^2 / 2`
    to second order when the two policies are close. Non-finite for an empty mask.
    """
    log_rho = -log_r.detach().to(torch.float64)
    k3 = log_rho.clamp(max=_METRIC_LOG_LIMIT).exp() - 1.0 - log_rho
    return torch.where(mask, k3, 0.0).sum() / mask.sum().to(torch.float64)


def behaviour_ess(w: Tensor, keep: Tensor) -> Tensor:
    """Effective sample size of the behaviour weights as a fraction, `(sum w)^2 / (n sum w^2)`.

    Over the kept tokens (n of them), with w as used (after its cap): 1 when every weight is equal
    (fresh data, or ppo), towards 1/n when one token carries all the weight. Non-finite when empty.
    """
    wk = torch.where(keep, w.detach().to(torch.float64), 0.0)
    return wk.sum().pow(2) / (keep.sum().to(torch.float64) * wk.pow(2).sum())


def _staleness(mask: Tensor, versions: Tensor | None, current_version: int | None) -> tuple[Tensor, Tensor]:
    """(generated tokens of the mask, staleness d >= 0 in float64); none without versions."""
    if versions is None or current_version is None:
        return torch.zeros_like(mask), torch.zeros(mask.shape, dtype=torch.float64, device=mask.device)
    st = (current_version - versions.to(torch.int64)).clamp(min=0).to(torch.float64)
    return mask & (versions >= 0), st


def loss_metrics(
    x: PolicyInputs, terms: LossTerms, versions: Tensor | None, current_version: int | None
) -> dict[str, float]:
    """STAT_KEYS as Python floats: float64, detached, one device sync, non-finite (empty) -> 0.

    Fractions are over the original mask count, so per-call stats weight by `tokens`.
    `importance_weight_*` is the trust-region ratio u = pi / pi_prox (AReaL's "importance
    weight"), `full_ratio_*` the full stale ratio r = pi / pi_behav = w u, both over the mask;
    `behav_weight_*` is w as used and `behav_ess` its effective sample size, over kept tokens
    (weight those by `kept_tokens`; `behav_weight_sq_mean` makes a step's ESS exact from
    per-call stats: mean_w^2 / mean_w2); `behav_kl` is `behaviour_kl_k3` over the mask.
    """
    f64 = torch.float64
    with torch.no_grad():
        m, keep = x.mask, terms.keep
        n = m.sum().to(f64).clamp(min=1)
        wk = torch.where(keep, terms.weight.w.detach().to(f64), 0.0)
        st_mask, st = _staleness(m, versions, current_version)
        n_st, n_keep = st_mask.sum().to(f64), keep.sum().to(f64)
        values = torch.stack([
            terms.loss.detach().to(f64),
            m.sum().to(f64),
            n_keep,
            terms.surrogate.clipped.sum().to(f64) / n,
            terms.surrogate.clipped_low.sum().to(f64) / n,
            terms.surrogate.clipped_high.sum().to(f64) / n,
            terms.surrogate.dual_clipped.sum().to(f64) / n,
            terms.weight.capped.sum().to(f64) / n,
            *_max_min_mean(_ratio_exp(terms.ratios.log_u), m),
            *_max_min_mean(_ratio_exp(terms.ratios.log_r), m),
            *_max_min_mean(wk, keep),
            wk.pow(2).sum() / n_keep,
            behaviour_ess(wk, keep),
            behaviour_kl_k3(terms.ratios.log_r, m),
            torch.where(st_mask, st, 0.0).sum() / n_st.clamp(min=1),
            _masked_max(st, st_mask),
            terms.m2.dropped.sum().to(f64) / n,
        ])
        finite = torch.where(torch.isfinite(values), values, 0.0).tolist()  # empty max -> 0
    stats = dict(zip(_DEVICE_STAT_KEYS, finite))
    stats.update(m2_before=terms.m2.before, m2_after=terms.m2.after, proximal_s=terms.proximal_s)
    if terms.bounds is not None:
        stats.update(zip(BAPO_STAT_KEYS, terms.bounds))
    if terms.vcpo_sums is not None:
        stats.update(zip(VCPO_STAT_KEYS, terms.vcpo_sums))
    return stats


# ------------------------------------------------------------------------------------ VCPO learning rate


def vcpo_weight_sums(log_w: Tensor, mask: Tensor) -> tuple[float, float, float]:
    """(sum w, sum w^2, n) over the sequences with a masked token, w = exp(sum_t log_w) per sequence.

    VCPO weighs whole trajectories: `log_w = lp_p - lp_b` (step-start policy over behaviour, before
    any cap), summed over each response. Sums, not the ESS, so micro-batches and ranks add up.
    """
    with torch.no_grad():
        m = _bool_mask(mask)
        seq = torch.where(m, log_w.detach().to(torch.float64), 0.0).sum(dim=1)[m.any(dim=1)]
        w = seq.clamp(-VCPO_LOG_LIMIT, VCPO_LOG_LIMIT).exp()
        s, q, n = torch.stack([w.sum(), w.pow(2).sum(), w.new_tensor(float(w.numel()))]).tolist()
    return s, q, n


def vcpo_ess_scale(w_sum: float, w_sq_sum: float, n: float, *, base_ess_ratio: float = VCPO_BASE_ESS_RATIO,
                  scaling: str = VCPO_SCALING) -> float:
    """VCPO's learning-rate multiplier: `sqrt(min(1, rho / rho_base))` (or linear), `rho = ESS / n`.

    `ESS = (sum w)^2 / (sum w^2 + 1e-8)`: n when all weights are equal (fresh data), towards 1 when one
    sequence carries them all; a stale minibatch then takes a smaller step. No sequence: 0 (as the code).
    """
    if scaling not in VCPO_SCALINGS:
        raise ValueError(f"vcpo scaling must be one of {VCPO_SCALINGS}, got {scaling!r}")
    ratio = (w_sum * w_sum / (w_sq_sum + VCPO_EPS)) / n if n > 0 else 0.0
    scale = min(1.0, ratio / max(float(base_ess_ratio), 1e-8))
    return math.sqrt(scale) if scaling == "sqrt" else scale


# ------------------------------------------------------------------------------------ VCPO baseline


def opob_advantages(rewards: Sequence[float], grad_sq_norms: Sequence[float], is_weights: Sequence[float],
                    group_sizes: Sequence[int], *, eps: float = VCPO_EPS) -> tuple[list[float], list[float]]:
    """VCPO's off-policy optimal baseline (OPOB) per group: advantages `(R_i - b) / std` and each
    group's `b`.

    `b = sum_i W_i R_i / (sum_i W_i + eps)`, `W_i = ||g_i||^2 w_i^2`: `g_i` the gradient of
    trajectory i's token-sum surrogate at advantage 1, `w_i` its sequence importance weight (proximal
    over behaviour). A trajectory whose score gradient is large or whose weight is large, the ones
    that dominate the update's variance, pulls the baseline towards its own reward. `std` is the
    group's population standard deviation of R (not divided when <= eps, as the code). A group with a
    non-finite W falls back to its plain mean (the code would propagate NaN).
    """
    if not len(rewards) == len(grad_sq_norms) == len(is_weights) == sum(group_sizes):
        raise ValueError(f"rewards ({len(rewards)}), grad_sq_norms ({len(grad_sq_norms)}) and is_weights "
                         f"({len(is_weights)}) must each have one entry per sequence of the groups "
                         f"({sum(group_sizes)})")
    advantages: list[float] = []
    baselines: list[float] = []
    start = 0
    for n in group_sizes:
        r = torch.tensor(rewards[start:start + n], dtype=torch.float64)
        w = (torch.tensor(grad_sq_norms[start:start + n], dtype=torch.float64)
             * torch.tensor(is_weights[start:start + n], dtype=torch.float64).pow(2))
        b = float((r * w).sum() / (w.sum() + eps)) if bool(torch.isfinite(w).all()) else float(r.mean())
        std = float(r.to(torch.float32).std(unbiased=False)) if n > 1 else 0.0
        scale = 1.0 / std if std > eps else 1.0
        advantages.extend(((r - b) * scale).tolist())
        baselines.append(b)
        start += n
    return advantages, baselines


# ------------------------------------------------------------------------------------ policy loss: checks


TensorKind = Literal["float", "int", "mask"]


def _check_tensor(name: str, t: Any, shape: torch.Size, *, kind: TensorKind, device: torch.device,
                  allow_row: bool = False) -> Tensor:
    """`t` is a tensor on `device` shaped like logprobs (or `[B]`), of the expected dtype family."""
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but logprobs is on {device}")
    ok_shape = t.shape == shape or (allow_row and t.dim() == 1 and t.shape[0] == shape[0])
    if not ok_shape:
        extra = " or [B]" if allow_row else ""
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(shape)}{extra} like logprobs")
    if kind == "float" and not t.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if kind == "int" and (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool):
        raise ValueError(f"{name} must be an integer tensor (-1 where not generated), got {t.dtype}")
    if kind == "mask" and t.is_complex():
        raise ValueError(f"mask must be bool or 0/1 numbers, got {t.dtype}")
    return t


def _check_tensors(logprobs: Any, behav_logprobs: Any, advantages: Any, mask: Any, versions: Any,
                   loss_denominator: float | None) -> None:
    """Types, shapes, dtypes and devices of `policy_loss`'s tensors, and the denominator."""
    if not isinstance(logprobs, Tensor):
        raise ValueError(f"logprobs must be a torch.Tensor, got {type(logprobs).__name__}")
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got shape {tuple(logprobs.shape)}")
    if not logprobs.is_floating_point():
        raise ValueError(f"logprobs must be a floating-point tensor, got {logprobs.dtype}")
    shape, dev = logprobs.shape, logprobs.device
    _check_tensor("behav_logprobs", behav_logprobs, shape, kind="float", device=dev)
    _check_tensor("advantages", advantages, shape, kind="float", device=dev, allow_row=True)
    _check_tensor("mask", mask, shape, kind="mask", device=dev)
    if versions is not None:
        _check_tensor("versions", versions, shape, kind="int", device=dev)
    if loss_denominator is not None and not (loss_denominator >= 0 and math.isfinite(loss_denominator)):
        raise ValueError(f"loss_denominator must be a finite number >= 0, got {loss_denominator!r}")


def _check_proximal_inputs(config: LossConfig, logprobs: Tensor, mask: Tensor, versions: Tensor | None,
                           current_version: Any, prox_logprobs: Any) -> None:
    """What the configured proximal method needs: `prox_logprobs`, or versions on every masked token."""
    decoupled = config.loss == "decoupled"
    if decoupled and config.proximal == "recompute":
        if prox_logprobs is None:
            raise ValueError("prox_logprobs is required for proximal='recompute'")
        _check_tensor("prox_logprobs", prox_logprobs, logprobs.shape, kind="float", device=logprobs.device)
    if decoupled and config.proximal == "loglinear":
        if versions is None or current_version is None:
            raise ValueError("versions and current_version are required for proximal='loglinear'")
        if bool((versions[_bool_mask(mask)] < 0).any()):
            raise ValueError("versions is -1 (not generated) on a token that mask includes")


def _as_version(current_version: Any) -> int | None:
    """`current_version` as a Python int (any integer type but bool), or None."""
    if current_version is None:
        return None
    if not isinstance(current_version, bool):
        try:
            return operator.index(current_version)
        except TypeError:
            pass
    raise ValueError(f"current_version must be an int, got {current_version!r}")


# ------------------------------------------------------------------------------------ policy loss


def policy_loss(
    logprobs: Tensor,
    behav_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    config: LossConfig,
    versions: Tensor | None = None,
    current_version: int | None = None,
    prox_logprobs: Tensor | None = None,
    loss_denominator: float | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """The policy loss of one (micro-)batch and its metrics; grad flows through `logprobs` only.

    All tensors are `[B, T]` and aligned (`advantages` may also be `[B]`, broadcast per sequence).
    `versions` (int, -1 where not generated) and `current_version` are required for
    `proximal="loglinear"` and feed the staleness metrics; `prox_logprobs` is required for
    `proximal="recompute"`. Values at positions outside `mask` are ignored (may be NaN/Inf).

    `loss_denominator` replaces this call's own normaliser so that micro-batch losses add up to the
    exact minibatch loss: the total mask count of the minibatch (token-mean), its number of
    non-empty sequences (seq-mean-token-mean), or its rows x `config.max_new_tokens`
    (seq-mean-token-sum-norm). Default None: this call alone.
    """
    # ---- 0. checks (a ValueError naming the argument, before any arithmetic), then sanitised inputs
    if not isinstance(config, LossConfig):
        raise ValueError(f"config must be a LossConfig, got {type(config).__name__}")
    _check_tensors(logprobs, behav_logprobs, advantages, mask, versions, loss_denominator)
    _check_proximal_inputs(config, logprobs, mask, versions, current_version, prox_logprobs)
    version = _as_version(current_version)
    x = prepare_inputs(logprobs, behav_logprobs, advantages, mask)

    # ---- 1. proximal log-probs lp_p: behaviour (ppo), recomputed forward, or A-3PO log-linear
    prox = proximal_logprobs(x, config, versions=versions, current_version=version, prox_logprobs=prox_logprobs)

    # ---- 2. ratios: u = exp(lp - lp_p) with grad (trust region), log w = lp_p - lp_b detached
    ratios = compute_ratios(x.lp, prox.logprobs, x.lp_b)

    # ---- 3. behaviour-weight cap (decoupled): mask or clamp w, per token or per sequence
    weight = cap_behaviour_weight(ratios.log_w, x.mask, config)

    # ---- 4. objective on u: PPO clip and dual clip (M2PO: the unclipped -A u), GSPO, CISPO or SAPO;
    #         BAPO first picks this call's clip bounds from the detached u, w and advantages
    bounds = (bapo_bounds(x.adv, ratios.u, weight.w, weight.keep, config.bapo)
              if config.bapo is not None else None)
    surrogate = policy_objective(x, ratios, weight.keep, config, bounds)

    # ---- 5. M2PO mask: drop the largest (log r)^2 (full ratio pi/pi_b) until their mean is <= tau
    m2 = m2po_trust_region(ratios.log_r, x.adv, weight.keep, config)
    keep = weight.keep & ~m2.dropped
    per_token = torch.where(keep, weight.w * surrogate.per_token, x.lp.new_zeros(()))

    # ---- 6. aggregation over the original mask count (or the caller's minibatch denominator)
    loss = aggregate(per_token, x.mask, config.aggregation, loss_denominator, norm_length=config.max_new_tokens)

    # ---- 7. metrics: float64, detached, one device sync
    vcpo_sums = vcpo_weight_sums(ratios.log_w, x.mask) if config.vcpo.ess_scaling else None
    terms = LossTerms(loss=loss, keep=keep, ratios=ratios, weight=weight, surrogate=surrogate, m2=m2,
                      proximal_s=prox.seconds, bounds=bounds, vcpo_sums=vcpo_sums)
    return loss, loss_metrics(x, terms, versions, version)
