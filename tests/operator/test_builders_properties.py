"""Properties of the pure builders that must hold for every job, plus kubernetes-validate on each child."""

from __future__ import annotations

import copy
import re
import subprocess
import time
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from asyncrl.api.engine_servers import ENGINE_KEY_DIR, PROXY_LIVE_PATH, PROXY_READY_PATH, engine_proxy_command
from asyncrl.api.loader import parse_job
from asyncrl.api.runtime import (
    ENV_ENGINE_API_KEY,
    ENV_ENGINE_URL,
    ENV_JOB_UID,
    ENV_POD_NAME,
    ENV_REDIS_URL,
    ENV_STATUS_TOKEN,
    ENV_WEIGHT_GROUP_ADDRESS,
    ENV_WEIGHT_GROUP_PORT,
    ENV_WEIGHTS_DIR,
)
from asyncrl.cli import COMMANDS
from asyncrl.infra.net import free_port
from asyncrl.operator import builders as B
from asyncrl.operator import multinode as MN
from asyncrl.operator import names as N
from tests.support.job_builds import OPERATOR_PEER, build, secret_env, secret_files
from tests.support.jobs import JobBuilder
from tests.support.redis_image import redis_bin_dir

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


VARIANTS = {
    "cluster": JobBuilder.example().doc(),
    "local": JobBuilder.example("local").doc(),
    "vllm-multinode": JobBuilder.example(**{"rollout.engine": "vllm", "trainer.replicas": 3,
                                         "trainer.gpusPerReplica": 4}).doc(),
    "external-redis-existing-claim": JobBuilder.example(**{"redis": {"mode": "external",
                                                        "external": {"urlSecret": {"name": "r", "key": "url"}}},
                                             "storage.claimName": "shared-rwx"}).doc(),
    "suspended": JobBuilder.example(suspend=True).doc(),
    "weights-deleted-with-job": JobBuilder.example(**{"storage.deleteWithJob": True}).doc(),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_children_owned_labelled_valid(variant):
    objs = build(VARIANTS[variant])
    job_name = VARIANTS[variant]["metadata"]["name"]
    delete_with_job = VARIANTS[variant]["spec"].get("storage", {}).get("deleteWithJob", False)
    for obj in objs:
        meta = obj["metadata"]
        if obj["kind"] == "PersistentVolumeClaim" and not delete_with_job:
            assert "ownerReferences" not in meta, "the weights volume outlives the job by default"
        else:
            assert meta["ownerReferences"] == [{"apiVersion": "asyncrl.dev/v1alpha1", "kind": "AsyncRLJob",
                                                "name": job_name, "uid": "uid-1", "controller": True,
                                                "blockOwnerDeletion": True}]
        assert meta["labels"][N.LABEL_JOB] == job_name and meta["labels"][N.LABEL_MANAGED_BY] == N.MANAGED_BY
        assert meta["namespace"] == "ns"
        for version in ("1.29.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(obj, version, strict=True)


def pods(objs: list[dict]) -> list[dict]:
    return [o["spec"]["template"]["spec"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pods_are_restricted_non_root(variant):
    for pod in pods(build(VARIANTS[variant])):
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] > 0
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        for c in pod["containers"]:
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["capabilities"] == {"drop": ["ALL"]}


def test_long_job_names_fit_kubernetes_limits():
    base = "a" * 60 + "-xyz"  # 64 > 63 is rejected by the spec; use the maximum, 63
    for name in ("j" + "x" * 62, "b" * 40 + "-" + "c" * 22, "q"):
        objs = build(VARIANTS["cluster"], name=name)
        names = [o["metadata"]["name"] for o in objs]
        for o in objs:
            n = o["metadata"]["name"]
            limit = {"StatefulSet": N.MAX_STATEFULSET, "Deployment": N.MAX_DEPLOYMENT}.get(o["kind"], N.MAX_NAME)
            assert len(n) <= limit and DNS1035.match(n), (o["kind"], n)
        assert len(set(zip(names, [o["kind"] for o in objs]))) == len(objs)
    assert len(base) == 64
    # Two long names that share a prefix still get different children.
    a = N.rollout("x" * 50 + "-one")
    b = N.rollout("x" * 50 + "-two")
    assert a != b and len(a) <= N.MAX_DEPLOYMENT


def test_gpus_land_in_limits():
    objs = {(o["kind"], o["metadata"]["name"]): o for o in build(VARIANTS["cluster"])}
    engine = objs[("Deployment", "qwen25-gsm8k-rollout")]["spec"]["template"]["spec"]["containers"][0]
    trainer = objs[("StatefulSet", "qwen25-gsm8k-trainer")]["spec"]["template"]["spec"]["containers"][0]
    assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert trainer["resources"]["limits"]["nvidia.com/gpu"] == "8"
    assert "nvidia.com/gpu" not in engine["resources"].get("requests", {})
    local = build(VARIANTS["local"])
    for pod in pods(local):
        for c in pod["containers"]:
            assert "nvidia.com/gpu" not in c.get("resources", {}).get("limits", {})


def test_rollout_pod_engine_and_worker():
    objs = build(VARIANTS["cluster"])
    pod = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    engine, proxy, worker = pod["containers"]
    assert engine["command"][:3] == ["python3", "-m", "sglang.launch_server"]
    assert engine["command"][-2:] == ["--mem-fraction-static", "0.85"]
    at = engine["command"].index("--host")
    assert engine["command"][at:at + 4] == ["--host", "127.0.0.1", "--port", "30001"], "loopback only"
    assert proxy["command"] == engine_proxy_command(port=30000, upstream_port=30001, health_path="/health",
                                                    api_key_file=f"{ENGINE_KEY_DIR}/api-key")
    assert proxy["readinessProbe"]["httpGet"]["path"] == PROXY_READY_PATH
    assert proxy["livenessProbe"]["httpGet"]["path"] == PROXY_LIVE_PATH
    assert worker["command"] == ["asyncrl", "rollout", "--config", B.CONFIG_FILE]
    env = {e["name"]: e for e in worker["env"]}
    assert env[ENV_ENGINE_URL]["value"] == "http://127.0.0.1:30001", "the worker talks to its engine directly"
    assert secret_files(pod)["worker"][ENV_REDIS_URL] == ("qwen25-gsm8k-redis-auth", "url")
    assert env[ENV_POD_NAME]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert env[ENV_WEIGHTS_DIR]["value"].startswith(B.SHARED_DIR)
    hf = next(o for o in build(VARIANTS["local"]) if o["kind"] == "Deployment")
    assert hf["spec"]["template"]["spec"]["containers"][0]["command"][:2] == ["asyncrl", "engine"]


def test_commands_are_asyncrl_subcommands():
    known = {name for name, _, _ in COMMANDS}
    for variant in VARIANTS.values():
        for pod in pods(build(variant)):
            for c in pod["containers"]:
                cmd = c["command"]
                if cmd[0] == "asyncrl":
                    assert cmd[1] in known
                if cmd[0] == "torchrun":
                    i = cmd.index("asyncrl.cli")
                    assert cmd[i - 1] == "-m" and cmd[i + 1] in known


def test_multinode_trainer_rendezvous():
    objs = build(VARIANTS["vllm-multinode"])
    sts = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("trainer"))
    cmd = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--nnodes=3" in cmd and "--nproc-per-node=4" in cmd and "--rdzv-backend=static" in cmd
    assert "--rdzv-endpoint=qwen25-gsm8k-trainer-0.qwen25-gsm8k-trainer.ns.svc:29500" in cmd
    # rank 0 is pod 0: the node rank is the pod's ordinal (tests/operator/test_multinode_trainer.py runs it)
    assert "--node-rank=$(ASYNCRL_NODE_RANK)" in cmd
    env = {e["name"]: e for e in sts["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["ASYNCRL_NODE_RANK"]["valueFrom"] == {"fieldRef": {
        "fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    headless = next(o for o in objs if o["kind"] == "Service" and o["metadata"]["name"] == "qwen25-gsm8k-trainer")
    assert headless["spec"]["clusterIP"] == "None" and sts["spec"]["serviceName"] == "qwen25-gsm8k-trainer"


def test_vllm_engine_reports_logprobs_after_temperature_and_exposes_weight_reload():
    objs = build(VARIANTS["vllm-multinode"])
    deploy = next(o for o in objs if o["kind"] == "Deployment")
    engine = next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")
    cmd = engine["command"]
    assert cmd[cmd.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert {"name": "VLLM_SERVER_DEV_MODE", "value": "1"} in engine["env"]


def test_external_redis_and_existing_claim():
    objs = build(VARIANTS["external-redis-existing-claim"])
    kinds = [o["kind"] for o in objs]
    assert "PersistentVolumeClaim" not in kinds
    # No Redis Secret of ours: only the status endpoint's token and the engine API key.
    assert [o["metadata"]["name"] for o in objs if o["kind"] == "Secret"] == [N.status_secret("qwen25-gsm8k"),
                                                                             N.engine_secret("qwen25-gsm8k")]
    # No Redis of ours, so no Redis policy: exactly the two that guard the engine and the trainer.
    policies = {o["metadata"]["name"]: o["spec"]["podSelector"]["matchLabels"]
                for o in objs if o["kind"] == "NetworkPolicy"}
    assert policies == {"qwen25-gsm8k-trainer": N.selector_labels("qwen25-gsm8k", "trainer"),
                        "qwen25-gsm8k-rollout": N.selector_labels("qwen25-gsm8k", "rollout")}
    assert next(o for o in objs if o["kind"] == "StatefulSet")["metadata"]["name"].endswith("trainer")
    pod = next(o for o in objs if o["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert secret_files(pod)["worker"][ENV_REDIS_URL] == ("r", "url")
    assert {"name": "shared", "persistentVolumeClaim": {"claimName": "shared-rwx"}} in pod["volumes"]


def test_managed_redis_aof_and_network_policy():
    objs = build(VARIANTS["cluster"])
    redis = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("redis"))
    args = redis["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--appendonly" in args and args[args.index("--appendonly") + 1] == "yes"
    assert args[args.index("--appendfsync") + 1] == "always"  # everysec loses acked writes on a kill
    assert redis["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "20Gi"
    netpol = next(o for o in objs if o["kind"] == "NetworkPolicy")
    assert netpol["spec"]["podSelector"]["matchLabels"] == N.selector_labels("qwen25-gsm8k", "redis")
    # The job's own pods, and the operator's pod (from its namespace only), which reads the trainer's
    # outcome there.
    assert netpol["spec"]["ingress"][0]["from"] == [{"podSelector": {"matchLabels": {N.LABEL_JOB: "qwen25-gsm8k"}}},
                                                    OPERATOR_PEER]


def test_managed_redis_is_requested_limited_and_full_without_evicting():
    """Not BestEffort by default (first evicted, refused by quotas that need requests), and maxmemory at
    90% of the limit with noeviction: a full Redis refuses writes, never drops untrained trajectories."""
    def redis_container(managed: dict | None) -> dict:
        doc = copy.deepcopy(VARIANTS["cluster"])
        doc["spec"]["redis"] = {"mode": "managed", **({"managed": managed} if managed is not None else {})}
        sts = next(o for o in build(doc) if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("redis"))
        return sts["spec"]["template"]["spec"]["containers"][0]

    default = redis_container(None)
    assert default["resources"] == {"requests": {"cpu": "1", "memory": "2Gi"}, "limits": {"cpu": "1", "memory": "2Gi"}}
    args = default["args"]
    assert args[args.index("--maxmemory") + 1] == str(2 * 1024 ** 3 * 9 // 10)
    assert args[args.index("--maxmemory-policy") + 1] == "noeviction"
    bigger = redis_container({"resources": {"memory": "10Gi"}})  # the cpu default stays
    assert bigger["resources"]["limits"] == {"cpu": "1", "memory": "10Gi"}
    assert bigger["args"][bigger["args"].index("--maxmemory") + 1] == str(9 * 1024 ** 3)
    unlimited = redis_container({"resources": {"memory": None}})
    assert "memory" not in unlimited["resources"]["limits"] and "--maxmemory" not in unlimited["args"]


def _policy(objs: list[dict], component: str) -> dict:
    return next(o for o in objs if o["kind"] == "NetworkPolicy" and o["metadata"]["labels"][N.LABEL_COMPONENT]
                == component)




@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_engine_port_admits_only_the_jobs_own_pods(variant):
    """The engine's admin API (pause, weight updates, vLLM's /collective_rpc) sits behind the key and
    behind a policy on the rollout pods that admits the job's pods, on the engine port only."""
    objs = build(VARIANTS[variant])
    job = VARIANTS[variant]["metadata"]["name"]
    policy = _policy(objs, "rollout")
    assert policy["metadata"]["name"] == N.rollout(job)
    assert policy["spec"] == {
        "podSelector": {"matchLabels": N.selector_labels(job, "rollout")},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": {N.LABEL_JOB: job}}}],
                     "ports": [{"protocol": "TCP", "port": B.ENGINE_PORT}]}]}
    deploy = next(o for o in objs if o["kind"] == "Deployment")
    proxy = next(c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "engine-proxy")
    assert [p["containerPort"] for p in proxy["ports"]] == [B.ENGINE_PORT], "the port the policy names"
    assert policy["spec"]["podSelector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]


def test_trainer_ports_admit_the_job_and_the_operator_on_status_only():
    objs = build(JobBuilder.example(**{"trainer.statusPort": 8123, "trainer.replicas": 2}).doc())
    policy = _policy(objs, "trainer")
    sts = next(o for o in objs if o["kind"] == "StatefulSet" and o["metadata"]["name"].endswith("-trainer"))
    assert policy["spec"]["podSelector"]["matchLabels"] == sts["spec"]["selector"]["matchLabels"]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    ranks, job, operator = policy["spec"]["ingress"]
    # rank to rank: every port (NCCL and Gloo use ephemeral ones after the c10d rendezvous)
    assert ranks == {"from": [{"podSelector": {"matchLabels": N.selector_labels("qwen25-gsm8k", "trainer")}}]}
    assert job == {"from": [{"podSelector": {"matchLabels": {N.LABEL_JOB: "qwen25-gsm8k"}}}],
                   "ports": [{"protocol": "TCP", "port": B.RDZV_PORT}, {"protocol": "TCP", "port": 8123}]}
    assert operator == {"from": [OPERATOR_PEER], "ports": [{"protocol": "TCP", "port": 8123}]}
    ports = {p["name"]: p["containerPort"] for p in sts["spec"]["template"]["spec"]["containers"][0]["ports"]}
    assert ports == {"status": 8123, "rdzv": B.RDZV_PORT}, "the ports the policy names"
    assert f"--rdzv-endpoint={N.trainer('qwen25-gsm8k')}-0.{N.trainer('qwen25-gsm8k')}.ns.svc:{B.RDZV_PORT}" \
        in sts["spec"]["template"]["spec"]["containers"][0]["command"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_network_policies_come_before_the_pods_they_guard(variant):
    """Applied in order: a pod never runs before the policy that closes its ports exists."""
    kinds = [(o["kind"], o["metadata"]["labels"][N.LABEL_COMPONENT]) for o in build(VARIANTS[variant])]
    assert kinds.index(("NetworkPolicy", "trainer")) < kinds.index(("StatefulSet", "trainer"))
    assert kinds.index(("NetworkPolicy", "rollout")) < kinds.index(("Deployment", "rollout"))


def test_redis_password_is_on_no_argv():
    """The password comes from the Secret, mounted as a file, into an in-memory config file; neither the
    pod spec, the process's arguments (`ps`) nor its environment carry it or a reference that expands to it."""
    redis = next(o for o in build(VARIANTS["cluster"]) if o["kind"] == "StatefulSet"
                 and o["metadata"]["name"].endswith("-redis"))
    pod = redis["spec"]["template"]["spec"]
    c = pod["containers"][0]
    argv = [*c["command"], *c["args"]]
    assert not any("REDIS_PASSWORD" in a and "$(" in a for a in argv), "kubelet would expand it into argv"
    assert "--requirepass" not in argv and "requirepass" not in " ".join(c["args"])
    assert c["command"][:2] == ["sh", "-c"] and "exec redis-server " + B.REDIS_CONF in c["command"][2]
    assert {"name": B.REDIS_CONF_VOLUME, "mountPath": B.REDIS_CONF_DIR} in c["volumeMounts"]
    assert {"name": B.REDIS_CONF_VOLUME, "emptyDir": {"medium": "Memory", "sizeLimit": "1Mi"}} in pod["volumes"]
    assert "env" not in c, "no secret (nor anything else) in the Redis container's environment"
    assert {"name": B.REDIS_AUTH_VOLUME, "mountPath": B.REDIS_AUTH_DIR, "readOnly": True} in c["volumeMounts"]
    auth = next(v for v in pod["volumes"] if v["name"] == B.REDIS_AUTH_VOLUME)["secret"]
    assert (auth["secretName"], auth["items"]) == (N.redis_secret("qwen25-gsm8k"),
                                                   [{"key": "password", "path": "password"}])
    assert f"{B.REDIS_AUTH_DIR}/password" == B.REDIS_PASSWORD_FILE and B.REDIS_PASSWORD_FILE in c["command"][2]
    assert c["readinessProbe"]["exec"]["command"][:3] == ["sh", "-c", B.REDIS_PING_SCRIPT]
    assert "pw" not in yaml.safe_dump(redis), "the rendered password is only in the Secret"


def test_the_redis_scripts_run_the_real_server_on_the_password_file(tmp_path: Path):
    """The managed Redis container's command and readiness probe, run as written (paths moved here) with
    the real server: it starts on the Secret file's password (no trailing newline, as a Secret volume
    holds it), refuses a client without it, the probe's ping answers, and the password is in neither
    the server's argv nor its environment."""
    password = "s3cret-" + "ab12" * 8  # the operator draws hex (a space would stop Redis: the line is unquoted)
    secret = tmp_path / "password"
    secret.write_text(password)
    port = free_port()

    def here(argv: list[str]) -> list[str]:
        """The container's argv with this test's paths and port."""
        return [a.replace(B.REDIS_PASSWORD_FILE, str(secret)).replace(B.REDIS_CONF, str(tmp_path / "auth.conf"))
                for a in argv]

    env = {"PATH": f"{redis_bin_dir(tmp_path)}:/usr/bin:/bin"}
    redis = next(o for o in build(VARIANTS["cluster"]) if o["kind"] == "StatefulSet"
                 and o["metadata"]["name"].endswith("-redis"))["spec"]["template"]["spec"]["containers"][0]
    args = ["--port", str(port), "--dir", str(tmp_path), "--save", ""]
    server = subprocess.Popen(here([*redis["command"], *args]), env=env)
    try:
        cli = [str(redis_bin_dir(tmp_path) / "redis-cli"), "-p", str(port)]
        deadline = time.monotonic() + 20
        while "NOAUTH" not in (out := subprocess.run([*cli, "ping"], capture_output=True, text=True, env=env)).stdout:
            assert time.monotonic() < deadline and server.poll() is None, out
            time.sleep(0.1)
        ping = here(redis["readinessProbe"]["exec"]["command"])
        assert ping[-3:] == ["-p", str(B.REDIS_PORT), "ping"], "the port as its own argument (the cluster maps it)"
        ping[-2] = str(port)
        probe = subprocess.run(ping, capture_output=True, text=True, env=env)
        assert probe.stdout.strip() == "PONG", probe
        proc = Path(f"/proc/{server.pid}")
        assert password.encode() not in proc.joinpath("cmdline").read_bytes()
        assert password.encode() not in proc.joinpath("environ").read_bytes()
        assert (tmp_path / "auth.conf").stat().st_mode & 0o077 == 0, "the config file is the server user's alone"
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_suspend_scales_to_zero_and_keeps_redis():
    objs = build(VARIANTS["suspended"])
    replicas = {(o["kind"], o["metadata"]["name"]): o["spec"]["replicas"]
                for o in objs if "replicas" in o.get("spec", {})}
    assert replicas[("Deployment", "qwen25-gsm8k-rollout")] == 0
    assert replicas[("StatefulSet", "qwen25-gsm8k-trainer")] == 0
    assert replicas[("StatefulSet", "qwen25-gsm8k-redis")] == 1


def test_scaling_does_not_change_the_pod_template():
    a = build(VARIANTS["cluster"])
    b = build(JobBuilder.example(**{"rollout.replicas": 9}).doc())
    deploy = lambda objs: next(o for o in objs if o["kind"] == "Deployment")  # noqa: E731
    assert deploy(a)["spec"]["template"] == deploy(b)["spec"]["template"]
    c = build(JobBuilder.example(**{"algorithm.temperature": 0.7}).doc())
    assert deploy(a)["spec"]["template"] != deploy(c)["spec"]["template"], "config changes roll the pods"


def test_config_map_holds_the_validated_job_with_defaults():
    cm = build(VARIANTS["local"])[0]
    doc = yaml.safe_load(cm["data"]["job.yaml"])
    job = parse_job(doc)
    assert job.spec.algorithm.clip_eps == 0.2  # a default, written out
    assert doc["spec"]["algorithm"]["clipEps"] == 0.2


def test_weights_volume_is_owned_only_when_asked():
    pvc = lambda objs: next(o for o in objs if o["kind"] == "PersistentVolumeClaim")  # noqa: E731
    assert "ownerReferences" not in pvc(build(VARIANTS["cluster"]))["metadata"]
    assert pvc(build(VARIANTS["weights-deleted-with-job"]))["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    deploy = lambda objs: next(o for o in objs if o["kind"] == "Deployment")  # noqa: E731
    assert deploy(build(VARIANTS["cluster"])) == deploy(build(VARIANTS["weights-deleted-with-job"])), \
        "a lifecycle knob: changing it restarts no pod"


def test_redis_data_volume_goes_with_its_statefulset():
    redis = next(o for o in build(VARIANTS["cluster"]) if o["metadata"]["name"].endswith("-redis")
                 and o["kind"] == "StatefulSet")
    assert redis["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    assert redis["metadata"]["ownerReferences"][0]["uid"] == "uid-1", "and the job owns the StatefulSet"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_every_asyncrl_process_knows_the_job_uid(variant):
    """The uid goes into every Redis key: a re-created job never reads the old run's streams."""
    for pod in pods(build(VARIANTS[variant])):
        for c in pod["containers"]:
            names = [e["name"] for e in c.get("env", [])]
            if ENV_REDIS_URL in names:
                assert {"name": ENV_JOB_UID, "value": "uid-1"} in c["env"], c["name"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_pods_that_read_the_redis_secret_carry_its_hash(variant):
    """Redis, rollout and trainer pod templates carry the Secret's hash, so a new Secret rolls them all."""
    objs = build(VARIANTS[variant])
    job = objs[0]["metadata"]["labels"][N.LABEL_JOB]
    secret = next((o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == N.redis_secret(job)), None)
    for obj in objs:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        annotations = obj["spec"]["template"]["metadata"].get("annotations", {})
        if secret is None:
            assert N.ANNOTATION_REDIS_AUTH_HASH not in annotations, "external Redis: the Secret is not ours"
        else:
            assert annotations[N.ANNOTATION_REDIS_AUTH_HASH] == B.secret_hash(secret)
            assert "pw" not in annotations[N.ANNOTATION_REDIS_AUTH_HASH]


def test_secret_hash_reads_data_and_string_data_alike():
    import base64

    rendered = {"metadata": {"uid": "u"}, "stringData": {"password": "pw", "url": "redis://:pw@r:6379/0"}}
    stored = {"metadata": {"uid": "u"}, "data": {k: base64.b64encode(v.encode()).decode()
                                                 for k, v in rendered["stringData"].items()}}
    assert B.secret_hash(rendered) == B.secret_hash(stored)
    assert B.secret_hash(stored) != B.secret_hash({**stored, "metadata": {"uid": "re-created"}})
    rotated = {"metadata": {"uid": "u"}, "stringData": {**rendered["stringData"], "password": "new"}}
    assert B.secret_hash(rotated) != B.secret_hash(rendered)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_trainer_requires_the_jobs_status_token(variant):
    """The trainer alone reads the status-token Secret (a file) and carries its hash, so a rotated token
    restarts the trainer with it; no other pod sees the token."""
    objs = build(VARIANTS[variant])
    job = objs[0]["metadata"]["labels"][N.LABEL_JOB]
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == N.status_secret(job))
    assert secret["metadata"]["ownerReferences"][0]["controller"] is True
    for obj in objs:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = obj["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        files = secret_files(template["spec"])
        holders = [c for c, found in files.items() if ENV_STATUS_TOKEN in found]
        assert N.status_secret(job) not in yaml.safe_dump(template["spec"]["volumes"]) or holders == ["trainer"]
        if obj["metadata"]["name"] == N.trainer(job):
            assert annotations[N.ANNOTATION_STATUS_AUTH_HASH] == B.secret_hash(secret)
            assert holders == ["trainer"] and files["trainer"][ENV_STATUS_TOKEN] == (N.status_secret(job), "token")
        else:
            assert N.ANNOTATION_STATUS_AUTH_HASH not in annotations and not holders


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_engine_api_key_reaches_the_proxy_worker_and_trainer_never_the_engine(variant):
    """One job-owned Secret holds the engine API key: the engine proxy reads it from a file and asks
    every request for it, the worker and the trainer send it, and its hash rolls the rollout pods and
    the trainer (not Redis) when it is rotated. The engine never gets it: neither in its environment
    nor in argv (the pinned SGLang logs its server_args, key included)."""
    objs = build(VARIANTS[variant])
    job = objs[0]["metadata"]["labels"][N.LABEL_JOB]
    secret = next(o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"] == N.engine_secret(job))
    assert secret["metadata"]["ownerReferences"][0]["controller"] is True and "api-key" in secret["stringData"]
    ref = {"secretKeyRef": {"name": N.engine_secret(job), "key": "api-key"}}
    for obj in objs:
        if obj["kind"] not in ("Deployment", "StatefulSet"):
            continue
        template = obj["spec"]["template"]
        annotations = template["metadata"].get("annotations", {})
        if obj["metadata"]["name"] == N.redis(job):
            assert N.ANNOTATION_ENGINE_AUTH_HASH not in annotations
            continue
        assert annotations[N.ANNOTATION_ENGINE_AUTH_HASH] == B.secret_hash(secret)
        key_volumes = [v["name"] for v in template["spec"]["volumes"]
                       if v.get("secret", {}).get("secretName") == N.engine_secret(job)]
        files = secret_files(template["spec"])
        for c in template["spec"]["containers"]:
            env = {e["name"]: e for e in c.get("env", [])}
            mounts = {m["name"] for m in c.get("volumeMounts", [])}
            if c["name"] == "engine":
                assert not [e for e in env.values() if e.get("valueFrom") == ref] and files["engine"] == {}
                assert "--api-key" not in c["command"] and not mounts & set(key_volumes)
                assert not {"VLLM_API_KEY", ENV_ENGINE_API_KEY} & set(env)
            elif c["name"] == "engine-proxy":
                assert not env and [m for m in c["volumeMounts"] if m["name"] in key_volumes] == [
                    {"name": "engine-key", "mountPath": ENGINE_KEY_DIR, "readOnly": True}]
            else:
                assert files[c["name"]][ENV_ENGINE_API_KEY] == (N.engine_secret(job), "api-key"), c["name"]
        if obj["kind"] == "Deployment":
            assert key_volumes == ["engine-key"]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_asyncrl_secrets_reach_its_processes_as_files(variant):
    """No container of ours takes a Secret in its environment (`/proc/*/environ`, crash reports, a child
    that dumps its env): the Redis URL, status token and API keys are mounted files, named by `<VAR>_FILE`."""
    for obj in build(VARIANTS[variant]):
        if obj["kind"] in ("Deployment", "StatefulSet"):
            for c in obj["spec"]["template"]["spec"]["containers"]:
                assert secret_env(c) == [], (obj["metadata"]["name"], c["name"])


# ---- collective weight sync (trainer.weightTransport collective): trainer env, port, Service, policies


def _by_key(objs: list[dict]) -> dict[tuple[str, str], dict]:
    return {(o["kind"], o["metadata"]["name"]): o for o in objs}


def _weight_group_wiring(objs: list[dict]) -> list[str]:
    """Every trace of the weight group in the manifests (env, container or Service port, a policy rule
    without ports)."""
    found = []
    for o in objs:
        text = yaml.safe_dump(o)
        if ENV_WEIGHT_GROUP_ADDRESS in text or ENV_WEIGHT_GROUP_PORT in text or "weight-group" in text:
            found.append(o["metadata"]["name"])
        if o["kind"] == "NetworkPolicy":
            found += [f"{o['metadata']['name']}: all ports from {r['from']}" for r in o["spec"]["ingress"]
                      if "ports" not in r and r["from"] != [{"podSelector": {"matchLabels": N.selector_labels(
                          o["metadata"]["labels"][N.LABEL_JOB], "trainer")}}]]
    return found


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_disk_transport_renders_exactly_as_without_the_field(variant):
    """weightTransport disk (the default, explicit or not) adds no env, port or policy rule."""
    explicit = copy.deepcopy(VARIANTS[variant])
    explicit["spec"].setdefault("trainer", {})["weightTransport"] = "disk"
    assert build(explicit) == build(VARIANTS[variant])
    assert _weight_group_wiring(build(VARIANTS[variant])) == []


@pytest.mark.parametrize("engine", ["sglang", "hf"])
def test_collective_wires_rank0_address_port_and_policies(engine):
    job = "qwen25-gsm8k"
    disk = build(JobBuilder.example(**{"rollout.engine": engine, "trainer.replicas": 2}).doc())
    collective = build(JobBuilder.example(**{"rollout.engine": engine, "trainer.replicas": 2,
                                          "trainer.weightTransport": "collective"}).doc())
    objs = _by_key(collective)
    sts = objs[("StatefulSet", N.trainer(job))]
    trainer = sts["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    # pod 0's stable DNS name through the headless Service: the host torchrun's rendezvous uses
    rdzv = next(a for a in trainer["command"] if a.startswith("--rdzv-endpoint="))
    assert env[ENV_WEIGHT_GROUP_ADDRESS] == MN.rank0_host(job, "ns") == \
        f"{N.trainer(job)}-0.{N.trainer(job)}.ns.svc" == rdzv.removeprefix("--rdzv-endpoint=").rsplit(":", 1)[0]
    assert env[ENV_WEIGHT_GROUP_PORT] == "29600" == str(B.WEIGHT_GROUP_PORT)
    assert {"name": "weight-group", "containerPort": 29600, "protocol": "TCP"} in trainer["ports"]
    headless = objs[("Service", N.trainer(job))]
    assert headless["spec"]["ports"][-1] == {"name": "weight-group", "port": 29600, "targetPort": 29600,
                                             "protocol": "TCP"}
    assert sts["spec"]["serviceName"] == headless["metadata"]["name"] and headless["spec"]["clusterIP"] == "None"
    rollout_peer = {"podSelector": {"matchLabels": N.selector_labels(job, "rollout")}}
    trainer_peer = {"podSelector": {"matchLabels": N.selector_labels(job, "trainer")}}
    trainer_policy, rollout_policy = _policy(collective, "trainer"), _policy(collective, "rollout")
    # every port, both ways: the engines dial the store, then NCCL/Gloo connect on ephemeral ports
    # (trainer to engine, engine to trainer and engine to engine)
    assert trainer_policy["spec"]["ingress"][-1] == {"from": [rollout_peer]}
    assert rollout_policy["spec"]["ingress"][-1] == {"from": [trainer_peer, rollout_peer]}
    # and the disk policies' rules are all still there, in order, first
    assert trainer_policy["spec"]["ingress"][:-1] == _policy(disk, "trainer")["spec"]["ingress"]
    assert rollout_policy["spec"]["ingress"][:-1] == _policy(disk, "rollout")["spec"]["ingress"]
    # the engines get no trainer address (the trainer hands it to them) and no NCCL env without spec.trainer.nccl
    deploy = objs[("Deployment", N.rollout(job))]
    for c in deploy["spec"]["template"]["spec"]["containers"]:
        names = {e["name"] for e in c.get("env", [])}
        assert ENV_WEIGHT_GROUP_ADDRESS not in names and not any(n.startswith(("NCCL_", "GLOO_")) for n in names)
    # nothing else differs from the disk job (the config map says collective; the pods' config hash follows)
    changed = {k for k, o in _by_key(disk).items() if o != objs[k]}
    assert changed == {("ConfigMap", N.config_map(job)), ("Service", N.trainer(job)),
                       ("NetworkPolicy", N.trainer(job)), ("NetworkPolicy", N.rollout(job)),
                       ("StatefulSet", N.trainer(job)), ("Deployment", N.rollout(job))}
    assert len(_weight_group_wiring(collective)) == 4, "what the disk test finds none of: Service, StatefulSet, 2 rules"
    for obj in collective:
        for version in ("1.29.0", kubernetes_validate.latest_version()):
            kubernetes_validate.validate(obj, version, strict=True)
