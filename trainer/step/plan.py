"""What one step trains, and in which pieces: plain bookkeeping, the same on every rank.

groups -> sequences with advantages (the group-wise estimator, then the optional token-weighted
batch normalisation) -> minibatches of whole groups (one optimizer update each) -> this rank's
micro-batches (every world-size-th sequence, longest first, the positions fed to the model <= the
token budget: rows x longest padded, the sum of lengths packed in one row), plus each minibatch's
loss normaliser over all ranks, so that the micro-batch losses add up to the exact minibatch loss
(`policy_loss(loss_denominator=...)`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from asyncrl.api.spec import AlgorithmSpec
from asyncrl.trainer.step.batch import Layout, first_fit, row_capacity
from asyncrl.trainer.step.losses import LossConfig, compute_advantages, normalize_advantages


@dataclass
class TrainSequence:
    """One sample flattened for the trainer (what `batch.build_batch` consumes)."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behav_logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    advantage: float = 0.0
    ref_sum: float = math.nan
    """log pi_ref of the response (objective tb): the reference model's, or kept by the replay buffer;
    NaN until known (a loss that read it unset would not be finite)."""

    loss_mask: np.ndarray | None = None
    """Per response token, True where the model generated it; False: context inside the response (a
    tool's output), fed to the model but outside the loss (batch.build_batch). None: all True."""

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    def trained(self) -> np.ndarray:
        """The response positions in the loss (all, without a mask)."""
        return np.ones(len(self.response_ids), dtype=bool) if self.loss_mask is None else self.loss_mask


@dataclass
class MinibatchPlan:
    """One optimizer update: its sequences (all ranks), this rank's micro-batches, the normaliser."""

    rows: list[int]
    """Indices into the step's sequences: the minibatch's whole groups, over all ranks."""
    micro_batches: list[list[int]]
    """This rank's share of `rows`, cut under the token budget (empty when it has none)."""
    loss_denominator: float
    """The whole minibatch's normaliser over all ranks (see `loss_denominator`)."""
    forwards: int = 1
    """Micro-batches of the rank that has the most (at least 1): every rank runs this many
    forwards, the ones past its own micro-batches on an empty one (FSDP's gathers are collectives)."""

    def rank_micro_batches(self) -> list[list[int]]:
        """This rank's micro-batches padded with empty ones to `forwards`."""
        return self.micro_batches + [[] for _ in range(self.forwards - len(self.micro_batches))]


def sequences_with_advantages(groups: list[Any], algo: AlgorithmSpec) -> list[TrainSequence]:
    """Flatten trajectory groups into sequences with per-sequence advantages (group-wise estimator)."""
    seqs: list[TrainSequence] = []
    for g in groups:
        rewards = torch.tensor([float(s.reward) for s in g.samples], dtype=torch.float32)
        adv = compute_advantages(rewards, len(g.samples), estimator=algo.advantage_estimator) \
            if len(g.samples) > 1 or algo.advantage_estimator == "dr_grpo" else torch.zeros_like(rewards)
        for s, a in zip(g.samples, adv.tolist()):
            seqs.append(TrainSequence(np.array(g.prompt_ids), np.array(s.response_ids),  # copies: decoded
                                      np.array(s.behav_logprobs), np.array(s.versions),  # arrays are read-only
                                      float(s.reward), float(a),
                                      loss_mask=_copied(getattr(s, "loss_mask", None))))
    if algo.batch_normalize_advantages and seqs:
        adv = normalize_advantages(torch.tensor([s.advantage for s in seqs], dtype=torch.float64),
                                   torch.tensor([float(s.trained().sum()) for s in seqs], dtype=torch.float64))
        for s, a in zip(seqs, adv.tolist()):
            s.advantage = a
    return seqs


def _copied(mask: Any) -> np.ndarray | None:
    return None if mask is None else np.array(mask, dtype=bool)


def plan_step(groups: list[Any], seqs: list[TrainSequence], algo: AlgorithmSpec, *, rank: int = 0,
              world_size: int = 1, layout: Layout = "padded") -> list[MinibatchPlan]:
    """The step's minibatches with this rank's micro-batches (budgeted for `layout`, the same on
    every rank) and each minibatch's normaliser."""
    # the one spec -> loss mapping, so normaliser and loss agree (trajectory balance: no policy loss)
    config = None if algo.objective == "tb" else LossConfig.from_spec(algo)
    plans = []
    for rows in minibatch_rows([len(g.samples) for g in groups], algo.minibatches):
        lengths = [seqs[i].length for i in rows]
        local = plan_microbatches(lengths, algo.micro_batch_tokens, rank=rank, world_size=world_size, layout=layout)
        forwards = max(len(plan_microbatches(lengths, algo.micro_batch_tokens, rank=r, world_size=world_size,
                                             layout=layout))
                       for r in range(world_size))
        plans.append(MinibatchPlan(rows, [[rows[j] for j in micro] for micro in local],
                                   loss_denominator(seqs, rows, config), max(forwards, 1)))
    return plans


def group_sizes(groups: list[Any], rows: list[int]) -> list[int]:
    """The sizes of the groups whose sequences `rows` (a minibatch's: whole groups, in order) are."""
    offsets = [0, *itertools.accumulate(len(g.samples) for g in groups)]
    chosen = set(rows)
    return [len(g.samples) for g, start in zip(groups, offsets) if start in chosen]


def minibatch_rows(group_sizes: list[int], count: int) -> list[list[int]]:
    """Sequence indices of `count` consecutive runs of whole groups (empty runs left out)."""
    offsets = [0, *itertools.accumulate(group_sizes)]
    n, per = len(group_sizes), len(group_sizes) // count or 1
    rows = [list(range(offsets[min(m * per, n)], offsets[min((m + 1) * per, n)])) for m in range(count)]
    return [r for r in rows if r]


def plan_microbatches(lengths: list[int], budget: int, *, rank: int = 0, world_size: int = 1,
                      layout: Layout = "padded") -> list[list[int]]:
    """This rank's micro-batches (indices into `lengths`): longest first, each feeding the model at
    most `budget` positions as `layout` lays it out (`batch.pack_rows`: rows x widest row; padded:
    rows x longest, packed in one row: the sum of lengths).

    The rank takes every world-size-th sequence of the longest-first order; a sequence longer than
    the budget still forms its own micro-batch. The rows are first-fit decreasing, as
    `batch.pack_rows` lays them out: sequences come longest first, so placing each as it comes is
    that rule, and the widest row is known as the micro-batch grows.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    micro: list[list[int]] = []
    current: list[int] = []
    fill: list[int] = []  # the current micro-batch's rows: positions used
    for i in order[rank::world_size]:
        n = lengths[i]
        j = first_fit(fill, n, row_capacity(layout, lengths[current[0]] if current else n))
        grown = [*fill, 0] if j == len(fill) else list(fill)
        grown[j] += n
        if current and len(grown) * max(grown) > budget:
            micro.append(current)
            current, grown = [], [n]
        current.append(i)
        fill = grown
    if current:
        micro.append(current)
    return micro


def loss_denominator(seqs: list[TrainSequence], rows: list[int], config: LossConfig | None) -> float:
    """The whole minibatch's normaliser (over all ranks), so micro-batch losses add up exactly.

    No config (objective tb): the minibatch's sequences, trajectory balance's mean over trajectories.
    token-mean: trained response tokens; seq-mean-token-mean: responses with a trained token; seq-mean-token-sum-norm
    (Dr. GRPO): rows x the fixed length `config.max_new_tokens` (maxNewTokens), what `aggregate` uses
    for a single call, never a padded width (which would depend on the longest row).
    """
    if config is None:
        return float(len(rows))
    if config.aggregation == "token-mean":
        return float(sum(int(seqs[i].trained().sum()) for i in rows))
    if config.aggregation == "seq-mean-token-mean":
        return float(sum(1 for i in rows if seqs[i].trained().any()))
    return float(len(rows) * config.max_new_tokens)
