"""The trainer's step against a bare PyTorch loop: tokens/s padded and packed, on the same model and batch.

Three modes train the same sequences (trajectory groups with random response lengths) on the same
model and AdamW optimizer:

  bare      plain PyTorch: the padded micro-batches of the same token budget (rows x longest), the
            HF forward's full logits -> log_softmax -> the tokens' log-probs (no labels), a
            token-mean policy-gradient loss, backward per micro-batch, clipping, AdamW
  padding   `Trainer.train_step` with `packSequences: false` (plan, micro-batches, decoupled loss
            with the log-linear proximal, metrics, clipping, AdamW)
  packing   the same with `packSequences: true` (the layout the model's attention takes:
            `trainer/step/logprobs.py` `packing_layout`)

and with `--one-row` also `packing-one-row`: the trainer packing every micro-batch into one row
(flash attention's layout), forced, to show what it costs attention that computes every pair of
positions of a row (sdpa, eager). Repetitions are interleaved, the order reversed every other one,
after one untimed warm-up of each mode; figures are medians over `--reps`. Prints one JSON object
(progress on stderr):

  trainer_over_bare_padding   trainer tokens/s padded / bare tokens/s (aim >= 0.9)
  trainer_over_bare_packing   the same, packed
  packing_over_padding        trainer tokens/s packed / padded
  padding_fraction_*          padded positions / all positions fed to the model, per mode

  python benchmarks/trainer_step.py                        # SmolLM2-135M-Instruct on CPU, 16 sequences
  python benchmarks/trainer_step.py --device cuda --arch qwen2-1.5b --dtype bfloat16 --groups 16 \\
      --max-response 1024 --micro-batch-tokens 8192
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from machine import load_average, machine_figures
from proximal_cost import ARCHS, load_model  # (the random-initialised architectures: one table)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_step_args(p, group_size=4, max_response=160, micro_batch_tokens=1024)
    p.add_argument("--one-row", action="store_true", help="also time the trainer packing each micro-batch in one row")
    args = p.parse_args(argv)
    check_step_args(p, args)
    return args


def add_step_args(p: argparse.ArgumentParser, *, group_size: int, max_response: int, micro_batch_tokens: int) -> None:
    """The batch, model and machine options of a benchmark of training steps (this one's, benchmarks/lora.py)."""
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per mode (median)")
    p.add_argument("--groups", type=int, default=4, help="trajectory groups in the batch (spec batchSize)")
    p.add_argument("--group-size", type=int, default=group_size, help="samples per group")
    p.add_argument("--prompt-tokens", type=int, default=32, help="prompt tokens per group")
    p.add_argument("--min-response", type=int, default=8, help="shortest response (tokens); lengths are uniform")
    p.add_argument("--max-response", type=int, default=max_response,
                   help="longest response (tokens; spec maxNewTokens)")
    p.add_argument("--micro-batch-tokens", type=int, default=micro_batch_tokens, help="spec.algorithm.microBatchTokens")
    p.add_argument("--model", default="embedded:SmolLM2-135M-Instruct", help="model path (ignored with --arch)")
    p.add_argument("--arch", choices=sorted(ARCHS), default=None, help="random-initialised architecture instead")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--threads", type=int, default=1, help="torch threads (CPU; 1 is steadier on a shared machine)")
    p.add_argument("--seed", type=int, default=0)


def check_step_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if min(args.reps, args.groups, args.group_size, args.prompt_tokens, args.min_response,
           args.micro_batch_tokens, args.threads) < 1:
        p.error("--reps, --groups, --group-size, --prompt-tokens, --min-response, --micro-batch-tokens and "
                "--threads must be >= 1")
    if args.max_response < args.min_response:
        p.error("--max-response must be >= --min-response")


def make_job(args: argparse.Namespace, pack: bool, trainer: dict[str, Any] | None = None) -> Any:
    """The job of these steps (`trainer`: more spec.trainer fields, e.g. lora)."""
    from asyncrl.api.spec import AsyncRLJob

    return AsyncRLJob.model_validate({
        "apiVersion": "asyncrl.dev/v1alpha1", "kind": "AsyncRLJob", "metadata": {"name": "trainer-step"},
        "spec": {
            "model": {"path": args.model, "dtype": args.dtype},
            "dataset": {"source": "builtin:arithmetic"}, "reward": {"function": "exact-number"},
            "algorithm": {"groupSize": args.group_size, "batchSize": args.groups, "minibatches": 1,
                          "maxNewTokens": args.max_response, "microBatchTokens": args.micro_batch_tokens,
                          "packSequences": pack, "optimizer": {"lr": 1e-7, "gradClip": 1.0}},
            "rollout": {"engine": "hf", "gpusPerReplica": 0},
            "trainer": {"device": args.device, "gpusPerReplica": 0, **(trainer or {})},
        },
    })


def make_groups(args: argparse.Namespace, vocab: int) -> list[Any]:
    """Random prompts and responses of random lengths, behaviour log-probs near the uniform
    policy's, rewards 0/1 (so advantages are not 0)."""
    import numpy as np

    from asyncrl.transport.wire import TrajectoryGroup, TrajectorySample

    rng = np.random.default_rng(args.seed)
    groups = []
    for g in range(args.groups):
        prompt = rng.integers(0, vocab, args.prompt_tokens).astype(np.int32)
        samples = []
        for i in range(args.group_size):
            n = int(rng.integers(args.min_response, args.max_response + 1))
            samples.append(TrajectorySample(i, rng.integers(0, vocab, n).astype(np.int32),
                                            (-np.log(vocab) + rng.normal(0, 0.1, n)).astype(np.float32),
                                            np.zeros(n, np.int32), float(i % 2), "stop"))
        groups.append(TrajectoryGroup("trainer-step", f"g{g}", f"p{g}", prompt, samples, "bench", 0.0, 0.0))
    return groups


def bare_step(model: Any, optimizer: Any, seqs: list[Any], micro_batches: list[list[int]], device: str) -> float:
    """One update the plain way on the trainer's sequences and (padded) micro-batches; the padding
    fraction of what it fed the model."""
    import torch

    total = sum(len(s.response_ids) for s in seqs)
    fed = padded = 0
    for rows in micro_batches:
        ids = [torch.as_tensor(seqs[i].prompt_ids.tolist() + seqs[i].response_ids.tolist()) for i in rows]
        input_ids = torch.nn.utils.rnn.pad_sequence(ids, batch_first=True).to(device)
        attention_mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(t) for t in ids], batch_first=True).to(device)
        # the loss covers response tokens: position t scores token t + 1
        mask = torch.zeros_like(attention_mask[:, 1:], dtype=torch.float32)
        for r, i in enumerate(rows):
            p = len(seqs[i].prompt_ids)
            mask[r, p - 1 : p - 1 + len(seqs[i].response_ids)] = 1.0
        advantages = torch.tensor([seqs[i].advantage for i in rows], device=device)[:, None]
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits[:, :-1].float()
        logprobs = logits.log_softmax(-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)
        (-(logprobs * advantages * mask).sum() / total).backward()
        fed, padded = fed + input_ids.numel(), padded + int((attention_mask == 0).sum())
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return padded / fed


def timed(fn: Callable[[], float], sync: Callable[[], None]) -> tuple[float, float]:
    """(seconds, padding fraction) of one call."""
    sync()
    start = time.perf_counter()
    padding = fn()
    sync()
    return time.perf_counter() - start, padding


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch

    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig
    from asyncrl.trainer.step.plan import plan_microbatches, sequences_with_advantages

    torch.set_num_threads(args.threads)
    load_start = load_average()
    model = load_model(args)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-7)
    groups = make_groups(args, model.config.vocab_size)
    ctx = DistContext(device=args.device)
    trainers = {"padding": Trainer(make_job(args, False), RunConfig(engine_kind="hf"), ctx, model, optimizer, None),
                "packing": Trainer(make_job(args, True), RunConfig(engine_kind="hf"), ctx, model, optimizer, None)}
    if args.one_row:
        trainers["packing-one-row"] = Trainer(make_job(args, True), RunConfig(engine_kind="hf"), ctx, model,
                                              optimizer, None)
        trainers["packing-one-row"].layout = "one-row"
    seqs = sequences_with_advantages(groups, trainers["padding"].spec.algorithm)
    lengths = [s.length for s in seqs]
    bare_micro = plan_microbatches(lengths, args.micro_batch_tokens)  # (the trainer's padded plan)
    steps: dict[str, Callable[[], float]] = {
        "bare": lambda: bare_step(model, optimizer, seqs, bare_micro, args.device),
        **{mode: (lambda t=t: t.train_step(groups).padding_fraction) for mode, t in trainers.items()}}
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)

    for mode, step in steps.items():  # warm-up: allocator, AdamW state, kernels
        timed(step, sync)
        print(f"warm-up {mode} done", file=sys.stderr)
    seconds: dict[str, list[float]] = {mode: [] for mode in steps}
    padding: dict[str, float] = {}
    for rep in range(args.reps):
        order = list(steps) if rep % 2 == 0 else list(reversed(steps))
        for mode in order:
            s, padding[mode] = timed(steps[mode], sync)
            seconds[mode].append(s)
            print(f"rep {rep} {mode}: {s:.2f}s", file=sys.stderr)

    tokens = sum(lengths)
    tps = {mode: tokens / statistics.median(v) for mode, v in seconds.items()}
    result: dict[str, Any] = {
        "trainer_over_bare_padding": round(tps["padding"] / tps["bare"], 3),
        "trainer_over_bare_packing": round(tps["packing"] / tps["bare"], 3),
        "packing_over_padding": round(tps["packing"] / tps["padding"], 3),
        **{f"{mode.replace('-', '_')}_tokens_per_s": round(v, 1) for mode, v in tps.items()},
        **{f"padding_fraction_{mode.replace('-', '_')}": round(v, 4) for mode, v in padding.items()},
        "packing_layout": trainers["packing"].layout,
        **({"one_row_over_padding": round(tps["packing-one-row"] / tps["padding"], 3)} if args.one_row else {}),
        **{f"{mode.replace('-', '_')}_step_s_all": [round(x, 3) for x in v] for mode, v in seconds.items()},
        "sequences": len(seqs),
        "tokens": tokens,
        "response_tokens": sum(len(s.response_ids) for s in seqs),
        "micro_batch_tokens": args.micro_batch_tokens,
        "reps": args.reps,
        "model": args.arch or args.model,
        "attn_implementation": model.config._attn_implementation,
        "params": sum(p.numel() for p in model.parameters()),
        "device": args.device,
        "dtype": args.dtype,
        **machine_figures(load_start),
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
