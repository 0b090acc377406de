"""Per-token log-probs and entropy of a transformers causal LM at a sampling temperature.

The trainer must score tokens exactly as the engine sampled them: `log_softmax(logits / T)`.
The full `[N, L, V]` logits tensor is never built: the decoder's hidden states go through the
LM head in chunks of positions (only the positions asked for), each chunk upcast to float32,
log-softmaxed and gathered. Entropy is a metric here (no entropy bonus), so it is computed
without grad from the same chunk. A DDP-wrapped model takes the same path: its HF attributes are
looked up on the wrapped module, and its own forward still runs (that is where DDP prepares the
gradient all-reduce), with the LM head applied to no position.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from asyncrl.trainer.distributed import unwrap


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
) -> tuple[Tensor, Tensor]:
    """`(logprobs, entropy)`, both `[N, L-1]` float32: position t scores token t+1.

    `mask` (`[N, L-1]` bool, e.g. `TrainBatch.loss_mask`) restricts the LM head to the positions
    that matter (prompts are skipped); other positions hold 0. Grad flows into `logprobs` when
    grad is enabled; `entropy` is always detached (zeros when `with_entropy=False`).
    `checkpoint_head=True` recomputes each chunk's logits in backward instead of keeping them
    (saves `tokens x vocab` floats of activation memory for ~one extra LM-head matmul).
    Position ids follow the attention mask, so left- and right-padded rows both score correctly.
    """
    mask = _checked_mask(input_ids, attention_mask, mask, temperature)
    n, length = input_ids.shape
    logprobs = torch.zeros((n, length - 1), dtype=torch.float32, device=input_ids.device)
    entropy = torch.zeros_like(logprobs)

    # 1. Hidden states of every position but the last (the LM head is applied below, per chunk).
    head, hidden = _hidden_states(model, input_ids, attention_mask)

    # 2. Only the masked positions go through the head.
    flat_idx = mask.reshape(-1).nonzero().squeeze(1)
    if flat_idx.numel() == 0:
        return logprobs + 0.0 * hidden.sum() if torch.is_grad_enabled() else logprobs, entropy
    sel_hidden = hidden.reshape(n * (length - 1), -1).index_select(0, flat_idx)
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


def _hidden_states(model: Any, input_ids: Tensor, attention_mask: Tensor) -> tuple[Any, Tensor]:
    """(head, hidden[:, :-1]): the base model's last hidden states and its LM head, or, for models
    that transform logits after the head, the model's own logits with an identity head."""
    attn = attention_mask.long()
    inputs = {"input_ids": input_ids, "attention_mask": attn, "position_ids": (attn.cumsum(-1) - 1).clamp(min=0),
              "use_cache": False}
    inner = unwrap(model)
    if _logit_transform_free(inner) and (inner is model or _skips_head(inner)):
        return inner.get_output_embeddings(), _base_hidden(model, inner, inputs)[:, :-1]
    # generic fallback: the model's own logits (materialised once)
    return torch.nn.Identity(), model(**inputs).logits[:, :-1]


def _skips_head(model: Any) -> bool:
    """True when the HF model's forward can apply its LM head to no position (`logits_to_keep`)."""
    return "logits_to_keep" in inspect.signature(model.forward).parameters


def _base_hidden(model: Any, inner: Any, inputs: dict[str, Any]) -> Tensor:
    """The base model's last hidden state. A wrapper's (DDP's) forward must run: it prepares the
    gradient all-reduce, which calling the base model directly would skip on this rank. So it runs
    with the LM head on no position, and the base model's output is taken from a forward hook."""
    base = getattr(inner, inner.base_model_prefix)
    if model is inner:
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
