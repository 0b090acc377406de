"""Run a rollout worker: generate with an engine server, score, publish trajectory groups to Redis.

Where things are comes from the environment (asyncrl.api.runtime: ASYNCRL_REDIS_URL,
ASYNCRL_ENGINE_URL, ASYNCRL_POD_NAME, ASYNCRL_ROLLOUT_INDEX/REPLICAS); flags override it.
ASYNCRL_ENGINE_ADVERTISE_URL (or --advertise-url) is the engine URL registered for the trainer
when it differs from the one the worker uses (e.g. http://$POD_IP:30000 vs http://127.0.0.1:30000).
The trainer pauses, updates and resumes the engine at that URL for every new version; the worker
only generates with it and reports the version it observes.
With spec.evaluation the worker also serves the trainer's held-out evaluation requests on the same
engine (rollout/evaluation/service.py); its dataset and reward are loaded before anything else, so
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


def main(args: argparse.Namespace) -> int:
    # The worker's modules are imported here, not at the top: `asyncrl --help` imports this module
    # (asyncrl/cli.py) and must not load the tokenizer stack, numpy or the Redis client.
    import asyncio
    import logging

    from asyncrl.rollout.worker.process import run_worker

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return asyncio.run(run_worker(args))
