"""Trajectories -> padded training tensors, with logprobs, mask and versions shifted together.

A sequence is stored whole (`prompt + response`). The model's output at position t scores token
t + 1, so every per-token quantity of response token j (at position P + j) lives at position
P + j - 1 of the `[N, L - 1]` tensors. The loss mask, the behaviour log-probs **and the versions**
are shifted by the same rule (docs/algorithms.md: shifting only some of them is an off-by-one).
Rows are right-padded: real tokens keep positions 0..len-1, and causal attention never lets a
real token see the padding after it.

What the model is fed (`ModelRows`) is either these padded rows or, with packing, the sequences laid
end to end in fewer rows (`pack_rows`, `model_rows`); the per-token tensors above keep their
padded `[N, L-1]` layout either way, so the loss never sees the difference.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor


@dataclass
class TrainBatch:
    """Padded, aligned tensors for one training step (or a slice of it)."""

    input_ids: Tensor  # [N, L] int64, pad_id after each sequence
    attention_mask: Tensor  # [N, L] int64, 1 on real tokens
    loss_mask: Tensor  # [N, L-1] bool, True where position t scores a response token t+1
    behav_logprobs: Tensor  # [N, L-1] float32, engine log-prob of token t+1 (0 elsewhere)
    versions: Tensor  # [N, L-1] int64, weight version that generated token t+1 (-1 elsewhere)
    advantages: Tensor  # [N, L-1] float32, the sequence's advantage on its response tokens
    prompt_lengths: Tensor  # [N] int64
    response_lengths: Tensor  # [N] int64

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_tokens(self) -> int:
        """Response tokens that enter the loss (the token-mean denominator)."""
        return int(self.loss_mask.sum())

    def to(self, device: torch.device | str) -> TrainBatch:
        return TrainBatch(**{f.name: getattr(self, f.name).to(device) for f in fields(self)})

    def select(self, rows: Sequence[int] | Tensor | slice) -> TrainBatch:
        """A sub-batch of the given rows, with padding columns no row needs trimmed off."""
        if isinstance(rows, slice):
            rows = torch.arange(self.num_sequences)[rows]
        idx = torch.as_tensor(rows, dtype=torch.int64, device=self.input_ids.device)
        lengths = self.prompt_lengths.index_select(0, idx) + self.response_lengths.index_select(0, idx)
        width = max(int(lengths.max()) if idx.numel() else 1, 2)
        width = min(width, int(self.input_ids.shape[1]))
        out = {}
        for f in fields(self):
            t = getattr(self, f.name).index_select(0, idx)
            if t.dim() == 2:
                t = t[:, : width if f.name in ("input_ids", "attention_mask") else width - 1]
            out[f.name] = t
        return TrainBatch(**out)


Layout = Literal["padded", "rows", "one-row"]
"""How a micro-batch's sequences are fed to the model. padded: one right-padded row per sequence.
rows: packed (first-fit, longest first) into rows as wide as the longest sequence: attention that
computes every pair of positions in a row (sdpa and eager with a mask) then does the padded
layout's work per token, while short sequences fill the gaps. one-row: all in one row, for a
varlen attention kernel (flash attention), which computes nothing across sequences."""


def row_capacity(layout: Layout, longest: int) -> float:
    """Positions one row of `layout` may hold when the micro-batch's longest sequence is `longest`
    (padded: 0, so no sequence shares a row)."""
    return {"padded": 0, "rows": longest, "one-row": math.inf}[layout]


def first_fit(fill: Sequence[int], length: int, capacity: float) -> int:
    """The first row (by its filled positions) with room for `length` more; len(fill): a new row."""
    return next((j for j, used in enumerate(fill) if used + length <= capacity), len(fill))


def pack_rows(lengths: Sequence[int], layout: Layout) -> list[list[int]]:
    """The sequences (indices into `lengths`) of each row: longest first (ties in order), each into
    the first row with room for it (first-fit decreasing; `plan.plan_microbatches` budgets the
    same rows, so it must stay this rule)."""
    capacity = row_capacity(layout, max(lengths, default=0))
    rows: list[list[int]] = []
    fill: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        j = first_fit(fill, lengths[i], capacity)
        if j == len(rows):
            rows.append([])
            fill.append(0)
        rows[j].append(i)
        fill[j] += lengths[i]
    return rows


@dataclass
class ModelRows:
    """What the model is fed for a batch of N sequences: R rows of W positions, and where each
    sequence lies in them. Position t of the batch's row i is `starts[i] + t` in the flattened
    `[R * W]` rows (padded: `i * W + t`)."""

    input_ids: Tensor  # [R, W] int64
    position_ids: Tensor  # [R, W] int64: 0, 1, ... from each sequence's first token
    attention_mask: Tensor | None  # [R, W] padded rows; None when packed (see `model_rows`)
    starts: Tensor  # [N] int64

    @property
    def positions(self) -> int:
        """Positions fed to the model (sequence tokens and padding)."""
        return int(self.input_ids.numel())

    def to(self, device: torch.device | str) -> ModelRows:
        return ModelRows(self.input_ids.to(device), self.position_ids.to(device),
                         None if self.attention_mask is None else self.attention_mask.to(device),
                         self.starts.to(device))


def padded_rows(input_ids: Tensor, attention_mask: Tensor) -> ModelRows:
    """The padded rows as they are; position ids follow the attention mask (left padding too)."""
    attn = attention_mask.long()
    n, width = input_ids.shape
    return ModelRows(input_ids, (attn.cumsum(-1) - 1).clamp(min=0), attn,
                     torch.arange(n, device=input_ids.device) * width)


def model_rows(batch: TrainBatch, layout: Layout, pad_id: int) -> ModelRows:
    """`batch` as the model is fed it in `layout`. Packed rows go without an attention mask and with
    position ids restarting at 0 for every sequence (and for a row's padding tail): transformers'
    masking_utils then finds the sequences of a row from the position ids (a step other than +1
    starts one) and masks attention between them (sdpa, eager, flex), and flash attention reads
    them as varlen sequences (one row only)."""
    if layout == "padded":
        return padded_rows(batch.input_ids, batch.attention_mask)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    rows = pack_rows(lengths, layout)
    width = max(sum(lengths[i] for i in row) for row in rows)
    input_ids = torch.full((len(rows), width), int(pad_id), dtype=torch.int64, device=batch.input_ids.device)
    position_ids = torch.zeros_like(input_ids)
    starts = torch.zeros(len(lengths), dtype=torch.int64, device=input_ids.device)
    positions = torch.arange(width, device=input_ids.device)
    for r, row in enumerate(rows):
        col = 0
        for i in row:
            n = lengths[i]
            input_ids[r, col : col + n] = batch.input_ids[i, :n]
            position_ids[r, col : col + n] = positions[:n]
            starts[i] = r * width + col
            col += n
        position_ids[r, col:] = positions[: width - col]  # the tail: a "sequence" of its own
    return ModelRows(input_ids, position_ids, None, starts)


def _field(seq: Any, name: str, index: int) -> Any:
    if isinstance(seq, Mapping):
        if name not in seq:
            raise ValueError(f"sequence {index} has no {name!r}")
        return seq[name]
    if not hasattr(seq, name):
        raise ValueError(f"sequence {index} ({type(seq).__name__}) has no attribute {name!r}")
    return getattr(seq, name)


def _as_array(value: Any, dtype: Any, what: str) -> np.ndarray:
    arr = np.asarray(value.detach().cpu().numpy() if isinstance(value, Tensor) else value)
    if arr.ndim != 1 and arr.size:
        raise ValueError(f"{what} must be 1-D, got shape {arr.shape}")
    arr = arr.reshape(-1)
    if np.issubdtype(dtype, np.integer) and arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must hold integers, got dtype {arr.dtype}")
    return arr.astype(dtype, copy=False)


def build_batch(
    sequences: Sequence[Any],
    pad_id: int,
    *,
    advantages: Sequence[float] | Tensor | None = None,
    pad_to_multiple_of: int | None = None,
) -> TrainBatch:
    """Pad `prompt_ids + response_ids` rows and align per-token data (see module docstring).

    Each sequence (mapping or object) has `prompt_ids`, `response_ids`, `behav_logprobs` and
    `versions` (the last two as long as the response), and optionally `loss_mask` (bool per response
    token; False: context inside the response, such as a tool's output, which is fed to the model
    like the prompt and, like it, has no loss, behaviour log-prob or version). `advantages`, one per
    sequence, is broadcast to that sequence's trained tokens.
    """
    if len(sequences) == 0:
        raise ValueError("sequences is empty")
    if advantages is not None and len(advantages) != len(sequences):
        raise ValueError(f"advantages has {len(advantages)} entries for {len(sequences)} sequences")
    adv = (torch.as_tensor(advantages, dtype=torch.float32) if advantages is not None
           else torch.zeros(len(sequences)))
    if adv.dim() != 1 or not bool(torch.isfinite(adv).all()):
        raise ValueError("advantages must be a flat list of finite numbers, one per sequence")

    # 1. Validate every row (the message names the sequence and the field).
    rows = [_checked_row(seq, i) for i, seq in enumerate(sequences)]

    # 2. Pad to one length and place each response's per-token data at the positions that score it.
    length = max(max(p.size + r.size for p, r, _, _, _ in rows), 2)
    if pad_to_multiple_of:
        length = -(-length // pad_to_multiple_of) * pad_to_multiple_of
    n = len(rows)
    input_ids = torch.full((n, length), int(pad_id), dtype=torch.int64)
    attention_mask = torch.zeros((n, length), dtype=torch.int64)
    loss_mask = torch.zeros((n, length - 1), dtype=torch.bool)
    behav_lp = torch.zeros((n, length - 1), dtype=torch.float32)
    versions = torch.full((n, length - 1), -1, dtype=torch.int64)
    adv_tok = torch.zeros((n, length - 1), dtype=torch.float32)
    prompt_lengths = torch.zeros(n, dtype=torch.int64)
    response_lengths = torch.zeros(n, dtype=torch.int64)
    for i, (prompt, resp, behav, vers, trained) in enumerate(rows):
        p, r = prompt.size, resp.size
        input_ids[i, :p] = torch.from_numpy(prompt)
        input_ids[i, p : p + r] = torch.from_numpy(resp)
        attention_mask[i, : p + r] = 1
        span = slice(p - 1, p - 1 + r)  # position t scores token t + 1
        keep = torch.from_numpy(trained)
        loss_mask[i, span] = keep
        behav_lp[i, span] = torch.from_numpy(behav).masked_fill(~keep, 0.0)
        versions[i, span] = torch.from_numpy(vers).masked_fill(~keep, -1)
        adv_tok[i, span] = adv[i] * keep
        prompt_lengths[i], response_lengths[i] = p, r
    return TrainBatch(input_ids, attention_mask, loss_mask, behav_lp, versions, adv_tok,
                      prompt_lengths, response_lengths)


def _checked_row(seq: Any, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(prompt, response, behav_logprobs, versions, trained) of sequence `i`, checked for a trainable
    shape; `trained` is the loss mask over the response (all True without one)."""
    prompt = _as_array(_field(seq, "prompt_ids", i), np.int64, f"sequence {i} prompt_ids")
    resp = _as_array(_field(seq, "response_ids", i), np.int64, f"sequence {i} response_ids")
    behav = _as_array(_field(seq, "behav_logprobs", i), np.float32, f"sequence {i} behav_logprobs")
    vers = _as_array(_field(seq, "versions", i), np.int64, f"sequence {i} versions")
    if prompt.size == 0:
        raise ValueError(f"sequence {i} has an empty prompt: its first response token cannot be scored")
    if behav.size != resp.size or vers.size != resp.size:
        raise ValueError(
            f"sequence {i}: {resp.size} response tokens but {behav.size} behav_logprobs "
            f"and {vers.size} versions")
    mask = seq.get("loss_mask") if isinstance(seq, Mapping) else getattr(seq, "loss_mask", None)
    trained = np.ones(resp.size, dtype=bool) if mask is None else np.asarray(mask)
    if trained.dtype != np.bool_ or trained.shape != resp.shape:
        raise ValueError(f"sequence {i} loss_mask must be {resp.size} bools, one per response token "
                         f"(got {trained.dtype} {trained.shape})")
    if behav.size and not np.isfinite(behav[trained]).all():
        raise ValueError(f"sequence {i} behav_logprobs contain NaN or Inf")
    if vers.size and (vers[trained] < 0).any():
        raise ValueError(f"sequence {i} has a negative version on a generated token")
    return prompt, resp, behav, vers, trained


def split_minibatches(batch: TrainBatch, count: int) -> list[TrainBatch]:
    """`count` consecutive, equally sized row slices (the optimizer updates of one step)."""
    n = batch.num_sequences
    if count < 1 or n % count:
        raise ValueError(f"cannot split {n} sequences into {count} equal minibatches")
    size = n // count
    return [batch.select(slice(k * size, (k + 1) * size)) for k in range(count)]


def micro_batches(batch: TrainBatch, max_tokens: int) -> Iterator[TrainBatch]:
    """Consecutive row groups whose padded size (rows x longest row) fits `max_tokens`.

    A row longer than the budget still forms its own micro-batch. Use the minibatch's
    `num_tokens` as `policy_loss(loss_denominator=...)` so the micro-batch losses add up exactly.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    start, longest = 0, 0
    for i, length in enumerate(lengths):
        new_longest = max(longest, length)
        if i > start and new_longest * (i - start + 1) > max_tokens:
            yield batch.select(slice(start, i))
            start, new_longest = i, length
        longest = new_longest
    if lengths:
        yield batch.select(slice(start, len(lengths)))
