"""scripts/scan.sh: checkov over the chart and the operator's rendered children, gated by
security/checkov-accepted.yaml (asyncrl/operator/checkov_gate.py).

The scan itself needs checkov (scripts/install-checkov.sh, run by setup.sh --tests) and helm: without
them those tests skip, or fail where CI sets ASYNCRL_REQUIRE_CONTROL_PLANE=1. The gate's logic is
checked without either.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from asyncrl.operator import checkov_gate as G
from tests.support.paths import REPO
from tests.support.tools import find_tool, unavailable

SCAN = REPO / "scripts" / "scan.sh"

PRIVILEGED = """\
apiVersion: v1
kind: Pod
metadata:
  name: deliberately-bad
  namespace: scan-test
spec:
  containers:
    - name: root
      image: busybox@sha256:0000000000000000000000000000000000000000000000000000000000000000
      securityContext:
        privileged: true
"""


@pytest.fixture(scope="module")
def tools() -> list[str]:
    """--checkov and --helm for scan.sh; skips (or fails, in CI) where either is missing."""
    checkov = Path(os.environ.get("CHECKOV", G.DEFAULT_CHECKOV))
    if not os.access(checkov, os.X_OK):
        unavailable(f"checkov not found at {checkov}: run bash scripts/install-checkov.sh")
    return ["--checkov", str(checkov), "--helm", str(find_tool("helm"))]


def scan(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCAN), *args], capture_output=True, text=True, cwd=REPO, timeout=300)


def test_the_chart_and_the_rendered_examples_have_no_new_findings(tools):
    res = scan(*tools)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "scan: ok" in res.stdout
    # Everything was scanned: both chart renders and every example's children.
    assert f"in {len(G.CHART_VALUE_SETS) + len(list((REPO / 'examples').glob('*.yaml')))} files" in res.stdout


def test_a_privileged_container_is_a_new_finding_with_its_check_resource_and_file(tools, tmp_path):
    bad = tmp_path / "privileged.yaml"
    bad.write_text(PRIVILEGED)
    res = scan(*tools, "--extra", str(bad))
    assert res.returncode == 1, res.stdout + res.stderr
    new = [line for line in res.stdout.splitlines() if line.startswith("NEW")]
    assert any(re.match(r"NEW +CKV_K8S_16 +Pod/deliberately-bad +in extra/privileged\.yaml", line) for line in new), new
    assert all("Pod/deliberately-bad" in line for line in new), "only the extra file is new"
    assert "STALE" not in res.stdout and "scan: FAILED" in res.stdout


# ------------------------------------------------------------------------- the gate, without checkov


def finding(check: str, resource: str, file: str = "examples/job.yaml") -> G.Finding:
    return G.Finding(check, resource, file, "title")


def test_judge_splits_new_from_accepted_and_reports_stale_patterns():
    accepted = G.parse_accepted({"checkov": "1", "accepted": [
        {"check": "CKV_K8S_43", "resources": ["StatefulSet/*-trainer", "Deployment/gone"], "reason": "tags"},
        {"check": "CKV_K8S_8", "resources": ["Deployment/*-rollout"], "reason": "no port"},
    ]}).entries
    found = [finding("CKV_K8S_43", "StatefulSet/a-trainer"), finding("CKV_K8S_43", "Deployment/a-rollout"),
             finding("CKV_K8S_8", "Deployment/a-rollout")]
    verdict = G.judge(found, accepted)
    assert verdict.new == (found[1],)  # accepted for another resource only: still new
    assert verdict.accepted == (found[0], found[2])
    assert verdict.stale == (("CKV_K8S_43", "Deployment/gone"),)
    text = G.format_verdict(verdict, {"examples/job.yaml": "asyncrl render examples/job.yaml"}, "list.yaml")
    assert "NEW    CKV_K8S_43  Deployment/a-rollout  in examples/job.yaml (asyncrl render examples/job.yaml)" in text
    assert "STALE  CKV_K8S_43  Deployment/gone" in text and "scan: FAILED" in text
    assert G.judge(found[:1], accepted[:1]).ok is False  # the unused pattern alone fails the gate


@pytest.mark.parametrize("entry, message", [
    ({"check": "CKV_K8S_8", "resources": ["Deployment/x"], "reason": " "}, "a reason is required"),
    ({"check": "CKV_K8S_8", "resources": [], "reason": "r"}, "non-empty list"),
    ({"check": "K8S_8", "resources": ["Deployment/x"], "reason": "r"}, "not a checkov id"),
    ({"check": "CKV_K8S_8", "resource": "Deployment/x", "reason": "r"}, "exactly the keys"),
])
def test_an_entry_without_check_resources_or_reason_is_refused(entry, message):
    with pytest.raises(G.ScanError, match=message):
        G.parse_accepted({"checkov": "1", "accepted": [entry]})


def test_checkov_report_parsing():
    report = [{"check_type": "kubernetes", "summary": {"passed": 3, "failed": 1, "parsing_errors": 0,
                                                       "resource_count": 2, "checkov_version": "9.9"},
               "results": {"passed_checks": [{"check_id": "CKV_K8S_1", "resource": "Pod.ns.a.b",
                                              "file_path": "/chart/defaults.yaml"}],
                           "failed_checks": [{"check_id": "CKV_K8S_16", "resource": "Pod.ns.a.b",
                                              "file_path": "/extra/x.yaml", "check_name": "privileged"}]}}]
    assert G.parse_findings(report) == [G.Finding("CKV_K8S_16", "Pod/a.b", "extra/x.yaml", "privileged")]
    assert G.scanned_files(report) == {"chart/defaults.yaml", "extra/x.yaml"}
    G.check_report(report, ["extra/x.yaml"], "9.9")
    with pytest.raises(G.ScanError, match=re.escape("ran no check on examples/job.yaml")):
        G.check_report(report, ["extra/x.yaml", "examples/job.yaml"], "9.9")
    with pytest.raises(G.ScanError, match=re.escape("reviewed with checkov 1.0")):
        G.check_report(report, [], "1.0")


def test_the_committed_list_is_valid_and_names_the_pinned_checkov():
    accepted = G.parse_accepted(yaml.safe_load(G.ACCEPTED_FILE.read_text()))
    pin = re.search(r'^CHECKOV_VERSION="([^"]+)"', (REPO / "scripts" / "install-checkov.sh").read_text(), re.M)
    assert pin and accepted.checkov_version == pin.group(1)
    assert "install-checkov.sh" in (REPO / "scripts" / "setup.sh").read_text()
