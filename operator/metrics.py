"""Prometheus metrics of the operator: jobs by phase, reconcile errors, per-job step and staleness.

A private registry (not the process-global one) so tests and the operator never see each other's
series; `serve(port)` exposes it next to kopf's liveness endpoint.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, start_http_server

from asyncrl.api.spec import PHASES

REGISTRY = CollectorRegistry()
JOBS_BY_PHASE = Gauge("asyncrl_jobs", "AsyncRLJobs by phase", ["phase"], registry=REGISTRY)
RECONCILE_ERRORS = Counter("asyncrl_reconcile_errors", "Failed reconcile attempts", ["kind"], registry=REGISTRY)
RECONCILES = Counter("asyncrl_reconciles", "Reconcile passes", registry=REGISTRY)
STATUS_CONFLICTS = Counter("asyncrl_status_conflicts", "Status writes refused (409) because the job had changed",
                           registry=REGISTRY)
OUTCOME_READ_ERRORS = Counter("asyncrl_outcome_read_errors",
                              "Passes that could not read a trainer's outcome record from Redis", registry=REGISTRY)
JOB_STEP = Gauge("asyncrl_job_step", "Trainer step of a job", ["namespace", "job"], registry=REGISTRY)
JOB_VERSION = Gauge("asyncrl_job_policy_version", "Policy version of a job", ["namespace", "job"], registry=REGISTRY)
JOB_STALENESS = Gauge("asyncrl_job_staleness_mean", "Mean token staleness of a job's last step",
                      ["namespace", "job"], registry=REGISTRY)
JOB_STALENESS_MAX = Gauge("asyncrl_job_staleness_max", "Max token staleness of a job's last step",
                          ["namespace", "job"], registry=REGISTRY)

_phases: dict[tuple[str, str], str] = {}


def record_status(namespace: str, job: str, status: dict) -> None:
    """Update every per-job series from a freshly written status."""
    _phases[(namespace, job)] = status.get("phase", "Pending")
    _refresh_phases()
    trainer = status.get("trainer") or {}
    staleness = status.get("staleness") or {}
    JOB_STEP.labels(namespace, job).set(trainer.get("step", 0))
    JOB_VERSION.labels(namespace, job).set(trainer.get("policyVersion", 0))
    JOB_STALENESS.labels(namespace, job).set(staleness.get("mean", 0.0))
    JOB_STALENESS_MAX.labels(namespace, job).set(staleness.get("max", 0))


def forget(namespace: str, job: str) -> None:
    """Drop a deleted job's series."""
    _phases.pop((namespace, job), None)
    _refresh_phases()
    for gauge in (JOB_STEP, JOB_VERSION, JOB_STALENESS, JOB_STALENESS_MAX):
        try:
            gauge.remove(namespace, job)
        except KeyError:
            pass


def _refresh_phases() -> None:
    for phase in PHASES:
        JOBS_BY_PHASE.labels(phase).set(sum(1 for p in _phases.values() if p == phase))


def serve(port: int, addr: str = "0.0.0.0") -> None:
    """Expose /metrics on `port` (0 = off) in a background thread."""
    if port:
        start_http_server(port, addr=addr, registry=REGISTRY)
