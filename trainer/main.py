"""Run the trainer: consume trajectory groups, update the policy, publish weights, serve /status.

Works as a plain process or under torchrun (any world size: gloo on CPU, NCCL on GPUs). Rank 0
reads from Redis, publishes weights, acknowledges and serves the status endpoint; every rank
trains its shard of each batch. Resumes from the newest checkpoint in the checkpoint directory.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from typing import Any

from asyncrl.loader import load_job
from asyncrl.runtime import Runtime
from asyncrl.spec import AsyncRLJob

# torch, transformers, Redis and the web server are imported inside the functions that run the
# trainer: `asyncrl --help` (and the operator, which has no torch) imports this module to build
# the command line (asyncrl/cli.py).

ENV_TORCH_THREADS = "ASYNCRL_TORCH_THREADS"

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
    parser.add_argument("--linger-seconds", type=float, default=0.0,
                        help="keep serving /status this long after the last step")
    parser.add_argument("--log-level", default="INFO")


def _set_threads(args: argparse.Namespace) -> None:
    import torch  # (heavy: see the note at the top)

    threads = args.threads or int(os.environ.get(ENV_TORCH_THREADS, "0") or 0)
    if threads > 0:
        torch.set_num_threads(threads)


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stdout,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    job = load_job(args.config)
    _set_threads(args)
    return asyncio.run(_main(job, args))


def with_overrides(job: AsyncRLJob, args: argparse.Namespace) -> AsyncRLJob:
    """The job as this process runs it: `--max-steps` replaces spec.trainer.maxSteps (re-validated)."""
    if not getattr(args, "max_steps", None):
        return job
    job = job.model_copy(deep=True)
    job.spec.trainer.max_steps = args.max_steps
    return job


def build_trainer(job: AsyncRLJob, args: argparse.Namespace, runtime: Runtime, ctx: Any, io: Any = None) -> Any:
    """Model, optimizer and state (restored from a checkpoint when there is one) around the loop."""
    import torch  # (heavy: see the note at the top)

    from asyncrl.models import load_causal_lm, load_tokenizer
    from asyncrl.status_report import TrainerReport
    from asyncrl.trainer import distributed as D
    from asyncrl.trainer.checkpoint import latest_checkpoint, load_checkpoint
    from asyncrl.trainer.loop import RunConfig, Trainer
    from asyncrl.trainer.step_metrics import truncate_metrics

    job = with_overrides(job, args)
    spec = job.spec
    torch.manual_seed(spec.seed)
    model = load_causal_lm(spec.model.path, spec.model.dtype, ctx.device)
    if spec.model.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    tokenizer = load_tokenizer(spec.model.path, spec.model.tokenizer)
    opt = spec.algorithm.optimizer
    optimizer = torch.optim.AdamW(model.parameters(), lr=opt.lr, betas=(opt.beta1, opt.beta2),
                                  eps=opt.eps, weight_decay=opt.weight_decay)
    cfg = RunConfig.from_runtime(runtime, job)
    state, report = None, None
    ckpt = None if args.no_resume else latest_checkpoint(cfg.checkpoint_dir)
    if ckpt is not None:
        state = load_checkpoint(ckpt, model, optimizer, device=ctx.device)
        if state.report:
            report = TrainerReport.model_validate(state.report)
            report.last_checkpoint = str(ckpt)
        log.info("resumed from %s: step %d, version %d", ckpt, state.step, state.version)
    if ctx.is_main and cfg.metrics_path is not None:
        # lines of steps after the checkpoint (or of a run that never checkpointed) were lost
        truncate_metrics(cfg.metrics_path, state.step if state else 0)
    wrapped = D.wrap_model(model, ctx)
    return Trainer(job, cfg, ctx, wrapped, optimizer, tokenizer, io=io, state=state, report=report)


async def connect_io(job: AsyncRLJob, runtime: Runtime) -> Any:
    """Rank 0's Redis side: consumer (stable name = pod name), admission, versions, engine registry."""
    from asyncrl.trainer.inbox import StreamIO  # (Redis clients: see the note at the top)
    from asyncrl.transport.admission import Admission
    from asyncrl.transport.connection import connect
    from asyncrl.transport.names import StreamNames
    from asyncrl.transport.streams import TrajectoryConsumer
    from asyncrl.transport.versions import EngineRegistry, VersionChannel

    spec = job.spec
    names = StreamNames.for_job(job.metadata.name)
    redis = await connect(runtime.redis_url)
    consumer = TrajectoryConsumer(redis, names, runtime.pod_name)
    await consumer.ensure_group()
    admission = Admission(redis, names, batch_size=spec.algorithm.batch_size,
                          max_head_offpolicyness=spec.staleness.max_head_offpolicyness,
                          max_concurrent=spec.max_concurrent_groups())
    return StreamIO(redis=redis, consumer=consumer, admission=admission,
                    versions=VersionChannel(redis, names), registry=EngineRegistry(redis, names))


async def _main(job: AsyncRLJob, args: argparse.Namespace) -> int:
    from asyncrl.trainer import distributed as D  # (torch: see the note at the top)

    runtime = Runtime.from_env()
    ctx = D.init_distributed(job.spec.trainer.device)
    if not ctx.is_main:
        logging.getLogger().setLevel(logging.WARNING)  # rank 0 tells the story
    io = await connect_io(job, runtime) if ctx.is_main else None
    server = None
    trainer = None
    try:
        trainer = build_trainer(job, args, runtime, ctx, io)
        _install_signal_handlers(trainer)
        if ctx.is_main and not args.no_status:
            from asyncrl.trainer.status_api import StatusServer, create_app  # (web server: see the top)

            port = job.spec.trainer.status_port if args.status_port is None else args.status_port
            server = StatusServer(create_app(trainer.get_report, token=runtime.status_token),
                                  args.status_host, port)
            url = server.start_in_thread()
            print(f"status endpoint: {url}/status (dashboard: {url}/)", flush=True)
        phase = await trainer.run()
        log.info("trainer finished: %s at step %d (version %d)", phase, trainer.state.step, trainer.state.version)
        if args.linger_seconds > 0 and ctx.is_main:
            await asyncio.sleep(args.linger_seconds)
        return 0
    except Exception as exc:
        if trainer is not None:
            trainer._set_phase("Failed", f"{type(exc).__name__}: {exc}")
        log.exception("trainer failed")
        return 1
    finally:
        if server is not None:
            server.stop_thread()
        if io is not None:
            close = getattr(io.redis, "aclose", None) or getattr(io.redis, "close", None)
            if close is not None:
                await close()
        D.shutdown(ctx)


def _install_signal_handlers(trainer: Any) -> None:
    """SIGTERM/SIGINT: finish the current step, checkpoint, acknowledge, exit; a second one aborts."""

    def handler(signum: int, frame: Any) -> None:
        if trainer.stop_requested:
            raise KeyboardInterrupt
        trainer.stop_requested = True
        log.info("signal %d: stopping after the current step", signum)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
