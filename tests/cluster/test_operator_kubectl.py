"""Drive the operator as a user would: real kubectl against a real kube-apiserver (apply with its OpenAPI
validation, get with the CRD's printer columns, scale through the scale subresource); the test writes the
workloads' status as their controllers would (tests/support/bare_apiserver.py)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
import yaml

from asyncrl.api.spec import PLURAL
from asyncrl.api.status_report import EvalRecord
from asyncrl.operator import names as N
from tests.support.bare_apiserver import BareApiserver, bare_apiserver_fixture  # noqa: F401
from tests.support.control_plane import find_tool
from tests.support.operator_jobs import assert_rbac_covers
from tests.support.operator_process import OperatorProcess, TrainerStatusServer, synthetic_report
from tests.support.paths import REPO
from tests.support.polling import poll

NS, NAME = "rl", "qwen25-gsm8k"
pytestmark = pytest.mark.slow


async def run_kubectl(kubeconfig: Path, *args: str) -> str:
    env = dict(os.environ, KUBECONFIG=str(kubeconfig))
    proc = await asyncio.create_subprocess_exec(str(find_tool("kubectl")), *args, env=env,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, f"kubectl {' '.join(args)} failed: {err.decode()}"
    return out.decode()


async def test_kubectl_apply_get_scale(api: BareApiserver, tmp_path: Path):
    cfg, operator_cfg = api.cp.kubeconfig, tmp_path / "operator.kubeconfig"
    evals = [EvalRecord(policy_version=v, reward_mean=p, pass_at_1=p, prompts=256, samples=256)
             for v, p in ((30, 0.71), (40, 0.7349))]
    report = synthetic_report().model_copy(update={"evaluations": evals})
    async with TrainerStatusServer(report) as trainer:
        api.kubeconfig(operator_cfg)
        op = await OperatorProcess(operator_cfg, tmp_path / "operator.log",
                                   status_url_template=f"http://127.0.0.1:{trainer.port}").start()
        try:
            out = await run_kubectl(cfg, "apply", "-f", str(REPO / "examples" / "job.yaml"))
            assert out.strip() == f"asyncrljob.asyncrl.dev/{NAME} created"
            await poll(lambda: api.get("deployments", NS, N.rollout(NAME)), what="rollout Deployment", log=op.log)
            await api.patch_status("apps", "v1", "deployments", NS, N.rollout(NAME),
                                   {"replicas": 4, "readyReplicas": 4})
            for sts in (N.trainer(NAME), N.redis(NAME)):
                await api.patch_status("apps", "v1", "statefulsets", NS, sts, {"replicas": 1, "readyReplicas": 1})
            # Readiness and the mirror may arrive on separate passes: wait for both.
            status = lambda: api.get(PLURAL, NS, NAME).get("status", {})  # noqa: E731
            await poll(lambda: (status().get("trainer") or {}).get("step") == 42
                           and status().get("phase") == "Running", what="Running with mirrored figures", log=op.log)

            listing = yaml.safe_load(await run_kubectl(cfg, "get", "asyncrljobs", "-n", NS, "-o", "yaml"))
            (job,) = listing["items"]
            assert job["status"]["phase"] == "Running"
            assert job["status"]["trainer"]["policyVersion"] == 42
            assert job["status"]["rollout"]["summary"] == "4/4"

            table = await run_kubectl(cfg, "get", "arj", "-n", NS)
            header, row = table.strip().splitlines()
            assert header.split() == ["NAME", "PHASE", "STEP", "VERSION", "STALENESS", "ROLLOUT", "REWARD", "EVAL",
                                      "AGE"]
            assert row.split()[:8] == [NAME, "Running", "42", "42", "1.75", "4/4", "0.625", "0.73@v40"]

            out = await run_kubectl(cfg, "scale", f"asyncrljob/{NAME}", "-n", NS, "--replicas=2")
            assert "scaled" in out
            await poll(lambda: api.get("deployments", NS, N.rollout(NAME))["spec"]["replicas"] == 2,
                           what="Deployment scaled by kubectl scale", log=op.log)
        finally:
            await op.stop()
        assert_rbac_covers(api)
