"""Drive the operator as a user would: real kubectl against the emulator (apply, get, scale)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import kmock
import pytest
import yaml

from asyncrl.operator import names as N
from asyncrl.spec import PLURAL
from asyncrl.status_report import EvalRecord
from tests.support.emulated_jobs import assert_rbac_covers
from tests.support.kube_emulator import KubeEmulator
from tests.support.operator_process import OperatorProcess, TrainerStatusServer, synthetic_report
from tests.support.polling import poll

REPO = Path(__file__).resolve().parent.parent
KUBECTL = REPO / ".tools" / "bin" / "kubectl"
NS, NAME = "rl", "qwen25-gsm8k"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def kubectl() -> Path:
    if not KUBECTL.exists():
        import subprocess

        subprocess.run([str(REPO / "scripts" / "install-k8s-tools.sh")], check=True)
    return KUBECTL


async def run_kubectl(kubeconfig: Path, *args: str) -> str:
    env = dict(os.environ, KUBECONFIG=str(kubeconfig))
    proc = await asyncio.create_subprocess_exec(str(KUBECTL), *args, env=env, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode == 0, f"kubectl {' '.join(args)} failed: {err.decode()}"
    return out.decode()


async def test_kubectl_apply_get_scale(kubectl: Path, tmp_path: Path):
    cfg = tmp_path / "kubeconfig"
    evals = [EvalRecord(policy_version=v, reward_mean=p, pass_at_1=p, prompts=256, samples=256)
             for v, p in ((30, 0.71), (40, 0.7349))]
    report = synthetic_report().model_copy(update={"evaluations": evals})
    async with KubeEmulator() as emu, kmock.Server(emu), TrainerStatusServer(report) as trainer:
        emu.kubeconfig(cfg)
        op = await OperatorProcess(cfg, tmp_path / "operator.log",
                                   status_url_template=f"http://127.0.0.1:{trainer.port}").start()
        try:
            # --validate=false: kubectl's client-side schema check needs the OpenAPI v2 protobuf
            # document, which the emulator does not serve (schema validation is the API server's job).
            out = await run_kubectl(cfg, "apply", "--validate=false", "-f", str(REPO / "examples" / "job.yaml"))
            assert out.strip() == f"asyncrljob.asyncrl.dev/{NAME} created"
            await poll(lambda: emu.get("deployments", NS, N.rollout(NAME)), what="rollout Deployment", log=op.log)
            await emu.patch_status("apps", "v1", "deployments", NS, N.rollout(NAME),
                                   {"replicas": 4, "readyReplicas": 4})
            for sts in (N.trainer(NAME), N.redis(NAME)):
                await emu.patch_status("apps", "v1", "statefulsets", NS, sts, {"replicas": 1, "readyReplicas": 1})
            # Readiness and the mirror may arrive on separate passes: wait for both.
            status = lambda: emu.get(PLURAL, NS, NAME).get("status", {})  # noqa: E731
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
            await poll(lambda: emu.get("deployments", NS, N.rollout(NAME))["spec"]["replicas"] == 2,
                           what="Deployment scaled by kubectl scale", log=op.log)
        finally:
            await op.stop()
        assert_rbac_covers(emu)
