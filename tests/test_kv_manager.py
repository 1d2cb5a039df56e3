"""KVManager on tiny pools: exact block ids, LRU eviction order, hash re-checks, CoW, pins."""
from __future__ import annotations

import pytest
import torch

from kvreplay.kv.manager import KVManager

BLOCK = 4


def _pool(num_blocks: int, **kwargs) -> KVManager:
    return KVManager(num_blocks, BLOCK, num_layers=2, num_kv_heads=1, head_dim=2,
                     dtype=torch.float32, **kwargs)


def _compute(kv: KVManager, seq_id: int, tokens: list[int], pinned: int = 0) -> list[int]:
    """Admit `tokens` as a prompt the way the scheduler does: adopt hits, allocate, commit."""
    kv.add_sequence(seq_id, pinned)
    hits = kv.match_prefix(seq_id, tokens)
    kv.adopt_prefix(seq_id, hits)
    assert kv.allocate(seq_id, len(tokens) - kv.num_slots(seq_id))
    kv.commit(seq_id, tokens, len(tokens))
    kv.check_integrity()
    return hits


def test_prefix_hit_exact_block_ids_and_last_token_rule():
    kv = _pool(8)
    prompt = list(range(100, 112))  # 3 full blocks
    assert _compute(kv, 1, prompt) == []
    assert kv.block_table(1) == [0, 1, 2]
    # The same prompt again: all but the last block (a hit never covers the last token).
    assert _compute(kv, 2, prompt) == [0, 1]
    assert kv.block_table(2) == [0, 1, 3]
    # One token longer: now the third block is full and before the last token, so it hits too.
    assert _compute(kv, 3, prompt + [7]) == [0, 1, 2]
    assert kv.block_table(3) == [0, 1, 2, 4]
    assert kv.num_used_blocks == 5
    # A different second block stops the chain even though the third block's tokens match.
    other = prompt[:4] + [9, 9, 9, 9] + prompt[8:] + [7]
    assert _compute(kv, 4, other) == [0]
    assert kv.block_table(4) == [0, 5, 6, 7]


def test_lru_eviction_order():
    kv = _pool(6)
    _compute(kv, 1, list(range(0, 9)))    # blocks 0, 1 full (cached), 2 partial
    _compute(kv, 2, list(range(50, 59)))  # blocks 3, 4 full (cached), 5 partial
    kv.free(2)
    kv.free(1)
    kv.check_integrity()
    # Freed tails go first; seq 2 was freed before seq 1, so its blocks are older.
    assert kv.pool.lru_order() == [4, 3, 1, 0]
    assert kv.num_free_blocks == 6 and kv.num_cached_blocks == 4
    # New content takes the two empty blocks first (lowest id first), then evicts in LRU order.
    kv.add_sequence(3)
    assert kv.allocate(3, 4 * BLOCK)
    assert kv.block_table(3) == [2, 5, 4, 3]
    assert kv.pool.lru_order() == [1, 0]
    kv.check_integrity()
    # The evicted prefix misses, the surviving one still hits.
    kv.add_sequence(4)
    assert kv.match_prefix(4, list(range(50, 59))) == []
    assert kv.match_prefix(4, list(range(0, 9))) == [0, 1]
    # Reusing a cached block takes it off the LRU list.
    kv.adopt_prefix(4, [0, 1])
    assert kv.pool.lru_order() == []
    kv.check_integrity()


def test_forced_hash_collision_is_a_miss_not_wrong_kv():
    kv = _pool(8, hash_fn=lambda parent, tokens, extra: 42)  # every block collides
    _compute(kv, 1, list(range(0, 9)))
    assert kv.pool.cache.key(0) == (42, (0, 1, 2, 3))
    assert _compute(kv, 2, list(range(20, 29))) == []  # same hash, other tokens: a miss
    assert kv.pool.cache.collisions >= 1
    assert kv.block_table(2) == [3, 4, 5]
    assert _compute(kv, 3, list(range(0, 9))) == [0]  # real match still found; the chain
    kv.free(1), kv.free(2), kv.free(3)                # stops where the hash map is taken
    kv.check_integrity()


def test_extra_keys_separate_equal_tokens():
    kv = _pool(8)
    kv.add_sequence(1, extra_keys=("adapter-a",))
    assert kv.allocate(1, 9)
    kv.commit(1, list(range(9)), 9)
    kv.add_sequence(2, extra_keys=("adapter-b",))
    assert kv.match_prefix(2, list(range(9))) == []


def test_fork_shares_blocks_and_copies_on_first_write():
    kv = _pool(8)
    _compute(kv, 1, list(range(10)))  # blocks 0, 1 full; 2 holds 2 tokens
    for layer in kv.kv_caches:
        layer[:, :, 2] = torch.arange(2 * BLOCK * 2, dtype=torch.float32).view(2, 1, BLOCK, 2)
    kv.fork(1, 2)
    assert kv.block_table(2) == [0, 1, 2] and kv.pool.ref_counts[:3] == [2, 2, 2]
    assert kv.num_used_blocks == 3
    assert kv.num_blocks_needed(2, 1) == 1  # the copy
    assert kv.allocate(2, 1)
    assert kv.block_table(2) == [0, 1, 3] and kv.num_cow_copies == 1
    for layer in kv.kv_caches:
        assert torch.equal(layer[:, :, 3], layer[:, :, 2])
    assert kv.pool.ref_counts[2] == 1
    assert kv.allocate(1, 1) and kv.block_table(1) == [0, 1, 2]  # sole owner writes in place
    assert kv.num_cow_copies == 1
    kv.check_integrity()
    kv.free(1), kv.free(2)
    assert kv.num_used_blocks == 0
    kv.check_integrity()


def test_pause_keeps_pinned_head_and_drops_the_rest():
    kv = _pool(10)
    _compute(kv, 1, list(range(23)), pinned=6)  # pinned: 6 tokens -> blocks 0 and 1
    assert kv.pause_preview(1, keep_pinned=True) == (23 - 8, 4)
    assert kv.pause_preview(1, keep_pinned=False) == (23, 6)
    assert kv.pause(1, keep_pinned=True) == 8
    assert kv.block_table(1) == [0, 1] and kv.num_slots(1) == 8
    kv.check_integrity()
    # The dropped full blocks stay cached: a resume finds them again without recomputing.
    hits = kv.match_prefix(1, list(range(23)))
    assert hits == [2, 3, 4]
    kv.adopt_prefix(1, hits)
    assert kv.num_slots(1) == 20
    kv.check_integrity()


def test_shared_blocks_count_no_replay_and_free_nothing():
    kv = _pool(10)
    _compute(kv, 1, list(range(17)))
    _compute(kv, 2, list(range(17)))  # shares blocks 0..3
    assert kv.pause_preview(2, keep_pinned=True) == (1, 1)  # only its own last block


def test_integrity_catches_corruption():
    kv = _pool(6)
    _compute(kv, 1, list(range(9)))
    kv.pool.ref_counts[0] += 1
    with pytest.raises(AssertionError, match="ref count"):
        kv.check_integrity()
    kv.pool.ref_counts[0] -= 1
    kv._hashes[1][1] ^= 1
    with pytest.raises(AssertionError, match="hash"):
        kv.check_integrity()


def test_empty_blocks_are_taken_lowest_id_first_after_churn():
    """Blocks freed in any order come back lowest id first, so a new sequence gets neighbouring
    blocks (the decode kernel reads them faster) rather than the release order."""
    kv = _pool(12, enable_prefix_caching=False)  # freed blocks are empty, not cached
    for seq_id in range(3):
        _compute(kv, seq_id, list(range(10 * seq_id, 10 * seq_id + 16)))  # 4 blocks each
    assert kv.block_table(1) == [4, 5, 6, 7]
    kv.free(2)  # released first: 8-11
    kv.free(0)  # then 0-3
    kv.check_integrity()
    _compute(kv, 3, list(range(500, 520)))  # 5 blocks
    assert kv.block_table(3) == [0, 1, 2, 3, 8]
    kv.free(3)
    kv.free(1)
    kv.check_integrity()
    assert kv.num_free_blocks == 12
