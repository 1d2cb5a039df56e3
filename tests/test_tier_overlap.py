"""The session tier's split of a missing run (issue 37; docs/architecture.md §4, "Session tier"):
its head recomputed while the tail is read in the background. The cost model's choice first,
then the real model in fp32: the tokens are full's, and the counters show both halves."""
from __future__ import annotations

import pytest

from kvreplay.engine.tier_costs import TierCosts
from tests.test_session_tier import _flush_pool, _run

BLOCK_TOKENS = 16


def _costs(load_per_block: float, recompute_per_block: float, choice: str = "cost") -> TierCosts:
    costs = TierCosts({"memory": 1.0}, choice)
    costs.recompute_tokens_per_second = BLOCK_TOKENS / recompute_per_block
    return costs


def test_the_split_balances_the_two_halves():
    # equal costs: half and half (each half takes n/2 blocks' time instead of n)
    assert _costs(1.0, 1.0).head_blocks(10, 10 * 1.0, BLOCK_TOKENS) == 5
    # reads 3x slower than recompute: recompute 3/4 while the last quarter is read
    assert _costs(3.0, 1.0).head_blocks(8, 8 * 3.0, BLOCK_TOKENS) == 6
    # one side far cheaper: all or nothing
    assert _costs(0.01, 1.0).head_blocks(20, 20 * 0.01, BLOCK_TOKENS) == 0
    assert _costs(100.0, 1.0).head_blocks(20, 20 * 100.0, BLOCK_TOKENS) == 20
    # a split costs one more engine step: a run short against a step is not split
    costs = _costs(1.0, 1.0)
    costs.step_seconds = 4.0
    assert costs.head_blocks(8, 8 * 1.0, BLOCK_TOKENS) in (0, 8)
    assert costs.head_blocks(20, 20 * 1.0, BLOCK_TOKENS) == 10  # 10 + 4 < 20
    # a single block is never split; forced choices do not split
    assert _costs(1.0, 1.0).head_blocks(1, 1.0, BLOCK_TOKENS) in (0, 1)
    assert _costs(1.0, 1.0, "load").head_blocks(10, 10.0, BLOCK_TOKENS) == 0
    assert _costs(1.0, 1.0, "recompute").head_blocks(10, 10.0, BLOCK_TOKENS) == 10


@pytest.mark.parametrize("load,recompute", [(0.5, 1.0), (1.0, 1.0), (2.0, 1.0), (1.0, 7.0)])
@pytest.mark.parametrize("step", [0.0, 3.0])
def test_the_split_is_never_slower_than_either_fixed_choice(load, recompute, step):
    costs = _costs(load, recompute)
    costs.step_seconds = step
    for blocks in range(1, 40):
        head = costs.head_blocks(blocks, blocks * load, BLOCK_TOKENS)
        seconds = max(head * recompute, (blocks - head) * load) + (0 < head < blocks) * costs.step_seconds
        assert seconds <= min(blocks * load, blocks * recompute) + 1e-9


def _split_evenly(llm) -> None:
    """Freeze the loader's rates with a block's read as dear as its recompute: every run splits
    about in half (the rates are measured on this machine otherwise, and loads win)."""
    costs = llm.engine.scheduler.replay.loader.costs
    costs.smoothing, costs.num_prefill_steps = 0.0, 1
    block_bytes = llm.engine.kv.tier_io.tier.block_bytes
    for where in ("memory", "disk"):
        costs.read_seconds_per_byte[where] = 0.01 / block_bytes
    costs.recompute_tokens_per_second = llm.engine.kv.block_size / 0.01


def test_a_returning_chat_recomputes_the_head_while_the_tail_is_read(tmp_path, llm32):
    from kvreplay import LLM, SamplingParams
    params = SamplingParams(max_tokens=8, temperature=0)
    first = list(range(500, 700))
    llm = LLM(dtype="float32", kv_cache_memory="24MiB", kv_tier_dir=str(tmp_path), kv_tier_disk="64MiB")
    _split_evenly(llm)
    reply = llm.generate([first], params)[0].token_ids
    _flush_pool(llm.engine.kv)
    second = first + reply + list(range(800, 840))
    out = llm.generate([second], params, on_step=lambda *_: llm.engine.check_integrity())[0]
    assert out.token_ids == llm32.generate([second], params)[0].token_ids
    stats = out.stats
    assert stats.prefix_hit_tokens == 0
    # 12 tier blocks (192 tokens): 6 recomputed at the head, 6 read meanwhile and loaded
    assert stats.tier_recomputed_tokens == 96 and stats.tier_loaded_tokens == 96
    assert stats.tier_overlapped_tokens == 96 and stats.replay_mismatches == 0


def test_a_replay_recomputes_the_head_while_the_tail_is_read(llm32):
    from kvreplay import LLM, SamplingParams
    prompt = list(range(1000, 1200))
    params = SamplingParams(max_tokens=12, temperature=0)
    want = llm32.generate([prompt], params)[0].token_ids
    llm = LLM(dtype="float32", policy="replay", trim="prefill", window_tokens=32, sink_tokens=4,
              replay_threshold=0, heavy_tokens=0, kv_cache_memory="24MiB", kv_tier_memory="16MiB")
    _split_evenly(llm)
    out = _run(llm, prompt, params, lambda engine, seq: engine.kv.dropped_blocks(seq.seq_id))
    assert out.token_ids == want
    stats = out.stats
    assert stats.replayed_tokens > 0 and stats.tier_overlapped_tokens > 0
    assert stats.tier_loaded_tokens == stats.tier_overlapped_tokens
    # the first replay splits its run about in half
    assert abs(stats.tier_recomputed_tokens - stats.tier_overlapped_tokens) <= 2 * llm.engine.kv.block_size
    assert stats.replay_mismatches == 0


def test_a_pause_forgets_a_tail_being_read(tmp_path, llm32):
    """Two requests outgrow a small pool with the disk tier splitting every resume: paused
    sequences drop their tails read ahead, and the tokens are full's."""
    from kvreplay import LLM, SamplingParams
    prompts = [list(range(1000, 1200)), list(range(2000, 2200))]
    params = SamplingParams(max_tokens=150, temperature=0, ignore_eos=True)
    want = [out.token_ids for out in llm32.generate(prompts, params)]
    llm = LLM(dtype="float32", kv_cache_memory="24MiB", kv_tier_dir=str(tmp_path), kv_tier_disk="64MiB",
              watermarks=(0.8, 0.9, 0.95))
    _split_evenly(llm)
    outs = llm.generate(prompts, params, on_step=lambda *_: llm.engine.check_integrity())
    assert [out.token_ids for out in outs] == want
    paused = [out.stats for out in outs if out.stats.pauses]
    assert paused and paused[0].tier_overlapped_tokens > 0 and paused[0].tier_recomputed_tokens > 0
    assert not llm.engine.scheduler.replay.loader._tails
