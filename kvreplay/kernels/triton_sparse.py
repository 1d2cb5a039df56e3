"""Triton kernels of the sparse paths: the Quest bound, attention over quantized cold blocks with the
dequantization fused, and the need detector's per-block scores over the key index's int4 keys.

- `quest_bound`: per (row, KV head, block) the Quest bound max over the head's G queries of
  sum_d max(q_d lo_d, q_d hi_d), read through a slot table from the fp16 summaries in place
  (kv/quant.py block_upper_bound's figure); -inf on padding. Top-k stays in torch.
- `cold_attention`: each (row, KV head) attends to its own picked cold slots, reading the cold
  pool's int8 or int4 fields (kv/cold_pool.py layout) and dequantizing in registers; hands back
  the attention within those blocks and its log-sum-exp, to merge with the hot part's.
- `need_block_lse`: per (row, KV head, picked slot) the log-sum-exp of each query's scores over the
  block's int4 keys (kv/quant.py dequantize_keys_int4's lerp), what KeyIndex.max_block_mass turns
  into each block's share.

Imported only through triton_backend.kernels(): this module imports triton.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvreplay.kernels.triton_attention import _pow2

COLD_KINDS = ("int8", "int4")  # what cold_attention reads; fp8 cold blocks stay on the PyTorch path
INT4_GROUP = 32  # kv/quant.py: channels sharing one int4 value scale in the cold tier


@triton.jit
def _load_queries(q_ptr, head0, G: tl.constexpr, D: tl.constexpr, G_P: tl.constexpr, D_P: tl.constexpr):
    """[G_P, D_P] fp32 queries of G consecutive heads from head0 (zero padding)."""
    g = tl.arange(0, G_P)
    d = tl.arange(0, D_P)
    mask = (g[:, None] < G) & (d[None, :] < D)
    return tl.load(q_ptr + (head0 + g)[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _int4_codes(data_ptr, rows, live, D: tl.constexpr, D_P: tl.constexpr):
    """[BS_P, D_P] fp32 4-bit codes of cache rows `rows`, packed two per byte (low nibble even)."""
    d = tl.arange(0, D_P)
    mask = live[:, None] & (d[None, :] < D)
    packed = tl.load(data_ptr + rows[:, None] * (D // 2) + d[None, :] // 2, mask=mask, other=0).to(tl.int32)
    return ((packed >> ((d[None, :] % 2) * 4)) & 15).to(tl.float32)


@triton.jit
def _quest_kernel(q_ptr, lo_ptr, hi_ptr, table_ptr, valid_ptr, out_ptr, pool_slots, N,
                  HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, G_P: tl.constexpr,
                  D_P: tl.constexpr, BN: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    cols = tl.program_id(2) * BN + tl.arange(0, BN)
    d = tl.arange(0, D_P)
    g = tl.arange(0, G_P)
    q = _load_queries(q_ptr, (r * HKV + h) * G, G, D, G_P, D_P)
    inside = cols < N
    slot = tl.load(table_ptr + r * N + cols, mask=inside, other=0).to(tl.int64)
    valid = tl.load(valid_ptr + r * N + cols, mask=inside, other=0) != 0
    offsets = (h * pool_slots + slot)[:, None] * D + d[None, :]
    mask = inside[:, None] & (d[None, :] < D)
    lo = tl.load(lo_ptr + offsets, mask=mask, other=0.0).to(tl.float32)             # [BN, D_P]
    hi = tl.load(hi_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    bound = tl.sum(tl.maximum(q[:, None, :] * lo[None, :, :], q[:, None, :] * hi[None, :, :]), axis=2)
    bound = tl.max(tl.where(g[:, None] < G, bound, float("-inf")), axis=0)           # [BN]
    tl.store(out_ptr + (r * HKV + h) * N + cols, tl.where(valid, bound, float("-inf")), mask=inside)


def quest_bound(query: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, slot_table: torch.Tensor,
                valid: torch.Tensor) -> torch.Tensor:
    """Quest bounds of each row's blocks through its slot table.

    Args:
        query: [R, Hkv, G, D] scaled queries.
        lo, hi: [Hkv, S, D] per-slot per-channel key minima and maxima (fp16 summaries).
        slot_table: [R, N] long slots of each row's blocks; valid: [R, N] bool, False on padding.
    Returns:
        [R, Hkv, N] fp32: per block the largest bound over the G queries, -inf where not valid.
    """
    rows, num_kv, group, head_dim = query.shape
    columns = slot_table.shape[1]
    out = torch.empty(rows, num_kv, columns, dtype=torch.float32, device=query.device)
    if rows == 0 or columns == 0:
        return out
    block = min(_pow2(columns), 32)
    grid = (rows, num_kv, triton.cdiv(columns, block))
    _quest_kernel[grid](query.contiguous(), lo.contiguous(), hi.contiguous(), slot_table.contiguous(),
                        valid.to(torch.int8).contiguous(), out, lo.shape[1], columns, HKV=num_kv, G=group,
                        D=head_dim, G_P=_pow2(group), D_P=_pow2(head_dim), BN=block)
    return out


@triton.jit
def _cold_kernel(q_ptr, slots_ptr, valid_ptr, kd_ptr, ks_ptr, kz_ptr, vd_ptr, vs_ptr, vz_ptr, out_ptr, lse_ptr,
                 block_lse_ptr, pool_slots, picks, HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                 G_P: tl.constexpr, D_P: tl.constexpr, BS_P: tl.constexpr, INT4: tl.constexpr,
                 GROUP: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    g = tl.arange(0, G_P)
    d = tl.arange(0, D_P)
    t = tl.arange(0, BS_P)
    head0 = (b * HKV + h) * G
    q = _load_queries(q_ptr, head0, G, D, G_P, D_P)
    dmask = d < D
    m = tl.full([G_P], float("-inf"), tl.float32)
    l_sum = tl.zeros([G_P], tl.float32)
    acc = tl.zeros([G_P, D_P], tl.float32)
    for i in range(0, picks):
        pick = (b * HKV + h) * picks + i
        block = h * pool_slots + tl.load(slots_ptr + pick).to(tl.int64)              # [Hkv, S] index
        live = t < tl.where(tl.load(valid_ptr + pick) != 0, BS, 0)  # no live rows in padding
        rows = block * BS + t                                                       # [BS_P] token rows
        mask = live[:, None] & dmask[None, :]
        if INT4:  # keys per channel (zero + code * scale, fp16), values per token and 32 channels
            k_zero = tl.load(kz_ptr + block * D + d, mask=dmask, other=0.0).to(tl.float32)
            k_scale = tl.load(ks_ptr + block * D + d, mask=dmask, other=0.0).to(tl.float32)
            keys = k_zero[None, :] + _int4_codes(kd_ptr, rows, live, D, D_P) * k_scale[None, :]
            groups = rows[:, None] * (D // GROUP) + d[None, :] // GROUP
            v_zero = tl.load(vz_ptr + groups, mask=mask, other=0.0).to(tl.float32)
            v_scale = tl.load(vs_ptr + groups, mask=mask, other=0.0).to(tl.float32)
            values = v_zero + _int4_codes(vd_ptr, rows, live, D, D_P) * v_scale
        else:  # int8: keys scaled per channel, values per token (fp32 scales)
            k_scale = tl.load(ks_ptr + block * D + d, mask=dmask, other=0.0)
            keys = tl.load(kd_ptr + rows[:, None] * D + d[None, :], mask=mask, other=0).to(tl.float32) \
                * k_scale[None, :]
            v_scale = tl.load(vs_ptr + rows, mask=live, other=0.0)
            values = tl.load(vd_ptr + rows[:, None] * D + d[None, :], mask=mask, other=0).to(tl.float32) \
                * v_scale[:, None]
        s = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)                        # [G_P, BS_P]
        s = tl.where(live[None, :], s, float("-inf"))
        top = tl.max(s, axis=1)
        top_safe = tl.where(top == float("-inf"), 0.0, top)
        block_sum = tl.sum(tl.exp(s - top_safe[:, None]), axis=1)
        tl.store(block_lse_ptr + (head0 + g) * picks + i,
                 tl.where(block_sum > 0, top_safe + tl.log(tl.where(block_sum > 0, block_sum, 1.0)), float("-inf")),
                 mask=g < G)
        m_new = tl.maximum(m, top)
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing live yet: no NaN
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * values[None, :, :], axis=1)
        m = m_new
    some = l_sum > 0
    out = acc / tl.where(some, l_sum, 1.0)[:, None]
    gmask = g < G
    tl.store(out_ptr + (head0 + g)[:, None] * D + d[None, :], out, mask=gmask[:, None] & dmask[None, :])
    tl.store(lse_ptr + head0 + g, tl.where(some, m + tl.log(tl.where(some, l_sum, 1.0)), float("-inf")),
             mask=gmask)


def cold_attention(query: torch.Tensor, fields: dict[str, torch.Tensor], kind: str, slots: torch.Tensor,
                   valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Attention of each row's queries within its picked cold blocks, dequantized in the kernel.

    Args:
        query: [B, Hkv, G, D] scaled queries.
        fields: one layer's cold-pool fields, each [Hkv, S, ...] (ColdPool.stored[name][layer]):
            key_data, key_scale, value_data, value_scale, and for int4 key_zero and value_zero.
        kind: "int8" or "int4" (COLD_KINDS).
        slots: [B, Hkv, k] long, each KV head's own picks; valid: [B, Hkv, k] bool.
    Returns:
        out [B, Hkv, G, D] fp32 (zero where no pick is valid), lse [B, Hkv, G] fp32 of the
        scores over the picked blocks' tokens (-inf where none), and each pick's own log-sum-exp
        [B, Hkv, G, k] (-inf where not valid), for its block mass.
    """
    if kind not in COLD_KINDS:
        raise ValueError(f"cold_attention reads {' or '.join(COLD_KINDS)} cold blocks, not {kind!r}")
    num_seqs, num_kv, group, head_dim = query.shape
    key_data = fields["key_data"]
    block_size = key_data.shape[2]
    int4 = kind == "int4"
    out = torch.empty(num_seqs, num_kv, group, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.empty(num_seqs, num_kv, group, dtype=torch.float32, device=query.device)
    block_lse = torch.empty(num_seqs, num_kv, group, slots.shape[-1], dtype=torch.float32, device=query.device)
    zeros = (fields["key_zero"], fields["value_zero"]) if int4 else (key_data, key_data)  # unread for int8
    _cold_kernel[(num_seqs, num_kv)](
        query.float().contiguous(), slots.contiguous(), valid.to(torch.int8).contiguous(),
        key_data.contiguous(), fields["key_scale"].contiguous(), zeros[0].contiguous(),
        fields["value_data"].contiguous(), fields["value_scale"].contiguous(), zeros[1].contiguous(),
        out, lse, block_lse, key_data.shape[1], slots.shape[-1], HKV=num_kv, G=group, D=head_dim, BS=block_size,
        G_P=_pow2(group), D_P=_pow2(head_dim), BS_P=_pow2(block_size), INT4=int4, GROUP=INT4_GROUP)
    return out, lse, block_lse


@triton.jit
def _need_kernel(q_ptr, codes_ptr, lo_ptr, hi_ptr, slots_ptr, out_ptr, pool_slots, picks,
                 HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                 G_P: tl.constexpr, D_P: tl.constexpr, BS_P: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    i = tl.program_id(2)
    g = tl.arange(0, G_P)
    d = tl.arange(0, D_P)
    t = tl.arange(0, BS_P)
    q = _load_queries(q_ptr, (r * HKV + h) * G, G, D, G_P, D_P)
    pick = (r * HKV + h) * picks + i
    block = h * pool_slots + tl.load(slots_ptr + pick).to(tl.int64)
    live = t < BS
    lo = tl.load(lo_ptr + block * D + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    hi = tl.load(hi_ptr + block * D + d, mask=d < D, other=0.0).to(tl.float32)[None, :]
    weight = _int4_codes(codes_ptr, block * BS + t, live, D, D_P) / 15.0
    # torch.lerp's two forms: exactly lo at code 0 and hi at code 15
    keys = tl.where(weight < 0.5, lo + weight * (hi - lo), hi - (hi - lo) * (1.0 - weight))
    s = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)                             # [G_P, BS_P]
    s = tl.where(live[None, :], s, float("-inf"))
    top = tl.max(s, axis=1)
    lse = top + tl.log(tl.sum(tl.exp(s - top[:, None]), axis=1))
    tl.store(out_ptr + ((r * HKV + h) * G + g) * picks + i, lse, mask=g < G)


def need_block_lse(query: torch.Tensor, codes: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor,
                   slots: torch.Tensor) -> torch.Tensor:
    """Log-sum-exp of each query's scores over each picked block's int4 keys.

    Args:
        query: [R, Hkv, G, D] scaled queries.
        codes: [Hkv, S, bs, D/2] uint8 packed int4 keys of one layer of the key index.
        lo, hi: [Hkv, S, D] fp16 per-channel minima and maxima.
        slots: [R, Hkv, k] long, the key-index slots each KV head reads.
    Returns:
        [R, Hkv, G, k] fp32.
    """
    rows, num_kv, group, head_dim = query.shape
    picks = slots.shape[-1]
    out = torch.empty(rows, num_kv, group, picks, dtype=torch.float32, device=query.device)
    if rows == 0 or picks == 0:
        return out
    block_size = codes.shape[2]
    _need_kernel[(rows, num_kv, picks)](
        query.float().contiguous(), codes.contiguous(), lo.contiguous(), hi.contiguous(), slots.contiguous(),
        out, codes.shape[1], picks, HKV=num_kv, G=group, D=head_dim, BS=block_size, G_P=_pow2(group),
        D_P=_pow2(head_dim), BS_P=_pow2(block_size))
    return out
