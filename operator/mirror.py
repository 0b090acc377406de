"""Mirror the trainer's `GET /status` (asyncrl.status_report.TrainerReport) into the job's status.

The trainer knows step, policy version, staleness and reward; Kubernetes users look at
`kubectl get asyncrljobs`. A timer in the operator fetches the report and this module maps it onto
the status fields the printer columns show.
"""

from __future__ import annotations

from typing import Any

import httpx
from pydantic import ValidationError

from asyncrl.status_report import TrainerReport

DEFAULT_URL_TEMPLATE = "http://{service}.{namespace}.svc:{port}"


class MirrorError(RuntimeError):
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


def report_fields(report: TrainerReport, *, max_steps: int, staleness_limit: int) -> dict[str, Any]:
    """The status sub-objects (camelCase) that come from the trainer's report."""
    total = report.max_steps or max_steps
    percent = round(min(100.0, 100.0 * report.step / total), 2) if total else 0.0
    engines = [e.weight_version for e in report.rollout if e.weight_version is not None]
    trainer: dict[str, Any] = {"step": report.step, "policyVersion": report.policy_version}
    if report.last_checkpoint:
        trainer["lastCheckpoint"] = report.last_checkpoint
    progress: dict[str, Any] = {"percent": percent, "tokensPerSecond": round(report.tokens_per_second, 3)}
    if report.reward_mean is not None:
        progress["rewardMean"] = round(report.reward_mean, 6)
    rollout: dict[str, Any] = {}
    if engines:
        rollout["minWeightVersion"] = min(engines)
    return {
        "trainer": trainer,
        "staleness": {"mean": round(report.staleness.mean, 6), "max": report.staleness.max,
                      "limit": report.staleness.limit or staleness_limit, "dropped": report.staleness.dropped},
        "progress": progress,
        "rollout": rollout,
    }
