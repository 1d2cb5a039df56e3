"""Turns a scheduled batch into flat tensors and attention metadata, runs the model."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from kvreplay.engine.cuda_graphs import DecodeGraphs, cuda_graphs_enabled
from kvreplay.engine.layered_pass import LayeredPass
from kvreplay.engine.local_meta import local_group_metas
from kvreplay.engine.replay import NeedOutcome
from kvreplay.engine.scheduler import ScheduledBatch
from kvreplay.engine.sequence import Sequence
from kvreplay.kernels import cpu_kernels, triton_backend
from kvreplay.kv import KVManager
from kvreplay.kv.importance import OBSERVED_QUERIES
from kvreplay.kv.manager import DROPPED
from kvreplay.layers.attention import (AttentionMetadata, ColdAttention, NeedProbe, PrefillSlice,
                                       decode_padding)
from kvreplay.layers.selection import HotSelection
from kvreplay.models.llama import LlamaModel
from kvreplay.sampling import greedy_tokens


@dataclass
class StepResult:
    """What one model run hands back to the engine."""
    sampled: list[Sequence]             # the sequences whose rows `logits` holds
    logits: torch.Tensor | None = None  # [S, V], or [S] token ids when run greedy
    needs: list[NeedOutcome] = field(default_factory=list)  # the need detector, per probed sequence
    cold: ColdAttention | None = None   # the cold tier's reads (sparse selection, dequant time)
    hot_reads: int = 0                  # hot blocks decode attention read (per layer and KV head)


@dataclass
class _Rows:
    """The flat rows of one forward pass, built up by decodes then chunks."""
    input_ids: list[int] = field(default_factory=list)
    positions: list[torch.Tensor] = field(default_factory=list)
    slots: list[torch.Tensor] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    sampled: list[Sequence] = field(default_factory=list)
    spans: list[tuple[Sequence, int, int]] = field(default_factory=list)  # chunks: (seq, start, end)


class ModelRunner:
    def __init__(self, model: LlamaModel, kv: KVManager, detect_need: bool = False,
                 need_top_blocks: int = 8, sparse_budget: int | None = None, dense_layers: int = 0,
                 need_layers: frozenset[int] | None = None, observe_importance: bool = False,
                 restart_importance: bool = False,
                 layered_chunk_tokens: int = 512,
                 select_hot: Callable[[Sequence], tuple[range, int] | None] | None = None,
                 use_triton: bool = False):
        self.model = model
        self.kv = kv
        self.device = model.device
        self.detect_need = detect_need
        self.need_top_blocks = need_top_blocks
        self.need_layers = need_layers
        self.sparse_budget_blocks = None if sparse_budget is None else sparse_budget // kv.block_size
        self.dense_layers = dense_layers
        self.observe_importance = observe_importance  # feed kv.importance (policies that trim)
        self.restart_importance = restart_importance  # a prompt's last queries replace earlier scores
        # quest: a decoding sequence's middle blocks and how many each KV head reads (None: all)
        self.select_hot = select_hot
        # attention_backend=triton: the Triton kernels (kernels/triton_backend.py) take decode
        # attention, plain causal prompt chunks and the cold tier's Quest bound.
        self.triton = triton_backend.kernels() if use_triton else None
        # Plain decode rows go to the Triton kernel, else the compiled CPU kernel where it builds
        # (None: PyTorch path).
        self.decode_kernel = self.triton.decode_attention if self.triton is not None else \
            cpu_kernels.decode_attention() if self.device.type == "cpu" else None
        # bf16 prompt chunks over resident earlier positions go to the compiled causal kernel
        # where it builds and is the faster (else SDPA).
        self.prefill_kernel = cpu_kernels.prefill_attention() \
            if self.device.type == "cpu" and model.dtype == torch.bfloat16 else None
        self.layered = LayeredPass(model, kv, layered_chunk_tokens, self.prefill_kernel, observe_importance,
                                   restart_importance)
        # Plain decode steps on a GPU replay CUDA graphs (kvreplay/engine/cuda_graphs.py);
        # not over a hybrid pool, whose local layers read other tables.
        self.graphs = DecodeGraphs(model, kv.kv_caches, kv.block_size,
                                   decode_kernel=None if self.triton is None else self.decode_kernel) \
            if self.device.type == "cuda" and cuda_graphs_enabled() and not kv.local.num_groups else None

    def _slots(self, table: torch.Tensor, start: int, end: int) -> torch.Tensor:
        positions = torch.arange(start, end)
        block_size = self.kv.block_size
        return table[positions // block_size] * block_size + positions % block_size

    def run(self, batch: ScheduledBatch, greedy: bool = False) -> StepResult:
        """Compute K/V for every scheduled token. The result holds logits [S, V] for the
        sequences whose known tokens are all computed after this step (they sample), and those
        sequences; with `greedy`, their argmax tokens [S] instead (the LM head keeps no logits)."""
        rows = _Rows()
        meta = AttentionMetadata(slot_mapping=torch.empty(0), prefill_kernel=self.prefill_kernel,
                                 paged_prefill=None if self.triton is None else self.triton.prefill_attention)
        result = StepResult(rows.sampled)
        probed: list[tuple[Sequence, list[tuple[int, int]]]] = []
        if batch.decodes:
            logits = self._add_decodes(batch, rows, meta, result, probed)
            if logits is not None:  # a CUDA graph ran the whole step
                result.logits = greedy_tokens(logits) if greedy else logits
                return result
        result.cold = meta.cold
        observed = self._add_chunks(batch, rows, meta)
        if rows.input_ids:
            meta.slot_mapping = torch.cat(rows.slots).to(self.device)
            if self.kv.local.num_groups:  # a hybrid pool: local layers read their groups' pages
                meta.layer_groups = self.kv.layer_groups
                meta.local_groups = local_group_metas(self.kv, meta, batch.decodes if meta.num_decode_tokens else [],
                                                      rows.spans)
            logits = self.model.forward(
                torch.tensor(rows.input_ids, dtype=torch.long, device=self.device),
                torch.cat(rows.positions).to(self.device), self.kv.kv_caches, meta,
                torch.tensor(rows.logit_rows, dtype=torch.long, device=self.device), greedy=greedy)
            if meta.probe is not None and meta.probe.max_mass is not None:
                for (seq, blocks), mass, column in zip(probed, meta.probe.max_mass.tolist(),
                                                       meta.probe.flagged.tolist()):
                    result.needs.append(NeedOutcome(seq, mass, blocks[column][0] if column < len(blocks) else None))
            self._record_importance(batch.decodes, meta, observed)
        else:
            logits = torch.empty((0,) if greedy else (0, self.model.config.vocab_size),
                                 dtype=torch.long if greedy else torch.float32, device=self.device)
        finished = []
        for seq, layers in batch.layers:
            last = self.layered.run(seq, layers)
            if last is not None:
                finished.append(greedy_tokens(last) if greedy else last)
                rows.sampled.append(seq)
        result.logits = torch.cat([logits] + finished) if finished else logits
        return result

    def _add_decodes(self, batch: ScheduledBatch, rows: "_Rows", meta: AttentionMetadata,
                     result: StepResult, probed: list) -> torch.Tensor | None:
        """One row per decoding sequence, attending to its resident blocks in any order (keys
        carry their positions: RoPE is applied before caching, so dropped blocks simply leave
        the list). Returns the logits when a CUDA graph ran the whole step, else None."""
        block_size = self.kv.block_size
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
            rows.input_ids.append(seq.token_ids[position])
            decode_positions.append(position)
            decode_slots.append(table[-1] * block_size + position % block_size)
            rows.logit_rows.append(row)
            rows.sampled.append(seq)
        meta.num_decode_tokens = len(tables)
        cfg = self.model.config
        # the layers that read these tables: every one, or a hybrid pool's global ones (its storages)
        result.hot_reads = sum(map(len, tables)) * len(self.kv.storages) * cfg.num_kv_heads
        if self.detect_need:
            meta.probe = self._probe(batch.decodes, probed)
        if self.kv.cold_pool is not None:
            meta.cold = self._cold(batch.decodes)
        meta.observe_decode = self.observe_importance
        if self.select_hot is not None:
            meta.hot_selection = self._hot_selection(batch.decodes, width)
        if self.graphs is not None and not (batch.prefills or batch.replays or batch.layers) \
                and meta.probe is None and meta.cold is None and not meta.observe_decode \
                and meta.hot_selection is None:
            logits = self.graphs.run(rows.input_ids, decode_positions, decode_slots, lengths, tables)
            if logits is not None:  # else capturing failed: the eager step
                return logits
        padded = torch.tensor(flat, dtype=torch.long).view(len(tables), width)
        context = torch.tensor(lengths, dtype=torch.long)
        rows.positions.append(torch.tensor(decode_positions, dtype=torch.long))
        rows.slots.append(torch.tensor(decode_slots, dtype=torch.long))
        meta.decode_block_tables = padded.to(self.device)
        meta.decode_context = context.to(self.device)
        if self.decode_kernel is not None and meta.cold is None and meta.hot_selection is None:
            meta.decode_kernel = self.decode_kernel
        else:  # the PyTorch path needs every row padded to the widest table, masked
            meta.decode_padding = decode_padding(context, width * block_size, cfg.num_kv_heads).to(self.device)
        return None

    def _add_chunks(self, batch: ScheduledBatch, rows: "_Rows", meta: AttentionMetadata) -> list:
        """Rows of prefill and replay chunks. Returns (sequence, table indices of its gathered
        blocks, prefill slice) for each prompt whose last queries are observed for importance."""
        block_size = self.kv.block_size
        observed = []
        chunks = [(seq, seq.num_computed_tokens, chunk, True) for seq, chunk in batch.prefills]
        chunks += [(r.seq, r.start, r.num_tokens, False) for r in batch.replays]
        for seq, start, chunk, may_sample in chunks:
            end = start + chunk
            row = len(rows.input_ids)
            rows.input_ids.extend(seq.token_ids[start:end])
            rows.positions.append(torch.arange(start, end))
            rows.spans.append((seq, start, end))
            full_table = torch.tensor(self.kv.block_table(seq.seq_id), dtype=torch.long)
            rows.slots.append(self._slots(full_table, start, end))
            piece = self._prefill_slice(full_table, start, end, row)
            meta.prefills.append(piece)
            if may_sample and end == seq.num_tokens:
                rows.logit_rows.append(row + chunk - 1)
                rows.sampled.append(seq)
                if self.observe_importance:  # a prompt's last queries: what it will ask about
                    piece.observe = OBSERVED_QUERIES
                    gathered = full_table[:-(-end // block_size)]
                    observed.append((seq, (gathered != DROPPED).nonzero().flatten(), piece))
        return observed

    def _record_importance(self, decodes: list[Sequence], meta: AttentionMetadata,
                           observed: list[tuple[Sequence, torch.Tensor, PrefillSlice]]) -> None:
        """Hand the block mass the attention observed to the KV manager's importance store."""
        importance = self.kv.importance
        for seq, indices, piece in observed:
            if piece.mass is not None:
                importance.observe(seq.seq_id, indices, piece.mass[:len(indices)],
                                   restart=self.restart_importance)
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

    def _hot_selection(self, decodes: list[Sequence], width: int) -> HotSelection | None:
        """Quest's choice for this step's decode rows (columns are table indices: nothing is
        dropped under quest); None when every row reads all its blocks."""
        picks = [self.select_hot(seq) for seq in decodes]
        if all(pick is None for pick in picks):
            return None
        candidates = torch.zeros(len(decodes), width, dtype=torch.bool)
        keep = torch.zeros(len(decodes), dtype=torch.long)
        for row, (seq, pick) in enumerate(zip(decodes, picks)):
            if pick is not None:
                assert not self.kv.dropped_blocks(seq.seq_id), "quest selects among hot blocks only"
                middle, keep[row] = pick
                candidates[row, middle.start:middle.stop] = True
        return HotSelection(candidates.to(self.device), keep.to(self.device))

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
        return ColdAttention(table, valid, self.kv.cold_pool, self.sparse_budget_blocks, self.dense_layers,
                             triton=self.triton)

    def _probe(self, decodes: list[Sequence], probed: list) -> NeedProbe | None:
        """The need detector's probe over the decoding sequences that have indexed dropped
        blocks; `probed` receives (sequence, its (table index, slot) entries in column order)."""
        rows, slot_lists = [], []
        for row, seq in enumerate(decodes):
            entries = self.kv.indexed_blocks(seq.seq_id)
            if seq.replay.cleared:  # cut after a replay that read them: not probed (engine/replay.py)
                entries = [entry for entry in entries if entry[0] not in seq.replay.cleared]
            if entries:
                rows.append(row)
                slot_lists.append([slot for _, slot in entries])
                probed.append((seq, entries))
        if not rows:
            return None
        slot_table, valid = self._padded(slot_lists)
        return NeedProbe(torch.tensor(rows, device=self.device), slot_table, valid,
                         self.kv.key_index, self.need_top_blocks, layers=self.need_layers,
                         order=self.kv.local.global_layers)
