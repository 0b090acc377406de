"""Rendering a prompt (a question, or a chat of messages) into prompt token ids with the model's chat template.

The worker sends token ids (not text) to every engine, so the tokens the trainer sees are exactly
the ones that were sampled from: no re-tokenisation drift between rollout and training.
"""

from __future__ import annotations

from typing import Any

from asyncrl.rollout.datasets import PromptItem


class PromptRenderer:
    """prompt -> token ids: optional template `{prompt}`, optional system message, chat template.

    An item with `messages` (dataset.messagesField) is rendered as that chat: the template wraps its
    last (user) message, and the system prompt is added only when the chat has no system message of
    its own (the data's wins: it was written for that conversation)."""

    def __init__(self, tokenizer: Any, template: str | None = None, system_prompt: str | None = None):
        if template is not None and "{prompt}" not in template:
            raise ValueError("dataset.promptTemplate must contain '{prompt}'")
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt

    def messages(self, prompt: PromptItem | str) -> list[dict[str, str]]:
        chat = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else (
            [dict(m) for m in prompt.messages] if prompt.messages else [{"role": "user", "content": prompt.question}])
        if self.template:
            chat[-1]["content"] = self.template.format(prompt=chat[-1]["content"])
        if self.system_prompt and chat[0]["role"] != "system":
            chat.insert(0, {"role": "system", "content": self.system_prompt})
        return chat

    def render(self, prompt: PromptItem | str) -> list[int]:
        """The prompt ids of an item (its chat, else its question) or of a question's text."""
        tok = self.tokenizer
        msgs = self.messages(prompt)
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
