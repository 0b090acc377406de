"""Rendering a prompt (a question, or a chat of messages) into prompt token ids with the model's chat template.

The worker sends token ids (not text) to every engine, so the tokens the trainer sees are exactly
the ones that were sampled from: no re-tokenisation drift between rollout and training.
"""

from __future__ import annotations

import json
from typing import Any

from asyncrl.api.episodes import Role
from asyncrl.rollout.data.datasets import PromptItem

_PROBE = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}, {"role": "assistant", "content": "A"}]
"""A conversation ending with a model turn: what ChatTurns renders the next message after."""


def hermes_tools_text(tools: list[dict[str, Any]]) -> str:
    """The tools described in the Hermes function-calling format (one JSON schema per line)."""
    schemas = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("You may call functions to help you answer. Their JSON schemas:\n<tools>\n" + schemas + "\n</tools>\n"
            "To call one, write a JSON object with its name and arguments inside tags, one block per call:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>\n'
            "Each call's result comes back in the next message. Without a call, your message is your answer.")


class PromptRenderer:
    """prompt -> token ids: optional template `{prompt}`, optional system message, chat template.

    An item with `messages` (dataset.messagesField) is rendered as that chat: the template wraps its
    last (user) message, and the system prompt is added only when the chat has no system message of
    its own (the data's wins: it was written for that conversation)."""

    def __init__(self, tokenizer: Any, template: str | None = None, system_prompt: str | None = None,
                 tools: list[dict[str, Any]] | None = None):
        if template is not None and "{prompt}" not in template:
            raise ValueError("dataset.promptTemplate must contain '{prompt}'")
        self.tokenizer, self.template, self.system_prompt = tokenizer, template, system_prompt
        self.tools = tools or None
        """JSON schemas of the tools the model may call (spec.rollout.tools), described in the prompt."""
        self._native_tools = bool(self.tools) and self._template_renders_tools()
        """The template has its own tool format (else the Hermes text goes in the system message)."""

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
            text = self._with_tools(msgs)
        else:  # a base model without a template: plain text
            if self.tools:
                msgs.insert(0, {"role": "system", "content": hermes_tools_text(self.tools)})
            text = "\n".join(m["content"] for m in msgs) + "\n"
        return list(tok(text, add_special_tokens=False)["input_ids"])

    def _template_renders_tools(self) -> bool:
        """Whether the chat template uses `tools=` (probed once: SmolLM2's ignores it, Qwen2.5's does not)."""
        if not getattr(self.tokenizer, "chat_template", None):
            return False
        probe, render = [{"role": "user", "content": "U"}], self.tokenizer.apply_chat_template
        return bool(render(probe, tools=self.tools, add_generation_prompt=True, tokenize=False)
                    != render(probe, add_generation_prompt=True, tokenize=False))

    def _with_tools(self, msgs: list[dict[str, str]]) -> str:
        """The chat rendered with the template's own tool format; a template that ignores `tools`
        (SmolLM2's) gets them in the system message, in the Hermes format its family was tuned on."""
        render = self.tokenizer.apply_chat_template
        if not self.tools or self._native_tools:
            return render(msgs, tools=self.tools, add_generation_prompt=True, tokenize=False)
        described = hermes_tools_text(self.tools)
        if msgs[0]["role"] == "system":
            msgs = [{"role": "system", "content": msgs[0]["content"] + "\n\n" + described}, *msgs[1:]]
        else:
            msgs = [{"role": "system", "content": described}, *msgs]
        return render(msgs, add_generation_prompt=True, tokenize=False)

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


class ChatTurns:
    """The chat template's tokens around a model turn, for episodes that continue after it.

    An observation is the template's rendering of that one message right after a model turn, cut
    right after the turn's end-of-turn token (what the engine stopped on) and tokenized on its own:
    the model is conditioned on exactly what a conversation rendered whole would show it, and the
    tokens before never change (token in, token out: no re-tokenisation)."""

    def __init__(self, tokenizer: Any, stop_token_ids: tuple[int, ...]) -> None:
        self.tokenizer = tokenizer
        self.has_template = bool(getattr(tokenizer, "chat_template", None))
        self.end_of_turn = self._end_of_turn(stop_token_ids)
        """The token that ends a model turn in the template (None: no template, no such token)."""
        self._cut = self._probe_cut()
        self._opening = self._probe_opening()
        """generation_prompt's tokens (the same before every turn: rendered once)."""

    def _render(self, msgs: list[dict[str, str]], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(msgs, add_generation_prompt=generation_prompt, tokenize=False)

    def _end_of_turn(self, stop_token_ids: tuple[int, ...]) -> int | None:
        if not self.has_template:
            return None
        text = self._render(_PROBE, False)
        for tid in stop_token_ids:
            mark = self.tokenizer.decode([tid])
            if mark and "A" + mark in text:
                return tid
        return None

    def _probe_cut(self) -> int:
        """Where the probe's model turn ends in its rendering (after its end-of-turn text)."""
        if not self.has_template:
            return 0
        text = self._render(_PROBE, False)
        mark = "" if self.end_of_turn is None else self.tokenizer.decode([self.end_of_turn])
        return text.rindex("A" + mark) + 1 + len(mark)

    def _ids(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def observation(self, content: str, role: Role = "user") -> list[int]:
        """A message after a model turn, as tokens (no generation prompt: see generation_prompt)."""
        if not self.has_template:
            return self._ids("\n" + content + "\n")
        text = self._render([*_PROBE, {"role": role, "content": content}], False)
        return self._ids(text[self._cut:])

    def generation_prompt(self) -> list[int]:
        """The tokens that open a model turn after a message."""
        return list(self._opening)

    def _probe_opening(self) -> list[int]:
        if not self.has_template:
            return []
        msgs = [*_PROBE, {"role": "user", "content": "O"}]
        closed, opened = self._render(msgs, False), self._render(msgs, True)
        return self._ids(opened[len(closed):])
