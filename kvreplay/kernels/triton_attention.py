"""Triton kernels reading the paged KV cache in place: decode attention and prefill attention.

The cache of one layer is [Hkv, num_blocks, block_size, D] for keys and for values; a sequence's
block table lists its blocks in position order, so its token p lives in block table[p // bs] at
row p % bs. Neither kernel gathers the blocks into a contiguous copy first (the PyTorch path does).

- `decode_attention`: one query per sequence; one program per (sequence, KV head) takes the G query
  heads that share the KV head, walks the row's blocks up to its own context length with an online
  softmax (fp32), and hands back the log-sum-exp of the scaled scores (the need probe) and, in a
  second pass, the block mass (importance): per block, the largest share any of the G heads gives it.
- `prefill_attention`: a chunk of C queries at positions causal_from .. causal_from + C - 1 over
  the sequence's cached keys 0 .. context - 1 (the chunk's own K/V are in the cache already),
  causal; one program per (tile of queries, query head), key tiles through the block table.

Imported only through triton_backend.kernels(): this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


def _pow2(n: int, least: int = 1) -> int:
    return max(triton.next_power_of_2(n), least)


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, table_ptr, ctx_ptr, out_ptr, lse_ptr, scale, pool_blocks, width,
                   HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                   G_P: tl.constexpr, D_P: tl.constexpr, BS_P: tl.constexpr, WANT_LSE: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, G_P)
    d = tl.arange(0, D_P)
    t = tl.arange(0, BS_P)
    qmask = (g[:, None] < G) & (d[None, :] < D)
    heads = (b * HKV + h) * G + g                                                   # [G_P]
    q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=qmask, other=0.0).to(tl.float32) * scale
    ctx = tl.load(ctx_ptr + b)
    m = tl.full([G_P], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, D_P], tl.float32)
    for n in range(0, tl.cdiv(ctx, BS)):
        blk = tl.load(table_ptr + b * width + n).to(tl.int64)
        rows = (h * pool_blocks + blk) * BS + t                                     # [BS_P]
        live = (t < BS) & (n * BS + t < ctx)
        kv_mask = live[:, None] & (d[None, :] < D)
        keys = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)                        # [G_P, BS_P]
        s = tl.where(live[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        values = tl.load(v_ptr + rows[:, None] * D + d[None, :], mask=kv_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values[None, :, :], axis=1)
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + heads[:, None] * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=qmask)
    if WANT_LSE:
        tl.store(lse_ptr + heads, m + tl.log(l_sum), mask=g < G)


@triton.jit
def _decode_mass_kernel(q_ptr, k_ptr, table_ptr, ctx_ptr, lse_ptr, mass_ptr, scale, pool_blocks, width,
                        HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                        G_P: tl.constexpr, D_P: tl.constexpr, BS_P: tl.constexpr):
    """Second pass of decode attention: each block's share of the row's attention, given its lse."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, G_P)
    d = tl.arange(0, D_P)
    t = tl.arange(0, BS_P)
    heads = (b * HKV + h) * G + g
    q = tl.load(q_ptr + heads[:, None] * D + d[None, :], mask=(g[:, None] < G) & (d[None, :] < D),
                other=0.0).to(tl.float32) * scale
    lse = tl.load(lse_ptr + heads, mask=g < G, other=0.0)
    ctx = tl.load(ctx_ptr + b)
    for n in range(0, tl.cdiv(ctx, BS)):
        blk = tl.load(table_ptr + b * width + n).to(tl.int64)
        rows = (h * pool_blocks + blk) * BS + t
        live = (t < BS) & (n * BS + t < ctx)
        keys = tl.load(k_ptr + rows[:, None] * D + d[None, :], mask=live[:, None] & (d[None, :] < D),
                       other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)
        p = tl.where(live[None, :], tl.exp(s - lse[:, None]), 0.0)
        share = tl.where(g < G, tl.sum(p, axis=1), 0.0)                             # [G_P]
        tl.store(mass_ptr + (b * HKV + h) * width + n, tl.max(share, axis=0))


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, context: torch.Tensor, scale: float,
                     want_lse: bool = False, want_mass: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Paged decode attention (the compiled CPU kernel's signature, AttentionMetadata.decode_kernel).

    Args:
        q: [B, Hq, D], one query per row (unscaled).
        key_cache, value_cache: [Hkv, num_blocks, block_size, D].
        block_tables: [B, W] long, each row's blocks in position order (padding past its context).
        context: [B] long, keys each row attends to (at least 1).
        scale: the softmax scale.
        want_lse, want_mass: fill lse / mass (else they are empty).
    Returns:
        out [B, Hq, D] in q's dtype; lse [B, Hq] fp32 of the scaled scores; mass [B, Hkv, W] fp32
        (zero on blocks past a row's context).
    """
    num_seqs, num_q, head_dim = q.shape
    num_kv, pool_blocks, block_size = key_cache.shape[:3]
    group = num_q // num_kv
    q = q.contiguous()
    tables, context = block_tables.contiguous(), context.contiguous()
    out = torch.empty_like(q)
    need_lse = want_lse or want_mass
    lse = torch.empty(num_seqs, num_q, dtype=torch.float32, device=q.device) if need_lse \
        else torch.empty(0, dtype=torch.float32, device=q.device)
    sizes = dict(HKV=num_kv, G=group, D=head_dim, BS=block_size, G_P=_pow2(group),
                 D_P=_pow2(head_dim), BS_P=_pow2(block_size))
    grid = (num_seqs, num_kv)
    _decode_kernel[grid](q, key_cache, value_cache, tables, context, out, lse, scale, pool_blocks,
                         tables.shape[1], WANT_LSE=need_lse, **sizes)
    mass = decode_block_mass(q, key_cache, tables, context, lse, scale) if want_mass \
        else torch.empty(0, dtype=torch.float32, device=q.device)
    return out, lse if want_lse else lse[:0], mass


def decode_block_mass(q: torch.Tensor, key_cache: torch.Tensor, block_tables: torch.Tensor,
                      context: torch.Tensor, lse: torch.Tensor, scale: float) -> torch.Tensor:
    """Per row, KV head and block of its table, the largest share of attention any of the KV
    head's G query heads gives the block, each head's scores normalized by `lse` [B, Hq] (the
    row's own log-sum-exp, or one over more keys than the hot ones). Returns [B, Hkv, W] fp32."""
    num_seqs, num_q, head_dim = q.shape
    num_kv, pool_blocks, block_size = key_cache.shape[:3]
    tables = block_tables.contiguous()
    mass = torch.zeros(num_seqs, num_kv, tables.shape[1], dtype=torch.float32, device=q.device)
    _decode_mass_kernel[(num_seqs, num_kv)](
        q.contiguous(), key_cache, tables, context.contiguous(), lse.float().contiguous(), mass, scale,
        pool_blocks, tables.shape[1], HKV=num_kv, G=num_q // num_kv, D=head_dim, BS=block_size,
        G_P=_pow2(num_q // num_kv), D_P=_pow2(head_dim), BS_P=_pow2(block_size))
    return mass


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, table_ptr, out_ptr, scale, pool_blocks, num_rows, context,
                    causal_from, HQ: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                    D_P: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, IEEE: tl.constexpr):
    """IEEE: products in fp32 (fp32 models; and any dtype under the interpreter, whose bf16 tl.dot
    is wrong in triton 3.9); else tl.dot on the cache's dtype with fp32 sums."""
    tile = tl.program_id(0)
    hq = tl.program_id(1)
    h = hq // G
    rows = tile * BM + tl.arange(0, BM)                                             # [BM] chunk rows
    d = tl.arange(0, D_P)
    dmask = d[None, :] < D
    qmask = (rows[:, None] < num_rows) & dmask
    q = tl.load(q_ptr + (rows[:, None] * HQ + hq) * D + d[None, :], mask=qmask, other=0.0)
    m = tl.full([BM], float("-inf"), tl.float32)
    l_sum = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, D_P], tl.float32)
    last = tl.minimum(context, causal_from + tile * BM + BM)  # keys any row of this tile sees
    for start in range(0, last, BN):
        pos = start + tl.arange(0, BN)                                              # [BN] key positions
        inside = pos < context
        blk = tl.load(table_ptr + pos // BS, mask=inside, other=0).to(tl.int64)
        cache_rows = (h * pool_blocks + blk) * BS + pos % BS
        kv_mask = inside[:, None] & dmask
        keys = tl.load(k_ptr + cache_rows[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            s = tl.dot(q.to(tl.float32), tl.trans(keys.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(keys))
        s = s * scale
        seen = inside[None, :] & (pos[None, :] <= causal_from + rows[:, None])
        s = tl.where(seen, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        values = tl.load(v_ptr + cache_rows[:, None] * D + d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p, values.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(values.dtype), values)
        acc = acc * alpha[:, None] + pv
        m = m_new
    out = acc / l_sum[:, None]
    tl.store(out_ptr + (rows[:, None] * HQ + hq) * D + d[None, :], out.to(out_ptr.dtype.element_ty), mask=qmask)


def prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      block_table: torch.Tensor, context: int, causal_from: int, scale: float
                      ) -> torch.Tensor:
    """Causal attention of one prompt chunk over its sequence's paged keys.

    Args:
        q: [C, Hq, D], the chunk's queries; query j sits at position causal_from + j.
        key_cache, value_cache: [Hkv, num_blocks, block_size, D], holding positions 0 .. context - 1
            of the sequence (the chunk's own included) in the blocks of `block_table`.
        block_table: [>= ceil(context / block_size)] long.
        context: keys the chunk attends to at most (causal_from + C for a whole prefix).
        causal_from: the first query's position.
        scale: the softmax scale.
    Returns:
        [C, Hq, D] in q's dtype.
    """
    rows, num_q, head_dim = q.shape
    num_kv, pool_blocks, block_size = key_cache.shape[:3]
    q = q.contiguous()
    out = torch.empty_like(q)
    tile = 16
    grid = (triton.cdiv(rows, tile), num_q)
    _prefill_kernel[grid](q, key_cache, value_cache, block_table.contiguous(), out, scale, pool_blocks, rows,
                          int(context), int(causal_from), HQ=num_q, G=num_q // num_kv, D=head_dim,
                          BS=block_size, D_P=_pow2(head_dim, 16), BM=tile, BN=32,
                          IEEE=q.dtype == torch.float32 or q.device.type != "cuda")
    return out
