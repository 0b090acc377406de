"""Two real operator processes (`asyncrl operator --leader-elect`) against a real kube-apiserver
(tests/support/bare_apiserver.py): exactly one reconciles, and the other takes over when it dies.

Each process has a client certificate of its own, so the apiserver's audit log says which process sent
every request. "Reconciles" is anything but the Lease: creating children, patching a job's status,
watching jobs. A standby must send nothing but Lease requests. The partition test holds the leader's
renewals at the apiserver with a slow admission webhook (tests/support/admission_gate.py).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from asyncrl.api.spec import PLURAL
from asyncrl.operator import names as N
from asyncrl.operator.kube import allowed
from tests.support import operator_jobs
from tests.support.admission_gate import AdmissionGate, Rule
from tests.support.bare_apiserver import BareApiserver, bare_apiserver_fixture  # noqa: F401
from tests.support.jobs import JobBuilder
from tests.support.operator_jobs import NS, expected_children
from tests.support.operator_process import OperatorProcess
from tests.support.polling import poll

LEASE_NS = "asyncrl-system"
LEASE = ("--leader-elect", "--leader-election-namespace", LEASE_NS,
         "--lease-duration", "3", "--renew-deadline", "2", "--retry-period", "0.3")
LONG_LEASE = ("--leader-elect", "--leader-election-namespace", LEASE_NS,
              "--lease-duration", "60", "--renew-deadline", "40", "--retry-period", "0.3")
"""A Lease that cannot expire within a test's waits: whoever takes it over took it released."""
pytestmark = pytest.mark.slow


def reconciled(api: BareApiserver, name: str) -> bool:
    job = api.get(PLURAL, NS, name) or {}
    return all(api.get(p, NS, n) for p, n in expected_children(name)) and bool((job.get("status") or {}).get("phase"))


def requests_of(api: BareApiserver, who: str, *, since: int = 0) -> list[tuple[str, str, str]]:
    """(verb, group, resource) of operator `who`'s requests, from the `since`-th request of the log on."""
    return [(r.verb, r.group, r.resource) for r in api.log[since:] if r.user == f"operator-{who}" and r.resource]


def not_lease(reqs: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    return [r for r in reqs if r[2] != "leases"]


def holder(api: BareApiserver) -> str | None:
    lease = api.get("leases", LEASE_NS, "asyncrl-operator")
    return ((lease or {}).get("spec") or {}).get("holderIdentity")


async def create_job(api: BareApiserver, name: str) -> None:
    await operator_jobs.create_job(api, JobBuilder.example().named(name, NS).doc())


@pytest.fixture
async def pair(api: BareApiserver, tmp_path: Path, request: pytest.FixtureRequest):
    """Operator "a" (started first: it becomes the leader) and operator "b" (the standby), each with a
    client certificate of its own, with the Lease settings LEASE (or the test's indirect parameter)."""
    lease = getattr(request, "param", LEASE)
    api.cp.kubectl("create", "namespace", LEASE_NS, check=True)
    ops = {}
    for who in ("a", "b"):
        config = tmp_path / f"kubeconfig-{who}"
        api.kubeconfig(config, user=f"operator-{who}")
        ops[who] = OperatorProcess(config, tmp_path / f"operator-{who}.log",
                                   extra_args=(*lease, "--leader-election-identity", f"operator-{who}"))
    await ops["a"].start()
    await poll(lambda: holder(api) == "operator-a", what="a holds the Lease", log=ops["a"].log, timeout=60)
    await ops["b"].start()
    # b is up and polling the Lease (its first requests), and it did not get it.
    await poll(lambda: requests_of(api, "b"), what="b polls the Lease", log=ops["b"].log, timeout=60)
    yield ops
    for op in ops.values():
        await op.stop()
    used = {(g, res, v) for who in ("a", "b") for v, g, res in requests_of(api, who)}
    assert not [u for u in used if not allowed(*u)], "every request is in PERMISSIONS (and so in the chart)"
    for who in ("a", "b"):
        assert not api.refused(f"operator-{who}"), api.refused(f"operator-{who}")


async def test_only_the_leader_reconciles_and_the_standby_takes_over_when_it_is_killed(api, pair):
    a, b = pair["a"], pair["b"]
    await create_job(api, "first")
    await poll(lambda: reconciled(api, "first"), what="the job reconciled", log=a.log)
    await asyncio.sleep(2.0)  # several of b's retry periods and a's status passes
    assert holder(api) == "operator-a"
    assert {"create", "patch", "watch"} <= {v for v, _, _ in not_lease(requests_of(api, "a"))}
    assert not_lease(requests_of(api, "b")) == [], "the standby sent nothing but Lease requests"
    assert {v for v, _, _ in requests_of(api, "b")} <= {"get"}, "the standby never wrote the held Lease"

    # SIGKILL: no release. b must wait out the lease duration (from the last renewal it saw).
    killed = time.monotonic()
    await a.stop(kill=True)
    await asyncio.sleep(0.2)  # requests a had already sent when it died may still be read and logged
    mark = len(api.log)
    await poll(lambda: holder(api) == "operator-b", what="b takes the Lease", log=b.log, timeout=30)
    took = time.monotonic() - killed
    assert took >= 3.0 - 0.3 - 0.1, f"b took an unexpired Lease after {took:.1f}s"
    lease = api.get("leases", LEASE_NS, "asyncrl-operator")
    assert lease["spec"]["leaseTransitions"] == 1

    # b reconciles now: a new job gets its children and status from b, and a sent nothing more.
    await create_job(api, "second")
    await poll(lambda: reconciled(api, "second"), what="b reconciles the new job", log=b.log)
    writes_b = {(v, res) for v, _, res in not_lease(requests_of(api, "b", since=mark))}
    assert {("create", "deployments"), ("patch", f"{PLURAL}/status")} <= writes_b
    assert requests_of(api, "a", since=mark) == []


@pytest.mark.parametrize("pair", [LONG_LEASE], indirect=True, ids=["60s-lease"])
async def test_a_stopped_leader_hands_the_lease_over_at_once(api, pair):
    """With a 60 s Lease, b can hold it within the wait below only if a released it on SIGTERM
    (expiry would take a minute): no clock on our side decides."""
    a, b = pair["a"], pair["b"]
    await create_job(api, "first")
    await poll(lambda: reconciled(api, "first"), what="the job reconciled", log=a.log)
    await a.stop()  # SIGTERM: kopf stops, then the Lease is released
    assert a.proc is not None and a.proc.returncode == 0, a.log.read_text()[-2000:]
    await poll(lambda: holder(api) == "operator-b", what="b takes the released Lease", log=b.log, timeout=30)
    mark = len(api.log)
    async with api.delete(f"/apis/apps/v1/namespaces/{NS}/deployments/{N.rollout('first')}") as resp:
        assert resp.status == 200
    await poll(lambda: api.get("deployments", NS, N.rollout("first")), what="b re-creates the Deployment",
                   log=b.log)
    assert ("create", "deployments") in {(v, res) for v, _, res in requests_of(api, "b", since=mark)}


async def test_a_leader_that_cannot_renew_exits_before_the_lease_can_expire(api, pair):
    """The fencing half of "never both": the leader's renewals are held at the apiserver (a slow
    admission webhook: a partition), and the leader must be gone within its renew deadline (2 s) of
    the first held renewal, before a standby may take the Lease (3 s after the last renewal it saw)."""
    a, b = pair["a"], pair["b"]
    assert a.proc is not None
    rule = Rule("coordination.k8s.io", "leases", ("UPDATE",))
    async with AdmissionGate(api.cp, rule, frozenset({"operator-a"})) as gate:
        await poll(lambda: gate.held, what="a renewal held", log=a.log, timeout=30)
        held = time.monotonic()
        await asyncio.wait_for(a.proc.wait(), 10)
        gone = time.monotonic() - held
        assert a.proc.returncode == 3, a.log.read_text()[-2000:]
        assert gone < 2.0 + 0.6, f"the leader ran {gone:.1f}s without renewing"
        assert "leadership lost" in a.log.read_text()
        assert holder(api) == "operator-a", "nobody took the Lease meanwhile"
    await poll(lambda: holder(api) == "operator-b", what="b takes over", log=b.log, timeout=30)
    await create_job(api, "after")
    await poll(lambda: reconciled(api, "after"), what="b reconciles", log=b.log)
