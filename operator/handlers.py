"""kopf handlers: one reconcile pass, run on create/resume/spec update and by the status loop.

A pass validates the job exactly like `asyncrl validate`, applies the builders' objects
idempotently (create or patch; never duplicates on retries or after a restart), observes the
children and the trainer's /status, writes `.status`, and only then posts an Event. Deletion is
left to ownerReferences: there is no finalizer because no external side effect needs one.

Handlers get the operator's settings and API client from kopf's memo (`OperatorMemo`), which
`asyncrl operator` builds once from its flags.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import secrets
from typing import Any, cast

import kopf

from asyncrl.loader import JobFileError, parse_job
from asyncrl.operator import builders as B
from asyncrl.operator import metrics
from asyncrl.operator import names as N
from asyncrl.operator.config import OperatorConfig
from asyncrl.operator.kube import ApiError, Kube, apply
from asyncrl.operator.mirror import MirrorError, fetch_report, status_endpoint
from asyncrl.operator.status import JobRef, Observed, compute_status, now_utc, pod_problems, ttl_expired
from asyncrl.spec import GROUP, PLURAL, TERMINAL_PHASES, VERSION, AsyncRLJob

Obj = dict[str, Any]
JobKey = tuple[str, str]  # (namespace, name)

# Pod reasons that deserve a Warning Event (besides phase Failed).
WARNING_REASONS = ("ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "OOMKilled", "Unschedulable")


class OperatorMemo(kopf.Memo):
    """kopf's `memo`: what every handler shares. Built once by `asyncrl operator`; kopf gives each
    job a shallow copy, so these attributes are the same objects everywhere."""

    config: OperatorConfig
    kube: Kube
    jobs: dict[JobKey, Obj]
    """The latest body of every job seen on the watch-stream: what the status loop visits."""
    status_loop: asyncio.Task[None]
    """Set by the startup handler."""


# ----------------------------------------------------------------------------------- kopf handlers


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
async def on_change(body: kopf.Body, memo: OperatorMemo, logger: kopf.Logger, **_: Any) -> None:
    try:
        await reconcile(copy.deepcopy(dict(body)), memo, logger, mirror=False)
    except ApiError as exc:
        metrics.RECONCILE_ERRORS.labels("api").inc()
        raise kopf.TemporaryError(str(exc), delay=min(30.0, max(1.0, memo.config.interval))) from exc


# The periodic status pass is our own loop over the jobs kopf's watch-stream has shown us, not a
# kopf timer: kopf guards timers and daemons with a finalizer, and nothing here needs one.


@kopf.on.event(GROUP, VERSION, PLURAL)
def track(event: kopf.RawEvent, memo: OperatorMemo, **_: Any) -> None:
    """Remember the latest body of every job for the status loop (event handlers add no finalizer)."""
    obj = event.get("object") or {}
    meta = obj.get("metadata") or {}
    key = (meta.get("namespace", ""), meta.get("name", ""))
    if event.get("type") == "DELETED":
        memo.jobs.pop(key, None)
        metrics.forget(*key)
    elif meta.get("name"):
        memo.jobs[key] = copy.deepcopy(dict(obj))


@kopf.on.startup()
async def start_status_loop(memo: OperatorMemo, logger: kopf.Logger, **_: Any) -> None:
    memo.status_loop = asyncio.create_task(_status_loop(memo, logger))


@kopf.on.cleanup()
async def stop_status_loop(memo: OperatorMemo, **_: Any) -> None:
    task = memo.get("status_loop")
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def _status_loop(memo: OperatorMemo, logger: kopf.Logger) -> None:
    """Every interval: readiness of the children, the trainer's /status, deadlines and TTL, per job."""
    interval = memo.config.interval
    while True:
        await asyncio.sleep(interval)
        for key in list(memo.jobs):
            body = memo.jobs.get(key)  # may have gone while an earlier job's pass ran
            if body is None or body["metadata"].get("deletionTimestamp"):
                continue
            try:
                await reconcile(copy.deepcopy(body), memo, logger, mirror=True)
            except Exception as exc:  # one bad job must not stop the loop for the others
                metrics.RECONCILE_ERRORS.labels(type(exc).__name__).inc()
                logger.warning(f"status pass for {key[0]}/{key[1]} failed, retrying in {interval}s: {exc}")


@kopf.on.delete(GROUP, VERSION, PLURAL, optional=True)
def on_delete(meta: kopf.Meta, **_: Any) -> None:
    """Optional: no finalizer is added; children go with their ownerReferences."""
    metrics.forget(meta.get("namespace", ""), meta.get("name", ""))


# ----------------------------------------------------------------------------------- one pass


async def reconcile(body: Obj, memo: OperatorMemo, logger: kopf.Logger, *, mirror: bool) -> Obj:
    """One idempotent pass over a job; returns the status it wrote (or would have written).

    `mirror`: also read the trainer's /status (the status loop does; change handlers do not wait for it).
    """
    metrics.RECONCILES.inc()
    meta = body["metadata"]
    ref = JobRef(name=meta["name"], namespace=meta.get("namespace", "default"), generation=meta.get("generation"))
    prev: Obj = dict(body.get("status") or {})
    now = now_utc()

    # Parse the spec with the loader `asyncrl validate` uses. An invalid job only gets a Failed status.
    try:
        job = parse_job(_document(body), source=f"{ref.namespace}/{ref.name}")
    except JobFileError as exc:
        message = "invalid spec: " + "; ".join(f"{e.path or '<spec>'}: {e.message}" for e in exc.errors)
        new = compute_status(ref, None, prev, Observed(), now, invalid=message)
        await _write(memo.kube, body, prev, new, logger)
        return new

    # Build the desired children. A finished job stays stopped: its GPUs were given back.
    was_terminal = prev.get("phase") in TERMINAL_PHASES
    ctx = B.BuildContext(owner_uid=meta["uid"], namespace=ref.namespace, redis_password=secrets.token_hex(24),
                         trainer_image=memo.config.trainer_image, rollout_image=memo.config.rollout_image,
                         stopped=job.spec.suspend or was_terminal)
    children = B.build_children(job, ctx)

    # Apply them: create what is missing, patch what differs from the desired state.
    applied = await _apply_all(memo.kube, children)

    # Observe: ready replicas, pod problems, and (status passes of running jobs) the trainer's report.
    obs = await _observe(memo, job, ref, applied, mirror=mirror and not was_terminal, logger=logger)

    # Compute the status. A job that has just finished or failed gives its GPUs back.
    new = compute_status(ref, job.spec, prev, obs, now)
    if new["phase"] in TERMINAL_PHASES and not ctx.stopped:
        await _stop(memo.kube, job, ctx)

    # Write the status (then the Event), and delete a finished job whose TTL has run out.
    await _write(memo.kube, body, prev, new, logger)
    ttl = job.spec.ttl_seconds_after_finished
    if ttl_expired(new, ttl, now):
        logger.info(f"ttlSecondsAfterFinished ({ttl}s) passed: deleting the job")
        await memo.kube.delete("AsyncRLJob", ref.namespace, ref.name)
        metrics.forget(ref.namespace, ref.name)
    return new


def _document(body: Obj) -> Obj:
    """The job as a job file: what `asyncrl validate` would read (no server-set metadata or status)."""
    meta = body.get("metadata", {})
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta},
            "spec": body.get("spec")}


async def _apply_all(k: Kube, children: list[Obj]) -> dict[str, Obj]:
    """Apply in order (dependencies first); the live objects by `<name>/<kind>`."""
    applied: dict[str, Obj] = {}
    for obj in children:
        _, current = await apply(k, obj)
        applied[f"{obj['metadata']['name']}/{obj['kind']}"] = current
    return applied


def _ready(obj: Obj | None) -> int | None:
    if obj is None:
        return None
    return int((obj.get("status") or {}).get("readyReplicas") or 0)


async def _observe(memo: OperatorMemo, job: AsyncRLJob, ref: JobRef, applied: dict[str, Obj], *, mirror: bool,
                   logger: kopf.Logger) -> Observed:
    name = ref.name
    obs = Observed(
        rollout_ready=_ready(applied.get(N.rollout(name) + "/Deployment")),
        trainer_ready=_ready(applied.get(N.trainer(name) + "/StatefulSet")),
        redis_ready=_ready(applied.get(N.redis(name) + "/StatefulSet")),
    )
    obs.problems = pod_problems(await memo.kube.list("Pod", ref.namespace, f"{N.LABEL_JOB}={name}"))
    if mirror and not job.spec.suspend:
        url = status_endpoint(memo.config.status_url_template, name=name, namespace=ref.namespace,
                              service=N.status_service(name), port=job.spec.trainer.status_port)
        try:
            obs.report = await fetch_report(url, timeout=memo.config.status_timeout)
        except MirrorError as exc:
            obs.report_error = str(exc)
            logger.debug(str(exc))
    return obs


async def _stop(k: Kube, job: AsyncRLJob, ctx: B.BuildContext) -> None:
    """Scale rollout and trainer to zero (Redis and volumes stay for inspection)."""
    stopped = dataclasses.replace(ctx, stopped=True)
    for obj in (B.trainer_statefulset(job, stopped), B.rollout_deployment(job, stopped)):
        await apply(k, obj)


async def _write(k: Kube, body: Obj, prev: Obj, new: Obj, logger: kopf.Logger) -> None:
    """Write the status if it changed, then (and only then) post an Event for a phase change."""
    meta = body["metadata"]
    ns, name = meta.get("namespace", "default"), meta["name"]
    metrics.record_status(ns, name, new)
    if prev == new:
        return
    await k.patch("AsyncRLJob", ns, name, {"status": new}, subresource="status")
    if prev.get("phase") != new["phase"] or prev.get("reason") != new["reason"]:
        warning = new["phase"] == "Failed" or new["reason"] in WARNING_REASONS
        # kopf.event reads only apiVersion, kind and metadata of the (plain dict) body.
        kopf.event(kopf.Body(cast(kopf.RawBody, body)), type="Warning" if warning else "Normal",
                   reason=new["reason"] or new["phase"], message=f"{new['phase']}: {new['message']}"[:1000])
        logger.info(f"phase {prev.get('phase', '-')} -> {new['phase']} ({new['reason']}): {new['message']}")
