"""Serve the in-process transformers engine over SGLang's native HTTP surface.

`asyncrl engine --config JOB.yaml --port P` loads the job's model (fp32 on CPU by default) and
answers the same requests as an SGLang 0.5.10.post1 server, so the rollout worker (generate) and
the trainer's weight sync (pause, update, continue) drive it with the `sglang` adapter, exactly as
they would a GPU server:
  POST /generate  /pause_generation {mode}  /continue_generation  /update_weights_from_disk
  POST /init_weights_update_group  /update_weights_from_distributed  /destroy_weights_update_group
       (collective weight sync over gloo, or NCCL on a CUDA engine: rollout/engines/weight_group.py)
  GET|POST /get_weights_by_name {name, truncate_size}: a parameter's first values (checks a sync)
  GET  /model_info (and /get_model_info)  /get_weight_version  /ready  /health  /stats
Errors are HTTP 400 with {"error": {"message"}} (validation errors too, as SGLang does).

Readiness is `GET /model_info`, as for SGLang (the rollout pod's readinessProbe and the adapter's
`ready()`): the port opens only after the model is loaded and the answer does not wait for a pause.
`/ready`, `/stats` and an answering `/get_weight_version` are asyncrl extras the pinned SGLang lacks
(its `/get_weight_version` always answers 404): `/ready` is kept for the local runner's wait.
`/health` answers 503 while paused, as the pin's token-generating `/health` would; with
SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false (the rollout pod's readiness) 200, as the pin's then does.
`--api-key` (or $ASYNCRL_ENGINE_API_KEY) closes every route but /health* with 401 unless the request
carries `Authorization: Bearer KEY`, exactly as the pin's `--api-key` (rollout/engines/auth.py).
`/model_info` also names the server's `incarnation` (a random id per server start, which the pin
lacks): a rollout worker then knows for sure when its engine restarted (rollout/generation/engine_view.py).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.api.loader import load_job
from asyncrl.api.runtime import ENV_ENGINE_API_KEY, HEALTH_GENERATION_ENV, secret_env
from asyncrl.api.weight_labels import WeightLabel, parse_label
from asyncrl.infra.hf_models import load_tokenizer
from asyncrl.rollout.engines.auth import require_api_key
from asyncrl.rollout.engines.base import SamplingParams

# Lazy imports (inside functions): fastapi and uvicorn (no core dependency: the operator image lacks
# them) and torch with what imports it (hf_engine, weight_group), because the CLI imports this module
# to build `asyncrl --help` and the operator's parser (tests/packaging/test_import_layers.py, asyncrl/cli.py).
if TYPE_CHECKING:
    from asyncrl.rollout.engines.weight_group import TensorSpec

DEFAULT_PORT = 30000
PIN_GROUP_NAME = "weight_update_group"
"""The pin's default group name (= asyncrl.rollout.engines.weight_group.GROUP_NAME, a module that imports torch)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="job file (YAML); its model.path and model.tokenizer are served")
    parser.add_argument("--model", help="model path or id (overrides the job's model.path)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=DEFAULT_PORT)
    parser.add_argument("--dtype", default=None,
                        help="float32 | bfloat16 | float16 (default: float32 on CPU, the job's dtype on GPU)")
    parser.add_argument("--device", default="auto", help="cpu | cuda | auto")
    parser.add_argument("--max-batch-size", type=int, default=64, help="requests decoded together")
    parser.add_argument("--weight-version", type=int, default=0, help="label of the initial weights")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = torch default)")
    parser.add_argument("--log-level", default="warning")
    parser.add_argument("--api-key", default=None,
                        help="require `Authorization: Bearer KEY` as SGLang's --api-key does (default: "
                             "$ASYNCRL_ENGINE_API_KEY; unset: open)")


# ---------------------------------------------------------------- request models (the pin's names)


class SGLangSamplingParams(BaseModel):
    """SGLang's `sampling_params` wire schema (this server speaks SGLang's native API)."""

    model_config = ConfigDict(extra="allow")
    max_new_tokens: int = Field(default=128, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    top_k: int = -1
    stop_token_ids: list[int] | None = None

    def to_engine(self) -> SamplingParams:
        """The engine's own sampling parameters (the wire's other fields are accepted, not used)."""
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                    top_p=self.top_p, top_k=self.top_k,
                                    stop_token_ids=tuple(self.stop_token_ids or ()))


class GenerateReqInput(BaseModel):
    """SGLang's GenerateReqInput, the fields we read (token ids, or text when a tokenizer is loaded)."""

    model_config = ConfigDict(extra="allow")
    input_ids: list[int] | None = None
    text: str | None = None
    sampling_params: SGLangSamplingParams = Field(default_factory=SGLangSamplingParams)
    return_logprob: bool = False
    stream: bool = False
    rid: str | None = None


class PauseGenerationReqInput(BaseModel):
    """SGLang's PauseGenerationReqInput (an unknown mode is the engine's 400)."""

    mode: str = "abort"


class UpdateWeightFromDiskReqInput(BaseModel):
    """SGLang's UpdateWeightFromDiskReqInput."""

    model_config = ConfigDict(extra="allow")
    model_path: str
    load_format: str | None = None
    abort_all_requests: bool = False
    weight_version: str | None = None


class InitWeightsUpdateGroupReqInput(BaseModel):
    """SGLang's InitWeightsUpdateGroupReqInput."""

    model_config = ConfigDict(extra="forbid")
    master_address: str
    master_port: int = Field(ge=1, le=65535)
    rank_offset: int = Field(ge=1)
    world_size: int = Field(ge=2)
    group_name: str = PIN_GROUP_NAME
    backend: str = "nccl"


class UpdateWeightsFromDistributedReqInput(BaseModel):
    """SGLang's UpdateWeightsFromDistributedReqInput (load_format: only the default, per-tensor)."""

    model_config = ConfigDict(extra="forbid")
    names: list[str]
    dtypes: list[str]
    shapes: list[list[int]]
    group_name: str = PIN_GROUP_NAME
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None
    load_format: str | None = None


class DestroyWeightsUpdateGroupReqInput(BaseModel):
    """SGLang's DestroyWeightsUpdateGroupReqInput."""

    model_config = ConfigDict(extra="forbid")
    group_name: str = PIN_GROUP_NAME


class GetWeightsByNameReqInput(BaseModel):
    """SGLang's GetWeightsByNameReqInput."""

    model_config = ConfigDict(extra="forbid")
    name: str
    truncate_size: int = Field(default=100, ge=1)


WEIGHT_GROUP_REQUEST_MODELS: dict[str, type[BaseModel]] = {
    "/init_weights_update_group": InitWeightsUpdateGroupReqInput,
    "/update_weights_from_distributed": UpdateWeightsFromDistributedReqInput,
    "/destroy_weights_update_group": DestroyWeightsUpdateGroupReqInput,
}
"""The pin's request models these routes copy (tests/rollout/engines/test_sglang_routes.py compares the fields)."""


# ---------------------------------------------------------------- answers other than 200


class _Refusal(Exception):
    """A route's answer with another status than 200, raised so that the routes need no fastapi
    import; create_app's handler sends `body` with `status`."""

    def __init__(self, body: dict[str, Any], status: int = 400) -> None:
        super().__init__(body)
        self.body = body
        self.status = status


def _error(message: str) -> _Refusal:
    """SGLang's error answer: 400 {"error": {"message"}}."""
    return _Refusal({"error": {"message": message}})


def _failed(message: str) -> _Refusal:
    """A weight-group route's failure: 400 {"success": false, "message"}, as the pin answers."""
    return _Refusal({"success": False, "message": message})


def _disk_failed(message: str) -> _Refusal:
    """/update_weights_from_disk's failure (the pin's answer also counts the paused requests)."""
    return _Refusal({"success": False, "message": message, "num_paused_requests": 0})


def _succeeded(message: str) -> dict[str, Any]:
    return {"success": True, "message": message}


def _weight_version(label: str | None, refuse: Callable[[str], _Refusal]) -> WeightLabel | None:
    """The weights a request's weight_version label names (None: no label), read with parse_label
    as everywhere else; a label that names no version is refused."""
    if label is None:
        return None
    version = parse_label(label)
    if version is None:
        raise refuse(f"weight_version {label!r} is not a version label (N or N@timeline)")
    return version


def _bucket(body: UpdateWeightsFromDistributedReqInput) -> tuple[list[TensorSpec], WeightLabel | None]:
    """A broadcast bucket's tensors and version label, checked before the engine joins the broadcast."""
    from asyncrl.rollout.engines.weight_group import TensorSpec, parse_dtype  # lazy: imports torch (see the imports)

    if not len(body.names) == len(body.dtypes) == len(body.shapes):
        raise _failed("names, dtypes and shapes must have the same length")
    if body.load_format is not None:
        raise _failed(f"load_format {body.load_format!r} is not supported (only the default)")
    version = _weight_version(body.weight_version, _failed)
    try:
        specs = [TensorSpec(n, d, tuple(s)) for n, d, s in zip(body.names, body.dtypes, body.shapes)]
        for spec in specs:
            parse_dtype(spec.dtype)
    except ValueError as exc:
        raise _failed(str(exc)) from exc
    return specs, version


# ---------------------------------------------------------------- the routes


class EngineRoutes:
    """The routes over one engine. create_app serves these bound methods: they reach the engine
    through `self`, so no route needs fastapi's Request or a dependency at import time."""

    def __init__(self, engine: Any, tokenizer: Any = None, *, model_name: str = "") -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.incarnation = uuid.uuid4().hex  # this server's life: a restarted server has another one
        health_generation = os.environ.get(HEALTH_GENERATION_ENV, "").strip().lower()
        self.light_health = health_generation in ("0", "false", "no", "off")

    def add_to(self, app: Any) -> None:
        """Serve every route on the FastAPI `app`."""
        for path, endpoint, methods in (
            ("/generate", self.generate, ["POST"]),
            ("/pause_generation", self.pause_generation, ["POST"]),
            ("/continue_generation", self.continue_generation, ["POST"]),
            ("/update_weights_from_disk", self.update_weights_from_disk, ["POST"]),
            ("/init_weights_update_group", self.init_weights_update_group, ["POST"]),
            ("/update_weights_from_distributed", self.update_weights_from_distributed, ["POST"]),
            ("/destroy_weights_update_group", self.destroy_weights_update_group, ["POST"]),
            ("/get_weights_by_name", self.get_weights_by_name, ["GET", "POST"]),
            ("/model_info", self.info, ["GET"]),
            ("/get_model_info", self.info, ["GET"]),
            ("/get_weight_version", self.get_weight_version, ["GET"]),
            ("/ready", self.ready, ["GET"]),
            ("/health", self.health, ["GET"]),
            ("/stats", self.stats, ["GET"]),
        ):
            app.add_api_route(path, endpoint, methods=methods)

    def _input_ids(self, body: GenerateReqInput) -> list[int]:
        """The request's token ids: its text's when it sends text and this server has a tokenizer."""
        ids = body.input_ids
        if ids is None and body.text is not None and self.tokenizer is not None:
            ids = self.tokenizer(body.text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise _error("input_ids (a non-empty list of token ids) is required")
        return ids

    async def generate(self, body: GenerateReqInput) -> Any:
        if body.stream:
            raise _error("stream=true is not supported by the asyncrl hf engine")
        ids = self._input_ids(body)
        params = body.sampling_params.to_engine()
        try:
            fut = self.engine.submit(ids, params, rid=body.rid)
        except ValueError as exc:
            raise _error(str(exc)) from exc
        result = await asyncio.wrap_future(fut)
        meta = dict(result.meta)
        meta.update({
            "completion_tokens": len(result.output_ids),
            "cached_tokens": 0,
            "weight_version": str(WeightLabel(result.weight_version or 0, result.weight_timeline)),
        })
        if body.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, result.output_ids)]
        text = self.tokenizer.decode(result.output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": result.output_ids, "meta_info": meta}

    async def pause_generation(self, body: PauseGenerationReqInput | None = None) -> Any:
        mode = body.mode if body else "abort"
        try:
            await asyncio.to_thread(self.engine.pause, mode)
        except ValueError as exc:
            raise _error(str(exc)) from exc
        return {"message": "Generation paused successfully.", "status": "ok"}

    async def continue_generation(self) -> Any:
        self.engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    async def update_weights_from_disk(self, body: UpdateWeightFromDiskReqInput) -> Any:
        from asyncrl.rollout.engines.hf_engine import WeightUpdateError  # lazy: imports torch (see the imports)

        version = _weight_version(body.weight_version, _disk_failed)  # (the same reading as the group route's)
        if body.abort_all_requests:
            await asyncio.to_thread(self.engine.pause, "abort")
        start = time.monotonic()
        try:
            await asyncio.to_thread(self.engine.update_weights, body.model_path, version)
        except (WeightUpdateError, OSError) as exc:
            raise _disk_failed(f"Failed to update weights: {exc}") from exc
        finally:
            if body.abort_all_requests:
                self.engine.resume()
        msg = f"Succeeded to update model weights in {time.monotonic() - start:.2f}s."
        if version is not None:
            msg += f" Weight version updated to {version}."
        print(f"asyncrl engine: loaded {body.model_path}: {msg}", flush=True)  # (what it serves, in its log)
        return {"success": True, "message": msg, "num_paused_requests": 0}

    async def init_weights_update_group(self, body: InitWeightsUpdateGroupReqInput) -> Any:
        from asyncrl.rollout.engines.weight_group import BACKENDS  # lazy: imports torch (see the imports)

        if body.backend not in BACKENDS:
            raise _failed(f"backend {body.backend!r} is not one of {', '.join(BACKENDS)}")
        try:
            await asyncio.to_thread(self.engine.join_weight_group, body.master_address, body.master_port,
                                    body.rank_offset, body.world_size, body.group_name, body.backend)
        except Exception as exc:  # a refused rendezvous, a timeout, a bad rank: the caller needs the words
            raise _failed(f"Failed to initialize custom process group: {exc}.") from exc
        return _succeeded("Succeeded to initialize custom process group.")

    async def update_weights_from_distributed(self, body: UpdateWeightsFromDistributedReqInput) -> Any:
        specs, version = _bucket(body)
        if body.abort_all_requests:
            await asyncio.to_thread(self.engine.pause, "abort")
        try:
            await asyncio.to_thread(self.engine.update_weights_from_group, specs, body.group_name, version)
        except Exception as exc:  # the sender vanished, or a tensor the model cannot take
            raise _failed(f"Failed to update parameter online: {exc}.") from exc
        finally:
            if body.abort_all_requests:
                self.engine.resume()
        return _succeeded("Succeeded to update parameter online.")

    async def destroy_weights_update_group(self, body: DestroyWeightsUpdateGroupReqInput) -> Any:
        from asyncrl.rollout.engines.hf_engine import WeightUpdateError  # lazy: imports torch (see the imports)

        try:
            await asyncio.to_thread(self.engine.leave_weight_group, body.group_name)
        except WeightUpdateError as exc:
            raise _failed("The group to be destroyed does not exist.") from exc
        return _succeeded("Succeeded to destroy custom process group.")

    async def get_weights_by_name(self, body: GetWeightsByNameReqInput) -> Any:
        values = self.engine.parameter_head(body.name, body.truncate_size)
        if values is None:
            raise _error(f"Get parameter by name failed: no parameter {body.name!r}")
        return values

    def info(self) -> dict[str, Any]:
        """/model_info (readiness) and /get_model_info: the model, its weight version, this server's life."""
        engine = self.engine
        return {"model_path": engine.model_path, "tokenizer_path": self.model_name or engine.model_path,
                "is_generation": True, "weight_version": str(engine.weight_label),
                "preferred_sampling_params": None, "engine": "asyncrl-hf", "incarnation": self.incarnation}

    async def get_weight_version(self) -> Any:
        return {"weight_version": str(self.engine.weight_label)}

    async def ready(self) -> Any:
        return {"status": "ready"}

    async def health(self) -> Any:
        if self.engine.paused and not self.light_health:
            raise _Refusal({"status": "paused"}, 503)
        return {"status": "ok"}

    async def stats(self) -> Any:
        return self.engine.stats()


def create_app(engine: Any, tokenizer: Any = None, *, model_name: str = "", api_key: str | None = None) -> Any:
    """The FastAPI app over an HFEngine (tests drive it in-process or with uvicorn); with `api_key`,
    every route but /health needs the key, as on SGLang (rollout/engines/auth.py)."""
    from fastapi import FastAPI, Request  # lazy: fastapi is no core dependency (see the imports)
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse

    app = FastAPI(title="asyncrl hf engine (SGLang-native surface)")
    require_api_key(app, api_key)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        """A request that does not fit its model: 400 in SGLang's error shape (not FastAPI's 422)."""
        return JSONResponse({"object": "error", "message": str(exc.errors()), "type": "Bad Request", "code": 400},
                            status_code=400)

    @app.exception_handler(_Refusal)
    async def _refused(request: Request, exc: _Refusal) -> JSONResponse:
        return JSONResponse(exc.body, status_code=exc.status)

    app.state.request_models = dict(WEIGHT_GROUP_REQUEST_MODELS)
    EngineRoutes(engine, tokenizer, model_name=model_name).add_to(app)
    return app


def main(args: argparse.Namespace) -> int:
    """`asyncrl engine`: load the model, then serve it until the server stops."""
    import torch  # lazy, as are uvicorn and the engine (see the imports)
    import uvicorn

    from asyncrl.rollout.engines.hf_engine import HFEngine

    model_path, tokenizer_path, job_dtype, revision = args.model, None, "float32", None
    if args.config:
        job = load_job(args.config)
        model_path = model_path or job.spec.model.path
        tokenizer_path = job.spec.model.tokenizer
        job_dtype = job.spec.model.dtype
        revision = None if args.model else job.spec.model.revision
    if not model_path:
        raise SystemExit("asyncrl engine: give --config JOB.yaml or --model PATH")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float32" if device == "cpu" else job_dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = HFEngine(model_path, dtype=dtype, device=device, max_batch_size=args.max_batch_size,
                      weight_version=args.weight_version, seed=args.seed, revision=revision)
    tokenizer = load_tokenizer(model_path, tokenizer_path, revision)
    api_key = args.api_key or secret_env(ENV_ENGINE_API_KEY)
    app = create_app(engine, tokenizer, model_name=model_path, api_key=api_key)
    print(f"asyncrl engine: serving {model_path} ({dtype} on {device}) at http://{args.host}:{args.port}", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
