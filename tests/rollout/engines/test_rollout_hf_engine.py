"""The in-process transformers engine (real SmolLM2-135M) and its SGLang-compatible HTTP server."""

from __future__ import annotations

import asyncio
import concurrent.futures
from pathlib import Path

import httpx
import pytest
import torch

from asyncrl.infra.hf_models import load_tokenizer
from asyncrl.rollout.engines import SamplingParams
from asyncrl.rollout.engines.base import EngineError
from asyncrl.rollout.engines.hf_engine import HFEngine, WeightUpdateError
from asyncrl.rollout.engines.hf_server import create_app
from asyncrl.rollout.engines.sglang import SGLangEngine
from tests.support.sglang_fake import ServerThread

pytestmark = pytest.mark.slow
MODEL = "embedded:SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def engine():
    eng = HFEngine(MODEL, max_batch_size=8, seed=1)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(MODEL)


def prompts(tokenizer, questions):
    return [tokenizer(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                    tokenize=False), add_special_tokens=False)["input_ids"]
            for q in questions]


def recomputed_logprobs(model, prompt: list[int], response: list[int], temperature: float) -> torch.Tensor:
    """What the trainer computes: log_softmax(logits / T) of prompt+response in one forward pass."""
    seq = torch.tensor([prompt + response])
    mask = torch.ones_like(seq)
    try:
        from asyncrl.trainer.step.logprobs import token_logprobs
    except ImportError:
        token_logprobs = None
    with torch.no_grad():
        if token_logprobs is not None:
            lp, _ = token_logprobs(model, seq, mask, temperature)
            lp = lp[0]
        else:
            logits = model(input_ids=seq, attention_mask=mask).logits[0, :-1].float()
            lp = torch.log_softmax(logits / temperature, dim=-1).gather(-1, seq[0, 1:, None]).squeeze(-1)
    return lp[len(prompt) - 1:]


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_behaviour_logprobs_equal_recomputed_logprobs(engine, tokenizer, temperature):
    """Left-padded batched decoding with a KV cache reports the trainer's logprobs to 1e-4 (fp32)."""
    ids = prompts(tokenizer, ["What is 12 + 34?", "Hi", "Name three colours of the rainbow, in order, please."])
    assert len({len(p) for p in ids}) >= 2  # different lengths: rows are padded
    futs = [engine.submit(p, SamplingParams(max_new_tokens=12, temperature=temperature)) for p in ids]
    results = [f.result(timeout=120) for f in futs]
    for p, r in zip(ids, results):
        assert len(r.output_ids) == len(r.logprobs) >= 1
        ref = recomputed_logprobs(engine.model, p, r.output_ids, temperature)
        assert torch.allclose(torch.tensor(r.logprobs), ref, atol=1e-4), (r.logprobs, ref.tolist())


def test_pause_abort_returns_partial_output_and_retract_continues(engine, tokenizer):
    [p] = prompts(tokenizer, ["Write a long story about a dragon."])
    fut = engine.submit(p, SamplingParams(max_new_tokens=400, stop_token_ids=()))
    _wait(lambda: engine.stats()["tokens_generated"] > 0 and engine.stats()["running"] == 1)
    engine.pause("abort")
    partial = fut.result(timeout=60)
    engine.resume()
    assert partial.finish_reason == "abort" and 0 < len(partial.output_ids) < 400
    assert partial.meta["finish_reason"]["type"] == "abort"

    before = engine.stats()["tokens_generated"]
    fut = engine.submit(p, SamplingParams(max_new_tokens=6, temperature=0.0))
    _wait(lambda: engine.stats()["tokens_generated"] > before)
    engine.pause("retract")
    assert not fut.done() or fut.result().finish_reason != "abort"
    engine.resume()
    result = fut.result(timeout=60)
    assert result.finish_reason in ("length", "stop") and len(result.output_ids) == len(result.logprobs)


def test_weight_reload_is_atomic_and_changes_outputs(engine, tokenizer, tmp_path: Path):
    from safetensors.torch import save_file

    [p] = prompts(tokenizer, ["What is 2 + 2?"])
    greedy = SamplingParams(max_new_tokens=5, temperature=0.0)
    first = engine.submit(p, greedy).result(timeout=60)
    original = {k: v.detach().clone() for k, v in engine.model.named_parameters()}

    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, str(bad / "model.safetensors"))
    with pytest.raises(WeightUpdateError):
        engine.update_weights(str(bad), 5)
    with pytest.raises(WeightUpdateError):
        engine.update_weights(str(tmp_path / "missing"), 5)
    assert engine.weight_version == 0
    assert all(torch.equal(v, original[k]) for k, v in engine.model.named_parameters())

    good = tmp_path / "v1"
    good.mkdir()
    torch.manual_seed(0)
    perturbed = {k: (v + 0.05 * torch.randn_like(v)).contiguous() for k, v in original.items()}
    save_file(perturbed, str(good / "model.safetensors"))
    engine.pause("abort")
    engine.update_weights(str(good), 1)
    engine.resume()
    second = engine.submit(p, greedy).result(timeout=60)
    assert second.weight_version == 1 and first.weight_version == 0
    assert second.logprobs != first.logprobs
    # restore for the other tests in this module
    engine.update_weights(str(_save(original, tmp_path / "v0")), 0)


def _save(state, folder: Path) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def _wait(cond, timeout: float = 60.0) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


async def test_http_server_speaks_the_sglang_surface(engine, tokenizer, tmp_path: Path):
    server = ServerThread(create_app(engine, tokenizer)).start()
    client = SGLangEngine(server.url)
    try:
        assert await client.ready()
        [p] = prompts(tokenizer, ["Say hello."])
        r = await client.generate(p, SamplingParams(max_new_tokens=4, temperature=0.0))
        assert len(r.output_ids) == len(r.logprobs) >= 1 and r.weight_version == engine.weight_version
        task = asyncio.create_task(client.generate(p, SamplingParams(max_new_tokens=300, stop_token_ids=())))
        await asyncio.to_thread(_wait, lambda: engine.stats()["running"] == 1)
        await client.pause("abort")
        partial = await task
        assert partial.finish_reason == "abort"
        state = {k: v.detach().clone() for k, v in engine.model.named_parameters()}
        await client.update_weights(str(_save(state, tmp_path / "v9")), 9)
        await client.resume()
        info = await client.model_info()
        assert info["weight_version"] == "9"
        cont = await client.generate(p + partial.output_ids, SamplingParams(max_new_tokens=2))
        assert cont.weight_version == 9
        with pytest.raises(EngineError) as err:
            await client.generate([], SamplingParams(max_new_tokens=2))
        assert err.value.status == 400
        with pytest.raises(EngineError) as err:
            await client.update_weights(str(tmp_path / "nothing-here"), 10)
        assert (await client.model_info())["weight_version"] == "9"
        async with httpx.AsyncClient() as http:  # a label that is not a version number: refused, nothing loaded
            resp = await http.post(f"{server.url}/update_weights_from_disk",
                                   json={"model_path": str(tmp_path / "v9"), "weight_version": "latest"})
        assert resp.status_code == 400 and "'latest' is not a version label" in resp.json()["message"]
        assert (await client.model_info())["weight_version"] == "9"
    finally:
        engine.update_weights(str(_save(state, tmp_path / "v0")), 0)
        await client.close()
        server.stop()


def test_submit_validates_input(engine):
    with pytest.raises(ValueError):
        engine.submit([], SamplingParams(max_new_tokens=2))
    with pytest.raises(ValueError):
        engine.submit([10**9], SamplingParams(max_new_tokens=2))
    assert isinstance(engine.submit([1, 2], SamplingParams(max_new_tokens=1)), concurrent.futures.Future)
