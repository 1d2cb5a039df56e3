"""Sliding-window attention (layers/window.py) on tiny shapes: the masks by hand, and the paged
path (prefill whole, in chunks, decode rows in a batch) against dense attention written out."""
from __future__ import annotations

import pytest
import torch

from kvreplay.layers.attention import AttentionMetadata, PrefillSlice, paged_attention
from kvreplay.layers.window import decode_window_tables, window_mask, window_start


def test_window_mask_by_hand():
    # queries at positions 3, 4, 5; keys 1..5; a window of 2: each sees itself and the one before
    expected = torch.tensor([[0, 1, 1, 0, 0],
                             [0, 0, 1, 1, 0],
                             [0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(window_mask(3, 3, 1, 5, 2), expected)
    assert torch.equal(window_mask(0, 3, 0, 3, 8), torch.ones(3, 3, dtype=torch.bool).tril())
    assert [window_start(p, 4) for p in (0, 3, 4, 9)] == [0, 0, 1, 6]


def test_decode_window_tables_by_hand():
    # block size 4, window 3. Row 0: 10 tokens, the query at 9 sees 7, 8, 9 (columns 1 and 2).
    # Row 1: 2 tokens, shorter than the window (column 0; the next column repeats the last).
    # Row 2: 16 tokens in a table 4 wide, the query at 15 sees 13..15 (column 3; then clamped).
    tables = torch.tensor([[7, 2, 9, 4], [5, 0, 0, 0], [1, 3, 6, 8]])
    picked, padding = decode_window_tables(tables, torch.tensor([10, 2, 16]), window=3, block_size=4)
    assert picked.tolist() == [[2, 9], [5, 0], [8, 8]]
    visible = [[4 + i for i in range(8) if not padding[0, i]],
               [i for i in range(8) if not padding[1, i]],
               [12 + i for i in range(4) if not padding[2, i]]]
    assert visible == [[7, 8, 9], [0, 1], [13, 14, 15]]
    assert padding[2, 4:].all()  # the clamped repeat of column 3 is masked whole


def _dense_window(q, k, v, window, scale):
    """q: [T, Hq, D], k, v: [T, Hkv, D] at positions 0..T-1: each query over its window."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("thd,shd->hts", q, k) * scale
    positions = torch.arange(q.shape[0])
    keep = (positions[None, :] <= positions[:, None]) & (positions[None, :] > positions[:, None] - window)
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    return torch.einsum("hts,shd->thd", probs, v)


@pytest.mark.parametrize("window", [3, 5, 64])
def test_paged_window_matches_dense(window):
    """Prefill chunks of 9 then 7 tokens, then one decode row at a time with a second sequence
    decoding beside it, through a scrambled block table: the dense reference's outputs."""
    torch.manual_seed(0)
    num_tokens, block_size, heads, kv_heads, head_dim = 23, 4, 4, 2, 8
    q = torch.randn(num_tokens, heads, head_dim)
    k, v = torch.randn(num_tokens, kv_heads, head_dim), torch.randn(num_tokens, kv_heads, head_dim)
    scale = head_dim ** -0.5
    expected = _dense_window(q, k, v, window, scale)
    num_blocks = 2 * -(-num_tokens // block_size) + 1
    cache = torch.zeros(2, kv_heads, num_blocks, block_size, head_dim)
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
    tables = order[:num_blocks // 2], order[num_blocks // 2:]  # two sequences' blocks

    def slots(table, start, end):
        positions = torch.arange(start, end)
        return table[positions // block_size] * block_size + positions % block_size

    for start, end in ((0, 9), (9, 16)):
        mask = None if start == 0 else torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
        meta = AttentionMetadata(slot_mapping=slots(tables[0], start, end), prefills=[
            PrefillSlice(0, end - start, end, tables[0], mask, causal_from=start)])
        out = paged_attention(q[start:end], k[start:end], v[start:end], cache, meta, scale, window=window)
        torch.testing.assert_close(out, expected[start:end])
    # the second sequence holds the same tokens' first 16 K/V (a copy), and both decode on
    cache.view(2, kv_heads, -1, head_dim)[:, :, slots(tables[1], 0, 16)] = \
        cache.view(2, kv_heads, -1, head_dim)[:, :, slots(tables[0], 0, 16)]
    for position in range(16, num_tokens):
        width = -(-(position + 1) // block_size)
        rows = [position, position]
        meta = AttentionMetadata(
            slot_mapping=torch.cat([slots(t, position, position + 1) for t in tables]), num_decode_tokens=2,
            decode_block_tables=torch.stack([t[:width] for t in tables]),
            decode_context=torch.tensor([position + 1, position + 1]))
        out = paged_attention(q[rows], k[rows], v[rows], cache, meta, scale, window=window)
        torch.testing.assert_close(out, expected[rows])
