"""Inference engine adapters behind one interface (see base.Engine).

`make_engine(kind, url)`: "sglang" and "hf" (our transformers server speaks SGLang's native HTTP
surface) use the SGLang adapter; "vllm" uses the OpenAI-server adapter.
"""

from __future__ import annotations

from typing import Any

from asyncrl.rollout.engines.base import Engine, EngineError, GenerateResult, SamplingParams

ENGINE_KINDS = ("sglang", "vllm", "hf")


def make_engine(kind: str, url: str, **kwargs: Any) -> Engine:
    """The adapter for an engine server of `kind` at `url`."""
    if kind in ("sglang", "hf"):
        from asyncrl.rollout.engines.sglang import SGLangEngine

        return SGLangEngine(url, **kwargs)
    if kind == "vllm":
        from asyncrl.rollout.engines.vllm import VLLMEngine

        return VLLMEngine(url, **kwargs)
    raise ValueError(f"unknown engine kind {kind!r}; allowed: {', '.join(ENGINE_KINDS)}")


__all__ = ["ENGINE_KINDS", "Engine", "EngineError", "GenerateResult", "SamplingParams", "make_engine"]
