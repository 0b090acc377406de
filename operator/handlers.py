"""kopf handlers: one reconcile pass, run on create/resume/spec update and on a timer.

A pass validates the job exactly like `asyncrl validate`, applies the builders' objects
idempotently (create or patch; never duplicates on retries or after a restart), observes the
children and the trainer's /status, writes `.status`, and only then posts an Event. Deletion is
left to ownerReferences: there is no finalizer because no external side effect needs one.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import secrets
from typing import Any

import kopf

from asyncrl.loader import JobFileError, parse_job
from asyncrl.operator import builders as B
from asyncrl.operator import metrics
from asyncrl.operator import names as N
from asyncrl.operator.config import OperatorConfig
from asyncrl.operator.kube import ApiError, Kube, apply
from asyncrl.operator.mirror import MirrorError, fetch_report, status_endpoint
from asyncrl.operator.status import JobView, Observed, compute_status, now_utc, parse_time, pod_problems, ttl_expired
from asyncrl.spec import GROUP, PLURAL, TERMINAL_PHASES, VERSION, AsyncRLJob

CONFIG = OperatorConfig.from_env()
_kube: Kube | None = None


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations: our status schema is declared fully and pruned."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own Events only, not every log line
    settings.peering.standalone = True  # one replica, Recreate: no peering objects needed
    settings.watching.server_timeout = 300


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@kopf.on.update(GROUP, VERSION, PLURAL, field="spec")
async def on_change(body: kopf.Body, logger: logging.Logger, **_: Any) -> None:
    try:
        await reconcile(copy.deepcopy(dict(body)), logger, mirror=False)
    except ApiError as exc:
        metrics.RECONCILE_ERRORS.labels("api").inc()
        raise kopf.TemporaryError(str(exc), delay=min(30.0, max(1.0, CONFIG.interval))) from exc


# The periodic status pass is our own loop over the jobs kopf's watch-stream has shown us, not a
# kopf timer: kopf guards timers and daemons with a finalizer, and nothing here needs one.
_known: dict[tuple[str, str], dict[str, Any]] = {}
_loop_task: asyncio.Task | None = None


@kopf.on.event(GROUP, VERSION, PLURAL)
def track(event: dict[str, Any], **_: Any) -> None:
    """Remember the latest body of every job for the status loop (event handlers add no finalizer)."""
    obj = event.get("object") or {}
    meta = obj.get("metadata") or {}
    key = (meta.get("namespace", ""), meta.get("name", ""))
    if event.get("type") == "DELETED":
        _known.pop(key, None)
        metrics.forget(*key)
    elif meta.get("name"):
        _known[key] = copy.deepcopy(dict(obj))


@kopf.on.startup()
async def start_status_loop(logger: logging.Logger, **_: Any) -> None:
    global _loop_task
    _loop_task = asyncio.create_task(_status_loop(logger))


@kopf.on.cleanup()
async def stop_status_loop(**_: Any) -> None:
    if _loop_task is not None:
        _loop_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await _loop_task


async def _status_loop(logger: logging.Logger) -> None:
    """Every interval: readiness of the children, the trainer's /status, deadlines and TTL, per job."""
    while True:
        await asyncio.sleep(CONFIG.interval)
        for key in list(_known):
            body = _known.get(key)
            if body is None or body["metadata"].get("deletionTimestamp"):
                continue
            try:
                await reconcile(copy.deepcopy(body), logger, mirror=True)
            except Exception as exc:  # one bad job must not stop the loop for the others
                metrics.RECONCILE_ERRORS.labels(type(exc).__name__).inc()
                logger.warning(f"status pass for {key[0]}/{key[1]} failed, retrying in {CONFIG.interval}s: {exc}")


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def on_delete(meta: kopf.Meta, **_: Any) -> None:
    """Optional: no finalizer is added; children go with their ownerReferences."""
    metrics.forget(meta.get("namespace", ""), meta.get("name", ""))


# ----------------------------------------------------------------------------------- one pass


def _document(body: dict[str, Any]) -> dict[str, Any]:
    meta = body.get("metadata", {})
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta},
            "spec": body.get("spec")}


def _view(body: dict[str, Any], job: AsyncRLJob | None) -> JobView:
    meta = body["metadata"]
    name, ns = meta["name"], meta.get("namespace", "default")
    created = parse_time(meta.get("creationTimestamp")) or now_utc()
    if job is None:  # invalid spec: nothing to run, only enough to write a status
        return JobView(name, ns, meta.get("generation"), created, False, 0, 0, True, 1, 0, 0, "",
                       B.rollout_selector(name))
    s = job.spec
    return JobView(
        name=name, namespace=ns, generation=meta.get("generation"), created=created, suspend=s.suspend,
        rollout_replicas=s.rollout.replicas, trainer_replicas=s.trainer.replicas,
        external_redis=s.redis.mode == "external", startup_deadline_seconds=s.startup_deadline_seconds,
        max_steps=s.trainer.max_steps, staleness_limit=s.staleness.max_head_offpolicyness,
        status_url=B.status_url(name, ns, s.trainer.status_port), rollout_selector=B.rollout_selector(name))


def _ready(obj: dict[str, Any] | None) -> int | None:
    if obj is None:
        return None
    return int((obj.get("status") or {}).get("readyReplicas") or 0)


async def _observe(k: Kube, job: AsyncRLJob, ns: str, applied: dict[str, dict[str, Any]], mirror: bool,
                   logger: logging.Logger) -> Observed:
    name = job.metadata.name
    obs = Observed(
        rollout_ready=_ready(applied.get(N.rollout(name) + "/Deployment")),
        trainer_ready=_ready(applied.get(N.trainer(name) + "/StatefulSet")),
        redis_ready=_ready(applied.get(N.redis(name) + "/StatefulSet")),
    )
    obs.problems = pod_problems(await k.list("Pod", ns, f"{N.LABEL_JOB}={name}"))
    if mirror and not job.spec.suspend:
        url = status_endpoint(CONFIG.status_url_template, name=name, namespace=ns,
                              service=N.status_service(name), port=job.spec.trainer.status_port)
        try:
            obs.report = await fetch_report(url, timeout=CONFIG.status_timeout)
        except MirrorError as exc:
            obs.report_error = str(exc)
            logger.debug(str(exc))
    return obs


async def _apply_all(k: Kube, job: AsyncRLJob, ctx: B.BuildContext) -> dict[str, dict[str, Any]]:
    applied: dict[str, dict[str, Any]] = {}
    for obj in B.build_children(job, ctx):
        _, current = await apply(k, obj)
        applied[f"{obj['metadata']['name']}/{obj['kind']}"] = current
    return applied


async def reconcile(body: dict[str, Any], logger: logging.Logger, *, mirror: bool) -> dict[str, Any]:
    """One idempotent pass over a job; returns the status it wrote (or would have written)."""
    metrics.RECONCILES.inc()
    k = kube()
    meta = body["metadata"]
    name, ns = meta["name"], meta.get("namespace", "default")
    prev = dict(body.get("status") or {})
    now = now_utc()
    try:
        job = parse_job(_document(body), source=f"{ns}/{name}")
    except JobFileError as exc:
        message = "invalid spec: " + "; ".join(f"{e.path or '<spec>'}: {e.message}" for e in exc.errors)
        new = compute_status(_view(body, None), prev, Observed(), now, invalid=message)
        await _write(k, body, prev, new, logger)
        return new

    view = _view(body, job)
    was_terminal = prev.get("phase") in TERMINAL_PHASES
    ctx = B.BuildContext(owner_uid=meta["uid"], namespace=ns, redis_password=secrets.token_hex(24),
                         trainer_image=CONFIG.trainer_image, rollout_image=CONFIG.rollout_image,
                         stopped=job.spec.suspend or was_terminal)
    applied = await _apply_all(k, job, ctx)
    obs = await _observe(k, job, ns, applied, mirror and not was_terminal, logger)
    new = compute_status(view, prev, obs, now)
    if new["phase"] in TERMINAL_PHASES and not ctx.stopped:
        # Finished or failed: give the GPUs back (Redis and volumes stay for inspection).
        stopped = B.BuildContext(**{**ctx.__dict__, "stopped": True})
        for obj in (B.trainer_statefulset(job, stopped), B.rollout_deployment(job, stopped)):
            await apply(k, obj)
    await _write(k, body, prev, new, logger)
    if ttl_expired(new, job.spec.ttl_seconds_after_finished, now):
        logger.info(f"ttlSecondsAfterFinished ({job.spec.ttl_seconds_after_finished}s) passed: deleting the job")
        await k.delete("AsyncRLJob", ns, name)
        metrics.forget(ns, name)
    return new


async def _write(k: Kube, body: dict[str, Any], prev: dict[str, Any], new: dict[str, Any],
                 logger: logging.Logger) -> None:
    """Write the status if it changed, then (and only then) post an Event for a phase change."""
    meta = body["metadata"]
    ns, name = meta.get("namespace", "default"), meta["name"]
    metrics.record_status(ns, name, new)
    if prev == new:
        return
    await k.patch("AsyncRLJob", ns, name, {"status": new}, subresource="status")
    if prev.get("phase") != new["phase"] or prev.get("reason") != new["reason"]:
        warning = new["phase"] == "Failed" or new["reason"] in (
            "ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "OOMKilled", "Unschedulable")
        kopf.event(body, type="Warning" if warning else "Normal", reason=new["reason"] or new["phase"],
                   message=f"{new['phase']}: {new['message']}"[:1000])
        logger.info(f"phase {prev.get('phase', '-')} -> {new['phase']} ({new['reason']}): {new['message']}")
