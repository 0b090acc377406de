"""Is a trajectory group trainable? One content check, run by the producer and by the consumer.

Why: the wire format (wire.py) checks shape (fields, dtypes, byte lengths, counts) but not the
numbers inside. A group whose behaviour logprob is NaN decodes fine and then makes the training
step raise (trainer/step/batch.py); the trainer exits, Redis re-delivers the still-pending group first
after the restart, and the trainer crashes again, forever. So the rollout worker checks
each group before it publishes it, and the trainer's consumer checks each group it decodes and
dead-letters a failure with the reason, before the group can reach a batch.

`check_group` returns None or one readable sentence naming the group, the sample, the field and the
value. Its rules are what the training step relies on (keep them in step with the trainer):

- at least one sample (`compute_advantages` refuses a group size of 0), sample indices distinct and
  in `0..n-1`, and exactly `group_size` samples when the checker knows it;
- a non-empty prompt (`build_batch`: the first response token must be scored by a prompt position);
- per sample: one-dimensional integer token ids, one behaviour logprob and one version per response
  token (`build_batch`), logprobs finite as float32 (`build_batch`; the wire stores float32, so a
  float64 value beyond float32's range becomes -inf), versions in `0..2**31-1` (the wire's int32;
  `-1` marks prompt tokens and the log-linear proximal refuses it on a response token), a known
  finish reason, at most `max_response_tokens` tokens when known;
- token ids (prompt and response) >= 0, and < `vocab_size` when known: the embedding lookup raises
  on anything else (on a GPU it is a device-side assert that kills the process);
- a finite reward with |reward| <= REWARD_LIMIT (1e30): advantages are float32 (`compute_advantages`
  raises on a reward that overflows float32, `build_batch` on an advantage that does), a Dr. GRPO or
  RLOO advantage is a difference of rewards (up to 2x), and batch normalisation (`normalize_advantages`)
  divides a difference of those (up to 4x the bound) by std + 1e-6, which is 1e-6 when the
  token-weighted std is 0: 4e30 / 1e-6 is still far inside float32's 3.4e38.

Not checked, on purpose: versions newer than the trainer (allowed: after a resume the trainer
treats them as fresh), versions decreasing within a response (a rolled-back lineage can do that),
positive logprobs (numerically impossible but harmless: ratios are clamped in the loss).
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .wire import FINISH_REASONS, TrajectoryGroup, TrajectorySample

FLOAT32_MAX = float(np.finfo(np.float32).max)
REWARD_LIMIT = 1e30
"""Largest |reward| accepted: every advantage derived from it stays a finite float32 (see above)."""
VERSION_MAX = int(np.iinfo(np.int32).max)


@dataclass(frozen=True)
class GroupLimits:
    """What the checking side knows beyond the format; None means unknown and skips that check."""

    vocab_size: int | None = None
    """The model's vocabulary (embedding rows): token ids must be below it."""
    group_size: int | None = None
    """Samples per group (the spec's `algorithm.groupSize`)."""
    max_response_tokens: int | None = None
    """Longest response (the spec's `algorithm.maxNewTokens`)."""


Columns = tuple[np.ndarray, np.ndarray, np.ndarray]
"""One sample's (response_ids, behav_logprobs, versions)."""


class _Invalid(Exception):
    """One reason a group cannot be trained (internal: `check_group` returns it as text)."""


def check_group(group: TrajectoryGroup, limits: GroupLimits | None = None) -> str | None:
    """Why `group` cannot be trained, as one sentence (group, sample, field, value), or None if it can."""
    try:
        _check(group, limits or GroupLimits())
    except _Invalid as exc:
        return f"group {group.group_id!r}: {exc}"
    return None


# ------------------------------------------------------------------------------------ the checks

def _check(g: TrajectoryGroup, limits: GroupLimits) -> None:
    _check_samples(g.samples, limits.group_size)
    _check_prompt(g.prompt_ids, limits.vocab_size)
    columns = [_sample_columns(s, limits.max_response_tokens) for s in g.samples]
    _check_tokens(g.samples, columns, limits)


def _check_samples(samples: list[TrajectorySample], group_size: int | None) -> None:
    """Count, indices, rewards and finish reasons (the per-sample scalars)."""
    n = len(samples)
    if n == 0:
        raise _Invalid("no samples (a group needs at least one to compute advantages)")
    if group_size is not None and n != group_size:
        raise _Invalid(f"{n} samples, but the group size is {group_size}")
    seen: set[int] = set()
    for k, s in enumerate(samples):  # messages name a sample by its sample_index once that is valid
        index = _int(s.sample_index, f"the sample at position {k}: sample_index")
        if not 0 <= index < n:
            raise _Invalid(f"the sample at position {k}: sample_index {index} is outside 0..{n - 1}")
        if index in seen:
            raise _Invalid(f"the sample at position {k}: sample_index {index} appears twice")
        seen.add(index)
        _check_reward(f"sample {index}", s.reward)
        if s.finish_reason not in FINISH_REASONS:
            raise _Invalid(f"sample {index}: finish_reason {s.finish_reason!r} is not one of {FINISH_REASONS}")


def _check_reward(where: str, reward: Any) -> None:
    if isinstance(reward, (str, bytes)):
        raise _Invalid(f"{where}: reward {reward!r} is not a number")
    try:
        value = float(reward)
    except (TypeError, ValueError):
        raise _Invalid(f"{where}: reward {reward!r} is not a number") from None
    if not math.isfinite(value):
        raise _Invalid(f"{where}: reward is {value}")
    if abs(value) > REWARD_LIMIT:
        raise _Invalid(f"{where}: reward {value:.6g} is outside ±{REWARD_LIMIT:.3g} (advantages are float32)")


def _check_prompt(prompt_ids: Any, vocab_size: int | None) -> None:
    prompt = _vector(prompt_ids, "prompt_ids", "iu")
    if prompt.size == 0:
        raise _Invalid("empty prompt (the first response token must be scored by a prompt position)")
    ok = _ids_ok(prompt, vocab_size)
    if not ok.all():
        j = int(np.argmin(ok))
        raise _Invalid(f"prompt_ids[{j}] = {prompt[j]} {_id_problem(int(prompt[j]), vocab_size)}")


_COLUMNS = (("response_ids", "iu"), ("behav_logprobs", "fiu"), ("versions", "iu"))
"""A sample's per-token fields and the dtype kinds each accepts (integers; numbers)."""


def _sample_columns(s: TrajectorySample, max_tokens: int | None) -> Columns:
    """(response_ids, behav_logprobs, versions) of one sample, checked for dtype, rank and length."""
    ids, lps, vers = cols = (np.asarray(s.response_ids), np.asarray(s.behav_logprobs), np.asarray(s.versions))
    if not all(_vector_ok(arr, kinds) for arr, (_, kinds) in zip(cols, _COLUMNS)):
        for arr, (name, kinds) in zip(cols, _COLUMNS):  # name the field at fault
            _vector(arr, f"sample {s.sample_index}: {name}", kinds)
    if not ids.size == lps.size == vers.size:
        raise _Invalid(f"sample {s.sample_index}: {ids.size} response tokens but {lps.size} behav_logprobs "
                       f"and {vers.size} versions (one of each per token)")
    if max_tokens is not None and ids.size > max_tokens:
        raise _Invalid(f"sample {s.sample_index}: {ids.size} response tokens, more than the limit of {max_tokens}")
    return cols


def _check_tokens(samples: list[TrajectorySample], columns: list[Columns], limits: GroupLimits) -> None:
    """Token-level checks, once over each column of the whole group (a few numpy reductions per group,
    not per sample); only a failure builds the per-token mask that names the first bad token."""
    ids, lps, vers = (_concat([c[i] for c in columns]) for i in range(3))
    if not ids.size:
        return
    vocab = limits.vocab_size
    if ids.min() < 0 or (vocab is not None and ids.max() >= vocab):
        raise _Invalid(_locate(samples, columns, "response_ids", _ids_ok(ids, vocab), ids, limits))
    if not np.isfinite(lps).all() or (lps.dtype.itemsize > 4 and np.abs(lps).max() > FLOAT32_MAX):
        raise _Invalid(_locate(samples, columns, "behav_logprobs", np.abs(lps) <= FLOAT32_MAX, lps, limits))
    if vers.min() < 0 or vers.max() > VERSION_MAX:
        raise _Invalid(_locate(samples, columns, "versions", (vers >= 0) & (vers <= VERSION_MAX), vers, limits))


def _ids_ok(ids: np.ndarray, vocab_size: int | None) -> np.ndarray:
    ok = ids >= 0
    return ok if vocab_size is None else ok & (ids < vocab_size)


# ------------------------------------------------------------------------------------ helpers

def _int(value: Any, what: str) -> int:
    if isinstance(value, bool):
        raise _Invalid(f"{what} {value!r} is not an integer")
    try:
        return operator.index(value)
    except TypeError:
        raise _Invalid(f"{what} {value!r} is not an integer") from None


def _vector_ok(arr: np.ndarray, kinds: str) -> bool:
    return arr.ndim == 1 and (arr.dtype.kind in kinds or arr.size == 0)


def _vector(value: Any, what: str, kinds: str) -> np.ndarray:
    """`value` as a 1-D numpy array whose dtype kind is one of `kinds` (empty arrays pass)."""
    arr = np.asarray(value)
    if arr.ndim != 1:
        raise _Invalid(f"{what} must be one-dimensional, got shape {arr.shape}")
    if not _vector_ok(arr, kinds):
        raise _Invalid(f"{what} has dtype {arr.dtype}, expected {'integers' if kinds == 'iu' else 'numbers'}")
    return arr


def _concat(parts: list[np.ndarray]) -> np.ndarray:
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _id_problem(token_id: int, vocab_size: int | None) -> str:
    return "is negative" if token_id < 0 else f"is outside the vocabulary (size {vocab_size})"


def _locate(samples: list[TrajectorySample], columns: list[Columns], name: str, ok: np.ndarray,
            values: np.ndarray, limits: GroupLimits) -> str:
    """The sentence for the first bad token: which sample, which position, what value, what is wrong."""
    flat = int(np.argmin(ok))
    offsets = np.cumsum([len(c[0]) for c in columns])
    k = int(np.searchsorted(offsets, flat, side="right"))
    j = flat - (int(offsets[k - 1]) if k else 0)
    value = values[flat]
    where = f"sample {samples[k].sample_index}: {name}[{j}]"
    if name == "behav_logprobs":
        if math.isnan(value):
            return f"{where} is NaN"
        if math.isinf(value):
            return f"{where} is {value}"
        return f"{where} = {value:.6g} is outside float32's range"
    if name == "versions":
        return f"{where} = {value} is outside 0..{VERSION_MAX}"
    return f"{where} = {value} {_id_problem(int(value), limits.vocab_size)}"
