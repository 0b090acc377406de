"""Serve a reward function over HTTP with the reward-service protocol (docs/rollout.md).

    asyncrl reward-server my_rewards:verify --port 8100
    asyncrl reward-server gsm8k --host 0.0.0.0 --workers 16

The same `fn(completion, answer) -> float` a job can run in-process (spec.reward.function) then
scales on its own pods or machine, and jobs score with it through `spec.reward.service.url` (a
function with a `metadata` parameter gets each item's `metadata`, as in-process). Each item runs
in a worker thread with `--timeout` seconds; one that raises, times out or returns a non-finite
number is tried again up to `--retries` more times in the service (default 0), then answered with
`error`: the job's worker sends it again up to `reward.retries` times (rollout/rewards/client.py), and
drops its group past that (never a made-up 0). With an API key (--api-key, else
$ASYNCRL_REWARD_API_KEY) /score wants `Authorization: Bearer <key>`; /health stays open for probes
and counts what was scored, failed and tried again.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from asyncrl.api.runtime import secret_env
from asyncrl.rollout.rewards.functions import RewardError, RewardFailed, RewardScorer, resolve_reward, settled
from asyncrl.rollout.rewards.protocol import (
    DEFAULT_PORT,
    ENV_REWARD_API_KEY,
    HEALTH_PATH,
    SCORE_PATH,
    ItemScore,
    ScoreRequest,
    ScoreResponse,
)


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("function", help="gsm8k, exact-number, or a plug-in package.module:function")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument("--workers", type=int, default=8, help="items scored at once, in threads (default 8)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds one item may take (default 5)")
    parser.add_argument("--retries", type=int, default=0,
                        help="times an item whose function raised, timed out or returned a non-finite number is "
                             "tried again in the service before it is answered with `error` (default 0: the "
                             "job's reward.retries re-sends it from the rollout worker)")
    parser.add_argument("--api-key", default=None,
                        help=f"require `Authorization: Bearer KEY` on /score (default: ${ENV_REWARD_API_KEY}; "
                             "unset: open)")
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level (default warning)")


def create_app(scorer: RewardScorer, *, api_key: str | None = None) -> Any:
    """The FastAPI app scoring with `scorer` (its failures become per-item errors)."""
    from fastapi import FastAPI

    from asyncrl.rollout.engines.auth import require_api_key

    app = FastAPI(title=f"asyncrl reward service: {scorer.name}")
    require_api_key(app, api_key)

    @app.get(HEALTH_PATH)
    async def health() -> dict[str, str | int]:
        return {"status": "ok", "reward": scorer.name, "scored": scorer.scored, "errors": scorer.errors,
                "retried": scorer.retried, "failed": scorer.failed}

    @app.post(SCORE_PATH)
    async def score(request: ScoreRequest) -> ScoreResponse:
        results = await settled([scorer.score(i.completion, i.answer, i.prompt, metadata=i.metadata)
                                 for i in request.items])
        return ScoreResponse(scores=[ItemScore(error=str(r)) if isinstance(r, RewardFailed) else ItemScore(score=r)
                                     for r in results])

    return app


def main(args: argparse.Namespace) -> int:
    import uvicorn

    if args.workers < 1 or args.timeout <= 0 or args.retries < 0:
        print("error: --workers must be >= 1, --timeout > 0 and --retries >= 0", file=sys.stderr)
        return 2
    try:
        fn = resolve_reward(args.function)
    except RewardError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    scorer = RewardScorer(fn, args.timeout, max_workers=args.workers, name=args.function, retries=args.retries,
                          on_error="drop")
    app = create_app(scorer, api_key=args.api_key or secret_env(ENV_REWARD_API_KEY))
    print(f"reward service {scorer.name} on http://{args.host}:{args.port}{SCORE_PATH}", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        scorer.close()
    return 0
