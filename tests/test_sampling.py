"""Sampling knobs on the real model: seeds, top-k/top-p, stops, max_tokens, logprobs, n."""
from __future__ import annotations

import math

import pytest
import torch

from kvreplay import SamplingParams
from kvreplay.sampling import sample

PROMPT = "Once upon a time, in a quiet village,"


def _check(engine):
    engine.check_integrity()


def test_seed_is_reproducible_whatever_runs_beside_it(llm32):
    params = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=1234)
    alone = llm32.generate(PROMPT, params).token_ids
    noisy = SamplingParams(max_tokens=16, temperature=1.0)
    batch = llm32.generate(["The weather today", PROMPT, "def main():"],
                           [noisy, params, noisy], on_step=_check)
    assert batch[1].token_ids == alone
    other = llm32.generate(PROMPT, SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=99))
    assert other.token_ids != alone  # a different seed explores a different path


def test_top_k_1_is_greedy(llm32):
    greedy = llm32.generate(PROMPT, SamplingParams(max_tokens=12, temperature=0))
    top1 = llm32.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.5, top_k=1, seed=5))
    assert top1.token_ids == greedy.token_ids


def test_sampler_respects_top_k_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    seen_k, seen_p = set(), set()
    for seed in range(200):
        g = torch.Generator().manual_seed(seed)
        seen_k.add(int(sample(logits, [SamplingParams(temperature=1.0, top_k=2)], [g])[0]))
        g = torch.Generator().manual_seed(seed)
        seen_p.add(int(sample(logits, [SamplingParams(temperature=1.0, top_p=0.7)], [g])[0]))
    assert seen_k == {0, 1}
    assert seen_p == {0, 1}  # 0.5 < 0.7, so the second token is needed, the third is not


def test_stop_string_is_excluded_and_ends_generation(llm32):
    free = llm32.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
    words = free.text.split()
    stop = words[len(words) // 2]
    out = llm32.generate(PROMPT, SamplingParams(max_tokens=40, temperature=0, stop=[stop],
                                                ignore_eos=True))
    assert out.finish_reason == "stop"
    assert stop not in out.text
    assert free.text.startswith(out.text)
    assert len(out.token_ids) < len(free.token_ids)


def test_stop_token_ids_and_max_tokens(llm32):
    free = llm32.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert free.finish_reason == "length" and len(free.token_ids) == 10
    stop_id = free.token_ids[4]
    out = llm32.generate(PROMPT, SamplingParams(max_tokens=10, temperature=0,
                                                stop_token_ids=[stop_id]))
    first = free.token_ids.index(stop_id)
    assert out.token_ids == free.token_ids[:first + 1] and out.finish_reason == "stop"


def test_eos_stops_unless_ignored(llm32):
    conv = [{"role": "user", "content": "Say hello."}]
    out = llm32.chat(conv, SamplingParams(max_tokens=64, temperature=0))
    assert out.finish_reason == "stop" and out.token_ids[-1] == 2  # <|im_end|>
    longer = llm32.chat(conv, SamplingParams(max_tokens=len(out.token_ids) + 3, temperature=0,
                                             ignore_eos=True))
    assert longer.token_ids[:len(out.token_ids)] == out.token_ids
    assert len(longer.token_ids) == len(out.token_ids) + 3 and longer.finish_reason == "length"


def test_logprobs_are_top_k_of_the_real_distribution(llm32):
    out = llm32.generate(PROMPT, SamplingParams(max_tokens=5, temperature=0, logprobs=3))
    assert len(out.logprobs) == 5
    for token, entry in zip(out.token_ids, out.logprobs):
        assert token in entry and len(entry) == 3  # greedy token is the top-1
        assert max(entry, key=entry.get) == token
        assert all(v <= 0 for v in entry.values())
        assert sum(math.exp(v) for v in entry.values()) <= 1.0 + 1e-5
    sampled = llm32.generate(PROMPT, SamplingParams(max_tokens=5, temperature=1.0, seed=3, logprobs=0))
    assert [list(e) for e in sampled.logprobs] == [[t] for t in sampled.token_ids]


def test_n_returns_independent_seeded_branches(llm32):
    params = SamplingParams(max_tokens=12, temperature=1.0, seed=7, n=3)
    out = llm32.generate(PROMPT, params, on_step=_check)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    # Branch i uses seed + i: branch 0 equals a single run with the same seed.
    single = llm32.generate(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=7))
    assert out.outputs[0].token_ids == single.token_ids


@pytest.mark.parametrize("kwargs, message", [
    ({"max_tokens": -1}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"temperature": -0.1}, "temperature"),
    ({"top_k": -5}, "top_k"),
    ({"n": 0}, "n must"),
    ({"logprobs": 50}, "logprobs"),
    ({"stop": [""]}, "stop"),
    ({"seed": -1}, "seed"),
    ({"max_tokens": "10"}, "max_tokens"),
])
def test_bad_sampling_params_are_clear_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_greedy_steps_take_the_lm_heads_argmax():
    """A step whose every sampling sequence is plain greedy asks the model for tokens (the LM head
    keeps each row's maximum instead of storing logits): the tokens are those of the logits path
    bit for bit. A sampled request, logprobs or n > 1 in the batch keep the logits."""
    from kvreplay import LLM
    llm = LLM(dtype="bfloat16", kv_cache_memory="32MiB", enable_prefix_caching=False)
    engine = llm.engine
    runner_run, argmax_only = engine.runner.run, type(engine)._argmax_only
    flags = []
    engine.runner.run = lambda batch, greedy=False: flags.append(greedy) or runner_run(batch, greedy=greedy)
    prompts = ["The weather today", PROMPT, "def main():", "1, 2, 3,"]
    greedy = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    try:
        fast = [o.token_ids for o in llm.generate(prompts, greedy, on_step=_check)]
        assert flags and all(flags)
        flags.clear()
        engine._argmax_only = lambda batch: False  # the logits path, as sampling takes it
        slow = [o.token_ids for o in llm.generate(prompts, greedy, on_step=_check)]
        assert not any(flags)
        assert fast == slow
        del engine._argmax_only
        for other in (SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True),
                      SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True)):
            flags.clear()
            outs = llm.generate(prompts[:2], [greedy, other], on_step=_check)
            assert len(flags) >= 10 and not any(flags)  # the other request's rows need logits every step
            assert outs[0].token_ids == fast[0]
        flags.clear()
        forked = llm.generate(prompts[:2], [greedy, SamplingParams(max_tokens=10, temperature=0, n=2, ignore_eos=True)])
        assert flags[0] is False  # the branches take their first tokens from the prompt's logits...
        assert all(flags[1:])  # ... then every row is plain greedy
        assert [c.token_ids for c in forked[1].outputs] == [fast[1]] * 2
    finally:
        engine.runner.run = runner_run
    assert argmax_only is type(engine)._argmax_only
