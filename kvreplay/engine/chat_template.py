"""A model's chat template rendered to prompt token ids, and the spans of a chat the KV
policies care about: the system part (a protected zone) and the last rounds (kept in full
precision by the cold presets).

It owns the tokenizer it renders with. A tokenizer is not safe to share across threads, so a
caller on another thread (the server's prompt preparer) takes a `private_copy()`.
"""
from __future__ import annotations

import copy
import functools
import os
import re

import jinja2
import jinja2.meta

from kvreplay.engine.request import prompt_token_ids

Message = dict[str, str]  # role, content (and for tool use: tool_calls, tool_call_id)
CHAT_ROLES = ("system", "user", "assistant")
TOOL_ROLE = "tool"  # a tool's result: only for templates that take tools


class ChatTemplate:
    """Renders conversations with `tokenizer`'s chat template; `hot_turns` is the default
    number of recent rounds for `recent_rounds_start`."""

    def __init__(self, tokenizer, vocab_size: int, hot_turns: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.hot_turns = hot_turns

    def private_copy(self) -> "ChatTemplate":
        """The same template over a deep copy of the tokenizer, for use on another thread."""
        return ChatTemplate(copy.deepcopy(self.tokenizer), self.vocab_size, self.hot_turns)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        """A plain prompt's ids: a string tokenized, token ids checked against the vocabulary."""
        return prompt_token_ids(self.tokenizer, prompt, self.vocab_size)

    def recent_rounds_start(self, conversation: list[Message], rounds: int | None = None) -> int | None:
        """First token of the conversation's last `rounds` rounds (a round starts at a user
        message; default: `hot_turns`), which the cold presets keep in full precision (the seeds'
        multi-turn rule). None when `rounds` is 0, when the chat has no older round (a single long
        message is compressed like any prompt, beyond the window), or when the template's
        rendering of the earlier messages is not a prefix of the prompt."""
        rounds = self.hot_turns if rounds is None else rounds
        users = [i for i, m in enumerate(conversation) if m.get("role") == "user"]
        if not rounds or len(users) <= rounds:
            return None
        cut = users[-rounds]
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        head = self.tokenizer.apply_chat_template(conversation[:cut], tokenize=False)
        if not text.startswith(head):
            return None
        return self._tokens_before(conversation, text, len(head))

    def system_span_tokens(self, conversation: list[Message]) -> int:
        """Tokens of the chat prompt that belong to the system part, found from the template's
        rendering and the tokenizer's character offsets. Explicit system messages end where the
        template's rendering of them alone ends; a system prompt the template inserts by itself
        ends where the line holding the first message's content begins (its header included)."""
        tokenizer = self.tokenizer
        text = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        end = 0
        num_system = next((i for i, m in enumerate(conversation) if m["role"] != "system"),
                          len(conversation))
        if num_system:
            head = tokenizer.apply_chat_template(conversation[:num_system], tokenize=False)
            end = len(head) if text.startswith(head) else 0
        elif conversation:
            probes = [tokenizer.apply_chat_template(
                [{**conversation[0], "content": probe}] + conversation[1:], tokenize=False,
                add_generation_prompt=True) for probe in ("\x01", "\x02")]
            common = len(os.path.commonprefix(probes))
            end = text.rfind("\n", 0, max(common - 1, 0)) + 1
        if not end:
            return 0
        return self._tokens_before(conversation, text, end) or 0

    def _tokens_before(self, conversation: list[Message], text: str, end: int) -> int | None:
        """Prompt tokens that end at or before character `end` of the rendered `text`; None
        when the template's ids are not a plain tokenization of its text."""
        encoded = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        if list(encoded.input_ids) != self.chat_prompt_ids(conversation):
            return None
        return sum(1 for _, stop in encoded.offset_mapping if stop <= end)

    @functools.cached_property
    def supports_tools(self) -> bool:
        """Whether the chat template renders a `tools` list (tool calling needs it)."""
        template = getattr(self.tokenizer, "chat_template", None)
        if isinstance(template, dict):  # named templates: the tool-use one, if any
            template = template.get("tool_use") or template.get("default")
        if not isinstance(template, str):
            return False
        try:
            parsed = jinja2.Environment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
            return "tools" in jinja2.meta.find_undeclared_variables(parsed)
        except jinja2.TemplateSyntaxError:  # tags of transformers' own: read the text instead
            return re.search(r"\btools\b", template) is not None

    def chat_prompt_ids(self, conversation: list[Message], tools: list[dict] | None = None) -> list[int]:
        """The prompt's token ids: the chat template applied to the conversation (and `tools`,
        OpenAI function definitions, for a template that takes them: `supports_tools`)."""
        if not conversation or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                                       and isinstance(m.get("content"), str) for m in conversation):
            raise ValueError("a conversation is a non-empty list of {'role': ..., 'content': str} dicts")
        if tools and not self.supports_tools:
            raise ValueError("this model's chat template does not take tools: tool calling is not "
                             "available with it")
        roles = CHAT_ROLES + ((TOOL_ROLE,) if self.supports_tools else ())
        unknown = [m["role"] for m in conversation if m["role"] not in roles]
        if unknown:
            raise ValueError(f"unknown chat role {unknown[0]!r}: a message's role is one of "
                             f"{', '.join(roles)}")
        extra = {"tools": tools} if tools else {}
        ids = self.tokenizer.apply_chat_template(conversation, add_generation_prompt=True,
                                                 tokenize=True, **extra)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
