"""Trajectory balance (`objective: tb`, TBA): the loss of trajectory_balance.py fed per micro-batch.

Per step: log pi_ref of every response (the frozen reference model's for the fresh groups; the
replay buffer kept the replayed groups'). Per update: log Z of each group at the weights about to
change (detached, as TBA's), from a no-grad pass over the minibatch first, because a group's
sequences may sit in different micro-batches.
"""

from __future__ import annotations

import math
from typing import Any

from torch import Tensor

from asyncrl.api.spec import AlgorithmSpec
from asyncrl.trainer.step.batch import TrainBatch
from asyncrl.trainer.step.objectives.base import StepData
from asyncrl.trainer.step.plan import MinibatchPlan, group_sizes
from asyncrl.trainer.step.trajectory_balance import group_log_z, tb_beta, trajectory_balance_loss


class TrajectoryBalance:
    """TB's squared residuals, beta annealed by step (`tb.beta` -> `tb.betaFinal`)."""

    def __init__(self, algo: AlgorithmSpec, reference_model: Any):
        if reference_model is None:
            raise ValueError("objective 'tb' needs the frozen reference model (reference_model)")
        self.algo = algo
        self.reference_model = reference_model
        self.step: StepData | None = None
        self.beta = algo.tb.beta
        self.log_z: dict[int, float] = {}
        self.log_zs: list[float] = []
        self.residual_sq = 0.0

    def prepare(self, step: StepData) -> None:
        algo = self.algo
        self.step, self.log_zs, self.residual_sq = step, [], 0.0
        self.beta = tb_beta(step.step, algo.tb.beta, algo.tb.beta_final, algo.tb.beta_anneal_steps)
        seqs, fresh = step.seqs, step.fresh
        for s, ref in zip(seqs[fresh:], (x for r in step.replayed for x in r.ref_sums), strict=True):
            s.ref_sum = ref
        refs = step.forward.sequence_sums(seqs, list(range(fresh)), model=self.reference_model)
        for i, ref in refs.items():
            seqs[i].ref_sum = ref

    def prepare_update(self, m: int, plan: MinibatchPlan) -> None:
        step = self.step
        assert step is not None
        seqs, rows = step.seqs, plan.rows
        sums = step.forward.sequence_sums(seqs, rows)
        self.log_z = dict(zip(rows, group_log_z(
            [sums[i] for i in rows], [seqs[i].ref_sum for i in rows], [seqs[i].reward for i in rows],
            group_sizes(step.trained, rows), self.beta), strict=True))
        self.log_zs += list(self.log_z.values())

    def loss(self, m: int, k: int, rows: list[int], batch: TrainBatch, logprobs: Tensor,
             denominator: float) -> tuple[Tensor, dict[str, float]]:
        assert self.step is not None
        seqs = self.step.seqs
        ref, rewards, log_z = (logprobs.new_tensor(column) for column in zip(
            *[(seqs[i].ref_sum, seqs[i].reward, self.log_z[i]) for i in rows]))
        loss, stats = trajectory_balance_loss(logprobs, batch.behav_logprobs, batch.loss_mask, ref, rewards, log_z,
                                              beta=self.beta, denominator=denominator)
        self.residual_sq += stats["tb_residual_sq_sum"]
        return loss, stats

    def lr_scale(self) -> float:
        return 1.0

    def figures(self) -> dict[str, float]:
        """beta; log Z: mean over the step's sequences of their group's; residual: root mean square."""
        n = len(self.step.seqs) if self.step is not None else 0
        return {"tb_beta": self.beta,
                "tb_log_z_mean": sum(self.log_zs) / len(self.log_zs) if self.log_zs else 0.0,
                "tb_residual_rms": math.sqrt(self.residual_sq / n) if n else 0.0}
