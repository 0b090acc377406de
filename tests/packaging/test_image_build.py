"""The images built and run, as a user deploys them: scripts/build-images.sh with podman, on the Debian
base made here from the package mirror (no image registry is reachable), each image started the way
the chart or the operator starts it, and what it is checked while it runs, not as its Dockerfile
reads. So far the operator image (the trainer and rollout images still build on their old bases:
tests/packaging/test_images.py reads those)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import yaml

from asyncrl import __version__
from tests.support.paths import REPO

pytestmark = pytest.mark.slow

HELM = REPO / ".tools" / "bin" / "helm"
PODMAN_CONF = REPO / ".tools" / "podman" / "containers.conf"
SETUP_HINT = "scripts/install-container-tools.sh installs podman and mmdebstrap (scripts/setup.sh --tests runs it)"


def podman(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    if PODMAN_CONF.is_file():
        env.setdefault("CONTAINERS_CONF", str(PODMAN_CONF))
    return subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def operator_image() -> str:
    """The operator image, built (or found in podman's layer cache) by scripts/build-images.sh."""
    assert shutil.which("podman") and shutil.which("mmdebstrap"), SETUP_HINT
    proc = subprocess.run(["bash", "scripts/build-images.sh", "--local-base", "operator"], cwd=REPO,
                          capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stderr[-5000:]
    ref, *_ = proc.stdout.split()
    assert ref == f"ghcr.io/asyncrl/operator:{__version__}", proc.stdout  # what the chart pulls by default
    return ref


@pytest.fixture(scope="module")
def chart_operator() -> dict:
    """The operator container and its pod's securityContext as the chart renders them (helm template)."""
    assert HELM.is_file(), "no helm: scripts/install-k8s-tools.sh"
    out = subprocess.run([str(HELM), "template", "asyncrl", str(REPO / "charts" / "asyncrl")], capture_output=True,
                         text=True, timeout=120, check=True).stdout
    [deployment] = [d for d in yaml.safe_load_all(out) if d and d["kind"] == "Deployment"]
    pod = deployment["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return {"pod": pod["securityContext"], "container": container}


def run_as_the_chart_does(image: str, chart: dict, *args: str, entrypoint: str | None = None
                          ) -> subprocess.CompletedProcess:
    """`podman run` with the chart's user, read-only root, dropped capabilities and no privilege escalation."""
    pod, sc = chart["pod"], chart["container"]["securityContext"]
    assert sc["readOnlyRootFilesystem"] and sc["capabilities"]["drop"] == ["ALL"] and not sc["allowPrivilegeEscalation"]
    flags = ["--rm", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
             "--user", f"{pod['runAsUser']}:{pod['runAsGroup']}"]
    if entrypoint is not None:
        flags.append(f"--entrypoint={entrypoint}")
    return podman("run", *flags, image, *args)


def test_the_operator_image_runs_asyncrl_as_the_charts_non_root_user_on_a_read_only_root(operator_image: str,
                                                                                        chart_operator: dict):
    proc = run_as_the_chart_does(operator_image, chart_operator, "--version")
    assert (proc.returncode, proc.stdout.strip()) == (0, f"asyncrl {__version__}"), proc.stderr
    who = run_as_the_chart_does(operator_image, chart_operator, "-c",
                                "import os; print(os.getuid(), os.getgid())",
                                entrypoint="python3")
    assert who.stdout.split() == ["10001", "10001"], who.stderr
    # and without --user: the image's own USER is that same non-root user (runAsNonRoot can verify it)
    config = json.loads(podman("image", "inspect", operator_image).stdout)[0]["Config"]
    assert config["User"] == "10001:10001", config


def test_the_operator_images_python_is_the_locks(operator_image: str, chart_operator: dict):
    """The operator lock is resolved for the suite's CPython minor (scripts/lock.sh), and the image runs it."""
    locked = re.search(r'^compile "\$R/operator.lock" (\d+\.\d+) ', (REPO / "scripts" / "lock.sh").read_text(), re.M)
    assert locked and locked[1] == f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = run_as_the_chart_does(operator_image, chart_operator, "-c",
                                 "import sys; print('%d.%d' % sys.version_info[:2])",
                                 entrypoint="python3")
    assert proc.stdout.strip() == locked[1], proc.stderr


def test_the_operator_image_takes_the_charts_command_and_flags(operator_image: str, chart_operator: dict):
    """The chart's command is the image's entrypoint and default command; its flags parse in the image's
    operator, whose handlers import there (kopf and the Kubernetes client, no torch)."""
    config = json.loads(podman("image", "inspect", operator_image).stdout)[0]["Config"]
    container = chart_operator["container"]
    assert config["Entrypoint"] + config["Cmd"] == container["command"] == ["asyncrl", "operator"]
    check = ("import argparse, sys, asyncrl.operator.handlers\n"
             "from asyncrl.operator.main import configure\n"
             "p = argparse.ArgumentParser(); configure(p); a = p.parse_args(sys.argv[1:])\n"
             "print(a.trainer_image, a.rollout_image, 'torch' in sys.modules)")
    proc = run_as_the_chart_does(operator_image, chart_operator, "-c", check, *container["args"],
                                 entrypoint="python3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    trainer, rollout, torch_loaded = proc.stdout.split()
    assert (trainer, rollout, torch_loaded) == (f"ghcr.io/asyncrl/trainer:{__version__}",
                                                f"ghcr.io/asyncrl/rollout:{__version__}", "False"), proc.stdout

