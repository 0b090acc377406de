"""Cost of the proximal policy: one training step with `recompute` vs A-3PO `loglinear`.

Both modes run the identical step on the same batch (build_batch -> token_logprobs ->
policy_loss -> backward -> AdamW, over `--minibatches` optimizer updates); `recompute` adds the
no-grad forward of the current weights over the whole batch at the start of the step, `loglinear`
computes the proximal inside the loss from the behaviour log-probs and token versions.
Repetitions are interleaved (R L, L R, ...) after one untimed warm-up of each, so drift in machine
load hits both modes alike. Prints one JSON object; medians over `--reps`.

  python benchmarks/proximal_cost.py                      # SmolLM2-135M-Instruct on CPU
  python benchmarks/proximal_cost.py --device cuda --arch qwen2-1.5b --seqs 64 --tokens 1024
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from machine import load_average, machine_figures

# Random-initialised architectures for machines without the weights (no hub access needed).
ARCHS: dict[str, dict[str, Any]] = {
    "qwen2-1.5b": dict(model_type="qwen2", vocab_size=151936, hidden_size=1536, intermediate_size=8960,
                       num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                       max_position_embeddings=32768, tie_word_embeddings=True, rope_theta=1e6),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per mode (median; >= 3)")
    p.add_argument("--seqs", type=int, default=16, help="sequences in the batch (>= 16)")
    p.add_argument("--tokens", type=int, default=256, help="response tokens per sequence (>= 256)")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt tokens per sequence")
    p.add_argument("--minibatches", type=int, default=4, help="optimizer updates per step")
    p.add_argument("--model", default="embedded:SmolLM2-135M-Instruct", help="model path (ignored with --arch)")
    p.add_argument("--arch", choices=sorted(ARCHS), default=None, help="random-initialised architecture instead")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.reps < 1 or args.seqs < 1 or args.tokens < 1 or args.minibatches < 1:
        p.error("--reps, --seqs, --tokens and --minibatches must be >= 1")
    if args.seqs % args.minibatches:
        p.error("--seqs must be divisible by --minibatches")
    return args


def load_model(args: argparse.Namespace) -> Any:
    return build_model(args.model, args.arch, args.dtype, args.device, args.seed)


def build_model(path: str, arch: str | None, dtype: str, device: str, seed: int = 0) -> Any:
    """The model at `path`, or the random-initialised architecture `arch` (initialised on the CPU
    from `seed`, so every device gets the same weights, then moved)."""
    import torch

    from asyncrl.infra.hf_models import load_causal_lm, torch_dtype

    if arch is None:
        return load_causal_lm(path, dtype=dtype, device=device)
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = dict(ARCHS[arch])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return model.to(device=device, dtype=torch_dtype(dtype))


def make_batch(args: argparse.Namespace, vocab: int, current_version: int) -> Any:
    import torch

    from asyncrl.trainer.step.batch import build_batch
    from asyncrl.trainer.step.losses import compute_advantages

    gen = torch.Generator().manual_seed(args.seed)
    sequences = []
    for _ in range(args.seqs):
        sequences.append(dict(
            prompt_ids=torch.randint(0, vocab, (args.prompt_tokens,), generator=gen),
            response_ids=torch.randint(0, vocab, (args.tokens,), generator=gen),
            behav_logprobs=-5.0 * torch.rand(args.tokens, generator=gen),
            # staleness 0..3: partial rollouts mix versions inside a response
            versions=current_version - torch.randint(0, 4, (args.tokens,), generator=gen),
        ))
    rewards = torch.randint(0, 2, (args.seqs,), generator=gen).float()
    group = 4 if args.seqs % 4 == 0 else 1
    advantages = compute_advantages(rewards, group_size=group, estimator="grpo")
    return build_batch(sequences, pad_id=0, advantages=advantages)


def run_step(model: Any, optimizer: Any, minibatches: list[Any], proximal: str, temperature: float,
             current_version: int) -> tuple[float, float]:
    """One training step; returns (step seconds, proximal seconds)."""
    import torch

    from asyncrl.trainer.step.logprobs import token_logprobs
    from asyncrl.trainer.step.losses import LossConfig, policy_loss

    config = LossConfig(loss="decoupled", proximal=proximal)
    device = next(model.parameters()).device
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    start = time.perf_counter()
    prox_s = 0.0
    prox_lps: list[Any] = [None] * len(minibatches)
    if proximal == "recompute":  # the extra forward of the current weights, before any update
        t0 = time.perf_counter()
        with torch.no_grad():
            for i, mb in enumerate(minibatches):
                prox_lps[i], _ = token_logprobs(model, mb.input_ids, mb.attention_mask, temperature,
                                                mask=mb.loss_mask, with_entropy=False)
        sync()
        prox_s = time.perf_counter() - t0
    for i, mb in enumerate(minibatches):
        lp, _entropy = token_logprobs(model, mb.input_ids, mb.attention_mask, temperature, mask=mb.loss_mask)
        if proximal == "loglinear":
            sync()  # time the proximal alone, not queued forward kernels
        loss, stats = policy_loss(lp, mb.behav_logprobs, mb.advantages, mb.loss_mask, config=config,
                                  versions=mb.versions, current_version=current_version,
                                  prox_logprobs=prox_lps[i])
        prox_s += stats["proximal_s"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
    sync()
    return time.perf_counter() - start, prox_s


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from asyncrl.trainer.step.batch import split_minibatches

    load_start = load_average()
    model = load_model(args)
    model.train()
    current_version = 7
    batch = make_batch(args, model.config.vocab_size, current_version).to(args.device)
    minibatches = split_minibatches(batch, args.minibatches)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    temperature = 1.0

    times: dict[str, list[float]] = {"recompute": [], "loglinear": []}
    prox: dict[str, list[float]] = {"recompute": [], "loglinear": []}
    for mode in ("recompute", "loglinear"):  # warm-up: allocator, AdamW state, kernels
        run_step(model, optimizer, minibatches, mode, temperature, current_version)
    for rep in range(args.reps):
        order = ("recompute", "loglinear") if rep % 2 == 0 else ("loglinear", "recompute")
        for mode in order:
            step_s, prox_s = run_step(model, optimizer, minibatches, mode, temperature, current_version)
            times[mode].append(step_s)
            prox[mode].append(prox_s)
            print(f"rep {rep} {mode}: step {step_s:.3f}s proximal {prox_s:.6f}s", file=sys.stderr)

    med = {k: statistics.median(v) for k, v in times.items()}
    pmed = {k: statistics.median(v) for k, v in prox.items()}
    result = {
        "recompute_step_s": round(med["recompute"], 4),
        "loglinear_step_s": round(med["loglinear"], 4),
        "recompute_prox_s": round(pmed["recompute"], 4),
        "loglinear_prox_s": pmed["loglinear"],
        "step_speedup": round(med["recompute"] / med["loglinear"], 4),
        "prox_speedup": round(pmed["recompute"] / max(pmed["loglinear"], 1e-9), 1),
        "loglinear_prox_fraction_of_step": pmed["loglinear"] / med["loglinear"],
        "recompute_prox_fraction_of_step": round(pmed["recompute"] / med["recompute"], 4),
        "train_only_s": round(med["recompute"] - pmed["recompute"], 4),
        "ideal_step_speedup": round(med["recompute"] / (med["recompute"] - pmed["recompute"]), 4),
        "reps": args.reps,
        "recompute_step_s_all": [round(t, 3) for t in times["recompute"]],
        "loglinear_step_s_all": [round(t, 3) for t in times["loglinear"]],
        "seqs": args.seqs,
        "prompt_tokens": args.prompt_tokens,
        "response_tokens": args.tokens,
        "minibatches": args.minibatches,
        "model": args.arch or args.model,
        "params": sum(p.numel() for p in model.parameters()),
        "device": args.device,
        "dtype": args.dtype,
        **machine_figures(load_start),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
