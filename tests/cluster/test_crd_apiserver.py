"""The CRD, the chart and the examples against a real kube-apiserver (tests/support/control_plane.py).

Offline checks (test_crd.py, test_crd_cel.py, test_helm_chart.py) evaluate our schema and CEL with
libraries that approximate the apiserver; only the apiserver says whether it accepts the CRD (it
checks every `default` against the property's CEL rules), fills the defaults it declares, and
rejects a bad or changed job with our messages. Uses the real kubectl and helm.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

# The import registers the fixtures `control_plane` and `namespace`.
from pydantic import ValidationError

from asyncrl.api import spec as S
from asyncrl.api.crd import declared_cel_rules, structural_default
from tests.support.control_plane import ControlPlane, control_plane_fixture, find_tool, k8s_version, namespace_fixture  # noqa: F401
from tests.support.jobs import MODEL, JobBuilder
from tests.support.paths import REPO
from tests.support.polling import poll_sync
from tests.support.real_operator import chart_release_fixture, helm  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

CRD_FILE = REPO / "crds" / "asyncrljob.yaml"
CRD_NAME = f"{S.PLURAL}.{S.GROUP}"
EXAMPLES = sorted(p for p in (REPO / "examples").glob("*.yaml")
                  if any(d and d.get("kind") == S.KIND for d in yaml.safe_load_all(p.read_text())))

def get_json(cp: ControlPlane, *args: str, kubeconfig: Path | None = None) -> Any:
    return json.loads(cp.kubectl("get", *args, "-o", "json", kubeconfig=kubeconfig, check=True).stdout)


def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD_FILE.read_text())
    return dict(crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"])




def example_job(path: Path, namespace: str) -> dict[str, Any]:
    """The example's AsyncRLJob moved into `namespace` (kubectl refuses a file whose namespace differs)."""
    doc = next(d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == S.KIND)
    doc["metadata"]["namespace"] = namespace
    return dict(doc)


def create(cp: ControlPlane, obj: dict[str, Any]) -> subprocess.CompletedProcess[str]:
    return cp.kubectl("create", "-f", "-", stdin=json.dumps(obj))


def cel_message(rule_fragment: str) -> str:
    """The message of the one CEL rule whose expression contains `rule_fragment`."""
    (message,) = [m for _, rule, m in declared_cel_rules() if rule_fragment in rule]
    return message


@pytest.fixture(scope="module")
def crd(control_plane: ControlPlane) -> subprocess.CompletedProcess[str]:
    """The CRD applied as a user would (`kubectl apply -f crds/asyncrljob.yaml`), and Established."""
    res = control_plane.kubectl("apply", "-f", str(CRD_FILE))
    assert res.returncode == 0, f"the apiserver refused the CRD:\n{res.stderr}"
    # Polled, not `kubectl wait`: that errors out while the fresh CRD has no status.conditions yet.
    poll_sync(lambda: crd_condition(control_plane, "Established") == "True", what="the CRD to be Established")
    return res


def crd_condition(cp: ControlPlane, kind: str) -> str | None:
    conditions = get_json(cp, "crd", CRD_NAME).get("status", {}).get("conditions") or []
    return next((c["status"] for c in conditions if c["type"] == kind), None)


# ----------------------------------------------------------------------------------------- CRD


def test_the_crd_is_accepted_and_established(control_plane: ControlPlane, crd):
    assert f"customresourcedefinition.apiextensions.k8s.io/{CRD_NAME}" in crd.stdout
    assert crd_condition(control_plane, "Established") == "True"
    assert crd_condition(control_plane, "NamesAccepted") == "True"
    # Served under its names: discovery knows the short name and the `asyncrl` category.
    resources = control_plane.kubectl("api-resources", f"--api-group={S.GROUP}", "-o", "wide", check=True).stdout
    assert S.PLURAL in resources and S.SHORT_NAMES[0] in resources and "asyncrl" in resources
    # A second apply is a no-op: what the server stored is what the file says.
    again = control_plane.kubectl("apply", "-f", str(CRD_FILE), check=True)
    assert "unchanged" in again.stdout, again.stdout


# -------------------------------------------------------------------------------------- helm


def test_helm_sees_the_real_server_version(control_plane: ControlPlane, namespace: str, tmp_path: Path):
    """Helm renders with the server's version (.Capabilities.KubeVersion): a build without the
    version ldflags reports v0.0.0 and charts with a kubeVersion range would refuse it."""
    server = json.loads(control_plane.kubectl("version", "-o", "json", check=True).stdout)["serverVersion"]
    assert server["gitVersion"] == k8s_version()
    probe = tmp_path / "probe"
    (probe / "templates").mkdir(parents=True)
    major, minor = k8s_version().lstrip("v").split(".")[:2]
    (probe / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "probe", "version": "0.1.0", "kubeVersion": f">={major}.{minor}.0-0"}))
    (probe / "templates" / "seen.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: helm-saw\n"
        "data:\n  version: {{ .Capabilities.KubeVersion.Version | quote }}\n")
    res = helm(control_plane, "install", "probe", str(probe), "-n", namespace)
    assert res.returncode == 0, res.stderr
    seen = get_json(control_plane, "configmap", "helm-saw", "-n", namespace)["data"]["version"]
    assert seen == k8s_version()


def test_helm_install_of_the_chart(control_plane: ControlPlane, chart_release):
    namespace, res = chart_release
    assert res.returncode == 0, res.stderr
    status = json.loads(helm(control_plane, "status", "asyncrl", "-n", namespace, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"
    manifest = helm(control_plane, "get", "manifest", "asyncrl", "-n", namespace).stdout
    objects = [d for d in yaml.safe_load_all(manifest) if d]
    kinds = {o["kind"] for o in objects}
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "Service",
            "Deployment"} <= kinds
    # Every object the release rendered is on the server (NotFound fails `kubectl get -f`).
    stored = json.loads(control_plane.kubectl("get", "-n", namespace, "-f", "-", "-o", "json", stdin=manifest,
                                              check=True).stdout)["items"]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in stored) == \
        sorted((o["kind"], o["metadata"]["name"]) for o in objects)
    # The chart's CRD (crds/) is there and served.
    control_plane.kubectl("get", S.PLURAL, "-A", check=True)


def test_the_controllers_act_on_the_chart_deployment(control_plane: ControlPlane, chart_release):
    """The Deployment gets a ReplicaSet and a Pod from the real controllers, and the scheduler finds
    no node for it (this control plane has none)."""
    namespace, res = chart_release
    assert res.returncode == 0, res.stderr

    def replica_set() -> dict[str, Any] | None:
        items = get_json(control_plane, "replicasets", "-n", namespace)["items"]
        return items[0] if items else None

    rs = poll_sync(replica_set, what="the Deployment's ReplicaSet")
    assert [(o["kind"], o["name"]) for o in rs["metadata"]["ownerReferences"]] == [("Deployment", "asyncrl")]

    def unschedulable() -> dict[str, Any] | None:
        for pod in get_json(control_plane, "pods", "-n", namespace)["items"]:
            for cond in pod["status"].get("conditions", []):
                if cond["type"] == "PodScheduled" and cond.get("reason") == "Unschedulable":
                    return dict(pod)
        return None

    pod = poll_sync(unschedulable, what="the scheduler to mark the operator pod Unschedulable")
    assert pod["spec"]["serviceAccountName"] == "asyncrl"


def test_the_operator_service_account_has_what_the_chart_grants(control_plane: ControlPlane, chart_release):
    """Acting as the chart's ServiceAccount with a real token: RBAC allows the operator's requests
    and nothing more (Secrets are never listed)."""
    namespace, res = chart_release
    assert res.returncode == 0, res.stderr
    token = control_plane.kubectl("create", "token", "asyncrl", "-n", namespace, check=True).stdout.strip()
    as_operator = control_plane.token_kubeconfig(token, name="operator")
    who = json.loads(control_plane.kubectl("auth", "whoami", "-o", "json", kubeconfig=as_operator,
                                           check=True).stdout)
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:asyncrl"
    assert get_json(control_plane, S.PLURAL, "-A", kubeconfig=as_operator)["items"] == []
    denied = control_plane.kubectl("get", "secrets", "-A", kubeconfig=as_operator)
    assert denied.returncode != 0 and "Forbidden" in denied.stderr, denied.stderr

    def can(*args: str) -> str:
        return control_plane.kubectl("auth", "can-i", *args, kubeconfig=as_operator).stdout.strip()

    assert can("patch", f"{S.PLURAL}.{S.GROUP}", "--subresource=status", "-n", "anywhere") == "yes"
    assert can("create", "statefulsets.apps", "-n", "anywhere") == "yes"
    assert can("update", "leases.coordination.k8s.io", "-n", namespace) == "yes"
    assert can("update", "leases.coordination.k8s.io", "-n", "default") == "no"


# ------------------------------------------------------------------------------------- jobs


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_each_example_is_accepted_and_defaulted(control_plane: ControlPlane, crd, namespace: str, path: Path):
    """Created for real; the stored spec is the example with every declared default filled in,
    exactly as asyncrl.api.crd.structural_default (what the offline CEL tests evaluate) predicts."""
    obj = example_job(path, namespace)
    res = create(control_plane, obj)
    assert res.returncode == 0, res.stderr
    stored = get_json(control_plane, S.SINGULAR, obj["metadata"]["name"], "-n", namespace)
    expected = structural_default(obj["spec"], crd_schema()["properties"]["spec"])
    assert expected != obj["spec"]  # some default applies to every example
    assert stored["spec"] == expected


def test_a_minimal_job_gets_the_defaults_from_the_apiserver(control_plane: ControlPlane, crd, namespace: str):
    res = create(control_plane, JobBuilder.spec({"model": {"path": MODEL}}, "minimal", namespace).doc())
    assert res.returncode == 0, res.stderr

    def field(jsonpath: str) -> str:
        return control_plane.kubectl("get", S.SHORT_NAMES[0], "minimal", "-n", namespace,
                                     "-o", f"jsonpath={{{jsonpath}}}", check=True).stdout

    algorithm = S.AlgorithmSpec()
    assert field(".spec.algorithm.batchSize") == str(algorithm.batch_size)
    assert field(".spec.algorithm.groupSize") == str(algorithm.group_size)
    assert field(".spec.algorithm.loss") == algorithm.loss
    assert field(".spec.model.dtype") == S.ModelSpec(path="x").dtype


BAD_ALGORITHMS = {
    "batch-not-divisible": ({"batchSize": 30, "minibatches": 4}, "self.batchSize % self.minibatches"),
    "loglinear-with-ppo": ({"proximal": "loglinear", "loss": "ppo"}, "self.proximal != 'loglinear'"),
    "top-p": ({"topP": 0.9}, "self.topP == 1.0"),
}


@pytest.mark.parametrize("name", sorted(BAD_ALGORITHMS))
def test_a_bad_job_is_rejected_by_the_apiserver_with_our_message(control_plane: ControlPlane, crd,
                                                                  namespace: str, name: str):
    algorithm, rule = BAD_ALGORITHMS[name]
    spec = {"model": {"path": MODEL}, "algorithm": algorithm}
    res = create(control_plane, JobBuilder.spec(spec, name, namespace).doc())
    assert res.returncode != 0
    assert f'The {S.KIND} "{name}" is invalid' in res.stderr, res.stderr
    assert cel_message(rule) in res.stderr, res.stderr
    assert control_plane.kubectl("get", S.SINGULAR, name, "-n", namespace).returncode != 0
    # Offline (pydantic) refuses the same job and accepts it without the bad settings: the two agree.
    S.AsyncRLJob.model_validate(JobBuilder.spec({"model": spec["model"]}, name, namespace).doc())
    with pytest.raises(ValidationError):
        S.AsyncRLJob.model_validate(JobBuilder.spec(spec, name, namespace).doc())


IMMUTABLE_CHANGES: dict[str, dict[str, Any]] = {
    "spec.model": {"model": {"path": "Qwen/Qwen2.5-0.5B-Instruct"}},
    "spec.rollout.engine": {"rollout": {"engine": "hf"}},
    "spec.redis": {"redis": {"managed": {"storage": "30Gi"}}},
    "spec.storage": {"storage": {"size": "1Ti"}},
    "spec.algorithm.groupSize": {"algorithm": {"groupSize": 8}},
    "spec.algorithm.batchSize": {"algorithm": {"batchSize": 16}},
    "spec.trainer.lora": {"trainer": {"lora": {"rank": 8}}},
}
"""A valid change of each immutable field of examples/job.yaml (as merge patches of its spec)."""


def test_every_immutable_field_has_a_change_here():
    assert sorted(IMMUTABLE_CHANGES) == sorted(path for path, _ in S.IMMUTABLE_FIELDS)


@pytest.fixture
def cluster_job(control_plane: ControlPlane, crd, namespace: str) -> tuple[str, str]:
    """examples/job.yaml created in the test's namespace: (namespace, name)."""
    obj = example_job(REPO / "examples" / "job.yaml", namespace)
    res = create(control_plane, obj)
    assert res.returncode == 0, res.stderr
    return namespace, obj["metadata"]["name"]


@pytest.mark.parametrize("path", sorted(IMMUTABLE_CHANGES))
def test_a_change_of_an_immutable_field_is_refused(control_plane: ControlPlane, cluster_job, path: str):
    namespace, name = cluster_job
    message = dict(S.IMMUTABLE_FIELDS)[path]
    before = get_json(control_plane, S.SINGULAR, name, "-n", namespace)
    patch = json.dumps({"spec": IMMUTABLE_CHANGES[path]})
    res = control_plane.kubectl("patch", S.SINGULAR, name, "-n", namespace, "--type=merge", "-p", patch)
    assert res.returncode != 0
    assert message in res.stderr, res.stderr
    after = get_json(control_plane, S.SINGULAR, name, "-n", namespace)
    assert after["metadata"]["resourceVersion"] == before["metadata"]["resourceVersion"]


def test_a_change_of_a_mutable_field_is_accepted(control_plane: ControlPlane, cluster_job):
    namespace, name = cluster_job
    patch = json.dumps({"spec": {"trainer": {"maxSteps": 500}, "rollout": {"replicas": 2}}})
    control_plane.kubectl("patch", S.SINGULAR, name, "-n", namespace, "--type=merge", "-p", patch, check=True)
    spec = get_json(control_plane, S.SINGULAR, name, "-n", namespace)["spec"]
    assert (spec["trainer"]["maxSteps"], spec["rollout"]["replicas"]) == (500, 2)


# ------------------------------------------------------------------------------------ audit


def test_the_audit_log_records_job_requests_at_metadata_level(control_plane: ControlPlane, crd, namespace: str):
    res = create(control_plane, JobBuilder.spec({"model": {"path": MODEL}}, "audited", namespace).doc())
    assert res.returncode == 0, res.stderr

    def create_event() -> dict[str, Any] | None:
        for line in control_plane.audit_log.read_text().splitlines():
            event = json.loads(line)
            ref = event.get("objectRef", {})
            if (event["verb"] == "create" and ref.get("resource") == S.PLURAL
                    and ref.get("namespace") == namespace and ref.get("name") == "audited"):
                return dict(event)
        return None

    event = poll_sync(create_event, what="the audit event of the job's create", timeout=30)
    assert event["level"] == "Metadata" and event["stage"] == "ResponseComplete"
    assert event["user"]["username"] == "asyncrl-admin" and "system:masters" in event["user"]["groups"]
    assert event["responseStatus"]["code"] == 201
    assert "requestObject" not in event and "responseObject" not in event  # Metadata: no bodies
