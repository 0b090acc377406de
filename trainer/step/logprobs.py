"""Per-token log-probs and entropy of a transformers causal LM at a sampling temperature.

The trainer must score tokens exactly as the engine sampled them: `log_softmax(logits / T)`.
The full `[N, L, V]` logits tensor is never built: the decoder's hidden states go through the
LM head in chunks of positions (only the positions asked for), each chunk upcast to float32,
log-softmaxed and gathered. Entropy is a metric here (no entropy bonus), so it is computed
without grad from the same chunk. DDP- and FSDP-wrapped models take the same path: the HF
attributes are looked up on the wrapped module, and the model's own forward still runs (that is
where DDP prepares the gradient all-reduce and FSDP gathers the root's parameters), with the LM
head applied to no position.

Packed rows (`batch.ModelRows`, `packing_layout`) change only what the model is fed: the hidden
state scoring position t of sequence i is read at `starts[i] + t` of the packed rows, and the
log-probs land in the same padded `[N, L-1]` layout as without packing.
"""

from __future__ import annotations

import inspect
import sys
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from asyncrl.trainer.distributed import runs_own_forward, unwrap
from asyncrl.trainer.step.batch import Layout, ModelRows, padded_rows

PACKING_LAYOUTS: dict[str, Layout] = {
    "sdpa": "rows", "eager": "rows", "flex_attention": "rows",
    "flash_attention_2": "one-row", "flash_attention_3": "one-row", "flash_attention_4": "one-row",
}
"""The packed layout of each attention implementation that keeps packed sequences apart (transformers
5: masking_utils builds the mask from the position ids when the attention mask is None, for sdpa,
eager and flex; flash attention reads them as varlen sequences, on a batch of one row only). sdpa
and eager compute every pair of positions of a row, so their rows stay as wide as the longest
sequence (`batch.Layout`)."""


def packing_layout(model: Any) -> Layout:
    """How this model can be fed packed sequences, or "padded" when it cannot: an attention
    implementation of `PACKING_LAYOUTS`, in a model whose code builds its mask with
    `masking_utils.create_causal_mask` (the code that reads packed position ids)."""
    inner = unwrap(model)
    layout = PACKING_LAYOUTS.get(str(getattr(getattr(inner, "config", None), "_attn_implementation", None)))
    module = sys.modules.get(getattr(type(inner).forward, "__module__", ""))
    return layout if layout is not None and hasattr(module, "create_causal_mask") else "padded"


def _logit_transform_free(model: Any) -> bool:
    """True when logits are exactly `lm_head(last_hidden_state)` (no soft-capping or scaling);
    `model` is the HF model itself (`unwrap`ped: a DDP wrapper hides these attributes)."""
    cfg = getattr(model, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale", "logits_scaling", "output_multiplier_scale"):
        value = getattr(cfg, attr, None)
        if value not in (None, 1, 1.0):
            return False
    prefix = getattr(model, "base_model_prefix", "")
    return (bool(prefix) and isinstance(getattr(model, prefix, None), torch.nn.Module)
            and callable(getattr(model, "get_output_embeddings", None))
            and model.get_output_embeddings() is not None)


def _chunk_logprobs(
    head: torch.nn.Module, hidden: Tensor, targets: Tensor, temperature: float, with_entropy: bool
) -> tuple[Tensor, Tensor]:
    """Gathered log-probs (with grad) and entropy (detached) from one chunk's logits."""
    logits = head(hidden).float()
    if temperature != 1.0:
        logits = logits / temperature
    logp = logits.log_softmax(-1)
    picked = logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return picked, picked.new_zeros(())
    with torch.no_grad():
        lp = logp.detach()
        ent = -(lp.exp() * lp).sum(-1)
    return picked, ent


def token_logprobs(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor,
    temperature: float = 1.0,
    *,
    mask: Tensor | None = None,
    with_entropy: bool = True,
    chunk_tokens: int = 1024,
    checkpoint_head: bool = False,
    rows: ModelRows | None = None,
) -> tuple[Tensor, Tensor]:
    """`(logprobs, entropy)`, both `[N, L-1]` float32: position t scores token t+1.

    `mask` (`[N, L-1]` bool, e.g. `TrainBatch.loss_mask`) restricts the LM head to the positions
    that matter (prompts are skipped); other positions hold 0. Grad flows into `logprobs` when
    grad is enabled; `entropy` is always detached (zeros when `with_entropy=False`).
    `checkpoint_head=True` recomputes each chunk's logits in backward instead of keeping them
    (saves `tokens x vocab` floats of activation memory for ~one extra LM-head matmul).
    Position ids follow the attention mask, so left- and right-padded rows both score correctly.
    `rows` (`batch.model_rows`) feeds the model these rows instead, e.g. the sequences packed:
    the result keeps the layout of `input_ids` (then right-padded, with `mask` inside the sequences).
    """
    mask = _checked_mask(input_ids, attention_mask, mask, temperature)
    n, length = input_ids.shape
    if rows is None:
        rows = padded_rows(input_ids, attention_mask)
    elif rows.starts.shape != (n,):
        raise ValueError(f"rows.starts has shape {tuple(rows.starts.shape)}, expected {(n,)}")
    logprobs = torch.zeros((n, length - 1), dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(logprobs)

    # 1. Hidden states of every position fed (the LM head is applied below, per chunk).
    head, hidden = _hidden_states(model, rows)

    # 2. Only the masked positions go through the head: position t of sequence i is read at
    #    starts[i] + t of the rows fed.
    flat_idx = mask.reshape(-1).nonzero().squeeze(1)
    if flat_idx.numel() == 0:
        return logprobs + 0.0 * hidden.sum() if torch.is_grad_enabled() else logprobs, entropy
    source = rows.starts.index_select(0, flat_idx // (length - 1)) + flat_idx % (length - 1)
    sel_hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, source)
    sel_targets = input_ids[:, 1:].reshape(-1).index_select(0, flat_idx)

    # 3. The head in chunks of `chunk_tokens` (optionally recomputed in backward).
    lp, ent = _chunked_head(head, sel_hidden, sel_targets, temperature, with_entropy=with_entropy,
                            chunk_tokens=chunk_tokens, checkpoint_head=checkpoint_head)

    # 4. Scatter back to [N, L-1]; unmasked positions stay 0.
    logprobs = logprobs.reshape(-1).index_put((flat_idx,), lp).view(n, length - 1)
    if with_entropy:
        entropy = entropy.reshape(-1).index_put((flat_idx,), ent).view(n, length - 1)
    return logprobs, entropy


def _checked_mask(input_ids: Tensor, attention_mask: Tensor, mask: Tensor | None, temperature: float) -> Tensor:
    """Validate the inputs; the boolean `[N, L-1]` mask of positions to score."""
    if not isinstance(input_ids, Tensor) or input_ids.dim() != 2:
        raise ValueError(f"input_ids must be a [N, L] tensor, got {getattr(input_ids, 'shape', type(input_ids))}")
    if input_ids.is_floating_point():
        raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
    if not isinstance(attention_mask, Tensor) or attention_mask.shape != input_ids.shape:
        raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}")
    if input_ids.shape[1] < 2:
        raise ValueError("input_ids needs at least 2 positions (position t scores token t+1)")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    n, length = input_ids.shape
    if mask is None:
        return attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    if mask.shape != (n, length - 1):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {(n, length - 1)}")
    return mask.bool()


def _hidden_states(model: Any, rows: ModelRows) -> tuple[Any, Tensor]:
    """(head, hidden `[R, W, H]`): the base model's last hidden states and its LM head, or, for
    models that transform logits after the head, the model's own logits with an identity head."""
    inputs = {"input_ids": rows.input_ids, "attention_mask": rows.attention_mask,
              "position_ids": rows.position_ids, "use_cache": False}
    inner = unwrap(model)
    if _logit_transform_free(inner) and (not runs_own_forward(model) or _skips_head(inner)):
        return inner.get_output_embeddings(), _base_hidden(model, inner, inputs)
    # generic fallback: the model's own logits (materialised once)
    return torch.nn.Identity(), model(**inputs).logits


def _skips_head(model: Any) -> bool:
    """True when the HF model's forward can apply its LM head to no position (`logits_to_keep`)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _base_hidden(model: Any, inner: Any, inputs: dict[str, Any]) -> Tensor:
    """The base model's last hidden state. A wrapped model's own forward must run: DDP prepares the
    gradient all-reduce there and FSDP gathers the root's parameters, which calling the base model
    directly would skip. So it runs with the LM head on no position, and the base model's output is
    taken from a forward hook."""
    base = getattr(inner, inner.base_model_prefix)
    if not runs_own_forward(model):
        return base(**inputs).last_hidden_state
    captured: list[Tensor] = []
    handle = base.register_forward_hook(lambda _module, _args, output: captured.append(output.last_hidden_state))
    try:
        model(**inputs, logits_to_keep=torch.zeros(0, dtype=torch.long, device=inputs["input_ids"].device))
    finally:
        handle.remove()
    return captured[0]


def _chunked_head(head: Any, hidden: Tensor, targets: Tensor, temperature: float, *, with_entropy: bool,
                  chunk_tokens: int, checkpoint_head: bool) -> tuple[Tensor, Tensor]:
    """Log-probs (and entropies) of `targets` under `head(hidden)`, `chunk_tokens` rows at a time."""
    chunk = max(int(chunk_tokens), 1)
    pieces, ent_pieces = [], []
    for start in range(0, hidden.shape[0], chunk):
        h = hidden[start : start + chunk]
        tgt = targets[start : start + chunk]
        if checkpoint_head and torch.is_grad_enabled():
            lp, ent = checkpoint(_chunk_logprobs, head, h, tgt, temperature, with_entropy,
                                 use_reentrant=False)
        else:
            lp, ent = _chunk_logprobs(head, h, tgt, temperature, with_entropy)
        pieces.append(lp)
        ent_pieces.append(ent)
    logprobs = torch.cat(pieces)
    return logprobs, torch.cat(ent_pieces) if with_entropy else logprobs.new_zeros(0)
