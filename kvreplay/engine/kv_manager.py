"""The KV manager: the only owner of KV blocks, block tables and reference counts.

Everyone else asks (`can_allocate`, `block_table`) and then acts through it (`allocate`, `free`).
The cache tensors live here too; the model reads and writes rows of them through the slot mapping
the runner derives from our block tables.
"""
from __future__ import annotations

from collections import deque

import torch


class KVManager:
    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        assert num_blocks > 0 and block_size > 0, "a pool needs at least one block"
        self.num_blocks = num_blocks
        self.block_size = block_size
        # One tensor per layer: [2 (K, V), num_kv_heads, num_blocks, block_size, head_dim].
        # Heads outermost: gathering a batch's blocks yields [Hkv, B, L, D], which batched
        # matmuls take as it is (no per-layer copy to a head-major layout).
        self.kv_caches = [torch.zeros(2, num_kv_heads, num_blocks, block_size, head_dim,
                                      dtype=dtype, device=device) for _ in range(num_layers)]
        self._free: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self._tables: dict[int, list[int]] = {}
        self._num_slots: dict[int, int] = {}  # tokens each sequence has room for (allocated)
        self.peak_used_blocks = 0

    # ------------------------------------------------------------------ queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_blocks_needed(self, seq_id: int, num_new_tokens: int) -> int:
        have = len(self._tables.get(seq_id, ()))
        total = self._num_slots.get(seq_id, 0) + num_new_tokens
        return max(0, -(-total // self.block_size) - have)

    def can_allocate(self, seq_id: int, num_new_tokens: int) -> bool:
        return self.num_blocks_needed(seq_id, num_new_tokens) <= len(self._free)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._tables.get(seq_id, ()))

    def num_slots(self, seq_id: int) -> int:
        return self._num_slots.get(seq_id, 0)

    # ------------------------------------------------------------------ mutations
    def allocate(self, seq_id: int, num_new_tokens: int) -> bool:
        """Make room for `num_new_tokens` more tokens of `seq_id`. Returns False (and changes
        nothing) when the pool cannot."""
        needed = self.num_blocks_needed(seq_id, num_new_tokens)
        if needed > len(self._free):
            return False
        table = self._tables.setdefault(seq_id, [])
        for _ in range(needed):
            block = self._free.popleft()
            assert self._ref_counts[block] == 0, f"free block {block} has references"
            self._ref_counts[block] = 1
            table.append(block)
        self._num_slots[seq_id] = self._num_slots.get(seq_id, 0) + num_new_tokens
        self.peak_used_blocks = max(self.peak_used_blocks, self.num_used_blocks)
        return True

    def free(self, seq_id: int) -> None:
        """Release every block of `seq_id` (finish, abort or preemption)."""
        for block in reversed(self._tables.pop(seq_id, [])):
            self._ref_counts[block] -= 1
            assert self._ref_counts[block] >= 0, f"block {block} freed twice"
            if self._ref_counts[block] == 0:
                self._free.append(block)
        self._num_slots.pop(seq_id, None)

    # ------------------------------------------------------------------ invariants
    def check_integrity(self) -> None:
        """Every block is either free (ref 0) or referenced exactly as often as tables hold it."""
        counted = [0] * self.num_blocks
        for seq_id, table in self._tables.items():
            slots = self._num_slots[seq_id]
            assert len(table) == -(-slots // self.block_size), \
                f"seq {seq_id}: {len(table)} blocks for {slots} slots"
            for block in table:
                counted[block] += 1
        free = set(self._free)
        assert len(free) == len(self._free), "duplicate block in the free list"
        for block in range(self.num_blocks):
            assert counted[block] == self._ref_counts[block], \
                f"block {block}: ref count {self._ref_counts[block]}, tables hold {counted[block]}"
            assert (block in free) == (counted[block] == 0), f"block {block} free-list state is wrong"
        assert len(free) + sum(1 for c in counted if c) == self.num_blocks, "blocks lost"
