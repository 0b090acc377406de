"""Episode functions written only against asyncrl.api.episodes, as a user's plug-in would be
(spec.rollout.episode: tests.support.episode_plugins:<name>)."""

from __future__ import annotations

import asyncio
from typing import Any

from asyncrl.api.episodes import Episode, EpisodeContext

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "6 * 7"}}\n</tool_call>'
TRIES: dict[str, int] = {}
"""Tries per prompt id (flaky_once)."""
BETWEEN_TURNS: asyncio.Event | None = None
"""When set by a test: two_turns waits for it between its turns (a weight update happens meanwhile)."""


async def two_turns(ctx: EpisodeContext, sample: dict[str, Any]) -> Episode:
    """Generate, observe, call the calculator (on a written call: the fake engine writes none), generate."""
    ep = ctx.start(sample)
    await ctx.generate(ep)
    ep.add_observation("Look again.")
    results = await ctx.call_tools(ep, CALL + '\n<tool_call>{"name": "nope", "arguments": {}}</tool_call>')
    ep.info["results"] = [r.content for r in results]
    if BETWEEN_TURNS is not None:
        await BETWEEN_TURNS.wait()
    await ctx.generate(ep)
    ep.reward = 1.0 if [r.content for r in results] == ["42", "Error: there is no tool 'nope' (tools: calculator)"] \
        else -1.0
    return ep


async def until_the_limit(ctx: EpisodeContext, sample: dict[str, Any]) -> Episode:
    """Generates and observes until ctx.generate raises EpisodeLimit (not caught: that ends it)."""
    ep = ctx.start(sample)
    while True:
        await ctx.generate(ep)
        ep.add_observation("More.")


async def fails_on_odd_prompts(ctx: EpisodeContext, sample: dict[str, Any]) -> Episode:
    ep = ctx.start(sample)
    await ctx.generate(ep)
    if int(sample["prompt_id"].rsplit("-", 1)[1]) % 2:
        raise KeyError("the environment lost its state")
    ep.reward = 0.5
    return ep


async def flaky_once(ctx: EpisodeContext, sample: dict[str, Any]) -> Episode:
    ep = ctx.start(sample)
    key = f"{sample['prompt_id']}/{id(ctx)}"
    TRIES[sample["prompt_id"]] = TRIES.get(sample["prompt_id"], 0) + 1
    await ctx.generate(ep)
    if TRIES[sample["prompt_id"]] == 1:
        raise ConnectionError(f"sandbox reset ({key})")
    ep.reward = 1.0
    return ep


def not_async(ctx: EpisodeContext, sample: dict[str, Any]) -> Episode:
    raise AssertionError("never called: the worker refuses a plain function")


async def scored_two_turns(ctx: EpisodeContext, sample: dict[str, Any]) -> Episode:
    """Generate, a calculator call (written by the episode), generate again; scored by the job's reward."""
    ep = ctx.start(sample)
    await ctx.generate(ep)
    await ctx.call_tools(ep, CALL)
    await ctx.generate(ep)
    ep.reward = await ctx.score(ep)
    return ep
