"""Turns a scheduled batch into flat tensors and attention metadata, runs the model."""
from __future__ import annotations

import torch

from kvreplay.engine.attention import AttentionMetadata, PrefillSlice
from kvreplay.engine.kv_manager import KVManager
from kvreplay.engine.scheduler import ScheduledBatch
from kvreplay.engine.sequence import Sequence
from kvreplay.models.llama import LlamaModel


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVManager):
        self.model = model
        self.kv = kv
        self.device = model.device

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        block_size = self.kv.block_size
        return table[positions // block_size] * block_size + positions % block_size

    def run(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute K/V for every scheduled token. Returns logits [S, V] for the sequences whose
        known tokens are all computed after this step (they sample), and those sequences."""
        block_size = self.kv.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0))

        if batch.decodes:
            tables = [self.kv.block_table(seq.seq_id) for seq in batch.decodes]
            width = max(len(t) for t in tables)
            padded = torch.zeros(len(tables), width, dtype=torch.long)
            context = torch.empty(len(tables), dtype=torch.long)
            for row, (seq, table) in enumerate(zip(batch.decodes, tables)):
                padded[row, :len(table)] = torch.tensor(table)
                position = seq.num_computed_tokens
                context[row] = position + 1
                input_ids.append(seq.token_ids[position])
                positions.append(torch.tensor([position]))
                slots.append(self._slots(padded[row], position, position + 1))
                logit_rows.append(row)
                sampled.append(seq)
            meta.num_decode_tokens = len(tables)
            meta.decode_block_tables = padded.to(self.device)
            padding = torch.arange(width * block_size)[None, :] >= context[:, None]  # [B, L]
            num_kv = self.model.config.num_kv_heads
            meta.decode_padding = padding.repeat(num_kv, 1).unsqueeze(1).to(self.device)

        for seq, chunk in batch.prefills:
            start = seq.num_computed_tokens
            end = start + chunk
            table = torch.tensor(self.kv.block_table(seq.seq_id), dtype=torch.long)
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            slots.append(self._slots(table, start, end))
            mask = None
            if start > 0:  # attend to cached tokens too: query i sees keys 0..start+i
                mask = (torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]).to(self.device)
            meta.prefills.append(PrefillSlice(row, row + chunk, end, table.to(self.device), mask))
            if end == seq.num_tokens:
                logit_rows.append(row + chunk - 1)
                sampled.append(seq)

        meta.slot_mapping = torch.cat(slots).to(self.device)
        logits = self.model.forward(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.cat(positions).to(self.device), self.kv.kv_caches, meta,
            torch.tensor(logit_rows, dtype=torch.long, device=self.device))
        return logits, sampled
