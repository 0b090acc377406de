"""The Helm chart with a real helm binary: lint, template several value sets, validate every object."""

from __future__ import annotations

import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from asyncrl.operator.names import OPERATOR_POD_LABELS
from tests.support.paths import REPO

CHART = REPO / "charts" / "asyncrl"
HELM = REPO / ".tools" / "bin" / "helm"
K8S_VERSIONS = ["1.29.0", kubernetes_validate.latest_version()]

VALUE_SETS = {
    "defaults": [],
    "namespaced-debug": ["--set", "watchNamespaces={team-a,team-b}", "--set", "logLevel=debug",
                         "--set-json", "statusInterval=2.5"],
    "monitoring": ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.port=9400",
                   "--set", "image.tag=v9", "--set", "serviceAccount.name=asyncrl-sa"],
    "no-metrics-no-sa": ["--set", "metrics.enabled=false", "--set", "serviceAccount.create=false",
                         "--set", "serviceAccount.name=asyncrl-operator",
                         "--set", "rbac.create=false", "--set", "nodeSelector.pool=cpu"],
}


@pytest.fixture(scope="session")
def helm() -> Path:
    if not HELM.exists():
        subprocess.run([str(REPO / "scripts" / "install-k8s-tools.sh")], check=True)
    return HELM


def run_helm(helm: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(helm), *args], capture_output=True, text=True, timeout=120)


def template(helm: Path, *values: str) -> list[dict]:
    res = run_helm(helm, "template", "asyncrl", str(CHART), "--namespace", "asyncrl-system", "--include-crds", *values)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def test_lint_strict(helm):
    res = run_helm(helm, "lint", "--strict", str(CHART))
    assert res.returncode == 0, res.stdout + res.stderr


@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_every_rendered_object_is_valid(helm, name):
    objs = template(helm, *VALUE_SETS[name])
    kinds = {o["kind"] for o in objs}
    assert {"CustomResourceDefinition", "Deployment"} <= kinds
    for obj in objs:
        if obj["kind"] == "ServiceMonitor":  # a CRD of prometheus-operator: not in the schemas
            assert obj["spec"]["endpoints"][0]["port"] == "metrics"
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    deploy = next(o for o in objs if o["kind"] == "Deployment")
    # Leader election (default on) lets a rollout start the new pod before the old one stops.
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    args = deploy["spec"]["template"]["spec"]["containers"][0]["args"]
    if name == "namespaced-debug":
        assert "--namespace=team-a" in args and "--namespace=team-b" in args and "--verbose" in args
    if name == "no-metrics-no-sa":
        assert "--metrics-port=0" in args and not any(o["kind"] == "ClusterRole" for o in objs)


def test_crd_in_chart_is_the_generated_crd():
    assert (CHART / "crds" / "asyncrljob.yaml").read_text() == (REPO / "crds" / "asyncrljob.yaml").read_text()


def test_operator_pod_carries_the_labels_that_job_policies_admit(helm):
    """Each job's Redis and trainer NetworkPolicies admit pods with OPERATOR_POD_LABELS (the operator
    reads the trainer's outcome in Redis and its report on the status port): the chart's operator pod
    must carry them."""
    deployment = next(o for o in template(helm) if o["kind"] == "Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert OPERATOR_POD_LABELS.items() <= labels.items()


def test_the_operator_pod_admits_only_metrics_scrapers_from_the_listed_peers(helm):
    """/metrics names every tenant's jobs: the chart's NetworkPolicy on the operator pod admits the
    metrics port from `networkPolicy.metricsFrom` (default: the release's namespace) and nothing else;
    an empty list, or metrics off, admits nothing."""
    def policy(*values: str) -> dict:
        return next(o for o in template(helm, *values) if o["kind"] == "NetworkPolicy")

    default = policy()
    deployment = next(o for o in template(helm) if o["kind"] == "Deployment")
    assert default["metadata"]["namespace"] == "asyncrl-system"
    assert default["spec"]["podSelector"]["matchLabels"].items() <= \
        deployment["spec"]["template"]["metadata"]["labels"].items()
    assert default["spec"]["policyTypes"] == ["Ingress"]
    assert default["spec"]["ingress"] == [{"from": [{"podSelector": {}}],
                                           "ports": [{"protocol": "TCP", "port": 9090}]}]
    monitoring = policy("--set", "networkPolicy.metricsFrom[0].namespaceSelector.matchLabels."
                        "kubernetes\\.io/metadata\\.name=monitoring", "--set", "metrics.port=9100")
    assert monitoring["spec"]["ingress"] == [
        {"from": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
         "ports": [{"protocol": "TCP", "port": 9100}]}]
    assert policy("--set", "networkPolicy.metricsFrom=null")["spec"]["ingress"] == []
    assert policy("--set", "metrics.enabled=false")["spec"]["ingress"] == []
    assert not any(o["kind"] == "NetworkPolicy" for o in template(helm, "--set", "networkPolicy.enabled=false"))


def test_notes_tell_the_next_command(helm):
    res = run_helm(helm, "install", "asyncrl", str(CHART), "--dry-run=client", "--namespace", "ops")
    assert res.returncode == 0, res.stderr
    assert "kubectl apply -f examples/job.yaml" in res.stdout
    assert "kubectl get asyncrljobs" in res.stdout


@pytest.mark.parametrize("bad", [
    ["--set", "image.pullPolicy=Sometimes"],
    ["--set", "statusInterval=0"],
    ["--set", "watchNamespaces={Not_A_Namespace}"],
    ["--set", "metrics.port=70000"],
    ["--set", "unknownKey=1"],
    ["--set", "logLevel=trace"],
    ["--set", "image.digest=sha256:abc"],
    ["--set", "image.digest=ghcr.io/asyncrl/operator@sha256:" + "a" * 64],
    ["--set", "jobImages.trainer=ghcr.io/asyncrl/trainer@sha256:" + "A" * 64],
    ["--set", "jobImages.rollout=Not An Image"],
    ["--set", "serviceAccount.create=false"],  # (its RBAC would go to the namespace's default account)
    ["--set", "serviceAccount.create=false", "--set", "serviceAccount.name="],
])
def test_bad_values_are_rejected_by_the_schema(helm, bad):
    res = run_helm(helm, "template", "asyncrl", str(CHART), *bad)
    assert res.returncode != 0
    assert "values don't meet the specifications of the schema" in res.stderr or "schema" in res.stderr.lower()


DIGEST = "sha256:" + "0123456789abcdef" * 4


def test_images_can_be_pinned_by_digest(helm):
    """image.digest pins the operator (repository:tag@digest); jobImages take digests as written and
    the operator gets them verbatim (it keeps them intact in every pod it builds)."""
    objs = template(helm, "--set", f"image.digest={DIGEST}", "--set", "image.tag=0.1.0",
                    "--set", f"jobImages.trainer=registry.example.com/asyncrl/trainer@{DIGEST}",
                    "--set", f"jobImages.rollout=ghcr.io/asyncrl/rollout:0.1.0@{DIGEST}")
    container = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == f"ghcr.io/asyncrl/operator:0.1.0@{DIGEST}"
    assert f"--trainer-image=registry.example.com/asyncrl/trainer@{DIGEST}" in container["args"]
    assert f"--rollout-image=ghcr.io/asyncrl/rollout:0.1.0@{DIGEST}" in container["args"]
    unpinned = next(o for o in template(helm) if o["kind"] == "Deployment")
    assert "@" not in unpinned["spec"]["template"]["spec"]["containers"][0]["image"]
