"""Jobs on the Kubernetes API emulator or a bare kube-apiserver (tests/support/bare_apiserver.py): the
example job, its expected children, and requests the way the tests make them (the operator under test
is a real `asyncrl operator` process)."""

from __future__ import annotations

from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from asyncrl.operator.kube import KINDS, allowed
from asyncrl.spec import GROUP, PLURAL, VERSION
from tests.support.bare_apiserver import BareApiserver
from tests.support.jobs import JobBuilder
from tests.support.kube_emulator import KubeEmulator

NS = "rl"
JOB = "qwen"
Api = KubeEmulator | BareApiserver


def assert_rbac_covers(api: Api) -> None:
    """Every request the operator made is in the PERMISSIONS table (which the chart's RBAC equals), and
    a real apiserver refused none as invalid or forbidden."""
    used = operator_requests(api)
    missing = sorted(u for u in used if not allowed(*u))
    assert not missing, f"operator used verbs not declared in PERMISSIONS: {missing}"
    if isinstance(api, BareApiserver):
        assert not api.refused(), f"the apiserver refused the operator: {api.refused()}"


def operator_requests(api: Api) -> set[tuple[str, str, str]]:
    """(group, resource, verb) of the operator's requests (not the test's client, not kubectl)."""
    if isinstance(api, BareApiserver):
        return {(r.group, r.resource, r.verb) for r in api.requests_of()}
    return {(r.group, r.resource, r.verb) for r in api.log if not r.agent.startswith(("kmock", "kubectl"))}


def phase(emu: Api, name: str = JOB) -> str | None:
    job = emu.get(PLURAL, NS, name)
    return (job or {}).get("status", {}).get("phase")


def expected_children(name: str = JOB, **spec_changes) -> list[tuple[str, str]]:
    from asyncrl.loader import parse_job

    job = parse_job(JobBuilder.example(**spec_changes).named(name, NS).doc())
    objs = B.build_children(job, B.BuildContext(owner_uid="x", namespace=NS))
    return [(KINDS[o["kind"]][2], o["metadata"]["name"]) for o in objs]


def children_exist(emu: Api, name: str = JOB):
    return all(emu.get(p, NS, n) for p, n in expected_children(name))


async def create_job(emu: Api, doc: dict) -> dict:
    async with emu.post(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", json=doc) as resp:
        assert resp.status == 201, await resp.text()
        return await resp.json()


async def patch_job(emu: Api, name: str, patch: dict, sub: str = "") -> dict:
    url = f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{name}" + (f"/{sub}" if sub else "")
    async with emu.patch(url, json=patch, headers={"Content-Type": "application/merge-patch+json"}) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def make_ready(emu: Api, name: str = JOB, rollout: int = 4) -> None:
    """Play kubelet + controllers: every workload reports its pods ready."""
    await emu.patch_status("apps", "v1", "deployments", NS, N.rollout(name),
                           {"replicas": rollout, "readyReplicas": rollout})
    await emu.patch_status("apps", "v1", "statefulsets", NS, N.trainer(name), {"replicas": 1, "readyReplicas": 1})
    await emu.patch_status("apps", "v1", "statefulsets", NS, N.redis(name), {"replicas": 1, "readyReplicas": 1})
