"""The published eviction methods as presets (docs/architecture.md §6, issue 36): snapkv, h2o,
window and quest at a `resident_ratio`, and replay's cut to the ratio at prefill. Block choices
are pinned on tiny pools with planted importance; the engine runs use a tiny random Llama."""
from __future__ import annotations

import pytest
import torch

from kvreplay import LLM, EngineConfig, SamplingParams
from kvreplay.engine.scheduler import Scheduler
from kvreplay.engine.sequence import Sequence
from kvreplay.kv.manager import DROPPED, KVManager
from kvreplay.kv.policy import POLICIES, quest_selection, recent_window_tokens
from kvreplay.layers.selection import HotSelection, mask_unselected

BLOCK = 8
PROMPT = 160  # 20 blocks of 8: block 0 holds the 4 sinks, blocks 16-19 the last 32 tokens
# Planted importance of middle blocks 1-15: distinct, not ordered by position.
SCORES = {index: float((index * 7) % 15 + 1) for index in range(1, 16)}


def _top(count: int, among=SCORES) -> set[int]:
    return set(sorted(among, key=lambda i: -among[i])[:count])


def _hot(kv: KVManager, seq: Sequence) -> list[int]:
    return [i for i, block in enumerate(kv.block_table(seq.seq_id)) if block != DROPPED]


def _prefilled(policy: str, ratio: float | None, trim: str = "pressure", window_tokens: int = 32,
               heavy_tokens: int = 0, pool: int = 0):
    """A scheduler on a tiny pool with one 160-token prompt just prefilled, its middle blocks
    scored SCORES by the prefill observation, and the step's trim done."""
    kv = KVManager(64, BLOCK, num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32,
                   enable_prefix_caching=False)
    scheduler = Scheduler(kv, 512, 8, policy=POLICIES[policy], window_tokens=window_tokens,
                          trim=trim, resident_ratio=ratio, heavy_tokens=heavy_tokens)
    scheduler.reclaim.importance_pool = pool
    seq = Sequence("r", list(range(PROMPT)), SamplingParams(max_tokens=16), set(), None)
    seq.max_tokens, seq.pinned_tokens = 16, 4
    scheduler.add(seq)
    assert scheduler.schedule().prefills == [(seq, PROMPT)]
    seq.num_computed_tokens = PROMPT
    seq.token_ids.append(7)
    kv.importance.observe(seq.seq_id, list(SCORES), torch.tensor(list(SCORES.values())))
    scheduler.end_step([seq])
    kv.check_integrity()
    return kv, scheduler, seq


def _decode(kv: KVManager, scheduler: Scheduler, seq: Sequence, mass: dict[int, float] | None = None):
    """One decode step of `seq` (its attention observed as `mass`), then the step's trim."""
    assert scheduler.schedule().decodes == [seq]
    seq.num_computed_tokens += 1
    seq.token_ids.append(7)
    if mass:
        kv.importance.observe(seq.seq_id, list(mass), torch.tensor(list(mass.values())))
    scheduler.end_step([])
    kv.check_integrity()


# ---------------------------------------------------------------------------- which blocks stay
def test_snapkv_keeps_sinks_observation_window_and_the_most_attended_middle():
    """r=0.5 of 20 blocks: 10 = sinks' block + the 4 blocks of the last 32 tokens + the 5 middle
    blocks with the most observed attention; the rest is evicted for good (no key index)."""
    kv, scheduler, seq = _prefilled("snapkv", 0.5)
    assert _hot(kv, seq) == sorted({0, 16, 17, 18, 19} | _top(5))
    assert kv.key_index.num_used == 0 and kv.indexed_blocks(seq.seq_id) == []
    assert seq.stats.dropped_tokens == 10 * BLOCK
    assert scheduler.reclaim.resident_share(seq) == 0.5
    # Decoded tokens are appended without further eviction, whatever they attend to.
    for _ in range(2 * BLOCK):
        _decode(kv, scheduler, seq, {19: 5.0})
    assert _hot(kv, seq) == sorted({0, 16, 17, 18, 19, 20, 21} | _top(5))
    # Memory pressure pauses (as full does) instead of evicting more.
    assert not scheduler.reclaim.trim_for_room(kv.num_blocks)


def test_importance_pool_keeps_the_neighbours_of_the_most_attended_blocks():
    """importance_pool=1: a block scores the largest of its and its neighbours' mass, so a fact
    straddling a block boundary keeps both halves. The top block is 2 (15); unpooled, its
    neighbours 1 and 3 (8 and 7) lose to blocks 4, 6, 8 and 10; pooled, blocks 1-3 score 15 and
    4-5 score 14 (block 4's own, block 5 beside it)."""
    assert _top(5) == {2, 4, 6, 8, 10}
    kv, _, seq = _prefilled("snapkv", 0.5, pool=1)
    assert _hot(kv, seq) == [0, 1, 2, 3, 4, 5, 16, 17, 18, 19]
    assert EngineConfig(importance_pool=2).importance_pool == 2 and EngineConfig().importance_pool == "auto"
    with pytest.raises(ValueError, match="importance_pool"):
        EngineConfig(importance_pool=-1)


def test_h2o_evicts_the_least_accumulated_attention_after_every_step():
    """r=0.5: the recent window is half the budget beyond the sinks (4 blocks), heavy hitters
    the other 5; one token later a block leaves the window and the least attended middle
    block (prefill observation + decode steps) is evicted to make room."""
    kv, scheduler, seq = _prefilled("h2o", 0.5)
    heavy = _top(5)
    assert _hot(kv, seq) == sorted({0, 16, 17, 18, 19} | heavy)
    # 161 tokens: 21 blocks, budget 10; window = blocks 17-20, so block 16 joins the middle.
    # The decode step put 100 on block 16 and 9 on the weakest heavy hitter: the next weakest goes.
    weakest, second = sorted(heavy, key=lambda i: SCORES[i])[:2]
    _decode(kv, scheduler, seq, {16: 100.0, weakest: 9.0})
    assert _hot(kv, seq) == sorted({0, 16, 17, 18, 19, 20} | heavy - {second})
    assert kv.key_index.num_used == 0 and scheduler.reclaim.resident_share(seq) <= 0.5
    assert not scheduler.reclaim.trim_for_room(kv.num_blocks)


def test_window_at_a_ratio_sizes_the_window_to_the_budget():
    """r=0.25 of 20 blocks: the sinks' block and the last 4 blocks; at 10% of 4,096 tokens
    (256 blocks): the sinks' block and 24 recent blocks."""
    kv, scheduler, seq = _prefilled("window", 0.25, window_tokens=512)
    assert _hot(kv, seq) == [0, 16, 17, 18, 19]
    window = POLICIES["window"]
    assert recent_window_tokens(window, 4096, 4, 16, 512, 0.1) == 24 * 16
    assert recent_window_tokens(window, 4096, 4, 16, 512, None) == 512  # no ratio: window_tokens
    # It slides: one block later the window is the last 4 blocks again (budget still 5 of 21).
    for _ in range(BLOCK):
        _decode(kv, scheduler, seq)
    assert _hot(kv, seq) == [0, 17, 18, 19, 20] and kv.key_index.num_used == 0


def test_replay_at_a_ratio_cuts_the_prompt_to_it_keeping_snapkvs_blocks():
    """trim="prefill" with r=0.5 drops middle blocks (keys kept) least attended first only down
    to r: SnapKV's ranking; the key index's bytes count in the budget, so it keeps 3 of SnapKV's
    5 (an index slot is 1/8 of a block here). Without a ratio the whole middle goes."""
    kv, scheduler, seq = _prefilled("replay", 0.5, trim="prefill")
    assert _hot(kv, seq) == sorted({0, 16, 17, 18, 19} | _top(3))
    assert sorted(kv.dropped_blocks(seq.seq_id)) == sorted(set(SCORES) - _top(3))
    assert kv.key_index.num_used == 12
    assert 0.5 - 1 / 20 <= scheduler.reclaim.resident_share(seq) <= 0.5
    kv, scheduler, seq = _prefilled("replay", None, trim="prefill")
    assert _hot(kv, seq) == [0, 16, 17, 18, 19]


def test_replays_heavy_hitters_count_inside_its_ratio():
    """Heavy hitters (here 8 blocks, more than r=0.5 leaves for the middle beside the sinks, a
    window of half the budget and the key index) do not lift replay above its ratio: the cap
    drops the least attended of them too, and what stays of the middle is the most attended."""
    kv, scheduler, seq = _prefilled("replay", 0.5, heavy_tokens=8 * BLOCK)
    for _ in range(2):
        _decode(kv, scheduler, seq)
    assert scheduler.reclaim.resident_share(seq) <= 0.5
    kept = set(_hot(kv, seq)) & set(SCORES)
    assert kept and kept == _top(len(kept))


def test_quest_selection_budget():
    quest = POLICIES["quest"]
    # 4,096 tokens at 10%: 25 blocks = the sinks' block, the block being written, 23 chosen.
    assert quest_selection(quest, 4096, 4, 16, 0.1) == (range(1, 255), 23)
    assert quest_selection(quest, 4097, 4, 16, 0.1) == (range(1, 256), 23)
    assert quest_selection(quest, 4096, 4, 16, 1.0)[1] == 254  # everything: no selection


def test_quest_masks_all_but_each_heads_top_blocks_by_bound():
    """Two KV heads, one sequence, 6 blocks of 4 keys; middle blocks 1-4, 2 read per head. Each
    head's query matches keys planted in its own two blocks: only those (and blocks 0 and 5)
    keep their scores, and the result is attention over exactly those keys."""
    torch.manual_seed(0)
    num_kv, block, width, dim = 2, 4, 6, 8
    keys = torch.randn(num_kv, width, block, dim) * 0.1
    query = torch.randn(num_kv, 1, dim)                          # [Hkv*B, G=1, D]
    planted = {0: (1, 3), 1: (2, 4)}
    for head, blocks in planted.items():
        for b in blocks:
            keys[head, b, 1] = query[head, 0] * 2
    flat = keys.view(num_kv, width * block, dim)
    scores = torch.bmm(query, flat.transpose(1, 2))              # [Hkv, 1, 24]
    selection = HotSelection(torch.tensor([[False, True, True, True, True, False]]), torch.tensor([2]))
    masked = scores.clone()
    mask_unselected(selection, query, flat, masked, num_kv, 1, block)
    for head, blocks in planted.items():
        read = {0, 5, *blocks}
        for b in range(width):
            row = masked[head, 0, b * block:(b + 1) * block]
            assert torch.isinf(row).all() == (b not in read), (head, b)
            if b in read:
                assert torch.equal(row, scores[head, 0, b * block:(b + 1) * block])
    assert selection.candidate_blocks == 8 and selection.selected_blocks == 4


# ---------------------------------------------------------------------------- the engine
PARAMS = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
BASELINES = {"snapkv": {}, "h2o": {}, "window": {}, "quest": {},
             "replay": {"trim": "prefill", "replay_threshold": 1.0, "heavy_tokens": 0}}


def _llm(model: str, policy: str = "full", **knobs) -> LLM:
    return LLM(model=model, dtype="float32", kv_cache_memory="4MiB", policy=policy, window_tokens=64,
               enable_prefix_caching=False, **knobs)


def _prompts(count: int = 2) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(100, 40000, (600 + 37 * i,), generator=generator).tolist() for i in range(count)]


@pytest.fixture(scope="module")
def full_tokens(tiny_model) -> list[list[int]]:
    return [o.token_ids for o in _llm(tiny_model).generate(_prompts(), PARAMS)]


@pytest.mark.parametrize("policy", BASELINES)
def test_budget_of_everything_gives_full_exactly(tiny_model, full_tokens, policy):
    llm = _llm(tiny_model, policy, resident_ratio=1.0, **BASELINES[policy])
    outs = llm.generate(_prompts(), PARAMS, on_step=lambda engine: engine.check_integrity())
    assert [o.token_ids for o in outs] == full_tokens
    assert all(o.stats.dropped_tokens == 0 and o.stats.replays == 0 for o in outs)


@pytest.mark.parametrize("policy", BASELINES)
@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_resident_share_after_prefill_is_r_within_a_block(tiny_model, policy, ratio):
    """After the step that ends each prompt's prefill its resident (quest: attended) share is
    within one block under r; it never replays (replay: threshold 1, never needed); snapkv's
    kept middle is the top of the prefill observation, h2o's the top of what it accumulated."""
    llm = _llm(tiny_model, policy, resident_ratio=ratio, **BASELINES[policy])
    engine = llm.engine
    reclaim, kv = engine.scheduler.reclaim, engine.kv
    shares = {}

    def on_step(engine):
        engine.check_integrity()
        for seq in engine.scheduler.running:
            if seq.num_uncomputed_tokens != 1:
                continue
            num_blocks = -(-seq.num_computed_tokens // kv.block_size)
            if seq.num_output_tokens == 1:  # this step ended the prefill
                shares[seq.request_id] = (reclaim.resident_share(seq), num_blocks)
            if policy in ("snapkv", "h2o"):
                _assert_kept_most_attended(kv, reclaim, seq)

    outs = llm.generate(_prompts(), PARAMS, on_step=on_step)
    assert len(shares) == 2
    for share, num_blocks in shares.values():
        assert ratio - 1 / num_blocks <= share <= ratio + 1e-9, (share, num_blocks)
    assert all(o.stats.replays == 0 for o in outs)
    if policy == "quest":
        assert all(o.stats.dropped_tokens == 0 for o in outs)  # everything stays: full's memory
    else:
        assert all(o.stats.dropped_tokens > 0 for o in outs)
    if policy != "replay":
        assert kv.key_index.num_used == 0 and kv.peak_index_bytes == 0  # evicted for good


def _assert_kept_most_attended(kv, reclaim, seq) -> None:
    """Every hot middle block scores at least as high as every evicted one that could be back
    in the middle (snapkv: at the prefill observation, before decode steps add to it)."""
    hot = [i for i, block in enumerate(kv.block_table(seq.seq_id)) if block != DROPPED]
    middle = set(reclaim.middle(seq))
    evicted = [i for i in kv.dropped_blocks(seq.seq_id) if i < max(middle, default=0)]
    if not evicted or not middle or seq.num_output_tokens > 1:
        return
    scores = dict(zip(hot + evicted, kv.importance.scores(seq.seq_id, hot + evicted)))
    assert min(scores[i] for i in middle) >= max(scores[i] for i in evicted)


def test_quest_attends_within_its_budget_and_keeps_everything(tiny_model):
    llm = _llm(tiny_model, "quest", resident_ratio=0.25)
    selections = []
    runner = llm.engine.runner
    original = runner._hot_selection

    def spy(decodes, width):
        selection = original(decodes, width)
        selections.append(selection)
        return selection

    runner._hot_selection = spy
    out = llm.generate(_prompts(1)[0], PARAMS, on_step=lambda engine: engine.check_integrity())
    assert len(selections) == PARAMS.max_tokens - 1 and all(s is not None for s in selections)
    num_layers, num_kv = 2, 2
    for selection in selections:  # each layer and KV head read exactly keep_blocks middle blocks
        keep = int(selection.keep_blocks[0])
        assert selection.selected_blocks == keep * num_layers * num_kv
        assert selection.candidate_blocks > 3 * selection.selected_blocks
    assert out.stats.dropped_tokens == 0 and len(out.token_ids) == PARAMS.max_tokens


# ---------------------------------------------------------------------------- errors
@pytest.mark.parametrize("policy", ["snapkv", "h2o", "quest"])
def test_budget_presets_need_a_ratio(policy):
    with pytest.raises(ValueError, match=f"policy='{policy}'.*set resident_ratio"):
        EngineConfig(policy=policy)
    for bad in (0, 1.5, "half"):
        with pytest.raises(ValueError, match="resident_ratio"):
            EngineConfig(policy=policy, resident_ratio=bad)
    assert EngineConfig(policy=policy, resident_ratio=0.1).kv_policy.needs_ratio


def test_planner_knows_the_baselines():
    from kvreplay.planner import KVDims, PlanKnobs, plan
    dims = KVDims(num_layers=30, num_kv_heads=3, head_dim=64)
    request = plan(dims, 4096, PlanKnobs(resident_ratio=0.1), policies=["full", "snapkv", "h2o", "quest"])
    assert [p.hot_blocks for p in request.policies] == [256, 25, 25, 256]
    assert request.policy("snapkv").resident_bytes == 25 * request.block_bytes
    assert request.policy("quest").resident_bytes == request.full_bytes
    assert plan(dims, 4096, PlanKnobs(resident_ratio=0.001), policies=["snapkv"]).policies[0].hot_blocks == 3
    with pytest.raises(ValueError, match="--resident-ratio"):
        plan(dims, 4096, policies=["h2o"])


def test_a_prompts_last_chunk_keeps_its_observed_queries():
    from kvreplay.kv.importance import OBSERVED_QUERIES, prompt_chunk
    snapkv = POLICIES["snapkv"]
    assert prompt_chunk(512, snapkv, 511) == 512 - OBSERVED_QUERIES  # not 511, leaving 1 for a decode row
    assert prompt_chunk(768, snapkv, 512) == 512 and prompt_chunk(40, snapkv, 40) == 40
    assert prompt_chunk(20, snapkv, 19) == 18 and prompt_chunk(20, snapkv, 1) == 1  # never 1 left
    assert prompt_chunk(512, POLICIES["full"], 511) == 511  # nothing observed: chunks as before


def test_snapkv_cuts_every_prompt_of_a_batch(tiny_model):
    """Two 768-token prompts on a 512-token step budget: the second one's prefill would have
    ended on a one-token decode row, which skipped its observation and its cut."""
    llm = _llm(tiny_model, "snapkv", resident_ratio=0.25, max_num_batched_tokens=512)
    prompts = [torch.randint(100, 40000, (768,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(2)]
    outs = llm.generate(prompts, PARAMS, on_step=lambda engine: engine.check_integrity())
    assert [o.stats.dropped_tokens for o in outs] == [576, 576]  # 48 blocks cut to 12
