"""The hybrid pool (kv/local_groups.py) on tiny pools: local layers hold only their window's pages,
exact page ids, prefix hits as far as the window's pages reach, CoW, pauses; and at Gemma 3's
dimensions, resident bytes equal the planner's figure."""
from __future__ import annotations

import torch

from kvreplay.kv.local_groups import layer_layout
from kvreplay.kv.manager import KVManager
from kvreplay.kv.tiers import DROPPED
from kvreplay.planner import KVDims, plan
from kvreplay.server.generation import EngineSnapshot
from kvreplay.server.metrics import ServerMetrics

BLOCK, WINDOW = 4, 8  # a window touches 3 blocks at most
LOCAL = (0, 1, 3, 4)  # of 6 layers: global 2 and 5, two local groups of two


def _pool(num_blocks: int, **kwargs) -> KVManager:
    return KVManager(num_blocks, BLOCK, num_layers=6, num_kv_heads=1, head_dim=2, dtype=torch.float32,
                     local_layers=LOCAL, sliding_window=WINDOW, **kwargs)


def _step(kv: KVManager, seq_id: int, tokens: list[int], num_new: int) -> None:
    """Allocate and compute `num_new` more of `tokens`, as the engine does in one step."""
    assert kv.allocate(seq_id, num_new)
    kv.commit(seq_id, tokens, kv.num_slots(seq_id))
    kv.check_integrity()


def _held(kv: KVManager, seq_id: int) -> list[list[int]]:
    return [[column for column, page in enumerate(table) if page != DROPPED] for table in kv.local.tables[seq_id]]


def test_layout_shares_storage_between_groups():
    assert layer_layout(6, LOCAL) == ([0, 1, 0, 0, 1, 1], [0, 0, None, 1, 1, None], 2)
    gemma = tuple(i for i in range(18) if i not in (5, 11, 17))
    slots, groups, num_groups = layer_layout(18, gemma)
    assert (num_groups, max(slots), [groups[i] for i in (5, 11, 17)]) == (5, 2, [None] * 3)
    kv = _pool(4)
    assert len(kv.storages) == 2 and kv.kv_caches[0] is kv.kv_caches[2] is kv.storages[0]
    assert kv.block_bytes == 2 * 2 * BLOCK * 2 * 4  # two layers a page
    assert KVManager(4, BLOCK, 6, 1, 2, torch.float32).local.num_groups == 0  # not hybrid


def test_local_groups_hold_only_their_window():
    """Token by token to 40: after each step the local groups hold the blocks the next query's
    window reads, 3 at most, and the pool holds one page a block more for the global layers."""
    kv = _pool(64)
    tokens = list(range(100, 140))
    kv.add_sequence(1)
    _step(kv, 1, tokens, 1)
    assert kv.block_table(1) == [0] and kv.local.tables[1] == [[1], [2]]
    for num_tokens in range(2, 41):
        _step(kv, 1, tokens, 1)
        first = max(0, num_tokens - WINDOW + 1) // BLOCK
        columns = list(range(first, -(-num_tokens // BLOCK)))
        assert _held(kv, 1) == [columns, columns] and len(columns) <= 3
        assert kv.num_used_blocks == len(kv.block_table(1)) + 2 * len(columns)
    # the released pages wait in the LRU under their derived hashes: 2 groups x 8 columns
    assert kv.num_cached_blocks == 16
    kv.free(1)
    kv.check_integrity()
    assert kv.num_used_blocks == 0


def test_a_step_holds_its_chunk_then_releases_what_left_the_window():
    kv = _pool(64)
    tokens = list(range(100, 140))
    kv.add_sequence(1)
    assert kv.num_blocks_needed(1, 24) == 6 * 3  # six blocks, each a global and two local pages
    assert kv.num_blocks_projected(1, 24) == 6 + 2 * 3  # between steps: the window only
    _step(kv, 1, tokens, 24)
    assert _held(kv, 1) == [[4, 5], [4, 5]]  # the query at 24 reads 17..24: blocks 4, 5 (and 6)
    assert kv.capacity_tokens == (64 - 2 * 3) * BLOCK


def test_prefix_hit_takes_the_window_pages_and_stops_where_they_are_gone():
    kv = _pool(40)
    tokens = list(range(100, 124))
    kv.add_sequence(1)
    _step(kv, 1, tokens, 16)
    for _ in range(8):
        _step(kv, 1, tokens, 1)
    assert kv.block_table(1) == [0, 1, 2, 3, 12, 15] and _held(kv, 1) == [[4, 5], [4, 5]]
    lru = kv.pool.lru_order()  # released local pages, oldest first: group 0 col 1, 0, group 1 col 1, 0, ...
    assert lru == [5, 4, 9, 8, 6, 10, 7, 11]
    # A second request over the first 16 tokens: the query at 16 reads blocks 2 and 3, cached.
    kv.add_sequence(2)
    hits = kv.match_prefix(2, tokens[:16] + [7])
    assert hits == [0, 1, 2, 3]
    assert kv.num_blocks_to_admit(2, hits, 17) == 1 + 2 * 3  # one new block; 2 x 3 local pages
    kv.adopt_prefix(2, hits)
    assert kv.local.tables[2] == [[DROPPED, DROPPED, 6, 7], [DROPPED, DROPPED, 10, 11]]
    kv.check_integrity()
    kv.free(2)
    # Evict the five oldest cached pages (group 0's block 2 among them): no block's window is
    # whole any more, so nothing of the prefix counts, though its global blocks are all held.
    taken = [kv.pool.take() for _ in range(kv.pool.num_free - kv.pool.num_cached_free + 5)]
    for page in taken:
        kv.pool.release(page)
    kv.add_sequence(3)
    assert kv.match_prefix(3, tokens[:16] + [7]) == []
    # The whole 24 tokens: the window at 24 reads blocks 4 and 5, held by sequence 1.
    assert kv.match_prefix(3, tokens + [7]) == [0, 1, 2, 3, 12, 15]
    kv.check_integrity()


def test_fork_copies_the_partial_block_in_every_group():
    kv = _pool(40)
    tokens = list(range(100, 110))
    kv.add_sequence(1)
    _step(kv, 1, tokens, 10)
    kv.fork(1, 2)
    assert kv.local.tables[2] == kv.local.tables[1]
    kv.check_integrity()
    _step(kv, 2, tokens + [5], 1)  # the first write into the shared partial block copies it
    assert kv.block_table(2)[-1] != kv.block_table(1)[-1]
    assert [t[-1] for t in kv.local.tables[2]] != [t[-1] for t in kv.local.tables[1]]
    assert [t[1:-1] for t in kv.local.tables[2]] == [t[1:-1] for t in kv.local.tables[1]]
    assert _held(kv, 2) == [[1, 2], [1, 2]] and _held(kv, 1) == [[0, 1, 2], [0, 1, 2]]  # 11 tokens, 10
    kv.free(1)
    kv.free(2)
    kv.check_integrity()
    assert kv.num_used_blocks == 0


def test_pause_keeps_the_head_only_while_its_window_is_held():
    kv = _pool(40)
    tokens = list(range(100, 140))
    kv.add_sequence(1, pinned_tokens=4)
    _step(kv, 1, tokens, 8)
    assert kv.pause_preview(1, keep_pinned=True) == (4, 1 + 2 * 1)
    assert kv.pause(1) == 4 and _held(kv, 1) == [[0], [0]]
    kv.check_integrity()
    _step(kv, 1, tokens, 16)  # 20 tokens: block 0 left the window
    assert kv.pause_preview(1, keep_pinned=True)[0] == 20
    assert kv.pause(1) == 0 and kv.block_table(1) == []
    kv.check_integrity()


def test_resident_bytes_at_8k_equal_the_planners_figure():
    """Gemma 3 270M's KV dimensions in bf16: a 8,180-token prompt in 512-token chunks holds 512
    global pages and 33 blocks' worth of local ones, the planner's hybrid figure at 8K."""
    local = tuple(i for i in range(18) if i not in (5, 11, 17))
    kv = KVManager(900, 16, 18, 1, 256, torch.bfloat16, local_layers=local, sliding_window=512)
    tokens = list(range(8180))
    kv.add_sequence(1)
    while kv.num_slots(1) < len(tokens):
        _step(kv, 1, tokens, min(512, len(tokens) - kv.num_slots(1)))
        assert kv.local.num_held(1) <= kv.local.window_blocks == 33
    dims = KVDims(18, 1, 256, num_local_layers=15, sliding_window=512)
    assert kv.num_used_blocks * kv.block_bytes == plan(dims, 8192).hybrid_bytes


def test_blocks_per_layer_group_in_metrics():
    kv = _pool(40)
    kv.add_sequence(1)
    _step(kv, 1, list(range(100, 124)), 24)
    groups = kv.local.blocks_by_group()  # local: blocks 4, 5 held, 0-3 cached, in two groups
    assert groups == {"global": {"used": 6, "cached": 0}, "local": {"used": 4, "cached": 8}}
    assert KVManager(4, BLOCK, 6, 1, 2, torch.float32).local.blocks_by_group() == \
        {"global": {"used": 0, "cached": 0}}
    text = ServerMetrics(lambda: EngineSnapshot(blocks_by_group=groups)).render().decode()
    assert 'kvreplay_kv_blocks_by_group{group="local",state="cached"} 8.0' in text
    assert 'kvreplay_kv_blocks_by_group{group="global",state="used"} 6.0' in text


def test_local_metadata_reads_true_positions_whatever_the_global_layers_dropped():
    """A lossy policy drops global blocks 1 and 2 of a 24-token sequence: the global decode row
    reads its 5 resident blocks (17 tokens), but each local group's row reads its own table to
    position 24 (context 25), its window 17..24 exactly, and carries none of the global layers'
    extras (probe, importance); a chunk's local slice counts keys from position 0."""
    from kvreplay.engine.local_meta import local_group_metas
    from kvreplay.engine.sequence import Sequence
    from kvreplay.layers.attention import AttentionMetadata, PrefillSlice, paged_attention
    from kvreplay.sampling import SamplingParams
    kv = _pool(64)
    seq = Sequence("r", list(range(100, 125)), SamplingParams(max_tokens=4), set(), None)
    kv.add_sequence(seq.seq_id)
    _step(kv, seq.seq_id, seq.token_ids, 24)
    kv.drop(seq.seq_id, [1, 2], keep_index=False)
    assert kv.allocate(seq.seq_id, 1)
    seq.num_computed_tokens = 24
    resident = kv.resident_blocks(seq.seq_id)
    assert len(resident) == 5
    meta = AttentionMetadata(slot_mapping=torch.tensor([resident[-1] * BLOCK]), num_decode_tokens=1,
                             decode_block_tables=torch.tensor([resident]), decode_context=torch.tensor([17]),
                             observe_decode=True, probe=object())
    locals_ = local_group_metas(kv, meta, [seq], [])
    assert len(locals_) == 2
    for group, local in enumerate(locals_):
        table = kv.local.group_table(seq.seq_id, group)
        assert local.decode_context.tolist() == [25] and local.decode_block_tables.tolist() == [table]
        assert local.slot_mapping.tolist() == [table[6] * BLOCK]
        assert local.probe is None and not local.observe_decode and local.decode_kernel is None
    # Layer 0 (group 0, storage 0): its output is softmax attention over positions 17..24 as
    # the group's pages hold them.
    torch.manual_seed(0)
    for storage in kv.storages:
        storage.normal_()
    q, k, v = torch.randn(1, 2, 2), torch.randn(1, 1, 2), torch.randn(1, 1, 2)  # [T, H, D]
    out = paged_attention(q, k, v, kv.kv_caches[0], locals_[0], scale=1.0, window=WINDOW)
    table = kv.local.group_table(seq.seq_id, 0)
    rows = [(table[p // BLOCK], p % BLOCK) for p in range(17, 25)]
    keys = torch.stack([kv.kv_caches[0][0, 0, page, row] for page, row in rows])    # [8, D]
    values = torch.stack([kv.kv_caches[0][1, 0, page, row] for page, row in rows])  # [8, D]
    expected = torch.softmax(q[0] @ keys.T, dim=-1) @ values                        # [H, D]
    torch.testing.assert_close(out[0], expected)
    # a chunk over positions 24..25 after the drops: keys from position 0, queries from 24
    piece = PrefillSlice(0, 1, 3 * BLOCK, torch.tensor(resident[:3]), torch.ones(1, 12, dtype=torch.bool))
    chunk_meta = AttentionMetadata(slot_mapping=torch.tensor([0]), prefills=[piece])
    (local_piece,) = local_group_metas(kv, chunk_meta, [], [(seq, 24, 25)])[1].prefills
    assert (local_piece.causal_from, local_piece.context_tokens) == (24, 25)
    assert local_piece.block_table.tolist() == kv.local.group_table(seq.seq_id, 1)
    kv.free(seq.seq_id)
    kv.check_integrity()
    assert kv.num_used_blocks == 0
