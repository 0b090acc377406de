"""Small networking helpers shared by the local runner, benchmarks and tests."""

from __future__ import annotations

import random
import socket
from pathlib import Path

EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
"""Where Linux says which local ports it hands to outgoing connections and to bind(port 0)."""
LOWEST_PORT = 10_000
"""free_port picks at or above this (below are well-known and registered services' ports)."""
_pick = random.SystemRandom()  # (not the `random` module's state: a test that seeds it must not make two
#                                 processes pick the same sequence)


def ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (32768 when it cannot be read)."""
    try:
        return int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port free now, for a server the caller starts soon.

    Picked at random below the kernel's ephemeral range: a port from bind(port 0) lies in that range,
    where every outgoing connection takes its local port too, so on a busy machine (a test suite with
    hundreds of clients) a client's connect() can take it before the server binds it. Below the range
    only another free_port caller can, one chance in tens of thousands. Falls back to the kernel's
    pick when no port there is free after `tries`."""
    low = ephemeral_low()
    if low - LOWEST_PORT > tries:
        for port in _pick.sample(range(LOWEST_PORT, low), tries):
            with socket.socket() as s:
                try:
                    s.bind((host, port))
                except OSError:  # in use (or in TIME_WAIT): another
                    continue
                return port
    with socket.socket() as s:
        s.bind((host, 0))
        found: int = s.getsockname()[1]
        return found
