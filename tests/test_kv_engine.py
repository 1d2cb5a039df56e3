"""The KV manager in the real engine: prefix hits, exact pause/replay, CoW branches, zones."""
from __future__ import annotations

import pytest

from kvreplay import LLM, EngineConfig, SamplingParams

FP32_TOKEN_BYTES = 46080  # SmolLM2-135M: 2 x 30 layers x 3 heads x 64 x 4 bytes


def _check(engine):
    engine.check_integrity()


def test_second_identical_prompt_hits_all_but_the_last_block(llm32, real_text):
    ids = llm32.tokenizer(real_text[5000:9000]).input_ids[:100]  # 6 full blocks + 4 tokens
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = llm32.generate(ids, params, on_step=_check)
    second = llm32.generate(ids, params, on_step=_check)
    assert first.stats.prefix_hit_tokens == 0
    assert second.stats.prefix_hit_tokens == 96
    assert second.token_ids == first.token_ids
    aligned = llm32.generate(ids[:96], params, on_step=_check)  # a hit never covers the last token
    assert aligned.stats.prefix_hit_tokens == 80


def test_multi_turn_chat_reuses_its_history(llm32):
    params = SamplingParams(max_tokens=24, temperature=0)
    history = [{"role": "system", "content": "You are a concise assistant who knows geography."},
               {"role": "user", "content": "Name three rivers in Europe and one fact about each."}]
    turn1 = llm32.chat(history, params, on_step=_check)
    history += [{"role": "assistant", "content": turn1.text},
                {"role": "user", "content": "Which of them is the longest?"}]
    turn2 = llm32.chat(history, params, on_step=_check)
    first_prompt = len(turn1.prompt_token_ids)
    assert turn2.stats.prefix_hit_tokens >= first_prompt // 16 * 16
    assert turn2.prompt_token_ids[:first_prompt] == turn1.prompt_token_ids
    alone = LLM(dtype="float32", kv_cache_memory="32MiB", enable_prefix_caching=False)
    assert alone.chat(history, params).token_ids == turn2.token_ids


def test_pressure_exactness_with_pauses_and_protected_zones(llm32, real_text):
    """8 requests of 600-1,500 tokens in a pool that holds about two: greedy outputs equal the
    unconstrained run, sequences pause and replay, and pinned blocks never move. The prefix
    cache is off so that every dropped token is recomputed (with it on, a resume may find its
    dropped blocks still cached and replay nothing)."""
    ids = llm32.tokenizer(real_text[40000:200000]).input_ids
    lengths = [1345, 928, 1051, 808, 980, 900, 1082, 693]
    prompts = [ids[i * 1600:i * 1600 + n] for i, n in enumerate(lengths)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    expected = [o.token_ids for o in llm32.generate(prompts, params)]

    # Admission projects each prompt whole, so pressure comes from decode growth: admit up to
    # the brim (admit = high = 1.0) so that two decoding sequences overflow it.
    small = LLM(dtype="float32", kv_cache_memory=125 * 16 * FP32_TOKEN_BYTES,
                watermarks=(0.5, 1.0, 1.0), enable_prefix_caching=False)
    engine = small.engine
    assert engine.kv.capacity_tokens == 2000
    pins: dict[int, list[int]] = {}

    def check(engine):
        engine.check_integrity()
        for seq in engine.scheduler.running:  # protected blocks stay put while it runs
            blocks = engine.kv.pinned_blocks(seq.seq_id)
            if len(blocks) == engine.kv.num_pinned_blocks(seq.seq_id):
                assert pins.setdefault(seq.seq_id, blocks) == blocks

    outs = small.generate(prompts, params, on_step=check, protected_tokens=40)
    assert [o.token_ids for o in outs] == expected
    stats = [o.stats for o in outs]
    assert engine.counters.pauses == sum(s.pauses for s in stats) >= 2
    assert sum(s.replays for s in stats) > 0
    assert sum(s.replayed_tokens for s in stats) == sum(s.dropped_tokens for s in stats) > 0
    assert sum(s.preemptions for s in stats) == 0  # every pause kept the protected head
    assert engine.kv.num_used_blocks == 0


def test_n_branches_share_prompt_blocks_and_match_separate_runs(llm32, real_text):
    ids = llm32.tokenizer(real_text[70000:80000]).input_ids[:200]  # 12 full blocks + 8
    small = LLM(dtype="float32", kv_cache_memory="16MiB")
    kv = small.engine.kv
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, n=4, ignore_eos=True)
    out = small.generate(ids, params, on_step=_check)
    # 4 x 13 blocks if nothing were shared; sharing needs 13 plus one per branch's partial block.
    assert kv.peak_used_blocks == 13 + 3
    assert kv.num_cow_copies == 3
    for branch, completion in enumerate(out.outputs):
        single = llm32.generate(ids, SamplingParams(max_tokens=8, temperature=1.0, seed=11 + branch,
                                                    ignore_eos=True))
        assert completion.token_ids == single.token_ids, branch


def test_chat_protects_the_system_span(llm32):
    default = [{"role": "user", "content": "hi"}]
    explicit = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    tok = llm32.tokenizer
    span = llm32.system_span_tokens(explicit)
    assert tok.decode(llm32.chat_prompt_ids(explicit)[:span]) == "<|im_start|>system\nBe brief.<|im_end|>\n"
    span = llm32.system_span_tokens(default)
    assert tok.decode(llm32.chat_prompt_ids(default)[:span]).endswith("Hugging Face<|im_end|>\n")
    engine = llm32.engine
    request_id = engine.add_request(llm32.chat_prompt_ids(explicit), SamplingParams(max_tokens=2),
                                    protected_tokens=llm32.system_span_tokens(explicit))
    assert engine.requests[request_id].seqs[0].pinned_tokens == 8
    engine.abort_request(request_id)
    engine.check_integrity()


def test_protected_span_errors(llm32):
    with pytest.raises(ValueError, match="longer than the prompt"):
        llm32.generate([1, 2, 3], SamplingParams(max_tokens=2), protected_tokens=5)
    with pytest.raises(ValueError, match="protected_tokens must be"):
        llm32.generate([1, 2, 3], SamplingParams(max_tokens=2), protected_tokens=-1)
    tiny = LLM(dtype="float32", kv_cache_memory=4 * 16 * FP32_TOKEN_BYTES)  # 64 tokens
    with pytest.raises(ValueError, match="protected span has 70 tokens.*holds 64"):
        tiny.engine.add_request(list(range(70)), SamplingParams(max_tokens=1), protected_tokens=70)
    assert not llm32.engine.has_unfinished_requests()


@pytest.mark.parametrize("kwargs, message", [
    ({"watermarks": (0.9, 0.7, 0.85)}, "low <= admit <= high"),
    ({"watermarks": "0.6,0.7"}, "three fractions"),
    ({"watermarks": "low,mid,high"}, "cannot parse watermarks"),
    ({"sink_tokens": -4}, "sink_tokens"),
    ({"pause_mode": "swap"}, "pause_mode"),
    ({"enable_prefix_caching": "yes"}, "enable_prefix_caching"),
])
def test_bad_kv_knobs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


@pytest.mark.parametrize("prompt_slice", [slice(90000, 92000), slice(3000, 5000)])
def test_beam_search_matches_transformers_num_beams(llm32, hf_reference, real_text, prompt_slice):
    import torch
    ids = llm32.tokenizer(real_text[prompt_slice]).input_ids[:120]
    kv = llm32.engine.kv
    assert kv.num_used_blocks == 0
    kv.peak_used_blocks = 0
    out = llm32.generate(ids, SamplingParams(max_tokens=12, beam_width=4), on_step=_check)
    with torch.no_grad():
        expected = hf_reference.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                         max_new_tokens=12, num_beams=4, do_sample=False,
                                         pad_token_id=2)[0, len(ids):].tolist()
    assert out.token_ids == expected
    assert len(out.outputs) == 1 and out.finish_reason in ("length", "stop")
    one_beam = -(-(len(ids) + 12) // 16)  # 9 blocks; the beams share the prompt's 7
    assert kv.peak_used_blocks <= 2 * one_beam  # 4 unshared beams would take 4x (measured: 14-15)
