"""Engine outputs -> OpenAI response JSON: choices, usage (with the `kv` counters), logprobs, and
the text deltas of a stream."""
from __future__ import annotations

import copy
import functools
from dataclasses import dataclass

from kvreplay.outputs import CompletionOutput, RequestOutput


def error_body(message: str, error_type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def finish_fields(finish_reason: str | None) -> dict:
    """A choice's `finish_reason` in OpenAI's terms. The only aborted request a client sees is one
    the server cut at shutdown (a client that leaves is sent nothing more): it ends with "length",
    as a cut reply does, and says why in `stop_reason`: "shutdown"."""
    if finish_reason == "abort":
        return {"finish_reason": "length", "stop_reason": "shutdown"}
    return {"finish_reason": finish_reason}


def usage(outputs: list[RequestOutput]) -> dict:
    """Token counts as OpenAI counts them (a prompt once, however many choices), plus `kv`: the
    request's KV counters (docs/architecture.md §5) summed over all its sequences."""
    completions = [completion for output in outputs for completion in output.outputs]
    prompt_tokens = sum(len(output.prompt_token_ids) for output in outputs)
    completion_tokens = sum(len(completion.token_ids) for completion in completions)
    kv: dict[str, int] = {}
    for completion in completions:
        for name, value in completion.stats.as_dict().items():
            kv[name] = kv.get(name, 0) + value
    kv.update(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens, "kv": kv}


class TokenFormatter:
    """Token ids -> the strings and logprob objects of the API.

    Holds a private copy of the tokenizer: the engine thread uses the original, and a tokenizer
    is not safe to share across threads.
    """

    def __init__(self, tokenizer):
        self._tokenizer = copy.deepcopy(tokenizer)
        self.token_text = functools.lru_cache(maxsize=1 << 16)(self._decode)

    def _decode(self, token_id: int) -> str:
        return self._tokenizer.decode([token_id])

    def _top(self, entry: dict[int, float], num_top: int) -> list[tuple[int, float]]:
        return sorted(entry.items(), key=lambda item: -item[1])[:num_top]

    def _chat_entry(self, token_id: int, logprob: float) -> dict:
        text = self.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode("utf-8"))}

    def chat_logprobs(self, token_ids: list[int], entries: list[dict[int, float]], num_top: int) -> dict:
        """`choices[i].logprobs` of /v1/chat/completions for these tokens."""
        content = []
        for token_id, entry in zip(token_ids, entries):
            item = self._chat_entry(token_id, entry[token_id])
            item["top_logprobs"] = [self._chat_entry(t, lp) for t, lp in self._top(entry, num_top)]
            content.append(item)
        return {"content": content}

    def completion_logprobs(self, token_ids: list[int], entries: list[dict[int, float]], num_top: int,
                            text_offset: int = 0) -> dict:
        """`choices[i].logprobs` of /v1/completions (the legacy shape) for these tokens."""
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for token_id, entry in zip(token_ids, entries):
            text = self.token_text(token_id)
            tokens.append(text)
            token_logprobs.append(entry[token_id])
            top_logprobs.append({self.token_text(t): lp for t, lp in self._top(entry, num_top)})
            offsets.append(text_offset)
            text_offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_logprobs,
                "top_logprobs": top_logprobs if num_top else None, "text_offset": offsets}


@dataclass
class ChoiceStream:
    """What one streamed choice has sent so far."""
    stop: tuple[str, ...] = ()
    sent_text: str = ""
    num_sent_tokens: int = 0
    num_logprob_chars: int = 0   # text_offset of the next legacy logprob entry
    finished: bool = False

    def text_delta(self, completion: CompletionOutput) -> str:
        """New text that is safe to send. Until the end, hold back a partial UTF-8 character
        ('\\ufffd') and any tail that could still grow into a stop string (the engine removes a
        stop string from the text once it completes)."""
        text = completion.text
        if completion.finish_reason is None:
            text = text.rstrip("\ufffd")
            text = text[:len(text) - _stop_prefix_length(text, self.stop)]
        if not text.startswith(self.sent_text):  # sent text cannot be taken back
            return ""
        delta = text[len(self.sent_text):]
        self.sent_text = text
        return delta

    def new_tokens(self, completion: CompletionOutput) -> tuple[list[int], list[dict[int, float]]]:
        """Tokens (and their logprob entries) made since the last call."""
        start = self.num_sent_tokens
        self.num_sent_tokens = len(completion.token_ids)
        return completion.token_ids[start:], (completion.logprobs or [])[start:]


def _stop_prefix_length(text: str, stop: tuple[str, ...]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of a stop string."""
    longest = 0
    for stop_string in stop:
        for length in range(min(len(stop_string) - 1, len(text)), longest, -1):
            if text.endswith(stop_string[:length]):
                longest = length
                break
    return longest
