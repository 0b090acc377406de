"""The builtin multi-turn episodes (spec.rollout.episode), written against asyncrl.api.episodes alone,
as a user's plug-in would be."""

from __future__ import annotations

from typing import Any

from asyncrl.api.episodes import Episode, EpisodeContext, EpisodeLimit

RETRY_FEEDBACK = "That is not correct. Check your work and answer again, with only the final number."
"""What `retry` tells the model after a wrong answer."""


async def retry(ctx: EpisodeContext, sample: dict[str, Any]) -> Episode:
    """Answer, be told when the answer is wrong, answer again (up to maxTurns attempts).

    The reward is the last attempt's, halved for each attempt before it: a right first answer is
    worth 1, a right third one 0.25, so the policy learns to get it right early, and a group whose
    samples all end right still has a signal in how fast they got there."""
    ep = ctx.start(sample)
    reward = 0.0
    while True:
        try:
            await ctx.generate(ep)
        except EpisodeLimit:
            break
        reward = await ctx.score(ep)
        if reward > 0 or ep.turns >= ctx.max_turns:
            break
        ep.add_observation(RETRY_FEEDBACK)
    ep.reward = reward * 0.5 ** max(ep.turns - 1, 0)
    return ep


async def tool_calling(ctx: EpisodeContext, sample: dict[str, Any]) -> Episode:
    """The agent loop: the model calls tools until it answers without a call (or runs out of turns
    or tokens); the job's reward scores its last turn."""
    ep = ctx.start(sample)
    while True:
        try:
            text = await ctx.generate(ep)
        except EpisodeLimit:
            break
        if not await ctx.call_tools(ep, text):
            break
    ep.reward = await ctx.score(ep)
    return ep


BUILTIN_EPISODES = {"retry": retry, "tool-calling": tool_calling}
