"""`asyncrl validate`: valid files summarised, every invalid file explained by field, never a traceback."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from asyncrl.cli import main
from tests.support.paths import REPO

INVALID = sorted((REPO / "tests" / "data" / "invalid").glob("*.yaml"))


def _expected(path: Path) -> str:
    first = path.read_text().splitlines()[:1]
    if first and first[0].startswith("# expect:"):
        return first[0].removeprefix("# expect:").strip()
    return "empty file"


def test_there_are_at_least_25_invalid_files():
    assert len(INVALID) >= 25


@pytest.mark.parametrize("path", INVALID, ids=[p.stem for p in INVALID])
def test_invalid_file_exits_1_and_names_the_field(path: Path, capsys):
    assert main(["validate", str(path)]) == 1
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    expected = _expected(path)
    assert expected in out.err, out.err
    # every error line says where: file, line (when known) and document
    for line in out.err.strip().splitlines():
        assert line.startswith(f"error: {path}"), line
        assert "(document " in line


def test_wrong_value_errors_show_the_offending_value_and_the_allowed_ones(capsys):
    assert main(["validate", str(REPO / "tests/data/invalid/unknown-engine.yaml")]) == 1
    err = capsys.readouterr().err
    assert "'tgi'" in err and "'sglang', 'vllm' or 'hf'" in err
    assert re.search(r"unknown-engine\.yaml:\d+ ", err), "line number of the field is reported"


def test_yaml_syntax_error_reports_the_line(capsys):
    assert main(["validate", str(REPO / "tests/data/invalid/yaml-syntax-error.yaml")]) == 1
    err = capsys.readouterr().err
    assert re.search(r"yaml-syntax-error\.yaml:\d+ ", err)


def test_cross_field_rule_message_says_what_is_allowed(capsys):
    main(["validate", str(REPO / "tests/data/invalid/loglinear-with-ppo.yaml")])
    assert "requires loss 'decoupled'" in capsys.readouterr().err
    main(["validate", str(REPO / "tests/data/invalid/batch-not-divisible.yaml")])
    assert "batchSize (6) must be divisible by minibatches (4)" in capsys.readouterr().err


def test_examples_validate_with_a_summary_line_each(capsys):
    files = [str(REPO / "examples" / n) for n in ("job.yaml", "local.yaml")]
    assert main(["validate", *files]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 2
    assert "qwen25-gsm8k" in out[0] and "4x sglang" in out[0] and "1x8 GPU" in out[0] and "loglinear" in out[0]
    assert "embedded:SmolLM2-135M-Instruct" in out[1]


def test_several_documents_per_file(tmp_path, capsys):
    text = (REPO / "examples" / "local.yaml").read_text()
    f = tmp_path / "two.yaml"
    f.write_text(text + "\n---\n" + text.replace("local-arithmetic", "second"))
    assert main(["validate", str(f)]) == 0
    assert len(capsys.readouterr().out.strip().splitlines()) == 2


def test_missing_file_is_an_error_not_a_traceback(tmp_path, capsys):
    assert main(["validate", str(tmp_path / "nope.yaml")]) == 1
    assert "cannot read file" in capsys.readouterr().err


def test_console_script_runs_and_mixed_files_exit_1():
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "validate", str(REPO / "examples/local.yaml"),
                          str(INVALID[0])], capture_output=True, text=True)
    assert res.returncode == 1
    assert "ok: local-arithmetic" in res.stdout
    assert "Traceback" not in res.stderr and res.stderr.startswith("error: ")


def test_typo_suggests_the_intended_field(capsys):
    main(["validate", str(REPO / "tests/data/invalid/typo-top-level-key.yaml")])
    assert "did you mean 'trainer'?" in capsys.readouterr().err
