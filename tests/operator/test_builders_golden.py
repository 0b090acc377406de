"""Golden files: `asyncrl render` of each example job (regenerate with ASYNCRL_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.api.loader import load_job
from asyncrl.operator.render import render
from tests.support.paths import REPO

GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
UID = "11111111-2222-3333-4444-555555555555"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_render_matches_golden(example: Path):
    text = render(load_job(example), uid=UID, redis_password="golden-password", status_token="golden-token",
                  engine_api_key="golden-engine-key")
    golden = GOLDEN / f"render-{example.stem}.yaml"
    if os.environ.get("ASYNCRL_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with ASYNCRL_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{golden.name} differs: review and regenerate with ASYNCRL_UPDATE_GOLDEN=1"


def test_render_command_prints_every_child():
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "render", str(REPO / "examples" / "job.yaml"),
                          "--uid", UID, "--redis-password", "golden-password", "--status-token", "golden-token",
                          "--engine-api-key", "golden-engine-key"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == (GOLDEN / "render-job.yaml").read_text()
    kinds = [d["kind"] for d in yaml.safe_load_all(res.stdout)]
    assert kinds == ["ConfigMap", "Secret", "Service", "StatefulSet", "NetworkPolicy", "PersistentVolumeClaim",
                     "Secret", "Secret", "Service", "Service", "NetworkPolicy", "StatefulSet", "PodDisruptionBudget",
                     "NetworkPolicy", "Deployment"]


def test_render_admits_the_operator_from_the_namespace_it_is_told(monkeypatch, tmp_path):
    """The job's policies admit the operator's pod from its own namespace only: `asyncrl render
    --operator-namespace`, and for the operator itself POD_NAMESPACE (the chart's downward API), the
    service account's namespace file, else "default"."""
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "render", str(REPO / "examples" / "job.yaml"),
                          "--operator-namespace", "team-ops"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    peers = [peer for d in yaml.safe_load_all(res.stdout) if d["kind"] == "NetworkPolicy"
             for rule in d["spec"]["ingress"] for peer in rule.get("from", []) if "namespaceSelector" in peer]
    assert len(peers) == 2  # the Redis and trainer policies (the operator reads the outcome and /status)
    assert all(p["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "team-ops"}} for p in peers)

    from asyncrl.operator import config

    monkeypatch.setenv("POD_NAMESPACE", "from-downward-api")
    assert config.own_namespace() == "from-downward-api"
    monkeypatch.delenv("POD_NAMESPACE")
    sa = tmp_path / "namespace"
    sa.write_text("from-service-account\n")
    monkeypatch.setattr(config, "SERVICE_ACCOUNT_NAMESPACE", str(sa))
    assert config.own_namespace() == "from-service-account"
    monkeypatch.setattr(config, "SERVICE_ACCOUNT_NAMESPACE", str(tmp_path / "absent"))
    assert config.own_namespace() == "default"


def _secrets(text: str) -> dict[str, dict[str, str]]:
    return {d["metadata"]["name"]: d["stringData"] for d in yaml.safe_load_all(text) if d["kind"] == "Secret"}


def test_render_generates_fresh_secrets_by_default():
    """No guessable default: without --redis-password/--status-token every run draws new random values
    (the old default password was the literal CHANGE-ME), and --help says so."""
    res = [subprocess.run([sys.executable, "-m", "asyncrl.cli", "render", str(REPO / "examples" / "job.yaml")],
                          capture_output=True, text=True, cwd=REPO, timeout=60) for _ in range(2)]
    assert all(r.returncode == 0 for r in res), res[0].stderr
    first, second = _secrets(res[0].stdout), _secrets(res[1].stdout)
    assert "CHANGE-ME" not in res[0].stdout
    redis, status, engine = "qwen25-gsm8k-redis-auth", "qwen25-gsm8k-status-auth", "qwen25-gsm8k-engine-auth"
    password, token, key = first[redis]["password"], first[status]["token"], first[engine]["api-key"]
    assert len(password) == 48 and int(password, 16) >= 0 and len(token) >= 43 and len(key) >= 43
    assert password != second[redis]["password"] and token != second[status]["token"]
    assert key != second[engine]["api-key"]
    helptext = subprocess.run([sys.executable, "-m", "asyncrl.cli", "render", "--help"], capture_output=True,
                              text=True, cwd=REPO, timeout=60).stdout
    assert "random" in helptext and "--status-token" in helptext


def test_render_reports_invalid_files(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "examples" / "local.yaml").read_text().replace("groupSize: 8", "groupSize: 1"))
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "render", str(bad)], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert res.returncode == 1
    assert "groupSize >= 2" in res.stderr
