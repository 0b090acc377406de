"""Packaging: the component folders are the package tree, the repo's operator/ never shadows the
stdlib `operator`, and the CLI lists every command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from asyncrl.cli import COMMANDS, build_parser
from tests.support.paths import REPO


def test_stdlib_operator_and_asyncrl_operator_both_import_from_the_repo_root():
    code = ("import operator, asyncrl.operator as op; "
            "assert operator.itemgetter(1)([0, 7]) == 7, operator.__file__; "
            "print(operator.__file__, list(op.__path__)[0])")
    res = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    stdlib_path, ours = res.stdout.split()
    assert Path(ours).resolve() == REPO / "operator"
    assert Path(stdlib_path).parent != REPO / "operator"


def test_component_folders_are_the_package_tree_that_static_tools_see():
    """asyncrl/operator, asyncrl/trainer and asyncrl/rollout are links to the top-level folders, so
    `asyncrl.trainer.loop` is the file asyncrl/trainer/loop.py: no import hook, no path remapping."""
    for name in ("operator", "trainer", "rollout"):
        link = REPO / "asyncrl" / name
        assert link.is_symlink() and link.resolve() == REPO / name, name
    assert not (REPO / "operator" / "__init__.py").exists(), "operator/ must stay a namespace folder"
    import asyncrl.rollout.worker.worker
    import asyncrl.trainer.loop

    assert Path(asyncrl.trainer.loop.__file__) == REPO / "asyncrl" / "trainer" / "loop.py"
    assert Path(asyncrl.rollout.worker.worker.__file__).resolve() == REPO / "rollout" / "worker" / "worker.py"


def test_help_lists_every_command_with_its_purpose():
    text = build_parser().format_help()
    for name, _, purpose in COMMANDS:
        assert name in text and purpose in " ".join(text.split()), name


def test_every_command_has_help(capsys):
    parser = build_parser()
    for name, _, _ in COMMANDS:
        sub = parser._subparsers._group_actions[0].choices[name]
        assert sub.format_help().startswith("usage: asyncrl " + name)


def test_top_level_operator_is_the_stdlib_even_without_site_preloading():
    """`python -S` from the repo root puts the root first and has not imported `operator` yet."""
    code = ("import sys; sys.path.insert(0, ''); import collections, operator; "
            "assert operator.eq(2, 2) and operator.attrgetter('real')(3) == 3; print(operator.__file__)")
    res = subprocess.run([sys.executable, "-S", "-c", code], cwd=REPO, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert Path(res.stdout.strip()).name == "operator.py"


def imports_of_test_modules(tests_dir: Path) -> list[str]:
    """`file:line` of every import of a test module (test_*) by a file under `tests_dir`."""
    import ast

    offenders = []
    for path in sorted(tests_dir.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):  # (`from tests import test_x` names it as an alias)
                names = [node.module or ""] + [a.name for a in node.names]
            else:
                continue
            if any(part.startswith("test_") for name in names for part in name.split(".")):
                offenders.append(f"{path.name}:{node.lineno}")
    return offenders


def test_no_test_module_imports_another():
    """What several test modules share lives in tests/support, never in a test module: importing
    one runs its module-level code and collects nothing it meant to."""
    assert imports_of_test_modules(REPO / "tests") == []


TEST_FOLDERS_APART = {"cluster": "tests against a Kubernetes API", "packaging": "the repository as shipped",
                      "benchmarks": "benchmarks/*.py", "support": "helpers", "data": "test data"}
"""Folders of tests/ that mirror no package folder, and what each holds."""


def test_tests_mirror_the_package():
    """Tests live in folders that mirror the package (tests/trainer/step for trainer/step/,
    tests/api for asyncrl/api/), or in the few folders apart: none flat in tests/ itself."""
    tests = REPO / "tests"
    assert sorted(p.name for p in tests.glob("*.py")) == ["__init__.py", "conftest.py"]
    for folder in sorted(p for p in tests.rglob("*") if p.is_dir() and any(p.glob("test_*.py"))):
        rel = folder.relative_to(tests)
        if rel.parts[0] in TEST_FOLDERS_APART:
            continue
        mirrored = [REPO / rel, REPO / "asyncrl" / rel]
        assert any(m.is_dir() and not m.is_symlink() for m in mirrored), f"tests/{rel} mirrors no package folder"


def test_test_support_lives_in_one_package_imported_one_way():
    """Test helpers are tests/support's modules, always imported as `tests.support.<module>` (never
    by a bare name that works only because pytest put a folder on the path)."""
    import ast

    tests = REPO / "tests"
    helpers = {p.stem for p in (tests / "support").glob("*.py")} - {"__init__"}
    bare = []
    for path in sorted(tests.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            if any(m.split(".")[0] in helpers | {"support"} for m in modules):
                bare.append(f"{path.relative_to(tests)}:{node.lineno}")
    assert bare == []


def test_jobs_are_built_one_way():
    """Every tier builds its jobs with tests/support/jobs.py `JobBuilder`: no test defines a job
    document of its own (an `apiVersion: asyncrl.dev/...` dict) or a `job_doc`-style builder."""
    import ast

    offenders = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        if path == REPO / "tests" / "support" / "jobs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.FunctionDef) and node.name in ("job_doc", "job_dict", "make_job", "write_job",
                                                                   "example"):
                offenders.append(f"{path.name}:{node.lineno} def {node.name}")
            if isinstance(node, ast.Dict):
                pairs = zip(node.keys, node.values, strict=True)
                fields = {k.value: v for k, v in pairs if isinstance(k, ast.Constant)}
                kind = ast.unparse(fields["kind"]) if "kind" in fields else ""
                if "spec" in fields and (kind == "'AsyncRLJob'" or kind.endswith("KIND")):
                    offenders.append(f"{path.name}:{node.lineno} a job dict")
    assert offenders == []
