"""Multi-turn episodes (spec.rollout.episode): the episode API, tools, the chat template's turns, and the
rollout worker running episode functions against the fake SGLang server, a real Redis and the real
tokenizer of the embedded model."""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest
from pydantic import ValidationError

from asyncrl.api.episodes import Episode, ToolCall
from asyncrl.api.spec import EPISODES, TOOLS, EpisodeLimits, RolloutSpec
from asyncrl.infra.hf_models import load_tokenizer
from asyncrl.rollout.data.datasets import ArithmeticSource
from asyncrl.rollout.data.mixture import Mixture
from asyncrl.rollout.data.prompts import ChatTurns, PromptRenderer
from asyncrl.rollout.episodes.runner import EpisodeError, EpisodeRunner, resolve_episode
from asyncrl.rollout.episodes.tools import Toolbox, ToolError, calculator, parse_tool_calls
from asyncrl.rollout.rewards.functions import RewardScorer, exact_number_reward
from asyncrl.trainer.weights.engine_update import update_engines
from asyncrl.transport.streams import read_dead_letters
from asyncrl.transport.versions import EngineRegistry
from asyncrl.transport.wire import EpisodeStats
from tests.support import episode_plugins
from tests.support.paths import REPO
from tests.support.polling import poll
from tests.support.rollout_workers import make_worker, published

MODEL = "embedded:SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


# ------------------------------------------------------------------------------------------ tools

@pytest.mark.parametrize(("expression", "value"), [("6 * 7", "42"), ("(12 + 7) * 3", "57"), ("7 / 2", "3.5"),
                                                   ("2 ^ 10", "1024"), ("-3 + 10 // 4", "-1"), ("1/3", "0.3333333333")])
def test_the_calculator_evaluates_arithmetic_exactly(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(("expression", "problem"), [
    ("__import__('os')", "unsupported expression"), ("1 / 0", "division by zero"), ("2 ** 1000", "exponent too large"),
    ("6 *", "not an arithmetic expression"), ("True + 1", "unsupported expression")])
def test_the_calculator_refuses_what_is_not_arithmetic(expression, problem):
    with pytest.raises(ValueError, match=problem):
        calculator(expression)


def test_tool_calls_are_parsed_hermes_style_and_malformed_ones_say_why():
    text = ('Let me compute.\n<tool_call>\n{"name": "calculator", "arguments": {"expression": "1+1"}}\n</tool_call>\n'
            '<tool_call>{"name": "calculator", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>'
            '<tool_call>{"name": calculator}</tool_call><tool_call>[1]</tool_call>'
            '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call><tool_call>{"name": "x", "argu')
    calls = parse_tool_calls(text)
    assert calls[:2] == [ToolCall("calculator", {"expression": "1+1"}), ToolCall("calculator", {"expression": "2*3"})]
    assert "not valid JSON" in calls[2].error and '{"name": "<tool>"' in calls[3].error
    assert calls[4].error == "the tool call's arguments must be a JSON object"
    assert "not valid JSON" in calls[5].error  # (unterminated: the turn stopped inside it)
    assert parse_tool_calls("The answer is 4.") == []


def _slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    import time

    time.sleep(seconds)
    return "late"


async def test_a_tool_that_fails_answers_the_model_with_an_error(monkeypatch):
    toolbox = Toolbox(["calculator", "tests.rollout.episodes.test_episodes:_slow"], timeout_s=0.2)
    try:
        assert [s["function"]["name"] for s in toolbox.schemas] == ["calculator", "_slow"]
        ok = await toolbox.run(ToolCall("calculator", {"expression": "2+2"}))
        assert (ok.content, ok.error) == ("4", False)
        for call, text in [(ToolCall("calculator", {"expression": "1/0"}), "Error: ValueError: division by zero"),
                           (ToolCall("calculator", {"x": 1}), "Error: TypeError: calculator() got an unexpected"),
                           (ToolCall("search", {}), "Error: there is no tool 'search' (tools: calculator, _slow)"),
                           (ToolCall("", {}, "the tool call is not valid JSON"), "Error: the tool call is not valid"),
                           (ToolCall("_slow", {"seconds": 2}), "Error: _slow did not answer within 0.2s")]:
            result = await toolbox.run(call)
            assert result.error and result.content.startswith(text), result
    finally:
        toolbox.close()


def test_a_tool_that_cannot_be_described_or_imported_is_a_clear_error():
    with pytest.raises(ToolError, match="cannot be described"):
        Toolbox(["tests.support.episode_plugins:not_async"])  # (no docstring with Args)
    with pytest.raises(ToolError, match="cannot import module 'no_such_module'"):
        Toolbox(["no_such_module:fn"])
    with pytest.raises(ToolError, match="unknown tool 'search'; allowed: calculator, or module:function"):
        Toolbox(["search"])


# ------------------------------------------------------------------------------------------ the spec

def test_the_spec_names_episodes_and_tools_with_their_allowed_values():
    assert RolloutSpec().episode == "single-turn" and not RolloutSpec().multi_turn()
    assert RolloutSpec(episode="tool-calling", tools=["calculator", "pkg.mod:fn"]).tools == ["calculator", "pkg.mod:fn"]
    for bad, message in [({"episode": "agent"}, "'agent' is not a episode; allowed: single-turn, retry, tool-calling"),
                         ({"episode": "retry", "tools": ["grep"]}, "'grep' is not a tool; allowed: calculator"),
                         ({"tools": ["calculator"]}, "tools are called in multi-turn episodes"),
                         ({"episode": "tool-calling"}, "episode tool-calling needs tools"),
                         ({"episode": "retry", "tools": ["calculator", "calculator"]}, "names a tool twice"),
                         ({"episodeLimits": {"maxTurns": 0}}, "greater than or equal to 1")]:
        with pytest.raises(ValidationError, match=message):
            RolloutSpec.model_validate(bad)


def test_the_builtins_the_spec_allows_are_the_ones_the_worker_has():
    from asyncrl.rollout.episodes.builtin import BUILTIN_EPISODES
    from asyncrl.rollout.episodes.tools import BUILTIN_TOOLS

    assert set(EPISODES) == {"single-turn", *BUILTIN_EPISODES} and set(TOOLS) == set(BUILTIN_TOOLS)
    with pytest.raises(EpisodeError, match="must be an async function"):
        resolve_episode("tests.support.episode_plugins:not_async")
    with pytest.raises(EpisodeError, match="has no function 'nothing'"):
        resolve_episode("tests.support.episode_plugins:nothing")


# ------------------------------------------------------------------------------------------ the template

def test_an_episode_is_the_tokens_of_the_whole_conversation_rendered_at_once(tokenizer):
    """Token in, token out: prompt + turn + observation + the next turn's opening, each tokenized on
    its own, is the tokenization of the conversation rendered whole (so the trainer trains on what
    a chat would show the model)."""
    renderer = PromptRenderer(tokenizer, system_prompt="Be brief.")
    chat = ChatTurns(tokenizer, renderer.stop_token_ids())
    assert chat.end_of_turn == tokenizer.convert_tokens_to_ids("<|im_end|>")
    answer = tokenizer("The answer is 12.", add_special_tokens=False)["input_ids"] + [chat.end_of_turn]
    ids = (renderer.render("What is 5 + 7?") + answer + chat.observation("That is not correct.")
           + chat.generation_prompt())
    whole = tokenizer.apply_chat_template(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 5 + 7?"},
         {"role": "assistant", "content": "The answer is 12."}, {"role": "user", "content": "That is not correct."}],
        add_generation_prompt=True, tokenize=False)
    assert ids == tokenizer(whole, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(chat.observation("42", "tool")) == "\n<|im_start|>tool\n42<|im_end|>\n"


def test_tools_are_described_in_the_prompt_when_the_template_has_no_tool_format(tokenizer):
    toolbox = Toolbox(["calculator"])
    try:
        renderer = PromptRenderer(tokenizer, system_prompt="Be brief.", tools=toolbox.schemas)
        text = tokenizer.decode(renderer.render("Hi"))
    finally:
        toolbox.close()
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call functions")
    assert '"name": "calculator"' in text and "<tool_call>" in text and text.endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------------ the worker

def _episode_worker(env, tokenizer, fn: str, *, n=2, max_new=5, max_groups=2, eos_after=None, limits=None, tools=(),
                    scorer=None):
    redis, fake, names = env
    fake.state.eos_after = eos_after
    renderer = PromptRenderer(tokenizer)
    limits = limits or EpisodeLimits(max_turns=4, max_tokens=512, retries=1)
    runner = EpisodeRunner(resolve_episode(fn), limits, ChatTurns(tokenizer, renderer.stop_token_ids()),
                           renderer.decode, Toolbox(list(tools)) if tools else None, name=fn)
    prompts = Mixture.single(ArithmeticSource(seed=0, difficulty=1), renderer.render,
                             scorer or RewardScorer(exact_number_reward, 5.0, on_error="drop"))
    return make_worker(redis, fake, names, n=n, max_new=max_new, max_groups=max_groups, prompts=prompts,
                       producer=runner, decode=renderer.decode, max_response_tokens=limits.max_tokens)


async def test_an_episode_plugin_publishes_masked_multi_turn_groups(rollout_env, tokenizer):
    worker = _episode_worker(rollout_env, tokenizer, "tests.support.episode_plugins:two_turns", tools=["calculator"])
    stats = await asyncio.wait_for(worker.run(), 60)
    groups = await published(rollout_env[0], rollout_env[2])
    assert stats.groups_published == 2 and len(groups) == 2
    chat = worker.producer.chat
    for g in groups:
        for s in g.samples:
            ids, mask, lps = list(s.response_ids), list(s.token_mask()), list(s.behav_logprobs)
            # turn 1 (5 tokens, cut at maxNewTokens: closed with <|im_end|>), the observation, two tool
            # results, the next turn's opening, turn 2
            context = ([chat.end_of_turn] + chat.observation("Look again.") + chat.observation("42", "tool")
                       + chat.observation("Error: there is no tool 'nope' (tools: calculator)", "tool")
                       + chat.generation_prompt())
            assert ids[5:5 + len(context)] == context and len(ids) == 10 + len(context)
            assert mask == [True] * 5 + [False] * len(context) + [True] * 5
            assert all(lp == 0.0 for lp, m in zip(lps, mask) if not m) and all(lp < 0 for lp, m in zip(lps, mask) if m)
            assert s.reward == 1.0 and s.finish_reason == "length"
            assert s.episode is not None and (s.episode.turns, s.episode.tool_calls, s.episode.tool_errors) == (2, 2, 1)
            assert s.episode.generate_seconds > 0 and list(s.versions) == [0] * len(ids)
    assert worker.stats.groups_failed == 0


async def test_a_weight_update_between_turns_labels_the_later_turn_newer(rollout_env, tokenizer):
    redis, fake, names = rollout_env
    episode_plugins.BETWEEN_TURNS = asyncio.Event()
    try:
        worker = _episode_worker(rollout_env, tokenizer, "tests.support.episode_plugins:two_turns", n=1, max_groups=1,
                                 tools=["calculator"])
        run = asyncio.create_task(worker.run())
        registry = EngineRegistry(redis, names)

        async def first_turn_done():
            return fake.state.tokens_generated >= 5 and len(await registry.list()) == 1

        await poll(first_turn_done, what="the first turn")
        await update_engines("sglang", await registry.list(), Path("/weights/v1"), 1, registry=registry, timeout_s=10)
        episode_plugins.BETWEEN_TURNS.set()
        await asyncio.wait_for(run, 60)
    finally:
        episode_plugins.BETWEEN_TURNS = None
    [group] = await published(redis, names)
    [s] = group.samples
    versions, mask = list(s.versions), list(s.token_mask())
    trained = [v for v, m in zip(versions, mask) if m]
    assert trained == [0] * 5 + [1] * 5 and group.oldest_version() == 0
    assert versions[5:mask.index(True, 5)] == [0] * (mask.index(True, 5) - 5)  # context: its turn's label


async def test_an_episode_that_raises_is_never_trained_with_a_made_up_reward(rollout_env, tokenizer):
    redis, _, names = rollout_env
    worker = _episode_worker(rollout_env, tokenizer, "tests.support.episode_plugins:fails_on_odd_prompts",
                             max_groups=4)
    stats = await asyncio.wait_for(worker.run(), 60)
    groups = await published(redis, names)
    assert sorted(g.prompt_id for g in groups) == ["arith-0-1-0", "arith-0-1-2"]
    assert all(s.reward == 0.5 for g in groups for s in g.samples)
    assert (stats.groups_failed, stats.groups_dropped, stats.groups_published) == (2, 2, 2)
    # each failed group: one episode failed both its tries; the first to give up cancels its sibling
    assert 2 * 2 <= worker.producer.failures <= 2 * 2 * 2
    snap = await worker.admission.snapshot()
    assert (snap.episode_failures, snap.running, snap.accepted) == (2, 0, 2)
    letters = await read_dead_letters(redis, names)
    assert sorted(letter.error.split(":")[0] for letter in letters) == ["episode failed"] * 2
    assert all("KeyError: 'the environment lost its state'" in letter.error for letter in letters)


async def test_an_episode_that_fails_once_is_tried_again(rollout_env, tokenizer):
    episode_plugins.TRIES.clear()
    worker = _episode_worker(rollout_env, tokenizer, "tests.support.episode_plugins:flaky_once", n=1, max_groups=2)
    stats = await asyncio.wait_for(worker.run(), 60)
    assert stats.groups_published == 2 and stats.groups_failed == 0 and worker.producer.failures == 2
    assert set(episode_plugins.TRIES.values()) == {2}


async def test_an_episode_ends_at_its_limits_and_says_it_was_cut(rollout_env, tokenizer):
    redis, _, names = rollout_env
    worker = _episode_worker(rollout_env, tokenizer, "tests.support.episode_plugins:until_the_limit", n=1,
                             max_groups=1, eos_after=3, limits=EpisodeLimits(max_turns=3, max_tokens=512))
    await asyncio.wait_for(worker.run(), 60)
    [g] = await published(redis, names)
    [s] = g.samples
    assert s.episode == EpisodeStats(3, 0, 0, 0.0, s.episode.generate_seconds)
    assert sum(s.token_mask()) == 3 * 4 and s.finish_reason == "stop"  # 3 turns of 3 tokens and <|im_end|>
    worker = _episode_worker(rollout_env, tokenizer, "tests.support.episode_plugins:until_the_limit", n=1,
                             max_groups=1, eos_after=3, limits=EpisodeLimits(max_turns=50, max_tokens=120))
    await asyncio.wait_for(worker.run(), 60)
    last = (await published(redis, names))[-1].samples[0]
    assert len(g.prompt_ids) + len(last.response_ids) == 120 and last.finish_reason == "length"


def test_the_episode_api_needs_no_torch():
    import subprocess
    import sys

    code = ("import sys; import asyncrl.api.episodes; "
            "assert 'torch' not in sys.modules and 'transformers' not in sys.modules, sorted(sys.modules)")
    subprocess.run([sys.executable, "-c", code], check=True)
    ep = Episode(sample={}, prompt_ids=[1, 2], _max_tokens=5)
    ep.add_turn([3], [-0.5], [0], [0], "x", "stop")
    ep.add_context([4, 5, 6])
    assert ep.ids == [3, 4, 5] and ep.mask == [True, False, False] and ep.truncated and ep.room == 0
    assert math.isclose(ep.logprobs[0], -0.5) and ep.trained_tokens() == 1 and np.array(ep.versions[1:]).tolist() == [
        None, None]


# ------------------------------------------------------------------------------------------ a local run

@pytest.mark.slow
def test_a_local_run_trains_a_plugin_episode_with_tools_and_reports_its_figures(tmp_path: Path, tiny_model_dir: Path):
    """`asyncrl run` with spec.rollout.episode naming a function written only against asyncrl.api.episodes:
    the model's turns are trained around masked context, and every step reports the episodes (the
    two-layer model: the episode's path, not what the model says, is under test)."""
    import os
    import subprocess

    import yaml

    from tests.support.jobs import JobBuilder
    from tests.support.trainer_support import ASYNCRL, read_jsonl

    doc = JobBuilder.small(name="t-episodes", batch_size=2, group_size=2, eta=1, max_steps=2, max_new_tokens=6,
                           model={"path": str(tiny_model_dir)}).doc()
    doc["spec"]["rollout"].update(episode="tests.support.episode_plugins:two_turns", tools=["calculator"],
                                  episodeLimits={"maxTurns": 2, "maxTokens": 400})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    repo = REPO
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(ASYNCRL + ["run", str(path), "--run-dir", str(run_dir), "--no-progress"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    lines = read_jsonl(run_dir / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2]
    for m in lines:
        assert m["reward_mean"] == 1.0  # (two_turns' reward: both tool results as expected)
        assert m["turns_mean"] == 2.0 and m["tool_calls"] == 2 * 4 and m["tool_errors"] == 4
        assert m["masked_tokens"] > 0 and 0 < m["tokens"] <= 4 * 2 * 6 and m["generate_seconds"] > 0
        assert m["episodes_failed"] == 0 and m["tool_seconds"] >= 0


# ------------------------------------------------------------------------------------------ benchmarks/episodes.py

def test_the_episodes_benchmark_derives_its_job_and_reads_its_figures(tmp_path: Path):
    import random

    from asyncrl.api.loader import load_job
    from tests.support.bench_support import load_benchmark

    bench = load_benchmark("episodes")
    workload = load_benchmark("episode_workload")
    repo = REPO
    path, batch, group = bench.workload_job(repo / "examples" / "local-agent.yaml", tmp_path / "job.yaml")
    spec = load_job(path).spec
    assert (spec.rollout.episode, spec.rollout.tools, spec.evaluation) == (
        "episode_workload:tool_episode", ["episode_workload:lookup"], None)
    assert (batch, group) == (spec.algorithm.batch_size, spec.algorithm.group_size) == (4, 4)
    rng = random.Random(0)
    delays = sorted(workload.tool_delay(rng, 1.5, 20.0) for _ in range(4001))
    assert 1.3 < delays[2000] < 1.7 and delays[-1] == 20.0 and delays[-400] > 2.5 * 1.5  # median 1.5; p90 2.9x it
    step = {"tool_seconds": 3.0, "generate_seconds": 2.0, "turns_mean": 3.0, "staleness_max": 0, "tokens": 100}
    lines = [{**step, "time": 10.0 * i, "step_seconds": 10.0, "compute_seconds": 4.0, "weight_sync_seconds": 1.0}
             for i in range(1, 4)]
    figs = bench.episode_figures(lines, 2, 4)
    assert figs["episodes_per_s"] == 2 * 4 * 2 / 20.0 and figs["trained_tokens_per_s"] == 200 / 20.0
    assert figs["episodes_per_s_all_steps"] == 2 * 4 * 3 / 30.0 and figs["trainer_idle"] == 0.5
    assert (figs["tool_s"], figs["generate_s"], figs["turns_mean"]) == (3.0, 2.0, 3.0)


# ------------------------------------------------------------------------------------------ evaluation

class _ScriptedEngine:
    """Answers an episode's turns from a script: "5" then "7" (its second turn is right), and aborts the
    very first request (a weight update: the evaluation starts that episode again)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer, self.calls, self.turns = tokenizer, 0, []

    async def generate(self, input_ids, params):
        from asyncrl.rollout.engines.base import GenerateResult

        self.calls += 1
        if self.calls == 1:
            return GenerateResult([], [], "abort", 3)
        second = self.tokenizer.decode(input_ids).count("<|im_start|>assistant") == 2
        self.turns.append((len(input_ids), params.max_new_tokens))
        ids = self.tokenizer("7" if second else "5", add_special_tokens=False)["input_ids"] + [2]
        return GenerateResult(ids, [-0.1] * len(ids), "stop", 3)


async def test_the_evaluator_runs_the_jobs_episode_and_restarts_one_a_weight_update_cut(tokenizer):
    from asyncrl.rollout.data.datasets import PromptItem
    from asyncrl.rollout.engines.base import SamplingParams
    from asyncrl.rollout.evaluation.run_pass import EvalSettings, evaluate

    renderer = PromptRenderer(tokenizer)
    runner = EpisodeRunner(resolve_episode("retry"), EpisodeLimits(max_turns=3), ChatTurns(tokenizer, (2,)),
                           renderer.decode, name="retry")
    engine = _ScriptedEngine(tokenizer)
    items = [PromptItem(f"p{i}", f"What is {i} + 7 - {i}?", "7") for i in range(3)]
    record = await evaluate(engine, items, render=renderer.render, decode=renderer.decode,
                            scorer=RewardScorer(exact_number_reward, 5.0), version=3,
                            settings=EvalSettings(1, SamplingParams(max_new_tokens=8, temperature=0.0)),
                            producer=runner)
    # every episode: "5" (wrong), feedback, "7" (right on the second attempt): reward 0.5, not a pass
    assert (record.reward_mean, record.pass_at_1, record.on_version, record.prompts) == (0.5, 0.0, 1.0, 3)
    assert engine.calls == 1 + 3 * 2 and all(budget == 8 for _, budget in engine.turns)
    feedback = len(runner.chat.observation(
        "That is not correct. Check your work and answer again, with only the final number.")) + len(
        runner.chat.generation_prompt())
    assert record.response_length == 2 + feedback + 2  # ("5" <|im_end|>, feedback, "7" <|im_end|>)


def test_episodes_with_different_prompts_share_their_common_prefix_and_mask_the_rest(tokenizer):
    """An episode function may start from an edited sample: the group's prompt is what every episode's
    prompt shares; each episode's own rest is context (masked, labelled like its first model token)."""
    from types import SimpleNamespace

    from asyncrl.rollout.data.datasets import PromptItem
    from asyncrl.rollout.data.mixture import Lane
    from asyncrl.transport.content import GroupLimits, check_group

    renderer = PromptRenderer(tokenizer)
    runner = EpisodeRunner(resolve_episode("retry"), EpisodeLimits(), ChatTurns(tokenizer, (2,)), renderer.decode)
    eps = []
    for i, prompt in enumerate([[1, 2, 3, 4], [1, 2, 5]]):
        ep = Episode(sample={}, prompt_ids=prompt)
        ep.add_turn([7, 8], [-0.1, -0.2], [3 + i, 4 + i], [0, 0], "x", "stop")
        ep.reward = float(i)
        eps.append(ep)
    generator = SimpleNamespace(cfg=SimpleNamespace(job="j", engine_id="e"))
    lane = Lane("src", ArithmeticSource(seed=0), renderer.render, RewardScorer(exact_number_reward))
    group = runner.to_group(generator, PromptItem("p", "q", "a"), lane, eps, 0.0, fallback=9)
    assert list(group.prompt_ids) == [1, 2] and group.source == "src"
    first, second = group.samples
    assert (list(first.response_ids), list(first.token_mask())) == ([3, 4, 7, 8], [False, False, True, True])
    assert (list(first.versions), list(first.behav_logprobs[:2])) == ([3, 3, 3, 4], [0.0, 0.0])
    assert (list(second.response_ids), list(second.versions), second.reward) == ([5, 7, 8], [4, 4, 5], 1.0)
    assert group.oldest_version() == 3 and check_group(group, GroupLimits(group_size=2)) is None
