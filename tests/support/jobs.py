"""The one way tests build an AsyncRLJob document, in every tier (unit, integration, cluster).

Start from a file in examples/ (`JobBuilder.example`) or from the small CPU job the trainer and
runner tests train for real (`JobBuilder.small`), then name it and change fields; `doc()` is the
dict a test applies or parses, `job()` the validated model, `write(path)` a YAML job file.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

from asyncrl.api.spec import API_VERSION, KIND, AsyncRLJob
from tests.support.paths import REPO

MODEL = "embedded:SmolLM2-135M-Instruct"


class JobBuilder:
    """A job document being built; every method changes it and returns the builder."""

    def __init__(self, doc: dict[str, Any]) -> None:
        self._doc = copy.deepcopy(doc)

    @classmethod
    def example(cls, file: str = "job", **dotted: Any) -> JobBuilder:
        """examples/<file>.yaml, with `dotted` fields set (keys are paths under spec, e.g. "trainer.replicas")."""
        return cls(yaml.safe_load((REPO / "examples" / f"{file}.yaml").read_text())).set(**dotted)

    @classmethod
    def spec(cls, spec: dict[str, Any], name: str = "job", namespace: str | None = None) -> JobBuilder:
        """A job with exactly `spec` (schema and validation tests)."""
        return cls({"apiVersion": API_VERSION, "kind": KIND, "metadata": {"name": name}, "spec": spec}).named(
            name, namespace)

    @classmethod
    def small(cls, name: str = "t-job", *, batch_size: int = 2, group_size: int = 4, eta: int = 2,
              max_steps: int = 2, checkpoint_interval: int = 1, max_new_tokens: int = 8,
              micro_batch_tokens: int = 8192, minibatches: int = 1, proximal: str = "loglinear",
              lr: float = 1e-5, grad_clip: float = 1.0, seed: int = 0,
              algorithm: dict[str, Any] | None = None, model: dict[str, Any] | None = None,
              trainer: dict[str, Any] | None = None) -> JobBuilder:
        """The small job of the real-model tests: the embedded model in float32 on CPU, the hf engine,
        builtin arithmetic; `algorithm`, `model` and `trainer` add or override fields of spec.algorithm,
        spec.model and spec.trainer (camelCase)."""
        return cls.spec({
            "model": {"path": MODEL, "dtype": "float32"},
            "dataset": {"source": "builtin:arithmetic", "difficulty": 1, "seed": seed},
            "reward": {"function": "exact-number"},
            "algorithm": {"groupSize": group_size, "batchSize": batch_size, "minibatches": minibatches,
                          "maxNewTokens": max_new_tokens, "microBatchTokens": micro_batch_tokens,
                          "proximal": proximal, "optimizer": {"lr": lr, "gradClip": grad_clip}},
            "staleness": {"maxHeadOffpolicyness": eta},
            "rollout": {"replicas": 1, "engine": "hf", "gpusPerReplica": 0, "maxConcurrentRequests": 16},
            "trainer": {"gpusPerReplica": 0, "device": "cpu", "maxSteps": max_steps,
                        "checkpointInterval": checkpoint_interval},
            "seed": seed,
        }, name).merge(algorithm=algorithm or {}, model=model or {}, trainer=trainer or {})

    def named(self, name: str, namespace: str | None = None) -> JobBuilder:
        self._doc["metadata"]["name"] = name
        if namespace is not None:
            self._doc["metadata"]["namespace"] = namespace
        return self

    def set(self, **dotted: Any) -> JobBuilder:
        """Set fields by their path under spec ("algorithm.temperature"); a plain name replaces a section."""
        for path, value in dotted.items():
            node = self._doc["spec"]
            *parents, last = path.split(".")
            for key in parents:
                node = node.setdefault(key, {})
            node[last] = copy.deepcopy(value)
        return self

    def merge(self, **sections: dict[str, Any]) -> JobBuilder:
        """Add or override fields of spec sections (`trainer={"replicas": 2}` keeps the other trainer fields)."""
        for section, values in sections.items():
            self._doc["spec"].setdefault(section, {}).update(copy.deepcopy(values))
        return self

    def doc(self) -> dict[str, Any]:
        return copy.deepcopy(self._doc)

    def job(self) -> AsyncRLJob:
        return AsyncRLJob.model_validate(self._doc)

    def write(self, path: Path) -> Path:
        path.write_text(yaml.safe_dump(self._doc, sort_keys=False))
        return path
