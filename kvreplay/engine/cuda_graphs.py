"""Decode-only steps replayed from CUDA graphs.

On a GPU an eager decode step is bound by the host, not the chip: each layer launches ~45 small
kernels from Python, so a step of this 135M model took 17-28 ms at batch 1 on an H200 whose memory
reads its weights in well under 0.1 ms. A CUDA graph records one step's kernels once and replays
them with one launch: 3.3 ms a step there (docs/benchmarks.md, "GPU").

A graph fixes its tensors' shapes and addresses, so steps are bucketed: rows up to the next power
of two, blocks per row likewise (at least `MIN_BLOCKS`). Each bucket owns static input buffers that
a step fills before the replay:

    rows 0..B-1     the step's own rows (token, position, cache slot, block table, context length)
    rows B..R-1     copies of row 0: they compute and write exactly the values row 0 writes, into
                    row 0's slot, so the cache is as if they were not there
    blocks past a row's table    block 0, masked out like the eager path's padding

Only plain decode steps take this path: no prefill chunk, need probe, cold tier or importance
observation in the step (those run eagerly, as on the CPU).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvreplay.layers.attention import AttentionMetadata, decode_padding
from kvreplay.kernels.switches import switch

log = logging.getLogger(__name__)

MIN_BLOCKS = 8  # the smallest table width a graph is captured for (blocks per row)


def cuda_graphs_enabled() -> bool:
    """KVREPLAY_CUDA_GRAPHS=0 runs every GPU decode step eagerly (for comparisons and
    debugging); 1 or unset: plain decode steps replay CUDA graphs."""
    return switch("KVREPLAY_CUDA_GRAPHS")


def bucket(n: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least)."""
    return 1 << (max(n, least) - 1).bit_length()


@dataclass
class _Bucket:
    rows: int
    blocks: int
    inputs: torch.Tensor  # [4 * rows + rows * blocks] int64: ids, positions, slots, lengths, tables
    logits: torch.Tensor | None = None  # [rows, vocab] written by each replay
    graph: "torch.cuda.CUDAGraph | None" = None


class DecodeGraphs:
    """The captured decode steps of one model and KV cache, one per (rows, blocks) bucket.

    capture=False runs the same padded step without capturing it (how the CPU tests check the
    padding: the same tokens as the eager step)."""

    def __init__(self, model, kv_caches: list[torch.Tensor], block_size: int, capture: bool = True,
                 decode_kernel=None):
        self.model = model
        self.decode_kernel = decode_kernel  # the Triton decode attention (attention_backend), else None
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.capture = capture
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = None  # one memory pool shared by every bucket's graph (made at the first capture)
        self.failed: str | None = None  # why capturing was given up (then every step runs eagerly)
        self.replays = 0

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], lengths: list[int],
            tables: list[list[int]]) -> torch.Tensor | None:
        """Logits [B, vocab] of a plain decode step (one row per sequence: its next token, its
        position, the cache slot its K/V go to, the tokens it attends to, its resident blocks);
        None when the step must run eagerly instead (capturing failed once)."""
        if self.failed is not None:
            return None
        rows = len(input_ids)
        key = (bucket(rows), bucket(max(map(len, tables)), MIN_BLOCKS))
        entry = self.buckets.get(key)
        fresh = entry is None
        if fresh:
            entry = _Bucket(*key, torch.empty(4 * key[0] + key[0] * key[1], dtype=torch.long,
                                              device=self.model.device))
        self._fill(entry, input_ids, positions, slots, lengths, tables)
        if not self.capture:
            self.buckets[key] = entry
            return self._step(entry)[:rows]
        if fresh:
            try:
                self._capture(entry)
            except Exception as exc:  # noqa: BLE001 - any failure leaves the eager path, which works
                self.failed = f"{type(exc).__name__}: {exc}"
                log.warning("CUDA graph capture failed; decode steps run eagerly from now on: %s", self.failed)
                return None
            self.buckets[key] = entry
        entry.graph.replay()
        self.replays += 1
        return entry.logits[:rows].clone()

    def _fill(self, entry: _Bucket, input_ids, positions, slots, lengths, tables) -> None:
        """One host-to-device copy of the step's inputs, padded to the bucket."""
        rows, width = entry.rows, entry.blocks
        pad = rows - len(input_ids)
        flat = (input_ids + input_ids[:1] * pad) + (positions + positions[:1] * pad) \
            + (slots + slots[:1] * pad) + (lengths + lengths[:1] * pad)
        for table in tables + tables[:1] * pad:
            flat += table
            flat += [0] * (width - len(table))
        entry.inputs.copy_(torch.tensor(flat, dtype=torch.long))

    def _step(self, entry: _Bucket) -> torch.Tensor:
        """The padded step on the bucket's buffers: device work only (what a graph records)."""
        rows, width = entry.rows, entry.blocks
        ids, positions, slots, lengths = entry.inputs[:4 * rows].view(4, rows)
        tables = entry.inputs[4 * rows:].view(rows, width)
        padding = None if self.decode_kernel is not None else \
            decode_padding(lengths, width * self.block_size, self.model.config.num_kv_heads)
        meta = AttentionMetadata(slot_mapping=slots, num_decode_tokens=rows, decode_block_tables=tables,
                                 decode_context=lengths, decode_padding=padding, decode_kernel=self.decode_kernel)
        return self.model.forward(ids, positions, self.kv_caches, meta, None)

    def _capture(self, entry: _Bucket) -> None:
        """Warm up on a side stream (cuBLAS picks its kernels, the allocator its blocks), then
        record. The warm-up computes this very step and writes the values the replay writes."""
        if self.model.device.type != "cuda":  # a CPU model's ops would run once, not be recorded
            raise RuntimeError(f"CUDA graphs need a model on a CUDA device, not {self.model.device}")
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._step(entry)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            entry.logits = self._step(entry)
        entry.graph = graph
