"""Memory-pressure policy: watermarks with hysteresis and the pause-victim cost rule.

Watermarks are fractions of the KV pool counted in *referenced* blocks (unreferenced cached
blocks are free: the pool evicts them lazily, least recently used first, which is the first and
cheapest step of the reclaim order of docs/architecture.md §4):

    0 ---------------- low ------ admit ---------- high ------ 1
                        ^ reclaim  ^ admit new work  ^ reclaim
                        | stops    | only while the  | starts
                                   | projection stays under

What each threshold counts:

- reclaim *starts* when every referenced block plus this step's decode growth is above `high`;
- reclaim *stops* once the blocks of running sequences plus their decode growth are under
  `low`. Blocks that only kept heads of paused sequences hold (`pause_mode="protected"`) count as
  reclaimed: the pause chose to keep them, and they are released on demand (paused longest ago
  first, as that one resumes last) when a decode cannot fit and no other running sequence can be
  paused, or when a lone admission cannot fit. Counting them as used would make
  each protected reclaim pause more sequences than a recompute reclaim for the same room (on
  issue 3's workload 28 pauses against 24, instead of 18 against 24);
- admission counts every referenced block, kept heads included: a resume only needs the blocks
  beyond its kept head, a new request needs all of its own.

Pause-victim rule (`pause_cost`): pausing a sequence drops every computed token outside its
protected zone and frees the blocks only it references. Its cost is the tokens that must be
replayed per byte freed: `dropped_tokens / freed_bytes`. The cheapest victim goes first; a
sequence that would free nothing (all its blocks protected or shared) is never chosen; ties go to
the newest sequence (the least served, as in vLLM). The rule prefers sequences whose blocks are
not shared and whose last block is nearly empty, and it never pauses the last running sequence.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvreplay.kv.importance import OBSERVED_QUERIES

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


# ---------------------------------------------------------------------- presets (docs/architecture.md §6)
TRIM_MODES = ("admission", "prefill", "pressure")
TRIM_ORDERS = ("importance", "oldest")
REPLAY_HOLDS = ("judged", "middle")  # what a resident_ratio cut spares after a need-replay


@dataclass(frozen=True)
class KVPolicy:
    """A preset: a named combination of the knobs the KV manager and scheduler consult.

    Attributes:
        name: the preset's name.
        drops_middle: middle blocks may leave the hot tier (window, replay, snapkv, h2o).
        replays: dropped blocks can be recomputed exactly (a prefill that needs them, a
            resume, the detector); the others evict for good.
        keeps_key_index: dropped blocks keep int4 keys (and their min/max summaries) so the need
            detector can see them and a replay can be decided.
        replays_on_need: the need detector runs at decode and replays dropped ranges.
        slides: blocks leave the hot tier as soon as they leave the window, every step
            (StreamingLLM eviction; demotion for the cold presets).
        demotes: middle blocks leaving the hot tier go to the cold tier (quantized, still
            attended); under pressure, hot middle blocks are demoted before anything is dropped.
        selects_at_prefill: when a prompt's prefill ends, its middle is cut down to
            `resident_ratio`, keeping the blocks the prompt's last queries attended most (SnapKV;
            replay and replay+cold do this too with trim="prefill" and a ratio).
        caps_each_step: after every step a decoding sequence above `resident_ratio` loses its
            least attended middle blocks until it fits (H2O; replay and replay+cold with a ratio).
        selects_per_step: nothing leaves the hot tier; each decode step each KV head attends only
            to the middle blocks with the highest Quest bound, up to `resident_ratio` (Quest).
        trims_under_pressure: memory pressure takes middle blocks out before pausing anyone;
            False: the policy's own rule is its whole budget, and pressure pauses as `full` does.
        needs_ratio: the preset is defined by its budget: `resident_ratio` must be set.
        recent_share: with `resident_ratio`, the recent window is this share of the budget left
            after the sinks (window: all of it; h2o: half, its heavy hitters get the other half),
            instead of `window_tokens`.
        recent_tokens: a fixed recent window instead of `window_tokens` (snapkv: its observation
            window; quest: the block being written).
    """
    name: str
    drops_middle: bool = False
    replays: bool = False
    keeps_key_index: bool = False
    replays_on_need: bool = False
    slides: bool = False
    demotes: bool = False
    selects_at_prefill: bool = False
    caps_each_step: bool = False
    selects_per_step: bool = False
    trims_under_pressure: bool = True
    needs_ratio: bool = False
    recent_share: float | None = None
    recent_tokens: int | None = None


POLICIES = {
    "full": KVPolicy("full"),
    "window": KVPolicy("window", drops_middle=True, slides=True, recent_share=1.0),
    "replay": KVPolicy("replay", drops_middle=True, replays=True, keeps_key_index=True, replays_on_need=True,
                       caps_each_step=True, recent_share=0.5),
    "sparse": KVPolicy("sparse", slides=True, demotes=True),
    "replay+cold": KVPolicy("replay+cold", drops_middle=True, replays=True, keeps_key_index=True,
                            replays_on_need=True, slides=True, demotes=True, caps_each_step=True,
                            recent_share=0.5),
    "snapkv": KVPolicy("snapkv", drops_middle=True, selects_at_prefill=True,
                       trims_under_pressure=False, needs_ratio=True, recent_tokens=OBSERVED_QUERIES),
    "h2o": KVPolicy("h2o", drops_middle=True, caps_each_step=True, trims_under_pressure=False,
                    needs_ratio=True, recent_share=0.5),
    "quest": KVPolicy("quest", selects_per_step=True, trims_under_pressure=False, needs_ratio=True,
                      recent_tokens=1),
}


def without_detector(policy: KVPolicy) -> KVPolicy:
    """`policy` with its need detector off (need_layers "none"): dropped blocks keep no key
    index and come back only when a prefill or a resume needs them."""
    return replace(policy, keeps_key_index=False, replays_on_need=False)


def ratio_blocks(num_tokens: int, block_size: int, ratio: float) -> int:
    """Whole blocks a sequence of `num_tokens` may keep under `resident_ratio`: r x the blocks
    `full` would hold for it, rounded down (a hair of slack for r x n landing just under an integer)."""
    return int(ratio * -(-num_tokens // block_size) + 1e-9)


def middle_block_range(num_tokens: int, pinned_tokens: int, window_tokens: int,
                       block_size: int, hot_from: int | None = None) -> range:
    """Block indices of a sequence's middle zone: whole blocks after the pinned head (protected
    span and sinks) and entirely older than the last `window_tokens` tokens (and than
    `hot_from`, the first token of a chat's last rounds, when given).

        | pinned head | middle (may be dropped)           | window (always hot) |
        0      ceil(pinned/bs)              floor((num_tokens - window)/bs)    num_tokens
    """
    first = -(-pinned_tokens // block_size)
    last = max(0, num_tokens - window_tokens) // block_size
    if hot_from is not None:
        last = min(last, hot_from // block_size)
    return range(first, max(first, last))


def recent_window_tokens(policy: KVPolicy, num_tokens: int, pinned_tokens: int, block_size: int,
                         window_tokens: int, resident_ratio: float | None) -> int:
    """The recent window (tokens at the end kept hot) of a sequence of `num_tokens` under
    `policy`: `window_tokens`; the preset's fixed window; or, with `resident_ratio` and a
    `recent_share`, that share of the whole blocks r allows beyond the pinned head (at least
    one block), as tokens that `middle_block_range` turns back into those blocks. E.g. window at
    10% of 4,096 tokens: 25 blocks, the sinks' block and the last 24 blocks (384 tokens)."""
    if policy.recent_tokens is not None:
        return policy.recent_tokens
    if resident_ratio is None or policy.recent_share is None:
        return window_tokens
    num_blocks = -(-num_tokens // block_size)
    spare = ratio_blocks(num_tokens, block_size, resident_ratio) - -(-pinned_tokens // block_size)
    recent_blocks = max(1, int(spare * policy.recent_share + 1e-9))
    return num_tokens - max(0, num_blocks - recent_blocks) * block_size


def quest_selection(policy: KVPolicy, num_tokens: int, pinned_tokens: int, block_size: int,
                    resident_ratio: float) -> tuple[range, int]:
    """Quest's per-step budget for a sequence whose context is `num_tokens`: the middle blocks
    decode attention chooses among, and how many of them each KV head reads, so that pinned
    head + recent window + chosen blocks are at most r x its blocks (the head and the window
    always count, even beyond r)."""
    recent = recent_window_tokens(policy, num_tokens, pinned_tokens, block_size, 0, resident_ratio)
    middle = middle_block_range(num_tokens, pinned_tokens, recent, block_size)
    always = -(-num_tokens // block_size) - len(middle)
    return middle, max(0, ratio_blocks(num_tokens, block_size, resident_ratio) - always)
