"""Same prompts, same weights: do TRL's `generate` and asyncrl's engine sample the same distribution?

`trl_step_parity.py` shows the update per batch is TRL's; a difference in learning per step must
then come from the data. This samples the job's first `--prompts` prompts `--samples` times each,
at step 0 (the launch weights), twice:

  asyncrl  the hf engine the local run uses (`HFEngine`, the renderer's stop tokens), decoded with
           `PromptRenderer.decode`, as the rollout worker does
  TRL      `GRPOTrainer._generate` (its GenerationConfig from benchmarks/trl_peer.py's settings,
           left-padded batches of B x n, EOS masking, `batch_decode(skip_special_tokens=True)`)

and scores every completion with the job's reward under both decoders. Figures per side: reward
mean and its standard error, completion length, the share that ended on a stop token and the share
truncated at maxNewTokens; `reward_gap_in_se` is (TRL - asyncrl) / the combined standard error. Run in
.venv-trl (`bash scripts/setup-trl.sh`):

  .venv-trl/bin/python benchmarks/sampling_parity.py [--job examples/local.yaml] [--prompts 16] [--samples 16]

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCHMARKS))

from trl_peer import DEFAULT_JOB, build_rows, make_reward, trl_settings  # noqa: E402


def side_figures(lengths: list[int], stopped: list[bool], rewards: list[float], max_new: int) -> dict[str, float]:
    """Reward mean and standard error, mean length, stop and truncation shares of one side's samples."""
    n = len(rewards)
    mean = sum(rewards) / n
    se = statistics.pstdev(rewards) / math.sqrt(n) if n > 1 else 0.0
    return {"samples": n, "reward_mean": round(mean, 4), "reward_se": round(se, 4),
            "length_mean": round(sum(lengths) / n, 2), "stopped_share": round(sum(stopped) / n, 4),
            "truncated_share": round(sum(1 for k in lengths if k >= max_new) / n, 4)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--job", type=Path, default=DEFAULT_JOB, help="asyncrl job file (default examples/local.yaml)")
    parser.add_argument("--prompts", type=int, default=16, help="dataset prompts, from position 0 (default 16)")
    parser.add_argument("--samples", type=int, default=16, help="samples per prompt (default 16)")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (default 2)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from asyncrl.api.loader import load_job
    from asyncrl.infra.hf_models import load_causal_lm, load_tokenizer
    from asyncrl.rollout.data.prompts import PromptRenderer
    from asyncrl.rollout.engines.base import SamplingParams
    from asyncrl.rollout.engines.hf_engine import HFEngine
    from asyncrl.rollout.rewards.functions import resolve_reward

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    job = load_job(args.job)
    spec = job.spec.model_copy(update={"trainer": job.spec.trainer.model_copy(
        update={"max_steps": math.ceil(args.prompts / job.spec.algorithm.batch_size)})})
    algo = spec.algorithm
    tokenizer = load_tokenizer(spec.model.path, spec.model.tokenizer)
    tokenizer.padding_side = "left"
    renderer = PromptRenderer(tokenizer, spec.dataset.prompt_template, spec.dataset.system_prompt)
    rows = build_rows(spec, tokenizer)[: args.prompts]
    reward = resolve_reward(spec.reward.function)

    def score(text: str, answer: str) -> float:
        try:
            return float(reward(text, answer))
        except Exception:  # the worker scores a failing reward 0
            return 0.0

    stop_ids = set(renderer.stop_token_ids())
    out: dict[str, Any] = {"job": str(args.job), "prompts": len(rows), "samples_per_prompt": args.samples,
                           "max_new_tokens": algo.max_new_tokens, "temperature": algo.temperature}

    # asyncrl: the hf engine, every sample of every prompt submitted at once (the engine batches them)
    model = load_causal_lm(spec.model.path, dtype=spec.model.dtype)
    engine = HFEngine(spec.model.path, model=model, seed=args.seed)
    params = SamplingParams(max_new_tokens=algo.max_new_tokens, temperature=algo.temperature,
                            stop_token_ids=renderer.stop_token_ids())
    ids = [tokenizer(text=[r["prompt"]])["input_ids"][0] for r in rows]
    try:
        futures = [(r, engine.submit(list(p), params)) for r, p in zip(rows, ids) for _ in range(args.samples)]
        results = [(r, f.result()) for r, f in futures]
    finally:
        engine.close()
    a_len = [len(res.output_ids) for _, res in results]
    a_stop = [bool(res.output_ids) and res.output_ids[-1] in stop_ids for _, res in results]
    a_text = [renderer.decode(res.output_ids) for _, res in results]
    a_text_trl = [tokenizer.decode(res.output_ids, skip_special_tokens=True) for _, res in results]
    answers = [r["answer"] for r, _ in results]
    out["asyncrl"] = side_figures(a_len, a_stop, [score(t, a) for t, a in zip(a_text, answers)], algo.max_new_tokens)
    out["asyncrl"]["reward_mean_trl_decode"] = round(
        statistics.mean(score(t, a) for t, a in zip(a_text_trl, answers)), 4)
    print(f"sampling_parity: asyncrl {out['asyncrl']}", file=sys.stderr, flush=True)

    # TRL: its own generation path on a fresh copy of the same weights, B x n completions per call
    trl_model = load_causal_lm(spec.model.path, dtype=spec.model.dtype)
    trainer = GRPOTrainer(model=trl_model, reward_funcs=make_reward(spec.reward.function),
                          args=GRPOConfig(**trl_settings(spec, "/tmp/asyncrl-sampling-parity")),
                          train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    trainer.model.train()  # as during GRPOTrainer.train (mode "train": num_generations)
    chunk = algo.batch_size * algo.group_size
    flat = [r for r in rows for _ in range(args.samples)]
    t_len, t_stop, t_reward, t_reward_ours = [], [], [], []
    eos = set(trainer.eos_token_ids)
    for i in range(0, len(flat), chunk):
        part = flat[i:i + chunk]
        _, completion_ids, _, completions, *_ = trainer._generate([r["prompt"] for r in part])
        for r, c_ids, text in zip(part, completion_ids, completions):
            t_len.append(len(c_ids))
            t_stop.append(bool(c_ids) and c_ids[-1] in eos)
            t_reward.append(score(text, r["answer"]))
            t_reward_ours.append(score(renderer.decode(c_ids), r["answer"]))
    out["trl"] = side_figures(t_len, t_stop, t_reward, algo.max_new_tokens)
    out["trl"]["reward_mean_asyncrl_decode"] = round(statistics.mean(t_reward_ours), 4)
    out["trl"]["eos_token_ids"] = sorted(eos)
    out["asyncrl"]["stop_token_ids"] = sorted(stop_ids)
    se = math.hypot(out["trl"]["reward_se"], out["asyncrl"]["reward_se"])
    gap = out["trl"]["reward_mean"] - out["asyncrl"]["reward_mean"]
    out["reward_gap"] = round(gap, 4)
    out["reward_gap_in_se"] = round(gap / se, 2) if se else None
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
