"""Determinism (issue 40): one request gives the same tokens and the same per-request counters
whatever else is in the batch and whatever the number of torch threads, for every policy under
the same budget (`resident_ratio`, a pool the others do not press). A tiny random Llama
(conftest.py) in fp32.

Which counters are the request's own (docs/architecture.md §5, "Per-request counters"):
- defined by the request alone, in a pool the batch does not press: its tokens,
  `completion_tokens`, `dropped_tokens`, `replays`, `replayed_tokens`, `cold_blocks`,
  `approx_tokens` and `replay_mismatches` (every decision that moves its blocks reads only its
  own attention, length and budget), checked here together with `pauses` and `preemptions`
  (0 in such a pool);
- depending on the others by design: `pauses` and `preemptions` once the batch presses the pool
  (and then under a policy that trims under pressure the blocks a trim or pause takes, hence its
  approximate tokens), `prefix_hit_tokens` (what other requests left in the prefix cache) and
  the session tier's counters (its cost model reads measured rates). Under `full` the tokens stay
  equal under pressure too: a pause is replayed exactly (the last test).
"""
from __future__ import annotations

import pytest
import torch

from kvreplay import LLM, SamplingParams
from token_helpers import seeded_tokens

OWN_COUNTERS = ("completion_tokens", "dropped_tokens", "replays", "replayed_tokens", "cold_blocks",
                "approx_tokens", "replay_mismatches", "pauses", "preemptions")
BUDGETS = {"full": None, "window": 0.5, "replay": 0.5, "replay+cold": 0.5, "snapkv": 0.5, "h2o": 0.5,
           "sparse": None, "quest": 0.5}
TARGET = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=40, temperature=0.9, seed=7, ignore_eos=True)


def _others(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Random company: prompts of 20-400 tokens, greedy and sampled, n up to 2."""
    rng = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, 1 << 30, (5, 4), generator=rng).tolist()
    return [(seeded_tokens(20 + a % 380, b), SamplingParams(max_tokens=8 + c % 40, temperature=0.8 * (d % 2),
                                                         n=1 + (d // 2) % 2, ignore_eos=True))
            for a, b, c, d in draws]


def _run(model: str, policy: str, threads: int, company: int | None, memory: str = "16MiB",
         params: SamplingParams = TARGET, late: bool = False, target_tokens: int = 360):
    """The target's output when run alone (`company` None) or among `_others(company)`, which
    start with it or, `late`, 10 steps before it; and the pauses of the whole run."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        llm = LLM(model=model, dtype="float32", kv_cache_memory=memory, policy=policy,
                  resident_ratio=BUDGETS[policy], window_tokens=32, replay_threshold=0.3,
                  max_num_batched_tokens=256)
        engine = llm.engine
        if company is not None:
            for prompt, params_ in _others(company):
                engine.add_request(prompt, params_)
            for _ in range(10 if late else 0):
                engine.step()
        target = engine.add_request(seeded_tokens(target_tokens, 99), params)
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                done[out.request_id] = out
            engine.check_integrity()
        return done[target], engine.counters.pauses
    finally:
        torch.set_num_threads(previous)


def _own(run) -> dict:
    out, _ = run
    stats = out.outputs[0].stats.as_dict()
    return {"tokens": out.token_ids, **{name: stats[name] for name in OWN_COUNTERS}}


@pytest.mark.parametrize("policy", list(BUDGETS))
def test_a_request_is_the_same_alone_among_others_and_on_any_thread_count(tiny_model, policy):
    alone = _own(_run(tiny_model, policy, 1, None))
    assert alone["completion_tokens"] == TARGET.max_tokens and alone["pauses"] == 0
    if policy not in ("full", "quest"):  # the budget acted on it (quest keeps every block)
        assert alone["dropped_tokens"] + alone["cold_blocks"] > 0, alone
    if policy in ("replay", "replay+cold"):
        assert alone["replays"] > 0, alone  # and the need detector brought blocks back
    # (company that starts late on one thread, company from the start on two: the three things
    # that may not matter, in two runs)
    runs = {(1, "late"): _run(tiny_model, policy, 1, company=4, late=True),
            (2, "others"): _run(tiny_model, policy, 2, company=5)}
    for key, out in runs.items():
        assert _own(out) == alone, f"{policy}, {key}"


@pytest.mark.parametrize("policy", ["full", "snapkv", "h2o"])
def test_a_seeded_sampled_request_is_the_same_among_others(tiny_model, policy):
    alone = _own(_run(tiny_model, policy, 1, None, params=SAMPLED))
    assert _own(_run(tiny_model, policy, 2, company=6, params=SAMPLED)) == alone


def test_under_pressure_full_keeps_its_tokens_while_pauses_depend_on_the_others(tiny_model):
    """A pool the batch overfills: sequences are paused (pauses count the batch's pressure, not
    the request), and `full` replays them exactly: the target's tokens are its tokens alone."""
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    alone, alone_pauses = _run(tiny_model, "full", 1, None, memory="256KiB", params=params, target_tokens=100)
    for late in (False, True):
        pressed, pauses = _run(tiny_model, "full", 1, company=3, memory="256KiB", params=params, late=late,
                               target_tokens=100)
        assert alone_pauses == 0 and pauses > 0
        assert pressed.token_ids == alone.token_ids
