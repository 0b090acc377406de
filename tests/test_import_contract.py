"""Import layers: the core never imports a component, components import each other only where the
design says so, and the operator (a small image without torch) never loads torch or transformers.

Layers, from the bottom:
  core      asyncrl/*.py, asyncrl/transport, asyncrl/commands: spec, wire format, Redis, CLI plumbing
  rollout   engine adapters, the rollout worker, rewards, datasets
  trainer   may use rollout's engine adapters (it owns weight sync to the engines), nothing else there
  operator  core only: it renders manifests and mirrors status, it never runs a model

`asyncrl.cli` and `asyncrl.runner` are the composition roots: the CLI names command modules as
strings, and the local runner starts every component as a process.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
COMPONENTS = ("operator", "trainer", "rollout")
COMPOSITION_ROOTS = {"asyncrl/cli.py", "asyncrl/runner.py"}

# component -> asyncrl.* prefixes it must not import
FORBIDDEN: dict[str, tuple[str, ...]] = {
    "core": tuple(f"asyncrl.{c}" for c in COMPONENTS),
    "operator": ("asyncrl.trainer", "asyncrl.rollout"),
    "rollout": ("asyncrl.trainer", "asyncrl.operator"),
    "trainer": ("asyncrl.operator", "asyncrl.rollout.worker", "asyncrl.rollout.main", "asyncrl.rollout.datasets",
                "asyncrl.rollout.rewards", "asyncrl.rollout.hf_engine", "asyncrl.rollout.hf_server",
                "asyncrl.rollout.groups", "asyncrl.rollout.engine_view", "asyncrl.rollout.evaluator",
                "asyncrl.rollout.prompt_cursor", "asyncrl.rollout.worker_config", "asyncrl.rollout.worker_process"),
}


def _layer_files() -> dict[str, list[Path]]:
    core = [p for p in (REPO / "asyncrl").rglob("*.py")
            if p.relative_to(REPO / "asyncrl").parts[0] not in COMPONENTS
            and str(p.relative_to(REPO)) not in COMPOSITION_ROOTS]
    layers = {"core": core}
    for c in COMPONENTS:
        layers[c] = sorted((REPO / c).rglob("*.py"))
    return layers


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module named by an import statement anywhere in the file (function-local ones too)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{a.name}") for a in node.names]
    return out


def test_every_layer_has_files():
    layers = _layer_files()
    assert all(layers.values()), {k: len(v) for k, v in layers.items()}
    assert len(layers["core"]) >= 15


@pytest.mark.parametrize("layer", ["core", *COMPONENTS])
def test_layer_imports_only_what_it_may(layer):
    bad = []
    for path in _layer_files()[layer]:
        for line, module in _imports(path):
            if any(module == f or module.startswith(f + ".") for f in FORBIDDEN[layer]):
                bad.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not bad, f"{layer} breaks its import contract:\n" + "\n".join(bad)


def test_the_contract_check_catches_a_violation(tmp_path):
    """The checker itself must see function-local and `from` imports."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from asyncrl.trainer import loop\n    import torch\n")
    names = [m for _, m in _imports(f)]
    assert "asyncrl.trainer" in names and "asyncrl.trainer.loop" in names and "torch" in names


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
