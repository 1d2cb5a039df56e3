"""A randomized state machine over the real engine (issue 40): Hypothesis drives an `LLM` on a tiny
random Llama (conftest.py `tiny_model`, fp32) with tiny pools through random requests (length,
shared prefixes, n, beam search, stop strings, max_tokens, seeded temperature, protected spans),
aborts, steps, forced needs (the detector's threshold at 0 for one step), forced fingerprint
mismatches (a dropped block's stored fingerprint perturbed) and kept sessions (keep, continue,
release), one policy and pool size per run. After every engine step it checks the invariants
below; when the run ends it drains the engine and checks that the pool is whole again.

Invariants (`Checks`): `check_integrity()`; every block is either free or referenced, never
both; the KV manager tracks exactly the live sequences (running, waiting, kept), so every pinned
block belongs to one; hot + cold + key-index bytes fit the pool; a sequence under a
`resident_ratio` is within it after the step its policy promises it (or has nothing left to cut);
fingerprint mismatches happen only where the test perturbed a fingerprint; under `full`, every
greedy, beam or seeded request gives the tokens of the same request run alone in a roomy pool;
drained, the pool's free count is its size and the prefix cache holds only unreferenced blocks.

CI runs a bounded slice (`CI_EXAMPLES` runs of up to `CI_STEPS` rules). The long run:

    KVREPLAY_FSM_LONG=10000 TORCH_EXTENSIONS_DIR=... python -m pytest -q tests/test_engine_machine.py -s

runs machines until that many engine steps were taken (one Hypothesis seed per round: set
KVREPLAY_FSM_SEED to start elsewhere) and prints the steps, examples and wall time.
A failure shrinks to a minimal reproducer; each one found is a plain test at the end of this file.
"""
from __future__ import annotations

import os
import time
from collections import Counter
import pytest
import torch
import hypothesis
from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, initialize, invariant, precondition, rule,
                                 run_state_machine_as_test)

from kvreplay import LLM, SamplingParams
from kvreplay.engine.beam import worst_case_blocks
from kvreplay.kv.policy import middle_block_range
from kvreplay.kv.tiers import DROPPED
from token_helpers import seeded_tokens as _tokens

CI_EXAMPLES, CI_STEPS = 12, 30
LONG_STEPS = int(os.environ.get("KVREPLAY_FSM_LONG", "0"))  # engine steps of the long run (0: CI slice)
POLICIES = ("full", "window", "replay", "replay+cold", "snapkv", "h2o")
# 512 bytes of K/V per token (2 layers x 2 KV heads x 16 dims x K and V x fp32): 256KiB holds
# 512 tokens, 4MiB 8,192 (the model's context is 2,048); the small ones press the pool.
MEMORIES = ("128KiB", "256KiB", "256KiB", "512KiB", "1MiB", "4MiB")
MAX_CONTEXT = 2047
SHARED = torch.randint(100, 40000, (256,), generator=torch.Generator().manual_seed(1234)).tolist()
STOPS = (None, "e", ["a", "."], "the")


class References:
    """The same request alone in a roomy pool, per block size: what `full` must reproduce."""

    def __init__(self, model: str):
        self.model = model
        self._llms: dict[int, LLM] = {}
        self._outputs: dict[tuple, list[list[int]]] = {}

    def tokens(self, block_size: int, prompt: list[int], params: SamplingParams, protected: int) -> list[list[int]]:
        key = (block_size, tuple(prompt), repr(params), protected)
        if key not in self._outputs:
            llm = self._llms.get(block_size)
            if llm is None:
                llm = self._llms[block_size] = LLM(model=self.model, dtype="float32", kv_cache_memory="8MiB",
                                                   block_size=block_size, enable_prefix_caching=False)
            out = llm.generate(prompt, params, protected_tokens=protected)
            self._outputs[key] = [completion.token_ids for completion in out.outputs]
        return self._outputs[key]


class EngineMachine(RuleBasedStateMachine):
    """One engine per run (policy, pool, block size, budget drawn at `build`); see the module
    docstring for the rules and invariants."""

    model: str = ""                      # set by the test (the tiny model's directory)
    references: References | None = None
    total_steps = 0                      # engine steps over every run (the long run reports it)
    tally: Counter = Counter()           # what the runs exercised (printed by the tests)

    def __init__(self):
        super().__init__()
        self.llm: LLM | None = None
        self.clean = True       # False while a rule or check is under way (teardown skips the drain)
        self.live: dict[str, tuple[list[int], SamplingParams, int, bool]] = {}  # prompt, params, protected, keep
        self.kept: dict[str, list[int]] = {}  # kept request id -> its prompt + output tokens
        self.perturbed = 0      # fingerprints this run perturbed
        self.next_seed = 0

    # ------------------------------------------------------------------ setup
    @initialize(policy=st.sampled_from(POLICIES), memory=st.sampled_from(MEMORIES),
                block_size=st.sampled_from((8, 16)), ratio=st.sampled_from((None, 0.25, 0.5, 0.5)),
                threshold=st.sampled_from((0.65, 0.2)), hold=st.sampled_from(("judged", "middle")),
                trim=st.sampled_from(("admission", "pressure", "prefill")), caching=st.booleans(),
                layered=st.booleans(), batched=st.sampled_from((32, 64, 256)), max_seqs=st.sampled_from((2, 4, 8)),
                detector=st.sampled_from(("all", "all", "all", "none")))
    def build(self, policy, memory, block_size, ratio, threshold, trim, caching, layered, batched, max_seqs,
              hold="middle", detector="all"):
        if policy in ("snapkv", "h2o") and ratio is None:
            ratio = 0.5
        self.llm = LLM(model=self.model, dtype="float32", kv_cache_memory=memory, block_size=block_size,
                       policy=policy, resident_ratio=ratio, trim=trim, enable_prefix_caching=caching,
                       layered_prefill=layered, window_tokens=32, max_num_batched_tokens=batched,
                       max_num_seqs=max_seqs, replay_threshold=threshold, replay_hold=hold, seed=0,
                       need_layers=detector)  # "none": replay with no detector and no key index
        self.engine = self.llm.engine
        self.capacity = min(self.engine.kv.capacity_tokens, MAX_CONTEXT)

    # ------------------------------------------------------------------ rules
    @precondition(lambda self: len(self.live) < 6)
    @rule(length=st.integers(1, 300), shared=st.sampled_from((0, 0, 8, 24, 64)), max_tokens=st.integers(1, 40),
          n=st.sampled_from((1, 1, 1, 2, 3)), beam=st.sampled_from((1, 1, 1, 1, 2)), stop=st.sampled_from(STOPS),
          temperature=st.sampled_from((0.0, 0.0, 0.8)), seeded=st.booleans(), ignore_eos=st.booleans(),
          protected=st.sampled_from((0, 0, 5, 20)), keep=st.booleans())
    def add(self, length, shared, max_tokens, n, beam, stop, temperature, seeded, ignore_eos, protected, keep):
        self.clean = False
        length = max(1, min(length, self.capacity - max_tokens - shared))
        prompt = SHARED[:shared] + _tokens(length, self.next_seed)
        self.next_seed += 1
        if beam > 1:
            n, stop, temperature = 1, None, 0.0
        if worst_case_blocks(len(prompt), max_tokens, beam, self.engine.kv.block_size) > self.engine.kv.num_blocks:
            beam = 1  # (refused when added: test_beams_that_cannot_fit_the_pool_are_refused)
        keep = keep and n == 1 and beam == 1
        params = SamplingParams(max_tokens=max_tokens, n=n, beam_width=beam, stop=stop, temperature=temperature,
                                seed=1000 + self.next_seed if seeded else None, ignore_eos=ignore_eos)
        protected = min(protected, len(prompt))
        request_id = self.engine.add_request(prompt, params, protected_tokens=protected, keep=keep)
        self.live[request_id] = (prompt, params, protected, keep)
        self.clean = True

    @rule(count=st.integers(1, 16))
    def step(self, count):
        self.clean = False
        for _ in range(count):
            self._step()
        self.clean = True

    @precondition(lambda self: self.live)
    @rule(pick=st.integers(0, 5), after=st.integers(0, 8))
    def abort(self, pick, after):
        """Abort a live request `after` engine steps (if it is still live then)."""
        self.clean = False
        for _ in range(after):
            self._step()
        if not self.live:
            self.clean = True
            return
        request_id = sorted(self.live)[pick % len(self.live)]
        out = self.engine.abort_request(request_id)
        EngineMachine.tally["aborted"] += 1
        # (branches that ended before the abort keep their reason)
        assert out is not None and all(c.finish_reason in ("abort", "stop", "length") for c in out.outputs)
        assert any(c.finish_reason == "abort" for c in out.outputs)
        del self.live[request_id]
        self.clean = True

    @precondition(lambda self: self.kept)
    @rule(pick=st.integers(0, 5), length=st.integers(1, 60), max_tokens=st.integers(1, 16), keep=st.booleans(),
          release=st.booleans())
    def continue_or_release(self, pick, length, max_tokens, keep, release):
        """The next round of a kept session (its tokens + new ones), or its release."""
        self.clean = False
        request_id = sorted(self.kept)[pick % len(self.kept)]
        before = self.kept[request_id]
        if release or len(before) + 1 + max_tokens > self.capacity:
            was_kept = request_id in self.engine.sessions  # (or released to make room meanwhile)
            assert self.engine.release(request_id) == was_kept
            assert not self.engine.release(request_id)
            del self.kept[request_id]
        else:
            prompt = before + _tokens(min(length, self.capacity - len(before) - max_tokens), self.next_seed)
            self.next_seed += 1
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            if request_id not in self.engine.sessions:  # released to make room meanwhile
                with pytest.raises(ValueError, match="no kept session"):
                    self.engine.add_request(prompt, params, continues=request_id)
            else:
                new_id = self.engine.add_request(prompt, params, keep=keep, continues=request_id)
                EngineMachine.tally["continued"] += 1
                self.live[new_id] = (prompt, params, 0, keep)
            del self.kept[request_id]
        self.clean = True

    @precondition(lambda self: self.llm is not None and self.engine.config.kv_policy.replays_on_need)
    @rule()
    def force_need(self):
        """The detector's threshold at 0 for one step: every decoding sequence with an indexed
        dropped block replays them all, then redoes its step."""
        self.clean = False
        replay = self.engine.scheduler.replay
        threshold, replay.threshold = replay.threshold, 0.0
        try:
            self._step()
        finally:
            replay.threshold = threshold
        EngineMachine.tally["forced needs"] += 1
        self.clean = True

    @precondition(lambda self: self.llm is not None and self.engine.kv.tiers.records)
    @rule(pick=st.integers(0, 1000))
    def perturb_fingerprint(self, pick):
        """A dropped block's stored fingerprint no longer matches what a replay computes."""
        self.clean = False
        records = [r for seq_records in self.engine.kv.tiers.records.values() for r in seq_records.values()]
        if not records:  # (a reproducer replayed below calls the rules without their preconditions)
            self.clean = True
            return
        record = records[pick % len(records)]
        record.fingerprint = record.fingerprint * 3 + 1
        self.perturbed += 1
        EngineMachine.tally["perturbed"] += 1
        self.clean = True

    # ------------------------------------------------------------------ checks
    def _step(self):
        engine = self.engine
        prefilling = {seq.seq_id for seq in [*engine.scheduler.running, *engine.scheduler.waiting]
                      if seq.num_uncomputed_tokens > 1}
        outputs = engine.step()
        EngineMachine.total_steps += 1
        self._check_pool()
        self._check_ratio(prefilling)
        for out in outputs:
            if out.finished:
                self._finished(out)

    def _finished(self, out):
        prompt, params, protected, keep = self.live.pop(out.request_id)
        for completion in out.outputs:
            stats = completion.stats
            EngineMachine.tally.update(finished=1, replays=stats.replays, pauses=stats.pauses,
                                       dropped_tokens=stats.dropped_tokens, cold_blocks=stats.cold_blocks,
                                       prefix_hit_tokens=stats.prefix_hit_tokens, approx_tokens=stats.approx_tokens,
                                       replay_mismatches=stats.replay_mismatches)
        assert all(c.finish_reason in ("stop", "length") for c in out.outputs), out.outputs
        assert all(len(c.token_ids) <= params.max_tokens for c in out.outputs)
        if keep and out.request_id in self.engine.sessions:
            self.kept[out.request_id] = out.prompt_token_ids + out.token_ids
        if self.engine.config.policy == "full" and (params.temperature == 0 or params.seed is not None):
            expected = self.references.tokens(self.engine.config.block_size, prompt, params, protected)
            got = [c.token_ids for c in out.outputs]
            if params.beam_width > 1:
                got, expected = got[:1], expected[:1]
            assert got == expected, f"{out.request_id}: {got} under full, {expected} alone"
            EngineMachine.tally["compared with a lone run"] += 1

    @invariant()
    def pool_is_consistent(self):
        if self.llm is not None:
            self._check_pool()

    def _check_pool(self):
        engine, kv = self.engine, self.engine.kv
        engine.check_integrity()
        free = set(kv.pool._empty) | set(kv.pool.lru_order())
        referenced = {b for table in kv._tables.values() for b in table if b != DROPPED}
        referenced |= set(kv.tiers.reserved) | {b for _, blocks in kv.layered.active.values() for b in blocks}
        assert not free & referenced, f"blocks both free and referenced: {sorted(free & referenced)}"
        assert free | referenced == set(range(kv.num_blocks)), "blocks neither free nor referenced"
        live = {seq.seq_id for seq in [*engine.scheduler.running, *engine.scheduler.waiting,
                                       *engine.sessions.sequences()]}
        assert set(kv._tables) == live, f"tracked {sorted(kv._tables)}, live {sorted(live)}"
        assert set(kv.importance._mass) <= live, "attention scores of a finished sequence"
        hot = (kv.num_used_blocks - kv.num_reserved_blocks) * kv.block_bytes
        assert hot + kv.index_bytes + kv.cold_bytes <= kv.num_blocks * kv.block_bytes
        assert engine.counters.replay_mismatches <= self.perturbed, "a replay mismatched unperturbed"

    def _check_ratio(self, prefilling: set[int]):
        """After its step, a sequence under a resident_ratio is within it, or nothing is left
        that its policy could cut (the pinned head, the recent window and shared blocks stay)."""
        scheduler = self.engine.scheduler
        reclaim, kv = scheduler.reclaim, self.engine.kv
        policy, ratio = reclaim.policy, reclaim.resident_ratio
        if ratio is None:
            return
        for seq in scheduler.running:
            if seq.num_uncomputed_tokens != 1 or seq.beam is not None:
                continue
            replayed_lately = scheduler.replay.holds_middle(seq, scheduler.num_steps)
            # (a capping preset leaves a sequence that replayed lately uncut, sliding or not:
            # its heavy hitters stay hot until then)
            every_step = (not replayed_lately and not scheduler.replay.wants_replay(seq)) \
                if policy.caps_each_step else policy.slides
            if not (every_step or (reclaim.selects_at_prefill and seq.seq_id in prefilling)):
                continue
            blocks = -(-seq.num_computed_tokens // kv.block_size)
            if kv.resident_bytes(seq.seq_id) <= (ratio * blocks + 1e-9) * kv.block_bytes:
                continue
            recent = reclaim.recent_tokens(seq.num_computed_tokens, seq.pinned_tokens)
            middle = middle_block_range(seq.num_computed_tokens, seq.pinned_tokens, recent, kv.block_size,
                                        seq.hot_from if policy.demotes else None)
            left = kv.droppable(seq.seq_id, middle) + kv.cold_blocks(seq.seq_id) * policy.drops_middle
            assert not left, (f"seq {seq.seq_id} ({policy.name}, r={ratio}): {kv.resident_bytes(seq.seq_id)} "
                              f"bytes resident over {blocks} blocks, blocks {left} still cuttable")

    def teardown(self):
        """Drain: every request finishes within a bounded number of steps, kept sessions are
        released, and the pool is whole again."""
        if self.llm is None or not self.clean:
            return
        EngineMachine.tally[f"runs under {self.engine.config.policy}"] += 1
        engine = self.engine
        bound = 200 + 4 * sum(len(p) + params.max_tokens * max(params.n, params.beam_width)
                              for p, params, _, _ in self.live.values())
        for _ in range(bound):
            if not engine.has_unfinished_requests():
                break
            self._step()
        assert not engine.has_unfinished_requests(), f"still running after {bound} steps: {sorted(self.live)}"
        assert not self.live, f"finished without an output: {sorted(self.live)}"
        for request_id in list(self.kept):
            engine.release(request_id)
        for seq in engine.sessions.sequences():  # kept but not tracked here: none expected
            raise AssertionError(f"kept session {seq.request_id} unknown to the test")
        kv = engine.kv
        engine.check_integrity()
        assert kv.num_free_blocks == kv.num_blocks and not kv._tables
        assert kv.key_index.num_used == 0 and kv.cold_bytes == 0 and not kv.tiers.reserved
        assert len(kv.pool.cache) == kv.num_cached_blocks
        assert all(kv.pool.ref_counts[b] == 0 for b in kv.pool.lru_order())


def _run(model: str, examples: int, steps: int, seed: int | None = None) -> None:
    """Run the machine `examples` times, up to `steps` rules each; derandomized unless `seed`."""
    EngineMachine.model = model
    if EngineMachine.references is None or EngineMachine.references.model != model:
        EngineMachine.references = References(model)
    config = settings(max_examples=examples, stateful_step_count=steps, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck), derandomize=seed is None)
    factory = EngineMachine if seed is None else hypothesis.seed(seed)(lambda: EngineMachine())
    run_state_machine_as_test(factory, settings=config)


def test_engine_state_machine(tiny_model):
    """The CI slice: a bounded, derandomized set of runs."""
    before = EngineMachine.total_steps
    _run(tiny_model, CI_EXAMPLES, CI_STEPS)
    assert EngineMachine.total_steps > before  # the machine did step the engine
    print(f"\nCI slice: {EngineMachine.total_steps - before} engine steps; {dict(EngineMachine.tally)}")


@pytest.mark.skipif(not LONG_STEPS, reason="the long run: KVREPLAY_FSM_LONG=<engine steps>")
def test_engine_state_machine_long(tiny_model):
    started, before = time.perf_counter(), EngineMachine.total_steps
    seed, rounds = int(os.environ.get("KVREPLAY_FSM_SEED", "0")), 0
    while EngineMachine.total_steps - before < LONG_STEPS:
        _run(tiny_model, 25, 60, seed=seed + rounds)
        rounds += 1
    print(f"\nlong run: {EngineMachine.total_steps - before} engine steps, {rounds} rounds x 25 examples "
          f"(seeds {seed}-{seed + rounds - 1}), {time.perf_counter() - started:.0f} s; {dict(EngineMachine.tally)}")


# ---------------------------------------------------------------------------- reproducers found
def _built_machine(model: str, **build) -> EngineMachine:
    """A machine built as a failing run was, to replay its rules by hand."""
    EngineMachine.model = model
    if EngineMachine.references is None or EngineMachine.references.model != model:
        EngineMachine.references = References(model)
    state = EngineMachine()
    state.build(**build)
    return state
def test_beam_search_outgrowing_the_high_watermark_finishes(tiny_model):
    """Found by the state machine (long run, seed 0): 32 blocks of 8 tokens, a 1-token request
    and two beams over a 227-token prompt (each fits the pool; together they pass `high`)."""
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="128KiB", block_size=8,
              enable_prefix_caching=False, max_num_seqs=2)
    engine = llm.engine
    engine.add_request(_tokens(1, 1), SamplingParams(max_tokens=1, temperature=0))
    beams = engine.add_request(_tokens(227, 2), SamplingParams(max_tokens=8, beam_width=2))
    done = {}
    for _ in range(100):
        if not engine.has_unfinished_requests():
            break
        done.update((out.request_id, out) for out in engine.step())
        engine.check_integrity()
    assert done[beams].outputs[0].finish_reason == "length"


def test_beams_that_cannot_fit_the_pool_are_refused(tiny_model):
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="128KiB", block_size=8)
    engine = llm.engine
    assert worst_case_blocks(227, 8, 2, 8) == 32 == engine.kv.num_blocks  # fits exactly (the test above)
    with pytest.raises(ValueError, match="may need 34 KV blocks, and the pool has 32"):
        engine.add_request(_tokens(227, 2), SamplingParams(max_tokens=8, beam_width=3))
    assert not engine.has_unfinished_requests()
    engine.check_integrity()


def test_a_lone_sequence_filling_the_pool_can_still_replay(tiny_model):
    """Found by the state machine (long run, seed 0): 32 blocks of 8 tokens, a 248-token prompt
    with 8 tokens to generate under `replay` at r=0.5, the detector forced at a few steps."""
    llm = LLM(model=tiny_model, dtype="float32", kv_cache_memory="128KiB", block_size=8, policy="replay",
              resident_ratio=0.5, max_num_seqs=2, window_tokens=32, max_num_batched_tokens=256)
    engine = llm.engine
    request_id = engine.add_request(SHARED[:64] + _tokens(184, 0), SamplingParams(max_tokens=8, temperature=0))
    done, replay = {}, engine.scheduler.replay
    for threshold in [0.0] * 3 + [0.65] * 6 + [0.0] + [0.65] * 30:  # (forced needs, as the machine did)
        if not engine.has_unfinished_requests():
            break
        replay.threshold = threshold
        done.update((out.request_id, out) for out in engine.step())
        engine.check_integrity()
    assert done[request_id].outputs[0].finish_reason == "length"
    assert done[request_id].stats.replays > 0  # it replayed, through the blocks its index slots stood for


def test_a_continued_session_whose_dropped_blocks_all_come_back_from_the_cache_prefills(tiny_model):
    """Found by the state machine (long run): a kept session continued under replay, every
    dropped block of it still in the prefix cache; admission restored them, the replay had
    nothing left, and the step scheduled nothing ("running work but nothing scheduled")."""
    state = _built_machine(tiny_model, policy="replay", threshold=0.2, block_size=16, layered=True,
                           memory="256KiB", ratio=0.25, caching=True, batched=32, trim="admission", max_seqs=2)
    state.add(beam=1, ignore_eos=True, keep=True, length=289, max_tokens=13, n=1, protected=0, seeded=True,
              shared=0, stop=None, temperature=0.0)
    state.abort(after=0, pick=0)
    state.step(count=4)
    state.add(beam=1, ignore_eos=False, keep=True, length=251, max_tokens=37, n=1, protected=0, seeded=False,
              shared=0, stop="e", temperature=0.0)
    state.step(count=16)
    state.continue_or_release(keep=False, length=15, max_tokens=6, pick=3, release=False)
    state.perturb_fingerprint(pick=1)
    state.abort(after=3, pick=4)
    state.pool_is_consistent()
    state.teardown()  # drains every request, checking each step


@pytest.mark.parametrize("hold", ["middle", "judged"])
def test_admission_does_not_trim_a_sequence_that_just_replayed_for_a_request_it_cannot_admit(tiny_model, hold):
    """Found by the state machine: under replay with trim="admission", three branches of one
    prompt, two of them paused; trimming the decoding one's middle for a paused sibling freed
    the very blocks the sibling's prefix hits would adopt back, so it was never admitted. Each
    step the decoding branch took its judged block back from the prefix cache, lost it to the
    next admission trim and had the detector fire again: no token for thousands of steps."""
    state = _built_machine(tiny_model, hold=hold, policy="replay", memory="128KiB", block_size=16, ratio=0.5,
                           threshold=0.2, trim="admission", caching=True, layered=False, batched=32,
                           max_seqs=2)
    state.add(beam=1, ignore_eos=False, keep=True, length=82, max_tokens=4, n=3, protected=0, seeded=True,
              shared=0, stop="the", temperature=0.8)
    state.add(beam=1, ignore_eos=True, keep=True, length=147, max_tokens=32, n=3, protected=0, seeded=True,
              shared=0, stop="the", temperature=0.0)
    state.step(count=10)
    state.add(beam=1, ignore_eos=True, keep=False, length=125, max_tokens=30, n=2, protected=5, seeded=True,
              shared=0, stop=["a", "."], temperature=0.0)
    for _ in range(5):
        state.step(count=13)
    state.step(count=1)
    state.teardown()  # drains every request within its bound, checking each step


@pytest.mark.parametrize("hold", ["middle", "judged"])
def test_a_block_taken_again_before_its_redone_step_is_not_replayed_again_for_that_token(tiny_model, hold):
    """Found by the state machine: a lone sequence filling the pool under replay (layered
    prefill, r=0.25). Its need-replay brought back the judged block with everything cached
    before it, which put the pool over the high watermark; the next step's pressure trim took
    the judged block again before the redone decode read it, the detector asked for it again,
    and so on: no token for thousands of steps. A block is now asked for once per token."""
    state = _built_machine(tiny_model, hold=hold, policy="replay", memory="128KiB", block_size=16, ratio=0.25,
                           threshold=0.2, trim="admission", caching=True, layered=True, batched=32, max_seqs=2)
    state.add(beam=1, ignore_eos=False, keep=False, length=268, max_tokens=30, n=1, protected=20, seeded=True,
              shared=64, stop="the", temperature=0.0)
    state.step(count=13)
    state.add(beam=1, ignore_eos=True, keep=True, length=199, max_tokens=27, n=1, protected=0, seeded=False,
              shared=24, stop="e", temperature=0.0)
    state.step(count=17)
    state.add(beam=1, ignore_eos=False, keep=False, length=300, max_tokens=15, n=1, protected=20, seeded=False,
              shared=0, stop=None, temperature=0.0)
    state.add(beam=1, ignore_eos=True, keep=False, length=182, max_tokens=7, n=1, protected=0, seeded=True,
              shared=64, stop=None, temperature=0.0)
    state.step(count=9)
    state.add(beam=1, ignore_eos=True, keep=True, length=125, max_tokens=6, n=1, protected=0, seeded=True,
              shared=8, stop=["a", "."], temperature=0.0)
    state.step(count=12)
    state.teardown()  # drains every request within its bound, checking each step


@pytest.mark.parametrize("hold", ["middle", "judged"])
def test_a_lone_sequence_whose_replay_finds_no_room_is_recomputed_whole(tiny_model, hold):
    """Found by the state machine: under replay at r=0.25 with forced needs, a lone sequence whose
    own hot blocks and key index filled the pool was asked to replay a run it had no room for;
    nothing could be trimmed or paused for it, so the step scheduled nothing. It now pauses
    itself and resumes by recomputing, as `full` does when a lone sequence outgrows the pool."""
    state = _built_machine(tiny_model, hold=hold, policy="replay", memory="128KiB", block_size=16, ratio=0.25,
                           threshold=0.2, trim="admission", caching=True, layered=False, batched=32,
                           max_seqs=2)
    state.force_need()
    state.add(beam=1, ignore_eos=True, keep=False, length=100, max_tokens=21, n=1, protected=0, seeded=False,
              shared=64, stop="e", temperature=0.0)
    state.add(beam=1, ignore_eos=True, keep=False, length=161, max_tokens=26, n=1, protected=0, seeded=False,
              shared=0, stop=["a", "."], temperature=0.0)
    state.step(count=8)
    state.force_need()
    state.step(count=1)
    state.add(beam=1, ignore_eos=False, keep=False, length=277, max_tokens=21, n=2, protected=5, seeded=False,
              shared=24, stop=None, temperature=0.0)
    state.force_need()
    state.step(count=3)
    state.force_need()
    state.add(beam=1, ignore_eos=True, keep=True, length=50, max_tokens=37, n=3, protected=20, seeded=True,
              shared=24, stop="e", temperature=0.0)
    state.add(beam=1, ignore_eos=False, keep=False, length=109, max_tokens=15, n=1, protected=5, seeded=True,
              shared=0, stop="the", temperature=0.0)
    state.force_need()
    state.add(beam=1, ignore_eos=False, keep=False, length=27, max_tokens=29, n=1, protected=0, seeded=False,
              shared=64, stop=["a", "."], temperature=0.0)
    state.step(count=4)
    state.step(count=3)
    state.add(beam=1, ignore_eos=True, keep=True, length=197, max_tokens=21, n=2, protected=0, seeded=True,
              shared=0, stop=["a", "."], temperature=0.0)
    state.force_need()
    state.force_need()
    state.step(count=9)
    state.force_need()
    state.force_need()
    state.force_need()
    state.force_need()
    state.force_need()
    state.force_need()
    state.force_need()
    state.force_need()
    state.step(count=8)
    state.force_need()
    state.force_need()
    state.teardown()  # drains every request within its bound, checking each step


def test_a_forced_need_under_the_judged_hold_leaves_the_sequence_within_its_ratio(tiny_model):
    """Found by the state machine (long run, seed 700): replay+cold at r=0.25 with
    replay_hold="judged", a 25-token request and forced needs with a perturbed fingerprint."""
    state = _built_machine(tiny_model, policy="replay+cold", memory="128KiB", block_size=8, ratio=0.25,
                           threshold=0.65, hold="judged", trim="prefill", caching=False, layered=False,
                           batched=32, max_seqs=2)
    state.add(beam=1, ignore_eos=False, keep=False, length=1, max_tokens=1, n=1, protected=0, seeded=False,
              shared=0, stop=None, temperature=0.0)
    state.add(beam=1, ignore_eos=False, keep=False, length=1, max_tokens=3, n=1, protected=0, seeded=False,
              shared=24, stop=None, temperature=0.0)
    state.force_need()
    state.force_need()
    state.perturb_fingerprint(pick=0)
    state.force_need()
    state.force_need()
    state.teardown()


def test_a_recompute_after_a_fingerprint_mismatch_leaves_the_sequence_within_its_ratio(tiny_model):
    """Found by the state machine (long run, seed 700): replay+cold at r=0.5 under the default
    hold, an 88-token request whose dropped block's fingerprint is perturbed."""
    state = _built_machine(tiny_model, policy="replay+cold", hold="middle", trim="prefill", threshold=0.2,
                           block_size=8, memory="128KiB", ratio=0.5, caching=False, layered=False, batched=64,
                           max_seqs=2)
    state.add(beam=1, ignore_eos=False, keep=False, length=88, max_tokens=3, n=1, protected=0, seeded=False,
              shared=0, stop=None, temperature=0.0)
    state.step(count=4)
    state.perturb_fingerprint(pick=0)
    state.step(count=6)
    state.teardown()


def test_a_running_prompt_whose_next_chunk_finds_the_pool_held_by_paused_heads_goes_on(tiny_model):
    """Found by the state machine (long run, seed 1300; replay at r=0.5, layered prefill): a
    prompt mid-prefill was the only running sequence, and the pages its next chunk needed were
    held by a paused sequence's kept head (and that head's key-index reservation). Its chunk did
    not fit, nothing could be trimmed or paused, so the step scheduled nothing. When a step
    would schedule nothing, the engine now releases paused heads as it releases kept sessions."""
    state = _built_machine(tiny_model, policy="replay", detector="all", ratio=0.5, block_size=8, trim="admission",
                           max_seqs=2, batched=32, threshold=0.65, caching=False, hold="judged", memory="128KiB",
                           layered=True)
    state.abort(after=5, pick=4)
    state.add(beam=1, ignore_eos=True, keep=True, length=8, max_tokens=23, n=1, protected=5, seeded=False, shared=8,
              stop=None, temperature=0.0)
    state.add(beam=2, ignore_eos=True, keep=False, length=137, max_tokens=7, n=1, protected=0, seeded=False,
              shared=8, stop="e", temperature=0.0)
    state.abort(after=2, pick=3)
    state.step(count=13)
    state.step(count=4)
    state.add(beam=1, ignore_eos=True, keep=True, length=176, max_tokens=19, n=1, protected=5, seeded=False,
              shared=64, stop=None, temperature=0.0)
    state.add(beam=1, ignore_eos=False, keep=True, length=76, max_tokens=36, n=2, protected=0, seeded=False,
              shared=24, stop="e", temperature=0.8)
    state.add(beam=1, ignore_eos=True, keep=True, length=291, max_tokens=19, n=1, protected=20, seeded=True,
              shared=64, stop=None, temperature=0.0)
    state.abort(after=8, pick=2)
    state.continue_or_release(keep=True, length=40, max_tokens=6, pick=1, release=False)
    state.teardown()  # drains every request within its bound, checking each step
