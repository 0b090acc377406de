"""Mirror the trainer's `GET /status` (asyncrl.status_report.TrainerReport) into the job's status.

The trainer knows step, policy version, staleness and reward; Kubernetes users look at
`kubectl get asyncrljobs`. The operator's status pass fetches the report and this module maps it
onto the status models (asyncrl.spec.AsyncRLJobStatus) whose fields the printer columns show.
"""

from __future__ import annotations

import httpx
from pydantic import ValidationError

from asyncrl.errors import OperatorError
from asyncrl.spec import AsyncRLJobSpec, AsyncRLJobStatus, ProgressStatus, StalenessStatus, TrainerStatus
from asyncrl.status_report import TrainerReport


class MirrorError(OperatorError, RuntimeError):
    """The status endpoint could not be read (message names the URL)."""


def status_endpoint(template: str, *, name: str, namespace: str, service: str, port: int) -> str:
    """Base URL of a job's status endpoint; the template lets an out-of-cluster operator reach it."""
    return template.format(name=name, namespace=namespace, service=service, port=port).rstrip("/")


async def fetch_report(base_url: str, *, token: str | None = None, timeout: float = 5.0) -> TrainerReport:
    """GET <base_url>/status and parse it; raise MirrorError on any failure."""
    url = f"{base_url}/status"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with httpx.AsyncClient(timeout=timeout) as client:
            resp = await client.get(url, headers=headers)
    except httpx.HTTPError as exc:
        raise MirrorError(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
    if resp.status_code != 200:
        raise MirrorError(f"GET {url} returned HTTP {resp.status_code}")
    try:
        return TrainerReport.model_validate(resp.json())
    except (ValueError, ValidationError) as exc:
        raise MirrorError(f"GET {url} returned a document that is not a trainer report: {exc}") from exc


def mirror_report(status: AsyncRLJobStatus, report: TrainerReport, spec: AsyncRLJobSpec) -> None:
    """Set the parts of `status` that come from the report: trainer, staleness, progress and
    rollout.minWeightVersion. The spec fills in what an early report may not know yet (max steps, eta)."""
    status.trainer = TrainerStatus(step=report.step, policy_version=report.policy_version,
                                   last_checkpoint=report.last_checkpoint or None)
    s = report.staleness
    status.staleness = StalenessStatus(mean=round(s.mean, 6), max=s.max, dropped=s.dropped,
                                       limit=s.limit or spec.staleness.max_head_offpolicyness)
    total = report.max_steps or spec.trainer.max_steps
    status.progress = ProgressStatus(
        percent=round(min(100.0, 100.0 * report.step / total), 2) if total else 0.0,
        tokens_per_second=round(report.tokens_per_second, 3),
        reward_mean=None if report.reward_mean is None else round(report.reward_mean, 6))
    engines = [e.weight_version for e in report.rollout if e.weight_version is not None]
    if engines:
        status.rollout.min_weight_version = min(engines)
