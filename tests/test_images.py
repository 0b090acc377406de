"""Dockerfiles: pinned bases, non-root users, entrypoints that are real `asyncrl` subcommands."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from asyncrl.cli import COMMANDS
from asyncrl.operator.builders import RUN_AS_USER
from asyncrl.spec import RolloutSpec

REPO = Path(__file__).resolve().parent.parent
IMAGES = {"operator": "operator", "trainer": "trainer", "rollout": "rollout"}


def instructions(name: str) -> list[tuple[str, str]]:
    text = (REPO / "images" / f"{name}.Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_base_is_pinned(name):
    bases = [rest for op, rest in instructions(name) if op == "FROM"]
    assert bases
    for base in bases:
        image, _, tag = base.split()[0].rpartition(":")
        assert image and tag and tag != "latest" and re.search(r"\d", tag), base


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_runs_as_non_root(name):
    users = [rest for op, rest in instructions(name) if op == "USER"]
    assert users, "an explicit USER"
    uid = users[-1].split(":")[0]
    assert uid.isdigit() and int(uid) > 0, "numeric non-root uid (runAsNonRoot can verify it)"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_entrypoint_is_an_asyncrl_subcommand(name):
    ops = dict(instructions(name))
    assert json.loads(ops["ENTRYPOINT"]) == ["asyncrl"]
    cmd = json.loads(ops["CMD"])
    assert cmd[0] == IMAGES[name] and cmd[0] in {c for c, _, _ in COMMANDS}


def test_rollout_image_is_based_on_the_pinned_sglang_default():
    (base,) = [rest for op, rest in instructions("rollout") if op == "FROM"]
    assert base == RolloutSpec().image, "the rollout image and the spec's default engine image agree"


def test_pod_uid_matches_image_users():
    for name in ("trainer", "rollout"):
        users = [rest for op, rest in instructions(name) if op == "USER"]
        assert users[-1] == f"{RUN_AS_USER}:{RUN_AS_USER}"
