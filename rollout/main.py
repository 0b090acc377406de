"""Run a rollout worker: generate with an engine server, score, publish trajectory groups to Redis.

Where things are comes from the environment (asyncrl.runtime: ASYNCRL_REDIS_URL,
ASYNCRL_ENGINE_URL, ASYNCRL_POD_NAME, ASYNCRL_ROLLOUT_INDEX/REPLICAS); flags override it.
ASYNCRL_ENGINE_ADVERTISE_URL (or --advertise-url) is the engine URL registered for the trainer
when it differs from the one the worker uses (e.g. http://$POD_IP:30000 vs http://127.0.0.1:30000).
The trainer pauses, updates and resumes the engine at that URL for every new version; the worker
only generates with it and reports the version it observes.
With spec.evaluation the worker also serves the trainer's held-out evaluation requests on the same
engine (rollout/worker.py `_evaluator`); its dataset and reward are loaded before anything else, so
a bad one ends the worker at once with the reason (exit status 1).
Outages of Redis (--redis-outage-s, or ASYNCRL_REDIS_OUTAGE_S) and of the engine
(--engine-outage-s) are waited out, Degraded in the log meanwhile, instead of ending the worker
(Redis) or dropping its groups (engine); default 180 s each.
"""

from __future__ import annotations

import argparse


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="job file (YAML)")
    parser.add_argument("--redis-url", help="overrides ASYNCRL_REDIS_URL")
    parser.add_argument("--engine-url", help="overrides ASYNCRL_ENGINE_URL")
    parser.add_argument("--engine", choices=["sglang", "vllm", "hf"],
                        help="engine kind (default: the job's rollout.engine)")
    parser.add_argument("--advertise-url", help="engine URL registered for the trainer (default: --engine-url)")
    parser.add_argument("--engine-id", help="registry id (default: ASYNCRL_POD_NAME or the host name)")
    parser.add_argument("--max-groups", type=int, help="stop after this many groups (default: run until SIGTERM)")
    parser.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the engine")
    parser.add_argument("--log-every", type=float, default=10.0, help="seconds between progress lines")
    parser.add_argument("--redis-outage-s", type=float, default=None,
                        help="seconds a Redis command waits through an outage before the worker gives up "
                             "(default $ASYNCRL_REDIS_OUTAGE_S or 180)")
    parser.add_argument("--engine-outage-s", type=float, default=180.0,
                        help="seconds a request waits for an unreachable engine before its group is dropped "
                             "(default 180)")


async def run_worker(args: argparse.Namespace) -> int:
    # Imported here, not at the top: `asyncrl --help` imports this module (asyncrl/cli.py) and must
    # not load the tokenizer stack, numpy or the Redis client.
    import asyncio
    import logging
    import signal
    import time

    from asyncrl.loader import load_job
    from asyncrl.models import load_tokenizer, vocab_size
    from asyncrl.rollout.datasets import DatasetError, PromptItem, load_source
    from asyncrl.rollout.engines import make_engine
    from asyncrl.rollout.engines.base import SamplingParams
    from asyncrl.rollout.evaluation import EvalSettings, eval_prompt_format, load_eval_items
    from asyncrl.rollout.prompts import PromptRenderer
    from asyncrl.rollout.rewards import RewardError, RewardScorer
    from asyncrl.rollout.worker import RolloutWorker, WorkerConfig, WorkerEvaluation
    from asyncrl.runtime import Runtime
    from asyncrl.transport.admission import Admission
    from asyncrl.transport.connection import connect, set_outage_window

    log = logging.getLogger("asyncrl.rollout")
    set_outage_window(args.redis_outage_s)  # (every client of this process; None: the environment's)
    job = load_job(args.config)
    spec = job.spec
    eval_items: list[PromptItem] = []
    eval_scorer: RewardScorer | None = None
    if spec.evaluation is not None:  # before waiting for the engine: a bad dataset fails at once
        ev = spec.evaluation
        try:
            eval_items = load_eval_items(ev)
        except DatasetError as exc:
            log.error("spec.evaluation.dataset (%s, split %s): %s", ev.dataset.source, ev.dataset.split, exc)
            return 1
        reward = ev.reward or spec.reward
        try:
            eval_scorer = RewardScorer.from_name(reward.function, reward.timeout_seconds)
        except RewardError as exc:
            log.error("spec.evaluation.reward: %s", exc)
            return 1
    rt = Runtime.from_env()
    redis_url = args.redis_url or rt.redis_url
    engine_url = args.engine_url or rt.engine_url
    kind = args.engine or spec.rollout.engine
    engine = make_engine(kind, engine_url, timeout=spec.rollout.request_timeout_seconds, api_key=rt.engine_api_key)
    deadline = time.monotonic() + args.ready_timeout
    while not await engine.ready():
        if time.monotonic() > deadline:
            log.error("engine at %s not ready after %.0fs", engine_url, args.ready_timeout)
            return 1
        await asyncio.sleep(1.0)
    tokenizer = load_tokenizer(spec.model.path, spec.model.tokenizer)
    renderer = PromptRenderer(tokenizer, spec.dataset.prompt_template, spec.dataset.system_prompt)
    alg = spec.algorithm
    sampling = SamplingParams(max_new_tokens=alg.max_new_tokens, temperature=alg.temperature, top_p=alg.top_p,
                              top_k=alg.top_k, stop_token_ids=renderer.stop_token_ids())
    redis = await connect(redis_url)
    names = rt.stream_names(job.metadata.name)
    admission = Admission.for_job(redis, names, spec)
    cfg = WorkerConfig(
        job=job.metadata.name, engine_id=args.engine_id or rt.pod_name, group_size=alg.group_size,
        sampling=sampling, engine_url=args.advertise_url or rt.engine_advertise_url or engine_url,
        max_concurrent_requests=spec.rollout.max_concurrent_requests, max_groups=args.max_groups,
        max_tokens_per_request=spec.rollout.max_tokens_per_request,
        log_every_s=args.log_every, engine_outage_s=args.engine_outage_s,
        rollout_index=rt.rollout_index, rollout_replicas=rt.rollout_replicas,
        vocab_size=vocab_size(spec.model.path))
    evaluation = None
    if spec.evaluation is not None and eval_scorer is not None:
        eval_template, eval_system = eval_prompt_format(spec.evaluation, spec.dataset)
        evaluation = WorkerEvaluation(
            items=eval_items, scorer=eval_scorer,
            render=PromptRenderer(tokenizer, eval_template, eval_system).render,
            settings=EvalSettings.from_spec(spec.evaluation, alg, renderer.stop_token_ids()))
    worker = RolloutWorker(cfg, engine=engine, redis=redis, source=load_source(spec.dataset),
                           render=renderer.render, decode=renderer.decode,
                           scorer=RewardScorer.from_name(spec.reward.function, spec.reward.timeout_seconds),
                           admission=admission, names=names, evaluation=evaluation)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, worker.stop)
    log.info("rollout worker %s: job %s, engine %s (%s), shard %d/%d, evaluation %s", cfg.engine_id, cfg.job,
             engine_url, kind, cfg.rollout_index, cfg.rollout_replicas,
             f"of {len(eval_items)} held-out prompts" if evaluation else "off")
    try:
        await worker.run()
    finally:
        await engine.close()
        await redis.aclose()
    return 0


def main(args: argparse.Namespace) -> int:
    import asyncio
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run_worker(args))
