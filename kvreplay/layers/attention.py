"""Attention over the paged KV cache.

A step's tokens are laid out flat: first one token per decoding sequence, then each prefill
chunk's tokens in turn. K/V of every scheduled token are written into the cache first (at
`slot_mapping`), then each query attends to its sequence's cached context through its block table:

    block table [7, 2, 9]  ->  cache rows  block 7: positions  0..15   (per KV head)
                                           block 2: positions 16..31
                                           block 9: positions 32..(context_len-1)
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch
import torch.nn.functional as F

from kvreplay.kv.importance import block_mass
from kvreplay.layers.cold_decode import add_decode_mass, cold_decode_attention, cold_picks
from kvreplay.layers.cold_decode import probe_dropped as _probe_dropped
from kvreplay.layers.linear import onednn_rows
from kvreplay.layers.selection import HotSelection, mask_unselected
from kvreplay.layers.window import window_chunk_keys, windowed_decode_meta

if TYPE_CHECKING:
    from kvreplay.kv.cold_pool import ColdPool
    from kvreplay.kv.key_index import KeyIndex


@dataclass
class PrefillSlice:
    token_start: int          # first row of this chunk in the flat batch
    token_end: int            # one past its last row
    context_tokens: int       # key rows gathered from block_table (cached + chunk)
    block_table: torch.Tensor  # [num_blocks] block ids whose rows are gathered
    mask: torch.Tensor | None  # [chunk, context] bool, None when nothing was cached before it
    observe: int = 0           # score this many last queries against every key (importance)
    # Keys are positions 0 .. context_tokens - 1 in order and query j sits at position
    # causal_from + j (plain causal attention); None when the keys are a resident subset.
    causal_from: int | None = None
    mass: torch.Tensor | None = None  # [context blocks] their block mass, summed over layers
    layer_masses: list | None = None  # when a list: each layer's block mass appended (calibration)


@dataclass
class NeedProbe:
    """The need detector's inputs for one decode step, and its running result."""
    rows: torch.Tensor        # [R] decode rows whose sequences have dropped, indexed blocks
    slot_table: torch.Tensor  # [R, N] key-index slots of their dropped blocks, padded
    valid: torch.Tensor       # [R, N] False on padding
    key_index: "KeyIndex"
    top_blocks: int
    layers: frozenset[int] | None = None  # layers to read (None: all)
    layer: int = 0                        # calls so far
    # the model layers that call it, in order (None: every layer; a hybrid pool's global layers)
    order: tuple[int, ...] | None = None
    max_mass: torch.Tensor | None = None  # [R] largest block share seen in any layer and head
    flagged: torch.Tensor | None = None   # [R] slot-table column of the block that took it

    def next_layer(self) -> int | None:
        """Move on to the next layer; its index when the detector reads it, else None."""
        layer = self.layer if self.order is None else self.order[self.layer]
        self.layer += 1
        return layer if self.layers is None or layer in self.layers else None

    def skip_layer(self) -> bool:
        """Move past the next layer if the detector does not read it (True); else stay (False)."""
        if self.layers is None or self.layer in self.layers:
            return False
        self.layer += 1
        return True


@dataclass
class ColdAttention:
    """Cold blocks of each decoding sequence, attended beside its hot blocks (docs/architecture.md §6 sparse).

    With `budget_blocks` set, each layer (past `dense_layers`) and KV head attends to the
    `budget_blocks` cold blocks with the highest Quest bound for its queries; else to all."""
    slot_table: torch.Tensor   # [B, N] cold-pool slots per decode row, padded
    valid: torch.Tensor        # [B, N] False on padding
    pool: "ColdPool"
    budget_blocks: int | None
    dense_layers: int = 0
    # The Triton kernels (kernels/triton_backend.kernels()), else None: the Quest bound, and for
    # int8/int4 blocks attention with the dequantization fused (layers/cold_decode.py).
    triton: Any = None
    layer: int = 0
    selected_blocks: int = 0   # cold blocks attended, summed over layers and KV heads
    candidate_blocks: int = 0  # cold blocks that could have been
    dequant_seconds: float = 0.0


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor                   # [T] cache row of each token
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None  # [B, max_blocks] resident blocks, padded with block 0
    decode_padding: torch.Tensor | None = None       # [Hkv*B, 1, max_blocks * block_size] True past the context
    decode_context: torch.Tensor | None = None       # [B] tokens each row attends to
    # The compiled decode kernel (kvreplay.kernels.cpu_kernels) when this step can use it (no
    # cold tier); the PyTorch path below otherwise, with rows padded by decode_padding.
    decode_kernel: Callable | None = None
    # The compiled causal attention for prefill chunks whose earlier positions are all resident
    # (bf16 on a CPU with AVX512-BF16; kvreplay.kernels.cpu_kernels.prefill_attention); else SDPA.
    prefill_kernel: Callable | None = None
    # The Triton prefill attention (kernels/triton_attention.py): chunks of plain causal attention
    # read the paged cache in place (not local layers, not chunks observed for importance).
    paged_prefill: Callable | None = None
    prefills: list[PrefillSlice] = field(default_factory=list)
    probe: NeedProbe | None = None
    cold: ColdAttention | None = None
    hot_selection: HotSelection | None = None  # quest: each KV head reads its top middle blocks
    # Importance (kvreplay.kv.importance): block mass of each decode row, summed over layers,
    # over its hot blocks [B, max_blocks] and its cold blocks [B, N] (when observe_decode).
    observe_decode: bool = False
    decode_mass: torch.Tensor | None = None
    cold_mass: torch.Tensor | None = None
    # A hybrid pool (kv/local_groups.py): each layer's group (None: global, the fields above),
    # and per local group this step's metadata over that group's pages.
    layer_groups: list[int | None] | None = None
    local_groups: list[AttentionMetadata] = field(default_factory=list)

    def for_layer(self, layer: int) -> AttentionMetadata:
        group = self.layer_groups[layer] if self.layer_groups else None
        return self if group is None else self.local_groups[group]


def decode_padding(context: torch.Tensor, width: int, num_kv: int) -> torch.Tensor:
    """AttentionMetadata.decode_padding [Hkv*B, 1, width] for rows attending to `context` [B]
    tokens each, their tables padded to `width` key rows: True past each row's context."""
    keys = torch.arange(width, device=context.device)
    return (keys[None, :] >= context[:, None]).repeat(num_kv, 1).unsqueeze(1)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, cache_written: bool = False,
                    window: int | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: [2, Hkv, num_blocks, block_size, D].
    cache_written: k and v are in the cache at slot_mapping already (the fused CPU layer op).
    window: a local layer's sliding window (layers/window.py; PyTorch path only); None: causal."""
    num_kv, num_blocks, block_size, head_dim = kv_cache.shape[1:]
    key_cache, value_cache = kv_cache[0], kv_cache[1]  # [Hkv, num_blocks, block_size, D]
    if not cache_written:
        key_cache.view(num_kv, -1, head_dim).index_copy_(1, meta.slot_mapping, k.transpose(0, 1))
        value_cache.view(num_kv, -1, head_dim).index_copy_(1, meta.slot_mapping, v.transpose(0, 1))
    num_decode = meta.num_decode_tokens
    if window is not None and num_decode:  # decode rows read only their windows' blocks
        meta = windowed_decode_meta(meta, window, block_size, num_kv)
    if num_decode == q.shape[0] and not meta.prefills:  # a decode-only step: no copy
        return _decode_attention(q, key_cache, value_cache, meta, scale)
    out = torch.empty_like(q)
    if num_decode:
        out[:num_decode] = _decode_attention(q[:num_decode], key_cache, value_cache, meta, scale)

    # the compiled causal kernel: bf16, no window, the head sizes it is built for
    kernel = meta.prefill_kernel if q.dtype == torch.bfloat16 and window is None and head_dim in (64, 128) else None
    for chunk in meta.prefills:
        rows = slice(chunk.token_start, chunk.token_end)
        query = q[rows].transpose(0, 1).unsqueeze(0)  # [1, Hq, C, D]
        if window is not None:
            keys, values, mask = window_chunk_keys(chunk, k[rows].transpose(0, 1), v[rows].transpose(0, 1),
                                                   key_cache, value_cache, window)  # [Hkv, L, D], [C, L]
            result = F.scaled_dot_product_attention(query, keys.unsqueeze(0), values.unsqueeze(0),
                                                    attn_mask=mask, scale=scale, enable_gqa=True)
            out[rows] = result.squeeze(0).transpose(0, 1)
            continue
        if meta.paged_prefill is not None and chunk.causal_from is not None and not chunk.observe:
            out[rows] = meta.paged_prefill(q[rows], key_cache, value_cache, chunk.block_table,
                                           chunk.context_tokens, chunk.causal_from, scale)
            continue
        if chunk.mask is None:  # nothing cached before: the chunk's own K/V suffice
            keys, values = k[rows].transpose(0, 1), v[rows].transpose(0, 1)  # [Hkv, C, D]
        else:
            context = chunk.context_tokens
            # index_select: ~9x faster than advanced indexing on a middle dimension here
            keys = key_cache.index_select(1, chunk.block_table).view(num_kv, -1, head_dim)[:, :context]
            values = value_cache.index_select(1, chunk.block_table).view(num_kv, -1, head_dim)[:, :context]
        if kernel is not None and chunk.causal_from is not None:  # plain causal: the compiled op
            out[rows] = kernel(q[rows], keys.transpose(0, 1), values.transpose(0, 1), scale, chunk.causal_from)
        else:
            result = F.scaled_dot_product_attention(query, keys.unsqueeze(0), values.unsqueeze(0),
                                                    attn_mask=chunk.mask, is_causal=chunk.mask is None,
                                                    scale=scale, enable_gqa=True)
            out[rows] = result.squeeze(0).transpose(0, 1)
        if chunk.observe:
            _observe_prefill(chunk, query[0], keys, chunk.mask, scale, block_size)
    return out


def _decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                      meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """One query per sequence. Plain batched matmuls: the CPU flash kernel is slow at q_len=1.

    The query heads sharing a KV head are stacked as rows, so K/V are never repeated."""
    if meta.decode_kernel is not None:
        return _kernel_decode(q, key_cache, value_cache, meta, scale)
    if meta.cold is not None and meta.cold.triton is not None and meta.hot_selection is None \
            and meta.cold.pool.kind in ("int8", "int4"):
        return cold_decode_attention(q, key_cache, value_cache, meta, scale)
    num_seqs, num_q, head_dim = q.shape
    num_kv = key_cache.shape[0]
    group = num_q // num_kv
    tables = meta.decode_block_tables  # [B, max_blocks]
    width = tables.shape[1] * key_cache.shape[2]
    flat = tables.flatten()
    keys = key_cache.index_select(1, flat).view(num_kv * num_seqs, width, head_dim)      # [Hkv*B, L, D]
    values = value_cache.index_select(1, flat).view(num_kv * num_seqs, width, head_dim)  # [Hkv*B, L, D]
    query = (q * scale).view(num_seqs, num_kv, group, head_dim).transpose(0, 1) \
        .reshape(num_kv * num_seqs, group, head_dim)                             # [Hkv*B, G, D]
    scores = torch.bmm(query, keys.transpose(1, 2)).float()                      # [Hkv*B, G, L]
    scores.masked_fill_(meta.decode_padding, float("-inf"))
    if meta.hot_selection is not None:
        mask_unselected(meta.hot_selection, query, keys, scores, num_kv, num_seqs, key_cache.shape[2])
    picks = None
    if meta.cold is not None:
        cold_keys, cold_values, cold_valid, picks = _cold_blocks(meta.cold, query, num_kv, num_seqs, group)
        cold_scores = torch.bmm(query, cold_keys.transpose(1, 2)).float()        # [Hkv*B, G, C]
        cold_scores.masked_fill_(~cold_valid, float("-inf"))
        scores = torch.cat([scores, cold_scores], dim=-1)
        values = torch.cat([values, cold_values], dim=1)
    probe = meta.probe
    layer = None if probe is None else probe.next_layer()
    if layer is not None:
        lse = scores.view(num_kv, num_seqs, group, -1).index_select(1, probe.rows) \
            .logsumexp(-1).transpose(0, 1)                                        # [R, Hkv, G]
        rows_query = query.view(num_kv, num_seqs, group, head_dim).index_select(1, probe.rows) \
            .transpose(0, 1)                                                      # [R, Hkv, G, D]
        _probe_dropped(probe, layer, rows_query, lse)
    probs = torch.softmax(scores, dim=-1)
    if meta.observe_decode:
        _observe_decode(meta, probs, width, num_kv, num_seqs, group, key_cache.shape[2], picks)
    out = torch.bmm(probs.to(q.dtype), values)                                                # [Hkv*B, G, D]
    return out.view(num_kv, num_seqs, num_q // num_kv, head_dim).transpose(0, 1) \
        .reshape(num_seqs, num_q, head_dim)


def _scores(query: torch.Tensor, keys: torch.Tensor, rows_at_least: int = 0) -> torch.Tensor:
    """`torch.bmm(query, keys.transpose(1, 2))`; on CPU in bf16 (oneDNN) with the rows (at least
    `rows_at_least`) and keys (at least 128) padded with zeros to one of a few sizes
    (`onednn_rows`) and cut back: oneDNN keeps memory for each shape it has multiplied, and every
    prompt length was one (docs/benchmarks.md, the soak)."""
    rows, context = query.shape[1], keys.shape[1]
    if query.device.type != "cpu" or query.dtype != torch.bfloat16:
        return torch.bmm(query, keys.transpose(1, 2))
    padded_rows, padded_keys = onednn_rows(max(rows, rows_at_least)), onednn_rows(max(context, 128))
    query = F.pad(query, (0, 0, 0, padded_rows - rows)) if padded_rows != rows else query
    keys = F.pad(keys, (0, 0, 0, padded_keys - context)) if padded_keys != context else keys.contiguous()
    return torch.bmm(query, keys.transpose(1, 2))[:, :rows, :context]


def _observe_prefill(chunk: PrefillSlice, query: torch.Tensor, keys: torch.Tensor,
                     mask: torch.Tensor | None, scale: float, block_size: int) -> None:
    """Block mass of the chunk's last `observe` queries over its keys (SnapKV's observation
    window). query: [Hq, C, D]; keys: [Hkv, context, D]; mask: [C, context] or None (causal)."""
    num_q, num_rows, head_dim = query.shape
    num_kv, context = keys.shape[0], keys.shape[1]
    group = num_q // num_kv
    observed = min(chunk.observe, num_rows)
    last = query[:, -observed:].reshape(num_kv, group * observed, head_dim)
    # [Hkv, G*obs, context]; the rows padded to a whole window's (a chunk shorter than it)
    scores = _scores(last, keys, group * chunk.observe).float().mul_(scale)
    if mask is None:  # causal within the chunk: query i sees keys <= its own row
        rows = torch.arange(num_rows - observed, num_rows, device=query.device)
        allowed = torch.arange(context, device=query.device)[None, :] <= rows[:, None]
    else:
        allowed = mask[-observed:]
    scores = scores.view(num_kv, group, observed, context).masked_fill_(~allowed, float("-inf"))
    probs = torch.softmax(scores, dim=-1).view(num_q, observed, context)
    probs = F.pad(probs, (0, -context % block_size))
    mass = block_mass(probs, block_size)                                       # [context blocks]
    chunk.mass = mass if chunk.mass is None else chunk.mass + mass
    if chunk.layer_masses is not None:
        chunk.layer_masses.append(mass)


def _observe_decode(meta: AttentionMetadata, probs: torch.Tensor, width: int, num_kv: int,
                    num_seqs: int, group: int, block_size: int, picks: torch.Tensor | None) -> None:
    """Block mass of this layer's decode attention, added to the metadata's running sums.
    probs: [Hkv*B, G, width + cold keys]; picks: [Hkv, B, k] cold-table columns read per KV
    head (sparse), None when every cold block was read."""
    heads = probs.view(num_kv, num_seqs, group, -1)

    def per_row(keys: torch.Tensor) -> torch.Tensor:  # [Hkv, B, G, L] -> [B, L / bs]
        return block_mass(keys.transpose(0, 1).reshape(num_seqs, num_kv * group, 1, -1), block_size)

    add_decode_mass(meta, per_row(heads[..., :width]))
    if probs.shape[-1] == width:
        return
    cold = heads[..., width:]                                                  # [Hkv, B, G, picks*bs]
    if picks is None:
        cold_mass = per_row(cold)
    else:
        per_head = cold.reshape(num_kv, num_seqs, group, picks.shape[-1], block_size).sum(-1).amax(2)
        columns = meta.cold.slot_table.shape[1]
        spread = per_head.new_zeros(num_kv, num_seqs, columns).scatter_(2, picks, per_head)
        cold_mass = spread.amax(0)                                             # [B, N]
    meta.cold_mass = cold_mass if meta.cold_mass is None else meta.cold_mass + cold_mass


def _kernel_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                   meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Decode rows through the compiled kernel: each row reads its own blocks and length, and
    hands back the log-sum-exp (need probe) and block mass (importance) when this layer wants them."""
    num_seqs, num_q, head_dim = q.shape
    num_kv = key_cache.shape[0]
    probe = meta.probe
    layer = None if probe is None else probe.next_layer()
    out, lse, mass = meta.decode_kernel(q, key_cache, value_cache, meta.decode_block_tables,
                                        meta.decode_context, scale, layer is not None,
                                        meta.observe_decode)
    if layer is not None:
        heads = (num_seqs, num_kv, num_q // num_kv)
        rows_query = (q * scale).view(*heads, head_dim).index_select(0, probe.rows)
        _probe_dropped(probe, layer, rows_query, lse.view(*heads).index_select(0, probe.rows))
    if meta.observe_decode:
        add_decode_mass(meta, mass.amax(1))  # the largest over KV heads, as block_mass takes it
    return out


def _cold_blocks(cold: ColdAttention, query: torch.Tensor, num_kv: int, num_seqs: int, group: int
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Dequantized K, V [Hkv*B, C, D] of the cold blocks this layer attends to, which of their
    rows are real [Hkv*B, 1, C], and the slot-table columns each KV head read [Hkv, B, k]
    (None: all); `cold_picks` chooses them."""
    head_dim = query.shape[-1]
    block_size = cold.pool.block_size
    layer, slots, picked_valid, top = cold_picks(cold, query, num_kv, num_seqs, group)
    start = time.perf_counter()
    if top is None:
        keys, values = cold.pool.gather_all_heads(layer, cold.slot_table.flatten(), query.dtype)  # [Hkv, B*N, bs, D]
    else:
        keys, values = cold.pool.gather(layer, slots.transpose(0, 1), query.dtype)  # [B, Hkv, k, bs, D]
        keys, values = keys.transpose(0, 1), values.transpose(0, 1)               # [Hkv, B, k, bs, D]
    cold.dequant_seconds += time.perf_counter() - start
    picks = picked_valid.shape[-1]
    keys = keys.reshape(num_kv * num_seqs, picks * block_size, head_dim)
    values = values.reshape(num_kv * num_seqs, picks * block_size, head_dim)
    rows_valid = picked_valid.unsqueeze(-1).expand(-1, -1, -1, block_size) \
        .reshape(num_kv * num_seqs, 1, picks * block_size)
    return keys, values, rows_valid, top
