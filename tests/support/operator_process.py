"""Processes the operator tests run beside the apiserver: `asyncrl operator` as a subprocess, and
the trainer's real status endpoint serving a report the test controls."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.support.paths import REPO


class OperatorProcess:
    """`asyncrl operator` as a subprocess talking to an apiserver through a kubeconfig."""

    def __init__(self, kubeconfig: Path, log: Path, *, interval: float = 0.3, status_url_template: str | None = None,
                 redis_url_template: str | None = None, extra_args: tuple[str, ...] = ()):
        self.kubeconfig, self.log, self.interval = kubeconfig, log, interval
        self.status_url_template = status_url_template
        self.redis_url_template = redis_url_template
        self.extra_args = extra_args
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> OperatorProcess:
        env = dict(os.environ, KUBECONFIG=str(self.kubeconfig), PYTHONUNBUFFERED="1")
        env.pop("KUBERNETES_SERVICE_HOST", None)
        args = [sys.executable, "-m", "asyncrl.cli", "operator", "--interval", str(self.interval),
                "--liveness-port", "0", "--metrics-port", "0", "--verbose"]
        if self.status_url_template:
            args += ["--status-url-template", self.status_url_template]
        if self.redis_url_template:
            args += ["--redis-url-template", self.redis_url_template]
        args += list(self.extra_args)
        out = open(self.log, "ab")
        self.proc = await asyncio.create_subprocess_exec(*args, env=env, cwd=str(REPO), stdout=out,
                                                         stderr=subprocess.STDOUT)
        out.close()
        return self

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def stop(self, *, kill: bool = False) -> None:
        if not self.alive:
            return
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            await asyncio.wait_for(self.proc.wait(), 15)
        except asyncio.TimeoutError:
            self.proc.kill()
            await self.proc.wait()


def synthetic_report() -> Any:
    """A trainer report with recognisable figures (what the trainer's GET /status would return)."""
    from asyncrl.api.status_report import EngineReport, StalenessReport, StepMetrics, TrainerReport

    return TrainerReport(
        job="qwen", phase="Training", step=42, policy_version=42, max_steps=400,
        last_step=StepMetrics(step=42, policy_version=42, tokens_per_second=1234.5, reward_mean=0.625,
                              staleness_mean=1.75, staleness_max=4, clip_fraction=0.125),
        staleness=StalenessReport(limit=4, dropped=3),
        last_checkpoint="/shared/checkpoints/step-40",
        rollout=[EngineReport(url="http://10.0.0.1:30000", weight_version=41, ready=True),
                 EngineReport(url="http://10.0.0.2:30000", weight_version=42, ready=True)])


class _AsgiDelegate:
    """An ASGI app that serves whatever `app` holds now (an async __call__, so uvicorn sees ASGI 3)."""

    app: Any = None

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)


class TrainerStatusServer:
    """The trainer's real status endpoint (asyncrl.trainer.report.status_api) on a free local port,
    serving whatever `report` currently holds."""

    def __init__(self, report: Any, token: str | None = None):
        from asyncrl.trainer.report.status_api import StatusServer

        self.report = report
        self._app = _AsgiDelegate()
        self.require_token(token)
        self._server = StatusServer(self._app)  # type: ignore[arg-type]

    def require_token(self, token: str | None) -> None:
        """Serve from now on as a trainer started with ASYNCRL_STATUS_TOKEN=token (None: open)."""
        from asyncrl.trainer.report.status_api import create_app

        self._app.app = create_app(lambda: self.report, token=token)

    @property
    def port(self) -> int:
        assert self._server.port is not None
        return self._server.port

    async def __aenter__(self) -> TrainerStatusServer:
        await self._server.start()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self._server.stop()
