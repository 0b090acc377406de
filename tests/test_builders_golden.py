"""Golden files: `asyncrl render` of each example job (regenerate with ASYNCRL_UPDATE_GOLDEN=1)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from asyncrl.loader import load_job
from asyncrl.operator.render import render

REPO = Path(__file__).resolve().parent.parent
GOLDEN = Path(__file__).parent / "golden"
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))
UID = "11111111-2222-3333-4444-555555555555"


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.stem)
def test_render_matches_golden(example: Path):
    text = render(load_job(example), uid=UID, redis_password="golden-password")
    golden = GOLDEN / f"render-{example.stem}.yaml"
    if os.environ.get("ASYNCRL_UPDATE_GOLDEN"):
        golden.write_text(text)
    assert golden.exists(), f"missing {golden}; run with ASYNCRL_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), f"{golden.name} differs: review and regenerate with ASYNCRL_UPDATE_GOLDEN=1"


def test_render_command_prints_every_child():
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "render", str(REPO / "examples" / "job.yaml"),
                          "--uid", UID, "--redis-password", "golden-password"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout == (GOLDEN / "render-job.yaml").read_text()
    kinds = [d["kind"] for d in yaml.safe_load_all(res.stdout)]
    assert kinds == ["ConfigMap", "Secret", "Service", "StatefulSet", "NetworkPolicy", "PersistentVolumeClaim",
                     "Service", "Service", "NetworkPolicy", "StatefulSet", "PodDisruptionBudget",
                     "NetworkPolicy", "Deployment"]


def test_render_reports_invalid_files(tmp_path: Path):
    bad = tmp_path / "bad.yaml"
    bad.write_text((REPO / "examples" / "local.yaml").read_text().replace("groupSize: 8", "groupSize: 1"))
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "render", str(bad)], capture_output=True, text=True,
                         cwd=REPO, timeout=60)
    assert res.returncode == 1
    assert "groupSize >= 2" in res.stderr
