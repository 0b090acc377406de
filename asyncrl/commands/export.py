"""Export a policy version as a plain Hugging Face model directory that transformers, SGLang and vLLM load.

RUN_OR_WEIGHTS_DIR is a run directory (its newest `weights/vN`), or one version directory. A full fine-tuning
version is copied as it is (it already is such a directory). A LoRA job's version (spec.trainer.lora)
is a PEFT adapter: without --merge it is copied as an adapter directory, with its base model named in
adapter_config.json (`embedded:` names are replaced by the converted model's directory, so PEFT can
find the base); with --merge the adapter is folded into its base model (W + B @ A x alpha / rank) and
the result is written with the base model's tokenizer: one model, no PEFT needed to serve it.

The output directory must not exist (or be empty); it is written atomically: a failed export leaves
nothing behind. Exit 0 when done, 1 when the version cannot be exported, 2 for a bad argument.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("source", metavar="RUN_OR_WEIGHTS_DIR",
                        help="a run directory (its newest weights/vN is exported) or a weights/vN directory")
    parser.add_argument("out", metavar="OUT_DIR", type=Path, help="where the model directory is written (new)")
    parser.add_argument("--merge", action="store_true",
                        help="fold a LoRA adapter into its base model (a plain model directory); without it an "
                             "adapter stays an adapter")
    parser.add_argument("--dtype", choices=DTYPES, default="float32",
                        help="dtype of a merged model's weights (default float32)")


class ExportError(RuntimeError):
    """The version cannot be exported (exit 1)."""


def version_dir(source: Path) -> Path:
    """The version directory `source` names: itself, or a run directory's newest weights/vN."""
    from asyncrl.infra.peft_adapters import ADAPTER_CONFIG, is_adapter_dir

    if is_adapter_dir(source) or (source / "config.json").is_file():
        return source
    weights = source / "weights"
    versions = sorted((int(p.name[1:]), p) for p in weights.glob("v*") if p.name[1:].isdigit() and p.is_dir()) \
        if weights.is_dir() else []
    if not versions:
        raise ExportError(f"{source} is neither a version directory (config.json, or {ADAPTER_CONFIG}) "
                          "nor a run directory with weights/vN")
    return versions[-1][1]


def export(source: Path, out: Path, *, merge: bool = False, dtype: str = "float32") -> Path:
    """Write the version `source` names to `out` (module docstring); the version directory exported."""
    from asyncrl.infra.files import atomic_directory
    from asyncrl.infra.peft_adapters import is_adapter_dir

    version = version_dir(source)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not empty: choose a new OUT_DIR")
    if out.is_dir():
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_directory(out) as tmp:
        if not is_adapter_dir(version):
            shutil.copytree(version, tmp, dirs_exist_ok=True)
        elif merge:
            _merge(version, tmp, dtype)
        else:
            _copy_adapter(version, tmp)
    return version


def _copy_adapter(version: Path, tmp: Path) -> None:
    from asyncrl.infra.hf_models import resolve_model_path
    from asyncrl.infra.peft_adapters import ADAPTER_CONFIG, base_of

    shutil.copytree(version, tmp, dirs_exist_ok=True)
    base, _ = base_of(version)
    config = json.loads((tmp / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = resolve_model_path(base)
    (tmp / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True))


def _merge(version: Path, tmp: Path, dtype: str) -> None:
    """PEFT itself reads the adapter onto the base and merges it (the same files any PEFT user loads)."""
    from peft import PeftModel

    from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer, torch_dtype
    from asyncrl.infra.peft_adapters import base_of

    base, revision = base_of(version)
    model: Any = load_causal_lm(base, "float32", "cpu", revision=revision)
    merged = PeftModel.from_pretrained(model, str(version)).merge_and_unload()
    merged.to(torch_dtype(dtype)).save_pretrained(tmp)
    load_tokenizer(base, revision=revision).save_pretrained(tmp)


def main(args: argparse.Namespace) -> int:
    from asyncrl.infra.hf_models import ModelNotFoundError
    from asyncrl.infra.peft_adapters import AdapterError

    try:
        version = export(Path(args.source), args.out, merge=args.merge, dtype=args.dtype)
    except (ExportError, AdapterError, ModelNotFoundError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"exported {version} to {args.out}" + (" (adapter merged into its base model)" if args.merge else ""))
    return 0
