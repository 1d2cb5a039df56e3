"""trim="admission" (the default): a request that waits because the pool is above `admit` makes
decoding sequences drop their least attended middle blocks, instead of waiting for them to end."""
from __future__ import annotations

import pytest

from kvreplay import LLM, SamplingParams
from kvreplay.config import EngineConfig


@pytest.fixture(scope="module")
def corpus(llm32):
    from kvreplay.bench.workload import corpus_token_ids
    return corpus_token_ids(llm32.tokenizer)


def _run(trim: str, prompts: list[list[int]]):
    # fp32 SmolLM2: 46,080 bytes a token, 48MiB = 68 blocks of 16; admit at 0.7 = 47 blocks, so
    # one 500-token prompt (32 blocks) runs alone unless the other's middle leaves the pool.
    llm = LLM(dtype="float32", kv_cache_memory="48MiB", policy="replay", trim=trim, window_tokens=64,
              replay_threshold=1.0, need_layers="all", heavy_tokens=0, max_num_batched_tokens=256,
              enable_prefix_caching=False)
    peak = [0]

    def check(*_):
        llm.engine.check_integrity()
        peak[0] = max(peak[0], llm.engine.num_running)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True),
                           on_step=check)
    assert llm.engine.kv.num_used_blocks == 0
    return outputs, peak[0]


def test_a_waiting_request_gets_room_from_the_middles_of_decoding_ones(corpus):
    prompts = [corpus[1000:1500], corpus[5000:5500]]
    waited, peak_waited = _run("pressure", prompts)
    made_room, peak_made_room = _run("admission", prompts)
    assert peak_waited == 1 and peak_made_room == 2
    assert all(out.outputs[0].stats.dropped_tokens == 0 for out in waited)
    first = made_room[0].outputs[0].stats
    assert first.dropped_tokens > 0 and first.replays == 0
    assert made_room[1].outputs[0].stats.dropped_tokens == 0  # it never had to make room
    assert all(len(out.outputs[0].token_ids) == 24 for out in made_room)


def test_trim_modes_and_the_default():
    assert EngineConfig().trim == "admission"
    with pytest.raises(ValueError, match="trim"):
        EngineConfig(trim="eventually")
