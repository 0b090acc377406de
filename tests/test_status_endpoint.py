"""The trainer's status endpoint, served by real uvicorn and read with a real HTTP client."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from asyncrl.status_report import TrainerReport
from asyncrl.trainer.status_api import StatusServer, create_app
from status_fixtures import synthetic_report


@pytest.fixture
def serve():
    servers: list[StatusServer] = []

    def start(get_report, **kwargs) -> str:
        server = StatusServer(create_app(get_report, **kwargs))
        servers.append(server)
        return server.start_in_thread()

    yield start
    for server in servers:
        server.stop_thread()


def test_status_has_every_documented_figure(serve):
    report = synthetic_report()
    url = serve(lambda: report)
    body = httpx.get(f"{url}/status").json()
    for key in ("phase", "step", "policy_version", "max_steps", "groups_trained", "tokens_trained",
                "tokens_per_second", "reward_mean", "reward_history", "staleness", "clip_fraction",
                "importance_weight", "proximal_seconds", "step_seconds", "weight_sync_seconds", "rollout"):
        assert key in body, key
    assert body["step"] == 30 and body["policy_version"] == 30 and body["phase"] == "Training"
    assert body["staleness"] == {"mean": 1.25, "max": 2, "limit": 2, "dropped": 3,
                                 "histogram": {"0": 500, "1": 900, "2": 300}}
    assert body["importance_weight"] == {"max": 3.5, "min": 0.2, "mean": 1.01}
    assert body["rollout"] == [{"url": "http://10.0.0.7:30000", "weight_version": 29, "ready": True}]
    assert len(body["reward_history"]) == 30
    assert TrainerReport.model_validate(body) == report


def test_status_follows_the_live_report(serve):
    state = {"report": synthetic_report(5)}
    url = serve(lambda: state["report"])
    assert httpx.get(f"{url}/status").json()["step"] == 5
    state["report"] = synthetic_report(6)
    assert httpx.get(f"{url}/status").json()["step"] == 6


def test_metrics_are_prometheus_text_with_the_same_figures(serve):
    url = serve(synthetic_report)
    resp = httpx.get(f"{url}/metrics")
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(resp.text) for s in family.samples}
    assert samples[("asyncrl_trainer_step", ())] == 30
    assert samples[("asyncrl_trainer_policy_version", ())] == 30
    assert samples[("asyncrl_trainer_staleness_mean", ())] == 1.25
    assert samples[("asyncrl_trainer_groups_trained_total", ())] == 240
    assert samples[("asyncrl_trainer_importance_weight", (("stat", "max"),))] == 3.5
    assert samples[("asyncrl_trainer_engine_weight_version", (("engine", "http://10.0.0.7:30000"),))] == 29
    # version lag -> tokens, cumulative buckets: 500 at lag 0, 900 at 1, 300 at 2
    assert samples[("asyncrl_trainer_token_staleness_bucket", (("le", "1.0"),))] == 1400
    assert samples[("asyncrl_trainer_token_staleness_count", ())] == 1700


def test_healthz(serve):
    url = serve(synthetic_report)
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}


def test_bad_paths_and_methods_get_json_errors(serve):
    url = serve(synthetic_report)
    missing = httpx.get(f"{url}/nope")
    assert missing.status_code == 404 and missing.json()["path"] == "/nope"
    post = httpx.post(f"{url}/status", json={})
    assert post.status_code == 405 and "read-only" in post.json()["error"]
    assert httpx.delete(f"{url}/").status_code == 405


def test_bearer_token_guards_everything_but_healthz(serve):
    url = serve(synthetic_report, token="s3cret")
    denied = httpx.get(f"{url}/status")
    assert denied.status_code == 401 and denied.headers["www-authenticate"].startswith("Bearer")
    assert "bearer token" in denied.json()["error"]
    assert httpx.get(f"{url}/status", headers={"Authorization": "Bearer wrong"}).status_code == 401
    ok = httpx.get(f"{url}/status", headers={"Authorization": "Bearer s3cret"})
    assert ok.status_code == 200 and ok.json()["step"] == 30
    assert httpx.get(f"{url}/metrics").status_code == 401
    assert httpx.get(f"{url}/healthz").status_code == 200
    assert httpx.get(f"{url}/").status_code == 401
    assert httpx.get(f"{url}/", params={"token": "s3cret"}).status_code == 200
    assert httpx.get(f"{url}/status", params={"token": "s3cret"}).status_code == 401  # page only


def test_a_failing_report_provider_gives_503_not_a_dead_server(serve):
    def broken() -> TrainerReport:
        raise RuntimeError("boom")

    url = serve(broken)
    resp = httpx.get(f"{url}/status")
    assert resp.status_code == 503 and "boom" in resp.json()["error"]
    assert httpx.get(f"{url}/healthz").status_code == 200


def test_dashboard_page_is_self_contained(serve):
    url = serve(synthetic_report)
    page = httpx.get(f"{url}/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "reward-chart" in page.text and "staleness-chart" in page.text
    external = page.text.replace("http://www.w3.org/2000/svg", "")  # the SVG namespace is not a fetch
    assert "http://" not in external and "https://" not in external and "<script src" not in external
