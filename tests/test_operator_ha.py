"""Two real operator processes (`asyncrl operator --leader-elect`) against the test cluster's API
server (tests/support/kube_emulator.py): exactly one reconciles, and the other takes over when it dies.

Each process has its own kubeconfig token, so the emulator's request log says which process sent
every request. "Reconciles" is anything but the Lease: creating children, patching a job's status,
watching jobs. A standby must send nothing but Lease requests.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import kmock
import pytest

from asyncrl.loader import parse_job
from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from asyncrl.operator.kube import KINDS, allowed
from asyncrl.spec import GROUP, PLURAL, VERSION
from tests.support.jobs import JobBuilder
from tests.support.kube_emulator import KubeEmulator
from tests.support.operator_process import OperatorProcess
from tests.support.polling import poll

REPO = Path(__file__).resolve().parent.parent
NS = "rl"
LEASE_NS = "asyncrl-system"
LEASE = ("--leader-elect", "--leader-election-namespace", LEASE_NS,
         "--lease-duration", "3", "--renew-deadline", "2", "--retry-period", "0.3")
LONG_LEASE = ("--leader-elect", "--leader-election-namespace", LEASE_NS,
              "--lease-duration", "60", "--renew-deadline", "40", "--retry-period", "0.3")
"""A Lease that cannot expire within a test's waits: whoever takes it over took it released."""
pytestmark = pytest.mark.slow


def children(name: str) -> list[tuple[str, str]]:
    job = parse_job(JobBuilder.example().named(name, NS).doc())
    ctx = B.BuildContext(owner_uid="x", namespace=NS)
    return [(KINDS[o["kind"]][2], o["metadata"]["name"]) for o in B.build_children(job, ctx)]


def reconciled(emu: KubeEmulator, name: str) -> bool:
    job = emu.get(PLURAL, NS, name) or {}
    return all(emu.get(p, NS, n) for p, n in children(name)) and bool((job.get("status") or {}).get("phase"))


def requests_of(emu: KubeEmulator, token: str, *, since: int = 0) -> list[tuple[str, str, str]]:
    return [(r.verb, r.group, r.resource) for r in emu.log[since:] if r.token == token]


def not_lease(reqs: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return [r for r in reqs if r[2] != "leases"]


def holder(emu: KubeEmulator) -> str | None:
    lease = emu.get("leases", LEASE_NS, "asyncrl-operator")
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


async def create_job(emu: KubeEmulator, name: str) -> None:
    doc = JobBuilder.example().named(name, NS).doc()
    async with emu.post(f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}", json=doc) as resp:
        assert resp.status == 201, await resp.text()


@pytest.fixture
async def emu():
    async with KubeEmulator() as e, kmock.Server(e):
        yield e


@pytest.fixture
async def pair(emu: KubeEmulator, tmp_path: Path, request: pytest.FixtureRequest):
    """Operator "a" (started first: it becomes the leader) and operator "b" (the standby), with the
    Lease settings LEASE (or the test's indirect parameter)."""
    lease = getattr(request, "param", LEASE)
    ops = {}
    for who in ("a", "b"):
        emu.kubeconfig(tmp_path / f"kubeconfig-{who}", token=f"token-{who}")
        ops[who] = OperatorProcess(tmp_path / f"kubeconfig-{who}", tmp_path / f"operator-{who}.log",
                                   extra_args=(*lease, "--leader-election-identity", f"operator-{who}"))
    await ops["a"].start()
    await poll(lambda: holder(emu) == "operator-a", what="a holds the Lease", log=ops["a"].log, timeout=60)
    await ops["b"].start()
    # b is up and polling the Lease (its first requests), and it did not get it.
    await poll(lambda: requests_of(emu, "token-b"), what="b polls the Lease", log=ops["b"].log, timeout=60)
    yield ops
    for op in ops.values():
        await op.stop()
    used = {(r.group, r.resource, r.verb) for r in emu.log if r.token.startswith("token-")}
    assert not [u for u in used if not allowed(*u)], "every request is in PERMISSIONS (and so in the chart)"


async def test_only_the_leader_reconciles_and_the_standby_takes_over_when_it_is_killed(emu, pair):
    a, b = pair["a"], pair["b"]
    await create_job(emu, "first")
    await poll(lambda: reconciled(emu, "first"), what="the job reconciled", log=a.log)
    await asyncio.sleep(2.0)  # several of b's retry periods and a's status passes
    assert holder(emu) == "operator-a"
    assert {"create", "patch", "watch"} <= {v for v, _, _ in not_lease(requests_of(emu, "token-a"))}
    assert not_lease(requests_of(emu, "token-b")) == [], "the standby sent nothing but Lease requests"
    assert {v for v, _, _ in requests_of(emu, "token-b")} <= {"get"}, "the standby never wrote the held Lease"

    # SIGKILL: no release. b must wait out the lease duration (from the last renewal it saw).
    killed = time.monotonic()
    await a.stop(kill=True)
    await asyncio.sleep(0.2)  # requests a had already sent when it died may still be read and logged
    mark = len(emu.log)
    await poll(lambda: holder(emu) == "operator-b", what="b takes the Lease", log=b.log, timeout=30)
    took = time.monotonic() - killed
    assert took >= 3.0 - 0.3 - 0.1, f"b took an unexpired Lease after {took:.1f}s"
    lease = emu.get("leases", LEASE_NS, "asyncrl-operator")
    assert lease["spec"]["leaseTransitions"] == 1

    # b reconciles now: a new job gets its children and status from b, and a sent nothing more.
    await create_job(emu, "second")
    await poll(lambda: reconciled(emu, "second"), what="b reconciles the new job", log=b.log)
    writes_b = {(v, res) for v, _, res in not_lease(requests_of(emu, "token-b", since=mark))}
    assert {("create", "deployments"), ("patch", f"{PLURAL}/status")} <= writes_b
    assert requests_of(emu, "token-a", since=mark) == []


@pytest.mark.parametrize("pair", [LONG_LEASE], indirect=True, ids=["60s-lease"])
async def test_a_stopped_leader_hands_the_lease_over_at_once(emu, pair):
    """With a 60 s Lease, b can hold it within the wait below only if a released it on SIGTERM
    (expiry would take a minute): no clock on our side decides."""
    a, b = pair["a"], pair["b"]
    await create_job(emu, "first")
    await poll(lambda: reconciled(emu, "first"), what="the job reconciled", log=a.log)
    await a.stop()  # SIGTERM: kopf stops, then the Lease is released
    assert a.proc is not None and a.proc.returncode == 0, a.log.read_text()[-2000:]
    await poll(lambda: holder(emu) == "operator-b", what="b takes the released Lease", log=b.log, timeout=30)
    mark = len(emu.log)
    async with emu.delete(f"/apis/apps/v1/namespaces/{NS}/deployments/{N.rollout('first')}") as resp:
        assert resp.status == 200
    await poll(lambda: emu.get("deployments", NS, N.rollout("first")), what="b re-creates the Deployment",
                   log=b.log)
    assert ("create", "deployments") in {(v, res) for v, _, res in requests_of(emu, "token-b", since=mark)}


async def test_a_leader_that_cannot_renew_exits_before_the_lease_can_expire(emu, pair):
    """The fencing half of "never both": renewals are held at the API server (a partition), and the
    leader must be gone within its renew deadline (2 s), before a standby may take the Lease (3 s
    after the last renewal it saw)."""
    a, b = pair["a"], pair["b"]
    gate = emu.gates[("update", "leases")] = asyncio.Event()
    held = time.monotonic()
    assert a.proc is not None
    await asyncio.wait_for(a.proc.wait(), 10)
    gone = time.monotonic() - held
    assert a.proc.returncode == 3, a.log.read_text()[-2000:]
    assert gone < 2.0 + 0.6, f"the leader ran {gone:.1f}s without renewing"
    assert "leadership lost" in a.log.read_text()
    assert holder(emu) == "operator-a", "nobody took the Lease meanwhile (writes are held)"
    gate.set()
    del emu.gates[("update", "leases")]
    await poll(lambda: holder(emu) == "operator-b", what="b takes over", log=b.log, timeout=30)
    await create_job(emu, "after")
    await poll(lambda: reconciled(emu, "after"), what="b reconciles", log=b.log)
