"""Layered prefill's forward pass: a prompt range computed one decoder layer at a time over its
whole length (`layered_prefill`), so the middle it is about to drop never holds K/V for every
layer at once. The scheduler hands out layers; the KV manager keeps what the table keeps."""
from __future__ import annotations

import torch

from kvreplay.engine.sequence import LayeredPrefill, Sequence
from kvreplay.kv import KVManager
from kvreplay.kv.importance import OBSERVED_QUERIES
from kvreplay.layers.attention import AttentionMetadata, PrefillSlice
from kvreplay.models.llama import LlamaModel


def layered_work_bytes(model_config, block_size: int, dtype: torch.dtype, kv_bytes_per_token: int,
                       start: int, end: int) -> int:
    """Working bytes of a layered prefill of positions [start, end): the residual stream of its
    tokens and one layer's K/V of every position before `end` (the scratch cache)."""
    dtype_bytes = torch.finfo(dtype).bits // 8
    scratch = -(-end // block_size) * block_size * kv_bytes_per_token // model_config.num_layers
    return (end - start) * model_config.hidden_size * dtype_bytes + scratch


class LayeredPass:
    def __init__(self, model: LlamaModel, kv: KVManager, chunk_tokens: int, prefill_kernel,
                 observe_importance: bool, restart_importance: bool = False):
        self.model = model
        self.kv = kv
        self.device = model.device
        self.chunk_tokens = chunk_tokens  # rows per pass (a normal prefill's chunk: the same K/V)
        self.prefill_kernel = prefill_kernel
        self.observe_importance = observe_importance
        self.restart_importance = restart_importance

    def run(self, seq: Sequence, layers: range) -> torch.Tensor | None:
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
            kv.importance.observe(seq.seq_id, list(range(len(state.mass))), state.mass,
                                  restart=self.restart_importance)
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
        for lo in range(start, end, self.chunk_tokens):
            hi = min(end, lo + self.chunk_tokens)
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

