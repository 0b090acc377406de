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

from tests.support.jobs import MODEL

ASYNCRL = [str(Path(sys.executable).parent / "asyncrl")]


_cache: dict[str, Any] = {}


def model_and_tokenizer() -> tuple[Any, Any]:
    if "model" not in _cache:
        from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer

        _cache["model"] = load_causal_lm(MODEL)
        _cache["tokenizer"] = load_tokenizer(MODEL)
    return _cache["model"], _cache["tokenizer"]


def make_groups(job: str, count: int, *, group_size: int = 4, version: int = 0, seed: int = 0,
                prefix: str = "g", max_len: int = 8) -> list[Any]:
    """`count` groups with deterministic ids/contents; rewards vary within each group."""
    import torch

    from asyncrl.trainer.step.logprobs import token_logprobs
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


def publish(redis_url: str, job: str, groups: list[Any], uid: str = "") -> None:
    async def go() -> None:
        from asyncrl.api.stream_names import StreamNames
        from asyncrl.transport.connection import connect
        from asyncrl.transport.streams import TrajectoryConsumer, TrajectoryProducer

        r = await connect(redis_url)
        names = StreamNames.for_job(job, uid)
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


def trainer_env(tmp: Path, redis_url: str, pod: str = "trainer-0", uid: str = "") -> dict[str, str]:
    """The trainer's environment as the operator sets it; its termination message goes to
    tmp/termination-log (/dev/termination-log is Kubernetes')."""
    from asyncrl.api.outcome import ENV_TERMINATION_LOG
    from asyncrl.api.runtime import Runtime

    env = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_") or k == "ASYNCRL_CACHE"}
    env.update(Runtime(redis_url=redis_url, weights_dir=tmp / "weights", checkpoint_dir=tmp / "checkpoints",
                       run_dir=tmp, pod_name=pod, job_uid=uid).to_env())
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env[ENV_TERMINATION_LOG] = str(tmp / "termination-log")
    return env


def wait_for_outcome(redis_url: str, job: str, proc: Any, uid: str = "", timeout: float = 500.0,
                     log: Path | None = None) -> Any:
    """Poll the job's outcome record in Redis (as the operator does) while the trainer runs."""
    import time

    from asyncrl.api.outcome import read_outcome_redis
    from asyncrl.api.stream_names import StreamNames

    names = StreamNames.for_job(job, uid)
    deadline = time.monotonic() + timeout
    while True:
        outcome = redis_query(redis_url, lambda r: read_outcome_redis(r, names))
        if outcome is not None:
            return outcome
        tail = log.read_text()[-3000:] if log is not None and log.exists() else ""
        assert proc.poll() is None, f"trainer exited ({proc.returncode}) without an outcome\n{tail}"
        assert time.monotonic() < deadline, f"no outcome after {timeout}s\n{tail}"
        time.sleep(0.5)


def stop_trainer(proc: Any, timeout: float = 60.0) -> int:
    """SIGTERM (what Kubernetes sends when the operator scales the trainer to zero); the exit code."""
    import signal

    proc.send_signal(signal.SIGTERM)
    return int(proc.wait(timeout))


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def tiny_model(layers: int = 1) -> Any:
    """A `layers`-layer model of SmolLM2's architecture and vocabulary (seeded): a trainer step in
    milliseconds, for tests of what happens around the step (commit window, evaluation)."""
    import copy

    import torch

    base, _ = model_and_tokenizer()
    cfg = copy.deepcopy(base.config)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 32, 64, layers
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, 16
    torch.manual_seed(0)
    model = type(base)(cfg)
    model.train()
    return model


def write_tiny_model(path: Path, layers: int = 1) -> Path:
    """`tiny_model(layers)` with the real tokenizer as an HF directory at `path`, for what loads a model
    by path (`asyncrl run`, `asyncrl engine`, torchrun trainers, the benchmarks' `--model`)."""
    _, tok = model_and_tokenizer()
    tiny_model(layers).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def shared_tiny_model(layers: int = 2) -> Path:
    """`write_tiny_model(layers)` once per machine, under the model cache (asyncrl.infra.hf_models
    cache_dir: outside /tmp, so a test pod, whose /tmp is its own, reads it at the same path; the name
    carries the transformers version that wrote it); written atomically, so concurrent workers agree."""
    import transformers

    from asyncrl.infra.files import atomic_directory
    from asyncrl.infra.hf_models import cache_dir

    target = cache_dir() / "test-models" / f"tiny-smollm2-{layers}-layers-transformers-{transformers.__version__}"
    if not (target / "config.json").is_file():
        with atomic_directory(target, replace=False) as tmp:
            write_tiny_model(tmp, layers)
    return target


def chat_groups(job: str, count: int) -> list[Any]:
    """`count` small groups (a chat prompt, 2-6 random response tokens per sample; rewards vary)."""
    from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample

    _, tok = model_and_tokenizer()
    rng = np.random.default_rng(0)
    prompt = np.array(tok(tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}],
                                                  add_generation_prompt=True, tokenize=False))["input_ids"],
                      dtype=np.int32)
    groups = []
    for g in range(count):
        samples = []
        for i in range(4):
            n = int(rng.integers(2, 7))
            samples.append(TrajectorySample(i, rng.integers(100, 5000, n).astype(np.int32),
                                            np.full(n, -8.0, np.float32), np.zeros(n, np.int32),
                                            float(i % 2), "stop"))
        groups.append(TrajectoryGroup(job, f"g{g:04d}", f"p{g}", prompt, samples, "engine-test",
                                      1000.0 + g, 1000.0 + g))
    return groups


def own_behaviour_groups(model: Any, job: str, count: int, *, noise: float = 0.0, seed: int = 0) -> list[Any]:
    """`chat_groups(job, count)` whose behaviour log-probs are `model`'s own (so every ratio starts
    at 1), plus Gaussian noise of std `noise` per token (stale data: sequence weights away from 1)."""
    import dataclasses

    import torch

    from asyncrl.trainer.step.logprobs import token_logprobs

    rng = np.random.default_rng(seed)
    groups = []
    for g in chat_groups(job, count):
        samples = []
        for s in g.samples:
            full = torch.tensor(np.concatenate([g.prompt_ids, s.response_ids]), dtype=torch.long)[None]
            with torch.no_grad():
                lp, _ = token_logprobs(model, full, torch.ones_like(full), 1.0, with_entropy=False)
            behav = lp[0, len(g.prompt_ids) - 1:].numpy()
            if noise:
                behav = behav + rng.normal(0, noise, len(s.response_ids))
            samples.append(dataclasses.replace(s, behav_logprobs=behav.astype(np.float32)))
        groups.append(dataclasses.replace(g, samples=samples))
    return groups


def run_trainer_on_groups(tmp_path: Path, redis_url: str, job: Any, groups: list[Any], *,
                          reference_model: Any = None) -> tuple[Any, list[tuple[list[str], list[str]]]]:
    """Publish `groups` to `job`'s stream (admission counting them as accepted) and run a trainer of
    the tiny model on them until the job's maxSteps; returns it and, per training step, the ids of
    its fresh groups and of the prompts it replayed."""
    import asyncio

    import torch

    from asyncrl.api.runtime import Runtime
    from asyncrl.api.stream_names import StreamNames
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.main import connect_io
    from asyncrl.trainer.run_config import RunConfig

    name = job.metadata.name
    publish(redis_url, name, groups)

    async def accept(r: Any) -> None:
        await r.hset(StreamNames.for_job(name).admission, "accepted", len(groups))

    redis_query(redis_url, accept)
    runtime = Runtime(redis_url=redis_url, weights_dir=tmp_path / "weights", checkpoint_dir=tmp_path / "ckpt",
                      run_dir=tmp_path, pod_name="trainer-0")
    steps: list[tuple[list[str], list[str]]] = []

    async def go() -> Any:
        _, tok = model_and_tokenizer()
        model = tiny_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        cfg = RunConfig(engine_kind="hf", weights_dir=tmp_path / "weights", checkpoint_dir=tmp_path / "ckpt",
                        metrics_path=tmp_path / "metrics.jsonl", read_block_ms=50)
        io = await connect_io(job, runtime)
        trainer = Trainer(job, cfg, DistContext(), model, opt, tok, io=io, reference_model=reference_model)
        real_step = trainer.train_step

        def step(batch: list[Any], replayed: Any = None) -> dict[str, Any]:
            steps.append(([g.group_id for g in batch], [r.group.prompt_id for r in replayed or []]))
            return real_step(batch, replayed)

        trainer.train_step = step
        try:
            assert await trainer.run() == "Succeeded"
        finally:
            await io.redis.aclose()
        return trainer

    return asyncio.run(go()), steps
