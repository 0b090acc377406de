"""spec.logging on a cluster: the trainer's tracker credentials come from the job's Secrets."""

from __future__ import annotations

import kubernetes_validate
import pytest

from tests.support.job_builds import build
from tests.support.jobs import JobBuilder

LOGGING = {"wandb": {"project": "rl", "mode": "online", "apiKeySecret": {"name": "wandb", "key": "api-key"}},
           "mlflow": {"trackingUri": "https://mlflow.example.com", "credentialsSecret": "mlflow-auth"}}


def containers(objs: list[dict], kind: str, component: str) -> list[dict]:
    [obj] = [o for o in objs
             if o["kind"] == kind and o["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return obj["spec"]["template"]["spec"]["containers"]


def test_trainer_gets_the_wandb_key_and_the_mlflow_credentials_from_secrets():
    objs = build(JobBuilder.example(logging=LOGGING).doc())
    [trainer] = containers(objs, "StatefulSet", "trainer")
    env = {e["name"]: e for e in trainer["env"]}
    assert env["WANDB_API_KEY"] == {"name": "WANDB_API_KEY",
                                    "valueFrom": {"secretKeyRef": {"name": "wandb", "key": "api-key"}}}
    assert trainer["envFrom"] == [{"secretRef": {"name": "mlflow-auth"}}]
    assert len(env) == len(trainer["env"])  # no name twice
    for c in containers(objs, "Deployment", "rollout"):  # the credentials go to the trainer only
        assert "WANDB_API_KEY" not in {e["name"] for e in c.get("env", [])} and "envFrom" not in c
    for obj in objs:
        kubernetes_validate.validate(obj, kubernetes_validate.latest_version(), strict=True)


@pytest.mark.parametrize("logging", [None, {"tensorboard": {}}, {"wandb": {"project": "rl", "mode": "offline"}},
                                     {"mlflow": {}}])
def test_no_secret_named_no_tracker_env(logging):
    objs = build(JobBuilder.example(logging=logging).doc() if logging else JobBuilder.example().doc())
    [trainer] = containers(objs, "StatefulSet", "trainer")
    assert "WANDB_API_KEY" not in {e["name"] for e in trainer["env"]}
    assert "envFrom" not in trainer


def test_pod_template_env_from_comes_after_the_trackers():
    overlay = {"envFrom": [{"prefix": "WANDB_", "secretRef": {"name": "wandb-extra", "optional": True}}]}
    objs = build(JobBuilder.example(logging=LOGGING, **{"trainer.podTemplate": overlay}).doc())
    [trainer] = containers(objs, "StatefulSet", "trainer")
    assert trainer["envFrom"] == [{"secretRef": {"name": "mlflow-auth"}},
                                  {"prefix": "WANDB_", "secretRef": {"name": "wandb-extra", "optional": True}}]


def test_trainer_egress_stays_open_for_tracker_servers():
    """The trainer's NetworkPolicy restricts ingress only: W&B and MLflow servers stay reachable."""
    objs = build(JobBuilder.example(logging=LOGGING).doc())
    [policy] = [o for o in objs if o["kind"] == "NetworkPolicy"
                and o["metadata"]["labels"]["app.kubernetes.io/component"] == "trainer"]
    assert policy["spec"]["policyTypes"] == ["Ingress"] and "egress" not in policy["spec"]
