"""The trainer's report behind its lock, and the protocol of the experiment trackers.

The report is read by the status endpoint's thread (/status, the dashboard, the operator's mirror)
while the loop writes it; every write goes through `edit`, every read through `snapshot`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from asyncrl.api.status_report import EvalRecord, TrainerReport


class TrackerSink(Protocol):
    """Where rank 0 hands its figures: the experiment trackers (spec.logging; trainer/report/trackers.py
    builds them), per-step figures and evaluation results, by trainer step. A tracker that fails is
    theirs to report (trackers.py turns each failure into a warning); the loop calls them as they are."""

    def log_step(self, step: int, figures: dict[str, float]) -> None: ...

    def log_eval(self, step: int, record: EvalRecord) -> None: ...

    def close(self) -> None: ...


class Reporter:
    """One `TrainerReport`, written by the loop and read by the status endpoint's thread."""

    def __init__(self, report: TrainerReport):
        self._report = report
        self._lock = threading.Lock()

    def snapshot(self) -> TrainerReport:
        """A deep copy, safe to serve while the loop goes on."""
        with self._lock:
            return self._report.model_copy(deep=True)

    @contextmanager
    def reading(self) -> Iterator[TrainerReport]:
        """The report, held under the lock for the block, to read in place (no copy, no stamp)."""
        with self._lock:
            yield self._report

    @contextmanager
    def edit(self) -> Iterator[TrainerReport]:
        """The report, held under the lock for the block; its `updated_at` is stamped after it."""
        with self._lock:
            yield self._report
            self._report.updated_at = time.time()

    def set_phase(self, phase: str, message: str = "", reason: str = "") -> None:
        with self.edit() as r:
            r.phase = phase  # type: ignore[assignment]
            r.message = message
            if reason:
                r.reason = reason

    def set_fields(self, fields: dict[str, Any]) -> None:
        """Set report fields by name (e.g. the recorded outcome's `TrainerOutcome.report_fields()`)."""
        with self.edit() as r:
            for key, value in fields.items():
                setattr(r, key, value)
