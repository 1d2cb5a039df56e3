"""The session tier below the pool: computed blocks kept in host memory, then in files, so that a
returning chat, a shared document or a resumed or replaying sequence can read its K/V back
instead of recomputing it (docs/architecture.md §4, "Session tier").

Owned by the KV manager (it alone puts and takes blocks; kv/tier_io.py moves the bytes between
the pool and the tier). Entries are keyed by a block's chained prefix-cache hash and re-checked
against its tokens, as the prefix cache does. Each hash sits in exactly one place:

    pool LRU --evict--> memory (LRU, kv_tier_memory bytes) --spill--> disk (LRU, kv_tier_disk
                                                                       bytes) --evict--> gone

With no memory budget blocks go straight to disk; with no disk tier a block spilled from memory
is gone. Disk writes are synchronous, on the engine thread: a block is a few hundred KiB that
lands in the page cache (tens of microseconds to ~1 ms), and writing in place keeps the tier's
bookkeeping exact at every step (a background writer would need a pending state that loads and
integrity checks must wait on). A loaded block is the same bits as the one that left: memory
entries are private copies, disk payloads are verified against their blake2b checksum.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from kvreplay.kv import tier_files
from kvreplay.validate import parse_bytes

logger = logging.getLogger(__name__)


TIER_CHOICES = ("cost", "load", "recompute")


def check_tier_dir(value) -> None:
    """kv_tier_dir's check at configuration time (the tier itself creates and probes it)."""
    if value is not None and os.path.exists(value) and not os.path.isdir(value):
        raise ValueError(f"kv_tier_dir={value!r} is a file, not a directory: name a directory "
                         "(it is created if missing)")


def parse_budget(name: str, value: int | str | None) -> int:
    """A tier's byte budget: 0 (or None) means off; otherwise bytes or a size like '2GiB'."""
    if value is None or value == 0 or (isinstance(value, str) and value.strip() in ("0", "")):
        return 0
    try:
        size = parse_bytes(value)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{name}={value!r}: {error}; use 0 for off or a size like '2GiB'") from None
    if size < 0:
        raise ValueError(f"{name}={value!r} is negative: use 0 for off or a size like '2GiB'")
    return size


@dataclass
class _DiskEntry:
    path: Path
    file_bytes: int


class SessionTier:
    """Host memory and disk LRUs of block K/V, each under its byte budget.

    Args:
        stamp: the version stamp (model identity, block size, dtype, layers, KV heads, head
            dim); files with another stamp are ignored.
        shape: one block's K/V, [layers, 2, kv_heads, block_size, head_dim].
        dtype: the pool's dtype (the payload's).
        memory_bytes, disk_bytes: budgets (0: that tier is off).
        directory: where the disk tier keeps its per-user directory (None: no disk tier).
    """

    def __init__(self, stamp: dict, shape: tuple[int, ...], dtype: torch.dtype, memory_bytes: int = 0,
                 disk_bytes: int = 0, directory: str | os.PathLike | None = None):
        if memory_bytes < 0 or disk_bytes < 0:
            raise ValueError("tier budgets must be 0 (off) or positive byte counts")
        self.stamp, self.shape, self.dtype = dict(stamp), tuple(shape), dtype
        self.block_bytes = torch.Size(shape).numel() * torch.finfo(dtype).bits // 8
        self.memory_budget = memory_bytes
        self.disk_budget = disk_bytes if directory is not None else 0
        self.directory = tier_files.prepare_dir(directory) if directory is not None and disk_bytes else None
        self._digest = tier_files.stamp_digest(self.stamp)
        self.memory: OrderedDict[int, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self.disk: OrderedDict[int, _DiskEntry] = OrderedDict()
        self.memory_used = 0
        self.disk_used = 0
        self.stats = dict(puts=0, hits=0, misses=0, loads=0, load_bytes=0, spills=0,
                          discarded=0, corrupted=0, ignored=0, disk_writes=0)
        if self.directory is not None:
            self._scan()

    @property
    def enabled(self) -> bool:
        return bool(self.memory_budget or self.directory)

    # ------------------------------------------------------------------ queries
    def where(self, block_hash: int) -> str | None:
        """'memory', 'disk' or None: where the block with `block_hash` is kept."""
        if block_hash in self.memory:
            return "memory"
        return "disk" if block_hash in self.disk else None

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.memory or block_hash in self.disk

    def __len__(self) -> int:
        return len(self.memory) + len(self.disk)

    # ------------------------------------------------------------------ mutations
    def put(self, block_hash: int, tokens: tuple[int, ...], data: torch.Tensor) -> None:
        """Keep one block's K/V ([layers, 2, kv_heads, block_size, head_dim], copied) under
        `block_hash`. A hash already kept is only refreshed (its bits are the same block's)."""
        assert tuple(data.shape) == self.shape, f"tier block shape {tuple(data.shape)}, expected {self.shape}"
        if block_hash in self.memory:
            self.memory.move_to_end(block_hash)
            return
        if block_hash in self.disk:
            self.disk.move_to_end(block_hash)
            return
        self.stats["puts"] += 1
        copy = data.to("cpu", copy=True).contiguous()
        if self.memory_budget >= self.block_bytes:
            self.memory[block_hash] = (tuple(tokens), copy)
            self.memory_used += self.block_bytes
            while self.memory_used > self.memory_budget:
                old_hash, (old_tokens, old_data) = self.memory.popitem(last=False)
                self.memory_used -= self.block_bytes
                self._to_disk(old_hash, old_tokens, old_data)
        else:
            self._to_disk(block_hash, tuple(tokens), copy)

    def get(self, block_hash: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        """The K/V kept under `block_hash` if its tokens match, else None. A disk payload that
        fails its checksum (or a torn file) is deleted, counted and never returned."""
        if block_hash in self.memory:
            kept_tokens, data = self.memory[block_hash]
            if kept_tokens == tuple(tokens):
                self.memory.move_to_end(block_hash)
                self._count_load()
                return data
        elif block_hash in self.disk:
            data = self._read(block_hash, tuple(tokens))
            if data is not None:
                self._count_load()
                return data
        self.stats["misses"] += 1
        return None

    def discard(self, block_hash: int) -> None:
        """Forget a block (a load that failed its fingerprint: its bits are not the ones that left)."""
        if block_hash in self.memory:
            del self.memory[block_hash]
            self.memory_used -= self.block_bytes
        elif block_hash in self.disk:
            self._delete(block_hash)

    def _count_load(self) -> None:
        self.stats["hits"] += 1
        self.stats["loads"] += 1
        self.stats["load_bytes"] += self.block_bytes

    # ------------------------------------------------------------------ disk
    def _to_disk(self, block_hash: int, tokens: tuple[int, ...], data: torch.Tensor) -> None:
        if self.directory is None:
            self.stats["discarded"] += 1
            return
        path = self.directory / tier_files.file_name(self._digest, block_hash)
        header = dict(stamp=self.stamp, hash=block_hash, tokens=list(tokens), shape=list(self.shape))
        payload = memoryview(data.view(torch.uint8).numpy()).cast("B")  # [bytes] of the contiguous copy
        try:
            size = tier_files.write_block(path, header, payload)
        except OSError as error:
            logger.warning("session tier: cannot write %s (%s); the block is dropped", path, error)
            self.stats["discarded"] += 1
            return
        self.stats["spills"] += 1
        self.stats["disk_writes"] += 1
        self.disk[block_hash] = _DiskEntry(path, size)
        self.disk_used += size
        while self.disk_used > self.disk_budget:
            self._delete(next(iter(self.disk)))
            self.stats["discarded"] += 1

    def _read(self, block_hash: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        entry = self.disk[block_hash]
        found = tier_files.read_header(entry.path)
        if found is None or found[0].get("stamp") != self.stamp or found[0].get("hash") != block_hash:
            self._corrupted(block_hash, "torn or unreadable")
            return None
        header, offset = found
        if tuple(header["tokens"]) != tokens:
            return None  # a hash collision: another block's file, kept for its own tokens
        payload = tier_files.read_payload(entry.path, header, offset)
        if payload is None:
            self._corrupted(block_hash, "checksum mismatch")
            return None
        self.disk.move_to_end(block_hash)
        return torch.frombuffer(payload, dtype=torch.uint8).view(self.dtype).reshape(self.shape)

    def _corrupted(self, block_hash: int, why: str) -> None:
        logger.warning("session tier: %s is %s; deleted, the block will be recomputed",
                       self.disk[block_hash].path, why)
        self.stats["corrupted"] += 1
        self._delete(block_hash)

    def _delete(self, block_hash: int) -> None:
        entry = self.disk.pop(block_hash)
        self.disk_used -= entry.file_bytes
        tier_files.remove(entry.path)

    def _scan(self) -> None:
        """Rebuild the disk index from the directory (a restart): this stamp's whole files, oldest
        first; torn ones are deleted; another stamp's files are left alone."""
        found = []
        for path in self.directory.glob(f"*{tier_files.SUFFIX}"):
            if not path.name.startswith(self._digest + "-"):
                self.stats["ignored"] += 1
                continue
            header = tier_files.read_header(path)
            if header is None:
                self.stats["corrupted"] += 1
                tier_files.remove(path)
                continue
            if header[0].get("stamp") != self.stamp or tuple(header[0].get("shape", ())) != self.shape:
                self.stats["ignored"] += 1
                continue
            found.append((path.stat().st_mtime, int(header[0]["hash"]), path))
        for _, block_hash, path in sorted(found):
            entry = _DiskEntry(path, path.stat().st_size)
            self.disk[block_hash] = entry
            self.disk_used += entry.file_bytes
        while self.disk_used > self.disk_budget:
            self._delete(next(iter(self.disk)))

    def snapshot(self) -> dict:
        """Bytes per tier and the counters, for /metrics."""
        return dict(self.stats, memory_bytes=self.memory_used, disk_bytes=self.disk_used)

    # ------------------------------------------------------------------ rates and checks
    def probe_seconds_per_byte(self) -> dict[str, float]:
        """A small startup probe of each tier's read cost (seconds per byte, per-file overhead
        included): a copy of a few blocks from host memory, and a written-then-read block file."""
        rates = {}
        sample = torch.zeros(self.shape, dtype=self.dtype)
        started = time.perf_counter()
        for _ in range(4):
            sample.clone()
        rates["memory"] = max(time.perf_counter() - started, 1e-9) / (4 * self.block_bytes)
        if self.directory is not None:
            path = self.directory / f".probe-{os.getpid()}{tier_files.SUFFIX}.tmp"
            payload = memoryview(sample.view(torch.uint8).numpy()).cast("B")
            tier_files.write_block(path, dict(stamp={}, hash=0, tokens=[], shape=[]), payload)
            started = time.perf_counter()
            header, offset = tier_files.read_header(path)
            tier_files.read_payload(path, header, offset)
            rates["disk"] = max(time.perf_counter() - started, 1e-9) / self.block_bytes
            tier_files.remove(path)
        return rates

    def check_integrity(self) -> None:
        """Bytes counted equal the entries' sum, budgets hold, no hash in both tiers, every disk
        entry has its file, memory entries have the block's shape and dtype."""
        assert self.memory_used == len(self.memory) * self.block_bytes, "tier memory bytes miscounted"
        assert self.memory_used <= self.memory_budget, "tier memory over its budget"
        assert self.disk_used == sum(e.file_bytes for e in self.disk.values()), "tier disk bytes miscounted"
        assert self.disk_used <= self.disk_budget, "tier disk over its budget"
        assert not set(self.memory) & set(self.disk), "a block both in tier memory and on disk"
        assert self.directory is not None or not self.disk, "disk entries without a disk tier"
        for block_hash, entry in self.disk.items():
            assert entry.path.is_file(), f"tier block {block_hash:x}: file {entry.path} missing"
        for block_hash, (tokens, data) in self.memory.items():
            assert tuple(data.shape) == self.shape and data.dtype == self.dtype, \
                f"tier block {block_hash:x} has shape {tuple(data.shape)} {data.dtype}"
            assert len(tokens) == self.shape[3], f"tier block {block_hash:x} holds {len(tokens)} tokens"
