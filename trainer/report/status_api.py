"""The trainer's read-only HTTP status endpoint: /status (JSON), /metrics (Prometheus), /healthz, /.

`create_app` builds the FastAPI app around a `get_report` callable so the trainer keeps a single
source of truth (its TrainerReport) and the server never touches training state.

While the trainer waits out an outage (Redis, see asyncrl/transport/connection.py), /status and
/metrics say so: the report's `degraded` (`DegradedReport`: status, reason RedisUnavailable or
EngineUnavailable, message, since, outages) is filled in at request time from the process's Health
board (asyncrl/infra/health.py), not by the training loop, because the loop is blocked inside the
very Redis command that waits and cannot update its report. It goes through the TrainerReport model (`with_health`), so
what is served is what the operator's mirror parses; the key is absent while nothing is down, so
a healthy trainer's document is exactly what it was before (readers that do not know it ignore it).

`StatusServer` runs uvicorn inside the trainer's own asyncio loop (or in a helper thread when the
loop is busy with compute) and stops it cleanly, without taking over the process's signal handlers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import html
import logging
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any
from urllib.parse import parse_qs, urlencode

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint

from asyncrl.api.status_report import DegradedReport, TrainerReport
from asyncrl.infra.health import HEALTH, Health
from asyncrl.trainer.report.dashboard import dashboard_html
from asyncrl.trainer.report.prometheus import TrainerMetrics

log = logging.getLogger(__name__)

PUBLIC_PATHS = frozenset({"/healthz"})
"""Routes that never need the token (liveness probes cannot carry secrets)."""
NO_STORE = {"Cache-Control": "no-store"}
LOGIN_PATH = "/login"
SESSION_COOKIE = "asyncrl_dashboard"
COOKIE_PATHS = frozenset({"/", "/status"})
"""What the dashboard's session cookie opens: the page and the report it polls (not /metrics)."""


def session_value(token: str) -> str:
    """The dashboard cookie's value: derived from the token (HMAC-SHA256), so the cookie a browser
    keeps opens the page and its polls but is not the token itself."""
    return hmac.new(token.encode(), b"asyncrl-dashboard-session", hashlib.sha256).hexdigest()


def login_page(action_query: str, problem: str = "") -> str:
    """The form a person types the token into (a browser cannot send a header on navigation, and a
    token in the URL would end up in history, proxy logs and Referer headers)."""
    action = "login" + ("?" + action_query if action_query else "")
    note = f'<p class="problem">{html.escape(problem)}</p>' if problem else ""
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>asyncrl trainer: sign in</title>
<style>body{{font:15px system-ui,sans-serif;margin:4em auto;max-width:28em}}.problem{{color:#b00}}
input{{width:100%;padding:.4em;margin:.5em 0}}</style></head>
<body><h1>asyncrl trainer</h1>
<p>This dashboard needs the job's status token (<code>kubectl get secret &lt;job&gt;-status-auth -o
jsonpath='{{.data.token}}' | base64 -d</code>).</p>{note}
<form method="post" action="{html.escape(action, quote=True)}">
<label>status token <input type="password" name="token" autocomplete="current-password" autofocus></label>
<button type="submit">Open the dashboard</button></form></body></html>
"""


def create_app(
    get_report: Callable[[], TrainerReport],
    *,
    token: str | None = None,
    metrics: TrainerMetrics | None = None,
    health: Health | None = HEALTH,
) -> FastAPI:
    """Build the status app. `get_report` must be cheap and thread-safe (return a snapshot);
    `health`: the board whose outages make /status and /metrics say Degraded (None: the report's
    own `degraded` is served as it is)."""
    app = FastAPI(
        title="asyncrl trainer status",
        docs_url=None,
        redoc_url=None,
        openapi_url=None,  # read-only surface: nothing beyond the four routes
    )
    trainer_metrics = metrics if metrics is not None else TrainerMetrics()
    app.state.metrics = trainer_metrics

    def report_or_503() -> TrainerReport | JSONResponse:
        try:
            return with_health(get_report(), health)
        except Exception as exc:  # the trainer's bug must not kill its status endpoint
            log.exception("status report provider failed")
            return JSONResponse(
                {"error": f"status report unavailable: {exc}", "status": 503}, status_code=503, headers=NO_STORE
            )

    @app.get("/status")
    async def status() -> Response:
        report = report_or_503()
        if isinstance(report, Response):
            return report
        return JSONResponse(status_document(report), headers=NO_STORE)

    @app.get("/metrics")
    async def metrics_route() -> Response:
        report = report_or_503()
        if isinstance(report, Response):
            return report
        trainer_metrics.update(report)
        return Response(generate_latest(trainer_metrics.registry), media_type=CONTENT_TYPE_LATEST, headers=NO_STORE)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(dashboard_html(), headers=NO_STORE)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(request, exc.status_code, _reason(exc), dict(exc.headers or {}))

    if token:
        _add_login(app, token)
        app.add_middleware(_BearerAuth, token=token)
    return app


def _add_login(app: FastAPI, token: str) -> None:
    """POST /login: the login form's token, checked; right, a session cookie (HttpOnly, SameSite
    Strict: no script and no other site's page can use it) and back to the dashboard."""

    @app.post(LOGIN_PATH)
    async def login(request: Request) -> Response:
        form = parse_qs((await request.body()).decode("utf-8", "replace"))
        query = request.url.query
        if not hmac.compare_digest((form.get("token") or [""])[0].encode(), token.encode()):
            return HTMLResponse(login_page(query, "That is not this job's status token."), status_code=401,
                                headers=NO_STORE)
        response = RedirectResponse("./" + ("?" + query if query else ""), status_code=303, headers=NO_STORE)
        response.set_cookie(SESSION_COOKIE, session_value(token), httponly=True, samesite="strict")
        return response


def with_health(report: TrainerReport, health: Health | None = HEALTH) -> TrainerReport:
    """The report as served: its `degraded` set from `health`'s current outages, or cleared when
    there are none (the board is the only authority on what is down now: a report restored from a
    checkpoint must not carry an old outage). A copy; the trainer's own report is left alone."""
    if health is None:
        return report
    condition = health.condition()
    degraded = DegradedReport.model_validate(condition) if condition["status"] else None
    if degraded is None and report.degraded is None:
        return report
    return report.model_copy(update={"degraded": degraded})


def status_document(report: TrainerReport) -> dict[str, Any]:
    """The /status JSON of a served report (`with_health`): its dump, without `degraded` while
    nothing is down (absent rather than null, as before the field existed)."""
    return report.model_dump(mode="json", exclude={"degraded"} if report.degraded is None else None)


class _BearerAuth(BaseHTTPMiddleware):
    """Every route except /healthz needs `Authorization: Bearer <token>`.

    A person opens the dashboard in a browser, which cannot send a header on navigation: `/` without
    credentials answers the login form, whose POST /login sets the session cookie (`session_value`)
    that opens `/` and `/status` only. The token is never accepted in a URL.
    """

    def __init__(self, app: Any, token: str) -> None:
        super().__init__(app)
        self._token = token.encode()
        self._session = session_value(token).encode()

    async def dispatch(self, request: Request, call_next: RequestResponseEndpoint) -> Response:
        path = request.url.path
        if path in PUBLIC_PATHS or (path == LOGIN_PATH and request.method == "POST") or self._authorized(request):
            return await call_next(request)
        headers = {"WWW-Authenticate": 'Bearer realm="asyncrl-trainer"', **NO_STORE}
        if path == "/" and request.method == "GET":
            query = urlencode([(k, v) for k, v in request.query_params.multi_items() if k != "token"])
            problem = ("The token is not accepted in the URL (it would stay in browser history, proxy logs "
                       "and Referer headers): enter it here." if "token" in request.query_params else "")
            return HTMLResponse(login_page(query, problem), status_code=401, headers=headers)
        return _error(request, 401, "missing or invalid bearer token (send 'Authorization: Bearer <token>')",
                      headers)

    def _authorized(self, request: Request) -> bool:
        scheme, _, credentials = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self._matches(credentials.strip(), self._token):
            return True
        return request.url.path in COOKIE_PATHS and self._matches(request.cookies.get(SESSION_COOKIE, ""),
                                                                   self._session)

    @staticmethod
    def _matches(candidate: str, secret: bytes) -> bool:
        return bool(candidate) and hmac.compare_digest(candidate.encode(), secret)


def _reason(exc: StarletteHTTPException) -> str:
    if exc.status_code == 404:
        return "not found"
    if exc.status_code == 405:
        return "method not allowed (this endpoint is read-only: use GET)"
    return str(exc.detail)


def _error(request: Request, status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": message, "status": status, "method": request.method, "path": request.url.path}
    return JSONResponse(body, status_code=status, headers=headers)


class _EmbeddedUvicorn(uvicorn.Server):
    """uvicorn without its signal capture: the trainer, not the status server, owns SIGINT/SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class StatusServer:
    """Runs the status app with uvicorn inside an existing asyncio loop, or in a helper thread.

    In-loop (`await start()` / `await stop()`) suits a loop that is not blocked by compute. When the
    training step runs synchronously on the loop's thread, use `start_in_thread()` / `stop_thread()`
    so /status keeps answering during long steps. `port=0` picks a free port; read `.port`/`.url`.
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning") -> None:
        self.app = app
        self.host = host
        self._requested_port = port
        self._log_level = log_level
        self._server: _EmbeddedUvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._thread_loop: asyncio.AbstractEventLoop | None = None
        self.port: int | None = None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("status server not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    async def start(self, startup_timeout: float = 10.0) -> str:
        """Bind, start serving in the running loop, and return the base URL once it accepts."""
        if self._task is not None:
            raise RuntimeError("status server already started")
        sock = _bind(self.host, self._requested_port)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self.app,
            log_level=self._log_level,
            access_log=False,
            lifespan="off",
            timeout_graceful_shutdown=2,
        )
        self._server = _EmbeddedUvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="asyncrl-status-server")
        deadline = asyncio.get_running_loop().time() + startup_timeout
        while not self._server.started:
            if self._task.done():
                sock.close()
                self._task.result()  # re-raise the startup error
                raise RuntimeError(f"status server on {self.host}:{self.port} exited during startup")
            if asyncio.get_running_loop().time() > deadline:
                await self.stop()
                raise TimeoutError(f"status server on {self.host}:{self.port} did not start in {startup_timeout}s")
            await asyncio.sleep(0.01)
        log.info("status endpoint listening on %s", self.url)
        return self.url

    async def stop(self, timeout: float = 5.0) -> None:
        """Stop accepting, let in-flight requests finish (bounded), then return. Idempotent."""
        server, task = self._server, self._task
        if server is None or task is None:
            return
        server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            server.force_exit = True
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        finally:
            self._server = None
            self._task = None

    def start_in_thread(self, startup_timeout: float = 10.0) -> str:
        """Serve from a daemon thread with its own loop (for trainers whose loop blocks on compute)."""
        if self._thread is not None:
            raise RuntimeError("status server already started")
        started = threading.Event()
        errors: list[BaseException] = []
        loop = asyncio.new_event_loop()

        def run() -> None:
            asyncio.set_event_loop(loop)
            try:
                loop.run_until_complete(self.start(startup_timeout))
            except BaseException as exc:  # reported to the caller below
                errors.append(exc)
                started.set()
                loop.close()
                return
            started.set()
            try:
                loop.run_until_complete(self._task)  # type: ignore[arg-type]
            except BaseException:
                pass
            finally:
                loop.close()

        self._thread_loop = loop
        self._thread = threading.Thread(target=run, name="asyncrl-status-server", daemon=True)
        self._thread.start()
        started.wait(startup_timeout + 5)
        if errors:
            self._thread.join()
            self._thread = None
            raise errors[0]
        return self.url

    def stop_thread(self, timeout: float = 5.0) -> None:
        """Stop a server started with `start_in_thread()` and join its thread. Idempotent."""
        thread, loop = self._thread, self._thread_loop
        if thread is None or loop is None:
            return
        server = self._server
        if server is not None:
            loop.call_soon_threadsafe(setattr, server, "should_exit", True)
        thread.join(timeout)
        if thread.is_alive() and server is not None:
            loop.call_soon_threadsafe(setattr, server, "force_exit", True)
            thread.join(timeout)
        self._thread = None
        self._thread_loop = None
        self._server = None
        self._task = None


async def serve(
    app: FastAPI,
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    on_started: Callable[[str], None] | None = None,
) -> None:
    """Serve `app` in the running loop until cancelled; cancellation stops the server cleanly.

    `on_started(url)` is called once the socket accepts (useful with port=0 to learn the port).
    """
    server = StatusServer(app, host, port)
    url = await server.start()
    if on_started is not None:
        on_started(url)
    try:
        await asyncio.Event().wait()
    finally:
        await asyncio.shield(server.stop())


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"status endpoint cannot bind {host}:{port}: {exc.strerror}") from exc
    sock.set_inheritable(True)
    return sock
