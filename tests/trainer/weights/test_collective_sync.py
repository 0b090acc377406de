"""Collective weight sync end to end on CPU: the trainer's side (this process, rank 0 over gloo) and
real hf engine servers (`asyncrl engine`, separate processes, as rollout pods are), through the
same update_engines() the trainer calls at every publish.

What it shows: a broadcast version reaches every engine bit for bit (checked with the pin's
/get_weights_by_name) and labels it; the group is reused while the engines stay the same and
re-formed when one joins; an engine that dies is loaded from disk never again but fenced, the
others fall back to disk within the same publish; a late joiner catches up from disk, then joins.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch

from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer
from asyncrl.infra.net import free_port
from asyncrl.rollout.engines.sglang import SGLangEngine
from asyncrl.trainer.weights.broadcast import CollectiveSync
from asyncrl.trainer.weights.engine_update import WeightSyncError, update_engines
from asyncrl.trainer.weights.files import write_weights
from asyncrl.transport.versions import EngineInfo

pytestmark = pytest.mark.slow
MODEL = "embedded:SmolLM2-135M-Instruct"
PROBE = ("model.layers.3.self_attn.q_proj.weight", "model.norm.weight", "model.embed_tokens.weight")


def start_engine(tmp_path: Path, name: str) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(tmp_path / f"{name}.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "asyncrl.cli", "engine", "--model", MODEL, "--port", str(port),
                             "--threads", "1", "--max-batch-size", "4"], stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        assert proc.poll() is None, (tmp_path / f"{name}.log").read_text()[-2000:]
        try:
            if httpx.get(url + "/model_info", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise AssertionError(f"engine {name} did not start: {(tmp_path / f'{name}.log').read_text()[-2000:]}")


def info(url: str, name: str) -> EngineInfo:
    return EngineInfo(engine_id=name, url=url, weight_version=0, ready=True, heartbeat=time.time(),
                      incarnation=httpx.get(url + "/model_info").json()["incarnation"])


async def head(url: str, name: str, size: int = 16) -> torch.Tensor:
    async with httpx.AsyncClient() as client:
        resp = await client.post(url + "/get_weights_by_name", json={"name": name, "truncate_size": size})
    resp.raise_for_status()
    return torch.tensor(resp.json())


async def label(url: str) -> str:
    engine = SGLangEngine(url)
    try:
        return str((await engine.model_info())["weight_version"])
    finally:
        await engine.close()


@pytest.fixture(scope="module")
def versions(module_dir: Path) -> Path:
    """weights/v1..v3: the model with each parameter shifted by 0.01 * version."""
    root = module_dir / "weights"
    root.mkdir()
    model = load_causal_lm(MODEL, dtype="float32", device="cpu")
    tokenizer = load_tokenizer(MODEL)
    for version in (1, 2, 3):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        write_weights(model, tokenizer, root, version, dtype=torch.float32, bucket_bytes=64 << 20)
    return root


def expected(versions: Path, version: int, name: str, size: int = 16) -> torch.Tensor:
    from safetensors import safe_open

    for f in sorted((versions / f"v{version}").glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as handle:
            if name in list(handle.keys()):
                return handle.get_tensor(name).flatten()[:size]
    raise KeyError(name)


async def test_broadcast_reaches_every_engine_and_the_group_follows_its_members(tmp_path: Path, versions: Path):
    a, url_a = start_engine(tmp_path, "a")
    b, url_b = start_engine(tmp_path, "b")
    late = None
    sync = CollectiveSync(address="127.0.0.1", port=free_port(), backend="gloo", timeout_s=60,
                          bucket_bytes=96 << 20)  # several buckets: only the last one labels the version
    try:
        engines = [info(url_a, "a"), info(url_b, "b")]
        result = await update_engines("hf", engines, versions / "v1", 1, timeout_s=60, collective=sync)
        assert result.engines == 2
        assert sync.stats.groups_formed == 1 and sync.stats.versions_broadcast == 1
        assert sync.stats.disk_fallbacks == 0
        for url in (url_a, url_b):
            assert await label(url) == "1"
            for name in PROBE:
                assert torch.equal(await head(url, name), expected(versions, 1, name))
        first_group = sync.group_name

        await update_engines("hf", engines, versions / "v2", 2, timeout_s=60, collective=sync)
        assert sync.group_name == first_group, "the same engines reuse the group"
        assert await label(url_b) == "2"
        assert torch.equal(await head(url_b, PROBE[0]), expected(versions, 2, PROBE[0]))

        late, url_late = start_engine(tmp_path, "late")  # joins: catch-up gives it v2 from disk first
        await update_engines("hf", [info(url_late, "late")], versions / "v2", 2, timeout_s=60)
        assert await label(url_late) == "2" and sync.group_name == first_group
        engines.append(info(url_late, "late"))
        await update_engines("hf", engines, versions / "v3", 3, timeout_s=60, collective=sync)
        assert sync.stats.groups_formed == 2 and sync.group_name != first_group
        for url in (url_a, url_b, url_late):
            assert await label(url) == "3"
            assert torch.equal(await head(url, PROBE[1]), expected(versions, 3, PROBE[1]))

        real_broadcast = sync._broadcast

        async def member_dies_mid_version(*args, **kwargs):  # after every engine paused, before the bytes
            b.kill()
            b.wait()
            return await real_broadcast(*args, **kwargs)

        sync._broadcast = member_dies_mid_version  # type: ignore[method-assign]
        with pytest.raises(WeightSyncError) as failed:  # the living engines load this version from disk
            await update_engines("hf", engines, versions / "v1", 1, timeout_s=30, collective=sync)
        sync._broadcast = real_broadcast  # type: ignore[method-assign]
        assert set(failed.value.failures) == {url_b} and failed.value.updated == 2
        assert sync.group_name is None and sync.stats.disk_fallbacks == 3
        for url in (url_a, url_late):
            assert await label(url) == "1"
            assert torch.equal(await head(url, PROBE[0]), expected(versions, 1, PROBE[0]))

        # the next publish: b's pause fails (nothing answers), the others form a group of two
        with pytest.raises(WeightSyncError) as failed:
            await update_engines("hf", engines, versions / "v2", 2, timeout_s=30, collective=sync)
        assert set(failed.value.failures) == {url_b}
        assert sync.stats.groups_formed == 3 and sync.stats.versions_broadcast == 4
        for url in (url_a, url_late):
            assert await label(url) == "2"
            assert torch.equal(await head(url, PROBE[2]), expected(versions, 2, PROBE[2]))
    finally:
        await sync.close()
        for proc in (a, b, late):
            if proc is not None:
                proc.kill()
                proc.wait()
