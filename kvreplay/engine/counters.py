"""The engine's totals since start, which `/metrics` exports."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class EngineCounters:
    """Totals since start, for metrics."""
    steps: int = 0
    prompt_tokens: int = 0
    generation_tokens: int = 0
    preemptions: int = 0   # pauses that kept nothing
    pauses: int = 0
    requests_finished: int = 0
    requests_aborted: int = 0
    need_checks: int = 0        # decode rows the need detector looked at
    need_fires: int = 0         # ... and judged to need a replay
    replay_mismatches: int = 0
    sparse_selected_blocks: int = 0   # cold blocks attended (per layer and KV head)
    sparse_candidate_blocks: int = 0  # cold blocks that could have been
    dequant_seconds: float = 0.0      # time spent dequantizing cold blocks for attention
    decode_seconds: float = 0.0       # time of steps that decoded (the share's denominator)
    hot_blocks_read: int = 0          # hot blocks decode attention read (per layer and KV head)
