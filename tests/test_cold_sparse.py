"""Cold tier and sparse attention (docs/architecture.md §4, §6; issue 5) through the engine: demotion, Quest
block selection, the sparse and replay+cold presets. Quantization round trips are pinned in
tests/test_quant.py and tests/test_cold_pool.py."""
from __future__ import annotations

import pytest
import torch

from kvreplay import LLM, SamplingParams
from kvreplay.layers.attention import ColdAttention, _cold_blocks
from kvreplay.kv.cold_pool import ColdPool

PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=1)


@pytest.fixture(scope="module")
def corpus(llm32):
    from kvreplay.bench.workload import corpus_token_ids
    return corpus_token_ids(llm32.tokenizer)


def _llm(policy: str, **knobs) -> LLM:
    knobs = {"kv_cache_memory": "96MiB", "window_tokens": 128, "enable_prefix_caching": False} | knobs
    return LLM(dtype="float32", policy=policy, **knobs)


def _check(llm):
    return lambda *_: llm.engine.check_integrity()


def test_block_selection_picks_the_planted_block():
    torch.manual_seed(0)
    pool = ColdPool(num_layers=1, num_kv_heads=2, block_size=4, head_dim=8, kind="int8")
    keys = torch.randn(1, 2, 10, 4, 8) * 0.3
    query = torch.randn(2, 1, 8)                     # [Hkv, G=1, D], one sequence
    keys[0, 1, 7, 2] = query[1, 0] * 3               # head 1: block 7 holds the matching key
    keys[0, 0, 3, 0] = query[0, 0] * 3               # head 0: block 3
    slots = pool.add(keys, torch.randn(1, 2, 10, 4, 8))
    cold = ColdAttention(torch.tensor([slots]), torch.ones(1, 10, dtype=torch.bool), pool, budget_blocks=1)
    picked_keys, _, valid, picks = _cold_blocks(cold, query.reshape(2, 1, 8), num_kv=2, num_seqs=1, group=1)
    assert valid.all() and cold.selected_blocks == 2 and cold.candidate_blocks == 20
    assert picks.flatten().tolist() == [3, 7]
    expected = pool.dequantize_slots([slots[3], slots[7]])[0][0]  # [Hkv, n, bs, D]
    assert torch.equal(picked_keys[0], expected[0, 0])         # head 0 read block 3
    assert torch.equal(picked_keys[1], expected[1, 1])         # head 1 read block 7


def test_sparse_with_everything_hot_equals_full(llm32, corpus):
    prompt = corpus[500:600]  # shorter than the window: nothing is ever demoted
    llm = _llm("sparse", sparse_budget=64)
    out = llm.generate(prompt, PARAMS, on_step=_check(llm)).outputs[0]
    ref = llm32.generate(prompt, PARAMS).outputs[0]
    assert out.token_ids == ref.token_ids and out.logprobs == ref.logprobs
    assert out.stats.cold_blocks == 0 and out.stats.approx_tokens == 0


def test_budget_covering_every_block_equals_dense_cold_attention(corpus):
    prompt = corpus[8000:8700]
    dense = _llm("sparse", sparse_budget=None)
    covering = _llm("sparse", sparse_budget=4096)  # more than the 35 cold blocks: select them all
    a = dense.generate(prompt, PARAMS, on_step=_check(dense)).outputs[0]
    b = covering.generate(prompt, PARAMS, on_step=_check(covering)).outputs[0]
    assert a.stats.cold_blocks > 30 and a.token_ids == b.token_ids
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.keys() == y.keys() and all(abs(x[t] - y[t]) < 1e-4 for t in x)
    counters = covering.engine.counters
    assert counters.sparse_selected_blocks == counters.sparse_candidate_blocks > 0


def test_int8_cold_tier_keeps_greedy_tokens_and_sparse_budget_selects(llm32, corpus):
    prompts = [corpus[:1000], corpus[3000:3600]]
    ref = llm32.generate(prompts, PARAMS)
    llm = _llm("sparse", sparse_budget=512, cold_dtype="int8")
    outs = llm.generate(prompts, PARAMS, on_step=_check(llm))
    agree = [sum(x == y for x, y in zip(o.outputs[0].token_ids, r.outputs[0].token_ids))
             for o, r in zip(outs, ref)]
    assert min(agree) >= 10, f"int8 cold + 512-token sparse budget agreed on {agree} of 12 tokens"
    counters = llm.engine.counters
    assert 0 < counters.sparse_selected_blocks < counters.sparse_candidate_blocks
    assert outs[0].outputs[0].stats.cold_blocks >= (1000 - 16 - 128) // 16
    assert llm.engine.kv.cold_pool.num_used == 0  # finished: every cold slot returned


def test_replay_cold_under_pressure_drops_cold_blocks_first(corpus):
    """Pressure drops cold blocks (their keys go to the index); the detector (threshold 0:
    always) then replays them in order, and the recomputed K/V match the fingerprints taken from
    the hot originals before demotion. Two heavy-hitter blocks stay hot among them, so the replay
    comes in several runs: the slide between steps must not demote a run already replayed (it
    looped forever)."""
    llm = _llm("replay+cold", replay_threshold=0.0, cold_dtype="int4", heavy_tokens=32)
    engine = llm.engine
    engine.add_request(corpus[2000:2600], SamplingParams(max_tokens=8, temperature=0), request_id="p")
    while not engine.kv.cold_blocks(engine.requests["p"].seqs[0].seq_id):
        engine.step()
    engine.step()  # one decode with the middle cold: no dropped block, nothing to detect
    seq = engine.requests["p"].seqs[0]
    assert seq.stats.replays == 0 and seq.stats.approx_tokens == 1
    cold = engine.kv.cold_blocks(seq.seq_id)
    used = engine.kv.num_used_blocks
    assert engine.scheduler.reclaim.trim_for_room(engine.kv.num_blocks)  # pressure: take all it can
    engine.check_integrity()
    assert engine.kv.cold_blocks(seq.seq_id) == [] and engine.kv.dropped_blocks(seq.seq_id) == cold
    assert engine.kv.num_used_blocks < used and seq.stats.dropped_tokens == len(cold) * 16
    for _ in range(32):  # the replay, then the request's last tokens (the middle goes cold again)
        if not engine.kv.dropped_blocks(seq.seq_id):
            break
        engine.step()
        engine.check_integrity()
    else:
        pytest.fail("the replay never ended")
    assert seq.stats.replays == 1 and seq.stats.replayed_tokens == len(cold) * 16
    assert seq.stats.replay_mismatches == 0
    while engine.has_unfinished_requests():
        engine.step()
        engine.check_integrity()
    assert engine.kv.key_index.num_used == 0 and engine.kv.cold_pool.num_used == 0


def test_bad_cold_knobs_are_clear_errors():
    from kvreplay.config import EngineConfig
    for knobs, message in [({"cold_dtype": "int3"}, "cold_dtype"), ({"sparse_budget": 8}, "sparse_budget"),
                           ({"sparse_budget": "lots"}, "sparse_budget"), ({"dense_layers": -1}, "dense_layers")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(**knobs)
