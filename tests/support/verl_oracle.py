"""verl 0.9.1's own policy-loss functions, read from its wheel, as a numeric oracle for trainer/step/losses.py.

Importing verl pulls ray, omegaconf, transformers, tensordict and its config system, so we do not
import it (and never copy its code into ours). `scripts/setup.sh --tests` downloads the wheel
(`pip download verl==0.9.1 --no-deps -d .tools/peers`); here the two modules are read out of the zip,
the functions we compare with are extracted with `ast` (decorators dropped: they register the
function in verl's registry), and executed in a namespace holding torch, the typing names their
signatures use, a `verl_F` namespace with the extracted torch_functional helpers, and a minimal
`ActorConfig` of our own with the fields those functions read.
"""

from __future__ import annotations

import ast
import types
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
import torch

from tests.support.paths import REPO

VERL_VERSION = "0.9.1"
WHEEL = REPO / ".tools" / "peers" / f"verl-{VERL_VERSION}-py3-none-any.whl"
SETUP_HINT = (f"run `bash scripts/setup.sh --tests` (its step `pip download verl=={VERL_VERSION} --no-deps "
              "-d .tools/peers` fetches the wheel)")
CORE_ALGOS = "verl/trainer/ppo/core_algos.py"
TORCH_FUNCTIONAL = "verl/utils/torch_functional.py"
POLICY_LOSSES = {
    "vanilla": "compute_policy_loss_vanilla", "gspo": "compute_policy_loss_gspo",
    "cispo": "compute_policy_loss_cispo", "sapo": "compute_policy_loss_sapo",
}
TF_FUNCTIONS = ("masked_sum", "masked_mean")


@dataclass
class ActorConfig:
    """The fields of verl's `ActorConfig` (verl/workers/config/actor.py) its policy losses read.

    Defaults are verl 0.9.1's. `global_batch_info` is passed to `agg_loss` as keyword arguments
    (`global_batch_size`, `loss_scale_factor`, ...)."""

    clip_ratio: float = 0.2
    clip_ratio_low: float | None = 0.2
    clip_ratio_high: float | None = 0.2
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    global_batch_info: dict[str, Any] = field(default_factory=dict)

    def get(self, key: str, default: Any = None) -> Any:
        """verl's configs are also read dict-style (`config.get("clip_ratio_c", 3.0)`)."""
        return getattr(self, key, default)


class AlgoConfig:
    """verl's algorithm config type; only used in an `isinstance` check that must be False here."""


class DictConfig:
    """omegaconf's DictConfig; only named in annotations."""


def _functions(source: str, names: tuple[str, ...], origin: str) -> ast.Module:
    """The top-level `def`s called `names` in `source`, without their decorators."""
    tree = ast.parse(source, filename=origin)
    found = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name in names}
    missing = [n for n in names if n not in found]
    if missing:
        raise AssertionError(f"{origin} in {WHEEL.name} has no function {', '.join(missing)}")
    for node in found.values():
        node.decorator_list = []
    return ast.Module(body=[found[n] for n in names], type_ignores=[])


def _exec(module: ast.Module, namespace: dict[str, Any], origin: str) -> None:
    exec(compile(module, f"<verl {VERL_VERSION} {origin}>", "exec"), namespace)


def load() -> dict[str, Callable[..., Any]]:
    """verl's `agg_loss` and policy losses by our name (`vanilla`, `gspo`, `cispo`, `sapo`).

    A missing wheel fails the calling test (not a skip): the oracle is part of the suite."""
    if not WHEEL.is_file():
        pytest.fail(f"the verl {VERL_VERSION} wheel is missing: {WHEEL} does not exist; {SETUP_HINT}", pytrace=False)
    with zipfile.ZipFile(WHEEL) as z:
        core, tf = z.read(CORE_ALGOS).decode(), z.read(TORCH_FUNCTIONAL).decode()
    tf_ns: dict[str, Any] = {"torch": torch, "Optional": Optional}
    _exec(_functions(tf, TF_FUNCTIONS, TORCH_FUNCTIONAL), tf_ns, TORCH_FUNCTIONAL)
    ns: dict[str, Any] = {
        "torch": torch, "Optional": Optional, "Any": Any, "Callable": Callable,
        "ActorConfig": ActorConfig, "AlgoConfig": AlgoConfig, "DictConfig": DictConfig,
        "verl_F": types.SimpleNamespace(**{n: tf_ns[n] for n in TF_FUNCTIONS}),
    }
    _exec(_functions(core, ("agg_loss", *POLICY_LOSSES.values()), CORE_ALGOS), ns, CORE_ALGOS)
    return {"agg_loss": ns["agg_loss"], **{ours: ns[theirs] for ours, theirs in POLICY_LOSSES.items()}}
