"""`asyncrl engine-proxy`: the one door to a rollout pod's engine, and it checks the key on every route.

Why a proxy: the pinned engines guard their routes unevenly. vLLM 0.32's own `--api-key` covers only
/v1, /v2, /inference and /cohere (its /invocations generates, /collective_rpc and /update_weights
load weights, /sleep stops it, all open), and SGLang 0.5.10.post1 logs its `server_args`, the key
among them, and takes the key in argv. So in a rollout pod the engine (SGLang, vLLM or our hf server)
listens on 127.0.0.1 without a key, and this proxy, the only listener on the pod's engine port,
forwards a request only with `Authorization: Bearer <key>`: every path and method, whatever engine
is behind it (a websocket is refused). The key comes from a file (the job's engine Secret, mounted),
so it is in no environment variable, argv or log, and the header is not passed on.

Two paths of the proxy's own answer without the key, for the kubelet, and disclose nothing:
  GET /asyncrl/live    200 while the proxy runs (liveness)
  GET /asyncrl/ready   200 when the engine's health route answers 200, else 503 (readiness)
Bodies stream both ways with no read timeout: a generation can take minutes and its caller sets the
deadline. An engine that does not answer the connection is a 502.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.api.engine_servers import PROXY_LIVE_PATH as LIVE_PATH
from asyncrl.api.engine_servers import PROXY_READY_PATH as READY_PATH
from asyncrl.api.runtime import read_secret_file
from asyncrl.rollout.engines.auth import bearer_matches

if TYPE_CHECKING:  # httpx and starlette are imported when serving: `asyncrl --help` stays light
    import httpx
    from starlette.requests import Request
    from starlette.responses import Response

DEFAULT_PORT = 30000
READY_TIMEOUT_S = 2.5
"""Below the readiness probe's timeoutSeconds (3), so a hung engine reads as 503, not a probe timeout."""
_NOT_FORWARDED = frozenset({"authorization", "connection", "keep-alive", "proxy-authenticate",
                            "proxy-authorization", "te", "trailer", "transfer-encoding", "upgrade", "host"})
"""Hop-by-hop headers (RFC 9110 7.6.1), the Host of the proxy, and the key itself."""


def read_key(path: Path) -> str:
    """The key in a mounted Secret file; a proxy without one would be an open door, so it does not start."""
    try:
        key = read_secret_file(path, f"--api-key-file {path}")
    except ValueError as exc:
        raise SystemExit(f"asyncrl engine-proxy: {exc}") from None
    if not key:
        raise SystemExit(f"asyncrl engine-proxy: --api-key-file {path} is empty; refusing to serve without a key")
    return key


def _forwarded(headers: Any) -> list[tuple[str, str]]:
    return [(k, v) for k, v in headers.items() if k.lower() not in _NOT_FORWARDED]


def _error(status: int, text: str) -> Response:
    """Refusals as the engines word theirs (a JSON `error`)."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": text}, status_code=status)


class EngineProxy:
    """An ASGI app forwarding authenticated requests to `upstream` (http://127.0.0.1:PORT)."""

    def __init__(self, upstream: str, api_key: str, health_path: str = "/health"):
        if not api_key:
            raise ValueError("EngineProxy needs a non-empty api_key")
        self.upstream = upstream.rstrip("/")
        self.api_key = api_key
        self.health_path = health_path
        self._client: httpx.AsyncClient | None = None

    def client(self) -> httpx.AsyncClient:
        import httpx

        if self._client is None:
            # No read/write/pool timeout: a generation's caller sets its own deadline.
            self._client = httpx.AsyncClient(timeout=httpx.Timeout(None, connect=5.0),
                                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        return self._client

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":  # a websocket: no engine route we serve needs one
            await send({"type": "websocket.close", "code": 1008})
            return
        from starlette.requests import Request

        response = await self.respond(Request(scope, receive))
        await response(scope, receive, send)

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self._client is not None:
                    await self._client.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def respond(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET" and path == LIVE_PATH:
            return _status(200, "live")
        if request.method == "GET" and path == READY_PATH:
            return await self._ready()
        if not bearer_matches(self.api_key, request.headers.get("authorization")):
            return _error(401, "Unauthorized")
        return await self._forward(request)

    async def _ready(self) -> Response:
        import httpx

        try:
            resp = await self.client().get(self.upstream + self.health_path, timeout=READY_TIMEOUT_S)
        except httpx.HTTPError:
            return _status(503, "engine not answering")
        return _status(200, "ready") if resp.status_code == 200 else _status(503, f"engine health {resp.status_code}")

    async def _forward(self, request: Request) -> Response:
        import httpx
        from starlette.background import BackgroundTask
        from starlette.responses import StreamingResponse

        target = self.upstream + request.scope.get("raw_path", request.url.path.encode()).decode("latin-1")
        if request.url.query:
            target += "?" + request.url.query
        client = self.client()
        # Content-Length passes on, so a sized body is not re-sent chunked.
        upstream_request = client.build_request(request.method, target, headers=_forwarded(request.headers),
                                                content=request.stream())
        try:
            resp = await client.send(upstream_request, stream=True)
        except httpx.HTTPError as exc:
            return _error(502, f"engine not reachable: {type(exc).__name__}")
        return StreamingResponse(resp.aiter_raw(), status_code=resp.status_code, headers=dict(_forwarded(resp.headers)),
                                 background=BackgroundTask(resp.aclose))


def _status(code: int, text: str) -> Response:
    """The probes' answers: a word, nothing about the engine."""
    from starlette.responses import PlainTextResponse

    return PlainTextResponse(text, status_code=code)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default="0.0.0.0", help="listen address (default: all, it is the pod's door)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"listen port (default {DEFAULT_PORT})")
    parser.add_argument("--upstream", required=True,
                        help="the engine, listening on loopback without a key, e.g. http://127.0.0.1:30001")
    parser.add_argument("--api-key-file", type=Path, required=True,
                        help="file holding the key every request must carry as `Authorization: Bearer KEY`")
    parser.add_argument("--health-path", default="/health",
                        help=f"the engine's health route, which {READY_PATH} reports (default /health)")
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")


def main(args: argparse.Namespace) -> int:
    """Serve the proxy until stopped."""
    import uvicorn

    proxy = EngineProxy(args.upstream, read_key(args.api_key_file), health_path=args.health_path)
    print(f"asyncrl engine-proxy: http://{args.host}:{args.port} -> {proxy.upstream} (key required)", flush=True)
    uvicorn.run(proxy, host=args.host, port=args.port, log_level=args.log_level, proxy_headers=False,
                server_header=False)
    return 0
