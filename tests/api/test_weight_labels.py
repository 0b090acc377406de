"""A weight label names one set of weights forever: version and trainer timeline, on the engines'
labels, on every token of the wire format, and in the lineage a resumed trainer keeps."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest

from asyncrl.api.weight_labels import Lineage, WeightLabel, parse_label
from asyncrl.transport.wire import TrajectorySample, decode_group, encode_group
from tests.support.trainer_support import make_groups


@pytest.mark.parametrize(("text", "label"), [
    ("default", WeightLabel(0)), ("7", WeightLabel(7)), (" 7 ", WeightLabel(7)), ("v7", WeightLabel(7)),
    ("7@2", WeightLabel(7, 2)), ("0@3", WeightLabel(0, 3)), (7, WeightLabel(7)),
])
def test_labels_parse_and_timeline_zero_reads_as_before(text: object, label: WeightLabel) -> None:
    assert parse_label(text) == label


@pytest.mark.parametrize("text", [None, True, "", "seven", "7@", "@2", "7@x", "-1", -1, "7@2@3", "7.5"])
def test_anything_else_is_unknown_never_a_guess(text: object) -> None:
    assert parse_label(text) is None


def test_a_label_prints_as_the_engines_carry_it() -> None:
    assert [str(WeightLabel(5)), str(WeightLabel(5, 1))] == ["5", "5@1"]
    assert parse_label(str(WeightLabel(12, 4))) == WeightLabel(12, 4)
    assert WeightLabel.of(3) == WeightLabel(3) and WeightLabel.of(WeightLabel(3, 1)) == WeightLabel(3, 1)


def test_a_lineage_holds_its_own_timeline_and_earlier_ones_up_to_where_it_resumed() -> None:
    """Timeline 0 checkpointed v4 and was killed after publishing v5; timeline 1 resumed from v4,
    checkpointed v8, published v9 and was killed; timeline 2 resumed from v8."""
    first = Lineage()
    assert first.contains(WeightLabel(5)) and not first.contains(WeightLabel(5, 1))
    second = first.resumed(1, 4)
    assert second.shared_until == {0: 4}
    assert second.contains(WeightLabel(4)) and not second.contains(WeightLabel(5))
    assert second.contains(WeightLabel(5, 1)) and second.label(6) == WeightLabel(6, 1)
    third = second.resumed(2, 8)
    assert third.shared_until == {0: 4, 1: 8}
    assert [third.contains(WeightLabel(v, t)) for v, t in ((3, 0), (5, 0), (8, 1), (9, 1), (9, 2), (1, 3))] == \
        [True, False, True, False, True, False]
    assert all(third.contains(WeightLabel(0, t)) for t in range(5))  # the base model is everyone's
    assert Lineage.from_json(third.to_json()) == third and Lineage.from_json(None) == Lineage()


def test_lives_that_died_before_checkpointing_share_only_the_checkpoint() -> None:
    """Timeline 0 checkpointed v4; timeline 1 resumed there and died before its first checkpoint;
    timeline 2 resumes from the same v4: what timeline 1 published past v4 is not its own."""
    lineage = Lineage().resumed(2, 4)
    assert lineage.shared_until == {0: 4, 1: 4}
    assert lineage.contains(WeightLabel(4, 1)) and not lineage.contains(WeightLabel(5, 1))
    with pytest.raises(ValueError, match="later timeline"):
        lineage.resumed(2, 6)


def test_token_timelines_travel_on_the_wire_and_old_payloads_are_timeline_zero() -> None:
    group = make_groups("j", 1, version=4)[0]
    plain = encode_group(group)
    assert "tl" not in msgpack.unpackb(plain, raw=False)  # (all timeline 0: as before timelines)
    assert all(s.timelines is None for s in decode_group(plain).samples)

    first = group.samples[0]
    tl = np.zeros(len(first.versions), dtype=np.int32)
    tl[len(tl) // 2:] = 1  # a partial rollout continued on the next timeline's weights
    mixed = dataclasses.replace(group, samples=[dataclasses.replace(first, timelines=tl), *group.samples[1:]])
    back = decode_group(encode_group(mixed))
    assert back == mixed
    assert np.array_equal(back.samples[0].token_timelines(), tl)
    assert not back.samples[1].token_timelines().any()
    assert back != group  # the timelines are part of what a sample is


def test_timelines_are_checked_like_every_token_array() -> None:
    from asyncrl.transport.wire import WireFormatError

    group = make_groups("j", 1)[0]
    s = group.samples[0]
    short = dataclasses.replace(group, samples=[TrajectorySample(s.sample_index, s.response_ids, s.behav_logprobs,
                                                                 s.versions, s.reward, s.finish_reason,
                                                                 timelines=np.ones(1, dtype=np.int32))])
    with pytest.raises(WireFormatError, match="timelines"):
        encode_group(short)
    doc = msgpack.unpackb(encode_group(group), raw=False)
    doc["tl"] = np.full(3, 1, dtype="<i4").tobytes()
    with pytest.raises(WireFormatError, match="timelines"):
        decode_group(msgpack.packb(doc, use_bin_type=True))
    doc["tl"] = "1"
    with pytest.raises(WireFormatError, match="'tl'"):
        decode_group(msgpack.packb(doc, use_bin_type=True))


def test_the_inbox_keeps_a_group_only_if_every_token_is_the_lineages() -> None:
    from asyncrl.trainer.inbox import in_lineage

    lineage = Lineage().resumed(1, 4)
    old, ghost = make_groups("j", 1, version=4)[0], make_groups("j", 1, version=5)[0]
    assert in_lineage(old, lineage) and not in_lineage(ghost, lineage)
    s = ghost.samples[0]
    relabelled = dataclasses.replace(ghost, samples=[
        dataclasses.replace(x, timelines=np.ones(len(x.versions), dtype=np.int32)) for x in ghost.samples])
    assert in_lineage(relabelled, lineage)  # 5@1: the live timeline's own v5
    tl = np.ones(len(s.versions), dtype=np.int32)
    tl[0] = 0  # its first segment on the dead v5
    spanning = dataclasses.replace(relabelled, samples=[dataclasses.replace(relabelled.samples[0], timelines=tl),
                                                        *relabelled.samples[1:]])
    assert not in_lineage(spanning, lineage)
    assert in_lineage(ghost, Lineage())  # (timeline 0 itself: its own v5)


async def test_the_sglang_adapter_reads_and_writes_whole_labels() -> None:
    """An answer labelled "5@1" is version 5 of timeline 1; an update names its timeline too."""
    import json

    import httpx

    from asyncrl.rollout.engines.base import SamplingParams
    from asyncrl.rollout.engines.sglang import SGLangEngine

    sent: list[dict] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            return httpx.Response(200, json={"output_ids": [7], "meta_info": {
                "id": "r", "finish_reason": {"type": "length", "length": 1}, "weight_version": "5@1",
                "output_token_logprobs": [[-0.5, 7, None]]}})
        sent.append(json.loads(request.content))
        return httpx.Response(200, json={"success": True, "message": "ok"})

    engine = SGLangEngine("http://sglang:30000", client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    result = await engine.generate([1, 2], SamplingParams(max_new_tokens=1))
    assert (result.weight_version, result.weight_timeline) == (5, 1)
    await engine.update_weights("/w/v6", WeightLabel(6, 1))
    await engine.update_weights("/w/v2", 2)
    assert [s["weight_version"] for s in sent] == ["6@1", "2"]


async def test_a_job_started_before_timelines_resumes_as_timeline_zeros_successor(tmp_path) -> None:
    """A checkpoint written before timelines (no timeline fields, no timeline.json, nothing in Redis)
    is timeline 0's: the resumed life is timeline 1, and timeline 0's labels up to the checkpoint's
    version (the plain numbers the engines carried) stay this lineage's."""
    from asyncrl.trainer.state.checkpoint import TrainerState
    from asyncrl.trainer.state.timelines import TIMELINE_FILE, read_last_timeline, start_timeline

    old = TrainerState.from_json({"step": 6, "version": 6, "groups_trained": 12, "window_group_ids": []})
    assert old.lineage() == Lineage()
    lineage = await start_timeline(tmp_path, None, old)
    assert lineage == Lineage(1, {0: 6})
    assert lineage.contains(parse_label("6")) and not lineage.contains(parse_label("7"))
    assert read_last_timeline(tmp_path) == 1
    assert await start_timeline(tmp_path, None, old) == Lineage(2, {0: 6, 1: 6})  # the next life: never reused
    fresh = await start_timeline(tmp_path / "new-job", None, TrainerState())
    assert fresh == Lineage() and (tmp_path / "new-job" / TIMELINE_FILE).is_file()
    (tmp_path / TIMELINE_FILE).write_text("{}")
    with pytest.raises(ValueError, match="not a timeline record"):
        read_last_timeline(tmp_path)
