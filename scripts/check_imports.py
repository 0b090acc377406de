"""Check the import layers of pyproject.toml's [tool.importlinter] contracts with import-linter.

import-linter (grimp) walks the package's folders, and follows neither the links asyncrl/operator,
asyncrl/trainer and asyncrl/rollout (to the top-level component folders) nor a folder without an
__init__.py (operator/ has none, so that a top-level `import operator` stays the stdlib's). So it
reads a copy of the package with the links resolved and operator/ given an empty __init__.py: the
same files, in the tree they stand for. Exit status: import-linter's (0 when every contract holds).

Usage: .venv/bin/python scripts/check_imports.py   (scripts/test.sh runs it before the tests)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def stage_package(repo: Path, into: Path) -> Path:
    """Copy `repo`/asyncrl into `into` with its links resolved; returns the copy's folder."""
    target = into / "asyncrl"
    shutil.copytree(repo / "asyncrl", target, symlinks=False, ignore=shutil.ignore_patterns("__pycache__"))
    (target / "operator" / "__init__.py").touch()
    return target


def lint_imports(repo: Path = REPO, *, extra: dict[str, str] | None = None,
                 contracts: tuple[str, ...] = ()) -> subprocess.CompletedProcess[str]:
    """Run lint-imports on a staged copy of `repo`'s package (only `contracts`, by id, if given);
    `extra` adds files to the copy (path inside the package -> text), for the test that a forbidden
    import fails the check."""
    with tempfile.TemporaryDirectory(prefix="asyncrl-imports-") as tmp:
        package = stage_package(repo, Path(tmp))
        for rel, text in (extra or {}).items():
            (package / rel).write_text(text)
        env = {**os.environ, "PYTHONPATH": tmp}
        lint = Path(sys.executable).with_name("lint-imports")
        only = [arg for c in contracts for arg in ("--contract", c)]
        return subprocess.run([str(lint), "--no-cache", *only, str(repo / "pyproject.toml")],
                              cwd=tmp, env=env, capture_output=True, text=True)


def main() -> int:
    result = lint_imports()
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    return result.returncode


if __name__ == "__main__":
    sys.exit(main())
