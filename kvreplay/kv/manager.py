"""The KV manager: the ONLY owner of block tables, ref counts, block hashes, pins, dropped
ranges and the key index.

The scheduler and the engine ask (`num_blocks_needed`, `match_prefix`, `pause_preview`) and then
act through it (`allocate`, `adopt_prefix`, `commit`, `fork`, `pause`, `free`); nothing else
mutates a block table. The cache tensors live here too; the model reads and writes rows of them
through the slot mapping the runner derives from our block tables.

A sequence's table, with its zones (SPEC §4) for the `full` policy:

    | pinned: max(protected span, sink_tokens), whole blocks | the rest: dropped on pause |
    [ b7 ][ b2 ]                                             [ b9 ][ b4 ][ b5 (partial) ]
    shared with other sequences through the prefix cache     CoW copy on the first write
                                                             to a shared partial block

With a dropping policy (window, replay) middle blocks leave the table (entry DROPPED); the
token ids stay with the sequence, and for `replay` the block's keys stay in the key index at
int4 (its per-channel min/max doubling as the Quest summary). The index's bytes are charged to
the budget as *reserved* pool blocks, so usage and watermarks see hot + index bytes:

    | pinned | middle: hot, or DROPPED (index slot + fingerprint) | window (hot) |
    [ b7 ]   [ -1 ][ -1 ][ b3 ][ -1 ]                             [ b9 ][ b5 ]
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvreplay.kernels import huge_pages
from kvreplay.kv.block_pool import BlockPool
from kvreplay.kv.cold_pool import ColdPool
from kvreplay.kv.importance import BlockImportance
from kvreplay.kv.key_index import KeyIndex
from kvreplay.kv.prefix_cache import HashFn, chain_hash

logger = logging.getLogger(__name__)

DROPPED = -1  # table entry of a block whose K/V were freed; its tokens are kept by the sequence


@dataclass
class DroppedBlock:
    """A block out of the hot tier: cold (K/V quantized in the cold pool) or dropped."""
    slot: int | None           # key-index slot, None when no keys were kept (window) or cold
    fingerprint: torch.Tensor  # [2, Hkv, D] fp32 sums of K and V over the block, last layer
    cold_slot: int | None = None  # cold-pool slot while the block is cold


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 enable_prefix_caching: bool = True, hash_fn: HashFn = chain_hash,
                 cold_dtype: str | None = None, index_layers: frozenset[int] | None = None):
        assert num_blocks > 0 and block_size > 0, "a pool needs at least one block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn
        # One tensor per layer: [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim].
        # Heads outermost: gathering a batch's blocks yields [Hkv, B, L, D], which batched
        # matmuls take as it is (no per-layer copy to a head-major layout).
        # On a CPU, 2 MiB pages where Linux gives them (decode reads scattered 2 KiB blocks).
        self.kv_caches = [huge_pages.zeros(2, num_kv_heads, num_blocks, block_size, head_dim,
                                           dtype=dtype, device=device) for _ in range(num_layers)]
        self.pool = BlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}
        self._num_slots: dict[int, int] = {}      # tokens each sequence has room for
        self._hashes: dict[int, list[int]] = {}   # chain hash of each leading full, computed block
        self._pinned_tokens: dict[int, int] = {}  # head of the sequence kept through a pause
        self._extra_keys: dict[int, tuple] = {}
        self.peak_used_blocks = 0
        self.num_cow_copies = 0
        self.block_bytes = 2 * num_layers * num_kv_heads * block_size * head_dim * \
            torch.finfo(dtype).bits // 8
        # The need detector's int4 keys, for the layers it reads (index_layers; None: all).
        self.key_index = KeyIndex(num_layers, num_kv_heads, block_size, head_dim, device,
                                  layers=index_layers)
        self.cold_pool = ColdPool(num_layers, num_kv_heads, block_size, head_dim, cold_dtype, device) \
            if cold_dtype else None
        self.peak_cold_bytes = 0
        self._dropped: dict[int, dict[int, DroppedBlock]] = {}  # seq -> block index -> record
        self._reserved: list[int] = []  # pool blocks standing for the key index's bytes
        # A layered prefill under way, per sequence: the first table index of its range (whose
        # blocks hold only some layers until it ends) and the pool blocks standing for its
        # working memory (its hidden states and one layer's K/V of the whole range).
        self._layered: dict[int, tuple[int, list[int]]] = {}
        self.fingerprint_tolerance = 1e-3 if dtype == torch.float32 else 6e-2
        self.peak_resident_bytes = 0
        self.peak_index_bytes = 0
        self.importance = BlockImportance()  # observed attention mass per block

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Unreferenced blocks, including cached ones (they are evicted on demand)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free

    @property
    def num_reserved_blocks(self) -> int:
        """Pool blocks standing for the key index's bytes (counted as used)."""
        return len(self._reserved)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a prefix-cache entry."""
        return self.pool.num_cached_free

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def num_slots(self, seq_id: int) -> int:
        return self._num_slots.get(seq_id, 0)

    def num_pinned_blocks(self, seq_id: int) -> int:
        return _blocks_for(self._pinned_tokens.get(seq_id, 0), self.block_size)

    def pinned_blocks(self, seq_id: int) -> list[int]:
        return self._tables.get(seq_id, [])[:self.num_pinned_blocks(seq_id)]

    def _needs_copy(self, seq_id: int, num_new_tokens: int) -> bool:
        """The next write lands in a partial last block that another sequence shares."""
        table = self._tables.get(seq_id)
        return bool(num_new_tokens and table and self._num_slots[seq_id] % self.block_size
                    and self.pool.ref_counts[table[-1]] > 1)

    def num_blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        """Free blocks that `allocate(seq_id, num_new_tokens)` would take (CoW copy included)."""
        have = len(self._tables.get(seq_id, ()))
        total = self._num_slots.get(seq_id, 0) + num_new_tokens
        return max(0, _blocks_for(total, self.block_size) - have) + self._needs_copy(seq_id, num_new_tokens)

    def can_allocate(self, seq_id: int, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq_id, num_new_tokens) <= self.pool.num_free

    def match_prefix(self, seq_id: int, token_ids: list[int]) -> list[int]:
        """Cached blocks that continue `seq_id`'s table for `token_ids`. A hit never covers the
        last token (its logits are needed), and only starts at a block boundary."""
        slots = self._num_slots.get(seq_id, 0)
        if not self.enable_prefix_caching or slots % self.block_size:
            return []
        hashes = self._hashes.get(seq_id, [])
        if len(hashes) * self.block_size != slots:
            return []
        parent = hashes[-1] if hashes else None
        extra = self._extra_keys.get(seq_id, ())
        blocks = []
        for start in range(slots, (len(token_ids) - 1) // self.block_size * self.block_size,
                           self.block_size):
            tokens = tuple(token_ids[start:start + self.block_size])
            parent = self._hash_fn(parent, tokens, extra)
            block = self.pool.cache.lookup(parent, tokens)
            if block is None:
                break
            blocks.append(block)
        return blocks

    def num_blocks_to_admit(self, seq_id: int, hit_blocks: list[int], num_tokens: int) -> int:
        """Blocks that become referenced if `seq_id` adopts `hit_blocks` and then holds
        `num_tokens` tokens: unreferenced hits plus new blocks."""
        have = len(self._tables.get(seq_id, ())) + len(hit_blocks)
        revived = sum(1 for block in hit_blocks if self.pool.ref_counts[block] == 0)
        return revived + max(0, _blocks_for(num_tokens, self.block_size) - have)

    def pause_preview(self, seq_id: int, keep_pinned: bool) -> tuple[int, int]:
        """(tokens to replay, blocks freed) if `pause(seq_id, keep_pinned)` ran now. Full blocks
        another sequence still references stay cached, so a resume finds them again: they free
        nothing and cost no replay."""
        table = self._tables.get(seq_id, [])
        slots = self._num_slots.get(seq_id, 0)
        keep = self._kept_blocks(seq_id, keep_pinned)
        replay_tokens, freed = slots - min(slots, keep * self.block_size), 0
        for index in range(keep, len(table)):
            if table[index] == DROPPED:
                continue
            if self.pool.ref_counts[table[index]] == 1:
                freed += 1
            elif self.pool.cache.is_cached(table[index]):
                replay_tokens -= self.block_size
        return replay_tokens, freed

    # ------------------------------------------------------------------ mutations
    def add_sequence(self, seq_id: int, pinned_tokens: int = 0, extra_keys: tuple = ()) -> None:
        """Start tracking `seq_id`; its first `pinned_tokens` tokens survive a pause. Extra keys
        (e.g. an adapter id) enter every block hash, so they separate otherwise equal prefixes."""
        assert seq_id not in self._tables, f"seq {seq_id} is already tracked"
        self._tables[seq_id] = []
        self._num_slots[seq_id] = 0
        self._hashes[seq_id] = []
        self._pinned_tokens[seq_id] = pinned_tokens
        self._extra_keys[seq_id] = tuple(extra_keys)

    def adopt_prefix(self, seq_id: int, blocks: list[int]) -> int:
        """Append cached blocks from `match_prefix` to the table; returns the tokens they hold."""
        if not blocks:
            return 0
        table = self._tables[seq_id]
        assert self._num_slots[seq_id] == len(table) * self.block_size, "adopt at a block boundary"
        for block in blocks:
            block_hash, _ = self.pool.cache.key(block)
            self.pool.acquire(block)
            table.append(block)
            self._hashes[seq_id].append(block_hash)
        self._num_slots[seq_id] += len(blocks) * self.block_size
        self._note_peak()
        return len(blocks) * self.block_size

    def allocate(self, seq_id: int, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq_id`. Returns False (and changes
        nothing) when the pool cannot. The first write into a shared partial block copies it."""
        if seq_id not in self._tables:
            self.add_sequence(seq_id)
        if self.num_blocks_needed(seq_id, num_new_tokens) > self.pool.num_free:
            return False
        table = self._tables[seq_id]
        if self._needs_copy(seq_id, num_new_tokens):
            source, copy = table[-1], self.pool.take()
            for cache in self.kv_caches:  # [2, Hkv, num_blocks, block_size, D]
                cache[:, :, copy] = cache[:, :, source]
            self.pool.release(source)
            table[-1] = copy
            self.num_cow_copies += 1
        total = self._num_slots[seq_id] + num_new_tokens
        while len(table) < _blocks_for(total, self.block_size):
            table.append(self.pool.take())
        self._num_slots[seq_id] = total
        self._note_peak()
        return True

    def commit(self, seq_id: int, token_ids: list[int], num_computed_tokens: int,
               through_dropped: bool = False) -> None:
        """Hash the blocks of `seq_id` that became full and computed, and index them.
        `through_dropped`: blocks dropped before they were hashed (a layered prefill's middle,
        computed exactly but never resident) get their hash, not a cache entry."""
        hashes = self._hashes[seq_id]
        full = min(num_computed_tokens, self._num_slots[seq_id]) // self.block_size
        if not self.enable_prefix_caching or len(hashes) >= full:
            return
        table, extra = self._tables[seq_id], self._extra_keys[seq_id]
        parent = hashes[-1] if hashes else None
        for index in range(len(hashes), full):
            assert through_dropped or table[index] != DROPPED, \
                f"seq {seq_id}: block {index} dropped before it was hashed"
            tokens = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            parent = self._hash_fn(parent, tokens, extra)
            hashes.append(parent)
            if table[index] != DROPPED and not self.pool.cache.is_cached(table[index]):
                self.pool.cache.insert(table[index], parent, tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        """`child_id` shares every block of `parent_id` (n > 1 branches, beams)."""
        assert not self._dropped.get(parent_id), f"seq {parent_id}: cannot fork with dropped blocks"
        self.add_sequence(child_id, self._pinned_tokens[parent_id], self._extra_keys[parent_id])
        for block in self._tables[parent_id]:
            self.pool.acquire(block)
        self._tables[child_id] = list(self._tables[parent_id])
        self._num_slots[child_id] = self._num_slots[parent_id]
        self._hashes[child_id] = list(self._hashes[parent_id])
        self.importance.copy(parent_id, child_id)

    def pause(self, seq_id: int, keep_pinned: bool = True) -> int:
        """Drop `seq_id`'s blocks past its pinned head (all of them when not `keep_pinned`).
        Full blocks stay in the prefix cache until evicted. Returns the tokens kept."""
        table = self._tables[seq_id]
        keep = self._kept_blocks(seq_id, keep_pinned)
        for block in reversed(table[keep:]):  # the tail is evicted first
            if block != DROPPED:
                self.pool.release(block)
        del table[keep:]
        kept_tokens = min(self._num_slots[seq_id], keep * self.block_size)
        self._num_slots[seq_id] = kept_tokens
        del self._hashes[seq_id][kept_tokens // self.block_size:]
        dropped = self._dropped.get(seq_id, {})
        for index in [i for i in dropped if i >= keep]:
            self._forget_dropped(seq_id, index)
        self.end_layered(seq_id)
        self._rebalance_reserve()
        return kept_tokens

    def _kept_blocks(self, seq_id: int, keep_pinned: bool) -> int:
        """Leading table entries a pause keeps: the pinned head, less any part of it that a
        layered prefill under way has not finished (those blocks lack their later layers)."""
        keep = min(len(self._tables.get(seq_id, ())), self.num_pinned_blocks(seq_id) if keep_pinned else 0)
        if seq_id in self._layered:
            keep = min(keep, self._layered[seq_id][0])
        return keep

    def free(self, seq_id: int) -> None:
        """Release every block of `seq_id` (finish or abort) and forget it."""
        if seq_id not in self._tables:
            return
        self.pause(seq_id, keep_pinned=False)
        for state in (self._tables, self._num_slots, self._hashes, self._pinned_tokens, self._extra_keys):
            del state[seq_id]
        self._dropped.pop(seq_id, None)
        self.importance.forget(seq_id)

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        index_bytes = self.index_bytes
        hot_bytes = (self.num_used_blocks - len(self._reserved)) * self.block_bytes
        self.peak_resident_bytes = max(self.peak_resident_bytes, hot_bytes + index_bytes + self.cold_bytes)
        self.peak_index_bytes = max(self.peak_index_bytes, index_bytes)
        self.peak_cold_bytes = max(self.peak_cold_bytes, self.cold_bytes)

    def peak_bytes_by_tier(self) -> dict[str, int]:
        """Peak bytes beside the hot tier: the key index (keys and summaries of dropped blocks)
        and the cold tier. The hot tier's own figure counts the blocks reserved for both."""
        return {"index": self.peak_index_bytes, "cold": self.peak_cold_bytes}

    @property
    def index_bytes(self) -> int:
        return self.key_index.num_used * self.key_index.slot_bytes

    @property
    def cold_bytes(self) -> int:
        return self.cold_pool.num_used * self.cold_pool.slot_bytes if self.cold_pool else 0

    # ------------------------------------------------------------------ dropped ranges (SPEC §5)
    def dropped_blocks(self, seq_id: int) -> list[int]:
        """Table indices of `seq_id`'s blocks out of the hot tier (dropped or cold), oldest
        first: what a replay recomputes."""
        return sorted(self._dropped.get(seq_id, ()))

    def cold_blocks(self, seq_id: int) -> list[int]:
        """Table indices of `seq_id`'s cold blocks, oldest first."""
        records = self._dropped.get(seq_id, {})
        return sorted(i for i, r in records.items() if r.cold_slot is not None)

    def cold_slots(self, seq_id: int) -> list[int]:
        """Cold-pool slots of `seq_id`'s cold blocks (attention reads them)."""
        records = self._dropped.get(seq_id, {})
        return [records[i].cold_slot for i in self.cold_blocks(seq_id)]

    def num_dropped_tokens(self, seq_id: int) -> int:
        return len(self._dropped.get(seq_id, ())) * self.block_size

    def index_slots(self, seq_id: int) -> list[int]:
        """Key-index slots of `seq_id`'s dropped blocks (the need detector reads them)."""
        return [slot for _, slot in self.indexed_blocks(seq_id)]

    def indexed_blocks(self, seq_id: int) -> list[tuple[int, int]]:
        """(table index, key-index slot) of each of `seq_id`'s dropped blocks that has a slot, in
        the order they were dropped (the need probe's columns)."""
        return [(index, r.slot) for index, r in self._dropped.get(seq_id, {}).items() if r.slot is not None]

    def resident_bytes(self, seq_id: int) -> int:
        """Bytes `seq_id` holds: its hot blocks (shared ones counted whole) and index slots."""
        cold = len(self.cold_slots(seq_id)) * self.cold_pool.slot_bytes if self.cold_pool else 0
        table = self._tables.get(seq_id, [])
        indexed = sum(r.slot is not None for r in self._dropped.get(seq_id, {}).values())
        return (len(table) - table.count(DROPPED)) * self.block_bytes + indexed * self.key_index.slot_bytes + cold

    def bytes_freed_by_drop(self, cold: bool, keep_index: bool) -> int:
        """How much `resident_bytes` falls when one unshared hot (or cold) block is dropped."""
        freed = self.cold_pool.slot_bytes if cold else self.block_bytes
        return freed - (self.key_index.slot_bytes if keep_index else 0)

    def resident_blocks(self, seq_id: int) -> list[int]:
        """Blocks of `seq_id` that hold K/V, in table order."""
        return [b for b in self._tables.get(seq_id, ()) if b != DROPPED]

    def droppable(self, seq_id: int, blocks: range) -> list[int]:
        """Of the table indices `blocks`, those hot and referenced by `seq_id` alone: dropping
        a shared block would free nothing."""
        table = self._tables.get(seq_id, [])
        return [i for i in blocks if i < len(table) and table[i] != DROPPED
                and self.pool.ref_counts[table[i]] == 1 and i * self.block_size < self._num_slots[seq_id]]

    def _fingerprint(self, blocks: torch.Tensor, cache: torch.Tensor | None = None) -> torch.Tensor:
        """[n, 2, Hkv, D] fp32 sums over each block's tokens of K and V in the last layer, the
        one every replay error would reach (`cache`: that layer's K/V laid out like the pool's,
        [2, Hkv, blocks, block_size, D]; default the pool's own)."""
        cache = self.kv_caches[-1] if cache is None else cache
        return cache.index_select(2, blocks).float().sum(3).permute(2, 0, 1, 3)

    def demote(self, seq_id: int, block_indices: list[int]) -> int:
        """Move hot blocks (from `droppable`) to the cold tier. Returns blocks freed (net of
        the cold tier's reservation)."""
        assert self.cold_pool is not None, "demote needs a cold tier (cold_dtype)"
        if not block_indices:
            return 0
        before = self.pool.num_free
        blocks = self._hot_blocks(seq_id, block_indices)
        fingerprints = self._fingerprint(blocks).cpu()
        cold_slots = self.cold_pool.add(self._gather(blocks, 0), self._gather(blocks, 1))
        self._vacate(seq_id, block_indices, [DroppedBlock(None, fingerprint, cold_slot)
                                             for cold_slot, fingerprint in zip(cold_slots, fingerprints)])
        return self.pool.num_free - before

    def drop_cold(self, seq_id: int, block_indices: list[int], keep_index: bool) -> int:
        """Drop cold blocks: their quantized K/V leave; with `keep_index` their (dequantized)
        keys enter the key index. Returns blocks freed from the reservation."""
        if not block_indices:
            return 0
        before = self.pool.num_free
        records = self._dropped[seq_id]
        cold_slots = [records[i].cold_slot for i in block_indices]
        assert None not in cold_slots, f"seq {seq_id}: only cold blocks can be dropped here"
        slots: list[int | None] = [None] * len(block_indices)
        if keep_index:
            keys, _ = self.cold_pool.dequantize_slots(cold_slots)
            slots = self.key_index.add(keys)
        self.cold_pool.remove(cold_slots)
        for index, slot in zip(block_indices, slots):
            records[index].cold_slot, records[index].slot = None, slot
        self._rebalance_reserve()
        return self.pool.num_free - before

    def drop(self, seq_id: int, block_indices: list[int], keep_index: bool) -> int:
        """Free the K/V of `seq_id`'s blocks at `block_indices` (from `droppable`). With
        `keep_index` their keys stay in the key index at int4. Returns blocks freed (net of
        the index's reservation)."""
        if not block_indices:
            return 0
        before = self.pool.num_free
        blocks = self._hot_blocks(seq_id, block_indices)
        fingerprints = self._fingerprint(blocks).cpu()
        slots = self.key_index.add(self._gather(blocks, 0)) if keep_index else [None] * len(block_indices)
        self._vacate(seq_id, block_indices, [DroppedBlock(slot, fingerprint)
                                             for slot, fingerprint in zip(slots, fingerprints)])
        return self.pool.num_free - before

    def _hot_blocks(self, seq_id: int, block_indices: list[int]) -> torch.Tensor:
        """The pool blocks at `block_indices`, which must be hot and referenced by `seq_id` alone."""
        table = self._tables[seq_id]
        assert all(table[i] != DROPPED and self.pool.ref_counts[table[i]] == 1 for i in block_indices), \
            f"seq {seq_id}: only hot, unshared blocks can leave the hot tier"
        return torch.tensor([table[i] for i in block_indices], device=self.kv_caches[0].device)

    def _gather(self, blocks: torch.Tensor, side: int) -> torch.Tensor:
        """K (side 0) or V (side 1) of `blocks` in every layer: [L, Hkv, n, block_size, D]."""
        return torch.stack([cache[side].index_select(1, blocks) for cache in self.kv_caches])

    def _vacate(self, seq_id: int, block_indices: list[int], records: list[DroppedBlock]) -> None:
        """Release the hot blocks at `block_indices` (a cached one waits in the LRU: a free
        restore) and record what stands in for each."""
        table = self._tables[seq_id]
        dropped = self._dropped.setdefault(seq_id, {})
        for index, record in zip(block_indices, records):
            self.pool.release(table[index])
            table[index] = DROPPED
            dropped[index] = record
        self._rebalance_reserve()
        self._note_peak()

    def restore_cached(self, seq_id: int, token_ids: list[int], indices: list[int] | None = None) -> list[int]:
        """Put back dropped blocks (all, or those among `indices`) whose K/V still sit in the
        prefix cache (not yet evicted): a replay that costs nothing. Returns the table indices
        restored."""
        table, hashes = self._tables[seq_id], self._hashes[seq_id]
        restored = []
        dropped = self.dropped_blocks(seq_id)
        if indices is not None:
            dropped = sorted(set(dropped).intersection(indices))
        for index in dropped:
            if index >= len(hashes):
                continue
            tokens = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            block = self.pool.cache.lookup(hashes[index], tokens)
            if block is None:
                continue
            self.pool.acquire(block)
            table[index] = block
            self._forget_dropped(seq_id, index)
            restored.append(index)
        if restored:
            self._rebalance_reserve()
            self._note_peak()
        return restored

    def allocate_restore(self, seq_id: int, block_indices: list[int]) -> bool:
        """Fresh blocks for dropped table indices about to be replayed; False (no change) when
        the pool lacks them."""
        if len(block_indices) > self.pool.num_free:
            return False
        table = self._tables[seq_id]
        for index in block_indices:
            assert table[index] == DROPPED, f"seq {seq_id}: block {index} is not dropped"
            table[index] = self.pool.take()
        self._note_peak()
        return True

    def finish_restore(self, seq_id: int, block_indices: list[int], token_ids: list[int]) -> int:
        """The replay of `block_indices` has written their K/V: compare each with the
        fingerprint taken at drop time, re-index it in the prefix cache, forget its index slot.
        Returns the number of blocks whose fingerprint did not match."""
        table, records = self._tables[seq_id], self._dropped[seq_id]
        blocks = torch.tensor([table[i] for i in block_indices], device=self.kv_caches[0].device)
        now = self._fingerprint(blocks).cpu()
        mismatches = 0
        for index, fingerprint in zip(block_indices, now):
            before = records[index].fingerprint
            error = (fingerprint - before).abs().max() / before.abs().max().clamp_min(1e-6)
            if error > self.fingerprint_tolerance:
                mismatches += 1
                logger.warning("seq %d: replayed block %d differs from its fingerprint by %.3g "
                               "(tolerance %.3g)", seq_id, index, float(error), self.fingerprint_tolerance)
            self._forget_dropped(seq_id, index)
            if self.enable_prefix_caching and index < len(self._hashes[seq_id]) \
                    and not self.pool.cache.is_cached(table[index]):
                tokens = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
                self.pool.cache.insert(table[index], self._hashes[seq_id][index], tokens)
        self._rebalance_reserve()
        return mismatches

    # ------------------------------------------------------------------ layered prefill
    def num_blocks_layered(self, seq_id: int, num_new_tokens: int, middle: range, keep_index: bool,
                           work_bytes: int) -> int:
        """Pool blocks `begin_layered` would take: the new hot blocks, the key-index slots'
        share of the reservation and the working memory's."""
        have = len(self._tables.get(seq_id, ()))
        new = range(have, _blocks_for(self._num_slots.get(seq_id, 0) + num_new_tokens, self.block_size))
        dropped = sum(1 for index in new if index in middle)
        index_bytes = dropped * self.key_index.slot_bytes if keep_index else 0
        return len(new) - dropped + _blocks_for(index_bytes, self.block_bytes) + \
            _blocks_for(work_bytes, self.block_bytes)

    def begin_layered(self, seq_id: int, num_new_tokens: int, middle: range, keep_index: bool,
                      work_bytes: int) -> list[int] | None:
        """Room for `num_new_tokens` more tokens of `seq_id` computed layer by layer: new table
        entries in `middle` start DROPPED (with a key-index slot when `keep_index`, filled by
        `write_layer`), the others get pool blocks, and `work_bytes` of working memory are held
        as reserved blocks until `end_layered`. The sequence's room must end on a block
        boundary and nothing of it may be dropped. Returns the new table indices, or None (no change) when the pool
        cannot hold them."""
        if seq_id not in self._tables:
            self.add_sequence(seq_id)
        table = self._tables[seq_id]
        assert self._num_slots[seq_id] == len(table) * self.block_size, "layered prefill starts at a block boundary"
        assert not self._dropped.get(seq_id) and seq_id not in self._layered, f"seq {seq_id}: not a fresh range"
        if self.num_blocks_layered(seq_id, num_new_tokens, middle, keep_index, work_bytes) > self.pool.num_free:
            return None
        new = list(range(len(table), _blocks_for(self._num_slots[seq_id] + num_new_tokens, self.block_size)))
        dropped = [index for index in new if index in middle]
        slots = self.key_index.allocate(len(dropped)) if keep_index else [None] * len(dropped)
        records = self._dropped.setdefault(seq_id, {}) if dropped else {}
        num_kv, head_dim = self.kv_caches[0].shape[1], self.kv_caches[0].shape[-1]
        for index, slot in zip(dropped, slots):  # fingerprints: written with the last layer
            records[index] = DroppedBlock(slot, torch.zeros(2, num_kv, head_dim))
        for index in new:
            table.append(DROPPED if index in records else self.pool.take())
        self._num_slots[seq_id] += num_new_tokens
        self._rebalance_reserve()
        self._layered[seq_id] = (new[0] if new else len(table),
                                 [self.pool.take() for _ in range(_blocks_for(work_bytes, self.block_bytes))])
        self._note_peak()
        return new

    def write_layer(self, seq_id: int, layer: int, scratch: torch.Tensor, new: list[int]) -> None:
        """One layer of a layered prefill is computed: `scratch` [2, Hkv, n, block_size, D]
        holds its K/V with scratch block i standing for table index i. The hot entries of
        `new` (from `begin_layered`) take their K/V; the dropped ones their keys in the key
        index and, at the last layer, their fingerprints (as `drop` takes them)."""
        table = self._tables[seq_id]
        device = scratch.device
        hot = [index for index in new if table[index] != DROPPED]
        if hot:
            source = torch.tensor(hot, device=device)
            target = torch.tensor([table[index] for index in hot], device=device)
            self.kv_caches[layer].index_copy_(2, target, scratch.index_select(2, source))
        records = self._dropped.get(seq_id, {})
        dropped = [index for index in new if table[index] == DROPPED]
        if not dropped:
            return
        source = torch.tensor(dropped, device=device)
        slots = [records[index].slot for index in dropped]
        if slots[0] is not None:
            self.key_index.write_layer(layer, slots, scratch[0].index_select(1, source))
        if layer == len(self.kv_caches) - 1:
            fingerprints = self._fingerprint(source, scratch).cpu()
            for index, fingerprint in zip(dropped, fingerprints):
                records[index].fingerprint = fingerprint

    def end_layered(self, seq_id: int) -> None:
        """Release a layered prefill's working memory (done, or the sequence paused)."""
        for block in self._layered.pop(seq_id, (0, []))[1]:
            self.pool.release(block)

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Forget slots past `num_tokens` (a decode step that is redone after a replay)."""
        table = self._tables[seq_id]
        assert num_tokens <= self._num_slots[seq_id], "truncate only shrinks"
        keep = _blocks_for(num_tokens, self.block_size)
        assert all(b != DROPPED for b in table[keep:]), "truncate through a dropped block"
        for block in reversed(table[keep:]):
            self.pool.release(block)
        del table[keep:]
        self._num_slots[seq_id] = num_tokens
        del self._hashes[seq_id][num_tokens // self.block_size:]

    def _forget_dropped(self, seq_id: int, index: int) -> None:
        record = self._dropped[seq_id].pop(index)
        if record.slot is not None:
            self.key_index.remove([record.slot])
        if record.cold_slot is not None:
            self.cold_pool.remove([record.cold_slot])
        if not self._dropped[seq_id]:
            del self._dropped[seq_id]

    def _reserve_target(self) -> int:
        index_bytes = self.key_index.num_used * self.key_index.slot_bytes
        return -(-(index_bytes + self.cold_bytes) // self.block_bytes)

    def _rebalance_reserve(self) -> None:
        """Hold as many pool blocks as the key index's bytes fill, so that the budget counts
        them (and the cold tier's). Dropping or demoting frees a whole block per slot (an index
        slot is ~1/5 of one, a cold slot 2/5-2/3), so this never starves."""
        target = self._reserve_target()
        while len(self._reserved) > target:
            self.pool.release(self._reserved.pop())
        while len(self._reserved) < target:
            assert self.pool.num_free > 0, "no block left to reserve for the key index"
            self._reserved.append(self.pool.take())

    # ------------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Ref counts equal table references; free lists, LRU and cache entries agree; every
        sequence's hash chain matches the cached content of its blocks; pins are held."""
        self.pool.check_integrity(self.block_size)
        counted = [0] * self.num_blocks
        for block in self._reserved + [b for _, blocks in self._layered.values() for b in blocks]:
            counted[block] += 1
        assert set(self._layered) <= set(self._tables), "working memory of an unknown sequence"
        assert len(self._reserved) == self._reserve_target(), "key-index reservation out of date"
        slots = [r.slot for records in self._dropped.values() for r in records.values()
                 if r.slot is not None]
        assert len(slots) == len(set(slots)) == self.key_index.num_used, "key-index slots leaked"
        cold = [r.cold_slot for records in self._dropped.values() for r in records.values()
                if r.cold_slot is not None]
        assert len(cold) == len(set(cold)) == (self.cold_pool.num_used if self.cold_pool else 0), \
            "cold slots leaked"
        assert not any(r.slot is not None and r.cold_slot is not None
                       for records in self._dropped.values() for r in records.values()), \
            "a block both cold and indexed"
        for seq_id, records in self._dropped.items():
            assert records, f"seq {seq_id}: empty dropped record"
            for index in records:
                assert self._tables[seq_id][index] == DROPPED, f"seq {seq_id}: block {index} not dropped"
        for seq_id, table in self._tables.items():
            slots = self._num_slots[seq_id]
            assert len(table) == _blocks_for(slots, self.block_size), \
                f"seq {seq_id}: {len(table)} blocks for {slots} slots"
            assert sum(b == DROPPED for b in table) == len(self._dropped.get(seq_id, ())), \
                f"seq {seq_id}: dropped entries without records"
            for block in table:
                if block != DROPPED:
                    counted[block] += 1
            hashes = self._hashes[seq_id]
            assert len(hashes) <= slots // self.block_size, f"seq {seq_id}: hash past its full blocks"
            parent = None
            for block, block_hash in zip(table, hashes):
                key = self.pool.cache.key(block) if block != DROPPED else None
                if key is not None:
                    assert key[0] == block_hash, f"seq {seq_id}: block {block} cached under another hash"
                    assert self._hash_fn(parent, key[1], self._extra_keys[seq_id]) == block_hash, \
                        f"seq {seq_id}: block {block} breaks the hash chain"
                parent = block_hash
            pinned = self.num_pinned_blocks(seq_id)
            assert all(b != DROPPED and self.pool.ref_counts[b] > 0 for b in table[:pinned]), \
                f"seq {seq_id}: pin lost"
        for block in range(self.num_blocks):
            assert counted[block] == self.pool.ref_counts[block], \
                f"block {block}: ref count {self.pool.ref_counts[block]}, tables hold {counted[block]}"
