"""Replay (docs/architecture.md §5, issue 4): dropping middle blocks, the key index, the need detector, exact
in-order replay, fingerprints. Tiny pools without a model first, then the real model in fp32."""
from __future__ import annotations

import pytest
import torch

from kvreplay import LLM, SamplingParams
from kvreplay.kv.manager import DROPPED, KVManager
from kvreplay.kv.policy import middle_block_range

BLOCK = 4


def _kv(num_blocks: int = 16, prefix_caching: bool = False) -> KVManager:
    kv = KVManager(num_blocks, BLOCK, num_layers=2, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                   enable_prefix_caching=prefix_caching)
    for cache in kv.kv_caches:
        cache.copy_(torch.randn_like(cache))
    return kv


# ---------------------------------------------------------------------- manager, tiny pools
def test_middle_zone_bounds():
    # 4 pinned tokens -> block 1 onwards; 10-token window of 40 tokens -> blocks before 30//4 = 7
    assert list(middle_block_range(40, 4, 10, BLOCK)) == [1, 2, 3, 4, 5, 6]
    assert list(middle_block_range(40, 5, 10, BLOCK)) == [2, 3, 4, 5, 6]  # a partial pin rounds up
    assert list(middle_block_range(12, 4, 10, BLOCK)) == []                 # all window


def test_drop_frees_blocks_charges_the_index_and_restores_from_cache():
    kv = _kv(prefix_caching=True)
    tokens = list(range(24))
    kv.add_sequence(0, pinned_tokens=4)
    assert kv.allocate(0, 24)
    kv.commit(0, tokens, 24)
    table = kv.block_table(0)
    free_before = kv.num_free_blocks
    freed = kv.drop(0, [1, 2, 3], keep_index=True)
    kv.check_integrity()
    # 3 blocks freed, one reserved for the index's 3 slots (3 x 2 layers x (8 + 16) bytes <= 128)
    assert kv.block_table(0) == [table[0], DROPPED, DROPPED, DROPPED, table[4], table[5]]
    assert freed == 2 and kv.num_free_blocks == free_before + 2
    assert kv.key_index.num_used == 3 and kv.dropped_blocks(0) == [1, 2, 3]
    assert kv.resident_blocks(0) == [table[0], table[4], table[5]]
    # what the resident_ratio trim counts on when it picks how many blocks to drop at once
    assert kv.resident_bytes(0) == 6 * kv.block_bytes - 3 * kv.bytes_freed_by_drop(False, keep_index=True)
    assert kv.bytes_freed_by_drop(False, keep_index=False) == kv.block_bytes
    # The dropped blocks still hold cached K/V: they come back without any recompute.
    assert kv.restore_cached(0, tokens) == [1, 2, 3]
    assert kv.block_table(0) == table and kv.key_index.num_used == 0
    kv.check_integrity()
    kv.free(0)
    kv.check_integrity()
    assert kv.num_free_blocks == kv.num_blocks


def test_key_index_keeps_int4_keys_within_half_a_step():
    kv = _kv()
    kv.add_sequence(0)
    kv.allocate(0, 16)
    block = kv.block_table(0)[2]
    original = torch.stack([c[0, :, block] for c in kv.kv_caches])  # [L, Hkv, bs, D]
    kv.drop(0, [2], keep_index=True)
    slot = kv.index_slots(0)[0]
    restored = kv.key_index.keys([slot])[:, :, 0]
    step = (original.amax(2, keepdim=True) - original.amin(2, keepdim=True)) / 15
    assert ((restored - original).abs() <= step / 2 + 1e-3).all()


def test_key_index_keeps_only_the_detector_layers():
    full = KVManager(16, BLOCK, num_layers=3, num_kv_heads=1, head_dim=4, dtype=torch.float32)
    kv = KVManager(16, BLOCK, num_layers=3, num_kv_heads=1, head_dim=4, dtype=torch.float32,
                   index_layers=frozenset({2}))
    assert kv.key_index.slot_bytes * 3 == full.key_index.slot_bytes
    for cache in kv.kv_caches:
        cache.copy_(torch.randn_like(cache))
    kv.add_sequence(0)
    kv.allocate(0, 16)
    block = kv.block_table(0)[1]
    layer2 = kv.kv_caches[2][0, :, block]                            # [Hkv, bs, D]
    kv.drop(0, [1], keep_index=True)
    slot = kv.index_slots(0)[0]
    kept = kv.key_index.keys([slot])                                 # [1 kept layer, Hkv, 1, bs, D]
    step = (layer2.amax(1, keepdim=True) - layer2.amin(1, keepdim=True)) / 15
    assert kept.shape[0] == 1 and ((kept[0, :, 0] - layer2).abs() <= step / 2 + 1e-3).all()
    query = torch.randn(1, 1, 1, 4)
    args = (query, torch.tensor([[slot]]), torch.tensor([[True]]), torch.zeros(1, 1, 1), 1)
    mass, column = kv.key_index.max_block_mass(2, *args)
    assert 0 <= mass.item() <= 1 and column.tolist() == [0]
    with pytest.raises(ValueError, match="not kept"):
        kv.key_index.max_block_mass(0, *args)
    kv.free(0)
    kv.check_integrity()


def test_compiled_need_detector_matches_the_pytorch_one():
    from kvreplay.kv.key_index import KeyIndex
    index = KeyIndex(4, 3, 16, 64, layers=frozenset({1, 3}))
    if index.kernel is None:
        pytest.skip("no compiled CPU kernels here: the PyTorch detector runs")
    gen = torch.Generator().manual_seed(5)
    keys = torch.randn(4, 3, 60, 16, 64, generator=gen) * 2
    keys[:, :, 9] *= 4  # a block that stands out
    slots = torch.tensor(index.add(keys))
    rows, width = 6, 40
    table = torch.stack([slots[torch.randperm(60, generator=gen)[:width]] for _ in range(rows)])
    valid = torch.ones(rows, width, dtype=torch.bool)
    valid[1, 5:] = False  # fewer dropped blocks than top_blocks
    valid[2] = False      # none at all
    query = torch.randn(rows, 3, 3, 64, generator=gen) * 0.3
    lse = torch.randn(rows, 3, 3, generator=gen) + 4
    kernel = index.kernel
    for layer in (1, 3):
        for top in (1, 8, 64):
            got, got_column = index.max_block_mass(layer, query, table, valid, lse, top)
            index.kernel = None
            want, want_column = index.max_block_mass(layer, query, table, valid, lse, top)
            index.kernel = kernel
            assert torch.allclose(got, want, atol=1e-5), (layer, top, got, want)
            assert got[2] == 0 and want.max() > 0.1  # a row without dropped blocks needs nothing
            # the same block judged the neediest (rows with dropped blocks)
            assert got_column[valid.any(1)].tolist() == want_column[valid.any(1)].tolist(), (layer, top)
    bad = table.clone()
    bad[0, 0] = index.capacity
    with pytest.raises(RuntimeError, match="outside the index"):
        kernel(query, index.codes[0], index.lo[0], index.hi[0], bad, valid, lse, 8)
    with pytest.raises(RuntimeError, match="resident_lse"):
        kernel(query, index.codes[0], index.lo[0], index.hi[0], table, valid, lse[:, :2], 8)


def test_restore_replay_path_and_fingerprint_mismatch():
    kv = _kv()
    kv.add_sequence(0)
    kv.allocate(0, 16)
    saved = [c[:, :, kv.block_table(0)[1]].clone() for c in kv.kv_caches]
    kv.drop(0, [1], keep_index=False)
    assert kv.index_slots(0) == [] and kv.dropped_blocks(0) == [1]
    assert not kv.allocate_restore(0, [1] * 20)  # more than the pool: nothing changes
    assert kv.allocate_restore(0, [1])
    new_block = kv.block_table(0)[1]
    for cache, before in zip(kv.kv_caches, saved):  # the "replay" writes the same K/V
        cache[:, :, new_block] = before
    assert kv.finish_restore(0, [1], list(range(16))) == 0
    kv.check_integrity()
    kv.drop(0, [1], keep_index=False)
    kv.allocate_restore(0, [1])
    kv.kv_caches[-1][:, :, kv.block_table(0)[1]] += 1.0  # a replay that went wrong
    assert kv.finish_restore(0, [1], list(range(16))) == 1
    kv.check_integrity()


def test_truncate_releases_the_redone_slot():
    kv = _kv()
    kv.add_sequence(0)
    kv.allocate(0, 9)  # 3 blocks, the last holding one token
    kv.truncate(0, 8)
    assert len(kv.block_table(0)) == 2 and kv.num_slots(0) == 8
    kv.check_integrity()


# ---------------------------------------------------------------------- the real model, fp32
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def corpus(llm32):
    from kvreplay.bench.workload import corpus_token_ids
    return corpus_token_ids(llm32.tokenizer)


@pytest.fixture(scope="module")
def replay32():
    """Replay preset, always replay (threshold 0), prefix cache off so replays recompute; the
    detector reads every layer and no heavy hitters stay hot, so every middle block drops."""
    return LLM(dtype="float32", kv_cache_memory="96MiB", policy="replay", trim="prefill",
               window_tokens=128, replay_threshold=0.0, enable_prefix_caching=False,
               need_layers="all", heavy_tokens=0)


def _check(llm):
    return lambda *_: llm.engine.check_integrity()


def test_replay_restores_kv_at_every_layer(replay32, corpus):
    engine = replay32.engine
    prompt = corpus[:700]
    engine.config.trim = engine.scheduler.reclaim.trim = "pressure"  # no automatic trim: drop by hand
    try:
        engine.add_request(prompt, SamplingParams(max_tokens=4, temperature=0), request_id="kv")
        engine.step()
        engine.step()  # 700 tokens in two chunks of 512 + 188, then the first token is sampled
        seq = engine.requests["kv"].seqs[0]
        assert seq.num_uncomputed_tokens == 1
        kv = engine.kv
        middle = kv.droppable(seq.seq_id, middle_block_range(seq.num_computed_tokens, seq.pinned_tokens,
                                                                engine.config.window_tokens, kv.block_size))
        assert len(middle) >= 30
        blocks = [kv.block_table(seq.seq_id)[i] for i in middle]
        before = [cache[:, :, blocks].clone() for cache in kv.kv_caches]  # [2, Hkv, n, bs, D]
        kv.drop(seq.seq_id, middle, keep_index=True)
        seq.replay.needed = True
        engine.check_integrity()
        engine.step()  # the replay, in chunks of the step's 512-token budget
        assert seq.stats.replayed_tokens == 512 and len(kv.dropped_blocks(seq.seq_id)) == len(middle) - 32
        engine.check_integrity()
        engine.step()
        assert not kv.dropped_blocks(seq.seq_id) and seq.stats.replayed_tokens == len(middle) * 16
        after = [cache[:, :, [kv.block_table(seq.seq_id)[i] for i in middle]] for cache in kv.kv_caches]
        worst = max((a - b).abs().max().item() for a, b in zip(after, before))
        assert worst < 1e-4, f"replayed K/V differ from the never-dropped K/V by {worst}"
        assert seq.stats.replay_mismatches == 0
        while engine.has_unfinished_requests():
            engine.step()
            engine.check_integrity()
    finally:
        engine.config.trim = engine.scheduler.reclaim.trim = "prefill"


def test_always_replay_equals_full_exactly(replay32, llm32, corpus):
    prompts = [corpus[1000:1900], corpus[4000:4300], corpus[9000:10200]]
    reference = llm32.generate(prompts, PARAMS)
    outputs = replay32.generate(prompts, PARAMS, on_step=_check(replay32))
    for out, ref in zip(outputs, reference):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    stats = [out.outputs[0].stats for out in outputs]
    assert all(s.dropped_tokens > 0 and s.replays >= 1 and s.replayed_tokens > 0 for s in stats)
    assert all(s.approx_tokens == 0 and s.replay_mismatches == 0 for s in stats)
    replay32.engine.check_integrity()


def test_replay_by_whole_recompute_equals_full_exactly(tiny_model):
    """A hybrid pool's replay (ReplayTracker.recomputes_whole) recomputes the whole sequence
    instead of its dropped runs: still `full`'s tokens, a replay counted, no replay chunk run."""
    from token_helpers import seeded_tokens
    knobs = dict(model=tiny_model, dtype="float32", kv_cache_memory="1MiB", block_size=8,
                 enable_prefix_caching=False)
    replay = LLM(policy="replay", trim="prefill", window_tokens=32, replay_threshold=0.0, need_layers="all",
                 heavy_tokens=0, **knobs)
    engine = replay.engine
    engine.scheduler.replay.recomputes_whole = True
    chunks = []
    run = engine.runner.run

    def spy(batch, **kwargs):
        chunks.extend(batch.replays)
        return run(batch, **kwargs)

    engine.runner.run = spy
    prompts = [seeded_tokens(300, 1), seeded_tokens(180, 2)]
    outputs = replay.generate(prompts, PARAMS, on_step=_check(replay))
    for out, ref in zip(outputs, LLM(**knobs).generate(prompts, PARAMS)):
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids
        stats = out.outputs[0].stats
        assert stats.dropped_tokens > 0 and stats.replays >= 1 and stats.replay_mismatches == 0
    assert not chunks, "a dropped run was replayed alone"
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_fingerprint_mismatch_recomputes_the_whole_sequence(replay32, llm32, corpus):
    engine = replay32.engine
    kv = engine.kv
    prompt = corpus[2000:2600]
    tolerance, kv.fingerprint_tolerance = kv.fingerprint_tolerance, -1.0  # the next check fails

    def on_step(*_):
        engine.check_integrity()
        if engine.counters.replay_mismatches:
            kv.fingerprint_tolerance = tolerance

    mismatches = engine.counters.replay_mismatches
    try:
        out = replay32.generate(prompt, PARAMS, on_step=on_step).outputs[0]
    finally:
        kv.fingerprint_tolerance = tolerance
    assert engine.counters.replay_mismatches > mismatches
    assert out.stats.replay_mismatches > 0
    assert out.token_ids == llm32.generate(prompt, PARAMS).outputs[0].token_ids


def test_abort_during_replay_leaves_the_pool_clean(replay32, corpus):
    engine = replay32.engine
    engine.add_request(corpus[3000:3800], PARAMS, request_id="abort-me")
    engine.add_request(corpus[5000:5300], PARAMS, request_id="keep")
    while not any(s.replay.active for r in engine.requests.values() for s in r.seqs):
        engine.step()
        engine.check_integrity()
    engine.abort_request("abort-me")
    engine.check_integrity()
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.kv.key_index.num_used == 0 and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_window_preset_slides_and_never_replays(corpus):
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", policy="window", window_tokens=64,
              sink_tokens=4, enable_prefix_caching=False)
    engine = llm.engine
    peak = []

    def on_step(*_):
        engine.check_integrity()
        for seq in engine.scheduler.running:
            if seq.num_uncomputed_tokens == 1:
                peak.append(len(engine.kv.resident_blocks(seq.seq_id)))

    out = llm.generate(corpus[:600], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
                       on_step=on_step).outputs[0]
    # sinks (1 block) + 64-token window (4 blocks) + the block being filled (+1 when the
    # window does not start on a block boundary)
    assert max(peak) <= 1 + 4 + 2
    assert out.stats.replays == 0 and out.stats.approx_tokens == 39
    assert out.stats.dropped_tokens >= 600 - 64 - 16
    assert engine.kv.key_index.num_used == 0


def test_bad_replay_knobs_are_clear_errors():
    from kvreplay.config import EngineConfig
    for knobs, message in [({"policy": "magic"}, "unknown policy"), ({"trim": "sometimes"}, "unknown trim"),
                           ({"replay_threshold": 1.5}, "replay_threshold"),
                           ({"window_tokens": 0}, "window_tokens"),
                           ({"need_top_blocks": -1}, "need_top_blocks"),
                           ({"approx_prefill": "yes"}, "approx_prefill"),
                           ({"need_layers": "20-x"}, "layers"), ({"need_layers": [-1]}, "layers")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**knobs)


def test_pressure_trims_a_long_prefill_and_approx_prefill_attends_to_what_is_left(corpus):
    # 48MiB fp32 holds 1,088 tokens; 128-token chunks; reclaim above half the pool.
    llm = LLM(dtype="float32", kv_cache_memory="48MiB", policy="replay", trim="pressure",
              approx_prefill=True, window_tokens=128, replay_threshold=1.0, watermarks=(0.3, 0.4, 0.5),
              max_num_batched_tokens=128, enable_prefix_caching=False)
    out = llm.generate(corpus[7000:7900], SamplingParams(max_tokens=4, temperature=0),
                       on_step=_check(llm)).outputs[0]
    assert out.stats.dropped_tokens > 0 and out.stats.approx_tokens >= 128
    assert out.stats.replays == 0 and len(out.token_ids) == 4
    assert llm.engine.kv.peak_used_blocks < 900 // 16  # never held the whole prompt


def test_replay_counters_reach_the_server_usage_shape(replay32, corpus):
    stats = replay32.generate(corpus[6000:6500], PARAMS).outputs[0].stats.as_dict()
    for key in ("dropped_tokens", "replays", "replayed_tokens", "approx_tokens", "replay_mismatches"):
        assert key in stats
    assert stats["dropped_tokens"] > 0 and stats["replays"] == 1


def test_need_layers_past_the_model_is_a_clear_error():
    with pytest.raises(ValueError, match="past the model's 30"):
        LLM(dtype="float32", kv_cache_memory="16MiB", policy="replay", need_layers="28-30")


def test_need_layers_limit_what_the_detector_reads(replay32, corpus):
    """In the 4K probe layers 0-1 never gave a dropped block more than 0.13 of a head
    (docs/benchmarks/replay.md): reading only them, a 0.5 threshold never fires."""
    engine = replay32.engine
    prompt = corpus[3000:3600]
    tracker = engine.scheduler.replay  # the replay tracker owns the threshold
    saved = engine.runner.need_layers, tracker.threshold
    tracker.threshold = 0.5
    try:
        engine.runner.need_layers = frozenset({0, 1})
        quiet = replay32.generate(prompt, PARAMS).outputs[0].stats
    finally:
        engine.runner.need_layers, tracker.threshold = saved
    assert quiet.replays == 0 and quiet.approx_tokens == PARAMS.max_tokens - 1


def test_need_detector_fires_on_a_planted_fact_and_stays_quiet_on_plain_text(corpus):
    """A number planted mid-prompt and asked for at the end: the middle is dropped after prefill,
    the detector (threshold 0.65, layers 20-23 as calibrated in docs/benchmarks/replay.md, no
    heavy hitters) must replay and the answer must be right. Plain text continued for 16 tokens: no replay at all."""
    from kvreplay.bench.quality import QualitySpec, retrieval_cases
    llm = LLM(dtype="float32", kv_cache_memory="96MiB", policy="replay", trim="prefill",
              window_tokens=128, need_layers="20-23", heavy_tokens=0, replay_threshold=0.65,
              enable_prefix_caching=False)
    assert llm.engine.kv.key_index.layers == [20, 21, 22, 23]  # the index keeps what the detector reads
    cases = retrieval_cases(llm.tokenizer, corpus, QualitySpec(lengths=(1024,), depths=(0.3, 0.7), seed=0))
    for case in cases:
        out = llm.generate(case.prompt_token_ids, SamplingParams(max_tokens=8, temperature=0),
                           on_step=_check(llm)).outputs[0]
        assert out.stats.dropped_tokens > 500 and out.stats.replays == 1, out.stats
        assert case.answer in out.text
    for offset in (7000, 20000):
        out = llm.generate(corpus[offset:offset + 1024], SamplingParams(max_tokens=16, temperature=0,
                                                                        ignore_eos=True)).outputs[0]
        assert out.stats.dropped_tokens > 500 and out.stats.replays == 0 and out.stats.approx_tokens == 15


def test_need_replay_brings_back_only_up_to_the_needed_block(corpus):
    """The detector names the dropped block it judged needed; the replay recomputes the dropped
    blocks in order up to it and leaves the later ones dropped (the redone step and the rest
    attend without them). A fact at 30% of the prompt: about a third of the middle comes back."""
    from kvreplay.bench.quality import QualitySpec, retrieval_cases
    llm = LLM(dtype="float32", kv_cache_memory="96MiB", policy="replay", trim="prefill",
              window_tokens=128, need_layers="20-23", heavy_tokens=0, replay_threshold=0.65,
              enable_prefix_caching=False)
    case = retrieval_cases(llm.tokenizer, corpus, QualitySpec(lengths=(1024,), depths=(0.3,), seed=0))[0]
    engine = llm.engine
    dropped_after_replay = []

    def watch(*_):
        engine.check_integrity()
        for seq in engine.scheduler.running:
            if seq.stats.replays and not seq.replay.active:
                dropped_after_replay.append(len(engine.kv.dropped_blocks(seq.seq_id)))

    out = llm.generate(case.prompt_token_ids, SamplingParams(max_tokens=8, temperature=0),
                       on_step=watch).outputs[0]
    assert case.answer in out.text
    assert out.stats.replays == 1, out.stats
    assert 0 < out.stats.replayed_tokens < 0.6 * out.stats.dropped_tokens, out.stats
    assert dropped_after_replay and min(dropped_after_replay) > 0  # the later blocks stayed dropped
    assert out.stats.approx_tokens >= 6, out.stats


def test_need_replay_is_free_when_the_needed_block_is_still_cached(corpus):
    """With the prefix cache on, a dropped block waits in its LRU list: the need-replay takes
    the block the detector named back from there, alone (cached K/V are exact whatever is dropped
    before it), and recomputes nothing."""
    from kvreplay.bench.quality import QualitySpec, retrieval_cases
    llm = LLM(dtype="float32", kv_cache_memory="96MiB", policy="replay", trim="prefill",
              window_tokens=128, need_layers="20-23", heavy_tokens=0, replay_threshold=0.65)
    case = retrieval_cases(llm.tokenizer, corpus, QualitySpec(lengths=(1024,), depths=(0.7,), seed=0))[0]
    engine = llm.engine
    dropped = []

    def watch(*_):
        engine.check_integrity()
        dropped.extend(len(engine.kv.dropped_blocks(seq.seq_id)) for seq in engine.scheduler.running)

    out = llm.generate(case.prompt_token_ids, SamplingParams(max_tokens=8, temperature=0),
                       on_step=watch).outputs[0]
    assert case.answer in out.text
    assert out.stats.replays == 1 and out.stats.replayed_tokens == 0, out.stats
    trimmed = [count for count in dropped if count]  # steps after the middle was dropped
    assert max(trimmed) > 30 and min(trimmed) == max(trimmed) - 1, dropped  # one block back only
