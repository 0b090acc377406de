"""The vLLM adapter's reading of /inference/v1/generate answers, on bodies shaped as vLLM 0.32 writes
them (entrypoints/scale_out/token_in_token_out/protocol.py: GenerateTokensChoice with token_ids,
logprobs.content[{token_id, logprob}], finish_reason, weight_versions [{version, start, end}];
finish reasons from v1/engine/__init__.py's FINISH_REASON_STRINGS: stop, length, abort, error,
repetition). A real server cannot be made to detect repetition, drop a logprob or change weights
inside one answer on demand; tests/rollout/engines/test_vllm_server.py covers the rest live."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from asyncrl.rollout.engines import SamplingParams
from asyncrl.rollout.engines.base import EngineError
from asyncrl.rollout.engines.vllm import GENERATE_PATH, VLLMEngine, first_span


def answer(finish_reason: str, logprobs: list[Any], spans: Any = "one") -> dict[str, Any]:
    ids = [100 + i for i in range(len(logprobs))]
    if spans == "one":
        spans = [{"version": "3", "start": 0, "end": len(ids)}]
    return {"request_id": "r-1", "model": "smol",
            "choices": [{"index": 0, "finish_reason": finish_reason, "stop_reason": None, "token_ids": ids,
                         "logprobs": {"content": [{"token_id": t, "logprob": lp, "top_logprobs": []}
                                                  for t, lp in zip(ids, logprobs)]},
                         "weight_versions": spans}]}


def engine_answering(body: dict[str, Any], seen: list[dict[str, Any]] | None = None) -> VLLMEngine:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "smol", "root": "/m"}]})
        if request.url.path == GENERATE_PATH:
            if seen is not None:
                seen.append(json.loads(request.content))
            return httpx.Response(200, json=body)
        return httpx.Response(404, json={"detail": "Not Found"})

    client = httpx.AsyncClient(base_url="http://vllm:8000", transport=httpx.MockTransport(handle))
    return VLLMEngine("http://vllm:8000", client=client)


async def test_the_request_and_the_servers_label_of_the_tokens():
    seen: list[dict[str, Any]] = []
    params = SamplingParams(max_new_tokens=4, temperature=0.7, stop_token_ids=[2])
    result = await engine_answering(answer("stop", [-0.5, -0.25]), seen).generate([1, 2, 3], params)
    assert seen == [{"model": "smol", "token_ids": [1, 2, 3], "output_mode": "tokens",
                     "sampling_params": {"max_tokens": 4, "temperature": 0.7, "top_p": 1.0, "top_k": -1,
                                         "logprobs": 0, "skip_special_tokens": False, "stop_token_ids": [2]}}]
    assert (result.output_ids, result.logprobs, result.finish_reason, result.weight_version) == (
        [100, 101], [-0.5, -0.25], "stop", 3)


async def test_launch_weights_are_version_0_and_an_unlabelled_answer_is_unknown():
    default = [{"version": "default", "start": 0, "end": 1}]
    launch = await engine_answering(answer("stop", [-1.0], default)).generate([1], SamplingParams(4))
    unlabelled = await engine_answering(answer("stop", [-1.0], None)).generate([1], SamplingParams(4))
    assert (launch.weight_version, unlabelled.weight_version) == (0, None)


async def test_an_answer_across_two_weight_versions_keeps_the_first_and_is_continued():
    spans = [{"version": "3", "start": 0, "end": 2}, {"version": "4", "start": 2, "end": 3}]
    result = await engine_answering(answer("stop", [-0.5, -0.25, -0.1], spans)).generate([1], SamplingParams(4))
    assert (result.output_ids, result.weight_version, result.finish_reason) == ([100, 101], 3, "abort")
    assert first_span(spans, 3) == (2, "3") and first_span([], 0) == (0, None)


async def test_a_repetition_ends_the_answer_it_is_not_an_abort_to_continue():
    result = await engine_answering(answer("repetition", [-0.5, -0.25])).generate([1, 2, 3], SamplingParams(4))
    assert (result.output_ids, result.logprobs, result.finish_reason) == ([100, 101], [-0.5, -0.25], "stop")
    assert result.meta["finish_reason"] == "repetition"


@pytest.mark.parametrize("reason", ["stop", "length", "abort"])
async def test_the_other_reasons_keep_their_meaning(reason: str):
    result = await engine_answering(answer(reason, [-1.0])).generate([1], SamplingParams(4))
    assert result.finish_reason == reason


async def test_an_error_finish_is_an_engine_error_not_a_partial_answer():
    with pytest.raises(EngineError, match="finish_reason 'error' after 2 token"):
        await engine_answering(answer("error", [-0.5, -0.25])).generate([1], SamplingParams(4))


async def test_a_token_without_a_logprob_is_an_engine_error_not_nan():
    with pytest.raises(EngineError, match=r"no logprob for generated token\(s\) \[1\] of 3"):
        await engine_answering(answer("stop", [-0.5, None, -0.1])).generate([1], SamplingParams(4))
