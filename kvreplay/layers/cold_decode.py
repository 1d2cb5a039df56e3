"""Decode attention over hot and cold blocks through the Triton kernels (attention_backend=triton).

The PyTorch path (attention.py `_decode_attention`) gathers the hot blocks, dequantizes the cold
picks into a copy, and takes one softmax over both. Here each part is attended on its own and the
two are merged by their log-sum-exps, which is the same softmax:

    hot:  decode_attention over the paged cache          -> out_h, lse_h
    cold: cold_attention on the int8/int4 fields in place -> out_c, lse_c (and each pick's lse)
    lse = logaddexp(lse_h, lse_c);  out = out_h exp(lse_h - lse) + out_c exp(lse_c - lse)

The need probe reads `lse`; importance reads each hot block's share (normalized by `lse`) and
each cold pick's, exp(pick lse - lse), spread over the slot-table columns as the PyTorch path does.
"""
from __future__ import annotations

import time

import torch

from kvreplay.layers.attention import AttentionMetadata, _probe_dropped, add_decode_mass, cold_picks


def cold_decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                          meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [B, Hq, D] one query per row; returns [B, Hq, D] in q's dtype (meta.cold set, int8/int4)."""
    cold = meta.cold
    ops = cold.triton
    num_seqs, num_q, head_dim = q.shape
    num_kv = key_cache.shape[0]
    group = num_q // num_kv
    tables, context = meta.decode_block_tables, meta.decode_context
    out_h, lse_h, _ = ops.decode_attention(q, key_cache, value_cache, tables, context, scale, True, False)
    query = (q.float() * scale).view(num_seqs, num_kv, group, head_dim)           # [B, Hkv, G, D]
    heads_query = query.transpose(0, 1).reshape(num_kv * num_seqs, group, head_dim)
    layer, slots, valid, columns = cold_picks(cold, heads_query, num_kv, num_seqs, group)  # [Hkv, B, k]
    start = time.perf_counter()
    fields = {name: t[layer] for name, t in cold.pool.stored.items()}
    out_c, lse_c, pick_lse = ops.cold_attention(query, fields, cold.pool.kind, slots.transpose(0, 1),
                                                valid.transpose(0, 1))           # [B, Hkv, G, D], [B, Hkv, G]
    cold.dequant_seconds += time.perf_counter() - start
    lse_h = lse_h.view(num_seqs, num_kv, group)
    lse = torch.logaddexp(lse_h, lse_c)                                            # [B, Hkv, G]
    out = out_h.view(num_seqs, num_kv, group, head_dim).float() * (lse_h - lse).exp().unsqueeze(-1) \
        + out_c * (lse_c - lse).exp().unsqueeze(-1)
    probe = meta.probe
    probed_layer = None if probe is None else probe.next_layer()
    if probed_layer is not None:
        _probe_dropped(probe, probed_layer, query.index_select(0, probe.rows), lse.index_select(0, probe.rows))
    if meta.observe_decode:
        hot = ops.decode_block_mass(q, key_cache, tables, context, lse.view(num_seqs, num_q), scale)
        add_decode_mass(meta, hot.amax(1))                                          # [B, W]
        per_head = (pick_lse - lse.unsqueeze(-1)).exp().amax(2).transpose(0, 1)     # [Hkv, B, k]
        if columns is not None:  # sparse: each head's picks back at their slot-table columns
            per_head = per_head.new_zeros(num_kv, num_seqs, cold.slot_table.shape[1]) \
                .scatter_(2, columns, per_head)
        cold_mass = per_head.amax(0)                                                # [B, N]
        meta.cold_mass = cold_mass if meta.cold_mass is None else meta.cold_mass + cold_mass
    return out.to(q.dtype).view(num_seqs, num_q, head_dim)
