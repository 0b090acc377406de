"""A fake SGLang server for tests: SGLang 0.5.10.post1's native HTTP surface, no model, no GPU.

SGLang needs CUDA kernels, so the adapter is tested against this server, which answers with the
field layout of the pinned release, written from reading these upstream files (not copied):
  - python/sglang/srt/entrypoints/http_server.py: routes `POST /generate` (non-stream returns one
    JSON object), `POST /pause_generation`, `POST /continue_generation` ({"message", "status": "ok"};
    both take a required JSON body), `POST /update_weights_from_disk` ({"success", "message",
    "num_paused_requests"}, HTTP 400 when success is false; " Weight version updated to X."
    appended), `GET /model_info` and its deprecated alias `GET /get_model_info` (model_path,
    tokenizer_path, is_generation, preferred_sampling_params, weight_version, ...),
    `GET /get_weight_version` and `GET /weight_version` (always 404: "use /model_info"),
    `GET /health` (generates one token: 503 while the server cannot generate, e.g. paused);
    `_create_error_response` -> HTTP 400 {"error": {"message"}}; request validation errors are
    turned into HTTP 400 {"object": "error", "message", "type": "Bad Request", "code": 400}.
  - python/sglang/srt/managers/io_struct.py: GenerateReqInput (input_ids, sampling_params,
    return_logprob, stream), PauseGenerationReqInput.mode in abort|retract|in_place,
    ContinueGenerationReqInput (no fields), UpdateWeightFromDiskReqInput (model_path, load_format,
    abort_all_requests, weight_version, ...).
  - python/sglang/srt/managers/tokenizer_manager.py: meta_info = {"id", "finish_reason",
    "prompt_tokens", "weight_version", "completion_tokens", "cached_tokens", "e2e_latency",
    "output_token_logprobs": [[logprob, token_id, null], ...]} (null: no text requested);
    an aborted request answers with its partial output and finish_reason {"type": "abort", ...}.
  - python/sglang/srt/managers/schedule_batch.py: finish reasons {"type": "stop", "matched": id},
    {"type": "length", "length": n}, {"type": "abort", "message": ...}.
  - the server's state, as TokenizerManager (0.5.x) keeps it: `server_args.weight_version` starts
    as "default" (ServerArgs' default) in every new process, so `restart()` brings the label back to
    "default" and the launch model; `pause_generation` runs under `is_pause_cond`, so pauses,
    continues and the weight-update check of the pause serialise (an abort-mode pause returns only
    once no request is running; the pin polls every 1 s, the fake every PAUSE_POLL_S);
    `update_weights_from_disk` takes the model-update writer lock only when not paused (it waits
    for running requests), and while paused takes no lock: the update's reply then goes to a
    single `model_update_result` future that the latest update overwrites, so of two updates
    that overlap during a pause, the earlier caller never gets an answer (it hangs until its
    client gives up) and the later one reads whichever reply arrives first. `update_delay`
    (seconds a load takes) makes updates long enough to overlap.

At least as strict as the pin (tests/rollout/engines/test_sglang_routes.py checks this against the pinned source):
every route is one the pin has, with only methods the pin allows (any other path is 404, another
method 405; no `/ready`, no docs or OpenAPI routes), and request bodies accept only fields the
pin's request models declare (an unknown field, or a sampling parameter the pin's SamplingParams
lacks, is a 400 here where the pin would silently ignore or crash on it).

Deterministic "model": token i of a response is `(sum(prompt) + 7 * i) % 1000 + 10`, its logprob is
`-0.01 * (i + 1) - version`, so tests can check which weights produced each token. Knobs:
`token_delay` (seconds per token), `fail_next` (answer the next N /generate with HTTP 500),
`eos_after` (emit the stop token after N tokens), `health_timeout` (how long /health waits for a
token before its 503; the pin waits SGLANG_HEALTH_CHECK_TIMEOUT = 20 s), `update_delay`, `api_key`
(the pin's `--api-key`: every route but /health* needs `Authorization: Bearer KEY`, else 401).
`stop()` takes the server down gracefully, `kill()` abruptly (requests in flight get no answer), and
`restart()` brings up a new process's state on the same port (label "default", not paused; the
knobs are kept). Tests poll `fake.state`
directly (the server runs in a thread of the test process); `state.control_calls` records pause /
update / continue in the order they arrived.

LoRA (`lora=LoraLaunch(...)`, the pin's --enable-lora flags): /load_lora_adapter,
/unload_lora_adapter, /v1/models and `lora_path` on /generate, as tests/support/sglang_fake_lora.py
describes; `state.adapters` holds what is loaded and the adapter calls in order.

Collective weight sync (the pin's ModelRunner with tp 1): `/init_weights_update_group` really joins
the trainer's group (rollout/engines/weight_group.py, the pin's construction) over gloo, and refuses nccl as
the pin would without a GPU; `/update_weights_from_distributed` really receives one broadcast per
name and keeps the tensors in `state.received`; the label moves only when the request succeeds.
"""


import asyncio
import math
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from asyncrl.infra.net import free_port
from asyncrl.rollout.engines.auth import require_api_key
from tests.support.sglang_fake_lora import LoraLaunch, LoraServing, LoraState, add_routes

STOP_TOKEN = 2
SAMPLING_KEYS = frozenset({"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids"})
"""The sampling parameters the fake accepts (the adapter's): a subset of the pin's SamplingParams.__init__."""
PAUSE_POLL_S = 0.01
"""How often an abort-mode pause checks that no request runs any more (the pin: 1 s)."""
WEIGHT_VERSION_DEPRECATED = ("Endpoint '/get_weight_version' or '/weight_version' is deprecated. "
                             "Please use '/model_info' instead.")


@dataclass
class FakeState:
    weight_version: str = "default"
    model_path: str = "fake/model"
    paused: str | None = None
    token_delay: float = 0.0
    fail_next: int = 0
    eos_after: int | None = None
    health_timeout: float = 0.5
    update_delay: float = 0.0
    updates_unanswered: int = 0
    """Updates whose caller never got an answer (overlapping updates during a pause, as in the pin)."""
    tokens_generated: int = 0
    running: int = 0
    in_flight: dict[str, int] = field(default_factory=dict)
    """Running requests: id -> tokens generated so far (a test waits for one that is part-way)."""
    requests: int = 0
    update_calls: list[dict[str, Any]] = field(default_factory=list)
    generate_calls: list[dict[str, Any]] = field(default_factory=list)
    pause_calls: list[str] = field(default_factory=list)
    control_calls: list[str] = field(default_factory=list)
    """Every control call in order: "pause:<mode>", "update:<weight_version>", "continue"."""
    api_key: str | None = None
    """The pin's `--api-key`: every route but /health* then needs the bearer token (401 otherwise)."""
    groups: dict[str, Any] = field(default_factory=dict)
    """Weight groups joined (name -> torch process group): the pin's `_model_update_group`."""
    received: dict[str, Any] = field(default_factory=dict)
    """The last tensor received for each name over a weight group (the fake's "model")."""
    lora: LoraLaunch | None = None
    """The pin's --enable-lora --max-lora-rank --lora-target-modules (None: not enabled); a knob, so a
    restarted server keeps it (tests/support/sglang_fake_lora.py)."""
    adapters: LoraState = field(default_factory=LoraState)
    """The adapters loaded, remembered and in use, and the adapter calls in order."""


def fake_token(prompt: list[int], i: int) -> int:
    return (sum(prompt) + 7 * i) % 1000 + 10


def fake_logprob(i: int, version: str) -> float:
    v = int(version) if version.isdigit() else 0
    return -0.01 * (i + 1) - v


def fake_version(logprob: float) -> int:
    """The version whose weights gave a token `logprob` (fake_logprob's inverse, for i < 100)."""
    return math.floor(-logprob)


def create_app(state: FakeState) -> Any:
    from typing import Literal

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict

    # Field names and defaults follow the pin's io_struct dataclasses (a subset of their fields);
    # extra="forbid" rejects a misspelled field that the pin would silently drop.
    class BaseReq(BaseModel):
        model_config = ConfigDict(extra="forbid")
        rid: str | None = None

    class GenerateReqInput(BaseReq):
        input_ids: list[int] | None = None
        text: str | None = None
        sampling_params: dict[str, Any] | None = None
        return_logprob: bool | None = None
        stream: bool = False
        lora_path: str | None = None

    class PauseGenerationReqInput(BaseReq):
        mode: Literal["abort", "retract", "in_place"] = "abort"

    class ContinueGenerationReqInput(BaseReq):
        pass

    class UpdateWeightFromDiskReqInput(BaseReq):
        model_path: str
        load_format: str | None = None
        abort_all_requests: bool = False
        weight_version: str | None = None
        flush_cache: bool = True

    class InitWeightsUpdateGroupReqInput(BaseReq):
        master_address: str
        master_port: int
        rank_offset: int
        world_size: int
        group_name: str = "weight_update_group"
        backend: str = "nccl"

    class UpdateWeightsFromDistributedReqInput(BaseReq):
        names: list[str]
        dtypes: list[str]
        shapes: list[list[int]]
        group_name: str = "weight_update_group"
        flush_cache: bool = True
        abort_all_requests: bool = False
        weight_version: str | None = None
        load_format: str | None = None

    class DestroyWeightsUpdateGroupReqInput(BaseReq):
        group_name: str = "weight_update_group"

    # No docs or OpenAPI routes: every route here is one the pin has (tests/rollout/engines/test_sglang_routes.py).
    app = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)
    require_api_key(app, state.api_key)  # the pin's decide_request_auth with only api_key set
    app.state.request_models = {"/generate": GenerateReqInput, "/pause_generation": PauseGenerationReqInput,
                                "/continue_generation": ContinueGenerationReqInput,
                                "/update_weights_from_disk": UpdateWeightFromDiskReqInput,
                                "/init_weights_update_group": InitWeightsUpdateGroupReqInput,
                                "/update_weights_from_distributed": UpdateWeightsFromDistributedReqInput,
                                "/destroy_weights_update_group": DestroyWeightsUpdateGroupReqInput}
    state.adapters.launch = state.lora
    lora = LoraServing(state.adapters)
    add_routes(app, lora, lambda: state.model_path, BaseReq)
    resume = asyncio.Event()
    abort_epoch = {"n": 0}
    pause_cond = asyncio.Lock()  # the pin's is_pause_cond
    update_lock = asyncio.Lock()  # the pin's model_update_lock.writer_lock (requests are its readers)
    update_result: dict[str, asyncio.Future | None] = {"future": None}  # the pin's model_update_result

    def err(message: str) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=400)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"object": "error", "message": str(exc), "type": "Bad Request", "param": None,
                             "code": 400}, status_code=400)

    @app.post("/generate")
    async def generate(obj: GenerateReqInput) -> Any:
        state.requests += 1
        if state.fail_next > 0:
            state.fail_next -= 1
            return JSONResponse({"error": {"message": "injected failure"}}, status_code=500)
        if obj.input_ids is None and obj.text is None:
            return err("Either text or input_ids should be provided.")
        if obj.stream:
            return err("the fake server does not stream")
        prompt = obj.input_ids or [ord(c) for c in (obj.text or "")]
        sp = obj.sampling_params or {}
        unknown = sorted(set(sp) - SAMPLING_KEYS)
        if unknown:
            return err(f"unknown sampling parameters {unknown} (not in the pinned SamplingParams)")
        max_new = sp.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or max_new < 0:
            return err(f"max_new_tokens must be at least 0, got {max_new}.")
        temperature = sp.get("temperature", 1.0)
        if not isinstance(temperature, (int, float)) or temperature < 0:
            return err(f"temperature must be non-negative, got {temperature}.")
        if any((not isinstance(t, int)) or t < 0 or t >= 50000 for t in prompt):
            return err("The input_ids contain an out-of-vocabulary token id.")
        stop_ids = set(sp.get("stop_token_ids") or []) | {STOP_TOKEN}
        state.generate_calls.append({"input_ids": list(prompt), "max_new_tokens": max_new,
                                     **({"lora_path": obj.lora_path} if obj.lora_path else {})})
        rid = uuid.uuid4().hex
        start = time.monotonic()
        my_epoch = abort_epoch["n"]
        while state.paused is not None:  # queued while paused (retract/in_place) until continue
            await resume.wait()
        adapter_version = None
        if obj.lora_path:  # (the pin resolves the adapter after the pause)
            error, adapter_version = lora.acquire(obj.lora_path)
            if error is not None:
                return err(error)
        out_ids: list[int] = []
        lps: list[float] = []
        finish: dict[str, Any] | None = None
        version = state.weight_version
        state.running += 1
        state.in_flight[rid] = 0
        try:
            for i in range(max_new):
                if abort_epoch["n"] != my_epoch:
                    finish = {"type": "abort", "message": "Abort by pause_generation."}
                    break
                while state.paused is not None and state.paused != "abort":
                    await resume.wait()  # retract: continue in place after /continue_generation
                    version = state.weight_version
                if state.token_delay:
                    await asyncio.sleep(state.token_delay)
                else:
                    await asyncio.sleep(0)
                if abort_epoch["n"] != my_epoch:
                    finish = {"type": "abort", "message": "Abort by pause_generation."}
                    break
                tok = STOP_TOKEN if state.eos_after is not None and i == state.eos_after else fake_token(prompt, i)
                out_ids.append(tok)
                lps.append(fake_logprob(i, adapter_version or version))
                state.tokens_generated += 1
                state.in_flight[rid] = len(out_ids)
                if tok in stop_ids:
                    finish = {"type": "stop", "matched": tok}
                    break
            if finish is None:
                finish = {"type": "length", "length": len(out_ids)}
        finally:
            state.running -= 1
            del state.in_flight[rid]
            if obj.lora_path:
                lora.release(obj.lora_path)
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "weight_version": version,
            "completion_tokens": len(out_ids),
            "cached_tokens": 0,
            "e2e_latency": time.monotonic() - start,
        }
        if obj.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out_ids)]
        return {"text": " ".join(map(str, out_ids)), "output_ids": out_ids, "meta_info": meta}

    @app.post("/pause_generation")
    async def pause_generation(obj: PauseGenerationReqInput) -> Any:
        mode = obj.mode
        async with pause_cond:
            state.pause_calls.append(mode)
            state.control_calls.append(f"pause:{mode}")
            state.paused = mode
            resume.clear()
            if mode == "abort":
                abort_epoch["n"] += 1
                while state.running:  # (the pin: until the update lock has no reader left)
                    await asyncio.sleep(PAUSE_POLL_S)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation(obj: ContinueGenerationReqInput) -> Any:
        async with pause_cond:
            state.control_calls.append("continue")
            state.paused = None
            resume.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def load(obj: UpdateWeightFromDiskReqInput) -> dict[str, Any]:
        """The scheduler's side: load the directory, answer the newest waiting future."""
        if state.update_delay:
            await asyncio.sleep(state.update_delay)
        if obj.model_path.startswith("/nonexistent"):
            return {"success": False, "num_paused_requests": 0,
                    "message": f"Failed to get weights iterator: {obj.model_path} not found."}
        state.model_path = obj.model_path
        return {"success": True, "message": "Succeeded to update model weights.", "num_paused_requests": 0,
                "weight_version": obj.weight_version}

    async def wait_for_update(obj: UpdateWeightFromDiskReqInput) -> dict[str, Any]:
        """The pin's _wait_for_model_update_from_disk: one future slot, the newest caller's."""
        loop = asyncio.get_running_loop()
        mine: asyncio.Future = loop.create_future()
        previous, update_result["future"] = update_result["future"], mine
        if previous is not None and not previous.done():
            state.updates_unanswered += 1  # its reply will land in `mine`; it waits forever

        async def scheduler() -> None:
            reply = await load(obj)
            target = update_result["future"]
            if target is not None and not target.done():
                target.set_result(reply)

        task = asyncio.ensure_future(scheduler())
        try:
            return await mine
        finally:
            if update_result["future"] is mine:
                update_result["future"] = None
            del task

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput) -> Any:
        state.update_calls.append(obj.model_dump())
        state.control_calls.append(f"update:{obj.weight_version}")
        if obj.abort_all_requests:
            abort_epoch["n"] += 1
        async with pause_cond:
            paused = state.paused is not None
        if paused:  # no lock: overlapping updates race for the one result future
            reply = await wait_for_update(obj)
        else:  # the writer lock: after running requests, one update at a time
            async with update_lock:
                while state.running:
                    await asyncio.sleep(PAUSE_POLL_S)
                reply = await wait_for_update(obj)
        if not reply["success"]:
            return JSONResponse({k: v for k, v in reply.items() if k != "weight_version"}, status_code=400)
        message = reply["message"]
        if obj.weight_version is not None:  # (the pin labels with its own request's version)
            state.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return {"success": True, "message": message, "num_paused_requests": 0}

    def outcome(success: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(obj: InitWeightsUpdateGroupReqInput) -> Any:
        """The pin's ModelRunner.init_weights_update_group (tp 1): join as rank_offset, blocking."""
        from asyncrl.rollout.engines.weight_group import open_group

        state.control_calls.append(f"init_group:{obj.group_name}")
        if obj.backend == "nccl":  # the pin then needs CUDA, which the fake has not
            return outcome(False, "Failed to initialize custom process group: NCCL needs a GPU.")
        try:
            state.groups[obj.group_name] = await asyncio.to_thread(
                open_group, obj.master_address, obj.master_port, obj.rank_offset, obj.world_size,
                group_name=obj.group_name, backend=obj.backend, timeout_s=30.0)
        except Exception as exc:
            return outcome(False, f"Failed to initialize custom process group: {exc}.")
        return outcome(True, "Succeeded to initialize custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(obj: UpdateWeightsFromDistributedReqInput) -> Any:
        """Receive one tensor per name from rank 0, in order; the label moves only on success."""
        from asyncrl.rollout.engines.weight_group import TensorSpec, receive

        state.control_calls.append(f"group_update:{obj.weight_version}")
        if obj.group_name not in state.groups:  # (the pin asserts; the scheduler's error reaches the caller)
            return outcome(False, f"Group {obj.group_name} not in {list(state.groups)}. "
                                  "Please call `init_weights_update_group` first.")
        specs = [TensorSpec(n, d, tuple(sh)) for n, d, sh in zip(obj.names, obj.dtypes, obj.shapes)]
        try:
            tensors = await asyncio.to_thread(receive, state.groups[obj.group_name], specs, "cpu")
        except Exception as exc:
            return outcome(False, f"Failed to update parameter online: {exc}. The full weights of the "
                                  "ModelRunner are partially updated. Please discard the whole weights.")
        state.received.update({spec.name: t for spec, t in zip(specs, tensors)})
        message = "Succeeded to update parameter online."
        if obj.weight_version is not None:
            state.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return outcome(True, message)

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(obj: DestroyWeightsUpdateGroupReqInput) -> Any:
        from asyncrl.rollout.engines.weight_group import close_group

        state.control_calls.append(f"destroy_group:{obj.group_name}")
        group = state.groups.pop(obj.group_name, None)
        if group is None:
            return outcome(False, "The group to be destroyed does not exist.")
        close_group(group)
        return outcome(True, "Succeeded to destroy custom process group.")

    async def model_info() -> dict[str, Any]:
        """Reads server state only: answers while paused (the pin's readiness route for us)."""
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": state.weight_version,
                "has_image_understanding": False, "has_audio_understanding": False, "model_type": "fake",
                "architectures": ["FakeForCausalLM"]}

    app.get("/model_info")(model_info)
    app.get("/get_model_info")(model_info)  # deprecated alias in the pin (it logs a warning there)

    async def weight_version() -> Any:
        return JSONResponse({"object": "error", "message": WEIGHT_VERSION_DEPRECATED, "type": "404", "param": None,
                             "code": 404}, status_code=404)

    app.get("/get_weight_version")(weight_version)
    app.get("/weight_version")(weight_version)

    @app.get("/health")
    async def health() -> Any:
        """The pin generates one token: it waits behind a pause, then answers 503."""
        deadline = time.monotonic() + state.health_timeout
        while state.paused is not None:
            if time.monotonic() >= deadline:
                return JSONResponse({}, status_code=503)
            await asyncio.sleep(0.01)
        return JSONResponse({}, status_code=200)

    return app


class ServerThread:
    """Run a FastAPI app with uvicorn in a daemon thread (for tests); `.url`, `.stop()`."""

    def __init__(self, app: Any, port: int | None = None):
        import uvicorn

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout: float = 20.0) -> "ServerThread":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError(f"server on {self.url} did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


class FakeSGLang(ServerThread):
    def __init__(self, **knobs: Any):
        self.knobs = knobs
        self.state = FakeState(**knobs)
        self.restarts = 0
        super().__init__(create_app(self.state))

    def kill(self) -> None:
        """Go down like a killed process: requests in flight get no answer (connection closed)."""
        self.server.force_exit = True
        self.stop()

    def restart(self) -> "FakeSGLang":
        """A new server process on the same port (killed first if it runs): fresh state, so the
        label is "default" again and the launch model is served; knobs such as token_delay stay."""
        if self.thread.is_alive():
            self.kill()
        knobs = {k: getattr(self.state, k) for k in ("token_delay", "eos_after", "health_timeout", "update_delay")}
        self.state = FakeState(**{**self.knobs, **knobs})
        self.restarts += 1
        ServerThread.__init__(self, create_app(self.state), port=self.port)
        self.start()
        return self
