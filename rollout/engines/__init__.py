"""Inference engine adapters behind one interface (see base.Engine).

`make_engine(kind, url)`: "sglang" and "hf" (our transformers server speaks SGLang's native HTTP
surface) use the SGLang adapter; "vllm" uses the OpenAI-server adapter. `adapters=True`: a LoRA job's
versions are named adapters on the server (SGLang; asyncrl.api.spec.lora.named_adapters says when).
"""

from __future__ import annotations

from typing import Any

from asyncrl.api.spec.lora import NAMED_ADAPTER_ENGINES
from asyncrl.rollout.engines.base import Engine, EngineError, GenerateResult, SamplingParams

ENGINE_KINDS = ("sglang", "vllm", "hf")


def make_engine(kind: str, url: str, *, adapters: bool = False, **kwargs: Any) -> Engine:
    """The adapter for an engine server of `kind` at `url`."""
    if adapters and kind not in NAMED_ADAPTER_ENGINES:
        raise ValueError(f"engine kind {kind!r} does not serve named adapters; those that do: "
                         f"{', '.join(NAMED_ADAPTER_ENGINES)}")
    if kind in ("sglang", "hf"):
        from asyncrl.rollout.engines.sglang import SGLangEngine

        return SGLangEngine(url, adapters=adapters, **kwargs)
    if kind == "vllm":
        from asyncrl.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(url, adapters=adapters, **kwargs)
    raise ValueError(f"unknown engine kind {kind!r}; allowed: {', '.join(ENGINE_KINDS)}")


__all__ = ["ENGINE_KINDS", "Engine", "EngineError", "GenerateResult", "SamplingParams", "make_engine"]
