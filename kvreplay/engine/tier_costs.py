"""The session tier's cost model: is a missing range cheaper to load or to recompute?

    load      = sum over its blocks of block_bytes x (seconds per byte of the tier holding it)
    recompute = tokens / (tokens per second of the engine's recent prefill steps)

Both rates are measured: the tiers' read costs by a small probe at startup (kv/session_tier.py),
then an exponential moving average of actual loads (per-file overhead included, so a short load
from disk is not flattered by bandwidth alone); the recompute rate from the engine's steps that
prefilled or replayed, over all the step's tokens (the rate at the current batch, decodes
included). Until a prefill has been timed the recompute rate is a prior (`PRIOR_TOKENS_PER_SECOND`,
a small model on a few CPU cores); on a fresh engine the tier is empty until blocks are evicted,
so in practice a measured rate decides. Costs are linear in blocks on both sides, so the choice
is made for a whole run at once (loading a tail while recomputing a head is not done).
"""
from __future__ import annotations

PRIOR_TOKENS_PER_SECOND = 2000.0


class TierCosts:
    def __init__(self, read_seconds_per_byte: dict[str, float], choice: str = "cost",
                 smoothing: float = 0.2):
        self.read_seconds_per_byte = dict(read_seconds_per_byte)  # 'memory' / 'disk' -> s/B
        self.recompute_tokens_per_second = PRIOR_TOKENS_PER_SECOND
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

    def prefer_load(self, load_seconds: float, recompute_seconds: float) -> bool:
        if self.choice != "cost":
            return self.choice == "load"
        return load_seconds < recompute_seconds

    def observe_load(self, where: str, num_bytes: int, seconds: float) -> None:
        if num_bytes > 0:
            old = self.read_seconds_per_byte.get(where, seconds / num_bytes)
            self.read_seconds_per_byte[where] = self._average(old, seconds / num_bytes)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A step that prefilled or replayed `num_tokens` (with its decodes) took `seconds`."""
        if num_tokens <= 0 or seconds <= 0:
            return
        rate = num_tokens / seconds
        self.recompute_tokens_per_second = rate if self.num_prefill_steps == 0 else \
            self._average(self.recompute_tokens_per_second, rate)
        self.num_prefill_steps += 1
