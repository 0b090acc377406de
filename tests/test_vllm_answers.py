"""The vLLM adapter's reading of /v1/completions answers, on bodies shaped as vLLM 0.32 writes them
(entrypoints/openai/completion/protocol.py; finish reasons from v1/engine/__init__.py's
FINISH_REASON_STRINGS: stop, length, abort, error, repetition). A real server cannot be made to
detect repetition or drop a logprob on demand; tests/test_rollout_vllm.py covers the rest live."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from asyncrl.rollout.engines import SamplingParams
from asyncrl.rollout.engines.base import EngineError
from asyncrl.rollout.engines.vllm import VLLMEngine


def answer(finish_reason: str, logprobs: list[Any]) -> dict[str, Any]:
    return {"id": "cmpl-1", "object": "text_completion", "model": "smol",
            "choices": [{"index": 0, "text": "", "finish_reason": finish_reason, "stop_reason": None,
                         "logprobs": {"tokens": [f"token_id:{100 + i}" for i in range(len(logprobs))],
                                      "token_logprobs": logprobs, "text_offset": [0] * len(logprobs),
                                      "top_logprobs": None}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": len(logprobs), "total_tokens": 3 + len(logprobs)}}


def engine_answering(body: dict[str, Any], seen: list[dict[str, Any]] | None = None) -> VLLMEngine:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "smol", "root": "/m"}]})
        if request.url.path == "/v1/completions":
            if seen is not None:
                seen.append(json.loads(request.content))
            return httpx.Response(200, json=body)
        return httpx.Response(404, json={"detail": "Not Found"})

    client = httpx.AsyncClient(base_url="http://vllm:8000", transport=httpx.MockTransport(handle))
    return VLLMEngine("http://vllm:8000", client=client)


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
