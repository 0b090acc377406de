"""Adapter for SGLang's native HTTP API, pinned to SGLang 0.5.10.post1 (`PINNED_VERSION`).

Why that version: it is the one AReaL (the async-RL reference) pins and our default rollout image
(`lmsysorg/sglang:v0.5.10.post1-cu126`); it has `/pause_generation` with a `mode` (abort|retract),
`weight_version` on `/update_weights_from_disk` and in every `/generate` meta_info, and the disk
update path we use.

Routes used, all present in the pin's `sglang/srt/entrypoints/http_server.py` with these methods
(tests/rollout/engines/test_sglang_routes.py checks them, and the request fields, against the pinned source):
  POST /generate  /pause_generation {mode}  /continue_generation {}
  POST /update_weights_from_disk {model_path, weight_version, abort_all_requests}
  POST /init_weights_update_group {master_address, master_port, rank_offset, world_size, group_name, backend}
       /update_weights_from_distributed {names, dtypes, shapes, group_name, flush_cache,
       abort_all_requests, weight_version}  /destroy_weights_update_group {group_name}
       (collective weight sync: the trainer broadcasts one tensor per name, in order; trainer/weights/broadcast.py)
  LoRA jobs (`adapters=True`): POST /load_lora_adapter {lora_name, lora_path, pinned}
       /unload_lora_adapter {lora_name} (answers {success, error_message, loaded_adapters}, HTTP 400 on
       failure), GET /v1/models (the base model's card, then one per adapter: id = its name, root = its
       path, parent = the base), and `lora_path` on /generate naming the adapter a request uses. The
       server needs --enable-lora --max-lora-rank --lora-target-modules (asyncrl.api.spec.lora.sglang_lora_args).
  GET  /model_info (falls back to the deprecated /get_model_info on 404): readiness, model path and
       weight version. The pin has no `/ready`; its `/health` generates a token, so it blocks while
       generation is paused and answers 503 after SGLANG_HEALTH_CHECK_TIMEOUT (20 s); its
       `/get_weight_version` and `/weight_version` always answer 404 ("use /model_info").

Wire layout (see tests/support/sglang_fake.py for the upstream files it follows):
  POST /generate -> {"text", "output_ids", "meta_info": {"id", "finish_reason": {"type": ...},
       "prompt_tokens", "completion_tokens", "weight_version": str,
       "output_token_logprobs": [[logprob, token_id, null], ...]}}
  errors -> HTTP 400 {"error": {"message"}} (or {"object": "error", "message", ...} for validation)

Adapters (LoRA jobs, asyncrl.rollout.engines.named_adapters): each version is an adapter loaded under
its weight label; a request names it in `lora_path`. A name the server does not hold is refused with
HTTP 400 (a "LoRA adapter" message), or reloaded by the pin from the path it was loaded from.

Our in-process `hf` engine server (asyncrl.rollout.engines.hf_server) speaks the same surface.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import httpx

from asyncrl.api.weight_labels import WeightLabel, parse_label
from asyncrl.rollout.engines.base import (
    EngineError,
    GenerateResult,
    PauseMode,
    SamplingParams,
)
from asyncrl.rollout.engines.named_adapters import NamedAdapterEngine

if TYPE_CHECKING:
    from asyncrl.rollout.engines.weight_group import TensorSpec

PINNED_VERSION = "0.5.10.post1"
"""The SGLang release we speak to; scripts/fetch-sglang-source.sh reads it, tests check images use it."""
MODEL_INFO_PATH = "/model_info"
"""Readiness and model info; the rollout pod's readinessProbe uses the same path."""
LEGACY_MODEL_INFO_PATH = "/get_model_info"


class SGLangEngine(NamedAdapterEngine):
    """SGLang (or our hf server) behind the common Engine interface; `adapters`: a LoRA job's versions
    are adapters the server holds by name."""

    def request_body(self, input_ids: list[int], params: SamplingParams) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_new_tokens": int(params.max_new_tokens),
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "top_k": int(params.top_k),
        }
        if params.stop_token_ids:
            sampling["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
        return {
            "input_ids": [int(t) for t in input_ids],
            "sampling_params": sampling,
            "return_logprob": True,
            "stream": False,
        }

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
        body = self.request_body(input_ids, params)
        adapter = await self.current_adapter() if self.adapters else None
        if adapter is None:
            return self.parse_generate(await self._json("POST", "/generate", json=body))
        try:
            answer = await self._json("POST", "/generate", json={**body, "lora_path": adapter})
        except EngineError as exc:
            if exc.status == 400 and "LoRA adapter" in str(exc):
                raise self.refused(exc) from None
            raise
        return self.answered_by(self.parse_generate(answer), adapter)

    def parse_generate(self, body: Any) -> GenerateResult:
        if isinstance(body, list):  # a batch answer; we always send one prompt
            body = body[0]
        try:
            meta = body["meta_info"]
            pairs = meta.get("output_token_logprobs") or []
            logprobs = [float(p[0]) for p in pairs]
            ids = [int(p[1]) for p in pairs]
            reason = meta.get("finish_reason")
        except (KeyError, TypeError, IndexError, ValueError) as exc:
            raise EngineError(f"/generate answered an unexpected layout: {str(body)[:300]}", url=self.url) from exc
        if not ids and body.get("output_ids"):
            raise EngineError("/generate returned tokens without logprobs (return_logprob ignored?)", url=self.url)
        kind = reason.get("type") if isinstance(reason, dict) else reason
        if kind not in ("stop", "length", "abort"):
            raise EngineError(f"/generate returned unknown finish_reason {reason!r}", url=self.url)
        label = parse_label(meta.get("weight_version"))
        return GenerateResult(
            output_ids=ids,
            logprobs=logprobs,
            finish_reason=kind,
            weight_version=None if label is None else label.version,
            weight_timeline=0 if label is None else label.timeline,
            meta={"finish_reason": reason, "id": meta.get("id"), "weight_label": meta.get("weight_version")},
        )

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._request("POST", "/pause_generation", json={"mode": mode})

    async def update_weights(self, path: str, version: WeightLabel | int) -> None:
        if self.adapters:
            await self.load_version(path, version)
            return
        await self._succeed("/update_weights_from_disk", {"model_path": str(path),
                                                          "weight_version": str(WeightLabel.of(version)),
                                                          "abort_all_requests": False})

    async def _load_named(self, name: str, path: str) -> None:
        await self._succeed("/load_lora_adapter", {"lora_name": name, "lora_path": path, "pinned": False})

    async def _unload_named(self, name: str) -> None:
        await self._succeed("/unload_lora_adapter", {"lora_name": name})

    async def _json_lenient(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST and return the JSON body even on HTTP 400 (SGLang reports {success: false} that way)."""
        try:
            resp = await self._client.post(self.url + path, json=payload, headers=self._headers)
        except httpx.HTTPError as exc:
            raise EngineError(f"POST {path} failed: {type(exc).__name__}: {exc}", url=self.url) from exc
        try:
            body = resp.json()
        except ValueError:
            raise EngineError(f"POST {path} returned HTTP {resp.status_code}: {resp.text[:300]}", url=self.url,
                              status=resp.status_code) from None
        if resp.status_code >= 400 and "success" not in body:
            raise EngineError(f"POST {path} returned HTTP {resp.status_code}: {body}", url=self.url,
                              status=resp.status_code, retryable=resp.status_code >= 500)
        return body

    async def init_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                group_name: str, backend: str) -> None:
        await self._succeed("/init_weights_update_group", {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "group_name": group_name, "backend": backend})

    async def update_weights_from_group(self, specs: Sequence[TensorSpec], group_name: str,
                                        version: WeightLabel | int | None) -> None:
        payload: dict[str, Any] = {"names": [s.name for s in specs], "dtypes": [s.dtype for s in specs],
                                   "shapes": [list(s.shape) for s in specs], "group_name": group_name,
                                   "flush_cache": version is not None, "abort_all_requests": False}
        if version is not None:
            payload["weight_version"] = str(WeightLabel.of(version))
        await self._succeed("/update_weights_from_distributed", payload)

    async def destroy_weight_group(self, group_name: str) -> None:
        await self._succeed("/destroy_weights_update_group", {"group_name": group_name})

    async def _succeed(self, path: str, payload: dict[str, Any]) -> None:
        body = await self._json_lenient(path, payload)
        if not body.get("success", False):  # (the adapter routes say why in error_message)
            why = body.get("message") or body.get("error_message")
            raise EngineError(f"{path.lstrip('/')} failed: {why}", url=self.url, retryable=False)

    async def resume(self) -> None:
        await self._request("POST", "/continue_generation", json={})

    async def ready(self) -> bool:
        """GET /model_info: served once the model is loaded, and answered while paused (no token).

        Not /health: in the pin it generates one token, which waits behind a pause."""
        try:
            await self._model_info_response()
        except EngineError:
            return False
        return True

    async def model_info(self) -> dict[str, Any]:
        resp = await self._model_info_response()
        try:
            body = resp.json()
        except ValueError as exc:
            raise EngineError(f"GET {MODEL_INFO_PATH} answered non-JSON: {resp.text[:200]!r}", url=self.url) from exc
        if not isinstance(body, dict):
            raise EngineError(f"GET {MODEL_INFO_PATH} answered {str(body)[:200]}", url=self.url)
        return await self.with_adapter(body) if self.adapters else body

    async def _model_info_response(self) -> httpx.Response:
        resp = await self._request("GET", MODEL_INFO_PATH, ok_404=True)
        if resp is None:  # releases before /model_info only have the (now deprecated) old name
            resp = await self._request("GET", LEGACY_MODEL_INFO_PATH)
        assert resp is not None
        return resp

    async def weight_label(self) -> WeightLabel | None:
        """The label of the weights the server serves (None: unknown)."""
        return parse_label((await self.model_info()).get("weight_version"))
