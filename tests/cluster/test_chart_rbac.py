"""The chart's RBAC is exactly what the operator uses: no call without a rule, no rule without a call.

Three sets are compared:
- what the chart grants the operator's ServiceAccount (real `helm template`, Roles and ClusterRoles
  followed through their bindings), per namespace ("*" = every namespace);
- asyncrl.operator.kube.PERMISSIONS, placed by scope (JOBS: the watched namespaces, OPERATOR: the
  release's namespace);
- the requests a real operator process (`asyncrl operator --leader-elect --namespace rl`) sends to a
  real kube-apiserver (tests/support/bare_apiserver.py; its audit log) in a scenario that takes every
  path (create, drift of every kind, a stale trainer gang, a deadline and a TTL deletion, leader
  election), plus what admission requires of it (`update` on the owner's `finalizers` for children
  that set blockOwnerDeletion).
"""

from __future__ import annotations

import asyncio
import subprocess
from pathlib import Path

import pytest
import yaml

from asyncrl.api.loader import parse_job
from asyncrl.api.spec import GROUP, PLURAL, VERSION
from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from asyncrl.operator.kube import JOBS, KINDS, OPERATOR, PERMISSIONS
from tests.support.bare_apiserver import BareApiserver, bare_apiserver_fixture  # noqa: F401
from tests.support.jobs import JobBuilder
from tests.support.operator_process import OperatorProcess
from tests.support.paths import REPO
from tests.support.polling import poll

CHART = REPO / "charts" / "asyncrl"
HELM = REPO / ".tools" / "bin" / "helm"
RELEASE_NS = "asyncrl-system"
NS = "rl"
Grant = tuple[str, str, str, str]  # (namespace or "*", group, resource, verb)


@pytest.fixture(scope="module")
def helm() -> Path:
    if not HELM.exists():
        subprocess.run([str(REPO / "scripts" / "install-k8s-tools.sh")], check=True)
    return HELM


def render(helm: Path, *values: str) -> list[dict]:
    res = subprocess.run([str(helm), "template", "asyncrl", str(CHART), "--namespace", RELEASE_NS, *values],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    return [d for d in yaml.safe_load_all(res.stdout) if d]


def granted(objs: list[dict], sa: str = "asyncrl") -> set[Grant]:
    """What the chart's bindings give the operator's ServiceAccount."""
    roles = {(o["kind"], o["metadata"].get("namespace", "*"), o["metadata"]["name"]): o
             for o in objs if o["kind"] in ("Role", "ClusterRole")}
    out: set[Grant] = set()
    for b in (o for o in objs if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        if not any(s["kind"] == "ServiceAccount" and s["name"] == sa and s["namespace"] == RELEASE_NS
                   for s in b["subjects"]):
            continue
        where = b["metadata"].get("namespace", "*")  # a RoleBinding grants only in its namespace
        ref = b["roleRef"]
        role = roles[(ref["kind"], "*" if ref["kind"] == "ClusterRole" else where, ref["name"])]
        for rule in role["rules"]:
            out |= {(where, g, r, v) for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}
    return out


def declared(watch: list[str]) -> set[Grant]:
    places = {JOBS: watch or ["*"], OPERATOR: [RELEASE_NS]}
    return {(ns, p.group, p.resource, v) for p in PERMISSIONS for ns in places[p.scope] for v in p.verbs}


@pytest.mark.parametrize("watch", [[], ["team-a", "team-b"]])
def test_chart_grants_exactly_the_permissions_table(helm, watch):
    values = ["--set", "watchNamespaces={" + ",".join(watch) + "}"] if watch else []
    objs = render(helm, *values)
    grants = granted(objs)
    assert grants == declared(watch)
    assert not any("*" in x for g in grants for x in g[1:]), "no wildcards"
    if watch:
        assert not [o["kind"] for o in objs if o["kind"].startswith("Cluster")], "namespaced: no ClusterRole"
        assert not [g for g in grants if g[0] == "*"], "namespaced: nothing granted cluster-wide"
    assert not [g for g in grants if g[2] == "secrets" and g[3] in ("list", "watch")], "Secrets by name only"


def test_without_leader_election_there_is_no_lease_rule(helm):
    grants = granted(render(helm, "--set", "leaderElection.enabled=false"))
    assert not [g for g in grants if g[2] == "leases"]


# ------------------------------------------------------------------ what a real operator calls


def admission_required() -> set[tuple[str, str, str]]:
    """`update` on <owner>/finalizers for every owner a child blocks the deletion of
    (OwnerReferencesPermissionEnforcement checks it at create/patch; the request log cannot show it)."""
    job = parse_job(JobBuilder.example().named("x", NS).doc())
    ctx = B.BuildContext(owner_uid="u", namespace=NS)
    out = set()
    for obj in B.build_children(job, ctx):
        for ref in obj["metadata"].get("ownerReferences") or []:
            if ref.get("blockOwnerDeletion"):
                group = ref["apiVersion"].rpartition("/")[0]
                out.add((group, f"{PLURAL}/finalizers", "update"))
    return out


async def make_ready(api: BareApiserver, name: str) -> None:
    n = JobBuilder.example().named(name, NS).doc()["spec"]["rollout"].get("replicas", 1)
    await api.patch_status("apps", "v1", "deployments", NS, N.rollout(name), {"replicas": n, "readyReplicas": n})
    for sts in (N.trainer(name), N.redis(name)):
        await api.patch_status("apps", "v1", "statefulsets", NS, sts,
                               {"replicas": 1, "readyReplicas": 1, "updateRevision": "rev-2"})


async def edit(api: BareApiserver, url: str, patch: dict) -> None:
    async with api.patch(url, json=patch, headers={"Content-Type": "application/merge-patch+json"}) as resp:
        assert resp.status == 200, await resp.text()


async def run_scenario(api: BareApiserver, op: OperatorProcess) -> None:
    doc = JobBuilder.example().named("main", NS).doc()
    async with api.post(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", json=doc) as resp:
        assert resp.status == 201
    job, ctx = parse_job(doc), B.BuildContext(owner_uid="u", namespace=NS)
    await poll(lambda: all(api.get(KINDS[o["kind"]][2], NS, o["metadata"]["name"])
                               for o in B.build_children(job, ctx)), what="every child", log=op.log)
    await make_ready(api, "main")
    await poll(lambda: (api.get(PLURAL, NS, "main") or {}).get("status", {}).get("phase") == "Running",
                   what="Running", log=op.log)
    # A trainer pod of an older template: the gang is restarted (pods list + delete).
    pod = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": f"{N.trainer('main')}-0", "namespace": NS,
                        "labels": {**N.selector_labels("main", "trainer"), N.LABEL_JOB: "main",
                                   "controller-revision-hash": "rev-1"}},
           "spec": {"containers": [{"name": "trainer", "image": "x"}]}}
    await api.put_object("", "v1", "pods", pod)
    await api.patch_status("", "v1", "pods", NS, pod["metadata"]["name"], {"phase": "Running"})
    await poll(lambda: api.get("pods", NS, pod["metadata"]["name"]) is None, what="gang restart", log=op.log)
    # A hand edit of every patchable kind is put back (patch).
    drift = {"configmaps": ("", N.config_map("main")), "services": ("", N.status_service("main")),
             "persistentvolumeclaims": ("", N.shared_pvc("main")), "deployments": ("apps", N.rollout("main")),
             "statefulsets": ("apps", N.trainer("main")),
             "networkpolicies": ("networking.k8s.io", N.redis_network_policy("main")),
             "poddisruptionbudgets": ("policy", N.trainer("main"))}
    for plural, (group, name) in drift.items():
        base = f"/apis/{group}/v1" if group else "/api/v1"
        await edit(api, f"{base}/namespaces/{NS}/{plural}/{name}", {"metadata": {"labels": {N.LABEL_JOB: "edited"}}})
    for plural, (_, name) in drift.items():
        await poll(lambda p=plural, n=name: (api.get(p, NS, n) or {}).get("metadata", {})
                       .get("labels", {}).get(N.LABEL_JOB) == "main", what=f"{plural} put back", log=op.log)
    # A job past its deadline fails, and its TTL deletes it (delete on asyncrljobs).
    short = JobBuilder.example(activeDeadlineSeconds=1, ttlSecondsAfterFinished=0).named("short", NS).doc()
    async with api.post(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", json=short) as resp:
        assert resp.status == 201
    await poll(lambda: api.get("deployments", NS, N.rollout("short")), what="short's children", log=op.log)
    await make_ready(api, "short")
    await poll(lambda: api.get(PLURAL, NS, "short") is None, what="TTL deletion", log=op.log, timeout=60)


@pytest.mark.slow
async def test_the_operator_calls_exactly_what_the_chart_grants(helm, api: BareApiserver, tmp_path: Path):
    api.cp.kubectl("create", "namespace", RELEASE_NS, check=True)
    api.kubeconfig(tmp_path / "kubeconfig")
    op = OperatorProcess(tmp_path / "kubeconfig", tmp_path / "operator.log", extra_args=(
        "--namespace", NS, "--leader-elect", "--leader-election-namespace", RELEASE_NS,
        "--lease-duration", "3", "--renew-deadline", "2", "--retry-period", "0.3"))
    await op.start()
    try:
        await run_scenario(api, op)
        await asyncio.sleep(1.0)  # a few more lease renewals and status passes
    finally:
        await op.stop()  # the release (update on the Lease) is a call too
    log = api.requests_of()
    assert not api.refused(), f"the apiserver refused the operator: {api.refused()}"
    used = {(r.group, r.resource, r.verb) for r in log} | admission_required()
    table = {(p.group, p.resource, v) for p in PERMISSIONS for v in p.verbs}
    assert sorted(used - table) == [], "calls without a rule in PERMISSIONS (and so in the chart)"
    assert sorted(table - used) == [], "rules that no call of the operator needs"
    # ...and in the namespaces the chart grants them in (`--namespace rl`, the Lease in RELEASE_NS).
    grants = granted(render(helm, "--set", f"watchNamespaces={{{NS}}}"))
    outside = sorted({(r.namespace, r.group, r.resource, r.verb) for r in log
                      if (r.namespace or "*", r.group, r.resource, r.verb) not in grants})
    assert outside == [], "requests the namespaced chart would refuse"
