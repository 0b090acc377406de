"""An in-process transformers inference engine: batched sampling with exact behaviour logprobs.

It is the embedded default engine (`asyncrl run`, CPU or one GPU). One background thread owns the
model and runs batches: prefill of left-padded prompts (attention mask + position ids, so padding
never changes a row's numbers), then token-by-token decoding with the KV cache. Every sampled
token's logprob is `log_softmax(logits / T)` in float32 at the sampling temperature, before top-p /
top-k truncation: the same quantity the trainer recomputes over the full sequence, so the
importance weights start at exactly 1 for on-policy tokens.

Requests that arrive while a batch runs join it at the next token boundary (the running rows are
re-prefilled from prompt + output so far), a cheap stand-in for continuous batching.

Control mirrors SGLang: `pause("abort")` ends running requests at the next token with their
partial output (finish "abort"); `pause("retract")` puts them back in the queue to continue after
`resume()`; requests that arrive while paused wait. `update_weights(dir, version)` reads a
safetensors directory (or a LoRA job's adapter directory, asyncrl/infra/peft_adapters.py) fully and validates
names and shapes before touching the model, then copies between two decoding steps: a failed update
leaves the old weights and version in place.
"""

from __future__ import annotations

import collections
import concurrent.futures
import itertools
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from asyncrl.api.weight_labels import WeightLabel
from asyncrl.infra.errors import RolloutError
from asyncrl.infra.hf_models import load_causal_lm, resolve_model_path
from asyncrl.infra.peft_adapters import AdapterError, has_adapters, is_adapter_dir, load_into, read_adapter
from asyncrl.rollout.engines.base import GenerateResult, SamplingParams


class WeightUpdateError(RolloutError, RuntimeError):
    """The weights directory cannot be loaded into this model (nothing was changed)."""


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    future: concurrent.futures.Future
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)
    matched: int | None = None


class HFEngine:
    """A transformers causal LM behind a request queue and one decoding thread."""

    def __init__(
        self,
        model_path: str,
        *,
        dtype: str = "float32",
        device: str = "cpu",
        max_batch_size: int = 64,
        batch_wait_s: float = 0.02,
        weight_version: int = 0,
        seed: int = 0,
        model: Any = None,
        revision: str | None = None,
    ):
        self.model_path = model_path
        self.dtype = dtype
        self.device = device
        self.max_batch_size = max_batch_size
        self.batch_wait_s = batch_wait_s
        self.model = model if model is not None else load_causal_lm(model_path, dtype=dtype, device=device,
                                                                                revision=revision)
        self.model.eval()
        cfg = self.model.config
        gen = getattr(self.model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if eos is None:
            eos = cfg.eos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(
            eos if isinstance(eos, (list, tuple)) else ([eos] if eos is not None else []))
        pad = getattr(cfg, "pad_token_id", None)
        self.pad_token_id = int(pad) if pad is not None else (self.eos_token_ids[0] if self.eos_token_ids else 0)
        self.weight_label = WeightLabel(weight_version)
        """The label of the weights served (set by each update that names one)."""
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self._cond = threading.Condition()
        self._waiting: collections.deque[_Request] = collections.deque()
        self._running: list[_Request] = []
        self._pause_mode: str | None = None
        self._busy = False
        self._closed = False
        self._ids = itertools.count()
        self._model_lock = threading.Lock()
        self._groups: dict[str, Any] = {}
        """Weight groups joined (collective weight sync), by name."""
        self._group_backends: dict[str, str] = {}
        self._group_received: dict[str, set[str]] = {}
        """Parameters received in each group since its last versioned bucket."""
        self.tokens_generated = 0
        self._thread = threading.Thread(target=self._loop, name="hf-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ public API (thread-safe)

    def submit(self, input_ids: list[int], params: SamplingParams, rid: str | None = None) -> concurrent.futures.Future:
        """Queue one request; the future resolves to a GenerateResult."""
        if not input_ids:
            raise ValueError("input_ids must not be empty")
        if params.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        vocab = self.model.config.vocab_size
        if any(t < 0 or t >= vocab for t in input_ids):
            raise ValueError(f"input_ids must be token ids in [0, {vocab})")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        req = _Request(rid or f"req-{next(self._ids)}", list(map(int, input_ids)), params, fut)
        with self._cond:
            if self._closed:
                raise RuntimeError("engine is closed")
            self._waiting.append(req)
            self._cond.notify_all()
        return fut

    async def generate(self, input_ids: list[int], params: SamplingParams) -> GenerateResult:
        import asyncio

        return await asyncio.wrap_future(self.submit(input_ids, params))

    def pause(self, mode: str = "abort") -> None:
        """Stop decoding at the next token; returns once no batch is running."""
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"unknown pause mode {mode!r}; expected abort, retract or in_place")
        with self._cond:
            self._pause_mode = "retract" if mode == "in_place" else mode
            if mode == "abort":  # queued requests are aborted too (SGLang: abort_all)
                while self._waiting:
                    self._finish(self._waiting.popleft(), "abort")
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._busy)

    def resume(self) -> None:
        with self._cond:
            self._pause_mode = None
            self._cond.notify_all()

    @property
    def weight_version(self) -> int:
        """The version of `weight_label`."""
        return self.weight_label.version

    @property
    def paused(self) -> bool:
        return self._pause_mode is not None

    def update_weights(self, path: str, version: WeightLabel | int | None = None) -> None:
        """Load a safetensors directory atomically, or a LoRA adapter directory (a LoRA job's version:
        the adapter replaces the one served, on the same base weights); raises WeightUpdateError and
        changes nothing on failure."""
        if is_adapter_dir(path):
            self._load_adapter(path, version)
            return
        if has_adapters(self.model):
            raise WeightUpdateError(f"{path} holds whole weights, but this engine serves LoRA adapters on its base "
                                    "model (it loaded one): load an adapter directory")
        state = self._read_weights(path)
        with self._model_lock:
            with torch.no_grad():
                params = dict(self.model.named_parameters())
                for name, tensor in state.items():
                    params[name].copy_(tensor)
            if version is not None:
                self.weight_label = WeightLabel.of(version)
            self.model_path = str(path)

    def _load_adapter(self, path: str, version: WeightLabel | int | None) -> None:
        """The adapter read first, then checked, loaded and labelled between two decoding steps (one
        hold of the lock: no token is decoded by the new adapter under the old label)."""
        try:
            config, tensors = read_adapter(path)
            with self._model_lock:
                load_into(self.model, config, tensors, str(path))
                if version is not None:
                    self.weight_label = WeightLabel.of(version)
                self.model_path = str(path)
        except AdapterError as exc:
            raise WeightUpdateError(str(exc)) from exc

    # ------------------------------------------------------------------ collective weight sync

    def join_weight_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                          group_name: str, backend: str, timeout_s: float = 120.0) -> None:
        """Join the trainer's weight group as rank `rank_offset` (one process: no tensor parallelism).

        Blocks until every member joined, as SGLang's init_weights_update_group does."""
        from asyncrl.rollout.engines.weight_group import open_group

        if group_name in self._groups:
            raise WeightUpdateError(f"weight group {group_name!r} already exists; destroy it first")
        if backend == "nccl" and self.device == "cpu":
            raise WeightUpdateError("backend nccl needs a CUDA engine; this one runs on cpu (use gloo)")
        self._groups[group_name] = open_group(master_address, master_port, rank_offset, world_size,
                                              group_name=group_name, backend=backend, timeout_s=timeout_s)
        self._group_backends[group_name] = backend

    def leave_weight_group(self, group_name: str) -> None:
        from asyncrl.rollout.engines.weight_group import close_group

        group = self._groups.pop(group_name, None)
        if group is None:
            raise WeightUpdateError(f"weight group {group_name!r} does not exist")
        self._group_received.pop(group_name, None)
        self._group_backends.pop(group_name, None)
        close_group(group)

    def update_weights_from_group(self, specs: list[Any], group_name: str,
                                  version: WeightLabel | int | None = None) -> None:
        """Receive one bucket of tensors from the group's rank 0 and load it between decoding steps.

        Every tensor is received before anything is checked (the sender's broadcast must complete);
        a bucket that names an unknown parameter or a wrong shape changes nothing. The bucket that
        carries `version` closes the version: it is refused (and the label kept) unless the buckets
        since the last version covered every parameter."""
        from asyncrl.rollout.engines.weight_group import receive

        group = self._groups.get(group_name)
        if group is None:
            raise WeightUpdateError(f"weight group {group_name!r} does not exist; "
                                    "call /init_weights_update_group first")
        device = "cpu" if self._group_backends.get(group_name, "gloo") == "gloo" else self.device
        tensors = receive(group, specs, device)
        state = self._checked({s.name: t for s, t in zip(specs, tensors)}, f"group {group_name}", complete=False)
        received = self._group_received.setdefault(group_name, set())
        with self._model_lock:
            with torch.no_grad():
                params = dict(self.model.named_parameters())
                for name, tensor in state.items():
                    params[name].copy_(tensor)
            received.update(state)
            if version is not None:
                missing = sorted(set(params) - received)
                received.clear()
                if missing:
                    raise WeightUpdateError(
                        f"version {version} is incomplete: {len(missing)} parameter(s) never received "
                        f"({', '.join(missing[:5])}{'...' if len(missing) > 5 else ''}); label not changed")
                self.weight_label = WeightLabel.of(version)

    def parameter_head(self, name: str, size: int) -> list[float] | None:
        """The first `size` values of parameter `name` (flattened, as floats); None if there is none."""
        param = dict(self.model.named_parameters()).get(name)
        if param is None:
            return None
        with self._model_lock:
            return param.detach().flatten()[:size].float().cpu().tolist()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            while self._waiting:
                self._finish(self._waiting.popleft(), "abort")
            self._cond.notify_all()
        self._thread.join(timeout=30)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {"waiting": len(self._waiting), "running": len(self._running), "paused": self.paused,
                    "tokens_generated": self.tokens_generated, "weight_version": str(self.weight_label)}

    # ------------------------------------------------------------------ weights

    def _read_weights(self, path: str) -> dict[str, torch.Tensor]:
        from safetensors.torch import load_file

        folder = Path(resolve_model_path(str(path)))
        files = sorted(folder.glob("*.safetensors")) if folder.is_dir() else []
        if not files:
            raise WeightUpdateError(f"{folder} has no *.safetensors files")
        state: dict[str, torch.Tensor] = {}
        for f in files:
            try:
                state.update(load_file(str(f)))
            except Exception as exc:  # a truncated or foreign file
                raise WeightUpdateError(f"cannot read {f}: {exc}") from exc
        return self._checked(state, str(folder))

    def _checked(self, state: dict[str, torch.Tensor], source: str, *,
                 complete: bool = True) -> dict[str, torch.Tensor]:
        """`state` with each tensor in its parameter's dtype and device; WeightUpdateError names a
        tensor the model lacks, a wrong shape, or (`complete`) a parameter `state` lacks."""
        params = dict(self.model.named_parameters())
        # Tied weights (lm_head = embed_tokens) appear once in named_parameters; accept either name.
        all_names = set(self.model.state_dict())
        state = {k: v for k, v in state.items() if k in params or k not in all_names}
        unknown = sorted(set(state) - set(params))
        missing = sorted(set(params) - set(state)) if complete else []
        if unknown or missing:
            raise WeightUpdateError(
                f"{source} does not match the model: missing {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected {unknown[:5]}{'...' if len(unknown) > 5 else ''}")
        out = {}
        for name, tensor in state.items():
            p = params[name]
            if tuple(tensor.shape) != tuple(p.shape):
                raise WeightUpdateError(f"{name}: shape {tuple(tensor.shape)} in {source}, model has {tuple(p.shape)}")
            out[name] = tensor.to(dtype=p.dtype, device=p.device)
        return out

    # ------------------------------------------------------------------ decoding thread

    def _finish(self, req: _Request, reason: str) -> None:
        if req.future.done():
            return
        meta: dict[str, Any] = {"id": req.rid, "prompt_tokens": len(req.input_ids),
                                "e2e_latency": time.monotonic() - req.created}
        if reason == "stop":
            meta["finish_reason"] = {"type": "stop", "matched": req.matched}
        elif reason == "length":
            meta["finish_reason"] = {"type": "length", "length": len(req.output_ids)}
        else:
            meta["finish_reason"] = {"type": "abort", "message": "Abort in waiting queue" if not req.output_ids
                                     else "Abort by pause_generation"}
        label = self.weight_label
        req.future.set_result(GenerateResult(list(req.output_ids), list(req.logprobs), reason,  # type: ignore[arg-type]
                                             label.version, meta, weight_timeline=label.timeline))

    def _take_batch(self) -> list[_Request]:
        with self._cond:
            while not self._closed and (self._pause_mode is not None or not self._waiting):
                self._cond.wait()
            if self._closed:
                return []
            if len(self._waiting) < self.max_batch_size and self.batch_wait_s > 0:
                # a short window lets the n samples of a group (sent together) share one batch
                self._cond.wait(timeout=self.batch_wait_s)
                if self._pause_mode is not None or not self._waiting:
                    return []
            batch = [self._waiting.popleft() for _ in range(min(self.max_batch_size, len(self._waiting)))]
            self._running = batch
            self._busy = True
            return batch

    def _loop(self) -> None:
        while True:
            batch = self._take_batch()
            if not batch:
                with self._cond:
                    if self._closed:
                        return
                continue
            try:
                self._run_batch(batch)
            except Exception as exc:  # never kill the thread: fail this batch's requests
                for req in batch:
                    if not req.future.done():
                        req.future.set_exception(exc)
            finally:
                with self._cond:
                    self._running = []
                    self._busy = False
                    self._cond.notify_all()

    def _check_pause(self, active: list[_Request]) -> bool:
        """At a token boundary: handle a pause. True if the batch must stop."""
        with self._cond:
            mode = self._pause_mode
            if mode is None and not self._closed:
                return False
            if mode == "retract" and not self._closed:
                for req in reversed(active):
                    self._waiting.appendleft(req)  # continue after resume from prompt + partial output
            else:
                for req in active:
                    self._finish(req, "abort")
            return True

    def _regroup(self, active: list[_Request]) -> bool:
        """Let waiting requests join: requeue the running ones (continued from prompt + output so far).

        Static batches would leave late arrivals waiting for the whole batch; re-prefilling the
        running rows costs about one forward over their tokens and keeps the batch full. Triggered
        only when enough are waiting, so a steady trickle does not re-prefill at every token.
        """
        with self._cond:
            waiting = len(self._waiting)
            if waiting == 0 or waiting < max(1, len(active) // 2) or len(active) + waiting > self.max_batch_size:
                return False
            for req in reversed(active):
                self._waiting.appendleft(req)
            return True

    @torch.inference_mode()
    def _run_batch(self, batch: list[_Request]) -> None:
        model, device = self.model, self.device
        rows = [r.input_ids + r.output_ids for r in batch]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, r in enumerate(rows):  # left padding: every row's last token is at the end
            ids[i, width - len(r):] = torch.tensor(r)
            mask[i, width - len(r):] = 1
        ids, mask = ids.to(device), mask.to(device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        temps = torch.tensor([r.params.temperature if r.params.temperature > 0 else 1.0 for r in batch],
                             dtype=torch.float32, device=device).unsqueeze(-1)
        greedy = [r.params.temperature <= 0 for r in batch]
        remaining = [r.params.max_new_tokens - len(r.output_ids) for r in batch]
        done = [False] * len(batch)
        for i, left in enumerate(remaining):
            if left <= 0:
                self._finish(batch[i], "length")
                done[i] = True
        if all(done):
            return
        with self._model_lock:
            # logits of the last position only: the full [B, L, vocab] head is most of a CPU prefill
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1)
        past = out.past_key_values
        logits = out.logits[:, -1, :]
        while True:
            logprobs_all = torch.log_softmax(logits.float() / temps, dim=-1)
            tokens = self._sample(logits.float() / temps, logprobs_all, batch, greedy)
            token_lp = logprobs_all.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            tok_list, lp_list = tokens.tolist(), token_lp.tolist()
            for i, req in enumerate(batch):
                if done[i]:
                    continue
                t = tok_list[i]
                req.output_ids.append(t)
                req.logprobs.append(lp_list[i])
                self.tokens_generated += 1
                if t in self.eos_token_ids or t in req.params.stop_token_ids:
                    req.matched = t
                    self._finish(req, "stop")
                    done[i] = True
                elif len(req.output_ids) >= req.params.max_new_tokens:
                    self._finish(req, "length")
                    done[i] = True
            if all(done):
                return
            active = [r for r, d in zip(batch, done) if not d]
            if self._check_pause(active) or self._regroup(active):
                return
            mask = torch.cat([mask, torch.ones((len(batch), 1), dtype=mask.dtype, device=device)], dim=-1)
            positions = positions[:, -1:] + 1
            with self._model_lock:
                out = model(input_ids=tokens.unsqueeze(-1), attention_mask=mask, position_ids=positions,
                            past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits = out.logits[:, -1, :]

    def _sample(self, scaled: torch.Tensor, logprobs: torch.Tensor, batch: list[_Request],
                greedy: list[bool]) -> torch.Tensor:
        """Sample from the temperature-scaled distribution, truncated per row by top-k / top-p."""
        probs = logprobs.exp()
        for i, req in enumerate(batch):
            k, p = req.params.top_k, req.params.top_p
            if k is not None and 0 < k < probs.shape[-1]:
                kth = torch.topk(scaled[i], k).values[-1]
                probs[i] = torch.where(scaled[i] < kth, torch.zeros_like(probs[i]), probs[i])
            if p is not None and p < 1.0:
                sorted_p, order = torch.sort(probs[i], descending=True)
                keep = (sorted_p.cumsum(-1) - sorted_p) < p
                filtered = torch.zeros_like(probs[i])
                filtered[order[keep]] = sorted_p[keep]
                probs[i] = filtered
        tokens = torch.multinomial(probs, 1, generator=self.generator).squeeze(-1)
        if any(greedy):
            argmax = scaled.argmax(-1)
            g = torch.tensor(greedy, device=tokens.device)
            tokens = torch.where(g, argmax, tokens)
        return tokens
