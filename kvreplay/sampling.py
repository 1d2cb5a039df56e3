"""Sampling parameters and the sampler that turns a step's logits into tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvreplay.kernels import cpu_kernels
from kvreplay.validate import check_int, check_number

MAX_LOGPROBS = 20
MAX_SEED = 2**63 - 1  # the engine seeds branch i with seed + i; torch takes seeds below 2**64


@dataclass
class SamplingParams:
    """How to pick tokens for one prompt.

    Attributes:
        max_tokens: tokens to generate at most (None: until the context is full).
        temperature: 0 is greedy; higher flattens the distribution.
        top_p: nucleus mass in (0, 1].
        top_k: keep the k most likely tokens (0 or -1: all).
        seed: makes sampling reproducible for this request, whatever else runs beside it
            (0 to MAX_SEED, 2**63 - 1).
        stop: strings that end generation; they are not included in the text.
        stop_token_ids: token ids that end generation (the EOS token always does, unless
            ignore_eos); each must be in the model's vocabulary (`check_token_ids`).
        n: completions per prompt.
        logprobs: return this many top log-probabilities per generated token (plus the chosen one).
        ignore_eos: keep generating past EOS.
        beam_width: beam search width (1: off). Beam search is deterministic (temperature,
            top_p, top_k and seed do not apply) and matches transformers' `num_beams`.
        response_format: constrain the text, in OpenAI's shape: {"type": "json_object"} (one
            JSON object), {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}
            (a JSON value matching the schema) or {"type": "text"} / None (free text). Enforced
            by a grammar mask on each step's logits (engine/grammar.py); generation stops when
            the value is complete. Not with beam search.
    """
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    n: int = 1
    logprobs: int | None = None
    ignore_eos: bool = False
    beam_width: int = 1
    response_format: dict | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        check_int("max_tokens", self.max_tokens, 1, optional=True)
        check_number("temperature", self.temperature, 0, 100, what="a number")
        check_number("top_p", self.top_p, 0, 1, low_open=True)
        check_int("top_k", self.top_k, -1)
        check_int("seed", self.seed, 0, MAX_SEED, optional=True)
        check_int("n", self.n, 1)
        check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, optional=True)
        check_int("beam_width", self.beam_width, 1)
        if self.beam_width > 1 and (self.n > 1 or self.stop or self.logprobs is not None):
            raise ValueError("beam search (beam_width > 1) returns one best sequence: use it with "
                             "n=1 and without stop strings or logprobs")
        self.response_format = check_response_format(self.response_format)
        if self.response_format is not None and self.beam_width > 1:
            raise ValueError("response_format cannot be combined with beam search (beam_width > 1): "
                             "a grammar state per beam is not kept; use n for several answers")
        if not all(isinstance(s, str) and s for s in self.stop):
            raise ValueError(f"stop must be non-empty strings, got {self.stop!r}")
        if not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")

    def check_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError for stop_token_ids outside a vocabulary of `vocab_size` tokens (the
        model's; LLM.generate and the server call this before queuing a request)."""
        bad = [t for t in self.stop_token_ids if t >= vocab_size]
        if bad:
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {bad[:5]}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def check_response_format(response_format: dict | None) -> dict | None:
    """OpenAI's `response_format` checked for shape (the schema itself is checked when it is
    compiled, engine/grammar.py): None for free text, else the dict. Raises ValueError naming
    the field at fault."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise ValueError(f"response_format must be an object such as {{'type': 'json_object'}}, "
                         f"got {type(response_format).__name__}")
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMATS:
        raise ValueError(f"response_format.type must be one of {', '.join(RESPONSE_FORMATS)}, "
                         f"got {kind!r}")
    if kind == "text":
        return None
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise ValueError("response_format.json_schema must be an object with the schema under "
                             "'schema': {'name': ..., 'schema': {...}}")
        if not isinstance(spec.get("schema"), dict):
            raise ValueError("response_format.json_schema.schema must be a JSON Schema object, got "
                             f"{type(spec.get('schema')).__name__}")
        if "name" in spec and not isinstance(spec["name"], str):
            raise ValueError("response_format.json_schema.name must be a string")
    return response_format


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] argmax of each row (the first on ties), through the compiled op for CPU
    float32 logits where it builds (torch.argmax takes ~0.7 ms at 32 x 49,152 here, it ~0.1)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.shape[1] > 0:
        ops = cpu_kernels.layer_ops()
        if ops is not None:
            return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """In place: -inf in each row of logits [R, V] (float32) wherever that row's packed int32
    mask [R, ceil(V / 32)] has a 0 bit (bit j of word w: token 32 w + j); a structured-output
    row's grammar mask. Through the compiled op for contiguous CPU logits where it builds (it
    skips whole words: ~10 us at 32 x 49,152, this path's unpacking ~10 ms)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
        ops = cpu_kernels.layer_ops()
        if ops is not None and hasattr(ops, "apply_token_bitmask"):
            ops.apply_token_bitmask(logits, bitmask.contiguous())
            return
    vocab = logits.shape[-1]
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = ((bitmask.unsqueeze(-1) >> shifts) & 1).flatten(1)[:, :vocab].bool()  # [R, V]
    logits.masked_fill_(~allowed.to(logits.device), float("-inf"))


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """logits: [B, V] float32 -> [B] token ids. Greedy rows use argmax; the others are sampled
    with their own generator so that a seeded request does not depend on its neighbours."""
    tokens = greedy_tokens(logits)
    for row, (param, generator) in enumerate(zip(params, generators)):
        if param.greedy:
            continue
        scores = logits[row] / param.temperature  # [V]
        if param.top_k > 0:
            kth = torch.topk(scores, min(param.top_k, scores.shape[-1])).values[-1]
            scores = scores.masked_fill(scores < kth, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        if param.top_p < 1.0:
            sorted_probs, order = probs.sort(descending=True)
            # drop a token when the mass before it already reaches top_p (always keep the first)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= param.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
        tokens[row] = torch.multinomial(probs.cpu(), 1, generator=generator).item()
    return tokens


def rows_logprobs(logits: torch.Tensor, tokens: torch.Tensor, chosen_ids: list[int],
                  params: list[SamplingParams]) -> dict[int, dict[int, float]]:
    """For each row whose params ask for logprobs: {token: logprob} of its `logprobs` most
    likely tokens and of the chosen one."""
    want = [i for i, p in enumerate(params) if p.logprobs is not None]
    if not want:
        return {}
    index = torch.tensor(want)
    rows = {}
    for i, entry in zip(want, top_logprobs(logits[index], tokens[index], max(params[i].logprobs for i in want))):
        top = dict(sorted(entry.items(), key=lambda kv: -kv[1])[:params[i].logprobs])
        top[chosen_ids[i]] = entry[chosen_ids[i]]
        rows[i] = top
    return rows


def top_logprobs(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> list[dict[int, float]]:
    """For each row: {token: logprob} of the chosen token and the k most likely ones."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    result = []
    for row in range(logits.shape[0]):
        entry = {}
        if k:
            values, ids = logprobs[row].topk(k)
            entry = dict(zip(ids.tolist(), values.tolist()))
        token = int(tokens[row])
        entry[token] = float(logprobs[row, token])
        result.append(entry)
    return result
