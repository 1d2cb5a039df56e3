"""Decode attention over hot and cold blocks through the Triton kernels (attention_backend=triton).

The PyTorch path (attention.py `_decode_attention`) gathers the hot blocks, dequantizes the cold
picks into a copy, and takes one softmax over both. Here each part is attended on its own and the
two are merged by their log-sum-exps, which is the same softmax:

    hot:  decode_attention over the paged cache          -> out_h, lse_h
    cold: cold_attention on the int8/int4 fields in place -> out_c, lse_c (and each pick's lse)
    lse = logaddexp(lse_h, lse_c);  out = out_h exp(lse_h - lse) + out_c exp(lse_c - lse)

The need probe reads `lse`; importance reads each hot block's share (normalized by `lse`) and
each cold pick's, exp(pick lse - lse), spread over the slot-table columns as the PyTorch path does.
Here too, shared with the PyTorch path: the choice of cold blocks (`cold_picks`), the need probe's
step (`probe_dropped`) and the sum of hot-block mass over layers (`add_decode_mass`).
"""
from __future__ import annotations

import time

import torch

from kvreplay.kv.quant import block_upper_bound

# AttentionMetadata, ColdAttention and NeedProbe in the annotations are attention.py's classes
# (unevaluated: attention.py imports this module).


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
        probe_dropped(probe, probed_layer, query.index_select(0, probe.rows), lse.index_select(0, probe.rows))
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


def cold_picks(cold: ColdAttention, query: torch.Tensor, num_kv: int, num_seqs: int, group: int
               ) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """This layer's cold reads: the layer, the slots [Hkv, B, k] and validity [Hkv, B, k] each KV
    head reads, and their slot-table columns [Hkv, B, k] (None: all N columns, k = N). Sparse:
    per KV head, the top blocks by Quest bound. query: [Hkv*B, G, D] scaled."""
    head_dim = query.shape[-1]
    table, valid = cold.slot_table, cold.valid                                    # [B, N]
    num_slots = table.shape[1]
    layer = cold.layer
    cold.layer += 1
    heads_valid = valid.unsqueeze(0).expand(num_kv, -1, -1)                       # [Hkv, B, N]
    cold.candidate_blocks += int(valid.sum()) * num_kv
    if cold.budget_blocks is None or layer < cold.dense_layers or num_slots <= cold.budget_blocks:
        cold.selected_blocks += int(valid.sum()) * num_kv
        return layer, table.unsqueeze(0).expand(num_kv, -1, -1), heads_valid, None
    lo, hi = cold.pool.summaries(layer)                                           # [Hkv, S, D]
    q = query.view(num_kv, num_seqs, group, head_dim).float()
    if cold.triton is not None:  # read through the slot table in place: [B, Hkv, N]
        bound = cold.triton.quest_bound(q.transpose(0, 1), lo, hi, table, valid).transpose(0, 1)
    else:
        flat = table.flatten()
        lo = lo.index_select(1, flat).view(num_kv, num_seqs, num_slots, head_dim)
        hi = hi.index_select(1, flat).view(num_kv, num_seqs, num_slots, head_dim)
        bound = block_upper_bound(q, lo.float(), hi.float()).amax(2)              # [Hkv, B, N]
        bound.masked_fill_(~heads_valid, float("-inf"))
    top = bound.topk(cold.budget_blocks, dim=-1).indices                          # [Hkv, B, k]
    picked_valid = heads_valid.gather(2, top)
    cold.selected_blocks += int(picked_valid.sum())
    return layer, table.unsqueeze(0).expand(num_kv, -1, -1).gather(2, top), picked_valid, top


def probe_dropped(probe: NeedProbe, layer: int, query: torch.Tensor, lse: torch.Tensor) -> None:
    """Estimate, for this layer, the largest attention share a dropped block would take.
    query: [R, Hkv, G, D] scaled queries of the probed rows; lse: [R, Hkv, G] log-sum-exp of their
    scores over the keys they attended to."""
    mass, column = probe.key_index.max_block_mass(layer, query, probe.slot_table, probe.valid, lse,
                                                  probe.top_blocks)
    if probe.max_mass is None:
        probe.max_mass, probe.flagged = mass, column
    else:
        larger = mass > probe.max_mass
        probe.flagged = torch.where(larger, column, probe.flagged)
        probe.max_mass = torch.where(larger, mass, probe.max_mass)


def add_decode_mass(meta: AttentionMetadata, mass: torch.Tensor) -> None:
    """Add one layer's hot-block mass [B, max_blocks] to the step's sum over layers."""
    meta.decode_mass = mass if meta.decode_mass is None else meta.decode_mass + mass
