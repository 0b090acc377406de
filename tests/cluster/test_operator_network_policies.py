"""A reconciled job's NetworkPolicies, as the real kube-apiserver stores them (the real operator process
on the real control plane, `kubectl get netpol` against it too).

Nothing here enforces a policy (no network plug-in runs): what is shown is that the apiserver accepts
them (its own validation and defaulting), that the operator creates them with selectors that match
the live workloads' pods and ports that are the containers' own, that kubectl lists them, and that a
hand-opened policy is closed again.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from tests.support.control_plane import ControlPlane, control_plane_fixture, namespace_fixture  # noqa: F401
from tests.support.jobs import JobBuilder
from tests.support.polling import poll_sync
from tests.support.real_operator import crd_fixture, get, running_operator  # noqa: F401

JOB = "qwen"
STATUS_PORT = 8123  # not the default: the trainer policy must follow the spec
pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.fixture
def operator(control_plane: ControlPlane, crd: None, namespace: str, tmp_path: Path) -> Iterator[Path]:
    with running_operator(control_plane, namespace, tmp_path, "--operator-namespace", OPERATOR_NS) as log:
        yield log


def create_job(cp: ControlPlane, namespace: str, doc: dict[str, Any]) -> None:
    doc["metadata"] = {"name": JOB, "namespace": namespace}
    cp.kubectl("create", "-f", "-", stdin=json.dumps(doc), check=True)


def policies(cp: ControlPlane, namespace: str) -> dict[str, dict]:
    return {p["metadata"]["name"]: p for p in (get(cp, "networkpolicies", "-n", namespace) or {"items": []})["items"]}


def wait_for_policies(cp: ControlPlane, namespace: str, operator_log: Path) -> dict[str, dict]:
    names = {N.redis_network_policy(JOB), N.trainer(JOB), N.rollout(JOB)}
    try:
        poll_sync(lambda: set(policies(cp, namespace)) == names
                  and get(cp, "deployment", N.rollout(JOB), "-n", namespace), timeout=60,
                  what="the job's three NetworkPolicies")
    except AssertionError:
        raise AssertionError(f"operator log:\n{operator_log.read_text()[-4000:]}") from None
    return policies(cp, namespace)


def selects(policy: dict, workload: dict) -> bool:
    """The policy's podSelector (matchLabels only, as ours are) matches the workload's pod template."""
    want = policy["spec"]["podSelector"]["matchLabels"]
    have = workload["spec"]["template"]["metadata"]["labels"]
    return want.items() <= have.items()


def admits(policy: dict, labels: dict, port: int) -> bool:
    """Would an ingress rule of the policy admit a pod of the policy's namespace with `labels` on `port`?
    (matchLabels peers; a namespaceSelector peer counts only with `anywhere`: see `admits_operator`.)"""
    for rule in policy["spec"].get("ingress") or []:
        ports = [p["port"] for p in rule.get("ports") or []]
        if ports and port not in ports:
            continue
        for peer in rule.get("from") or []:
            if "namespaceSelector" not in peer and peer["podSelector"]["matchLabels"].items() <= labels.items():
                return True
    return False


OPERATOR_NS = "asyncrl-ops"
"""The operator's own namespace (--operator-namespace): the only one the policies admit it from."""


def admits_operator(policy: dict, port: int) -> bool:
    """An ingress rule admits the operator's pod (its labels) from the operator's namespace, and only
    from there, on `port`."""
    return any(peer == {"namespaceSelector": {"matchLabels": {B.NAMESPACE_NAME_LABEL: OPERATOR_NS}},
                        "podSelector": {"matchLabels": N.OPERATOR_POD_LABELS}}
               for rule in policy["spec"].get("ingress") or []
               if port in [p["port"] for p in rule.get("ports") or []]
               for peer in rule.get("from") or [])


def test_reconciled_job_has_policies_that_close_engine_c10d_status_and_redis(control_plane: ControlPlane,
                                                                            namespace: str, operator: Path):
    cp = control_plane
    create_job(cp, namespace, JobBuilder.example(**{"trainer.statusPort": STATUS_PORT, "trainer.replicas": 2}).doc())
    stored = wait_for_policies(cp, namespace, operator)
    uid = get(cp, "asyncrljob", JOB, "-n", namespace)["metadata"]["uid"]
    for p in stored.values():
        assert p["metadata"]["ownerReferences"][0]["uid"] == uid, "the job owns it: it goes with the job"
        assert p["spec"]["policyTypes"] == ["Ingress"]

    redis, trainer, rollout = (get(cp, "statefulset", N.redis(JOB), "-n", namespace),
                               get(cp, "statefulset", N.trainer(JOB), "-n", namespace),
                               get(cp, "deployment", N.rollout(JOB), "-n", namespace))
    workloads = {"redis": redis, "trainer": trainer, "rollout": rollout}
    guards = {"redis": stored[N.redis_network_policy(JOB)], "trainer": stored[N.trainer(JOB)],
              "rollout": stored[N.rollout(JOB)]}
    for component, policy in guards.items():  # each selects its own workload's pods and no other's
        assert [c for c, w in workloads.items() if selects(policy, w)] == [component], policy["metadata"]["name"]

    pod_labels = {c: w["spec"]["template"]["metadata"]["labels"] for c, w in workloads.items()}
    stranger = {"app": "curious", N.LABEL_JOB: "another-job"}
    proxy = next(c for c in rollout["spec"]["template"]["spec"]["containers"] if c["name"] == "engine-proxy")
    engine_port = proxy["ports"][0]["containerPort"]
    trainer_container = trainer["spec"]["template"]["spec"]["containers"][0]
    trainer_ports = {p["name"]: p["containerPort"] for p in trainer_container["ports"]}
    assert trainer_ports == {"status": STATUS_PORT, "rdzv": B.RDZV_PORT}

    # The engine port: the trainer (and any pod of the job), not another job's pod, not the operator.
    assert admits(guards["rollout"], pod_labels["trainer"], engine_port)
    assert not admits(guards["rollout"], stranger, engine_port)
    assert not admits_operator(guards["rollout"], engine_port)
    assert not admits(guards["rollout"], pod_labels["trainer"], B.RDZV_PORT), "only the engine port is open"
    # The trainer: c10d and status from the job's pods; every port between ranks (NCCL); the operator on
    # the status port only; nothing from another job.
    for port in (B.RDZV_PORT, STATUS_PORT):
        assert admits(guards["trainer"], pod_labels["rollout"], port)
        assert not admits(guards["trainer"], stranger, port)
    assert admits(guards["trainer"], pod_labels["trainer"], 41234), "NCCL's ephemeral ports between ranks"
    assert not admits(guards["trainer"], pod_labels["rollout"], 41234)
    assert admits_operator(guards["trainer"], STATUS_PORT) and not admits_operator(guards["trainer"], B.RDZV_PORT)
    # Redis: as before, the job's pods and the operator, on 6379.
    assert admits(guards["redis"], pod_labels["trainer"], B.REDIS_PORT)
    assert admits_operator(guards["redis"], B.REDIS_PORT) and not admits(guards["redis"], stranger, B.REDIS_PORT)

    # Opened by hand (an ingress rule that admits everything): the operator closes it again.
    cp.kubectl("patch", "networkpolicy", N.trainer(JOB), "-n", namespace, "--type=merge",
               "-p", json.dumps({"spec": {"ingress": [{}]}}), check=True)
    closed = guards["trainer"]["spec"]
    poll_sync(lambda: (get(cp, "networkpolicy", N.trainer(JOB), "-n", namespace) or {}).get("spec") == closed,
              timeout=60, what="the opened trainer policy put back")

    rows = [line.split() for line in cp.kubectl("get", "netpol", "-n", namespace, check=True).stdout.splitlines()]
    assert rows[0] == ["NAME", "POD-SELECTOR", "AGE"]
    assert sorted(r[:2] for r in rows[1:]) == sorted(
        [name, ",".join(f"{k}={v}" for k, v in sorted(guards[c]["spec"]["podSelector"]["matchLabels"].items()))]
        for c, name in (("redis", N.redis_network_policy(JOB)), ("trainer", N.trainer(JOB)),
                        ("rollout", N.rollout(JOB))))


@pytest.mark.parametrize("transport", ["disk", "collective"])
def test_collective_weight_sync_opens_trainer_and_rollout_to_each_other_only(control_plane: ControlPlane,
                                                                             namespace: str, operator: Path,
                                                                             transport: str):
    """trainer.weightTransport collective: the engines dial the weight group's store on trainer pod 0
    (29600) and NCCL/Gloo then connect on ephemeral ports both ways, trainer to engine and engine to
    engine; so the stored policies admit every port between the job's trainer and rollout pods, and
    still nothing from another job or the operator. With disk nothing of that is open."""
    cp = control_plane
    create_job(cp, namespace, JobBuilder.example(**{"trainer.statusPort": STATUS_PORT, "trainer.replicas": 2,
                                                    "trainer.weightTransport": transport}).doc())
    stored = wait_for_policies(cp, namespace, operator)
    trainer_policy, rollout_policy = stored[N.trainer(JOB)], stored[N.rollout(JOB)]
    trainer = get(cp, "statefulset", N.trainer(JOB), "-n", namespace)
    rollout = get(cp, "deployment", N.rollout(JOB), "-n", namespace)
    labels = {c: w["spec"]["template"]["metadata"]["labels"] for c, w in (("trainer", trainer), ("rollout", rollout))}
    stranger = {N.LABEL_JOB: "another-job", N.LABEL_COMPONENT: "rollout"}
    collective = transport == "collective"

    trainer_container = trainer["spec"]["template"]["spec"]["containers"][0]
    trainer_ports = {p["name"]: p["containerPort"] for p in trainer_container["ports"]}
    headless = {p["name"]: p["port"] for p in get(cp, "service", N.trainer(JOB), "-n", namespace)["spec"]["ports"]}
    if collective:
        assert trainer_ports["weight-group"] == B.WEIGHT_GROUP_PORT == 29600
        assert headless == {"rdzv": B.RDZV_PORT, "weight-group": B.WEIGHT_GROUP_PORT}
    else:
        assert "weight-group" not in trainer_ports and headless == {"rdzv": B.RDZV_PORT}
    for port in (B.WEIGHT_GROUP_PORT, 41234):  # the store, an ephemeral NCCL/Gloo port
        assert admits(trainer_policy, labels["rollout"], port) == collective, ("engine -> trainer", port)
        assert admits(rollout_policy, labels["trainer"], port) == collective, ("trainer -> engine", port)
        assert admits(rollout_policy, labels["rollout"], port) == collective, ("engine -> engine", port)
        assert not admits(trainer_policy, stranger, port) and not admits(rollout_policy, stranger, port)
        assert not admits_operator(trainer_policy, port) and not admits_operator(rollout_policy, port)
    # what the disk transport admits holds either way
    assert admits(rollout_policy, labels["trainer"], B.ENGINE_PORT)
    assert not admits(rollout_policy, stranger, B.ENGINE_PORT)
    assert admits(trainer_policy, labels["trainer"], 41234), "rank to rank, as before"
