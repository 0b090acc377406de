"""LoRA models for the tests: the embedded model with adapters injected as the trainer does it, made to
look trained, and the log-probs a served answer is checked against (tests/test_lora*.py)."""

from __future__ import annotations

from typing import Any

import torch

from asyncrl.api.spec.lora import LoraSpec
from asyncrl.infra.hf_models import load_causal_lm
from asyncrl.trainer.lora import add_adapters, trainable_parameters
from asyncrl.trainer.step.logprobs import token_logprobs

MODEL = "embedded:SmolLM2-135M-Instruct"


def adapted(spec: LoraSpec, seed: int = 0) -> Any:
    """The embedded model (float32, CPU) with the adapters of `spec`, as the trainer adds them."""
    return add_adapters(load_causal_lm(MODEL, "float32", "cpu"), spec, base_model=MODEL, seed=seed)


def perturbed(model: Any, seed: int = 1) -> Any:
    """A trained-looking adapter: B != 0 (PEFT starts it at 0, which changes nothing)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in trainable_parameters(model):
            p.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return model


def logprobs(model: Any, ids: list[int]) -> torch.Tensor:
    """Log-prob of each token of `ids` after the first under `model` (temperature 1)."""
    seq = torch.tensor([ids])
    with torch.no_grad():
        lp, _ = token_logprobs(model, seq, torch.ones_like(seq), 1.0)
    return lp[0]
