"""One training step: the minibatch updates over the planned micro-batches, top to bottom.

    objective.prepare(step)                        # per step: recomputed proximal, reference log-probs
    for each minibatch m (one optimizer update):
        objective.prepare_update(m)                # VCPO's baseline, trajectory balance's log Z
        for each of this rank's micro-batches k:   # DDP all-reduces on the last one only
            loss = objective.loss(forward(k))      # normalised by the whole minibatch's denominator
            (loss * world_size).backward()         # DDP averages over ranks: this makes it the sum
        clip the gradient; scale the learning rate (VCPO); step AdamW, unless the norm is not finite

An update whose gradient norm is NaN or Inf is skipped: AdamW would spread it into every
parameter. The norm is taken after DDP's all-reduce, of gradients that are then identical on every
rank (a NaN on one rank reaches all of them), so every rank skips the same updates.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

from asyncrl.api.spec import AlgorithmSpec
from asyncrl.trainer import distributed as D
from asyncrl.trainer.step.forward import ModelForward
from asyncrl.trainer.step.objectives import Objective, StepData
from asyncrl.trainer.step.plan import MinibatchPlan, plan_step, sequences_with_advantages
from asyncrl.trainer.step.replay import ReplayedGroup
from asyncrl.trainer.step.stats import StepStats

log = logging.getLogger("asyncrl.trainer")


@dataclass(frozen=True)
class StepUpdates:
    """What the step's optimizer updates did."""

    updates: int
    skipped: int
    """Updates not applied: their gradient norm was not finite."""


def step_data(groups: list[Any], replayed: list[ReplayedGroup], algo: AlgorithmSpec, forward: ModelForward, *,
              version: int, step: int) -> StepData:
    """The step's sequences with their advantages and its plan: minibatches of whole groups, this
    rank's micro-batches under the token budget. Every rank computes the same from the same groups."""
    stats = StepStats()  # (starts the step's compute clock)
    trained = [*groups, *(r.group for r in replayed)]
    seqs = sequences_with_advantages(trained, algo)
    ctx = forward.ctx
    plans = plan_step(trained, seqs, algo, rank=ctx.rank, world_size=ctx.world_size, layout=forward.layout)
    return StepData(groups=groups, replayed=replayed, seqs=seqs, plans=plans, version=version, step=step,
                    forward=forward, stats=stats)


def train_updates(step: StepData, objective: Objective, optimizer: Any, *, grad_clip: float) -> StepUpdates:
    """Run the step's updates (identical decisions on every rank); figures go to `step.stats`."""
    model = step.forward.model
    objective.prepare(step)
    skipped = 0
    for m, plan in enumerate(step.plans):
        objective.prepare_update(m, plan)
        optimizer.zero_grad(set_to_none=True)
        accumulate_gradients(step, objective, m, plan)
        grad_norm = D.clip_grad_norm(model, grad_clip)
        step.stats.grad_norms.append(grad_norm)
        scale = objective.lr_scale()
        if math.isfinite(grad_norm):
            scaled_optimizer_step(optimizer, scale)
        else:  # (the gradients are zeroed before the next update and after the last)
            skipped += 1
            log.warning("step %d, minibatch %d/%d: gradient norm %s: update skipped (weights and optimizer "
                        "state unchanged)", step.step, m + 1, len(step.plans), grad_norm)
    optimizer.zero_grad(set_to_none=True)
    return StepUpdates(updates=len(step.plans), skipped=skipped)


def accumulate_gradients(step: StepData, objective: Objective, m: int, plan: MinibatchPlan) -> None:
    """Forward and backward this rank's micro-batches of update `m`; a rank with none left where
    another still has one runs a padding forward, scaled by 0 (it joins the collectives)."""
    fwd, ctx = step.forward, step.forward.ctx
    micro_batches = plan.rank_micro_batches()
    for k, rows in enumerate(micro_batches):
        # DDP all-reduces once per update: on the last micro-batch (FSDP reduce-scatters each).
        with D.no_sync_unless(fwd.model, k == len(micro_batches) - 1, ctx):
            if not rows:
                (fwd.pad() * 0.0).backward()
                continue
            batch, fed = fwd.batch(step.seqs, rows)
            logprobs, entropy = fwd.logprobs(batch, fed)
            loss, loss_stats = objective.loss(m, k, rows, batch, logprobs, plan.loss_denominator)
            (loss * ctx.world_size).backward()
            step.stats.add_micro_batch(loss, loss_stats, entropy, batch)
            step.stats.add_fed(fed.positions, sum(step.seqs[i].length for i in rows))


def scaled_optimizer_step(optimizer: Any, scale: float) -> None:
    """One optimizer step at `scale` times each group's learning rate; the base rates are restored
    after it (checkpoints and the next update keep them)."""
    base_lrs = [g["lr"] for g in optimizer.param_groups]
    for g, lr in zip(optimizer.param_groups, base_lrs, strict=True):
        g["lr"] = lr * scale
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, base_lrs, strict=True):
            g["lr"] = lr
