"""Layered prefill's KV side, owned by the KV manager: room for a range computed one layer
at a time over its whole length, whose middle starts out dropped, and the working memory it
holds (reserved pool blocks) until its last layer is written.
"""
from __future__ import annotations

import torch

from kvreplay.kv.tiers import DROPPED, DroppedBlock, blocks_for as _blocks_for


class LayeredPrefills:
    def __init__(self, kv):
        self.kv = kv  # the KVManager that owns this helper and the block tables
        # Per sequence under way: the first table index of its range (whose blocks hold only
        # some layers until it ends) and the pool blocks standing for its working memory (its
        # hidden states and one layer's K/V of the whole range).
        self.active: dict[int, tuple[int, list[int]]] = {}

    def num_blocks(self, seq_id: int, num_new_tokens: int, middle: range, keep_index: bool,
                           work_bytes: int) -> int:
        """Pool blocks `begin_layered` would take: the new hot blocks, the key-index slots'
        share of the reservation and the working memory's."""
        have = len(self.kv._tables.get(seq_id, ()))
        new = range(have, _blocks_for(self.kv._num_slots.get(seq_id, 0) + num_new_tokens, self.kv.block_size))
        dropped = sum(1 for index in new if index in middle)
        index_bytes = dropped * self.kv.key_index.slot_bytes if keep_index else 0
        return len(new) - dropped + _blocks_for(index_bytes, self.kv.block_bytes) + \
            _blocks_for(work_bytes, self.kv.block_bytes)

    def begin(self, seq_id: int, num_new_tokens: int, middle: range, keep_index: bool,
                      work_bytes: int) -> list[int] | None:
        """Room for `num_new_tokens` more tokens of `seq_id` computed layer by layer: new table
        entries in `middle` start DROPPED (with a key-index slot when `keep_index`, filled by
        `write_layer`), the others get pool blocks, and `work_bytes` of working memory are held
        as reserved blocks until `end_layered`. The sequence's room must end on a block
        boundary and nothing of it may be dropped. Returns the new table indices, or None (no change) when the pool
        cannot hold them."""
        if seq_id not in self.kv._tables:
            self.kv.add_sequence(seq_id)
        table = self.kv._tables[seq_id]
        assert self.kv._num_slots[seq_id] == len(table) * self.kv.block_size, "layered prefill starts at a block boundary"
        assert not self.kv._dropped.get(seq_id) and seq_id not in self.active, f"seq {seq_id}: not a fresh range"
        if self.num_blocks(seq_id, num_new_tokens, middle, keep_index, work_bytes) > self.kv.pool.num_free:
            return None
        new = list(range(len(table), _blocks_for(self.kv._num_slots[seq_id] + num_new_tokens, self.kv.block_size)))
        dropped = [index for index in new if index in middle]
        slots = self.kv.key_index.allocate(len(dropped)) if keep_index else [None] * len(dropped)
        records = self.kv._dropped.setdefault(seq_id, {}) if dropped else {}
        num_kv, head_dim = self.kv.kv_caches[0].shape[1], self.kv.kv_caches[0].shape[-1]
        for index, slot in zip(dropped, slots):  # fingerprints: written with the last layer
            records[index] = DroppedBlock(slot, torch.zeros(2, num_kv, head_dim))
        for index in new:
            table.append(DROPPED if index in records else self.kv.pool.take())
        self.kv._num_slots[seq_id] += num_new_tokens
        self.kv.tiers.rebalance_reserve()
        self.active[seq_id] = (new[0] if new else len(table),
                                 [self.kv.pool.take() for _ in range(_blocks_for(work_bytes, self.kv.block_bytes))])
        self.kv._note_peak()
        return new

    def write_layer(self, seq_id: int, layer: int, scratch: torch.Tensor, new: list[int]) -> None:
        """One layer of a layered prefill is computed: `scratch` [2, Hkv, n, block_size, D]
        holds its K/V with scratch block i standing for table index i. The hot entries of
        `new` (from `begin_layered`) take their K/V; the dropped ones their keys in the key
        index and, at the last layer, their fingerprints (as `drop` takes them)."""
        table = self.kv._tables[seq_id]
        device = scratch.device
        hot = [index for index in new if table[index] != DROPPED]
        if hot:
            source = torch.tensor(hot, device=device)
            target = torch.tensor([table[index] for index in hot], device=device)
            self.kv.kv_caches[layer].index_copy_(2, target, scratch.index_select(2, source))
        records = self.kv._dropped.get(seq_id, {})
        dropped = [index for index in new if table[index] == DROPPED]
        if not dropped:
            return
        source = torch.tensor(dropped, device=device)
        slots = [records[index].slot for index in dropped]
        if slots[0] is not None:
            self.kv.key_index.write_layer(layer, slots, scratch[0].index_select(1, source))
        if layer == len(self.kv.kv_caches) - 1:
            fingerprints = self.kv.tiers.fingerprint(source, scratch).cpu()
            for index, fingerprint in zip(dropped, fingerprints):
                records[index].fingerprint = fingerprint

    def end(self, seq_id: int) -> None:
        """Release a layered prefill's working memory (done, or the sequence paused)."""
        for block in self.active.pop(seq_id, (0, []))[1]:
            self.kv.pool.release(block)
