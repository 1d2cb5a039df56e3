"""Memory-pressure policy: watermarks with hysteresis and the pause-victim cost rule.

Watermarks are fractions of the KV pool counted in *referenced* blocks (unreferenced cached
blocks are free: the pool evicts them lazily, least recently used first, which is the first and
cheapest step of the reclaim order of SPEC §4):

    0 ---------------- low ------ admit ---------- high ------ 1
                        ^ reclaim  ^ admit new work  ^ reclaim
                        | stops    | only while the  | starts
                                   | projection stays under

Pause-victim rule (`pause_cost`): pausing a sequence drops every computed token outside its
protected zone and frees the blocks only it references. Its cost is the tokens that must be
replayed per byte freed: `dropped_tokens / freed_bytes`. The cheapest victim goes first; a
sequence that would free nothing (all its blocks protected or shared) is never chosen; ties go to
the newest sequence (the least served, as in vLLM). The rule prefers sequences whose blocks are
not shared and whose last block is nearly empty, and it never pauses the last running sequence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

PAUSE_MODES = ("protected", "recompute")


@dataclass(frozen=True)
class Watermarks:
    low: float = 0.60
    admit: float = 0.70
    high: float = 0.85

    def __post_init__(self):
        values = (self.low, self.admit, self.high)
        if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            raise ValueError(f"watermarks must be numbers, got {values!r}")
        if not 0 < self.low <= self.admit <= self.high <= 1:
            raise ValueError(f"watermarks must satisfy 0 < low <= admit <= high <= 1, got "
                             f"low={self.low}, admit={self.admit}, high={self.high}")

    @classmethod
    def parse(cls, value) -> "Watermarks":
        """A Watermarks, a (low, admit, high) tuple, or a string "0.6,0.7,0.85"."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = tuple(float(part) for part in value.split(","))
            except ValueError:
                raise ValueError(f"cannot parse watermarks {value!r}: use 'low,admit,high' "
                                 f"like '0.6,0.7,0.85'") from None
        if not isinstance(value, (tuple, list)) or len(value) != 3:
            raise ValueError(f"watermarks are three fractions (low, admit, high), got {value!r}")
        return cls(*value)


def pause_cost(dropped_tokens: int, freed_bytes: int) -> float:
    """Tokens to replay per byte freed; infinite when pausing frees nothing."""
    return dropped_tokens / freed_bytes if freed_bytes > 0 else math.inf
