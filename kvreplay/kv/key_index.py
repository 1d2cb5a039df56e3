"""The key index of docs/architecture.md §4: int4 keys of dropped blocks, and the need detector that reads them.

Values are not kept. Per slot (one dropped block), layer and KV head the index holds the block's
keys as 4-bit codes with a per-channel min and max; min/max are also the block's Quest summary.
For SmolLM2-135M (3 KV heads x 64 dims, 16-token blocks) a slot is 2,304 bytes per layer against
12,288 for the block's bf16 K and V: 19%. Only the detector reads the index, so it keeps only the
layers the detector reads (`need_layers`): with 4 of 30 layers a dropped block costs 2.5% of its
K and V instead of 19%.

Need detection (docs/architecture.md §5 trigger 2): at a decode step, per layer and KV head, the Quest bound ranks
the sequence's dropped blocks; the top few are dequantized and scored against the step's queries.
A block's estimated share of the head's attention is exp(lse_block - lse_total), where the total
covers the resident keys and those top blocks only: leaving the other dropped blocks out can only
raise the estimate, so the detector errs towards replaying.
"""
from __future__ import annotations

import torch

from kvreplay.kernels import cpu_kernels
from kvreplay.kv.quant import KeyCodes, block_upper_bound, dequantize_keys_int4, quantize_keys_int4


class KeyIndex:
    """A slot pool of int4 keys, grown by doubling. The KV manager is its only writer."""

    def __init__(self, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                 device: torch.device | str = "cpu", initial_slots: int = 16,
                 layers: frozenset[int] | None = None):
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.block_size, self.head_dim = block_size, head_dim
        self.device = torch.device(device)
        # The model layers kept (None: all); stored row i holds layer self.layers[i].
        self.layers = list(range(num_layers)) if layers is None else sorted(layers)
        if not self.layers or self.layers[0] < 0 or self.layers[-1] >= num_layers:
            raise ValueError(f"key-index layers {self.layers} must be non-empty and within 0..{num_layers - 1}")
        self._row = {layer: row for row, layer in enumerate(self.layers)}
        self._kept = None if layers is None else torch.tensor(self.layers, device=self.device)
        stored = len(self.layers)
        self.codes = torch.zeros(stored, num_kv_heads, 0, block_size, head_dim // 2,
                                 dtype=torch.uint8, device=self.device)  # [L, Hkv, S, bs, D/2]
        self.lo = torch.zeros(stored, num_kv_heads, 0, head_dim, dtype=torch.float16,
                              device=self.device)                       # [L kept, Hkv, S, D]
        self.hi = torch.zeros_like(self.lo)
        self._free: list[int] = []
        self._grow(initial_slots)
        self.trace: list | None = None
        # The detector's compiled form on CPU (csrc/decode_attention.cpp), None: PyTorch below.
        self.kernel = cpu_kernels.need_block_mass() if self.device.type == "cpu" else None
        # The Triton kernels (kernels/triton_backend.kernels()) when the engine's attention_backend
        # takes them: the Quest bound and the blocks' scores of the PyTorch path below run there.
        self.triton = None
        self.slot_bytes = self.bytes_per_slot(stored, num_kv_heads, block_size, head_dim)

    @staticmethod
    def bytes_per_slot(num_layers: int, num_kv_heads: int, block_size: int, head_dim: int) -> int:
        """A dropped block's index bytes: per kept layer and KV head, block_size * D / 2 code
        bytes and 2 * D fp16 summary values."""
        return num_layers * num_kv_heads * (block_size * head_dim // 2 + 4 * head_dim)

    @property
    def capacity(self) -> int:
        return self.codes.shape[2]

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    def _grow(self, extra: int) -> None:
        start = self.capacity
        self.codes = torch.cat([self.codes, self.codes.new_zeros(
            *self.codes.shape[:2], extra, *self.codes.shape[3:])], dim=2)
        self.lo = torch.cat([self.lo, self.lo.new_zeros(*self.lo.shape[:2], extra, self.head_dim)], dim=2)
        self.hi = torch.cat([self.hi, self.hi.new_zeros(*self.hi.shape[:2], extra, self.head_dim)], dim=2)
        self._free.extend(range(start + extra - 1, start - 1, -1))  # pop() hands out low slots first

    def add(self, keys: torch.Tensor, layers: tuple[int, ...] | None = None) -> list[int]:
        """keys: [L, Hkv, n, block_size, D] of n blocks, row i of model layer layers[i] (None:
        every model layer; a hybrid pool's cold tier holds its global layers). Returns their n slots."""
        if layers is not None:
            keys = keys.index_select(0, torch.tensor([layers.index(layer) for layer in self.layers],
                                                     device=keys.device))
        elif self._kept is not None:
            keys = keys.index_select(0, self._kept)
        num_blocks = keys.shape[2]
        slots = self.allocate(num_blocks)
        codes = quantize_keys_int4(keys)  # packed [L, Hkv, n, bs, D/2], lo/hi [L, Hkv, n, 1, D]
        index = torch.tensor(slots, device=self.device)
        self.codes.index_copy_(2, index, codes.packed)
        self.lo.index_copy_(2, index, codes.lo.squeeze(3))
        self.hi.index_copy_(2, index, codes.hi.squeeze(3))
        return slots

    def allocate(self, num_blocks: int) -> list[int]:
        """`num_blocks` slots whose keys `write_layer` fills one layer at a time (a prompt
        computed layer by layer: its dropped blocks never have every layer's K/V at once)."""
        if num_blocks > len(self._free):
            self._grow(max(self.capacity, num_blocks))
        return [self._free.pop() for _ in range(num_blocks)]

    def write_layer(self, layer: int, slots: list[int], keys: torch.Tensor) -> None:
        """keys: [Hkv, n, block_size, D] of model layer `layer` for `slots` (ignored when the
        index does not keep that layer). Same codes as `add` would store."""
        row = self._row.get(layer)
        if row is None or not slots:
            return
        codes = quantize_keys_int4(keys)  # packed [Hkv, n, bs, D/2], lo/hi [Hkv, n, 1, D]
        index = torch.tensor(slots, device=self.device)
        self.codes[row].index_copy_(1, index, codes.packed)
        self.lo[row].index_copy_(1, index, codes.lo.squeeze(2))
        self.hi[row].index_copy_(1, index, codes.hi.squeeze(2))

    def remove(self, slots: list[int]) -> None:
        self._free.extend(slots)

    def keys(self, slots: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantized keys [L kept, Hkv, n, block_size, D] of `slots` (rows follow self.layers)."""
        index = torch.tensor(slots, device=self.device)
        return dequantize_keys_int4(KeyCodes(self.codes.index_select(2, index),
                                             self.lo.index_select(2, index).unsqueeze(3),
                                             self.hi.index_select(2, index).unsqueeze(3)), dtype)

    def max_block_mass(self, layer: int, query: torch.Tensor, slot_table: torch.Tensor,
                       valid: torch.Tensor, resident_lse: torch.Tensor, top_blocks: int
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """Largest estimated attention share any dropped block takes in any head, per sequence,
        and which block takes it.

        Args:
            layer: the layer whose keys to read.
            query: [R, Hkv, G, D] the step's scaled queries, G query heads per KV head.
            slot_table: [R, N] index slots of each sequence's dropped blocks, padded.
            valid: [R, N] False on padding.
            resident_lse: [R, Hkv, G] log-sum-exp of the query's logits over resident keys.
            top_blocks: blocks per KV head dequantized and scored, chosen by the Quest bound.
        Returns:
            [R] float32 in [0, 1], and [R] int64: the column of `slot_table` holding the block
            with that share.
        """
        if layer not in self._row:
            raise ValueError(f"layer {layer} is not kept by this key index (layers {self.layers})")
        layer = self._row[layer]
        rows, num_slots = slot_table.shape
        num_kv, head_dim = self.num_kv_heads, self.head_dim
        query = query.float()
        if self.kernel is not None and self.triton is None and self.trace is None:
            return self.kernel(query, self.codes[layer], self.lo[layer], self.hi[layer], slot_table,
                               valid, resident_lse.float(), top_blocks)
        gpu = self.triton
        if gpu is not None:  # the Quest bound read through the slot table in place
            bound = gpu.quest_bound(query, self.lo[layer], self.hi[layer], slot_table, valid)
        else:
            flat = slot_table.flatten()
            lo = self.lo[layer].index_select(1, flat).view(num_kv, rows, num_slots, head_dim).transpose(0, 1)
            hi = self.hi[layer].index_select(1, flat).view(num_kv, rows, num_slots, head_dim).transpose(0, 1)
            bound = block_upper_bound(query, lo.float(), hi.float()).amax(2)  # [R, Hkv, N]
            bound.masked_fill_(~valid[:, None, :], float("-inf"))
        k = min(top_blocks, num_slots)
        top = bound.topk(k, dim=-1).indices                                # [R, Hkv, k]
        top_valid = valid.gather(1, top.view(rows, -1)).view(rows, num_kv, k)
        slots = slot_table.gather(1, top.view(rows, -1)).view(rows, num_kv, k)
        if gpu is not None:  # int4 keys dequantized in registers
            block_lse = gpu.need_block_lse(query, self.codes[layer], self.lo[layer], self.hi[layer], slots)
        else:
            heads = torch.arange(num_kv, device=slots.device)[None, :, None]
            codes = KeyCodes(self.codes[layer][heads, slots],            # [R, Hkv, k, bs, D/2]
                             self.lo[layer][heads, slots].unsqueeze(3),  # [R, Hkv, k, 1, D]
                             self.hi[layer][heads, slots].unsqueeze(3))
            keys = dequantize_keys_int4(codes).view(rows, num_kv, k * self.block_size, head_dim)
            scores = query @ keys.transpose(-1, -2)                            # [R, Hkv, G, k*bs]
            block_lse = scores.view(*scores.shape[:3], k, self.block_size).logsumexp(-1)  # [R, Hkv, G, k]
        block_lse.masked_fill_(~top_valid[:, :, None, :], float("-inf"))
        total = torch.logaddexp(resident_lse.float(), block_lse.logsumexp(-1))  # [R, Hkv, G]
        mass = (block_lse - total[..., None]).exp()                          # [R, Hkv, G, k]
        share, where = mass.amax(2).flatten(1).max(1)  # over heads and blocks: [R], flat (Hkv, k)
        column = top.view(rows, -1).gather(1, where[:, None]).squeeze(1)
        if self.trace is not None:  # research hook (bench/need_probe.py): per-head statistics
            within = (block_lse - block_lse.logsumexp(-1, keepdim=True)).exp().amax(-1)  # [R, Hkv, G]
            dropped = 1 - (resident_lse.float() - total).exp()                            # [R, Hkv, G]
            self.trace.append((layer, within.cpu(), dropped.cpu(), mass.amax(-1).cpu()))
        return share, column
