"""The figures every benchmark prints about the machine it ran on (these machines are shared:
the load average before and after says how quiet the run was)."""

from __future__ import annotations

import os
import platform
from typing import Any


def load_average() -> float | None:
    """The 1-minute load average, where the system has one."""
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


def machine_figures(load_start: float | None) -> dict[str, Any]:
    """Threads, cores, load average at the start (`load_start`) and now, torch and Python versions."""
    import torch

    return {"torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "load_avg_1m_start": load_start, "load_avg_1m_end": load_average(),
            "torch": torch.__version__, "python": platform.python_version()}
