"""The Python API: `LLM(...).generate(prompts, params)` and `.chat(conversations, params)`."""
from __future__ import annotations

import functools
import logging
import os
import re
import time
from typing import Iterable, Iterator, Sequence as Seq

import jinja2
import jinja2.meta

from kvreplay.config import EngineConfig
from kvreplay.engine import step_log, summary
from kvreplay.engine.llm_engine import LLMEngine
from kvreplay.outputs import RequestOutput
from kvreplay.sampling import SamplingParams

Message = dict[str, str]  # role, content (and for tool use: tool_calls, tool_call_id)
CHAT_ROLES = ("system", "user", "assistant")
TOOL_ROLE = "tool"  # a tool's result: only for templates that take tools

logger = logging.getLogger(__name__)


class LLM:
    """An engine for offline batch generation.

    Every keyword is an `EngineConfig` field (model, dtype, device, kv_cache_memory, policy
    and **knobs for the rest); each field's help there is its one description.

    Example:
        >>> llm = LLM(dtype="float32")
        >>> llm.generate("The capital of France is", SamplingParams(max_tokens=8, temperature=0)).text
    """

    def __init__(self, model: str | None = None, dtype: str = "bfloat16", device: str | None = None,
                 kv_cache_memory: int | str = "256MiB", policy: str = "full", **knobs):
        unknown = set(knobs) - set(EngineConfig.__dataclass_fields__)
        if unknown:
            raise TypeError(f"unknown LLM option(s): {', '.join(sorted(unknown))}; "
                            f"known: {', '.join(EngineConfig.__dataclass_fields__)}")
        if device is not None:
            knobs["device"] = device
        self.config = EngineConfig(model=model, dtype=dtype,
                                   kv_cache_memory=kv_cache_memory, policy=policy, **knobs)
        started = time.perf_counter()
        self.engine = LLMEngine(self.config)
        self.tokenizer = self.engine.tokenizer
        for line in summary.describe(self.engine, time.perf_counter() - started):
            logger.info(line)

    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False, on_step=None,
                 protected_tokens: int | Seq[int] | None = None,
                 hot_from: Seq[int | None] | None = None, keep: bool = False,
                 continues: Seq[str | None] | None = None):
        """Generate for one prompt (returns one RequestOutput) or a list (returns a list, in order).

        A prompt is a string or a list of token ids. `on_step`, if given, is called after each
        engine step (tests use it to check integrity). `protected_tokens` marks the first tokens
        of each prompt (one int for all, or one per prompt) as a protected zone: pinned, never
        dropped while the request lives. `hot_from` (one per prompt, None for none): the cold
        presets keep tokens from there on in full precision (`chat` passes its last rounds).
        `keep`: each request's KV stays, as its policy left it, after it finishes; `continues`
        (one per prompt, None for none): the request id of a kept request whose tokens the
        prompt extends, so only the new tokens are prefilled (a chat's next round; `release`
        frees a kept request)."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                               and isinstance(prompts[0], int))
        batch = [prompts] if single else list(prompts)
        if isinstance(params, (list, tuple)):
            if len(params) != len(batch):
                raise ValueError(f"{len(params)} SamplingParams for {len(batch)} prompts")
            param_list = list(params)
        else:
            param_list = [params or SamplingParams()] * len(batch)
        if protected_tokens is None or isinstance(protected_tokens, int):
            protected = [protected_tokens or 0] * len(batch)
        else:
            protected = list(protected_tokens)
            if len(protected) != len(batch):
                raise ValueError(f"{len(protected)} protected_tokens for {len(batch)} prompts")
        hot = [None] * len(batch) if hot_from is None else list(hot_from)
        if len(hot) != len(batch):
            raise ValueError(f"{len(hot)} hot_from values for {len(batch)} prompts")
        after = [None] * len(batch) if continues is None else list(continues)
        if len(after) != len(batch):
            raise ValueError(f"{len(after)} continues values for {len(batch)} prompts")
        vocab_size = self.engine.model_config.vocab_size
        for param in param_list:
            if isinstance(param, SamplingParams):  # the engine refuses anything else
                param.check_token_ids(vocab_size)
        ids = []
        try:
            for prompt, param, span, start, kept in zip(batch, param_list, protected, hot, after):
                ids.append(self.engine.add_request(prompt, param, protected_tokens=span, hot_from=start,
                                                   keep=keep, continues=kept))
        except Exception:
            for request_id in ids:  # nothing half-queued survives a bad prompt in the batch
                self.engine.abort_request(request_id)
            raise
        results = self._run(ids, use_tqdm, on_step)
        outputs = [results[i] for i in ids]
        return outputs[0] if single else outputs

    def release(self, request_id: str) -> bool:
        """Free a request kept with `generate(keep=True)`; False when none has that id."""
        return self.engine.release(request_id)

    def chat(self, conversations: list[Message] | Seq[list[Message]],
             params: SamplingParams | Seq[SamplingParams] | None = None, use_tqdm: bool = False,
             on_step=None, protect_system: bool = True, tools: list[dict] | None = None):
        """Apply the model's chat template to each conversation, then generate. The system
        message span (`system_span_tokens`) is a protected zone unless `protect_system=False`.
        `tools` (OpenAI function definitions) are rendered by templates that take them
        (`supports_tools`; ValueError otherwise); the spans are then not found (no protected zone)."""
        single = bool(conversations) and isinstance(conversations[0], dict)
        batch = [conversations] if single else list(conversations)
        prompts = [self.chat_prompt_ids(conv, tools) for conv in batch]
        protected = [self.system_span_tokens(conv) if protect_system and not tools else 0 for conv in batch]
        hot_from = [None if tools else self.recent_rounds_start(conv) for conv in batch]
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm, on_step=on_step,
                                protected_tokens=protected, hot_from=hot_from)
        return outputs[0] if single else outputs

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None,
               protected_tokens: int = 0, hot_from: int | None = None) -> Iterator[RequestOutput]:
        """Generate for one prompt, yielding its output after each step that added to it (the
        text so far; `finished` on the last). The request is checked and queued at once (a bad
        prompt raises here, not at the first step); closing the iterator early, or Ctrl-C while
        it runs, aborts the request and frees its blocks."""
        params = params or SamplingParams()
        if isinstance(params, SamplingParams):
            params.check_token_ids(self.engine.model_config.vocab_size)
        request_id = self.engine.add_request(prompt, params, stream=True,
                                             protected_tokens=protected_tokens, hot_from=hot_from)
        return self._follow(request_id)

    def chat_stream(self, conversation: list[Message], params: SamplingParams | None = None,
                    protect_system: bool = True) -> Iterator[RequestOutput]:
        """`chat` for one conversation, streamed as `stream` streams (`kvreplay chat`)."""
        return self.stream(self.chat_prompt_ids(conversation), params,
                           self.system_span_tokens(conversation) if protect_system else 0,
                           self.recent_rounds_start(conversation))

    def _follow(self, request_id: str) -> Iterator[RequestOutput]:
        try:
            while True:
                for output in step_log.step(self.engine):
                    if output.request_id == request_id:
                        yield output
                        if output.finished:
                            return
        finally:
            if request_id in self.engine.requests:  # closed early: leave no blocks behind
                self.engine.abort_request(request_id)

    def recent_rounds_start(self, conversation: list[Message], rounds: int | None = None) -> int | None:
        """First token of the conversation's last `rounds` rounds (a round starts at a user
        message; default: the engine's `hot_turns`), which the cold presets keep in full
        precision (the seeds' multi-turn rule). None when `rounds` is 0, when the chat has no
        older round (a single long message is compressed like any prompt, beyond the window),
        or when the template's rendering of the earlier messages is not a prefix of the prompt."""
        rounds = self.engine.config.hot_turns if rounds is None else rounds
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
        """Whether the model's chat template renders a `tools` list (tool calling needs it)."""
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

    def _run(self, ids: Iterable[str], use_tqdm: bool, on_step) -> dict[str, RequestOutput]:
        pending = set(ids)
        results: dict[str, RequestOutput] = {}
        progress = None
        if use_tqdm:  # requests done, and the tokens generated so far (max_tokens=None can run long)
            from tqdm import tqdm
            progress = tqdm(total=len(pending), desc="generating", unit="req")
            first_token = self.engine.counters.generation_tokens
        try:
            while pending:
                for output in step_log.step(self.engine):
                    if output.finished and output.request_id in pending:
                        results[output.request_id] = output
                        pending.discard(output.request_id)
                        if progress:
                            progress.update(1)
                if progress:  # update(0) redraws when tqdm's interval has passed
                    progress.set_postfix_str(
                        f"{self.engine.counters.generation_tokens - first_token} tokens", refresh=False)
                    progress.update(0)
                if on_step is not None:
                    on_step(self.engine)
        except BaseException:
            for request_id in pending:  # Ctrl-C or an error: leave no blocks behind
                self.engine.abort_request(request_id)
            raise
        finally:
            if progress:
                progress.close()
        return results
