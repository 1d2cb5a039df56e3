"""The session tier (issue 37; docs/architecture.md §4): host memory and disk LRUs of block K/V
below the pool, loads chosen against recompute. Tiny pools with random K/V first, then the real
model in fp32 for exact tokens."""
from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

from kvreplay.kv.manager import DROPPED, KVManager
from kvreplay.kv.session_tier import SessionTier, parse_budget
from kvreplay.kv import tier_files

BLOCK = 4
LAYERS, HEADS, DIM = 3, 2, 4
STAMP = dict(model="tiny", block_size=BLOCK, dtype="float32", layers=LAYERS, kv_heads=HEADS, head_dim=DIM)
SHAPE = (LAYERS, 2, HEADS, BLOCK, DIM)
BLOCK_BYTES = LAYERS * 2 * HEADS * BLOCK * DIM * 4


def _tier(tmp_path=None, memory_blocks=0, disk_blocks=0, stamp=STAMP) -> SessionTier:
    # a file is the payload plus a header of ~300 bytes: budget whole files
    return SessionTier(stamp, SHAPE, torch.float32, memory_blocks * BLOCK_BYTES,
                       disk_blocks * (BLOCK_BYTES + 400), tmp_path)


def _kv(tier: SessionTier | None, num_blocks: int = 8) -> KVManager:
    kv = KVManager(num_blocks, BLOCK, LAYERS, HEADS, DIM, torch.float32)
    for cache in kv.kv_caches:
        cache.copy_(torch.randn_like(cache))
    if tier is not None:
        kv.attach_tier(tier)
    return kv


def _compute(kv: KVManager, seq_id: int, tokens: list[int], pinned: int = 0) -> None:
    """Allocate and 'compute' `tokens` (random K/V written into the fresh blocks)."""
    kv.add_sequence(seq_id, pinned)
    assert kv.allocate(seq_id, len(tokens))
    for block in kv.block_table(seq_id):
        for cache in kv.kv_caches:
            cache[:, :, block] = torch.randn_like(cache[:, :, block])
    kv.commit(seq_id, tokens, len(tokens))


def _blocks(kv: KVManager, seq_id: int) -> list[torch.Tensor]:
    return [torch.stack([c[:, :, b] for c in kv.kv_caches]).clone() for b in kv.block_table(seq_id)]


# ---------------------------------------------------------------------- the tier alone
def test_bad_arguments_are_clear_value_errors(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    with pytest.raises(ValueError, match="is a file, not a directory"):
        _tier(a_file, disk_blocks=4)
    with pytest.raises(ValueError, match="cannot be written"):
        _tier("/proc/kvreplay-tier-test", disk_blocks=4)
    with pytest.raises(ValueError, match="use 0 for off"):
        parse_budget("kv_tier_memory", "lots")
    with pytest.raises(ValueError, match="use 0 for off"):
        parse_budget("kv_tier_disk", -5)
    assert parse_budget("kv_tier_memory", "0") == 0 and parse_budget("kv_tier_memory", "1KiB") == 1024
    from kvreplay.config import EngineConfig
    with pytest.raises(ValueError, match="kv_tier_memory"):
        EngineConfig(kv_tier_memory="lots")
    with pytest.raises(ValueError, match="kv_tier_dir"):
        EngineConfig(kv_tier_dir=str(a_file))
    with pytest.raises(ValueError, match="kv_tier_choice"):
        EngineConfig(kv_tier_choice="sometimes")


def test_files_are_private_and_spill_in_lru_order(tmp_path):
    tier = _tier(tmp_path, memory_blocks=2, disk_blocks=2)
    assert oct(tier.directory.stat().st_mode & 0o777) == "0o700"
    data = [torch.randn(SHAPE) for _ in range(5)]
    for i, block in enumerate(data):
        tier.put(i, (i,) * BLOCK, block)
        tier.check_integrity()
    # memory holds the newest two, disk the two before, block 0 fell off the end
    assert list(tier.memory) == [3, 4] and list(tier.disk) == [1, 2] and 0 not in tier
    tier.flush()  # (files are written in the tier's background thread)
    for entry in tier.disk.values():
        assert oct(entry.path.stat().st_mode & 0o777) == "0o600"
    for i in range(1, 5):
        assert torch.equal(tier.get(i, (i,) * BLOCK), data[i])  # bitwise, memory and disk
    assert tier.get(1, (9,) * BLOCK) is None  # same hash, other tokens: a miss
    assert not list(tier.directory.glob("*.tmp"))


def test_budgets_hold_under_a_random_workload(tmp_path):
    rng = random.Random(3)
    tier = _tier(tmp_path, memory_blocks=3, disk_blocks=5)
    kept = {}
    for step in range(300):
        key = rng.randrange(20)
        if rng.random() < 0.6:
            kept.setdefault(key, torch.randn(SHAPE))
            tier.put(key, (key,) * BLOCK, kept[key])
        else:
            got = tier.get(key, (key,) * BLOCK)
            assert got is None or torch.equal(got, kept[key])
        tier.check_integrity()
        assert tier.memory_used <= 3 * BLOCK_BYTES and tier.disk_used <= tier.disk_budget
    assert tier.stats["spills"] > 0 and tier.stats["discarded"] > 0


def test_restart_reads_the_disk_tier_back_and_ignores_other_stamps(tmp_path):
    tier = _tier(tmp_path, disk_blocks=8)
    data = {i: torch.randn(SHAPE) for i in range(3)}
    for i, block in data.items():
        tier.put(i, (i,) * BLOCK, block)
    again = _tier(tmp_path, disk_blocks=8)
    assert set(again.disk) == {0, 1, 2} and again.disk_used == tier.disk_used
    assert all(torch.equal(again.get(i, (i,) * BLOCK), data[i]) for i in data)
    for other in (dict(STAMP, model="other"), dict(STAMP, block_size=8)):
        shape = SHAPE if other["block_size"] == BLOCK else SHAPE[:3] + (8, DIM)
        stranger = SessionTier(other, shape, torch.float32, 0, 10**6, tmp_path)
        assert not stranger.disk and stranger.stats["ignored"] == 3
        assert len(list(tier.directory.glob("*.kvt"))) == 3  # left alone


def test_torn_and_corrupted_files_are_discarded(tmp_path):
    tier = _tier(tmp_path, disk_blocks=8)
    for i in range(3):
        tier.put(i, (i,) * BLOCK, torch.randn(SHAPE))
    tier.flush()
    torn, flipped = tier.disk[0].path, tier.disk[1].path
    torn.write_bytes(torn.read_bytes()[:-7])
    raw = bytearray(flipped.read_bytes())
    raw[-5] ^= 0x10
    flipped.write_bytes(bytes(raw))
    assert tier.get(1, (1,) * BLOCK) is None and not flipped.exists()  # checksum
    assert tier.stats["corrupted"] == 1
    tier.check_integrity()
    again = _tier(tmp_path, disk_blocks=8)  # a restart finds the torn one by its length
    assert set(again.disk) == {2} and again.stats["corrupted"] == 1 and not torn.exists()
    assert tier.get(0, (0,) * BLOCK) is None and tier.stats["corrupted"] == 2


def test_a_killed_writers_temporaries_are_deleted_at_restart_and_never_loaded(tmp_path):
    """kill -9 in the middle of write_block leaves `<file>.<pid>.tmp` (or the cost probe's file):
    the next start deletes those of processes that no longer run, and leaves a live writer's."""
    tier = _tier(tmp_path, disk_blocks=8)
    tier.put(0, (0,) * BLOCK, torch.randn(SHAPE))
    tier.flush()
    whole = tier.disk[0].path
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    dead_pid = int(dead.stdout)
    half = whole.read_bytes()[: len(whole.read_bytes()) // 2]
    killed = whole.with_name(f"{whole.stem}9.kvt.{dead_pid}.tmp")
    probe = whole.with_name(f".probe-{dead_pid}.kvt.tmp")
    live = whole.with_name(f"{whole.stem}8.kvt.{os.getppid()}.tmp")
    for path in (killed, probe, live):
        path.write_bytes(half)
    again = _tier(tmp_path, disk_blocks=8)
    assert set(again.disk) == {0} and again.stats["corrupted"] == 2
    assert not killed.exists() and not probe.exists() and live.exists()
    again.check_integrity()


# ---------------------------------------------------------------------- with the KV manager
@pytest.mark.parametrize("where", ["memory", "disk"])
def test_evicted_blocks_come_back_bitwise_on_a_prefix_miss(tmp_path, where):
    tier = _tier(tmp_path, memory_blocks=8 if where == "memory" else 0, disk_blocks=8)
    kv = _kv(tier, num_blocks=6)
    tokens = list(range(13))  # 3 full blocks + 1 token
    _compute(kv, 0, tokens)
    left = _blocks(kv, 0)
    kv.free(0)
    _compute(kv, 1, list(range(100, 124)))  # 6 blocks: every cached block of seq 0 is evicted
    kv.check_integrity()
    assert len(tier) == 3 and all(tier.where(h) == where for h in list(tier.memory) + list(tier.disk))
    kv.free(1)
    kv.add_sequence(2)
    assert kv.match_prefix(2, tokens) == []  # evicted from the pool...
    hashes = kv.tier_io.match(2, tokens)
    assert len(hashes) == 3                  # ...but the tier continues the chain
    assert kv.tier_io.load_prefix(2, tokens, 3) == 12
    kv.check_integrity()
    for before, after in zip(left, _blocks(kv, 2)):
        assert torch.equal(before, after)   # every layer, K and V, bitwise
    kv.add_sequence(3)
    assert kv.match_prefix(3, tokens) == kv.block_table(2)  # re-indexed in the prefix cache


def test_a_corrupted_block_ends_the_load_and_the_rest_is_recomputed(tmp_path):
    tier = _tier(tmp_path, disk_blocks=8)
    kv = _kv(tier, num_blocks=6)
    tokens = list(range(13))
    _compute(kv, 0, tokens)
    kv.free(0)
    _compute(kv, 1, list(range(100, 124)))
    kv.free(1)
    tier.flush()
    paths = {h: e.path for h, e in tier.disk.items()}
    kv.add_sequence(2)
    hashes = kv.tier_io.match(2, tokens)
    raw = bytearray(paths[hashes[1]].read_bytes())
    raw[-1] ^= 1
    paths[hashes[1]].write_bytes(bytes(raw))
    assert kv.tier_io.load_prefix(2, tokens, 3) == 4  # block 0 only; 1 failed its checksum
    assert kv.num_slots(2) == 4 and not paths[hashes[1]].exists() and tier.stats["corrupted"] == 1
    kv.check_integrity()


def test_a_dropped_block_is_restored_from_the_tier_and_fingerprint_checked(tmp_path):
    tier = _tier(tmp_path, memory_blocks=8)
    kv = _kv(tier, num_blocks=8)
    tokens = list(range(24))
    _compute(kv, 0, tokens, pinned=4)
    left = _blocks(kv, 0)
    kv.drop(0, [1, 2, 3], keep_index=True)
    _compute(kv, 1, list(range(100, 116)))  # takes the free blocks, then evicts the dropped ones
    kv.check_integrity()
    assert kv.restore_cached(0, tokens) == []  # no longer in the prefix cache
    assert kv.tier_io.restorable(0, [1, 2, 3]) == [1, 2, 3]
    kv.free(1)
    restored, mismatches = kv.tier_io.restore(0, tokens, [1, 2, 3])
    assert restored == [1, 2, 3] and mismatches == 0 and DROPPED not in kv.block_table(0)
    assert all(torch.equal(a, b) for a, b in zip(left, _blocks(kv, 0)))
    kv.check_integrity()
    # a tier entry whose bits are not the block's fails the fingerprint and is not installed
    kv.drop(0, [2], keep_index=True)
    block_hash = kv._hashes[0][2]
    _compute(kv, 2, list(range(200, 200 + kv.num_free_blocks * BLOCK)))  # evicts it
    kv.free(2)
    tier.memory[block_hash] = (tier.memory[block_hash][0], torch.randn(SHAPE))
    assert kv.tier_io.restore(0, tokens, [2]) == ([], 1) and block_hash not in tier
    assert kv.dropped_blocks(0) == [2]
    kv.check_integrity()


def test_integrity_covers_tier_bookkeeping(tmp_path):
    tier = _tier(tmp_path, memory_blocks=2, disk_blocks=4)
    kv = _kv(tier)
    tier.put(1, (1,) * BLOCK, torch.randn(SHAPE))
    kv.check_integrity()
    tier.memory_used += 1
    with pytest.raises(AssertionError, match="memory bytes"):
        kv.check_integrity()
    tier.memory_used -= 1
    tier.put(2, (2,) * BLOCK, torch.randn(SHAPE))
    tier.put(3, (3,) * BLOCK, torch.randn(SHAPE))
    tier.flush()
    os.unlink(tier.disk[1].path)
    with pytest.raises(AssertionError, match="missing"):
        kv.check_integrity()


# ---------------------------------------------------------------------- the engine, real model
def _flush_pool(kv: KVManager) -> None:
    """Pressure from elsewhere: take every free block (evicting the prefix cache's LRU into
    the tier), then give them back empty."""
    kv.add_sequence(-1)
    assert kv.allocate(-1, kv.num_free_blocks * kv.block_size)
    kv.free(-1)


def _run(llm, prompt, params, flush_when) -> "RequestOutput":
    engine = llm.engine
    request_id = engine.add_request(prompt, params)
    flushed, done = False, None
    while engine.has_unfinished_requests():
        for output in engine.step():
            done = output if output.finished else done
        engine.check_integrity()
        seq = engine.requests[request_id].seqs[0] if request_id in engine.requests else None
        if not flushed and seq is not None and flush_when(engine, seq):
            _flush_pool(engine.kv)
            flushed = True
            engine.check_integrity()
    assert flushed
    return done


def test_replay_loads_from_the_tier_with_the_tokens_of_full(llm32):
    """replay, threshold 0 (every dropped range replayed before the next step), the pool
    flushed right after the prompt's middle was dropped: with the tier the dropped blocks are
    loaded instead of recomputed, and the greedy tokens are full's."""
    from kvreplay import LLM, SamplingParams
    prompt = list(range(1000, 1200))
    params = SamplingParams(max_tokens=12, temperature=0)
    want = llm32.generate([prompt], params)[0].token_ids
    stats = {}
    for memory in ("0", "16MiB"):
        llm = LLM(dtype="float32", policy="replay", trim="prefill", window_tokens=32, sink_tokens=4,
                  replay_threshold=0, kv_cache_memory="24MiB", kv_tier_memory=memory,
                  kv_tier_choice="load")
        out = _run(llm, prompt, params, lambda engine, seq: engine.kv.dropped_blocks(seq.seq_id))
        assert out.token_ids == want, memory
        stats[memory] = out.stats
    off, on = stats["0"], stats["16MiB"]
    assert off.tier_loaded_tokens == 0 and off.replayed_tokens > 0
    assert on.tier_loaded_tokens >= off.replayed_tokens and on.replayed_tokens == 0
    assert on.replay_mismatches == 0 and on.tier_actual_seconds > 0


def test_a_returning_chat_loads_its_history_from_disk(tmp_path, llm32):
    """A chat's first round, the pool flushed (its blocks go to the disk tier), the second
    round: its history is loaded, not prefilled, and the tokens are full's."""
    from kvreplay import LLM, SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0)
    first = list(range(500, 700))
    llm = LLM(dtype="float32", kv_cache_memory="24MiB", kv_tier_dir=str(tmp_path), kv_tier_disk="64MiB",
              kv_tier_choice="load")
    reply = llm.generate([first], params)[0].token_ids
    _flush_pool(llm.engine.kv)
    llm.engine.check_integrity()
    second = first + reply + list(range(800, 840))
    out = llm.generate([second], params)[0]
    llm.engine.check_integrity()
    assert out.token_ids == llm32.generate([second], params)[0].token_ids
    assert out.stats.prefix_hit_tokens == 0 and out.stats.tier_loaded_tokens == 192
    assert llm.engine.kv.tier_io.tier.stats["load_bytes"] > 0


def test_a_paused_request_resumes_from_the_tier(llm32):
    """Two requests outgrow a small pool: one is paused and its released blocks, pushed out of
    the prefix cache by the other's growth, go to the tier. On resume they are loaded, not
    recomputed; without the tier they are recomputed. The tokens are full's either way."""
    from kvreplay import LLM, SamplingParams
    prompts = [list(range(1000, 1200)), list(range(2000, 2200))]
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    want = [out.token_ids for out in llm32.generate(prompts, params)]
    stats = {}
    for memory in ("0", "16MiB"):
        # 34 blocks; both admitted (admit at 0.9), the later one paused as they grow
        llm = LLM(dtype="float32", kv_cache_memory="24MiB", kv_tier_memory=memory, kv_tier_choice="load",
                  watermarks=(0.8, 0.9, 0.95))
        outs = llm.generate(prompts, params, on_step=lambda *_: llm.engine.check_integrity())
        assert [out.token_ids for out in outs] == want, memory
        paused = [out.stats for out in outs if out.stats.pauses]
        assert paused, f"the pool did not pause anyone ({memory})"
        stats[memory] = paused[0]
    off, on = stats["0"], stats["16MiB"]
    assert off.tier_loaded_tokens == 0 and off.replayed_tokens > 0
    assert on.tier_loaded_tokens >= off.replayed_tokens and on.replayed_tokens == 0


# ---------------------------------------------------------------------- planner and metrics
def test_planner_counts_sessions_per_tier_level():
    from kvreplay import planner
    dims = planner.KVDims(num_layers=30, num_kv_heads=3, head_dim=64)
    result = planner.plan(dims, 1024, budget_bytes=2**28, tier_memory_bytes=2**33, tier_disk_bytes=200 * 10**9)
    block_bytes = 2 * 30 * 3 * 64 * 2 * 16  # bf16, 16-token blocks
    assert result.block_bytes == block_bytes
    assert result.tier_sessions == {"memory": 2**33 // (64 * block_bytes),
                                    "disk": 200 * 10**9 // (64 * (block_bytes + planner.TIER_FILE_HEADER_BYTES))}
    assert planner.plan(dims, 1024).tier_sessions == {}


def test_metrics_export_the_tier_series():
    from kvreplay.server.generation import EngineSnapshot
    from kvreplay.server.metrics import ServerMetrics
    snap = EngineSnapshot(tier=dict(memory_bytes=100, disk_bytes=300, loads=4, load_bytes=400, hits=4,
                                    misses=2, corrupted=1, discarded=0),
                          request_stats=dict(tier_loaded_tokens=64, tier_recomputed_tokens=16))
    text = ServerMetrics(lambda: snap).render().decode()
    for line in ('kvreplay_kv_tier_bytes{tier="memory"} 100.0', 'kvreplay_kv_tier_bytes{tier="disk"} 300.0',
                 "kvreplay_kv_tier_loads_total 4.0", "kvreplay_kv_tier_load_bytes_total 400.0",
                 "kvreplay_kv_tier_hits_total 4.0", "kvreplay_kv_tier_misses_total 2.0",
                 "kvreplay_kv_tier_corrupted_files_total 1.0", "kvreplay_kv_tier_loaded_tokens_total 64.0",
                 "kvreplay_kv_tier_recomputed_tokens_total 16.0"):
        assert line in text, line


def test_session_resume_bench_rejects_bad_arguments():
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for args, message in ((["--rounds", "1"], "--rounds at least 2"), (["--modes", "sometimes"], "--modes takes")):
        result = subprocess.run([sys.executable, os.path.join(root, "bench", "session_resume.py"), *args],
                                capture_output=True, text=True, timeout=120, cwd=root)
        assert result.returncode == 2 and message in result.stderr, result.stderr


def test_context_first_bench_rejects_bad_arguments():
    import subprocess
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for args, message in ((["--resident-ratio", "1.5"], "--resident-ratio must lie between 0 and 1"),
                          (["--modes", "disk"], "--modes takes none and tier"),
                          (["--users", "0"], "must be at least 1")):
        result = subprocess.run([sys.executable, os.path.join(root, "bench", "context_first.py"), *args],
                                capture_output=True, text=True, timeout=120, cwd=root)
        assert result.returncode == 2 and message in result.stderr, result.stderr
