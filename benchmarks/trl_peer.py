"""The TRL peer of benchmarks/vs_trl.py: Hugging Face TRL's synchronous GRPOTrainer on an asyncrl job.

Trains, with TRL 1.16's `GRPOTrainer`, exactly the work that `asyncrl run JOB` trains: the same
model weights (asyncrl.infra.hf_models.resolve_model_path: for `embedded:SmolLM2-135M-Instruct` the HF
directory asyncrl converts the embedded GGUF into), the same prompts in the same order (the job's
dataset, positions 0, 1, 2, ... as asyncrl's rollout worker takes them, rendered by asyncrl's
PromptRenderer: the token ids are checked to be identical), the same reward function, and the
job's group size, batch size, response length, sampling, AdamW and clipping settings. Settings
that TRL cannot reproduce (rloo, batch-normalised advantages, seq-mean-token-sum-norm, several
minibatches per step) stop it with a message naming them; asyncrl's off-policy corrections
(proximal policy, behaviour cap, M2PO, staleness limit) do nothing on TRL's on-policy data and
are listed as such in result.json.

Run inside .venv-trl (`bash scripts/setup-trl.sh` creates it):

  .venv-trl/bin/python benchmarks/trl_peer.py --seed 0 --steps 28 --out DIR [--job examples/local.yaml]

Writes DIR/steps.jsonl (one line per optimizer step: step, wall_s since training start, reward_mean
and completion_length of the step's completions, loss, grad_norm, entropy) and, at the end,
DIR/result.json (the TRL settings used, the generation config, versions, totals). One progress line
per step goes to stderr. `--print-settings` prints the TRL settings and exits (no training).

The spec -> TRL mapping (`trl_settings`, `unsupported_settings`, `inert_settings`) is pure and
imports neither trl nor torch, so it can be tested without them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
DEFAULT_JOB = REPO / "examples" / "local.yaml"

SYSTEM = "trl"
LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo"}
"""asyncrl aggregation -> TRL loss_type: dapo normalises by the active tokens of the whole
(accumulated) batch, grpo averages each sequence's token mean (trl grpo_trainer.py _compute_loss)."""
SCALE_REWARDS = {"grpo": "group", "dr_grpo": "none"}
"""asyncrl advantage estimator -> TRL scale_rewards: (R - mean_g) / (std_g + eps) or R - mean_g."""


class UnsupportedSettingError(ValueError):
    """The job uses a setting that TRL's GRPOTrainer cannot reproduce."""


# ------------------------------------------------------------------------------ spec -> TRL (pure)


def with_overrides(spec: Any, *, seed: int | None = None, steps: int | None = None) -> Any:
    """The spec with `asyncrl run --seed/--max-steps` applied (--seed sets the job and dataset seed)."""
    spec = spec.model_copy(deep=True)
    if seed is not None:
        spec.seed = seed
        spec.dataset.seed = seed
    if steps is not None:
        spec.trainer.max_steps = steps
    return spec


def unsupported_settings(spec: Any) -> list[str]:
    """Why TRL cannot train this job as asyncrl does (empty: it can)."""
    a = spec.algorithm
    out = []
    if a.advantage_estimator not in SCALE_REWARDS:
        out.append(f"algorithm.advantageEstimator {a.advantage_estimator!r}: GRPOTrainer has only group-mean "
                   "baselines (grpo: scale_rewards 'group', dr_grpo: 'none'); RLOO is a different trainer")
    if a.batch_normalize_advantages:
        out.append("algorithm.batchNormalizeAdvantages: TRL has no token-weighted batch normalisation after the "
                   "group estimator (scale_rewards 'batch' replaces the group std instead)")
    if a.aggregation not in LOSS_TYPES:
        out.append(f"algorithm.aggregation {a.aggregation!r}: TRL's dr_grpo divides by batch x "
                   "max_completion_length, asyncrl by the padded length; only token-mean (dapo) and "
                   "seq-mean-token-mean (grpo) match")
    if a.minibatches != 1:
        out.append(f"algorithm.minibatches {a.minibatches}: several optimizer updates per batch split TRL's "
                   "generation batch into shuffled per-sequence slices normalised over the whole batch, not "
                   "asyncrl's group minibatches; use minibatches 1")
    return out


def inert_settings(spec: Any) -> dict[str, str]:
    """asyncrl settings with no counterpart in synchronous TRL, and why they change nothing there.

    TRL with num_iterations 1 and one optimizer step per generation batch trains on-policy: it sets
    old_per_token_logps = per_token_logps.detach(), so every importance ratio is exactly 1 and the
    clip range, proximal policy, behaviour cap and M2PO masking never act."""
    a, s = spec.algorithm, spec.staleness
    on_policy = "on-policy in TRL (importance ratio exactly 1): no effect"
    out = {
        "algorithm.loss": f"{a.loss}: {on_policy}",
        "staleness.maxHeadOffpolicyness": f"{s.max_head_offpolicyness}: TRL is synchronous (eta = 0 by construction)",
        "algorithm.microBatchTokens": f"{a.micro_batch_tokens}: memory only; TRL does one forward/backward over "
                                      "the batch (same gradient up to float summation order)",
        "rollout.engine": f"{spec.rollout.engine}: TRL generates with the training model (transformers generate)",
        "reward.timeoutSeconds": f"{spec.reward.timeout_seconds}: TRL calls the reward inline without a timeout "
                                 "(a reward that raises still scores 0, as in asyncrl)",
    }
    if a.loss == "decoupled":
        out["algorithm.proximal"] = f"{a.proximal}: {on_policy}"
    if a.behaviour_cap.limit is not None:
        out["algorithm.behaviourCap.limit"] = f"{a.behaviour_cap.limit}: {on_policy}"
    if a.dual_clip is not None:
        out["algorithm.dualClip"] = f"{a.dual_clip}: {on_policy}"
    if a.m2 is not None:
        out["algorithm.m2.threshold"] = f"{a.m2.threshold}: {on_policy}"
    return out


def uses_cpu(spec: Any) -> bool:
    t = spec.trainer
    return t.device == "cpu" or (t.device == "auto" and t.gpus_per_replica == 0)


def trl_settings(spec: Any, output_dir: str) -> dict[str, Any]:
    """GRPOConfig keyword arguments that train `spec` as asyncrl does; raises UnsupportedSettingError.

    Batch layout: one generation batch of batchSize x groupSize completions per optimizer step,
    trained in one forward/backward (per_device_train_batch_size = B x n, gradient_accumulation_steps
    1, so steps_per_generation = 1 and generation_batch_size = B x n: grpo_config.py __post_init__).
    """
    problems = unsupported_settings(spec)
    if problems:
        raise UnsupportedSettingError("TRL cannot reproduce this job:\n  " + "\n  ".join(problems))
    a, o = spec.algorithm, spec.algorithm.optimizer
    return {
        "output_dir": output_dir,
        "seed": spec.seed,
        "data_seed": spec.seed,
        "max_steps": spec.trainer.max_steps,
        # one optimizer step per B x n completions, generated at once, trained in one pass
        "per_device_train_batch_size": a.batch_size * a.group_size,
        "gradient_accumulation_steps": 1,
        "num_generations": a.group_size,
        "num_iterations": 1,
        "shuffle_dataset": False,  # prompts in asyncrl's order (the dataset is built in that order)
        "dataloader_num_workers": 0,
        # sampling: plain temperature sampling (top_k 0 = off: utils.py _get_logits_processor skips 0;
        # leaving it None would let transformers fill in its global default 50)
        "max_completion_length": a.max_new_tokens,
        "temperature": a.temperature,
        "top_p": a.top_p,
        "top_k": a.top_k if a.top_k > 0 else 0,
        "min_p": None,
        "repetition_penalty": 1.0,
        "use_vllm": False,
        "use_transformers_continuous_batching": False,
        # objective
        "beta": 0.0,
        "loss_type": LOSS_TYPES[a.aggregation],
        "scale_rewards": SCALE_REWARDS[a.advantage_estimator],
        "epsilon": a.clip_eps,
        "epsilon_high": a.clip_eps_high,
        "importance_sampling_level": "token",
        "mask_truncated_completions": False,
        "top_entropy_quantile": 1.0,
        # AdamW, constant learning rate (asyncrl has no schedule or warm-up), global-norm clipping
        "optim": "adamw_torch",
        "learning_rate": o.lr,
        "adam_beta1": o.beta1,
        "adam_beta2": o.beta2,
        "adam_epsilon": o.eps,
        "weight_decay": o.weight_decay,
        "max_grad_norm": o.grad_clip,
        "lr_scheduler_type": "constant",
        "warmup_steps": 0,
        # precision and device: the model is loaded in model.dtype; no autocast (TRL defaults bf16 to True)
        "bf16": False,
        "fp16": False,
        "use_cpu": uses_cpu(spec),
        # (transformers 5.23 name; its deprecated alias gradient_checkpointing defaults to True in TRL)
        "activation_checkpointing": spec.model.gradient_checkpointing,
        # logging only
        "logging_steps": 1,
        "save_strategy": "no",
        "report_to": "none",
        "disable_tqdm": True,
        "log_completions": False,
    }


def prompt_positions(steps: int, batch_size: int) -> range:
    """The dataset positions asyncrl's single rollout worker takes for `steps` steps (0, 1, 2, ...)."""
    return range(steps * batch_size)


def prompt_text(tokenizer: Any, messages: list[dict[str, str]]) -> str:
    """The text PromptRenderer.render tokenizes (chat template, or plain lines without one)."""
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return "\n".join(m["content"] for m in messages) + "\n"


# ------------------------------------------------------------------------------ training (needs trl)


def build_rows(spec: Any, tokenizer: Any) -> list[dict[str, str]]:
    """One dataset row per prompt, in asyncrl's order; the prompt is the rendered text whose token ids
    (as TRL tokenizes it: processing_class(text=...), grpo_trainer.py _tokenize_prompts) must equal
    asyncrl's PromptRenderer.render ids."""
    from asyncrl.rollout.data.datasets import load_source
    from asyncrl.rollout.data.prompts import PromptRenderer

    source = load_source(spec.dataset)
    renderer = PromptRenderer(tokenizer, spec.dataset.prompt_template, spec.dataset.system_prompt)
    rows = []
    for position in prompt_positions(spec.trainer.max_steps, spec.algorithm.batch_size):
        item = source.item(position)
        text = prompt_text(tokenizer, renderer.messages(item.question))
        ids = list(tokenizer(text=[text])["input_ids"][0])
        if ids != renderer.render(item.question):
            raise SystemExit(f"trl_peer: prompt {item.prompt_id} tokenizes differently in TRL than in asyncrl")
        rows.append({"prompt": text, "answer": item.answer, "prompt_id": item.prompt_id})
    return rows


def make_reward(name: str, batches: list[list[str]] | None = None) -> Any:
    """TRL reward function around asyncrl's: fn(completion, answer); a raising call scores 0.
    Each call's prompt ids (in order, once per group) are appended to `batches`."""
    from asyncrl.rollout.rewards.functions import resolve_reward

    fn = resolve_reward(name)

    def reward(prompts: list[str], completions: list[str], answer: list[str], prompt_id: list[str] | None = None,
               **_: Any) -> list[float]:
        if batches is not None and prompt_id is not None:
            batches.append(list(dict.fromkeys(prompt_id)))
        out = []
        for completion, gold in zip(completions, answer):
            try:
                out.append(float(fn(completion, gold)))
            except Exception:  # asyncrl's RewardScorer scores a failing reward 0
                out.append(0.0)
        return out

    reward.__name__ = name.replace("-", "_").replace(":", "_").replace(".", "_")
    return reward


def progress(msg: str) -> None:
    print(f"trl_peer: {msg}", file=sys.stderr, flush=True)


def train(job_path: Path, seed: int | None, steps: int | None, out: Path, threads: int | None = None) -> dict[str, Any]:
    import torch
    import transformers
    import trl
    from datasets import Dataset
    from transformers import PrinterCallback, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.api.loader import load_job
    from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer, resolve_model_path
    from asyncrl.rollout.data.prompts import PromptRenderer

    job = load_job(job_path)
    spec = with_overrides(job.spec, seed=seed, steps=steps)
    try:
        settings = trl_settings(spec, str(out / "trainer"))
    except UnsupportedSettingError as exc:
        raise SystemExit(f"trl_peer: {job_path}: {exc}") from None
    out.mkdir(parents=True, exist_ok=True)
    steps_file = out / "steps.jsonl"
    steps_file.write_text("")

    t_setup = time.perf_counter()
    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(spec.seed)
    model_dir = resolve_model_path(spec.model.path)
    model = load_causal_lm(spec.model.path, dtype=spec.model.dtype, device="cpu")  # the Trainer places it
    tokenizer = load_tokenizer(spec.model.path, spec.model.tokenizer)
    tokenizer.padding_side = "left"
    rows = build_rows(spec, tokenizer)
    dataset = Dataset.from_list(rows)

    records: list[dict[str, Any]] = []
    batches: list[list[str]] = []  # the prompt ids of each generation batch (the reward sees them)
    per_step = spec.algorithm.batch_size

    class StepLog(TrainerCallback):
        """Wall time at each optimizer step's end; the step's metrics arrive in the log that follows."""

        def __init__(self) -> None:
            self.t0 = 0.0
            self.ends: dict[int, float] = {}

        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.t0 = time.perf_counter()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self.ends[state.global_step] = time.perf_counter() - self.t0

        def on_log(self, args: Any, state: Any, control: Any, logs: dict | None = None, **kwargs: Any) -> None:
            if not logs or "reward" not in logs:
                return
            step = state.global_step
            wall = self.ends.get(step, time.perf_counter() - self.t0)
            want = [r["prompt_id"] for r in rows[(step - 1) * per_step:step * per_step]]
            got = batches[step - 1] if len(batches) >= step else None
            if got != want:  # TRL must take the prompts in asyncrl's order
                raise RuntimeError(f"step {step} trained prompts {got}, asyncrl's order is {want}")
            rec = {"step": step, "wall_s": round(wall, 3), "reward_mean": logs["reward"],
                   "completion_length": logs.get("completions/mean_length"),
                   "loss": logs.get("loss"), "grad_norm": logs.get("grad_norm"), "entropy": logs.get("entropy"),
                   "learning_rate": logs.get("learning_rate"), "clipped_ratio": logs.get("completions/clipped_ratio"),
                   "prompt_ids": got}
            records.append(rec)
            with steps_file.open("a") as fh:
                fh.write(json.dumps(rec) + "\n")
            prev = records[-2]["wall_s"] if len(records) > 1 else 0.0
            progress(f"seed {spec.seed} step {step}/{spec.trainer.max_steps} reward {rec['reward_mean']:.3f} "
                     f"len {rec['completion_length']:.1f} {wall - prev:.1f}s (total {wall:.0f}s)")

    config = GRPOConfig(**settings)
    o = spec.algorithm.optimizer
    # asyncrl's AdamW (trainer/main.py build_trainer): every parameter at the same weight decay; the HF
    # Trainer's own would exempt biases and norms (identical at weightDecay 0, the default)
    optimizer = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay)
    step_log = StepLog()
    trainer = GRPOTrainer(model=model, reward_funcs=make_reward(spec.reward.function, batches), args=config,
                          train_dataset=dataset, processing_class=tokenizer, callbacks=[step_log],
                          optimizers=(optimizer, None))
    trainer.remove_callback(PrinterCallback)  # our progress line replaces its dict dumps on stdout

    renderer = PromptRenderer(tokenizer)
    gen = getattr(model, "generation_config", None)
    gen_eos = getattr(gen, "eos_token_id", None)
    gen_eos = [] if gen_eos is None else ([gen_eos] if isinstance(gen_eos, int) else list(gen_eos))
    asyncrl_stops = sorted(set(gen_eos) | set(renderer.stop_token_ids()))
    if sorted(set(trainer.eos_token_ids)) != asyncrl_stops:
        raise SystemExit(f"trl_peer: TRL stops generation on tokens {sorted(set(trainer.eos_token_ids))}, asyncrl's "
                         f"engine on {asyncrl_stops}")
    gc = trainer.generation_config
    generation = {k: getattr(gc, k, None) for k in ("do_sample", "temperature", "top_k", "top_p", "min_p",
                                                     "repetition_penalty", "max_new_tokens", "eos_token_id")}
    if not (gc.do_sample and gc.top_k == settings["top_k"] and gc.top_p == settings["top_p"]
            and gc.temperature == settings["temperature"] and gc.min_p is None and gc.repetition_penalty == 1.0):
        raise SystemExit(f"trl_peer: unexpected generation config {generation}")
    setup_s = time.perf_counter() - t_setup
    progress(f"seed {spec.seed}: {len(rows)} prompts, {settings['per_device_train_batch_size']} completions/step, "
             f"loss {settings['loss_type']}, torch threads {torch.get_num_threads()}, setup {setup_s:.1f}s; training")

    trainer.train()
    n = len(records)
    wall = records[-1]["wall_s"] if records else 0.0
    q = max(n // 4, 1)
    result = {
        "system": SYSTEM, "job": str(job_path), "seed": spec.seed, "steps": n, "wall_s": wall,
        "s_per_step": wall / n if n else None,
        "reward_last_quarter": sum(r["reward_mean"] for r in records[-q:]) / q if records else None,
        "setup_s": round(setup_s, 2), "model_dir": model_dir, "trl_settings": settings,
        "generation_config": generation, "stop_token_ids": asyncrl_stops,
        "optimizer": "torch.optim.AdamW(model.parameters()) as asyncrl's trainer builds it",
        "inert_asyncrl_settings": inert_settings(spec),
        "versions": {"trl": trl.__version__, "transformers": transformers.__version__, "torch": torch.__version__},
        "torch_threads": torch.get_num_threads(),
    }
    (out / "result.json").write_text(json.dumps(result, indent=2, default=str))
    progress(f"seed {spec.seed}: {n} steps in {wall:.0f}s, last-quarter reward {result['reward_last_quarter']}")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="trl_peer.py", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train an asyncrl job's work with Hugging Face TRL's GRPOTrainer (synchronous), for "
                    "benchmarks/vs_trl.py. Run it with .venv-trl/bin/python (bash scripts/setup-trl.sh).",
        epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--job", type=Path, default=DEFAULT_JOB, help="asyncrl job file (default: examples/local.yaml)")
    parser.add_argument("--seed", type=int, default=None, help="job and dataset seed, as `asyncrl run --seed` "
                        "(default: the job's)")
    parser.add_argument("--steps", type=int, default=None, help="optimizer steps (default: trainer.maxSteps)")
    parser.add_argument("--out", type=Path, help="output directory for steps.jsonl and result.json")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's, one per core)")
    parser.add_argument("--print-settings", action="store_true",
                        help="print the GRPOConfig settings for the job as JSON and exit (imports no trl)")
    args = parser.parse_args(argv)
    if args.print_settings:
        from asyncrl.api.loader import load_job

        spec = with_overrides(load_job(args.job).spec, seed=args.seed, steps=args.steps)
        try:
            settings = trl_settings(spec, str(args.out / "trainer") if args.out else "trl-output")
        except UnsupportedSettingError as exc:
            raise SystemExit(f"trl_peer: {args.job}: {exc}") from None
        print(json.dumps({"trl_settings": settings, "inert_asyncrl_settings": inert_settings(spec)}, indent=2))
        return 0
    if args.out is None:
        parser.error("--out is required")
    train(args.job, args.seed, args.steps, args.out, args.threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
