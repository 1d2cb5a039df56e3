"""The session tier's background thread (docs/architecture.md §4, "Session tier"): file writes
off the engine thread with exact bookkeeping (pending entries, back-pressure, failed writes),
and prefetch/collect reads. Tiny random K/V, no model."""
from __future__ import annotations

import logging
import random
import threading
import time

import pytest
import torch

from kvreplay.kv import tier_files
from kvreplay.kv.session_tier import SessionTier

BLOCK = 4
LAYERS, HEADS, DIM = 3, 2, 4
STAMP = dict(model="tiny", block_size=BLOCK, dtype="float32", layers=LAYERS, kv_heads=HEADS, head_dim=DIM)
SHAPE = (LAYERS, 2, HEADS, BLOCK, DIM)
BLOCK_BYTES = LAYERS * 2 * HEADS * BLOCK * DIM * 4
WAIT = 10  # seconds: a bound that a passing run never comes near


def _tier(tmp_path, memory_blocks=0, disk_blocks=0, max_pending=64) -> SessionTier:
    # a file is the payload plus a header of ~300 bytes: budget whole files
    return SessionTier(STAMP, SHAPE, torch.float32, memory_blocks * BLOCK_BYTES,
                       disk_blocks * (BLOCK_BYTES + 400), tmp_path, max_pending=max_pending)


def _toks(key: int) -> tuple[int, ...]:
    return (key,) * BLOCK


def _files(tier: SessionTier) -> set:
    return set(tier.directory.iterdir())


def _indexed(tier: SessionTier) -> set:
    return {entry.path for entry in tier.disk.values()}


def _until(condition, what: str) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.001)


class _Gate:
    """A monkeypatched tier_files function that waits for `release()` (calls for `only`'s block
    only, when given), so a test holds the background thread at a known point."""

    def __init__(self, monkeypatch, name: str, only=None):
        self.real = getattr(tier_files, name)
        self.open, self.entered, self.only = threading.Event(), threading.Event(), only
        monkeypatch.setattr(tier_files, name, self)

    def __call__(self, path, header, *args):
        if self.only is None or header.get("hash") == self.only:
            self.entered.set()
            assert self.open.wait(WAIT), "the gate was never opened"
        return self.real(path, header, *args)

    def release(self) -> None:
        self.open.set()


@pytest.fixture
def gates(monkeypatch):
    made = []

    def make(name: str, only=None) -> _Gate:
        made.append(_Gate(monkeypatch, name, only))
        return made[-1]

    yield make
    for gate in made:  # never leave the worker thread waiting, whatever the test did
        gate.release()


# ---------------------------------------------------------------------- writes
def test_pending_blocks_serve_their_bits_and_land_after_flush(tmp_path, gates):
    gate = gates("write_block")
    tier = _tier(tmp_path, memory_blocks=1, disk_blocks=8)
    data = {i: torch.randn(SHAPE) for i in range(5)}
    for i, block in data.items():
        tier.put(i, _toks(i), block)
        tier.check_integrity()
    assert list(tier.memory) == [4] and list(tier.disk) == [0, 1, 2, 3]
    assert tier.snapshot()["pending_writes"] == 4 and not list(tier.directory.glob("*.kvt"))
    assert tier.disk_used == sum(tier_files.file_size(dict(stamp=STAMP, hash=i, tokens=list(_toks(i)),
                                                           shape=list(SHAPE)), BLOCK_BYTES) for i in range(4))
    for i, block in data.items():
        assert tier.where(i) == ("memory" if i == 4 else "disk")
        assert torch.equal(tier.get(i, _toks(i)), block)  # the pending copy, bitwise
        assert tier.get(i, _toks(i + 100)) is None         # other tokens: a miss, as on disk
        tier.check_integrity()
    gate.release()
    tier.flush()
    tier.check_integrity()
    assert tier.snapshot()["pending_writes"] == 0 and tier.stats["disk_writes"] == 4
    assert _files(tier) == _indexed(tier)
    for i in range(4):
        entry = tier.disk[i]
        assert entry.path.stat().st_size == entry.file_bytes and not entry.pending
        assert torch.equal(tier.get(i, _toks(i)), data[i])  # now read from the file
        tier.check_integrity()


@pytest.mark.parametrize("flushes", [False, True])
@pytest.mark.parametrize("memory_blocks", [0, 2])
def test_budgets_hold_at_every_step_of_a_random_workload(tmp_path, monkeypatch, flushes, memory_blocks):
    real = tier_files.write_block

    def slowish(path, header, payload):  # writes overlap the engine thread's calls
        time.sleep(0.0005)
        return real(path, header, payload)

    monkeypatch.setattr(tier_files, "write_block", slowish)
    rng = random.Random(7 + flushes + memory_blocks)
    tier = _tier(tmp_path, memory_blocks=memory_blocks, disk_blocks=3, max_pending=2)
    kept, pending_seen = {}, 0
    for step in range(400):
        key, roll = rng.randrange(12), rng.random()
        if roll < 0.5:
            kept.setdefault(key, torch.randn(SHAPE))
            tier.put(key, _toks(key), kept[key])
        elif roll < 0.8:
            got = tier.get(key, _toks(key))
            assert got is None or torch.equal(got, kept[key])
        elif roll < 0.9:
            tier.discard(key)
        else:
            blocks = [(k, _toks(k)) for k in rng.sample(range(12), 4)]
            got = tier.collect(tier.prefetch(blocks))
            assert all(torch.equal(data, kept[k]) for k, data in got.items())
        if flushes and step % 25 == 0:
            tier.flush()
        tier.check_integrity()
        assert tier.disk_used <= tier.disk_budget and tier.memory_used <= tier.memory_budget
        pending_seen = max(pending_seen, tier.snapshot()["pending_writes"])
        assert pending_seen <= 2
    tier.flush()
    tier.check_integrity()
    assert tier.stats["spills"] > 0 and tier.stats["discarded"] > 0
    assert _files(tier) == _indexed(tier)  # no leftovers, no .tmp
    for key in list(tier.disk):
        assert torch.equal(tier.get(key, _toks(key)), kept[key])
    tier.close()


def test_a_failed_write_drops_the_block_and_is_counted(tmp_path, monkeypatch, caplog):
    real = tier_files.write_block

    def failing(path, header, payload):
        if header["hash"] == 5:
            raise OSError(28, "No space left on device")
        return real(path, header, payload)

    monkeypatch.setattr(tier_files, "write_block", failing)
    tier = _tier(tmp_path, disk_blocks=8)
    data = {i: torch.randn(SHAPE) for i in range(7)}
    with caplog.at_level(logging.WARNING, logger="kvreplay.kv.session_tier"):
        for i, block in data.items():
            tier.put(i, _toks(i), block)
            tier.check_integrity()
        tier.flush()
    tier.check_integrity()
    assert 5 not in tier and tier.where(5) is None and tier.get(5, _toks(5)) is None
    assert tier.stats["discarded"] == 1 and tier.stats["disk_writes"] == 6
    assert sum("cannot write" in record.getMessage() for record in caplog.records) == 1
    assert _files(tier) == _indexed(tier) and len(_indexed(tier)) == 6
    assert all(torch.equal(tier.get(i, _toks(i)), data[i]) for i in data if i != 5)


def test_puts_do_not_wait_for_writes_until_max_pending(tmp_path, gates):
    gate = gates("write_block")
    tier = _tier(tmp_path, disk_blocks=8, max_pending=2)
    data = {i: torch.randn(SHAPE) for i in range(3)}
    tier.put(0, _toks(0), data[0])
    assert gate.entered.wait(WAIT)  # the worker holds block 0's write...
    assert tier.where(0) == "disk" and not tier.disk[0].path.exists()  # ...and put has returned
    tier.put(1, _toks(1), data[1])  # two in flight: the limit
    third = threading.Thread(target=tier.put, args=(2, _toks(2), data[2]), daemon=True)
    third.start()
    third.join(0.2)
    assert third.is_alive(), "put went past max_pending writes in flight"
    gate.release()
    third.join(WAIT)
    assert not third.is_alive()
    tier.flush()
    tier.check_integrity()
    assert _files(tier) == _indexed(tier) and set(tier.disk) == {0, 1, 2}
    assert all(torch.equal(tier.get(i, _toks(i)), data[i]) for i in data)


def test_evicting_a_pending_block_leaves_no_file(tmp_path, gates):
    gate = gates("write_block")
    tier = _tier(tmp_path, disk_blocks=2, max_pending=8)
    for i in range(5):  # 0 is being written (held), 1.. queued; the LRU drops 0, 1 and 2
        tier.put(i, _toks(i), torch.randn(SHAPE))
        tier.check_integrity()
    tier.discard(3)
    assert list(tier.disk) == [4] and tier.stats["discarded"] == 3
    gate.release()
    tier.flush()
    tier.check_integrity()
    assert _files(tier) == _indexed(tier) == {tier.disk[4].path}


# ---------------------------------------------------------------------- prefetch and collect
def _filled(tmp_path, memory_blocks=2, disk_blocks=8, count=6):
    tier = _tier(tmp_path, memory_blocks=memory_blocks, disk_blocks=disk_blocks)
    data = {i: torch.randn(SHAPE) for i in range(count)}
    for i, block in data.items():
        tier.put(i, _toks(i), block)
    tier.flush()
    return tier, data


def test_collect_gives_the_bits_get_gives(tmp_path):
    tier, data = _filled(tmp_path)
    assert set(tier.memory) == {4, 5} and set(tier.disk) == {0, 1, 2, 3}
    blocks = [(i, _toks(i)) for i in data] + [(99, _toks(99)), (2, _toks(7))]
    handle = tier.prefetch(blocks)
    hits, misses = tier.stats["hits"], tier.stats["misses"]
    got = tier.collect(handle)
    assert handle.done() and set(got) == set(data)
    assert all(torch.equal(got[i], data[i]) and torch.equal(got[i], tier.get(i, _toks(i))) for i in data)
    assert tier.stats["hits"] == hits + 2 * len(data) and tier.stats["misses"] == misses + 1
    assert tier.stats["load_bytes"] == 2 * len(data) * BLOCK_BYTES
    with pytest.raises(ValueError, match="collected already"):
        tier.collect(handle)
    other = tier.prefetch([(2, _toks(7))])  # same hash, other tokens: absent, the file kept
    assert tier.collect(other) == {} and tier.disk[2].path.exists()
    tier.check_integrity()


def test_a_pending_block_is_collected_from_its_copy(tmp_path, gates):
    gate = gates("write_block")
    tier = _tier(tmp_path, disk_blocks=8)
    block = torch.randn(SHAPE)
    tier.put(0, _toks(0), block)
    handle = tier.prefetch([(0, _toks(0))])
    assert handle.done()  # nothing to read in the background: the copy is taken at collect
    assert torch.equal(tier.collect(handle, wait=False)[0], block)
    gate.release()
    tier.flush()
    tier.check_integrity()


def test_blocks_evicted_or_discarded_before_collect_are_absent(tmp_path):
    tier, data = _filled(tmp_path, memory_blocks=0, disk_blocks=4, count=4)
    handle = tier.prefetch([(i, _toks(i)) for i in data])
    _until(handle.done, "the reads")  # read successfully, then...
    tier.put(10, _toks(10), torch.randn(SHAPE))  # ...0 falls off the LRU
    tier.discard(1)
    tier.discard(2)
    tier.put(2, _toks(2), data[2])  # back, pending: another entry, served from its copy
    got = tier.collect(handle)
    assert set(got) == {2, 3} and all(torch.equal(got[i], data[i]) for i in got)
    assert tier.stats["corrupted"] == 0
    # an eviction while the read may be running: absent either way, never an error
    handle = tier.prefetch([(3, _toks(3)), (10, _toks(10))])
    tier.discard(3)
    got = tier.collect(handle)
    assert 3 not in got and tier.stats["corrupted"] == 0
    tier.flush()
    tier.check_integrity()
    assert _files(tier) == _indexed(tier)


def test_a_corrupted_file_is_absent_deleted_and_counted(tmp_path):
    tier, data = _filled(tmp_path, memory_blocks=0, count=3)
    flipped = tier.disk[1].path
    raw = bytearray(flipped.read_bytes())
    raw[-3] ^= 0x40
    flipped.write_bytes(bytes(raw))
    got = tier.collect(tier.prefetch([(i, _toks(i)) for i in data]))
    assert set(got) == {0, 2} and not flipped.exists() and 1 not in tier
    assert tier.stats["corrupted"] == 1 and tier.stats["misses"] == 1
    tier.check_integrity()


def test_collect_without_waiting_is_none_until_the_reads_finish(tmp_path, gates):
    tier, data = _filled(tmp_path, memory_blocks=0, count=3)
    gate = gates("read_payload")
    handle = tier.prefetch([(i, _toks(i)) for i in data])
    assert gate.entered.wait(WAIT)
    assert not handle.done() and tier.collect(handle, wait=False) is None
    tier.put(7, _toks(7), torch.randn(SHAPE))  # the engine thread goes on meanwhile
    tier.check_integrity()
    gate.release()
    _until(handle.done, "the reads")
    got = tier.collect(handle, wait=False)
    assert set(got) == set(data) and all(torch.equal(got[i], data[i]) for i in data)


# ---------------------------------------------------------------------- restarts
def test_a_restart_after_close_finds_every_block(tmp_path):
    tier = _tier(tmp_path, memory_blocks=0, disk_blocks=8)
    data = {i: torch.randn(SHAPE) for i in range(6)}
    for i, block in data.items():
        tier.put(i, _toks(i), block)
    tier.close()  # flushes: no write is lost
    again = _tier(tmp_path, disk_blocks=8)
    assert list(again.disk) == list(range(6)) and again.disk_used == tier.disk_used
    assert all(torch.equal(again.get(i, _toks(i)), data[i]) for i in data)
    again.check_integrity()
    tier.put(6, _toks(6), torch.randn(SHAPE))  # a closed tier still works: a new thread
    tier.close()
    assert tier.disk[6].path.exists()


def test_a_new_tier_waits_for_writes_still_in_flight(tmp_path, gates):
    gate = gates("write_block")
    tier = _tier(tmp_path, disk_blocks=8)
    for i in range(3):
        tier.put(i, _toks(i), torch.randn(SHAPE))
    made = []
    opener = threading.Thread(target=lambda: made.append(_tier(tmp_path, disk_blocks=8)), daemon=True)
    opener.start()
    opener.join(0.2)
    assert opener.is_alive(), "the scan did not wait for the writes in flight"
    gate.release()
    opener.join(WAIT)
    assert not opener.is_alive() and set(made[0].disk) == {0, 1, 2}
