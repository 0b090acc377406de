"""The LoRA adapter directory every part of asyncrl reads and writes: PEFT's format.

A version published by a LoRA job (spec.trainer.lora) is `adapter_config.json` plus
`adapter_model.safetensors`: what `peft.PeftModel.from_pretrained`, SGLang's `/load_lora_adapter`
and vLLM's LoRA loader read. The trainer writes it (trainer/lora.py), the hf engine hot-loads it
(rollout/engines/hf_engine.py), `asyncrl export` merges it into its base. Tensor names are PEFT's saved
names (`...q_proj.lora_A.weight`: no adapter name in them).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_NAME = "default"
"""PEFT's name for the one adapter a model carries here (it is not written into the files)."""
SAVED_PREFIX = "base_model.model."
"""What a tensor name in the file starts with (PeftModel's path to the wrapped model; SGLang's and
vLLM's loaders strip it); the names inside a bare model with injected adapters lack it."""


class AdapterError(ValueError):
    """An adapter directory that cannot be read, or does not fit the model it is loaded into."""


def is_adapter_dir(path: Path | str) -> bool:
    return (Path(path) / ADAPTER_CONFIG).is_file()


def read_adapter(path: Path | str) -> tuple[Any, dict[str, torch.Tensor]]:
    """(LoraConfig, tensors) of an adapter directory; AdapterError says what is wrong with it."""
    from peft import LoraConfig
    from safetensors.torch import load_file

    folder = Path(path)
    weights = folder / ADAPTER_WEIGHTS
    if not is_adapter_dir(folder) or not weights.is_file():
        raise AdapterError(f"{folder} is not a LoRA adapter directory (needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    try:
        config = LoraConfig.from_pretrained(str(folder))
        tensors = load_file(str(weights))
    except Exception as exc:  # a truncated or foreign file
        raise AdapterError(f"cannot read the adapter in {folder}: {exc}") from exc
    return config, tensors


def has_adapters(model: Any) -> bool:
    """Whether adapters were injected into `model` (the bare Hugging Face model)."""
    return ADAPTER_NAME in (getattr(model, "peft_config", None) or {})


def inject(model: Any, config: Any) -> Any:
    """Add the adapters `config` describes to `model` in place (initialised as PEFT does: B = 0, so the
    model computes what it did), base weights frozen; the model keeps its class and forward."""
    from peft import inject_adapter_in_model

    inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    return model


def adapter_tensors(model: Any) -> dict[str, torch.Tensor]:
    """The adapter tensors of `model` (the bare Hugging Face model) by the names PEFT saves them under."""
    from peft import get_peft_model_state_dict

    state = {n: t for n, t in model.state_dict(keep_vars=True).items() if ".lora_" in n}
    return {SAVED_PREFIX + n: t for n, t in
            get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER_NAME,
                                      save_embedding_layers=False).items()}  # (no embedding is adapted)


def same_shape(a: Any, b: Any) -> bool:
    """Whether two LoraConfigs give the same adapter: rank, alpha and target modules (what the tensors
    and the scale alpha/rank depend on)."""
    def targets(c: Any) -> Any:
        t = c.target_modules
        return t if isinstance(t, str) else sorted(t)
    return (a.r, a.lora_alpha, targets(a), bool(a.use_rslora)) == (b.r, b.lora_alpha, targets(b), bool(b.use_rslora))


def load_into(model: Any, config: Any, tensors: dict[str, torch.Tensor], source: str) -> None:
    """Load an adapter into `model` (the bare Hugging Face model), injecting its modules the first time.

    Everything is checked before a weight changes (the config's shape, every name, every shape), so an
    adapter that does not fit leaves the model serving what it served; AdapterError says why."""
    from peft import set_peft_model_state_dict

    if has_adapters(model):
        current = model.peft_config[ADAPTER_NAME]
        if not same_shape(current, config):
            raise AdapterError(f"{source}: adapter of rank {config.r}, alpha {config.lora_alpha}, targets "
                               f"{config.target_modules}; this model carries rank {current.r}, alpha "
                               f"{current.lora_alpha}, targets {current.target_modules}")
    else:
        inject(model, config)
    expected = {n: tuple(t.shape) for n, t in adapter_tensors(model).items()}
    unknown, missing = sorted(set(tensors) - set(expected)), sorted(set(expected) - set(tensors))
    if unknown or missing:
        raise AdapterError(f"{source} does not fit the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}"
                           f", unexpected {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
    for name, tensor in tensors.items():
        if tuple(tensor.shape) != expected[name]:
            raise AdapterError(f"{name}: shape {tuple(tensor.shape)} in {source}, the model has {expected[name]}")
    with torch.no_grad():
        set_peft_model_state_dict(model, {n.removeprefix(SAVED_PREFIX): t for n, t in tensors.items()},
                                  adapter_name=ADAPTER_NAME)


def base_of(path: Path | str) -> tuple[str, str | None]:
    """(model path, revision) of the base model an adapter directory was trained on (its config says)."""
    import json

    try:
        config = json.loads((Path(path) / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise AdapterError(f"cannot read {Path(path) / ADAPTER_CONFIG}: {exc}") from exc
    base = config.get("base_model_name_or_path")
    if not base:
        raise AdapterError(f"{Path(path) / ADAPTER_CONFIG} does not name its base model (base_model_name_or_path)")
    return str(base), config.get("revision") or None
