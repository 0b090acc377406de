"""Experiment trackers (spec.logging): the figures of /status in TensorBoard, W&B and MLflow.

The trainer's rank 0 hands every step's figures to `Trackers.log_step` and every held-out evaluation
to `Trackers.log_eval`, both at the trainer step, so every tracker and metrics.jsonl share one x axis.
Names: a figure without a `/` goes under `train/` (`train/loss`), evaluations under `eval/`
(`eval/pass_at_1`, `eval/policy_version`).

Rules, the same for every tracker:
- Each tracker's package is an optional extra, imported only when configured. A configured tracker
  whose package is missing is a `TrackerError` (a SpecError: the trainer exits 78, InvalidSpec)
  raised before any tracker starts, so a misconfigured job fails at once instead of training blind.
- A tracker that fails later (its server unreachable, a deleted store) logs a warning and training
  goes on; the next call tries again. MLflow's calls run on a thread of their own (its client
  retries a dead server for minutes); W&B queues in its own service process.
- Non-finite figures (NaN, ±inf) are left out: the W&B and MLflow servers reject or mangle them, and
  one rule keeps the trackers identical. metrics.jsonl keeps the raw values.
- A restarted trainer (same run directory) continues the same W&B and MLflow runs, whose ids are kept
  in `<run_dir>/trackers.json`. TensorBoard drops the events the earlier life wrote past the point the
  trainer resumed from (SummaryWriter's purge_step); MLflow keeps both values of a step logged twice
  and W&B keeps the first (it refuses steps below its last one).
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import numbers
import os
import queue
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

from asyncrl.api.spec import LoggingSpec, MlflowSpec, TensorBoardSpec, WandbSpec
from asyncrl.api.status_report import EvalRecord
from asyncrl.infra.errors import SpecError
from asyncrl.infra.files import write_file_atomically

log = logging.getLogger(__name__)

IDS_FILE = "trackers.json"
"""In the run directory: the W&B and MLflow run ids a restarted trainer continues."""
EVAL_FIGURES = ("reward_mean", "pass_at_1", "pass_at_k", "k", "prompts", "samples", "on_version",
                "response_length", "seconds")
"""The EvalRecord fields logged under `eval/` (besides `eval/policy_version`, and each source's
`eval/pass_at_1/<source>` and `eval/reward_mean/<source>` with spec.evaluation.datasets)."""
PACKAGES = {"tensorboard": ("tensorboard", "tensorboard"), "wandb": ("wandb", "wandb"),
            "mlflow": ("mlflow", "mlflow-skinny")}
"""spec.logging field -> (module to import, the PyPI package the extra of that name installs)."""
MLFLOW_CLOSE_SECONDS = 60.0
"""How long `close` waits for MLflow calls still queued (an unreachable server) before giving up."""
MLFLOW_BATCH_PARAMS = 100
"""MLflow's limit of params per log_batch call."""
MLFLOW_KEY_MAX = 250
MLFLOW_VALUE_MAX = 6000
"""MLflow's limits on a param's key and value length (values longer are cut, ending in '...')."""


class TrackerError(SpecError):
    """A configured tracker cannot be used here: its package is missing or it refuses its settings."""


class Backend(Protocol):
    """One tracker. `begin` is called once, before the first `log`, with the first step this process
    writes new training figures for (a restarted trainer's resume point)."""

    name: str

    def begin(self, step: int) -> None: ...

    def log(self, step: int, values: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def require(field: str) -> None:
    """Import spec.logging.<field>'s package, or raise the TrackerError naming the extra to install."""
    module, package = PACKAGES[field]
    try:
        importlib.import_module(module)
    except ImportError as exc:
        raise missing(field, package, exc) from exc


def missing(field: str, package: str, exc: BaseException) -> TrackerError:
    return TrackerError(f"spec.logging.{field} needs the {package} package: pip install 'asyncrl[{field}]' "
                        f"(or the trainer image built with it; import failed: {exc})")


# --------------------------------------------------------------------------------- front


class Trackers:
    """Every configured tracker behind one call; empty (every call a no-op) when none is."""

    def __init__(self, backends: list[Backend] | None = None) -> None:
        self._backends: list[Backend] = list(backends or [])
        self._failing: set[str] = set()
        self._begun = False

    @property
    def names(self) -> list[str]:
        return [b.name for b in self._backends]

    def __bool__(self) -> bool:
        return bool(self._backends)

    @classmethod
    def from_spec(cls, logging: LoggingSpec, run_dir: Path, job: str,
                  config: Mapping[str, Any] | None = None) -> Trackers:
        """The trackers spec.logging configures. `config` (the job spec as a dict) becomes the run's
        hyperparameters (W&B config, MLflow params, a TensorBoard text). Raises TrackerError when a
        configured tracker's package is missing; a tracker that cannot start otherwise (network) is
        left out with a warning."""
        fields = [f for f in PACKAGES if getattr(logging, f) is not None]
        for field in fields:  # every package first: a missing one must not leave half-started runs
            require(field)
        if not fields:
            return cls()
        run_dir = Path(run_dir)
        ids = RunIds(run_dir / IDS_FILE, job)
        cfg = dict(config or {})
        makers: dict[str, Callable[[], Backend]] = {
            "tensorboard": lambda: TensorBoardBackend(_given(logging.tensorboard), run_dir, cfg),
            "wandb": lambda: WandbBackend(_given(logging.wandb), run_dir, job, cfg, ids),
            "mlflow": lambda: MlflowBackend(_given(logging.mlflow), run_dir, job, cfg, ids),
        }
        backends: list[Backend] = []
        try:
            for field in fields:
                try:
                    backends.append(makers[field]())
                except ImportError as exc:  # a part of the package (or a store's driver) is missing
                    raise missing(field, PACKAGES[field][1], exc) from exc
                except TrackerError:
                    raise
                except Exception as exc:
                    log.warning("spec.logging.%s: cannot start (%s: %s); training goes on without it",
                                field, type(exc).__name__, exc)
        except BaseException:
            cls(backends).close()
            raise
        log.info("experiment trackers: %s", ", ".join(b.name for b in backends) or "none started")
        return cls(backends)

    def log_step(self, step: int, figures: Mapping[str, Any]) -> None:
        """One training step's figures (plain numbers; anything else is ignored)."""
        values = {(k if "/" in k else f"train/{k}"): float(v) for k, v in figures.items() if _finite(v)}
        self._emit(step, values, resume=step)

    def log_eval(self, step: int, record: EvalRecord) -> None:
        """One evaluation result, at the trainer step it arrived at."""
        raw: dict[str, Any] = {name: getattr(record, name) for name in EVAL_FIGURES}
        raw["policy_version"] = record.policy_version
        for source, value in record.pass_at_1_by_source.items():  # (spec.evaluation.datasets)
            raw[f"pass_at_1/{source}"] = value
        for source, value in record.reward_by_source.items():
            raw[f"reward_mean/{source}"] = value
        values = {f"eval/{k}": float(v) for k, v in raw.items() if _finite(v)}
        self._emit(step, values, resume=step + 1)  # step `step` was trained before: new ones follow

    def close(self) -> None:
        """Finish every run (flushes what is queued); the Trackers is empty afterwards."""
        backends, self._backends = self._backends, []
        for b in backends:
            self._guard(b, "close", b.close)

    def __enter__(self) -> Trackers:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _emit(self, step: int, values: dict[str, float], resume: int) -> None:
        if not values or not self._backends:
            return
        if not self._begun:
            self._begun = True
            for b in self._backends:
                self._guard(b, "begin", b.begin, resume)
        for b in self._backends:
            self._guard(b, "log", b.log, step, dict(values))  # (a copy each: a tracker may keep it)

    def _guard(self, backend: Backend, what: str, call: Callable[..., None], *args: Any) -> None:
        """Run one tracker call; a failure is a warning (once until it works again), never an exception."""
        try:
            call(*args)
        except Exception as exc:
            if backend.name not in self._failing:
                log.warning("tracker %s: %s failed (%s: %s); training goes on", backend.name, what,
                            type(exc).__name__, exc)
                self._failing.add(backend.name)
            return
        if backend.name in self._failing:
            log.info("tracker %s works again", backend.name)
            self._failing.discard(backend.name)


def _finite(v: Any) -> bool:
    """A plain finite number (numpy's too); not a bool, a string or a list."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def _given(spec: Any) -> Any:
    assert spec is not None  # (only called for configured fields)
    return spec


class RunIds:
    """The run ids of this job's trackers in the run directory, so a restarted trainer continues its
    runs; ids written for another job name are ignored."""

    def __init__(self, path: Path, job: str) -> None:
        self.path, self.job = path, job
        self._lock = threading.Lock()

    def get(self, tracker: str) -> str | None:
        data = self._read()
        value = data.get(tracker) if data.get("job") == self.job else None
        return value if isinstance(value, str) else None

    def put(self, tracker: str, run_id: str) -> None:
        with self._lock:
            data = self._read()
            if data.get("job") != self.job:
                data = {"job": self.job}
            data[tracker] = run_id
            write_file_atomically(self.path, json.dumps(data, indent=1) + "\n")

    def _read(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}


# ------------------------------------------------------------------------------ backends


class TensorBoardBackend:
    """Event files, flushed after every call (a crash loses nothing logged). Values are TensorBoard's
    scalars (float32). The writer opens at `begin`, purging what an earlier life wrote from there on."""

    name = "tensorboard"

    def __init__(self, spec: TensorBoardSpec, run_dir: Path, config: Mapping[str, Any]) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self._writer_type = SummaryWriter
        self.log_dir = _log_dir(spec.log_dir, run_dir)
        self._config = config
        self._writer: Any = None

    def begin(self, step: int) -> None:
        self._writer = self._writer_type(log_dir=self.log_dir, purge_step=step)
        if self._config:
            text = json.dumps(self._config, indent=2, sort_keys=True, default=str)
            self._writer.add_text("config", f"```\n{text}\n```", global_step=step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._writer.add_scalar(key, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _log_dir(log_dir: str | None, run_dir: Path) -> str:
    """spec.logging.tensorboard.logDir: unset = <run_dir>/tensorboard; relative = inside the run
    directory (a pod's working directory is not on the job's volume); a URL (s3://...) as given."""
    if log_dir is None:
        return str(run_dir / "tensorboard")
    if "://" in log_dir:
        return log_dir
    return str(run_dir / log_dir)


class WandbBackend:
    """One W&B run named after the job; `mode: offline` writes it under <run_dir>/wandb for a later
    `wandb sync`. W&B's own console capture is off (the trainer's log stays as it is)."""

    name = "wandb"

    def __init__(self, spec: WandbSpec, run_dir: Path, job: str, config: Mapping[str, Any], ids: RunIds) -> None:
        import wandb

        run_dir.mkdir(parents=True, exist_ok=True)
        run_id = ids.get("wandb") or f"{job[:50]}-{uuid.uuid4().hex[:8]}"
        try:
            self.run = wandb.init(project=spec.project, entity=spec.entity, mode=spec.mode, tags=spec.tags or None,
                                  dir=str(run_dir), config=dict(config), name=job, id=run_id, resume="allow",
                                  settings=wandb.Settings(console="off", silent=True))
        except wandb.errors.UsageError as exc:  # e.g. online without an API key: the job's settings
            raise TrackerError(f"spec.logging.wandb: {exc} (mode {spec.mode}: set WANDB_API_KEY, on a cluster "
                               "through spec.logging.wandb.apiKeySecret, or use mode: offline)") from exc
        ids.put("wandb", run_id)

    def begin(self, step: int) -> None:
        pass

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        import wandb

        self.run.finish()
        # finish() only tells W&B's service process that the run is over; the service writes and closes the
        # run's file afterwards. teardown() waits for that, so the run is on disk when close returns (an
        # offline run read or synced right after, or a trainer killed right after, loses no step).
        wandb.teardown()


class MlflowBackend:
    """One MLflow run named after the job, in spec.logging.mlflow.experiment. Unset trackingUri = a
    file store `mlruns/` in the run directory (MLflow 3 wants MLFLOW_ALLOW_FILE_STORE for it: set here
    unless the environment says otherwise). Every call to the store runs on the `Sender` thread."""

    name = "mlflow"

    def __init__(self, spec: MlflowSpec, run_dir: Path, job: str, config: Mapping[str, Any], ids: RunIds) -> None:
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        uri = spec.tracking_uri or (run_dir / "mlruns").resolve().as_uri()
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self._metric, self._param = Metric, Param
        self.client = MlflowClient(tracking_uri=uri)  # (the store is built here: a missing driver is an ImportError)
        self.run_id: str | None = None
        self._sender = Sender("mlflow")
        self._sender.submit(lambda: self._open(spec.experiment, job, config, ids))

    def _open(self, experiment: str, job: str, config: Mapping[str, Any], ids: RunIds) -> None:
        c = self.client
        old = ids.get("mlflow")
        if old is not None:
            try:
                c.update_run(old, status="RUNNING")
                self.run_id = old
                return
            except Exception as exc:
                log.info("mlflow: run %s from %s not resumed (%s); starting a new one", old, ids.path, exc)
        found = c.get_experiment_by_name(experiment)
        experiment_id = found.experiment_id if found is not None else c.create_experiment(experiment)
        self.run_id = c.create_run(experiment_id, run_name=job).info.run_id
        ids.put("mlflow", self.run_id)
        params = [self._param(k, v) for k, v in mlflow_params(config).items()]
        for i in range(0, len(params), MLFLOW_BATCH_PARAMS):
            c.log_batch(self.run_id, params=params[i:i + MLFLOW_BATCH_PARAMS])

    def begin(self, step: int) -> None:
        pass

    def log(self, step: int, values: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(mlflow_key(k), v, now, step) for k, v in values.items()]
        self._sender.submit(lambda: self.client.log_batch(self._run(), metrics=metrics))

    def close(self) -> None:
        self._sender.submit(lambda: self.client.set_terminated(self._run()))
        left = self._sender.close(MLFLOW_CLOSE_SECONDS)
        if left:
            log.warning("mlflow: %d call(s) still queued after %.0f s (the server does not answer); "
                        "they are dropped", left, MLFLOW_CLOSE_SECONDS)

    def _run(self) -> str:
        if self.run_id is None:
            raise RuntimeError("the MLflow run did not start (see the first warning)")
        return self.run_id


def mlflow_key(key: str) -> str:
    """`key` with the characters MLflow refuses in a metric or param name replaced by '_', cut to its limit."""
    return re.sub(r"[^\w./\- ]", "_", key)[:MLFLOW_KEY_MAX]


def mlflow_params(config: Mapping[str, Any]) -> dict[str, str]:
    """The job spec as MLflow params: nested keys joined with '.', list items by index, characters
    MLflow refuses in a key replaced by '_', keys and values cut to MLflow's limits."""
    out: dict[str, str] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, Mapping) and value:
            for k, v in value.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(value, list) and value and any(isinstance(v, (Mapping, list)) for v in value):
            for i, v in enumerate(value):
                walk(f"{prefix}.{i}", v)
        else:
            key = mlflow_key(prefix)
            text = value if isinstance(value, str) else json.dumps(value, default=str)
            out[key] = text if len(text) <= MLFLOW_VALUE_MAX else text[:MLFLOW_VALUE_MAX - 3] + "..."

    walk("", dict(config))
    return out


class Sender:
    """One daemon thread making a tracker's blocking calls in order, so a slow or dead server delays
    neither a training step nor the end of the process. A failed call is a warning (once until a call
    works again); past `limit` queued calls, new ones are dropped with a warning."""

    def __init__(self, name: str, limit: int = 10_000) -> None:
        self.name = name
        self._queue: queue.Queue[Callable[[], Any] | None] = queue.Queue(maxsize=limit)
        self._failing = False
        self._dropped = 0
        self._thread = threading.Thread(target=self._work, name=f"tracker-{name}", daemon=True)
        self._thread.start()

    def submit(self, call: Callable[[], Any]) -> None:
        try:
            self._queue.put_nowait(call)
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1:
                log.warning("tracker %s: %d calls queued (its server does not keep up); dropping new ones",
                            self.name, self._queue.maxsize)

    def close(self, timeout: float) -> int:
        """Wait up to `timeout` seconds for the queued calls; returns how many were left undone."""
        deadline = time.monotonic() + timeout
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            return self._queue.qsize()
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return self._queue.qsize() if self._thread.is_alive() else 0

    def _work(self) -> None:
        while True:
            call = self._queue.get()
            if call is None:
                return
            try:
                call()
            except Exception as exc:
                if not self._failing:
                    log.warning("tracker %s: a call failed (%s: %s); training goes on", self.name,
                                type(exc).__name__, exc)
                self._failing = True
            else:
                if self._failing:
                    log.info("tracker %s works again", self.name)
                self._failing = False
