"""Helpers for the trainer, checkpoint and runner tests: tiny job files and synthetic groups.

Synthetic groups use the real tokenizer's chat-formatted prompts and short random responses
whose behaviour log-probs are the real model's own (so importance weights start near 1).
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

MODEL = "embedded:SmolLM2-135M-Instruct"
REPO = Path(__file__).resolve().parent.parent
ASYNCRL = [str(Path(sys.executable).parent / "asyncrl")]


def job_dict(name: str = "t-job", *, batch_size: int = 2, group_size: int = 4, eta: int = 2,
             max_steps: int = 2, checkpoint_interval: int = 1, max_new_tokens: int = 8,
             micro_batch_tokens: int = 8192, minibatches: int = 1, proximal: str = "loglinear",
             lr: float = 1e-5, grad_clip: float = 1.0, seed: int = 0,
             algorithm: dict[str, Any] | None = None) -> dict[str, Any]:
    """A small valid job document; `algorithm` adds or overrides spec.algorithm fields (camelCase)."""
    return {
        "apiVersion": "asyncrl.dev/v1alpha1", "kind": "AsyncRLJob", "metadata": {"name": name},
        "spec": {
            "model": {"path": MODEL, "dtype": "float32"},
            "dataset": {"source": "builtin:arithmetic", "difficulty": 1, "seed": seed},
            "reward": {"function": "exact-number"},
            "algorithm": {"groupSize": group_size, "batchSize": batch_size, "minibatches": minibatches,
                          "maxNewTokens": max_new_tokens, "microBatchTokens": micro_batch_tokens,
                          "proximal": proximal, "optimizer": {"lr": lr, "gradClip": grad_clip},
                          **(algorithm or {})},
            "staleness": {"maxHeadOffpolicyness": eta},
            "rollout": {"replicas": 1, "engine": "hf", "gpusPerReplica": 0, "maxConcurrentRequests": 16},
            "trainer": {"gpusPerReplica": 0, "device": "cpu", "maxSteps": max_steps,
                        "checkpointInterval": checkpoint_interval},
            "seed": seed,
        },
    }


def write_job(path: Path, **kw: Any) -> Path:
    path.write_text(yaml.safe_dump(job_dict(**kw), sort_keys=False))
    return path


def make_job(**kw: Any) -> Any:
    """The validated AsyncRLJob of `job_dict(**kw)` (what the trainer takes)."""
    from asyncrl.spec import AsyncRLJob

    return AsyncRLJob.model_validate(job_dict(**kw))


_cache: dict[str, Any] = {}


def model_and_tokenizer() -> tuple[Any, Any]:
    if "model" not in _cache:
        from asyncrl.models import load_causal_lm, load_tokenizer

        _cache["model"] = load_causal_lm(MODEL)
        _cache["tokenizer"] = load_tokenizer(MODEL)
    return _cache["model"], _cache["tokenizer"]


def make_groups(job: str, count: int, *, group_size: int = 4, version: int = 0, seed: int = 0,
                prefix: str = "g", max_len: int = 8) -> list[Any]:
    """`count` groups with deterministic ids/contents; rewards vary within each group."""
    import torch

    from asyncrl.trainer.logprobs import token_logprobs
    from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample

    model, tok = model_and_tokenizer()
    rng = np.random.default_rng(seed)
    groups = []
    for g in range(count):
        a, b = int(rng.integers(10, 50)), int(rng.integers(10, 50))
        text = tok.apply_chat_template([{"role": "user", "content": f"What is {a} + {b}?"}],
                                       add_generation_prompt=True, tokenize=False)
        prompt = np.array(tok(text)["input_ids"], dtype=np.int32)
        samples = []
        for i in range(group_size):
            n = int(rng.integers(2, max_len + 1))
            ids = rng.integers(100, 5000, n).astype(np.int32)
            full = torch.tensor(np.concatenate([prompt, ids]), dtype=torch.long)[None]
            with torch.no_grad():
                lp, _ = token_logprobs(model, full, torch.ones_like(full), 1.0, with_entropy=False)
            behav = lp[0, len(prompt) - 1:].numpy().astype(np.float32)
            samples.append(TrajectorySample(i, ids, behav, np.full(n, version, np.int32),
                                            float(i % 2), "stop"))
        groups.append(TrajectoryGroup(job, f"{prefix}{g:04d}", f"p{g}", prompt, samples, "engine-test",
                                      1000.0 + g, 1000.0 + g))
    return groups


def publish(redis_url: str, job: str, groups: list[Any]) -> None:
    async def go() -> None:
        from asyncrl.transport.connection import connect
        from asyncrl.transport.names import StreamNames
        from asyncrl.transport.streams import TrajectoryConsumer, TrajectoryProducer

        r = await connect(redis_url)
        names = StreamNames.for_job(job)
        await TrajectoryConsumer(r, names, "setup").ensure_group()
        producer = TrajectoryProducer(r, names)
        for g in groups:
            await producer.publish(g)
        await r.aclose()

    asyncio.run(go())


def redis_query(redis_url: str, fn: Any) -> Any:
    """Run `await fn(redis, names_factory)` against a fresh client."""
    async def go() -> Any:
        from asyncrl.transport.connection import connect

        r = await connect(redis_url)
        try:
            return await fn(r)
        finally:
            await r.aclose()

    return asyncio.run(go())


def trainer_env(tmp: Path, redis_url: str, pod: str = "trainer-0") -> dict[str, str]:
    from asyncrl.runtime import Runtime

    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_") or k == "ASYNCRL_CACHE"}
    env.update(Runtime(redis_url=redis_url, weights_dir=tmp / "weights", checkpoint_dir=tmp / "checkpoints",
                       run_dir=tmp, pod_name=pod).to_env())
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
