"""The session tier's cost model: is a missing range cheaper to load or to recompute?

    load      = sum over its blocks of block_bytes x (seconds per byte of the tier holding it)
    recompute = tokens / (tokens per second of the engine's recent prefill steps)

Both rates are measured: the tiers' read costs by a small probe at startup (kv/session_tier.py),
then an exponential moving average of actual loads (per-file overhead included, so a short load
from disk is not flattered by bandwidth alone); the recompute rate from the engine's steps that
prefilled or replayed, over all the step's tokens (the rate at the current batch, decodes
included). Until a prefill has been timed the recompute rate is a prior (`PRIOR_TOKENS_PER_SECOND`,
a small model on a few CPU cores); on a fresh engine the tier is empty until blocks are evicted,
so in practice a measured rate decides.

A run of n blocks can also be split: its first k blocks recomputed by the engine while the
tier's background thread reads the other n - k (a loaded block needs nothing before it, so the
tail does not wait for the head). Both proceed at once, so the run takes

    max(k x recompute per block, (n - k) x load per block)

which is least near k = n x load / (load + recompute), plus one engine step: the tail goes in
once the head's step is done, so what follows the run is computed a step later than with either
fixed choice (the recent mean step time, measured). `head_blocks` picks k among 0 (load all),
n (recompute all) and the two integers around that point. A split pays where the two costs are
of one order and large against a step (a slow disk, a fast accelerator, a long run); elsewhere
it is all or nothing.
"""
from __future__ import annotations

PRIOR_TOKENS_PER_SECOND = 2000.0


class TierCosts:
    def __init__(self, read_seconds_per_byte: dict[str, float], choice: str = "cost",
                 smoothing: float = 0.2):
        self.read_seconds_per_byte = dict(read_seconds_per_byte)  # 'memory' / 'disk' -> s/B
        self.recompute_tokens_per_second = PRIOR_TOKENS_PER_SECOND
        self.step_seconds = 0.0  # the recent prefill steps' mean time (what a split waits more)
        self.num_prefill_steps = 0
        self.choice = choice        # cost | load | recompute (kv_tier_choice)
        self.smoothing = smoothing  # weight of the newest measurement in the averages

    def _average(self, old: float, new: float) -> float:
        return (1 - self.smoothing) * old + self.smoothing * new

    def predict_load(self, bytes_by_tier: dict[str, int]) -> float:
        return sum(num_bytes * self.read_seconds_per_byte.get(where, self.read_seconds_per_byte["memory"])
                   for where, num_bytes in bytes_by_tier.items())

    def predict_recompute(self, num_tokens: int) -> float:
        return num_tokens / self.recompute_tokens_per_second

    def head_blocks(self, num_blocks: int, load_seconds: float, block_tokens: int) -> int:
        """Of a run of `num_blocks` the tier holds (predicted to load in `load_seconds`), how
        many at its head to recompute while the rest is read in the background: 0 loads all,
        `num_blocks` recomputes all."""
        if self.choice != "cost" or num_blocks == 0:
            return 0 if self.choice == "load" else num_blocks
        load = load_seconds / num_blocks
        recompute = self.predict_recompute(block_tokens)
        point = num_blocks * load / max(load + recompute, 1e-12)
        candidates = sorted({0, num_blocks, min(num_blocks, int(point)), min(num_blocks, int(point) + 1)})

        def seconds(head: int) -> float:
            split = 0 < head < num_blocks
            return max(head * recompute, (num_blocks - head) * load) + (self.step_seconds if split else 0.0)
        # ties go to the fewest parts: all or nothing first (a split costs a second pass)
        return min(sorted(candidates, key=lambda head: head not in (0, num_blocks)), key=seconds)

    def observe_load(self, where: str, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0:
            old = self.read_seconds_per_byte.get(where, seconds / num_bytes)
            self.read_seconds_per_byte[where] = self._average(old, seconds / num_bytes)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step that prefilled or replayed `num_tokens` (with its decodes) took `seconds`."""
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        first = self.num_prefill_steps == 0
        self.recompute_tokens_per_second = rate if first else self._average(self.recompute_tokens_per_second, rate)
        self.step_seconds = seconds if first else self._average(self.step_seconds, seconds)
        self.num_prefill_steps += 1
