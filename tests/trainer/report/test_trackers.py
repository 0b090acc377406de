"""Experiment trackers (spec.logging): what each real tracker wrote, read back with its own reader."""

from __future__ import annotations

import json
import logging
import math
import socket
import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from asyncrl.api.spec import LoggingSpec, MlflowSpec, TensorBoardSpec, WandbSpec
from asyncrl.api.status_report import EvalRecord
from asyncrl.infra.errors import SpecError
from asyncrl.trainer.report import trackers as T
from asyncrl.trainer.report.trackers import TrackerError, Trackers

JOB = "arith-eval"
CONFIG = {"model": {"name": "embedded:SmolLM2-135M-Instruct"}, "algorithm": {"batchSize": 4, "lr": 1e-6},
          "logging": {"wandb": {"project": "p", "tags": ["a", "b"]}}}
STEP1 = {"reward_mean": 0.25, "loss": 0.123456789, "policy_version": 0, "tokens": 512}
STEP2 = {"reward_mean": 0.5, "loss": math.nan, "policy_version": 1, "tokens": 640, "clip_fraction": math.inf,
         "group_ids": ["g1"], "note": "text", "done": True}
EVAL = EvalRecord(policy_version=1, reward_mean=0.375, pass_at_1=0.3, pass_at_k=None, k=1, prompts=16, samples=16,
                  on_version=0.9375, response_length=41.5, seconds=3.25, engine_id="e0", time=1.0)
EXPECTED = {  # what every tracker must hold: NaN/inf, lists, strings and bools left out; pass_at_k None too
    "train/reward_mean": {1: 0.25, 2: 0.5}, "train/loss": {1: 0.123456789}, "train/policy_version": {1: 0.0, 2: 1.0},
    "train/tokens": {1: 512.0, 2: 640.0},
    "eval/reward_mean": {2: 0.375}, "eval/pass_at_1": {2: 0.3}, "eval/k": {2: 1.0}, "eval/prompts": {2: 16.0},
    "eval/samples": {2: 16.0}, "eval/on_version": {2: 0.9375}, "eval/response_length": {2: 41.5},
    "eval/seconds": {2: 3.25}, "eval/policy_version": {2: 1.0},
}


def log_two_steps(trackers: Trackers) -> None:
    trackers.log_step(1, STEP1)
    trackers.log_step(2, STEP2)
    trackers.log_eval(2, EVAL)
    trackers.close()


@pytest.fixture
def no_wandb_account(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """W&B with no key, no netrc and its config/cache dirs in the test's folder (nothing of the machine's)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("NETRC", str(tmp_path / "home" / ".netrc"))
    for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))


# ------------------------------------------------------------------------------ none configured


def test_empty_spec_makes_no_files_and_every_call_is_a_no_op(tmp_path: Path):
    trackers = Trackers.from_spec(LoggingSpec(), tmp_path / "run", JOB, CONFIG)
    assert not trackers and trackers.names == []
    log_two_steps(trackers)
    assert not (tmp_path / "run").exists()


# -------------------------------------------------------------------------------- TensorBoard


def scalars(log_dir: Path) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}


def as_float32(expected: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
    return {tag: {s: float(np.float32(v)) for s, v in points.items()} for tag, points in expected.items()}


def test_tensorboard_event_files_hold_every_figure_at_its_step(tmp_path: Path):
    trackers = Trackers.from_spec(LoggingSpec(tensorboard=TensorBoardSpec()), tmp_path, JOB, CONFIG)
    assert trackers.names == ["tensorboard"]
    trackers.log_step(1, STEP1)
    trackers.log_step(2, STEP2)
    trackers.log_eval(2, EVAL)
    # Flushed after every call: a reader sees it all before close (a crash here loses nothing).
    assert scalars(tmp_path / "tensorboard") == as_float32(EXPECTED)
    trackers.close()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    [config] = acc.Tensors("config/text_summary")
    assert "batchSize" in config.tensor_proto.string_val[0].decode()


def test_tensorboard_relative_log_dir_is_inside_the_run_directory(tmp_path: Path):
    log_two_steps(Trackers.from_spec(LoggingSpec(tensorboard=TensorBoardSpec(log_dir="tb/x")), tmp_path, JOB))
    assert scalars(tmp_path / "tb" / "x")["train/reward_mean"] == {1: 0.25, 2: 0.5}
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_restarted_trainer_replaces_the_steps_past_its_checkpoint(tmp_path: Path):
    spec = LoggingSpec(tensorboard=TensorBoardSpec())
    first = Trackers.from_spec(spec, tmp_path, JOB)
    for step in range(1, 6):  # the first life reached step 5 (and an eval there); its last checkpoint was step 3
        first.log_step(step, {"loss": float(step)})
    first.log_eval(5, EVAL)
    first.close()
    second = Trackers.from_spec(spec, tmp_path, JOB)
    for step in (4, 5, 6):
        second.log_step(step, {"loss": 10.0 + step})
    second.log_eval(6, EVAL.model_copy(update={"pass_at_1": 0.75}))
    second.close()
    got = scalars(tmp_path / "tensorboard")
    assert got["train/loss"] == {1: 1.0, 2: 2.0, 3: 3.0, 4: 14.0, 5: 15.0, 6: 16.0}
    assert got["eval/pass_at_1"] == {6: 0.75}  # the dead life's eval at step 5 is gone too


# ------------------------------------------------------------------------------------- W&B


def wandb_records(path: Path) -> list:
    """The records of a W&B transaction log (.wandb): a 7-byte header (':W&B', 0xBEE1, version), then
    32 KiB blocks of chunks, each with a 7-byte header (crc32c, length, type: 1 full, 2 first, 3 middle,
    4 last) carrying serialized `Record` protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, pending, out = 7, 32768, b"", []
    while pos + 7 <= len(data):
        room = block - pos % block
        if room < 7:  # a block's tail too short for a chunk header is padding
            pos += room
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0:  # zero padding to the end of the block
            pos += room
            continue
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()  # type: ignore[attr-defined]
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
    return out


def wandb_history(path: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for record in wandb_records(path):
        if record.WhichOneof("record_type") == "history":
            for item in record.history.item:
                key = item.key or "/".join(item.nested_key)
                if not key.startswith("_"):
                    out.setdefault(key, {})[record.history.step.num] = json.loads(item.value_json)
    return out


def test_wandb_offline_run_holds_the_values_config_and_tags(tmp_path: Path, no_wandb_account):
    spec = LoggingSpec(wandb=WandbSpec(project="asyncrl-test", mode="offline", tags=["ci", "eval"]))
    trackers = Trackers.from_spec(spec, tmp_path, JOB, CONFIG)
    assert trackers.names == ["wandb"]
    log_two_steps(trackers)
    [log_file] = (tmp_path / "wandb").glob("offline-run-*/run-*.wandb")
    kinds = [r.WhichOneof("record_type") for r in wandb_records(log_file)]
    assert wandb_history(log_file) == EXPECTED, f"{log_file.stat().st_size} bytes, records {kinds}"
    [run] = [r.run for r in wandb_records(log_file) if r.WhichOneof("record_type") == "run"][:1]
    assert (run.display_name, run.project, list(run.tags)) == (JOB, "asyncrl-test", ["ci", "eval"])
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["algorithm"] == CONFIG["algorithm"] and config["model"] == CONFIG["model"]
    ids = json.loads((tmp_path / T.IDS_FILE).read_text())
    assert ids["job"] == JOB and run.run_id == ids["wandb"]


def test_wandb_restarted_trainer_continues_the_same_run(tmp_path: Path, no_wandb_account):
    spec = LoggingSpec(wandb=WandbSpec(project="asyncrl-test", mode="offline"))
    for step in (1, 2):
        trackers = Trackers.from_spec(spec, tmp_path, JOB)
        trackers.log_step(step, {"loss": float(step)})
        trackers.close()
    logs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(logs) == 2 and logs[0].name == logs[1].name  # one run id: `wandb sync` uploads both to it
    assert [wandb_history(p)["train/loss"] for p in logs] == [{1: 1.0}, {2: 2.0}]


def test_wandb_online_without_an_api_key_is_a_configuration_error(tmp_path: Path, no_wandb_account):
    spec = LoggingSpec(tensorboard=TensorBoardSpec(), wandb=WandbSpec(project="p", mode="online"))
    with pytest.raises(TrackerError, match=r"spec\.logging\.wandb.*apiKeySecret.*mode: offline") as info:
        Trackers.from_spec(spec, tmp_path, JOB)
    assert isinstance(info.value, SpecError)


# ----------------------------------------------------------------------------------- MLflow


def mlflow_run(tmp_path: Path, experiment: str = "asyncrl"):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    exp = client.get_experiment_by_name(experiment)
    assert exp is not None
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1, [r.info.run_name for r in runs]
    return client, runs[0]


def test_mlflow_file_store_holds_metric_history_and_params(tmp_path: Path):
    trackers = Trackers.from_spec(LoggingSpec(mlflow=MlflowSpec(experiment="exp-1")), tmp_path, JOB, CONFIG)
    assert trackers.names == ["mlflow"]
    log_two_steps(trackers)
    client, run = mlflow_run(tmp_path, "exp-1")
    assert run.info.run_name == JOB and run.info.status == "FINISHED"
    got = {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)} for key in EXPECTED}
    assert got == EXPECTED
    assert set(run.data.metrics) == set(EXPECTED)
    assert run.data.params["algorithm.batchSize"] == "4"
    assert run.data.params["model.name"] == "embedded:SmolLM2-135M-Instruct"
    assert json.loads(run.data.params["logging.wandb.tags"]) == ["a", "b"]


def test_mlflow_restarted_trainer_continues_the_same_run(tmp_path: Path):
    spec = LoggingSpec(mlflow=MlflowSpec())
    for step in (1, 2):
        trackers = Trackers.from_spec(spec, tmp_path, JOB, CONFIG)
        trackers.log_step(step, {"loss": float(step)})
        trackers.close()
    client, run = mlflow_run(tmp_path)
    assert [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")] == [(1, 1.0),
                                                                                                    (2, 2.0)]
    assert run.info.status == "FINISHED"


def test_mlflow_unreachable_server_warns_and_the_other_trackers_go_on(tmp_path: Path, caplog,
                                                                       monkeypatch: pytest.MonkeyPatch):
    with socket.socket() as s:  # a loopback port nobody listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    spec = LoggingSpec(tensorboard=TensorBoardSpec(), mlflow=MlflowSpec(tracking_uri=f"http://127.0.0.1:{port}"))
    with caplog.at_level(logging.WARNING, logger="asyncrl.trainer.report.trackers"):
        trackers = Trackers.from_spec(spec, tmp_path, JOB, CONFIG)
        assert trackers.names == ["tensorboard", "mlflow"]
        log_two_steps(trackers)
    assert scalars(tmp_path / "tensorboard") == as_float32(EXPECTED)
    warnings = [r.getMessage() for r in caplog.records if "tracker mlflow" in r.getMessage()]
    assert len(warnings) == 1 and "a call failed" in warnings[0], caplog.text


def test_mlflow_params_are_flattened_and_cut_to_mlflows_limits():
    params = T.mlflow_params({"a": {"b": [1, 2], "c": [{"d": "x"}, {"e": None}], "empty": {}},
                              "label:key/with*odd": True, "long": "y" * 7000, "k" * 300: 1})
    assert params["a.b"] == "[1, 2]" and params["a.c.0.d"] == "x" and params["a.c.1.e"] == "null"
    assert params["a.empty"] == "{}" and params["label_key/with_odd"] == "true"
    assert len(params["long"]) == T.MLFLOW_VALUE_MAX and params["long"].endswith("...")
    assert "k" * T.MLFLOW_KEY_MAX in params


# ------------------------------------------------------------------------------ missing packages


@pytest.mark.parametrize("field", ["tensorboard", "wandb", "mlflow"])
def test_missing_package_is_a_spec_error_naming_the_extra(field: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setitem(sys.modules, T.PACKAGES[field][0], None)  # `import <module>` now fails
    spec = LoggingSpec(tensorboard=TensorBoardSpec(), wandb=WandbSpec(project="p", mode="offline"),
                       mlflow=MlflowSpec())
    with pytest.raises(TrackerError) as info:
        Trackers.from_spec(spec, tmp_path / "run", JOB)
    text = str(info.value)
    assert f"spec.logging.{field} needs the {T.PACKAGES[field][1]} package" in text
    assert f"pip install 'asyncrl[{field}]'" in text
    assert not (tmp_path / "run").exists()  # checked before any tracker started

    from asyncrl.trainer.main import config_reason

    assert isinstance(info.value, SpecError) and config_reason(info.value) == "InvalidSpec"  # exit 78


# ------------------------------------------------------------------------------ a failing tracker


class Flaky:
    """A tracker whose `log` raises while `broken` is set (a full disk, a dropped connection)."""

    name = "flaky"

    def __init__(self) -> None:
        self.broken = False
        self.logged: list[tuple[int, dict[str, float]]] = []
        self.begun: list[int] = []
        self.closed = 0

    def begin(self, step: int) -> None:
        self.begun.append(step)

    def log(self, step: int, values: dict[str, float]) -> None:
        if self.broken:
            raise OSError("No space left on device")
        self.logged.append((step, values))

    def close(self) -> None:
        self.closed += 1


def test_a_failing_tracker_warns_once_and_recovers(caplog):
    flaky = Flaky()
    trackers = Trackers([flaky])
    with caplog.at_level(logging.INFO, logger="asyncrl.trainer.report.trackers"):
        trackers.log_eval(0, EVAL)
        flaky.broken = True
        trackers.log_step(1, {"loss": 1.0})
        trackers.log_step(2, {"loss": 2.0})
        flaky.broken = False
        trackers.log_step(3, {"loss": 3.0})
        trackers.close()
        trackers.close()
    assert flaky.begun == [1]  # an eval at step 0 first: new training figures start at step 1
    assert [step for step, _ in flaky.logged] == [0, 3] and flaky.closed == 1
    messages = [r.getMessage() for r in caplog.records]
    assert sum("No space left on device" in m for m in messages) == 1
    assert any("tracker flaky works again" in m for m in messages)
