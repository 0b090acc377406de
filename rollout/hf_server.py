"""Serve the in-process transformers engine over SGLang's native HTTP surface.

`asyncrl engine --config JOB.yaml --port P` loads the job's model (fp32 on CPU by default) and
answers the same requests as an SGLang 0.5.10.post1 server, so the rollout worker (generate) and
the trainer's weight sync (pause, update, continue) drive it with the `sglang` adapter, exactly as
they would a GPU server:
  POST /generate  /pause_generation {mode}  /continue_generation  /update_weights_from_disk
  POST /init_weights_update_group  /update_weights_from_distributed  /destroy_weights_update_group
       (collective weight sync over gloo, or NCCL on a CUDA engine: asyncrl/weight_group.py)
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
lacks): a rollout worker then knows for sure when its engine restarted (rollout/worker.py).
"""


import argparse
import os
import time
import uuid
from typing import Any

DEFAULT_PORT = 30000


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


def create_app(engine: Any, tokenizer: Any = None, *, model_name: str = "", api_key: str | None = None) -> Any:
    """The FastAPI app over an HFEngine (tests drive it in-process or with uvicorn); with `api_key`,
    every route but /health needs the key, as on SGLang (rollout/engines/auth.py)."""
    import asyncio

    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from pydantic import BaseModel, ConfigDict, Field

    from asyncrl.rollout.engines.auth import require_api_key
    from asyncrl.rollout.engines.base import SamplingParams, parse_version
    from asyncrl.rollout.hf_engine import WeightUpdateError
    from asyncrl.runtime import HEALTH_GENERATION_ENV
    from asyncrl.weight_group import BACKENDS, GROUP_NAME, TensorSpec, parse_dtype

    class SamplingIn(BaseModel):
        """SGLang's `sampling_params` wire schema (this server speaks SGLang's native API)."""

        model_config = ConfigDict(extra="allow")
        max_new_tokens: int = Field(default=128, ge=1)
        temperature: float = Field(default=1.0, ge=0)
        top_p: float = Field(default=1.0, gt=0, le=1)
        top_k: int = -1
        stop_token_ids: list[int] | None = None

    class GenerateIn(BaseModel):
        model_config = ConfigDict(extra="allow")
        input_ids: list[int] | None = None
        text: str | None = None
        sampling_params: SamplingIn = Field(default_factory=SamplingIn)
        return_logprob: bool = False
        stream: bool = False
        rid: str | None = None

    class PauseIn(BaseModel):
        mode: str = "abort"

    class UpdateIn(BaseModel):
        model_config = ConfigDict(extra="allow")
        model_path: str
        load_format: str | None = None
        abort_all_requests: bool = False
        weight_version: str | None = None

    app = FastAPI(title="asyncrl hf engine (SGLang-native surface)")
    require_api_key(app, api_key)

    def error(message: str, status: int = 400) -> JSONResponse:
        return JSONResponse({"error": {"message": message}}, status_code=status)

    @app.exception_handler(RequestValidationError)
    async def _bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse({"object": "error", "message": str(exc.errors()), "type": "Bad Request", "code": 400},
                            status_code=400)

    @app.post("/generate")
    async def generate(body: GenerateIn) -> Any:
        if body.stream:
            return error("stream=true is not supported by the asyncrl hf engine")
        ids = body.input_ids
        if ids is None and body.text is not None and tokenizer is not None:
            ids = tokenizer(body.text, add_special_tokens=False)["input_ids"]
        if not ids:
            return error("input_ids (a non-empty list of token ids) is required")
        sp = body.sampling_params
        params = SamplingParams(max_new_tokens=sp.max_new_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                top_k=sp.top_k, stop_token_ids=tuple(sp.stop_token_ids or ()))
        try:
            fut = engine.submit(ids, params, rid=body.rid)
        except ValueError as exc:
            return error(str(exc))
        result = await asyncio.wrap_future(fut)
        meta = dict(result.meta)
        meta.update({
            "completion_tokens": len(result.output_ids),
            "cached_tokens": 0,
            "weight_version": str(result.weight_version),
        })
        if body.return_logprob:
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(result.logprobs, result.output_ids)]
        text = tokenizer.decode(result.output_ids) if tokenizer is not None else ""
        return {"text": text, "output_ids": result.output_ids, "meta_info": meta}

    @app.post("/pause_generation")
    async def pause_generation(body: PauseIn | None = None) -> Any:
        mode = body.mode if body else "abort"
        try:
            await asyncio.to_thread(engine.pause, mode)
        except ValueError as exc:
            return error(str(exc))
        return {"message": "Generation paused successfully.", "status": "ok"}

    @app.post("/continue_generation")
    async def continue_generation() -> Any:
        engine.resume()
        return {"message": "Generation continued successfully.", "status": "ok"}

    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(body: UpdateIn) -> Any:
        version = None
        if body.weight_version is not None:
            version = parse_version(body.weight_version)  # (the same reading as the group route's)
            if version is None:
                return JSONResponse({"success": False,
                                     "message": f"weight_version {body.weight_version!r} is not an integer",
                                     "num_paused_requests": 0}, status_code=400)
        if body.abort_all_requests:
            await asyncio.to_thread(engine.pause, "abort")
        start = time.monotonic()
        try:
            await asyncio.to_thread(engine.update_weights, body.model_path, version)
        except (WeightUpdateError, OSError) as exc:
            return JSONResponse({"success": False, "message": f"Failed to update weights: {exc}",
                                 "num_paused_requests": 0}, status_code=400)
        finally:
            if body.abort_all_requests:
                engine.resume()
        msg = f"Succeeded to update model weights in {time.monotonic() - start:.2f}s."
        if version is not None:
            msg += f" Weight version updated to {version}."
        return {"success": True, "message": msg, "num_paused_requests": 0}

    class InitGroupIn(BaseModel):
        """SGLang's InitWeightsUpdateGroupReqInput."""

        model_config = ConfigDict(extra="forbid")
        master_address: str
        master_port: int = Field(ge=1, le=65535)
        rank_offset: int = Field(ge=1)
        world_size: int = Field(ge=2)
        group_name: str = GROUP_NAME
        backend: str = "nccl"

    class GroupUpdateIn(BaseModel):
        """SGLang's UpdateWeightsFromDistributedReqInput (load_format: only the default, per-tensor)."""

        model_config = ConfigDict(extra="forbid")
        names: list[str]
        dtypes: list[str]
        shapes: list[list[int]]
        group_name: str = GROUP_NAME
        flush_cache: bool = True
        abort_all_requests: bool = False
        weight_version: str | None = None
        load_format: str | None = None

    class GroupIn(BaseModel):
        model_config = ConfigDict(extra="forbid")
        group_name: str = GROUP_NAME

    class WeightsByNameIn(BaseModel):
        model_config = ConfigDict(extra="forbid")
        name: str
        truncate_size: int = Field(default=100, ge=1)

    app.state.request_models = {"/init_weights_update_group": InitGroupIn,
                                "/update_weights_from_distributed": GroupUpdateIn,
                                "/destroy_weights_update_group": GroupIn}
    """The pin's request models these routes copy (tests/test_sglang_routes.py compares the fields)."""

    def outcome(success: bool, message: str) -> JSONResponse:
        return JSONResponse({"success": success, "message": message}, status_code=200 if success else 400)

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(body: InitGroupIn) -> Any:
        if body.backend not in BACKENDS:
            return outcome(False, f"backend {body.backend!r} is not one of {', '.join(BACKENDS)}")
        try:
            await asyncio.to_thread(engine.join_weight_group, body.master_address, body.master_port,
                                    body.rank_offset, body.world_size, body.group_name, body.backend)
        except Exception as exc:  # a refused rendezvous, a timeout, a bad rank: the caller needs the words
            return outcome(False, f"Failed to initialize custom process group: {exc}.")
        return outcome(True, "Succeeded to initialize custom process group.")

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(body: GroupUpdateIn) -> Any:
        if not len(body.names) == len(body.dtypes) == len(body.shapes):
            return outcome(False, "names, dtypes and shapes must have the same length")
        if body.load_format is not None:
            return outcome(False, f"load_format {body.load_format!r} is not supported (only the default)")
        version = None
        if body.weight_version is not None:
            version = parse_version(body.weight_version)
            if version is None:
                return outcome(False, f"weight_version {body.weight_version!r} is not an integer")
        try:
            specs = [TensorSpec(n, d, tuple(s)) for n, d, s in zip(body.names, body.dtypes, body.shapes)]
            for spec in specs:
                parse_dtype(spec.dtype)
        except ValueError as exc:
            return outcome(False, str(exc))
        if body.abort_all_requests:
            await asyncio.to_thread(engine.pause, "abort")
        try:
            await asyncio.to_thread(engine.update_weights_from_group, specs, body.group_name, version)
        except Exception as exc:  # the sender vanished, or a tensor the model cannot take
            return outcome(False, f"Failed to update parameter online: {exc}.")
        finally:
            if body.abort_all_requests:
                engine.resume()
        return outcome(True, "Succeeded to update parameter online.")

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(body: GroupIn) -> Any:
        try:
            await asyncio.to_thread(engine.leave_weight_group, body.group_name)
        except WeightUpdateError:
            return outcome(False, "The group to be destroyed does not exist.")
        return outcome(True, "Succeeded to destroy custom process group.")

    @app.api_route("/get_weights_by_name", methods=["GET", "POST"])
    async def get_weights_by_name(body: WeightsByNameIn) -> Any:
        values = engine.parameter_head(body.name, body.truncate_size)
        if values is None:
            return error(f"Get parameter by name failed: no parameter {body.name!r}")
        return values

    incarnation = uuid.uuid4().hex  # this server's life: a restarted server has another one

    def info() -> dict[str, Any]:
        return {"model_path": engine.model_path, "tokenizer_path": model_name or engine.model_path,
                "is_generation": True, "weight_version": str(engine.weight_version),
                "preferred_sampling_params": None, "engine": "asyncrl-hf", "incarnation": incarnation}

    app.get("/model_info")(info)
    app.get("/get_model_info")(info)

    @app.get("/get_weight_version")
    async def get_weight_version() -> Any:
        return {"weight_version": str(engine.weight_version)}

    @app.get("/ready")
    async def ready() -> Any:
        return {"status": "ready"}

    light_health = os.environ.get(HEALTH_GENERATION_ENV, "").strip().lower() in ("0", "false", "no", "off")

    @app.get("/health")
    async def health() -> Any:
        if engine.paused and not light_health:
            return JSONResponse({"status": "paused"}, status_code=503)
        return {"status": "ok"}

    @app.get("/stats")
    async def stats() -> Any:
        return engine.stats()

    return app


def main(args: argparse.Namespace) -> int:
    import torch
    import uvicorn

    from asyncrl.models import load_tokenizer
    from asyncrl.rollout.hf_engine import HFEngine

    model_path, tokenizer_path, job_dtype = args.model, None, "float32"
    if args.config:
        from asyncrl.loader import load_job

        job = load_job(args.config)
        model_path = model_path or job.spec.model.path
        tokenizer_path = job.spec.model.tokenizer
        job_dtype = job.spec.model.dtype
    if not model_path:
        raise SystemExit("asyncrl engine: give --config JOB.yaml or --model PATH")
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    dtype = args.dtype or ("float32" if device == "cpu" else job_dtype)
    if args.threads:
        torch.set_num_threads(args.threads)
    engine = HFEngine(model_path, dtype=dtype, device=device, max_batch_size=args.max_batch_size,
                      weight_version=args.weight_version, seed=args.seed)
    tokenizer = load_tokenizer(model_path, tokenizer_path)
    from asyncrl.runtime import ENV_ENGINE_API_KEY

    api_key = args.api_key or os.environ.get(ENV_ENGINE_API_KEY) or None
    app = create_app(engine, tokenizer, model_name=model_path, api_key=api_key)
    print(f"asyncrl engine: serving {model_path} ({dtype} on {device}) at http://{args.host}:{args.port}", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.close()
    return 0
