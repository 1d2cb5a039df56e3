"""The KV manager: the ONLY owner of block tables, ref counts, block hashes and pins.

The scheduler and the engine ask (`num_blocks_needed`, `match_prefix`, `pause_preview`) and then
act through it (`allocate`, `adopt_prefix`, `commit`, `fork`, `pause`, `free`); nothing else
mutates a block table. The cache tensors live here too; the model reads and writes rows of them
through the slot mapping the runner derives from our block tables.

A sequence's table, with its zones (SPEC §4) for the `full` policy:

    | pinned: max(protected span, sink_tokens), whole blocks | the rest: dropped on pause |
    [ b7 ][ b2 ]                                             [ b9 ][ b4 ][ b5 (partial) ]
    shared with other sequences through the prefix cache     CoW copy on the first write
                                                             to a shared partial block
"""
from __future__ import annotations

import torch

from kvreplay.kv.block_pool import BlockPool
from kvreplay.kv.prefix_cache import HashFn, chain_hash


def _blocks_for(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 enable_prefix_caching: bool = True, hash_fn: HashFn = chain_hash):
        assert num_blocks > 0 and block_size > 0, "a pool needs at least one block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._hash_fn = hash_fn
        # One tensor per layer: [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim].
        # Heads outermost: gathering a batch's blocks yields [Hkv, B, L, D], which batched
        # matmuls take as it is (no per-layer copy to a head-major layout).
        self.kv_caches = [torch.zeros(2, num_kv_heads, num_blocks, block_size, head_dim,
                                      dtype=dtype, device=device) for _ in range(num_layers)]
        self.pool = BlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}
        self._num_slots: dict[int, int] = {}      # tokens each sequence has room for
        self._hashes: dict[int, list[int]] = {}   # chain hash of each leading full, computed block
        self._pinned_tokens: dict[int, int] = {}  # head of the sequence kept through a pause
        self._extra_keys: dict[int, tuple] = {}
        self.peak_used_blocks = 0
        self.num_cow_copies = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        """Unreferenced blocks, including cached ones (they are evicted on demand)."""
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.pool.num_free

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
        keep = min(len(table), self.num_pinned_blocks(seq_id) if keep_pinned else 0)
        replay_tokens, freed = slots - min(slots, keep * self.block_size), 0
        for index in range(keep, len(table)):
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

    def commit(self, seq_id: int, token_ids: list[int], num_computed_tokens: int) -> None:
        """Hash the blocks of `seq_id` that became full and computed, and index them."""
        hashes = self._hashes[seq_id]
        full = min(num_computed_tokens, self._num_slots[seq_id]) // self.block_size
        if not self.enable_prefix_caching or len(hashes) >= full:
            return
        table, extra = self._tables[seq_id], self._extra_keys[seq_id]
        parent = hashes[-1] if hashes else None
        for index in range(len(hashes), full):
            tokens = tuple(token_ids[index * self.block_size:(index + 1) * self.block_size])
            parent = self._hash_fn(parent, tokens, extra)
            hashes.append(parent)
            if not self.pool.cache.is_cached(table[index]):
                self.pool.cache.insert(table[index], parent, tokens)

    def fork(self, parent_id: int, child_id: int) -> None:
        """`child_id` shares every block of `parent_id` (n > 1 branches, beams)."""
        self.add_sequence(child_id, self._pinned_tokens[parent_id], self._extra_keys[parent_id])
        for block in self._tables[parent_id]:
            self.pool.acquire(block)
        self._tables[child_id] = list(self._tables[parent_id])
        self._num_slots[child_id] = self._num_slots[parent_id]
        self._hashes[child_id] = list(self._hashes[parent_id])

    def pause(self, seq_id: int, keep_pinned: bool = True) -> int:
        """Drop `seq_id`'s blocks past its pinned head (all of them when not `keep_pinned`).
        Full blocks stay in the prefix cache until evicted. Returns the tokens kept."""
        table = self._tables[seq_id]
        keep = min(len(table), self.num_pinned_blocks(seq_id) if keep_pinned else 0)
        for block in reversed(table[keep:]):  # the tail is evicted first
            self.pool.release(block)
        del table[keep:]
        kept_tokens = min(self._num_slots[seq_id], keep * self.block_size)
        self._num_slots[seq_id] = kept_tokens
        del self._hashes[seq_id][kept_tokens // self.block_size:]
        return kept_tokens

    def free(self, seq_id: int) -> None:
        """Release every block of `seq_id` (finish or abort) and forget it."""
        if seq_id not in self._tables:
            return
        self.pause(seq_id, keep_pinned=False)
        for state in (self._tables, self._num_slots, self._hashes, self._pinned_tokens, self._extra_keys):
            del state[seq_id]

    def _note_peak(self) -> None:
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)

    # ------------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Ref counts equal table references; free lists, LRU and cache entries agree; every
        sequence's hash chain matches the cached content of its blocks; pins are held."""
        self.pool.check_integrity(self.block_size)
        counted = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            slots = self._num_slots[seq_id]
            assert len(table) == _blocks_for(slots, self.block_size), \
                f"seq {seq_id}: {len(table)} blocks for {slots} slots"
            for block in table:
                counted[block] += 1
            hashes = self._hashes[seq_id]
            assert len(hashes) <= slots // self.block_size, f"seq {seq_id}: hash past its full blocks"
            parent = None
            for block, block_hash in zip(table, hashes):
                key = self.pool.cache.key(block)
                if key is not None:
                    assert key[0] == block_hash, f"seq {seq_id}: block {block} cached under another hash"
                    assert self._hash_fn(parent, key[1], self._extra_keys[seq_id]) == block_hash, \
                        f"seq {seq_id}: block {block} breaks the hash chain"
                parent = block_hash
            pinned = self.num_pinned_blocks(seq_id)
            assert all(self.pool.ref_counts[b] > 0 for b in table[:pinned]), f"seq {seq_id}: pin lost"
        for block in range(self.num_blocks):
            assert counted[block] == self.pool.ref_counts[block], \
                f"block {block}: ref count {self.pool.ref_counts[block]}, tables hold {counted[block]}"
