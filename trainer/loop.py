"""The training loop, top to bottom: batch -> advantages -> proximal -> updates -> publish -> commit.

One step:
  1. rank 0 reads trajectory groups until B fresh ones are buffered (oldest first); groups past
     the staleness policy's bound (eta versions, or ROLL's asyncRatio) are dropped, counted
     (admission frees their capacity) and acknowledged (inbox.py); with `dynamicSampling` (DAPO)
     groups whose rewards are all equal are skipped the same way and reading goes on until B
     groups with signal are buffered, or `dynamicSampling.maxDraws` were drawn (then the step
     trains on the fewer it has, with a warning: `next_batch`); while it waits it checks every
     ENGINE_REFRESH_S that groups are still accepted: if none was for trainer.stallAfterSeconds
     the report names why (`stalled`: reward failures, too stale, no worker generating, ...), and
     past trainer.progressDeadlineSeconds without a step the run fails (trainer/report/stall.py);
  2. the batch is broadcast, so every rank computes the same advantages and token counts;
  3-4. the step (trainer/step/update.py, the objective from trainer/step/objectives/):
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
  5. rank 0 publishes version+1 (trainer/weights/publisher.py: weights dir, event, engines
     paused/updated/resumed, admission),
     also after a step whose updates were all skipped (same weights, next version: the groups were
     consumed, and admission's budget grows with the version); non-finite weights are never
     published: they end training (NonFiniteWeightsError), which stops every rank; an engine whose
     weight update fails is fenced and reported (weights/engine_update.py), training goes on;
  6. every K steps (and at the end) a checkpoint is written and only then are the groups trained
     since the previous checkpoint (its window) acknowledged; a resumed trainer first acknowledges
     the window of the checkpoint it resumed from, so a kill between a checkpoint and its ack
     trains nothing twice (checkpoint.py says why this holds wherever the kill lands).
The report (served at /status) and metrics.jsonl (report/metrics_file.py) are updated after each step,
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

import dataclasses
import logging
import time
from typing import Any

from asyncrl.api.spec import AsyncRLJob
from asyncrl.api.status_report import AdmissionReport, RecoveryReport, StepMetrics, TrainerReport
from asyncrl.infra.errors import TrainerError
from asyncrl.trainer import distributed as D
from asyncrl.trainer.evaluation import ENGINE_REFRESH_S, Evaluations
from asyncrl.trainer.inbox import EvalInbox, GroupInbox, StepDraw, StreamIO, eval_key, labels_of
from asyncrl.trainer.report.metrics_file import append_metrics_line, written_evaluations
from asyncrl.trainer.report.reporter import Reporter, TrackerSink
from asyncrl.trainer.report.stall import ProgressDeadlineExceeded, ProgressWatch, pipeline_counts
from asyncrl.trainer.report.step_report import report_step
from asyncrl.trainer.run_config import RunConfig
from asyncrl.trainer.state.checkpoint import (
    TrainerState,
    append_trained,
    model_identity,
    save_checkpoint,
    truncate_trained_log,
)
from asyncrl.trainer.state.timelines import start_timeline
from asyncrl.trainer.step.batch import Layout
from asyncrl.trainer.step.forward import ModelForward
from asyncrl.trainer.step.logprobs import packing_layout
from asyncrl.trainer.step.objectives import build_objective
from asyncrl.trainer.step.replay import ReplayedGroup, StepReplay
from asyncrl.trainer.step.stats import summarize_step
from asyncrl.trainer.step.update import step_data, train_updates
from asyncrl.trainer.weights.broadcast import CollectiveSync
from asyncrl.trainer.weights.files import (
    drop_versions_after,
)
from asyncrl.trainer.weights.publisher import Publisher, on_every_rank, refuse_non_finite_weights
from asyncrl.trainer.weights.watch import EngineWatch
from asyncrl.transport.admission import AdmissionSnapshot

log = logging.getLogger("asyncrl.trainer")

SUCCEEDED_REASON = "MaxStepsReached"
"""The reason of a run that reached maxSteps (the report's and the recorded outcome's)."""


class NonFiniteGradientsError(TrainerError, RuntimeError):
    """Every update of `maxNonFiniteSteps` steps in a row had a non-finite gradient norm (Failed)."""

    reason = "NonFiniteGradients"


class Trainer:
    """Owns the model, optimizer, report and (on rank 0) the stream I/O of one trainer process."""

    def __init__(self, job: AsyncRLJob, cfg: RunConfig, ctx: D.DistContext, model: Any, optimizer: Any,
                 tokenizer: Any, *, io: StreamIO | None = None, state: TrainerState | None = None,
                 report: TrainerReport | None = None, trackers: TrackerSink | None = None,
                 reference_model: Any = None):
        self.spec = job.spec  # what to train: algorithm, staleness limit, steps, checkpoint interval
        self.cfg = cfg        # what the spec does not say: paths, waits, engine protocol
        algo = self.spec.algorithm
        self.objective = build_objective(algo, reference_model=reference_model)
        self.replay = StepReplay.for_job(job)
        self.ctx = ctx
        self.model = model
        self.optimizer = optimizer
        self.tokenizer = tokenizer
        self.io = io
        self.state = state or TrainerState()
        self.state.identity = model_identity(self.spec)
        self.lineage = self.state.lineage()
        """This life's lineage (startup_sync starts its timeline): the labels the publisher and the
        engines' catch-up put on versions, and what the inbox keeps. One object, updated in place."""
        self.inbox = None if io is None else GroupInbox(
            io.consumer, io.admission, lineage=self.lineage, batch_size=self.spec.algorithm.batch_size,
            read_block_ms=cfg.read_block_ms, pending_check_s=cfg.pending_check_s, reclaim_idle_ms=cfg.reclaim_idle_ms,
            dynamic_sampling=self.spec.algorithm.dynamic_sampling is not None,
            max_draws=self.spec.algorithm.dynamic_sampling_draws)
        max_steps = self.spec.trainer.max_steps
        report = report or TrainerReport(job=job.metadata.name, max_steps=max_steps, started_at=time.time())
        report.max_steps = max_steps
        report.staleness.limit = self.spec.staleness.as_policy().version_bound
        report.staleness.policy = self.spec.staleness.policy
        report.staleness.async_ratio = self.spec.staleness.async_ratio
        self.reporter = Reporter(report)
        self.trackers = trackers if ctx.is_main else None
        self.evaluations = Evaluations(
            self._eval_inbox(io, cfg, report) if ctx.is_main else None, self.spec.evaluation, max_steps=max_steps,
            reporter=self.reporter, metrics_path=cfg.metrics_path, trackers=self.trackers)
        self.stop_requested = False
        self.progress = ProgressWatch(stall_after_s=self.spec.trainer.stall_after_seconds,
                                      deadline_s=self.spec.trainer.progress_deadline_seconds)
        """Rank 0: when a group was last accepted, and why none is (trainer/report/stall.py)."""
        self._stale_error = ""  # rank 0: the newest too-stale drop, in words (a stall quotes it)
        self._all_skipped_steps = 0  # steps in a row whose every update was skipped (a restart starts over)
        self._draw = StepDraw()  # rank 0: what it drew for this step's batch (dynamic sampling's figures)
        self._committed_step = self.state.step
        self._last_step_end = time.time()
        self.engines = EngineWatch(io, cfg, weight_sync_lag=self.spec.trainer.weight_sync_lag, reporter=self.reporter,
                                   main=ctx.is_main, lineage=self.lineage)
        self.collective = self._collective_sync() if ctx.is_main else None
        report.weight_transport = "collective" if self.collective is not None else "disk"
        self.publisher = Publisher(self.spec, cfg, ctx, model, tokenizer, io=io, collective=self.collective,
                                   reporter=self.reporter, engines=self.engines, evaluations=self.evaluations,
                                   lineage=self.lineage)
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

    def _eval_inbox(self, io: StreamIO | None, cfg: RunConfig, report: TrainerReport) -> EvalInbox | None:
        """Rank 0's reader of evaluation results, with spec.evaluation and a Redis connection."""
        if self.spec.evaluation is None or io is None:
            return None
        if io.evals is None:
            raise ValueError("spec.evaluation is set but the trainer's StreamIO has no evaluation channel "
                             "(StreamIO.evals: an asyncrl.transport.evaluation.EvalChannel)")
        # Handled by an earlier life: what its checkpoint's report holds, and the eval lines it left
        # in metrics.jsonl (those read after that checkpoint too: truncate_metrics keeps them only
        # up to the checkpoint's step, the rest are read and written anew).
        handled = [eval_key(r) for r in report.evaluations]
        if cfg.metrics_path is not None:
            handled += [eval_key(r) for r in written_evaluations(cfg.metrics_path)]
        return EvalInbox(io.evals, handled=handled)

    # ------------------------------------------------------------------ report

    def get_report(self) -> TrainerReport:
        """A snapshot for the status endpoint (called from its thread)."""
        return self.reporter.snapshot()

    def succeeded_message(self) -> str:
        return f"reached maxSteps={self.spec.trainer.max_steps}"

    def set_outcome(self, fields: dict[str, Any]) -> None:
        """Show the recorded outcome (`TrainerOutcome.report_fields()`) in the report."""
        self.reporter.set_fields(fields)

    async def refresh_engines(self, *, catch_up_engines: bool = True) -> list[Any]:
        """The registered engines, into the report, after catching up those behind this policy version."""
        return await self.engines.refresh(self.state.version, catch_up_engines=catch_up_engines)

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
        await self.engines.count_start()
        await self.startup_sync()
        await self.evaluations.request(self.state.version)  # the version this run starts from
        while self.state.step < max_steps:
            # 1-2. Batch: rank 0 reads B fresh groups, every rank gets the same list (or rank 0's
            # ProgressDeadlineExceeded, which fails every rank).
            drawn: list[Any] | ProgressDeadlineExceeded | None
            try:
                drawn = await self.next_batch() if self.ctx.is_main else None
            except ProgressDeadlineExceeded as exc:
                drawn = exc
            groups = D.broadcast_object(drawn, self.ctx)
            if isinstance(groups, ProgressDeadlineExceeded):
                raise groups
            if groups is None:  # rank 0 was asked to stop
                break
            # (algorithm.replay: objective tb, one process)
            replayed = self.replay.draw(self.state.step) if self.replay is not None else []
            # 3-4. Train: advantages, proximal, minibatch updates (identical on every rank).
            self.reporter.set_phase("Training")
            metrics = self.train_step(groups, replayed)
            self._count_skipped(metrics)  # (fails after maxNonFiniteSteps all-skipped steps in a row)
            # 5. Publish version + 1 (finite weights only); then counters, report, metrics.jsonl.
            await self.publish_next()
            self.finish_step(groups, metrics)
            # 6. Commit: checkpoint, then acknowledge what it contains.
            if self.state.step % interval == 0 or self.state.step >= max_steps:
                await self.commit()
        if self.state.step > self._committed_step:  # (same decision on every rank: commit() has barriers)
            await self.commit()
        if self.state.step >= max_steps:
            await self.evaluations.await_final(self.state.version, self.state.step,
                                               stop_requested=lambda: self.stop_requested,
                                               refresh_engines=self.refresh_engines)
            # With the reason and message the outcome record will carry (trainer/main.py records it
            # next): the operator ends the job on /status too, whichever of the two it reads first.
            self.reporter.set_phase("Succeeded", self.succeeded_message(), SUCCEEDED_REASON)
            return "Succeeded"
        self.reporter.set_phase("Stopped", f"{self.state.step} steps, policy version {self.state.version}")
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
        """Start this life's timeline (trainer/state/timelines.py); after a resume, put the engines back on
        this lineage's weights (newer ones were lost). Rank 0 decides; every rank takes part in
        writing them (a sharded model is gathered)."""
        lineage = (await start_timeline(self.cfg.checkpoint_dir, self.engines.recovery, self.state)
                   if self.ctx.is_main else None)
        lineage = D.broadcast_object(lineage, self.ctx)
        self.lineage.timeline, self.lineage.shared_until = lineage.timeline, lineage.shared_until
        self.state.set_lineage(lineage)
        with self.reporter.edit() as report:
            report.timeline = lineage.timeline
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
        drew `dynamicSampling.maxDraws` groups without B with signal trains on the fewer it has (a
        warning, counted in `dynamic_sampling_starved_steps`) rather than waiting on: a task where
        nearly every group is solved (or failed) by every sample would otherwise stall the job
        with no sign but a flat step count."""
        assert self.inbox is not None
        self._draw = StepDraw()
        fresh = self.spec.algorithm.batch_size - (self.replay.slots(self.state.step) if self.replay else 0)
        self.reporter.set_phase("Waiting", f"waiting for {fresh} trajectory groups")
        last_refresh = 0.0
        if self.stop_requested:
            return None
        await self.evaluations.poll(self.state.step)  # (each step; then every ENGINE_REFRESH_S while waiting)
        await self.check_admission()   # (each step; then every pendingCheck while waiting)
        last_check = time.monotonic()
        while True:
            self._count_ghosts(await self.inbox.drop_ghosts())
            self._count_dropped(await self.inbox.drop_stale(self.state.version))
            self._count_zero_signal(await self.inbox.skip_zero_signal())
            self.progress.kept(self.state.groups_trained + len(self.inbox.buffer))
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
                await self.evaluations.poll(self.state.step)
                await self.watch_progress()
                last_refresh = time.monotonic()
            if time.monotonic() - last_check >= self.cfg.pending_check_s:
                await self.check_admission()
                last_check = time.monotonic()
            await self.inbox.read()

    async def check_admission(self) -> None:
        """Rank 0: reconcile admission's accounting (a leak would starve producers: inbox.reconcile)
        and show the job's admission state in the report."""
        assert self.inbox is not None and self.io is not None
        check = await self.inbox.reconcile()
        self._show_admission(await self.io.admission.snapshot(), drift=check.drift - check.repaired)

    def _show_admission(self, snap: AdmissionSnapshot, drift: int | None = None) -> None:
        """The job's admission state and recovery totals into the report (`drift` None: the last check's)."""
        assert self.inbox is not None
        stats = self.inbox.consumer.stats
        with self.reporter.edit() as report:
            report.admission = AdmissionReport(accepted=snap.accepted, running=snap.running, capacity=snap.capacity,
                                               drift=report.admission.drift if drift is None else drift)
            # admission's job totals (RecoveryReport's fields among the snapshot's), this consumer's own
            report.recovery = RecoveryReport.model_validate({
                **report.recovery.model_dump(), **dataclasses.asdict(snap),
                "dead_lettered": max(snap.dead_lettered, self.inbox.dead_lettered),
                "recovered_entries": stats.recovered, "reclaimed_entries": stats.reclaimed})

    async def watch_progress(self) -> None:
        """Rank 0, while it waits: report a stall with its cause (`report.stalled`), and fail with
        ProgressDeadlineExceeded past spec.trainer.progressDeadlineSeconds without a step."""
        assert self.io is not None
        snap = await self.io.admission.snapshot()
        self._show_admission(snap)
        counts = pipeline_counts(snap, too_stale=self.state.dropped, stale_error=self._stale_error)
        with self.reporter.edit() as report:
            report.stalled = self.progress.observe(counts, running=snap.running, engines=len(report.rollout),
                                                   ready=sum(e.ready for e in report.rollout))
        overdue = self.progress.overdue()
        if overdue is not None:
            raise overdue

    def _count_dropped(self, count: int) -> None:
        if not count:
            return
        self.state.dropped += count
        self._draw.dropped += count
        with self.reporter.edit() as report:
            report.staleness.dropped = self.state.dropped
        policy = self.spec.staleness.as_policy().describe()
        self._stale_error = f"{count} group(s) past the bound ({policy}) at policy version {self.state.version}"
        log.info("dropped %d over-stale group(s) (%s)", count, policy)

    def _count_ghosts(self, count: int) -> None:
        if not count:
            return
        with self.reporter.edit() as report:
            report.recovery.ghost_groups_dropped += count
        log.warning("dropped %d group(s) generated on weights a trainer restart threw away (labelled with an "
                    "earlier timeline's version past the one this lineage resumed from)", count)

    def _count_zero_signal(self, skipped: list[Any]) -> None:
        if not skipped:
            return
        self._draw.add(skipped, skipped=True)
        with self.reporter.edit() as report:
            report.zero_signal_groups += len(skipped)
        log.info("dynamic sampling: skipped %d group(s) whose rewards were all equal (%d for this step)",
                 len(skipped), self._draw.skipped)

    def _count_starved(self) -> None:
        draw = self._draw
        draw.starved = True
        with self.reporter.edit() as report:
            report.dynamic_sampling_starved_steps += 1
        log.warning("dynamic sampling: step %d drew %d group(s) (dynamicSampling.maxDraws=%d), %d with signal: "
                    "training on the %d it has (batchSize %d); most groups get equal rewards: consider an "
                    "easier or harder dataset, or a larger groupSize", self.state.step + 1,
                    draw.skipped + draw.batch, self.spec.algorithm.dynamic_sampling_draws,
                    draw.batch - draw.batch_zero_signal, draw.batch, self.spec.algorithm.batch_size)

    def _count_skipped(self, metrics: StepMetrics) -> None:
        """Add the step's skipped updates to the running total (`skipped_updates_total` in
        metrics.jsonl); after `maxNonFiniteSteps` steps in a row whose every update was skipped the
        model is not learning any more: fail (every rank counts the same, see `train_step`)."""
        skipped, limit = metrics.skipped_updates, self.spec.trainer.max_non_finite_steps
        self.state.skipped_updates += skipped
        metrics.skipped_updates_total = self.state.skipped_updates
        self._all_skipped_steps = self._all_skipped_steps + 1 if 0 < skipped == metrics.updates else 0
        if self._all_skipped_steps >= limit:
            raise NonFiniteGradientsError(
                f"every update of the last {limit} step(s) had a non-finite gradient norm "
                f"(maxNonFiniteSteps={limit}); the weights of policy version {self.state.version} are unchanged")

    # ------------------------------------------------------------------ one update

    def train_step(self, groups: list[Any], replayed: list[ReplayedGroup] | None = None) -> StepMetrics:
        """One training step (trainer/step/update.py) on the fresh `groups` and the `replayed` ones (identical
        on every rank); returns the step's figures (rewards, tokens and staleness: of the fresh
        groups; `finish_step` adds the clock's and the draw's)."""
        algo, version = self.spec.algorithm, self.state.version
        step = step_data(groups, replayed or [], algo, self.model_forward(), version=version,
                         step=self.state.step + 1)
        updates = train_updates(step, self.objective, self.optimizer, grad_clip=algo.optimizer.grad_clip)
        metrics = summarize_step(step.stats, step.seqs[:step.fresh], groups, step=self.state.step + 1,
                                 version=version, ctx=self.ctx)
        metrics.updates, metrics.skipped_updates = updates.updates, updates.skipped
        for name, value in self.objective.figures().items():  # (each one a StepMetrics field)
            setattr(metrics, name, value)
        if self.replay is not None:  # keep what was trained fresh
            metrics.replayed_groups = len(step.replayed)
            metrics.replay = self.replay.keep(groups, [s.ref_sum for s in step.seqs[:step.fresh]],
                                              replayed=len(step.replayed))
        return metrics

    def model_forward(self) -> ModelForward:
        """How this step feeds the model (the layout is read each step: a test may set it)."""
        algo = self.spec.algorithm
        return ModelForward(model=self.model, ctx=self.ctx, layout=self.layout, pad_id=self.pad_id,
                            temperature=algo.temperature, micro_batch_tokens=algo.micro_batch_tokens,
                            checkpoint_head=self.spec.model.gradient_checkpointing)

    # ------------------------------------------------------------------ publish and commit

    async def publish_next(self) -> None:
        """Every rank: refuse non-finite weights, then `publish` version + 1 (rank 0 does the work;
        a fatal weight-sync error it sees is raised on every rank: publishing.on_every_rank)."""
        refuse_non_finite_weights(self.model, self.ctx, step=self.state.step + 1)
        await on_every_rank(self.publish(self.state.version + 1), self.ctx)

    async def publish(self, version: int, *, write: bool = True) -> None:
        """Every rank advances to `version` and publishes it (publishing.Publisher)."""
        self.state.version = version
        await self.publisher.publish(version, write=write)

    def finish_step(self, groups: list[Any], metrics: StepMetrics) -> None:
        """Advance counters, update the report and append one line to metrics.jsonl."""
        st = self.state
        st.step += 1
        st.groups_trained += len(groups)
        st.tokens_trained += metrics.tokens
        st.window_group_ids.extend(g.group_id for g in groups)
        for label in (str(x) for g in groups for x in labels_of(g)):
            st.window_labels[label] = st.window_labels.get(label, 0) + 1
        now = time.time()
        wall = max(now - self._last_step_end, 1e-9)
        self._last_step_end = now
        m = metrics
        m.step, m.policy_version, m.time, m.dropped = st.step, st.version, now, st.dropped
        m.step_seconds, m.tokens_per_second = wall, m.tokens / wall
        m.weight_sync_seconds = self.publisher.last_seconds
        self._record_zero_signal(m)
        self.progress.stepped()
        with self.reporter.edit() as r:
            m.episodes_failed = r.recovery.episode_failures
            r.stalled = None
            report_step(r, st, m, dead_lettered=self.inbox.dead_lettered if self.inbox is not None else 0)
        if self.ctx.is_main and self.cfg.metrics_path is not None:
            append_metrics_line(self.cfg.metrics_path, m)
        if self.trackers is not None:
            self.trackers.log_step(st.step, m.numbers())
        log.info("step %d v%d reward %.3f loss %.4f staleness %.2f/%d tokens %d %.1fs (compute %.1fs)",
                 st.step, st.version, m.reward_mean, m.loss, m.staleness_mean, m.staleness_max, m.tokens, wall,
                 m.compute_seconds)

    def _record_zero_signal(self, metrics: StepMetrics) -> None:
        """The step's dynamic-sampling figures, from what rank 0 drew (`next_batch`; 0 on the other
        ranks): groups skipped, the job's total, the fraction of the groups drawn that had no
        signal (with dynamicSampling off: trained at advantage 0; the figure that says whether to
        turn it on), whether the step was short (`dynamicSampling.maxDraws` reached), and the mean
        reward of every sample drawn (`reward_mean` is the trained batch's: with skipping, not the
        policy's)."""
        draw, self._draw = self._draw, StepDraw()
        m = metrics
        m.zero_signal_groups, m.dropped_step = draw.skipped, draw.dropped
        with self.reporter.reading() as report:
            m.zero_signal_groups_total = report.zero_signal_groups
        m.zero_signal_fraction, m.dynamic_sampling_starved = draw.zero_signal_fraction, int(draw.starved)
        m.reward_mean_drawn = draw.reward_sum / draw.samples if draw.samples else m.reward_mean

    # ------------------------------------------------------------------ commit

    async def commit(self) -> None:
        """Checkpoint (rank 0 writes; its window holds the groups trained since the last one), then
        acknowledge them; the next window starts. A kill at any instant in between is safe: the
        resumed trainer acknowledges the window again (`settle_restored`; checkpoint.py)."""
        D.barrier(self.ctx)
        if self.ctx.is_main:
            with self.reporter.reading() as report:
                self.state.report = report.model_dump(mode="json")
            append_trained(self.cfg.checkpoint_dir, self.state)  # (the lineage log first, fsynced)
        # every rank writes its part (rank 0's state.json completes it)
        path = save_checkpoint(self.cfg.checkpoint_dir, self.model, self.optimizer, self.state, ctx=self.ctx)
        if self.ctx.is_main:
            acked = await self.inbox.ack_trained() if self.inbox is not None else 0
            with self.reporter.edit() as report:
                report.last_checkpoint = str(path)
            log.info("checkpoint %s; acknowledged %d group(s)", path, acked)
        self.state.start_window()
        self._committed_step = self.state.step
        D.barrier(self.ctx)

