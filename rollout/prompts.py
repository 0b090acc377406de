"""Rendering a question into prompt token ids with the model's chat template.

The worker sends token ids (not text) to every engine, so the tokens the trainer sees are exactly
the ones that were sampled from: no re-tokenisation drift between rollout and training.
"""

from __future__ import annotations

from typing import Any


class PromptRenderer:
    """question -> token ids: optional template `{prompt}`, optional system message, chat template."""

    def __init__(self, tokenizer: Any, template: str | None = None, system_prompt: str | None = None):
        if template is not None and "{prompt}" not in template:
            raise ValueError("dataset.promptTemplate must contain '{prompt}'")
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt

    def messages(self, question: str) -> list[dict[str, str]]:
        content = self.template.format(prompt=question) if self.template else question
        msgs = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return msgs + [{"role": "user", "content": content}]

    def render(self, question: str) -> list[int]:
        tok = self.tokenizer
        msgs = self.messages(question)
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
        else:  # a base model without a template: plain text
            text = "\n".join(m["content"] for m in msgs) + "\n"
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def stop_token_ids(self) -> tuple[int, ...]:
        """End-of-turn tokens of the chat format (engines stop on them as well as on EOS)."""
        tok, ids = self.tokenizer, set()
        if tok.eos_token_id is not None:
            ids.add(int(tok.eos_token_id))
        for name in ("<|im_end|>", "<|eot_id|>", "<|end|>"):
            tid = tok.convert_tokens_to_ids(name)
            if isinstance(tid, int) and tid != getattr(tok, "unk_token_id", None) and tid >= 0:
                ids.add(tid)
        return tuple(sorted(ids))
