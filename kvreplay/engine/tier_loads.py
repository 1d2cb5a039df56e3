"""Loads from the session tier, chosen against recompute (docs/architecture.md §4, "Session tier").

The engine builds one `TierLoader` when a tier is configured (`attach_tier`); the KV manager owns
the tier and moves the bytes (kv/tier_io.py), the scheduler's replay tracker asks this loader at
the two places a missing range comes back:

- admission (a new prompt, or a paused sequence resuming): after the prefix-cache hit, tier
  blocks that continue the hash chain are loaded instead of prefilled (`load_prefix`);
- a replay of dropped blocks (`restore`, after the free prefix-cache restore): blocks the tier
  holds are loaded, and go through the replay's fingerprint check (`finish_restore`). On a
  hybrid pool, where the other way back is a whole recompute, they load when the tier holds
  every one asked for (unless `kv_tier_choice` is recompute); admission loads nothing there.

Each run is loaded, recomputed, or split, as `TierCosts.head_blocks` predicts fastest (or as
`kv_tier_choice` forces). A split recomputes the run's head through the usual prefill or replay
chunks while the tier reads the tail in its background thread (`SessionTier.prefetch`): the
scheduler stops the head's chunks at the tail (`prefill_cap`, `replay_stop`) and the tail goes
into the pool when its reads are done, or when the head is, whichever comes later. Per request
(`RequestStats`, `usage.kv`): `tier_loaded_tokens` (of which `tier_overlapped_tokens` read in the
background), `tier_recomputed_tokens` (the tier held them, recompute was chosen),
`tier_predicted_seconds` and `tier_actual_seconds` of the loads (for a read-ahead tail, the
engine thread's wait and copy).
"""
from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, field

from kvreplay.engine.sequence import Sequence
from kvreplay.engine.tier_costs import TierCosts
from kvreplay.kv import KVManager
from kvreplay.kv.session_tier import SessionTier


@dataclass
class TailRead:
    """A run's tail being read in the background while its head is recomputed."""
    handle: object              # SessionTier.prefetch's handle
    hashes: list[int]
    by_tier: dict[str, int]     # bytes per tier level, for the cost model
    predicted: float            # predicted load seconds of the tail
    start: int = 0              # admission: the token position where the tail starts
    indices: list[int] = field(default_factory=list)  # replay: the tail's table indices


class TierLoader:
    def __init__(self, kv: KVManager, costs: TierCosts):
        self.kv = kv
        self.costs = costs
        # Hashes each sequence was told to recompute: a replay asks again every step until its
        # chunks are done, and a choice is counted once.
        self._recomputing: weakref.WeakKeyDictionary[Sequence, set[int]] = weakref.WeakKeyDictionary()
        self._tails: weakref.WeakKeyDictionary[Sequence, TailRead] = weakref.WeakKeyDictionary()

    @property
    def tier(self) -> SessionTier:
        return self.kv.tier_io.tier

    def _bytes_by_tier(self, hashes: list[int]) -> dict[str, int]:
        found: dict[str, int] = {}
        for block_hash in hashes:
            where = self.tier.where(block_hash)
            found[where] = found.get(where, 0) + self.tier.block_bytes
        return found

    def _decide(self, seq: Sequence, hashes: list[int]) -> tuple[int, dict]:
        """How many blocks at the head of the run `hashes` to recompute (0: load all), and the
        run's bytes per tier; the recompute choice is counted."""
        by_tier = self._bytes_by_tier(hashes)
        head = self.costs.head_blocks(len(hashes), self.costs.predict_load(by_tier), self.kv.block_size)
        counted = self._recomputing.setdefault(seq, set())
        seq.stats.tier_recomputed_tokens += len(set(hashes[:head]) - counted) * self.kv.block_size
        counted.update(hashes[:head])
        return head, by_tier

    def _read_tail(self, seq: Sequence, hashes: list[int], tokens: list[tuple[int, ...]], **where) -> None:
        by_tier = self._bytes_by_tier(hashes)
        handle = self.tier.prefetch(list(zip(hashes, tokens)))
        self._tails[seq] = TailRead(handle, hashes, by_tier, self.costs.predict_load(by_tier), **where)

    def _collect(self, seq: Sequence, wait: bool) -> tuple[TailRead, dict, float] | None:
        """The read-ahead tail of `seq` and its blocks once read (waiting for them when `wait`),
        and when the engine thread started on it; None while still reading."""
        started = time.perf_counter()
        tail = self._tails[seq]
        found = self.tier.collect(tail.handle, wait=wait)
        if found is None:
            return None
        del self._tails[seq]
        return tail, found, started

    def forget(self, seq: Sequence) -> None:
        """`seq` was paused, restarts from scratch or left: a tail read for it is not used (the
        background reads touch nothing but their own results)."""
        self._tails.pop(seq, None)

    def _count(self, seq: Sequence, by_tier: dict[str, int], predicted: float, started: float,
               loaded_tokens: int, overlapped: bool = False) -> None:
        seconds = time.perf_counter() - started
        seq.stats.tier_loaded_tokens += loaded_tokens
        seq.stats.tier_predicted_seconds += predicted
        seq.stats.tier_actual_seconds += seconds
        if overlapped:  # the engine thread's share only: not a read rate
            seq.stats.tier_overlapped_tokens += loaded_tokens
            return
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
        head, by_tier = self._decide(seq, hashes)
        if head == len(hashes):
            return 0
        block_size, start = self.kv.block_size, self.kv.num_slots(seq.seq_id)  # (after the prefix hit)
        if head:  # recompute the head while the tail is read
            first = start + head * block_size
            self._read_tail(seq, hashes[head:], [tuple(seq.token_ids[b:b + block_size]) for b in
                                                 range(first, start + len(hashes) * block_size, block_size)],
                            start=first)
            return 0
        if self.kv.num_blocks_needed(seq.seq_id, len(hashes) * block_size) > self.kv.num_free_blocks:
            return 0
        started = time.perf_counter()
        loaded = self.kv.tier_io.load_prefix(seq.seq_id, seq.token_ids, len(hashes))
        self._count(seq, by_tier, self.costs.predict_load(by_tier), started, loaded)
        return loaded

    def prefill_cap(self, seq: Sequence) -> int | None:
        """Before a prefill chunk of `seq`: the most tokens it may compute (up to a tail being
        read), or None for no limit. At the tail, the tail goes in (waiting for its reads) and
        `seq`'s computed tokens move past it."""
        tail = self._tails.get(seq)
        if tail is None or not tail.hashes or tail.indices:
            return None
        if seq.num_computed_tokens < tail.start:
            return tail.start - seq.num_computed_tokens
        tail, found, started = self._collect(seq, wait=True)
        if seq.num_computed_tokens != tail.start or self.kv.num_blocks_needed(
                seq.seq_id, len(tail.hashes) * self.kv.block_size) > self.kv.num_free_blocks:
            return None  # (past it somehow, or no room: the tail is recomputed)
        loaded = self.kv.tier_io.load_prefix(seq.seq_id, seq.token_ids, len(tail.hashes), found)
        self._count(seq, tail.by_tier, tail.predicted, started, loaded, overlapped=True)
        seq.num_computed_tokens += loaded
        return None

    def restore(self, seq: Sequence, indices: list[int]) -> list[int]:
        """Dropped blocks at `indices` that the tier holds come back from it when cheaper than
        replaying them. Returns the table indices restored."""
        if seq in self._tails:  # (an admission tail waits for its prefill to reach it)
            return self._restore_tail(seq, indices) if self._tails[seq].indices else []
        asked, indices = indices, self.kv.tier_io.restorable(seq.seq_id, indices)
        if not indices:
            return []
        hashes = self.kv.tier_io.hashes(seq.seq_id, indices)
        if self.kv.local.num_groups:  # hybrid: the other way back recomputes the whole sequence
            if len(indices) < len(asked) or self.costs.choice == "recompute":
                return []
            head, by_tier = 0, self._bytes_by_tier(hashes)
        else:
            head, by_tier = self._decide(seq, hashes)
        if head == len(indices):
            return []
        block_size = self.kv.block_size
        if head:  # replay the head while the tail is read
            self._read_tail(seq, hashes[head:], [tuple(seq.token_ids[i * block_size:(i + 1) * block_size])
                                                 for i in indices[head:]], indices=indices[head:])
            return []
        started = time.perf_counter()
        restored, mismatches = self.kv.tier_io.restore(seq.seq_id, seq.token_ids, indices)
        seq.stats.replay_mismatches += mismatches
        self._count(seq, by_tier, self.costs.predict_load(by_tier) * len(restored) / len(indices), started,
                    len(restored) * block_size)
        return restored

    def _restore_tail(self, seq: Sequence, left: list[int]) -> list[int]:
        """A replay's tail being read: in once its reads are done, or (waiting for them) once
        the replay has nothing before it left to recompute."""
        tail = self._tails[seq]
        collected = self._collect(seq, wait=not left or left[0] >= tail.indices[0])
        if collected is None:
            return []
        tail, found, started = collected
        indices = [index for index in tail.indices if index in set(left)]
        restored, mismatches = self.kv.tier_io.restore(seq.seq_id, seq.token_ids, indices, found)
        seq.stats.replay_mismatches += mismatches
        self._count(seq, tail.by_tier, tail.predicted * len(restored) / max(len(tail.indices), 1), started,
                    len(restored) * self.kv.block_size, overlapped=True)
        return restored

    def replay_stop(self, seq: Sequence) -> int | None:
        """The first table index of `seq`'s replay tail being read (its replay chunks stop
        before it), or None."""
        tail = self._tails.get(seq)
        return tail.indices[0] if tail is not None and tail.indices else None

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
    if kv.local.num_groups:  # a hybrid pool's pages hold its global layers
        stamp["global_layers"] = list(kv.local.global_layers)
    shape = (len(kv.storages), 2, cfg.num_kv_heads, config.block_size, cfg.head_dim)
    tier = SessionTier(stamp, shape, config.torch_dtype, config.kv_tier_memory_bytes,
                       config.kv_tier_disk_bytes, config.kv_tier_dir)
    kv.attach_tier(tier)
    loader = TierLoader(kv, TierCosts(tier.probe_seconds_per_byte(), config.kv_tier_choice))
    engine.scheduler.replay.loader = loader
    return loader
