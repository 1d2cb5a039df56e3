"""Moves between the KV tiers, owned by the KV manager: hot blocks demoted to the cold pool or
dropped (their keys kept in the key index at int4), cold blocks dropped, dropped blocks brought
back (from the prefix cache, or into fresh blocks a replay then fills and checks against the
fingerprint taken when they left). Holds the dropped records and the pool blocks reserved for
the key index's and cold pool's bytes; every table change goes through the manager's tables.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

DROPPED = -1  # table entry of a block whose K/V were freed; its tokens are kept by the sequence


def blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass
class DroppedBlock:
    """A block out of the hot tier: cold (K/V quantized in the cold pool) or dropped."""
    slot: int | None           # key-index slot, None when no keys were kept (window) or cold
    fingerprint: torch.Tensor  # [2, Hkv, D] fp32 sums of K and V over the block, last layer
    cold_slot: int | None = None  # cold-pool slot while the block is cold



class TierMoves:
    def __init__(self, kv):
        self.kv = kv  # the KVManager that owns this helper and the block tables
        self.records: dict[int, dict[int, DroppedBlock]] = {}  # seq -> block index -> record
        self.reserved: list[int] = []  # pool blocks standing for the key index's and cold bytes

    # ------------------------------------------------------------------ dropped ranges
    def dropped_blocks(self, seq_id: int) -> list[int]:
        """Table indices of `seq_id`'s blocks out of the hot tier (dropped or cold), oldest
        first: what a replay recomputes."""
        return sorted(self.records.get(seq_id, ()))

    def cold_blocks(self, seq_id: int) -> list[int]:
        """Table indices of `seq_id`'s cold blocks, oldest first."""
        records = self.records.get(seq_id, {})
        return sorted(i for i, r in records.items() if r.cold_slot is not None)

    def cold_slots(self, seq_id: int) -> list[int]:
        """Cold-pool slots of `seq_id`'s cold blocks (attention reads them)."""
        records = self.records.get(seq_id, {})
        return [records[i].cold_slot for i in self.cold_blocks(seq_id)]

    def num_dropped_tokens(self, seq_id: int) -> int:
        return len(self.records.get(seq_id, ())) * self.kv.block_size

    def index_slots(self, seq_id: int) -> list[int]:
        """Key-index slots of `seq_id`'s dropped blocks (the need detector reads them)."""
        return [slot for _, slot in self.indexed_blocks(seq_id)]

    def indexed_blocks(self, seq_id: int) -> list[tuple[int, int]]:
        """(table index, key-index slot) of each of `seq_id`'s dropped blocks that has a slot, in
        the order they were dropped (the need probe's columns)."""
        return [(index, r.slot) for index, r in self.records.get(seq_id, {}).items() if r.slot is not None]

    def resident_bytes(self, seq_id: int) -> int:
        """Bytes `seq_id` holds: its hot blocks (shared ones counted whole) and index slots."""
        cold = len(self.cold_slots(seq_id)) * self.kv.cold_pool.slot_bytes if self.kv.cold_pool else 0
        table = self.kv._tables.get(seq_id, [])
        indexed = sum(r.slot is not None for r in self.records.get(seq_id, {}).values())
        return (len(table) - table.count(DROPPED)) * self.kv.block_bytes + indexed * self.kv.key_index.slot_bytes + cold

    def bytes_freed_by_drop(self, cold: bool, keep_index: bool) -> int:
        """How much `resident_bytes` falls when one unshared hot (or cold) block is dropped."""
        freed = self.kv.cold_pool.slot_bytes if cold else self.kv.block_bytes
        return freed - (self.kv.key_index.slot_bytes if keep_index else 0)

    def resident_blocks(self, seq_id: int) -> list[int]:
        """Blocks of `seq_id` that hold K/V, in table order."""
        return [b for b in self.kv._tables.get(seq_id, ()) if b != DROPPED]

    def droppable(self, seq_id: int, blocks: range) -> list[int]:
        """Of the table indices `blocks`, those hot and referenced by `seq_id` alone: dropping
        a shared block would free nothing."""
        table = self.kv._tables.get(seq_id, [])
        return [i for i in blocks if i < len(table) and table[i] != DROPPED
                and self.kv.pool.ref_counts[table[i]] == 1 and i * self.kv.block_size < self.kv._num_slots[seq_id]]

    def fingerprint(self, blocks: torch.Tensor, cache: torch.Tensor | None = None) -> torch.Tensor:
        """[n, 2, Hkv, D] fp32 sums over each block's tokens of K and V in the last layer, the
        one every replay error would reach (`cache`: that layer's K/V laid out like the pool's,
        [2, Hkv, blocks, block_size, D]; default the pool's own)."""
        cache = self.kv.kv_caches[-1] if cache is None else cache
        return cache.index_select(2, blocks).float().sum(3).permute(2, 0, 1, 3)

    def demote(self, seq_id: int, block_indices: list[int]) -> int:
        """Move hot blocks (from `droppable`) to the cold tier. Returns blocks freed (net of
        the cold tier's reservation)."""
        assert self.kv.cold_pool is not None, "demote needs a cold tier (cold_dtype)"
        if not block_indices:
            return 0
        before = self.kv.pool.num_free
        blocks = self._hot_blocks(seq_id, block_indices)
        fingerprints = self.fingerprint(blocks).cpu()
        storages = self.kv.storages  # every layer, or a hybrid pool's global layers (its cold tier's)
        cold_slots = self.kv.cold_pool.add(self._gather(blocks, 0, storages), self._gather(blocks, 1, storages))
        self._vacate(seq_id, block_indices, [DroppedBlock(None, fingerprint, cold_slot)
                                             for cold_slot, fingerprint in zip(cold_slots, fingerprints)])
        return self.kv.pool.num_free - before

    def drop_cold(self, seq_id: int, block_indices: list[int], keep_index: bool) -> int:
        """Drop cold blocks: their quantized K/V leave; with `keep_index` their (dequantized)
        keys enter the key index. Returns blocks freed from the reservation."""
        if not block_indices:
            return 0
        before = self.kv.pool.num_free
        records = self.records[seq_id]
        cold_slots = [records[i].cold_slot for i in block_indices]
        assert None not in cold_slots, f"seq {seq_id}: only cold blocks can be dropped here"
        slots: list[int | None] = [None] * len(block_indices)
        if keep_index:
            keys, _ = self.kv.cold_pool.dequantize_slots(cold_slots)
            slots = self.kv.key_index.add(keys, self.kv.local.global_layers)
        self.kv.cold_pool.remove(cold_slots)
        for index, slot in zip(block_indices, slots):
            records[index].cold_slot, records[index].slot = None, slot
        self.rebalance_reserve()
        return self.kv.pool.num_free - before

    def drop(self, seq_id: int, block_indices: list[int], keep_index: bool) -> int:
        """Free the K/V of `seq_id`'s blocks at `block_indices` (from `droppable`). With
        `keep_index` their keys stay in the key index at int4. Returns blocks freed (net of
        the index's reservation)."""
        if not block_indices:
            return 0
        before = self.kv.pool.num_free
        blocks = self._hot_blocks(seq_id, block_indices)
        fingerprints = self.fingerprint(blocks).cpu()
        slots = self.kv.key_index.add(self._gather(blocks, 0)) if keep_index else [None] * len(block_indices)
        self._vacate(seq_id, block_indices, [DroppedBlock(slot, fingerprint)
                                             for slot, fingerprint in zip(slots, fingerprints)])
        return self.kv.pool.num_free - before

    def _hot_blocks(self, seq_id: int, block_indices: list[int]) -> torch.Tensor:
        """The pool blocks at `block_indices`, which must be hot and referenced by `seq_id` alone."""
        table = self.kv._tables[seq_id]
        assert all(table[i] != DROPPED and self.kv.pool.ref_counts[table[i]] == 1 for i in block_indices), \
            f"seq {seq_id}: only hot, unshared blocks can leave the hot tier"
        return torch.tensor([table[i] for i in block_indices], device=self.kv.kv_caches[0].device)

    def _gather(self, blocks: torch.Tensor, side: int, caches: list[torch.Tensor] | None = None) -> torch.Tensor:
        """K (side 0) or V (side 1) of `blocks` in every layer (or in `caches`): [L, Hkv, n, block_size, D]."""
        caches = self.kv.kv_caches if caches is None else caches
        return torch.stack([cache[side].index_select(1, blocks) for cache in caches])

    def _vacate(self, seq_id: int, block_indices: list[int], records: list[DroppedBlock]) -> None:
        """Release the hot blocks at `block_indices` (a cached one waits in the LRU: a free
        restore) and record what stands in for each."""
        table = self.kv._tables[seq_id]
        dropped = self.records.setdefault(seq_id, {})
        for index, record in zip(block_indices, records):
            self.kv.pool.release(table[index])
            table[index] = DROPPED
            dropped[index] = record
        self.rebalance_reserve()
        self.kv._note_peak()

    def restore_cached(self, seq_id: int, token_ids: list[int], indices: list[int] | None = None) -> list[int]:
        """Put back dropped blocks (all, or those among `indices`) whose K/V still sit in the
        prefix cache (not yet evicted): a replay that costs nothing. Returns the table indices
        restored."""
        table, hashes = self.kv._tables[seq_id], self.kv._hashes[seq_id]
        restored = []
        dropped = self.dropped_blocks(seq_id)
        if indices is not None:
            dropped = sorted(set(dropped).intersection(indices))
        for index in dropped:
            if index >= len(hashes):
                continue
            tokens = tuple(token_ids[index * self.kv.block_size:(index + 1) * self.kv.block_size])
            block = self.kv.pool.cache.lookup(hashes[index], tokens)
            if block is None:
                continue
            self.kv.pool.acquire(block)
            table[index] = block
            self.forget(seq_id, index)
            restored.append(index)
        if restored:
            self.rebalance_reserve()
            self.kv._note_peak()
        return restored

    def restore_room(self, seq_id: int, block_indices: list[int]) -> int:
        """How many of `block_indices` (dropped, in order) the pool can take back now: its free
        blocks, plus reserved ones that the restored blocks' index slots stop needing. Without
        the latter a sequence that fills the pool alone could never replay: the block it needs
        back is the one reserved for its index slot."""
        records = self.records.get(seq_id, {})
        room = self.kv.pool.num_free
        for taken, index in enumerate(block_indices):
            if taken >= room + len(self.reserved) - self._reserve_after(seq_id, block_indices[:taken + 1]):
                return taken
            assert index in records, f"seq {seq_id}: block {index} is not dropped"
        return len(block_indices)

    def _reserve_after(self, seq_id: int, block_indices: list[int]) -> int:
        """The reservation once `block_indices` are restored and their index slots forgotten."""
        records = self.records[seq_id]
        slots = sum(records[index].slot is not None for index in block_indices)
        index_bytes = (self.kv.key_index.num_used - slots) * self.kv.key_index.slot_bytes
        return -(-(index_bytes + self.kv.cold_bytes) // self.kv.block_bytes)

    def allocate_restore(self, seq_id: int, block_indices: list[int]) -> bool:
        """Fresh blocks for dropped table indices about to be replayed; False (no change) when
        the pool lacks them. Blocks beyond the free ones come out of the reservation that the
        restore releases (`restore_room`): until `finish_restore` forgets their index slots in
        the same step, the index's bytes and the restored blocks both count."""
        if len(block_indices) > self.restore_room(seq_id, block_indices):
            return False
        table = self.kv._tables[seq_id]
        for index in block_indices:
            assert table[index] == DROPPED, f"seq {seq_id}: block {index} is not dropped"
            table[index] = self.kv.pool.take() if self.kv.pool.num_free else self.reserved.pop()
        self.kv._note_peak()
        return True

    def finish_restore(self, seq_id: int, block_indices: list[int], token_ids: list[int],
                       unchecked_from: int | None = None) -> int:
        """The replay of `block_indices` has written their K/V: compare each with the
        fingerprint taken at drop time (blocks holding positions from `unchecked_from` on
        had approximate K/V then: not compared), re-index it in the prefix cache, forget its
        index slot. Returns the number of blocks whose fingerprint did not match."""
        table, records = self.kv._tables[seq_id], self.records[seq_id]
        blocks = torch.tensor([table[i] for i in block_indices], device=self.kv.kv_caches[0].device)
        now = self.fingerprint(blocks).cpu()
        mismatches = 0
        for index, fingerprint in zip(block_indices, now):
            before = records[index].fingerprint
            error = (fingerprint - before).abs().max() / before.abs().max().clamp_min(1e-6)
            approximate = unchecked_from is not None and (index + 1) * self.kv.block_size > unchecked_from
            if error > self.kv.fingerprint_tolerance and not approximate:
                mismatches += 1
                logger.warning("seq %d: replayed block %d differs from its fingerprint by %.3g "
                               "(tolerance %.3g)", seq_id, index, float(error), self.kv.fingerprint_tolerance)
            self.forget(seq_id, index)
            if self.kv.enable_prefix_caching and not approximate and index < len(self.kv._hashes[seq_id]) \
                    and not self.kv.pool.cache.is_cached(table[index]):
                tokens = tuple(token_ids[index * self.kv.block_size:(index + 1) * self.kv.block_size])
                hashes = self.kv._hashes[seq_id]
                self.kv.pool.cache.insert(table[index], hashes[index], tokens,
                                          hashes[index - 1] if index else None)
        self.rebalance_reserve()
        return mismatches

    def forget(self, seq_id: int, index: int) -> None:
        record = self.records[seq_id].pop(index)
        if record.slot is not None:
            self.kv.key_index.remove([record.slot])
        if record.cold_slot is not None:
            self.kv.cold_pool.remove([record.cold_slot])
        if not self.records[seq_id]:
            del self.records[seq_id]

    def reserve_target(self) -> int:
        index_bytes = self.kv.key_index.num_used * self.kv.key_index.slot_bytes
        return -(-(index_bytes + self.kv.cold_bytes) // self.kv.block_bytes)

    def rebalance_reserve(self) -> None:
        """Hold as many pool blocks as the key index's bytes fill, so that the budget counts
        them (and the cold tier's). Dropping or demoting frees a whole block per slot (an index
        slot is ~1/5 of one, a cold slot 2/5-2/3), so this never starves."""
        target = self.reserve_target()
        while len(self.reserved) > target:
            self.kv.pool.release(self.reserved.pop())
        while len(self.reserved) < target:
            assert self.kv.pool.num_free > 0, "no block left to reserve for the key index"
            self.reserved.append(self.kv.pool.take())
