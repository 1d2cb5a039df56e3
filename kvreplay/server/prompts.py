"""Prompts -> token ids, off the engine thread.

Rendering a chat template and tokenizing take time in proportion to the prompt: done on the engine
thread, one pasted megabyte would stall every stream for seconds. So the event loop first refuses
a prompt by its size in bytes (cheap, before any tokenizing), then a thread of this module's own,
holding a private copy of the tokenizer (a tokenizer is not safe to share across threads), renders
and tokenizes it and checks its length in tokens; the engine thread only queues the ids. On a
machine with few cores that thread still takes a core from the engine's while it works, so it runs
at a lower OS priority (`tokenize_nice`): the streams keep their pace, a long prompt waits.
"""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import jinja2

from kvreplay.server.config import PROMPT_BYTES_PER_TOKEN
from kvreplay.server.generation import PromptTooLongError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedPrompt:
    """What the engine thread needs to queue one prompt."""
    token_ids: list[int]
    protected_tokens: int = 0        # a chat's system message, a protected zone (as in LLM.chat)
    hot_from: int | None = None      # where a chat's last rounds start (LLM.recent_rounds_start)


class PromptPreparer:
    """Checks and tokenizes prompts (strings, token ids, or conversations) for one LLM.

    Args:
        llm: the loaded model; only a private copy of its chat template (and tokenizer) is used here.
        max_prompt_bytes: a prompt over this many UTF-8 bytes is refused before tokenizing
            (None: PROMPT_BYTES_PER_TOKEN per token of the context).
        nice: added to the tokenizing thread's OS niceness (Linux: per thread; 0 leaves it).
    """

    def __init__(self, llm, max_prompt_bytes: int | None = None, nice: int = 0):
        self.max_model_len = llm.engine.max_model_len
        self.max_prompt_bytes = max_prompt_bytes or PROMPT_BYTES_PER_TOKEN * self.max_model_len
        self._template = llm.engine.chat_template.private_copy()
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="kvreplay-tokenize",
                                            initializer=_lower_priority, initargs=(nice,))

    def check_sizes(self, prompts: list, chat: bool) -> None:
        """Refuse a prompt whose bytes (or token ids) cannot fit the context; cheap: no tokenizing."""
        for prompt in prompts:
            if not chat and isinstance(prompt, list):
                self._check_tokens(len(prompt))
                continue
            size = (sum(len(m["content"].encode()) + len(m["role"]) for m in prompt) if chat
                    else len(prompt.encode()))
            if size > self.max_prompt_bytes:
                raise PromptTooLongError(
                    f"the prompt has {size:,} bytes; this server tokenizes at most "
                    f"{self.max_prompt_bytes:,} (max_prompt_bytes; the context is "
                    f"{self.max_model_len:,} tokens): shorten it")

    async def prepare(self, prompts: list, chat: bool, tools: list[dict] | None = None) -> list[PreparedPrompt]:
        """Each prompt's token ids, made on the tokenizing thread (after check_sizes); a chat's
        `tools` go to its template. Raises ValueError (or TypeError) for a prompt the engine
        could not take."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._prepare_all, prompts, chat, tools)

    async def tokenize(self, prompt: str | list[dict[str, str]], add_special_tokens: bool,
                       add_generation_prompt: bool = True) -> list[int]:
        """The token ids of a text, or of a conversation rendered by the chat template, made on
        the tokenizing thread (after check_sizes); with the defaults for a conversation
        (add_special_tokens False, add_generation_prompt True) the ids a chat completion gets."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._tokenize, prompt, add_special_tokens,
                                          add_generation_prompt)

    async def detokenize(self, token_ids: list[int]) -> str:
        """The text of token ids, special tokens included, made on the tokenizing thread."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, self._template.tokenizer.decode, token_ids)

    # ------------------------------------------------------------------ tokenizing thread
    def _tokenize(self, prompt, add_special_tokens: bool, add_generation_prompt: bool) -> list[int]:
        tokenizer = self._template.tokenizer
        if isinstance(prompt, str):
            return list(tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
        try:
            if add_generation_prompt and not add_special_tokens:
                return self._template.chat_prompt_ids(prompt)
            text = tokenizer.apply_chat_template(prompt, tokenize=False,
                                                 add_generation_prompt=add_generation_prompt)
            return list(tokenizer(text, add_special_tokens=add_special_tokens).input_ids)
        except jinja2.TemplateError as exc:
            raise ValueError(f"the model's chat template refused the messages: {exc}") from exc

    def _prepare_all(self, prompts: list, chat: bool, tools: list[dict] | None) -> list[PreparedPrompt]:
        return [self._prepare_chat(prompt, tools) if chat else self._prepare_text(prompt)
                for prompt in prompts]

    def _prepare_text(self, prompt) -> PreparedPrompt:
        token_ids = self._template.tokenize(prompt)  # token ids: checked against the vocabulary
        self._check_tokens(len(token_ids))
        return PreparedPrompt(token_ids)

    def _prepare_chat(self, conversation: list[dict[str, str]], tools: list[dict] | None) -> PreparedPrompt:
        template = self._template
        try:
            token_ids = template.chat_prompt_ids(conversation, tools)
            self._check_tokens(len(token_ids))
            if tools:  # the spans below are found from renderings without the tools
                return PreparedPrompt(token_ids)
            return PreparedPrompt(token_ids, template.system_span_tokens(conversation),
                                  template.recent_rounds_start(conversation))
        except jinja2.TemplateError as exc:
            raise ValueError(f"the model's chat template refused the messages: {exc}") from exc

    def _check_tokens(self, num_tokens: int) -> None:
        if num_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_tokens:,} tokens but the context is {self.max_model_len:,}: "
                f"shorten it (leave room for one output token)")


def _lower_priority(nice: int) -> None:
    """Raise the calling thread's niceness by `nice` (on Linux a thread's own; raising needs no
    privilege)."""
    if not nice or not hasattr(os, "setpriority"):
        return
    thread_id = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, thread_id, os.getpriority(os.PRIO_PROCESS, thread_id) + nice)
    except OSError as exc:
        logger.warning("could not lower the tokenizing thread's priority: %s", exc)

