"""VCPO's off-policy optimal baseline (`algorithm.vcpo.baseline`), wrapped around the policy gradient.

Before each update the advantages of the minibatch's sequences are replaced by the baseline of
`losses.opob_advantages`, which weighs each trajectory by the squared norm of its score gradient
at the current weights and by its importance weight; then the policy gradient trains as usual.
One process only (the spec says so): a trajectory's gradient norm is taken with a backward of its own.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from asyncrl.api.spec.families import VcpoSpec
from asyncrl.trainer.step.batch import TrainBatch
from asyncrl.trainer.step.losses import opob_advantages, policy_loss
from asyncrl.trainer.step.objectives.base import StepData
from asyncrl.trainer.step.objectives.policy_gradient import PolicyGradient
from asyncrl.trainer.step.plan import MinibatchPlan, group_sizes


class VcpoBaseline:
    """`inner` with its advantages replaced per update by VCPO's baseline."""

    def __init__(self, inner: PolicyGradient):
        self.inner = inner
        self.step: StepData | None = None
        self.shifts: list[float] = []
        """Each group's baseline minus its mean reward, over the step's updates."""

    def prepare(self, step: StepData) -> None:
        self.step, self.shifts = step, []
        self.inner.prepare(step)

    def prepare_update(self, m: int, plan: MinibatchPlan) -> None:
        self.shifts += self._replace_advantages(m, plan)
        self.inner.prepare_update(m, plan)

    def loss(self, m: int, k: int, rows: list[int], batch: TrainBatch, logprobs: Tensor,
             denominator: float) -> tuple[Tensor, dict[str, float]]:
        return self.inner.loss(m, k, rows, batch, logprobs, denominator)

    def lr_scale(self) -> float:
        return self.inner.lr_scale()

    def figures(self) -> dict[str, float]:
        """How far the baselines moved from the groups' plain means (mean absolute shift)."""
        shift = sum(abs(x) for x in self.shifts) / len(self.shifts) if self.shifts else 0.0
        return {**self.inner.figures(), "vcpo_baseline_shift": shift}

    def _replace_advantages(self, m: int, plan: MinibatchPlan) -> list[float]:
        """One forward and backward per trajectory gives the norm of its score gradient at the
        current weights (the loss at advantage 1, summed over its tokens, batch-dependent bounds
        and masks off) and its sequence weight; the minibatch's advantages are replaced. Returns
        each group's baseline minus its mean reward."""
        step = self.step
        assert step is not None
        fwd, seqs, model = step.forward, step.seqs, step.forward.model
        config = dataclasses.replace(self.inner.config, aggregation="token-mean", vcpo=VcpoSpec(ess_scaling=True),
                                     bapo=None, m2=None)
        norms: dict[int, float] = {}
        weights: dict[int, float] = {}
        for k, rows in enumerate(plan.rank_micro_batches()):
            p = self.inner.proximal.get((m, k))  # (recompute: the step-start log-probs; row r is i's)
            for r, i in enumerate(rows):  # one row at a time: a backward through a batch costs the batch
                batch, logprobs, _ = fwd.rows_logprobs(seqs, [i], with_entropy=False)
                loss, stats = policy_loss(
                    logprobs, batch.behav_logprobs, torch.ones_like(batch.advantages), batch.loss_mask,
                    config=config, versions=batch.versions, current_version=step.version,
                    prox_logprobs=None if p is None else p[r:r + 1, :logprobs.shape[1]], loss_denominator=1.0)
                model.zero_grad(set_to_none=True)
                loss.backward()
                norms[i] = float(torch.stack([q.grad.detach().double().pow(2).sum()
                                              for q in model.parameters() if q.grad is not None]).sum())
                weights[i] = stats["vcpo_w_sum"]
        model.zero_grad(set_to_none=True)
        rows = plan.rows
        sizes = group_sizes(step.trained, rows)
        rewards = [seqs[i].reward for i in rows]
        advantages, baselines = opob_advantages(rewards, [norms[i] for i in rows], [weights[i] for i in rows], sizes)
        for i, a in zip(rows, advantages, strict=True):
            seqs[i].advantage = a
        it = iter(rewards)
        means = [sum(next(it) for _ in range(n)) / n for n in sizes]
        return [b - mu for b, mu in zip(baselines, means, strict=True)]
