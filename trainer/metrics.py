"""Prometheus figures of the trainer, derived from its TrainerReport.

The report is the single source of truth (the trainer writes it, `/status` serves it), so the
metrics are refreshed from it at scrape time instead of being updated from inside the training
loop: nothing can drift between `/status` and `/metrics`. Everything lives in a dedicated
CollectorRegistry so several apps (tests, an embedded server) never clash in the global registry.

Degraded (an outage being waited out, the report's `degraded`) is exported as
`asyncrl_trainer_degraded{dependency}` 0/1 and `asyncrl_trainer_outage_seconds{dependency}`, with
a series for each known dependency (redis, engine) even when healthy: an alert on `== 1` or on the
outage's length then needs no `absent()` and never mistakes "no series" for "no outage".

The newest held-out evaluation (spec.evaluation; the report's `evaluations`, newest version last) is
exported as `asyncrl_eval_reward`, `asyncrl_eval_pass_at_1`, `asyncrl_eval_policy_version` (NaN
before the first result) and `asyncrl_eval_pass_at_k{k}` (only when k = samplesPerPrompt > 1).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Enum, Gauge, Histogram, Info
from prometheus_client.core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from asyncrl.status_report import DegradedReport, EvalRecord, StepRecord, TrainerReport

PREFIX = "asyncrl_trainer"
PHASES = ["Starting", "Waiting", "Training", "Publishing", "Evaluating", "Succeeded", "Failed", "Stopped"]
STEP_SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300, 600, math.inf)
DEPENDENCIES = ("redis", "engine")
"""Dependencies whose Degraded series always exist (others appear while they are down)."""
SYNC_SECONDS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, math.inf)
EVAL_PREFIX = "asyncrl_eval"


class _StalenessHistogram(Collector):
    """Exposes the report's cumulative lag -> token-count table as a Prometheus histogram.

    prometheus_client's Histogram observes one value at a time; a step trains thousands of tokens,
    so the (already cumulative) table from the report is rendered directly as buckets instead.
    """

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._limit = 0

    def set(self, histogram: dict[str, int], limit: int) -> None:
        counts: dict[int, int] = {}
        for key, value in histogram.items():
            try:
                counts[int(key)] = counts.get(int(key), 0) + int(value)
            except ValueError:
                continue  # a malformed key never breaks the scrape
        self._counts = counts
        self._limit = max(0, int(limit))

    def describe(self) -> Iterable[Metric]:
        return []  # dynamic buckets: let the registry call collect() lazily

    def collect(self) -> Iterator[Metric]:
        counts = dict(self._counts)
        top = max([self._limit, *counts.keys()]) if counts else self._limit
        buckets: list[tuple[str, float]] = []
        running = 0
        for lag in range(0, top + 1):
            running += counts.get(lag, 0)
            buckets.append((str(float(lag)), running))
        buckets.append(("+Inf", sum(counts.values())))
        total = sum(lag * n for lag, n in counts.items())
        yield HistogramMetricFamily(
            f"{PREFIX}_token_staleness",
            "Tokens trained by version lag (policy version minus the version that generated them).",
            buckets=buckets,
            sum_value=total,
        )


class TrainerMetrics:
    """All trainer metrics in one registry; `update(report)` makes them match the report."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry

        def gauge(name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
            return Gauge(f"{PREFIX}_{name}", doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(f"{PREFIX}_{name}", doc, buckets=buckets, registry=r)

        self._lock = threading.Lock()
        self._last_step_seen = -1
        self._groups_seen = 0
        self._tokens_seen = 0
        self._dropped_seen = 0
        self._zero_signal_seen = 0
        self._starved_seen = 0
        self._skipped_seen = 0
        self._dead_seen = 0
        self._drift_seen = {"lost": 0, "found": 0}
        self._leases_returned_seen = 0
        self._recovered_seen = 0
        self._reclaimed_seen = 0
        self._restarts_seen = {"trainer": 0, "engine": 0}
        self._resyncs_seen = 0

        self.info = Info(f"{PREFIX}_job", "The job this trainer runs.", registry=r)
        self.phase = Enum(f"{PREFIX}_phase", "Trainer phase.", states=PHASES, registry=r)
        self.step = gauge("step", "Optimizer steps done.")
        self.max_steps = gauge("max_steps", "Steps the job will run (0: unbounded).")
        self.policy_version = gauge("policy_version", "Version of the latest published weights.")
        self.groups = Counter(f"{PREFIX}_groups_trained", "Trajectory groups trained.", registry=r)
        self.tokens = Counter(f"{PREFIX}_tokens_trained", "Response tokens trained.", registry=r)
        self.tokens_per_second = gauge("tokens_per_second", "Trained tokens per second (recent).")
        self.reward = gauge("reward_mean", "Mean reward of the last step's batch (NaN before the first).")
        self.loss = gauge("loss", "Policy loss of the last step.")
        self.staleness_mean = gauge("staleness_mean", "Mean version lag of the last step's tokens.")
        self.staleness_max = gauge("staleness_max", "Largest version lag in the last step.")
        self.staleness_limit = gauge("staleness_limit", "Version bound (eta, or ceil(alpha) for the per-sample "
                                     "policy): groups older than this are dropped.")
        self.async_ratio = gauge("staleness_async_ratio", "ROLL's asynchronous ratio alpha (per-sample policy; "
                                 "NaN under global-budget).")
        self.dropped = Counter(f"{PREFIX}_stale_groups_dropped", "Groups dropped as too stale (by either "
                               "policy's bound; their admission capacity is given back).", registry=r)
        self.dropped_last_step = gauge("stale_groups_dropped_last_step", "Groups dropped as too stale while the "
                                       "last step's batch was read.")
        self.zero_signal = Counter(f"{PREFIX}_zero_signal_groups_skipped", "Groups skipped by dynamic sampling: "
                                   "their rewards were all equal (no signal).", registry=r)
        self.zero_signal_fraction = gauge("zero_signal_fraction", "Fraction of the groups drawn for the last step "
                                          "whose rewards were all equal.")
        self.starved_steps = Counter(f"{PREFIX}_dynamic_sampling_starved_steps", "Steps that trained fewer than "
                                     "batchSize groups after dynamicSamplingMaxDraws draws.", registry=r)
        self.staleness_histogram = _StalenessHistogram()
        r.register(self.staleness_histogram)
        self.clip_fraction = gauge("clip_fraction", "Fraction of tokens clipped in the last step.")
        self.clip_fraction_side = gauge("clip_fraction_by_side", "Fraction of tokens clipped in the last step at "
                                        "the lower (A < 0) or upper (A > 0) ratio bound.", ["side"])
        self.bapo_bound = gauge("bapo_clip_bound", "BAPO's adapted ratio bound of the last step "
                                "(algorithm.clipBounds bapo; 0 when off).", ["side"])
        self.vcpo_lr_scale = gauge("vcpo_lr_scale", "VCPO's learning-rate scale in the last step "
                                   "(algorithm.vcpo; 1 when off).")
        self.tb_beta = gauge("tb_beta", "Trajectory balance's reward temperature in the last step (objective tb; "
                             "NaN otherwise).")
        self.replay_trajectories = gauge("replay_trajectories", "Trajectories in TBA's replay buffer "
                                         "(algorithm.replay; 0 without one).")
        self.replay_bytes = gauge("replay_bytes", "Host memory held by the replay buffer's trajectories.")
        self.replayed_groups = gauge("replayed_groups", "Groups trained from the replay buffer in this "
                                     "trainer's life.")
        self.importance_weight = gauge("importance_weight", "Trust-region ratio u = pi/pi_prox of the last step.",
                                       ["stat"])
        self.full_ratio = gauge("full_ratio", "Stale ratio pi/pi_behav of the last step.", ["stat"])
        self.behaviour_weight = gauge("behaviour_weight", "Behaviour weight w = pi_prox/pi_behav of the last step.",
                                      ["stat"])
        self.behaviour_ess = gauge("behaviour_ess", "Effective sample size of w (fraction) in the last step.")
        self.behaviour_kl = gauge("behaviour_kl", "Approximate KL(pi_behav || pi) per token in the last step.")
        self.skipped_updates = Counter(f"{PREFIX}_skipped_updates", "Updates skipped for a non-finite gradient.",
                                       registry=r)
        self.dead_lettered = Counter(f"{PREFIX}_dead_lettered_groups", "Groups moved to the dead-letter stream.",
                                     registry=r)
        self.admission = gauge("admission_groups", "The job's admission state: accepted groups, running "
                               "leases, free capacity, unrepaired drift.", ["figure"])
        self.drift_repaired = Counter(f"{PREFIX}_admission_drift_repaired_groups", "Groups admission's "
                                      "reconciliation took out of (lost) or added to (found) 'accepted'.",
                                      ["direction"], registry=r)
        self.recovered = Counter(f"{PREFIX}_recovered_entries", "Stream entries re-read from the trainer's own "
                                 "pending list (a lost read reply).", registry=r)
        self.reclaimed = Counter(f"{PREFIX}_reclaimed_entries", "Stream entries taken over from a dead "
                                 "consumer's pending list.", registry=r)
        self.restarts = Counter(f"{PREFIX}_restarts", "Restarts seen in the job: the trainer's own, and rollout "
                                "engines coming back as a new incarnation.", ["component"], registry=r)
        self.engine_resyncs = Counter(f"{PREFIX}_engine_resyncs", "Engines the trainer's catch-up loaded with "
                                      "the current weights.", registry=r)
        self.leases_returned = Counter(f"{PREFIX}_admission_leases_returned", "Leases of dead rollout workers "
                                       "returned by their replacements.", registry=r)
        self.proximal_seconds = gauge("proximal_seconds", "Proximal logprob time of the last step.")
        self.step_seconds = gauge("step_seconds", "Wall time of the last step.")
        self.weight_sync_seconds = gauge("weight_sync_seconds", "Weight publish+sync time of the last step.")
        self.step_duration = histogram("step_duration_seconds", "Wall time per step.", STEP_SECONDS_BUCKETS)
        self.proximal_duration = histogram("proximal_duration_seconds", "Proximal logprob time per step.",
                                           STEP_SECONDS_BUCKETS)
        self.weight_sync_duration = histogram("weight_sync_duration_seconds", "Weight sync time per step.",
                                              SYNC_SECONDS_BUCKETS)
        self.engine_version = gauge("engine_weight_version", "Weight version each rollout engine serves (-1: unknown).",
                                    ["engine"])
        self.engine_ready = gauge("engine_ready", "1 when the rollout engine is ready.", ["engine"])
        self.engine_lag = gauge("engine_version_lag", "Policy version minus the engine's weight version.", ["engine"])
        self.updated = gauge("report_updated_timestamp_seconds", "When the trainer last updated its report.")
        self.degraded = gauge("degraded", "1 while the trainer waits out an outage of this dependency (Degraded).",
                              ["dependency"])
        self.outage_seconds = gauge("outage_seconds", "How long the current outage of this dependency has lasted "
                                    "(0: reachable).", ["dependency"])
        self.eval_reward = Gauge(f"{EVAL_PREFIX}_reward", "Mean reward of the newest held-out evaluation.",
                                 registry=r)
        self.eval_pass_at_1 = Gauge(f"{EVAL_PREFIX}_pass_at_1", "pass@1 of the newest held-out evaluation.",
                                    registry=r)
        self.eval_pass_at_k = Gauge(f"{EVAL_PREFIX}_pass_at_k", "pass@k of the newest held-out evaluation "
                                    "(k = evaluation.samplesPerPrompt, only when > 1).", ["k"], registry=r)
        self.eval_policy_version = Gauge(f"{EVAL_PREFIX}_policy_version",
                                         "Policy version of the newest held-out evaluation.", registry=r)

    def update(self, report: TrainerReport) -> None:
        """Bring every metric in line with `report` (idempotent; call before each scrape)."""
        with self._lock:
            self.info.info({"job": report.job})
            self.phase.state(report.phase)
            self.step.set(report.step)
            self.max_steps.set(report.max_steps)
            self.policy_version.set(report.policy_version)
            self._groups_seen = _advance(self.groups, self._groups_seen, report.groups_trained)
            self._tokens_seen = _advance(self.tokens, self._tokens_seen, report.tokens_trained)
            self._dropped_seen = _advance(self.dropped, self._dropped_seen, report.staleness.dropped)
            self._zero_signal_seen = _advance(self.zero_signal, self._zero_signal_seen, report.zero_signal_groups)
            self._starved_seen = _advance(self.starved_steps, self._starved_seen,
                                          report.dynamic_sampling_starved_steps)
            self.zero_signal_fraction.set(report.zero_signal_fraction)
            self.tokens_per_second.set(report.tokens_per_second)
            self.reward.set(math.nan if report.reward_mean is None else report.reward_mean)
            self.staleness_mean.set(report.staleness.mean)
            self.staleness_max.set(report.staleness.max)
            self.staleness_limit.set(report.staleness.limit)
            ratio = report.staleness.async_ratio
            self.async_ratio.set(math.nan if ratio is None else ratio)
            self.dropped_last_step.set(report.staleness.dropped_last_step)
            self.staleness_histogram.set(report.staleness.histogram, report.staleness.limit)
            self.clip_fraction.set(report.clip_fraction)
            for side in ("low", "high"):
                self.clip_fraction_side.labels(side=side).set(getattr(report, f"clip_fraction_{side}"))
                self.bapo_bound.labels(side=side).set(getattr(report, f"bapo_clip_{side}"))
            self.vcpo_lr_scale.set(report.vcpo_lr_scale)
            self.tb_beta.set(math.nan if report.tb_beta is None else report.tb_beta)
            replay = report.replay
            self.replay_trajectories.set(replay.trajectories if replay else 0)
            self.replay_bytes.set(replay.bytes if replay else 0)
            self.replayed_groups.set(replay.replayed_groups if replay else 0)
            for gauge_, source in ((self.importance_weight, report.importance_weight),
                                   (self.full_ratio, report.behaviour.full_ratio),
                                   (self.behaviour_weight, report.behaviour.weight)):
                for stat in ("max", "min", "mean"):
                    gauge_.labels(stat=stat).set(getattr(source, stat))
            self.behaviour_ess.set(report.behaviour.ess)
            self.behaviour_kl.set(report.behaviour.kl)
            self._skipped_seen = _advance(self.skipped_updates, self._skipped_seen, report.skipped_updates)
            self._dead_seen = _advance(self.dead_lettered, self._dead_seen, report.dead_lettered)
            self._set_admission(report)
            self.proximal_seconds.set(report.proximal_seconds)
            self.step_seconds.set(report.step_seconds)
            self.weight_sync_seconds.set(report.weight_sync_seconds)
            if report.history:
                self.loss.set(report.history[-1].loss)
            for record in report.history:
                self._observe_step(record)
            self._set_engines(report)
            self._set_degraded(report.degraded)
            self._set_evaluation(report.evaluations[-1] if report.evaluations else None)
            self.updated.set(report.updated_at)

    def _set_admission(self, report: TrainerReport) -> None:
        a = report.admission
        for figure in ("accepted", "running", "capacity", "drift"):
            self.admission.labels(figure=figure).set(getattr(a, figure))
        for direction, total in (("lost", a.drift_lost), ("found", a.drift_found)):
            self._drift_seen[direction] = _advance(self.drift_repaired.labels(direction=direction),
                                                   self._drift_seen[direction], total)
        self._leases_returned_seen = _advance(self.leases_returned, self._leases_returned_seen, a.leases_returned)
        self._recovered_seen = _advance(self.recovered, self._recovered_seen, report.recovered_entries)
        self._reclaimed_seen = _advance(self.reclaimed, self._reclaimed_seen, report.reclaimed_entries)
        for component, total in (("trainer", report.trainer_restarts), ("engine", report.engine_restarts)):
            self._restarts_seen[component] = _advance(self.restarts.labels(component=component),
                                                      self._restarts_seen[component], total)
        self._resyncs_seen = _advance(self.engine_resyncs, self._resyncs_seen, report.engine_resyncs)

    def observe_step(self, record: StepRecord) -> None:
        """Record one finished step's durations (steps already seen are ignored)."""
        with self._lock:
            self._observe_step(record)

    def _observe_step(self, record: StepRecord) -> None:
        if record.step <= self._last_step_seen:
            return
        self._last_step_seen = record.step
        self.step_duration.observe(record.step_seconds)
        self.proximal_duration.observe(record.proximal_seconds)
        self.weight_sync_duration.observe(record.weight_sync_seconds)

    def _set_engines(self, report: TrainerReport) -> None:
        # Engines come and go (scale-down, restart with a new URL): drop series of vanished ones.
        for gauge in (self.engine_version, self.engine_ready, self.engine_lag):
            gauge.clear()
        for engine in report.rollout:
            version = -1 if engine.weight_version is None else engine.weight_version
            self.engine_version.labels(engine=engine.url).set(version)
            self.engine_ready.labels(engine=engine.url).set(1 if engine.ready else 0)
            if engine.weight_version is not None:
                self.engine_lag.labels(engine=engine.url).set(report.policy_version - engine.weight_version)


    def _set_evaluation(self, newest: EvalRecord | None) -> None:
        self.eval_reward.set(math.nan if newest is None else newest.reward_mean)
        self.eval_pass_at_1.set(math.nan if newest is None else newest.pass_at_1)
        self.eval_policy_version.set(math.nan if newest is None else newest.policy_version)
        self.eval_pass_at_k.clear()
        if newest is not None and newest.pass_at_k is not None:
            self.eval_pass_at_k.labels(k=str(newest.k)).set(newest.pass_at_k)

    def _set_degraded(self, degraded: DegradedReport | None) -> None:
        # Several targets of one dependency (two engines): down if any is, for as long as the oldest.
        longest: dict[str, float] = dict.fromkeys(DEPENDENCIES, -1.0)
        for outage in degraded.outages if degraded is not None and degraded.status else []:
            longest[outage.dependency] = max(longest.get(outage.dependency, -1.0), outage.seconds)
        for gauge in (self.degraded, self.outage_seconds):
            gauge.clear()  # a dependency that is not known and no longer down loses its series
        for dependency, seconds in longest.items():
            self.degraded.labels(dependency=dependency).set(1 if seconds >= 0 else 0)
            self.outage_seconds.labels(dependency=dependency).set(max(seconds, 0.0))


def _advance(counter: Counter, seen: int, total: int) -> int:
    """Counters only go up: add what the report's cumulative total gained since the last scrape."""
    if total > seen:
        counter.inc(total - seen)
        return total
    return seen
