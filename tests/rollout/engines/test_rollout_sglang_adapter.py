"""The SGLang adapter against the fake SGLang server (always) and a real one (marker `sglang`).

Set ASYNCRL_SGLANG_URL=http://host:30000 on a GPU machine with SGLang and run
`pytest -m sglang tests/rollout/engines/test_rollout_sglang_adapter.py` to run the shared tests against it.
"""

from __future__ import annotations

import asyncio
import os
import time

import httpx
import pytest

from asyncrl.api.weight_labels import WeightLabel
from asyncrl.rollout.engines import SamplingParams, make_engine
from asyncrl.rollout.engines.base import EngineError
from asyncrl.rollout.engines.sglang import SGLangEngine
from tests.support.sglang_fake import FakeSGLang, fake_logprob, fake_token

REAL_URL = os.environ.get("ASYNCRL_SGLANG_URL")


@pytest.fixture(params=["fake", pytest.param("real", marks=pytest.mark.sglang)])
def server(request):
    """(url, fake) where fake is the FakeSGLang instance, or None against a real server."""
    if request.param == "real":
        if not REAL_URL:
            pytest.skip("set ASYNCRL_SGLANG_URL to a running SGLang server to run the adapter tests against it")
        yield REAL_URL, None
        return
    fake = FakeSGLang(token_delay=0.0).start()
    yield fake.url, fake
    fake.stop()


async def _wait_tokens(url: str, fake, at_least: int, timeout: float = 20.0) -> None:
    """Poll until the server has generated `at_least` tokens (fake) or give a real server time."""
    if fake is None:
        await asyncio.sleep(1.0)  # a real server has no progress probe; 1 s is many tokens on a GPU
        return
    deadline = time.monotonic() + timeout
    while fake.state.tokens_generated < at_least:  # the fake runs in this process: read its state
        assert time.monotonic() < deadline, "server made no progress"
        await asyncio.sleep(0.01)


PROMPT = [1, 504, 3458, 314, 216, 30, 33, 1314]


async def test_generate_reads_logprobs_tokens_and_version(server):
    url, fake = server
    engine = make_engine("sglang", url)
    try:
        result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=8, temperature=1.0))
        assert 1 <= len(result.output_ids) <= 8
        assert len(result.logprobs) == len(result.output_ids)
        assert all(lp <= 0.0 for lp in result.logprobs)
        assert result.finish_reason in ("stop", "length")
        if fake is not None:
            assert result.output_ids == [fake_token(PROMPT, i) for i in range(8)]
            assert result.logprobs == pytest.approx([fake_logprob(i, "default") for i in range(8)])
            assert result.finish_reason == "length"
            # "default" labels the weights the server was launched with: the base model, version 0
            assert result.weight_version == 0 and result.meta["weight_label"] == "default"
            assert fake.state.generate_calls[-1] == {"input_ids": PROMPT, "max_new_tokens": 8}
    finally:
        await engine.close()


async def test_stop_token_finishes_with_stop(server):
    url, fake = server
    if fake is None:
        pytest.skip("needs a controllable model")
    fake.state.eos_after = 3
    engine = SGLangEngine(url)
    result = await engine.generate(PROMPT, SamplingParams(max_new_tokens=10))
    assert result.finish_reason == "stop" and len(result.output_ids) == 4
    assert result.meta["finish_reason"] == {"type": "stop", "matched": 2}
    await engine.close()


async def test_pause_abort_returns_partial_output_then_update_and_continue(server):
    url, fake = server
    if fake is not None:
        fake.state.token_delay = 0.01
    engine = SGLangEngine(url)
    try:
        task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_new_tokens=4000)))
        await _wait_tokens(url, fake, 3)
        await engine.pause("abort")
        partial = await asyncio.wait_for(task, 30)
        assert partial.finish_reason == "abort"
        assert 0 < len(partial.output_ids) < 4000
        assert len(partial.logprobs) == len(partial.output_ids)
        info = await engine.model_info()
        await engine.update_weights(info["model_path"], 7)
        await engine.resume()
        assert (await engine.model_info())["weight_version"] == "7"
        cont = await engine.generate(PROMPT + partial.output_ids, SamplingParams(max_new_tokens=3))
        assert cont.weight_version == 7
        if fake is not None:
            assert cont.logprobs == pytest.approx([fake_logprob(i, "7") for i in range(3)])
            assert fake.state.pause_calls == ["abort"]
            assert fake.state.update_calls[-1]["weight_version"] == "7"
    finally:
        await engine.close()


async def test_retract_pause_holds_requests_until_continue(server):
    url, fake = server
    if fake is None:
        pytest.skip("retract timing is not observable on a real server")
    fake.state.token_delay = 0.005
    engine = SGLangEngine(url)
    task = asyncio.create_task(engine.generate(PROMPT, SamplingParams(max_new_tokens=50)))
    await _wait_tokens(url, fake, 3)
    await engine.pause("retract")
    assert fake.state.paused == "retract"
    assert not task.done()
    await engine.resume()
    result = await asyncio.wait_for(task, 30)
    assert result.finish_reason == "length" and len(result.output_ids) == 50
    await engine.close()


async def test_bad_requests_are_400_engine_errors_naming_the_url(server):
    url, _ = server
    engine = SGLangEngine(url)
    try:
        with pytest.raises(EngineError) as err:
            await engine.generate(PROMPT, SamplingParams(max_new_tokens=4, temperature=-1.0))
        assert err.value.status == 400 and not err.value.retryable
        assert url in str(err.value)
        with pytest.raises(EngineError) as err:
            await engine.update_weights("/nonexistent/weights", 3)
        assert not err.value.retryable and "nonexistent" in str(err.value)
        with pytest.raises(EngineError):
            await engine.pause("sideways")  # type: ignore[arg-type]
        await engine.resume()
    finally:
        await engine.close()


async def test_ready_and_model_info_hold_while_paused(server):
    """Readiness is GET /model_info: it answers while generation is paused for a weight update,
    where the pin's token-generating /health waits and then fails."""
    url, fake = server
    if fake is not None:
        fake.state.health_timeout = 0.2
    engine = SGLangEngine(url)
    try:
        assert await engine.ready()
        assert "model_path" in await engine.model_info()
        await engine.pause("abort")
        try:
            assert await engine.ready()
            assert "weight_version" in await engine.model_info()
            if fake is not None:
                async with httpx.AsyncClient() as c:
                    assert (await c.get(url + "/health")).status_code == 503
        finally:
            await engine.resume()
        if fake is not None:
            async with httpx.AsyncClient() as c:
                assert (await c.get(url + "/health")).status_code == 200
    finally:
        await engine.close()


async def test_model_info_falls_back_to_the_deprecated_name_on_404():
    """Releases without /model_info only have /get_model_info (the pin has both)."""
    seen: list[str] = []

    def handler(request: httpx.Request) -> httpx.Response:
        seen.append(request.url.path)
        if request.url.path == "/get_model_info":
            return httpx.Response(200, json={"model_path": "m", "weight_version": "4"})
        return httpx.Response(404, json={"detail": "Not Found"})

    engine = SGLangEngine("http://old-sglang:30000", client=httpx.AsyncClient(transport=httpx.MockTransport(handler)))
    assert await engine.ready()
    assert await engine.weight_label() == WeightLabel(4)
    assert seen == ["/model_info", "/get_model_info"] * 2


async def test_the_fake_refuses_what_the_pin_lacks(server):
    """The fake is at least as strict as the pinned release (tests/rollout/engines/test_sglang_routes.py checks the
    route table against the pin's source): no /ready, wrong methods are 405, unknown fields 400."""
    url, fake = server
    if fake is None:
        pytest.skip("checks the fake")
    async with httpx.AsyncClient(base_url=url) as c:
        assert (await c.get("/ready")).status_code == 404
        assert (await c.get("/openapi.json")).status_code == 404
        assert (await c.get("/generate")).status_code == 405
        assert (await c.post("/model_info")).status_code == 405
        assert (await c.get("/get_weight_version")).status_code == 404  # the pin: "use /model_info"
        assert (await c.post("/continue_generation")).status_code == 400  # the pin requires a JSON body
        assert (await c.post("/pause_generation", json={"mode": "sideways"})).status_code == 400
        bad = {"model_path": "/w", "abort_all_request": False}  # misspelled: the pin would ignore it
        assert (await c.post("/update_weights_from_disk", json=bad)).status_code == 400
        body = {"input_ids": [5], "sampling_params": {"max_tokens": 3}}  # the OpenAI name, not SGLang's
        assert (await c.post("/generate", json=body)).status_code == 400


async def test_server_errors_are_retryable_and_unreachable_servers_named():
    fake = FakeSGLang(fail_next=1).start()
    engine = SGLangEngine(fake.url)
    try:
        with pytest.raises(EngineError) as err:
            await engine.generate(PROMPT, SamplingParams(max_new_tokens=2))
        assert err.value.status == 500 and err.value.retryable
        assert (await engine.generate(PROMPT, SamplingParams(max_new_tokens=2))).finish_reason == "length"
    finally:
        await engine.close()
        fake.stop()
    dead = SGLangEngine(fake.url, timeout=2.0)
    assert not await dead.ready()
    with pytest.raises(EngineError, match=fake.url.replace(".", r"\.")):
        await dead.generate(PROMPT, SamplingParams(max_new_tokens=2))
    await dead.close()


def test_make_engine_kinds():
    assert isinstance(make_engine("hf", "http://x:1"), SGLangEngine)
    assert make_engine("vllm", "http://x:1").__class__.__name__ == "VLLMEngine"
    with pytest.raises(ValueError, match="allowed"):
        make_engine("tgi", "http://x:1")
