"""The policy-gradient family: PPO-clip, GSPO, CISPO and SAPO on the coupled or decoupled ratio, the
proximal policy recomputed, log-linear (A-3PO) or the behaviour policy, and VCPO's ESS-scaled step.

The loss itself is `losses.policy_loss` (pure, tested against the authors' code); this module
feeds it per micro-batch and keeps what spans micro-batches: the recomputed proximal log-probs of
the step, and VCPO's sums of sequence weights over an update.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from asyncrl.api.spec import AlgorithmSpec
from asyncrl.trainer import distributed as D
from asyncrl.trainer.step.batch import TrainBatch
from asyncrl.trainer.step.losses import VCPO_STAT_KEYS, LossConfig, policy_loss, vcpo_ess_scale
from asyncrl.trainer.step.objectives.base import StepData
from asyncrl.trainer.step.plan import MinibatchPlan


class PolicyGradient:
    """`policy_loss` under the job's `LossConfig`."""

    def __init__(self, algo: AlgorithmSpec):
        self.algo = algo
        self.config = LossConfig.from_spec(algo)
        self.step: StepData | None = None
        self.proximal: dict[tuple[int, int], Tensor] = {}
        """`recompute`: the step-start log-probs per (update, micro-batch); else empty."""
        self._vcpo_sums = [0.0, 0.0, 0.0]  # this rank's sum w, sum w^2, sequences of the update
        self._scales: list[float] = []  # VCPO: the step's scale per update

    def prepare(self, step: StepData) -> None:
        self.step, self._scales = step, []
        t0 = time.perf_counter()
        self.proximal = self._recomputed_proximal(step)
        step.stats.proximal_seconds += time.perf_counter() - t0  # (log-linear's is added per micro-batch)

    def prepare_update(self, m: int, plan: MinibatchPlan) -> None:
        self._vcpo_sums = [0.0, 0.0, 0.0]

    def loss(self, m: int, k: int, rows: list[int], batch: TrainBatch, logprobs: Tensor,
             denominator: float) -> tuple[Tensor, dict[str, float]]:
        assert self.step is not None
        loss, stats = policy_loss(logprobs, batch.behav_logprobs, batch.advantages, batch.loss_mask,
                                  config=self.config, versions=batch.versions, current_version=self.step.version,
                                  prox_logprobs=self.proximal.get((m, k)), loss_denominator=denominator)
        self._vcpo_sums = [a + stats.get(key, 0.0) for a, key in zip(self._vcpo_sums, VCPO_STAT_KEYS, strict=True)]
        return loss, stats

    def lr_scale(self) -> float:
        """VCPO: one scale from the update's sums of every rank (a collective on every rank,
        whether the update is then skipped or not); 1.0 without VCPO."""
        if not self.algo.vcpo.ess_scaling:
            return 1.0
        assert self.step is not None
        scale = vcpo_ess_scale(*D.all_reduce_sum(self._vcpo_sums, self.step.forward.ctx),
                               base_ess_ratio=self.algo.vcpo.base_ess_ratio, scaling=self.algo.vcpo.scaling)
        self._scales.append(scale)
        return scale

    def figures(self) -> dict[str, float]:
        """VCPO: the learning-rate scale, the mean over the step's updates (none without VCPO)."""
        return {"vcpo_lr_scale": sum(self._scales) / len(self._scales)} if self._scales else {}

    def _recomputed_proximal(self, step: StepData) -> dict[tuple[int, int], Tensor]:
        """`recompute`: no-grad log-probs of the current weights per (update, micro-batch); else none.
        A rank with no rows left runs a padding forward (FSDP: every rank runs as many forwards)."""
        if not (self.config.loss == "decoupled" and self.config.proximal == "recompute"):
            return {}
        fwd = step.forward
        fwd.model.eval()
        with torch.no_grad():
            prox = {(m, k): fwd.rows_logprobs(step.seqs, rows, with_entropy=False)[1] if rows else fwd.pad()
                    for m, plan in enumerate(step.plans) for k, rows in enumerate(plan.rank_micro_batches())}
        fwd.model.train()
        return prox
