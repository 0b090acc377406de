"""The engine proxy (`asyncrl engine-proxy`): in a rollout pod it is the only way to the engine, and
every route of every pinned engine needs the key there, where the engines' own keys leave routes
open (vLLM 0.32's /invocations, /collective_rpc, /update_weights, /sleep) or log the key (SGLang).

Driven over real sockets: a recording upstream (or the fake SGLang) behind a proxy started as the
rollout pod starts it, from the command the operator renders."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route as StarletteRoute

from asyncrl.api.engine_servers import PROXY_LIVE_PATH, PROXY_READY_PATH, engine_proxy_command
from asyncrl.infra.net import free_port
from asyncrl.rollout.engines import SamplingParams, make_engine
from asyncrl.rollout.engines.proxy import EngineProxy
from asyncrl.trainer.weights.engine_update import update_engines
from tests.support.engine_routes import concrete, pin_routes, vllm_routes
from tests.support.served import served
from tests.support.sglang_fake import FakeSGLang, ServerThread

KEY = "proxy-k3y"
METHODS_WITH_BODY = {"POST", "PUT", "PATCH"}
# Routes mounted outside the decorators the tables read (Prometheus, FastAPI's docs), and a path no
# engine has: the proxy's answer must not depend on the path at all.
EXTRA_PATHS = [("GET", "/metrics"), ("GET", "/openapi.json"), ("GET", "/docs"), ("DELETE", "/no/such/route")]


class Recorder:
    """An upstream that answers every request and remembers it; its /health answers `health`."""

    def __init__(self) -> None:
        self.seen: list[dict[str, Any]] = []
        self.health = 200

        async def health(request: Request) -> Response:
            return JSONResponse({}, status_code=self.health)

        async def stream(request: Request) -> Response:
            async def chunks() -> Any:
                for i in range(5):
                    yield f"data: {i}\n\n".encode()
                    await asyncio.sleep(0.01)
            return StreamingResponse(chunks(), media_type="text/event-stream")

        async def anything(request: Request) -> Response:
            body = await request.body()
            self.seen.append({"method": request.method, "path": request.url.path, "query": request.url.query,
                              "headers": dict(request.headers), "body": body})
            return JSONResponse({"echo": len(body)}, status_code=207, headers={"x-engine": "yes"})

        methods = ["GET", "POST", "PUT", "DELETE", "PATCH", "HEAD", "OPTIONS"]
        self.app = Starlette(routes=[StarletteRoute("/health", health), StarletteRoute("/stream", stream),
                                     StarletteRoute("/{path:path}", anything, methods=methods)])


@pytest.fixture
def upstream() -> Iterator[tuple[Recorder, ServerThread]]:
    recorder = Recorder()
    server = ServerThread(recorder.app).start()
    yield recorder, server
    server.stop()


def _proxy(upstream_url: str) -> ServerThread:
    return ServerThread(EngineProxy(upstream_url, KEY)).start()


@pytest.fixture
def proxied(upstream) -> Iterator[tuple[Recorder, str]]:
    recorder, server = upstream
    proxy = _proxy(server.url)
    yield recorder, proxy.url
    proxy.stop()


def _refusals(url: str, table: list[tuple[str, str]]) -> list[str]:
    """Every (method, path) without a key, with a wrong one and with another scheme: what was not refused."""
    wrong = []
    with httpx.Client(base_url=url, timeout=10) as client:
        for method, path in table:
            body = b"{}" if method in METHODS_WITH_BODY else None
            for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": f"Basic {KEY}"},
                            {"Authorization": KEY}):
                resp = client.request(method, concrete(path), content=body, headers=headers)
                if resp.status_code not in (401, 403):
                    wrong.append(f"{method} {path} with {headers or 'no header'}: {resp.status_code}")
    return wrong


def _table(routes: dict[str, Any]) -> list[tuple[str, str]]:
    return sorted({(m, p) for p, r in routes.items() for m in r.methods}) + EXTRA_PATHS


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_every_route_of_each_pinned_engine_is_refused_without_the_key(engine, proxied):
    recorder, url = proxied
    routes = pin_routes() if engine == "sglang" else vllm_routes()
    # the routes the engines' own keys leave open, or that matter most, are in the tables read
    must = {"sglang": {"/generate", "/update_weights_from_disk", "/pause_generation", "/health"},
            "vllm": {"/invocations", "/collective_rpc", "/update_weights", "/init_weight_transfer_engine",
                     "/sleep", "/pause", "/inference/v1/generate", "/health"}}[engine]
    assert must <= set(routes), f"the {engine} route table lacks {sorted(must - set(routes))}"
    table = _table(routes)
    assert _refusals(url, table) == []
    assert recorder.seen == [], "a refused request reached the engine"


def test_with_the_key_a_request_passes_whole_and_the_key_stays_behind(proxied):
    recorder, url = proxied
    body = b'{"model_path": "/shared/weights/v3", "weight_version": "3"}' * 1000
    resp = httpx.post(f"{url}/update_weights_from_disk?flush=1", content=body, timeout=10,
                      headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json", "X-Trace": "t1"})
    assert resp.status_code == 207 and resp.json() == {"echo": len(body)} and resp.headers["x-engine"] == "yes"
    (seen,) = recorder.seen
    assert (seen["method"], seen["path"], seen["query"], seen["body"]) == ("POST", "/update_weights_from_disk",
                                                                           "flush=1", body)
    assert "authorization" not in seen["headers"], "the engine never sees the key"
    assert seen["headers"]["x-trace"] == "t1" and seen["headers"]["content-type"] == "application/json"
    # the scheme is case-insensitive, as the engines' own check
    assert httpx.get(f"{url}/model_info", headers={"Authorization": f"bearer {KEY}"}).status_code == 207


def test_a_streamed_answer_streams_through(proxied):
    _, url = proxied
    with httpx.stream("GET", f"{url}/stream", headers={"Authorization": f"Bearer {KEY}"}, timeout=10) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        events = [line for line in resp.iter_lines() if line]
    assert events == [f"data: {i}" for i in range(5)]


def test_probes_answer_without_the_key_and_say_nothing_of_the_engine(upstream):
    recorder, server = upstream
    proxy = _proxy(server.url)
    try:
        assert httpx.get(proxy.url + PROXY_LIVE_PATH).text == "live"
        ready = httpx.get(proxy.url + PROXY_READY_PATH)
        assert (ready.status_code, ready.text) == (200, "ready")
        recorder.health = 503  # e.g. SGLang starting, or a /health that generates behind a pause
        assert httpx.get(proxy.url + PROXY_READY_PATH).status_code == 503
        # only GET, and only those two paths
        assert httpx.post(proxy.url + PROXY_READY_PATH).status_code == 401
        assert recorder.seen == []
        server.stop()  # the engine is gone: not ready, still live, and a keyed request is a 502
        assert httpx.get(proxy.url + PROXY_READY_PATH).status_code == 503
        assert httpx.get(proxy.url + PROXY_LIVE_PATH).status_code == 200
        gone = httpx.post(proxy.url + "/generate", headers={"Authorization": f"Bearer {KEY}"}, json={})
        assert gone.status_code == 502 and "not reachable" in gone.json()["error"]
    finally:
        proxy.stop()


async def test_a_websocket_is_refused():
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "websocket.connect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    await EngineProxy("http://127.0.0.1:9", KEY)({"type": "websocket", "path": "/v1/realtime", "headers": []},
                                                 receive, send)
    assert [m["type"] for m in sent] == ["websocket.close"]


async def test_the_sglang_adapter_and_the_weight_sync_drive_the_engine_through_the_proxy(tmp_path: Path):
    """What the rollout pod runs: the fake SGLang (as strict as the pin) without a key on loopback, the
    proxy in front; the trainer's weight sync and an adapter with the key work, without it nothing does."""
    fake = FakeSGLang().start()
    proxy = _proxy(fake.url)
    try:
        engine = make_engine("sglang", proxy.url, api_key=KEY)
        try:
            assert await engine.ready()
            assert (await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=2, temperature=0.0))).output_ids
        finally:
            await engine.close()
        assert (await update_engines("sglang", [proxy.url], tmp_path, 4, api_key=KEY)).engines == 1
        assert fake.state.weight_version == "4"
        assert httpx.post(proxy.url + "/pause_generation", json={"mode": "abort"}).status_code == 401
        assert fake.state.weight_version == "4"
    finally:
        proxy.stop()
        fake.stop()


def test_the_rendered_command_starts_and_refuses_to_run_without_a_key(tmp_path: Path, upstream):
    """The command the operator renders (engine_servers.engine_proxy_command) serves; an empty or missing
    key file stops it at once with the reason, never an open proxy."""
    _, server = upstream
    key_file = tmp_path / "api-key"
    key_file.write_text(KEY + "\n")  # a trailing newline, as `kubectl create secret --from-file` keeps it
    port = free_port()
    cmd = engine_proxy_command(port=port, upstream_port=int(server.url.rsplit(":", 1)[1]), api_key_file=str(key_file))
    assert cmd[:2] == ["asyncrl", "engine-proxy"]
    argv = [sys.executable, "-m", "asyncrl.cli", *cmd[1:]]
    url = f"http://127.0.0.1:{port}"
    with served(argv, url + PROXY_READY_PATH, log=tmp_path / "proxy.log", what="engine proxy", timeout=60):
        assert httpx.get(url + "/get_model_info").status_code == 401
        assert httpx.get(url + "/get_model_info", headers={"Authorization": f"Bearer {KEY}"}).status_code == 207
    assert KEY not in (tmp_path / "proxy.log").read_text()
    for content, reason in (("", "is empty"), (None, "cannot read")):
        if content is None:
            key_file.unlink()
        else:
            key_file.write_text(content)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert done.returncode != 0 and reason in done.stderr, done.stderr
