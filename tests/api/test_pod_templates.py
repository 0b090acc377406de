"""Per-role pod template overlays (spec.{rollout,trainer,redis.managed}.podTemplate): what a platform team
sets reaches the pods, merged after the operator's own fields, and validates strictly; mistakes are
rejected with the field path and what is allowed; jobs without an overlay are unchanged."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from asyncrl.api.crd import build_crd
from asyncrl.api.loader import JobFileError, parse_job
from asyncrl.api.spec.pod_template import (
    OPERATOR_ENV_PREFIX,
    OPERATOR_POD_LABELS,
    OPERATOR_PREFIX,
    EnvVar,
    PodTemplateOverlay,
    RedisPodTemplate,
    RolloutPodTemplate,
    TrainerPodTemplate,
    Volume,
    VolumeMount,
)
from asyncrl.operator import builders as B
from asyncrl.operator import names as N
from tests.support.jobs import JobBuilder
from tests.support.paths import REPO

PLATFORM = REPO / "examples" / "job-platform.yaml"
SCHEMA = build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
K8S_VERSIONS = ["1.30.0", kubernetes_validate.latest_version()]
# role -> (where its overlay sits in the spec, the kind and name suffix of the object carrying its pods)
ROLES = {"rollout": (("rollout",), "Deployment", "-rollout"),
         "trainer": (("trainer",), "StatefulSet", "-trainer"),
         "redis": (("redis", "managed"), "StatefulSet", "-redis")}
OVERLAY_CLASSES: dict[str, type[PodTemplateOverlay]] = {
    "rollout": RolloutPodTemplate, "trainer": TrainerPodTemplate, "redis": RedisPodTemplate}


def load(path: Path = PLATFORM) -> dict:
    return yaml.safe_load(path.read_text())


def overlay_of(doc: dict, role: str) -> dict:
    node = doc["spec"]
    for key in ROLES[role][0]:
        node = node[key]
    return node["podTemplate"]


def build(doc: dict, engine: str | None = None) -> list[dict]:
    doc = copy.deepcopy(doc)
    if engine:
        doc["spec"]["rollout"]["engine"] = engine
    if engine == "vllm":  # (the example's collective weight sync needs sglang or hf: vllm is disk only)
        doc["spec"]["trainer"]["weightTransport"] = "disk"
    return B.build_children(parse_job(doc), B.BuildContext(owner_uid="uid-1", namespace="rl", redis_password="pw"))


def workload(objs: list[dict], role: str) -> dict:
    _, kind, suffix = ROLES[role]
    return next(o for o in objs if o["kind"] == kind and o["metadata"]["name"].endswith(suffix))


# ----------------------------------------------------------------------------------- the example


def test_example_sets_every_overlay_field_on_every_role():
    """So the strict validation below covers every field the overlay can put into a pod."""
    doc = load()
    for role, cls in OVERLAY_CLASSES.items():
        wire_fields = {f.alias or n for n, f in cls.model_fields.items()}
        assert set(overlay_of(doc, role)) == wire_fields, role


def test_render_of_the_platform_example_validates_strictly_on_130_and_latest():
    """`asyncrl render` (the command) of every overlay: each object passes the strict Kubernetes schemas."""
    res = subprocess.run([sys.executable, "-m", "asyncrl.cli", "render", str(PLATFORM), "--uid", "u-1",
                          "--redis-password", "pw"], capture_output=True, text=True, cwd=REPO, timeout=60)
    assert res.returncode == 0, res.stderr
    docs = list(yaml.safe_load_all(res.stdout))
    assert {d["kind"] for d in docs} >= {"Deployment", "StatefulSet"}
    for version in K8S_VERSIONS:
        for obj in docs:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("engine", ["sglang", "vllm", "hf"])
def test_every_engine_with_overlays_validates_strictly(engine):
    for version in K8S_VERSIONS:
        for obj in build(load(), engine):
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("role", sorted(ROLES))
def test_overlay_lands_in_the_role_pods_after_the_operator_fields(role):
    doc = load()
    overlay = overlay_of(doc, role)
    plain = copy.deepcopy(doc)
    node = plain["spec"]
    for key in ROLES[role][0]:
        node = node[key]
    del node["podTemplate"]
    got, base = workload(build(doc), role), workload(build(plain), role)
    assert got["spec"]["selector"] == base["spec"]["selector"], "the selector is the operator's"
    tmpl, base_tmpl = got["spec"]["template"], base["spec"]["template"]
    pod, base_pod = tmpl["spec"], base_tmpl["spec"]
    # scheduling and identity: fields the operator never sets, taken as written
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "schedulerName",
                "serviceAccountName", "imagePullSecrets"):
        assert key not in base_pod
        got_value = pod[key]
        if key == "tolerations":  # the model fills in Kubernetes' default operator
            assert got_value == [{"operator": "Equal", **t} for t in overlay[key]]
        else:
            assert got_value == overlay[key], key
    # operator-owned pod fields are untouched
    for key in ("securityContext", "automountServiceAccountToken", "terminationGracePeriodSeconds"):
        assert pod.get(key) == base_pod.get(key), key
    # metadata: the operator's labels and annotations first and intact, the overlay's after them
    for key in ("labels", "annotations"):
        own = {k: v for k, v in base_tmpl["metadata"][key].items() if k != N.ANNOTATION_CONFIG_HASH}
        merged = {k: v for k, v in tmpl["metadata"][key].items() if k != N.ANNOTATION_CONFIG_HASH}
        assert list(merged)[:len(own)] == list(own) and {k: merged[k] for k in own} == own
        assert {k: merged[k] for k in overlay[key]} == overlay[key]
    # volumes appended after the operator's
    assert pod.get("volumes", [])[:len(base_pod.get("volumes", []))] == base_pod.get("volumes", [])
    assert [v["name"] for v in pod["volumes"][len(base_pod.get("volumes", [])):]] == \
        [v["name"] for v in overlay["volumes"]]
    # env, envFrom and volumeMounts in every container, after the operator's
    assert len(pod["containers"]) == len(base_pod["containers"])
    for c, base_c in zip(pod["containers"], base_pod["containers"]):
        if c["name"] == B.ENGINE_PROXY_CONTAINER:
            assert c == base_c, "the engine proxy takes nothing from the overlay"
            continue
        for field in ("command", "args", "image", "ports", "resources", "securityContext", "readinessProbe"):
            assert c.get(field) == base_c.get(field), (c["name"], field)
        own_env = base_c.get("env", [])
        assert c["env"][:len(own_env)] == own_env
        assert [e["name"] for e in c["env"][len(own_env):]] == [e["name"] for e in overlay["env"]]
        assert c["envFrom"] == overlay["envFrom"]
        mounts = c["volumeMounts"][len(base_c["volumeMounts"]):]
        assert c["volumeMounts"][:len(base_c["volumeMounts"])] == base_c["volumeMounts"]
        assert [m["mountPath"] for m in mounts] == [m["mountPath"] for m in overlay["volumeMounts"]]


def test_other_children_are_untouched_by_overlays():
    doc, plain = load(), load()
    for role in ROLES:
        node = plain["spec"]
        for key in ROLES[role][0]:
            node = node[key]
        del node["podTemplate"]
    for got, base in zip(build(doc), build(plain)):
        if got["kind"] in ("ConfigMap", "Deployment", "StatefulSet"):
            continue  # the ConfigMap carries the spec; the workloads are compared above
        assert got == base, got["kind"]


# ----------------------------------------------------------------------------------- no overlay


def test_no_overlay_returns_the_template_itself():
    template = {"metadata": {"labels": {"a": "b"}}, "spec": {"containers": [{"name": "c"}]}}
    assert B.apply_pod_template(template, None) is template


def test_an_unset_overlay_stays_off_the_wire_and_off_the_hash():
    """Absent, not {}: existing jobs keep their config hash (no pod restarts on an operator upgrade)."""
    doc = JobBuilder.example().doc()
    job = parse_job(doc)
    wire = job.spec.to_wire()
    assert "podTemplate" not in wire["rollout"] and "podTemplate" not in wire["trainer"]
    assert "podTemplate" not in wire["redis"]["managed"]
    # The CRD does not default it either (the API server would otherwise store podTemplate: {}).
    spec = SCHEMA["properties"]["spec"]["properties"]
    for node in (spec["rollout"], spec["trainer"], spec["redis"]["properties"]["managed"]):
        assert "default" not in node["properties"]["podTemplate"]
    from asyncrl.api.crd import structural_default

    stored = structural_default(doc, SCHEMA)  # (as the API server defaults before it stores)
    assert "podTemplate" not in stored["spec"]["rollout"]
    assert B.config_hash(parse_job(stored)) == B.config_hash(job)


def test_empty_overlay_changes_nothing_but_the_spec_hash():
    doc = JobBuilder.example().doc()
    empty = copy.deepcopy(doc)
    empty["spec"]["rollout"]["podTemplate"] = {}
    empty["spec"]["trainer"]["podTemplate"] = {}
    empty["spec"]["redis"]["managed"]["podTemplate"] = {}
    for got, base in zip(build(empty), build(doc)):
        if got["kind"] in ("Deployment", "StatefulSet"):
            for o in (got, base):
                o["spec"]["template"]["metadata"]["annotations"].pop(N.ANNOTATION_CONFIG_HASH, None)
            assert got == base, got["kind"]


def test_operator_entries_win_over_an_unvalidated_overlay():
    """Defence in depth: an overlay built without validation still cannot replace operator entries."""
    bad = TrainerPodTemplate.model_construct(
        labels={N.LABEL_COMPONENT: "evil", "team": "x"}, annotations={N.ANNOTATION_CONFIG_HASH: "0"},
        env=[EnvVar(name="HOME", value="/evil"), EnvVar(name="PLAIN", value="1")],
        volumes=[Volume(name="shared", emptyDir={}), Volume(name="extra", emptyDir={})],
        volume_mounts=[VolumeMount(name="x", mountPath="/tmp"), VolumeMount(name="extra", mountPath="/extra")])
    template = workload(build(JobBuilder.example().doc()), "trainer")
    template = template["spec"]["template"]
    before = copy.deepcopy(template)
    out = B.apply_pod_template(template, bad)
    assert template == before, "the input template is not modified"
    assert out["metadata"]["labels"][N.LABEL_COMPONENT] == "trainer" and out["metadata"]["labels"]["team"] == "x"
    assert out["metadata"]["annotations"][N.ANNOTATION_CONFIG_HASH] != "0"
    env = out["spec"]["containers"][0]["env"]
    assert [e for e in env if e["name"] == "HOME"] == [{"name": "HOME", "value": "/tmp"}]
    assert env[-1] == {"name": "PLAIN", "value": "1"}
    volumes = out["spec"]["volumes"]
    assert [v["name"] for v in volumes].count("shared") == 1 and volumes[-1]["name"] == "extra"
    mounts = out["spec"]["containers"][0]["volumeMounts"]
    assert [m["mountPath"] for m in mounts].count("/tmp") == 1 and mounts[-1]["mountPath"] == "/extra"


# ----------------------------------------------------------------------------------- drift guard


@pytest.mark.parametrize("engine", ["sglang", "vllm", "hf"])
def test_reserved_names_cover_everything_the_builders_set(engine):
    """The spec rejects exactly the names the builders use: a new operator variable, volume, mount or
    label must be added to the spec's reserved sets (or the ASYNCRL_ / asyncrl.dev/ prefixes)."""
    objs = build(JobBuilder.example().doc(), engine)
    assert set(N.job_labels("j")) | {N.LABEL_COMPONENT} <= OPERATOR_POD_LABELS | {N.LABEL_JOB}
    assert N.LABEL_JOB.startswith(OPERATOR_PREFIX)
    for role, cls in OVERLAY_CLASSES.items():
        sts = workload(objs, role)
        tmpl = sts["spec"]["template"]
        for key in tmpl["metadata"]["labels"]:
            assert key in OPERATOR_POD_LABELS or key.startswith(OPERATOR_PREFIX), (role, key)
        for key in tmpl["metadata"]["annotations"]:
            assert key.startswith(OPERATOR_PREFIX), (role, key)
        volumes = [v["name"] for v in tmpl["spec"].get("volumes", [])]
        volumes += [c["metadata"]["name"] for c in sts["spec"].get("volumeClaimTemplates", [])]
        assert set(volumes) <= cls.RESERVED_VOLUMES, role
        for c in tmpl["spec"]["containers"]:
            for e in c.get("env", []):
                assert e["name"].startswith(OPERATOR_ENV_PREFIX) or e["name"] in cls.RESERVED_ENV, (role, e["name"])
            for m in c.get("volumeMounts", []):
                assert m["mountPath"] in cls.RESERVED_MOUNTS, (role, m["mountPath"])
            for ro in (m["mountPath"] for m in c.get("volumeMounts", []) if m.get("readOnly")):
                assert ro in cls.READ_ONLY_MOUNTS or role == "redis", (role, ro)


# ----------------------------------------------------------------------------------- rejections


def errors_for(role: str, overlay: dict[str, Any]) -> list[tuple[str, str]]:
    doc = JobBuilder.example().doc()
    node = doc["spec"]
    for key in ROLES[role][0]:
        node = node.setdefault(key, {})
    node["podTemplate"] = overlay
    with pytest.raises(JobFileError) as err:
        parse_job(doc)
    return [(e.path, e.message) for e in err.value.errors]


def _pt(role: str) -> str:
    return "spec." + ".".join(ROLES[role][0]) + ".podTemplate"


REJECTED = [
    # (role, overlay, path under podTemplate, words the message must contain)
    ("trainer", {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Contains"}]}, "tolerations.0.operator",
     ["'Exists'", "'Equal'"]),
    ("rollout", {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoRun"}]},
     "tolerations.0.effect", ["'NoSchedule'", "'PreferNoSchedule'", "'NoExecute'"]),
    ("rollout", {"tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "value": "present"}]},
     "tolerations.0", ["operator 'Exists' matches any value", "allowed operators: Exists, Equal"]),
    ("trainer", {"tolerations": [{"operator": "Equal", "value": "x"}]}, "tolerations.0", ["without a key"]),
    ("trainer", {"tolerations": [{"key": "k", "operator": "Exists", "effect": "NoSchedule",
                                  "tolerationSeconds": 30}]}, "tolerations.0", ["needs effect 'NoExecute'"]),
    ("trainer", {"tolerations": [{"key": "bad key!", "operator": "Exists"}]}, "tolerations.0.key",
     ["qualified name"]),
    ("trainer", {"env": [{"name": "1-bad name", "value": "x"}]}, "env.0.name", ["not valid", "[-._a-zA-Z]"]),
    ("trainer", {"env": [{"name": "ASYNCRL_REDIS_URL", "value": "redis://x"}]}, "env",
     ["env[0].name 'ASYNCRL_REDIS_URL'", "trainer pods", "ASYNCRL_*"]),
    ("rollout", {"env": [{"name": "A", "value": "1"}, {"name": "HOME", "value": "/x"}]}, "env",
     ["env[1].name 'HOME'", "rollout pods", "HF_HOME"]),
    ("rollout", {"env": [{"name": "VLLM_SERVER_DEV_MODE", "value": "0"}]}, "env", ["VLLM_SERVER_DEV_MODE"]),
    ("redis", {"env": [{"name": "REDISCLI_AUTH", "value": "x"}]}, "env", ["redis pods", "REDISCLI_AUTH"]),
    ("trainer", {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}, "env", ["defined twice"]),
    ("trainer", {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}}]},
     "env.0", ["value or valueFrom, not both"]),
    ("trainer", {"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"},
                                                     "secretKeyRef": {"name": "s", "key": "k"}}}]},
     "env.0.valueFrom", ["exactly one of", "secretKeyRef, fieldRef"]),
    ("trainer", {"env": [{"name": "A", "valueFrom": {"fieldRef": {"fieldPath": "spec.containers"}}}]},
     "env.0.valueFrom.fieldRef.fieldPath", ["not a pod field", "allowed:", "spec.nodeName"]),
    ("trainer", {"envFrom": [{"configMapRef": {"name": "a"}, "secretRef": {"name": "b"}}]}, "envFrom.0",
     ["exactly one of configMapRef, secretRef"]),
    ("trainer", {"envFrom": [{"prefix": "ASYNCRL_", "secretRef": {"name": "b"}}]}, "envFrom.0.prefix",
     ["belong to asyncrl"]),
    ("trainer", {"volumes": [{"name": "x", "emptyDir": {}}, {"name": "x", "emptyDir": {}}]}, "volumes",
     ["volumes[1].name 'x' is used twice"]),
    ("trainer", {"volumes": [{"name": "shared", "emptyDir": {}}]}, "volumes",
     ["volumes[0].name 'shared'", "reserved: config, dshm, job-secrets, shared, tmp"]),
    ("redis", {"volumes": [{"name": "data", "emptyDir": {}}]}, "volumes", ["reserved: data"]),
    ("rollout", {"volumes": [{"name": "host", "hostPath": {"path": "/var/run"}}]}, "volumes.0",
     ["'hostPath' is not allowed", "restricted Pod Security Standard", "allowed: configMap, secret"]),
    ("rollout", {"volumes": [{"name": "x"}]}, "volumes.0", ["exactly one source", "allowed: configMap"]),
    ("rollout", {"volumes": [{"name": "Bad_Name", "emptyDir": {}}]}, "volumes.0.name", ["DNS-1123 label"]),
    ("trainer", {"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "/shared"}]},
     "volumeMounts", ["volumeMounts[0].mountPath '/shared'", "reserved: /etc/asyncrl, /shared, /tmp, /dev/shm"]),
    ("trainer", {"volumes": [{"name": "x", "emptyDir": {}}],
                 "volumeMounts": [{"name": "x", "mountPath": "/etc/asyncrl/extra"}]},
     "volumeMounts", ["inside the read-only /etc/asyncrl"]),
    ("trainer", {"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "y", "mountPath": "/y"}]},
     "", ["volumeMounts[0].name 'y' names no volume", "allowed: x"]),
    ("trainer", {"volumes": [{"name": "x", "emptyDir": {}}], "volumeMounts": [{"name": "x", "mountPath": "rel"}]},
     "volumeMounts.0.mountPath", ["absolute path"]),
    ("rollout", {"labels": {"app.kubernetes.io/component": "x"}}, "labels",
     ["label 'app.kubernetes.io/component'", "reserved: asyncrl.dev/*"]),
    ("rollout", {"labels": {"asyncrl.dev/anything": "x"}}, "labels", ["set by the operator"]),
    ("rollout", {"labels": {"team": "not a value!"}}, "labels", ["not a label value"]),
    ("trainer", {"annotations": {"asyncrl.dev/config-hash": "0"}}, "annotations", ["belong to the operator"]),
    ("trainer", {"nodeSelector": {"-bad": "x"}}, "nodeSelector", ["qualified name"]),
    ("trainer", {"priorityClassName": "High_Priority"}, "priorityClassName",
     ["priorityClassName 'High_Priority' is not a DNS-1123 subdomain"]),
    ("trainer", {"schedulerName": "Volcano"}, "schedulerName", ["DNS-1123 subdomain"]),
    ("trainer", {"serviceAccountName": "a b"}, "serviceAccountName", ["DNS-1123 subdomain"]),
    ("trainer", {"imagePullSecrets": [{"name": "UPPER"}]}, "imagePullSecrets.0.name", ["DNS-1123 subdomain"]),
    ("trainer", {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "Like", "values": ["a"]}]}]}}}},
     "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.0.matchExpressions.0"
     ".operator", ["'In'", "'NotIn'", "'Exists'", "'DoesNotExist'", "'Gt'", "'Lt'"]),
    ("trainer", {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "In"}]}]}}}},
     "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.0.matchExpressions.0",
     ["'In' needs at least one value"]),
    ("trainer", {"affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [{"key": "k", "operator": "Gt", "values": ["many"]}]}]}}}},
     "affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.0.matchExpressions.0",
     ["exactly one integer value"]),
    ("trainer", {"affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 0, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname"}}]}}},
     "affinity.podAntiAffinity.preferredDuringSchedulingIgnoredDuringExecution.0.weight", ["greater than or equal"]),
    ("trainer", {"affinity": {"podAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": [
        {"labelSelector": {"matchExpressions": [{"key": "a", "operator": "Exists", "values": ["x"]}]},
         "topologyKey": "zone"}]}}},
     "affinity.podAffinity.requiredDuringSchedulingIgnoredDuringExecution.0.labelSelector.matchExpressions.0",
     ["'Exists' takes no values"]),
    ("trainer", {"containers": []}, "containers", ["unknown field", "allowed: labels, annotations"]),
]


@pytest.mark.parametrize("role, overlay, path, words", REJECTED,
                         ids=[f"{r[0]}-{r[2] or 'podTemplate'}-{i}" for i, r in enumerate(REJECTED)])
def test_bad_overlays_are_rejected_with_path_and_allowed_values(role, overlay, path, words):
    errors = errors_for(role, overlay)
    want = _pt(role) + (f".{path}" if path else "")
    assert [p for p, _ in errors] == [want], errors
    message = errors[0][1]
    for word in words:
        assert word in message, (word, message)


def test_crd_schema_rejects_what_it_can_say_structurally():
    """The API server refuses bad enums before the operator sees the job (kubectl apply feedback)."""
    validator = jsonschema.Draft4Validator(SCHEMA)
    good = load()
    validator.validate(good)
    for path, value in [(("tolerations", 0, "operator"), "Contains"), (("tolerations", 0, "effect"), "NoRun"),
                        (("affinity", "podAntiAffinity", "preferredDuringSchedulingIgnoredDuringExecution", 0,
                          "weight"), 101)]:
        bad = copy.deepcopy(good)
        node: Any = overlay_of(bad, "rollout")
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with pytest.raises(jsonschema.ValidationError):
            validator.validate(bad)


def test_wire_form_of_the_example_round_trips():
    job = parse_job(load())
    assert parse_job(job.to_wire()) == job
    assert job.to_wire()["spec"]["trainer"]["podTemplate"]["volumes"][2]["ephemeral"] == \
        overlay_of(load(), "trainer")["volumes"][2]["ephemeral"]


def test_fields_at_their_defaults_do_not_change_the_config_hash():
    """An operator upgrade that adds spec fields (at defaults that keep the old behaviour) must not roll
    every running job's pods; setting one away from its default does."""
    doc = JobBuilder.example().doc()
    base = B.config_hash(parse_job(doc))
    spelled = copy.deepcopy(doc)
    spelled["spec"]["algorithm"].update(vcpo={"essScaling": False}, objective="ppo-clip", sapo={"tauPos": 1.0})
    spelled["spec"]["trainer"]["weightTransport"] = "disk"
    assert B.config_hash(parse_job(spelled)) == base
    changed = copy.deepcopy(doc)
    changed["spec"]["algorithm"]["vcpo"] = {"essScaling": True}
    assert B.config_hash(parse_job(changed)) != base
