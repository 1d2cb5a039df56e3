"""The KV manager: the ONLY owner of block tables, ref counts, block hashes, pins, dropped
ranges and the key index.

The scheduler and the engine ask (`num_blocks_needed`, `match_prefix`, `pause_preview`) and then
act through it (`allocate`, `adopt_prefix`, `commit`, `fork`, `pause`, `free`); nothing else
mutates a block table. The cache tensors live here too; the model reads and writes rows of them
through the slot mapping the runner derives from our block tables.

A sequence's table, with its zones (docs/architecture.md §4) for the `full` policy:

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

import functools
import logging

import torch

from kvreplay.kernels import huge_pages
from kvreplay.kv.block_pool import BlockPool
from kvreplay.kv.cold_pool import ColdPool
from kvreplay.kv.importance import BlockImportance
from kvreplay.kv.integrity import check_integrity
from kvreplay.kv.key_index import KeyIndex
from kvreplay.kv.layered import LayeredPrefills
from kvreplay.kv.local_groups import LocalGroups, layer_layout
from kvreplay.kv.prefix_cache import HashFn, chain_hash
from kvreplay.kv.tiers import DROPPED, TierMoves, blocks_for as _blocks_for
from kvreplay.kv.tier_io import TierIO

logger = logging.getLogger(__name__)


def _forward(helper: str, function):
    """A KVManager method carried out by its helper `helper` (same signature and docstring)."""
    @functools.wraps(function)
    def method(self, *args, **kwargs):
        return function(getattr(self, helper), *args, **kwargs)
    return method


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 enable_prefix_caching: bool = True, hash_fn: HashFn = chain_hash,
                 cold_dtype: str | None = None, index_layers: frozenset[int] | None = None,
                 local_layers: tuple[int, ...] = (), sliding_window: int | None = None):
        assert num_blocks > 0 and block_size > 0, "a pool needs at least one block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn
        # One tensor per layer: [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim].
        # Heads outermost: gathering a batch's blocks yields [Hkv, B, L, D], which batched
        # matmuls take as it is (no per-layer copy to a head-major layout).
        # On a CPU, 2 MiB pages where Linux gives them (decode reads scattered 2 KiB blocks).
        # `local_layers` (their window `sliding_window`): a hybrid pool (kv/local_groups.py),
        # whose layers share storage tensors, one per global layer.
        layer_slots, self.layer_groups, num_groups = layer_layout(num_layers, local_layers)
        self.storages = [huge_pages.zeros(2, num_kv_heads, num_blocks, block_size, head_dim, dtype=dtype,
                                          device=device) for _ in range(max(layer_slots) + 1)]
        self.kv_caches = [self.storages[slot] for slot in layer_slots]
        self.pool = BlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}
        self._num_slots: dict[int, int] = {}      # tokens each sequence has room for
        self._hashes: dict[int, list[int]] = {}   # chain hash of each leading full, computed block
        self._pinned_tokens: dict[int, int] = {}  # head of the sequence kept through a pause
        self._extra_keys: dict[int, tuple] = {}
        self.peak_used_blocks = self.peak_resident_bytes = self.peak_index_bytes = self.peak_cold_bytes = 0
        self.num_cow_copies = 0
        self.block_bytes = 2 * len(self.storages) * num_kv_heads * block_size * head_dim * \
            torch.finfo(dtype).bits // 8
        self.local = LocalGroups(self, num_groups, sliding_window)  # no groups: not hybrid
        # The need detector's int4 keys, for the layers it reads (index_layers; None: all).
        self.key_index = KeyIndex(num_layers, num_kv_heads, block_size, head_dim, device,
                                  layers=index_layers)
        self.cold_pool = ColdPool(len(self.storages), num_kv_heads, block_size, head_dim, cold_dtype, device) \
            if cold_dtype else None  # the layers that keep every block: a hybrid pool's global ones
        # Helpers this manager owns: moves between tiers (with the dropped records and the
        # reservation) and layered prefills (with their working memory).
        self.tiers = TierMoves(self)
        self._dropped = self.tiers.records  # seq -> block index -> DroppedBlock
        self.layered = LayeredPrefills(self)
        self.fingerprint_tolerance = 1e-3 if dtype == torch.float32 else 6e-2
        self.importance = BlockImportance()  # observed attention mass per block
        self.tier_io: TierIO | None = None  # the session tier below the pool (attach_tier)

    def attach_tier(self, tier) -> None:
        """Own the session tier `tier` (kv/session_tier.py): evicted cached blocks go to it."""
        self.tier_io = TierIO(self, tier)

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
        return len(self.tiers.reserved)

    @property
    def num_cached_blocks(self) -> int:
        """Unreferenced blocks that still hold a prefix-cache entry."""
        return self.pool.num_cached_free

    @property
    def capacity_tokens(self) -> int:
        """Tokens one sequence can hold (beside a hybrid pool's local windows)."""
        return max(0, self.num_blocks - self.local.num_groups * self.local.window_blocks) * self.block_size

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
        new, copy = max(0, _blocks_for(total, self.block_size) - have), self._needs_copy(seq_id, num_new_tokens)
        return new + copy + self.local.num_pages_needed(seq_id, new, copy)

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
        blocks, hashes, tokens_of = [], [], []
        for start in range(slots, (len(token_ids) - 1) // self.block_size * self.block_size,
                           self.block_size):
            tokens = tuple(token_ids[start:start + self.block_size])
            parent = self._hash_fn(parent, tokens, extra)
            block = self.pool.cache.lookup(parent, tokens)
            if block is None:
                break
            blocks.append(block)
            hashes.append(parent)
            tokens_of.append(tokens)
        if blocks:  # as far as the local groups' windows reach
            blocks = blocks[:self.local.trim_hit(seq_id, slots // self.block_size, hashes, tokens_of)]
        return blocks

    def num_blocks_to_admit(self, seq_id: int, hit_blocks: list[int], num_tokens: int) -> int:
        """Blocks that become referenced if `seq_id` adopts `hit_blocks` and then holds
        `num_tokens` tokens: unreferenced hits plus new blocks."""
        have = len(self._tables.get(seq_id, ())) + len(hit_blocks)
        revived = sum(1 for block in hit_blocks if self.pool.ref_counts[block] == 0)
        return revived + max(0, _blocks_for(num_tokens, self.block_size) - have) + \
            self.local.num_pages_projected(seq_id, num_tokens)

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
        return replay_tokens, freed + self.local.num_released_by(seq_id, keep)

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
        self.local.add(seq_id)

    def adopt_prefix(self, seq_id: int, blocks: list[int]) -> int:
        """Append cached blocks from `match_prefix` to the table; returns the tokens they hold."""
        if not blocks:
            return 0
        table = self._tables[seq_id]
        assert self._num_slots[seq_id] == len(table) * self.block_size, "adopt at a block boundary"
        keys = [self.pool.cache.key(block) for block in blocks]
        for block, (block_hash, _) in zip(blocks, keys):
            self.pool.acquire(block)
            table.append(block)
            self._hashes[seq_id].append(block_hash)
        self._num_slots[seq_id] += len(blocks) * self.block_size
        self.local.adopt(seq_id, len(table) - len(blocks), *map(list, zip(*keys)), self._num_slots[seq_id])
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
            self.local.copy_page(source, copy)
            self.pool.release(source)
            table[-1] = copy
            self.num_cow_copies += 1
            self.local.copy_last(seq_id)
        total = self._num_slots[seq_id] + num_new_tokens
        while len(table) < _blocks_for(total, self.block_size):
            table.append(self.pool.take())
        self.local.grow(seq_id, len(table))
        self._num_slots[seq_id] = total
        self._note_peak()
        return True

    def commit(self, seq_id: int, token_ids: list[int], num_computed_tokens: int,
               approx_from: int | None = None, through_dropped: bool = False) -> None:
        """Hash the blocks of `seq_id` that became full and computed, and index them.
        `approx_from`: blocks holding positions from there on were computed without some
        dropped range: hashed, never offered to other requests as exact K/V.
        `through_dropped`: blocks dropped before they were hashed (a layered prefill's middle,
        computed exactly but never resident) get their hash, not a cache entry."""
        hashes = self._hashes[seq_id]
        computed = min(num_computed_tokens, self._num_slots[seq_id])
        full = computed // self.block_size
        table, extra = self._tables[seq_id], self._extra_keys[seq_id]
        parent = hashes[-1] if hashes else None
        for index in range(len(hashes), full if self.enable_prefix_caching else 0):
            assert through_dropped or table[index] != DROPPED, \
                f"seq {seq_id}: block {index} dropped before it was hashed"
            tokens = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            before, parent = parent, self._hash_fn(parent, tokens, extra)
            hashes.append(parent)
            exact = approx_from is None or (index + 1) * self.block_size <= approx_from
            if exact and table[index] != DROPPED and not self.pool.cache.is_cached(table[index]):
                if self.pool.cache.insert(table[index], parent, tokens, before) and self.local.num_groups:
                    self.local.index(seq_id, index, parent, tokens)
        self.local.release_before(seq_id, self.local.first_needed(computed))  # no later query reads them

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
        self.local.fork(parent_id, child_id)

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
        self.local.cut(seq_id, keep, kept_tokens)
        dropped = self._dropped.get(seq_id, {})
        for index in [i for i in dropped if i >= keep]:
            self.tiers.forget(seq_id, index)
        self.end_layered(seq_id)
        self.tiers.rebalance_reserve()
        return kept_tokens

    def _kept_blocks(self, seq_id: int, keep_pinned: bool) -> int:
        """Leading table entries a pause keeps: the pinned head, less any part of it that a
        layered prefill under way has not finished (those blocks lack their later layers)."""
        keep = min(len(self._tables.get(seq_id, ())), self.num_pinned_blocks(seq_id) if keep_pinned else 0)
        if seq_id in self.layered.active:
            keep = min(keep, self.layered.active[seq_id][0])
        kept_tokens = min(self._num_slots.get(seq_id, 0), keep * self.block_size)
        if not self.local.head_is_whole(seq_id, keep, kept_tokens):
            return 0  # the local layers' window at the head's end is gone: recompute it all
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
        self.local.forget(seq_id)

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        index_bytes = self.index_bytes
        hot_bytes = (self.num_used_blocks - len(self.tiers.reserved)) * self.block_bytes
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

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """Forget slots past `num_tokens` (a decode step that is redone after a replay)."""
        table = self._tables[seq_id]
        assert num_tokens <= self._num_slots[seq_id], "truncate only shrinks"
        keep = _blocks_for(num_tokens, self.block_size)
        assert all(b != DROPPED for b in table[keep:]), "truncate through a dropped block"
        for block in reversed(table[keep:]):
            self.pool.release(block)
        del table[keep:]
        self.local.cut(seq_id, keep)
        self._num_slots[seq_id] = num_tokens
        del self._hashes[seq_id][num_tokens // self.block_size:]

    # ------------------------------------------------------------------ carried out by helpers
    # Tier moves and dropped-range queries (kv/tiers.py), layered prefills (kv/layered.py), the
    # hybrid pool's local groups (kv/local_groups.py); each keeps its helper's docstring.
    dropped_blocks = _forward("tiers", TierMoves.dropped_blocks)
    cold_blocks = _forward("tiers", TierMoves.cold_blocks)
    cold_slots = _forward("tiers", TierMoves.cold_slots)
    num_dropped_tokens = _forward("tiers", TierMoves.num_dropped_tokens)
    index_slots = _forward("tiers", TierMoves.index_slots)
    indexed_blocks = _forward("tiers", TierMoves.indexed_blocks)
    resident_bytes = _forward("tiers", TierMoves.resident_bytes)
    bytes_freed_by_drop = _forward("tiers", TierMoves.bytes_freed_by_drop)
    resident_blocks = _forward("tiers", TierMoves.resident_blocks)
    droppable = _forward("tiers", TierMoves.droppable)
    demote = _forward("tiers", TierMoves.demote)
    drop_cold = _forward("tiers", TierMoves.drop_cold)
    drop = _forward("tiers", TierMoves.drop)
    restore_cached = _forward("tiers", TierMoves.restore_cached)
    restore_room = _forward("tiers", TierMoves.restore_room)
    allocate_restore = _forward("tiers", TierMoves.allocate_restore)
    finish_restore = _forward("tiers", TierMoves.finish_restore)
    num_blocks_projected = _forward("local", LocalGroups.num_blocks_projected)
    num_blocks_layered = _forward("layered", LayeredPrefills.num_blocks)
    begin_layered = _forward("layered", LayeredPrefills.begin)
    write_layer = _forward("layered", LayeredPrefills.write_layer)
    end_layered = _forward("layered", LayeredPrefills.end)
    check_integrity = check_integrity
