"""Sliding-window attention over the paged cache: which cached keys a local layer's query sees.

A local layer (Gemma 3's, docs/architecture.md "Gemma 3") lets the query at position p attend to
positions p - window + 1 .. p: its own and the window - 1 before it. The cache is the same pool
every layer uses; only the keys read and the mask change, so these layers take the PyTorch path
(the compiled kernels have no window). Positions follow table columns here (column j of a
sequence's table holds positions j*bs .. j*bs + bs - 1): a local group's table under the hybrid
pool, which a lossy policy never drops from (engine/local_meta.py hands it with true positions);
the lossy policies need that pool (engine/model_setup.py).

    positions     0 ............ p-window | p-window+1 ....... p | p+1 ...
    query p sees  no                      | yes                  | no (future)
"""
from __future__ import annotations

import dataclasses

import torch


def window_start(query_position: int, window: int) -> int:
    """The first position the query at `query_position` attends to."""
    return max(0, query_position - window + 1)


def window_mask(query_start: int, num_queries: int, key_start: int, num_keys: int, window: int
                ) -> torch.Tensor:
    """[num_queries, num_keys] bool, True where a query (positions query_start ..) may attend to
    a key (positions key_start ..): the key is neither in its future nor `window` or more back."""
    queries = torch.arange(query_start, query_start + num_queries)[:, None]
    keys = torch.arange(key_start, key_start + num_keys)[None, :]
    return (keys <= queries) & (keys > queries - window)


def decode_window_tables(tables: torch.Tensor, context: torch.Tensor, window: int, block_size: int
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """The blocks a decode row's window lies in, and which of their rows it must not see.

    tables: [B, W] block ids (padded); context: [B] tokens each row attends to (its query sits at
    position context - 1). Returns the window's blocks [B, N] (N = the most blocks a window can
    touch, at most W; columns past a row's table repeat its last) and padding [B, N * block_size],
    True for rows outside the window or past the context."""
    width = tables.shape[1]
    num_blocks = min(width, (window - 1) // block_size + 2)
    first = (context - window).clamp(min=0) // block_size                          # [B]
    columns = first[:, None] + torch.arange(num_blocks, device=tables.device)      # [B, N]
    picked = tables.gather(1, columns.clamp(max=width - 1))                       # [B, N]
    positions = (columns[:, :, None] * block_size
                 + torch.arange(block_size, device=tables.device)).flatten(1)     # [B, N*bs]
    padding = (positions >= context[:, None]) | (positions < (context - window)[:, None])
    return picked, padding


def windowed_decode_meta(meta, window: int, block_size: int, num_kv: int):
    """`meta` (an AttentionMetadata) with its decode rows reading only their windows, through
    the PyTorch path (no compiled kernel)."""
    assert meta.probe is None and meta.cold is None and meta.hot_selection is None \
        and not meta.observe_decode, "a lossy policy's extras act on the global layers only"
    tables, padding = decode_window_tables(meta.decode_block_tables, meta.decode_context, window, block_size)
    return dataclasses.replace(meta, decode_block_tables=tables, decode_kernel=None,
                               decode_padding=padding.repeat(num_kv, 1).unsqueeze(1))  # [Hkv*B, 1, L]


def window_chunk_keys(chunk, keys: torch.Tensor, values: torch.Tensor, key_cache: torch.Tensor,
                      value_cache: torch.Tensor, window: int
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """K, V [Hkv, L, D] a prefill chunk's window covers and its mask [C, L].

    chunk: a PrefillSlice whose keys are positions 0 .. context_tokens - 1 (causal_from set; its
    mask is not read); keys, values: the chunk's own [Hkv, C, D] (used when the chunk starts at
    position 0); caches: [Hkv, num_blocks, bs, D]. Only keys from the first query's window start
    on are read."""
    query_start = chunk.causal_from
    assert query_start is not None, "a local layer reads its window by position: every column in order"
    num_queries = chunk.token_end - chunk.token_start
    start = window_start(query_start, window)
    if query_start == 0:  # nothing cached before: the chunk's own K/V, positions 0 ..
        keys, values = keys[:, start:], values[:, start:]
    else:
        num_kv, _, block_size, head_dim = key_cache.shape
        first = start // block_size
        table = chunk.block_table[first:]
        offset, end = start - first * block_size, chunk.context_tokens - first * block_size
        keys = key_cache.index_select(1, table).view(num_kv, -1, head_dim)[:, offset:end]
        values = value_cache.index_select(1, table).view(num_kv, -1, head_dim)[:, offset:end]
    mask = window_mask(query_start, num_queries, start, keys.shape[1], window)
    return keys, values, mask.to(keys.device)
