"""The KV manager's invariants, checked after every step in tests."""
from __future__ import annotations

from kvreplay.kv.tiers import DROPPED, blocks_for as _blocks_for


def check_integrity(kv) -> None:
    """Ref counts equal table references; free lists, LRU and cache entries agree; every
    sequence's hash chain matches the cached content of its blocks; pins are held."""
    kv.pool.check_integrity(kv.block_size)
    if kv.tier_io is not None:
        kv.tier_io.tier.check_integrity()
    counted = [0] * kv.num_blocks
    for block in kv.tiers.reserved + [b for _, blocks in kv.layered.active.values() for b in blocks]:
        counted[block] += 1
    assert set(kv.layered.active) <= set(kv._tables), "working memory of an unknown sequence"
    assert len(kv.tiers.reserved) == kv.tiers.reserve_target(), "key-index reservation out of date"
    slots = [r.slot for records in kv._dropped.values() for r in records.values()
             if r.slot is not None]
    assert len(slots) == len(set(slots)) == kv.key_index.num_used, "key-index slots leaked"
    cold = [r.cold_slot for records in kv._dropped.values() for r in records.values()
            if r.cold_slot is not None]
    assert len(cold) == len(set(cold)) == (kv.cold_pool.num_used if kv.cold_pool else 0), \
        "cold slots leaked"
    assert not any(r.slot is not None and r.cold_slot is not None
                   for records in kv._dropped.values() for r in records.values()), \
        "a block both cold and indexed"
    for seq_id, records in kv._dropped.items():
        assert records, f"seq {seq_id}: empty dropped record"
        for index in records:
            assert kv._tables[seq_id][index] == DROPPED, f"seq {seq_id}: block {index} not dropped"
    for seq_id, table in kv._tables.items():
        slots = kv._num_slots[seq_id]
        assert len(table) == _blocks_for(slots, kv.block_size), \
            f"seq {seq_id}: {len(table)} blocks for {slots} slots"
        assert sum(b == DROPPED for b in table) == len(kv._dropped.get(seq_id, ())), \
            f"seq {seq_id}: dropped entries without records"
        for block in table:
            if block != DROPPED:
                counted[block] += 1
        hashes = kv._hashes[seq_id]
        assert len(hashes) <= slots // kv.block_size, f"seq {seq_id}: hash past its full blocks"
        parent = None
        for block, block_hash in zip(table, hashes):
            key = kv.pool.cache.key(block) if block != DROPPED else None
            if key is not None:
                assert key[0] == block_hash, f"seq {seq_id}: block {block} cached under another hash"
                assert kv._hash_fn(parent, key[1], kv._extra_keys[seq_id]) == block_hash, \
                    f"seq {seq_id}: block {block} breaks the hash chain"
            parent = block_hash
        pinned = kv.num_pinned_blocks(seq_id)
        assert all(b != DROPPED and kv.pool.ref_counts[b] > 0 for b in table[:pinned]), \
            f"seq {seq_id}: pin lost"
    kv.local.check_integrity(counted)  # a hybrid pool's local pages
    for block in range(kv.num_blocks):
        assert counted[block] == kv.pool.ref_counts[block], \
            f"block {block}: ref count {kv.pool.ref_counts[block]}, tables hold {counted[block]}"
