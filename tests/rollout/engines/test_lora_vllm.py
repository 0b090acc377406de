"""A LoRA job on vLLM, checked against the installed vLLM's own source: the adapter routes, flags and
request fields we send, and the launch the operator renders. (The adapters served by a real server:
tests/rollout/engines/test_vllm_server.py.)
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

from asyncrl.api.loader import parse_job
from asyncrl.api.spec.lora import VLLM_MAX_LORA_RANKS, LoraSpec, vllm_lora_args
from asyncrl.operator.render import render
from tests.support.engine_routes import vllm_routes
from tests.support.jobs import JobBuilder
from tests.support.vllm_server import NEEDS_VLLM, VLLM_PYTHON

pytestmark = [pytest.mark.vllm, pytest.mark.slow, NEEDS_VLLM]


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
