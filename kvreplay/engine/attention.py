"""Attention over the paged KV cache.

A step's tokens are laid out flat: first one token per decoding sequence, then each prefill
chunk's tokens in turn. K/V of every scheduled token are written into the cache first (at
`slot_mapping`), then each query attends to its sequence's cached context through its block table:

    block table [7, 2, 9]  ->  cache rows  block 7: positions  0..15
                                           block 2: positions 16..31
                                           block 9: positions 32..(context_len-1)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSlice:
    token_start: int          # first row of this chunk in the flat batch
    token_end: int            # one past its last row
    context_tokens: int       # tokens attended to after the chunk is written (cached + chunk)
    block_table: torch.Tensor  # [num_blocks] block ids covering context_tokens
    mask: torch.Tensor | None  # [chunk, context] bool, None when nothing was cached before it


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                   # [T] cache row of each token
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None = None          # [B, 1, 1, max_blocks * block_size] bool
    prefills: list[PrefillSlice] = field(default_factory=list)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [2, num_blocks, block_size, Hkv, D]."""
    num_blocks, block_size, num_kv, head_dim = kv_cache.shape[1:]
    key_cache, value_cache = kv_cache[0], kv_cache[1]
    key_cache.view(-1, num_kv, head_dim).index_copy_(0, meta.slot_mapping, k)
    value_cache.view(-1, num_kv, head_dim).index_copy_(0, meta.slot_mapping, v)
    out = torch.empty_like(q)

    num_decode = meta.num_decode_tokens
    if num_decode:
        tables = meta.decode_block_tables
        width = tables.shape[1] * block_size
        keys = key_cache[tables].view(num_decode, width, num_kv, head_dim).transpose(1, 2)
        values = value_cache[tables].view(num_decode, width, num_kv, head_dim).transpose(1, 2)
        decoded = F.scaled_dot_product_attention(
            q[:num_decode].unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
            scale=scale, enable_gqa=True)  # [B, Hq, 1, D]
        out[:num_decode] = decoded.squeeze(2)

    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_end)
        query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, C, D]
        if chunk.mask is None:  # nothing cached before: the chunk's own K/V suffice
            keys = k[rows].transpose(0, 1).unsqueeze(0)
            values = v[rows].transpose(0, 1).unsqueeze(0)
            result = F.scaled_dot_product_attention(query, keys, values, is_causal=True,
                                                    scale=scale, enable_gqa=True)
        else:
            context = chunk.context_tokens
            keys = key_cache[chunk.block_table].view(-1, num_kv, head_dim)[:context]
            values = value_cache[chunk.block_table].view(-1, num_kv, head_dim)[:context]
            result = F.scaled_dot_product_attention(
                query, keys.transpose(0, 1).unsqueeze(0), values.transpose(0, 1).unsqueeze(0),
                attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[rows] = result.squeeze(0).transpose(0, 1)
    return out
