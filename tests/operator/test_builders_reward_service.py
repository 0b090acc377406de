"""spec.reward.service.deployment on a cluster: the operator runs the job's reward service (a
Deployment, its Service, a NetworkPolicy admitting only the job's rollout pods, the job's key), the
workers are pointed at it, and it is scaled to zero with the GPU workloads when the job ends."""

from __future__ import annotations

import kubernetes_validate

from asyncrl.api import runtime as R
from asyncrl.api.loader import parse_job
from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from tests.support.job_builds import build, rollout_pod_containers, secret_files
from tests.support.jobs import JobBuilder

JOB = "qwen25-gsm8k"  # examples/job.yaml's name


def by_kind(objs: list[dict], component: str) -> dict[str, dict]:
    return {o["kind"]: o for o in objs if o["metadata"]["labels"]["app.kubernetes.io/component"] == component}


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container["env"]}


def test_the_operator_runs_the_reward_service_and_points_the_workers_at_it_behind_the_key() -> None:
    doc = JobBuilder.example().set(**{"reward.service": {"deployment": {"replicas": 2, "gpus": 1,
                                                                         "resources": {"memory": "8Gi"}}}}).doc()
    objs = build(doc)
    reward = by_kind(objs, "reward")
    assert set(reward) == {"Deployment", "Service", "NetworkPolicy"}
    assert {o["metadata"]["name"] for o in reward.values()} == {N.reward(JOB)}
    assert all(o["metadata"]["ownerReferences"][0]["uid"] == "uid-1" for o in reward.values())
    deployment = reward["Deployment"]["spec"]
    [server] = deployment["template"]["spec"]["containers"]
    assert deployment["replicas"] == 2
    assert server["command"] == ["asyncrl", "reward-server", "gsm8k", "--host", "0.0.0.0", "--port", "8100"]
    assert server["image"] == rollout_pod_containers(objs)["worker"]["image"]  # it has `asyncrl reward-server`
    key = {"secretKeyRef": {"name": N.engine_secret(JOB), "key": "api-key"}}
    assert env_of(server)[R.ENV_REWARD_API_KEY]["valueFrom"] == key
    assert server["resources"] == {"requests": {"memory": "8Gi"}, "limits": {"memory": "8Gi", "nvidia.com/gpu": "1"}}
    assert server["readinessProbe"]["httpGet"] == {"path": "/health", "port": "reward"}
    assert reward["Service"]["spec"]["ports"] == [{"name": "reward", "port": 8100, "targetPort": "reward",
                                                   "protocol": "TCP"}]
    policy = reward["NetworkPolicy"]["spec"]
    assert policy["ingress"] == [{"from": [{"podSelector": {"matchLabels": N.selector_labels(JOB, "rollout")}}],
                                  "ports": [{"protocol": "TCP", "port": 8100}]}]
    worker = env_of(rollout_pod_containers(objs)["worker"])
    assert worker[R.ENV_REWARD_URL]["value"] == f"http://{N.reward(JOB)}:8100"
    rollout_pod = by_kind(objs, "rollout")["Deployment"]["spec"]["template"]["spec"]
    assert secret_files(rollout_pod)["worker"][R.ENV_REWARD_API_KEY] == (N.engine_secret(JOB), "api-key")
    kinds = [o["kind"] + "/" + o["metadata"]["name"] for o in objs]
    assert kinds.index(f"Deployment/{N.reward(JOB)}") < kinds.index(f"Deployment/{N.rollout(JOB)}")
    for obj in objs:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


def test_a_service_of_your_own_image_and_command_and_none_without_a_deployment() -> None:
    own = {"deployment": {"image": "ghcr.io/acme/judge:1.2", "command": ["python", "-m", "judge"], "port": 9000}}
    objs = build(JobBuilder.example().set(**{"reward.service": own}).doc())
    [server] = by_kind(objs, "reward")["Deployment"]["spec"]["template"]["spec"]["containers"]
    assert (server["image"], server["command"]) == ("ghcr.io/acme/judge:1.2", ["python", "-m", "judge"])
    assert server["ports"][0]["containerPort"] == 9000
    for service in (None, {"url": "http://judge.shared.svc:8100"}):
        doc = JobBuilder.example().set(**({"reward.service": service} if service else {})).doc()
        objs = build(doc)
        assert by_kind(objs, "reward") == {}
        worker = rollout_pod_containers(objs)["worker"]
        assert R.ENV_REWARD_URL not in env_of(worker)


def test_the_reward_service_is_scaled_to_zero_with_the_gpu_workloads_when_the_job_ends() -> None:
    job = parse_job(JobBuilder.example().set(**{"reward.service": {"deployment": {}}}).doc())
    ctx = B.BuildContext(owner_uid="uid-1", namespace="ns", stopped=True)
    scaled = {o["metadata"]["name"]: o["spec"]["replicas"] for o in B.scaled_workloads(job, ctx)}
    assert scaled == {N.trainer(JOB): 0, N.rollout(JOB): 0, N.reward(JOB): 0}
