"""The example job on a bare kube-apiserver (tests/support/bare_apiserver.py) as the operator tests make
and read it: its expected children, the requests the way the tests make them, and the status the
workloads' controllers would write (the operator under test is a real `asyncrl operator` process)."""

from __future__ import annotations

from asyncrl.api.spec import GROUP, PLURAL, VERSION
from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from asyncrl.operator.kube import KINDS, allowed
from tests.support.bare_apiserver import BareApiserver
from tests.support.jobs import JobBuilder

NS = "rl"
JOB = "qwen"


def assert_rbac_covers(api: BareApiserver) -> None:
    """Every request the operator made is in the PERMISSIONS table (which the chart's RBAC equals), and
    a real apiserver refused none as invalid or forbidden."""
    used = operator_requests(api)
    missing = sorted(u for u in used if not allowed(*u))
    assert not missing, f"operator used verbs not declared in PERMISSIONS: {missing}"
    assert not api.refused(), f"the apiserver refused the operator: {api.refused()}"


def operator_requests(api: BareApiserver) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of the operator's requests (not the test's client, not kubectl)."""
    return {(r.group, r.resource, r.verb) for r in api.requests_of()}


def phase(api: BareApiserver, name: str = JOB) -> str | None:
    job = api.get(PLURAL, NS, name)
    return (job or {}).get("status", {}).get("phase")


def expected_children(name: str = JOB, **spec_changes) -> list[tuple[str, str]]:
    from asyncrl.api.loader import parse_job

    job = parse_job(JobBuilder.example(**spec_changes).named(name, NS).doc())
    objs = B.build_children(job, B.BuildContext(owner_uid="x", namespace=NS))
    return [(KINDS[o["kind"]][2], o["metadata"]["name"]) for o in objs]


def children_exist(api: BareApiserver, name: str = JOB):
    return all(api.get(p, NS, n) for p, n in expected_children(name))


async def create_job(api: BareApiserver, doc: dict) -> dict:
    async with api.post(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", json=doc) as resp:
        assert resp.status == 201, await resp.text()
        return await resp.json()


async def patch_job(api: BareApiserver, name: str, patch: dict, sub: str = "") -> dict:
    url = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{name}" + (f"/{sub}" if sub else "")
    async with api.patch(url, json=patch, headers={"Content-Type": "application/merge-patch+json"}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def make_ready(api: BareApiserver, name: str = JOB, rollout: int = 4) -> None:
    """Play kubelet + controllers: every workload reports its pods ready."""
    await api.patch_status("apps", "v1", "deployments", NS, N.rollout(name),
                           {"replicas": rollout, "readyReplicas": rollout})
    await api.patch_status("apps", "v1", "statefulsets", NS, N.trainer(name), {"replicas": 1, "readyReplicas": 1})
    await api.patch_status("apps", "v1", "statefulsets", NS, N.redis(name), {"replicas": 1, "readyReplicas": 1})
