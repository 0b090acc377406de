"""The trainer's outcome: how a job ended, recorded durably so that the operator (not a pod exit)
decides the job's phase, and a restarted trainer pod never trains or publishes again.

A StatefulSet pod always restarts, so the trainer does not exit when training ends: it records
the outcome (Redis first, then a file on the weights volume; both keyed by the job's uid, so a
re-created job with the same name never reads an old run's outcome), then stays up serving it on
/status. The operator reads the record, sets Succeeded/Failed and scales the trainer and rollout
to zero (as KubeRay tears down a finished RayJob's cluster).

Pure data and small I/O helpers; no torch, safe for the operator to import.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from asyncrl.api.stream_names import StreamNames
from asyncrl.infra.files import write_file_atomically

OutcomePhase = Literal["Succeeded", "Failed"]
OUTCOME_FILE = "outcome.json"

EXIT_CONFIG_ERROR = 78
"""Exit code of a trainer that cannot start because the job is misconfigured (sysexits EX_CONFIG):
retrying cannot help, so the operator fails the job at once instead of counting restarts."""

CONFIG_ERROR_REASONS = ("InvalidJobFile", "ModelNotFound", "InvalidSpec", "InvalidConfiguration")
"""Reasons the trainer puts first in its termination message (`Reason: detail`) for a config error."""


def is_config_error(exit_code: int | None, message: str) -> bool:
    """A trainer container that ended on a configuration error: exit code 78, or (under torchrun,
    which turns any worker failure into exit code 1) a termination message naming a config reason."""
    return exit_code == EXIT_CONFIG_ERROR or message.lstrip().startswith(
        tuple(f"{reason}:" for reason in CONFIG_ERROR_REASONS))


TERMINATION_LOG = Path("/dev/termination-log")
"""Kubernetes' default terminationMessagePath: its content becomes lastState.terminated.message."""
ENV_TERMINATION_LOG = "ASYNCRL_TERMINATION_LOG"
"""Overrides where the termination message goes (`asyncrl run` and tests point it into a folder)."""
TERMINATION_MESSAGE_LIMIT = 4000
"""Kubernetes keeps at most 4096 bytes of a termination message."""


class TrainerOutcome(BaseModel):
    """How training ended. Written once; a later write for the same job uid must not change it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job: str
    job_uid: str = ""
    """metadata.uid of the AsyncRLJob ("" for local runs, which have no API object)."""
    phase: OutcomePhase
    reason: str
    """CamelCase, for the job's status.reason: MaxStepsReached, TooManyBadSteps, ..."""
    message: str = ""
    step: int = 0
    policy_version: int = 0
    weights_path: str | None = None
    """The final weights directory (on the shared volume)."""
    finished_at: float = 0.0
    report: dict[str, Any] | None = None
    """The trainer's last /status document (TrainerReport, without its per-step history): a
    restarted trainer serves it again without having trained."""

    @property
    def summary(self) -> str:
        """One line for logs and the termination message: `Succeeded (MaxStepsReached): ...`."""
        return f"{self.phase} ({self.reason}) at step {self.step}, policy version {self.policy_version}" \
            + (f": {self.message}" if self.message else "")

    def report_fields(self) -> dict[str, Any]:
        """The TrainerReport fields this outcome sets (phase, message, reason, step, version, weights)."""
        return {"phase": self.phase, "message": self.message, "reason": self.reason, "step": self.step,
                "policy_version": self.policy_version, "final_weights": self.weights_path}

    def to_json(self) -> str:
        return self.model_dump_json()

    @classmethod
    def from_json(cls, raw: str | bytes) -> TrainerOutcome | None:
        """The outcome in `raw`, or None when it is missing or unreadable (treated as "not ended")."""
        try:
            return cls.model_validate_json(raw)
        except (ValidationError, ValueError):
            return None


def new_outcome(job: str, job_uid: str, phase: OutcomePhase, reason: str, **fields: Any) -> TrainerOutcome:
    return TrainerOutcome(job=job, job_uid=job_uid, phase=phase, reason=reason,
                          finished_at=fields.pop("finished_at", time.time()), **fields)


# ------------------------------------------------------------------------------------ file record


def outcome_path(weights_dir: Path) -> Path:
    return Path(weights_dir) / OUTCOME_FILE


def write_outcome_file(weights_dir: Path, outcome: TrainerOutcome) -> Path:
    """Atomically (write temp, fsync, rename) record the outcome next to the weights."""
    path = outcome_path(weights_dir)
    write_file_atomically(path, outcome.to_json())
    return path


def read_outcome_file(weights_dir: Path, job_uid: str) -> TrainerOutcome | None:
    """The recorded outcome of the job with `job_uid` (an outcome of another uid is not ours)."""
    try:
        raw = outcome_path(weights_dir).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    outcome = TrainerOutcome.from_json(raw)
    return outcome if outcome is not None and outcome.job_uid == job_uid else None


def remove_outcome_file(weights_dir: Path) -> bool:
    """Forget the file record (`asyncrl run` starting a new attempt in an old run directory)."""
    try:
        outcome_path(weights_dir).unlink()
    except FileNotFoundError:
        return False
    return True


# ------------------------------------------------------------------------------------ Redis record


async def write_outcome_redis(redis: Any, names: StreamNames, outcome: TrainerOutcome) -> bool:
    """Record the outcome unless one is already there (SET NX): the first outcome wins; True if ours."""
    return bool(await redis.set(names.outcome, outcome.to_json(), nx=True))


async def read_outcome_redis(redis: Any, names: StreamNames) -> TrainerOutcome | None:
    """The recorded outcome, or None (none yet, or unreadable)."""
    raw = await redis.get(names.outcome)
    return None if raw is None else TrainerOutcome.from_json(raw)


def read_outcome_redis_sync(redis: Any, names: StreamNames) -> TrainerOutcome | None:
    """`read_outcome_redis` for a synchronous client (redis.Redis): `asyncrl run` polls with it."""
    raw = redis.get(names.outcome)
    return None if raw is None else TrainerOutcome.from_json(raw)


# ------------------------------------------------------------------------------ termination message


def termination_log_path() -> Path | None:
    """Where the termination message goes: $ASYNCRL_TERMINATION_LOG, else /dev/termination-log when
    it exists (Kubernetes mounts it into every container); None elsewhere (never create /dev files)."""
    override = os.environ.get(ENV_TERMINATION_LOG)
    if override:
        return Path(override)
    return TERMINATION_LOG if TERMINATION_LOG.exists() else None


def write_termination_message(text: str, path: Path | None = None) -> bool:
    """Best effort: Kubernetes shows this as the container's lastState.terminated.message (the last
    4000 characters). `path` defaults to `termination_log_path()`. True if written."""
    target = path if path is not None else termination_log_path()
    if target is None:
        return False
    try:
        target.write_text(text[-TERMINATION_MESSAGE_LIMIT:], encoding="utf-8")
    except OSError:
        return False
    return True


def dumps(outcome: TrainerOutcome) -> dict[str, Any]:
    return json.loads(outcome.to_json())
