"""The training loop, top to bottom: batch -> advantages -> proximal -> updates -> publish -> commit.

One step:
  1. rank 0 reads trajectory groups until B fresh ones are buffered (oldest first); groups past
     the staleness policy's bound (eta versions, or ROLL's asyncRatio) are dropped, counted
     (admission frees their capacity) and acknowledged (inbox.py); with `dynamicSampling` (DAPO)
     groups whose rewards are all equal are skipped the same way and reading goes on until B
     groups with signal are buffered, or `dynamicSamplingMaxDraws` were drawn (then the step
     trains on the fewer it has, with a warning: `next_batch`);
  2. the batch is broadcast, so every rank computes the same advantages and token counts;
  3. proximal log-probs: `recompute` runs a no-grad forward over the batch (timed), `loglinear`
     is A-3PO's interpolation inside the loss (timed too);
  4. for each minibatch, each rank forwards/backwards its shard in micro-batches under a token
     budget (plan.py), their sequences packed where the model's attention allows (`packSequences`,
     batch.py; the log-probs come back in the padded layout the loss reads); every micro-batch
     loss is normalised by the whole minibatch's denominator over all ranks, so the gradient is
     the exact token-mean of the minibatch; DDP sums the shards;
     gradient clipping; AdamW, skipped when the gradient norm is not finite (weights and optimizer
     state untouched, counted); `maxNonFiniteSteps` steps in a row whose every update was skipped
     end training (NonFiniteGradientsError);
  5. rank 0 publishes version+1 (weights dir, event, engines paused/updated/resumed, admission),
     also after a step whose updates were all skipped (same weights, next version: the groups were
     consumed, and admission's budget grows with the version); non-finite weights are never
     published: they end training (NonFiniteWeightsError), which stops every rank; an engine whose
     weight update fails is fenced and reported (weight_sync.py), training goes on;
  6. every K steps (and at the end) a checkpoint is written and only then are the groups trained
     since the previous checkpoint (its window) acknowledged; a resumed trainer first acknowledges
     the window of the checkpoint it resumed from, so a kill between a checkpoint and its ack
     trains nothing twice (checkpoint.py says why this holds wherever the kill lands).
The report (served at /status) and metrics.jsonl (step_metrics.py) are updated after each step,
and the step's figures go to the experiment trackers (spec.logging), if any.
With spec.evaluation, rank 0 also asks the rollout workers for a held-out evaluation of the
starting version (after startup_sync), of every published version that is a multiple of
`everySteps` and of the final one (each right after it was published, step 5), reads the results
at each step and while it waits for a batch (into the report, metrics.jsonl, the trackers), and
after the last step waits (phase Evaluating) up to `finalTimeoutSeconds` for the final version's
result before the run succeeds.
How the run ends (the recorded outcome, trainer/main.py) is decided from what `run` returns or raises.
What to train comes from the validated job spec; `RunConfig` holds only what the spec does not say.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from asyncrl.errors import TrainerError
from asyncrl.runtime import Runtime
from asyncrl.spec import AsyncRLJob
from asyncrl.status_report import AdmissionReport, EngineReport, EvalRecord, ReplayReport, StepRecord, TrainerReport
from asyncrl.trainer import distributed as D
from asyncrl.trainer.batch import Layout, ModelRows, TrainBatch, build_batch, model_rows
from asyncrl.trainer.checkpoint import (
    TrainerState,
    append_trained,
    save_checkpoint,
    truncate_trained_log,
)
from asyncrl.trainer.collective_sync import CollectiveSync
from asyncrl.trainer.inbox import EvalInbox, GroupInbox, StepDraw, StreamIO, eval_key, merge_evaluations
from asyncrl.trainer.logprobs import packing_layout, token_logprobs
from asyncrl.trainer.losses import VCPO_STAT_KEYS, LossConfig, opob_advantages, policy_loss, vcpo_lr_scale
from asyncrl.trainer.plan import (
    MinibatchPlan,
    TrainSequence,
    group_sizes,
    plan_microbatches,
    plan_step,
    sequences_with_advantages,
)
from asyncrl.trainer.publish import (
    drop_versions_after,
    prune_weights,
    retained_versions,
    served_version,
    weights_path,
    write_weights,
)
from asyncrl.trainer.replay import ReplayBuffer, ReplayedGroup
from asyncrl.trainer.step_metrics import (
    StepStats,
    append_eval_line,
    append_metrics_line,
    metrics_line,
    step_figures,
    summarize_step,
    written_evaluations,
)
from asyncrl.trainer.trajectory_balance import group_log_z, sequence_sums, tb_beta, trajectory_balance_loss
from asyncrl.trainer.weight_sync import WeightSyncError, catch_up, update_engines
from asyncrl.transport.recovery import RecoveryCounters

log = logging.getLogger("asyncrl.trainer")

HISTORY_LIMIT = 500
EVAL_HISTORY_LIMIT = HISTORY_LIMIT
"""Evaluations kept in the report (one per policy version, the newest versions)."""
ENGINE_REFRESH_S = 5.0
"""While rank 0 waits (for a batch, for the final evaluation): refresh engines and read eval results this often."""
PRUNE_EVERY_S = 60.0
"""How often refresh_engines also prunes the registry of long-silent engines."""
FINAL_EVAL_POLL_S = 0.5
"""While waiting for the final evaluation, re-read the results (and check for a stop) this often."""
# Ratio and weight stats of the step shown in the report (non-finite shown as 0: /status is strict JSON).
_SHOWN_RATIO_STATS = tuple(f"{prefix}_{stat}" for prefix in ("importance_weight", "full_ratio", "behav_weight")
                           for stat in ("max", "min", "mean")) + ("behav_ess", "behav_kl")
_LOSS_SHAPE_STATS = ("clip_fraction_low", "clip_fraction_high", "bapo_clip_low", "bapo_clip_high", "vcpo_lr_scale")
"""Loss-shape figures of the last step shown in the report as they are (step_metrics.py and train_step
compute them)."""
SUCCEEDED_REASON = "MaxStepsReached"
"""The reason of a run that reached maxSteps (the report's and the recorded outcome's)."""


class NonFiniteWeightsError(TrainerError, RuntimeError):
    """The updated weights hold NaN or Inf: they are not published and training ends (Failed)."""

    reason = "NonFiniteWeights"


class NonFiniteGradientsError(TrainerError, RuntimeError):
    """Every update of `maxNonFiniteSteps` steps in a row had a non-finite gradient norm (Failed)."""

    reason = "NonFiniteGradients"


class Trackers(Protocol):
    """Experiment trackers (spec.logging; trainer/trackers.py builds them): per-step figures and
    evaluation results, by trainer step. A tracker that fails is theirs to report (trainer/trackers.py
    turns each failure into a warning); the loop calls them as they are."""

    def log_step(self, step: int, figures: dict[str, float]) -> None: ...

    def log_eval(self, step: int, record: EvalRecord) -> None: ...

    def close(self) -> None: ...


class TrainerFailed(TrainerError):
    """A fatal error that one rank (rank 0: weight sync) saw, re-raised on every other rank."""

    def __init__(self, reason: str, message: str):
        self.reason = reason
        super().__init__(message)


def failure_reason(exc: BaseException) -> str:
    """The CamelCase reason of a fatal trainer error (its `reason`, else its class name)."""
    return str(getattr(exc, "reason", "") or type(exc).__name__)


def finite_or_zero(value: float) -> float:
    """`value`, or 0.0 when it is NaN or infinite: the report is served as strict JSON (a step whose
    loss was not finite had its updates skipped; metrics.jsonl's `skipped_updates` says so)."""
    return value if math.isfinite(value) else 0.0


def non_finite_parameters(model: Any, ctx: D.DistContext | None = None, limit: int = 5) -> list[str]:
    """Names of (up to `limit`) parameters holding NaN or Inf; [] when all are finite. With a
    process group every rank calls this and gets the same verdict (a sharded model's NaN may sit
    in another rank's shard: then it is named as such).

    One fp32 sum per tensor (~20 ms for 135M parameters on one CPU core): NaN and Inf survive a sum.
    """
    params = [(n, D.local_tensor(p.detach())) for n, p in D.unwrap(model).named_parameters()]
    sums = torch.stack([p.sum(dtype=torch.float32) for _, p in params])
    bad = [] if bool(torch.isfinite(sums).all()) else \
        [n for n, p in params if not bool(torch.isfinite(p).all())][:limit]
    if ctx is not None and ctx.enabled and D.all_reduce_max([float(bool(bad))], ctx)[0] and not bad:
        return ["(in another rank's shard)"]
    return bad


@dataclass(frozen=True)
class RunConfig:
    """What the loop needs that the job spec does not say; everything about training is `job.spec`.

    Paths come from the deployment (`asyncrl.runtime.Runtime`), the waits are process settings,
    and `engine_kind` is the weight-update protocol to speak to the engines: in a deployment it is
    `spec.rollout.engine` as the runner or operator finally chose it (`from_runtime`).
    """

    engine_kind: str
    weights_dir: Path = Path("weights")
    checkpoint_dir: Path = Path("checkpoints")
    metrics_path: Path | None = None
    """metrics.jsonl (rank 0 appends one line per step); None = not written."""
    weight_sync_timeout_s: float = 120.0
    read_block_ms: int = 1000
    engine_max_age_s: float = 30.0
    """Engines whose registry heartbeat is older than this are ignored."""
    engine_prune_s: float = 3600.0
    """Registry entries (and trainer records) of engines silent this long are removed (registry.prune)."""
    pending_check_s: float = 30.0
    """How often rank 0 re-reads its own pending list and reclaims idle entries (inbox.py)."""
    reclaim_idle_ms: int = 600_000
    """Another consumer's entry idle this long is taken over (far above the longest step)."""
    engine_api_key: str | None = field(default=None, repr=False)
    """Bearer token for the engines' admin calls (their `--api-key`; Runtime.engine_api_key)."""
    weight_group_address: str = "127.0.0.1"
    """With trainer.weightTransport collective: where the engines reach rank 0 (Runtime)."""
    weight_group_port: int = 29600

    @classmethod
    def from_runtime(cls, runtime: Runtime, job: AsyncRLJob) -> RunConfig:
        return cls(engine_kind=job.spec.rollout.engine, weights_dir=Path(runtime.weights_dir),
                   checkpoint_dir=Path(runtime.checkpoint_dir),
                   metrics_path=Path(runtime.run_dir) / "metrics.jsonl", engine_api_key=runtime.engine_api_key,
                   weight_group_address=runtime.weight_group_address, weight_group_port=runtime.weight_group_port)


class Trainer:
    """Owns the model, optimizer, report and (on rank 0) the stream I/O of one trainer process."""

    def __init__(self, job: AsyncRLJob, cfg: RunConfig, ctx: D.DistContext, model: Any, optimizer: Any,
                 tokenizer: Any, *, io: StreamIO | None = None, state: TrainerState | None = None,
                 report: TrainerReport | None = None, trackers: Trackers | None = None,
                 reference_model: Any = None):
        self.spec = job.spec  # what to train: algorithm, staleness limit, steps, checkpoint interval
        self.cfg = cfg        # what the spec does not say: paths, waits, engine protocol
        algo = self.spec.algorithm
        self.trajectory_balance = algo.objective == "tb"
        # (objective tb trains with trajectory_balance.py, not policy_loss)
        self.loss_config = LossConfig() if self.trajectory_balance else LossConfig.from_spec(algo)
        if self.trajectory_balance and reference_model is None:
            raise ValueError("objective 'tb' needs the frozen reference model (reference_model)")
        self.reference_model = reference_model
        self.replay = None if algo.replay is None else ReplayBuffer(
            job=job.metadata.name, group_size=algo.group_size, capacity_per_prompt=algo.replay.capacity_per_prompt,
            capacity=algo.replay.capacity, reward_priority=algo.replay.reward_priority)
        self._replayed_total = 0
        self.ctx = ctx
        self.model = model
        self.optimizer = optimizer
        self.tokenizer = tokenizer
        self.io = io
        self.inbox = None if io is None else GroupInbox(
            io.consumer, io.admission, batch_size=self.spec.algorithm.batch_size,
            max_head_offpolicyness=self.spec.staleness.version_bound, read_block_ms=cfg.read_block_ms,
            pending_check_s=cfg.pending_check_s, reclaim_idle_ms=cfg.reclaim_idle_ms,
            dynamic_sampling=self.spec.algorithm.dynamic_sampling,
            max_draws=self.spec.algorithm.dynamic_sampling_draws, async_ratio=self.spec.staleness.async_ratio)
        self.state = state or TrainerState()
        max_steps = self.spec.trainer.max_steps
        self.report = report or TrainerReport(job=job.metadata.name, max_steps=max_steps, started_at=time.time())
        self.report.max_steps = max_steps
        self.report.staleness.limit = self.spec.staleness.version_bound
        self.report.staleness.policy = self.spec.staleness.policy
        self.report.staleness.async_ratio = self.spec.staleness.async_ratio
        self._report_lock = threading.Lock()
        self.trackers = trackers if ctx.is_main else None
        self.evals = self._eval_inbox(io, cfg) if ctx.is_main else None
        self.stop_requested = False
        self._sync_failures = 0
        self._all_skipped_steps = 0  # steps in a row whose every update was skipped (a restart starts over)
        self._draw = StepDraw()  # rank 0: what it drew for this step's batch (dynamic sampling's figures)
        self._committed_step = self.state.step
        self._last_step_end = time.time()
        self._last_prune = -math.inf
        self._incarnations: dict[str, str] = {}  # engine id -> the incarnation last seen in the registry
        self.recovery = None if io is None else RecoveryCounters(io.redis, io.admission.names)
        self.collective = self._collective_sync() if ctx.is_main else None
        self.report.weight_transport = "collective" if self.collective is not None else "disk"
        self.pad_id = tokenizer.pad_token_id if tokenizer is not None and tokenizer.pad_token_id is not None else 0
        self.layout = self._layout()

    def _layout(self) -> Layout:
        """How micro-batches are fed to the model: packed (`algorithm.packSequences`) where the
        model's attention keeps packed sequences apart, else padded (said once, in the log)."""
        if not self.spec.algorithm.pack_sequences or self.model is None:
            return "padded"
        layout = packing_layout(self.model)
        if layout == "padded" and self.ctx.is_main:
            impl = getattr(getattr(D.unwrap(self.model), "config", None), "_attn_implementation", None)
            log.warning("packSequences: attention implementation %r of %s cannot keep packed sequences "
                        "apart: micro-batches are padded", impl, type(D.unwrap(self.model)).__name__)
        return layout

    def _collective_sync(self) -> CollectiveSync | None:
        """Rank 0's side of the weight group (trainer.weightTransport: collective), else None.

        NCCL when the engines are SGLang and this process trains on a GPU (tensors go from its
        device); gloo otherwise (our hf engine; an SGLang engine takes gloo too, slower). An SGLang
        engine has one rank per tensor-parallel GPU (rollout.gpusPerReplica)."""
        if self.spec.trainer.weight_transport != "collective":
            return None
        nccl = self.cfg.engine_kind == "sglang" and self.ctx.device.startswith("cuda")
        return CollectiveSync(
            address=self.cfg.weight_group_address, port=self.cfg.weight_group_port,
            backend="nccl" if nccl else "gloo",
            engine_ranks=self.spec.rollout.gpus_per_replica if self.cfg.engine_kind == "sglang" else 1,
            timeout_s=self.cfg.weight_sync_timeout_s, device=self.ctx.device if nccl else "cpu")

    def _eval_inbox(self, io: StreamIO | None, cfg: RunConfig) -> EvalInbox | None:
        """Rank 0's reader of evaluation results, with spec.evaluation and a Redis connection."""
        if self.spec.evaluation is None or io is None:
            return None
        if io.evals is None:
            raise ValueError("spec.evaluation is set but the trainer's StreamIO has no evaluation channel "
                             "(StreamIO.evals: an asyncrl.transport.evaluation.EvalChannel)")
        # Handled by an earlier life: what its checkpoint's report holds, and the eval lines it left
        # in metrics.jsonl (those read after that checkpoint too: truncate_metrics keeps them only
        # up to the checkpoint's step, the rest are read and written anew).
        handled = [eval_key(r) for r in self.report.evaluations]
        if cfg.metrics_path is not None:
            handled += [eval_key(r) for r in written_evaluations(cfg.metrics_path)]
        return EvalInbox(io.evals, handled=handled)

    # ------------------------------------------------------------------ report

    def get_report(self) -> TrainerReport:
        """A snapshot for the status endpoint (called from its thread)."""
        with self._report_lock:
            return self.report.model_copy(deep=True)

    def _set_phase(self, phase: str, message: str = "", reason: str = "") -> None:
        with self._report_lock:
            self.report.phase = phase  # type: ignore[assignment]
            self.report.message = message
            if reason:
                self.report.reason = reason
            self.report.updated_at = time.time()

    def succeeded_message(self) -> str:
        return f"reached maxSteps={self.spec.trainer.max_steps}"

    def set_outcome(self, fields: dict[str, Any]) -> None:
        """Show the recorded outcome (`TrainerOutcome.report_fields()`) in the report."""
        with self._report_lock:
            for key, value in fields.items():
                setattr(self.report, key, value)
            self.report.updated_at = time.time()

    async def refresh_engines(self, *, catch_up_engines: bool = True) -> list[Any]:
        """The registered engines, into the report. First (catch_up_engines) load the policy version
        into engines that serve another one: they joined or restarted since the last publish, and
        the trainer is the only one that updates engine weights (weight_sync.py)."""
        if self.io is None:
            return []
        if catch_up_engines:
            try:
                served = served_version(self.state.version, self.spec.trainer.weight_sync_lag)
                resynced = await catch_up(
                    self.cfg.engine_kind, self.io.registry,
                    weights_path(self.cfg.weights_dir, served).resolve(), served,
                    max_age_s=self.cfg.engine_max_age_s, timeout_s=self.cfg.weight_sync_timeout_s,
                    api_key=self.cfg.engine_api_key)
                if resynced:
                    await self._count("engine_resyncs", len(resynced))
            except Exception as exc:  # retried at the next refresh; the next publish updates it anyway
                log.warning("engine catch-up failed: %s", exc)
        try:
            infos = await self.io.registry.list(max_age_s=self.cfg.engine_max_age_s)
            await self._count("engine_restarts", self._new_incarnations(infos))
            if time.monotonic() - self._last_prune >= PRUNE_EVERY_S:
                self._last_prune = time.monotonic()
                if pruned := await self.io.registry.prune(self.cfg.engine_prune_s):
                    log.info("engine registry: removed %d entr%s silent for %.0fs", pruned,
                             "y" if pruned == 1 else "ies", self.cfg.engine_prune_s)
        except Exception as exc:
            log.warning("engine registry unavailable: %s", exc)
            return []
        with self._report_lock:  # weight_version: the trainer's record or the worker's newer observation
            self.report.rollout = [EngineReport(url=i.url, weight_version=i.weight_version, ready=i.ready,
                                                fenced=i.fenced)
                                   for i in infos]
        return infos

    def _new_incarnations(self, infos: list[Any]) -> int:
        """How many engines came back as a new incarnation since this trainer last looked."""
        came_back = 0
        for info in infos:
            seen = self._incarnations.get(info.engine_id)
            if seen and info.incarnation and info.incarnation != seen:
                came_back += 1
                log.warning("engine %s came back as a new incarnation (%s -> %s)", info.url, seen[:8],
                            info.incarnation[:8])
            if info.incarnation:
                self._incarnations[info.engine_id] = info.incarnation
        return came_back

    async def count_start(self) -> None:
        """Rank 0, before training: one more trainer start for the job (a restart after the first)."""
        await self._count("trainer_starts", 1)

    async def _count(self, field: str, n: int) -> None:
        """Add to a job-wide recovery counter (Redis) and show all of them in the report."""
        if self.recovery is None or not self.ctx.is_main or n <= 0:
            return
        await self.recovery.add(field, n)
        counts = await self.recovery.read()
        with self._report_lock:
            self.report.trainer_restarts = max(counts.trainer_starts - 1, 0)
            self.report.engine_restarts, self.report.engine_resyncs = counts.engine_restarts, counts.engine_resyncs

    # ------------------------------------------------------------------ the loop

    async def run(self) -> str:
        """Train until max_steps (-> "Succeeded") or a stop request (-> "Stopped").

        A fatal TrainerError (non-finite weights, too many steps without a finite gradient)
        propagates on every rank; the caller records the job as Failed
        (trainer/main.py). The trackers are closed whichever way it ends."""
        try:
            return await self._run()
        finally:
            if self.trackers is not None:
                self.trackers.close()
            if self.collective is not None:  # (the engines drop theirs when they next join a group)
                await self.collective.close()

    async def _run(self) -> str:
        max_steps, interval = self.spec.trainer.max_steps, self.spec.trainer.checkpoint_interval
        await self.settle_restored()
        await self.count_start()
        await self.startup_sync()
        await self.request_evaluation(self.state.version)  # the version this run starts from
        while self.state.step < max_steps:
            # 1-2. Batch: rank 0 reads B fresh groups, every rank gets the same list.
            groups = await self.next_batch() if self.ctx.is_main else None
            groups = D.broadcast_object(groups, self.ctx)
            if groups is None:  # rank 0 was asked to stop
                break
            replayed = self.draw_replay()  # (algorithm.replay: objective tb, one process)
            # 3-4. Train: advantages, proximal, minibatch updates (identical on every rank).
            self._set_phase("Training")
            record = self.train_step(groups, replayed)
            self._count_skipped(record)  # (fails after maxNonFiniteSteps all-skipped steps in a row)
            # 5. Publish version + 1 (finite weights only); then counters, report, metrics.jsonl.
            await self.publish_next()
            self.finish_step(groups, record)
            # 6. Commit: checkpoint, then acknowledge what it contains.
            if self.state.step % interval == 0 or self.state.step >= max_steps:
                await self.commit()
        if self.state.step > self._committed_step:  # (same decision on every rank: commit() has barriers)
            await self.commit()
        if self.state.step >= max_steps:
            await self.await_final_evaluation()
            # With the reason and message the outcome record will carry (trainer/main.py records it
            # next): the operator ends the job on /status too, whichever of the two it reads first.
            self._set_phase("Succeeded", self.succeeded_message(), SUCCEEDED_REASON)
            return "Succeeded"
        self._set_phase("Stopped", f"{self.state.step} steps, policy version {self.state.version}")
        return "Stopped"

    async def settle_restored(self) -> None:
        """Make Redis agree with the checkpoint this run starts from, before anything is read.

        Rank 0 cuts the lineage log back to the checkpoint's step (later lines are a lost timeline)
        and acknowledges the checkpoint's window through the ack script: if the last life was
        killed after the checkpoint landed but before its ack, those groups are still pending and
        would otherwise be read and trained a second time. Then every rank starts a new window."""
        if self.ctx.is_main:
            truncate_trained_log(self.cfg.checkpoint_dir, self.state.step)
            if self.inbox is not None:  # every group the checkpoint trained is acknowledged from here on
                self.inbox.trained_acked = self.state.groups_trained
            if self.inbox is not None and self.state.window_group_ids:
                acked = await self.inbox.ack_restored(self.state.window_group_ids)
                if acked:
                    log.warning("acknowledged %d pending group(s) that checkpoint step %d already trained "
                                "(the last run was stopped between its checkpoint and its ack)",
                                acked, self.state.step)
        self.state.start_window()

    async def startup_sync(self) -> None:
        """After a resume, put the engines back on this lineage's weights (newer ones were lost).
        Rank 0 decides; every rank takes part in writing them (a sharded model is gathered)."""
        republish = False
        if self.ctx.is_main and self.io is not None:
            await self.io.admission.set_version(self.state.version)
            lost = drop_versions_after(self.cfg.weights_dir, self.state.version)
            # (a fresh start needs nothing: the engines serve the base model, which is version 0)
            republish = self.state.version > 0 or bool(lost)
            if republish:
                log.info("resuming at version %d (discarded newer weight dirs %s): re-publishing",
                         self.state.version, lost)
        if D.broadcast_object(republish, self.ctx):
            await self.publish(self.state.version, write=True)

    async def next_batch(self) -> list[Any] | None:
        """Rank 0: the B oldest fresh groups, or None when a stop was requested.

        With `dynamicSampling`, groups without signal are skipped and reading goes on; a step that
        drew `dynamicSamplingMaxDraws` groups without B with signal trains on the fewer it has (a
        warning, counted in `dynamic_sampling_starved_steps`) rather than waiting on: a task where
        nearly every group is solved (or failed) by every sample would otherwise stall the job
        with no sign but a flat step count."""
        assert self.inbox is not None
        self._draw = StepDraw()
        fresh = self.spec.algorithm.batch_size - self.replay_slots()
        self._set_phase("Waiting", f"waiting for {fresh} trajectory groups")
        last_refresh = 0.0
        if self.stop_requested:
            return None
        await self.poll_evaluations()  # (each step; then every ENGINE_REFRESH_S while waiting)
        await self.check_admission()   # (each step; then every pendingCheck while waiting)
        last_check = time.monotonic()
        while True:
            self._count_dropped(await self.inbox.drop_stale(self.state.version))
            self._count_zero_signal(await self.inbox.skip_zero_signal())
            starved = self.inbox.starved()
            batch = self.inbox.take_batch(fresh)
            if batch is not None:
                self._draw.add(batch, skipped=False)
                if starved:
                    self._count_starved()
                return batch
            if self.stop_requested:
                return None
            if time.monotonic() - last_refresh > ENGINE_REFRESH_S:
                await self.refresh_engines()
                await self.poll_evaluations()
                last_refresh = time.monotonic()
            if time.monotonic() - last_check >= self.cfg.pending_check_s:
                await self.check_admission()
                last_check = time.monotonic()
            await self.inbox.read()

    def _replay_rng(self, stream: int) -> np.random.Generator:
        """A generator for the step's replay draws (stream 0: the slots, 1: the groups): a function of
        the seed and the step only, so a resumed run draws the slots the lost life would have."""
        return np.random.default_rng((self.spec.seed, self.state.step, stream))

    def replay_slots(self) -> int:
        """Of the step's batchSize group slots, how many the replay buffer fills: each with probability
        1 - onPolicyProb (TBA), none while it is empty, and at least one slot left for a fresh group."""
        replay, b = self.spec.algorithm.replay, self.spec.algorithm.batch_size
        if self.replay is None or replay is None or not self.replay.prompts:
            return 0
        return min(int(self._replay_rng(0).binomial(b, 1.0 - replay.on_policy_prob)), b - 1)

    def draw_replay(self) -> list[ReplayedGroup]:
        """The groups `next_batch` left to the replay buffer (none without one): `replay_slots` again,
        the same draw (a function of the seed and the step, and the buffer is unchanged in between)."""
        slots = self.replay_slots()
        if self.replay is None or not slots:
            return []
        return self.replay.sample_groups(slots, self._replay_rng(1), now=time.time())

    async def check_admission(self) -> None:
        """Rank 0: reconcile admission's accounting (a leak would starve producers: inbox.reconcile)
        and show the job's admission state in the report."""
        assert self.inbox is not None and self.io is not None
        check = await self.inbox.reconcile()
        snap = await self.io.admission.snapshot()
        stats = self.inbox.consumer.stats
        with self._report_lock:
            self.report.recovered_entries, self.report.reclaimed_entries = stats.recovered, stats.reclaimed
            self.report.admission = AdmissionReport(
                accepted=snap.accepted, running=snap.running, capacity=snap.capacity,
                drift=check.drift - check.repaired, dead_lettered=snap.dead_lettered,
                drift_lost=snap.drift_lost, drift_found=snap.drift_found,
                leases_returned=snap.leases_returned)

    def _count_dropped(self, count: int) -> None:
        if not count:
            return
        self.state.dropped += count
        self._draw.dropped += count
        with self._report_lock:
            self.report.staleness.dropped = self.state.dropped
        s = self.spec.staleness
        log.info("dropped %d over-stale group(s) (%s)", count, f"maxHeadOffpolicyness={s.max_head_offpolicyness}"
                 if s.async_ratio is None else f"asyncRatio={s.async_ratio}, bound {s.version_bound} version(s)")

    def _count_zero_signal(self, skipped: list[Any]) -> None:
        if not skipped:
            return
        self._draw.add(skipped, skipped=True)
        with self._report_lock:
            self.report.zero_signal_groups += len(skipped)
        log.info("dynamic sampling: skipped %d group(s) whose rewards were all equal (%d for this step)",
                 len(skipped), self._draw.skipped)

    def _count_starved(self) -> None:
        draw = self._draw
        draw.starved = True
        with self._report_lock:
            self.report.dynamic_sampling_starved_steps += 1
        log.warning("dynamic sampling: step %d drew %d group(s) (dynamicSamplingMaxDraws=%d), %d with signal: "
                    "training on the %d it has (batchSize %d); most groups get equal rewards: consider an "
                    "easier or harder dataset, or a larger groupSize", self.state.step + 1,
                    draw.skipped + draw.batch, self.spec.algorithm.dynamic_sampling_draws,
                    draw.batch - draw.batch_zero_signal, draw.batch, self.spec.algorithm.batch_size)

    def _count_skipped(self, record: dict[str, Any]) -> None:
        """Add the step's skipped updates to the running total (`skipped_updates_total` in
        metrics.jsonl); after `maxNonFiniteSteps` steps in a row whose every update was skipped the
        model is not learning any more: fail (every rank counts the same, see `train_step`)."""
        skipped, limit = record["skipped_updates"], self.spec.trainer.max_non_finite_steps
        self.state.skipped_updates += skipped
        record["skipped_updates_total"] = self.state.skipped_updates
        self._all_skipped_steps = self._all_skipped_steps + 1 if 0 < skipped == record["updates"] else 0
        if self._all_skipped_steps >= limit:
            raise NonFiniteGradientsError(
                f"every update of the last {limit} step(s) had a non-finite gradient norm "
                f"(maxNonFiniteSteps={limit}); the weights of policy version {self.state.version} are unchanged")

    # ------------------------------------------------------------------ one update

    def train_step(self, groups: list[Any], replayed: list[ReplayedGroup] | None = None) -> dict[str, Any]:
        """One training step on the fresh `groups` and the `replayed` ones (identical on every rank);
        returns the step's metrics (rewards, tokens and staleness: of the fresh groups).

        An update whose gradient norm is NaN or Inf is skipped: AdamW would spread it into every
        parameter. The norm is taken after DDP's all-reduce, of gradients that are then identical on
        every rank (a NaN on one rank reaches all of them), so every rank skips the same updates."""
        algo, version = self.spec.algorithm, self.state.version
        stats = StepStats()  # (starts the step's compute clock)
        replayed = replayed or []
        trained = [*groups, *(r.group for r in replayed)]

        # Sequences and advantages: every rank computes the same from the broadcast groups.
        seqs = sequences_with_advantages(trained, algo)
        fresh = sum(len(g.samples) for g in groups)  # (the fresh groups' sequences come first)

        # Plan: minibatches of whole groups; this rank's micro-batches under the token budget.
        plans = plan_step(trained, seqs, algo, rank=self.ctx.rank, world_size=self.ctx.world_size, layout=self.layout)

        # Trajectory balance: log pi_ref of every response (the replay buffer kept the replayed ones').
        beta = tb_beta(self.state.step + 1, algo.tb_beta, algo.tb_beta_final, algo.tb_beta_anneal_steps)
        if self.trajectory_balance:
            for s, ref in zip(seqs[fresh:], (x for r in replayed for x in r.ref_sums), strict=True):
                s.ref_sum = ref
            for i, ref in self._sequence_sums(self.reference_model, seqs, list(range(fresh))).items():
                seqs[i].ref_sum = ref
        log_zs: list[float] = []
        residual_sq = 0.0

        # Proximal log-probs for `recompute`: the current weights before any update (timed).
        # (`loglinear` is computed inside policy_loss; its time is added per micro-batch.)
        t_prox = time.perf_counter()
        prox = self._recomputed_proximal(seqs, plans)
        stats.proximal_seconds += time.perf_counter() - t_prox

        # Minibatch updates: forward, loss, backward per micro-batch, then clip and step.
        skipped, lr_scales, baseline_shifts = 0, [], []
        for m, plan in enumerate(plans):
            if algo.vcpo_baseline:  # VCPO's baseline: the minibatch's advantages at the current weights
                baseline_shifts += self._vcpo_baseline(seqs, group_sizes(trained, plan.rows), plan, prox, m)
            log_z = self._log_partitions(seqs, group_sizes(trained, plan.rows), plan, beta) \
                if self.trajectory_balance else {}
            log_zs += list(log_z.values())
            self.optimizer.zero_grad(set_to_none=True)
            vcpo_sums = [0.0, 0.0, 0.0]  # VCPO: this rank's sum w, sum w^2, sequences of the minibatch
            micro_batches = plan.rank_micro_batches()
            for k, rows in enumerate(micro_batches):
                # DDP all-reduces once per update: on the last micro-batch (FSDP reduce-scatters each).
                with D.no_sync_unless(self.model, k == len(micro_batches) - 1, self.ctx):
                    if not rows:  # this rank has no sequence left in this minibatch: join the collectives
                        (self._pad_forward() * 0.0).backward()
                        continue
                    batch, fed = self._batch(seqs, rows)
                    logprobs, entropy = self._forward(batch, fed)
                    if self.trajectory_balance:
                        tb_ref, tb_rewards, tb_log_z = (logprobs.new_tensor(column) for column in zip(
                            *[(seqs[i].ref_sum, seqs[i].reward, log_z[i]) for i in rows]))
                        loss, loss_stats = trajectory_balance_loss(
                            logprobs, batch.behav_logprobs, batch.loss_mask, tb_ref, tb_rewards, tb_log_z,
                            beta=beta, denominator=plan.loss_denominator)
                        residual_sq += loss_stats["tb_residual_sq_sum"]
                    else:
                        loss, loss_stats = policy_loss(
                            logprobs, batch.behav_logprobs, batch.advantages, batch.loss_mask,
                            config=self.loss_config, versions=batch.versions, current_version=version,
                            prox_logprobs=prox.get((m, k)), loss_denominator=plan.loss_denominator)
                    # DDP averages gradients over ranks; multiplying by world makes it the exact sum.
                    (loss * self.ctx.world_size).backward()
                    stats.add_micro_batch(loss, loss_stats, entropy, batch)
                    stats.add_fed(fed.positions, sum(seqs[i].length for i in rows))
                    vcpo_sums = [a + loss_stats.get(k, 0.0) for a, k in zip(vcpo_sums, VCPO_STAT_KEYS, strict=True)]
            grad_norm = D.clip_grad_norm(self.model, algo.optimizer.grad_clip)
            stats.grad_norms.append(grad_norm)
            # VCPO: one scale from the sums of every rank (a collective on every rank, skipped update or not)
            scale = (vcpo_lr_scale(*D.all_reduce_sum(vcpo_sums, self.ctx), base_ess_ratio=algo.vcpo_base_ess_ratio,
                                   scaling=algo.vcpo_scaling) if algo.vcpo else 1.0)
            lr_scales.append(scale)
            if math.isfinite(grad_norm):
                base_lrs = [g["lr"] for g in self.optimizer.param_groups]
                for g, lr in zip(self.optimizer.param_groups, base_lrs, strict=True):
                    g["lr"] = lr * scale
                try:
                    self.optimizer.step()
                finally:  # checkpoints and the next update keep the base learning rate
                    for g, lr in zip(self.optimizer.param_groups, base_lrs, strict=True):
                        g["lr"] = lr
            else:  # (the gradients are zeroed before the next update and after the last)
                skipped += 1
                log.warning("step %d, minibatch %d/%d: gradient norm %s: update skipped (weights and optimizer "
                            "state unchanged)", self.state.step + 1, m + 1, len(plans), grad_norm)
        self.optimizer.zero_grad(set_to_none=True)

        # Metrics: means over all ranks; staleness, rewards and lengths of the fresh groups.
        record = summarize_step(stats, seqs[:fresh], groups, version, self.ctx)
        record["updates"], record["skipped_updates"] = len(plans), skipped
        if self.trajectory_balance:
            # (log Z: mean over the step's sequences of their group's; residual: root mean square)
            record.update(tb_beta=beta, tb_log_z_mean=sum(log_zs) / len(log_zs) if log_zs else 0.0,
                          tb_residual_rms=math.sqrt(residual_sq / len(seqs)) if seqs else 0.0)
        if self.replay is not None:  # keep what was trained fresh; then what the buffer holds
            for g, start in zip(groups, itertools.accumulate((len(g.samples) for g in groups), initial=0)):
                self.replay.add(g, [seqs[i].ref_sum for i in range(start, start + len(g.samples))])
            self._replayed_total += len(replayed)
            held = self.replay.stats()
            record.update(replayed_groups=len(replayed), replay_trajectories=held.trajectories,
                          replay_bytes=held.bytes)
        record["vcpo_lr_scale"] = sum(lr_scales) / len(lr_scales) if lr_scales else 1.0  # mean over updates
        if algo.vcpo_baseline:  # how far VCPO's baselines moved from the groups' plain means
            record["vcpo_baseline_shift"] = (sum(abs(x) for x in baseline_shifts) / len(baseline_shifts)
                                             if baseline_shifts else 0.0)
        return record

    def _vcpo_baseline(self, seqs: list[TrainSequence], sizes: list[int], plan: MinibatchPlan,
                       prox: dict[tuple[int, int], torch.Tensor], m: int) -> list[float]:
        """VCPO's off-policy optimal baseline for minibatch `m` (losses.opob_advantages): one
        forward and backward per trajectory gives the norm of its score gradient at the current
        weights (the loss at advantage 1, summed over its tokens, batch-dependent bounds and masks
        off) and its sequence weight; the advantages of the minibatch's sequences are replaced.
        One process only (the spec says so). Returns each group's baseline minus its mean reward."""
        norms: dict[int, float] = {}
        weights: dict[int, float] = {}
        config = dataclasses.replace(self.loss_config, aggregation="token-mean", vcpo=True, clip_bounds="fixed",
                                     m2_threshold=None)
        for k, rows in enumerate(plan.rank_micro_batches()):
            p = prox.get((m, k))  # (recompute: the step-start log-probs of this micro-batch; row r is i's)
            for r, i in enumerate(rows):  # one row at a time: a backward through a batch costs the batch
                batch, fed = self._batch(seqs, [i])
                logprobs, _ = self._forward(batch, fed, with_entropy=False)
                loss, stats = policy_loss(
                    logprobs, batch.behav_logprobs, torch.ones_like(batch.advantages), batch.loss_mask,
                    config=config, versions=batch.versions, current_version=self.state.version,
                    prox_logprobs=None if p is None else p[r:r + 1, :logprobs.shape[1]], loss_denominator=1.0)
                self.optimizer.zero_grad(set_to_none=True)
                loss.backward()
                norms[i] = float(torch.stack([q.grad.detach().double().pow(2).sum()
                                              for q in self.model.parameters() if q.grad is not None]).sum())
                weights[i] = stats["vcpo_w_sum"]
        self.optimizer.zero_grad(set_to_none=True)
        rows = plan.rows
        rewards = [seqs[i].reward for i in rows]
        advantages, baselines = opob_advantages(rewards, [norms[i] for i in rows], [weights[i] for i in rows], sizes)
        for i, a in zip(rows, advantages, strict=True):
            seqs[i].advantage = a
        it = iter(rewards)
        means = [sum(next(it) for _ in range(n)) / n for n in sizes]
        return [b - mu for b, mu in zip(baselines, means, strict=True)]

    def _recomputed_proximal(self, seqs: list[TrainSequence],
                             plans: list[MinibatchPlan]) -> dict[tuple[int, int], torch.Tensor]:
        """`recompute`: no-grad log-probs of the current weights per (minibatch, micro-batch); else none."""
        if not (self.loss_config.kind == "decoupled" and self.loss_config.proximal == "recompute"):
            return {}
        self.model.eval()
        with torch.no_grad():
            prox = {(m, k): self._forward(*self._batch(seqs, rows), with_entropy=False)[0] if rows
                    else self._pad_forward()  # (FSDP: every rank runs as many forwards)
                    for m, plan in enumerate(plans) for k, rows in enumerate(plan.rank_micro_batches())}
        self.model.train()
        return prox

    def _sequence_sums(self, model: Any, seqs: list[TrainSequence], rows: list[int]) -> dict[int, float]:
        """No-grad log pi(y|x) of each of `rows`' responses under `model` (the policy or the frozen
        reference), in micro-batches under the token budget; one process (objective tb)."""
        lengths = [seqs[i].length for i in rows]
        sums: dict[int, float] = {}
        training = model.training
        model.eval()
        with torch.no_grad():
            for micro in plan_microbatches(lengths, self.spec.algorithm.micro_batch_tokens, layout=self.layout):
                idx = [rows[j] for j in micro]
                batch, fed = self._batch(seqs, idx)
                logprobs, _ = self._forward(batch, fed, with_entropy=False, model=model)
                sums.update(zip(idx, sequence_sums(logprobs, batch.loss_mask).tolist()))
        model.train(training)
        return sums

    def _log_partitions(self, seqs: list[TrainSequence], sizes: list[int], plan: MinibatchPlan,
                        beta: float) -> dict[int, float]:
        """Trajectory balance's log Z of each sequence's group for minibatch `plan`, at the weights it
        is about to update (detached, as TBA's): a no-grad pass over the minibatch first, because a
        group's sequences may sit in different micro-batches."""
        sums = self._sequence_sums(self.model, seqs, plan.rows)
        rows = plan.rows
        return dict(zip(rows, group_log_z([sums[i] for i in rows], [seqs[i].ref_sum for i in rows],
                                          [seqs[i].reward for i in rows], sizes, beta), strict=True))

    def _pad_forward(self) -> torch.Tensor:
        """A forward (through the LM head) of one 2-token row, for a rank with no micro-batch left
        where another rank still has one: FSDP gathers parameters in every forward and reduces
        every parameter's gradient in every backward, collectives every rank must join (and DDP's
        all-reduce expects a gradient for every parameter). Scaled by 0 it changes no gradient."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.ctx.device)
        return token_logprobs(self.model, ids, torch.ones_like(ids), self.spec.algorithm.temperature,
                              mask=torch.ones((1, 1), dtype=torch.bool, device=self.ctx.device),
                              with_entropy=False)[0].sum()

    def _batch(self, seqs: list[TrainSequence], rows: list[int]) -> tuple[TrainBatch, ModelRows]:
        """The micro-batch's padded tensors (what the loss reads) and the rows the model is fed (laid
        out on the host: packing is a few slice copies per sequence)."""
        batch = build_batch([seqs[i] for i in rows], self.pad_id, advantages=[seqs[i].advantage for i in rows])
        return batch.to(self.ctx.device), model_rows(batch, self.layout, self.pad_id).to(self.ctx.device)

    def _forward(self, batch: TrainBatch, fed: ModelRows, *, with_entropy: bool = True,
                 model: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs (with grad when enabled) and entropy, at the sampling temperature,
        in the batch's padded layout whatever rows the model was fed.

        With `model.gradientCheckpointing` the LM head's chunk logits are recomputed in backward
        too: with the decoder's activations checkpointed they are the largest activation left."""
        return token_logprobs(self.model if model is None else model, batch.input_ids, batch.attention_mask,
                              self.spec.algorithm.temperature, mask=batch.loss_mask, with_entropy=with_entropy,
                              checkpoint_head=self.spec.model.gradient_checkpointing, rows=fed)

    # ------------------------------------------------------------------ publish and commit

    async def publish_next(self) -> None:
        """Every rank: refuse non-finite weights, then `publish` version + 1 (rank 0 does the work).

        The weights are identical on every rank after the update, so every rank takes the same
        decision on them; a fatal weight-sync error only rank 0 sees is broadcast, so no rank is
        left waiting in a collective for a rank that stopped training."""
        bad = non_finite_parameters(self.model, self.ctx)
        if bad:
            raise NonFiniteWeightsError(
                f"non-finite weights after step {self.state.step + 1} (not published): {', '.join(bad)}")
        if not self.ctx.enabled:
            await self.publish(self.state.version + 1)
            return
        failure: TrainerError | None = None
        try:
            await self.publish(self.state.version + 1)
        except TrainerError as exc:  # (only rank 0 publishes)
            failure = exc
        verdict = D.broadcast_object(None if failure is None else (failure_reason(failure), str(failure)), self.ctx)
        if failure is not None:
            raise failure
        if verdict is not None:
            raise TrainerFailed(*verdict)

    async def publish(self, version: int, *, write: bool = True) -> None:
        """Every rank: weights/v{version} (a sharded model is gathered: every rank takes part, rank 0
        writes); then rank 0: version event, engines updated, admission told. All ranks advance."""
        self.state.version = version
        self._set_phase("Publishing", f"publishing version {version}")
        from asyncrl.models import torch_dtype
        from asyncrl.transport.versions import VersionEvent

        t0 = time.perf_counter()
        path = weights_path(self.cfg.weights_dir, version)
        if write:
            write_weights(self.model, self.tokenizer, self.cfg.weights_dir, version,
                          dtype=torch_dtype(self.spec.model.dtype), ctx=self.ctx)
        if not self.ctx.is_main:
            return
        lag = self.spec.trainer.weight_sync_lag
        served = served_version(version, lag)  # (trainer.weightSyncLag: the engines load an older version)
        served_path = weights_path(self.cfg.weights_dir, served)
        sync_error = None
        engines = []
        if self.io is not None:
            await self.io.versions.publish(VersionEvent(version=version, weights_path=str(path.resolve()),
                                                        time=time.time()))
            engines = await self.io.registry.list(max_age_s=self.cfg.engine_max_age_s)
            if engines and (served == version or served_path.is_dir()):  # (lagged v0: the base model)
                try:
                    await update_engines(self.cfg.engine_kind, engines, served_path.resolve(), served,
                                         registry=self.io.registry, timeout_s=self.cfg.weight_sync_timeout_s,
                                         api_key=self.cfg.engine_api_key, collective=self.collective)
                except WeightSyncError as exc:  # the failing engines are fenced: training goes on
                    self._sync_failures += 1
                    sync_error = str(exc)
                    log.error("%s; fenced %s (retried by catch-up; %d failed sync(s) in this run)",
                              exc, ", ".join(exc.fenced) or "none", self._sync_failures)
            await self.io.admission.set_version(version)
            engines = await self.refresh_engines(catch_up_engines=False)  # failed ones: at the next refresh
            ready = [e for e in engines if e.ready]
            if ready and all(e.fenced for e in ready):  # waits (no crash loop) and says so
                sync_error = (f"all {len(ready)} ready engine(s) are fenced after failed weight updates; "
                              f"rollout waits until catch-up loads version {served} into one: "
                              + "; ".join(f"{e.url}: {e.fenced}" for e in ready))
                log.error("%s", sync_error)
        keep = {e.weight_version for e in engines} - {None}  # versions engines still serve
        prune_weights(self.cfg.weights_dir, keep | retained_versions(version, lag), newest=version)
        seconds = time.perf_counter() - t0
        with self._report_lock:
            self.report.policy_version = version
            self.report.weight_sync_seconds = seconds
            if self.collective is not None:
                self.report.weight_sync_disk_fallbacks = self.collective.stats.disk_fallbacks
            if sync_error:
                self.report.message = sync_error
        if self._evaluation_due(version):  # (its weights are out: the engines serve it, or catch up)
            await self.request_evaluation(version)

    def finish_step(self, groups: list[Any], record: dict[str, Any]) -> None:
        """Advance counters, update the report and append one line to metrics.jsonl."""
        st = self.state
        st.step += 1
        st.groups_trained += len(groups)
        st.tokens_trained += record["tokens"]
        st.window_group_ids.extend(record["group_ids"])
        now = time.time()
        wall = max(now - self._last_step_end, 1e-9)
        self._last_step_end = now
        shown = {k: finite_or_zero(record[k]) for k in ("loss", "clip_fraction", *_SHOWN_RATIO_STATS)}
        self._record_zero_signal(record)
        step_record = StepRecord(step=st.step, policy_version=st.version, reward_mean=record["reward_mean"],
                                 staleness_mean=record["staleness_mean"], staleness_max=record["staleness_max"],
                                 loss=shown["loss"], clip_fraction=shown["clip_fraction"],
                                 tokens=record["tokens"], step_seconds=wall,
                                 proximal_seconds=record["proximal_seconds"], time=now,
                                 zero_signal_groups=record["zero_signal_groups"])
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
            r.staleness.dropped, r.staleness.dropped_last_step = st.dropped, record["dropped_step"]
            for lag, n in record["staleness_histogram"].items():
                r.staleness.histogram[str(lag)] = r.staleness.histogram.get(str(lag), 0) + n
            r.clip_fraction = shown["clip_fraction"]
            for key in _LOSS_SHAPE_STATS:  # (clipped tokens by side; BAPO's adapted bounds, 0 when off; VCPO's scale)
                setattr(r, key, finite_or_zero(record.get(key, 0.0)))
            r.tb_beta = record.get("tb_beta")
            if self.replay is not None:
                held = self.replay.stats()
                r.replay = ReplayReport(trajectories=held.trajectories, prompts=held.prompts, bytes=held.bytes,
                                        capacity=held.capacity, replayed_groups=self._replayed_total)
            for target, prefix in ((r.importance_weight, "importance_weight"),
                                   (r.behaviour.full_ratio, "full_ratio"), (r.behaviour.weight, "behav_weight")):
                for stat in ("max", "min", "mean"):
                    setattr(target, stat, shown[f"{prefix}_{stat}"])
            r.behaviour.ess, r.behaviour.kl = shown["behav_ess"], shown["behav_kl"]
            r.skipped_updates = st.skipped_updates
            r.zero_signal_fraction = record["zero_signal_fraction"]
            r.dead_lettered = self.inbox.dead_lettered if self.inbox is not None else 0
            r.proximal_seconds, r.step_seconds = record["proximal_seconds"], wall
            r.history.append(step_record)
            del r.history[:-HISTORY_LIMIT]
            r.updated_at = now
        if self.ctx.is_main and self.cfg.metrics_path is not None:
            line = append_metrics_line(self.cfg.metrics_path, step_record, record, dropped=st.dropped)
        else:
            line = metrics_line(step_record, record, dropped=st.dropped)
        if self.trackers is not None:
            self.trackers.log_step(st.step, step_figures(line))
        log.info("step %d v%d reward %.3f loss %.4f staleness %.2f/%d tokens %d %.1fs (compute %.1fs)",
                 st.step, st.version, record["reward_mean"], record["loss"], record["staleness_mean"],
                 record["staleness_max"], record["tokens"], wall, record["compute_seconds"])

    def _record_zero_signal(self, record: dict[str, Any]) -> None:
        """The step's dynamic-sampling figures, from what rank 0 drew (`next_batch`; 0 on the other
        ranks): groups skipped, the job's total, the fraction of the groups drawn that had no
        signal (with dynamicSampling off: trained at advantage 0; the figure that says whether to
        turn it on), whether the step was short (`dynamicSamplingMaxDraws` reached), and the mean
        reward of every sample drawn (`reward_mean` is the trained batch's: with skipping, not the
        policy's)."""
        draw, self._draw = self._draw, StepDraw()
        record["zero_signal_groups"] = draw.skipped
        record["dropped_step"] = draw.dropped
        with self._report_lock:
            record["zero_signal_groups_total"] = self.report.zero_signal_groups
        record["zero_signal_fraction"] = draw.zero_signal_fraction
        record["dynamic_sampling_starved"] = int(draw.starved)
        record["reward_mean_drawn"] = draw.reward_sum / draw.samples if draw.samples else record["reward_mean"]

    # ------------------------------------------------------------------ evaluation (spec.evaluation)

    def _evaluation_due(self, version: int) -> bool:
        """Versions 0, N, 2N, ... (N = evaluation.everySteps) and the final one are evaluated."""
        evaluation = self.spec.evaluation
        return evaluation is not None and (version % evaluation.every_steps == 0
                                           or version >= self.spec.trainer.max_steps)

    async def request_evaluation(self, version: int) -> None:
        """Rank 0: ask the rollout workers to evaluate `version` (already published); asking twice is a no-op."""
        if self.evals is not None and await self.evals.request(version):
            log.info("asked for a held-out evaluation of policy version %d", version)

    async def poll_evaluations(self) -> list[EvalRecord]:
        """Rank 0: read the results that arrived into the report; each new one also goes to
        metrics.jsonl, the log and the trackers (at the current step). Returns the new ones."""
        if self.evals is None:
            return []
        read, new = await self.evals.read()
        if not read:
            return []
        with self._report_lock:
            self.report.evaluations = merge_evaluations(self.report.evaluations, read, EVAL_HISTORY_LIMIT)
            self.report.updated_at = time.time()
        step = self.state.step
        for r in new:
            if self.cfg.metrics_path is not None:
                append_eval_line(self.cfg.metrics_path, step, r)
            pass_at_k = f" pass@{r.k} {r.pass_at_k:.3f}" if r.pass_at_k is not None else ""
            log.info("eval v%d (step %d): reward %.3f pass@1 %.3f%s, %d prompts x %d, %.0f%% on version, "
                     "%.1fs on %s", r.policy_version, step, r.reward_mean, r.pass_at_1, pass_at_k, r.prompts, r.k,
                     100 * r.on_version, r.seconds, r.engine_id or "?")
            if self.trackers is not None:
                self.trackers.log_eval(step, r)
        return new

    def _evaluated(self, version: int) -> bool:
        with self._report_lock:
            return any(r.policy_version == version for r in self.report.evaluations)

    async def await_final_evaluation(self) -> None:
        """Rank 0, after the last step: wait (phase Evaluating) until the final version's result
        arrives, `finalTimeoutSeconds` pass (a warning: the job still succeeds) or a stop is asked."""
        if self.evals is None or self.spec.evaluation is None:
            return
        version, timeout = self.state.version, self.spec.evaluation.final_timeout_seconds
        await self.request_evaluation(version)  # (asked at its publish already, unless that life was cut short)
        await self.poll_evaluations()
        if self._evaluated(version):
            return
        if timeout <= 0:
            log.info("not waiting for the evaluation of the final policy version %d (finalTimeoutSeconds=0)",
                     version)
            return
        self._set_phase("Evaluating", f"waiting up to {timeout}s for the held-out evaluation of the final "
                                      f"policy version {version}")
        log.info("waiting up to %ds for the held-out evaluation of the final policy version %d", timeout, version)
        deadline = time.monotonic() + timeout
        last_refresh = time.monotonic()
        while not self._evaluated(version):
            if self.stop_requested:
                log.warning("stop requested: not waiting any longer for the evaluation of policy version %d",
                            version)
                return
            left = deadline - time.monotonic()
            if left <= 0:
                log.warning("no held-out evaluation of the final policy version %d after %ds "
                            "(evaluation.finalTimeoutSeconds); finishing without it", version, timeout)
                return
            await asyncio.sleep(min(FINAL_EVAL_POLL_S, left))
            if time.monotonic() - last_refresh > ENGINE_REFRESH_S:  # (an engine behind catches up to it)
                await self.refresh_engines()
                last_refresh = time.monotonic()
            await self.poll_evaluations()
        log.info("final policy version %d evaluated", version)

    async def commit(self) -> None:
        """Checkpoint (rank 0 writes; its window holds the groups trained since the last one), then
        acknowledge them; the next window starts. A kill at any instant in between is safe: the
        resumed trainer acknowledges the window again (`settle_restored`; checkpoint.py)."""
        D.barrier(self.ctx)
        if self.ctx.is_main:
            with self._report_lock:
                self.state.report = self.report.model_dump(mode="json")
            append_trained(self.cfg.checkpoint_dir, self.state)  # (the lineage log first, fsynced)
        # every rank writes its part (rank 0's state.json completes it)
        path = save_checkpoint(self.cfg.checkpoint_dir, self.model, self.optimizer, self.state, ctx=self.ctx)
        if self.ctx.is_main:
            acked = await self.inbox.ack_trained() if self.inbox is not None else 0
            with self._report_lock:
                self.report.last_checkpoint = str(path)
            log.info("checkpoint %s; acknowledged %d group(s)", path, acked)
        self.state.start_window()
        self._committed_step = self.state.step
        D.barrier(self.ctx)

