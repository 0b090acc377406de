"""Import layers: pyproject.toml's import-linter contracts hold, cover every part of the package, and
fail on a forbidden import; and the operator (a small image without torch) never loads torch.

The contracts (scripts/check_imports.py runs them; scripts/test.sh before the tests):
  packages   cli > local | commands > operator | trainer | rollout > transport > api > infra
  trainer    main > loop > weights > evaluation > inbox | lora | report > state | step >
             distributed | run_config,
             and of rollout only rollout.engines (it owns weight sync to the engines)
  rollout    main > worker > evaluation > episodes > generation > data > rewards > engines
  operator   never torch, transformers or safetensors
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import tomllib

from tests.support.paths import REPO


def _check_imports():
    spec = importlib.util.spec_from_file_location("check_imports", REPO / "scripts" / "check_imports.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


CHECK = _check_imports()
CONFIG = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
CONTRACTS = {c["id"]: c for c in CONFIG["contracts"]}


def _layer_names(contract: dict) -> set[str]:
    return {name.strip() for layer in contract["layers"] for name in layer.split("|")}


def _parts(folder) -> set[str]:
    """The modules and packages directly inside a package folder (what a layers contract must name)."""
    return {p.stem if p.suffix == ".py" else p.name for p in folder.iterdir()
            if p.name != "__init__.py" and not p.name.startswith((".", "__")) and
            (p.suffix == ".py" or (p.is_dir() and any(p.glob("*.py"))))}


def test_every_contract_holds():
    result = CHECK.lint_imports()
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout and f"{len(CONTRACTS)} kept" in result.stdout


@pytest.mark.parametrize(("contract", "folder", "prefix"), [
    ("packages", "asyncrl", "asyncrl."), ("trainer", "trainer", ""), ("rollout", "rollout", "")])
def test_each_layers_contract_names_every_part_so_it_cannot_rot(contract, folder, prefix):
    """A new module or package must be placed in a layer: one left out would be checked by nothing."""
    parts = _parts(REPO / folder)
    named = {n.removeprefix(prefix) for n in _layer_names(CONTRACTS[contract])}
    assert parts == named, f"{folder}/: in no layer {sorted(parts - named)}, named but absent {sorted(named - parts)}"


@pytest.mark.parametrize(("where", "text", "contract"), [
    ("trainer/step/bad.py", "from asyncrl.rollout.worker import worker\n", "trainer-rollout"),
    ("trainer/state/bad.py", "def f():\n    from asyncrl.trainer import loop\n", "trainer"),
    ("rollout/engines/bad.py", "import asyncrl.rollout.data.datasets\n", "rollout"),
    ("api/bad.py", "from asyncrl.transport import streams\n", "packages"),
    ("operator/bad.py", "from asyncrl.infra.hf_models import load_tokenizer\n", "operator-torch"),
])
def test_a_forbidden_import_fails_the_check_and_is_named(where, text, contract):
    """Each contract alone catches its kind of import (a function-local one too), naming the module."""
    assert CHECK.lint_imports(contracts=(contract,)).returncode == 0
    result = CHECK.lint_imports(extra={where: text}, contracts=(contract,))
    assert result.returncode != 0, result.stdout
    assert "BROKEN" in result.stdout and "bad" in result.stdout, result.stdout


def test_operator_never_loads_torch_or_transformers():
    """Import every operator module and build the whole CLI parser (what `asyncrl operator` does
    before kopf starts): torch and transformers must stay unloaded (the operator image has neither)."""
    modules = sorted(f"asyncrl.operator.{p.stem}" for p in (REPO / "operator").glob("*.py"))
    check = ("import importlib, sys\n"
             f"for m in {modules!r}: importlib.import_module(m)\n"
             "from asyncrl.cli import build_parser\n"
             "build_parser()\n"
             "print(','.join(m for m in ('torch', 'transformers', 'safetensors') if m in sys.modules))\n")
    res = subprocess.run([sys.executable, "-c", check], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip() == "", f"the operator loaded {res.stdout.strip()}"
    assert len(modules) >= 8
