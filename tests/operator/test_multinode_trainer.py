"""The multi-node trainer's settings: rank 0 is pod 0 (torchrun run as the builders write it), NCCL
env, RDMA opt-in, and a termination grace derived from the model's size (docs/operator.md,
"Multi-node trainer")."""

from __future__ import annotations

import copy
import json
import socket
import subprocess
import sys
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from asyncrl.api.loader import JobFileError, parse_job
from asyncrl.operator import builders as B
from asyncrl.operator import multinode as MN
from tests.support.jobs import JobBuilder
from tests.support.paths import REPO

NS = "rl"




def trainer_sts(doc: dict) -> dict:
    return B.trainer_statefulset(parse_job(doc), B.BuildContext(owner_uid="u", namespace=NS))


def container(doc: dict) -> dict:
    return trainer_sts(doc)["spec"]["template"]["spec"]["containers"][0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


RANK_PROBE = """
import json, os, sys
keys = ("RANK", "GROUP_RANK", "LOCAL_RANK", "WORLD_SIZE")
open(sys.argv[1], "w").write(json.dumps({k: os.environ[k] for k in keys}))
"""


def test_global_rank_0_runs_in_pod_0(tmp_path: Path):
    """Two "pods" run the builders' torchrun command (static rendezvous, --node-rank = the ordinal as
    Kubernetes expands $(ASYNCRL_NODE_RANK)); pod 1 starts first. Pod 0 gets global rank 0 (the one
    that serves /status, where the status Service points) whatever the start order. With the c10d
    rendezvous this was not so: it ignores --node-rank and numbers nodes as they join."""
    cmd = container(JobBuilder.example().merge(trainer=dict(replicas=2, gpusPerReplica=0)).doc())["command"]
    assert cmd[:1] == ["torchrun"] and "--rdzv-backend=static" in cmd
    probe = tmp_path / "probe.py"
    probe.write_text(RANK_PROBE)
    port = free_port()
    endpoint = next(a for a in cmd if a.startswith("--rdzv-endpoint="))
    launched = []
    for ordinal in (1, 0):
        argv = [sys.executable, "-m", "torch.distributed.run",
                *(f"--rdzv-endpoint=127.0.0.1:{port}" if a == endpoint else
                  a.replace(f"$({MN.ENV_NODE_RANK})", str(ordinal)) for a in cmd[1:cmd.index("-m")]),
                str(probe), str(tmp_path / f"pod-{ordinal}.json")]
        launched.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for proc in launched:
        out, _ = proc.communicate(timeout=240)
        assert proc.returncode == 0, out
    seen = {o: json.loads((tmp_path / f"pod-{o}.json").read_text()) for o in (0, 1)}
    assert seen[0] == {"RANK": "0", "GROUP_RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}
    assert seen[1] == {"RANK": "1", "GROUP_RANK": "1", "LOCAL_RANK": "0", "WORLD_SIZE": "2"}


def test_single_node_trainer_is_unchanged():
    c = container(JobBuilder.example().doc())
    assert "--standalone" in c["command"] and MN.ENV_NODE_RANK not in {e["name"] for e in c["env"]}


def test_nccl_settings_become_env_and_the_overlay_wins():
    nccl = {"socketIfname": "^lo,docker", "ibHca": "=mlx5_0:1", "ibDisable": False, "debug": "WARN"}
    doc = JobBuilder.example().merge(trainer=dict(
        replicas=2, nccl=nccl, podTemplate={"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]})).doc()
    env = [(e["name"], e.get("value")) for e in container(doc)["env"]]
    assert [e for e in env if e[0].startswith(("NCCL_", "GLOO_"))] == [
        ("NCCL_SOCKET_IFNAME", "^lo,docker"), ("GLOO_SOCKET_IFNAME", "^lo,docker"), ("NCCL_IB_HCA", "=mlx5_0:1"),
        ("NCCL_IB_DISABLE", "0"), ("NCCL_DEBUG", "INFO")], "the overlay's NCCL_DEBUG, once, after ours"


def rollout_containers(doc: dict) -> dict[str, dict]:
    deploy = B.rollout_deployment(parse_job(doc), B.BuildContext(owner_uid="u", namespace=NS))
    return {c["name"]: c for c in deploy["spec"]["template"]["spec"]["containers"]}


@pytest.mark.parametrize("engine", ["sglang", "hf"])
def test_collective_engines_get_the_trainers_nccl_settings_and_their_overlay_wins(engine):
    """With weightTransport collective the engines are NCCL (sglang) or Gloo (hf) peers of trainer rank 0:
    the engine container gets the same variables of spec.trainer.nccl as the trainer (a rollout
    podTemplate variable of the same name wins); the worker does not; disk gives the engine none."""
    nccl = {"socketIfname": "^lo,docker", "ibHca": "=mlx5_0:1", "ibDisable": True, "debug": "WARN"}
    doc = JobBuilder.example().merge(trainer=dict(replicas=2, nccl=nccl, weightTransport="collective")).doc()
    doc["spec"]["rollout"].update(engine=engine, podTemplate={"env": [{"name": "NCCL_DEBUG", "value": "INFO"}]})
    ours = [(e["name"], e.get("value")) for e in container(doc)["env"] if e["name"].startswith(("NCCL_", "GLOO_"))]
    assert ours == [("NCCL_SOCKET_IFNAME", "^lo,docker"), ("GLOO_SOCKET_IFNAME", "^lo,docker"),
                    ("NCCL_IB_HCA", "=mlx5_0:1"), ("NCCL_IB_DISABLE", "1"), ("NCCL_DEBUG", "WARN")]
    pod = rollout_containers(doc)
    engine_env = [(e["name"], e.get("value")) for e in pod["engine"]["env"] if e["name"].startswith(("NCCL_", "GLOO_"))]
    assert engine_env == [*ours[:-1], ("NCCL_DEBUG", "INFO")], "the trainer's, NCCL_DEBUG from the rollout overlay"
    assert [e for e in pod["worker"]["env"] if e["name"].startswith(("NCCL_", "GLOO_"))] == [
        {"name": "NCCL_DEBUG", "value": "INFO"}], "the worker only has the overlay's"
    disk = JobBuilder.example().merge(trainer=dict(replicas=2, nccl=nccl)).doc()
    disk["spec"]["rollout"]["engine"] = engine
    assert not any(e["name"].startswith(("NCCL_", "GLOO_")) for e in rollout_containers(disk)["engine"]["env"])


def test_rdma_requests_the_device_and_ipc_lock_only():
    c = container(JobBuilder.example().merge(trainer=dict(replicas=2, gpusPerReplica=8,
                          rdma={"resourceName": "rdma/rdma_shared_device_a", "count": 2})).doc())
    limits = c["resources"]["limits"]
    assert (limits["nvidia.com/gpu"], limits["rdma/rdma_shared_device_a"]) == ("8", "2")
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["IPC_LOCK"]}
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    plain = container(JobBuilder.example().merge(trainer=dict(replicas=2)).doc())
    assert "add" not in plain["securityContext"]["capabilities"]
    no_lock = container(JobBuilder.example().merge(trainer=dict(rdma={"ipcLock": False})).doc())
    assert "add" not in no_lock["securityContext"]["capabilities"] and "rdma" not in json.dumps(no_lock["resources"])


@pytest.mark.parametrize("version", ["1.30.0", kubernetes_validate.latest_version()])
def test_multinode_trainer_validates_strictly(version):
    doc = JobBuilder.example().merge(trainer=dict(
        replicas=4, gpusPerReplica=8, nccl={"socketIfname": "eth0", "debug": "INFO"},
        rdma={"resourceName": "nvidia.com/hostdev"}, terminationGracePeriodSeconds=900)).doc()
    kubernetes_validate.validate(trainer_sts(doc), version, strict=True)


@pytest.mark.parametrize(("path", "dtype", "explicit", "grace"), [
    ("Qwen/Qwen2.5-1.5B-Instruct", "bfloat16", None, 120),     # 12 GB at 200 MiB/s: 58 s + 60 < the floor
    ("Qwen/Qwen2.5-7B-Instruct", "bfloat16", None, 328),       # 56 GB: 267.03 s -> 268 + 60
    ("meta-llama/Llama-3.1-70B-Instruct", "bfloat16", None, 2731),
    ("Qwen/Qwen2.5-7B-Instruct", "float32", None, 595),
    ("/models/in-house", "bfloat16", None, 120),               # no size in the name: the floor
    ("meta-llama/Llama-3.1-70B-Instruct", "bfloat16", 600, 600),  # overridden
])
def test_termination_grace_follows_the_checkpoint_size(path, dtype, explicit, grace):
    doc = JobBuilder.example().merge(trainer={"terminationGracePeriodSeconds": explicit} if explicit else {}).doc()
    doc["spec"]["model"].update(path=path, dtype=dtype)
    assert trainer_sts(doc)["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == grace


def errors(doc: dict) -> list[tuple[str, str]]:
    with pytest.raises(JobFileError) as err:
        parse_job(doc)
    return [(e.path, e.message) for e in err.value.errors]


@pytest.mark.parametrize(("trainer", "path", "says"), [
    ({"nccl": {"debug": "LOUD"}}, "spec.trainer.nccl.debug", "'VERSION', 'WARN', 'INFO' or 'TRACE'"),
    ({"nccl": {"socketIfname": "eth0 eth1"}}, "spec.trainer.nccl.socketIfname", "is not an interface list"),
    ({"nccl": {"ibHca": "mlx5_0:x"}}, "spec.trainer.nccl.ibHca", "is not an HCA list"),
    ({"rdma": {"resourceName": "rdma"}}, "spec.trainer.rdma.resourceName", "<domain>/<name>"),
    ({"rdma": {"resourceName": "rdma/ib", "count": 0}}, "spec.trainer.rdma.count", "greater than or equal to 1"),
    ({"terminationGracePeriodSeconds": 5}, "spec.trainer.terminationGracePeriodSeconds", "greater than or equal"),
])
def test_bad_settings_name_the_field_and_what_is_allowed(trainer, path, says):
    [(where, message)] = errors(JobBuilder.example().merge(trainer=dict(**copy.deepcopy(trainer))).doc())
    assert where == path and says in message, message


def test_the_multinode_example_renders_fsdp_and_the_collective_sync_wiring():
    """examples/job-multinode.yaml through `asyncrl render`, as a user reads it: 2 trainer nodes of 8
    FSDP2 ranks, and the weight group (rank 0's address and port, its port on the container and the
    headless Service, NCCL settings on the engines, trainer <-> rollout policies)."""
    example = REPO / "examples" / "job-multinode.yaml"
    out = subprocess.run([sys.executable, "-m", "asyncrl.cli", "render", str(example)], capture_output=True,
                         text=True, check=True).stdout
    docs = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(out) if d}
    job = "qwen25-7b-multinode"
    config = yaml.safe_load(docs[("ConfigMap", f"{job}-config")]["data"]["job.yaml"])
    assert config["spec"]["trainer"]["parallelism"] == "fsdp"
    assert config["spec"]["trainer"]["weightTransport"] == "collective"
    sts = docs[("StatefulSet", f"{job}-trainer")]
    (trainer,) = sts["spec"]["template"]["spec"]["containers"]
    assert sts["spec"]["replicas"] == 2
    assert trainer["command"][:4] == ["torchrun", "--nnodes=2", "--nproc-per-node=8", "--rdzv-backend=static"]
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    rank0 = MN.rank0_host(job, "rl")
    assert env["ASYNCRL_WEIGHT_GROUP_ADDRESS"] == rank0 and env["ASYNCRL_WEIGHT_GROUP_PORT"] == "29600"
    assert {"name": "weight-group", "containerPort": 29600, "protocol": "TCP"} in trainer["ports"]
    assert "weight-group" in {p["name"] for p in docs[("Service", f"{job}-trainer")]["spec"]["ports"]}
    engines = {c["name"]: c for c in
               docs[("Deployment", f"{job}-rollout")]["spec"]["template"]["spec"]["containers"]}
    engine_env = {e["name"]: e.get("value") for e in engines["engine"]["env"]}
    assert engine_env["NCCL_SOCKET_IFNAME"] == "eth0" and engine_env["NCCL_IB_HCA"] == "mlx5"
    rollout_policy = docs[("NetworkPolicy", f"{job}-rollout")]["spec"]["ingress"]
    trainer_policy = docs[("NetworkPolicy", f"{job}-trainer")]["spec"]["ingress"]
    assert any("ports" not in rule and any(p["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
                                           == "trainer" for p in rule["from"]) for rule in rollout_policy)
    assert any("ports" not in rule and any(p["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
                                           == "rollout" for p in rule["from"]) for rule in trainer_policy)
