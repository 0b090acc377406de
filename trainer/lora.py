"""LoRA adapters on the trainer's model (spec.trainer.lora), and a version published as one.

The adapters are injected into the Hugging Face model itself (PEFT's `inject_adapter_in_model`): the
model keeps its class, config, LM head and forward, so the log-prob code, DDP and FSDP2 see the same
model as in full fine-tuning, with every base weight frozen (`requires_grad` False) and only the
adapter matrices trained. The optimizer is built over the trainable parameters only, and a
checkpoint holds only those and their optimizer state (trainer/state/checkpoint.py leaves frozen ones out).

A published version `weights/v{N}` is then a PEFT adapter directory (asyncrl/infra/peft_adapters.py), written
atomically like a full version; its config names the base model (and revision) it belongs to.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from asyncrl.api.spec.lora import ALL_LINEAR, LoraSpec
from asyncrl.infra.errors import SpecError
from asyncrl.infra.files import atomic_directory
from asyncrl.infra.peft_adapters import ADAPTER_NAME, ADAPTER_WEIGHTS, adapter_tensors, inject
from asyncrl.trainer.distributed import DistContext, full_tensor, unwrap


class TargetModulesError(SpecError, ValueError):
    """spec.trainer.lora.targetModules names a module the model does not have."""


def lora_config(spec: LoraSpec, base_model: str, revision: str | None = None) -> Any:
    """PEFT's LoraConfig for `spec`, naming the base model (and its revision) it adapts."""
    from peft import LoraConfig

    targets: str | list[str] = ALL_LINEAR if spec.target_modules == [ALL_LINEAR] else list(spec.target_modules)
    return LoraConfig(r=spec.rank, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                      bias="none", task_type="CAUSAL_LM", base_model_name_or_path=base_model, revision=revision)


def missing_target_modules(model: Any, names: list[str]) -> list[str]:
    """The names of `names` that match no linear layer of `model` (PEFT matches a name against the
    end of a module's dotted path; it fails only when none of them matches, so one typo among
    several would silently train fewer modules)."""
    linear = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    return [name for name in names if name != ALL_LINEAR
            and not any(n == name or n.endswith("." + name) for n in linear)]


def add_adapters(model: Any, spec: LoraSpec, *, base_model: str, revision: str | None = None,
                 seed: int = 0) -> Any:
    """Inject LoRA adapters into `model` in place (base weights frozen, the adapters trainable) and
    return it; TargetModulesError names a target module the model lacks, with the ones it has. The
    adapters' initial values depend on `seed` alone (not on what drew random numbers before), so every
    way of loading the model (one process, DDP, FSDP's rank 0) starts from the same adapter."""
    missing = missing_target_modules(model, spec.target_modules)
    if missing:
        have = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise TargetModulesError(f"spec.trainer.lora.targetModules: {type(model).__name__} has no module "
                                 f"{', '.join(repr(m) for m in missing)}; its linear layers: {', '.join(have)} "
                                 f"(or use ['{ALL_LINEAR}'])")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return inject(model, lora_config(spec, base_model, revision))


def trainable_parameters(model: Any) -> list[torch.nn.Parameter]:
    """What the optimizer updates: every parameter in full fine-tuning, the adapters with LoRA."""
    return [p for p in model.parameters() if p.requires_grad]


def write_adapter(model: Any, target: Path, *, dtype: torch.dtype | None = None,
                  ctx: DistContext | None = None) -> Path | None:
    """Write the adapter as a PEFT directory at `target`, atomically (a leftover is replaced); with a
    sharded model every rank calls this (the gathers are collectives), rank 0 writes and gets the path."""
    from safetensors.torch import save_file

    tensors = {n: full_tensor(t).detach().to(device="cpu", dtype=dtype or t.dtype).contiguous()
               for n, t in adapter_tensors(unwrap(model)).items()}
    if ctx is not None and not ctx.is_main:
        return None
    with atomic_directory(target, replace=True) as tmp:
        save_file(tensors, tmp / ADAPTER_WEIGHTS, metadata={"format": "pt"})
        unwrap(model).peft_config[ADAPTER_NAME].save_pretrained(tmp)
    return target


