"""Continuous batching must not change results: batch invariance, chunked prefill, preemption."""
from __future__ import annotations

import pytest

from kvreplay import LLM, SamplingParams


def _mixed_prompts(tokenizer, real_text: str, count: int) -> list[list[int]]:
    ids = tokenizer(real_text[:120000]).input_ids
    lengths = [7, 300, 45, 610, 12, 150, 33, 480, 90, 5, 260, 700, 18, 120, 390, 64][:count]
    prompts = [ids[i * 997:i * 997 + n] for i, n in enumerate(lengths)]
    assert [len(p) for p in prompts] == lengths
    return prompts


@pytest.fixture(scope="module")
def prompts(llm32, real_text):
    return _mixed_prompts(llm32.tokenizer, real_text, 16)


@pytest.fixture(scope="module")
def alone(llm32, prompts):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    return [llm32.generate(p, params).token_ids for p in prompts]


def _check(engine):
    engine.check_integrity()


def test_batch_of_16_equals_each_alone(llm32, prompts, alone):
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    together = llm32.generate(prompts, params, on_step=_check)
    assert [o.token_ids for o in together] == alone
    assert llm32.engine.kv.num_free_blocks == llm32.engine.kv.num_blocks


def test_chunked_prefill_equals_unchunked(llm32, prompts, alone):
    # A 64-token budget splits every long prompt into many chunks, mixed with other decodes.
    small = LLM(dtype="float32", kv_cache_memory="64MiB", max_num_batched_tokens=64)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    chunked = small.generate(prompts, params, on_step=_check)
    assert [o.token_ids for o in chunked] == alone
    small.engine.check_integrity()


def test_preemption_under_a_tiny_pool_is_exact(llm32, real_text):
    # 96 blocks x 16 = 1,536 tokens. Four ~350-token prompts are admitted together (admit=1.0),
    # then their decodes outgrow the pool: sequences pause and are later replayed exactly.
    ids = llm32.tokenizer(real_text[30000:60000]).input_ids
    prompts = [ids[i * 400:i * 400 + 340 + 7 * i] for i in range(4)]
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    expected = [llm32.generate(p, params).token_ids for p in prompts]
    tiny = LLM(dtype="float32", kv_cache_memory=96 * 16 * 46080, max_num_batched_tokens=512,
               watermarks=(0.9, 1.0, 1.0))
    assert tiny.engine.kv.num_blocks == 96
    outs = tiny.generate(prompts, params, on_step=_check)
    assert tiny.engine.counters.pauses > 0
    assert sum(o.stats.pauses for o in outs) == tiny.engine.counters.pauses
    assert [o.token_ids for o in outs] == expected
    assert tiny.engine.kv.num_free_blocks == 96
