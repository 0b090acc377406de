"""The fake SGLang server keeps the pinned release's state (tests/support/sglang_fake.py says where each
rule comes from): a restart brings back the "default" label, overlapping weight updates during a
pause leave the earlier caller without an answer, unpaused updates and pauses serialise."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from tests.support.polling import poll
from tests.support.sglang_fake import FakeSGLang

GENERATE = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 20}, "return_logprob": True}


@pytest.fixture
def fake():
    server = FakeSGLang().start()
    yield server
    server.kill()


def update(version: str) -> dict:
    return {"model_path": f"/w/v{version}", "weight_version": version}


async def test_a_restarted_server_is_labelled_default_on_its_launch_model(fake):
    async with httpx.AsyncClient(base_url=fake.url) as client:
        assert (await client.post("/update_weights_from_disk", json=update("3"))).json()["success"]
        assert (await client.get("/model_info")).json()["weight_version"] == "3"
        fake.restart()
        info = (await client.get("/model_info")).json()
        assert (info["weight_version"], info["model_path"]) == ("default", "fake/model")
        answer = (await client.post("/generate", json=GENERATE)).json()
        assert answer["meta_info"]["weight_version"] == "default"


async def test_overlapping_updates_during_a_pause_leave_the_first_caller_unanswered(fake):
    fake.state.update_delay = 0.3
    async with httpx.AsyncClient(base_url=fake.url, timeout=5) as client:
        await client.post("/pause_generation", json={"mode": "abort"})
        first = asyncio.create_task(client.post("/update_weights_from_disk", json=update("1"), timeout=1.5))
        while not fake.state.update_calls:
            await asyncio.sleep(0.01)
        second = await client.post("/update_weights_from_disk", json=update("2"))
        assert second.json()["success"] and fake.state.weight_version == "2"
        with pytest.raises(httpx.ReadTimeout):
            await first
        assert fake.state.updates_unanswered == 1
        await client.post("/continue_generation", json={})


async def test_unpaused_updates_wait_for_running_requests_and_for_each_other(fake):
    fake.state.token_delay = 0.01
    async with httpx.AsyncClient(base_url=fake.url, timeout=10) as client:
        generating = asyncio.create_task(client.post("/generate", json=GENERATE))
        while not fake.state.running:
            await asyncio.sleep(0.005)
        a, b = await asyncio.gather(client.post("/update_weights_from_disk", json=update("1")),
                                    client.post("/update_weights_from_disk", json=update("2")))
        answer = (await generating).json()
        assert a.json()["success"] and b.json()["success"] and fake.state.updates_unanswered == 0
        # the request ran to its end on the launch weights: the updates waited for it
        assert answer["meta_info"]["weight_version"] == "default" and len(answer["output_ids"]) == 20


async def test_an_abort_pause_returns_once_no_request_runs(fake):
    fake.state.token_delay = 0.01
    async with httpx.AsyncClient(base_url=fake.url, timeout=10) as client:
        generating = asyncio.create_task(client.post("/generate", json=GENERATE))
        while not fake.state.running:
            await asyncio.sleep(0.005)
        # the pause goes first and holds the control lock while the request drains; a continue
        # sent meanwhile must wait behind it (two racing requests have no arrival order to test)
        pausing = asyncio.create_task(client.post("/pause_generation", json={"mode": "abort"}))
        async def paused() -> list[str]:
            return fake.state.control_calls

        await poll(paused, what="the pause to reach the server")
        resume = await client.post("/continue_generation", json={})
        pause = await pausing
        assert pause.status_code == resume.status_code == 200
        assert fake.state.control_calls == ["pause:abort", "continue"]  # serialised, in order
        assert (await generating).json()["meta_info"]["finish_reason"]["type"] == "abort"
