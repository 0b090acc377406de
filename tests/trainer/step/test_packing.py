"""Packed micro-batches: the layout, the planner's budget, and the real SmolLM2 giving the same
log-probs, gradients and training step packed as padded (sdpa and eager)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from asyncrl.trainer.step.batch import build_batch, model_rows, pack_rows
from asyncrl.trainer.step.logprobs import packing_layout, token_logprobs
from asyncrl.trainer.step.plan import plan_microbatches, plan_step, sequences_with_advantages
from tests.support.jobs import JobBuilder
from tests.support.trainer_support import make_groups, model_and_tokenizer

JOB = "t-packing"
LAYOUTS = ("padded", "rows", "one-row")
# (prompt, response) lengths: a spread that lets short sequences share rows with long ones, an
# empty response and a one-token one
SHAPES = [(30, 7), (12, 40), (5, 3), (20, 20), (8, 1), (3, 0), (25, 33), (40, 25)]


def _batch(shapes: list[tuple[int, int]], seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    return build_batch([dict(prompt_ids=rng.integers(100, 5000, p), response_ids=rng.integers(100, 5000, r),
                             behav_logprobs=np.zeros(r, np.float32), versions=np.zeros(r, np.int64))
                        for p, r in shapes], pad_id=0)


def _positions(lengths: list[int], layout: str) -> int:
    """What a micro-batch of these lengths feeds the model: rows x widest row."""
    rows = pack_rows(lengths, layout)
    return len(rows) * max(sum(lengths[i] for i in row) for row in rows)


# ------------------------------------------------------------------------------ layout


def test_pack_rows_is_first_fit_decreasing() -> None:
    lengths = [4, 10, 3, 6, 2, 10]
    assert pack_rows(lengths, "padded") == [[1], [5], [3], [0], [2], [4]]  # longest first, ties in order
    assert pack_rows(lengths, "rows") == [[1], [5], [3, 0], [2, 4]]  # rows as wide as the longest (10)
    assert pack_rows(lengths, "one-row") == [[1, 5, 3, 0, 2, 4]]


def test_model_rows_restart_positions_and_map_every_token() -> None:
    batch = _batch(SHAPES)
    lengths = (batch.prompt_lengths + batch.response_lengths).tolist()
    for layout in LAYOUTS:
        fed = model_rows(batch, layout, pad_id=0)
        assert (fed.attention_mask is None) == (layout != "padded")
        assert fed.positions == _positions(lengths, layout)
        flat_ids, flat_pos = fed.input_ids.reshape(-1), fed.position_ids.reshape(-1)
        for i, n in enumerate(lengths):  # position t of sequence i is starts[i] + t, at position id t
            at = fed.starts[i] + torch.arange(n)
            assert flat_ids[at].tolist() == batch.input_ids[i, :n].tolist()
            assert flat_pos[at].tolist() == list(range(n))
        if layout != "padded":  # every position is a sequence's or a row's padding tail
            assert sum(lengths) <= fed.positions
            assert fed.position_ids[:, 0].tolist() == [0] * fed.input_ids.shape[0]
    one_row = model_rows(batch, "one-row", pad_id=0)
    assert one_row.input_ids.shape == (1, sum(lengths))  # no padding at all


def test_packing_layout_follows_the_attention_implementation(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = model_and_tokenizer()
    for impl, layout in (("sdpa", "rows"), ("eager", "rows"), ("flash_attention_2", "one-row"),
                         ("paged|sdpa", "padded"), ("my_kernel", "padded")):
        monkeypatch.setattr(model.config, "_attn_implementation", impl)
        assert packing_layout(model) == layout, impl
    assert packing_layout(torch.nn.Linear(2, 2)) == "padded"  # no HF model: no packing


# ------------------------------------------------------------------------------ planner


def test_the_planner_respects_the_token_budget() -> None:
    rng = np.random.default_rng(1)
    for trial in range(40):
        lengths = rng.integers(3, 120, int(rng.integers(1, 40))).tolist()
        budget = int(rng.integers(20, 600))
        world = 1 + trial % 3
        for layout in LAYOUTS:
            seen: list[int] = []
            for rank in range(world):
                micro = plan_microbatches(lengths, budget, rank=rank, world_size=world, layout=layout)
                assert micro == plan_microbatches(lengths, budget, rank=rank, world_size=world, layout=layout)
                for k, m in enumerate(micro):
                    fed = _positions([lengths[i] for i in m], layout)
                    assert fed <= budget or len(m) == 1, (layout, budget, m)  # a longer sequence alone
                    if k + 1 < len(micro):  # greedy: the next sequence would not have fitted
                        assert _positions([lengths[i] for i in [*m, micro[k + 1][0]]], layout) > budget
                    seen += m
            assert sorted(seen) == list(range(len(lengths)))  # every sequence once, over all ranks
        # packed in one row, the budget is the sum of lengths (rows x longest when padded)
        one_row = plan_microbatches(lengths, budget, layout="one-row")
        assert all(sum(lengths[i] for i in m) <= budget or len(m) == 1 for m in one_row)
        padded = plan_microbatches(lengths, budget)
        assert all(len(m) * max(lengths[i] for i in m) <= budget or len(m) == 1 for m in padded)


def _group(prompt: int, responses: list[int]) -> Any:
    return SimpleNamespace(prompt_ids=list(range(prompt)), samples=[
        SimpleNamespace(reward=float(i % 2), response_ids=[7] * n, behav_logprobs=[0.0] * n, versions=[0] * n)
        for i, n in enumerate(responses)])


def test_every_rank_runs_the_forwards_of_the_busiest_rank() -> None:
    algo = JobBuilder.small(name=JOB, batch_size=2, micro_batch_tokens=90).job().spec.algorithm
    groups = [_group(30, [5, 45, 25, 5]), _group(10, [60, 5, 5, 20])]
    seqs = sequences_with_advantages(groups, algo)
    for layout in LAYOUTS:
        plans = [plan_step(groups, seqs, algo, rank=r, world_size=3, layout=layout) for r in range(3)]
        [forwards] = {p[0].forwards for p in plans}  # the same on every rank
        assert forwards == max(len(p[0].micro_batches) for p in plans)
        assert all(len(p[0].rank_micro_batches()) == forwards for p in plans)


# ------------------------------------------------------------------------------ the real model


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_logprobs_and_gradients_equal_the_padded_ones(impl: str, monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = model_and_tokenizer()
    monkeypatch.setattr(model.config, "_attn_implementation", impl)
    batch = _batch(SHAPES)
    weights = torch.rand(batch.loss_mask.shape, generator=torch.Generator().manual_seed(0)) - 0.5
    results = {}
    for layout in LAYOUTS:
        fed = model_rows(batch, layout, pad_id=0)
        model.zero_grad(set_to_none=True)
        lp, ent = token_logprobs(model, batch.input_ids, batch.attention_mask, 0.7, mask=batch.loss_mask, rows=fed)
        (lp * weights).sum().backward()
        grad = torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])
        results[layout] = (lp.detach(), ent, grad, fed.input_ids.shape[0])
    model.zero_grad(set_to_none=True)
    lp0, ent0, grad0, rows0 = results["padded"]
    assert rows0 == len(SHAPES)
    for layout in ("rows", "one-row"):
        lp, ent, grad, rows = results[layout]
        assert rows < rows0  # sequences did share rows
        assert lp.shape == lp0.shape and bool((lp[~batch.loss_mask] == 0).all())  # the padded layout
        assert torch.allclose(lp, lp0, rtol=0, atol=5e-5), float((lp - lp0).abs().max())
        assert torch.allclose(ent, ent0, rtol=0, atol=5e-5)
        assert float((grad - grad0).norm() / grad0.norm()) < 1e-5
        assert float((grad - grad0).abs().max()) <= 1e-4 * float(grad0.abs().max())


def _trainer(job: Any, base: Any = None) -> Any:
    """A single-process Trainer on a fresh copy of `base` (default: the embedded model); SGD at lr 0
    keeps the weights."""
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.loop import Trainer
    from asyncrl.trainer.run_config import RunConfig

    embedded, tok = model_and_tokenizer()
    base = embedded if base is None else base
    model = type(base)(base.config)
    model.load_state_dict(base.state_dict())
    return Trainer(job, RunConfig(engine_kind="hf"), DistContext(), model, torch.optim.SGD(model.parameters(), lr=0.0),
                   tok)


@pytest.mark.slow
@pytest.mark.parametrize("algorithm", [
    {"loss": "decoupled", "proximal": "recompute"},
    # sequence-level: GSPO's sequence ratio, per-sequence aggregation and the sequence-level cap
    {"objective": "gspo", "aggregation": "seq-mean-token-mean", "behaviourCap": {"level": "sequence"}},
])
def test_a_packed_train_step_equals_the_padded_one(algorithm: dict[str, Any]) -> None:
    """On the two-layer model of SmolLM2's architecture: the step around the forward, not the model's
    size, is under test (the embedded model's packed forward and gradients: the test above)."""
    from asyncrl.trainer.report.metrics_file import metrics_line
    from tests.support.trainer_support import tiny_model

    groups = make_groups(JOB, 2, group_size=4, version=0, seed=2, max_len=150)  # (rows share: 64 + 48 < 119)
    records, layouts = {}, {}
    base = tiny_model(layers=2)
    for pack, layout in ((False, "padded"), (True, "rows"), (True, "one-row")):
        job = JobBuilder.small(name=JOB, batch_size=2, micro_batch_tokens=600, grad_clip=1e9,
                               algorithm={**algorithm, "packSequences": pack}).job()
        trainer = _trainer(job, base)
        layouts[layout] = trainer.layout
        trainer.layout = layout  # (SmolLM2 on sdpa packs in "rows"; "one-row" is flash attention's)
        records[layout] = trainer.train_step(groups)
    assert layouts == {"padded": "padded", "rows": "rows", "one-row": "rows"}
    padded = records["padded"]
    for layout in ("rows", "one-row"):
        record = records[layout]
        assert record.loss == pytest.approx(padded.loss, rel=1e-4, abs=1e-6)
        assert record.grad_norm == pytest.approx(padded.grad_norm, rel=1e-4)
        assert record.entropy == pytest.approx(padded.entropy, rel=1e-4)
        assert record.tokens == padded.tokens
    # padding: reported for both modes, none packed in one row, less in packed rows than padded
    assert records["one-row"].padding_fraction == 0.0
    assert 0.0 < records["rows"].padding_fraction < padded.padding_fraction < 0.5
    line = metrics_line(padded)  # (what metrics.jsonl gets)
    assert line["padding_fraction"] == padded.padding_fraction


def test_the_padding_fraction_is_padding_over_positions_fed() -> None:
    from asyncrl.trainer.distributed import DistContext
    from asyncrl.trainer.step.stats import StepStats

    stats = StepStats()
    stats.add_fed(10, 8)
    stats.add_fed(30, 30)
    assert stats.reduce(DistContext())["padding_fraction"] == pytest.approx(2 / 40)
    assert StepStats().reduce(DistContext())["padding_fraction"] == 0.0


def test_a_model_that_cannot_pack_is_trained_padded(monkeypatch: pytest.MonkeyPatch,
                                                    caplog: pytest.LogCaptureFixture) -> None:
    trainer = _trainer(JobBuilder.small(name=JOB, algorithm={"packSequences": True}).job())
    assert trainer.layout == "rows" and not caplog.text
    monkeypatch.setattr(trainer.model.config, "_attn_implementation", "my_kernel")  # (a kernel it cannot tell)
    assert trainer._layout() == "padded"
    assert "cannot keep packed sequences apart" in caplog.text
