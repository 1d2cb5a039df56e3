"""A hybrid pool's step metadata per local layer group (kv/local_groups.py): the global layers'
AttentionMetadata with each row's table and slots read from that group's pages instead.
Every other field (contexts, chunk bounds, masks) is the same: a local group's table has the
global table's columns, its released ones standing as page 0, which no window reads."""
from __future__ import annotations

import dataclasses

import torch

from kvreplay.engine.sequence import Sequence
from kvreplay.layers.attention import AttentionMetadata


def local_group_metas(kv, meta: AttentionMetadata, decodes: list[Sequence],
                      spans: list[tuple[Sequence, int, int]]) -> list[AttentionMetadata]:
    """Per local group of `kv` (a KVManager), `meta` over that group's pages. `decodes`: the
    decode rows' sequences in row order; `spans`: (sequence, start, end) of each chunk after
    them, in the order of `meta.prefills`."""
    block_size, device = kv.block_size, meta.slot_mapping.device
    metas = []
    for group in range(kv.local.num_groups):
        slots, flat, tables = [], [], None
        if decodes:
            width = meta.decode_block_tables.shape[1]
            for seq in decodes:
                table = kv.local.group_table(seq.seq_id, group)
                flat += table + [0] * (width - len(table))
                slots.append(table[-1] * block_size + seq.num_computed_tokens % block_size)
            tables = torch.tensor(flat, dtype=torch.long).view(len(decodes), width).to(device)
        slot_parts, prefills = [torch.tensor(slots, dtype=torch.long)], []
        for (seq, start, end), piece in zip(spans, meta.prefills):
            table = torch.tensor(kv.local.group_table(seq.seq_id, group), dtype=torch.long)
            positions = torch.arange(start, end)
            slot_parts.append(table[positions // block_size] * block_size + positions % block_size)
            prefills.append(dataclasses.replace(piece, block_table=table[:len(piece.block_table)].to(device)))
        metas.append(dataclasses.replace(meta, slot_mapping=torch.cat(slot_parts).to(device), prefills=prefills,
                                         decode_block_tables=tables, layer_groups=None, local_groups=[]))
    return metas
