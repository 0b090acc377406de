"""`kubectl get` columns and discovery short names of the test cluster's kinds."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.support.kube_cluster.objects import LOCAL_IP, Obj, is_terminating
from tests.support.kube_emulator import KubeEmulator


def _pod_cells(pod: Obj) -> list[Any]:
    """READY, STATUS, RESTARTS as kubectl computes them for `kubectl get pods`."""
    status = pod.get("status") or {}
    statuses = status.get("containerStatuses") or []
    total = len((pod.get("spec") or {}).get("containers") or [])
    reason = status.get("reason") or status.get("phase") or "Pending"
    running = False
    for cs in reversed(statuses):
        state = cs.get("state") or {}
        if (state.get("waiting") or {}).get("reason"):
            reason = state["waiting"]["reason"]
        elif "terminated" in state:
            term = state["terminated"]
            reason = term.get("reason") or f"ExitCode:{term.get('exitCode')}"
        elif "running" in state and cs.get("ready"):
            running = True
    if reason == "Completed" and running:
        reason = "Running"
    if is_terminating(pod):
        reason = "Terminating"
    ready = sum(bool(cs.get("ready")) for cs in statuses)
    return [f"{ready}/{total}", reason, sum(int(cs.get("restartCount") or 0) for cs in statuses)]


def _deployment_cells(d: Obj) -> list[Any]:
    status = d.get("status") or {}
    return [f"{status.get('readyReplicas', 0)}/{(d.get('spec') or {}).get('replicas', 1)}",
            status.get("updatedReplicas", 0), status.get("availableReplicas", 0)]


def _statefulset_cells(s: Obj) -> list[Any]:
    return [f"{(s.get('status') or {}).get('readyReplicas', 0)}/{(s.get('spec') or {}).get('replicas', 1)}"]


def _service_cells(s: Obj) -> list[Any]:
    spec = s.get("spec") or {}
    ports = ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in spec.get("ports") or [])
    return [spec.get("type", "ClusterIP"), spec.get("clusterIP", LOCAL_IP), "<none>", ports or "<none>"]


def _claim_cells(c: Obj) -> list[Any]:
    return [(c.get("status") or {}).get("phase", "Pending"),
            ((c.get("status") or {}).get("capacity") or {}).get("storage", "")]


def _selector_text(selector: Obj | None) -> str:
    """A label selector as kubectl prints it (`metav1.FormatLabelSelector`): `k=v,k2=v2`, `k in (a,b)`."""
    selector = selector or {}
    parts = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        op, values = expr.get("operator", ""), ",".join(expr.get("values") or [])
        parts.append({"In": f"{expr['key']} in ({values})", "NotIn": f"{expr['key']} notin ({values})",
                      "Exists": expr["key"], "DoesNotExist": f"!{expr['key']}"}.get(op, f"{expr['key']} {op}"))
    return ",".join(parts) or "<none>"


def _network_policy_cells(np: Obj) -> list[Any]:
    return [_selector_text((np.get("spec") or {}).get("podSelector"))]


def _disruption_budget_cells(pdb: Obj) -> list[Any]:
    spec, status = pdb.get("spec") or {}, pdb.get("status") or {}
    return [spec.get("minAvailable", "N/A"), spec.get("maxUnavailable", "N/A"), status.get("disruptionsAllowed", 0)]


def _columns(*specs: tuple[str, str]) -> list[Obj]:
    return [{"name": n, "type": t, "format": "", "description": n} for n, t in specs]


# Discovery short names and the `all` category, as a real API server lists them (`kubectl get deploy,sts`).
SHORT_NAMES: dict[str, tuple[set[str], bool]] = {
    "v1/pods": ({"po"}, True), "v1/services": ({"svc"}, True), "v1/persistentvolumeclaims": ({"pvc"}, False),
    "v1/configmaps": ({"cm"}, False), "v1/events": ({"ev"}, False), "v1/namespaces": ({"ns"}, False),
    "apps/v1/deployments": ({"deploy"}, True), "apps/v1/statefulsets": ({"sts"}, True),
    "networking.k8s.io/v1/networkpolicies": ({"netpol"}, False), "policy/v1/poddisruptionbudgets": ({"pdb"}, False),
}

PRINTERS: dict[str, tuple[list[Obj], Callable[[Obj], list[Any]]]] = {
    "pods": (_columns(("Ready", "string"), ("Status", "string"), ("Restarts", "integer")), _pod_cells),
    "deployments": (_columns(("Ready", "string"), ("Up-to-date", "integer"), ("Available", "integer")),
                    _deployment_cells),
    "statefulsets": (_columns(("Ready", "string")), _statefulset_cells),
    "services": (_columns(("Type", "string"), ("Cluster-IP", "string"), ("External-IP", "string"),
                          ("Port(s)", "string")), _service_cells),
    "persistentvolumeclaims": (_columns(("Status", "string"), ("Capacity", "string")), _claim_cells),
    # stored and listed, not enforced (package doc): `kubectl get netpol,pdb` shows what a job asked for
    "networkpolicies": (_columns(("Pod-Selector", "string")), _network_policy_cells),
    "poddisruptionbudgets": (_columns(("Min Available", "string"), ("Max Unavailable", "string"),
                                      ("Allowed Disruptions", "integer")), _disruption_budget_cells),
}


def register_kubectl_tables(emu: KubeEmulator) -> None:
    """Give `kubectl get` on `emu` the columns, short names and `all` category above (idempotent): what
    a cluster shows; also for tests that need the tables but run no pods."""
    printers = getattr(emu, "printers", None)
    if isinstance(printers, dict):
        printers.update(PRINTERS)
    for key, (short, in_all) in SHORT_NAMES.items():
        info = emu.resources[key]
        info.shortnames.update(short)
        if in_all:
            info.categories.add("all")
