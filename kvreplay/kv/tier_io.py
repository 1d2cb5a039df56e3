"""Moves between the pool and the session tier (kv/session_tier.py), owned by the KV manager.

In: a cached block the pool evicts from its LRU (`on_evict`) is copied to the tier before its
slot is reused. Every computed full block reaches the tier that way: a finished chat's blocks,
a paused sequence's released range and a block dropped by trim or reclaim all wait in the
prefix cache's LRU first (they are hashed when computed), so one hook covers them, and a block
still in the LRU costs nothing to restore.

Out: `load_prefix` continues a sequence's table with tier blocks that extend its hash chain (a
prefix-cache miss: a returning chat, a resume); `restore` puts back dropped blocks of a running
sequence (a replay). A block is a pool page, its storage slots: on a hybrid pool a global page
holds the global layers, all a dropped block leaves, so `restore` works there as on any pool;
`load_prefix` does not (a prefix also needs the local layers' window pages, which it would have
to match too: not built), so a hybrid pool's returning chat recomputes what the cache lost. Loaded K/V are the bits that left (the tier verifies checksums), so neither
needs anything before it resident: replay's exactness rule holds as for a prefix-cache restore.
A restored block's fingerprint is checked before it enters the table (a mismatch leaves it
dropped for the replay to recompute) and again by `finish_restore`, the replay's own check.
Both take the K/V from the tier, or from `found`: blocks the tier read ahead in its background
thread (`SessionTier.prefetch` / `collect`), keyed by hash.
"""
from __future__ import annotations

import torch

from kvreplay.kv.session_tier import SessionTier


class TierIO:
    def __init__(self, kv, tier: SessionTier):
        self.kv = kv      # the KVManager that owns this helper, the tier and the block tables
        self.tier = tier
        kv.pool.on_evict = self.on_evict

    def block_data(self, block: int) -> torch.Tensor:
        """One pool page's K/V at each storage slot: [slots, 2, Hkv, block_size, D] (every
        layer; on a hybrid pool, the global layers of a global page)."""
        return torch.stack([storage[:, :, block] for storage in self.kv.storages])

    def write_blocks(self, blocks: list[int], data: list[torch.Tensor]) -> None:
        """Write each block's K/V ([layers, 2, Hkv, block_size, D]) into the pool. One copy per
        block and layer from a contiguous source: on a CPU in bf16 that is ~15x faster than one
        indexed copy per layer (index_copy_ or a slice copy from a permuted source take a slow
        strided path: ~12 ms per layer for 31 blocks against 0.8 ms)."""
        device = self.kv.kv_caches[0].device
        for block, layers in zip(blocks, data):
            layers = layers.to(device)
            for cache, layer in zip(self.kv.storages, layers):  # cache: [2, Hkv, num_blocks, block_size, D]
                cache[:, :, block] = layer  # [2, Hkv, block_size, D]

    def on_evict(self, block: int, key: tuple[int, tuple[int, ...]]) -> None:
        self.tier.put(key[0], key[1], self.block_data(block))

    # ------------------------------------------------------------------ prefix misses
    def match(self, seq_id: int, token_ids: list[int]) -> list[int]:
        """Hashes of the tier blocks that continue `seq_id`'s table for `token_ids` (like
        `match_prefix`: from a block boundary, never covering the last token)."""
        kv = self.kv
        if kv.local.num_groups:  # a hybrid pool's prefix also needs its local windows' pages: not kept
            return []
        slots = kv._num_slots.get(seq_id, 0)
        hashes = kv._hashes.get(seq_id, [])
        if not kv.enable_prefix_caching or slots % kv.block_size or len(hashes) * kv.block_size != slots:
            return []
        parent, extra, found = (hashes[-1] if hashes else None), kv._extra_keys[seq_id], []
        for start in range(slots, (len(token_ids) - 1) // kv.block_size * kv.block_size, kv.block_size):
            parent = kv._hash_fn(parent, tuple(token_ids[start:start + kv.block_size]), extra)
            if parent not in self.tier:
                break
            found.append(parent)
        return found

    def _get(self, block_hash: int, tokens: tuple[int, ...], found: dict | None) -> torch.Tensor | None:
        return self.tier.get(block_hash, tokens) if found is None else found.get(block_hash)

    def load_prefix(self, seq_id: int, token_ids: list[int], num_blocks: int, found: dict | None = None) -> int:
        """Append `num_blocks` tier blocks (from `match`) to `seq_id`'s table, their K/V read
        from the tier, and index them. A block that fails to load ends the run there (the rest
        is recomputed). Returns the tokens loaded; 0 when the pool lacks the blocks."""
        kv = self.kv
        start = kv._num_slots[seq_id]
        if not num_blocks or not kv.allocate(seq_id, num_blocks * kv.block_size):
            return 0
        parent = kv._hashes[seq_id][-1] if kv._hashes[seq_id] else None
        loads = []
        for offset in range(num_blocks):
            begin = start + offset * kv.block_size
            tokens = tuple(token_ids[begin:begin + kv.block_size])
            parent = kv._hash_fn(parent, tokens, kv._extra_keys[seq_id])
            data = self._get(parent, tokens, found)
            if data is None:
                break
            loads.append(data)
        table = kv._tables[seq_id]
        self.write_blocks(table[len(table) - num_blocks:][:len(loads)], loads)
        loaded = len(loads) * kv.block_size
        kv.truncate(seq_id, start + loaded)
        kv.commit(seq_id, token_ids, start + loaded)
        return loaded

    # ------------------------------------------------------------------ replays
    def hashes(self, seq_id: int, indices: list[int]) -> list[int]:
        """The chained hashes of `seq_id`'s blocks at `indices`."""
        return [self.kv._hashes[seq_id][i] for i in indices]

    def restorable(self, seq_id: int, indices: list[int]) -> list[int]:
        """Of dropped table indices `indices`, those whose K/V the tier holds."""
        hashes = self.kv._hashes[seq_id]
        return [i for i in indices if i < len(hashes) and hashes[i] in self.tier]

    def restore(self, seq_id: int, token_ids: list[int], indices: list[int],
                found: dict | None = None) -> tuple[list[int], int]:
        """Put back dropped blocks at `indices` (from `restorable`) from the tier, as far as the
        pool has free blocks. Returns (table indices restored, fingerprint mismatches)."""
        kv, records = self.kv, self.kv.tiers.records[seq_id]
        restored, loads, mismatches = [], [], 0
        for index in indices:
            if kv.pool.num_free == 0:
                break
            tokens = tuple(token_ids[index * kv.block_size:(index + 1) * kv.block_size])
            block_hash = kv._hashes[seq_id][index]
            data = self._get(block_hash, tokens, found)
            if data is None:
                continue
            before = records[index].fingerprint  # [2, Hkv, D], taken when the block left
            now = data[-1].float().sum(2)        # the same sums over the loaded last layer
            if (now - before).abs().max() / before.abs().max().clamp_min(1e-6) > kv.fingerprint_tolerance:
                self.tier.discard(block_hash)  # not the bits that left: the replay recomputes it
                mismatches += 1
                continue
            kv.allocate_restore(seq_id, [index])
            restored.append(index)
            loads.append(data)
        self.write_blocks([kv._tables[seq_id][i] for i in restored], loads)
        if restored:
            mismatches += kv.finish_restore(seq_id, restored, token_ids)
            kv._note_peak()
        return restored, mismatches
