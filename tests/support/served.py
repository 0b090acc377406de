"""A server process for a test: started with its output in a log, waited for until its health URL
answers 200, and stopped (SIGTERM, then SIGKILL after `grace`) when the block ends."""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx


@contextlib.contextmanager
def served(cmd: Sequence[str], health_url: str, *, log: Path, what: str, timeout: float = 60.0,
           cwd: Path | None = None, env: Mapping[str, str] | None = None, grace: float = 30.0) -> Iterator[None]:
    with log.open("wb") as out:
        proc = subprocess.Popen(list(cmd), cwd=cwd, env=None if env is None else dict(env), stdout=out,
                                stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout
        while True:
            assert proc.poll() is None, f"{what} exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, f"{what} not ready in {timeout:.0f} s:\n{log.read_text()[-3000:]}"
            time.sleep(0.2)
        yield
    finally:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
