"""Lossy policies on Gemma 3 270M (fp32, real model) over the hybrid pool: they drop blocks from
the global layers' table only, by their own rules, while the local layers keep their window and
read it by true position (engine/local_meta.py). Prompts of 700 tokens with small budgets so
that blocks really are dropped; the settings Gemma refuses are in tests/test_gemma3.py."""
from __future__ import annotations

import pytest
import torch

from kvreplay import SamplingParams
from kvreplay.kv.policy import middle_block_range, ratio_blocks
from kvreplay.kv.tiers import DROPPED
from tests.test_gemma3 import _checked, _engine_on

PROMPT, PARAMS = 700, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
FIRST_GLOBAL = 5  # layers 0-4 are local and see nothing a global layer computed


def _dropped(kv, seq_id: int) -> set[int]:
    return {index for index, block in enumerate(kv.block_table(seq_id)) if block == DROPPED}


def _run(llm, prompt: list[int], on_step=None) -> tuple:
    """Greedy tokens of `llm` on `prompt`, every step checked (and handed to `on_step`), and
    the deltas of layers 0..FIRST_GLOBAL at each decode step. Nothing is left in the pool."""
    model, records = llm.engine.model, []
    layer = model.layer

    def recording(index, *args):
        out = layer(index, *args)
        if args[0].shape[0] == 1 and index <= FIRST_GLOBAL:  # a decode step of one sequence
            records.append((index, out[0].clone()))
        return out

    def step(engine) -> None:
        _checked(engine)
        if on_step is not None:
            on_step(engine)

    model.layer = recording
    try:
        output = llm.generate(prompt, PARAMS, on_step=step)
    finally:
        del model.layer
    kv = llm.engine.kv
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_blocks and not kv.local.tables
    return output, records


@pytest.fixture(scope="module")
def full_run(gemma32, text_ids):
    """`full` on a fresh pool (no prefix hit from another test: the same chunks as the others)."""
    return _run(_engine_on(gemma32), text_ids[:PROMPT])


@pytest.fixture(scope="module")
def window_run(gemma32, text_ids):
    """`window` with sinks of one block and 128 recent tokens over the 700-token prompt: after
    each step the global table has dropped exactly the middle, and each local group holds the
    blocks its next query's window reads. Returns the run and the dropped counts per step."""
    llm = _engine_on(gemma32, policy="window", window_tokens=128, sink_tokens=16)
    kv, dropped_counts = llm.engine.kv, []

    def step(engine) -> None:
        for seq_id in kv.local.tables:
            num_tokens = kv.num_slots(seq_id)
            if num_tokens < PROMPT:  # prefilling: nothing dropped yet
                assert not _dropped(kv, seq_id)
                continue
            assert _dropped(kv, seq_id) == set(middle_block_range(num_tokens, 16, 128, 16))
            held = [column for column, page in enumerate(kv.local.tables[seq_id][0]) if page != DROPPED]
            assert held == list(range(kv.local.first_needed(num_tokens), -(-num_tokens // 16)))
            dropped_counts.append(len(_dropped(kv, seq_id)))

    return _run(llm, text_ids[:PROMPT], step), dropped_counts


@pytest.mark.parametrize("knobs", [{"policy": "window", "window_tokens": 2048},
                                   {"policy": "snapkv", "resident_ratio": 1.0},
                                   {"policy": "h2o", "resident_ratio": 1.0},
                                   {"policy": "quest", "resident_ratio": 1.0},
                                   {"policy": "sparse", "window_tokens": 2048}],
                         ids=["window", "snapkv", "h2o", "quest", "sparse"])
def test_nothing_to_drop_gives_fulls_tokens(gemma32, text_ids, full_run, knobs):
    output, _ = _run(_engine_on(gemma32, **knobs), text_ids[:PROMPT])
    assert output.stats.dropped_tokens == 0
    assert output.token_ids == full_run[0].token_ids


def test_window_drops_the_global_middle_only(window_run):
    (output, _), dropped_counts = window_run
    # 700 tokens: blocks 1 .. 34 are wholly older than the last 128 tokens (the sinks' block 0
    # and 35 .. 43 stay), and one more leaves as the decode reaches 704 tokens
    assert dropped_counts[:5] == [34] * 4 + [35]
    assert len(dropped_counts) == PARAMS.max_tokens - 1  # the last step frees the sequence
    assert output.stats.dropped_tokens == 16 * dropped_counts[-1]


def _same_local_deltas(run, full_run) -> None:
    """Layers 0-4 (local, before any global layer) give the same deltas at every decode step as
    under `full`; layer 5, global, does not: the policy changed what the global layers read,
    while the local layers still read their windows at true positions."""
    (output, records), (full, full_records) = run, full_run
    assert output.token_ids == full.token_ids  # the same inputs at every decode step
    assert [index for index, _ in records] == [index for index, _ in full_records]
    assert len(records) == 6 * (PARAMS.max_tokens - 1)
    for (index, ours), (_, theirs) in zip(records, full_records):
        if index < FIRST_GLOBAL:
            assert torch.equal(ours, theirs), f"local layer {index} changed"
    first_global = next(i for i, (index, _) in enumerate(full_records) if index == FIRST_GLOBAL)
    assert not torch.equal(records[first_global][1], full_records[first_global][1])


def test_local_layers_see_no_global_drop(full_run, window_run):
    _same_local_deltas(window_run[0], full_run)


def test_sparse_demotes_the_global_middle_and_attends_to_its_best_blocks(gemma32, text_ids, full_run):
    """sparse (int8, 4 cold blocks a step) with a 128-token window: the global middle goes cold as
    it leaves the window, nothing is dropped, the cold tier holds the global layers only, and
    the local layers read their windows as under full."""
    llm = _engine_on(gemma32, policy="sparse", window_tokens=128, sink_tokens=16, sparse_budget=64)
    kv = llm.engine.kv
    assert kv.cold_pool.num_layers == len(kv.storages) == 3

    def step(engine) -> None:
        for seq_id in kv.local.tables:
            num_tokens = kv.num_slots(seq_id)
            cold = kv.cold_blocks(seq_id)
            assert cold == (list(middle_block_range(num_tokens, 16, 128, 16)) if num_tokens >= PROMPT else [])
            assert _dropped(kv, seq_id) == set(cold) and kv.cold_pool.num_used == len(cold)

    run = _run(llm, text_ids[:PROMPT], step)
    assert run[0].stats.cold_blocks > 0 and kv.cold_pool.num_used == 0
    _same_local_deltas(run, full_run)


def test_quest_reads_a_share_of_the_global_blocks(gemma32, text_ids, full_run):
    """quest at r = 0.3 keeps every block; each decode step's global layers read a subset of the
    middle, the local layers their windows as under full."""
    llm = _engine_on(gemma32, policy="quest", resident_ratio=0.3)
    kv = llm.engine.kv

    def step(engine) -> None:
        assert not any(_dropped(kv, seq_id) for seq_id in kv.local.tables)

    _same_local_deltas(_run(llm, text_ids[:PROMPT], step), full_run)


def test_snapkv_keeps_the_most_observed_middle_blocks(gemma32, text_ids, full_run):
    """snapkv at r = 0.3: when the prompt's prefill ends its global middle is cut to 13 of 44
    blocks, the least observed first, and decoding drops nothing more."""
    llm = _engine_on(gemma32, policy="snapkv", resident_ratio=0.3)
    kv, cuts = llm.engine.kv, []

    def step(engine) -> None:
        for seq_id in kv.local.tables:
            dropped = _dropped(kv, seq_id)
            if not dropped:
                continue
            if not cuts:
                middle = middle_block_range(PROMPT, 4, 32, 16)  # sinks' block; last 32 tokens
                kept = [i for i in middle if i not in dropped]
                scores = dict(zip(middle, kv.importance.scores(seq_id, list(middle))))
                assert dropped <= set(middle)
                assert max(scores[i] for i in dropped) <= min(scores[i] for i in kept)
                assert len(kv.resident_blocks(seq_id)) == ratio_blocks(PROMPT, 16, 0.3) == 13
            cuts.append(dropped)

    run = _run(llm, text_ids[:PROMPT], step)
    assert len(cuts) == PARAMS.max_tokens - 1 and all(cut == cuts[0] for cut in cuts)
    assert run[0].stats.dropped_tokens == 16 * len(cuts[0])
    _same_local_deltas(run, full_run)


def test_h2o_fits_the_ratio_after_every_step(gemma32, text_ids, full_run):
    """h2o at r = 0.3: after every step the sequence holds at most r of its blocks, and what a
    step newly drops had no more accumulated attention than any middle block it kept."""
    llm = _engine_on(gemma32, policy="h2o", resident_ratio=0.3)
    engine, seen = llm.engine, [set()]

    def step(engine) -> None:
        kv, reclaim = engine.kv, engine.scheduler.reclaim
        for seq in engine.scheduler.running:
            dropped = _dropped(kv, seq.seq_id)
            if seq.num_uncomputed_tokens != 1:
                continue
            assert len(kv.resident_blocks(seq.seq_id)) <= ratio_blocks(seq.num_computed_tokens, 16, 0.3)
            new = dropped - seen[-1]
            kept = [i for i in reclaim.middle_range(seq) if i not in dropped]
            if new and kept:
                scores = kv.importance.scores(seq.seq_id, sorted(new) + kept)
                assert max(scores[:len(new)]) <= min(scores[len(new):])
            seen.append(dropped)

    run = _run(llm, text_ids[:PROMPT], step)
    assert len(seen[1]) > 0 and len(seen[-1]) > len(seen[1])  # cut at prefill, then as it grew
    _same_local_deltas(run, full_run)
    assert engine.kv.num_used_blocks == 0


def _two_rounds(llm, text_ids) -> tuple[list[int], list[tuple[int, torch.Tensor]]]:
    """A kept 700-token round, then a 200-token next round over it: the second round's tokens
    and the deltas of layers 0..FIRST_GLOBAL while it ran, every step checked."""
    model, records = llm.engine.model, []
    layer = model.layer

    def recording(index, *args):
        out = layer(index, *args)
        if index <= FIRST_GLOBAL:
            records.append((index, out[0].clone()))
        return out

    one = llm.generate(text_ids[:PROMPT], PARAMS, keep=True, on_step=_checked)
    model.layer = recording
    try:
        two = llm.generate(one.prompt_token_ids + one.token_ids + text_ids[PROMPT:PROMPT + 200], PARAMS,
                           continues=[one.request_id], on_step=_checked)
    finally:
        del model.layer
    assert llm.engine.kv.num_used_blocks == 0 and not llm.engine.kv.local.tables
    return two.token_ids, records


def test_a_next_round_over_the_windows_holes(gemma32, text_ids):
    """A kept session under `window` continues with a new round: its prefill attends to the
    global blocks left (approximately) while the local layers read their windows at true
    positions, so layers 0-4 compute what they compute under full, prefill and decode."""
    window = _engine_on(gemma32, policy="window", window_tokens=128, sink_tokens=16)
    tokens, records = _two_rounds(window, text_ids)
    # a fresh pool: a prefix hit on gemma32's earlier runs would chunk the first round otherwise,
    # and fp32 products of other row counts round differently
    full_tokens, full_records = _two_rounds(_engine_on(gemma32), text_ids)
    # the global layers' holes may change a token: compare the steps whose inputs agree (the
    # round's prefill, then a decode step per equal token)
    agree = next((i for i, (a, b) in enumerate(zip(tokens, full_tokens)) if a != b), len(tokens))
    assert agree >= 1 and len(records) == len(full_records)
    compared = (1 + agree) * (FIRST_GLOBAL + 1)
    for (index, ours), (_, theirs) in zip(records[:compared], full_records[:compared]):
        if index < FIRST_GLOBAL:
            assert torch.equal(ours, theirs), f"local layer {index} changed"


def test_window_under_pressure_on_a_small_hybrid_pool(gemma32, text_ids):
    """Five 40-token requests decoding 50 tokens under `window` (16 tokens) on a 172-page pool
    (as test_pauses_on_a_small_hybrid_pool under full): the global middles slide out, the local
    windows outgrow the pool and sequences pause and resume, every step consistent, nothing leaked."""
    small = _engine_on(gemma32, policy="window", window_tokens=16, kv_cache_memory=172 * 98304)
    prompts = [text_ids[i * 300:i * 300 + 40] for i in range(5)]
    outputs = small.generate(prompts, SamplingParams(max_tokens=50, temperature=0, ignore_eos=True),
                             on_step=_checked)
    assert all(len(output.token_ids) == 50 for output in outputs)
    assert sum(output.stats.pauses for output in outputs) > 0
    assert all(output.stats.dropped_tokens > 0 for output in outputs)
    kv = small.engine.kv
    assert kv.num_used_blocks == 0 and kv.num_free_blocks == kv.num_blocks
