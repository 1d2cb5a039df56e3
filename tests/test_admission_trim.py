"""trim="admission" (the default): a request that waits because the pool is above `admit` makes
decoding sequences drop their least attended middle blocks, instead of waiting for them to end."""
from __future__ import annotations

import pytest

from kvreplay import LLM, SamplingParams
from kvreplay.config import EngineConfig
from token_helpers import seeded_tokens


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


def test_room_made_for_a_request_may_evict_its_prefix_hits_and_admission_looks_again(tiny_model):
    """Found by the server soak (an engine-loop TypeError, then 503s): dropping a middle to admit
    a request takes key-index blocks from the pool, which evicted cached blocks the request's
    prefix match had just named; adopting them failed. A seeded random run that hit it."""
    import random
    rng = random.Random(4)
    assert (rng.choice([8, 16]), rng.choice(["64KiB", "96KiB", "128KiB", "192KiB"])) == (8, "128KiB")
    llm = LLM(model=tiny_model, dtype="float32", policy="replay", kv_cache_memory="128KiB", block_size=8,
              window_tokens=16, sink_tokens=4, max_num_seqs=8)
    engine = llm.engine
    capacity = engine.kv.num_blocks * 8
    bases = [seeded_tokens(rng.randrange(8, 48), 1040 + i) for i in range(3)]
    trims = 0
    for step in range(300):
        if rng.random() < 0.3 and len(engine.requests) < 8:
            base = rng.choice(bases) if rng.random() < 0.7 else []
            prompt = (base + seeded_tokens(rng.randrange(4, max(5, capacity // 2)), 4000 + step))[: capacity // 2]
            engine.add_request(prompt, SamplingParams(max_tokens=rng.randrange(4, 40), temperature=0,
                                                      ignore_eos=True))
        if engine.has_unfinished_requests():
            for out in engine.step():
                trims += out.outputs[0].stats.dropped_tokens > 0 if out.finished else 0
            engine.check_integrity()
    assert trims > 0  # admissions did drop middles
