"""The KV map: one JSON-ready picture of the pool and of every live sequence's tokens by zone.

The web console (`GET /v1/kv/state`, server/console.py) and `kvreplay bench serve --kv-map`
draw it. It reads the KV manager's tables and the scheduler's queues, which only the engine's
owner thread may touch, so `kv_state` must run there between steps (the server posts it as a job
with `AsyncEngine.call`; the bench calls it after each step). A sequence becomes runs of
`[zone, tokens]` from position 0 (docs/architecture.md §4 names the zones):

    | sinks | protected | hot / heavy / cold / dropped / evicted / replaying ... | window | pending |
    0       sink_tokens  pinned (its last block whole)            middle_range.stop       computed

`dropped` blocks keep their keys in the key index (a replay may bring them back), `evicted` ones
do not, `replaying` ones are dropped blocks a replay under way is bringing back, and `pending`
tokens have no K/V yet (a prompt still prefilling, the newest sampled token).
"""
from __future__ import annotations

import dataclasses

ZONES = ("sinks", "protected", "window", "heavy", "hot", "cold", "dropped", "evicted",
         "replaying", "pending")
MAX_SEQUENCES = 64  # sequences drawn at most (running first): the JSON stays small
_STAT_FIELDS = ("prompt_tokens", "completion_tokens", "prefix_hit_tokens", "dropped_tokens",
                "replays", "replayed_tokens", "cold_blocks", "pauses")


def kv_state(engine, now: float, finished_totals: dict | None = None) -> dict:
    """The pool, the watermarks, the counters and each live sequence's zone runs.

    Args:
        engine: the LLMEngine; call on the thread that owns it, between steps.
        now: a time stamp in seconds (the caller's clock), for rates drawn from several states.
        finished_totals: RequestStats totals of the requests that have ended; the live
            sequences' own counters are added to them, so totals never fall as requests end.
    """
    kv, scheduler, config = engine.kv, engine.scheduler, engine.config
    totals = dict(finished_totals or {})
    live = [seq for request in engine.requests.values() for seq in request.seqs if not seq.is_finished]
    for seq in live:
        for name, value in seq.stats.as_dict().items():
            totals[name] = totals.get(name, 0) + value
    capacity_bytes = kv.num_blocks * kv.block_bytes
    watermarks = scheduler.watermarks
    running = {seq.seq_id for seq in scheduler.running}
    shown = sorted(live, key=lambda seq: (seq.seq_id not in running, seq.seq_id))[:MAX_SEQUENCES]
    return {
        "time": now,
        "step": engine.counters.steps,
        "policy": {"name": scheduler.policy.name, "trim": scheduler.reclaim.trim,
                   "resident_ratio": scheduler.reclaim.resident_ratio,
                   "window_tokens": scheduler.reclaim.window_tokens,
                   "sink_tokens": config.sink_tokens},
        "pool": {"num_blocks": kv.num_blocks, "block_size": kv.block_size,
                 "block_bytes": kv.block_bytes, "num_used_blocks": kv.num_used_blocks,
                 "num_reserved_blocks": kv.num_reserved_blocks,
                 "num_cached_blocks": kv.num_cached_blocks,
                 "index_bytes": kv.index_bytes, "cold_bytes": kv.cold_bytes,
                 "groups": kv.local.blocks_by_group()},
        "usage": {"used": kv.usage(),
                  "hot": (kv.num_used_blocks - kv.num_reserved_blocks) / kv.num_blocks,
                  "cold": kv.cold_bytes / capacity_bytes, "index": kv.index_bytes / capacity_bytes},
        "watermarks": {"low": watermarks.low, "admit": watermarks.admit, "high": watermarks.high},
        "counters": dataclasses.asdict(engine.counters),
        "totals": totals,
        "num_running": len(scheduler.running), "num_waiting": len(scheduler.waiting),
        "sequences": [sequence_state(engine, seq, seq.seq_id in running) for seq in shown],
    }


def sequence_state(engine, seq, running: bool) -> dict:
    """One sequence: its sizes, whether a replay is under way, its counters and zone runs."""
    replay = engine.scheduler.replay
    replaying = seq.replay.active or replay.wants_replay(seq)
    return {"request_id": seq.request_id, "seq_id": seq.seq_id, "branch": seq.branch,
            "status": "running" if running else "waiting",
            "num_tokens": seq.num_tokens, "num_prompt_tokens": seq.num_prompt_tokens,
            "num_computed_tokens": seq.num_computed_tokens, "replaying": replaying,
            "stats": {name: getattr(seq.stats, name) for name in _STAT_FIELDS},
            "runs": zone_runs(engine, seq, set(replay.replay_left(seq)) if replaying else set())}


def zone_runs(engine, seq, replaying: set[int]) -> list[list]:
    """`seq`'s tokens from position 0 as `[zone, tokens]` runs, neighbours of one zone merged."""
    kv, reclaim = engine.kv, engine.scheduler.reclaim
    block_size, seq_id = kv.block_size, seq.seq_id
    table = kv.block_table(seq_id)
    dropped = set(kv.dropped_blocks(seq_id))
    cold = set(kv.cold_blocks(seq_id))
    indexed = {index for index, _ in kv.indexed_blocks(seq_id)}
    moves_middle = reclaim.policy.drops_middle or reclaim.policy.demotes
    middle = reclaim.middle_range(seq)
    window_from = middle.stop if moves_middle else len(table)
    head_blocks = -(-seq.pinned_tokens // block_size)  # kept whole through a pause
    heavy = set(reclaim.heavy_hitters(seq)) if moves_middle and reclaim.heavy_blocks else set()
    sinks = min(engine.config.sink_tokens, seq.pinned_tokens)
    computed = seq.num_computed_tokens

    def block_zone(index: int) -> str:
        if index < head_blocks:  # the rest of the pinned head's last block
            return "protected" if seq.pinned_tokens > sinks else "sinks"
        if index in dropped:
            if index in cold:
                return "cold"
            if index in replaying:
                return "replaying"
            return "dropped" if index in indexed else "evicted"
        if index >= window_from:
            return "window"
        return "heavy" if index in heavy else "hot"

    runs: list[list] = []

    def add(zone: str, count: int) -> None:
        if count <= 0:
            return
        if runs and runs[-1][0] == zone:
            runs[-1][1] += count
        else:
            runs.append([zone, count])

    for start in range(0, seq.num_tokens, block_size):
        end = min(start + block_size, seq.num_tokens)
        index = start // block_size
        # a block splits at the sinks' and pinned head's ends and at the first pending token
        cuts = sorted({start, end, *(p for p in (sinks, seq.pinned_tokens, computed) if start < p < end)})
        for low, high in zip(cuts, cuts[1:]):
            if low >= computed or index >= len(table):
                zone = "pending"
            elif low < sinks:
                zone = "sinks"
            elif low < seq.pinned_tokens:
                zone = "protected"
            else:
                zone = block_zone(index)
            add(zone, high - low)
    return runs
