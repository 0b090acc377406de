"""The multi-turn workload of benchmarks/episodes.py: an episode plug-in whose tool is slow.

Each episode: a model turn, a tool call, a model turn, a tool call, a last model turn (maxTurns 3),
scored by the job's reward on the last turn. Generation is real; the tool only sleeps, for a
heavy-tailed time (Pareto, shape 1.5: most calls are quick, a few are many times the median), the
shape of search, code execution and web tools. The call is written by the episode, not parsed from
the model (a 135M model rarely writes one), so every episode spends the same share in tools.

Settings from the environment (the rollout worker's): BENCH_EPISODE_TOOL_MEDIAN_S (default 1.5),
BENCH_EPISODE_TOOL_CAP_S (default 20). (Not ASYNCRL_-prefixed: `asyncrl run` does not pass those on
to the processes it starts.)
"""

from __future__ import annotations

import asyncio
import os
import random
from typing import Any

from asyncrl.api.episodes import Episode, EpisodeContext

SHAPE = 1.5
CALL = '<tool_call>\n{"name": "lookup", "arguments": {"key": "the answer"}}\n</tool_call>'


def tool_delay(rng: random.Random, median_s: float, cap_s: float) -> float:
    """A Pareto(SHAPE) delay scaled to `median_s` (a Pareto of scale 1 has median 2 ** (1 / shape)), capped."""
    return min(median_s * rng.paretovariate(SHAPE) / 2 ** (1 / SHAPE), cap_s)


_RNG = random.Random()


async def lookup(key: str) -> str:
    """Look a key up in a slow remote service.

    Args:
        key: What to look up.
    """
    median = float(os.environ.get("BENCH_EPISODE_TOOL_MEDIAN_S", "1.5"))
    cap = float(os.environ.get("BENCH_EPISODE_TOOL_CAP_S", "20"))
    await asyncio.sleep(tool_delay(_RNG, median, cap))
    return f"{key}: see the question"


async def tool_episode(ctx: EpisodeContext, sample: dict[str, Any]) -> Episode:
    ep = ctx.start(sample)
    while True:
        await ctx.generate(ep)
        if ep.turns >= ctx.max_turns:
            break
        await ctx.call_tools(ep, CALL)
    ep.reward = await ctx.score(ep)
    return ep
