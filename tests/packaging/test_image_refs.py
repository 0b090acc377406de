"""Digest-pinnable images: the spec, the operator's default-image flags and the builders accept
`name[:tag]@sha256:<64 hex>`, refuse a malformed reference with the field path and the allowed form,
and keep a digest exactly as written (the chart's side: tests/packaging/test_helm_chart.py)."""

from __future__ import annotations

import argparse
import copy
import re

import pytest

from asyncrl.api.crd import openapi_schema
from asyncrl.api.loader import JobFileError, parse_job
from asyncrl.api.spec.base import IMAGE_PATTERN
from asyncrl.operator import builders as B
from asyncrl.operator.config import image_arg
from tests.support.jobs import JobBuilder

DIGEST = "sha256:" + "0123456789abcdef" * 4
PINNED = {
    ("rollout", "image"): f"lmsysorg/sglang:v0.5.10.post1-cu126@{DIGEST}",
    ("rollout", "workerImage"): f"registry.example.com:5000/asyncrl/rollout@{DIGEST}",
    ("trainer", "image"): f"ghcr.io/asyncrl/trainer:0.1.0@{DIGEST}",
}


def pinned_job(**images: str) -> dict:
    """examples/job.yaml with every image pinned by digest; `images` ("section__field") change some."""
    pinned = {f"{section}.{field}": value for (section, field), value in PINNED.items()}
    redis = {"redis": {"mode": "managed", "managed": {"image": f"redis:7.4-alpine@{DIGEST}"}}}
    changed = {key.replace("__", "."): value for key, value in images.items()}
    return JobBuilder.example(**{**pinned, **redis, **changed}).doc()


def errors(doc: dict) -> list[tuple[str, str]]:
    with pytest.raises(JobFileError) as err:
        parse_job(doc)
    return [(e.path, e.message) for e in err.value.errors]


def test_digests_reach_every_pod_unchanged():
    objs = B.build_children(parse_job(pinned_job()), B.BuildContext(owner_uid="u", namespace="ns"))
    images = {(o["metadata"]["name"], c["name"]): c["image"] for o in objs if o["kind"] in ("Deployment", "StatefulSet")
              for c in o["spec"]["template"]["spec"]["containers"]}
    assert images == {
        ("qwen25-gsm8k-rollout", "engine"): PINNED[("rollout", "image")],
        ("qwen25-gsm8k-rollout", "worker"): PINNED[("rollout", "workerImage")],
        ("qwen25-gsm8k-rollout", "engine-proxy"): PINNED[("rollout", "workerImage")],
        ("qwen25-gsm8k-trainer", "trainer"): PINNED[("trainer", "image")],
        ("qwen25-gsm8k-redis", "redis"): f"redis:7.4-alpine@{DIGEST}",
    }


def test_operator_default_images_keep_their_digest():
    ctx = B.BuildContext(owner_uid="u", namespace="ns", trainer_image=image_arg(f"ghcr.io/a/trainer@{DIGEST}"))
    doc = copy.deepcopy(pinned_job())
    del doc["spec"]["trainer"]["image"]
    sts = B.trainer_statefulset(parse_job(doc), ctx)
    assert sts["spec"]["template"]["spec"]["containers"][0]["image"] == f"ghcr.io/a/trainer@{DIGEST}"
    with pytest.raises(argparse.ArgumentTypeError, match="sha256:<64 lowercase hex digits>"):
        image_arg("ghcr.io/a/trainer@sha256:1234")


@pytest.mark.parametrize(("field", "value", "says"), [
    ("trainer__image", "ghcr.io/a/trainer@sha256:1234", "digest 'sha256:1234' is not sha256:<64"),
    ("trainer__image", f"ghcr.io/a/trainer@{DIGEST.upper()}", "is not sha256:<64 lowercase hex digits>"),
    ("rollout__image", "SGLang:latest", "is not an image reference"),
    ("rollout__workerImage", "a b:1", "is not an image reference"),
])
def test_malformed_images_are_refused_with_path_and_form(field, value, says):
    section, name = field.split("__")
    [(path, message)] = errors(pinned_job(**{field: value}))
    assert path == f"spec.{section}.{name}"
    assert says in message and "[registry/]name[:tag][@sha256:<64 lowercase hex digits>]" in message


def test_crd_carries_the_same_pattern():
    """The API server refuses what the spec refuses (pattern, RE2-compatible), for every image field."""
    spec = openapi_schema()["properties"]["spec"]["properties"]
    for node in (spec["rollout"]["properties"]["image"], spec["rollout"]["properties"]["workerImage"],
                 spec["trainer"]["properties"]["image"], spec["redis"]["properties"]["managed"]["properties"]["image"]):
        assert node["pattern"] == IMAGE_PATTERN
    assert re.fullmatch(IMAGE_PATTERN, PINNED[("trainer", "image")])
    assert not re.fullmatch(IMAGE_PATTERN, "ghcr.io/a/trainer@sha256:1234")
