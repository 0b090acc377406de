"""The operator mirrors the trainer's /status (a real HTTP server) into the job's status, on a real
kube-apiserver with no controllers (tests/support/bare_apiserver.py: the test writes the workloads'
status as their controllers would)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from asyncrl.api import runtime as R
from asyncrl.api.spec import PLURAL
from asyncrl.api.status_report import EvalRecord, RecoveryReport, TrainerReport
from asyncrl.operator import names as N
from asyncrl.operator.mirror import secret_value
from tests.support.bare_apiserver import BareApiserver, bare_apiserver_fixture  # noqa: F401
from tests.support.job_builds import secret_files
from tests.support.jobs import JobBuilder
from tests.support.operator_jobs import JOB, NS, assert_rbac_covers, children_exist, create_job, make_ready
from tests.support.operator_process import OperatorProcess, TrainerStatusServer, synthetic_report
from tests.support.polling import poll

pytestmark = pytest.mark.slow


def evaluated_report() -> TrainerReport:
    """synthetic_report() with held-out evaluations of versions 0, 20 and 40 (pass@1 0.417 at v40)."""
    evals = [EvalRecord(policy_version=v, reward_mean=p + 0.02, pass_at_1=p, prompts=64, samples=64)
             for v, p in ((0, 0.05), (20, 0.3), (40, 0.4167))]
    return synthetic_report().model_copy(update={"evaluations": evals})


async def test_trainer_status_is_mirrored_into_job_status(api: BareApiserver, tmp_path: Path):
    async with TrainerStatusServer(evaluated_report()) as trainer:
        api.kubeconfig(tmp_path / "kubeconfig")
        op = await OperatorProcess(tmp_path / "kubeconfig", tmp_path / "operator.log",
                                   status_url_template=f"http://127.0.0.1:{trainer.port}").start()
        try:
            await create_job(api, JobBuilder.example().named(JOB, NS).doc())
            await poll(lambda: children_exist(api), what="children", log=op.log)
            await make_ready(api)
            status = lambda: api.get(PLURAL, NS, "qwen").get("status", {})  # noqa: E731
            # Readiness and the mirror arrive on separate passes: wait for both.
            await poll(lambda: status().get("trainer", {}).get("step") == 42
                           and status().get("phase") == "Running", what="mirrored step, Running", log=op.log)
            s = status()
            assert s["phase"] == "Running"
            assert s["trainer"] == {"step": 42, "policyVersion": 42, "lastCheckpoint": "/shared/checkpoints/step-40"}
            assert s["staleness"] == {"mean": 1.75, "max": 4, "limit": 4, "dropped": 3}
            assert s["progress"] == {"percent": 10.5, "rewardMean": 0.625, "tokensPerSecond": 1234.5}
            assert s["lastStep"]["clip_fraction"] == 0.125 and s["lastStep"]["staleness_max"] == 4
            assert "tb_beta" not in s["lastStep"] and "step" not in s["lastStep"]  # (no value; an axis)
            assert s["rollout"]["minWeightVersion"] == 41
            assert s["evaluation"] == {"policyVersion": 40, "rewardMean": 0.4367, "passAt1": 0.4167, "k": 1,
                                       "summary": "0.42@v40"}
            assert s["statusURL"] == "http://qwen-status.rl.svc:8000"
            conds = {c["type"]: c for c in s["conditions"]}
            assert conds["WeightsSynced"]["status"] == "False" and conds["WeightsSynced"]["reason"] == "Lagging"
            assert s["recovery"] == {"deadLettered": 0, "driftLost": 0, "driftFound": 0, "leasesReturned": 0,
                                     "rewardFailures": 0, "episodeFailures": 0, "generationFailures": 0,
                                     "engineRequeues": 0, "recoveredEntries": 0,
                                     "reclaimedEntries": 0,
                                     "fencedEngines": 0, "trainerRestarts": 0, "engineRestarts": 0, "engineResyncs": 0,
                                     "ghostGroupsDropped": 0}

            # Recovery figures grow: in the job's status, and one Event per figure that grew.
            engines = [e.model_copy(update={"fenced": "3 failed updates"} if i == 0 else {})
                       for i, e in enumerate(evaluated_report().rollout)]
            trainer.report = evaluated_report().model_copy(update={
                "dead_lettered": 1, "rollout": engines,
                "recovery": RecoveryReport(dead_lettered=2, drift_lost=1, leases_returned=3, reward_failures=4,
                                           fenced_engines=1, trainer_restarts=1, engine_resyncs=2,
                                           ghost_groups_dropped=3)})
            await poll(lambda: status().get("recovery", {}).get("deadLettered") == 2, what="recovery mirrored",
                           log=op.log)
            assert status()["recovery"] == {"deadLettered": 2, "driftLost": 1, "driftFound": 0, "leasesReturned": 3,
                                            "rewardFailures": 4, "episodeFailures": 0, "generationFailures": 0,
                                            "engineRequeues": 0, "recoveredEntries": 0,
                                            "reclaimedEntries": 0,
                                            "fencedEngines": 1, "trainerRestarts": 1, "engineRestarts": 0,
                                            "engineResyncs": 2, "ghostGroupsDropped": 3}
            reasons = lambda: {e.get("reason"): e.get("message") for e in api.all("events", NS)}  # noqa: E731
            await poll(lambda: {"GroupsDeadLettered", "AdmissionDriftRepaired", "LeasesReturned", "RewardsFailed",
                                    "EngineFenced", "TrainerRestarted", "EngineResynced",
                                    "GhostGroupsDropped"} <= set(reasons()),
                           what="recovery events", log=op.log)
            assert reasons()["GroupsDeadLettered"].startswith("2 more trajectory group(s) refused")
            assert "asyncrl dead-letters" in reasons()["GroupsDeadLettered"]
            assert reasons()["EngineFenced"].startswith("1 more rollout engine(s) fenced")
            assert reasons()["GhostGroupsDropped"].startswith("3 more trajectory group(s) dropped")
            assert reasons()["RewardsFailed"].startswith("4 more trajectory group(s) dropped, never trained")

            # The trainer finishes: the job succeeds, GPUs are released, Complete is True.
            trainer.report = evaluated_report().model_copy(update={"phase": "Succeeded", "step": 400})
            await poll(lambda: status().get("phase") == "Succeeded", what="Succeeded", log=op.log)
            s = status()
            assert s["reason"] == "TrainingComplete" and s["completionTime"]
            assert {c["type"]: c["status"] for c in s["conditions"]}["Complete"] == "True"
            assert s["progress"]["percent"] == 100.0
            await poll(lambda: api.get("deployments", NS, "qwen-rollout")["spec"]["replicas"] == 0,
                           what="rollout scaled to zero after success", log=op.log)
        finally:
            await op.stop()
        assert_rbac_covers(api)


async def test_mirror_sends_the_jobs_generated_status_token(api: BareApiserver, tmp_path: Path):
    """The operator creates the job's status-token Secret (random, owned by the job), the trainer's
    env reads it, and the mirror sends it: a trainer that requires it is still mirrored, while a GET
    without it (or with another token) is refused with 401."""
    async with TrainerStatusServer(evaluated_report()) as trainer:
        api.kubeconfig(tmp_path / "kubeconfig")
        op = await OperatorProcess(tmp_path / "kubeconfig", tmp_path / "operator.log",
                                   status_url_template=f"http://127.0.0.1:{trainer.port}").start()
        try:
            job = await create_job(api, JobBuilder.example().named(JOB, NS).doc())
            await poll(lambda: children_exist(api), what="children", log=op.log)
            secret = api.get("secrets", NS, N.status_secret("qwen"))
            token = secret_value(secret, "token")
            assert token and len(token) >= 32
            assert secret["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
            sts = api.get("statefulsets", NS, N.trainer("qwen"))
            files = secret_files(sts["spec"]["template"]["spec"])
            assert files["trainer"][R.ENV_STATUS_TOKEN] == (N.status_secret("qwen"), "token")

            trainer.require_token(token)  # the trainer pod starts with the token in a mounted file
            await make_ready(api)
            status = lambda: api.get(PLURAL, NS, "qwen").get("status", {})  # noqa: E731
            await poll(lambda: status().get("trainer", {}).get("step") == 42, what="mirrored step", log=op.log)

            async with httpx.AsyncClient() as client:
                url = f"http://127.0.0.1:{trainer.port}/status"
                assert (await client.get(url)).status_code == 401
                assert (await client.get(url, headers={"Authorization": "Bearer wrong"})).status_code == 401
                ok = await client.get(url, headers={"Authorization": f"Bearer {token}"})
                assert ok.status_code == 200 and ok.json()["step"] == 42
            # created once: later passes keep the token (the Secret is create-only)
            assert secret_value(api.get("secrets", NS, N.status_secret("qwen")), "token") == token
        finally:
            await op.stop()
        assert_rbac_covers(api)
