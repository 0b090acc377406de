"""One rollout worker process (`asyncrl rollout`): the job file and the pod's environment turned
into a running RolloutWorker, and its exit status (rollout/main.py has the flags)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

from asyncrl.api.loader import load_job
from asyncrl.api.runtime import Runtime
from asyncrl.api.spec import AsyncRLJobSpec, DatasetSpec, EvalDatasetSpec, NamedSource
from asyncrl.api.spec.lora import named_adapters
from asyncrl.infra.hf_models import load_tokenizer, vocab_size
from asyncrl.rollout.data.datasets import DatasetError, PromptSource, load_source
from asyncrl.rollout.data.mixture import Lane, Mixture
from asyncrl.rollout.data.prompts import PromptRenderer
from asyncrl.rollout.engines import make_engine
from asyncrl.rollout.engines.base import SamplingParams
from asyncrl.rollout.episodes.runner import EpisodeError, group_producer
from asyncrl.rollout.evaluation.run_pass import (
    EvalPart,
    EvalSettings,
    eval_prompt_format,
    eval_sources,
    load_eval_items,
)
from asyncrl.rollout.evaluation.service import WorkerEvaluation
from asyncrl.rollout.generation.config import WorkerConfig
from asyncrl.rollout.rewards.functions import RewardError, Scorer
from asyncrl.rollout.rewards.scorers import scorer_for
from asyncrl.rollout.worker.worker import RolloutWorker
from asyncrl.transport.admission import Admission
from asyncrl.transport.connection import connect, set_outage_window

log = logging.getLogger("asyncrl.rollout")
WAIT_LOG_S = 30.0
"""How often a worker waiting for its engine or reward service says so."""


class StartupError(Exception):
    """The worker cannot start (a bad evaluation dataset or reward, an engine that never got ready)."""


def evaluation_inputs(spec: AsyncRLJobSpec, reward_url: str | None = None) -> list[EvalInputs] | None:
    """spec.evaluation's held-out prompts and scorer of each source, loaded before the engine is
    waited for: a bad dataset or reward fails the worker at once. None without spec.evaluation.
    `reward_url`: where the job's operator-run reward service answers (an eval source scored with
    the job's reward uses it too)."""
    ev = spec.evaluation
    if ev is None:
        return None
    training = {d.name: d for d in spec.datasets or []}
    inputs = []
    for name, dataset in eval_sources(ev):
        where = f"spec.evaluation.datasets ({name})" if name else "spec.evaluation.dataset"
        try:
            items = load_eval_items(dataset, ev.prompts)
        except DatasetError as exc:
            raise StartupError(f"{where} ({dataset.source}, split {dataset.split}): {exc}") from exc
        own = dataset.reward if isinstance(dataset, NamedSource) else None
        reward = own or (training[name].reward if name in training else None) or ev.reward or spec.reward
        try:
            scorer = scorer_for(reward, on_error="zero", service_url=reward_url if reward is spec.reward else None)
        except RewardError as exc:
            raise StartupError(f"{where}: reward: {exc}") from exc
        format_of = training[name] if name in training else spec.training_datasets()[0]
        inputs.append(EvalInputs(EvalPart(name, items, scorer), dataset, format_of))
    return inputs


@dataclass(frozen=True)
class EvalInputs:
    """One source of held-out prompts, loaded, with the training dataset whose prompt format it
    falls back on."""

    part: EvalPart
    dataset: EvalDatasetSpec
    training: DatasetSpec


@dataclass(frozen=True)
class SourceInputs:
    """One training source, loaded and with its scorer, before the engine is waited for."""

    name: str
    weight: float
    dataset: DatasetSpec
    source: PromptSource
    scorer: Scorer


def training_inputs(spec: AsyncRLJobSpec, reward_url: str | None = None) -> list[SourceInputs]:
    """spec.dataset (one source named "") or spec.datasets, each loaded, with its scorer (its own
    reward, else the job's, one scorer shared); a bad dataset or reward fails the worker at once."""
    try:
        job_scorer = scorer_for(spec.reward, service_url=reward_url)
    except RewardError as exc:
        raise StartupError(f"spec.reward: {exc}") from exc
    if spec.datasets is None:
        dataset = spec.training_datasets()[0]
        return [SourceInputs("", 1.0, dataset, _load(dataset, "spec.dataset"), job_scorer)]
    inputs = []
    for i, d in enumerate(spec.datasets):
        try:
            scorer = job_scorer if d.reward is None else scorer_for(d.reward)
        except RewardError as exc:
            raise StartupError(f"spec.datasets[{i}].reward ({d.name}): {exc}") from exc
        inputs.append(SourceInputs(d.name, d.weight, d, _load(d, f"spec.datasets[{i}] ({d.name})"), scorer))
    return inputs


def _load(dataset: DatasetSpec, where: str) -> PromptSource:
    try:
        return load_source(dataset)
    except DatasetError as exc:
        raise StartupError(f"{where}: {dataset.source}: {exc}") from exc


def training_prompts(inputs: list[SourceInputs], tokenizer: object, seed: int,
                     tools: list[dict[str, Any]] | None = None) -> Mixture:
    """The worker's prompts: each source rendered in its own format (template, system prompt), with
    the job's `tools` described."""
    lanes = [Lane(i.name, i.source, PromptRenderer(tokenizer, i.dataset.prompt_template,
                                                   i.dataset.system_prompt, tools).render, i.scorer) for i in inputs]
    return Mixture(lanes, [i.weight for i in inputs], seed=seed)


async def wait_until_ready(ready: Callable[[], Awaitable[bool]], what: str, timeout: float) -> None:
    """Poll `ready` every second; say so when it is not ready at once and every WAIT_LOG_S after, so
    a worker held by a dependency (a reward service that never answers) shows which one in its log."""
    start = time.monotonic()
    said = 0.0
    while not await ready():
        waited = time.monotonic() - start
        if waited > timeout:
            raise StartupError(f"{what} not ready after {timeout:.0f}s")
        if not said or waited - said >= WAIT_LOG_S:
            log.info("waiting for %s to be ready (%.0fs so far, giving up after %.0fs)", what, waited, timeout)
            said = max(waited, 1e-9)
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
        vocab_size=vocab_size(spec.model.path, spec.model.revision), max_response_tokens=spec.max_response_tokens())


async def run_worker(args: argparse.Namespace) -> int:
    set_outage_window(args.redis_outage_s)  # (every client of this process; None: the environment's)
    job = load_job(args.config)
    spec = job.spec
    rt = Runtime.from_env()
    engine_url = args.engine_url or rt.engine_url
    kind = args.engine or spec.rollout.engine
    engine = make_engine(kind, engine_url, timeout=spec.rollout.request_timeout_seconds, api_key=rt.engine_api_key,
                         adapters=named_adapters(kind, spec.trainer.lora))
    try:
        eval_inputs = evaluation_inputs(spec, rt.reward_url)
        sources = training_inputs(spec, rt.reward_url)
        tokenizer = load_tokenizer(spec.model.path, spec.model.tokenizer, spec.model.revision)
        renderer = PromptRenderer(tokenizer)  # (the chat format's stop tokens and decoding: every source's)
        producer = group_producer(spec.rollout, tokenizer, renderer)
        await wait_until_ready(engine.ready, f"engine at {engine_url}", args.ready_timeout)
        # (a reward service started with the job may come up after the engine: no group is scored before it)
        for scorer in {id(i.scorer): i.scorer for i in sources}.values():
            await wait_until_ready(scorer.ready, f"reward service {scorer.name}", args.ready_timeout)
    except (StartupError, EpisodeError) as exc:
        log.error("%s", exc)
        await engine.close()
        return 1
    redis = await connect(args.redis_url or rt.redis_url)
    names = rt.stream_names(job.metadata.name)
    cfg = worker_config(args, spec, job.metadata.name, rt, engine_url, renderer.stop_token_ids())
    tools = producer.tool_schemas()
    evaluation = None
    if spec.evaluation is not None and eval_inputs is not None:
        parts = [replace(i.part, render=PromptRenderer(tokenizer, *eval_prompt_format(i.dataset, i.training),
                                                       tools=tools).render) for i in eval_inputs]
        evaluation = WorkerEvaluation(
            parts=parts, settings=EvalSettings.from_spec(spec.evaluation, spec.algorithm, renderer.stop_token_ids()))
    prompts = training_prompts(sources, tokenizer, spec.seed, tools)
    worker = RolloutWorker(cfg, engine=engine, redis=redis, prompts=prompts, decode=renderer.decode,
                           admission=Admission.for_job(redis, names, spec), names=names, evaluation=evaluation,
                           producer=producer)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    log.info("rollout worker %s: job %s, engine %s (%s), shard %d/%d, evaluation %s", cfg.engine_id, cfg.job,
             engine_url, kind, cfg.rollout_index, cfg.rollout_replicas,
             f"of {sum(len(p.items) for p in evaluation.parts)} held-out prompts" if evaluation else "off")
    try:
        await worker.run()
    finally:
        await engine.close()
        await redis.aclose()
    return 0
