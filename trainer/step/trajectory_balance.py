"""Trajectory balance, the objective of TBA (Trajectory Balance with Asynchrony, arXiv 2503.18929).

TB asks each trajectory y of a prompt x to satisfy `log Z(x) + log pi(y|x) = log pi_ref(y|x) + R(y)/beta`:
at the optimum pi is pi_ref tilted by exp(R / beta), the KL-regularised RL optimum. It has no
importance ratio: a residual is defined for any trajectory whatever policy sampled it, which is why
TBA trains from stale and replayed data without a correction. As in the authors' code
(bbartoldson/TBA, `src/tba_trainer_gsm8k.py`), log Z is not learned: per group it is the VarGrad
estimate `mean_j(R_j/beta - log pi(y_j) + log pi_ref(y_j))` at the current weights, detached, and the
loss is the mean squared residual. Everything here is pure math on per-sequence sums.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from asyncrl.trainer.step.losses import behaviour_kl_k3


def tb_beta(step: int, start: float, final: float | None, anneal_steps: int) -> float:
    """beta for the update of 1-based `step`: linear from `start` to `final` over `anneal_steps` steps,
    then `final` (TBA's kl_coef anneal, stop and target iteration equal); constant without `final`."""
    if final is None:
        return start
    t = min(max(step - 1, 0) / anneal_steps, 1.0)
    return final * t + start * (1.0 - t)


def sequence_sums(logprobs: Tensor, mask: Tensor) -> Tensor:
    """`[B]` sums of the masked per-token log-probs (log pi(y|x) of each response); grad flows."""
    return torch.where(mask.bool(), logprobs, logprobs.new_zeros(())).sum(dim=1)


def group_log_z(policy_sums: Sequence[float], ref_sums: Sequence[float], rewards: Sequence[float],
                group_sizes: Sequence[int], beta: float) -> list[float]:
    """The VarGrad log-partition estimate of each sequence's group, one entry per sequence (in order):
    `mean_j(R_j/beta - log pi(y_j) + log pi_ref(y_j))` over the group."""
    if not len(policy_sums) == len(ref_sums) == len(rewards) == sum(group_sizes):
        raise ValueError(f"policy_sums ({len(policy_sums)}), ref_sums ({len(ref_sums)}) and rewards "
                         f"({len(rewards)}) must each have one entry per sequence of the groups ({sum(group_sizes)})")
    if not beta > 0:
        raise ValueError(f"beta must be > 0, got {beta!r}")
    terms = (torch.tensor(rewards, dtype=torch.float64) / beta - torch.tensor(policy_sums, dtype=torch.float64)
             + torch.tensor(ref_sums, dtype=torch.float64))
    out: list[float] = []
    for chunk in torch.split(terms, list(group_sizes)):
        out.extend([float(chunk.mean())] * len(chunk))
    return out


def tb_residuals(policy_sums: Tensor, ref_sums: Tensor, rewards: Tensor, log_z: Tensor, beta: float) -> Tensor:
    """`log Z + log pi(y) - log pi_ref(y) - R/beta` per sequence (grad through `policy_sums` only)."""
    return log_z.detach() + policy_sums - ref_sums.detach() - rewards / beta


def tb_loss(policy_sums: Tensor, ref_sums: Tensor, rewards: Tensor, log_z: Tensor, beta: float,
            denominator: float) -> tuple[Tensor, Tensor]:
    """(sum of squared residuals / `denominator`, the detached residuals): with `denominator` the
    minibatch's sequence count, micro-batch losses add up to the authors' mean over the minibatch."""
    if not denominator > 0:
        raise ValueError(f"denominator must be > 0, got {denominator!r}")
    residuals = tb_residuals(policy_sums, ref_sums, rewards, log_z, beta)
    return residuals.pow(2).sum() / denominator, residuals.detach()


def trajectory_balance_loss(logprobs: Tensor, behav_logprobs: Tensor, mask: Tensor, ref_sums: Tensor,
                            rewards: Tensor, log_z: Tensor, beta: float,
                            denominator: float) -> tuple[Tensor, dict[str, float]]:
    """One micro-batch's TB loss (`tb_loss` on the responses' sums of `[B, T]` `logprobs`) and its
    figures: tokens, the sum of squared residuals, and how far the policy has moved from the
    behaviour policy (`behav_kl`, k3), which TB does not correct for but a reader of staleness wants."""
    m = mask.bool()
    loss, residuals = tb_loss(sequence_sums(logprobs, m), ref_sums, rewards, log_z, beta, denominator)
    with torch.no_grad():
        log_r = torch.where(m, logprobs.detach() - behav_logprobs, logprobs.new_zeros(()))
        kl = behaviour_kl_k3(log_r, m)
        tokens = float(m.sum())
    return loss, {"tokens": tokens, "kept_tokens": tokens, "behav_kl": float(kl) if tokens else 0.0,
                  "tb_residual_sq_sum": float(residuals.double().pow(2).sum())}
