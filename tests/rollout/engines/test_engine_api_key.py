"""The engine API key (issue 19): our hf server and the fake SGLang refuse what the pinned SGLang's
`--api-key` refuses (401 without `Authorization: Bearer KEY`, /health* open), and the adapters and
the trainer's weight sync send the key."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path
from typing import Any

import httpx
import pytest

from asyncrl.api.runtime import ENV_ENGINE_API_KEY, ENV_REDIS_URL, ENV_STATUS_TOKEN, FILE_SUFFIX, Runtime, secret_env
from asyncrl.api.weight_labels import WeightLabel
from asyncrl.rollout.engines import SamplingParams, make_engine
from asyncrl.rollout.engines.auth import request_allowed
from asyncrl.rollout.engines.base import EngineError, GenerateResult
from asyncrl.rollout.engines.hf_server import create_app
from asyncrl.trainer.weights.engine_update import WeightSyncError, update_engines
from tests.support.sglang_fake import FakeSGLang, ServerThread

KEY = "k3y-for-tests"
CLOSED = [("POST", "/update_weights_from_disk", {"model_path": "/x", "weight_version": "1"}),
          ("POST", "/generate", {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}),
          ("POST", "/pause_generation", {"mode": "abort"}),
          ("POST", "/continue_generation", {}),
          ("GET", "/model_info", None)]


class StubEngine:
    """What hf_server.create_app calls on an HFEngine, without a model."""

    model_path = "stub/model"
    weight_label = WeightLabel(0)
    paused = False

    def submit(self, ids: list[int], params: Any, rid: str | None = None) -> concurrent.futures.Future:
        fut: concurrent.futures.Future = concurrent.futures.Future()
        fut.set_result(GenerateResult(output_ids=[5], logprobs=[-0.5], finish_reason="length",
                                      weight_version=self.weight_label.version,
                                      meta={"finish_reason": {"type": "length", "length": 1}}))
        return fut

    def pause(self, mode: str) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def update_weights(self, path: str, version: WeightLabel | None) -> None:
        self.weight_label = version if version is not None else self.weight_label

    def stats(self) -> dict[str, Any]:
        return {}


@pytest.fixture(params=["hf", "fake-sglang"])
def keyed_server(request):
    """A server started with the API key: our hf server (stub engine) or the fake SGLang."""
    server = (ServerThread(create_app(StubEngine(), api_key=KEY)) if request.param == "hf"
              else FakeSGLang(api_key=KEY))
    server.start()
    yield server
    server.stop()


@pytest.mark.parametrize(("method", "path", "header", "allowed"), [
    ("POST", "/generate", None, False),
    ("POST", "/generate", f"Bearer {KEY}", True),
    ("POST", "/generate", f"bearer {KEY}", True),
    ("POST", "/generate", f"Bearer {KEY}x", False),
    ("POST", "/generate", f"Basic {KEY}", False),
    ("POST", "/generate", KEY, False),
    ("GET", "/health", None, True),
    ("GET", "/health_generate", None, True),
    ("GET", "/metrics", None, True),
    ("OPTIONS", "/generate", None, True),
    ("GET", "/model_info", None, False),
])
def test_request_allowed_matches_the_pins_rules(method, path, header, allowed):
    assert request_allowed(KEY, method, path, header) is allowed
    assert request_allowed(None, method, path, header) is True  # no key: open, as before


@pytest.mark.parametrize(("method", "path", "body"), CLOSED)
def test_unauthenticated_calls_are_refused(keyed_server, method, path, body):
    resp = httpx.request(method, keyed_server.url + path, json=body, timeout=10)
    assert resp.status_code == 401
    wrong = httpx.request(method, keyed_server.url + path, json=body, timeout=10,
                          headers={"Authorization": "Bearer wrong"})
    assert wrong.status_code == 401


def test_health_stays_open(keyed_server):
    """The kubelet's probes carry no key: /health must never answer 401."""
    assert httpx.get(keyed_server.url + "/health", timeout=10).status_code != 401


async def test_adapter_with_the_key_drives_the_server(keyed_server, tmp_path: Path):
    engine = make_engine("sglang", keyed_server.url, api_key=KEY)
    try:
        assert await engine.ready()
        r = await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0.0))
        assert r.output_ids
        await engine.pause("abort")
        await engine.update_weights(str(tmp_path), 3)
        await engine.resume()
        assert (await engine.model_info())["weight_version"] == "3"
    finally:
        await engine.close()
    anonymous = make_engine("sglang", keyed_server.url)
    try:
        with pytest.raises(EngineError) as err:
            await anonymous.pause("abort")
        assert err.value.status == 401
    finally:
        await anonymous.close()


async def test_weight_sync_sends_the_key(keyed_server, tmp_path: Path):
    result = await update_engines("sglang", [keyed_server.url], tmp_path, 7, api_key=KEY)
    assert result.engines == 1
    with pytest.raises(WeightSyncError):
        await update_engines("sglang", [keyed_server.url], tmp_path, 8)


def test_runtime_carries_the_key(monkeypatch):
    rt = Runtime(engine_api_key=KEY)
    assert rt.to_env()[ENV_ENGINE_API_KEY] == KEY
    monkeypatch.setenv(ENV_ENGINE_API_KEY, KEY)
    assert Runtime.from_env().engine_api_key == KEY
    assert ENV_ENGINE_API_KEY not in Runtime().to_env()


def test_runtime_reads_each_secret_from_the_file_its_variable_names(monkeypatch, tmp_path: Path):
    """How the operator passes secrets (mounted files, `<VAR>_FILE`); the variable itself wins, as
    `asyncrl run` sets it; an unreadable file is an error naming the variable, never a silent None."""
    files = {}
    for var, value in ((ENV_ENGINE_API_KEY, KEY), (ENV_REDIS_URL, "redis://:pw@redis:6379/0"),
                       (ENV_STATUS_TOKEN, "t0ken")):
        files[var] = tmp_path / var
        files[var].write_text(value + "\n")  # a trailing newline, as `kubectl create secret --from-file` keeps it
        monkeypatch.setenv(var + FILE_SUFFIX, str(files[var]))
        monkeypatch.delenv(var, raising=False)
    rt = Runtime.from_env()
    assert (rt.engine_api_key, rt.redis_url, rt.status_token) == (KEY, "redis://:pw@redis:6379/0", "t0ken")
    monkeypatch.setenv(ENV_STATUS_TOKEN, "from-env")
    assert Runtime.from_env().status_token == "from-env"
    assert secret_env("ASYNCRL_NOT_SET") is None
    files[ENV_REDIS_URL].unlink()
    with pytest.raises(ValueError, match=f"{ENV_REDIS_URL}_FILE=.*cannot read"):
        Runtime.from_env()
