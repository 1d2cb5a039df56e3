"""Replay on Gemma 3 270M (fp32, real model) over the hybrid pool: dropped blocks leave the
global layers' table only, and a replay recomputes the whole sequence (a dropped run's K/V at a
global layer rest on every local window before it: ReplayTracker.recomputes_whole). The need
probe reads the global layers' key index; `full`'s greedy tokens come back exactly."""
from __future__ import annotations

import pytest

from kvreplay import SamplingParams
from tests.test_gemma3 import _checked, _engine_on

PROMPT, PARAMS = 600, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def full_tokens(gemma32, text_ids):
    return gemma32.generate(text_ids[:PROMPT], PARAMS).outputs[0].token_ids


def _run(llm, prompt: list[int]):
    """The output, with every step checked, the replay chunks the runner saw, and the pool
    clean at the end."""
    engine, chunks = llm.engine, []
    run = engine.runner.run

    def spy(batch, **kwargs):
        chunks.extend(batch.replays)
        return run(batch, **kwargs)

    engine.runner.run = spy
    output = llm.generate(prompt, PARAMS, on_step=_checked).outputs[0]
    kv = engine.kv
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_blocks and not kv.local.tables
    return output, chunks


@pytest.mark.parametrize("knobs", [
    {"policy": "replay", "trim": "prefill", "window_tokens": 128, "heavy_tokens": 0, "need_layers": "all"},
    {"policy": "replay+cold", "resident_ratio": 0.25},
])
def test_always_replay_on_the_hybrid_pool_equals_full(gemma32, text_ids, full_tokens, knobs):
    """Threshold 0: the detector asks for every dropped block at every decode step, so each
    step recomputes the whole sequence: `full`'s tokens, and no dropped run replayed alone."""
    llm = _engine_on(gemma32, replay_threshold=0.0, **knobs)
    engine = llm.engine
    assert engine.scheduler.replay.recomputes_whole
    # "all": the global layers; auto: the last one
    assert engine.runner.need_layers == (frozenset({5, 11, 17}) if "need_layers" in knobs else frozenset({17}))
    output, chunks = _run(llm, text_ids[:PROMPT])
    assert output.token_ids == full_tokens
    assert output.stats.dropped_tokens > 0 and output.stats.replays >= 1 and output.stats.replay_mismatches == 0
    assert not chunks


def test_the_default_replay_on_the_hybrid_pool_stays_within_its_ratio(gemma32, text_ids):
    """Auto knobs on Gemma: the last global layer read, 2 heavy blocks, the fallback threshold;
    at r=0.25 the sequence holds at most a quarter of its global blocks after its prefill."""
    llm = _engine_on(gemma32, policy="replay", resident_ratio=0.25)
    engine = llm.engine
    assert engine.calibration is not None and engine.calibration.need_layers == (17,)
    assert engine.runner.need_layers == frozenset({17}) and engine.scheduler.replay.threshold == 0.65
    kv, fractions = engine.kv, []

    def step(engine) -> None:
        _checked(engine)
        for seq in engine.scheduler.running:
            if seq.num_uncomputed_tokens == 1:
                blocks = -(-seq.num_computed_tokens // kv.block_size)
                fractions.append(kv.resident_bytes(seq.seq_id) / (blocks * kv.block_bytes))

    output = llm.generate(text_ids[:PROMPT], PARAMS, on_step=step).outputs[0]
    assert output.stats.dropped_tokens > 0 and fractions and max(fractions) <= 0.25 + 1e-9, fractions
    assert kv.num_used_blocks == 0


def test_auto_turns_the_detector_off_where_its_index_would_crowd_a_tight_budget(gemma32):
    """One global layer's index is 3.1% of a dropped block's fp32 K/V (6.25% in bf16): it fits an
    eighth of r = 0.25, not of r = 0.1, where auto reads no layer."""
    from kvreplay.config import EngineConfig
    from kvreplay.engine.calibration import replay_knobs
    engine = gemma32.engine
    args = (engine.model, engine.tokenizer, engine.model_source)
    knobs = dict(model="gemma3-270m", dtype="float32", policy="replay")
    assert replay_knobs(EngineConfig(resident_ratio=0.25, **knobs), *args)[0] == frozenset({17})
    assert replay_knobs(EngineConfig(resident_ratio=0.1, **knobs), *args)[0] == frozenset()


def test_plan_says_when_auto_reads_no_layer(capsys):
    from kvreplay.cli import main
    assert main(["plan", "--model", "gemma3-270m", "--context", "4096", "--resident-ratio", "0.1"]) == 0
    assert "need_layers=17" in (out := capsys.readouterr().out) and "at resident_ratio 0.1, need_layers none" in out
    assert main(["plan", "--model", "gemma3-270m", "--context", "4096", "--resident-ratio", "0.25"]) == 0
    assert "at resident_ratio 0.25, need_layers none" in capsys.readouterr().out  # bf16: 6.25% of a block
    assert main(["plan", "--model", "gemma3-270m", "--context", "4096", "--resident-ratio", "0.5"]) == 0
    assert "need_layers none" not in capsys.readouterr().out


@pytest.mark.parametrize("caching", [True, False])
def test_a_hybrid_replay_takes_back_what_the_prefix_cache_holds_before_recomputing(gemma32, text_ids, full_tokens,
                                                                                   caching):
    """A dropped global page waits in the prefix cache's LRU: a replay takes it back exactly and
    recomputes nothing; with the cache off the sequence is recomputed whole. `full`'s tokens."""
    llm = _engine_on(gemma32, policy="replay", trim="prefill", window_tokens=128, heavy_tokens=0,
                     need_layers="all", replay_threshold=0.0, enable_prefix_caching=caching)
    output, chunks = _run(llm, text_ids[:PROMPT])
    assert output.token_ids == full_tokens and not chunks
    assert output.stats.dropped_tokens > 0 and output.stats.replays >= 1
    assert (output.stats.replayed_tokens == 0) == caching, output.stats


def _flush(kv) -> None:
    """Pressure from elsewhere: take every page the pool can give (its LRU's cached pages go to
    the session tier), then give them back empty."""
    kv.add_sequence(-1)
    tokens = kv.num_free_blocks * kv.block_size
    while tokens and not kv.allocate(-1, tokens):
        tokens -= kv.block_size
    kv.free(-1)


def test_a_hybrid_replay_loads_dropped_global_pages_from_the_session_tier(gemma32, text_ids, full_tokens):
    """The pool flushed once the prompt's middle is dropped: with the tier, its global pages
    (all a dropped block leaves) load instead of the whole sequence being recomputed; without
    it the sequence is recomputed whole. Both give `full`'s tokens."""
    stats = {}
    for memory in ("0", "64MiB"):
        llm = _engine_on(gemma32, policy="replay", trim="prefill", window_tokens=128, heavy_tokens=0,
                         need_layers="all", replay_threshold=0.0, kv_tier_memory=memory)
        engine = llm.engine
        request_id = engine.add_request(text_ids[:PROMPT], PARAMS)
        flushed, done = False, None
        while engine.has_unfinished_requests():
            for output in engine.step():
                done = output if output.finished else done
            _checked(engine)
            seq = engine.requests[request_id].seqs[0] if request_id in engine.requests else None
            if not flushed and seq is not None and engine.kv.dropped_blocks(seq.seq_id):
                _flush(engine.kv)
                flushed = True
                _checked(engine)
        assert flushed and done.outputs[0].token_ids == full_tokens, memory
        stats[memory] = done.outputs[0].stats
    off, on = stats["0"], stats["64MiB"]
    assert off.tier_loaded_tokens == 0 and off.replayed_tokens > 0  # a whole recompute
    assert on.tier_loaded_tokens > 0 and on.replayed_tokens == 0 and on.replay_mismatches == 0
