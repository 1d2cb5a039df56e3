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


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B] argmax of each row (the first on ties), through the compiled op for CPU
    float32 logits where it builds (torch.argmax takes ~0.7 ms at 32 x 49,152 here, it ~0.1)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 \
            and logits.shape[1] > 0:
        ops = cpu_kernels.layer_ops()
        if ops is not None:
            return ops.argmax_rows(logits)
    return logits.argmax(dim=-1)


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
