"""The session tier below the pool: computed blocks kept in host memory, then in files, so that a
returning chat, a shared document or a resumed or replaying sequence can read its K/V back
instead of recomputing it (docs/architecture.md §4, "Session tier").

Owned by the KV manager (it alone puts and takes blocks; kv/tier_io.py moves the bytes between
the pool and the tier). Entries are keyed by a block's chained prefix-cache hash and re-checked
against its tokens, as the prefix cache does. Each hash sits in exactly one place:

    pool LRU --evict--> memory (LRU, kv_tier_memory bytes) --spill--> disk (LRU, kv_tier_disk
                                                                       bytes) --evict--> gone

With no memory budget blocks go straight to disk; with no disk tier a block spilled from memory
is gone. A loaded block is the same bits as the one that left: memory entries are private
copies, disk payloads are verified against their blake2b checksum.

File writes run on one background thread of the tier's (the engine thread waits on one only
under back-pressure); the bookkeeping stays on the engine thread and exact at every step. A spilled block
enters the disk index at once, pending, holding its private copy, its file's exact size counted
against the budget; it is served from that copy until the write is reaped at the next tier call
(a failed write drops it then). At most `max_pending` writes are in flight: beyond that `put`
waits for the oldest, so pending copies stay bounded. Reads can go the same way (`prefetch`,
then `collect`): the thread only reads and verifies files, and every change to the index is
made on the engine thread. One worker keeps the order simple: a read or an unlink queued after
a write sees its file. `flush` waits for the thread, `close` stops it.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict, deque
from concurrent.futures import Future, wait as wait_for
from dataclasses import dataclass
from pathlib import Path

import torch

from kvreplay.kv import tier_files
from kvreplay.kv.tier_files import check_tier_dir  # noqa: F401 - config's check, kept importable here
from kvreplay.validate import parse_bytes

logger = logging.getLogger(__name__)


TIER_CHOICES = ("cost", "load", "recompute")


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


@dataclass(eq=False)
class _DiskEntry:
    path: Path
    file_bytes: int
    tokens: tuple[int, ...] | None = None  # known for blocks put by this process
    data: torch.Tensor | None = None       # the private copy while the write is pending
    future: Future | None = None           # that write

    @property
    def pending(self) -> bool:
        return self.data is not None


@dataclass(eq=False)
class Prefetch:
    """Background reads started by SessionTier.prefetch, collected on the engine thread."""
    blocks: list[tuple[int, tuple[int, ...]]]  # (hash, tokens), each hash once
    _reads: dict[int, tuple[_DiskEntry, Future]]  # hash -> (the entry read, its read)
    collected: bool = False

    def done(self) -> bool:
        """Every background read of this batch has finished."""
        return all(future.done() for _, future in self._reads.values())


class SessionTier:
    """Host memory and disk LRUs of block K/V, each under its byte budget.

    Args:
        stamp: the version stamp (model identity, block size, dtype, layers, KV heads, head
            dim); files with another stamp are ignored.
        shape: one block's K/V, [layers, 2, kv_heads, block_size, head_dim].
        dtype: the pool's dtype (the payload's).
        memory_bytes, disk_bytes: budgets (0: that tier is off).
        directory: where the disk tier keeps its per-user directory (None: no disk tier).
        max_pending: disk writes in flight at most (each holds a block's copy until written).
    """

    def __init__(self, stamp: dict, shape: tuple[int, ...], dtype: torch.dtype, memory_bytes: int = 0,
                 disk_bytes: int = 0, directory: str | os.PathLike | None = None, max_pending: int = 64):
        if memory_bytes < 0 or disk_bytes < 0:
            raise ValueError("tier budgets must be 0 (off) or positive byte counts")
        if max_pending < 1:
            raise ValueError(f"max_pending={max_pending}: at least one write must be allowed in flight")
        self.stamp, self.shape, self.dtype = dict(stamp), tuple(shape), dtype
        self.block_bytes = torch.Size(shape).numel() * torch.finfo(dtype).bits // 8
        self.memory_budget = memory_bytes
        self.disk_budget = disk_bytes if directory is not None else 0
        self.directory = tier_files.prepare_dir(directory) if directory is not None and disk_bytes else None
        self.max_pending = max_pending
        self._digest = tier_files.stamp_digest(self.stamp)
        self.memory: OrderedDict[int, tuple[tuple[int, ...], torch.Tensor]] = OrderedDict()
        self.disk: OrderedDict[int, _DiskEntry] = OrderedDict()
        self.memory_used = self.disk_used = 0
        self.stats = dict(puts=0, hits=0, misses=0, loads=0, load_bytes=0, spills=0,
                          discarded=0, corrupted=0, ignored=0, disk_writes=0)
        self._worker = tier_files.Worker(self.directory) if self.directory is not None else None
        self._writes: deque[tuple[int, _DiskEntry, Future]] = deque()  # in submission order
        if self.directory is not None:
            self._scan()

    @property
    def enabled(self) -> bool:
        return bool(self.memory_budget or self.directory)

    # ------------------------------------------------------------------ queries
    def where(self, block_hash: int) -> str | None:
        """'memory', 'disk' (a pending write included) or None: where the block is kept."""
        self.poll()
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
        self.poll()
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
        self.poll()
        return self._counted(self._take(block_hash, tuple(tokens)))

    def discard(self, block_hash: int) -> None:
        """Forget a block (a load that failed its fingerprint: its bits are not the ones that left)."""
        if block_hash in self.memory:
            del self.memory[block_hash]
            self.memory_used -= self.block_bytes
        elif block_hash in self.disk:
            self._delete(block_hash)

    def _take(self, block_hash: int, tokens: tuple[int, ...]) -> torch.Tensor | None:
        if block_hash in self.memory:
            kept_tokens, data = self.memory[block_hash]
            if kept_tokens != tokens:
                return None
            self.memory.move_to_end(block_hash)
            return data
        entry = self.disk.get(block_hash)
        if entry is None:
            return None
        if entry.pending:  # served from its copy: the same bits the file will hold
            if entry.tokens != tokens:
                return None
            self.disk.move_to_end(block_hash)
            return entry.data
        return self._settle(block_hash, tier_files.read_block(entry.path, self.stamp, block_hash, tokens))

    def _counted(self, data: torch.Tensor | None) -> torch.Tensor | None:
        if data is None:
            self.stats["misses"] += 1
        else:
            self.stats["hits"] += 1
            self.stats["loads"] += 1
            self.stats["load_bytes"] += self.block_bytes
        return data

    # ------------------------------------------------------------------ background reads
    def prefetch(self, blocks: list[tuple[int, tuple[int, ...]]]) -> Prefetch:
        """Start reading the disk-held blocks among `blocks` ((hash, tokens) pairs) in the tier's
        background thread; memory-held (and pending-write) blocks are taken at collect time."""
        self.poll()
        unique: dict[int, tuple[int, ...]] = {}
        for block_hash, tokens in blocks:
            unique.setdefault(int(block_hash), tuple(tokens))
        reads = {}
        for block_hash, tokens in unique.items():
            entry = self.disk.get(block_hash)
            if entry is not None and not entry.pending:  # the path is snapshotted with the entry
                future = self._worker.submit(tier_files.read_block, entry.path, self.stamp, block_hash, tokens)
                reads[block_hash] = (entry, future)
        return Prefetch(list(unique.items()), reads)

    def collect(self, handle: Prefetch, wait: bool = True) -> dict[int, torch.Tensor] | None:
        """On the engine thread: the K/V of each block of `handle` that the tier could supply, keyed
        by hash (those missing, evicted meanwhile, with other tokens, torn or failing their checksum are
        absent; a corrupted file is deleted and counted as `get` does). With wait=False returns None
        while the background reads are not finished. Counts hits/loads/load_bytes/misses as `get` does."""
        if handle.collected:
            raise ValueError("this prefetch was collected already")
        if not wait and not handle.done():
            return None
        wait_for([future for _, future in handle._reads.values()])
        self.poll()
        found = {}
        for block_hash, tokens in handle.blocks:
            read = handle._reads.get(block_hash)
            if read is not None and self.disk.get(block_hash) is read[0]:  # still indexed, same file
                try:
                    result = read[1].result()
                except Exception as error:  # noqa: BLE001 - a failed read is a miss, never a crash
                    logger.warning("session tier: reading %s failed (%s)", read[0].path, error)
                    result = ("failed", None)
                data = self._settle(block_hash, result)
            else:  # memory, a pending write, or the entry changed since: as `get`
                data = self._take(block_hash, tokens)
            if self._counted(data) is not None:
                found[block_hash] = data
        handle.collected, handle._reads = True, {}
        return found

    # ------------------------------------------------------------------ disk
    def _to_disk(self, block_hash: int, tokens: tuple[int, ...], data: torch.Tensor) -> None:
        if self.directory is None:
            self.stats["discarded"] += 1
            return
        while len(self._writes) >= self.max_pending:  # back-pressure: wait for the oldest write
            wait_for([self._writes[0][2]])
            self.poll()
        path = self.directory / tier_files.file_name(self._digest, block_hash)
        header = dict(stamp=self.stamp, hash=block_hash, tokens=list(tokens), shape=list(self.shape))
        entry = _DiskEntry(path, tier_files.file_size(header, self.block_bytes), tuple(tokens), data)
        self.disk[block_hash] = entry
        self.disk_used += entry.file_bytes
        self.stats["spills"] += 1
        self._fit_disk()
        if self.disk.get(block_hash) is entry:  # (not evicted at once: a budget under one file)
            payload = memoryview(data.view(torch.uint8).numpy()).cast("B")  # [bytes] of the contiguous copy
            entry.future = self._worker.submit(tier_files.write_block, path, header, payload)
            self._writes.append((block_hash, entry, entry.future))

    def poll(self) -> None:
        """Reap finished writes, on the engine thread (every tier call does): a written block
        drops its copy, a failed one is dropped from the index, counted and logged."""
        while self._writes and self._writes[0][2].done():
            block_hash, entry, future = self._writes.popleft()
            if self.disk.get(block_hash) is not entry:
                continue  # deleted meanwhile: cancelled, or its file unlinked after the write
            error = future.exception()
            if error is not None:
                logger.warning("session tier: cannot write %s (%s); the block is dropped", entry.path, error)
                self._delete(block_hash)  # (no file: a failed write_block leaves none)
                self.stats["discarded"] += 1
                continue
            entry.data, entry.future = None, None
            self.stats["disk_writes"] += 1
            size = future.result()
            if size != entry.file_bytes:  # not expected: file_size mirrors write_block
                self.disk_used += size - entry.file_bytes
                entry.file_bytes = size
                self._fit_disk()

    def flush(self) -> None:
        """Wait for every background job (writes, unlinks, reads), then reap the writes."""
        if self._worker is not None:
            self._worker.barrier()
        self.poll()

    def close(self) -> None:
        """Finish every background job and stop the thread (shutdown; a later put starts another)."""
        self.flush()
        if self._worker is not None:
            self._worker.close()

    def _fit_disk(self) -> None:
        while self.disk_used > self.disk_budget:
            self._delete(next(iter(self.disk)))
            self.stats["discarded"] += 1

    def _settle(self, block_hash: int, result: tuple[str, bytearray | None]) -> torch.Tensor | None:
        """A read's outcome (tier_files.read_block's) applied to the index, on the engine thread."""
        status, payload = result
        if status in ("torn", "checksum"):
            self._corrupted(block_hash, "torn or unreadable" if status == "torn" else "checksum mismatch")
            return None
        if status != "ok":
            return None  # a hash collision: another block's file, kept for its own tokens
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
        pending, future, entry.data = entry.pending, entry.future, None
        if not pending or (future is not None and future.done()):
            tier_files.remove(entry.path)
        elif future is not None and not future.cancel():  # being written: unlinked right after
            self._worker.submit(tier_files.remove, entry.path)

    def _scan(self) -> None:
        """Rebuild the disk index from the directory (a restart): this stamp's whole files, oldest
        first; torn ones are deleted; another stamp's files are left alone. Writes still in flight
        in this process to the same directory (another tier's) are waited for first."""
        tier_files.Worker.settle(self.directory)
        found, ignored, torn = tier_files.scan(self.directory, self._digest, self.stamp, self.shape)
        self.stats["ignored"] += ignored
        self.stats["corrupted"] += torn
        for block_hash, path, size in found:
            self.disk[block_hash] = _DiskEntry(path, size)
            self.disk_used += size
        while self.disk_used > self.disk_budget:
            self._delete(next(iter(self.disk)))

    def snapshot(self) -> dict:
        """Bytes per tier and the counters, for /metrics."""
        self.poll()
        pending = sum(1 for block_hash, entry, _ in self._writes if self.disk.get(block_hash) is entry)
        return dict(self.stats, memory_bytes=self.memory_used, disk_bytes=self.disk_used, pending_writes=pending)

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
            payload = memoryview(sample.view(torch.uint8).numpy()).cast("B")
            rates["disk"] = max(tier_files.probe_read_seconds(self.directory, payload), 1e-9) / self.block_bytes
        return rates

    def check_integrity(self) -> None:
        """Bytes counted equal the entries' sum, budgets hold, no hash in both tiers, every written
        disk entry has its file and every pending one its copy (of the block's shape and dtype,
        its write in flight), memory entries have the block's shape and dtype."""
        self.poll()
        assert self.memory_used == len(self.memory) * self.block_bytes, "tier memory bytes miscounted"
        assert self.memory_used <= self.memory_budget, "tier memory over its budget"
        assert self.disk_used == sum(e.file_bytes for e in self.disk.values()), "tier disk bytes miscounted"
        assert self.disk_used <= self.disk_budget, "tier disk over its budget"
        assert not set(self.memory) & set(self.disk), "a block both in tier memory and on disk"
        assert self.directory is not None or not self.disk, "disk entries without a disk tier"
        assert len(self._writes) <= self.max_pending, f"{len(self._writes)} tier writes in flight"
        in_flight = {id(entry) for _, entry, _ in self._writes}
        for block_hash, entry in self.disk.items():
            if not entry.pending:
                assert entry.path.is_file(), f"tier block {block_hash:x}: file {entry.path} missing"
                continue
            assert id(entry) in in_flight, f"tier block {block_hash:x} pending without a write"
            assert tuple(entry.data.shape) == self.shape and entry.data.dtype == self.dtype, \
                f"pending tier block {block_hash:x} has shape {tuple(entry.data.shape)} {entry.data.dtype}"
            assert len(entry.tokens) == self.shape[3], f"tier block {block_hash:x} holds {len(entry.tokens)} tokens"
        for block_hash, (tokens, data) in self.memory.items():
            assert tuple(data.shape) == self.shape and data.dtype == self.dtype, \
                f"tier block {block_hash:x} has shape {tuple(data.shape)} {data.dtype}"
            assert len(tokens) == self.shape[3], f"tier block {block_hash:x} holds {len(tokens)} tokens"
