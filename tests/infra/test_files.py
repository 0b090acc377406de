"""Crash-safe directory writes (asyncrl/infra/files.py): all or nothing, never half a directory."""

from __future__ import annotations

import pytest

from asyncrl.infra.files import atomic_directory, remove_stray_temp_dirs
from asyncrl.infra.net import free_port


def test_atomic_directory_appears_complete_and_leaves_no_temp(tmp_path):
    target = tmp_path / "v3"
    with atomic_directory(target) as tmp:
        (tmp / "a.bin").write_bytes(b"x" * 10)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "b.txt").write_text("b")
        assert not target.exists()  # nothing visible before the block ends
    assert (target / "a.bin").read_bytes() == b"x" * 10 and (target / "sub" / "b.txt").read_text() == "b"
    assert [p.name for p in tmp_path.iterdir()] == ["v3"]


def test_a_failing_writer_leaves_the_old_directory_and_no_temp(tmp_path):
    target = tmp_path / "v1"
    with atomic_directory(target) as tmp:
        (tmp / "f").write_text("old")
    with pytest.raises(RuntimeError, match="disk full"), atomic_directory(target) as tmp:
        (tmp / "f").write_text("half")
        raise RuntimeError("disk full")
    assert (target / "f").read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["v1"]


def test_replace_false_keeps_the_first_writers_copy(tmp_path):
    target = tmp_path / "model"
    with atomic_directory(target, replace=False) as tmp:
        (tmp / "f").write_text("first")
    with atomic_directory(target, replace=False) as tmp:
        (tmp / "f").write_text("second")
    assert (target / "f").read_text() == "first"
    with atomic_directory(target) as tmp:
        (tmp / "f").write_text("third")
    assert (target / "f").read_text() == "third"


def test_stray_temp_dirs_of_a_killed_writer_are_removed(tmp_path):
    (tmp_path / ".v7-abc123").mkdir()
    (tmp_path / ".step-000002-xyz").mkdir()
    (tmp_path / "v6").mkdir()
    removed = remove_stray_temp_dirs(tmp_path, "v")
    assert [p.name for p in removed] == [".v7-abc123"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".step-000002-xyz", "v6"]


def test_free_port_is_bindable():
    import socket

    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))
