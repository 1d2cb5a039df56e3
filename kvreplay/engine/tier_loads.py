"""Loads from the session tier, chosen against recompute (docs/architecture.md §4, "Session tier").

The engine builds one `TierLoader` when a tier is configured (`attach_tier`); the KV manager owns
the tier and moves the bytes (kv/tier_io.py), the scheduler's replay tracker asks this loader at
the two places a missing range comes back:

- admission (a new prompt, or a paused sequence resuming): after the prefix-cache hit, tier
  blocks that continue the hash chain are loaded instead of prefilled (`load_prefix`);
- a replay of dropped blocks (`restore`, after the free prefix-cache restore): blocks the tier
  holds are loaded, and go through the replay's fingerprint check (`finish_restore`).

Each run is loaded or recomputed, whichever `TierCosts` predicts cheaper (or as
`kv_tier_choice` forces). Per request (`RequestStats`, `usage.kv`): `tier_loaded_tokens`,
`tier_recomputed_tokens` (the tier held them, recompute was predicted cheaper),
`tier_predicted_seconds` and `tier_actual_seconds` of the loads.
"""
from __future__ import annotations

import os
import time
import weakref

from kvreplay.engine.sequence import Sequence
from kvreplay.engine.tier_costs import TierCosts
from kvreplay.kv import KVManager
from kvreplay.kv.session_tier import SessionTier


class TierLoader:
    def __init__(self, kv: KVManager, costs: TierCosts):
        self.kv = kv
        self.costs = costs
        # Hashes each sequence was told to recompute: a replay asks again every step until its
        # chunks are done, and a choice is counted once.
        self._recomputing: weakref.WeakKeyDictionary[Sequence, set[int]] = weakref.WeakKeyDictionary()

    @property
    def tier(self) -> SessionTier:
        return self.kv.tier_io.tier

    def _bytes_by_tier(self, hashes: list[int]) -> dict[str, int]:
        found: dict[str, int] = {}
        for block_hash in hashes:
            where = self.tier.where(block_hash)
            found[where] = found.get(where, 0) + self.tier.block_bytes
        return found

    def _decide(self, seq: Sequence, hashes: list[int]) -> tuple[bool, float, dict[str, int]]:
        """(load?, predicted load seconds, bytes per tier); a recompute choice is counted."""
        by_tier = self._bytes_by_tier(hashes)
        load = self.costs.predict_load(by_tier)
        num_tokens = len(hashes) * self.kv.block_size
        if self.costs.prefer_load(load, self.costs.predict_recompute(num_tokens)):
            return True, load, by_tier
        counted = self._recomputing.setdefault(seq, set())
        seq.stats.tier_recomputed_tokens += len(set(hashes) - counted) * self.kv.block_size
        counted.update(hashes)
        return False, load, by_tier

    def _count(self, seq: Sequence, by_tier: dict[str, int], predicted: float, started: float,
               loaded_tokens: int) -> None:
        seconds = time.perf_counter() - started
        seq.stats.tier_loaded_tokens += loaded_tokens
        seq.stats.tier_predicted_seconds += predicted
        seq.stats.tier_actual_seconds += seconds
        if len(by_tier) == 1 and loaded_tokens:
            where, = by_tier
            loaded_bytes = loaded_tokens // self.kv.block_size * self.tier.block_bytes
            self.costs.observe_load(where, loaded_bytes, seconds)

    def load_prefix(self, seq: Sequence) -> int:
        """At admission, after the prefix-cache hit: load the tier's continuation of `seq`'s
        chain when cheaper. Returns the tokens loaded (now computed)."""
        if seq.layered is not None:  # a layered prefill holds its whole range already
            return 0
        hashes = self.kv.tier_io.match(seq.seq_id, seq.token_ids)
        if not hashes:
            return 0
        load, predicted, by_tier = self._decide(seq, hashes)
        if not load or self.kv.num_blocks_needed(seq.seq_id, len(hashes) * self.kv.block_size) > \
                self.kv.num_free_blocks:
            return 0
        started = time.perf_counter()
        loaded = self.kv.tier_io.load_prefix(seq.seq_id, seq.token_ids, len(hashes))
        self._count(seq, by_tier, predicted, started, loaded)
        return loaded

    def restore(self, seq: Sequence, indices: list[int]) -> list[int]:
        """Dropped blocks at `indices` that the tier holds come back from it when cheaper than
        replaying them. Returns the table indices restored."""
        indices = self.kv.tier_io.restorable(seq.seq_id, indices)
        if not indices:
            return []
        hashes = self.kv.tier_io.hashes(seq.seq_id, indices)
        load, predicted, by_tier = self._decide(seq, hashes)
        if not load:
            return []
        started = time.perf_counter()
        restored, mismatches = self.kv.tier_io.restore(seq.seq_id, seq.token_ids, indices)
        seq.stats.replay_mismatches += mismatches
        self._count(seq, by_tier, predicted * len(restored) / len(indices), started,
                    len(restored) * self.kv.block_size)
        return restored

    def observe_step(self, batch, seconds: float) -> None:
        """The model ran `batch` (a ScheduledBatch) in `seconds`; it counts for the recompute
        rate when at least a block of its tokens were prefill or replay tokens."""
        if batch.num_tokens - len(batch.decodes) >= self.kv.block_size:
            self.costs.observe_step(batch.num_tokens, seconds)


def model_identity(source: str) -> str:
    """The model's part of the tier's version stamp: its path, and for a file its size and
    modification time (a model replaced in place gets new files)."""
    try:
        info = os.stat(source)
    except OSError:
        return str(source)
    return f"{source}:{info.st_size}:{info.st_mtime_ns}" if os.path.isfile(source) else str(source)


def attach_tier(engine) -> TierLoader | None:
    """Build the session tier the engine's config asks for, hand it to the KV manager and the
    loader to the scheduler's replay tracker. None (and nothing changed) when it is off."""
    config, cfg, kv = engine.config, engine.model_config, engine.kv
    if not (config.kv_tier_memory_bytes or (config.kv_tier_dir and config.kv_tier_disk_bytes)):
        return None
    if not config.enable_prefix_caching:
        raise ValueError("the session tier (kv_tier_memory / kv_tier_dir) keys blocks by their "
                         "prefix-cache hash: enable prefix caching or turn the tier off")
    stamp = dict(model=model_identity(engine.model_source), block_size=config.block_size,
                 dtype=str(config.torch_dtype), layers=cfg.num_layers, kv_heads=cfg.num_kv_heads,
                 head_dim=cfg.head_dim)
    shape = (cfg.num_layers, 2, cfg.num_kv_heads, config.block_size, cfg.head_dim)
    tier = SessionTier(stamp, shape, config.torch_dtype, config.kv_tier_memory_bytes,
                       config.kv_tier_disk_bytes, config.kv_tier_dir)
    kv.attach_tier(tier)
    loader = TierLoader(kv, TierCosts(tier.probe_seconds_per_byte(), config.kv_tier_choice))
    engine.scheduler.replay.loader = loader
    return loader
