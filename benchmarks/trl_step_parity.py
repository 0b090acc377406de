"""One batch, two implementations: asyncrl's policy-gradient step vs TRL GRPOTrainer's, gradient for gradient.

Separates "asyncrl computes a different update" from "asyncrl gets different data". For each batch:
the job's prompts (positions --start ...) are sampled by asyncrl's hf engine (B prompts x G samples at
the job's temperature), scored by the job's reward, then the same sequences go through

  asyncrl  compute_advantages -> build_batch -> token_logprobs -> policy_loss (the job's LossConfig,
           every token at staleness 0, as in a synchronous step)
  TRL      GRPOTrainer._compute_loss (the settings benchmarks/trl_peer.py derives from the job)

on the same weights, and the two gradients are compared: cosine, norm ratio, largest element
difference relative to the largest element. If no sample of a batch is rewarded (no signal, zero
gradient) a reward with variance (response length parity) is used instead and flagged: the
comparison is of the update given a reward, not of the reward.

Run inside .venv-trl (`bash scripts/setup-trl.sh`):

  .venv-trl/bin/python benchmarks/trl_step_parity.py [--job examples/local.yaml] [--batches 3]

Prints one JSON object: per batch the figures above, and the worst over batches.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from trl_peer import DEFAULT_JOB, build_rows, make_reward, trl_settings  # noqa: E402


def sample_batch(spec: Any, tokenizer: Any, start: int,
                 seed: int) -> tuple[list[list[int]], list[Any], list[float], bool]:
    """B prompts x G samples from asyncrl's hf engine; (prompt ids per sample, results, rewards, synthetic)."""
    from asyncrl.infra.hf_models import load_causal_lm
    from asyncrl.rollout.data.datasets import load_source
    from asyncrl.rollout.data.prompts import PromptRenderer
    from asyncrl.rollout.engines.base import SamplingParams
    from asyncrl.rollout.engines.hf_engine import HFEngine
    from asyncrl.rollout.rewards.functions import resolve_reward

    algo = spec.algorithm
    renderer = PromptRenderer(tokenizer, spec.dataset.prompt_template, spec.dataset.system_prompt)
    source = load_source(spec.dataset)
    items = [source.item(start + i) for i in range(algo.batch_size) for _ in range(algo.group_size)]
    prompts = [renderer.render(item.question) for item in items]
    engine = HFEngine(spec.model.path, model=load_causal_lm(spec.model.path, dtype=spec.model.dtype), seed=seed)
    params = SamplingParams(max_new_tokens=algo.max_new_tokens, temperature=algo.temperature,
                            stop_token_ids=renderer.stop_token_ids())
    try:
        results = [f.result() for f in [engine.submit(p, params) for p in prompts]]
    finally:
        engine.close()
    reward = resolve_reward(spec.reward.function)
    rewards = [float(reward(renderer.decode(r.output_ids), item.answer)) for r, item in zip(results, items)]
    synthetic = len(set(rewards)) == 1
    if synthetic:
        rewards = [float(len(r.output_ids) % 2) for r in results]
    return prompts, results, rewards, synthetic


def flat_grad(model: Any) -> Any:
    import torch

    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).double()
                      for p in model.parameters()])


def asyncrl_gradient(model: Any, spec: Any, pad_id: int, prompts: list[list[int]], results: list[Any],
                     rewards: list[float]) -> tuple[Any, float]:
    """The gradient of asyncrl's loss on the batch (the trainer's functions, synchronous: staleness 0)."""
    import torch

    from asyncrl.trainer.step.batch import build_batch
    from asyncrl.trainer.step.logprobs import token_logprobs
    from asyncrl.trainer.step.losses import LossConfig, compute_advantages, policy_loss

    algo = spec.algorithm
    seqs = [{"prompt_ids": p, "response_ids": r.output_ids, "behav_logprobs": r.logprobs,
             "versions": [0] * len(r.output_ids)} for p, r in zip(prompts, results)]
    adv = compute_advantages(torch.tensor(rewards), algo.group_size, algo.advantage_estimator)
    batch = build_batch(seqs, pad_id, advantages=adv)
    model.train()
    model.zero_grad(set_to_none=True)
    lp, _ = token_logprobs(model, batch.input_ids, batch.attention_mask, algo.temperature, mask=batch.loss_mask)
    loss, _ = policy_loss(lp, batch.behav_logprobs, batch.advantages, batch.loss_mask,
                          config=LossConfig.from_spec(algo), versions=batch.versions, current_version=0)
    loss.backward()
    return flat_grad(model), float(loss.detach())


def trl_gradient(trainer: Any, spec: Any, pad_id: int, prompts: list[list[int]], results: list[Any],
                 rewards: list[float]) -> tuple[Any, float]:
    """The gradient of TRL's GRPO loss on the same sequences (left-padded prompts, right-padded completions)."""
    import torch

    n, g = len(prompts), spec.algorithm.group_size
    width_p, width_c = max(map(len, prompts)), max(len(r.output_ids) for r in results)
    prompt_ids, prompt_mask = torch.full((n, width_p), pad_id), torch.zeros((n, width_p), dtype=torch.long)
    completion_ids, completion_mask = torch.full((n, width_c), pad_id), torch.zeros((n, width_c), dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompts, results)):
        prompt_ids[i, width_p - len(p):], prompt_mask[i, width_p - len(p):] = torch.tensor(p), 1
        completion_ids[i, :len(r.output_ids)], completion_mask[i, :len(r.output_ids)] = torch.tensor(r.output_ids), 1
    grouped = torch.tensor(rewards).view(-1, g)
    # TRL's group scaling (scale_rewards="group"): (r - mean) / (std + 1e-4)
    advantages = ((grouped - grouped.mean(1, keepdim=True)) / (grouped.std(1, keepdim=True) + 1e-4)).reshape(-1)
    inputs = {"prompt_ids": prompt_ids, "prompt_mask": prompt_mask, "completion_ids": completion_ids,
              "completion_mask": completion_mask, "advantages": advantages,
              "num_items_in_batch": completion_mask.sum(), "old_per_token_logps": None}
    trainer.current_gradient_accumulation_steps = 1  # set by Trainer.train(); one window = the whole batch
    trainer.model.train()
    trainer.model.zero_grad(set_to_none=True)
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return flat_grad(trainer.model), float(loss.detach())


def compare(a: Any, b: Any) -> dict[str, float]:
    """Cosine, norm ratio a/b and the largest element difference relative to b's largest element (float64)."""
    return {"grad_cosine": float(a.dot(b) / (a.norm() * b.norm())),
            "grad_norm_ratio": float(a.norm() / b.norm()),
            "max_abs_diff_rel": float((a - b).abs().max() / b.abs().max())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=DEFAULT_JOB, help="asyncrl job file (default examples/local.yaml)")
    parser.add_argument("--batches", type=int, default=3, help="batches to compare (default 3)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.api.loader import load_job
    from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    spec = load_job(args.job).spec
    tokenizer = load_tokenizer(spec.model.path, spec.model.tokenizer)
    tokenizer.padding_side = "left"
    model = load_causal_lm(spec.model.path, dtype=spec.model.dtype)
    trainer = GRPOTrainer(model=model, reward_funcs=make_reward(spec.reward.function),
                          args=GRPOConfig(**trl_settings(spec, "/tmp/asyncrl-trl-step-parity")),
                          train_dataset=Dataset.from_list(build_rows(spec, tokenizer)), processing_class=tokenizer)
    batches = []
    for k in range(args.batches):
        start = k * spec.algorithm.batch_size
        prompts, results, rewards, synthetic = sample_batch(spec, tokenizer, start, seed=k)
        g_ours, loss_ours = asyncrl_gradient(model, spec, tokenizer.pad_token_id, prompts, results, rewards)
        g_trl, loss_trl = trl_gradient(trainer, spec, tokenizer.pad_token_id, prompts, results, rewards)
        row = {"prompts_from": start, "synthetic_reward": synthetic, "reward_mean": sum(rewards) / len(rewards),
               "loss_asyncrl": loss_ours, "loss_trl": loss_trl, **compare(g_ours, g_trl)}
        print(f"trl_step_parity: batch {k}: {row}", file=sys.stderr)
        batches.append(row)
    worst = {"grad_cosine_min": min(b["grad_cosine"] for b in batches),
             "grad_norm_ratio_max_dev": max(abs(b["grad_norm_ratio"] - 1) for b in batches),
             "max_abs_diff_rel_max": max(b["max_abs_diff_rel"] for b in batches)}
    print(json.dumps({"job": str(args.job), "batches": batches, **worst}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
