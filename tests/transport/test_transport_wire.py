"""Wire format: round trips (edge sizes), zero-copy decode, and one error type for every defect."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncrl.transport.wire import (
    SCHEMA_VERSION,
    TrajectoryGroup,
    TrajectorySample,
    WireFormatError,
    decode_group,
    encode_group,
)


def make_group(gid: str = "g-1", n_samples: int = 2, n_tokens: int = 5, prompt_len: int = 3,
               version: int = 7) -> TrajectoryGroup:
    rng = np.random.default_rng(0)
    samples = [TrajectorySample(
        sample_index=i, response_ids=rng.integers(0, 50_000, n_tokens, dtype=np.int32),
        behav_logprobs=-rng.random(n_tokens, dtype=np.float32),
        versions=np.full(n_tokens, version + i, dtype=np.int32), reward=float(i) / 2,
        finish_reason=("stop", "length", "abort")[i % 3]) for i in range(n_samples)]
    return TrajectoryGroup(job="job-a", group_id=gid, prompt_id="p-1",
                           prompt_ids=np.arange(prompt_len, dtype=np.int32), samples=samples,
                           engine_id="engine-0", created_at=1.5, published_at=2.5)


def test_round_trip_preserves_every_field():
    g = make_group()
    out = decode_group(encode_group(g))
    assert out == g
    assert out.schema_version == SCHEMA_VERSION
    assert out.samples[1].finish_reason == "length" and out.samples[1].reward == 0.5
    assert out.prompt_ids.dtype == np.int32 and out.samples[0].behav_logprobs.dtype == np.float32
    assert out.samples[0].versions.dtype == np.int32


@pytest.mark.parametrize("n_tokens", [0, 1, 32_768])
def test_round_trip_edge_sizes(n_tokens):
    g = make_group(n_tokens=n_tokens, prompt_len=0 if n_tokens == 0 else 256)
    out = decode_group(encode_group(g))
    assert out == g
    assert out.num_tokens() == 2 * n_tokens
    assert [len(s.response_ids) for s in out.samples] == [n_tokens, n_tokens]


def test_empty_group_has_no_oldest_version():
    g = make_group(n_tokens=0)
    assert decode_group(encode_group(g)).oldest_version() == -1
    g.samples = []
    assert decode_group(encode_group(g)).samples == []


def test_oldest_version_is_min_over_generated_tokens():
    g = make_group(version=4)
    g.samples[1].versions = np.array([9, 3, 9, 9, 9], dtype=np.int32)
    assert decode_group(encode_group(g)).oldest_version() == 3


def test_decode_is_zero_copy_views_over_one_buffer():
    out = decode_group(encode_group(make_group(n_tokens=1000)))
    ids = out.samples[0].response_ids
    assert not ids.flags.owndata and not ids.flags.writeable  # np.frombuffer view, no copy


def test_arrays_are_raw_little_endian_bytes_in_msgpack():
    g = make_group(n_tokens=3)
    doc = msgpack.unpackb(encode_group(g))
    assert doc["v"] == SCHEMA_VERSION
    assert doc["ids"] == b"".join(s.response_ids.astype("<i4").tobytes() for s in g.samples)
    assert doc["lp"] == b"".join(s.behav_logprobs.astype("<f4").tobytes() for s in g.samples)
    assert doc["n"] == np.array([3, 3], dtype="<i4").tobytes()


def test_encode_converts_lists_and_wider_ints():
    g = make_group(n_tokens=3)
    g.samples[0].response_ids = [1, 2, 3]
    g.samples[0].versions = np.array([1, 2, 3], dtype=np.int64)
    g.samples[0].behav_logprobs = np.array([-0.5, -1.0, -2.0], dtype=np.float64)
    out = decode_group(encode_group(g))
    assert out.samples[0].response_ids.tolist() == [1, 2, 3]
    assert out.samples[0].versions.dtype == np.int32
    assert out.samples[0].behav_logprobs.tolist() == [-0.5, -1.0, -2.0]


@pytest.mark.parametrize("mutate, message", [
    (lambda g: setattr(g.samples[0], "versions", np.zeros(4, np.int32)), "same length"),
    (lambda g: setattr(g.samples[0], "finish_reason", "eos"), "finish_reason"),
    (lambda g: setattr(g.samples[0], "response_ids", np.array([1.5] * 5)), "integers"),
    (lambda g: setattr(g.samples[0], "response_ids", np.array([2**40] * 5)), "int32"),
    (lambda g: setattr(g.samples[0], "response_ids", np.zeros((5, 1), np.int32)), "one-dimensional"),
    (lambda g: setattr(g, "group_id", ""), "group_id"),
    (lambda g: setattr(g.samples[1], "versions", np.array([1, 2, -1, 3, 4])), ">= 0"),
    (lambda g: setattr(g, "schema_version", 99), "schema version"),
])
def test_encode_rejects_invalid_groups(mutate, message):
    g = make_group()
    mutate(g)
    with pytest.raises(WireFormatError, match=message):
        encode_group(g)


def _doc() -> dict:
    return msgpack.unpackb(encode_group(make_group()))


def _pack(doc: dict) -> bytes:
    return msgpack.packb(doc, use_bin_type=True)


def _set(path, value):
    def mutate(doc):
        target = doc
        for key in path[:-1]:
            target = target[key]
        if value is KeyError:
            del target[path[-1]]
        else:
            target[path[-1]] = value
        return _pack(doc)
    return mutate


MALFORMED = {
    "garbage": lambda doc: b"\xc1\xff\x00not msgpack",
    "empty": lambda doc: b"",
    "truncated": lambda doc: _pack(doc)[:-7],
    "trailing bytes": lambda doc: _pack(doc) + b"\x00",
    "not a map": lambda doc: _pack([1, 2, 3]),
    "schema version 2": _set(["v"], 2),
    "schema version missing": _set(["v"], KeyError),
    "schema version as bool": _set(["v"], True),
    "group id missing": _set(["gid"], KeyError),
    "group id empty": _set(["gid"], ""),
    "group id not str": _set(["gid"], 17),
    "prompt odd bytes": _set(["prompt"], b"\x01\x02\x03"),
    "prompt as list": _set(["prompt"], [1, 2, 3]),
    "finish reasons not list": _set(["fin"], {"a": 1}),
    "finish reason unknown": _set(["fin"], ["stop", "eos"]),
    "finish reason not str": _set(["fin"], ["stop", ["x"]]),
    "one finish reason short": _set(["fin"], ["stop"]),
    "ids odd bytes": _set(["ids"], b"\x00" * 18),
    "ids short": _set(["ids"], b"\x00" * 36),
    "logprobs short": _set(["lp"], b"\x00" * 16),
    "versions long": _set(["ver"], b"\x00" * 44),
    "negative version": _set(["ver"], b"\xff" * 40),
    "negative length": _set(["n"], np.array([-5, 15], dtype="<i4").tobytes()),
    "lengths disagree": _set(["n"], np.array([4, 5], dtype="<i4").tobytes()),
    "rewards as str": _set(["r"], "1.0"),
    "rewards odd bytes": _set(["r"], b"\x00" * 12),
    "timestamp missing": _set(["ct"], KeyError),
    "int map key": lambda doc: _pack({1: 2}),
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_payloads_raise_wire_format_error_only(name):
    payload = MALFORMED[name](_doc())
    with pytest.raises(WireFormatError):
        decode_group(payload)


def test_every_truncation_raises_wire_format_error():
    payload = encode_group(make_group(n_tokens=4))
    for cut in range(len(payload)):
        with pytest.raises(WireFormatError):
            decode_group(payload[:cut])


def test_unknown_top_level_keys_are_kept_not_rejected():
    doc = _doc()
    doc["future_field"] = "x"
    out = decode_group(_pack(doc))
    assert out.extra == {"future_field": "x"} and out == make_group()


def test_content_is_checked_apart_from_the_format():
    """Backward compatible: schema 1 is unchanged and a group the trainer cannot train (NaN logprob,
    empty prompt) still round-trips; `content.check_group`, run by producer and consumer, rejects it."""
    from asyncrl.transport.content import check_group

    g = make_group(prompt_len=0)
    g.samples[0].behav_logprobs[1] = np.nan
    out = decode_group(encode_group(g))
    assert out == g
    assert check_group(out) == ("group 'g-1': empty prompt "
                                "(the first response token must be scored by a prompt position)")
    out.prompt_ids = np.arange(3, dtype=np.int32)
    assert check_group(out) == "group 'g-1': sample 0: behav_logprobs[1] is NaN"
    assert check_group(decode_group(encode_group(make_group()))) is None


def test_non_bytes_payload_is_rejected():
    with pytest.raises(WireFormatError):
        decode_group("a string")  # type: ignore[arg-type]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2**31 - 1), max_size=40), max_size=5),
       st.lists(st.integers(0, 2**31 - 1), max_size=20), st.floats(allow_nan=False))
def test_round_trip_property(responses, prompt, reward):
    samples = [TrajectorySample(i, np.array(r, dtype=np.int64), np.linspace(-1, 0, len(r)),
                                np.array(r, dtype=np.int64), reward, "stop") for i, r in enumerate(responses)]
    g = TrajectoryGroup("j", "g", "p", np.array(prompt, dtype=np.int64), samples, "e", 0.0, 1.0)
    out = decode_group(encode_group(g))
    assert [s.response_ids.tolist() for s in out.samples] == responses
    assert out.prompt_ids.tolist() == prompt
    assert all(s.reward == reward for s in out.samples)
    assert out.oldest_version() == (min(min(r) for r in responses if r) if any(responses) else -1)
