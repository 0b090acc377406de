"""Every SGLang route and request field we use exists in the pinned release's own source.

The pinned wheel's `http_server.py` (route table), `v1_loads.py` (its one included router),
`io_struct.py` (request models) and `sampling_params.py` are cached by scripts/fetch-sglang-source.sh
(run by `scripts/setup.sh --tests`) into .tools/sglang-<PINNED_VERSION>/. Checked here:
  - the probe paths of the rendered rollout Deployment (sglang engine: examples/job.yaml; our hf
    server: examples/local.yaml), and that the readiness handler cannot wait behind a pause;
  - every call the sglang adapter makes (path, method, body fields, field types, pause modes,
    sampling parameters);
  - tests/support/sglang_fake.py: only routes and methods the pin has, request fields the pin declares;
  - the in-process hf server serves every route the adapter calls, readiness included.
"""

from __future__ import annotations

import ast
import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

import httpx
import yaml

from asyncrl.api.engine_servers import PROXY_READY_PATH
from asyncrl.api.loader import load_job, parse_job
from asyncrl.api.runtime import ENV_ENGINE_API_KEY, HEALTH_GENERATION_ENV
from asyncrl.api.spec import RolloutSpec
from asyncrl.api.weight_labels import WeightLabel
from asyncrl.operator.render import render
from asyncrl.rollout.engines import SamplingParams
from asyncrl.rollout.engines.sglang import LEGACY_MODEL_INFO_PATH, MODEL_INFO_PATH, PINNED_VERSION, SGLangEngine
from asyncrl.rollout.engines.weight_group import TensorSpec
from tests.support.engine_routes import FETCH_HINT, HTTP_SERVER, PIN_DIR, Route, pin_file, pin_routes
from tests.support.paths import REPO

IO_STRUCT = "sglang/srt/managers/io_struct.py"
SAMPLING = "sglang/srt/sampling/sampling_params.py"


def pin_classes() -> dict[str, ast.ClassDef]:
    tree = ast.parse(pin_file(IO_STRUCT).read_text())
    return {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}


def pin_fields(model: str) -> dict[str, ast.expr]:
    """A request dataclass's fields (with its bases'), name -> annotation."""
    classes = pin_classes()
    out: dict[str, ast.expr] = {}
    todo = [model]
    while todo:
        cls = classes[todo.pop()]
        for stmt in cls.body:
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                out.setdefault(stmt.target.id, stmt.annotation)
        todo += [b.id for b in cls.bases if isinstance(b, ast.Name) and b.id in classes]
    return out


def pin_sampling_params() -> set[str]:
    tree = ast.parse(pin_file(SAMPLING).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
    return {a.arg for a in init.args.args[1:]} | {a.arg for a in init.args.kwonlyargs}


def literal_values(annotation: ast.expr) -> set[Any] | None:
    if isinstance(annotation, ast.Subscript) and isinstance(annotation.value, ast.Name) \
            and annotation.value.id == "Literal":
        return set(ast.literal_eval(annotation.slice))
    return None


def value_fits(value: Any, annotation: ast.expr) -> bool:
    """A light type check for the annotations our calls meet (str, bool, Optional[...], Literal)."""
    text = ast.unparse(annotation)
    literals = literal_values(annotation)
    if literals is not None:
        return value in literals
    if text.startswith("Optional[") and value is None:
        return True
    inner = text.removeprefix("Optional[").removesuffix("]") if text.startswith("Optional[") else text
    simple = {"str": str, "bool": bool, "int": int, "float": (int, float)}
    if inner in simple:
        if inner != "bool" and isinstance(value, bool):
            return False
        return isinstance(value, simple[inner])
    return True  # richer annotations (Union, List, Dict): not checked here


def assert_in_pin(method: str, path: str, what: str) -> Route:
    routes = pin_routes()
    assert path in routes, f"{what}: {method} {path} is not a route of SGLang {PINNED_VERSION}"
    assert method in routes[path].methods, (
        f"{what}: SGLang {PINNED_VERSION} serves {path} only as {sorted(routes[path].methods)}, not {method}")
    return routes[path]


def _calls(node: ast.AST) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Call):
            f = n.func
            out.add(f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else "")
    return out


# ---------------------------------------------------------------- the pin itself


def test_pin_is_one_version_everywhere():
    default = RolloutSpec().engine_image() or ""
    assert f":v{PINNED_VERSION}-" in default, "the default engine image is the pinned SGLang"
    wheel = pin_file("WHEEL").read_text().strip()
    assert wheel.startswith(f"sglang-{PINNED_VERSION}-"), f"{PIN_DIR} holds {wheel}; {FETCH_HINT}"


def test_route_table_is_read():
    routes = pin_routes()
    assert len(routes) > 60, f"only {len(routes)} routes read from {HTTP_SERVER}: the parser broke"
    assert routes["/generate"].methods == {"POST", "PUT"}
    assert routes["/flush_cache"].methods == {"GET", "POST"}
    assert routes["/v1/loads"].methods == {"GET"}  # from the included v1_loads router
    assert "/ready" not in routes, "the pin has no /ready (the probe we used to render)"
    assert routes["/update_weights_from_disk"].body_models == {"UpdateWeightFromDiskReqInput"}


# ---------------------------------------------------------------- the rollout pod's probes


def _rollout_containers(example: str) -> dict[str, dict[str, Any]]:
    docs = list(yaml.safe_load_all(render(load_job(REPO / "examples" / example), uid="u", redis_password="p")))
    (deploy,) = [d for d in docs if d["kind"] == "Deployment"]
    return {c["name"]: c for c in deploy["spec"]["template"]["spec"]["containers"]}


def _probed_health_path(containers: dict[str, dict[str, Any]]) -> str:
    """The engine route the proxy's readiness reports (the kubelet probes the proxy, never the engine)."""
    proxy = containers["engine-proxy"]
    assert proxy["readinessProbe"]["httpGet"]["path"] == PROXY_READY_PATH
    assert not any(k in containers["engine"] for k in ("startupProbe", "readinessProbe", "livenessProbe")), \
        "the engine listens on loopback: a kubelet probe cannot reach it"
    return proxy["command"][proxy["command"].index("--health-path") + 1]


def test_sglang_readiness_is_a_route_of_the_pin():
    containers = _rollout_containers("job.yaml")
    engine = containers["engine"]
    assert engine["command"][:3] == ["python3", "-m", "sglang.launch_server"]
    assert_in_pin("GET", _probed_health_path(containers), "the rollout pod's readiness")
    env = {e["name"]: e for e in engine["env"]}
    assert env[HEALTH_GENERATION_ENV]["value"] == "false", "readiness must not generate (see below)"
    # the engine gets no key (the pin logs server_args, key included, and would have it in argv)
    assert "--api-key" not in engine["command"] and ENV_ENGINE_API_KEY not in env


def test_readiness_route_does_not_wait_behind_a_pause():
    """The trainer pauses generation on every step: readiness must not depend on generating.

    The pin's /health generates one token (`generate_request`, which waits while `is_pause`) and
    answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT, unless SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION is
    false (the rollout pod sets it): then GET /health answers 200 before awaiting anything, once the
    server is no longer Starting. /model_info would not wait either."""
    routes = pin_routes()
    (health,) = routes["/health"].handlers
    assert "generate_request" in _calls(health)
    light = [n for n in health.body if isinstance(n, ast.If) and HEALTH_GENERATION_ENV in ast.unparse(n.test)
             and "'/health'" in ast.unparse(n.test)]
    assert light, f"the pin's /health has no {HEALTH_GENERATION_ENV} shortcut"
    assert "status_code=200" in ast.unparse(light[0].body[0])
    before = health.body[:health.body.index(light[0]) + 1]
    assert not [n for stmt in before for n in ast.walk(stmt) if isinstance(n, ast.Await)], \
        "the light /health awaits something"


def test_hf_engine_probes_are_routes_of_our_hf_server():
    from asyncrl.rollout.engines.hf_server import create_app

    containers = _rollout_containers("local.yaml")
    assert containers["engine"]["command"][:2] == ["asyncrl", "engine"]
    path = _probed_health_path(containers)
    assert "GET" in _app_routes(create_app(object())).get(path, set()), f"the hf rollout pod's readiness {path}"


# ---------------------------------------------------------------- the adapter's calls


GROUP_ROUTES = ("/init_weights_update_group", "/update_weights_from_distributed", "/destroy_weights_update_group")
LORA_ROUTES = ("/load_lora_adapter", "/unload_lora_adapter")


@dataclass
class Recorder:
    calls: list[tuple[str, str, Any]] = field(default_factory=list)
    missing: set[str] = field(default_factory=set)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        self.calls.append((request.method, request.url.path, body))
        path = request.url.path
        if path in self.missing:
            return httpx.Response(404, json={"detail": "Not Found"})
        if path == "/generate":
            meta = {"id": "r", "finish_reason": {"type": "length", "length": 1}, "weight_version": "3",
                    "output_token_logprobs": [[-0.5, 11, None]]}
            return httpx.Response(200, json={"text": "x", "output_ids": [11], "meta_info": meta})
        if path == "/update_weights_from_disk":
            return httpx.Response(200, json={"success": True, "message": "ok", "num_paused_requests": 0})
        if path in GROUP_ROUTES:
            return httpx.Response(200, json={"success": True, "message": "ok"})
        if path in (MODEL_INFO_PATH, LEGACY_MODEL_INFO_PATH):
            return httpx.Response(200, json={"model_path": "m", "weight_version": "3"})
        if path == "/v1/models":  # the base model, then the adapters "2" and "3"
            cards = [{"id": "m", "root": "m", "parent": None}] + [
                {"id": name, "root": f"/shared/weights/v{name}", "parent": "m"} for name in ("2", "3")]
            return httpx.Response(200, json={"object": "list", "data": cards})
        if path in LORA_ROUTES:
            return httpx.Response(200, json={"success": True, "error_message": None, "loaded_adapters": {}})
        return httpx.Response(200, json={"message": "ok", "status": "ok"})


async def _drive_adapter(missing: frozenset[str] = frozenset()) -> list[tuple[str, str, Any]]:
    rec = Recorder(missing=set(missing))
    engine = SGLangEngine("http://sglang:30000", client=httpx.AsyncClient(transport=httpx.MockTransport(rec)))
    await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=20,
                                                    stop_token_ids=(2,)))
    await engine.pause("abort")
    await engine.pause("retract")
    await engine.update_weights("/shared/weights/v3", 3)
    await engine.init_weight_group("trainer-0.trainer", 29600, 1, 3, "asyncrl-1", "nccl")
    specs = [TensorSpec("model.norm.weight", "bfloat16", (576,)), TensorSpec("lm_head.weight", "float32", (8, 4))]
    await engine.update_weights_from_group(specs[:1], "asyncrl-1", None)
    await engine.update_weights_from_group(specs[1:], "asyncrl-1", 4)
    await engine.destroy_weight_group("asyncrl-1")
    await engine.resume()
    assert await engine.ready()
    await engine.model_info()
    assert await engine.weight_label() == WeightLabel(3)
    await engine.close()
    return rec.calls


async def _drive_lora_adapter() -> list[tuple[str, str, Any]]:
    """A LoRA job's engine: requests name the newest adapter ("3"); v4 is loaded as "4" and "2" unloaded."""
    rec = Recorder()
    engine = SGLangEngine("http://sglang:30000", adapters=True,
                          client=httpx.AsyncClient(transport=httpx.MockTransport(rec)))
    await engine.generate([1, 2, 3], SamplingParams(max_new_tokens=4))
    await engine.update_weights("/shared/weights/v4", 4)
    assert (await engine.model_info())["weight_version"] == "3"  # (the recorder still lists 2 and 3)
    await engine.close()
    return rec.calls


def adapter_calls() -> list[tuple[str, str, Any]]:
    # both the normal path and the fallback a server without /model_info takes, and a LoRA job's
    return (asyncio.run(_drive_adapter()) + asyncio.run(_drive_adapter(frozenset({MODEL_INFO_PATH})))
            + asyncio.run(_drive_lora_adapter()))


def test_adapter_calls_are_routes_of_the_pin_with_its_fields():
    calls = adapter_calls()
    sampling_args = pin_sampling_params()
    for method, path, body in calls:
        route = assert_in_pin(method, path, "the sglang adapter")
        if method == "GET":
            assert body is None
            continue
        assert isinstance(body, dict), f"{path}: the pin's handler takes a JSON object"
        (model,) = route.body_models
        fields = pin_fields(model)
        unknown = set(body) - set(fields)
        assert not unknown, f"{path}: {sorted(unknown)} are not fields of the pin's {model} (silently ignored)"
        for key, value in body.items():
            assert value_fits(value, fields[key]), f"{path}: {key}={value!r} does not fit {ast.unparse(fields[key])}"
        if path == "/generate":
            assert body["stream"] is False and body["return_logprob"] is True
            unknown = set(body["sampling_params"]) - sampling_args
            assert not unknown, f"sampling parameters {sorted(unknown)} are not in the pin's SamplingParams"
    used = {p for _, p, _ in calls}
    assert used == {"/generate", "/pause_generation", "/update_weights_from_disk", "/continue_generation",
                    MODEL_INFO_PATH, LEGACY_MODEL_INFO_PATH, *GROUP_ROUTES, *LORA_ROUTES, "/v1/models"}, \
        f"the adapter's routes changed: {sorted(used)}"


def test_adapter_wire_values_the_pin_reads():
    calls = adapter_calls()
    modes = literal_values(pin_fields("PauseGenerationReqInput")["mode"])
    assert modes is not None
    sent = {body["mode"] for m, p, body in calls if p == "/pause_generation"}
    assert sent == {"abort", "retract"} and sent <= modes
    (update,) = {json.dumps(b, sort_keys=True) for _, p, b in calls if p == "/update_weights_from_disk"}
    assert json.loads(update) == {"model_path": "/shared/weights/v3", "weight_version": "3",
                                  "abort_all_requests": False}
    assert "weight_version" in pin_fields("UpdateWeightFromDiskReqInput")
    assert [b for _, p, b in calls if p == "/continue_generation"] == [{}, {}], "the pin requires a JSON body"


def test_adapter_calls_name_the_adapter_by_its_weight_label():
    calls = asyncio.run(_drive_lora_adapter())
    (generate,) = [b for _, p, b in calls if p == "/generate"]
    assert generate["lora_path"] == "3", "a request names the newest adapter the server lists"
    assert [(p, b) for _, p, b in calls if p in LORA_ROUTES] == [
        ("/load_lora_adapter", {"lora_name": "4", "lora_path": "/shared/weights/v4", "pinned": False}),
        ("/unload_lora_adapter", {"lora_name": "2"})]  # ("3", the newest other one, stays)
    assert "lora_path" in pin_fields("GenerateReqInput")


def test_a_lora_job_launches_sglang_with_flags_and_modules_of_the_pin():
    """The pin needs --max-lora-rank and --lora-target-modules when no adapter is given at launch; the
    modules we allow with sglang are its SUPPORTED_LORA_TARGET_MODULES (utils/common.py)."""
    from asyncrl.api.spec.lora import SGLANG_ALL_LINEAR, SGLANG_TARGET_MODULES

    tree = ast.parse(pin_file("sglang/srt/utils/common.py").read_text())
    (supported,) = [ast.literal_eval(n.value) for n in tree.body if isinstance(n, ast.Assign)
                    and [t.id for t in n.targets if isinstance(t, ast.Name)] == ["SUPPORTED_LORA_TARGET_MODULES"]]
    assert list(SGLANG_TARGET_MODULES) == supported and set(SGLANG_ALL_LINEAR) <= set(supported)
    server_args = pin_file("sglang/srt/server_args.py").read_text()
    for lora, modules in (({}, list(SGLANG_ALL_LINEAR)), ({"rank": 8, "targetModules": ["q_proj", "v_proj"]},
                                                          ["q_proj", "v_proj"])):
        doc = yaml.safe_load((REPO / "examples" / "job.yaml").read_text())
        doc["spec"]["trainer"]["lora"] = lora
        docs = list(yaml.safe_load_all(render(parse_job(doc), uid="u", redis_password="p")))
        (deploy,) = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-rollout")]
        (engine,) = [c for c in deploy["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
        command = engine["command"]
        at = command.index("--enable-lora")
        rank = str(lora.get("rank", 16))
        assert command[at:at + 4 + len(modules)] == ["--enable-lora", "--max-lora-rank", rank,
                                                     "--lora-target-modules", *modules]
        for flag in ("--enable-lora", "--max-lora-rank", "--lora-target-modules"):
            assert f'"{flag}"' in server_args, f"the pinned SGLang has no {flag}"


def test_weight_group_calls_carry_what_the_pin_needs():
    """The pin's handlers read `backend` and `group_name` (defaults: nccl, weight_update_group) and
    `getattr(torch, dtype)` each dtype: we always send the group's own name and plain dtype names."""
    calls = adapter_calls()
    (init,) = {json.dumps(b, sort_keys=True) for _, p, b in calls if p == "/init_weights_update_group"}
    assert json.loads(init) == {"master_address": "trainer-0.trainer", "master_port": 29600, "rank_offset": 1,
                                "world_size": 3, "group_name": "asyncrl-1", "backend": "nccl"}
    updates = [b for _, p, b in calls if p == "/update_weights_from_distributed"][:2]
    assert [u["names"] for u in updates] == [["model.norm.weight"], ["lm_head.weight"]]
    assert [u["dtypes"] for u in updates] == [["bfloat16"], ["float32"]]
    assert [u["shapes"] for u in updates] == [[[576]], [[8, 4]]]
    # only the version's last bucket labels it (and flushes the cache); every bucket names the group
    assert ["weight_version" in u for u in updates] == [False, True] and updates[1]["weight_version"] == "4"
    assert [u["flush_cache"] for u in updates] == [False, True]
    assert {u["group_name"] for u in updates} == {"asyncrl-1"}
    assert {p for _, p, b in calls if b == {"group_name": "asyncrl-1"}} == {"/destroy_weights_update_group"}


def test_the_hf_server_request_models_are_the_pins():
    """The hf server's weight-group routes take exactly the pin's fields (a trainer talking to both
    cannot send something only one of them reads)."""
    from asyncrl.rollout.engines.hf_server import create_app

    pin = pin_routes()
    models = create_app(object()).state.request_models
    assert sorted(models) == sorted(GROUP_ROUTES)
    for path, model in models.items():
        (pin_model,) = pin[path].body_models
        fields = set(pin_fields(pin_model))
        own = fields - set(pin_fields("BaseReq"))  # (BaseReq: rid and SGLang's internal routing fields)
        assert own and own <= set(model.model_fields) <= fields, path
        assert model.model_config.get("extra") == "forbid", f"hf server {path} must refuse unknown fields"


# ---------------------------------------------------------------- the fake and the hf server


def _app_routes(app: Any, *, only_api: bool = False) -> dict[str, set[str]]:
    """path -> methods a FastAPI app serves (docs/OpenAPI routes too, unless only_api)."""
    from fastapi.routing import APIRoute

    out: dict[str, set[str]] = {}
    for r in app.routes:
        if only_api:
            assert isinstance(r, APIRoute), f"a route that is not an API route: {r!r}"
        out.setdefault(r.path, set()).update(getattr(r, "methods", None) or {"GET"})
    return out


def test_the_fake_serves_only_routes_and_methods_of_the_pin():
    from tests.support.sglang_fake import FakeState, create_app

    fake = _app_routes(create_app(FakeState()), only_api=True)
    pin = pin_routes()
    lacking = sorted(p for p in fake if p not in pin)
    assert not lacking, f"the fake serves routes SGLang {PINNED_VERSION} lacks: {lacking}"
    for path, methods in fake.items():
        assert methods <= pin[path].methods, f"fake {path}: {sorted(methods)} vs the pin's {sorted(pin[path].methods)}"
    # fake == the pin restricted to what we emulate; it covers everything the adapter calls
    assert {(m, p) for m, p, _ in adapter_calls()} <= {(m, p) for p, ms in fake.items() for m in ms}
    assert "/health" in fake and "/ready" not in fake


def test_the_fake_request_models_are_the_pins():
    from tests.support.sglang_fake import SAMPLING_KEYS, FakeState, create_app

    app = create_app(FakeState())
    pin = pin_routes()
    for path, model in app.state.request_models.items():
        (pin_model,) = pin[path].body_models
        fields = pin_fields(pin_model)
        assert set(model.model_fields) <= set(fields), f"fake {path}: {set(model.model_fields) - set(fields)}"
        assert model.model_config.get("extra") == "forbid", f"fake {path} must refuse unknown fields"
    pin_modes = literal_values(pin_fields("PauseGenerationReqInput")["mode"])
    fake_modes = set(app.state.request_models["/pause_generation"].model_fields["mode"].annotation.__args__)
    assert fake_modes == pin_modes
    assert set(SAMPLING_KEYS) - pin_sampling_params() == set()


def test_the_hf_server_serves_what_the_adapter_calls():
    """Our hf server speaks the same surface (but a LoRA job's adapter routes: it swaps the adapter it
    serves on /update_weights_from_disk); its extras beyond the pin are named here."""
    from asyncrl.rollout.engines.hf_server import create_app

    served = _app_routes(create_app(object()))
    for method, path, _ in asyncio.run(_drive_adapter()):
        assert method in served.get(path, set()), f"the hf server does not serve {method} {path}"
    pin = pin_routes()
    extras = sorted(p for p in served if p not in pin and p not in ("/openapi.json", "/docs", "/docs/oauth2-redirect",
                                                                     "/redoc"))
    assert extras == ["/ready", "/stats"], "asyncrl-only routes of the hf server (docs/rollout.md)"
