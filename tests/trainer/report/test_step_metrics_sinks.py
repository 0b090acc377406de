"""Every figure of the step's record (StepMetrics) reaches every sink, from its one declaration:
metrics.jsonl, /status, Prometheus, the experiment trackers, the dashboard and the job's status;
and so does every recovery total (RecoveryReport): /status, Prometheus, the dashboard, the job's status."""

from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.api.figures import Exported, figures, is_number
from asyncrl.api.spec import AsyncRLJob, AsyncRLJobStatus, RecoveryStatus
from asyncrl.api.status_report import RecoveryReport, ReplayReport, StepMetrics, TrainerReport
from asyncrl.infra.health import Health
from asyncrl.operator.mirror import mirror_report
from asyncrl.trainer.report.metrics_file import metrics_line
from asyncrl.trainer.report.status_api import create_app
from asyncrl.trainer.report.step_report import report_step
from asyncrl.trainer.state.checkpoint import TrainerState
from asyncrl.trainer.step.stats import source_figures
from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample
from tests.support.jobs import JobBuilder

FIELDS = list(figures(StepMetrics))


def every_figure_set() -> StepMetrics:
    """A record whose every field holds its own recognisable value (none left at a default)."""
    values: dict[str, object] = {}
    for i, name in enumerate(StepMetrics.model_fields):
        annotation = StepMetrics.model_fields[name].annotation
        values[name] = (i if int in (annotation, *getattr(annotation, "__args__", ())) else i + 0.25)
    values["staleness_histogram"] = {"0": 5, "2": 7}
    values["reward_by_source"] = {"easy": 0.75, "hard": 0.125}
    values["groups_by_source"] = {"easy": 3, "hard": 1}
    values["replay"] = ReplayReport(trajectories=301, prompts=21, bytes=4096, capacity=512, replayed_groups=3)
    return StepMetrics.model_validate(values)


@pytest.fixture(scope="module")
def record() -> StepMetrics:
    return every_figure_set()


def every_total_set() -> RecoveryReport:
    return RecoveryReport.model_validate({name: 11 + i for i, name in enumerate(RecoveryReport.model_fields)})


def served(record: StepMetrics, path: str, recovery: RecoveryReport | None = None) -> httpx.Response:
    """GET `path` of the trainer's status app serving a report whose last step is `record`."""
    report = TrainerReport(job="sinks", step=record.step, last_step=record, recovery=recovery or RecoveryReport())
    app = create_app(lambda: report, health=Health())

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get(path)

    return asyncio.run(get())


def at(document: dict[str, object], dotted: str) -> object:
    value: object = document
    for key in dotted.split("."):
        assert isinstance(value, dict) and key in value, dotted
        value = value[key]
    return value


def test_the_record_declares_each_figure_once_with_a_description() -> None:
    names = [f.name for f in FIELDS]
    assert len(names) == len(set(names))
    undocumented = [f.name for f in FIELDS if not f.description]
    assert not undocumented, f"figures without a docstring: {undocumented}"
    record = every_figure_set()
    with pytest.raises(ValueError):
        record.undeclared_figure = 1.0  # type: ignore[attr-defined]  # (an objective's figure must be declared)


def test_metrics_jsonl_and_status_carry_every_figure(record: StepMetrics) -> None:
    line = json.loads(json.dumps(metrics_line(record)))
    body = served(record, "/status").json()
    for f in figures(record):
        want = f.value
        assert at(line, f.name) == want, f.name
        assert at(body["last_step"], f.name) == want, f.name


def test_prometheus_exports_every_figure_or_says_which_series_does(record: StepMetrics) -> None:
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(served(record, "/metrics").text) for s in family.samples}
    report_level = {f.name: f.exported for f in figures(TrainerReport) if not f.name.startswith("last_step.")}
    for f in figures(record):
        e = f.exported
        if not is_number(f.field.annotation) and e is not None and e.key_label:  # a table: a series per key
            assert f.value, f.name
            for key, value in f.value.items():
                sample = f"asyncrl_trainer_{e.name}" + ("_total" if e.kind == "counter" else "")
                assert samples[(sample, ((e.key_label, key),))] == pytest.approx(value), f.name
            continue
        if not is_number(f.field.annotation):
            assert e is not None and e.name is None and e.reason, f"{f.name}: a table needs a reason or a key label"
            continue
        assert isinstance(e, Exported), f.name
        if e.name is None:  # the reason names the report's own figure that is exported instead
            named = re.findall(r"`([a-z_.]+)`", e.reason)
            covering = [report_level[n] for n in named if n in report_level]
            assert len(covering) == 1 and covering[0] is not None and covering[0].name, f.name
            assert any(name.startswith(f"asyncrl_trainer_{covering[0].name}") for name, _ in samples), f.name
            continue
        sample = f"asyncrl_trainer_{e.name}" + ("_total" if e.kind == "counter" else "")
        got = samples[(sample, tuple(sorted(e.labels)))]
        assert got == pytest.approx(float(f.value)), f.name


def test_trackers_and_the_job_status_get_every_number(record: StepMetrics) -> None:
    numbers = record.numbers()
    want = {f.name for f in FIELDS if is_number(f.field.annotation)} - set(StepMetrics.AXES)
    assert set(numbers) == want
    assert all(isinstance(v, float) and math.isfinite(v) for v in numbers.values())

    job = AsyncRLJob.model_validate(JobBuilder.example().doc())
    status = AsyncRLJobStatus()
    mirror_report(status, TrainerReport(step=record.step, last_step=record), job.spec)
    assert status.last_step == numbers
    assert AsyncRLJobStatus.model_validate(status.to_wire()).last_step == numbers  # (the CRD's camelCase form)


def test_the_dashboard_lists_every_figure(record: StepMetrics) -> None:
    page = served(record, "/").text
    declared = json.loads(re.search(r"const FIGURES = (\{.*?\});\n", page).group(1))  # type: ignore[union-attr]
    for key, model in (("last_step", StepMetrics), ("recovery", RecoveryReport)):
        want = list(figures(model))
        assert [d["name"] for d in declared[key]] == [f.name for f in want]
        assert all(d["help"] == f.description for d, f in zip(declared[key], want, strict=True))


def test_every_recovery_total_reaches_status_prometheus_and_the_job_status(record: StepMetrics) -> None:
    totals = every_total_set()
    assert served(record, "/status", totals).json()["recovery"] == totals.model_dump()
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for family in
               text_string_to_metric_families(served(record, "/metrics", totals).text) for s in family.samples}
    for f in figures(totals):
        e = f.exported
        assert e is not None and f.description, f.name
        if e.name is None:
            assert e.reason, f.name
            continue
        sample = f"asyncrl_trainer_{e.name}" + ("_total" if e.kind == "counter" else "")
        assert samples[(sample, tuple(sorted(e.labels)))] == f.value, f.name
    status = AsyncRLJobStatus()
    mirror_report(status, TrainerReport(recovery=totals), AsyncRLJob.model_validate(JobBuilder.example().doc()).spec)
    assert status.recovery is not None and status.recovery.model_dump() == totals.model_dump()
    assert set(status.to_wire()["recovery"]) == {f.alias for f in RecoveryStatus.model_fields.values()}


def test_per_source_figures_come_from_the_groups_and_add_up_in_the_report() -> None:
    def group(source: str, rewards: list[float]) -> TrajectoryGroup:
        samples = [TrajectorySample(i, np.zeros(1, np.int32), np.zeros(1, np.float32), np.zeros(1, np.int32), r,
                                    "stop") for i, r in enumerate(rewards)]
        return TrajectoryGroup("j", f"g{source}{rewards}", "p", np.zeros(1, np.int32), samples, "e", 0.0, 0.0,
                               source=source)

    rewards, counts = source_figures([group("easy", [1.0, 0.0]), group("hard", [0.0, 0.0]), group("easy", [1.0, 1.0])])
    assert rewards == {"easy": 0.75, "hard": 0.0} and counts == {"easy": 2, "hard": 1}
    assert source_figures([group("", [1.0])]) == ({}, {})  # (a job with one dataset)

    report, state = TrainerReport(), TrainerState()
    for step, by_source in enumerate(({"easy": 2, "hard": 1}, {"easy": 3}), 1):
        state.step = step
        report_step(report, state, every_figure_set().model_copy(update={"groups_by_source": by_source}),
                    dead_lettered=0)
    assert report.groups_by_source == {"easy": 5, "hard": 1}
    app = create_app(lambda: report, health=Health())

    async def get() -> httpx.Response:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.get("/metrics")

    samples = {(s.name, tuple(s.labels.items())): s.value
               for family in text_string_to_metric_families(asyncio.run(get()).text) for s in family.samples}
    assert samples[("asyncrl_trainer_groups_trained_by_source_total", (("source", "easy"),))] == 5
    assert samples[("asyncrl_trainer_groups_trained_by_source_total", (("source", "hard"),))] == 1
