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
before the first result) and `asyncrl_eval_pass_at_k{k}` (only when k = samplesPerPrompt > 1); with
several sources of held-out prompts (spec.evaluation.datasets), each one's as
`asyncrl_eval_pass_at_1_by_source{source}` and `asyncrl_eval_reward_by_source{source}`.
"""

from __future__ import annotations

import math
import threading
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Enum, Gauge, Histogram, Info
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from asyncrl.api.figures import Figure, figures
from asyncrl.api.status_report import DegradedReport, EvalRecord, StepRecord, TrainerReport

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


class _ReportFigures(Collector):
    """Every report field its metadata exports (asyncrl/api/figures.py), as gauges and counters made at
    scrape time from the report: a figure declared on the report needs nothing here. Counters are
    the report's running totals themselves (a trainer restart starts this process's counters over,
    as a Prometheus counter reset)."""

    def __init__(self) -> None:
        self._figures: list[Figure] = [f for f in figures(TrainerReport) if f.exported and f.exported.name]
        families: dict[str, list[Figure]] = defaultdict(list)
        for f in self._figures:
            assert f.exported is not None and f.exported.name is not None
            families[f.exported.name].append(f)
        for name, members in families.items():  # (a mistake in the report's declarations: fail at start)
            kinds = {m.exported.kind for m in members if m.exported}
            labels = [m.exported.labels for m in members if m.exported]
            if len(kinds) > 1 or len(set(labels)) < len(labels):
                raise ValueError(f"report figures {[m.name for m in members]} clash as {PREFIX}_{name}")
        self._report = TrainerReport()

    def set(self, report: TrainerReport) -> None:
        self._report = report

    def describe(self) -> Iterable[Metric]:
        return []  # made at scrape time

    def collect(self) -> Iterator[Metric]:
        values = {f.path: f.value for f in figures(self._report)}
        made: dict[str, GaugeMetricFamily | CounterMetricFamily] = {}
        for f in self._figures:
            e = f.exported
            assert e is not None and e.name is not None
            family = made.get(e.name)
            if family is None:
                cls = CounterMetricFamily if e.kind == "counter" else GaugeMetricFamily
                keys = [e.key_label] if e.key_label else []
                family = made[e.name] = cls(f"{PREFIX}_{e.name}", e.help or f.description or e.name,
                                            labels=[k for k, _ in e.labels] + keys)
            value = values.get(f.path)
            if e.key_label:  # a table: a series per key
                for key, number in (value or {}).items():
                    family.add_metric([*(v for _, v in e.labels), str(key)], float(number))
                continue
            family.add_metric([v for _, v in e.labels], math.nan if value is None else float(value))
        yield from made.values()


class TrainerMetrics:
    """All trainer metrics in one registry; `update(report)` makes them match the report."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self._lock = threading.Lock()
        self._last_step_seen = -1
        self.info = Info(f"{PREFIX}_job", "The job this trainer runs.", registry=r)
        self.phase = Enum(f"{PREFIX}_phase", "Trainer phase.", states=PHASES, registry=r)
        self.figures = _ReportFigures()
        r.register(self.figures)
        self.staleness_histogram = _StalenessHistogram()
        r.register(self.staleness_histogram)
        self.step_duration = self._histogram("step_duration_seconds", "Wall time per step.", STEP_SECONDS_BUCKETS)
        self.proximal_duration = self._histogram("proximal_duration_seconds", "Proximal logprob time per step.",
                                                 STEP_SECONDS_BUCKETS)
        self.weight_sync_duration = self._histogram("weight_sync_duration_seconds", "Weight sync time per step.",
                                                    SYNC_SECONDS_BUCKETS)
        self.engine_version = self._gauge("engine_weight_version", "Weight version each rollout engine serves "
                                          "(-1: unknown).", ["engine"])
        self.engine_ready = self._gauge("engine_ready", "1 when the rollout engine is ready.", ["engine"])
        self.engine_lag = self._gauge("engine_version_lag", "Policy version minus the engine's weight version.",
                                      ["engine"])
        self.degraded = self._gauge("degraded", "1 while the trainer waits out an outage of this dependency "
                                    "(Degraded).", ["dependency"])
        self.outage_seconds = self._gauge("outage_seconds", "How long the current outage of this dependency has "
                                          "lasted (0: reachable).", ["dependency"])
        self.eval_reward = Gauge(f"{EVAL_PREFIX}_reward", "Mean reward of the newest held-out evaluation.",
                                 registry=r)
        self.eval_pass_at_1 = Gauge(f"{EVAL_PREFIX}_pass_at_1", "pass@1 of the newest held-out evaluation.",
                                    registry=r)
        self.eval_pass_at_k = Gauge(f"{EVAL_PREFIX}_pass_at_k", "pass@k of the newest held-out evaluation "
                                    "(k = evaluation.samplesPerPrompt, only when > 1).", ["k"], registry=r)
        self.eval_policy_version = Gauge(f"{EVAL_PREFIX}_policy_version",
                                         "Policy version of the newest held-out evaluation.", registry=r)
        self.eval_pass_at_1_by_source = Gauge(f"{EVAL_PREFIX}_pass_at_1_by_source", "pass@1 of each source of the "
                                              "newest held-out evaluation (spec.evaluation.datasets).", ["source"],
                                              registry=r)
        self.eval_reward_by_source = Gauge(f"{EVAL_PREFIX}_reward_by_source", "Mean reward of each source of the "
                                           "newest held-out evaluation.", ["source"], registry=r)

    def _gauge(self, name: str, doc: str, labels: Sequence[str] = ()) -> Gauge:
        return Gauge(f"{PREFIX}_{name}", doc, labels, registry=self.registry)

    def _histogram(self, name: str, doc: str, buckets: Sequence[float]) -> Histogram:
        return Histogram(f"{PREFIX}_{name}", doc, buckets=buckets, registry=self.registry)

    def update(self, report: TrainerReport) -> None:
        """Bring every metric in line with `report` (idempotent; call before each scrape)."""
        with self._lock:
            self.info.info({"job": report.job})
            self.phase.state(report.phase)
            self.figures.set(report)
            self.staleness_histogram.set(report.staleness.histogram, report.staleness.limit)
            for record in report.history:
                self._observe_step(record)
            self._set_engines(report)
            self._set_degraded(report.degraded)
            self._set_evaluation(report.evaluations[-1] if report.evaluations else None)

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
        for gauge, table in ((self.eval_pass_at_1_by_source, newest.pass_at_1_by_source if newest else {}),
                             (self.eval_reward_by_source, newest.reward_by_source if newest else {})):
            gauge.clear()
            for source, value in table.items():
                gauge.labels(source=source).set(value)

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

