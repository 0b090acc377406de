"""Evaluate a model directory on held-out prompts, in this process (no server, no Redis).

MODEL_DIR is any Hugging Face model directory (a run's final weights, a `weights/vN` directory,
a saved checkpoint), a LoRA job's `weights/vN` adapter directory (served on the base model its
adapter_config.json names), or `embedded:SmolLM2-135M-Instruct` (the base model), so a base model and the
weights a run produced can be compared on the same prompts with the same code the trainer's
in-training evaluation uses (asyncrl.rollout.evaluation.run_pass).

Settings: without --config, spec.evaluation's defaults (builtin:arithmetic split test,
exact-number, 64 prompts, greedy, 256 new tokens). With --config JOB.yaml, the job's
spec.evaluation, or when it has none the job's dataset with split test, its reward and
algorithm.maxNewTokens; the job's prompt template and system prompt apply. Flags override both.

Output: a progress bar (answers done / total) on stderr, a table of the figures, then one JSON
object on the last line of stdout (the EvalRecord fields plus model, dataset and split).
Exit 0 when done, 2 for a flag value that is not allowed, 1 when the model or dataset cannot be used.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console

    from asyncrl.api.spec import EvaluationSpec, RolloutSpec
    from asyncrl.api.status_report import EvalRecord
    from asyncrl.rollout.data.prompts import PromptRenderer
    from asyncrl.rollout.engines.hf_engine import HFEngine
    from asyncrl.rollout.evaluation.run_pass import EvalPart
    from asyncrl.rollout.generation.producer import GroupProducer

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("float32", "bfloat16", "float16")
FORMATS = ("auto", "gsm8k", "prompt-answer")
# EvaluationSpec field (wire name, as pydantic reports it) -> the flag that sets it
FLAGS = {
    "source": "--dataset", "format": "--format", "split": "--split", "difficulty": "--difficulty",
    "function": "--reward", "prompts": "--prompts", "samplesPerPrompt": "--samples-per-prompt",
    "temperature": "--temperature", "maxNewTokens": "--max-new-tokens",
}
# errors of a whole object (cross-field rules) -> the flags involved
OBJECT_FLAGS = {(): "--samples-per-prompt/--temperature", ("dataset",): "--dataset/--split"}
ENGINE_BATCH = 64
"""Requests decoded together: nothing else shares this engine, so every prompt may be in flight."""


class FlagError(ValueError):
    """A flag value that is not allowed (exit 2); the message starts with the flag."""


class EvalCommandError(RuntimeError):
    """The model, tokenizer or dataset cannot be used (exit 1)."""


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("model", metavar="MODEL_DIR",
                        help="Hugging Face model directory (e.g. RUN/weights/v28), a LoRA adapter directory, or "
                             "embedded:SmolLM2-135M-Instruct; a weights/vN directory is reported as policy version N")
    parser.add_argument("--config", metavar="JOB.yaml",
                        help="job file whose spec.evaluation (else its dataset with split test, reward and "
                             "maxNewTokens), prompt template and system prompt are the defaults")
    parser.add_argument("--dataset", metavar="SOURCE",
                        help="builtin:arithmetic, a .jsonl or .parquet file, a save_to_disk directory or "
                             "hf:<dataset id> (default: builtin:arithmetic)")
    parser.add_argument("--format", choices=FORMATS, help="record layout (default: auto)")
    parser.add_argument("--split", help="dataset split; builtin:arithmetic: train or test (default: test)")
    parser.add_argument("--difficulty", type=int, metavar="N", help="builtin:arithmetic difficulty 1..5 (default: 1)")
    parser.add_argument("--reward", metavar="NAME",
                        help="gsm8k, exact-number or module:function (default: the job's, else exact-number)")
    parser.add_argument("--prompts", type=int, metavar="N", help="held-out prompts (default: 64)")
    parser.add_argument("--samples-per-prompt", type=int, metavar="K",
                        help="answers per prompt; K > 1 needs --temperature > 0 and adds pass@K (default: 1)")
    parser.add_argument("--temperature", type=float, metavar="T", help="sampling temperature; 0 = greedy (default: 0)")
    parser.add_argument("--max-new-tokens", type=int, metavar="N",
                        help="answer length limit (default: the job's, else 256)")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="sampling seed (temperature > 0); the prompts depend on the dataset's seed only "
                             "(default: 0)")
    parser.add_argument("--json-out", metavar="FILE", help="also write the JSON object to FILE")
    parser.add_argument("--threads", type=int, default=0, metavar="N", help="torch CPU threads (default: 0 = torch's)")
    parser.add_argument("--device", choices=DEVICES, default="auto", help="where the model runs (default: auto = "
                        "cuda when visible)")
    parser.add_argument("--dtype", choices=DTYPES,
                        help="model dtype (default: float32 on CPU, else the job's model.dtype, else bfloat16)")
    parser.add_argument("--tokenizer", metavar="PATH",
                        help="tokenizer when MODEL_DIR has none (default: MODEL_DIR, then the job's model)")


# ------------------------------------------------------------------------------------- the plan


@dataclass(frozen=True)
class EvalPlan:
    """Everything one evaluation needs, resolved from the flags and the optional job."""

    model: str
    spec: EvaluationSpec
    """The evaluation settings, reward and max_new_tokens filled in."""
    prompt_template: str | None = None
    system_prompt: str | None = None
    tokenizers: tuple[str, ...] = ()
    """Where to look for the tokenizer, in order."""
    job_dtype: str | None = None
    version: int = 0
    note: str = ""
    """Something the user should know about the settings (printed on stderr)."""
    rollout: RolloutSpec | None = None
    """The job's rollout section (--config): a multi-turn episode is evaluated as it is trained."""


def _flag_error(exc: Any) -> FlagError:
    """A pydantic ValidationError of the overridden EvaluationSpec, worded by flag."""
    lines = []
    for err in exc.errors():
        loc = tuple(str(p) for p in err["loc"])
        flag = FLAGS.get(loc[-1]) if loc else None
        flag = flag or OBJECT_FLAGS.get(loc, "/".join(loc) or "--samples-per-prompt/--temperature")
        msg = str(err["msg"]).removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if flag in FLAGS.values() else ""
        lines.append(f"{flag}: {msg}{got}")
    return FlagError("; ".join(lines))


def _with_training_rewards(evaluation: EvaluationSpec, training: list[Any]) -> Any:
    """evaluation.datasets with each source that has no reward given its training namesake's (as the
    rollout worker scores them); None when the evaluation has one dataset."""
    if evaluation.datasets is None:
        return None
    rewards = {d.name: d.reward for d in training}
    return [d if d.reward is not None else d.model_copy(update={"reward": rewards.get(d.name)})
            for d in evaluation.datasets]


def _version_of(model: str) -> int:
    path = Path(model)
    m = re.fullmatch(r"v(\d+)", path.name)
    return int(m.group(1)) if m and path.parent.name == "weights" else 0


def plan_from_args(args: argparse.Namespace) -> EvalPlan:
    """Resolve the settings (job, then flags) and validate them as an EvaluationSpec."""
    from pydantic import ValidationError

    from asyncrl.api.spec import DatasetSpec, EvalDatasetSpec, EvaluationSpec, RewardSpec

    if args.threads < 0:
        raise FlagError(f"--threads: must be >= 0 (0 = torch's default), got {args.threads}")
    template = system = job_dtype = rollout = None
    tokenizers = [args.tokenizer] if args.tokenizer else []
    note = ""
    if args.config:
        from asyncrl.api.loader import load_job

        spec = load_job(args.config).spec  # a JobFileError is reported by asyncrl.cli
        # (a mixture's first source stands for its training data: its format, its held-out split)
        train = spec.training_datasets()[0]
        base = spec.evaluation or EvaluationSpec(
            dataset=EvalDatasetSpec.model_validate({**train.model_dump(include=set(DatasetSpec.model_fields)),
                                                    "split": "test"}),
            reward=spec.reward, max_new_tokens=spec.algorithm.max_new_tokens)
        if spec.evaluation is None and not train.source.startswith(("builtin:", "hf:")) and not args.dataset:
            note = (f"note: {args.config} has no spec.evaluation: evaluating on its training file "
                    f"{train.source} (give --dataset for held-out prompts)")
        base = base.model_copy(update={"reward": base.reward or spec.reward,
                                       "max_new_tokens": base.max_new_tokens or spec.algorithm.max_new_tokens,
                                       "datasets": _with_training_rewards(base, spec.datasets or [])})
        template, system = train.prompt_template, train.system_prompt  # (of eval prompts without their own)
        tokenizers = tokenizers or ([spec.model.tokenizer] if spec.model.tokenizer else [args.model, spec.model.path])
        job_dtype = spec.model.dtype
        rollout = spec.rollout
    else:
        base = EvaluationSpec(reward=RewardSpec(), max_new_tokens=256)
        tokenizers = tokenizers or [args.model]
    data = base.model_dump(exclude_none=True)
    reward = data.pop("reward")
    flags = {key: value for key, value in (("source", args.dataset), ("format", args.format), ("split", args.split),
                                            ("difficulty", args.difficulty)) if value is not None}
    if flags and "datasets" in data:  # (the flags name the one dataset to evaluate)
        del data["datasets"]
    data["dataset"] = {**data.get("dataset", {}), **flags} if flags or "dataset" in data else None
    if args.reward is not None:
        reward["function"] = args.reward
    for key in ("prompts", "samples_per_prompt", "temperature", "max_new_tokens"):
        if getattr(args, key) is not None:
            data[key] = getattr(args, key)
    try:
        resolved = EvaluationSpec.model_validate({**data, "reward": reward})
    except ValidationError as exc:
        raise _flag_error(exc) from None
    return EvalPlan(model=args.model, spec=resolved, prompt_template=template, system_prompt=system,
                    tokenizers=tuple(dict.fromkeys(tokenizers)), job_dtype=job_dtype,
                    version=_version_of(args.model), note=note, rollout=rollout)


# ------------------------------------------------------------------------------------- running


def check_model_dir(model: str) -> tuple[str, str | None]:
    """(the directory to load, the LoRA adapter to load onto it or None): an embedded model (converted
    once), an existing HF model directory, or a LoRA job's adapter directory (on the base model its
    adapter_config.json names)."""
    from asyncrl.infra.hf_models import EMBEDDED_PREFIX, ModelNotFoundError, resolve_model_path
    from asyncrl.infra.peft_adapters import AdapterError, base_of, is_adapter_dir

    if is_adapter_dir(model):
        try:
            base, _ = base_of(model)
            return check_model_dir(base)[0], model
        except (AdapterError, EvalCommandError) as exc:
            raise EvalCommandError(f"MODEL_DIR {model} is a LoRA adapter, but its base model cannot be used: "
                                   f"{exc}") from None
    if model.startswith(EMBEDDED_PREFIX):
        try:
            return resolve_model_path(model), None
        except ModelNotFoundError as exc:
            raise EvalCommandError(f"MODEL_DIR: {exc}") from None
    path = Path(model)
    if not path.exists():
        raise EvalCommandError(f"MODEL_DIR {model}: no such directory (give a Hugging Face model directory, "
                               "e.g. RUN/weights/vN, or embedded:SmolLM2-135M-Instruct)")
    if not path.is_dir() or not (path / "config.json").is_file():
        raise EvalCommandError(f"MODEL_DIR {model}: not a Hugging Face model directory (no config.json)")
    from transformers import AutoConfig

    try:
        AutoConfig.from_pretrained(str(path))
    except Exception as exc:  # OSError, ValueError (no model_type), JSON errors
        raise EvalCommandError(f"MODEL_DIR {model}: not a Hugging Face model directory: {exc}") from None
    return str(path), None


def _load_tokenizer(plan: EvalPlan, base: str) -> Any:
    """The first of the plan's tokenizers that loads, else the one of the model directory loaded (the
    base model of an adapter)."""
    from asyncrl.infra.hf_models import load_tokenizer

    problems = []
    for where in [*plan.tokenizers, *([base] if base not in plan.tokenizers else [])]:
        try:
            return load_tokenizer(where)
        except Exception as exc:  # transformers raises OSError, ValueError, ... for a folder without one
            problems.append(f"{where}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
    raise EvalCommandError("no tokenizer could be loaded (give --tokenizer PATH): " + "; ".join(problems))


def _device(requested: str) -> str:
    import torch

    if requested == "cuda" and not torch.cuda.is_available():
        raise FlagError("--device cuda: no CUDA device is visible here; allowed: cpu, auto")
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return requested


def run_plan(plan: EvalPlan, *, device: str, dtype: str | None, seed: int, threads: int) -> dict[str, Any]:
    """Load everything (dataset and reward first: they fail fast), answer, and return the result."""
    import torch
    from rich.console import Console

    from asyncrl.rollout.evaluation.run_pass import eval_sources

    spec = plan.spec
    parts, producer, renderer, model_dir, adapter = _prepare(plan)
    device = _device(device)
    if threads:
        torch.set_num_threads(threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # ours is the only bar on stderr
    dtype = dtype or ("float32" if device == "cpu" else plan.job_dtype or "bfloat16")
    err = Console(stderr=True)
    prompts, data = sum(len(part.items) for part in parts), _datasets_named(spec)
    err.print(f"asyncrl eval: {plan.model} ({dtype} on {device}), {prompts} prompts x {spec.samples_per_prompt} "
              f"from {data}", highlight=False, soft_wrap=True)
    engine = _load_engine(plan, model_dir, adapter, dtype=dtype, device=device, seed=seed)
    try:
        record = _answer(plan, engine, parts, renderer, producer, device=device, console=err)
    finally:
        engine.close()
        producer.close()
        for scorer in {id(part.scorer): part.scorer for part in parts}.values():
            scorer.close()
    first = eval_sources(spec)[0][1]
    if len(parts) > 1:  # (`data` names each source and its split)
        return {**record.model_dump(), "model": plan.model, "dataset": data, "split": ""}
    return {**record.model_dump(), "model": plan.model, "dataset": first.source, "split": first.split}


def _prepare(plan: EvalPlan) -> tuple[list[EvalPart], GroupProducer, PromptRenderer, str, str | None]:
    """The evaluation's parts with their prompt rendering, how an answer is made (the job's episode),
    the renderer and the model: everything that can fail on the user's input, before the model loads."""
    from asyncrl.api.spec import DatasetSpec
    from asyncrl.rollout.data.prompts import PromptRenderer
    from asyncrl.rollout.episodes.runner import EpisodeError, group_producer
    from asyncrl.rollout.evaluation.run_pass import eval_prompt_format, eval_sources
    from asyncrl.rollout.generation.producer import SingleTurn

    parts = _load_parts(plan)
    model_dir, adapter = check_model_dir(plan.model)
    tokenizer = _load_tokenizer(plan, model_dir)
    training = DatasetSpec(prompt_template=plan.prompt_template, system_prompt=plan.system_prompt)
    renderer = PromptRenderer(tokenizer)
    try:
        producer = (group_producer(plan.rollout, tokenizer, renderer) if plan.rollout is not None
                    else SingleTurn(renderer.decode))
    except EpisodeError as exc:
        raise EvalCommandError(f"--config: {exc}") from None
    tools = producer.tool_schemas()
    try:
        parts = [replace(part, render=PromptRenderer(tokenizer, *eval_prompt_format(dataset, training), tools).render)
                 for part, (_, dataset) in zip(parts, eval_sources(plan.spec), strict=True)]
    except ValueError as exc:
        raise EvalCommandError(f"--config: {exc}") from None
    return parts, producer, renderer, model_dir, adapter


def _load_engine(plan: EvalPlan, model_dir: str, adapter: str | None, *, dtype: str, device: str,
                 seed: int) -> HFEngine:
    """The in-process engine on the model (and its adapter), or an error naming MODEL_DIR."""
    from asyncrl.rollout.engines.hf_engine import HFEngine

    try:
        engine = HFEngine(model_dir, dtype=dtype, device=device, max_batch_size=ENGINE_BATCH, seed=seed)
    except Exception as exc:  # transformers: OSError, ValueError (unknown architecture), safetensors errors
        raise EvalCommandError(f"MODEL_DIR {plan.model}: cannot load the model: {exc}") from None
    if adapter is not None:
        try:
            engine.update_weights(adapter, plan.version)
        except Exception as exc:  # WeightUpdateError: the adapter does not fit its base
            engine.close()
            raise EvalCommandError(f"MODEL_DIR {plan.model}: cannot load the adapter: {exc}") from None
    return engine


def _answer(plan: EvalPlan, engine: HFEngine, parts: list[EvalPart], renderer: PromptRenderer,
            producer: GroupProducer, *, device: str, console: Console) -> EvalRecord:
    """One evaluation pass over every part, with a progress bar of answers on stderr."""
    import asyncio

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from asyncrl.api.spec import AlgorithmSpec
    from asyncrl.rollout.evaluation.run_pass import EvalSettings, EvaluationError, evaluate_parts

    spec = plan.spec
    settings = EvalSettings.from_spec(spec, AlgorithmSpec(), renderer.stop_token_ids())
    settings = EvalSettings(settings.samples_per_prompt, settings.sampling, ENGINE_BATCH)
    columns = (TextColumn("answers"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    prompts = sum(len(part.items) for part in parts)
    try:
        with Progress(*columns, console=console) as progress:
            task = progress.add_task("answers", total=prompts * spec.samples_per_prompt)
            return asyncio.run(evaluate_parts(
                engine, parts, render=renderer.render, decode=renderer.decode, settings=settings,
                version=plan.version, engine_id=f"asyncrl-eval/{device}",
                on_answer=lambda: progress.advance(task), producer=producer))
    except EvaluationError as exc:
        raise EvalCommandError(str(exc)) from None


def _datasets_named(spec: EvaluationSpec) -> str:
    """`source (split)` of each source of held-out prompts, for the user."""
    from asyncrl.rollout.evaluation.run_pass import eval_sources

    return ", ".join(f"{name + ': ' if name else ''}{d.source} ({d.split})" for name, d in eval_sources(spec))


def _load_parts(plan: EvalPlan) -> list[EvalPart]:
    """Each source's held-out prompts and scorer (its own reward, else the plan's), loaded first: a
    missing file or a bad reward fails before the model is loaded."""
    from asyncrl.api.spec import NamedSource, RewardSpec
    from asyncrl.infra.errors import RolloutError
    from asyncrl.rollout.evaluation.run_pass import EvalPart, eval_sources, load_eval_items
    from asyncrl.rollout.rewards.scorers import scorer_for

    spec, parts = plan.spec, []
    for name, dataset in eval_sources(spec):
        flag = f"--config evaluation.datasets ({name})" if name else "--dataset"
        try:
            items = load_eval_items(dataset, spec.prompts)
        except (RolloutError, OSError, ValueError) as exc:  # a missing, unreadable or malformed file
            raise EvalCommandError(f"{flag} {dataset.source}: {exc}") from None
        own = dataset.reward if isinstance(dataset, NamedSource) else None
        try:
            scorer = scorer_for(own or spec.reward or RewardSpec(), on_error="zero")
        except RolloutError as exc:
            raise FlagError(f"{flag + ' reward' if own else '--reward'}: {exc}") from None
        parts.append(EvalPart(name, items, scorer))
    return parts


def print_result(result: dict[str, Any]) -> None:
    """The figures as a table, then the JSON object as the last line of stdout."""
    from rich.console import Console
    from rich.table import Table

    def num(x: float | None) -> str:
        return "-" if x is None else f"{x:.4f}"

    table = Table(title="asyncrl eval", show_header=True)
    table.add_column("figure")
    table.add_column("value", overflow="fold")
    k = result["k"]
    for name, value in (
        ("model", result["model"]),
        ("dataset", f"{result['dataset']} ({result['split']})" if result["split"] else result["dataset"]),
        ("policy version", str(result["policy_version"])), ("prompts", str(result["prompts"])), ("k", str(k)),
        ("reward mean", num(result["reward_mean"])), ("pass@1", num(result["pass_at_1"])),
        (f"pass@{k}" if k > 1 else "pass@k", num(result["pass_at_k"])),
        ("mean length (tokens)", f"{result['response_length']:.1f}"),
        ("seconds", f"{result['seconds']:.1f}"),
        *((f"pass@1 · {source}", f"{num(p1)} (reward {num(result['reward_by_source'][source])})")
          for source, p1 in sorted(result.get("pass_at_1_by_source", {}).items())),
    ):
        table.add_row(name, value)
    Console(highlight=False).print(table)
    sys.stdout.write(json.dumps(result, sort_keys=True) + "\n")
    sys.stdout.flush()


def main(args: argparse.Namespace) -> int:
    try:
        plan = plan_from_args(args)
        if plan.note:
            print(plan.note, file=sys.stderr)
        result = run_plan(plan, device=args.device, dtype=args.dtype, seed=args.seed, threads=args.threads)
    except FlagError as exc:
        print(f"asyncrl eval: error: {exc}", file=sys.stderr)
        return 2
    except EvalCommandError as exc:
        print(f"asyncrl eval: error: {exc}", file=sys.stderr)
        return 1
    print_result(result)
    if args.json_out:
        try:
            Path(args.json_out).write_text(json.dumps(result, sort_keys=True) + "\n")
        except OSError as exc:
            print(f"asyncrl eval: error: --json-out {args.json_out}: {exc}", file=sys.stderr)
            return 1
    return 0
