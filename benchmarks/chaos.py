"""Chaos: every component of a job killed (SIGKILL) at seeded moments and restarted as kubelet would.

The job runs as separate processes, as on a cluster: a Redis server (AOF, fsync at every write, as
the operator ships it), hf engines, rollout workers and the trainer, on a one-layer model of
SmolLM2's architecture (steps in milliseconds, so the run is about recovery, not compute). A
supervisor restarts whatever dies after `restart_delay_s`. A seeded schedule kills, at given policy
versions, each kind of component:

  engine   the inference server, while a group is being generated (it comes back serving the
           base weights)
  worker   a rollout worker, while it holds an admission lease (mid-group)
  trainer  the trainer (anywhere in a step)
  commit   the trainer in the commit window: alternately the moment a checkpoint starts being
           written (its lineage line is on disk, the checkpoint is not) and the moment a new one
           lands (before or just after its ack)
  publish  the trainer, the moment a new weights directory appears (mid weight sync)
  redis    the Redis server (every client rides the outage out)

Afterwards, from Redis and the final checkpoint:
  lost          groups counted as produced that were neither trained nor dropped: the repairs
                admission's reconciliation had to make downward (drift_lost) plus any drift left
  twice         group ids that occur more than once in the final lineage (trained-groups.jsonl)
  foreign       groups of the final lineage trained with a token whose weight label is not the
                lineage's (a dead timeline's version past where the lineage resumed: the labels the
                lineage log records against the lineage of the final checkpoint)
  ghosts        groups the trainers dropped as generated on such weights (ghost_groups_dropped)
  longest_stall_s  the longest stretch without a new policy version, after the first one
  finished      the trainer recorded Succeeded at maxSteps
and, against an undisturbed run of the same job in the same invocation, the wall-time overhead.

    .venv/bin/python benchmarks/chaos.py                          # seeds 0 1 2, 12 kills each
    .venv/bin/python benchmarks/chaos.py --seeds 0 --kills 6 --max-steps 30

Prints one JSON object. tests/local/test_chaos.py runs a short version in the test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import secrets
import signal
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("engine", "worker", "trainer", "commit", "publish", "redis")
"""What the schedule kills (see the top)."""


@dataclass
class ChaosConfig:
    seed: int = 0
    kills: int = 12
    max_steps: int = 40
    batch_size: int = 2
    group_size: int = 2
    eta: int = 1
    checkpoint_interval: int = 2
    replicas: int = 1
    restart_delay_s: float = 1.0
    timeout_s: float = 900.0
    kinds: tuple[str, ...] = KINDS


@dataclass
class ChaosResult:
    seed: int
    kills: dict[str, int]
    restarts: dict[str, int]
    finished: bool
    steps: int
    lost: int
    twice: int
    foreign: int
    ghosts: int
    trained: int
    dropped: int
    drift_lost: int
    drift_found: int
    final_drift: int
    leases_returned: int
    longest_stall_s: float
    wall_s: float
    log: list[str] = field(default_factory=list)


def plan_kills(seed: int, kills: int, max_steps: int, kinds: tuple[str, ...] = KINDS) -> list[tuple[int, str]]:
    """(policy version to kill at, kind), in order: every kind once before any twice (shuffled per
    round, seeded), at versions spread over the run's first 85% with jitter."""
    if kills <= 0:
        return []
    rng = random.Random(seed)
    order: list[str] = []
    while len(order) < kills:
        round_ = list(kinds)
        rng.shuffle(round_)
        order += round_
    last = max(2, int(max_steps * 0.85))
    spacing = (last - 1) / kills
    return [(1 + int(i * spacing + rng.random() * spacing), kind) for i, kind in enumerate(order[:kills])]


def write_tiny_model(path: Path) -> Path:
    """A seeded one-layer model with SmolLM2's architecture and tokenizer, as an HF directory."""
    import copy

    import torch

    from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer

    if (path / "config.json").exists():
        return path
    base, tok = load_causal_lm("embedded:SmolLM2-135M-Instruct"), load_tokenizer("embedded:SmolLM2-135M-Instruct")
    cfg = copy.deepcopy(base.config)
    cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers = 32, 64, 1
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = 2, 1, 16
    torch.manual_seed(0)
    model = type(base)(cfg)
    tmp = path.with_name(path.name + ".tmp")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    os.replace(tmp, path)
    return path


def job_document(name: str, model: Path, cfg: ChaosConfig) -> dict[str, Any]:
    return {
        "apiVersion": "asyncrl.dev/v1alpha1", "kind": "AsyncRLJob", "metadata": {"name": name},
        "spec": {
            "model": {"path": str(model), "dtype": "float32"},
            "dataset": {"source": "builtin:arithmetic", "difficulty": 1, "seed": cfg.seed},
            "reward": {"function": "exact-number"},
            "algorithm": {"groupSize": cfg.group_size, "batchSize": cfg.batch_size, "maxNewTokens": 8,
                          "optimizer": {"lr": 1e-4}},
            "staleness": {"maxHeadOffpolicyness": cfg.eta},
            "rollout": {"replicas": cfg.replicas, "engine": "hf", "gpusPerReplica": 0,
                        "maxConcurrentRequests": 8},
            "trainer": {"gpusPerReplica": 0, "device": "cpu", "maxSteps": cfg.max_steps,
                        "checkpointInterval": cfg.checkpoint_interval},
            "seed": cfg.seed,
        },
    }


class ChaosJob:
    """The job's processes under a kubelet-like supervisor, and the schedule that kills them."""

    def __init__(self, run_dir: Path, cfg: ChaosConfig, model: Path) -> None:
        import yaml

        from asyncrl.api.outcome import ENV_TERMINATION_LOG
        from asyncrl.api.runtime import Runtime
        from asyncrl.infra.net import free_port
        from asyncrl.local.redis_server import LocalRedis
        from asyncrl.local.runner import Child, asyncrl_command, engine_child

        self.cfg, self.run_dir = cfg, run_dir
        self.name = f"chaos-{cfg.seed}"
        run_dir.mkdir(parents=True, exist_ok=True)
        self.job_file = run_dir / "job.yaml"
        self.job_file.write_text(yaml.safe_dump(job_document(self.name, model, cfg), sort_keys=False))
        self.redis = LocalRedis(run_dir / "redis").start()
        runtime = Runtime(redis_url=self.redis.url, weights_dir=run_dir / "weights",
                          checkpoint_dir=run_dir / "checkpoints", run_dir=run_dir,
                          engine_api_key=secrets.token_urlsafe(32))  # (as `asyncrl run` and the operator do)
        self.runtime, self.names = runtime, runtime.stream_names(self.name)
        logs = run_dir / "logs"
        base = {k: v for k, v in os.environ.items() if not k.startswith("ASYNCRL_") or k == "ASYNCRL_CACHE"}
        base.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        self.children: list[Any] = []
        urls = []
        for i in range(cfg.replicas):
            port = free_port()
            env = dict(base, **Runtime(**{**runtime.__dict__, "pod_name": f"engine-{i}"}).to_env())
            self.children.append(engine_child(i, "hf", self.job_file, port, 1, cfg.seed + i, env, logs, str(model)))
            urls.append(f"http://127.0.0.1:{port}")
        trainer_env = dict(base, **Runtime(**{**runtime.__dict__, "pod_name": "trainer-0"}).to_env())
        trainer_env[ENV_TERMINATION_LOG] = str(logs / "trainer.termination-log")
        self.trainer = Child("trainer", asyncrl_command() + [
            "trainer", "--config", str(self.job_file), "--status-port", str(free_port()),
            "--status-host", "127.0.0.1", "--threads", "1"], trainer_env, logs / "trainer.log")
        self.children.append(self.trainer)
        for i, url in enumerate(urls):
            rt = Runtime(**{**runtime.__dict__, "engine_url": url, "pod_name": f"rollout-{i}",
                            "rollout_index": i, "rollout_replicas": cfg.replicas})
            self.children.append(Child(f"rollout-{i}", asyncrl_command() + ["rollout", "--config", str(self.job_file)],
                                       dict(base, **rt.to_env()), logs / f"rollout-{i}.log"))
        self.restarts: Counter[str] = Counter()
        self.kills: Counter[str] = Counter()
        self.log: list[str] = []
        self._dead_since: dict[str, float] = {}
        self._redis_down_since: float | None = None
        self._t0 = time.monotonic()

    # ---------------------------------------------------------------- processes

    def note(self, text: str) -> None:
        self.log.append(f"{time.monotonic() - self._t0:7.1f}s {text}")

    def start(self) -> None:
        for c in self.children:
            c.start(self.run_dir)

    def supervise(self) -> None:
        """Restart what died, `restart_delay_s` after it was seen dead (Redis too, on its port and AOF)."""
        now = time.monotonic()
        for c in self.children:
            if c.poll() is None:
                continue
            since = self._dead_since.setdefault(c.name, now)
            if now - since >= self.cfg.restart_delay_s:
                del self._dead_since[c.name]
                self.restarts[c.name] += 1
                self.note(f"restart {c.name} (exit {c.poll()})")
                c.start(self.run_dir)
        if self._redis_down_since is not None and now - self._redis_down_since >= self.cfg.restart_delay_s:
            self._redis_down_since = None
            self.redis.start()
            self.restarts["redis"] += 1
            self.note("restart redis")

    def kill(self, kind: str) -> None:
        self.kills[kind] += 1
        if kind == "redis":
            self.note("SIGKILL redis")
            self.redis.stop(kill=True)
            self._redis_down_since = time.monotonic()
            return
        prefix = {"engine": "engine-", "worker": "rollout-"}.get(kind, "trainer")
        alive = [c for c in self.children if c.name.startswith(prefix) and c.poll() is None]
        if not alive:
            self.note(f"{kind}: nothing alive to kill")
            return
        victim = random.Random(len(self.log)).choice(alive)
        self.note(f"SIGKILL {victim.name} ({kind})")
        victim.signal(signal.SIGKILL)
        victim.wait(10)

    def stop(self) -> None:
        from asyncrl.local.runner import _stop_all

        _stop_all(self.trainer, self.children)
        self.redis.stop()

    # ---------------------------------------------------------------- observations

    def version(self, client: Any) -> int | None:
        """The policy version the trainer last published (the admission hash); None while Redis is down."""
        import redis as redis_lib

        if self._redis_down_since is not None:
            return None
        try:
            raw = client.hget(self.names.admission, "version")
        except redis_lib.RedisError:
            return None
        return int(raw) if raw is not None else 0

    def outcome(self, client: Any) -> Any:
        import redis as redis_lib

        from asyncrl.api.outcome import read_outcome_redis_sync

        if self._redis_down_since is not None:
            return None
        try:
            return read_outcome_redis_sync(client, self.names)
        except redis_lib.RedisError:
            return None

    def trigger(self, kind: str, client: Any) -> Any:
        """When to kill for `kind` (engine, worker, commit, publish): a predicate, polled every 20 ms."""
        if kind in ("engine", "worker"):
            self.note(f"armed: kill the {kind} while a group is being generated")
            return lambda: self._leased(client)
        if kind == "commit" and self.kills["commit"] % 2 == 0:
            self.note("armed: kill the trainer while its next checkpoint is being written")
            strays = set(self.runtime.checkpoint_dir.glob(".step-*"))  # (left by a writer killed earlier)
            return lambda: bool(set(self.runtime.checkpoint_dir.glob(".step-*")) - strays)
        where = "checkpoint" if kind == "commit" else "weights"
        before = self.newest(where)
        self.note(f"armed: kill the trainer when its next {where} directory lands")
        return lambda: self.newest(where) != before

    def _leased(self, client: Any) -> bool:
        import redis as redis_lib

        try:
            return int(client.zcard(self.names.admission_leases)) > 0
        except redis_lib.RedisError:
            return False

    def newest(self, where: str) -> str | None:
        """The newest checkpoint (`step-*`) or weights (`v*`) directory name, to see a new one appear."""
        root, pattern = ((self.runtime.checkpoint_dir, "step-*") if where == "checkpoint"
                         else (self.runtime.weights_dir, "v*"))
        try:
            names = [p.name for p in Path(root).glob(pattern) if not p.name.startswith(".")]
        except OSError:
            return None
        return max(names, key=lambda n: int("".join(ch for ch in n if ch.isdigit()) or 0), default=None)


def run_chaos(run_dir: Path, cfg: ChaosConfig, model: Path | None = None) -> ChaosResult:
    """One job under the kill schedule of `cfg` (no kills: the undisturbed baseline)."""
    import redis as redis_lib

    model = model or write_tiny_model(run_dir.parent / "tiny-model")
    job = ChaosJob(run_dir, cfg, model)
    schedule = plan_kills(cfg.seed, cfg.kills, cfg.max_steps, cfg.kinds)
    client = redis_lib.Redis.from_url(job.redis.url, socket_timeout=2, socket_connect_timeout=2)
    start = time.monotonic()
    progress, progress_at, stall = 0, None, 0.0
    armed: tuple[str, Any] | None = None  # (kind, when to fire)
    outcome = None
    try:
        job.start()
        while time.monotonic() - start < cfg.timeout_s:
            job.supervise()
            version = job.version(client)
            now = time.monotonic()
            if version is not None and version > progress:
                if progress_at is not None:
                    stall = max(stall, now - progress_at)
                progress, progress_at = version, now
            outcome = job.outcome(client)
            if outcome is not None:
                break
            if armed is not None:
                if armed[1]():
                    job.kill(armed[0])
                    armed = None
            elif schedule and version is not None and version >= schedule[0][0]:
                _, kind = schedule.pop(0)
                if kind in ("commit", "publish", "engine", "worker"):
                    armed = (kind, job.trigger(kind, client))
                else:
                    job.kill(kind)
            time.sleep(0.02)
        wall = time.monotonic() - start
        if progress_at is not None and outcome is None:
            stall = max(stall, time.monotonic() - progress_at)
    finally:
        client.close()
        job.stop()
    return summarize(job, cfg, outcome, stall, wall)


def summarize(job: ChaosJob, cfg: ChaosConfig, outcome: Any, stall: float, wall: float) -> ChaosResult:
    """What Redis (restarted alone, on the same AOF) and the final checkpoint say about the run."""
    import asyncio

    from asyncrl.api.staleness import StalenessPolicy
    from asyncrl.api.weight_labels import parse_label
    from asyncrl.trainer.state.checkpoint import latest_checkpoint, lineage_group_ids, lineage_labels, read_state
    from asyncrl.transport.admission import Admission
    from asyncrl.transport.connection import connect

    latest = latest_checkpoint(job.runtime.checkpoint_dir)
    state = read_state(latest) if latest is not None else None
    lineage = lineage_group_ids(job.runtime.checkpoint_dir)
    trained_acked = state.groups_trained if state is not None else 0
    labels = lineage_labels(job.runtime.checkpoint_dir, state.step) if state is not None else {}
    final = state.lineage() if state is not None else None
    foreign = sum(n for label, n in labels.items()
                  if final is None or (parsed := parse_label(label)) is None or not final.contains(parsed))
    ghosts = int(((state.report if state is not None else {}).get("recovery") or {}).get("ghost_groups_dropped", 0))

    async def admission() -> tuple[Any, Any]:
        redis = await connect(job.redis.url, timeout=10, outage_s=5, health=None)
        try:
            adm = Admission(redis, job.names, batch_size=cfg.batch_size,
                            staleness=StalenessPolicy.global_budget(cfg.eta), max_concurrent=64)
            return await adm.snapshot(), await adm.reconcile(trained_acked)
        finally:
            await redis.aclose()

    job.redis.start()
    try:
        snap, drift = asyncio.run(admission())
    finally:
        job.redis.stop()
    return ChaosResult(
        seed=cfg.seed, kills=dict(job.kills), restarts=dict(job.restarts),
        finished=outcome is not None and getattr(outcome, "phase", "") == "Succeeded",
        steps=state.step if state is not None else 0,
        lost=snap.drift_lost + max(0, -drift.drift), twice=len(lineage) - len(set(lineage)),
        foreign=foreign, ghosts=ghosts,
        trained=len(lineage), dropped=snap.dropped, drift_lost=snap.drift_lost, drift_found=snap.drift_found,
        final_drift=drift.drift, leases_returned=snap.leases_returned, longest_stall_s=round(stall, 1),
        wall_s=round(wall, 1), log=job.log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--kills", type=int, default=12, help="kills per seeded run (default 12: every kind twice)")
    parser.add_argument("--max-steps", type=int, default=40)
    parser.add_argument("--replicas", type=int, default=1, help="engines (one rollout worker each)")
    parser.add_argument("--run-dir", type=Path, default=Path("runs/chaos"))
    args = parser.parse_args(argv)
    args.run_dir = args.run_dir.resolve()  # (the job's processes run elsewhere: paths must not be relative)
    model = write_tiny_model(args.run_dir / "tiny-model")
    base = ChaosConfig(kills=0, max_steps=args.max_steps, replicas=args.replicas)
    undisturbed = run_chaos(args.run_dir / "undisturbed", base, model)
    runs = []
    for seed in args.seeds:
        cfg = ChaosConfig(seed=seed, kills=args.kills, max_steps=args.max_steps, replicas=args.replicas)
        result = run_chaos(args.run_dir / f"seed{seed}", cfg, model)
        print(f"seed {seed}: {json.dumps({k: v for k, v in asdict(result).items() if k != 'log'})}",
              file=sys.stderr, flush=True)
        runs.append(result)
    kills: Counter[str] = Counter()
    for r in runs:
        kills.update(r.kills)
    print(json.dumps({
        "seeds": args.seeds, "max_steps": args.max_steps, "kills_per_run": args.kills,
        "kills_by_kind": dict(kills), "finished": sum(r.finished for r in runs), "runs": len(runs),
        "lost": sum(r.lost for r in runs), "twice": sum(r.twice for r in runs),
        "foreign": sum(r.foreign for r in runs), "ghosts_dropped": sum(r.ghosts for r in runs),
        "dropped": sum(r.dropped for r in runs), "drift_found": sum(r.drift_found for r in runs),
        "leases_returned": sum(r.leases_returned for r in runs),
        "longest_stall_s": max(r.longest_stall_s for r in runs),
        "wall_s": [r.wall_s for r in runs], "undisturbed_wall_s": undisturbed.wall_s,
        "overhead_vs_undisturbed": round(sum(r.wall_s for r in runs) / len(runs) / undisturbed.wall_s, 2),
        "undisturbed_longest_stall_s": undisturbed.longest_stall_s,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())
