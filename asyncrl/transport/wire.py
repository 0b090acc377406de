"""Wire format of one trajectory group: a msgpack map whose arrays are raw little-endian bytes.

Why this shape: msgpack carries the small scalar fields cheaply, and the token arrays travel as
`bin` blobs, so encoding is one `memcpy` per array and decoding is `np.frombuffer` (no per-token
Python objects; JSON or Python lists are several times slower end to end).

Layout (schema version 1), keys kept short; samples are stored column-wise so a group of any
size costs a constant number of fields (decode = a few `np.frombuffer` plus slicing):

    {"v": 1, "job": str, "gid": str, "pid": str, "eng": str, "ct": float, "pt": float,
     "prompt": bin(int32 LE),
     "n": bin(int32: response length per sample), "i": bin(int32: sample index per sample),
     "r": bin(float64: reward per sample), "fin": [str per sample: stop|length|abort],
     "ids": bin(int32: all responses concatenated), "lp": bin(float32), "ver": bin(int32),
     "tl": bin(int32),   (optional: absent when every token is of timeline 0)
     "m": bin(uint8),    (optional: 1 where the token is the model's, 0 where it is context
                          the model did not choose, such as a tool's output; absent: all 1)
     "src": str,         (optional: absent for a job's only dataset)
     "et": bin(int32: per sample turns, tool calls, tool errors),  (optional: multi-turn episodes
     "es": bin(float32: per sample seconds in tools, in generation)  only; both or neither)}

"ver" and "tl" label each token with the weights that produced it: policy version and trainer
timeline (asyncrl.api.weight_labels). "tl" came after schema version 1 was set: a payload without it
is timeline 0 throughout, as every payload written before timelines existed. So did "src" (str),
the mixture source the prompt was drawn from (spec.datasets): absent for a job's only dataset.

Unknown keys are ignored (additive fields do not need a new schema version); a different "v" is
rejected. Every decoding failure raises WireFormatError and nothing else, so a consumer can route
the raw payload to the dead-letter stream instead of crashing. Decoded arrays are read-only
views over the unpacked bytes: copy them (`np.array(a)`) before writing in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from asyncrl.infra.errors import TransportError

SCHEMA_VERSION = 1
FINISH_REASONS = ("stop", "length", "abort")

_I32 = np.dtype("<i4")
_F32 = np.dtype("<f4")
_F64 = np.dtype("<f8")
_I32_MIN, _I32_MAX = np.iinfo(np.int32).min, np.iinfo(np.int32).max


class WireFormatError(TransportError, ValueError):
    """A payload (or a group being encoded) does not follow the trajectory wire schema."""


@dataclass(frozen=True)
class EpisodeStats:
    """What one multi-turn episode did beside its tokens (spec.rollout.episode; None: single-turn)."""

    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    tool_seconds: float = 0.0
    generate_seconds: float = 0.0


@dataclass(eq=False)
class TrajectorySample:
    """One sampled response of a group, with what the trainer needs to correct for staleness."""

    sample_index: int
    response_ids: np.ndarray
    behav_logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    finish_reason: str
    timelines: np.ndarray | None = None
    """Per token, the trainer timeline of its version (asyncrl.api.weight_labels); None: all 0."""
    loss_mask: np.ndarray | None = None
    """Per token, True where the model generated it (trained), False where it is context inside the
    response (an observation, a tool's output: no behaviour log-prob, never in the loss); None: all True."""
    episode: EpisodeStats | None = None
    """The episode's turns, tool calls and time (multi-turn episodes); None: a single answer."""

    def token_timelines(self) -> np.ndarray:
        """`timelines`, zeros when None."""
        return np.zeros(len(self.versions), dtype=_I32) if self.timelines is None else self.timelines

    def token_mask(self) -> np.ndarray:
        """`loss_mask`, all True when None."""
        return np.ones(len(self.response_ids), dtype=bool) if self.loss_mask is None else self.loss_mask

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrajectorySample):
            return NotImplemented
        return (self.sample_index == other.sample_index and self.reward == other.reward
                and self.finish_reason == other.finish_reason
                and np.array_equal(self.response_ids, other.response_ids)
                and np.array_equal(self.behav_logprobs, other.behav_logprobs, equal_nan=True)
                and np.array_equal(self.versions, other.versions)
                and np.array_equal(self.token_timelines(), other.token_timelines())
                and np.array_equal(self.token_mask(), other.token_mask()) and self.episode == other.episode)


@dataclass(eq=False)
class TrajectoryGroup:
    """All samples of one prompt (the unit of admission, advantage grouping and dedupe)."""

    job: str
    group_id: str
    prompt_id: str
    prompt_ids: np.ndarray
    samples: list[TrajectorySample]
    engine_id: str
    created_at: float
    published_at: float
    schema_version: int = SCHEMA_VERSION
    source: str = ""
    """The mixture source of the prompt (spec.datasets); "" for a job's only dataset."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)
    """Unknown top-level keys found when decoding (kept for forward compatibility; not encoded)."""

    def oldest_version(self) -> int:
        """Smallest policy version over all generated tokens; -1 when no token was generated."""
        mins = [int(np.min(s.versions)) for s in self.samples if len(s.versions)]
        return min(mins) if mins else -1

    def num_tokens(self) -> int:
        """Number of response (generated) tokens over all samples."""
        return sum(len(s.response_ids) for s in self.samples)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TrajectoryGroup):
            return NotImplemented
        return (self.job == other.job and self.group_id == other.group_id
                and self.prompt_id == other.prompt_id and self.engine_id == other.engine_id
                and self.created_at == other.created_at and self.published_at == other.published_at
                and self.schema_version == other.schema_version and self.source == other.source
                and np.array_equal(self.prompt_ids, other.prompt_ids)
                and self.samples == other.samples)


# ---------------------------------------------------------------------------------------- encode

def _as_array(name: str, values: Any, dtype: np.dtype) -> np.ndarray:
    """`values` as a 1-D array of `dtype` (no copy when it already is one), range-checked."""
    arr = np.asarray(values)
    if arr.ndim != 1:
        raise WireFormatError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.dtype == dtype or arr.size == 0:
        return arr.astype(dtype, copy=False)
    if dtype.kind == "i":
        if arr.dtype.kind not in "iu":
            raise WireFormatError(f"{name} must hold integers, got dtype {arr.dtype}")
        if arr.dtype.itemsize > 4 or arr.dtype == np.uint32:
            lo, hi = int(arr.min()), int(arr.max())
            if lo < _I32_MIN or hi > _I32_MAX:
                raise WireFormatError(f"{name} has values outside int32 ({lo}..{hi})")
    elif arr.dtype.kind not in "fiu":
        raise WireFormatError(f"{name} must hold numbers, got dtype {arr.dtype}")
    return arr.astype(dtype)


def _bin(arr: np.ndarray) -> memoryview:
    return np.ascontiguousarray(arr).data.cast("B")


def _concat(parts: list[np.ndarray], dtype: np.dtype) -> np.ndarray:
    if not parts:
        return np.empty(0, dtype=dtype)
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def encode_group(g: TrajectoryGroup) -> bytes:
    """Serialise a group for one XADD. Raises WireFormatError if the group itself is invalid."""
    if g.schema_version != SCHEMA_VERSION:
        raise WireFormatError(f"cannot encode schema version {g.schema_version}; "
                              f"this code writes version {SCHEMA_VERSION}")
    for name in ("job", "group_id", "prompt_id", "engine_id", "source"):
        if not isinstance(getattr(g, name), str):
            raise WireFormatError(f"{name} must be a string")
    if not g.group_id:
        raise WireFormatError("group_id must not be empty (it is the dedupe key)")
    ids, lps, vers, tls, masks, lengths = [], [], [], [], [], []
    for s in g.samples:
        a = _as_array("response_ids", s.response_ids, _I32)
        b = _as_array("behav_logprobs", s.behav_logprobs, _F32)
        c = _as_array("versions", s.versions, _I32)
        t = _as_array("timelines", s.token_timelines(), _I32)
        m = np.asarray(s.token_mask())
        if m.dtype != np.bool_ or m.ndim != 1:
            raise WireFormatError(f"sample {s.sample_index}: loss_mask must be a 1-D bool array, got {m.dtype}")
        if not len(a) == len(b) == len(c) == len(t) == len(m):
            raise WireFormatError(
                f"sample {s.sample_index}: response_ids ({len(a)}), behav_logprobs ({len(b)}), "
                f"versions ({len(c)}), timelines ({len(t)}) and loss_mask ({len(m)}) must have the same length")
        masks.append(m)
        if s.finish_reason not in FINISH_REASONS:
            raise WireFormatError(f"sample {s.sample_index}: finish_reason {s.finish_reason!r} "
                                  f"is not one of {FINISH_REASONS}")
        ids.append(a)
        lps.append(b)
        vers.append(c)
        tls.append(t)
        lengths.append(len(a))
    all_versions, all_timelines = _concat(vers, _I32), _concat(tls, _I32)
    if len(all_versions) and min(all_versions.min(), all_timelines.min()) < 0:
        raise WireFormatError("versions and timelines must be >= 0")
    doc = {"v": SCHEMA_VERSION, "job": g.job, "gid": g.group_id, "pid": g.prompt_id,
           "prompt": _bin(_as_array("prompt_ids", g.prompt_ids, _I32)), "eng": g.engine_id,
           "ct": float(g.created_at), "pt": float(g.published_at),
           "n": _bin(np.array(lengths, dtype=_I32)),
           "i": _bin(np.array([int(s.sample_index) for s in g.samples], dtype=_I32)),
           "r": _bin(np.array([float(s.reward) for s in g.samples], dtype=_F64)),
           "fin": [s.finish_reason for s in g.samples],
           "ids": _bin(_concat(ids, _I32)), "lp": _bin(_concat(lps, _F32)),
           "ver": _bin(all_versions)}
    if all_timelines.any():
        doc["tl"] = _bin(all_timelines)
    all_masks = _concat(masks, np.dtype(np.bool_))
    if not all_masks.all():
        doc["m"] = _bin(all_masks.astype(np.uint8))
    if g.source:
        doc["src"] = g.source
    if any(s.episode is not None for s in g.samples):
        stats = [s.episode or EpisodeStats() for s in g.samples]
        doc["et"] = _bin(np.array([(e.turns, e.tool_calls, e.tool_errors) for e in stats], dtype=_I32).reshape(-1))
        doc["es"] = _bin(np.array([(e.tool_seconds, e.generate_seconds) for e in stats], dtype=_F32).reshape(-1))
    return msgpack.packb(doc, use_bin_type=True)


# ---------------------------------------------------------------------------------------- decode

# field -> expected Python type after unpacking (bool is rejected separately)
_FIELDS: dict[str, type | tuple[type, ...]] = {
    "v": int, "job": str, "gid": str, "pid": str, "eng": str, "ct": (float, int), "pt": (float, int),
    "prompt": bytes, "n": bytes, "i": bytes, "r": bytes, "fin": list, "ids": bytes, "lp": bytes,
    "ver": bytes}
_ARRAYS: dict[str, np.dtype] = {"prompt": _I32, "n": _I32, "i": _I32, "r": _F64, "ids": _I32, "lp": _F32, "ver": _I32}
_OPTIONAL: dict[str, np.dtype] = {"tl": _I32, "m": np.dtype(np.uint8), "et": _I32, "es": _F32}
"""Array fields a payload may leave out (read as all zeros)."""
_OPTIONAL_TEXT = ("src",)
"""String fields a payload may leave out (read as "")."""
_FIN_SET = frozenset(FINISH_REASONS)


def decode_group(b: bytes | bytearray | memoryview) -> TrajectoryGroup:
    """Parse and validate one payload. Raises WireFormatError (only) on any defect."""
    doc = _document(b)
    arrays = _arrays(doc)
    _check_samples(doc, arrays)
    lengths, ids, lp, ver, tl = arrays["n"], arrays["ids"], arrays["lp"], arrays["ver"], arrays.get("tl")
    mask = None if "m" not in arrays else arrays["m"].astype(bool)
    fin = doc["fin"]
    version = doc["v"]
    episodes = _episode_stats(arrays)
    samples = []
    end = 0
    for k, (n, index, reward) in enumerate(zip(lengths.tolist(), arrays["i"].tolist(),
                                               arrays["r"].tolist())):
        start, end = end, end + n
        samples.append(TrajectorySample(index, ids[start:end], lp[start:end], ver[start:end],
                                        reward, fin[k], None if tl is None else tl[start:end],
                                        None if mask is None else mask[start:end],
                                        None if episodes is None else episodes[k]))
    return TrajectoryGroup(job=doc["job"], group_id=doc["gid"], prompt_id=doc["pid"],
                           prompt_ids=arrays["prompt"], samples=samples, engine_id=doc["eng"],
                           created_at=float(doc["ct"]), published_at=float(doc["pt"]),
                           schema_version=version, source=doc.get("src", ""),
                           extra={k: v for k, v in doc.items()
                                  if k not in _FIELDS and k not in _OPTIONAL and k not in _OPTIONAL_TEXT})



def _episode_stats(arrays: dict[str, np.ndarray]) -> list[EpisodeStats] | None:
    if "et" not in arrays:
        return None
    counts, seconds = arrays["et"].reshape(-1, 3).tolist(), arrays["es"].reshape(-1, 2).tolist()
    return [EpisodeStats(t, c, e, ts, gs) for (t, c, e), (ts, gs) in zip(counts, seconds)]


def _document(b: bytes | bytearray | memoryview) -> dict[str, Any]:
    """The payload's top-level map, of the schema version this code reads, every field typed."""
    if not isinstance(b, (bytes, bytearray, memoryview)):
        raise WireFormatError(f"payload must be bytes, got {type(b).__name__}")
    try:
        doc = msgpack.unpackb(b, raw=False, use_list=True, strict_map_key=True)
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise WireFormatError(f"not a valid msgpack document ({len(b)} bytes): "
                              f"{type(exc).__name__}: {exc}") from exc
    if type(doc) is not dict:
        raise WireFormatError(f"expected a map at the top level, got {type(doc).__name__}")
    version = doc.get("v")
    if type(version) is not int:
        raise WireFormatError(f"missing or non-integer schema version: {version!r}")
    if version != SCHEMA_VERSION:
        raise WireFormatError(f"schema version {version} is not supported "
                              f"(this code reads version {SCHEMA_VERSION})")
    for key, types in _FIELDS.items():
        value = doc.get(key)
        if value is None:
            raise WireFormatError(f"missing field {key!r}")
        if not isinstance(value, types) or type(value) is bool:
            raise WireFormatError(f"field {key!r} has type {type(value).__name__}")
    for key in _OPTIONAL_TEXT:
        if key in doc and not isinstance(doc[key], str):
            raise WireFormatError(f"field {key!r} has type {type(doc[key]).__name__}")
    return doc


def _arrays(doc: dict[str, Any]) -> dict[str, np.ndarray]:
    """The raw little-endian array fields as numpy views (no copy)."""
    arrays = {}
    for key, dtype in {**_ARRAYS, **{k: d for k, d in _OPTIONAL.items() if k in doc}}.items():
        raw = doc[key]
        if not isinstance(raw, bytes):
            raise WireFormatError(f"field {key!r} has type {type(raw).__name__}")
        if len(raw) % dtype.itemsize:
            raise WireFormatError(f"field {key!r} has {len(raw)} bytes, not a multiple of "
                                  f"{dtype.itemsize} ({dtype.name})")
        arrays[key] = np.frombuffer(raw, dtype=dtype)
    return arrays


def _check_samples(doc: dict[str, Any], arrays: dict[str, np.ndarray]) -> None:
    """Per-sample fields agree in count, token arrays with the lengths; versions and finish reasons valid."""
    if not doc["gid"]:
        raise WireFormatError("empty group id")
    lengths, ids, lp, ver = arrays["n"], arrays["ids"], arrays["lp"], arrays["ver"]
    fin = doc["fin"]
    n_samples = len(lengths)
    if not len(arrays["i"]) == len(arrays["r"]) == len(fin) == n_samples:
        raise WireFormatError(f"per-sample fields disagree: {n_samples} lengths, "
                              f"{len(arrays['i'])} indices, {len(arrays['r'])} rewards, "
                              f"{len(fin)} finish reasons")
    if n_samples and lengths.min() < 0:
        raise WireFormatError("negative sample length")
    total = int(lengths.sum(dtype=np.int64))
    if not len(ids) == len(lp) == len(ver) == total:
        raise WireFormatError(f"token arrays disagree with the sample lengths ({total} tokens): "
                              f"ids {len(ids)}, logprobs {len(lp)}, versions {len(ver)}")
    if total and ver.min() < 0:
        raise WireFormatError(f"negative policy version {int(ver.min())}")
    tl = arrays.get("tl")
    if tl is not None and len(tl) != total:
        raise WireFormatError(f"timelines ({len(tl)}) disagree with the sample lengths ({total} tokens)")
    if tl is not None and total and tl.min() < 0:
        raise WireFormatError(f"negative timeline {int(tl.min())}")
    mask = arrays.get("m")
    if mask is not None and len(mask) != total:
        raise WireFormatError(f"the loss mask ({len(mask)}) disagrees with the sample lengths ({total} tokens)")
    if mask is not None and total and mask.max() > 1:
        raise WireFormatError(f"loss mask values must be 0 or 1, got {int(mask.max())}")
    et, es = arrays.get("et"), arrays.get("es")
    if (et is None) != (es is None):
        raise WireFormatError("episode fields 'et' and 'es' come together")
    if et is not None and es is not None and (len(et) != 3 * n_samples or len(es) != 2 * n_samples):
        raise WireFormatError(f"episode fields disagree with {n_samples} samples: 'et' has {len(et)} values "
                              f"(3 per sample), 'es' {len(es)} (2 per sample)")
    try:
        bad = not set(fin) <= _FIN_SET
    except TypeError:
        bad = True
    if bad:
        raise WireFormatError(f"finish reasons {fin!r} are not all in {FINISH_REASONS}")
