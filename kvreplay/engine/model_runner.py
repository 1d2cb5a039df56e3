"""Turns a scheduled batch into flat tensors and attention metadata, runs the model."""
from __future__ import annotations

import torch

from kvreplay.kernels import cpu_kernels
from kvreplay.layers.attention import (AttentionMetadata, ColdAttention, NeedProbe, PrefillSlice,
                                       decode_padding)
from kvreplay.engine.cuda_graphs import DecodeGraphs, cuda_graphs_enabled
from kvreplay.kv import KVManager
from kvreplay.engine.scheduler import ScheduledBatch
from kvreplay.engine.sequence import LayeredPrefill, Sequence
from kvreplay.kv.importance import OBSERVED_QUERIES
from kvreplay.kv.manager import DROPPED
from kvreplay.models.llama import LlamaModel
from kvreplay.sampling import greedy_tokens


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVManager, detect_need: bool = False,
                 need_top_blocks: int = 8, sparse_budget: int | None = None, dense_layers: int = 0,
                 need_layers: frozenset[int] | None = None, observe_importance: bool = False,
                 layered_chunk_tokens: int = 512):
        self.model = model
        self.layered_chunk_tokens = layered_chunk_tokens  # rows per pass of a layered prefill
        self.kv = kv
        self.device = model.device
        self.detect_need = detect_need
        self.need_top_blocks = need_top_blocks
        self.need_layers = need_layers
        self.sparse_budget_blocks = None if sparse_budget is None else sparse_budget // kv.block_size
        self.dense_layers = dense_layers
        self.observe_importance = observe_importance  # feed kv.importance (policies that trim)
        self.last_cold: ColdAttention | None = None  # the cold-tier reads of the last run
        self.last_hot_reads = 0  # hot blocks its decode attention read (per layer and KV head)
        # After each run: the decoding sequences the need detector looked at, and the largest
        # share of attention any of their dropped blocks would have taken.
        self.probed: list[Sequence] = []
        self.probed_mass: list[float] = []
        # per probed sequence: its indexed dropped blocks, (table index, slot) in probe column
        # order, and the table index of the one whose estimated share was the largest (what a
        # need-replay must bring back)
        self.probed_blocks: list[list[tuple[int, int]]] = []
        self.probed_flagged: list[int | None] = []
        # Plain decode rows go to the compiled CPU kernel where it builds (None: PyTorch path).
        self.decode_kernel = cpu_kernels.decode_attention() if self.device.type == "cpu" else None
        # bf16 prompt chunks over resident earlier positions go to the compiled causal kernel
        # where it builds and is the faster (else SDPA).
        self.prefill_kernel = cpu_kernels.prefill_attention() \
            if self.device.type == "cpu" and model.dtype == torch.bfloat16 else None
        # Plain decode steps on a GPU replay CUDA graphs (kvreplay/engine/cuda_graphs.py).
        self.graphs = DecodeGraphs(model, kv.kv_caches, kv.block_size) \
            if self.device.type == "cuda" and cuda_graphs_enabled() else None

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        block_size = self.kv.block_size
        return table[positions // block_size] * block_size + positions % block_size

    def run(self, batch: ScheduledBatch, greedy: bool = False) -> tuple[torch.Tensor, list[Sequence]]:
        """Compute K/V for every scheduled token. Returns logits [S, V] for the sequences whose
        known tokens are all computed after this step (they sample), and those sequences; with
        `greedy`, their argmax tokens [S] instead (the LM head keeps no logits)."""
        block_size = self.kv.block_size
        input_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slots: list[torch.Tensor] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0), prefill_kernel=self.prefill_kernel)
        self.probed, self.probed_mass, self.probed_blocks, self.probed_flagged = [], [], [], []
        self.last_hot_reads = 0

        if batch.decodes:
            # Decode attends to resident blocks only, in any order: keys carry their positions
            # (RoPE is applied before caching), so dropped blocks simply leave the list.
            tables = [self.kv.resident_blocks(seq.seq_id) for seq in batch.decodes]
            width = max(len(t) for t in tables)
            # plain lists, one tensor each: per-row tensors cost ~1 ms a step at batch 32
            flat, lengths, decode_positions, decode_slots = [], [], [], []
            for row, (seq, table) in enumerate(zip(batch.decodes, tables)):
                flat += table
                flat += [0] * (width - len(table))
                position = seq.num_computed_tokens
                # The block being written is the table's last, always hot (never middle).
                assert self.kv.num_slots(seq.seq_id) == position + 1, "decode slot not allocated"
                lengths.append((len(table) - 1) * block_size + position % block_size + 1)
                input_ids.append(seq.token_ids[position])
                decode_positions.append(position)
                decode_slots.append(table[-1] * block_size + position % block_size)
                logit_rows.append(row)
                sampled.append(seq)
            meta.num_decode_tokens = len(tables)
            cfg = self.model.config
            self.last_hot_reads = sum(map(len, tables)) * cfg.num_layers * cfg.num_kv_heads
            if self.detect_need:
                meta.probe = self._probe(batch.decodes)
            if self.kv.cold_pool is not None:
                meta.cold = self._cold(batch.decodes)
            meta.observe_decode = self.observe_importance
            if self.graphs is not None and not (batch.prefills or batch.replays or batch.layers) \
                    and meta.probe is None and meta.cold is None and not meta.observe_decode:
                logits = self.graphs.run(input_ids, decode_positions, decode_slots, lengths, tables)
                if logits is not None:  # else capturing failed: the eager step below
                    self.last_cold = None
                    return (greedy_tokens(logits) if greedy else logits), sampled
            padded = torch.tensor(flat, dtype=torch.long).view(len(tables), width)
            context = torch.tensor(lengths, dtype=torch.long)
            positions.append(torch.tensor(decode_positions, dtype=torch.long))
            slots.append(torch.tensor(decode_slots, dtype=torch.long))
            meta.decode_block_tables = padded.to(self.device)
            meta.decode_context = context.to(self.device)
            if self.decode_kernel is not None and meta.cold is None:
                meta.decode_kernel = self.decode_kernel
            else:  # the PyTorch path needs every row padded to the widest table, masked
                meta.decode_padding = decode_padding(context, width * block_size, cfg.num_kv_heads).to(self.device)
        self.last_cold = meta.cold
        observed = []  # (sequence, table indices of its gathered blocks, prefill slice)

        chunks = [(seq, seq.num_computed_tokens, chunk, True) for seq, chunk in batch.prefills]
        chunks += [(r.seq, r.start, r.num_tokens, False) for r in batch.replays]
        for seq, start, chunk, may_sample in chunks:
            end = start + chunk
            row = len(input_ids)
            input_ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            full_table = torch.tensor(self.kv.block_table(seq.seq_id), dtype=torch.long)
            slots.append(self._slots(full_table, start, end))
            piece = self._prefill_slice(full_table, start, end, row)
            meta.prefills.append(piece)
            if may_sample and end == seq.num_tokens:
                logit_rows.append(row + chunk - 1)
                sampled.append(seq)
                if self.observe_importance:  # a prompt's last queries: what it will ask about
                    piece.observe = OBSERVED_QUERIES
                    gathered = full_table[:-(-end // block_size)]
                    observed.append((seq, (gathered != DROPPED).nonzero().flatten(), piece))

        if input_ids:
            meta.slot_mapping = torch.cat(slots).to(self.device)
            logits = self.model.forward(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.cat(positions).to(self.device), self.kv.kv_caches, meta,
                torch.tensor(logit_rows, dtype=torch.long, device=self.device), greedy=greedy)
            if meta.probe is not None and meta.probe.max_mass is not None:
                self.probed_mass = meta.probe.max_mass.tolist()
                self.probed_flagged = [blocks[column][0] if column < len(blocks) else None for blocks, column
                                       in zip(self.probed_blocks, meta.probe.flagged.tolist())]
            self._record_importance(batch.decodes, meta, observed)
        else:
            logits = torch.empty((0,) if greedy else (0, self.model.config.vocab_size),
                                 dtype=torch.long if greedy else torch.float32, device=self.device)
        finished = []
        for seq, layers in batch.layers:
            last = self._run_layers(seq, layers)
            if last is not None:
                finished.append(greedy_tokens(last) if greedy else last)
                sampled.append(seq)
        if finished:
            logits = torch.cat([logits] + finished)
        return logits, sampled

    def _run_layers(self, seq: Sequence, layers: range) -> torch.Tensor | None:
        """Layers `layers` of `seq`'s layered prefill, each over the whole range [start, end)
        in passes of `layered_chunk_tokens` rows (the token chunks of a normal prefill, so
        the same K/V come out). One layer's K/V of every position up to `end` sit in a
        scratch cache whose block i stands for table index i; the KV manager keeps what the
        table keeps. Returns the last token's logits [1, V] after the last layer, else None."""
        state, kv = seq.layered, self.kv
        with torch.inference_mode():
            self._layers(seq, state, layers)
        if state.next_layer < len(kv.kv_caches):
            return None
        if state.mass is not None:  # every block up to `end`, dropped ones included
            kv.importance.observe(seq.seq_id, list(range(len(state.mass))), state.mass)
        with torch.inference_mode():
            logits = self.model.logits(state.hidden[-1:].contiguous(), None)
        state.hidden = state.mass = None
        return logits

    def _layers(self, seq: Sequence, state: LayeredPrefill, layers: range) -> None:
        model, kv = self.model, self.kv
        block_size = kv.block_size
        start, end = state.start, state.end
        if state.hidden is None:
            state.hidden = model.embed(torch.tensor(seq.token_ids[start:end], device=self.device))
        first, num_blocks = start // block_size, -(-end // block_size)
        resident = torch.tensor(kv.block_table(seq.seq_id)[:first], dtype=torch.long, device=self.device)
        passes = []
        for lo in range(start, end, self.layered_chunk_tokens):
            hi = min(end, lo + self.layered_chunk_tokens)
            meta = AttentionMetadata(slot_mapping=torch.arange(lo, hi, device=self.device),
                                     prefill_kernel=self.prefill_kernel)
            if lo == 0:  # the pass's own K/V suffice
                piece = PrefillSlice(0, hi - lo, hi, None, None, causal_from=0)
            else:
                mask = torch.arange(hi)[None, :] <= torch.arange(lo, hi)[:, None]
                piece = PrefillSlice(0, hi - lo, hi, torch.arange(-(-hi // block_size), device=self.device),
                                     mask.to(self.device), causal_from=lo)
            meta.prefills.append(piece)
            cos, sin = model.rope(torch.arange(lo, hi, device=self.device))
            passes.append((slice(lo - start, hi - start), meta, cos, sin))
        if self.observe_importance:  # the prompt's last queries, as a chunked prefill observes
            piece.observe = OBSERVED_QUERIES
        cache = kv.kv_caches[0]
        for layer in layers:
            scratch = cache.new_empty(2, cache.shape[1], num_blocks, block_size, cache.shape[-1])
            if first:
                scratch[:, :, :first] = kv.kv_caches[layer].index_select(2, resident)
            for rows, meta, cos, sin in passes:
                delta, residual = model.layer(layer, state.hidden[rows], None, cos, sin, scratch, meta)
                state.hidden[rows] = residual + delta  # rounded as the next norm's add would
            kv.write_layer(seq.seq_id, layer, scratch, state.new_blocks)
        if piece.mass is not None:  # summed over this call's layers
            state.mass = piece.mass if state.mass is None else state.mass + piece.mass
        state.next_layer = layers.stop

    def _record_importance(self, decodes: list[Sequence], meta: AttentionMetadata,
                           observed: list[tuple[Sequence, torch.Tensor, PrefillSlice]]) -> None:
        """Hand the block mass the attention observed to the KV manager's importance store."""
        importance = self.kv.importance
        for seq, indices, piece in observed:
            if piece.mass is not None:
                importance.observe(seq.seq_id, indices, piece.mass[:len(indices)])
        if meta.decode_mass is None:
            return
        hot_mass = meta.decode_mass.cpu()
        cold_mass = None if meta.cold_mass is None else meta.cold_mass.cpu()
        for row, seq in enumerate(decodes):
            # hot_mass columns follow resident_blocks(): the table's non-dropped entries
            hot = [index for index, block in enumerate(self.kv.block_table(seq.seq_id)) if block != DROPPED]
            importance.observe(seq.seq_id, hot, hot_mass[row, :len(hot)])
            if cold_mass is not None:
                cold = torch.tensor(self.kv.cold_blocks(seq.seq_id), dtype=torch.long)
                importance.observe(seq.seq_id, cold, cold_mass[row, :len(cold)])

    def _prefill_slice(self, full_table: torch.Tensor, start: int, end: int, row: int) -> PrefillSlice:
        """Attention of positions [start, end) to everything before them that is resident.
        Dropped blocks (approximate prefill) leave the gathered keys; the mask compares the
        remaining keys' true positions with each query's."""
        block_size = self.kv.block_size
        needed = full_table[:-(-end // block_size)]
        if start == 0:  # nothing cached before: the chunk's own K/V suffice
            return PrefillSlice(row, row + end - start, end, needed.to(self.device), None, causal_from=0)
        resident = (needed != DROPPED).nonzero().flatten()  # [R] table indices
        if len(resident) == len(needed):
            mask = torch.arange(end)[None, :] <= torch.arange(start, end)[:, None]
            return PrefillSlice(row, row + end - start, end, needed.to(self.device), mask.to(self.device),
                                causal_from=start)
        key_positions = (resident[:, None] * block_size + torch.arange(block_size)).flatten()
        mask = key_positions[None, :] <= torch.arange(start, end)[:, None]  # [chunk, R*bs]
        return PrefillSlice(row, row + end - start, len(key_positions), needed[resident].to(self.device),
                            mask.to(self.device))

    def _padded(self, slot_lists: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """[R, N] slot table padded with slot 0, and [R, N] validity (one tensor from plain
        lists: a tensor per row cost ~20 us each)."""
        width = max(len(s) for s in slot_lists)
        flat = []
        for slots in slot_lists:
            flat += slots
            flat += [0] * (width - len(slots))
        table = torch.tensor(flat, dtype=torch.long).view(len(slot_lists), width)
        lengths = torch.tensor([len(s) for s in slot_lists], dtype=torch.long)
        valid = torch.arange(width)[None, :] < lengths[:, None]
        return table.to(self.device), valid.to(self.device)

    def _cold(self, decodes: list[Sequence]) -> ColdAttention | None:
        slot_lists = [self.kv.cold_slots(seq.seq_id) for seq in decodes]
        if not any(slot_lists):
            return None
        table, valid = self._padded(slot_lists)
        return ColdAttention(table, valid, self.kv.cold_pool, self.sparse_budget_blocks, self.dense_layers)

    def _probe(self, decodes: list[Sequence]) -> NeedProbe | None:
        rows, slot_lists = [], []
        for row, seq in enumerate(decodes):
            entries = self.kv.indexed_blocks(seq.seq_id)
            if entries:
                rows.append(row)
                slot_lists.append([slot for _, slot in entries])
                self.probed.append(seq)
                self.probed_blocks.append(entries)
        if not rows:
            return None
        slot_table, valid = self._padded(slot_lists)
        return NeedProbe(torch.tensor(rows, device=self.device), slot_table, valid,
                         self.kv.key_index, self.need_top_blocks, layers=self.need_layers)
