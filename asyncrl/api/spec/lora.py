"""`spec.trainer.lora`: train LoRA adapters (PEFT) on a frozen base model instead of every weight.

Its own module so the spec (asyncrl.api.spec), the trainer (asyncrl.trainer.lora) and the engines read one
declaration of the fields, their bounds and the rules that tie them to the rest of the job.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from asyncrl.api.spec.base import CelRule, SpecModel

ALL_LINEAR = "all-linear"
"""targetModules' shorthand (PEFT's): every linear layer of the transformer blocks, not the LM head."""
NAMED_ADAPTER_ENGINES = ("sglang", "vllm")
"""Engines that hold several adapters by name beside the base model, each request naming the one it
uses (SGLang's /load_lora_adapter and `lora_path`, vLLM's /v1/load_lora_adapter and `model`), where
our hf engine swaps the one adapter it serves."""
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM 0.32's --max-lora-rank takes (its LoRAConfig.max_lora_rank); an adapter's rank may be
any up to the value given."""
VLLM_LORA_ENV = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}
"""What vLLM needs to serve /v1/load_lora_adapter and /v1/unload_lora_adapter."""
SGLANG_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                         "gate_up_proj", "embed_tokens", "lm_head")
"""The module names SGLang 0.5.10.post1 serves adapters on (its SUPPORTED_LORA_TARGET_MODULES, the
choices of --lora-target-modules); tests/rollout/engines/test_sglang_routes.py reads them from the pinned source."""
SGLANG_ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""What targetModules all-linear means to SGLang's --lora-target-modules: the attention and MLP
projections (SGLang's own `all` would also reserve adapter memory for the embeddings and LM head)."""
MAX_RANK = 1024
MODULE_NAME_PATTERN = rf"^([A-Za-z_][A-Za-z0-9_.]*|{ALL_LINEAR})$"
"""A module name as PEFT matches it (the last components of a dotted module path: q_proj, mlp.up_proj),
or the all-linear shorthand."""
ModuleName = Annotated[str, Field(min_length=1, max_length=128, pattern=MODULE_NAME_PATTERN)]
ALL_LINEAR_ALONE = f"lora.targetModules '{ALL_LINEAR}' stands alone: it already names every linear layer"


class LoraSpec(SpecModel):
    """Train LoRA adapters on the frozen base model: every published version is an adapter (megabytes,
    not the whole model), the engines hot-load it, and only the adapter has optimizer state. RL with
    LoRA learns like full fine-tuning even at low rank, with a learning rate 10-40x higher
    (docs/benchmarks.md, "LoRA against full fine-tuning")."""

    rank: int = Field(default=16, ge=1, le=MAX_RANK)
    """The adapters' rank r (the low-rank update B @ A has r columns). RL learns little per token, so a
    low rank holds it; 16 keeps a version under 5% of even a 135M model's bytes."""
    alpha: int = Field(default=32, ge=1, le=16 * MAX_RANK)
    """LoRA's alpha: the update is scaled by alpha / rank."""
    dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Dropout on the adapters' input while training (0: the trainer's log-probs are exact, as RL needs)."""
    target_modules: list[ModuleName] = Field(default_factory=lambda: [ALL_LINEAR], min_length=1, max_length=64,
                                             json_schema_extra={"x-kubernetes-list-type": "set"})
    """The modules that get adapters, by name as the model names them (q_proj, v_proj, up_proj, ...), or
    ["all-linear"]: every linear layer but the LM head. Checked against the model at start: a name no
    module has fails the job, naming it."""

    __cel_rules__ = (CelRule(f"!has(self.targetModules) || !('{ALL_LINEAR}' in self.targetModules)"
                             " || size(self.targetModules) == 1", ALL_LINEAR_ALONE),)

    @field_validator("target_modules")
    @classmethod
    def _module_names(cls, names: list[str]) -> list[str]:
        # (the same rules as the CRD: list-type set, and __cel_rules__)
        if ALL_LINEAR in names and len(names) > 1:
            raise ValueError(ALL_LINEAR_ALONE)
        if len(set(names)) != len(names):
            raise ValueError(f"lora.targetModules has duplicates: {names}")
        return names


def named_adapters(engine: str, lora: LoraSpec | None) -> bool:
    """Whether the rollout engine serves a LoRA job's versions as named adapters (NAMED_ADAPTER_ENGINES)."""
    return lora is not None and engine in NAMED_ADAPTER_ENGINES


def sglang_lora_args(lora: LoraSpec) -> list[str]:
    """SGLang's launch flags for a LoRA job: adapters are loaded at run time (no --lora-paths), so the
    pin needs the largest rank and the modules up front."""
    modules = SGLANG_ALL_LINEAR if lora.target_modules == [ALL_LINEAR] else lora.target_modules
    return ["--enable-lora", "--max-lora-rank", str(lora.rank), "--lora-target-modules", *modules]


def vllm_lora_args(lora: LoraSpec) -> list[str]:
    """vLLM's launch flags for a LoRA job: the smallest --max-lora-rank it takes that holds the rank, and
    room for two adapters in a batch (the current version and the one before, which requests sent
    just before an update still name)."""
    rank = next(r for r in VLLM_MAX_LORA_RANKS if r >= lora.rank)
    return ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2"]
