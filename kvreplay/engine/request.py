"""The engine's record of a request, and the checks a request passes before it is queued."""
from __future__ import annotations

from dataclasses import dataclass

from kvreplay.engine.sequence import Sequence
from kvreplay.outputs import CompletionOutput, RequestOutput
from kvreplay.sampling import SamplingParams


@dataclass
class Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]  # its branches (n > 1) or, for beam search, the live beams
    stream: bool
    keep: bool = False  # park its sequence with its KV when it finishes (engine/sessions.py)

    def output(self) -> RequestOutput:
        """What generation returns for it now (a snapshot: lists copied)."""
        completions = [CompletionOutput(seq.branch, seq.text, list(seq.output_token_ids),
                                        seq.finish_reason,
                                        list(seq.logprobs) if seq.params.logprobs is not None else None,
                                        seq.stats)
                       for seq in self.seqs]
        return RequestOutput(self.request_id, self.prompt, self.prompt_token_ids, completions,
                             finished=all(seq.is_finished for seq in self.seqs))


def prompt_token_ids(tokenizer, prompt: str | list[int], vocab_size: int) -> list[int]:
    """A prompt's token ids: a string tokenized, a list of ids checked against the vocabulary."""
    if isinstance(prompt, str):
        return tokenizer(prompt, add_special_tokens=True).input_ids
    if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) and not isinstance(t, bool)
                                                  for t in prompt):
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"token ids must be in [0, {vocab_size}), got {bad[:5]}")
        return list(prompt)
    raise TypeError(f"a prompt is a string or a list of token ids, got {type(prompt).__name__}")


def check_request(token_ids: list[int], params: SamplingParams, max_model_len: int, capacity: int,
                  kv_cache_memory: str, protected_tokens: int, hot_from: int | None) -> int:
    """A ValueError naming what to change for a request the engine cannot serve; else the
    request's max_tokens (the rest of the context when params leave it open)."""
    if not token_ids:
        raise ValueError("the prompt is empty: give at least one token")
    num_prompt = len(token_ids)
    if num_prompt >= max_model_len:
        raise ValueError(f"the prompt has {num_prompt:,} tokens but the context is "
                         f"{max_model_len:,}: shorten it (leave room for one output token)")
    max_tokens = params.max_tokens if params.max_tokens is not None else max_model_len - num_prompt
    if num_prompt + max_tokens > max_model_len:
        raise ValueError(f"prompt ({num_prompt:,} tokens) + max_tokens ({max_tokens:,}) exceeds "
                         f"the context of {max_model_len:,} tokens: lower max_tokens")
    if isinstance(protected_tokens, bool) or not isinstance(protected_tokens, int) \
            or protected_tokens < 0:
        raise ValueError(f"protected_tokens must be an integer >= 0, got {protected_tokens!r}")
    if protected_tokens > capacity:
        raise ValueError(
            f"the protected span has {protected_tokens:,} tokens but kv_cache_memory="
            f"{kv_cache_memory!r} holds {capacity:,}: raise kv_cache_memory or "
            f"protect less")
    if num_prompt + max_tokens > capacity:
        raise ValueError(
            f"kv_cache_memory={kv_cache_memory!r} holds {capacity:,} tokens; this "
            f"request needs up to {num_prompt + max_tokens:,} (prompt {num_prompt:,} + max_tokens "
            f"{max_tokens:,}): raise kv_cache_memory or lower max_tokens")
    if protected_tokens > num_prompt:
        raise ValueError(f"protected_tokens={protected_tokens:,} is longer than the prompt "
                         f"({num_prompt:,} tokens): protect a prefix of the prompt")
    if hot_from is not None and (isinstance(hot_from, bool) or not isinstance(hot_from, int)
                                 or not 0 <= hot_from <= num_prompt):
        raise ValueError(f"hot_from must be None or a prompt position in [0, {num_prompt}], "
                         f"got {hot_from!r}")
    return max_tokens
