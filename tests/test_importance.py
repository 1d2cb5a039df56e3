"""The importance signal (kvreplay.kv.importance): what it measures, where it comes from, and the
reclaim order and heavy hitters it drives; the seeds' multi-turn rule; the cold-tier metrics."""
from __future__ import annotations

import pytest
import torch

from kvreplay import LLM, SamplingParams
from kvreplay.layers.attention import AttentionMetadata, ColdAttention, _observe_decode
from kvreplay.engine.scheduler import Scheduler
from kvreplay.engine.sequence import Sequence
from kvreplay.kv.importance import BlockImportance, block_mass
from kvreplay.kv.manager import KVManager
from kvreplay.kv.policy import POLICIES, middle_block_range


def test_block_mass_is_the_largest_share_any_head_and_query_put_on_a_block():
    probs = torch.zeros(2, 2, 8)  # [heads, queries, keys], blocks of 4 keys
    probs[0, 0, 0:2] = 0.25         # head 0 puts 0.5 on block 0 at both queries (a sum would be 1.0)
    probs[0, 1, 3] = 0.5
    probs[0, :, 4] = 0.5            # ... and 0.5 on block 1
    probs[1, 0, 1] = 0.8            # head 1, query 0: 0.8 on block 0, 0.2 on block 1
    probs[1, 0, 7] = 0.2
    probs[1, 1, 5:8] = 1 / 3        # head 1, query 1: all on block 1
    assert block_mass(probs, 4).tolist() == pytest.approx([0.8, 1.0])
    assert block_mass(probs[None], 4).shape == (1, 2)  # leading dims pass through


def test_store_accumulates_grows_copies_and_forgets():
    store = BlockImportance()
    assert store.scores(1, [0, 5]) == [0.0, 0.0]
    store.observe(1, torch.tensor([0, 2]), torch.tensor([0.5, 1.0]))
    store.observe(1, torch.tensor([2, 40]), torch.tensor([0.25, 3.0]))  # grows past 16
    assert store.scores(1, [0, 1, 2, 40, 99]) == [0.5, 0.0, 1.25, 3.0, 0.0]
    assert store.most_important(1, [0, 1, 2, 40], 2) == {40, 2}
    assert store.most_important(1, [0, 1], 0) == set()
    # pooled among the blocks asked about: block 40's 3.0 reaches 39 and 41, block 0's 0.5 does not reach 1
    assert store.scores(1, [1, 2, 39, 40, 41, 42], pool=1) == [1.25, 1.25, 3.0, 3.0, 3.0, 0.0]
    assert store.scores(1, [1, 39, 41], pool=1) == [0.0, 0.0, 0.0]
    assert store.most_important(1, [39, 40, 41, 1, 2], 2, pool=1) == {40, 39}  # the peak, then the older tie
    store.copy(1, 2)
    store.forget(1)
    assert 1 not in store and store.scores(2, [40]) == [3.0]


def test_sparse_decode_observation_lands_on_the_blocks_each_head_read():
    """With a sparse budget every KV head reads its own cold blocks; their mass must go back to
    the right columns of the sequence's cold table, hot mass to the hot table."""
    num_kv, batch, group, block = 2, 1, 1, 2
    meta = AttentionMetadata(slot_mapping=torch.empty(0))
    meta.cold = ColdAttention(torch.zeros(1, 5, dtype=torch.long), torch.ones(1, 5, dtype=torch.bool),
                              pool=None, budget_blocks=1)
    width = 2 * block  # two hot blocks
    probs = torch.zeros(num_kv * batch, group, width + block)
    probs[0, 0, 0] = 0.7   # KV head 0: hot block 0, and its picked cold block (column 3)
    probs[0, 0, width] = 0.3
    probs[1, 0, 3] = 0.1   # KV head 1: hot block 1, and its picked cold block (column 1)
    probs[1, 0, width + 1] = 0.9
    picks = torch.tensor([[[3]], [[1]]])  # [Hkv, B, k]
    _observe_decode(meta, probs, width, num_kv, batch, group, block, picks)
    assert meta.decode_mass.tolist() == [pytest.approx([0.7, 0.1])]
    assert meta.cold_mass.tolist() == [pytest.approx([0.0, 0.9, 0.0, 0.3, 0.0])]


# ---------------------------------------------------------------------------- reclaim order
def _cold_setup(trim_order: str):
    """A replay+cold scheduler on a tiny pool with one decoding sequence whose middle is cold."""
    kv = KVManager(64, 4, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                   enable_prefix_caching=False, cold_dtype="int8")
    scheduler = Scheduler(kv, 256, 8, policy=POLICIES["replay+cold"], window_tokens=8,
                          trim_order=trim_order)
    seq = Sequence("r", list(range(60)), SamplingParams(max_tokens=4), set(), None)
    seq.max_tokens, seq.pinned_tokens = 4, 4
    scheduler.add(seq)
    batch = scheduler.schedule()
    assert batch.prefills == [(seq, 60)]
    seq.num_computed_tokens = 60
    kv.commit(seq.seq_id, seq.token_ids, 60)
    seq.token_ids.append(7)
    scheduler.end_step([seq])  # slides: the middle goes cold
    middle = list(middle_block_range(60, 4, 8, 4))
    assert kv.cold_blocks(seq.seq_id) == middle and len(middle) == 12
    # Importance falls with age reversed: the newest middle block matters least.
    kv.importance.observe(seq.seq_id, torch.tensor(middle), torch.arange(len(middle), 0, -1).float())
    return kv, scheduler, seq, middle


@pytest.mark.parametrize("trim_order", ["importance", "oldest"])
def test_pressure_drops_cold_blocks_in_trim_order(trim_order):
    kv, scheduler, seq, middle = _cold_setup(trim_order)
    scheduler.reclaim.chunked.clear()  # a later step: the prefill chunk no longer shields the sequence
    before = kv.num_used_blocks
    assert scheduler.reclaim.trim_for_room(0, target_used=before - 2)
    kv.check_integrity()
    dropped = [i for i in kv.dropped_blocks(seq.seq_id) if i not in kv.cold_blocks(seq.seq_id)]
    assert 0 < len(dropped) < len(middle)
    expected = middle[-len(dropped):] if trim_order == "importance" else middle[:len(dropped)]
    assert dropped == expected


def test_heavy_hitters_stay_hot_when_the_middle_slides():
    kv = KVManager(64, 4, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                   enable_prefix_caching=False, cold_dtype="int8")
    scheduler = Scheduler(kv, 256, 8, policy=POLICIES["sparse"], window_tokens=8, heavy_tokens=8)
    seq = Sequence("r", list(range(60)), SamplingParams(max_tokens=4), set(), None)
    seq.max_tokens = 4
    scheduler.add(seq)
    scheduler.schedule()
    seq.num_computed_tokens = 60
    kv.commit(seq.seq_id, seq.token_ids, 60)
    seq.token_ids.append(7)
    kv.importance.observe(seq.seq_id, torch.tensor([3, 9]), torch.tensor([5.0, 2.0]))
    scheduler.end_step([seq])
    middle = set(middle_block_range(60, 0, 8, 4))
    assert middle - set(kv.cold_blocks(seq.seq_id)) == {3, 9}  # two blocks = heavy_tokens 8
    kv.check_integrity()


# ---------------------------------------------------------------------------- real model
@pytest.fixture(scope="module")
def corpus(llm32):
    from kvreplay.bench.workload import corpus_token_ids
    return corpus_token_ids(llm32.tokenizer)


def _check(llm):
    return lambda *_: llm.engine.check_integrity()


def test_prefill_observation_ranks_the_planted_fact_first_whole_or_chunked(corpus):
    """The prompt's last queries (the question) rank the blocks holding the planted number among
    the top 4 of ~55 middle blocks; chunked prefill (the masked path) observes the same mass as
    one whole chunk."""
    from kvreplay.bench.quality import QualitySpec, retrieval_cases
    cases = None
    scores = {}
    for chunk in (2048, 256):
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", policy="replay", window_tokens=128,
                  max_num_batched_tokens=chunk, enable_prefix_caching=False)
        cases = cases or retrieval_cases(llm.tokenizer, corpus, QualitySpec(lengths=(1024,), depths=(0.3, 0.7)))
        engine = llm.engine
        for case in cases:
            engine.add_request(case.prompt_token_ids, SamplingParams(max_tokens=2), request_id="p")
            seq = engine.scheduler.waiting[0]
            while seq.num_computed_tokens < len(case.prompt_token_ids):
                engine.step()
                engine.check_integrity()
            middle = list(middle_block_range(seq.num_computed_tokens, seq.pinned_tokens, 128, 16))
            scores[chunk, case.depth] = torch.tensor(engine.kv.importance.scores(seq.seq_id, middle))
            engine.abort_request("p")
            digits = llm.tokenizer(f" is {case.answer}.", add_special_tokens=False).input_ids[2:-1]
            ids = case.prompt_token_ids
            start = next(i for i in range(len(ids)) if ids[i:i + len(digits)] == digits)
            needle = {middle.index(p // 16) for p in range(start, start + len(digits))}
            top4 = set(scores[chunk, case.depth].topk(4).indices.tolist())
            assert needle <= top4, (case.depth, needle, top4)
    for case in cases:
        assert torch.allclose(scores[2048, case.depth], scores[256, case.depth], atol=1e-4)


def test_heavy_tokens_keep_the_fact_hot_so_replay_answers_without_replaying(corpus):
    """trim="prefill" drops the middle; with 32 heavy tokens the fact's blocks stay hot and the
    answer comes without a replay; without them the same case needs one."""
    from kvreplay.bench.quality import QualitySpec, retrieval_cases
    results = {}
    for heavy in (0, 32):
        llm = LLM(dtype="float32", kv_cache_memory="64MiB", policy="replay", trim="prefill",
                  window_tokens=128, need_layers="20-23", heavy_tokens=heavy, replay_threshold=0.65,
                  enable_prefix_caching=False)
        case = retrieval_cases(llm.tokenizer, corpus, QualitySpec(lengths=(1024,), depths=(0.5,)))[0]
        out = llm.generate(case.prompt_token_ids, SamplingParams(max_tokens=8, temperature=0),
                           on_step=_check(llm)).outputs[0]
        assert case.answer in out.text and out.stats.dropped_tokens > 500
        results[heavy] = out.stats
    assert results[0].replays == 1 and results[32].replays == 0
    assert results[32].dropped_tokens == results[0].dropped_tokens - 32


def test_bad_importance_knobs_are_clear_errors():
    for knobs, message in [({"heavy_tokens": -1}, "heavy_tokens"), ({"trim_order": "newest"}, "trim_order"),
                           ({"hot_turns": 1.5}, "hot_turns")]:
        with pytest.raises(ValueError, match=message):
            LLM(dtype="float32", kv_cache_memory="16MiB", **knobs)


# ---------------------------------------------------------------------------- multi-turn rule
def test_last_two_rounds_stay_in_full_precision_under_sparse(corpus):
    """A chat of three rounds under `sparse`: the system prompt and the last two rounds stay hot,
    the first round's middle goes cold."""
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", policy="sparse", window_tokens=64,
              enable_prefix_caching=False)
    text = llm.tokenizer.decode(corpus[:1500])
    chat = [{"role": "system", "content": "You answer briefly."},
            {"role": "user", "content": text[:2400]}, {"role": "assistant", "content": text[2400:3000]},
            {"role": "user", "content": text[3000:4500]}, {"role": "assistant", "content": text[4500:5000]},
            {"role": "user", "content": "Summarize the above."}]
    hot_from = llm.recent_rounds_start(chat)
    assert hot_from == llm.recent_rounds_start(chat, rounds=2) and hot_from > 400
    assert llm.recent_rounds_start(chat, rounds=0) is None
    assert llm.recent_rounds_start(chat[:2]) is None  # one round: nothing older to compress
    seen = []

    def on_step(engine):
        engine.check_integrity()
        for seq in engine.scheduler.running:
            if seq.num_uncomputed_tokens == 1:
                seen.append((seq.hot_from, engine.kv.cold_blocks(seq.seq_id)))

    out = llm.chat(chat, SamplingParams(max_tokens=4, temperature=0), on_step=on_step).outputs[0]
    assert out.stats.cold_blocks > 0
    for start, cold in seen:
        assert start == hot_from and cold and max(cold) < hot_from // 16
    # hot_turns=0: the window alone bounds the hot tail, so later rounds go cold too
    llm0 = LLM(dtype="float32", kv_cache_memory="64MiB", policy="sparse", window_tokens=64,
               enable_prefix_caching=False, hot_turns=0)
    seen.clear()
    llm0.chat(chat, SamplingParams(max_tokens=4, temperature=0), on_step=on_step)
    assert seen and max(seen[-1][1]) >= hot_from // 16


def test_hot_from_is_validated():
    llm = LLM(dtype="float32", kv_cache_memory="16MiB")
    for bad in (-1, 10_000, "3", True):
        with pytest.raises(ValueError, match="hot_from"):
            llm.engine.add_request("Hello there", SamplingParams(max_tokens=1), hot_from=bad)
    assert not llm.engine.has_unfinished_requests()


def test_resident_ratio_caps_each_decoding_sequence(corpus):
    """replay+cold with resident_ratio=0.3: after every step a decoding sequence holds at most
    30% of full's bytes (hot + int8 cold + key index; an int8 slot is ~32% of an fp32 block, so
    cold alone would be ~0.43 here), dropping its least important cold blocks; the output stays
    close to full's."""
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", policy="replay+cold", window_tokens=128,
              resident_ratio=0.3, need_layers="20-23", enable_prefix_caching=False)
    kv = llm.engine.kv
    ratios = []

    def on_step(engine):
        engine.check_integrity()
        for seq in engine.scheduler.running:
            if seq.num_uncomputed_tokens == 1:
                full = -(-seq.num_computed_tokens // kv.block_size) * kv.block_bytes
                ratios.append(kv.resident_bytes(seq.seq_id) / full)

    prompt = corpus[3000:4000]
    out = llm.generate(prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                       on_step=on_step).outputs[0]
    assert ratios and max(ratios) <= 0.3 and min(ratios) > 0.25, ratios
    assert out.stats.cold_blocks > 0 and out.stats.dropped_tokens > 0
    reference = LLM(dtype="float32", kv_cache_memory="64MiB").generate(
        prompt, SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)).outputs[0]
    same = sum(a == b for a, b in zip(out.token_ids, reference.token_ids))
    assert same >= 10, (out.token_ids, reference.token_ids)  # measured: 11 of 12
    with pytest.raises(ValueError, match="resident_ratio"):
        LLM(dtype="float32", kv_cache_memory="16MiB", resident_ratio=1.5)


def test_resident_ratio_waits_after_a_replay_instead_of_replaying_every_token(corpus, llm32):
    """Always-replay (threshold 0) with a resident cap: the replayed middle is kept for
    HOLD_STEPS steps, so 12 tokens cost one replay (trimming right after the redone step
    made the detector fire again at every token) and the output equals full's exactly."""
    from kvreplay.engine.replay import HOLD_STEPS
    assert HOLD_STEPS > 12
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", policy="replay", trim="prefill", window_tokens=128,
              replay_threshold=0.0, resident_ratio=0.3, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompt = corpus[9000:10000]
    out = llm.generate(prompt, params, on_step=_check(llm)).outputs[0]
    assert out.stats.dropped_tokens > 500 and out.stats.replays == 1, out.stats
    assert out.token_ids == llm32.generate(prompt, params).outputs[0].token_ids


def test_replay_hold_judged_cuts_back_to_the_ratio_once_the_redone_token_is_out(corpus, llm32):
    """replay_hold="judged": after a need-replay only the judged block stays beside the ratio's
    choice. At r=0.3 with threshold 0.3 on this prompt the detector fires once (block 51); the
    whole middle is back while the step is redone, then the sequence is cut to the ratio again
    with block 51 hot, the probe skips what the cut took, and no second replay follows. Measured:
    the 24 greedy tokens equal full's, as with the "middle" hold, which stays at 1.0 resident."""
    llm = LLM(dtype="float32", kv_cache_memory="64MiB", policy="replay", trim="prefill", window_tokens=128,
              replay_threshold=0.3, resident_ratio=0.3, replay_hold="judged", enable_prefix_caching=False,
              importance_pool=0)  # (the scenario was pinned with each block scored alone)
    engine = llm.engine
    reclaim, replay = engine.scheduler.reclaim, engine.scheduler.replay
    seen = []  # (resident share, judged blocks, cleared blocks, replays, held) per decoding step

    def on_step(*_):
        engine.check_integrity()
        for seq in engine.scheduler.running:
            if seq.num_uncomputed_tokens == 1:
                held = replay.holds_middle(seq, engine.scheduler.num_steps) or replay.wants_replay(seq)
                seen.append((reclaim.resident_share(seq), set(seq.replay.kept), set(seq.replay.cleared),
                             seq.stats.replays, held))
                if seq.replay.kept and not held:
                    dropped = set(engine.kv.dropped_blocks(seq.seq_id))
                    assert not seq.replay.kept & dropped, "a judged block was cut"
                    assert seq.replay.cleared <= dropped, "the probe skips only blocks the cut took"

    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompt = corpus[9000:10000]
    out = llm.generate(prompt, params, on_step=on_step).outputs[0]
    assert out.stats.replays == 1, out.stats
    fired = [row for row in seen if row[1]]
    assert fired and any(row[4] for row in fired), seen  # held while the replayed step is redone
    after = [row for row in fired if not row[4]]
    assert len(after) >= 10 and all(share <= 0.3 + 1e-6 and cleared for share, _, cleared, _, _ in after), after
    assert max(share for share, *_ in seen) == 1.0  # the whole middle came back for the redone step
    assert out.token_ids == llm32.generate(prompt, params).outputs[0].token_ids
