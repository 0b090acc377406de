"""Drift correction, the Redis Secret, and storage ownership (issue 18, parts 3 and 4).

The real operator (`asyncrl operator` subprocess) runs against a real kube-apiserver with no controllers
(tests/support/bare_apiserver.py), which writes its defaults into what it stores: so "no patch when
nothing drifted" is shown against objects that differ from what the builders rendered by exactly the
server's defaults (and every child is checked against the server's own defaulting with a dry run).
Nothing collects garbage there: what goes with a job is read from its ownerReferences (the full
control plane shows the collection). The operator's status loop runs only once a minute in the
correction tests, so a fix seen within seconds came from the owned-kind watches, not from the
periodic pass.
"""

from __future__ import annotations

import asyncio
import base64
import copy
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from asyncrl.api.loader import parse_job
from asyncrl.api.runtime import ENV_JOB_UID, ENV_REDIS_URL, FILE_SUFFIX
from asyncrl.api.spec import GROUP, PLURAL, VERSION
from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from asyncrl.operator.kube import KINDS, differences, patch_body, stamp
from tests.support.bare_apiserver import BareApiserver, bare_apiserver_fixture  # noqa: F401
from tests.support.job_builds import secret_files
from tests.support.jobs import JobBuilder
from tests.support.operator_jobs import JOB, NS, assert_rbac_covers, children_exist, create_job
from tests.support.operator_process import OperatorProcess
from tests.support.polling import poll

CHILD_PLURALS = ("configmaps", "secrets", "services", "persistentvolumeclaims", "deployments", "statefulsets",
                 "networkpolicies")


# ----------------------------------------------------------------------------------- helpers


def build(doc: dict, uid: str = "uid-1") -> list[dict]:
    return B.build_children(parse_job(doc), B.BuildContext(owner_uid=uid, namespace=NS, redis_password="pw"))


def child_patches(api: BareApiserver) -> list[Any]:
    """PATCH requests the operator sent to the job's children (not the job, its status or the test's)."""
    return [r for r in api.requests_of() if r.verb == "patch" and r.resource.split("/")[0] in CHILD_PLURALS]


async def request(api: BareApiserver, method: str, path: str, body: Any = None, status: int = 200) -> Any:
    headers = {"Content-Type": "application/merge-patch+json"} if method == "PATCH" else {}
    kwargs = {"json": body} if body is not None else {}
    async with api.request(method, path, headers=headers, **kwargs) as resp:
        assert resp.status == status, await resp.text()
        return await resp.json()


def path(plural: str, name: str) -> str:
    return BareApiserver.path(plural, NS, name)


async def settled(api: BareApiserver, op: OperatorProcess, quiet: float = 0.5) -> None:
    """Wait until the job is Initializing and the operator has sent nothing for `quiet` seconds: what
    changes after this was not done by the passes that followed the job's creation."""
    await poll(lambda: (api.get(PLURAL, NS, JOB) or {}).get("status", {}).get("phase") == "Initializing",
                   what="Initializing", log=op.log)
    deadline = asyncio.get_running_loop().time() + 20
    while asyncio.get_running_loop().time() < deadline:
        count = len(api.requests_of())
        await asyncio.sleep(quiet)
        if len(api.requests_of()) == count:
            return
    raise AssertionError("the operator never went quiet")


def template_annotations(api: BareApiserver, plural: str, name: str) -> dict:
    obj = api.get(plural, NS, name) or {}
    return obj.get("spec", {}).get("template", {}).get("metadata", {}).get("annotations") or {}


# Workloads whose pods read the managed Redis Secret: Redis (requirepass), rollout and trainer (URL).
SECRET_USERS = (("statefulsets", N.redis(JOB)), ("deployments", N.rollout(JOB)), ("statefulsets", N.trainer(JOB)))


# ----------------------------------------------------------------------------------- fixtures


async def _operator(api: BareApiserver, tmp_path: Path, interval: float):
    api.kubeconfig(tmp_path / "kubeconfig")
    op = await OperatorProcess(tmp_path / "kubeconfig", tmp_path / "operator.log", interval=interval).start()
    yield op
    await op.stop()
    assert_rbac_covers(api)


@pytest.fixture
async def watch_only_operator(api: BareApiserver, tmp_path: Path):
    """Status passes once a minute: anything corrected within seconds was corrected by the watches."""
    async for op in _operator(api, tmp_path, interval=60):
        yield op


@pytest.fixture
async def operator(api: BareApiserver, tmp_path: Path):
    async for op in _operator(api, tmp_path, interval=0.3):
        yield op


# ----------------------------------------------------------------------------------- pure: what is compared


@pytest.mark.cluster
async def test_server_defaults_are_not_drift(api: BareApiserver):
    """Every child, as the apiserver would store it (a server-side dry run: its defaults, canonical
    quantities, `stringData` as base64 `data`), needs no patch."""
    doc = JobBuilder.example().named(JOB, NS).doc()
    doc["spec"]["redis"]["managed"]["resources"]["cpu"] = "0.5"  # stored as "500m"
    for obj in build(doc):
        desired = stamp(obj)
        async with api.post(api.path(plural_of(obj), NS) + "?dryRun=All", json=desired) as resp:
            assert resp.status == 201, await resp.text()
            live = await resp.json()
        body = patch_body(desired)
        if body is not None:
            assert differences(live, body) == [], obj["kind"]


def plural_of(obj: dict) -> str:
    """The resource a child is stored as (the operator's own table: a new kind needs no test edit)."""
    return KINDS[obj["kind"]][2]


def test_differences_name_what_was_edited():
    deploy = next(o for o in build(JobBuilder.example().named(JOB, NS).doc()) if o["kind"] == "Deployment")
    body = patch_body(stamp(deploy))
    assert body is not None
    live = copy.deepcopy(stamp(deploy))
    live["spec"]["replicas"] = 9
    live["spec"]["template"]["spec"]["containers"][2]["image"] = "evil:1"
    live["spec"]["template"]["spec"]["containers"][2]["env"].pop()
    live["metadata"]["labels"].pop(N.LABEL_JOB)
    live["metadata"]["annotations"]["someone/else"] = "kept"  # not ours: never drift
    assert differences(live, body) == [
        "spec.replicas", "spec.template.spec.containers[2].image", "spec.template.spec.containers[2].env",
        f"metadata.labels.{N.LABEL_JOB}"]
    # A desired change that only removes something is caught by the desired-hash annotation.
    smaller = copy.deepcopy(deploy)
    smaller["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"].pop("cpu")
    assert differences(live, patch_body(stamp(smaller))), "removal must not look in sync"


# ----------------------------------------------------------------------------------- the real operator

slow = pytest.mark.slow


@slow
async def test_hand_edited_rollout_is_corrected_within_seconds(api, watch_only_operator):
    op = watch_only_operator
    await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=op.log)
    await settled(api, op)
    name = N.rollout(JOB)
    before = api.get("deployments", NS, name)
    containers = copy.deepcopy(before["spec"]["template"]["spec"]["containers"])
    containers[0]["image"] = "attacker/sglang:evil"
    await request(api, "PATCH", path("deployments", name),
                  {"spec": {"replicas": 9, "template": {"spec": {"containers": containers}}}})
    assert api.get("deployments", NS, name)["spec"]["replicas"] == 9

    def corrected() -> bool:
        now = api.get("deployments", NS, name)
        return (now["spec"]["replicas"] == 4
                and now["spec"]["template"]["spec"]["containers"][0]["image"] == before["spec"]["template"]["spec"][
                    "containers"][0]["image"])

    await poll(corrected, timeout=5, what="replicas and image restored", log=op.log)
    log = op.log.read_text()
    assert f"deployments {NS}/{name} changed (MODIFIED): waking job {JOB}" in log, "the watch saw the edit"
    assert f"Deployment {NS}/{name} differs from the desired state at spec.replicas, " \
           "spec.template.spec.containers[0].image: patching" in log


@slow
async def test_deleted_children_are_recreated(api, watch_only_operator):
    op = watch_only_operator
    await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=op.log)
    await settled(api, op)
    old = api.get("deployments", NS, N.rollout(JOB))
    await request(api, "DELETE", path("deployments", N.rollout(JOB)))
    await request(api, "DELETE", path("configmaps", N.config_map(JOB)))
    await poll(lambda: (api.get("deployments", NS, N.rollout(JOB)) or {}).get("metadata", {}).get("uid")
                   not in (None, old["metadata"]["uid"]), timeout=5, what="rollout Deployment re-created", log=op.log)
    await poll(lambda: api.get("configmaps", NS, N.config_map(JOB)), timeout=5, what="ConfigMap re-created",
                   log=op.log)
    assert f"deployments {NS}/{N.rollout(JOB)} changed (DELETED): waking job {JOB}" in op.log.read_text()


@slow
async def test_redis_secret_and_its_users_never_disagree(api, operator):
    """Invariant: every pod template that reads the Redis Secret carries the hash of the live Secret,
    so after any change of the Secret (deleted and re-created with a new password, or rotated by
    hand) Redis (requirepass) and every client (URL) are rolled onto the same Secret. Secrets are
    not watched (that needs cluster-wide list/watch on Secrets): the interval's pass corrects them."""
    op = operator
    await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=op.log)

    def secret() -> dict | None:
        return api.get("secrets", NS, N.redis_secret(JOB))

    def password(s: dict) -> str:
        return base64.b64decode(s["data"]["password"]).decode()

    def users_agree_with(s: dict) -> bool:
        want = B.secret_hash(s)
        return all(template_annotations(api, p, n).get(N.ANNOTATION_REDIS_AUTH_HASH) == want for p, n in SECRET_USERS)

    first = await poll(lambda: (s := secret()) and users_agree_with(s) and s, timeout=10,
                           what="consistent from the start", log=op.log)
    # Redis takes requirepass from the Secret's `password`, clients their URL from its `url`.
    redis = api.get("statefulsets", NS, N.redis(JOB))["spec"]["template"]["spec"]
    auth = next(v["secret"] for v in redis["volumes"] if v["name"] == B.REDIS_AUTH_VOLUME)
    assert (auth["secretName"], auth["items"][0]["key"]) == (N.redis_secret(JOB), "password")
    for plural, name in SECRET_USERS[1:]:
        files = secret_files(api.get(plural, NS, name)["spec"]["template"]["spec"])
        assert [found[ENV_REDIS_URL] for found in files.values() if ENV_REDIS_URL in found] == [
            (N.redis_secret(JOB), "url")], name
    assert f":{password(first)}@" in base64.b64decode(first["data"]["url"]).decode()

    # Deleted: re-created with a new password, and Redis, rollout and trainer all roll onto it.
    await request(api, "DELETE", path("secrets", N.redis_secret(JOB)))
    second = await poll(lambda: (s := secret()) and s["metadata"]["uid"] != first["metadata"]["uid"] and s,
                            timeout=5, what="Secret re-created", log=op.log)
    assert password(second) != password(first)
    await poll(lambda: users_agree_with(second), timeout=5, what="every user rolled onto the new Secret",
                   log=op.log)
    assert f":{password(second)}@" in base64.b64decode(second["data"]["url"]).decode()

    # Rotated by hand (same object, new content): the users roll again.
    new_pw = "rotated-by-hand"
    url = f"redis://:{new_pw}@{N.redis(JOB)}.{NS}.svc:6379/0"
    await request(api, "PATCH", path("secrets", N.redis_secret(JOB)),
                  {"data": {"password": base64.b64encode(new_pw.encode()).decode(),
                            "url": base64.b64encode(url.encode()).decode()}})
    third = secret()
    assert third is not None and password(third) == new_pw
    await poll(lambda: users_agree_with(third), timeout=5, what="every user rolled onto the rotated Secret",
                   log=op.log)
    assert password(secret()) == new_pw, "the operator never overwrites a Secret"
    hashes = {template_annotations(api, p, n)[N.ANNOTATION_REDIS_AUTH_HASH] for p, n in SECRET_USERS}
    assert len(hashes) == 1 and new_pw not in next(iter(hashes))


@slow
async def test_a_new_engine_key_rolls_the_rollout_and_the_trainer_not_redis(api, operator):
    """The engine API key Secret is created once (never patched) and its users (the rollout pods,
    whose engine requires it, and the trainer, which sends it) carry its hash: a re-created Secret
    rolls both onto the new key, so engine and clients never disagree; Redis does not read it."""
    op = operator
    await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=op.log)
    users = SECRET_USERS[1:]

    def secret() -> dict | None:
        return api.get("secrets", NS, N.engine_secret(JOB))

    def users_agree_with(s: dict) -> bool:
        want = B.secret_hash(s)
        return all(template_annotations(api, p, n).get(N.ANNOTATION_ENGINE_AUTH_HASH) == want for p, n in users)

    first = await poll(lambda: (s := secret()) and users_agree_with(s) and s, timeout=10,
                           what="consistent from the start", log=op.log)
    assert N.ANNOTATION_ENGINE_AUTH_HASH not in template_annotations(api, *SECRET_USERS[0])
    await request(api, "DELETE", path("secrets", N.engine_secret(JOB)))
    second = await poll(lambda: (s := secret()) and s["metadata"]["uid"] != first["metadata"]["uid"] and s,
                            timeout=5, what="Secret re-created", log=op.log)
    assert second["data"]["api-key"] != first["data"]["api-key"]
    await poll(lambda: users_agree_with(second), timeout=5, what="rollout and trainer rolled onto the new key",
                   log=op.log)


@slow
async def test_no_patch_when_nothing_drifted(api, operator):
    """Many status passes and watch events (status updates included) over objects carrying the API
    server's defaults: not one PATCH of a child."""
    await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=operator.log)
    await poll(lambda: (api.get(PLURAL, NS, JOB) or {}).get("status", {}).get("phase") == "Initializing",
                   what="Initializing", log=operator.log)
    await api.patch_status("apps", "v1", "deployments", NS, N.rollout(JOB), {"replicas": 4, "readyReplicas": 4})
    await api.patch_status("apps", "v1", "statefulsets", NS, N.trainer(JOB), {"replicas": 1, "readyReplicas": 1})
    await api.patch_status("apps", "v1", "statefulsets", NS, N.redis(JOB), {"replicas": 1, "readyReplicas": 1})
    await poll(lambda: (api.get(PLURAL, NS, JOB) or {}).get("status", {}).get("phase") == "Running",
                   what="Running", log=operator.log)
    passes = lambda: sum(1 for r in api.log if r.verb == "list" and r.resource == "pods")  # noqa: E731 - one a pass
    start = passes()
    await poll(lambda: passes() >= start + 10, what="ten more passes", log=operator.log)
    assert child_patches(api) == [], "a pass over unchanged children sent a PATCH"
    gets = [r for r in api.log if r.verb == "get" and r.resource == "deployments"]
    assert len(gets) >= 10, "the passes did read the live objects"
    # The owned kinds (not Secrets: least privilege) are watched, streaming only our children.
    watched = {r.resource: parse_qs(urlsplit(r.uri).query).get("labelSelector", [None])[0]
               for r in api.requests_of() if r.verb == "watch" and r.resource in CHILD_PLURALS}
    assert watched == {p: N.owned_selector() for p in CHILD_PLURALS if p not in ("persistentvolumeclaims", "secrets")}


@slow
async def test_weights_survive_the_job_unless_asked(api, operator):
    short_lived = JobBuilder.example(startupDeadlineSeconds=1, ttlSecondsAfterFinished=0).named(JOB, NS).doc()
    job = await create_job(api, short_lived)
    await poll(lambda: api.get(PLURAL, NS, JOB) is None, what="job deleted by its TTL", log=operator.log)
    pvc = api.get("persistentvolumeclaims", NS, N.shared_pvc(JOB))
    assert pvc is not None, "the weights volume outlives the job and its TTL"
    assert not pvc["metadata"].get("ownerReferences")
    deployment = api.get("deployments", NS, N.rollout(JOB))  # the rest goes with the job (its collector)
    assert [r["uid"] for r in deployment["metadata"]["ownerReferences"]] == [job["metadata"]["uid"]]
    assert f"persistentvolumeclaims/{N.shared_pvc(JOB)}" not in await api.collect_garbage(NS, job["metadata"]["uid"])

    # A volume that an older operator made the job's (it owned every child) is let go of.
    await request(api, "DELETE", path("persistentvolumeclaims", N.shared_pvc(JOB)))
    job = await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    owner = lambda: (api.get("persistentvolumeclaims", NS, N.shared_pvc(JOB)) or {}).get(  # noqa: E731
        "metadata", {}).get("ownerReferences")
    await poll(lambda: api.get("persistentvolumeclaims", NS, N.shared_pvc(JOB)), what="PVC", log=operator.log)
    ref = {"apiVersion": f"{GROUP}/{VERSION}", "kind": "AsyncRLJob", "name": JOB, "uid": job["metadata"]["uid"],
           "controller": True, "blockOwnerDeletion": True}
    await request(api, "PATCH", path("persistentvolumeclaims", N.shared_pvc(JOB)),
                  {"metadata": {"ownerReferences": [ref]}})
    await poll(lambda: not owner(), what="ownerReference removed by a status pass", log=operator.log)
    await request(api, "DELETE", f"/apis/{GROUP}/{VERSION}/namespaces/{NS}/{PLURAL}/{JOB}")
    await api.collect_garbage(NS, job["metadata"]["uid"])
    assert api.get("persistentvolumeclaims", NS, N.shared_pvc(JOB)) is not None
    await request(api, "DELETE", path("persistentvolumeclaims", N.shared_pvc(JOB)))

    # Asked for (at creation: spec.storage is immutable): owned, and deleted with the job.
    job = await create_job(api, JobBuilder.example(storage={"size": "1Gi", "deleteWithJob": True}).named(JOB, NS).doc())
    await poll(owner, what="PVC owned by the job (the collector deletes it with the job)", log=operator.log)
    assert owner() == [{**ref, "uid": job["metadata"]["uid"]}]


@slow
async def test_redis_data_goes_with_the_job_and_pods_know_the_uid(api, operator):
    job = await create_job(api, JobBuilder.example().named(JOB, NS).doc())
    await poll(lambda: children_exist(api), what="children", log=operator.log)
    redis = api.get("statefulsets", NS, N.redis(JOB))
    assert redis["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    assert redis["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    for plural, name in SECRET_USERS[1:]:
        containers = api.get(plural, NS, name)["spec"]["template"]["spec"]["containers"]
        users = [c for c in containers if any(e["name"] == ENV_REDIS_URL + FILE_SUFFIX for e in c.get("env", []))]
        assert users
        for c in users:
            assert {"name": ENV_JOB_UID, "value": job["metadata"]["uid"]} in c["env"], (name, c["name"])
