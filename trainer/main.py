"""Run the trainer: consume trajectory groups, update the policy, publish weights, serve /status.

Works as a plain process or under torchrun (any world size: gloo on CPU, NCCL on GPUs). Rank 0
reads from Redis, publishes weights, acknowledges and serves the status endpoint; every rank
trains its shard of each batch. Resumes from the newest checkpoint in the checkpoint directory.

The end of training is a record, not an exit (a StatefulSet pod always restarts; the operator,
seeing the record, marks the job Succeeded/Failed and scales the trainer and rollout to zero):

  start   if this job's outcome is already recorded (Redis, else outcome.json on the weights
          volume; both keyed by the job uid), serve it on /status at once: no model, weights,
          engines, streams or checkpoints are touched, nothing is trained or published;
  end     max steps reached (Succeeded, MaxStepsReached) or a fatal TrainerError (Failed:
          WeightSyncFailed, NonFiniteWeights): record the outcome (Redis SET NX, then the file;
          on failure also the termination message), then keep serving /status until
          SIGTERM/SIGINT and exit 0;
  config  a job this trainer cannot run (job file, spec, model not found): termination message
          (and, once the job is known, a Failed outcome), exit 78 (EXIT_CONFIG_ERROR): retrying
          cannot help, the operator fails the job at once;
  crash   any other exception: termination message, exit 1; the pod restarts and the trainer
          resumes from its checkpoint (the operator counts restarts against its backoff limit).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.api.loader import JobFileError, load_job
from asyncrl.api.outcome import (
    EXIT_CONFIG_ERROR,
    TrainerOutcome,
    new_outcome,
    read_outcome_file,
    read_outcome_redis,
    write_outcome_file,
    write_outcome_redis,
    write_termination_message,
)
from asyncrl.api.runtime import Runtime
from asyncrl.api.spec import AsyncRLJob
from asyncrl.api.stream_names import StreamNames
from asyncrl.infra.errors import SpecError, TrainerError

if TYPE_CHECKING:
    from asyncrl.trainer.loop import Trainer

# torch, transformers, Redis and the web server are imported inside the functions that run the
# trainer: `asyncrl --help` (and the operator, which has no torch) imports this module to build
# the command line (asyncrl/cli.py).

ENV_TORCH_THREADS = "ASYNCRL_TORCH_THREADS"
EXIT_CRASH = 1
RECORD_KEEP_INTERVAL_S = 15.0
"""While serving an outcome, rank 0 re-checks this often that Redis still holds the record."""

log = logging.getLogger("asyncrl.trainer")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="job file (AsyncRLJob YAML)")
    parser.add_argument("--max-steps", type=int, default=None, help="override spec.trainer.maxSteps")
    parser.add_argument("--status-port", type=int, default=None,
                        help="status endpoint port (default spec.trainer.statusPort; 0 = any free port)")
    parser.add_argument("--status-host", default="0.0.0.0", help="status endpoint address (default 0.0.0.0)")
    parser.add_argument("--no-status", action="store_true", help="do not serve the status endpoint")
    parser.add_argument("--threads", type=int, default=None,
                        help=f"torch intra-op threads (default ${ENV_TORCH_THREADS} or torch's choice)")
    parser.add_argument("--no-resume", action="store_true", help="ignore existing checkpoints")
    parser.add_argument("--exit-on-outcome", action="store_true",
                        help="exit once the outcome is recorded (0 Succeeded, 1 Failed) instead of serving it "
                             "until SIGTERM; for scripts and tests, never in a StatefulSet (it would restart)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("--redis-outage-s", type=float, default=None,
                        help="seconds a Redis command waits through an outage (Degraded on /status meanwhile) "
                             "before the trainer gives up and restarts (default $ASYNCRL_REDIS_OUTAGE_S or 180)")


def _set_threads(args: argparse.Namespace) -> None:
    import torch  # (heavy: see the note at the top)

    threads = args.threads or int(os.environ.get(ENV_TORCH_THREADS, "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    from asyncrl.transport.connection import outage_window, set_outage_window  # (Redis: see the top)

    try:  # every Redis client of this process waits out outages this long (a bad value: config error)
        set_outage_window(getattr(args, "redis_outage_s", None))
        outage_window()
    except ValueError as exc:
        return config_error(exc)
    try:
        job = load_job(args.config)
    except SpecError as exc:
        return config_error(exc)
    _set_threads(args)
    return asyncio.run(_main(job, args))


def with_overrides(job: AsyncRLJob, args: argparse.Namespace) -> AsyncRLJob:
    """The job as this process runs it: `--max-steps` replaces spec.trainer.maxSteps (re-validated)."""
    if not getattr(args, "max_steps", None):
        return job
    job = job.model_copy(deep=True)
    job.spec.trainer.max_steps = args.max_steps
    return job


# ------------------------------------------------------------------------------------ exits


def config_reason(exc: BaseException) -> str:
    """The Failed reason of a configuration error (one of outcome.CONFIG_ERROR_REASONS)."""
    from asyncrl.infra.hf_models import ModelNotFoundError

    if isinstance(exc, JobFileError):
        return "InvalidJobFile"
    if isinstance(exc, ModelNotFoundError):
        return "ModelNotFound"
    if isinstance(exc, SpecError):
        return "InvalidSpec"
    return "InvalidConfiguration"


def config_error(exc: BaseException) -> int:
    """Log, write the termination message, return EXIT_CONFIG_ERROR: the operator fails the job."""
    reason = config_reason(exc)
    if isinstance(exc, JobFileError):
        for err in exc.errors:
            print(f"error: {err}", file=sys.stderr)
    log.error("configuration error (%s): %s", reason, exc)
    write_termination_message(f"{reason}: {exc}")
    return EXIT_CONFIG_ERROR


def crash(exc: BaseException) -> int:
    """Any other failure: the pod restarts and resumes from its checkpoint."""
    log.error("trainer crashed", exc_info=exc)
    write_termination_message(f"Crashed: {type(exc).__name__}: {exc}")
    return EXIT_CRASH


# ------------------------------------------------------------------------------------ signals


class StopSignals:
    """SIGTERM and SIGINT over the trainer's whole life.

    Starting (before the trainer exists): stop at once, as the default action would (exit 130).
    Training: the first signal asks the trainer to finish its step, checkpoint and acknowledge;
    a second aborts. Serving an outcome: a signal ends the wait (exit 0).
    """

    def __init__(self) -> None:
        self.received = 0
        self.trainer: Any = None
        self.serving = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._event: asyncio.Event | None = None

    def install(self) -> StopSignals:
        """Install the handlers (call from the running event loop)."""
        self._loop, self._event = asyncio.get_running_loop(), asyncio.Event()
        signal.signal(signal.SIGTERM, self)
        signal.signal(signal.SIGINT, self)
        return self

    def __call__(self, signum: int, _frame: Any) -> None:
        self.received += 1
        if self._loop is not None and self._event is not None:
            with contextlib.suppress(RuntimeError):  # (the loop is closed once the process is ending)
                self._loop.call_soon_threadsafe(self._event.set)  # (wakes the loop from its select)
        if self.serving:
            log.info("signal %d: stopping", signum)
            return
        if self.trainer is None or self.trainer.stop_requested:
            raise KeyboardInterrupt
        self.trainer.stop_requested = True
        log.info("signal %d: stopping after the current step", signum)

    def serve(self) -> None:
        """From now on the process only serves its outcome (a stop asked while training still counts)."""
        self.serving = True
        self.trainer = None

    async def wait(self) -> None:
        if self.received or self._event is None:
            return
        await self._event.wait()


# ------------------------------------------------------------------------------------ the record


class OutcomeRecord:
    """Rank 0's view of the job's durable outcome: Redis first, outcome.json on the weights volume
    as the fallback (Redis unreachable, or restarted without its data). Both are keyed by the job
    uid; the first outcome recorded wins."""

    def __init__(self, job: AsyncRLJob, runtime: Runtime, names: StreamNames, *, connect_timeout: float = 10.0):
        self.job_name = job.metadata.name
        self.job_uid = runtime.job_uid
        self.names = names
        self.redis_url = runtime.redis_url
        self.weights_dir = Path(runtime.weights_dir)
        self.connect_timeout = connect_timeout
        self.redis: Any = None
        self.redis_error: Exception | None = None

    async def connect(self) -> Any:
        """The Redis client, or None (the error is kept) when Redis does not answer in time."""
        from asyncrl.transport.connection import RedisUnavailableError, connect  # (see the top)

        if self.redis is None:
            try:
                self.redis = await connect(self.redis_url, timeout=self.connect_timeout)
                self.redis_error = None
            except RedisUnavailableError as exc:
                self.redis_error = exc
        return self.redis

    async def find(self) -> TrainerOutcome | None:
        """The recorded outcome, if any. Found only in the file, it is put back into Redis (the
        operator reads Redis). Raises the connection error when Redis is unreachable and the file
        has nothing: the trainer cannot start without Redis anyway."""
        redis = await self.connect()
        if redis is not None:
            recorded = await read_outcome_redis(redis, self.names)
            if recorded is not None:
                return recorded
        recorded = read_outcome_file(self.weights_dir, self.job_uid)
        if recorded is not None:
            if redis is not None:
                await write_outcome_redis(redis, self.names, recorded)
            log.info("outcome found in %s, not in Redis%s", self.weights_dir / "outcome.json",
                     ": recorded it there again" if redis is not None else " (unreachable)")
            return recorded
        if redis is None and self.redis_error is not None:
            raise self.redis_error
        return None

    async def record(self, outcome: TrainerOutcome) -> TrainerOutcome:
        """Record `outcome` (Redis SET NX, then the file); return the one recorded (an earlier
        outcome of this job wins). A Redis failure is logged: the file has it, and `keep` retries."""
        try:
            redis = await self.connect()
            if redis is not None and not await write_outcome_redis(redis, self.names, outcome):
                earlier = await read_outcome_redis(redis, self.names)
                if earlier is not None:
                    log.warning("an outcome was already recorded for this job; keeping it: %s", earlier.summary)
                    outcome = earlier
            elif redis is None:
                log.error("cannot record the outcome in Redis (%s); retrying while serving", self.redis_error)
        except Exception as exc:
            log.error("cannot record the outcome in Redis (%s); retrying while serving", exc)
        try:
            write_outcome_file(self.weights_dir, outcome)
        except OSError as exc:
            log.error("cannot write %s: %s", self.weights_dir / "outcome.json", exc)
        return outcome

    async def keep(self, outcome: TrainerOutcome, interval_s: float = RECORD_KEEP_INTERVAL_S) -> None:
        """While serving: make sure Redis holds the record (it may have been unreachable, or lost it)."""
        while True:
            try:
                redis = await self.connect()
                if redis is not None and await write_outcome_redis(redis, self.names, outcome):
                    log.info("outcome recorded in Redis")
            except Exception as exc:
                log.warning("outcome record check failed: %s", exc)
            await asyncio.sleep(interval_s)

    async def close(self) -> None:
        if self.redis is not None:
            await self.redis.aclose()
            self.redis = None


def outcome_of(trainer: Any, job: AsyncRLJob, runtime: Runtime, phase: str, reason: str,
               message: str) -> TrainerOutcome:
    """The outcome of this run as the trainer ends it, with its last report (history left out)."""
    from asyncrl.trainer.weights.files import weights_path

    state = trainer.state
    weights = weights_path(trainer.cfg.weights_dir, state.version)
    outcome = new_outcome(job.metadata.name, runtime.job_uid, phase, reason,  # type: ignore[arg-type]
                          message=message, step=state.step, policy_version=state.version,
                          weights_path=str(weights.resolve()) if weights.is_dir() else None)
    trainer.set_outcome(outcome.report_fields())
    report = trainer.get_report().model_dump(mode="json", exclude={"history", "reward_history", "rollout"})
    return outcome.model_copy(update={"report": report})


def report_of(outcome: TrainerOutcome, job: AsyncRLJob) -> Any:
    """The /status document of a trainer that found its outcome recorded at start."""
    import time

    from asyncrl.api.status_report import TrainerReport

    base = TrainerReport.model_validate(outcome.report) if outcome.report else \
        TrainerReport(job=job.metadata.name, max_steps=job.spec.trainer.max_steps)
    return base.model_copy(update={**outcome.report_fields(), "outcome_restored": True, "updated_at": time.time()})


# ------------------------------------------------------------------------------------ running


def build_trainer(job: AsyncRLJob, args: argparse.Namespace, runtime: Runtime, ctx: Any, io: Any = None, *,
                  trackers: Any = None) -> Any:
    """Model, optimizer and state (restored from a checkpoint when there is one) around the loop;
    `trackers` (rank 0's experiment trackers, report/reporter.py `TrackerSink`) get the step figures and
    evaluation results, and are closed when the run ends."""
    import torch  # (heavy: see the note at the top)

    from asyncrl.api.status_report import TrainerReport
    from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer, torch_dtype
    from asyncrl.trainer import distributed as D
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.lora import trainable_parameters
    from asyncrl.trainer.report.metrics_file import truncate_metrics
    from asyncrl.trainer.run_config import RunConfig
    from asyncrl.trainer.state.checkpoint import latest_checkpoint, load_checkpoint, model_identity

    job = with_overrides(job, args)
    spec = job.spec
    torch.manual_seed(spec.seed)
    # FSDP keeps a float32 master copy (sharded, with the optimizer state) and computes in the
    # model dtype; DDP and one process train in the model dtype itself.
    prepare = adapters_for(spec)
    if ctx.enabled and spec.trainer.parallelism == "fsdp":  # (only rank 0 loads the whole model)
        model = D.load_sharded_model(spec.model.path, ctx, torch_dtype(spec.model.dtype),
                                     gradient_checkpointing=spec.model.gradient_checkpointing,
                                     revision=spec.model.revision, prepare=prepare)
    else:
        model = load_causal_lm(spec.model.path, spec.model.dtype, ctx.device, revision=spec.model.revision)
        if spec.model.gradient_checkpointing:
            model.gradient_checkpointing_enable()
        if prepare is not None:
            prepare(model)
        model = D.wrap_model(model, ctx, spec.trainer.parallelism)
    model.train()
    reference = None
    if spec.algorithm.objective == "tb":  # trajectory balance's frozen pi_ref: the model training starts from
        reference = load_causal_lm(spec.model.path, spec.model.dtype, ctx.device,
                                   revision=spec.model.revision).eval().requires_grad_(False)
    tokenizer = load_tokenizer(spec.model.path, spec.model.tokenizer, spec.model.revision)
    opt = spec.algorithm.optimizer
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=opt.lr, betas=(opt.beta1, opt.beta2),
                                  eps=opt.eps, weight_decay=opt.weight_decay)  # (over the shards: after wrapping)
    cfg = RunConfig.from_runtime(runtime, job)
    state, report = None, None
    ckpt = None if args.no_resume else latest_checkpoint(cfg.checkpoint_dir)
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, optimizer, device=ctx.device, ctx=ctx, identity=model_identity(spec))
        if state.report:
            report = TrainerReport.model_validate(state.report)
            report.last_checkpoint = str(ckpt)
        log.info("resumed from %s: step %d, version %d", ckpt, state.step, state.version)
    if ctx.is_main and cfg.metrics_path is not None:
        # lines of steps after the checkpoint (or of a run that never checkpointed) were lost
        truncate_metrics(cfg.metrics_path, state.step if state else 0)
    return Trainer(job, cfg, ctx, model, optimizer, tokenizer, io=io, state=state, report=report,
                   trackers=trackers, reference_model=reference)


def adapters_for(spec: Any) -> Any:
    """With spec.trainer.lora: what adds the adapters to a freshly loaded model (before it is wrapped or
    sharded); None for full fine-tuning."""
    lora = spec.trainer.lora
    if lora is None:
        return None
    from asyncrl.trainer.lora import add_adapters

    def prepare(model: Any) -> None:
        add_adapters(model, lora, base_model=spec.model.path, revision=spec.model.revision, seed=spec.seed)
        if spec.model.gradient_checkpointing:  # (frozen embeddings: checkpointed blocks need an input with grad)
            model.enable_input_require_grads()

    return prepare


async def connect_io(job: AsyncRLJob, runtime: Runtime, redis: Any = None) -> Any:
    """Rank 0's Redis side: consumer (stable name = pod name), admission, versions, engine registry,
    evaluation requests and results (on `redis` when given, else a new client)."""
    from asyncrl.infra.hf_models import vocab_size
    from asyncrl.trainer.inbox import StreamIO  # (Redis clients: see the note at the top)
    from asyncrl.transport.admission import Admission
    from asyncrl.transport.connection import connect
    from asyncrl.transport.content import GroupLimits
    from asyncrl.transport.evaluation import EvalChannel
    from asyncrl.transport.streams import TrajectoryConsumer
    from asyncrl.transport.versions import EngineRegistry, VersionChannel

    spec = job.spec
    names = runtime.stream_names(job.metadata.name)
    redis = redis if redis is not None else await connect(runtime.redis_url)
    # Groups the training step could not use go to the dead-letter stream, not into a batch.
    limits = GroupLimits(vocab_size=vocab_size(spec.model.path, spec.model.revision),
                         group_size=spec.algorithm.group_size, max_response_tokens=spec.max_response_tokens())
    consumer = TrajectoryConsumer(redis, names, runtime.pod_name, limits=limits)
    await consumer.ensure_group()
    admission = Admission.for_job(redis, names, spec)
    return StreamIO(redis=redis, consumer=consumer, admission=admission,
                    versions=VersionChannel(redis, names), registry=EngineRegistry(redis, names),
                    evals=EvalChannel(redis, names))


def start_status(get_report: Any, job: AsyncRLJob, args: argparse.Namespace, runtime: Runtime) -> Any:
    """Rank 0's status endpoint (in a helper thread: the loop is busy with compute while training)."""
    from asyncrl.trainer.report.status_api import StatusServer, create_app  # (web server: see the top)

    port = job.spec.trainer.status_port if args.status_port is None else args.status_port
    server = StatusServer(create_app(get_report, token=runtime.status_token), args.status_host, port)
    url = server.start_in_thread()
    print(f"status endpoint: {url}/status (dashboard: {url}/)", flush=True)
    return server


async def _main(job: AsyncRLJob, args: argparse.Namespace) -> int:
    signals = StopSignals().install()
    try:
        runtime = Runtime.from_env()
        names = runtime.stream_names(job.metadata.name)
    except ValueError as exc:  # the deployment's variables (a bad number, a bad job uid)
        return config_error(exc)
    ctx = None
    try:
        from asyncrl.trainer import distributed as D  # (torch: see the note at the top)

        ctx = D.init_distributed(job.spec.trainer.device)
        if not ctx.is_main:
            logging.getLogger().setLevel(logging.WARNING)  # rank 0 tells the story
        record = OutcomeRecord(job, runtime, names) if ctx.is_main else None
        try:
            return await _lifecycle(job, args, runtime, ctx, record, signals)
        finally:
            if record is not None:
                await record.close()
    except Exception as exc:
        return crash(exc)
    finally:
        if ctx is not None:
            D.shutdown(ctx)


async def _lifecycle(job: AsyncRLJob, args: argparse.Namespace, runtime: Runtime, ctx: Any,
                     record: OutcomeRecord | None, signals: StopSignals) -> int:
    # A restarted pod of a job that already ended: serve the outcome, touch nothing else.
    recorded = await _recorded_outcome(record, ctx)
    if recorded is not None:
        if ctx.is_main:
            log.info("outcome already recorded for job %s%s: %s; serving it without loading the model",
                     job.metadata.name, f" (uid {runtime.job_uid})" if runtime.job_uid else "", recorded.summary)
        report = report_of(recorded, job)
        return await _serve(recorded, lambda: report, job, args, runtime, ctx, record, signals)

    io = await connect_io(job, runtime, record.redis) if record is not None else None
    server = None
    try:
        trainer = await _build_or_record_failure(job, args, runtime, ctx, io, record)
        if isinstance(trainer, int):
            return trainer
        trainer.stop_requested = signals.received > 0
        signals.trainer = trainer
        if ctx.is_main and not args.no_status:
            server = start_status(trainer.get_report, job, args, runtime)
        outcome = await _train(trainer, job, runtime)
        if outcome is None:  # stopped by a signal: the restarted pod resumes
            return 0
        signals.serve()
        if record is not None:
            _terminate_with(outcome)  # (first: whoever sees the recorded outcome finds the message too)
            recorded = await record.record(outcome)
            if recorded != outcome:  # (another life's, recorded first: the pod says what the job says)
                _terminate_with(recorded)
            outcome = recorded
            trainer.set_outcome(outcome.report_fields())
            log.info("trainer finished: %s", outcome.summary)
        return await _serve(outcome, None, job, args, runtime, ctx, record, signals)
    finally:
        if server is not None:
            server.stop_thread()
        if io is not None and (record is None or io.redis is not record.redis):
            await io.redis.aclose()


def _terminate_with(outcome: TrainerOutcome) -> None:
    """The termination message of a Failed outcome (none for a success)."""
    if outcome.phase == "Failed":
        write_termination_message(f"{outcome.reason}: {outcome.message}")


async def _recorded_outcome(record: OutcomeRecord | None, ctx: Any) -> TrainerOutcome | None:
    """The job's outcome if an earlier life of the trainer recorded one (every rank gets rank 0's)."""
    from asyncrl.trainer import distributed as D

    recorded = await record.find() if record is not None else None
    recorded_json = D.broadcast_object(recorded.to_json() if recorded is not None else None, ctx)
    return TrainerOutcome.model_validate_json(recorded_json) if recorded_json is not None else None


async def _build_or_record_failure(job: AsyncRLJob, args: argparse.Namespace, runtime: Runtime, ctx: Any,
                                   io: Any, record: OutcomeRecord | None) -> Trainer | int:
    """The trainer (with rank 0's experiment trackers, spec.logging); or, when the spec cannot be used
    here (the model, a missing tracker package), the job's Failed outcome recorded and the exit code."""
    from asyncrl.trainer.report.trackers import Trackers

    trackers = None
    try:
        if ctx.is_main:
            trackers = Trackers.from_spec(job.spec.logging, Path(runtime.run_dir), job.metadata.name,
                                          config=job.spec.to_wire())
        return build_trainer(job, args, runtime, ctx, io, trackers=trackers)
    except SpecError as exc:
        if trackers is not None:
            trackers.close()
        if record is not None:
            await record.record(new_outcome(job.metadata.name, runtime.job_uid, "Failed", config_reason(exc),
                                            message=str(exc)))
        return config_error(exc)


async def _train(trainer: Trainer, job: AsyncRLJob, runtime: Runtime) -> TrainerOutcome | None:
    """Run training to its outcome: Succeeded, or Failed on a fatal error (retrying cannot help);
    None when a signal stopped it (the restarted pod resumes)."""
    from asyncrl.trainer.loop import SUCCEEDED_REASON
    from asyncrl.trainer.weights.publisher import failure_reason

    try:
        phase = await trainer.run()
    except TrainerError as exc:
        log.error("training failed: %s", exc)
        return outcome_of(trainer, job, runtime, "Failed", failure_reason(exc), str(exc))
    if phase != "Succeeded":
        log.info("trainer stopped at step %d (version %d)", trainer.state.step, trainer.state.version)
        return None
    return outcome_of(trainer, job, runtime, "Succeeded", SUCCEEDED_REASON, trainer.succeeded_message())


async def _serve(outcome: TrainerOutcome, get_report: Any, job: AsyncRLJob, args: argparse.Namespace,
                 runtime: Runtime, ctx: Any, record: OutcomeRecord | None, signals: StopSignals) -> int:
    """Keep serving the outcome (rank 0: /status, and the Redis record kept) until SIGTERM/SIGINT.

    `get_report` None: the training run's status endpoint is already up."""
    signals.serve()
    if args.exit_on_outcome:
        return 0 if outcome.phase == "Succeeded" else 1
    server = None
    keeper = None
    if ctx.is_main and get_report is not None and not args.no_status:
        server = start_status(get_report, job, args, runtime)
    if record is not None:
        keeper = asyncio.create_task(record.keep(outcome))
    try:
        await signals.wait()
    finally:
        if keeper is not None:
            keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await keeper
        if server is not None:
            server.stop_thread()
    return 0
