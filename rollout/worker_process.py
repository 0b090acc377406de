"""One rollout worker process (`asyncrl rollout`): the job file and the pod's environment turned
into a running RolloutWorker, and its exit status (rollout/main.py has the flags)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable

from asyncrl.loader import load_job
from asyncrl.models import load_tokenizer, vocab_size
from asyncrl.rollout.datasets import DatasetError, PromptItem, load_source
from asyncrl.rollout.engines import make_engine
from asyncrl.rollout.engines.base import SamplingParams
from asyncrl.rollout.evaluation import EvalSettings, eval_prompt_format, load_eval_items
from asyncrl.rollout.evaluator import WorkerEvaluation
from asyncrl.rollout.prompts import PromptRenderer
from asyncrl.rollout.rewards import RewardError, Scorer
from asyncrl.rollout.scorers import scorer_for
from asyncrl.rollout.worker import RolloutWorker
from asyncrl.rollout.worker_config import WorkerConfig
from asyncrl.runtime import Runtime
from asyncrl.spec import AsyncRLJobSpec
from asyncrl.transport.admission import Admission
from asyncrl.transport.connection import connect, set_outage_window

log = logging.getLogger("asyncrl.rollout")


class StartupError(Exception):
    """The worker cannot start (a bad evaluation dataset or reward, an engine that never got ready)."""


def evaluation_inputs(spec: AsyncRLJobSpec, reward_url: str | None = None) -> tuple[list[PromptItem], Scorer] | None:
    """spec.evaluation's held-out prompts and scorer, loaded before the engine is waited for: a bad
    dataset or reward fails the worker at once. None without spec.evaluation. `reward_url`: where the
    job's operator-run reward service answers (evaluation without a reward of its own uses it too)."""
    ev = spec.evaluation
    if ev is None:
        return None
    try:
        items = load_eval_items(ev)
    except DatasetError as exc:
        raise StartupError(f"spec.evaluation.dataset ({ev.dataset.source}, split {ev.dataset.split}): {exc}") from exc
    reward = ev.reward or spec.reward
    try:
        return items, scorer_for(reward, on_error="zero", service_url=reward_url if ev.reward is None else None)
    except RewardError as exc:
        raise StartupError(f"spec.evaluation.reward: {exc}") from exc


async def wait_until_ready(ready: Callable[[], Awaitable[bool]], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not await ready():
        if time.monotonic() > deadline:
            raise StartupError(f"{what} not ready after {timeout:.0f}s")
        await asyncio.sleep(1.0)


def worker_config(args: argparse.Namespace, spec: AsyncRLJobSpec, job: str, rt: Runtime, engine_url: str,
                  stop_token_ids: tuple[int, ...]) -> WorkerConfig:
    alg = spec.algorithm
    sampling = SamplingParams(max_new_tokens=alg.max_new_tokens, temperature=alg.temperature, top_p=alg.top_p,
                              top_k=alg.top_k, stop_token_ids=stop_token_ids)
    return WorkerConfig(
        job=job, engine_id=args.engine_id or rt.pod_name, group_size=alg.group_size,
        sampling=sampling, engine_url=args.advertise_url or rt.engine_advertise_url or engine_url,
        max_concurrent_requests=spec.rollout.max_concurrent_requests, max_groups=args.max_groups,
        max_tokens_per_request=spec.rollout.max_tokens_per_request,
        log_every_s=args.log_every, engine_outage_s=args.engine_outage_s,
        rollout_index=rt.rollout_index, rollout_replicas=rt.rollout_replicas,
        vocab_size=vocab_size(spec.model.path))


async def run_worker(args: argparse.Namespace) -> int:
    set_outage_window(args.redis_outage_s)  # (every client of this process; None: the environment's)
    job = load_job(args.config)
    spec = job.spec
    rt = Runtime.from_env()
    engine_url = args.engine_url or rt.engine_url
    kind = args.engine or spec.rollout.engine
    engine = make_engine(kind, engine_url, timeout=spec.rollout.request_timeout_seconds, api_key=rt.engine_api_key)
    try:
        eval_inputs = evaluation_inputs(spec, rt.reward_url)
        try:
            scorer = scorer_for(spec.reward, service_url=rt.reward_url)
        except RewardError as exc:
            raise StartupError(f"spec.reward: {exc}") from exc
        await wait_until_ready(engine.ready, f"engine at {engine_url}", args.ready_timeout)
        # (a reward service started with the job may come up after the engine: no group is scored before it)
        await wait_until_ready(scorer.ready, f"reward service {scorer.name}", args.ready_timeout)
    except StartupError as exc:
        log.error("%s", exc)
        await engine.close()
        return 1
    tokenizer = load_tokenizer(spec.model.path, spec.model.tokenizer)
    renderer = PromptRenderer(tokenizer, spec.dataset.prompt_template, spec.dataset.system_prompt)
    redis = await connect(args.redis_url or rt.redis_url)
    names = rt.stream_names(job.metadata.name)
    cfg = worker_config(args, spec, job.metadata.name, rt, engine_url, renderer.stop_token_ids())
    evaluation = None
    if spec.evaluation is not None and eval_inputs is not None:
        eval_template, eval_system = eval_prompt_format(spec.evaluation, spec.dataset)
        evaluation = WorkerEvaluation(
            items=eval_inputs[0], scorer=eval_inputs[1],
            render=PromptRenderer(tokenizer, eval_template, eval_system).render,
            settings=EvalSettings.from_spec(spec.evaluation, spec.algorithm, renderer.stop_token_ids()))
    worker = RolloutWorker(cfg, engine=engine, redis=redis, source=load_source(spec.dataset),
                           render=renderer.render, decode=renderer.decode,
                           scorer=scorer,
                           admission=Admission.for_job(redis, names, spec), names=names, evaluation=evaluation)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    log.info("rollout worker %s: job %s, engine %s (%s), shard %d/%d, evaluation %s", cfg.engine_id, cfg.job,
             engine_url, kind, cfg.rollout_index, cfg.rollout_replicas,
             f"of {len(evaluation.items)} held-out prompts" if evaluation else "off")
    try:
        await worker.run()
    finally:
        await engine.close()
        await redis.aclose()
    return 0
