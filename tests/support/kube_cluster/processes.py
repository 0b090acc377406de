"""Container processes: exit codes, process groups and the marker that stands in for a PID namespace."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

from tests.support.kube_cluster.objects import CONTAINER_ENV


def exit_code(returncode: int) -> int:
    """A container's exit code: 128 + signal for a signalled process, as container runtimes report it."""
    return returncode if returncode >= 0 else 128 - returncode


def killpg(pgid: int | None, sig: int) -> None:
    if pgid:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)


def marked_processes(markers: Sequence[str] | set[str]) -> list[int]:
    """Live processes whose environment carries `CONTAINER_ENV=<marker>` for one of `markers` (read from
    /proc; a zombie's environment is empty): a container instance's processes, wherever they went."""
    needles = [f"\0{CONTAINER_ENV}={marker}\0".encode() for marker in markers]
    if not needles:
        return []
    out = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            data = b"\0" + environ.read_bytes()
        except OSError:
            continue
        if any(needle in data for needle in needles):
            out.append(int(environ.parent.name))
    return out


def kill_container(pgid: int | None, marker: str | None, sig: int) -> None:
    """Signal every process of a container instance: its process group, and the processes that left it
    (a new session, as torchrun's workers) but carry its marker, as a PID namespace would take them along."""
    killpg(pgid, sig)
    for pid in marked_processes([marker] if marker else []):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


_LIBC = ctypes.CDLL(None) if sys.platform.startswith("linux") else None
_PR_SET_PDEATHSIG = 1


def die_with_test_process() -> None:
    """preexec_fn of every container process: SIGKILL it if the test process dies without stopping the
    cluster (a test runner killed by a timeout must not leave pods running; grandchildren are not covered)."""
    if _LIBC is not None:
        _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def group_alive(pgid: int) -> bool:
    """Whether any non-zombie process is still in process group `pgid` (read from /proc)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False
