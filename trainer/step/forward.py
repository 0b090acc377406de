"""The model as the training step and the objectives use it: a micro-batch's tensors, its log-probs.

One `ModelForward` is handed to the step and to each objective, so that none of them needs the
trainer: they read the model through it (forward with or without grad, a padding forward for a
rank with nothing left, no-grad sums of whole responses) and never import the loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from asyncrl.trainer import distributed as D
from asyncrl.trainer.step.batch import Layout, ModelRows, TrainBatch, build_batch, model_rows
from asyncrl.trainer.step.logprobs import token_logprobs
from asyncrl.trainer.step.plan import TrainSequence, plan_microbatches
from asyncrl.trainer.step.trajectory_balance import sequence_sums


@dataclass(frozen=True)
class ModelForward:
    """How one step feeds the model: its layout (packed or padded), padding id and temperature."""

    model: Any
    ctx: D.DistContext
    layout: Layout
    pad_id: int
    temperature: float
    micro_batch_tokens: int
    checkpoint_head: bool = False
    """With `model.gradientCheckpointing`: the LM head's chunk logits are recomputed in backward
    too (with the decoder's activations checkpointed they are the largest activation left)."""

    def batch(self, seqs: list[TrainSequence], rows: list[int]) -> tuple[TrainBatch, ModelRows]:
        """The micro-batch's padded tensors (what the loss reads) and the rows the model is fed (laid
        out on the host: packing is a few slice copies per sequence)."""
        batch = build_batch([seqs[i] for i in rows], self.pad_id, advantages=[seqs[i].advantage for i in rows])
        return batch.to(self.ctx.device), model_rows(batch, self.layout, self.pad_id).to(self.ctx.device)

    def logprobs(self, batch: TrainBatch, fed: ModelRows, *, with_entropy: bool = True,
                 model: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs (with grad when enabled) and entropy, at the sampling temperature, in
        the batch's padded layout whatever rows the model was fed; of `model` if given (a frozen
        reference), else of the policy."""
        return token_logprobs(self.model if model is None else model, batch.input_ids, batch.attention_mask,
                              self.temperature, mask=batch.loss_mask, with_entropy=with_entropy,
                              checkpoint_head=self.checkpoint_head, rows=fed)

    def rows_logprobs(self, seqs: list[TrainSequence], rows: list[int], *, with_entropy: bool = True,
                      model: Any = None) -> tuple[TrainBatch, torch.Tensor, torch.Tensor]:
        """`batch` then `logprobs` of `rows`: the batch, its log-probs and entropy."""
        batch, fed = self.batch(seqs, rows)
        logprobs, entropy = self.logprobs(batch, fed, with_entropy=with_entropy, model=model)
        return batch, logprobs, entropy

    def pad(self) -> torch.Tensor:
        """A forward (through the LM head) of one 2-token row, for a rank with no micro-batch left
        where another rank still has one: FSDP gathers parameters in every forward and reduces
        every parameter's gradient in every backward, collectives every rank must join (and DDP's
        all-reduce expects a gradient for every parameter). Scaled by 0 it changes no gradient."""
        ids = torch.full((1, 2), self.pad_id, dtype=torch.long, device=self.ctx.device)
        return token_logprobs(self.model, ids, torch.ones_like(ids), self.temperature,
                              mask=torch.ones((1, 1), dtype=torch.bool, device=self.ctx.device),
                              with_entropy=False)[0].sum()

    def sequence_sums(self, seqs: list[TrainSequence], rows: list[int], *, model: Any = None) -> dict[int, float]:
        """No-grad log pi(y|x) of each of `rows`' responses under `model` (default: the policy), in
        micro-batches under the token budget; one process (objective tb)."""
        model = self.model if model is None else model
        lengths = [seqs[i].length for i in rows]
        sums: dict[int, float] = {}
        training = model.training
        model.eval()
        with torch.no_grad():
            for micro in plan_microbatches(lengths, self.micro_batch_tokens, layout=self.layout):
                idx = [rows[j] for j in micro]
                batch, logprobs, _ = self.rows_logprobs(seqs, idx, with_entropy=False, model=model)
                sums.update(zip(idx, sequence_sums(logprobs, batch.loss_mask).tolist()))
        model.train(training)
        return sums
