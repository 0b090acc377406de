"""Loss tests that go through the trainer's step metrics: micro-batches in, a metrics.jsonl line out."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from asyncrl.trainer.distributed import DistContext
from asyncrl.trainer.report.metrics_file import append_metrics_line, metrics_line
from asyncrl.trainer.step.losses import LossConfig, policy_loss
from asyncrl.trainer.step.plan import TrainSequence
from asyncrl.trainer.step.stats import StepStats, summarize_step


def step_over_micro_batches(path: Path, lp: torch.Tensor, lp_b: torch.Tensor, adv: torch.Tensor,
                            mask: torch.Tensor, config: LossConfig, parts: list[Any], *,
                            prox: torch.Tensor | None = None) -> tuple[StepStats, dict[str, Any]]:
    """`policy_loss` on each part (an index into the `[B, T]` tensors: rows or columns) with the whole
    batch's token count as the denominator, as the trainer splits a minibatch; then the step's
    metrics.jsonl line written as the trainer writes it. Returns the stats and the line read back."""
    stats = StepStats()
    for part in parts:
        loss, figures = policy_loss(lp[part], lp_b[part], adv[part], mask[part], config=config,
                                    prox_logprobs=None if prox is None else prox[part],
                                    loss_denominator=float(mask.sum()))
        batch = SimpleNamespace(num_tokens=int(mask[part].sum()), loss_mask=mask[part])
        stats.add_micro_batch(loss, figures, torch.zeros(mask[part].shape), batch)
    stats.grad_norms.append(1.0)
    width = lp.shape[1]
    seqs = [TrainSequence(np.arange(2), np.arange(width), np.zeros(width), np.zeros(width, dtype=int), 1.0)]
    record = summarize_step(stats, seqs, [], step=1, version=0, ctx=DistContext())
    append_metrics_line(path, record)
    line = json.loads(path.read_text())
    assert line == metrics_line(record)
    return stats, line
