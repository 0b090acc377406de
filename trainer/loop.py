"""The training loop, top to bottom: batch -> advantages -> proximal -> updates -> publish -> commit.

One step:
  1. rank 0 reads trajectory groups until B fresh ones are buffered (oldest first); groups older
     than eta versions are dropped, counted (admission frees their capacity) and acknowledged;
  2. the batch is broadcast, so every rank computes the same advantages and token counts;
  3. proximal log-probs: `recompute` runs a no-grad forward over the batch (timed), `loglinear`
     is A-3PO's interpolation inside the loss (timed too);
  4. for each minibatch, each rank forwards/backwards its shard in micro-batches under a token
     budget; every micro-batch loss is weighted by its share of the minibatch's tokens over all
     ranks, so the gradient is the exact token-mean of the minibatch; DDP sums the shards;
     gradient clipping; AdamW;
  5. rank 0 publishes version+1 (weights dir, event, engines paused/updated/resumed, admission);
  6. every K steps (and at the end) a checkpoint is written and only then are the groups trained
     since the previous checkpoint acknowledged (see checkpoint.py for why).
The report (served at /status) and metrics.jsonl are updated after each step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from asyncrl.status_report import EngineReport, StepRecord, TrainerReport
from asyncrl.trainer import distributed as D
from asyncrl.trainer.checkpoint import TrainerState, save_checkpoint
from asyncrl.trainer.publish import (WeightSyncError, drop_versions_after, prune_weights,
                                     update_engines, write_weights)

log = logging.getLogger("asyncrl.trainer")

HISTORY_LIMIT = 500
SYNC_FAILURES_BEFORE_FATAL = 3


@dataclass
class LoopConfig:
    """What the loop needs from the job spec and the runtime (built in trainer/main.py)."""

    job: str
    batch_size: int
    eta: int
    minibatches: int = 1
    micro_batch_tokens: int = 8192
    temperature: float = 1.0
    estimator: str = "grpo"
    batch_normalize_advantages: bool = False
    aggregation: str = "token-mean"
    grad_clip: float = 1.0
    max_steps: int = 100
    checkpoint_interval: int = 10
    engine_kind: str = "hf"
    weights_dir: Path = Path("weights")
    checkpoint_dir: Path = Path("checkpoints")
    metrics_path: Path | None = None
    weight_sync_timeout_s: float = 120.0
    read_block_ms: int = 1000
    engine_max_age_s: float = 30.0


@dataclass
class Sequence:
    """One sample flattened for the trainer (what build_batch consumes)."""

    prompt_ids: np.ndarray
    response_ids: np.ndarray
    behav_logprobs: np.ndarray
    versions: np.ndarray
    reward: float
    advantage: float = 0.0

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)


@dataclass
class StreamIO:
    """Rank 0's connections: the trajectory consumer, admission, version channel, engine registry."""

    redis: Any
    consumer: Any
    admission: Any
    versions: Any
    registry: Any


@dataclass
class StepStats:
    """Sums and extremes accumulated over micro-batches (and then over ranks)."""

    sums: dict[str, float] = field(default_factory=lambda: Counter())
    maxes: dict[str, float] = field(default_factory=dict)
    mins: dict[str, float] = field(default_factory=dict)

    def add(self, key: str, value: float, weight: float = 1.0) -> None:
        if not math.isnan(value):
            self.sums[key] += value * weight
            self.sums[key + "#w"] += weight

    def extreme(self, key: str, value: float) -> None:
        if not math.isnan(value):
            self.maxes[key] = max(self.maxes.get(key, -math.inf), value)
            self.mins[key] = min(self.mins.get(key, math.inf), value)


class Trainer:
    """Owns the model, optimizer, report and (on rank 0) the stream I/O of one trainer process."""

    def __init__(self, cfg: LoopConfig, ctx: D.DistContext, model: Any, optimizer: Any, tokenizer: Any,
                 loss_config: Any, *, io: StreamIO | None = None, state: TrainerState | None = None,
                 report: TrainerReport | None = None):
        self.cfg = cfg
        self.ctx = ctx
        self.model = model
        self.optimizer = optimizer
        self.tokenizer = tokenizer
        self.loss_config = loss_config
        self.io = io
        self.state = state or TrainerState()
        self.report = report or TrainerReport(job=cfg.job, max_steps=cfg.max_steps, started_at=time.time())
        self.report.max_steps = cfg.max_steps
        self.report.staleness.limit = cfg.eta
        self._report_lock = threading.Lock()
        self.buffer: list[Any] = []        # read, fresh, not yet trained (still pending in Redis)
        self.uncommitted: list[Any] = []   # trained since the last checkpoint (acked at the next one)
        self._stale: list[Any] = []        # over-stale deliveries, acked as dropped
        self.stop_requested = False
        self._sync_failures = 0
        self._committed_step = self.state.step
        self._pushed: dict[str, int] = {}  # engine url -> version this trainer loaded into it
        self._last_step_end = time.time()
        self.pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0

    # ------------------------------------------------------------------ report

    def get_report(self) -> TrainerReport:
        """A snapshot for the status endpoint (called from its thread)."""
        with self._report_lock:
            return self.report.model_copy(deep=True)

    def _set_phase(self, phase: str, message: str = "") -> None:
        with self._report_lock:
            self.report.phase = phase  # type: ignore[assignment]
            self.report.message = message
            self.report.updated_at = time.time()

    async def refresh_engines(self) -> None:
        if self.io is None:
            return
        try:
            infos = await self.io.registry.list(max_age_s=self.cfg.engine_max_age_s)
        except Exception as exc:  # noqa: BLE001 - the report is best effort
            log.warning("engine registry unavailable: %s", exc)
            return
        def version(i: Any) -> int | None:  # the registry's label may lag behind what we pushed
            known = [v for v in (i.weight_version, self._pushed.get(i.url)) if v is not None]
            return max(known) if known else None

        with self._report_lock:
            self.report.rollout = [EngineReport(url=i.url, weight_version=version(i), ready=i.ready)
                                   for i in infos]

    # ------------------------------------------------------------------ the loop

    async def run(self) -> str:
        """Train until max_steps (-> "Succeeded") or a stop request (-> "Stopped")."""
        await self.startup_sync()
        while self.state.step < self.cfg.max_steps:
            groups = await self.next_batch() if self.ctx.is_main else None
            groups = D.broadcast_object(groups, self.ctx)
            if groups is None:  # rank 0 was asked to stop
                break
            self._set_phase("Training")
            record = self.train_step(groups)
            await self.publish(self.state.version + 1)
            self.finish_step(groups, record)
            if self.state.step % self.cfg.checkpoint_interval == 0 or self.state.step >= self.cfg.max_steps:
                await self.commit()
        if self.state.step > self._committed_step:  # (same decision on every rank: commit() has barriers)
            await self.commit()
        phase = "Succeeded" if self.state.step >= self.cfg.max_steps else "Stopped"
        self._set_phase(phase, f"{self.state.step} steps, policy version {self.state.version}")
        return phase

    async def startup_sync(self) -> None:
        """After a resume, put the engines back on this lineage's weights (newer ones were lost)."""
        if not self.ctx.is_main or self.io is None:
            return
        await self.io.admission.set_version(self.state.version)
        lost = drop_versions_after(self.cfg.weights_dir, self.state.version)
        if self.state.version == 0 and not lost:
            return  # fresh start: the engines serve the base model, which is version 0
        log.info("resuming at version %d (discarded newer weight dirs %s): re-publishing",
                 self.state.version, lost)
        await self.publish(self.state.version, write=True)

    async def next_batch(self) -> list[Any] | None:
        """Rank 0: the B oldest fresh groups, or None when a stop was requested."""
        assert self.io is not None
        self._set_phase("Waiting", f"waiting for {self.cfg.batch_size} trajectory groups")
        last_refresh = 0.0
        if self.stop_requested:
            return None
        while True:
            self._drop_stale_from_buffer()
            await self._ack_dropped()
            if len(self.buffer) >= self.cfg.batch_size:
                break
            if self.stop_requested:
                return None
            if time.monotonic() - last_refresh > 5:
                await self.refresh_engines()
                last_refresh = time.monotonic()
            deliveries = await self.io.consumer.read(count=max(self.cfg.batch_size - len(self.buffer), 1),
                                                     block_ms=self.cfg.read_block_ms)
            known = {d.group.group_id for d in self.buffer}
            for d in deliveries:
                if d.group.group_id not in known:
                    self.buffer.append(d)
                    known.add(d.group.group_id)
        self.buffer.sort(key=lambda d: (d.group.oldest_version(), d.group.created_at, d.group.group_id))
        batch, self.buffer = self.buffer[: self.cfg.batch_size], self.buffer[self.cfg.batch_size:]
        self.uncommitted.extend(batch)
        return [d.group for d in batch]

    def _drop_stale_from_buffer(self) -> None:
        from asyncrl.transport.admission import is_too_stale

        keep, stale = [], self._stale
        for d in self.buffer:
            (stale if is_too_stale(d.group, self.state.version, self.cfg.eta) else keep).append(d)
        self.buffer, self._stale = keep, stale

    async def _ack_dropped(self) -> None:
        stale = self._stale
        if not stale or self.io is None:
            return
        await self.io.admission.record_dropped(len(stale))
        await self.io.consumer.ack(stale)
        self.state.dropped += len(stale)
        with self._report_lock:
            self.report.staleness.dropped = self.state.dropped
        log.info("dropped %d over-stale group(s) (limit eta=%d)", len(stale), self.cfg.eta)
        self._stale = []

    # ------------------------------------------------------------------ one update

    def sequences(self, groups: list[Any]) -> list[Sequence]:
        """Flatten groups into sequences with per-sequence advantages (group-wise estimator)."""
        from asyncrl.trainer.losses import compute_advantages

        seqs: list[Sequence] = []
        for g in groups:
            rewards = torch.tensor([float(s.reward) for s in g.samples], dtype=torch.float32)
            adv = compute_advantages(rewards, len(g.samples), estimator=self.cfg.estimator) \
                if len(g.samples) > 1 or self.cfg.estimator == "dr_grpo" else torch.zeros_like(rewards)
            for s, a in zip(g.samples, adv.tolist()):
                seqs.append(Sequence(np.array(g.prompt_ids), np.array(s.response_ids),  # copies: decoded
                                     np.array(s.behav_logprobs), np.array(s.versions),  # arrays are read-only
                                     float(s.reward), float(a)))
        if self.cfg.batch_normalize_advantages and seqs:
            from asyncrl.trainer.losses import normalize_advantages

            adv = normalize_advantages(torch.tensor([s.advantage for s in seqs], dtype=torch.float64),
                                       torch.tensor([float(len(s.response_ids)) for s in seqs],
                                                    dtype=torch.float64))
            for s, a in zip(seqs, adv.tolist()):
                s.advantage = a
        return seqs

    def plan_microbatches(self, seqs: list[Sequence]) -> list[list[int]]:
        """This rank's micro-batches (indices into `seqs`): longest first, padded tokens <= budget."""
        order = sorted(range(len(seqs)), key=lambda i: (-seqs[i].length, i))
        mine = order[self.ctx.rank::self.ctx.world_size]
        micro: list[list[int]] = []
        current: list[int] = []
        longest = 0
        for i in mine:
            longest_if = max(longest, seqs[i].length)
            if current and longest_if * (len(current) + 1) > self.cfg.micro_batch_tokens:
                micro.append(current)
                current, longest_if = [], seqs[i].length
            current.append(i)
            longest = longest_if
        if current:
            micro.append(current)
        return micro

    def _batch(self, seqs: list[Sequence], idx: list[int]) -> Any:
        from asyncrl.trainer.batch import build_batch

        return build_batch([seqs[i] for i in idx], self.pad_id,
                           advantages=[seqs[i].advantage for i in idx]).to(self.ctx.device)

    def _forward(self, model: Any, batch: Any, *, with_entropy: bool = True) -> tuple[Any, Any]:
        from asyncrl.trainer.logprobs import token_logprobs

        return token_logprobs(model, batch.input_ids, batch.attention_mask, self.cfg.temperature,
                              mask=batch.loss_mask, with_entropy=with_entropy)

    def _denominator(self, seqs: list[Sequence], mb: list[int]) -> float:
        """The whole minibatch's normaliser (over all ranks), so micro-batch losses add up exactly."""
        if self.cfg.aggregation == "token-mean":
            return float(sum(len(seqs[i].response_ids) for i in mb))
        if self.cfg.aggregation == "seq-mean-token-mean":
            return float(sum(1 for i in mb if len(seqs[i].response_ids)))
        return float(max(seqs[i].length for i in mb) - 1)  # seq-mean-token-sum-norm: padded T

    def train_step(self, groups: list[Any]) -> dict[str, Any]:
        """One training step on `groups` (identical on every rank); returns the step's metrics."""
        from asyncrl.trainer.losses import policy_loss

        t0 = time.perf_counter()
        model, version = self.model, self.state.version
        seqs = self.sequences(groups)
        per_mb = len(groups) // self.cfg.minibatches or 1
        minibatches = [[i for gi in range(m * per_mb, min((m + 1) * per_mb, len(groups)))
                        for i in self._seq_range(groups, gi)] for m in range(self.cfg.minibatches)]
        minibatches = [mb for mb in minibatches if mb]
        plans = [[[mb[j] for j in micro] for micro in self.plan_microbatches([seqs[i] for i in mb])]
                 for mb in minibatches]

        # Proximal log-probs for `recompute`: the current weights before any update (timed).
        t_prox = time.perf_counter()
        prox: dict[tuple[int, int], Any] = {}
        if getattr(self.loss_config, "kind", "decoupled") == "decoupled" and \
                getattr(self.loss_config, "proximal", "loglinear") == "recompute":
            model.eval()
            with torch.no_grad():
                for m, plan in enumerate(plans):
                    for k, idx in enumerate(plan):
                        prox[(m, k)] = self._forward(model, self._batch(seqs, idx), with_entropy=False)[0]
            model.train()
        prox_seconds = time.perf_counter() - t_prox
        loglinear_seconds = 0.0

        stats = StepStats()
        grad_norms = []
        for m, (mb, plan) in enumerate(zip(minibatches, plans)):
            denominator = self._denominator(seqs, mb)
            self.optimizer.zero_grad(set_to_none=True)
            steps = plan or [[]]
            for k, idx in enumerate(steps):
                with D.no_sync_unless(model, k == len(steps) - 1, self.ctx):
                    if not idx:  # this rank has no sequence in this minibatch: join the all-reduce
                        _zero_loss(model, self.ctx.device).backward()
                        continue
                    batch = self._batch(seqs, idx)
                    logprobs, entropy = self._forward(model, batch)
                    loss, s = policy_loss(logprobs, batch.behav_logprobs, batch.advantages, batch.loss_mask,
                                          config=self.loss_config, versions=batch.versions,
                                          current_version=version, prox_logprobs=prox.get((m, k)),
                                          loss_denominator=denominator)
                    # DDP averages gradients over ranks; multiplying by world makes it the exact sum.
                    (loss * self.ctx.world_size).backward()
                    ntok = float(batch.num_tokens)
                    stats.sums["loss"] += float(loss.detach())
                    stats.sums["loss#w"] += 1.0
                    loglinear_seconds += float(s.get("proximal_s", 0.0))
                    for key in ("clip_fraction", "dual_clip_fraction", "behav_filtered_fraction",
                                "importance_weight_mean", "m2_before", "m2_after", "m2_masked_fraction"):
                        if key in s:
                            stats.add(key, float(s[key]), ntok)
                    if ntok:
                        stats.extreme("importance_weight", float(s.get("importance_weight_max", 1.0)))
                        stats.extreme("importance_weight", float(s.get("importance_weight_min", 1.0)))
                        stats.add("entropy", float(entropy[batch.loss_mask].mean()), ntok)
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.grad_clip)
            grad_norms.append(float(grad_norm))
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

        # Step metrics, summed over ranks.
        keys = ["loss", "clip_fraction", "dual_clip_fraction", "behav_filtered_fraction", "importance_weight_mean",
                "m2_before", "m2_after", "m2_masked_fraction", "entropy"]  # same list on every rank
        vec = [stats.sums[k] for k in keys] + [stats.sums[k + "#w"] for k in keys]
        vec += [prox_seconds + loglinear_seconds]
        summed = D.all_reduce_sum(vec, self.ctx)
        values = {k: summed[i] / summed[len(keys) + i] if summed[len(keys) + i] else 0.0
                  for i, k in enumerate(keys)}
        values["loss"] = summed[0] / max(len(minibatches), 1)
        # (each micro-batch loss is already normalised by its whole minibatch, so they add up)
        iw_max, neg_iw_min = D.all_reduce_max([stats.maxes.get("importance_weight", 1.0),
                                               -stats.mins.get("importance_weight", 1.0)], self.ctx)
        # Staleness over the whole batch (identical on every rank: computed from the broadcast groups).
        all_lags: Counter[int] = Counter()
        for s in seqs:
            lags = np.clip(version - s.versions[s.versions >= 0], 0, None) if len(s.versions) else np.array([])
            all_lags.update(int(x) for x in lags)
        n_tokens = sum(all_lags.values())
        rewards = [s.reward for s in seqs]
        return {
            "loss": values.get("loss", 0.0),
            "clip_fraction": values.get("clip_fraction", 0.0),
            "dual_clip_fraction": values.get("dual_clip_fraction", 0.0),
            "behav_filtered_fraction": values.get("behav_filtered_fraction", 0.0),
            "importance_weight_mean": values.get("importance_weight_mean", 1.0),
            "importance_weight_max": iw_max,
            "importance_weight_min": -neg_iw_min,
            "m2_before": values.get("m2_before", 0.0),
            "m2_after": values.get("m2_after", 0.0),
            "m2_masked_fraction": values.get("m2_masked_fraction", 0.0),
            "entropy": values.get("entropy", 0.0),
            "grad_norm": float(np.mean(grad_norms)) if grad_norms else 0.0,
            "reward_mean": float(np.mean(rewards)) if rewards else 0.0,
            "response_length": float(np.mean([len(s.response_ids) for s in seqs])) if seqs else 0.0,
            "tokens": int(sum(len(s.response_ids) for s in seqs)),
            "staleness_mean": (sum(k * v for k, v in all_lags.items()) / n_tokens) if n_tokens else 0.0,
            "staleness_max": max(all_lags) if all_lags else 0,
            "staleness_histogram": dict(all_lags),
            "proximal_seconds": summed[-1] / self.ctx.world_size,
            "compute_seconds": time.perf_counter() - t0,
            "group_ids": [g.group_id for g in groups],
        }

    @staticmethod
    def _seq_range(groups: list[Any], gi: int) -> range:
        start = sum(len(g.samples) for g in groups[:gi])
        return range(start, start + len(groups[gi].samples))

    # ------------------------------------------------------------------ publish and commit

    async def publish(self, version: int, *, write: bool = True) -> None:
        """Rank 0: weights/v{version}, version event, engines updated, admission told; all ranks advance."""
        self.state.version = version
        if not self.ctx.is_main:
            return
        self._set_phase("Publishing", f"publishing version {version}")
        from asyncrl.transport.versions import VersionEvent

        t0 = time.perf_counter()
        path = write_weights(D.unwrap(self.model), self.tokenizer, self.cfg.weights_dir, version) if write \
            else self.cfg.weights_dir / f"v{version}"
        sync_error = None
        engines = []
        if self.io is not None:
            await self.io.versions.publish(VersionEvent(version=version, weights_path=str(path.resolve()),
                                                        time=time.time()))
            engines = await self.io.registry.list(max_age_s=self.cfg.engine_max_age_s)
            if engines:
                try:
                    await update_engines(self.cfg.engine_kind, [e.url for e in engines], path.resolve(),
                                         version, timeout_s=self.cfg.weight_sync_timeout_s)
                    self._pushed.update({e.url: version for e in engines})
                    self._sync_failures = 0
                except WeightSyncError as exc:
                    self._sync_failures += 1
                    sync_error = str(exc)
                    log.error("%s", exc)
                    if self._sync_failures >= SYNC_FAILURES_BEFORE_FATAL:
                        raise
            await self.io.admission.set_version(version)
            await self.refresh_engines()
        keep = {self._pushed.get(e.url, e.weight_version) for e in engines} - {None}
        prune_weights(self.cfg.weights_dir, keep | {version - 1}, newest=version)
        seconds = time.perf_counter() - t0
        with self._report_lock:
            self.report.policy_version = version
            self.report.weight_sync_seconds = seconds
            if sync_error:
                self.report.message = sync_error

    def finish_step(self, groups: list[Any], record: dict[str, Any]) -> None:
        """Advance counters, update the report and append one line to metrics.jsonl."""
        st = self.state
        st.step += 1
        st.groups_trained += len(groups)
        st.tokens_trained += record["tokens"]
        st.trained_group_ids.extend(record["group_ids"])
        now = time.time()
        wall = max(now - self._last_step_end, 1e-9)
        self._last_step_end = now
        step_record = StepRecord(step=st.step, policy_version=st.version, reward_mean=record["reward_mean"],
                                 staleness_mean=record["staleness_mean"], staleness_max=record["staleness_max"],
                                 loss=record["loss"], clip_fraction=record["clip_fraction"],
                                 tokens=record["tokens"], step_seconds=wall,
                                 proximal_seconds=record["proximal_seconds"], time=now)
        with self._report_lock:
            r = self.report
            sync_seconds = r.weight_sync_seconds
            step_record.weight_sync_seconds = sync_seconds
            r.step, r.policy_version = st.step, st.version
            r.groups_trained, r.tokens_trained = st.groups_trained, st.tokens_trained
            r.tokens_per_second = record["tokens"] / wall
            r.reward_mean = record["reward_mean"]
            r.reward_history.append(record["reward_mean"])
            r.staleness.mean, r.staleness.max = record["staleness_mean"], record["staleness_max"]
            r.staleness.dropped = st.dropped
            for lag, n in record["staleness_histogram"].items():
                r.staleness.histogram[str(lag)] = r.staleness.histogram.get(str(lag), 0) + n
            r.clip_fraction = record["clip_fraction"]
            r.importance_weight.max = record["importance_weight_max"]
            r.importance_weight.min = record["importance_weight_min"]
            r.importance_weight.mean = record["importance_weight_mean"]
            r.proximal_seconds, r.step_seconds = record["proximal_seconds"], wall
            r.history.append(step_record)
            del r.history[:-HISTORY_LIMIT]
            r.updated_at = now
        if self.ctx.is_main and self.cfg.metrics_path is not None:
            line = step_record.model_dump(mode="json")
            line.update({k: v for k, v in record.items() if k not in line and k != "group_ids"})
            line["staleness_histogram"] = {str(k): v for k, v in record["staleness_histogram"].items()}
            line["dropped"] = st.dropped
            self.cfg.metrics_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.cfg.metrics_path, "a") as fh:
                fh.write(json.dumps(line) + "\n")
        log.info("step %d v%d reward %.3f loss %.4f staleness %.2f/%d tokens %d %.1fs (compute %.1fs)",
                 st.step, st.version, record["reward_mean"], record["loss"], record["staleness_mean"],
                 record["staleness_max"], record["tokens"], wall, record["compute_seconds"])

    async def commit(self) -> None:
        """Checkpoint (rank 0 writes), then acknowledge every group trained since the last one."""
        D.barrier(self.ctx)
        if self.ctx.is_main:
            with self._report_lock:
                self.state.report = self.report.model_dump(mode="json")
            path = save_checkpoint(self.cfg.checkpoint_dir, D.unwrap(self.model), self.optimizer, self.state)
            if self.io is not None and self.uncommitted:
                await self.io.consumer.ack(self.uncommitted)
            with self._report_lock:
                self.report.last_checkpoint = str(path)
            log.info("checkpoint %s; acknowledged %d group(s)", path, len(self.uncommitted))
        self.uncommitted = []
        self._committed_step = self.state.step
        D.barrier(self.ctx)


def _zero_loss(model: Any, device: str) -> Any:
    """A loss of exactly 0 that touches every parameter (so DDP's all-reduce sees this rank)."""
    return sum((p.sum() * 0.0 for p in model.parameters() if p.requires_grad), torch.zeros((), device=device))


def truncate_metrics(path: Path, step: int) -> None:
    """On resume: forget metrics lines of steps after the checkpoint (their updates were lost)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line).get("step", 0) <= step:
                kept.append(line)
        except ValueError:
            continue
    path.write_text("".join(k + "\n" for k in kept))
