"""What the trainer says about itself, read into the job's status: its live `GET /status`
(asyncrl.api.status_report.TrainerReport) and its durable outcome record (asyncrl.api.outcome).

The trainer knows step, policy version, staleness and reward; Kubernetes users look at
`kubectl get asyncrljobs`. The operator's status pass fetches the report and this module maps it
onto the status models (asyncrl.api.spec.AsyncRLJobStatus) whose fields the printer columns show.

How a job ended is not left to the report alone: the trainer records a TrainerOutcome in the job's
Redis (keyed by the job's uid) and stays up serving it. `OutcomeReader` reads that record with one
cached client per job; Redis being unreachable is an answer too (`MirrorError`), after which the
operator falls back to /status.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import fnmatch
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import httpx
from pydantic import ValidationError
from redis.exceptions import RedisError

from asyncrl.api.outcome import TrainerOutcome
from asyncrl.api.spec import (
    AsyncRLJobSpec,
    AsyncRLJobStatus,
    EvaluationStatus,
    ProgressStatus,
    RecoveryStatus,
    StalenessStatus,
    TrainerStatus,
)
from asyncrl.api.status_report import EvalRecord, TrainerReport
from asyncrl.api.stream_names import StreamNames
from asyncrl.infra.errors import OperatorError
from asyncrl.transport.connection import make_client

DEFAULT_REDIS_URL_TEMPLATE = "redis://:{password}@{service}.{namespace}.svc:{port}/0"
"""How the operator reaches a job's managed Redis: its Service, with the password of its Secret."""


MAX_REPORT_BYTES = 4 * 1024 * 1024
"""The largest /status body the operator reads (a trainer's report is a few KiB): one job's pod must
not be able to make the operator, shared by every tenant, hold an arbitrary reply in memory."""
MAX_OUTCOME_BYTES = 256 * 1024
"""The largest outcome record the operator reads from a job's Redis (a record is well under 8 KiB)."""


class MirrorError(OperatorError, RuntimeError):
    """The status endpoint could not be read (message names the URL)."""


def status_endpoint(template: str, *, name: str, namespace: str, service: str, port: int) -> str:
    """Base URL of a job's status endpoint; the template lets an out-of-cluster operator reach it."""
    return template.format(name=name, namespace=namespace, service=service, port=port).rstrip("/")


async def fetch_report(base_url: str, *, token: str | None = None, timeout: float = 5.0,
                       max_bytes: int = MAX_REPORT_BYTES) -> TrainerReport:
    """GET <base_url>/status and parse it; raise MirrorError on any failure.

    Bounded whatever the pod does: `timeout` is a deadline for the whole exchange (httpx's own
    timeout applies to each read, which a reply dripping a byte at a time never trips), and the body
    is read in chunks and given up past `max_bytes`, announced or not."""
    url = f"{base_url}/status"
    # identity: a compressed body would be inflated past the limit before it could be counted
    headers = {"Accept-Encoding": "identity", **({"Authorization": f"Bearer {token}"} if token else {})}
    try:
        body = await asyncio.wait_for(_bounded_get(url, headers, timeout, max_bytes), timeout)
    except asyncio.TimeoutError:
        raise MirrorError(f"GET {url} did not complete within its {timeout:g}s deadline") from None
    except httpx.HTTPError as exc:
        raise MirrorError(f"GET {url} failed: {type(exc).__name__}: {exc}") from exc
    try:
        return TrainerReport.model_validate_json(body)
    except (ValueError, ValidationError) as exc:
        raise MirrorError(f"GET {url} returned a document that is not a trainer report: {exc}") from exc


async def _bounded_get(url: str, headers: dict[str, str], timeout: float, max_bytes: int) -> bytes:
    """The 200 body of GET `url`, at most `max_bytes` of it (MirrorError otherwise)."""
    async with httpx.AsyncClient(timeout=timeout) as client, client.stream("GET", url, headers=headers) as resp:
        if resp.status_code != 200:
            raise MirrorError(f"GET {url} returned HTTP {resp.status_code}")
        announced = resp.headers.get("content-length", "")
        if announced.isdigit() and int(announced) > max_bytes:
            raise MirrorError(f"GET {url} announced {int(announced)} bytes, over the operator's limit of "
                              f"{max_bytes} for a trainer report")
        body = bytearray()
        async for chunk in resp.aiter_bytes():
            body += chunk
            if len(body) > max_bytes:
                raise MirrorError(f"GET {url} sent over {max_bytes} bytes, the operator's limit for a trainer "
                                  "report; the rest was not read")
        return bytes(body)


def mirror_outcome(status: AsyncRLJobStatus, outcome: TrainerOutcome, spec: AsyncRLJobSpec) -> None:
    """The final step and policy version from the outcome record (it may be newer than the last
    report, or the only word from a trainer whose /status cannot be reached)."""
    kept = status.trainer if "trainer" in status.model_fields_set else TrainerStatus()
    if "trainer" not in status.model_fields_set or outcome.step >= kept.step:
        status.trainer = TrainerStatus(step=outcome.step, policy_version=max(outcome.policy_version, 0),
                                       last_checkpoint=kept.last_checkpoint)
    total = spec.trainer.max_steps
    percent = round(min(100.0, 100.0 * status.trainer.step / total), 2) if total else 0.0
    if "progress" in status.model_fields_set:
        status.progress = status.progress.model_copy(update={"percent": percent})
    else:
        status.progress = ProgressStatus(percent=percent)


def newest_evaluation(evaluations: list[EvalRecord]) -> EvalRecord | None:
    """The evaluation of the highest policy version (the latest of equals): results can arrive out
    of version order when several engines evaluate, and the column should show the newest model."""
    newest = None
    for record in evaluations:
        if newest is None or record.policy_version >= newest.policy_version:
            newest = record
    return newest


def evaluation_status(record: EvalRecord) -> EvaluationStatus:
    """One evaluation as the job's `status.evaluation`; summary "0.42@v14" is the `Eval` column."""
    return EvaluationStatus(
        policy_version=record.policy_version, reward_mean=round(record.reward_mean, 6),
        pass_at_1=round(record.pass_at_1, 6),
        pass_at_k=None if record.pass_at_k is None or record.k <= 1 else round(record.pass_at_k, 6),
        k=record.k, summary=f"{record.pass_at_1:.2f}@v{record.policy_version}")


def mirror_report(status: AsyncRLJobStatus, report: TrainerReport, spec: AsyncRLJobSpec) -> None:
    """Set the parts of `status` that come from the report: trainer, staleness, progress,
    rollout.minWeightVersion and, once there is one, the newest evaluation. The spec fills in what
    an early report may not know yet (max steps, eta). A report without evaluations leaves
    `status.evaluation` as it was (absent until the first; a restarted trainer's empty list does
    not erase the last one written)."""
    status.trainer = TrainerStatus(step=report.step, policy_version=report.policy_version,
                                   last_checkpoint=report.last_checkpoint or None)
    last, s = report.last_step, report.staleness
    status.staleness = StalenessStatus(mean=round(last.staleness_mean, 6) if last else 0.0,
                                       max=last.staleness_max if last else 0, dropped=s.dropped,
                                       limit=s.limit or spec.staleness.as_policy().version_bound)
    total = report.max_steps or spec.trainer.max_steps
    status.progress = ProgressStatus(
        percent=round(min(100.0, 100.0 * report.step / total), 2) if total else 0.0,
        tokens_per_second=round(last.tokens_per_second, 3) if last else 0.0,
        reward_mean=round(last.reward_mean, 6) if last else None)
    if last is not None:
        status.last_step = last.numbers()
    engines = [e.weight_version for e in report.rollout if e.weight_version is not None]
    if engines:
        status.rollout.min_weight_version = min(engines)
    newest = newest_evaluation(report.evaluations)
    if newest is not None:
        status.evaluation = evaluation_status(newest)
    status.recovery = RecoveryStatus.model_validate(report.recovery.model_dump())


RECOVERY_EVENTS: tuple[tuple[str, str, str, str], ...] = (
    # (status.recovery field, Event type, reason, what one more of it means)
    ("deadLettered", "Warning", "GroupsDeadLettered",
     "trajectory group(s) refused by the trainer; list them with `asyncrl dead-letters`"),
    ("driftLost", "Warning", "AdmissionDriftRepaired",
     "admission slot(s) given back: groups counted as produced that existed nowhere"),
    ("driftFound", "Normal", "AdmissionDriftRepaired", "published group(s) counted whose release never landed"),
    ("leasesReturned", "Normal", "LeasesReturned", "admission lease(s) of killed rollout workers returned"),
    ("rewardFailures", "Warning", "RewardsFailed",
     "trajectory group(s) dropped, never trained: a reward could not be computed (`asyncrl dead-letters` says why)"),
    ("episodeFailures", "Warning", "EpisodesFailed",
     "trajectory group(s) dropped, never trained: an episode function failed past its retries"),
    ("generationFailures", "Warning", "GenerationFailed",
     "trajectory group(s) dropped, never trained: a sample kept failing on its engine"),
    ("engineRequeues", "Warning", "GroupsRequeued",
     "trajectory group(s) interrupted by an engine that went away, their prompts queued again"),
    ("reclaimedEntries", "Normal", "EntriesReclaimed", "stream entries taken over from a dead trainer consumer"),
    ("fencedEngines", "Warning", "EngineFenced",
     "rollout engine(s) fenced after failed weight updates (retried in the background)"),
    ("trainerRestarts", "Warning", "TrainerRestarted",
     "trainer restart(s): it resumed from its last checkpoint, nothing acknowledged was lost"),
    ("engineRestarts", "Warning", "EngineRestarted",
     "rollout engine restart(s): the engine serves no rollout until it has the current weights"),
    ("engineResyncs", "Normal", "EngineResynced", "rollout engine(s) loaded with the current weights by the trainer"),
    ("ghostGroupsDropped", "Warning", "GhostGroupsDropped",
     "trajectory group(s) dropped: generated on weights a trainer restart threw away, never trained"),
)
QUIET_RECOVERY = ("recoveredEntries",)
"""status.recovery figures that send no Event: a lost read reply re-read is routine, nothing to act on."""


def recovery_events(old: dict[str, Any] | None, new: dict[str, Any] | None) -> list[tuple[str, str, str]]:
    """(type, reason, message) of an Event for each recovery figure of the job's status that grew
    between two writes (a figure that went down is a new trainer life starting over: no Event)."""
    out: list[tuple[str, str, str]] = []
    if not new:
        return out
    old = old or {}
    for key, kind, reason, what in RECOVERY_EVENTS:
        before, after = int(old.get(key) or 0), int(new.get(key) or 0)
        if after > before:
            out.append((kind, reason, f"{after - before} more {what} ({after} now)"))
    return out


# ----------------------------------------------------------------------------------- outcome record


@dataclass(frozen=True)
class RedisSettings:
    """How the operator reads a job's outcome record (from `asyncrl operator`'s flags)."""

    url_template: str = DEFAULT_REDIS_URL_TEMPLATE
    """URL of a managed Redis: {name} {namespace} {service} {port} {password}. An external Redis is
    reached at the URL in the job's Secret."""
    timeout: float = 3.0
    """Seconds for one read (connect included)."""
    external_hosts: tuple[str, ...] = ()
    """Host patterns (fnmatch: `*.redis.example.com`) an external Redis URL may name; empty: any host."""


def external_redis_url(url: str, allowed_hosts: tuple[str, ...] = ()) -> str:
    """The URL the operator itself uses for a job's external Redis (spec.redis.external.urlSecret):
    redis:// or rediss:// only (not unix://, a socket in the operator's own pod), a host the operator
    is allowed to reach (`allowed_hosts`, when set), and none of the URL's query options (they would
    set the operator's own client up: CA and key file paths of its filesystem, timeouts); the job's
    pods still get the whole URL. MirrorError names what is refused, without the password."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        raise MirrorError(f"the external Redis URL must start with redis:// or rediss://, got "
                          f"{parts.scheme + '://' if parts.scheme else 'no scheme'}")
    host = parts.hostname
    if not host:
        raise MirrorError("the external Redis URL names no host")
    if allowed_hosts and not any(fnmatch.fnmatch(host, pattern) for pattern in allowed_hosts):
        raise MirrorError(f"the external Redis host {host} is not one this operator may reach "
                          f"(--external-redis-hosts {','.join(allowed_hosts)})")
    try:
        port = parts.port or 6379
    except ValueError:
        raise MirrorError(f"the external Redis URL has a bad port for host {host}") from None
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@" if credentials else ""
    netloc += f"[{host}]" if ":" in host else host
    return urlunsplit((parts.scheme, f"{netloc}:{port}", parts.path, "", ""))


def managed_redis_url(template: str, *, name: str, namespace: str, service: str, port: int, password: str) -> str:
    return template.format(name=name, namespace=namespace, service=service, port=port,
                           password=quote(password, safe=""))


def secret_value(secret: dict[str, Any] | None, key: str) -> str | None:
    """One key of a Secret as the API server returns it (`data`, base64), or as written
    (`stringData`, which a real API server folds into `data`)."""
    if not secret:
        return None
    raw = (secret.get("data") or {}).get(key)
    if raw is not None:
        try:
            return base64.b64decode(raw, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
    value = (secret.get("stringData") or {}).get(key)
    return value if isinstance(value, str) else None


async def read_outcome_bounded(redis: Any, names: StreamNames, max_bytes: int) -> TrainerOutcome | None:
    """The recorded outcome (None: none yet), reading at most `max_bytes` + 1 of it (GETRANGE), so a
    value written over the record by anything holding the job's Redis password cannot make the
    operator fetch an arbitrary amount; MirrorError past the limit."""
    raw = await redis.getrange(names.outcome, 0, max_bytes)  # (inclusive: max_bytes + 1 bytes at most)
    if not raw:
        return None  # no record ("" for a missing key; an empty value is no record either)
    if len(raw) > max_bytes:
        raise MirrorError(f"the outcome record {names.outcome} is over {max_bytes} bytes, the operator's limit; "
                          "it was not read")
    return TrainerOutcome.from_json(raw)  # (unreadable: None, "not ended", as the trainer's own reader)


class OutcomeReader:
    """Reads jobs' outcome records, keeping one Redis client per job (by key) while it works.

    A failed read closes and forgets the job's client (and so its URL, which the caller rebuilds
    from the Secret on the next pass: the password may have changed) and raises MirrorError."""

    def __init__(self, settings: RedisSettings | None = None):
        self.settings = settings or RedisSettings()
        self._clients: dict[Any, tuple[str, Any]] = {}

    def url(self, key: Any) -> str | None:
        """The URL of the job's cached client (None: resolve it)."""
        entry = self._clients.get(key)
        return entry[0] if entry else None

    async def read(self, key: Any, url: str, names: StreamNames, job_uid: str) -> TrainerOutcome | None:
        """The job's recorded outcome, or None while training goes on. MirrorError when unreadable."""
        entry = self._clients.get(key)
        if entry is None or entry[0] != url:
            await self.forget(key)
            timeout = self.settings.timeout
            try:
                client = make_client(url, retries=1, socket_timeout=timeout, connect_timeout=timeout)
            except ValueError as exc:
                raise MirrorError(f"bad Redis URL for the outcome record: {exc}") from None
            entry = self._clients[key] = (url, client)
        try:
            outcome = await asyncio.wait_for(read_outcome_bounded(entry[1], names, MAX_OUTCOME_BYTES),
                                             2 * self.settings.timeout + 1)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            await self.forget(key)
            raise MirrorError(f"reading the outcome record {names.outcome} failed: {type(exc).__name__}: {exc}") \
                from None
        if outcome is not None and outcome.job_uid and outcome.job_uid != job_uid:
            return None  # another run's record (cannot happen with uid-keyed names; be sure anyway)
        return outcome

    async def forget(self, key: Any) -> None:
        entry = self._clients.pop(key, None)
        if entry is not None:
            try:
                await entry[1].aclose()
            except (RedisError, OSError):
                pass

    async def close(self) -> None:
        for key in list(self._clients):
            await self.forget(key)
