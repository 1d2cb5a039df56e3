"""Kept sessions (engine/sessions.py): a finished request keeps its KV as its policy left it and
the next round extends it. Exact under `full`; SnapKV's evictions stay evicted; replay brings its
dropped ranges back before the next round; kept sessions give way to waiting work; bad calls are
clear errors. A tiny random Llama (conftest.py) on fp32, integrity checked after every step."""
from __future__ import annotations

import pytest

from kvreplay import LLM, SamplingParams
from kvreplay.kv.manager import DROPPED
from token_helpers import seeded_tokens

PARAMS = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


def _llm(model: str, policy: str = "full", memory: str = "4MiB", **knobs) -> LLM:
    return LLM(model=model, dtype="float32", kv_cache_memory=memory, policy=policy, window_tokens=64,
               enable_prefix_caching=False, **knobs)


def _check(engine) -> None:
    engine.check_integrity()


def _all(output) -> list[int]:
    """A finished request's prompt and output tokens: what its next round extends."""
    return output.prompt_token_ids + output.token_ids


def _two_rounds(llm: LLM, first: list[int], follow: list[int]):
    one = llm.generate(first, PARAMS, keep=True, on_step=_check)
    two = llm.generate(_all(one) + follow, PARAMS, continues=[one.request_id], on_step=_check)
    return one, two


def test_full_continues_a_kept_round_exactly(tiny_model):
    """Round 2 over the kept KV gives the tokens of the same prompt computed from scratch, and
    computes only what round 1 had not."""
    llm = _llm(tiny_model)
    first, follow = seeded_tokens(300, 1), seeded_tokens(40, 2)
    one, two = _two_rounds(llm, first, follow)
    assert two.stats.prefix_hit_tokens == len(_all(one)) - 1  # the last sampled token had no K/V
    assert one.stats.prefix_hit_tokens == 0 and one.stats.completion_tokens == 8  # its own counters
    assert not llm.release(two.request_id)  # round 2 was not asked to keep its KV
    fresh = llm.generate(_all(one) + follow, PARAMS, on_step=_check)
    assert two.token_ids == fresh.token_ids
    engine = llm.engine
    assert not engine.sessions and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_snapkv_keeps_its_first_rounds_choice_and_replay_brings_its_middle_back(tiny_model):
    """SnapKV chose its blocks for round 1: round 2 attends without what it evicted (no replay,
    the holes stay). Replay dropped its middle too, and replays it before round 2's tokens."""
    first, follow = seeded_tokens(640, 3), seeded_tokens(48, 4)
    snap = _llm(tiny_model, "snapkv", resident_ratio=0.25)
    one = snap.generate(first, PARAMS, keep=True, on_step=_check)
    holes = [i for i, b in enumerate(snap.engine.kv.block_table(
        snap.engine.sessions.sequences()[0].seq_id)) if b == DROPPED]
    assert one.stats.dropped_tokens > 0 and holes
    two = snap.generate(_all(one) + follow, PARAMS, continues=[one.request_id], keep=True,
                        on_step=_check)
    seq = snap.engine.sessions.sequences()[0]
    table = snap.engine.kv.block_table(seq.seq_id)
    assert all(table[i] == DROPPED for i in holes) and two.stats.replays == 0
    assert snap.release(two.request_id) and not snap.release(two.request_id)

    replay = _llm(tiny_model, "replay", resident_ratio=0.25, trim="prefill", replay_threshold=1.0,
                  heavy_tokens=0)
    one, two = _two_rounds(replay, first, follow)
    assert one.stats.dropped_tokens > 0 and one.stats.replays == 0
    assert two.stats.replays == 1 and two.stats.replayed_tokens == one.stats.dropped_tokens


@pytest.mark.parametrize("policy", ["snapkv", "h2o", "replay"])
def test_a_context_sent_ahead_of_its_question_parks_cut_to_the_ratio(tiny_model, policy):
    """A request that ends as its prefill ends (max_tokens=1: a context sent before its
    question) parks within its policy's ratio, so the cut is chosen without the question; the
    question's round then prefills over the cut KV (replay brings the middle back first)."""
    llm = _llm(tiny_model, policy, resident_ratio=0.25)
    context, question = seeded_tokens(640, 5), seeded_tokens(24, 6)
    one = llm.generate(context, SamplingParams(max_tokens=1, temperature=0), keep=True, on_step=_check)
    engine = llm.engine
    seq = engine.sessions.sequences()[0]
    assert seq.num_computed_tokens == len(context)
    full_blocks = -(-len(context) // engine.kv.block_size)
    assert engine.kv.resident_bytes(seq.seq_id) <= 0.25 * full_blocks * engine.kv.block_bytes + 1e-6
    assert one.stats.dropped_tokens > 0
    two = llm.generate(context + question, PARAMS, continues=[one.request_id], on_step=_check)
    assert len(two.token_ids) == 8 and two.stats.prefix_hit_tokens == len(context)
    assert (two.stats.replays == 1) == (policy == "replay")
    assert not engine.sessions and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_replay_without_a_detector_keeps_no_key_index_and_still_replays_the_next_round(tiny_model):
    """need_layers "none": a dropped block keeps no index slot (the ratio holds more hot blocks)
    and no probe runs, yet the next round still replays the dropped middle before its tokens,
    so its first token, read from that exact prefill, is `full`'s."""
    context, question = seeded_tokens(640, 5), seeded_tokens(24, 6)
    llm = _llm(tiny_model, "replay", resident_ratio=0.25, need_layers="none")
    engine = llm.engine
    assert not engine.runner.detect_need and engine.scheduler.replay.replayable

    def check(engine) -> None:
        engine.check_integrity()
        assert engine.kv.key_index.num_used == 0

    one = llm.generate(context, SamplingParams(max_tokens=1, temperature=0), keep=True, on_step=check)
    seq = engine.sessions.sequences()[0]
    full_blocks = -(-len(context) // engine.kv.block_size)
    hot = sum(b != DROPPED for b in engine.kv.block_table(seq.seq_id))
    assert one.stats.dropped_tokens > 0 and hot == int(0.25 * full_blocks)  # the whole budget is hot
    two = llm.generate(context + question, PARAMS, continues=[one.request_id], on_step=check)
    assert two.stats.replays == 1 and two.stats.replayed_tokens == one.stats.dropped_tokens
    reference = _llm(tiny_model).generate(context + question, PARAMS, on_step=_check)
    assert two.token_ids[0] == reference.token_ids[0]
    assert not engine.sessions and engine.kv.num_free_blocks == engine.kv.num_blocks


def test_kept_sessions_give_way_to_waiting_work(tiny_model):
    """Kept sessions are released oldest first when the pool goes above the high watermark,
    and when a new request could not run otherwise."""
    llm = _llm(tiny_model, memory="1MiB")
    capacity = llm.engine.kv.capacity_tokens
    kept = [llm.generate(seeded_tokens(300, 10 + i), PARAMS, keep=True, on_step=_check).request_id
            for i in range(capacity // 300)]
    assert kept[-1] in llm.engine.sessions and kept[0] not in llm.engine.sessions  # above high
    big = llm.generate(seeded_tokens(capacity - 300, 99), PARAMS, on_step=_check)
    assert big.outputs[0].finish_reason == "length"
    assert not llm.engine.sessions  # all released, for the big one
    with pytest.raises(ValueError, match="no kept session"):
        llm.generate(seeded_tokens(400, 10), PARAMS, continues=[kept[0]])
    for request_id in kept:
        llm.release(request_id)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_bad_continuations_are_clear_errors_and_keep_the_session(tiny_model):
    llm = _llm(tiny_model)
    one = llm.generate(seeded_tokens(100, 5), PARAMS, keep=True)
    with pytest.raises(ValueError, match="no kept session"):
        llm.generate(_all(one) + [5], PARAMS, continues=["nope"])
    with pytest.raises(ValueError, match="does not extend"):
        llm.generate(seeded_tokens(120, 6), PARAMS, continues=[one.request_id])
    with pytest.raises(ValueError, match="does not extend"):  # nothing new to compute
        llm.generate(_all(one)[:-1], PARAMS, continues=[one.request_id])
    with pytest.raises(ValueError, match="n=1"):
        llm.generate(_all(one) + [5], SamplingParams(n=2, max_tokens=4), continues=[one.request_id])
    with pytest.raises(ValueError, match="1 continues values for 2 prompts"):
        llm.generate([[5, 6], [7, 8]], PARAMS, continues=[one.request_id])
    assert one.request_id in llm.engine.sessions  # every refusal left it kept
    two = llm.generate(_all(one) + [5, 6], PARAMS, continues=[one.request_id], on_step=_check)
    assert two.stats.prefix_hit_tokens == len(_all(one)) - 1
    with pytest.raises(ValueError, match="no kept session"):  # continued once already
        llm.generate(_all(one) + [5, 6], PARAMS, continues=[one.request_id])
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_blocks


def test_blocks_computed_without_a_dropped_range_are_not_offered_as_exact(tiny_model):
    """Replay drops the middle after prefill; the 40 tokens decoded next attend without it. A
    later request with the same prompt and output reuses the prompt's blocks from the prefix
    cache, not the decoded ones (they would be approximate K/V served as exact)."""
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="4MiB", policy="replay",
              window_tokens=64, resident_ratio=0.25, trim="prefill", replay_threshold=1.0, heavy_tokens=0)
    prompt = seeded_tokens(640, 7)
    one = llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0, ignore_eos=True), on_step=_check)
    assert one.stats.dropped_tokens > 0 and one.stats.approx_tokens == 39
    two = llm.generate(prompt + one.token_ids[:32], PARAMS, on_step=_check)
    assert two.stats.prefix_hit_tokens == 640


@pytest.mark.parametrize("policy", ["replay", "h2o"])
def test_a_next_rounds_blocks_rank_by_its_own_question_under_replay(tiny_model, policy):
    """Under replay a round's prompt restarts the importance scores: a chat's next round ranks
    its blocks as the same prompt sent fresh would, not by what round 1's answer read (that
    would outrank the block the new question asks for). H2O keeps its running sums."""
    first, follow = seeded_tokens(300, 8), seeded_tokens(40, 9)
    one_token = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)  # no decode step observed

    def scores(llm: LLM) -> list[float]:
        seq = llm.engine.sessions.sequences()[-1]
        return llm.engine.kv.importance.scores(seq.seq_id, list(range(len(llm.engine.kv.block_table(seq.seq_id)))))

    chat = _llm(tiny_model, policy, resident_ratio=1.0, need_layers="none")
    one = chat.generate(first, PARAMS, keep=True, on_step=_check)
    chat.generate(_all(one) + follow, one_token, continues=[one.request_id], keep=True, on_step=_check)
    fresh = _llm(tiny_model, policy, resident_ratio=1.0, need_layers="none")
    fresh.generate(_all(one) + follow, one_token, keep=True, on_step=_check)
    kept, alone = scores(chat), scores(fresh)
    assert len(kept) == len(alone) and sum(alone) > 0
    if policy == "replay":
        assert kept == pytest.approx(alone, abs=1e-5)
    else:  # round 1's prefill and its 8 decode steps still count
        assert sum(kept) > sum(alone) + 1.0
