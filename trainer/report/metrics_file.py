"""metrics.jsonl, the run's record of every step: one line per step (its StepMetrics) and one per
held-out evaluation result (`"event": "eval"`, the EvalRecord, and the trainer step it was read at);
per-step lines have no `event` key. Rank 0 appends; a resumed trainer first forgets the lines of
steps its checkpoint does not hold."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from asyncrl.api.status_report import EvalRecord, StepMetrics


def metrics_line(metrics: StepMetrics) -> dict[str, Any]:
    """A step's line of metrics.jsonl: every figure of its record, as computed (NaN stays NaN)."""
    return metrics.model_dump()


def append_metrics_line(path: Path, metrics: StepMetrics) -> None:
    """Append the step's line (`metrics_line`)."""
    _append(path, metrics_line(metrics))


EVENT_KEY = "event"
"""Lines that are not per-step lines carry this key (readers of steps skip them)."""


def eval_line(step: int, record: EvalRecord) -> dict[str, Any]:
    """The metrics.jsonl line of one evaluation result, read at trainer step `step`."""
    return {EVENT_KEY: "eval", **record.model_dump(mode="json"), "step": step}


def append_eval_line(path: Path, step: int, record: EvalRecord) -> None:
    """Append the line of one evaluation result (`eval_line`) beside the per-step lines."""
    _append(path, eval_line(step, record))


def written_evaluations(path: Path) -> list[EvalRecord]:
    """The evaluation results metrics.jsonl already holds (an earlier life of the trainer wrote them)."""
    if not path.exists():
        return []
    out = []
    for text in path.read_text().splitlines():
        try:
            line = json.loads(text)
            if isinstance(line, dict) and line.get(EVENT_KEY) == "eval":
                out.append(EvalRecord.model_validate(line))  # (extra keys are ignored)
        except ValueError:  # (pydantic's ValidationError is one too)
            continue
    return out


def _append(path: Path, line: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as fh:
        fh.write(json.dumps(line) + "\n")


def truncate_metrics(path: Path, step: int) -> None:
    """On resume: forget metrics lines of steps after the checkpoint (their updates were lost), eval
    lines read after it too (the resumed trainer reads the results again and writes them anew)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:
            continue
    path.write_text("".join(k + "\n" for k in kept))
