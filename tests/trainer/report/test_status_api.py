"""The trainer's status endpoint, served by a real uvicorn on a free port and read with httpx."""

from __future__ import annotations

import asyncio
import html
import math
import signal
import time
from collections.abc import AsyncIterator, Callable

import httpx
import pytest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.api.status_report import (
    AdmissionReport,
    DegradedReport,
    EngineReport,
    OutageReport,
    RecoveryReport,
    ReplayReport,
    StalenessReport,
    StepMetrics,
    StepRecord,
    TrainerReport,
)
from asyncrl.infra.health import Health
from asyncrl.trainer.report.status_api import StatusServer, create_app, serve

TOKEN = "s3cret-token"


def make_report(steps: int = 30) -> TrainerReport:
    """A deterministic mid-run report: `steps` steps, two engines, a staleness table."""
    history = [
        StepRecord(
            step=s,
            policy_version=s,
            reward_mean=0.05 + 0.01 * s,
            staleness_mean=0.5 + (s % 3) * 0.25,
            staleness_max=s % 3,
            loss=0.01 * s,
            clip_fraction=0.02,
            tokens=1000,
            step_seconds=2.0 + 0.1 * s,
            proximal_seconds=0.5,
            weight_sync_seconds=0.2,
            time=1_700_000_000.0 + s,
        )
        for s in range(1, steps + 1)
    ]
    return TrainerReport(
        job="demo",
        phase="Training",
        message="",
        step=steps,
        policy_version=steps,
        max_steps=40,
        groups_trained=8 * steps,
        tokens_trained=1000 * steps,
        reward_history=[h.reward_mean for h in history],
        staleness=StalenessReport(limit=2, dropped=3, histogram={"0": 10000, "1": 15000, "2": 5000}),
        skipped_updates=2,
        dead_lettered=1,
        admission=AdmissionReport(accepted=70, running=5, capacity=3, drift=-1),
        recovery=RecoveryReport(drift_lost=2, drift_found=1, leases_returned=4, recovered_entries=3,
                                reclaimed_entries=6, trainer_restarts=2, engine_restarts=5, engine_resyncs=7),
        last_checkpoint="/run/checkpoints/step-30",
        rollout=[
            EngineReport(url="http://engine-a:30000", weight_version=steps, ready=True),
            EngineReport(url="http://engine-b:30000", weight_version=steps - 1, ready=False),
        ],
        history=history,
        started_at=1_700_000_000.0,
        updated_at=1_700_000_100.0,
        last_step=StepMetrics.model_validate({
            **(history[-1].model_dump() if history else {"step": 0, "policy_version": 0}),
            "reward_mean": history[-1].reward_mean if history else 0.0, "staleness_mean": 0.75, "staleness_max": 2,
            "tokens_per_second": 456.5, "clip_fraction": 0.02, "clip_fraction_low": 0.005,
            "clip_fraction_high": 0.015, "bapo_clip_low": 0.7, "bapo_clip_high": 1.4, "vcpo_lr_scale": 0.6,
            "tb_beta": 0.012, "importance_weight_max": 1.7, "importance_weight_min": 0.4,
            "importance_weight_mean": 0.99, "full_ratio_max": 2.5, "full_ratio_min": 0.3, "full_ratio_mean": 1.01,
            "behav_weight_max": 1.4, "behav_weight_min": 0.8, "behav_weight_mean": 1.0, "behav_ess": 0.93,
            "behav_kl": 0.004, "proximal_seconds": 0.5, "step_seconds": 5.0, "weight_sync_seconds": 0.2,
            "replay": ReplayReport(trajectories=300, prompts=20, bytes=123456, capacity=16384, replayed_groups=9)}),
    )


class ReportBox:
    """What a trainer does: keep the latest report object and swap it atomically."""

    def __init__(self, report: TrainerReport) -> None:
        self.report = report

    def __call__(self) -> TrainerReport:
        return self.report


@pytest.fixture
async def box() -> ReportBox:
    return ReportBox(make_report())


async def _start(get_report: Callable[[], TrainerReport], token: str | None = None,
                 health: Health | None = None) -> StatusServer:
    """A server on a free port. Its Health board is its own (an empty one unless given): the
    process-wide board may hold an outage left by another test in this process."""
    server = StatusServer(create_app(get_report, token=token, health=health or Health()), "127.0.0.1", 0)
    await server.start()
    return server


@pytest.fixture
async def server(box: ReportBox) -> AsyncIterator[StatusServer]:
    srv = await _start(box)
    yield srv
    await srv.stop()


@pytest.fixture
async def client(server: StatusServer) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
        yield c


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


async def test_status_serves_the_report_document(client: httpx.AsyncClient, box: ReportBox) -> None:
    resp = await client.get("/status")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    # Healthy: exactly the report, `degraded` absent rather than null (as before the field existed).
    assert body == box.report.model_dump(mode="json", exclude={"degraded"})
    assert "degraded" not in body
    assert TrainerReport.model_validate(body) == box.report  # the document round-trips through the model
    for key in (
        "phase", "step", "policy_version", "max_steps", "groups_trained", "tokens_trained", "reward_history",
        "staleness", "rollout", "last_step",
    ):
        assert key in body, key
    assert set(body["staleness"]) >= {"limit", "dropped", "histogram"}
    assert body["staleness"]["histogram"] == {"0": 10000, "1": 15000, "2": 5000}
    last = body["last_step"]
    assert (last["tokens_per_second"], last["staleness_mean"], last["staleness_max"]) == (456.5, 0.75, 2)
    assert last["full_ratio_max"] == 2.5 and last["behav_ess"] == 0.93
    assert (body["skipped_updates"], body["dead_lettered"]) == (2, 1)
    assert body["rollout"][1] == {"url": "http://engine-b:30000", "weight_version": 29, "ready": False, "fenced": ""}
    assert len(body["reward_history"]) == 30

    box.report = box.report.model_copy(update={"step": 31, "phase": "Publishing"})
    body = (await client.get("/status")).json()
    assert (body["step"], body["phase"]) == (31, "Publishing")


async def test_metrics_are_prometheus_text_with_the_same_figures(client: httpx.AsyncClient) -> None:
    resp = await client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"] == CONTENT_TYPE_LATEST
    m = _samples(resp.text)
    g = lambda name, **labels: m[(name, tuple(sorted(labels.items())))]  # noqa: E731

    assert g("asyncrl_trainer_step") == 30
    assert g("asyncrl_trainer_max_steps") == 40
    assert g("asyncrl_trainer_policy_version") == 30
    assert g("asyncrl_trainer_phase", asyncrl_trainer_phase="Training") == 1
    assert g("asyncrl_trainer_phase", asyncrl_trainer_phase="Failed") == 0
    assert g("asyncrl_trainer_groups_trained_total") == 240
    assert g("asyncrl_trainer_tokens_trained_total") == 30000
    assert g("asyncrl_trainer_tokens_per_second") == 456.5
    assert g("asyncrl_trainer_reward_mean") == pytest.approx(0.35)
    assert g("asyncrl_trainer_loss") == pytest.approx(0.30)
    assert g("asyncrl_trainer_staleness_mean") == 0.75
    assert g("asyncrl_trainer_staleness_max") == 2
    assert g("asyncrl_trainer_staleness_limit") == 2
    assert g("asyncrl_trainer_stale_groups_dropped_total") == 3
    # lag -> tokens as a cumulative histogram: le=0 -> 10000, le=1 -> 25000, le=2 -> 30000
    assert g("asyncrl_trainer_token_staleness_bucket", le="0.0") == 10000
    assert g("asyncrl_trainer_token_staleness_bucket", le="1.0") == 25000
    assert g("asyncrl_trainer_token_staleness_bucket", le="2.0") == 30000
    assert g("asyncrl_trainer_token_staleness_bucket", le="+Inf") == 30000
    assert g("asyncrl_trainer_token_staleness_count") == 30000
    assert g("asyncrl_trainer_token_staleness_sum") == 15000 + 2 * 5000
    assert g("asyncrl_trainer_clip_fraction") == 0.02
    assert [g("asyncrl_trainer_clip_fraction_by_side", side=s) for s in ("low", "high")] == [0.005, 0.015]
    assert [g("asyncrl_trainer_bapo_clip_bound", side=s) for s in ("low", "high")] == [0.7, 1.4]
    assert g("asyncrl_trainer_vcpo_lr_scale") == 0.6
    assert g("asyncrl_trainer_tb_beta") == 0.012
    assert (g("asyncrl_trainer_replay_trajectories"), g("asyncrl_trainer_replay_bytes"),
            g("asyncrl_trainer_replayed_groups")) == (300, 123456, 9)
    assert g("asyncrl_trainer_importance_weight", stat="max") == 1.7
    assert g("asyncrl_trainer_importance_weight", stat="min") == 0.4
    assert g("asyncrl_trainer_importance_weight", stat="mean") == 0.99
    assert g("asyncrl_trainer_full_ratio", stat="max") == 2.5
    assert g("asyncrl_trainer_behaviour_weight", stat="min") == 0.8
    assert g("asyncrl_trainer_behaviour_ess") == 0.93
    assert g("asyncrl_trainer_behaviour_kl") == 0.004
    assert g("asyncrl_trainer_skipped_updates_total") == 2
    assert g("asyncrl_trainer_dead_lettered_groups_total") == 1
    assert [g("asyncrl_trainer_admission_groups", figure=f) for f in ("accepted", "running", "capacity", "drift")] \
        == [70, 5, 3, -1]
    assert g("asyncrl_trainer_admission_drift_repaired_groups_total", direction="lost") == 2
    assert g("asyncrl_trainer_admission_drift_repaired_groups_total", direction="found") == 1
    assert g("asyncrl_trainer_admission_leases_returned_total") == 4
    assert (g("asyncrl_trainer_recovered_entries_total"), g("asyncrl_trainer_reclaimed_entries_total")) == (3, 6)
    assert [g("asyncrl_trainer_restarts_total", component=c) for c in ("trainer", "engine")] == [2, 5]
    assert g("asyncrl_trainer_engine_resyncs_total") == 7
    assert g("asyncrl_trainer_proximal_seconds") == 0.5
    assert g("asyncrl_trainer_step_seconds") == 5.0
    assert g("asyncrl_trainer_weight_sync_seconds") == 0.2
    assert g("asyncrl_trainer_step_duration_seconds_count") == 30
    assert g("asyncrl_trainer_step_duration_seconds_sum") == pytest.approx(sum(2.0 + 0.1 * s for s in range(1, 31)))
    assert g("asyncrl_trainer_weight_sync_duration_seconds_count") == 30
    assert g("asyncrl_trainer_proximal_duration_seconds_count") == 30
    assert g("asyncrl_trainer_engine_weight_version", engine="http://engine-a:30000") == 30
    assert g("asyncrl_trainer_engine_weight_version", engine="http://engine-b:30000") == 29
    assert g("asyncrl_trainer_engine_ready", engine="http://engine-a:30000") == 1
    assert g("asyncrl_trainer_engine_ready", engine="http://engine-b:30000") == 0
    assert g("asyncrl_trainer_engine_version_lag", engine="http://engine-b:30000") == 1
    assert g("asyncrl_trainer_job_info", job="demo") == 1


async def test_metrics_follow_the_report_between_scrapes(client: httpx.AsyncClient, box: ReportBox) -> None:
    await client.get("/metrics")
    nxt = make_report(31)
    nxt = nxt.model_copy(update={"rollout": nxt.rollout[:1], "last_step": None})
    box.report = nxt
    m = _samples((await client.get("/metrics")).text)
    assert m[("asyncrl_trainer_groups_trained_total", ())] == 248  # counters advance by the delta
    assert m[("asyncrl_trainer_step_duration_seconds_count", ())] == 31  # each step observed once
    assert math.isnan(m[("asyncrl_trainer_reward_mean", ())])  # no step yet: the step's figures are NaN
    engines = {labels for name, labels in m if name == "asyncrl_trainer_engine_ready"}
    assert engines == {(("engine", "http://engine-a:30000"),)}  # the vanished engine's series is gone


async def test_an_outage_on_the_board_makes_status_and_metrics_say_degraded(box: ReportBox) -> None:
    """While the Health board lists an outage, /status carries a typed `degraded` that the operator's
    mirror (fetch_report: TrainerReport.model_validate of /status) keeps, and /metrics says which
    dependency is down and for how long; once it recovers, both go back to healthy."""
    from asyncrl.operator.mirror import fetch_report

    board = Health()
    server = await _start(box, health=board)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            m = _samples((await c.get("/metrics")).text)
            for dependency in ("redis", "engine"):  # the series exist while healthy: alerts need no absent()
                assert m[("asyncrl_trainer_degraded", (("dependency", dependency),))] == 0
                assert m[("asyncrl_trainer_outage_seconds", (("dependency", dependency),))] == 0

            before = time.time()
            board.failing("redis", "redis.ns.svc:6379/0", ConnectionRefusedError("Connection refused"), 180.0)
            board.failing("redis", "redis.ns.svc:6379/0", ConnectionRefusedError("Connection refused"), 180.0)
            body = (await c.get("/status")).json()
            d = body["degraded"]
            assert (d["status"], d["reason"]) == (True, "RedisUnavailable")
            assert "redis.ns.svc:6379/0" in d["message"] and "Connection refused" in d["message"]
            assert before - 1 <= d["since"] <= time.time()
            [o] = d["outages"]
            assert (o["dependency"], o["target"], o["failures"], o["window_s"]) == (
                "redis", "redis.ns.svc:6379/0", 2, 180.0)
            assert o["last_error"] == "ConnectionRefusedError: Connection refused" and o["seconds"] >= 0
            assert {k: v for k, v in body.items() if k != "degraded"} == box.report.model_dump(
                mode="json", exclude={"degraded"}), "the rest of the document is the report"

            mirrored = await fetch_report(server.url)  # what the operator reads into the job's status
            assert isinstance(mirrored.degraded, DegradedReport)
            assert mirrored.degraded.reason == "RedisUnavailable"
            assert mirrored.degraded.outages[0].target == "redis.ns.svc:6379/0"

            m = _samples((await c.get("/metrics")).text)
            assert m[("asyncrl_trainer_degraded", (("dependency", "redis"),))] == 1
            assert m[("asyncrl_trainer_degraded", (("dependency", "engine"),))] == 0
            assert 0 <= m[("asyncrl_trainer_outage_seconds", (("dependency", "redis"),))] <= time.time() - before + 1
            assert m[("asyncrl_trainer_outage_seconds", (("dependency", "engine"),))] == 0

            board.recovered("redis", "redis.ns.svc:6379/0")
            body = (await c.get("/status")).json()
            assert "degraded" not in body and (await fetch_report(server.url)).degraded is None
            m = _samples((await c.get("/metrics")).text)
            assert m[("asyncrl_trainer_degraded", (("dependency", "redis"),))] == 0
            assert m[("asyncrl_trainer_outage_seconds", (("dependency", "redis"),))] == 0
    finally:
        await server.stop()


async def test_the_board_not_the_report_says_what_is_down(box: ReportBox) -> None:
    """A report that carries an old `degraded` (restored, or set by mistake) is served healthy when
    the board is empty; without a board (health=None) the report is served as it is."""
    stale = DegradedReport(reason="EngineUnavailable", message="old", since=1.0,
                           outages=[OutageReport(dependency="engine", target="http://e:30000", since=1.0, seconds=5.0)])
    box.report = box.report.model_copy(update={"degraded": stale})
    server = await _start(box)  # an empty board
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            assert "degraded" not in (await c.get("/status")).json()
    finally:
        await server.stop()
    bare = StatusServer(create_app(box, health=None), "127.0.0.1", 0)
    await bare.start()
    try:
        async with httpx.AsyncClient(base_url=bare.url, timeout=10) as c:
            assert (await c.get("/status")).json()["degraded"]["reason"] == "EngineUnavailable"
            m = _samples((await c.get("/metrics")).text)  # /metrics agrees with /status
            assert m[("asyncrl_trainer_degraded", (("dependency", "engine"),))] == 1
            assert m[("asyncrl_trainer_outage_seconds", (("dependency", "engine"),))] == 5.0
    finally:
        await bare.stop()


async def test_healthz_and_dashboard(client: httpx.AsyncClient) -> None:
    resp = await client.get("/healthz")
    assert (resp.status_code, resp.json()) == (200, {"status": "ok"})
    page = await client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    html = page.text
    assert 'id="reward-chart"' in html and 'id="staleness-chart"' in html
    assert "<script src" not in html and "<link" not in html  # self-contained: no CDN
    assert "https://" not in html
    assert html.count("http://") == html.count("http://www.w3.org/2000/svg")  # only the SVG namespace


async def test_unknown_paths_and_methods_get_json_errors(client: httpx.AsyncClient) -> None:
    resp = await client.get("/nope")
    assert resp.status_code == 404
    assert resp.json() == {"error": "not found", "status": 404, "method": "GET", "path": "/nope"}
    for path in ("/docs", "/openapi.json"):
        assert (await client.get(path)).status_code == 404
    for method in ("POST", "PUT", "DELETE", "PATCH"):
        for path in ("/status", "/metrics", "/", "/healthz"):
            resp = await client.request(method, path, json={})
            assert resp.status_code == 405, (method, path)
            body = resp.json()
            assert body["path"] == path and body["method"] == method and "read-only" in body["error"]
            assert "GET" in resp.headers["allow"]


async def test_bearer_token_guards_everything_but_healthz(box: ReportBox) -> None:
    server = await _start(box, token=TOKEN)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            auth = {"Authorization": f"Bearer {TOKEN}"}
            for path in ("/status", "/metrics", "/", "/nope"):
                for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": f"Basic {TOKEN}"}):
                    resp = await c.get(path, headers=headers)
                    assert resp.status_code == 401, (path, headers)
                    assert resp.headers["www-authenticate"].startswith("Bearer")
                    if path == "/":  # a browser gets the login form
                        assert '<form method="post" action="login">' in resp.text
                    else:
                        assert resp.json()["path"] == path and "token" in resp.json()["error"]
            assert (await c.post("/status")).status_code == 401  # auth before method checks
            assert (await c.get("/healthz")).status_code == 200
            assert (await c.get("/status", headers=auth)).json()["step"] == 30
            assert "asyncrl_trainer_step 30.0" in (await c.get("/metrics", headers=auth)).text
            assert (await c.get("/", headers=auth)).status_code == 200
            assert (await c.get("/nope", headers=auth)).status_code == 404
            # the token is never accepted in a URL: it would stay in history, proxy logs and Referers
            in_url = await c.get("/", params={"token": TOKEN, "refresh": "0.5"})
            assert in_url.status_code == 401 and "not accepted in the URL" in in_url.text
            assert TOKEN not in in_url.text and 'action="login?refresh=0.5"' in in_url.text
            assert (await c.get("/status", params={"token": TOKEN})).status_code == 401
    finally:
        await server.stop()


async def test_the_login_form_sets_a_session_cookie_for_the_page_and_its_polls_only(box: ReportBox) -> None:
    """A browser cannot send a header on navigation: POST /login takes the token from the form and
    sets an HttpOnly, SameSite=Strict cookie (derived from the token, not the token) that opens / and
    /status, not /metrics."""
    from asyncrl.trainer.report.status_api import SESSION_COOKIE, session_value

    server = await _start(box, token=TOKEN)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            wrong = await c.post("/login", data={"token": "guess"})
            assert wrong.status_code == 401 and "not this job's status token" in html.unescape(wrong.text)
            assert SESSION_COOKIE not in wrong.cookies
            ok = await c.post("/login?refresh=0.5", data={"token": TOKEN})
            assert ok.status_code == 303 and ok.headers["location"] == "./?refresh=0.5"
            cookie = ok.headers["set-cookie"]
            assert "HttpOnly" in cookie and "samesite=strict" in cookie.lower() and TOKEN not in cookie
            assert c.cookies[SESSION_COOKIE] == session_value(TOKEN)
            assert (await c.get("/")).status_code == 200
            assert (await c.get("/status")).json()["step"] == 30
            metrics = await c.get("/metrics")
            assert metrics.status_code == 401, "the cookie is for the dashboard, not an API credential"
        async with httpx.AsyncClient(base_url=server.url, timeout=10,
                                     cookies={SESSION_COOKIE: session_value("another-job's-token")}) as other:
            assert (await other.get("/status")).status_code == 401
    finally:
        await server.stop()


async def test_a_failing_report_provider_gives_503_json() -> None:
    def broken() -> TrainerReport:
        raise RuntimeError("trainer state not ready")

    server = await _start(broken)
    try:
        async with httpx.AsyncClient(base_url=server.url, timeout=10) as c:
            for path in ("/status", "/metrics"):
                resp = await c.get(path)
                assert resp.status_code == 503
                assert "trainer state not ready" in resp.json()["error"]
            assert (await c.get("/healthz")).status_code == 200
    finally:
        await server.stop()


async def test_in_loop_server_stops_cleanly_and_leaves_signal_handlers_alone(box: ReportBox) -> None:
    before = signal.getsignal(signal.SIGINT)
    server = await _start(box)
    assert signal.getsignal(signal.SIGINT) is before
    url = server.url
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(f"{url}/healthz")).status_code == 200
        await server.stop()
        await server.stop()  # idempotent
        with pytest.raises(httpx.ConnectError):
            await c.get(f"{url}/healthz")
    assert signal.getsignal(signal.SIGINT) is before


async def test_serve_runs_until_cancelled(box: ReportBox) -> None:
    started: asyncio.Queue[str] = asyncio.Queue()
    task = asyncio.create_task(serve(create_app(box), "127.0.0.1", 0, on_started=started.put_nowait))
    url = await asyncio.wait_for(started.get(), 10)
    async with httpx.AsyncClient(timeout=10) as c:
        assert (await c.get(f"{url}/status")).json()["job"] == "demo"
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(httpx.ConnectError):
            await c.get(f"{url}/status")


def test_threaded_server_answers_while_the_caller_blocks(box: ReportBox) -> None:
    server = StatusServer(create_app(box, token=TOKEN))
    url = server.start_in_thread()
    try:
        # the calling thread blocks (as a synchronous training step would); the thread still serves
        with httpx.Client(timeout=10) as c:
            resp = c.get(f"{url}/status", headers={"Authorization": f"Bearer {TOKEN}"})
            assert resp.status_code == 200 and resp.json()["policy_version"] == 30
            box.report = box.report.model_copy(update={"phase": "Succeeded", "updated_at": time.time()})
            assert c.get(f"{url}/status", headers={"Authorization": f"Bearer {TOKEN}"}).json()["phase"] == "Succeeded"
    finally:
        server.stop_thread()
    server.stop_thread()  # idempotent
    with httpx.Client(timeout=10) as c, pytest.raises(httpx.ConnectError):
        c.get(f"{url}/healthz")


async def test_binding_a_taken_port_names_host_and_port(server: StatusServer, box: ReportBox) -> None:
    other = StatusServer(create_app(box), "127.0.0.1", server.port or 0)
    with pytest.raises(OSError, match=f"127.0.0.1:{server.port}"):
        await other.start()
