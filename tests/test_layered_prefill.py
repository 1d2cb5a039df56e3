"""Layered prefill (LLM(layered_prefill=True)): a prompt whose middle a dropping preset drops right
after prefill is computed one layer at a time, so the middle's K/V never exist for every layer
at once. Tiny pools for the KV manager's side, then the real model: the kept K/V, key index and
fingerprints must be bit for bit those of the chunked prefill."""
from __future__ import annotations

import pytest
import torch

from kvreplay import LLM, SamplingParams
from kvreplay.engine.scheduler import HEAVY_CANDIDATES, ScheduledBatch
from kvreplay.kv.manager import DROPPED, KVManager
from kvreplay.kv.policy import middle_block_range

BLOCK = 4


def _kv(num_blocks: int = 24) -> KVManager:
    return KVManager(num_blocks, BLOCK, num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                     enable_prefix_caching=True)


# ---------------------------------------------------------------------- manager, tiny pools
def test_layered_range_starts_dropped_and_ends_like_a_drop():
    kv, chunked = _kv(), _kv()
    tokens = list(range(40))  # 10 blocks; middle 2..6 dropped from the start
    middle = range(2, 7)
    kv.add_sequence(0, pinned_tokens=4)
    work = kv.block_bytes + 1  # two blocks of working memory
    needed = kv.num_blocks_layered(0, 40, middle, keep_index=True, work_bytes=work)
    free = kv.num_free_blocks
    new = kv.begin_layered(0, 40, middle, keep_index=True, work_bytes=work)
    assert new == list(range(10)) and kv.num_slots(0) == 40
    assert free - kv.num_free_blocks == needed == 5 + 1 + 2  # hot blocks, index share, work
    table = kv.block_table(0)
    assert [i for i, b in enumerate(table) if b == DROPPED] == list(middle)
    kv.check_integrity()
    # The same K/V through the chunked path: allocate, write every layer, then drop the middle.
    chunked.add_sequence(0, pinned_tokens=4)
    assert chunked.allocate(0, 40)
    scratches = []
    for layer in range(2):
        scratch = torch.randn(2, 1, 10, BLOCK, 4)
        scratches.append(scratch)
        kv.write_layer(0, layer, scratch, new)
        chunked.kv_caches[layer][:, :, chunked.block_table(0)] = scratch
    chunked.commit(0, tokens, 40)
    chunked.drop(0, list(middle), keep_index=True)
    kv.commit(0, tokens, 40, through_dropped=True)
    kv.end_layered(0)
    assert kv.num_free_blocks == chunked.num_free_blocks  # work memory back, same footprint
    for layer in range(2):
        for index, block in enumerate(kv.block_table(0)):
            if block != DROPPED:
                assert torch.equal(kv.kv_caches[layer][:, :, block], scratches[layer][:, :, index])
    mine, theirs = kv._dropped[0], chunked._dropped[0]
    for index in middle:
        assert torch.equal(mine[index].fingerprint, theirs[index].fingerprint)
        assert torch.equal(kv.key_index.keys([mine[index].slot]), chunked.key_index.keys([theirs[index].slot]))
    # hashed through the dropped blocks (the window's blocks are cached), dropped ones not cached
    assert kv._hashes[0] == chunked._hashes[0]
    assert kv.pool.cache.is_cached(kv.block_table(0)[8]) and not kv.restore_cached(0, tokens)
    kv.check_integrity()
    kv.free(0)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks and kv.key_index.num_used == 0


def test_layered_begin_that_does_not_fit_changes_nothing_and_pause_releases_work():
    kv = _kv(num_blocks=6)
    kv.add_sequence(0, pinned_tokens=4)
    assert kv.begin_layered(0, 40, range(2, 7), keep_index=True, work_bytes=kv.block_bytes) is None
    assert kv.num_free_blocks == 6 and kv.num_slots(0) == 0 and kv.key_index.num_used == 0
    kv.check_integrity()
    assert kv.begin_layered(0, 40, range(1, 8), keep_index=False, work_bytes=kv.block_bytes) is not None
    assert kv.num_free_blocks == 6 - 3 - 1
    assert kv.pause_preview(0, keep_pinned=True) == (40, 3)
    kept = kv.pause(0, keep_pinned=True)  # mid-prefill: its pinned head lacks later layers
    assert kept == 0 and kv.num_free_blocks == 6 and not kv.dropped_blocks(0)
    kv.check_integrity()
    # a layered range after a kept head: the head stays through a pause, the range does not
    kv.add_sequence(1, pinned_tokens=4)
    assert kv.allocate(1, 4)
    assert kv.begin_layered(1, 36, range(2, 7), keep_index=False, work_bytes=kv.block_bytes) is not None
    assert kv.pause(1, keep_pinned=True) == 4 and kv.num_free_blocks == 5
    kv.check_integrity()


# ---------------------------------------------------------------------- the real model
def _replay(layered: bool, **overrides) -> LLM:
    options = dict(dtype="float32", kv_cache_memory="64MiB", policy="replay", trim="prefill",
                   window_tokens=128, replay_threshold=1.0, need_layers="20-23", heavy_tokens=0,
                   enable_prefix_caching=False, layered_prefill=layered)
    options.update(overrides)
    return LLM(**options)


@pytest.fixture(scope="module")
def corpus(llm32):
    from kvreplay.bench.workload import corpus_token_ids
    return corpus_token_ids(llm32.tokenizer)


def _prefill(llm: LLM, prompt: list[int]):
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), request_id="p")
    seq = engine.scheduler.waiting[0]
    steps = 0
    while seq.num_computed_tokens < len(prompt):
        engine.step()
        engine.check_integrity()
        steps += 1
    return engine, seq, steps


def test_layered_prefill_keeps_what_the_chunked_prefill_keeps_bit_for_bit(corpus):
    prompt = corpus[1000:2100]  # 1,100 tokens: 3 chunks of a 512-token budget
    (ea, sa, na), (eb, sb, nb) = _prefill(_replay(False), prompt), _prefill(_replay(True), prompt)
    assert nb == na == 3  # 30 layers x 1,100 tokens at ~512 tokens' worth of layers a step
    ta, tb = ea.kv.block_table(sa.seq_id), eb.kv.block_table(sb.seq_id)
    assert [b == DROPPED for b in ta] == [b == DROPPED for b in tb] and ta.count(DROPPED) == 59
    size = ea.kv.block_size
    for layer in range(len(ea.kv.kv_caches)):
        for index, (x, y) in enumerate(zip(ta, tb)):
            if x != DROPPED:
                rows = min(size, len(prompt) - index * size)  # the last block is partial
                assert torch.equal(ea.kv.kv_caches[layer][:, :, x, :rows], eb.kv.kv_caches[layer][:, :, y, :rows])
    ra, rb = ea.kv._dropped[sa.seq_id], eb.kv._dropped[sb.seq_id]
    assert sorted(ra) == sorted(rb)
    for index in ra:
        assert torch.equal(ra[index].fingerprint, rb[index].fingerprint)
        assert torch.equal(ea.kv.key_index.keys([ra[index].slot]), eb.kv.key_index.keys([rb[index].slot]))
    # The point: the chunked prefill held the whole prompt at its peak, the layered one its
    # kept blocks, index share and working memory.
    assert eb.kv.peak_used_blocks < ea.kv.peak_used_blocks / 3
    for engine in (ea, eb):
        while engine.has_unfinished_requests():
            engine.step()
            engine.check_integrity()
        assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_layered_prefill_then_always_replay_equals_full(llm32, corpus):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    prompts = [corpus[3000:4100], corpus[7000:7700]]
    reference = [out.outputs[0].token_ids for out in llm32.generate(prompts, params)]
    llm = _replay(True, replay_threshold=0.0)
    outputs = llm.generate(prompts, params, on_step=lambda *_: llm.engine.check_integrity())
    for out, ref in zip(outputs, reference):
        stats = out.outputs[0].stats
        assert out.outputs[0].token_ids == ref
        assert stats.dropped_tokens > 0 and stats.replayed_tokens > 0 and stats.replay_mismatches == 0


def test_layered_prefill_keeps_the_heavy_hitters_among_its_candidates(corpus):
    prompt = corpus[5000:6100]
    heavy = 32
    kept = []
    for layered in (False, True):
        engine, seq, _ = _prefill(_replay(layered, heavy_tokens=heavy), prompt)
        table = engine.kv.block_table(seq.seq_id)
        middle = middle_block_range(len(prompt), seq.pinned_tokens, 128, 16)
        kept.append([i for i in middle if table[i] != DROPPED])
    candidates = range(middle.stop - HEAVY_CANDIDATES * heavy // 16, middle.stop)
    assert len(kept[0]) == len(kept[1]) == heavy // 16
    # on this prompt the chunked prefill's heavy hitters lie among the candidates, so the
    # layered prefill, which observes the same attention, must keep the same blocks
    assert all(i in candidates for i in kept[0])
    assert kept[1] == kept[0]


def test_pause_and_abort_during_a_layered_prefill(llm32, corpus):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompt = corpus[8000:9100]
    reference = llm32.generate(prompt, params).outputs[0].token_ids
    llm = _replay(True, replay_threshold=0.0)
    engine = llm.engine
    engine.add_request(prompt, params, request_id="pause-me")
    engine.step()
    seq = engine.requests["pause-me"].seqs[0]
    assert seq.layered is not None and 0 < seq.layered.next_layer < 30
    engine.scheduler._pause(seq, ScheduledBatch())  # as a reclaim would
    engine.check_integrity()
    # its pinned head (the sinks' block) holds only the layers done so far: nothing is kept
    assert seq.layered is None and seq.num_computed_tokens == 0
    assert engine.kv.num_used_blocks == 0
    finished = []
    while engine.has_unfinished_requests():
        finished += [out for out in engine.step() if out.finished]
        engine.check_integrity()
    # computed again layer by layer, then replayed: the same greedy tokens
    assert finished[0].outputs[0].token_ids == reference
    assert engine.kv.num_free_blocks == engine.kv.num_blocks
    engine.add_request(prompt, params, request_id="abort-me")
    engine.step()
    assert engine.requests["abort-me"].seqs[0].layered is not None
    engine.abort_request("abort-me")
    engine.check_integrity()
    assert engine.kv.num_free_blocks == engine.kv.num_blocks and engine.kv.key_index.num_used == 0


def test_layered_prefill_admits_more_long_prompts_under_the_same_budget(corpus):
    # 64 MiB fp32 = 2,184 tokens; three 1,100-token prompts: in chunks one fits under `admit`
    # at a time, layer by layer all three run together.
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    prompts = [corpus[i:i + 1100] for i in (0, 12000, 24000)]
    peaks = []
    for layered in (False, True):
        llm = _replay(layered, kv_cache_memory="64MiB")
        engine, peak = llm.engine, 0

        def on_step(*_):
            nonlocal peak
            engine.check_integrity()
            peak = max(peak, engine.num_running)
        llm.generate(prompts, params, on_step=on_step)
        peaks.append(peak)
    assert peaks == [1, 3]


def test_window_preset_with_layered_prefill_gives_the_chunked_tokens(corpus):
    # StreamingLLM evicts the middle as the prompt ends; layer by layer it is never kept at all
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompt = corpus[11000:12100]
    outputs = []
    for layered in (False, True):
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", policy="window", window_tokens=128,
                  enable_prefix_caching=False, layered_prefill=layered)
        out = llm.generate(prompt, params, on_step=lambda *_: llm.engine.check_integrity()).outputs[0]
        outputs.append((out.token_ids, out.stats.dropped_tokens, llm.engine.kv.peak_used_blocks))
    (chunked, dropped_a, peak_a), (layered, dropped_b, peak_b) = outputs
    assert layered == chunked and dropped_a == dropped_b > 0
    assert peak_b < peak_a / 3


def test_layered_prefill_must_be_a_bool():
    with pytest.raises(ValueError, match="layered_prefill must be True or False"):
        LLM(layered_prefill="yes")


def test_layered_prefill_flag_reaches_the_engine_config():
    from kvreplay.cli import build_parser, engine_config_from_args
    on = build_parser().parse_args(["generate", "--policy", "replay", "--trim", "prefill", "--layered-prefill", "hi"])
    off = build_parser().parse_args(["generate", "hi"])
    assert engine_config_from_args(on).layered_prefill is True
    assert engine_config_from_args(off).layered_prefill is False
