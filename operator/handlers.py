"""kopf wiring, and the one reconcile path that writes a job's children and its `.status`.

Who writes what, and when:

- kopf's watch-stream calls `track` (an event handler: kopf adds no finalizer and writes no
  annotations for it) with every version of every job. It writes nothing: it keeps the latest body
  in `memo.jobs` and wakes that job's worker when something it did not write changed (the spec, or
  a status written by someone else).
- One `JobWorker` per job (an asyncio task, started when the job is first seen, cancelled when it
  is deleted or replaced by a job of another uid) runs the passes: at once when woken, else every
  `--interval` seconds. A pass is the only writer of the job's children and of its status, so a
  spec change is applied once, by one pass, never by two writers racing.
- The status is written as a JSON merge patch carrying the `metadata.resourceVersion` of the body
  the pass computed from: the API server answers 409 Conflict when the job changed meanwhile, and
  the worker re-reads the job and computes the pass again (up to MAX_CONFLICT_RETRIES times).
- A terminal phase is never left: compute_status keeps it, the precondition stops a pass computed
  from an older body from overwriting it, and the worker remembers it so that a stale body from the
  watch-stream never scales a finished job back up.

A pass validates the job exactly like `asyncrl validate`, applies the builders' objects
idempotently (create or patch; never duplicates on retries or after a restart), observes the
children, the trainer's outcome record (Redis) and its /status, writes `.status`, gives a finished
job's GPUs back, and only then posts an Event. Deletion is left to ownerReferences: no finalizer.

Handlers get the operator's settings, the API client and the outcome reader from kopf's memo
(`OperatorMemo`), which `asyncrl operator` builds once from its flags.
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import dataclasses
import logging
import secrets
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from asyncrl.api.loader import JobFileError, parse_job
from asyncrl.api.spec import GROUP, PLURAL, TERMINAL_PHASES, VERSION, AsyncRLJob
from asyncrl.api.stream_names import StreamNames
from asyncrl.operator import builders as B
from asyncrl.operator import metrics
from asyncrl.operator import names as N
from asyncrl.operator.config import OperatorConfig
from asyncrl.operator.kube import ApiError, ChildConflict, Kube, apply
from asyncrl.operator.mirror import (
    MirrorError,
    OutcomeReader,
    external_redis_url,
    fetch_report,
    managed_redis_url,
    recovery_events,
    secret_value,
    status_endpoint,
)
from asyncrl.operator.status import (
    CHILD_CONFLICT,
    FAILED_CREATE,
    JobRef,
    Observed,
    compute_status,
    container_runs,
    now_utc,
    pod_problems,
    ttl_expired,
    workload_problems,
)

Obj = dict[str, Any]
JobKey = tuple[str, str]  # (namespace, name)

# Pod reasons that deserve a Warning Event (besides phase Failed), and a child's name held by another object.
WARNING_REASONS = ("ImagePullBackOff", "ErrImagePull", "CrashLoopBackOff", "OOMKilled", "Unschedulable",
                   CHILD_CONFLICT, FAILED_CREATE)
MAX_CONFLICT_RETRIES = 3
"""Re-reads after a 409 within one pass; then the pass gives up until the next wake-up or interval."""


class OperatorMemo(kopf.Memo):
    """kopf's `memo`: what every handler shares. Built once by `asyncrl operator`; kopf gives each
    job a shallow copy, so these attributes are the same objects everywhere."""

    config: OperatorConfig
    kube: Kube
    outcomes: OutcomeReader
    """Reads the trainers' outcome records, one cached Redis client per job."""
    jobs: dict[JobKey, Obj]
    """The latest body of every job seen on the watch-stream."""
    workers: dict[JobKey, JobWorker]
    """The one worker (reconcile loop) of every job."""


class StatusConflict(Exception):
    """The status write's resourceVersion precondition failed: the job changed since it was read."""


# ----------------------------------------------------------------------------------- kopf handlers


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, memo: OperatorMemo, **_: Any) -> None:
    """Keep kopf's bookkeeping in annotations (should kopf ever need any: with only an event handler
    it writes none), our own Events only, no peering."""
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key="last-handled-configuration")
    settings.posting.level = logging.WARNING  # our own Events only, not every log line
    # No kopf peering: with --leader-elect, kopf runs only in the replica that holds the Lease
    # (asyncrl.operator.leader says why a Lease and not kopf's peering).
    settings.peering.standalone = True
    # No watch on CustomResourceDefinitions or Namespaces: kopf finds the AsyncRLJob resource by API
    # discovery at startup (which needs no RBAC), so the operator needs no cluster-scoped permission
    # and, with --namespace, no ClusterRole at all. The CRD must exist when the operator starts
    # (the chart installs it first); one installed later is seen after a restart.
    settings.scanning.disabled = True
    settings.watching.server_timeout = 300
    for name, default in (("jobs", dict), ("workers", dict), ("outcomes", OutcomeReader)):
        if name not in memo:
            memo[name] = default()


@kopf.on.event(GROUP, VERSION, PLURAL)
async def track(event: kopf.RawEvent, memo: OperatorMemo, logger: kopf.Logger, **_: Any) -> None:
    """Record the latest body of a job and wake (or start, or stop) its worker. Writes nothing."""
    obj = event.get("object") or {}
    meta = obj.get("metadata") or {}
    if not meta.get("name"):
        return
    key = (meta.get("namespace", ""), meta["name"])
    if event.get("type") == "DELETED":
        memo.jobs.pop(key, None)
        await _retire(memo, key)
        metrics.forget(*key)
        return
    body = copy.deepcopy(dict(obj))
    memo.jobs[key] = body
    worker = memo.workers.get(key)
    if worker is not None and worker.uid != meta.get("uid", ""):
        await _retire(memo, key)  # deleted and re-created under the same name: a new job
        worker = None
    if worker is None:
        worker = memo.workers[key] = JobWorker(key=key, uid=meta.get("uid", ""))
        worker.start(memo, logger)
    else:
        worker.notice(body)


@kopf.on.cleanup()
async def stop_workers(memo: OperatorMemo, **_: Any) -> None:
    for key in list(memo.get("workers") or {}):
        await _retire(memo, key)
    outcomes = memo.get("outcomes")
    if outcomes is not None:
        await outcomes.close()


def wake_job(memo: OperatorMemo, namespace: str, name: str) -> None:
    """Make the job's worker pass now (for watchers of its children: a deleted or edited child is
    put back by the next pass, and only the worker writes)."""
    worker = memo.workers.get((namespace, name))
    if worker is not None:
        worker.wake.set()


async def _retire(memo: OperatorMemo, key: JobKey) -> None:
    worker = memo.workers.pop(key, None)
    if worker is not None:
        await worker.stop()
    await memo.outcomes.forget(key)


# ----------------------------------------------------------------------------------- the worker


@dataclass(eq=False)
class JobWorker:
    """The one reconcile loop of one job (identified by its uid)."""

    key: JobKey
    uid: str
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    generation: int | None = None
    """metadata.generation of the body the last pass computed from."""
    written: Obj | None = None
    """The status the last pass wrote (or found already in place)."""
    terminal: Obj | None = None
    """The job's terminal status, once this worker has written or seen one: never forgotten."""

    def start(self, memo: OperatorMemo, logger: kopf.Logger) -> None:
        self.task = asyncio.create_task(self.run(memo, logger), name=f"asyncrl-job-{self.key[0]}/{self.key[1]}")

    async def stop(self) -> None:
        task, self.task = self.task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def notice(self, body: Obj) -> None:
        """A new version of the job arrived on the watch-stream: pass again now unless it is only
        the echo of this worker's own status write."""
        meta = body.get("metadata") or {}
        if (meta.get("generation") != self.generation or (body.get("status") or {}) != self.written
                or meta.get("deletionTimestamp")):
            self.wake.set()

    async def run(self, memo: OperatorMemo, logger: kopf.Logger) -> None:
        ns, name = self.key
        while True:
            self.wake.clear()
            body = memo.jobs.get(self.key)
            if body is None:
                return
            if not body["metadata"].get("deletionTimestamp"):
                try:
                    await self.reconcile(copy.deepcopy(body), memo, logger)
                except Exception as exc:  # the next wake-up or interval retries; the loop never dies
                    metrics.RECONCILE_ERRORS.labels(type(exc).__name__).inc()
                    logger.warning(f"pass for {ns}/{name} failed, retrying in {memo.config.interval}s: {exc}")
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self.wake.wait(), memo.config.interval)

    async def reconcile(self, body: Obj, memo: OperatorMemo, logger: kopf.Logger) -> Obj | None:
        """One pass; on a status conflict re-read the job and compute the pass again."""
        ns, name = self.key
        for _ in range(MAX_CONFLICT_RETRIES + 1):
            try:
                return await reconcile(body, memo, logger, worker=self)
            except StatusConflict:
                metrics.STATUS_CONFLICTS.inc()
                logger.debug(f"status of {ns}/{name} changed since it was read: re-reading")
                fresh = await _reread(memo.kube, ns, name)
                if fresh is None or fresh["metadata"].get("uid", "") != self.uid:
                    return None  # gone (or replaced): the watch-stream will retire this worker
                body = fresh
        raise ApiError(409, f"status of {ns}/{name} kept changing: {MAX_CONFLICT_RETRIES} conflicts in one pass")


async def _reread(k: Kube, namespace: str, name: str) -> Obj | None:
    """The job as the API server has it now (listed: the operator's RBAC has no `get` on jobs)."""
    for item in await k.list("AsyncRLJob", namespace, ""):
        if item.get("metadata", {}).get("name") == name:
            return item
    return None


# ----------------------------------------------------------------------------------- one pass


async def reconcile(body: Obj, memo: OperatorMemo, logger: kopf.Logger, *, worker: JobWorker | None = None) -> Obj:
    """One idempotent pass over a job; returns the status it wrote (or found in place). Raises
    StatusConflict when the job changed since `body` was read (nothing of it was written)."""
    metrics.RECONCILES.inc()
    meta = body["metadata"]
    ref = JobRef(name=meta["name"], namespace=meta.get("namespace", "default"), generation=meta.get("generation"))
    actual: Obj = dict(body.get("status") or {})
    prev = actual
    if worker is not None:
        if actual.get("phase") in TERMINAL_PHASES:
            worker.terminal = actual
        elif worker.terminal is not None:
            prev = worker.terminal  # a stale body, or a status someone rewrote: the job has finished
    now = now_utc()

    # Parse the spec with the loader `asyncrl validate` uses. An invalid job only gets a Failed status.
    try:
        job = parse_job(_document(body), source=f"{ref.namespace}/{ref.name}")
    except JobFileError as exc:
        message = "invalid spec: " + "; ".join(f"{e.path or '<spec>'}: {e.message}" for e in exc.errors)
        new = compute_status(ref, None, prev, Observed(), now, invalid=message)
        await _write(memo.kube, body, actual, new, logger)
        _remember(worker, meta, new)
        return new

    # Build the desired children. A finished job stays stopped: its GPUs were given back.
    was_terminal = prev.get("phase") in TERMINAL_PHASES
    ctx = B.BuildContext(owner_uid=meta["uid"], namespace=ref.namespace, redis_password=secrets.token_hex(24),
                         status_token=secrets.token_urlsafe(32), engine_api_key=secrets.token_urlsafe(32),
                         trainer_image=memo.config.trainer_image, rollout_image=memo.config.rollout_image,
                         stopped=job.spec.suspend or was_terminal,
                         operator_namespace=memo.config.operator_namespace)
    children = B.build_children(job, ctx)

    # Apply them: create what is missing, patch what differs from the desired state; a changed trainer
    # template restarts the whole gang at once. An object of a child's name that is not the job's
    # stops the pass there (nothing after it may refer to it) and holds the job (ChildConflict).
    applied, conflict = await _apply_children(memo.kube, ref, children, ctx, logger)

    # Observe: ready replicas, the pods' containers, and (running jobs) the trainer's outcome and report.
    active = not (was_terminal or job.spec.suspend or conflict)
    obs = await _observe(memo, job, ref, meta["uid"], applied, active=active, logger=logger)
    obs.conflict = None if conflict is None else str(conflict)

    # Compute and write the status (with the resourceVersion precondition), then act on it.
    new = compute_status(ref, job.spec, prev, obs, now)
    await _write(memo.kube, body, actual, new, logger)
    _remember(worker, meta, new)

    # A job that has just finished or failed gives its GPUs back: trainer and rollout to zero
    # (Redis, its Secret and the volumes stay until the TTL, for inspection and the final weights).
    if new["phase"] in TERMINAL_PHASES and not ctx.stopped:
        await _stop(memo.kube, job, ctx, logger)

    ttl = job.spec.ttl_seconds_after_finished
    if ttl_expired(new, ttl, now):
        logger.info(f"ttlSecondsAfterFinished ({ttl}s) passed: deleting the job")
        await memo.kube.delete("AsyncRLJob", ref.namespace, ref.name)
        metrics.forget(ref.namespace, ref.name)
    return new


def _remember(worker: JobWorker | None, meta: Obj, new: Obj) -> None:
    if worker is None:
        return
    worker.generation = meta.get("generation")
    worker.written = new
    if new.get("phase") in TERMINAL_PHASES:
        worker.terminal = new


def _document(body: Obj) -> Obj:
    """The job as a job file: what `asyncrl validate` would read (no server-set metadata or status)."""
    meta = body.get("metadata", {})
    return {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"),
            "metadata": {k: meta[k] for k in ("name", "namespace", "labels", "annotations") if k in meta},
            "spec": body.get("spec")}


async def _apply_children(k: Kube, ref: JobRef, children: list[Obj], ctx: B.BuildContext,
                          logger: kopf.Logger) -> tuple[dict[str, Obj], ChildConflict | None]:
    """`_apply_all`, then (a running job whose children are all its own) the trainer gang's restart."""
    applied, conflict = await _apply_all(k, children, ctx.owner_uid)
    if conflict is not None:
        logger.warning(str(conflict))
    elif not ctx.stopped:
        await _restart_stale_trainer_gang(k, ref, applied.get(N.trainer(ref.name) + "/StatefulSet"), logger)
    return applied, conflict


async def _apply_all(k: Kube, children: list[Obj], owner_uid: str) -> tuple[dict[str, Obj], ChildConflict | None]:
    """Apply in order (dependencies first); the live objects by `<name>/<kind>`, and the first child
    whose name another object holds (the ones after it are not applied: they may refer to it)."""
    applied: dict[str, Obj] = {}
    for obj in children:
        try:
            _, current = await apply(k, obj, owner_uid=owner_uid)
        except ChildConflict as exc:
            return applied, exc
        applied[f"{obj['metadata']['name']}/{obj['kind']}"] = current
    return applied, None


async def _restart_stale_trainer_gang(k: Kube, ref: JobRef, sts: Obj | None, logger: kopf.Logger) -> None:
    """The trainer StatefulSet updates OnDelete: when any trainer pod runs an older template than the
    StatefulSet's `updateRevision`, every trainer pod is deleted at once, so all ranks come back
    together on the new template (the controller re-creates them; Parallel starts them together)."""
    revision = ((sts or {}).get("status") or {}).get("updateRevision")
    if not revision:
        return
    pods = await k.list("Pod", ref.namespace, N.selector_string(N.selector_labels(ref.name, "trainer")))
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    stale = sorted(p["metadata"]["name"] for p in live
                   if ((p["metadata"].get("labels") or {}).get("controller-revision-hash") or revision) != revision)
    if not stale:
        return
    logger.info(f"trainer pods {', '.join(stale)} run an older template than {revision}: restarting all "
                f"{len(live)} ranks together")
    for pod in live:
        await k.delete("Pod", ref.namespace, pod["metadata"]["name"])


def _ready(obj: Obj | None) -> int | None:
    if obj is None:
        return None
    return int((obj.get("status") or {}).get("readyReplicas") or 0)


async def _observe(memo: OperatorMemo, job: AsyncRLJob, ref: JobRef, uid: str, applied: dict[str, Obj], *,
                   active: bool, logger: kopf.Logger) -> Observed:
    name = ref.name
    obs = Observed(
        rollout_ready=_ready(applied.get(N.rollout(name) + "/Deployment")),
        trainer_ready=_ready(applied.get(N.trainer(name) + "/StatefulSet")),
        redis_ready=_ready(applied.get(N.redis(name) + "/StatefulSet")),
    )
    pods = await memo.kube.list("Pod", ref.namespace, f"{N.LABEL_JOB}={name}")
    # a workload that cannot create pods first: then no pod exists to say why
    obs.problems = workload_problems(list(applied.values())) + pod_problems(pods)
    obs.containers = container_runs(pods)
    if not active:
        return obs
    # The durable record first: it is there even while the trainer pod cannot be reached.
    await _read_outcome(memo, job, ref, uid, obs, logger)
    if obs.outcome is None:
        url = status_endpoint(memo.config.status_url_template, name=name, namespace=ref.namespace,
                              service=N.status_service(name), port=job.spec.trainer.status_port)
        try:
            # The trainer requires the job's token (builders.status_secret), as this pass applied it.
            token = secret_value(applied.get(N.status_secret(name) + "/Secret"), "token")
            obs.report = await fetch_report(url, token=token, timeout=memo.config.status_timeout)
        except MirrorError as exc:
            obs.report_error = str(exc)
            logger.debug(str(exc))
    return obs


async def _read_outcome(memo: OperatorMemo, job: AsyncRLJob, ref: JobRef, uid: str, obs: Observed,
                        logger: kopf.Logger) -> None:
    """Set obs.outcome from the job's Redis, or obs.outcome_error (then /status is the only word)."""
    if job.spec.redis.mode == "managed" and not obs.redis_ready:
        return  # no Redis pod is ready: nothing can have been recorded in it
    key = (ref.namespace, ref.name)
    try:
        url = memo.outcomes.url(key) or await _redis_url(memo, job, ref)
        if url is None:
            obs.outcome_error = "the Redis URL is not known yet (its Secret is missing or incomplete)"
            return
        obs.outcome = await memo.outcomes.read(key, url, StreamNames.for_job(ref.name, uid), uid)
    except (MirrorError, ApiError, ValueError) as exc:
        metrics.OUTCOME_READ_ERRORS.inc()
        obs.outcome_error = str(exc)
        logger.debug(f"outcome record of {ref.namespace}/{ref.name} not readable, using /status: {exc}")


async def _redis_url(memo: OperatorMemo, job: AsyncRLJob, ref: JobRef) -> str | None:
    """Where the job's Redis is: the URL in the external Secret, or the managed Service (through
    the operator's --redis-url-template) with the password of the job's Redis Secret."""
    r = job.spec.redis
    if r.mode == "external" and r.external is not None:
        key_ref = r.external.url_secret
        url = secret_value(await memo.kube.get("Secret", ref.namespace, key_ref.name), key_ref.key)
        return None if url is None else external_redis_url(url, memo.outcomes.settings.external_hosts)
    password = secret_value(await memo.kube.get("Secret", ref.namespace, N.redis_secret(ref.name)), "password")
    if password is None:
        return None
    return managed_redis_url(memo.outcomes.settings.url_template, name=ref.name, namespace=ref.namespace,
                             service=N.redis(ref.name), port=B.REDIS_PORT, password=password)


async def _stop(k: Kube, job: AsyncRLJob, ctx: B.BuildContext, logger: kopf.Logger) -> None:
    """Scale rollout, trainer and an operator-run reward service to zero (Redis and volumes stay for
    inspection)."""
    stopped = dataclasses.replace(ctx, stopped=True)
    for obj in B.scaled_workloads(job, stopped):
        try:
            await apply(k, obj, owner_uid=ctx.owner_uid)
        except ChildConflict as exc:  # not ours to scale
            logger.warning(str(exc))


def merge_patch(old: Obj, new: Obj) -> Obj:
    """The JSON merge patch (RFC 7396) that turns `old` into `new`: null removes a key."""
    patch: Obj = {key: None for key in old if key not in new}
    for key, value in new.items():
        before = old.get(key)
        if isinstance(value, dict) and isinstance(before, dict):
            sub = merge_patch(before, value)
            if sub:
                patch[key] = sub
        elif key not in old or value != before:
            patch[key] = value
    return patch


async def _write(k: Kube, body: Obj, actual: Obj, new: Obj, logger: kopf.Logger) -> None:
    """Write the status if it changed (precondition: the resourceVersion `body` was read at; 409 ->
    StatusConflict), then (and only then) post an Event for a phase change."""
    meta = body["metadata"]
    ns, name = meta.get("namespace", "default"), meta["name"]
    if actual != new:
        patch: Obj = {"status": merge_patch(actual, new)}
        if meta.get("resourceVersion"):
            patch["metadata"] = {"resourceVersion": meta["resourceVersion"]}
        try:
            await k.patch("AsyncRLJob", ns, name, patch, subresource="status")
        except ApiError as exc:
            if exc.status == 409:
                raise StatusConflict(str(exc)) from None
            raise
    metrics.record_status(ns, name, new)
    for kind, reason, message in recovery_events(actual.get("recovery"), new.get("recovery")):
        kopf.event(kopf.Body(cast(kopf.RawBody, body)), type=kind, reason=reason, message=message)
    if actual.get("phase") != new["phase"] or actual.get("reason") != new["reason"]:
        warning = new["phase"] == "Failed" or new["reason"] in WARNING_REASONS
        # kopf.event reads only apiVersion, kind and metadata of the (plain dict) body.
        kopf.event(kopf.Body(cast(kopf.RawBody, body)), type="Warning" if warning else "Normal",
                   reason=new["reason"] or new["phase"], message=f"{new['phase']}: {new['message']}"[:1000])
        logger.info(f"phase {actual.get('phase', '-')} -> {new['phase']} ({new['reason']}): {new['message']}")


# ----------------------------------------------------------------------------------- owned kinds (drift)
# The children are watched (a server-side label selector streams only ours), so that a hand edit or
# a deletion is put back within seconds instead of at the next interval: an event on a child whose
# content changed (not only its status) wakes its job's worker (`wake_job`), and the worker's pass
# compares the live objects with what we own (asyncrl.operator.kube.apply) and patches only what
# drifted. Wake-ups coalesce in the worker; the echo of our own patch ends in a pass that sends
# nothing. Only the worker writes: these handlers read and wake.

# Not Secrets: watching them needs cluster-wide list/watch on every Secret (least privilege wins);
# a deleted or edited Secret is put back by the next interval's pass instead.
OWNED_KINDS: tuple[tuple[str, str, str], ...] = (
    ("apps", "v1", "deployments"), ("apps", "v1", "statefulsets"), ("", "v1", "services"),
    ("", "v1", "configmaps"), ("networking.k8s.io", "v1", "networkpolicies"))


@kopf.on.startup()
def watch_owned_kinds(settings: kopf.OperatorSettings, memo: OperatorMemo, **_: Any) -> None:
    for group, version, plural in OWNED_KINDS:
        settings.watching.label_selectors[(group, version, plural)] = N.owned_selector()
    if "owned_seen" not in memo:
        memo["owned_seen"] = {}  # (plural, namespace, name) -> fingerprint of the child's content


def _fingerprint(obj: Obj) -> str:
    """What an edit can change and a status update cannot."""
    meta = obj.get("metadata") or {}
    return B.stable_hash({"labels": meta.get("labels"), "annotations": meta.get("annotations"),
                          "ownerReferences": meta.get("ownerReferences"),
                          **{k: v for k, v in obj.items() if k not in ("metadata", "status")}})


async def on_owned_event(event: kopf.RawEvent, resource: kopf.Resource, memo: OperatorMemo,
                         logger: kopf.Logger, **_: Any) -> None:
    """A child was edited or deleted: wake its job's worker (not for status-only updates)."""
    seen: dict[tuple[str, str, str], str] | None = memo.get("owned_seen")
    obj: Obj = dict(event.get("object") or {})
    meta: Obj = dict(obj.get("metadata") or {})
    job = (meta.get("labels") or {}).get(N.LABEL_JOB)
    if seen is None or not job:
        return
    ns, name = meta.get("namespace", ""), meta.get("name", "")
    ident = (resource.plural, ns, name)
    if event.get("type") == "DELETED":
        seen.pop(ident, None)
    else:
        fingerprint = _fingerprint(obj)
        if seen.get(ident) == fingerprint:
            return  # readiness, observedGeneration...: the interval's pass reads those
        seen[ident] = fingerprint
    worker = (memo.get("workers") or {}).get((ns, job))
    refs: list[Obj] = list(meta.get("ownerReferences") or [])
    if worker is None or (refs and not any(r.get("uid") == worker.uid for r in refs)):
        return  # no such job (any more), or a child of an earlier job of that name on its way out
    logger.debug(f"{resource.plural} {ns}/{name} changed ({event.get('type')}): waking job {job}")
    wake_job(memo, ns, job)


for _group, _version, _plural in OWNED_KINDS:
    kopf.on.event(_group, _version, _plural, id=f"owned-{_plural}",
                  labels={N.LABEL_MANAGED_BY: N.MANAGED_BY, N.LABEL_JOB: kopf.PRESENT})(on_owned_event)
