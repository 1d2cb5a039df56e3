"""The cold tier of docs/architecture.md §4: middle KV blocks kept quantized, dequantized on the fly for attention.

Layout of one slot (one block: K and V of every layer and KV head), following KIVI:

- keys: int8 and int4 per channel over the block's tokens (key outliers sit in a few channels, so a
  per-channel range keeps the other channels precise); fp8 per token (e4m3 keeps its relative
  precision whatever the channel's range, so a per-token scale costs less for the same error).
- values: per token, every kind (int4: per group of 32 channels).
- Quest summaries: per-channel min and max of the original keys, fp16, min rounded down and max up.
  An int4 key's zero point is exactly that rounded-down minimum, so int4 stores it once.

Bytes per layer and KV head for SmolLM2-135M (head_dim 64, 16-token blocks); a slot is 90 of
them (30 layers x 3 KV heads), against 4,096 x 90 = 368,640 bytes for the block's bf16 K and V:

    kind  keys data + params          values data + params       summaries  slot               vs bf16
    int8  1024 + 256 (fp32/channel)   1024 + 64 (fp32/token)     256        2,624 -> 236,160   64.1%
    fp8   1024 + 64  (fp32/token)     1024 + 64 (fp32/token)     256        2,432 -> 218,880   59.4%
    int4   512 + 256 (fp16 scale+min)  512 + 128 (fp16, 32 ch)   128 (max)  1,536 -> 138,240   37.5%

Storage: each field of quant.QTensor gets its own preallocated tensor with a slot dim, e.g. key
data [L, Hkv, S, bs, D or D/2] and per-channel key scales [L, Hkv, S, 1, D], so a gather is one
index op per field and one `dequantize` per side. fp8 data is kept as its raw bytes (uint8): CPU
torch has no index_copy_ for float8_e4m3fn.
"""
from __future__ import annotations

import math

import torch

# quant.py's outward fp16 rounding, so the summaries bound the keys exactly as the key index's do.
from kvreplay.kv.quant import KINDS, QTensor, _half_down, _half_up, dequantize, quantize

KEY_AXIS = {"int8": "channel", "fp8": "token", "int4": "channel"}
VALUE_AXIS = "token"
_SUMMARY_FIELDS = ("summary_lo", "summary_hi")


class ColdPool:
    """A slot pool of quantized KV blocks, grown by doubling. The KV manager is its only writer.

    Every stored tensor is indexed [layer, kv_head, slot, ...]; `stored` maps field names (key_data,
    key_scale, key_zero, value_data, value_scale, value_zero, summary_lo, summary_hi; only those the
    kind needs) to them.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, block_size: int, head_dim: int,
                 kind: str, device: torch.device | str = "cpu", initial_slots: int = 16):
        if kind not in KINDS:
            raise ValueError(f"unknown cold_dtype {kind!r}; choose one of {', '.join(KINDS)}")
        assert initial_slots >= 1, f"initial_slots must be positive, got {initial_slots}"
        self.num_layers, self.num_kv_heads = num_layers, num_kv_heads
        self.block_size, self.head_dim = block_size, head_dim
        self.kind = kind
        self.device = torch.device(device)
        # Encoding an empty batch of blocks gives every field's dtype and per-slot shape from
        # quant.py itself (and raises its ValueError for a head_dim int4 cannot pack or group).
        empty = torch.zeros(num_layers, num_kv_heads, 0, block_size, head_dim, device=self.device)
        self.stored: dict[str, torch.Tensor] = self._encode(empty, empty)
        self._free: list[int] = []
        self._grow(initial_slots)
        self.slot_bytes = sum(math.prod(t.shape[:2]) * math.prod(t.shape[3:]) * t.element_size()
                              for t in self.stored.values())

    @property
    def capacity(self) -> int:
        return self.stored["key_data"].shape[2]

    @property
    def num_used(self) -> int:
        return self.capacity - len(self._free)

    # -----------------------------------------------------------------------------------------
    # Writing

    def _encode(self, keys: torch.Tensor, values: torch.Tensor) -> dict[str, torch.Tensor]:
        """Blocks [L, Hkv, n, bs, D] -> the stored fields of n slots, each [L, Hkv, n, ...]."""
        qk = quantize(keys, self.kind, KEY_AXIS[self.kind])
        qv = quantize(values, self.kind, VALUE_AXIS)
        fields = {"key_data": qk.data, "key_scale": qk.scale, "key_zero": qk.zero,
                  "value_data": qv.data, "value_scale": qv.scale, "value_zero": qv.zero}
        keys32 = keys.float()
        if self.kind != "int4":  # int4's key_zero is this same rounded-down minimum
            fields["summary_lo"] = _half_down(keys32.amin(dim=3))  # [L, Hkv, n, D]
        fields["summary_hi"] = _half_up(keys32.amax(dim=3))        # [L, Hkv, n, D]
        return {name: t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t
                for name, t in fields.items() if t is not None}

    def _grow(self, extra: int) -> None:
        start = self.capacity
        self.stored = {name: torch.cat([t, t.new_zeros(*t.shape[:2], extra, *t.shape[3:])], dim=2)
                       for name, t in self.stored.items()}
        # New slots go under the free ones, so pop() hands out the old free slots, then the new
        # ones lowest first.
        self._free[:0] = range(start + extra - 1, start - 1, -1)

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> list[int]:
        """Quantizes n blocks into free slots, growing the pool when it is short.

        Args:
            keys: [L, Hkv, n, block_size, head_dim], any float dtype.
            values: the same shape.

        Returns:
            The n slots, in block order.

        Raises:
            ValueError: if keys and values are not both [L, Hkv, n, block_size, head_dim].
        """
        expected = (self.num_layers, self.num_kv_heads, self.block_size, self.head_dim)
        if keys.dim() != 5 or keys.shape != values.shape or (*keys.shape[:2], *keys.shape[3:]) != expected:
            raise ValueError(
                f"ColdPool.add takes keys and values of one shape [L, Hkv, n, block_size, head_dim]"
                f" = [{expected[0]}, {expected[1]}, n, {expected[2]}, {expected[3]}]; got keys "
                f"{list(keys.shape)} and values {list(values.shape)}")
        num_blocks = keys.shape[2]
        if num_blocks > len(self._free):
            self._grow(max(self.capacity, num_blocks - len(self._free)))
        slots = [self._free.pop() for _ in range(num_blocks)]
        if not slots:
            return slots
        fields = self._encode(keys.to(self.device), values.to(self.device))
        index = torch.tensor(slots, device=self.device)
        for name, t in self.stored.items():
            t.index_copy_(2, index, fields[name])
        return slots

    def remove(self, slots: list[int]) -> None:
        """Frees `slots`; their contents stay until reused."""
        assert all(0 <= s < self.capacity for s in slots), f"slots {slots} outside [0, {self.capacity})"
        self._free.extend(slots)

    # -----------------------------------------------------------------------------------------
    # Reading

    def summaries(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Quest summaries of every slot of `layer`: (lo, hi), fp16 [Hkv, capacity, D].

        Per-channel min (rounded down) and max (rounded up) of the original keys, so
        quant.block_upper_bound on them bounds every logit. Views: free slots hold stale values,
        and the views miss slots added by a later growth.
        """
        lo = (self.stored["key_zero"][layer].squeeze(2) if self.kind == "int4"
              else self.stored["summary_lo"][layer])
        return lo, self.stored["summary_hi"][layer]

    def _dequantize(self, fields: dict[str, torch.Tensor], dtype: torch.dtype
                    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Gathered fields (any leading dims before the block's own) -> (K, V) in `dtype`."""
        def side(prefix: str, axis: str) -> torch.Tensor:
            data = fields[f"{prefix}_data"]
            if self.kind == "fp8":
                data = data.view(torch.float8_e4m3fn)
            shape = torch.Size((*data.shape[:-1], self.head_dim))
            q = QTensor(data, fields[f"{prefix}_scale"], fields.get(f"{prefix}_zero"),
                        self.kind, axis, shape, dtype)
            return dequantize(q, dtype)
        return side("key", KEY_AXIS[self.kind]), side("value", VALUE_AXIS)

    def _block_fields(self):
        return ((name, t) for name, t in self.stored.items() if name not in _SUMMARY_FIELDS)

    def gather(self, layer: int, slots: torch.Tensor, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of per-head picks: head h of `slots[..., h, :]` reads its own blocks.

        Args:
            layer: the layer to read.
            slots: long [..., Hkv, k], k slots per KV head.
            dtype: the output dtype.

        Returns:
            K, V: [..., Hkv, k, block_size, head_dim] in `dtype`.
        """
        assert slots.shape[-2:-1] == (self.num_kv_heads,), \
            f"gather takes slots [..., Hkv={self.num_kv_heads}, k], got {list(slots.shape)}"
        heads = torch.arange(self.num_kv_heads, device=slots.device).unsqueeze(1)  # [Hkv, 1]
        # [Hkv, S, ...][heads, slots] -> [..., Hkv, k, ...]
        return self._dequantize({name: t[layer][heads, slots] for name, t in self._block_fields()},
                                dtype)

    def gather_all_heads(self, layer: int, slots: torch.Tensor, dtype: torch.dtype
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of the same n slots in every head: [Hkv, n, block_size, D] each."""
        return self._dequantize({name: t[layer].index_select(1, slots)
                                 for name, t in self._block_fields()}, dtype)

    def dequantize_slots(self, slots: list[int], dtype: torch.dtype = torch.float32
                         ) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K and V of `slots` in every layer: [L, Hkv, n, block_size, D] each."""
        index = torch.tensor(slots, dtype=torch.long, device=self.device)
        return self._dequantize({name: t.index_select(2, index) for name, t in self._block_fields()},
                                dtype)

    # -----------------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Asserts the free list is duplicate-free and in range and every field spans capacity."""
        free = set(self._free)
        assert len(free) == len(self._free), "a cold slot was freed twice"
        assert all(0 <= s < self.capacity for s in free), f"free slots outside [0, {self.capacity})"
        for name, t in self.stored.items():
            assert t.shape[:3] == (self.num_layers, self.num_kv_heads, self.capacity), \
                f"cold field {name} has shape {list(t.shape)}, capacity {self.capacity}"
