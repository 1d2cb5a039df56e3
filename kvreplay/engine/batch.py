"""What one engine step computes: the scheduler's output, the model runner's input."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvreplay.engine.sequence import Sequence


@dataclass
class ReplayChunk:
    """Dropped blocks `block_indices` of `seq`, recomputed at positions [start, start + num_tokens)."""
    seq: Sequence
    start: int
    num_tokens: int
    block_indices: list[int]


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk tokens)
    replays: list[ReplayChunk] = field(default_factory=list)
    layers: list[tuple[Sequence, range]] = field(default_factory=list)  # layered prefills' layers
    paused: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills) + \
            sum(r.num_tokens for r in self.replays)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills or self.replays or self.layers)
