"""What every objective sees of a step, and the protocol it implements.

The step (trainer/step/update.py) owns the minibatch loop: forward, backward, clipping, the optimizer step
and the non-finite skip. An objective owns what is particular to its loss: work done once per
step before any update (a recomputed proximal policy, reference log-probs), work done once per
update before its first forward (VCPO's baseline, trajectory balance's log Z), the loss of one
micro-batch, a learning-rate scale for the update, and the figures it adds to the step's record.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from torch import Tensor

from asyncrl.trainer.step.batch import TrainBatch
from asyncrl.trainer.step.forward import ModelForward
from asyncrl.trainer.step.plan import MinibatchPlan, TrainSequence
from asyncrl.trainer.step.replay import ReplayedGroup
from asyncrl.trainer.step.stats import StepStats


@dataclass
class StepData:
    """One training step's data, identical on every rank (built from the broadcast groups)."""

    groups: list[Any]
    """The fresh trajectory groups (rewards, tokens and staleness are reported of these)."""
    replayed: list[ReplayedGroup]
    """Groups the replay buffer drew for this step (objective tb with algorithm.replay)."""
    seqs: list[TrainSequence]
    """Every trained sequence: the fresh groups' first, then the replayed groups'."""
    plans: list[MinibatchPlan]
    """One per optimizer update: the minibatch's rows and this rank's micro-batches."""
    version: int
    """The policy version being trained (the tokens' staleness is measured against it)."""
    step: int
    """The number of the step being trained (1 for the first)."""
    forward: ModelForward
    stats: StepStats = field(default_factory=StepStats)

    @property
    def trained(self) -> list[Any]:
        """Every trained group, in the order of `seqs`."""
        return [*self.groups, *(r.group for r in self.replayed)]

    @property
    def fresh(self) -> int:
        """How many of `seqs` are the fresh groups' (they come first)."""
        return sum(len(g.samples) for g in self.groups)


class Objective(Protocol):
    """A training objective: what the step calls, in this order, for each step."""

    def prepare(self, step: StepData) -> None:
        """Once per step, before any update: no-grad work over the whole step (every rank)."""

    def prepare_update(self, m: int, plan: MinibatchPlan) -> None:
        """Once per update `m`, before its first forward, at the weights it is about to change."""

    def loss(self, m: int, k: int, rows: list[int], batch: TrainBatch, logprobs: Tensor,
             denominator: float) -> tuple[Tensor, dict[str, float]]:
        """Micro-batch `k` of update `m`: its loss (normalised by the whole minibatch's
        `denominator`, so micro-batch losses add up) and its figures (step/stats.py StepStats)."""

    def lr_scale(self) -> float:
        """After update `m`'s backward, before its optimizer step: the learning-rate factor for the
        update (1.0 for most; a collective on every rank where the objective needs one)."""

    def figures(self) -> dict[str, float]:
        """After the step: the objective's own figures for the step's record."""
