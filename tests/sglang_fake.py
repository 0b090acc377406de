"""A fake SGLang server for tests: SGLang 0.5.10.post1's native HTTP surface, no model, no GPU.

SGLang needs CUDA kernels, so the adapter is tested against this server, which answers with the
field layout of the pinned release, written from reading these upstream files (not copied):
  - python/sglang/srt/entrypoints/http_server.py: routes `/generate` (non-stream returns one JSON
    object), `/pause_generation`, `/continue_generation` ({"message", "status": "ok"}),
    `/update_weights_from_disk` ({"success", "message", "num_paused_requests"}, HTTP 400 when
    success is false; " Weight version updated to X." appended), `/get_model_info` (model_path,
    tokenizer_path, is_generation, preferred_sampling_params, weight_version), `/get_weight_version`;
    `_create_error_response` -> HTTP 400 {"error": {"message"}}; request validation errors are
    turned into HTTP 400 {"object": "error", "message", "type": "Bad Request", "code": 400}.
  - python/sglang/srt/managers/io_struct.py: GenerateReqInput (input_ids, sampling_params,
    return_logprob, stream), PauseGenerationReqInput.mode in abort|retract|in_place,
    UpdateWeightFromDiskReqInput (model_path, load_format, abort_all_requests, weight_version).
  - python/sglang/srt/managers/tokenizer_manager.py: meta_info = {"id", "finish_reason",
    "prompt_tokens", "weight_version", "completion_tokens", "cached_tokens", "e2e_latency",
    "output_token_logprobs": [[logprob, token_id, null], ...]} (null: no text requested);
    an aborted request answers with its partial output and finish_reason {"type": "abort", ...}.
  - python/sglang/srt/managers/schedule_batch.py: finish reasons {"type": "stop", "matched": id},
    {"type": "length", "length": n}, {"type": "abort", "message": ...}.
Newer releases also serve `/model_info` and `/ready` (0.5.20+); `serve_ready=False` emulates the
pinned release without them so the adapter's fallback is exercised.

Deterministic "model": token i of a response is `(sum(prompt) + 7 * i) % 1000 + 10`, its logprob is
`-0.01 * (i + 1) - version`, so tests can check which weights produced each token. Knobs:
`token_delay` (seconds per token), `fail_next` (answer the next N /generate with HTTP 500),
`eos_after` (emit the stop token after N tokens). GET /fake/state shows progress for polling;
`state.control_calls` records pause / update / continue in the order they arrived.
"""


import asyncio
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from asyncrl.net import free_port

STOP_TOKEN = 2


@dataclass
class FakeState:
    weight_version: str = "default"
    model_path: str = "fake/model"
    paused: str | None = None
    token_delay: float = 0.0
    fail_next: int = 0
    eos_after: int | None = None
    serve_ready: bool = True
    tokens_generated: int = 0
    running: int = 0
    requests: int = 0
    update_calls: list[dict[str, Any]] = field(default_factory=list)
    generate_calls: list[dict[str, Any]] = field(default_factory=list)
    pause_calls: list[str] = field(default_factory=list)
    control_calls: list[str] = field(default_factory=list)
    """Every control call in order: "pause:<mode>", "update:<weight_version>", "continue"."""


def fake_token(prompt: list[int], i: int) -> int:
    return (sum(prompt) + 7 * i) % 1000 + 10


def fake_logprob(i: int, version: str) -> float:
    v = int(version) if version.isdigit() else 0
    return -0.01 * (i + 1) - v


def create_app(state: FakeState) -> Any:
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict

    class GenerateReqInput(BaseModel):
        model_config = ConfigDict(extra="allow")
        input_ids: list[int] | None = None
        text: str | None = None
        sampling_params: dict[str, Any] | None = None
        return_logprob: bool = False
        stream: bool = False

    class PauseReq(BaseModel):
        mode: str = "abort"

    class UpdateWeightFromDiskReqInput(BaseModel):
        model_path: str
        load_format: str | None = None
        abort_all_requests: bool = False
        weight_version: str | None = None

    app = FastAPI()
    resume = asyncio.Event()
    abort_epoch = {"n": 0}

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
        max_new = sp.get("max_new_tokens", 128)
        if not isinstance(max_new, int) or max_new < 0:
            return err(f"max_new_tokens must be at least 0, got {max_new}.")
        temperature = sp.get("temperature", 1.0)
        if not isinstance(temperature, (int, float)) or temperature < 0:
            return err(f"temperature must be non-negative, got {temperature}.")
        if any((not isinstance(t, int)) or t < 0 or t >= 50000 for t in prompt):
            return err("The input_ids contain an out-of-vocabulary token id.")
        stop_ids = set(sp.get("stop_token_ids") or []) | {STOP_TOKEN}
        state.generate_calls.append({"input_ids": list(prompt), "max_new_tokens": max_new})
        rid = uuid.uuid4().hex
        start = time.monotonic()
        my_epoch = abort_epoch["n"]
        while state.paused is not None:  # queued while paused (retract/in_place) until continue
            await resume.wait()
        out_ids: list[int] = []
        lps: list[float] = []
        finish: dict[str, Any] | None = None
        version = state.weight_version
        state.running += 1
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
                lps.append(fake_logprob(i, version))
                state.tokens_generated += 1
                if tok in stop_ids:
                    finish = {"type": "stop", "matched": tok}
                    break
            if finish is None:
                finish = {"type": "length", "length": len(out_ids)}
        finally:
            state.running -= 1
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
    async def pause_generation(obj: PauseReq | None = None) -> Any:
        mode = obj.mode if obj else "abort"
        if mode not in ("abort", "retract", "in_place"):
            return err(f"Invalid mode: {mode!r}. Expected one of ['abort', 'retract', 'in_place'].")
        state.pause_calls.append(mode)
        state.control_calls.append(f"pause:{mode}")
        state.paused = mode
        resume.clear()
        if mode == "abort":
            abort_epoch["n"] += 1
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> Any:
        state.control_calls.append("continue")
        state.paused = None
        resume.set()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(obj: UpdateWeightFromDiskReqInput) -> Any:
        state.update_calls.append(obj.model_dump())
        state.control_calls.append(f"update:{obj.weight_version}")
        if obj.model_path.startswith("/nonexistent"):
            return JSONResponse({"success": False, "num_paused_requests": 0,
                                 "message": f"Failed to get weights iterator: {obj.model_path} not found."},
                                status_code=400)
        if obj.abort_all_requests:
            abort_epoch["n"] += 1
        state.model_path = obj.model_path
        message = "Succeeded to update model weights."
        if obj.weight_version is not None:
            state.weight_version = obj.weight_version
            message += f" Weight version updated to {obj.weight_version}."
        return {"success": True, "message": message, "num_paused_requests": 0}

    def model_info() -> dict[str, Any]:
        return {"model_path": state.model_path, "tokenizer_path": state.model_path, "is_generation": True,
                "preferred_sampling_params": None, "weight_version": state.weight_version}

    app.get("/get_model_info")(model_info)

    @app.get("/model_info")
    async def model_info_new() -> Any:
        if not state.serve_ready:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return model_info()

    @app.get("/get_weight_version")
    async def get_weight_version() -> Any:
        return {"weight_version": state.weight_version}

    @app.get("/ready")
    async def ready() -> Any:
        if not state.serve_ready:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        return {"status": "ready"}

    @app.get("/health")
    async def health() -> Any:
        if state.paused is not None:
            return JSONResponse({}, status_code=503)
        return {}

    @app.get("/fake/state")
    async def fake_state() -> Any:
        return {"tokens_generated": state.tokens_generated, "running": state.running, "paused": state.paused,
                "requests": state.requests, "weight_version": state.weight_version}

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
        self.state = FakeState(**knobs)
        super().__init__(create_app(self.state))
