"""Policy-gradient math for async RL: group advantages, (decoupled) PPO, A-3PO proximal, M2PO.

Everything here works on tensors that are already aligned (position t scores token t, see
`asyncrl.trainer.batch`) and is pure: no model, no I/O. The rules, and the choices made where
papers and reference code disagree, are written down in docs/algorithms.md (DESIGN.md section 5).

Notation per token: `lp` current policy (with grad), `lp_b` behaviour (engine), `lp_p` proximal,
`A` advantage, `m` loss mask; `u = exp(lp - lp_p)` trust-region ratio, `w = exp(lp_p - lp_b)`
behaviour weight (always detached).
"""

from __future__ import annotations

import math
import operator
import time
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch
from torch import Tensor

Estimator = Literal["grpo", "dr_grpo", "rloo"]
LossKind = Literal["ppo", "decoupled"]
ProximalMethod = Literal["recompute", "loglinear"]
OnPolicyRule = Literal["current", "behave"]
CapMode = Literal["mask", "clamp"]
CapLevel = Literal["token", "sequence"]
M2Scope = Literal["all", "harmful"]
Aggregation = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"]

ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo")
AGGREGATIONS: tuple[str, ...] = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")

# Log-ratios entering exp() with grad are clamped to +-LOG_RATIO_LIMIT nats (ratio ~4.9e8): beyond
# that a float32 loss (ratio x advantage x tokens) can overflow. Tokens past the limit get no
# gradient through the ratio; they are pathological and the behaviour cap drops them by default.
LOG_RATIO_LIMIT = 20.0

STAT_KEYS: tuple[str, ...] = (
    "loss", "tokens", "kept_tokens", "clip_fraction", "dual_clip_fraction",
    "behav_filtered_fraction", "importance_weight_max", "importance_weight_min",
    "importance_weight_mean", "behav_weight_max", "behav_weight_mean", "staleness_mean",
    "staleness_max", "m2_before", "m2_after", "m2_masked_fraction", "proximal_s",
)


# ------------------------------------------------------------------------------------ advantages


def compute_advantages(
    rewards: Tensor, group_size: int, estimator: Estimator = "grpo", eps: float = 1e-6
) -> Tensor:
    """Per-sample advantages from outcome rewards laid out group by group (`[g0s0, g0s1, ...]`).

    grpo: `(R - mean_g) / (std_g + eps)` with the unbiased std; dr_grpo: `R - mean_g`;
    rloo: `R - mean of the other samples of the group`. A group whose rewards are all equal carries
    no signal and gets exactly 0 (not rounding noise divided by eps). Computed in float64, returned
    in the rewards' floating dtype (float32 for integer rewards), detached.
    """
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
    """Which policy objective to use; one-to-one with the job's `spec.algorithm` loss fields.

    `kind="ppo"` ignores `proximal`/`loglinear_on_policy`/behaviour cap (the behaviour policy is
    the proximal, w = 1). `behav_cap=None` removes the behaviour weight entirely (w = 1).
    """

    kind: LossKind = "decoupled"
    proximal: ProximalMethod = "loglinear"
    loglinear_on_policy: OnPolicyRule = "current"
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    dual_clip: float | None = None
    behav_cap: float | None = 5.0
    behav_mode: CapMode = "mask"
    behav_level: CapLevel = "token"
    m2_threshold: float | None = None
    m2_scope: M2Scope = "all"
    aggregation: Aggregation = "token-mean"

    def __post_init__(self) -> None:
        choices = {
            "kind": ("ppo", "decoupled"), "proximal": ("recompute", "loglinear"),
            "loglinear_on_policy": ("current", "behave"), "behav_mode": ("mask", "clamp"),
            "behav_level": ("token", "sequence"), "m2_scope": ("all", "harmful"),
            "aggregation": AGGREGATIONS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"LossConfig.{name} must be one of {allowed}, got {getattr(self, name)!r}")
        if not 0 < self.eps_clip < 1:
            raise ValueError(f"LossConfig.eps_clip must be in (0, 1), got {self.eps_clip!r}")
        if self.eps_clip_high is not None and not self.eps_clip_high > 0:
            raise ValueError(f"LossConfig.eps_clip_high must be > 0, got {self.eps_clip_high!r}")
        if self.dual_clip is not None and not self.dual_clip > 1:
            raise ValueError(f"LossConfig.dual_clip must be > 1, got {self.dual_clip!r}")
        if self.behav_cap is not None and not self.behav_cap >= 1:
            raise ValueError(f"LossConfig.behav_cap must be >= 1, got {self.behav_cap!r}")
        if self.m2_threshold is not None and not self.m2_threshold > 0:
            raise ValueError(f"LossConfig.m2_threshold must be > 0, got {self.m2_threshold!r}")

    @property
    def eps_high(self) -> float:
        """Upper clip epsilon (clip-higher), `eps_clip` when unset."""
        return self.eps_clip if self.eps_clip_high is None else self.eps_clip_high

    @classmethod
    def from_spec(cls, spec: Any) -> "LossConfig":
        """Map an `asyncrl.spec.AlgorithmSpec` (or anything with its attribute names) onto a config."""
        mapping = {
            "kind": "loss", "proximal": "proximal", "loglinear_on_policy": "loglinear_on_policy",
            "eps_clip": "clip_eps", "eps_clip_high": "clip_eps_high", "dual_clip": "dual_clip",
            "behav_cap": "behaviour_cap", "behav_mode": "behaviour_cap_mode",
            "behav_level": "behaviour_cap_level", "m2_threshold": "m2_threshold",
            "m2_scope": "m2_scope", "aggregation": "aggregation",
        }
        missing = [src for src in mapping.values() if not hasattr(spec, src)]
        if missing:
            raise ValueError(
                f"{type(spec).__name__} is not an AlgorithmSpec: missing {', '.join(missing)}")
        return cls(**{dst: getattr(spec, src) for dst, src in mapping.items()})

    def to_dict(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


# ------------------------------------------------------------------------------------ proximal


def loglinear_proximal(
    behav_logprobs: Tensor,
    logprobs: Tensor,
    versions: Tensor,
    current_version: int,
    *,
    on_policy: OnPolicyRule = "current",
) -> Tensor:
    """A-3PO's staleness-aware proximal log-probs, detached: `lp_b + alpha * (lp - lp_b)`.

    d = current_version - version; alpha = 1 - 1/d for d >= 1 (d = 1 gives the behaviour policy,
    large d approaches the current policy). At d = 0 the proximal is the current policy
    (`on_policy="current"`, the paper) or the behaviour policy (`"behave"`, AReaL's code).
    Positions with a negative version (prompt, padding) get the behaviour log-prob. Cost: a few
    elementwise ops, no forward pass.
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


# ------------------------------------------------------------------------------------ policy loss


def _check_tensor(name: str, t: Any, shape: torch.Size, *, kind: str, device: torch.device,
                  allow_row: bool = False) -> Tensor:
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
    non-empty sequences (seq-mean-token-mean), or the length normaliser (seq-mean-token-sum-norm;
    default the padded length T). Default None: this call alone.
    """
    if not isinstance(config, LossConfig):
        raise ValueError(f"config must be a LossConfig, got {type(config).__name__}")
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

    decoupled = config.kind == "decoupled"
    use_loglinear = decoupled and config.proximal == "loglinear"
    if decoupled and config.proximal == "recompute":
        if prox_logprobs is None:
            raise ValueError("prox_logprobs is required for proximal='recompute'")
        _check_tensor("prox_logprobs", prox_logprobs, shape, kind="float", device=dev)
    if use_loglinear and (versions is None or current_version is None):
        raise ValueError("versions and current_version are required for proximal='loglinear'")

    m = mask if mask.dtype == torch.bool else mask != 0
    if use_loglinear and bool((versions[m] < 0).any()):
        raise ValueError("versions is -1 (not generated) on a token that mask includes")
    if current_version is not None:
        try:
            if isinstance(current_version, bool):
                raise TypeError
            current_version = operator.index(current_version)
        except TypeError:
            raise ValueError(f"current_version must be an int, got {current_version!r}") from None

    cdtype = torch.promote_types(logprobs.dtype, torch.float32)
    zero = torch.zeros((), dtype=cdtype, device=dev)
    # Sanitise: masked-out positions may hold padding garbage (NaN, -inf); where() keeps them out
    # of both the forward values and the gradient.
    lp = torch.where(m, logprobs.to(cdtype), zero)
    lp_b = torch.where(m, behav_logprobs.detach().to(cdtype), zero)
    adv = advantages.detach().to(cdtype)
    if adv.dim() == 1:
        adv = adv.unsqueeze(1).expand(shape)
    adv = torch.where(m, adv, zero)

    proximal_s = 0.0
    if not decoupled:
        lp_p = lp_b
    elif use_loglinear:
        t0 = time.perf_counter()
        lp_p = loglinear_proximal(lp_b, lp, versions, int(current_version),
                                  on_policy=config.loglinear_on_policy)
        proximal_s = time.perf_counter() - t0
    else:
        lp_p = torch.where(m, prox_logprobs.detach().to(cdtype), zero)

    n_tokens = m.sum()
    row_tokens = m.sum(dim=1)

    # ---- behaviour weight w = exp(lp_p - lp_b), detached, capped (decoupled only)
    log_w = (lp_p - lp_b).detach()
    keep = m.clone()
    truncated = torch.zeros_like(m)
    if decoupled and config.behav_cap is not None:
        log_cap = math.log(config.behav_cap)
        if config.behav_level == "sequence":  # geometric mean of w over the response
            seq_log_w = (log_w * m).sum(dim=1) / row_tokens.clamp(min=1)
            log_w = torch.where(m, seq_log_w.unsqueeze(1).expand(shape), zero)
        over = m & (log_w > log_cap)
        if config.behav_mode == "mask":
            keep = m & ~over
        else:
            truncated = over
            log_w = log_w.clamp(max=log_cap)
        w = torch.where(keep, log_w.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp(), zero)
        filtered = over
    else:
        w = torch.where(m, torch.ones_like(lp), zero)
        filtered = torch.zeros_like(m)

    # ---- trust-region ratio u = exp(lp - lp_p) (with grad through lp)
    log_u = lp - lp_p.detach()
    u = log_u.clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()

    m2_before = m2_after = 0.0
    m2_dropped = torch.zeros_like(m)
    clipped_strict = torch.zeros_like(m)
    dual_strict = torch.zeros_like(m)
    if config.m2_threshold is not None:
        # M2PO: second-moment mask, then the unclipped objective -M * r * A (times w if decoupled).
        if config.m2_scope == "all":
            candidates = keep
        else:  # "harmful": the ratio already moved the way A pushes it (PPO would clip these)
            candidates = keep & (((adv > 0) & (log_u > 0)) | ((adv < 0) & (log_u < 0)))
        m2_dropped, m2_before, m2_after = m2po_mask(log_u, candidates, config.m2_threshold)
        keep = keep & ~m2_dropped
        per_token = -adv * u
    else:
        lo, hi = 1.0 - config.eps_clip, 1.0 + config.eps_high
        unclipped = -adv * u
        clipped = -adv * u.clamp(lo, hi)
        per_token = torch.maximum(unclipped, clipped)
        clipped_strict = keep & (clipped > unclipped).detach()
        if config.dual_clip is not None:
            bound = config.dual_clip * adv.abs()
            dual_strict = keep & (adv < 0) & (per_token > bound).detach()
            per_token = torch.where(adv < 0, torch.minimum(per_token, bound), per_token)
    per_token = torch.where(keep, w * per_token, zero)

    # ---- aggregation (denominators keep the original mask counts; tensors, so no device sync)
    total = per_token.sum()
    if config.aggregation == "token-mean":
        denom = n_tokens.clamp(min=1).to(cdtype) if loss_denominator is None else loss_denominator
    elif config.aggregation == "seq-mean-token-mean":
        total = (per_token.sum(dim=1) / row_tokens.clamp(min=1).to(cdtype)).sum()
        denom = ((row_tokens > 0).sum().clamp(min=1).to(cdtype) if loss_denominator is None
                 else loss_denominator)
    else:  # seq-mean-token-sum-norm (Dr. GRPO): divide by the padded length T
        denom = float(shape[1]) if loss_denominator is None else loss_denominator
    # an empty batch, or an explicit 0 normaliser, gives 0 (still in the graph for backward)
    loss = total / denom if (isinstance(denom, Tensor) or denom > 0) else total * 0.0

    # ---- metrics: float64, detached, one device sync; fractions over the original mask count
    with torch.no_grad():
        f64 = torch.float64
        n = n_tokens.to(f64).clamp(min=1)
        iw = (lp - lp_b).detach().to(f64).clamp(max=700.0).exp()  # pi / pi_behav
        wk = w.detach().to(f64)
        inf = torch.tensor(float("inf"), dtype=f64, device=dev)
        if versions is not None and current_version is not None:
            st_mask = m & (versions >= 0)
            st = (current_version - versions.to(torch.int64)).clamp(min=0).to(f64)
        else:
            st_mask, st = torch.zeros_like(m), torch.zeros(shape, dtype=f64, device=dev)
        n_st = st_mask.sum().to(f64)
        n_keep = keep.sum().to(f64)

        def masked_max(x: Tensor, sel: Tensor) -> Tensor:
            return torch.where(sel, x, -inf).amax() if x.numel() else inf.new_zeros(())

        values = torch.stack([
            loss.detach().to(f64),
            n_tokens.to(f64),
            n_keep,
            clipped_strict.sum().to(f64) / n,
            dual_strict.sum().to(f64) / n,
            (filtered if config.behav_mode == "mask" else truncated).sum().to(f64) / n,
            masked_max(iw, m),
            -masked_max(-iw, m),
            torch.where(m, iw, 0.0).sum() / n,
            masked_max(wk, keep),
            torch.where(keep, wk, 0.0).sum() / n_keep.clamp(min=1),
            torch.where(st_mask, st, 0.0).sum() / n_st.clamp(min=1),
            masked_max(st, st_mask),
            m2_dropped.sum().to(f64) / n,
        ])
        values = torch.where(torch.isfinite(values), values, 0.0).tolist()  # empty max -> 0
        names = ("loss", "tokens", "kept_tokens", "clip_fraction", "dual_clip_fraction",
                 "behav_filtered_fraction", "importance_weight_max", "importance_weight_min",
                 "importance_weight_mean", "behav_weight_max", "behav_weight_mean",
                 "staleness_mean", "staleness_max", "m2_masked_fraction")
        stats = dict(zip(names, values))
        stats.update(m2_before=m2_before, m2_after=m2_after, proximal_s=proximal_s)
    return loss, stats
