"""The Python API: `LLM(...).generate(prompts, params)` and `.chat(conversations, params)`."""
from __future__ import annotations

import logging
import time
from typing import Iterable, Iterator, Sequence as Seq

from kvreplay.config import EngineConfig
from kvreplay.engine import step_log, summary
from kvreplay.engine.chat_template import Message
from kvreplay.engine.llm_engine import LLMEngine
from kvreplay.outputs import RequestOutput
from kvreplay.sampling import SamplingParams

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

    # the chat template's renderings (engine/chat_template.py), for users of LLM alone
    def recent_rounds_start(self, conversation: list[Message], rounds: int | None = None) -> int | None:
        return self.engine.chat_template.recent_rounds_start(conversation, rounds)

    def system_span_tokens(self, conversation: list[Message]) -> int:
        return self.engine.chat_template.system_span_tokens(conversation)

    def chat_prompt_ids(self, conversation: list[Message], tools: list[dict] | None = None) -> list[int]:
        return self.engine.chat_template.chat_prompt_ids(conversation, tools)

    @property
    def supports_tools(self) -> bool:
        return self.engine.chat_template.supports_tools

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
