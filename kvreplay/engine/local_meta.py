"""A hybrid pool's step metadata per local layer group (kv/local_groups.py), built from true
positions: a lossy policy drops blocks from the global table only (docs/architecture.md, "Gemma
3"), so the global metadata's tables hold resident blocks and its contexts count resident tokens,
while a local layer reads its window by position. Each group's table has the global table's
columns (released ones stand as page 0, which no window reads), so a decode row's context is its
position + 1 and a chunk's keys are positions 0 .. end - 1, whatever the global layers dropped.
The global layers' extras (need probe, cold tier, Quest selection, importance) are not carried
over: they act on the global layers alone."""
from __future__ import annotations

import dataclasses

import torch

from kvreplay.engine.sequence import Sequence
from kvreplay.layers.attention import AttentionMetadata, PrefillSlice


def local_group_metas(kv, meta: AttentionMetadata, decodes: list[Sequence],
                      spans: list[tuple[Sequence, int, int]]) -> list[AttentionMetadata]:
    """Per local group of `kv` (a KVManager), `meta`'s step over that group's pages. `decodes`:
    the decode rows' sequences in row order; `spans`: (sequence, start, end) of each chunk
    after them, in the order of `meta.prefills`."""
    block_size, device = kv.block_size, meta.slot_mapping.device
    context = None
    if decodes:  # the query sits at position num_computed_tokens: it attends to that many + 1
        context = torch.tensor([seq.num_computed_tokens + 1 for seq in decodes], dtype=torch.long).to(device)
    metas = []
    for group in range(kv.local.num_groups):
        slots, tables = [], None
        if decodes:
            rows = [kv.local.group_table(seq.seq_id, group) for seq in decodes]
            width, flat = max(map(len, rows)), []
            for seq, table in zip(decodes, rows):
                flat += table + [0] * (width - len(table))
                slots.append(table[-1] * block_size + seq.num_computed_tokens % block_size)
            tables = torch.tensor(flat, dtype=torch.long).view(len(decodes), width).to(device)  # [B, W]
        slot_parts, prefills = [torch.tensor(slots, dtype=torch.long)], []
        for (seq, start, end), piece in zip(spans, meta.prefills):
            table = torch.tensor(kv.local.group_table(seq.seq_id, group), dtype=torch.long)
            positions = torch.arange(start, end)
            slot_parts.append(table[positions // block_size] * block_size + positions % block_size)
            # keys: positions 0 .. end - 1 in column order (the window picks its own, with its mask)
            prefills.append(PrefillSlice(piece.token_start, piece.token_end, end,
                                         table[:-(-end // block_size)].to(device), None, causal_from=start))
        metas.append(dataclasses.replace(
            meta, slot_mapping=torch.cat(slot_parts).to(device), prefills=prefills, decode_block_tables=tables,
            decode_context=context, decode_padding=None, decode_kernel=None, probe=None, cold=None,
            hot_selection=None, observe_decode=False, decode_mass=None, cold_mass=None,
            layer_groups=None, local_groups=[]))
    return metas
