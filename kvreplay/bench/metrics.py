"""Latency and throughput from per-token timestamps (docs/architecture.md §8).

For a request with N output tokens observed at t_1..t_N, sent at a:

    TTFT = t_1 - a            E2E = t_N - a
    TPOT = (E2E - TTFT) / (N - 1)          (requests with N > 1 only)
    ITL  = every gap t_{i+1} - t_i         (pooled over requests)

Throughputs divide by the run's duration: from the first arrival to the last token.
Percentiles interpolate linearly between order statistics (numpy's default).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class RequestRecord:
    index: int
    arrival_s: float
    num_prompt_tokens: int
    token_times_s: list[float] = field(default_factory=list)
    error: str | None = None
    stats: dict = field(default_factory=dict)   # RequestStats.as_dict() when known

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_times_s)

    @property
    def ok(self) -> bool:
        return self.error is None and bool(self.token_times_s)

    @property
    def ttft_s(self) -> float:
        return self.token_times_s[0] - self.arrival_s

    @property
    def e2e_s(self) -> float:
        return self.token_times_s[-1] - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        n = self.num_output_tokens
        return (self.e2e_s - self.ttft_s) / (n - 1) if n > 1 else None

    @property
    def itls_s(self) -> list[float]:
        times = self.token_times_s
        return [b - a for a, b in zip(times, times[1:])]


def summarize(values_s: list[float]) -> dict[str, float | None]:
    """mean / p50 / p99 in milliseconds (None when there are no values)."""
    if not values_s:
        return {"mean": None, "p50": None, "p99": None}
    ms = np.asarray(values_s, dtype=float) * 1000.0
    return {"mean": float(ms.mean()), "p50": float(np.percentile(ms, 50)),
            "p99": float(np.percentile(ms, 99))}


COUNTERS = ("pauses", "preemptions", "replays", "replayed_tokens", "dropped_tokens", "cold_blocks",
            "approx_tokens", "replay_mismatches", "prefix_hit_tokens")


def compute_metrics(records: list[RequestRecord]) -> dict:
    """Everything the serving report shows, from the records of one timed run."""
    done = [r for r in records if r.ok]
    start = min((r.arrival_s for r in records), default=0.0)
    end = max((r.token_times_s[-1] for r in done), default=start)
    duration = end - start
    prompt_tokens = sum(r.num_prompt_tokens for r in done)
    output_tokens = sum(r.num_output_tokens for r in done)

    def rate(x):
        return x / duration if duration > 0 else None

    return {
        "num_requests": len(records),
        "num_completed": len(done),
        "num_failed": len(records) - len(done),
        "duration_s": duration,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "request_throughput": rate(len(done)),
        "output_token_throughput": rate(output_tokens),
        "total_token_throughput": rate(prompt_tokens + output_tokens),
        "ttft_ms": summarize([r.ttft_s for r in done]),
        "tpot_ms": summarize([r.tpot_s for r in done if r.tpot_s is not None]),
        "itl_ms": summarize([gap for r in done for gap in r.itls_s]),
        "e2e_ms": summarize([r.e2e_s for r in done]),
        "counters": {name: sum(int(r.stats.get(name, 0)) for r in done) for name in COUNTERS},
    }
