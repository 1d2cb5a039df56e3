"""The serving workload of docs/architecture.md §8: a seeded prompt-length mix with Poisson or burst arrivals.

The mix is the seeds' 70/20/10 split scaled to an 8K context: 70% of prompts under 1K tokens,
20% in 1K-4K, 10% in 4K-7.5K, uniform within a bucket. `length_scale` shrinks every bucket for
slow machines (0.125 turns 8K-context lengths into 1K-context ones). Prompts are slices of real
text (the Python docs shipped with CPython) at random offsets, so no two share a prefix by chance.

Lengths, arrivals and prompt offsets draw from separate seeded streams: changing the rate does
not change the prompts, and the same seed always gives the same workload.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

# (fraction of requests, first length, one past the last length), in prompt tokens
LENGTH_MIX: tuple[tuple[float, int, int], ...] = ((0.70, 64, 1024), (0.20, 1024, 4096), (0.10, 4096, 7680))


@dataclass(frozen=True)
class WorkloadSpec:
    """What to send.

    Attributes:
        num_requests: timed requests.
        request_rate: mean arrivals per second (Poisson); `math.inf` sends all at once (burst).
        seed: one seed for lengths, arrivals and prompt text.
        length_scale: multiplies every bucket bound of the length mix.
        output_tokens: tokens generated per request (EOS ignored, so exactly this many).
        num_warmup: short untimed requests run first (allocator, threads, caches).
        mix: (fraction, first, end) buckets of prompt lengths; fractions sum to 1.
    """
    num_requests: int = 100
    request_rate: float = math.inf
    seed: int = 0
    length_scale: float = 1.0
    output_tokens: int = 128
    num_warmup: int = 2
    mix: tuple[tuple[float, int, int], ...] = LENGTH_MIX

    def __post_init__(self):
        if self.num_requests <= 0:
            raise ValueError(f"num_requests must be positive, got {self.num_requests}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be positive (inf for a burst), got {self.request_rate}")
        if not self.length_scale > 0:
            raise ValueError(f"length_scale must be positive, got {self.length_scale}")
        if self.output_tokens <= 0 or self.num_warmup < 0:
            raise ValueError("output_tokens must be positive and num_warmup >= 0")
        if abs(sum(f for f, _, _ in self.mix) - 1) > 1e-6:
            raise ValueError(f"the length mix fractions must sum to 1, got {self.mix}")

    @property
    def buckets(self) -> list[tuple[int, int]]:
        """[first, end) prompt lengths of each bucket after scaling (at least one token wide)."""
        scaled = []
        for _, first, end in self.mix:
            lo = max(1, round(first * self.length_scale))
            scaled.append((lo, max(lo + 1, round(end * self.length_scale))))
        return scaled

    @property
    def max_request_tokens(self) -> int:
        return max(end - 1 for _, end in self.buckets) + self.output_tokens


@dataclass
class BenchRequest:
    index: int
    arrival_s: float              # when it is sent, from the start of the timed run
    prompt_token_ids: list[int] = field(repr=False)
    max_tokens: int
    bucket: int                   # index into the length mix; -1 for warmup

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def sample_buckets_and_lengths(spec: WorkloadSpec) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng([spec.seed, 0])
    fractions = np.array([f for f, _, _ in spec.mix])
    buckets = rng.choice(len(fractions), size=spec.num_requests, p=fractions / fractions.sum())
    bounds = np.array(spec.buckets)
    lengths = rng.integers(bounds[buckets, 0], bounds[buckets, 1])
    return buckets, lengths


def arrival_times(spec: WorkloadSpec) -> np.ndarray:
    """Seconds from the start: 0 for all in a burst, else cumulative exponential gaps."""
    if math.isinf(spec.request_rate):
        return np.zeros(spec.num_requests)
    rng = np.random.default_rng([spec.seed, 1])
    gaps = rng.exponential(1.0 / spec.request_rate, size=spec.num_requests)
    gaps[0] = 0.0  # the first request opens the run
    return np.cumsum(gaps)


def corpus_token_ids(tokenizer, min_tokens: int = 0) -> list[int]:
    """Token ids of the Python reference docs (pydoc_data.topics), in a fixed order."""
    from pydoc_data.topics import topics
    text = "\n\n".join(topics[key] for key in sorted(topics))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < min_tokens:
        raise ValueError(f"the text corpus has {len(ids):,} tokens; {min_tokens:,} were asked for")
    return ids


def make_workload(spec: WorkloadSpec, corpus: list[int],
                  max_model_len: int | None = None) -> tuple[list[BenchRequest], list[BenchRequest]]:
    """(warmup requests, timed requests) for `spec`, prompts cut from `corpus` token ids."""
    if max_model_len is not None and spec.max_request_tokens > max_model_len:
        raise ValueError(f"the longest request needs {spec.max_request_tokens:,} tokens but the "
                         f"context is {max_model_len:,}: lower --length-scale or --output-tokens")
    longest = max(end for _, end in spec.buckets)
    if len(corpus) <= longest:
        raise ValueError(f"corpus of {len(corpus):,} tokens is too short for {longest:,}-token prompts")
    buckets, lengths = sample_buckets_and_lengths(spec)
    arrivals = arrival_times(spec)
    offsets = np.random.default_rng([spec.seed, 2]).integers(0, len(corpus) - lengths)
    timed = [BenchRequest(i, float(arrivals[i]), corpus[o:o + n], spec.output_tokens, int(b))
             for i, (b, n, o) in enumerate(zip(buckets, lengths.tolist(), offsets.tolist()))]
    warm_len = min(32, spec.buckets[0][0] + 1)
    warmup = [BenchRequest(-1 - i, 0.0, corpus[97 * i:97 * i + warm_len], min(4, spec.output_tokens), -1)
              for i in range(spec.num_warmup)]
    return warmup, timed
