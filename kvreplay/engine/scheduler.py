"""Continuous batching under a KV budget: which sequences run this step, how many tokens each
computes, and which pause when memory is short.

Every step has a token budget and follows the same order:

0. Reclaim: if this step's decodes would lift usage above `high`, pause the cheapest victims
   (`kvreplay.kv.policy`) until running blocks are under `low` (kept heads count as reclaimed).
1. Decodes, oldest first; if one does not fit, pause the cheapest other sequence at once.
2. Prefill chunks of running sequences (long prompts and replays continue where they left off).
3. Admission, in a step that paused nobody: paused sequences first (an exact replay of their
   range on resume), then new ones, while usage stays under `admit`; prefix hits are adopted.

Dropping policies (window, replay) add two actions, each in a module of its own: reclaim
(engine/reclaim.py) takes middle blocks out of the hot tier before anyone is paused, and a
running sequence whose dropped ranges are needed replays them (engine/replay.py) before it
decodes or prefills again; room for a replay is made by trimming or pausing *other* sequences.

With `layered_prefill`, a prompt (or resumed range) whose middle would be dropped after its
prefill is computed a few layers per step over its whole range: its middle starts out dropped
and only its kept blocks, key-index slots and working memory count at admission.

A pause keeps the pinned head (protected span, sinks) or nothing; the KV manager moves blocks.
"""
from __future__ import annotations

from collections import deque
from typing import Callable

from kvreplay.engine.batch import ReplayChunk, ScheduledBatch
from kvreplay.engine.beam import beams_fit
from kvreplay.engine.reclaim import Reclaimer
from kvreplay.engine.replay import ReplayTracker
from kvreplay.engine.sequence import LayeredPrefill, Sequence, SequenceStatus
from kvreplay.kv import KVManager
from kvreplay.kv.importance import prompt_chunk
from kvreplay.kv.policy import POLICIES, KVPolicy, Watermarks, middle_block_range, pause_cost

# A layered prefill cannot pick heavy hitters after the fact (the middle's K/V never exist for
# every layer at once), so it keeps this many times `heavy_tokens` of the middle's last blocks
# hot as candidates, and the usual trim after prefill keeps the heavy ones among them. On
# SmolLM2-135M over the serving bench's 3,000-token prompts, 24 of the 28 top-2 blocks by the
# prompt's observed attention lie in the middle's last 16 blocks (bench note in
# docs/benchmarks/replay.md).
HEAVY_CANDIDATES = 8


class Scheduler:
    def __init__(self, kv: KVManager, max_num_batched_tokens: int, max_num_seqs: int,
                 watermarks: Watermarks = Watermarks(), pause_mode: str = "protected",
                 block_bytes: int = 1, policy: KVPolicy = POLICIES["full"],
                 window_tokens: int = 512, trim: str = "pressure", approx_prefill: bool = False,
                 heavy_tokens: int = 0, trim_order: str = "importance",
                 resident_ratio: float | None = None, num_layers: int = 1,
                 layered_work: Callable[[int, int], int] | None = None, replay_threshold: float = 0.65,
                 replay_hold: str = "middle"):
        self.kv = kv
        # Layered prefill (None: off): working bytes of computing positions [start, end) layer
        # by layer, and the model's layer count.
        self.layered_work = layered_work
        self.num_layers = num_layers
        self.policy = policy
        self.num_steps = 0
        self._busy: set[int] = set()  # sequences with work in this batch: never paused
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.watermarks = watermarks
        self.keep_pinned = pause_mode == "protected"
        self.block_bytes = block_bytes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.replay = ReplayTracker(kv, approx_prefill, replay_threshold, policy.replays, replay_hold)
        self.reclaim = Reclaimer(kv, policy, self.replay, self.running, window_tokens, trim,
                                 heavy_tokens, trim_order, resident_ratio)

    def add(self, seq: Sequence, kept: bool = False) -> None:
        """Queue a new sequence, or a kept one (engine/sessions.py) whose blocks the pool holds."""
        if not kept:
            self.kv.add_sequence(seq.seq_id, seq.pinned_tokens)
        self.waiting.append(seq)

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` running on `parent`'s blocks (shared until one of them writes)."""
        self.kv.fork(parent.seq_id, child.seq_id)
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        self.running.append(child)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence, free: bool = True) -> None:
        """Take a sequence out of the queues (finish or abort); free its blocks unless kept
        (then it parks cut as its policy leaves a decoding sequence: Reclaimer.cut_parked)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if free:
            self.kv.free(seq.seq_id)
        else:
            self.reclaim.cut_parked(seq)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self.num_steps += 1
        self._reclaim(batch)

        # 1. Decodes, oldest first. A pause here is forced: the pool is full.
        scheduled: set[int] = set()
        self._busy = scheduled  # sequences with work in this batch: never paused
        self.reclaim.chunked = set()
        for seq in self.running:
            if self.replay.wants_replay(seq):  # what the prefix cache still holds comes back for free
                self.replay.restore_cached(seq, self.num_steps)
        for seq in list(self.running):
            if seq not in self.running or seq.num_uncomputed_tokens != 1 or budget == 0 \
                    or self.replay.wants_replay(seq):
                continue
            while not self.kv.allocate(seq.seq_id, 1):
                if self.reclaim.trim_for_room(1):
                    continue
                victim = self._cheapest_victim(exclude=scheduled | {seq.seq_id})
                if victim is None and self.release_paused_pins(exclude=None):
                    continue
                victim = victim or seq
                self._pause(victim, batch)
                if victim is seq:
                    break
            else:
                batch.decodes.append(seq)
                scheduled.add(seq.seq_id)
                budget -= 1

        # 2. Replays, then prefill chunks of running sequences.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq not in self.running:
                continue
            if seq.layered is not None:
                budget -= self._schedule_layers(seq, budget, batch)
            elif self.replay.wants_replay(seq):
                budget -= self._schedule_replay(seq, budget, batch)
            elif seq.num_uncomputed_tokens > 1:
                budget -= self._schedule_prefill(seq, budget, batch)

        # 3. Admission (resumes first: paused sequences sit at the front of the queue).
        admit_blocks = self.watermarks.admit * self.kv.num_blocks
        # Running prompts still to prefill are committed already: project them in.
        # (A layered prefill holds its blocks from the start.)
        committed = self.kv.num_used_blocks + sum(
            self.kv.num_blocks_projected(seq.seq_id, seq.num_uncomputed_tokens)
            for seq in self.running if seq.num_uncomputed_tokens > 1 and seq.layered is None)
        while self.waiting and budget > 0 and not batch.paused \
                and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.kv.match_prefix(seq.seq_id, seq.token_ids)
            layered = None if hits else self._layered_middle(seq)
            if layered is not None:  # its hot blocks (and the first decode's), index slots, work
                projected = self.kv.num_blocks_layered(seq.seq_id, seq.num_uncomputed_tokens + 1, layered,
                                                       self.policy.keeps_key_index, self._layered_bytes(seq))
            else:
                projected = self.kv.num_blocks_to_admit(seq.seq_id, hits, seq.num_tokens + 1)
            if not beams_fit(seq, self.running, self.kv.num_blocks):
                break  # (beams are never paused: engine/beam.py)
            if self.running and committed + projected > admit_blocks:
                # trim="admission" makes room, or it waits. Dropping takes key-index blocks from
                # the pool, which may evict cached blocks among `hits`: then look again.
                freed = self.reclaim.room_to_admit(int(committed + projected - admit_blocks) + 1, self.num_steps)
                committed -= freed
                if freed:
                    continue
                break
            elif projected > self.kv.num_free_blocks:
                # Alone it must fit whatever the watermarks say; make room from paused pins.
                if self.release_paused_pins(exclude=seq):
                    continue
                if not self.kv.can_allocate(seq.seq_id, 1):
                    break
            if layered is not None and not self._begin_layered(seq, layered) and self.running:
                break  # (alone, it prefills in chunks instead)
            self.waiting.popleft()
            hit_tokens = self.kv.adopt_prefix(seq.seq_id, hits)
            seq.num_computed_tokens += hit_tokens + self.replay.load_prefix(seq)
            seq.stats.prefix_hit_tokens += hit_tokens
            self.replay.resumed(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            committed += projected
            if seq.layered is not None:
                budget -= self._schedule_layers(seq, budget, batch)
            elif self.replay.wants_replay(seq):  # a kept session with dropped ranges (engine/sessions.py)
                budget -= self._schedule_replay(seq, budget, batch)
            else:
                budget -= self._schedule_prefill(seq, budget, batch)
        return batch

    def _schedule_prefill(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        """The next prefill chunk of `seq` that fits the budget and the pool; tokens used."""
        cap = self.replay.prefill_cap(seq)  # (may move past a tail loaded from the session tier)
        want = prompt_chunk(seq.num_uncomputed_tokens, self.policy,
                            min(seq.num_uncomputed_tokens, budget, cap if cap is not None else budget))
        chunk = self._fit_chunk(seq, want)
        if chunk:
            batch.prefills.append((seq, chunk))
            self._busy.add(seq.seq_id)
            self.reclaim.chunked.add(seq.seq_id)
        return chunk

    # ------------------------------------------------------------------ layered prefill
    def _layered_middle(self, seq: Sequence) -> range | None:
        """The middle blocks a layered prefill of `seq`'s uncomputed tokens would leave dropped
        from the start, or None when `seq` prefills in token chunks: layered prefill is off,
        the preset keeps the middle after prefill, the range does not start on a block
        boundary or something is dropped already, or it would save no memory."""
        if self.layered_work is None or self.replay.approx_prefill or seq.beam is not None or seq.forks:
            return None
        if not self.policy.drops_middle or self.policy.demotes or self.reclaim.selects_at_prefill \
                or not (self.policy.slides or self.reclaim.trim == "prefill"):
            return None  # (a cut to resident_ratio at prefill needs the whole middle's attention)
        start, end = seq.num_computed_tokens, seq.num_tokens
        block_size = self.kv.block_size
        if start % block_size or self.kv.num_slots(seq.seq_id) != start or \
                self.kv.dropped_blocks(seq.seq_id) or end - start < 2:
            return None
        middle = middle_block_range(end, seq.pinned_tokens, self.reclaim.recent_tokens(end, seq.pinned_tokens),
                                    block_size)
        middle = range(max(middle.start, start // block_size),
                       max(middle.start, middle.stop - HEAVY_CANDIDATES * self.reclaim.heavy_blocks))
        work_blocks = -(-self._layered_bytes(seq) // self.kv.block_bytes)
        return middle if len(middle) > 2 * work_blocks else None

    def _layered_bytes(self, seq: Sequence) -> int:
        return self.layered_work(seq.num_computed_tokens, seq.num_tokens)

    def _begin_layered(self, seq: Sequence, middle: range) -> bool:
        start, end = seq.num_computed_tokens, seq.num_tokens
        new = self.kv.begin_layered(seq.seq_id, end - start, middle, self.policy.keeps_key_index,
                                    self._layered_bytes(seq))
        if new is None:
            return False
        seq.layered = LayeredPrefill(start, end, new)
        seq.stats.dropped_tokens += sum(index in middle for index in new) * self.kv.block_size
        return True

    def _schedule_layers(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        """The next layers of `seq`'s layered prefill: about `budget` tokens' worth (at least
        one layer). Returns the tokens they count for."""
        state = seq.layered
        tokens = state.end - state.start
        left = self.num_layers - state.next_layer
        count = min(left, max(1, budget * self.num_layers // tokens))
        batch.layers.append((seq, range(state.next_layer, state.next_layer + count)))
        self._busy.add(seq.seq_id)
        self.reclaim.chunked.add(seq.seq_id)
        return min(budget, -(-count * tokens // self.num_layers))

    # ------------------------------------------------------------------ dropped ranges
    def _schedule_replay(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        """Schedule the oldest run of `seq`'s dropped blocks (exact: all before it is resident);
        what the prefix cache holds comes back for free. Returns tokens used."""
        block_size = self.kv.block_size
        if not self.replay.restore_cached(seq, self.num_steps):
            # everything came back from the prefix cache: a resumed session prefills its new turn now
            return self._schedule_prefill(seq, budget, batch) if seq.num_uncomputed_tokens > 1 else 0
        if self.replay.recomputes_whole:
            self._recompute_for_replay(seq)
            return 0
        dropped = self.replay.replay_left(seq)
        stop = self.replay.replay_stop(seq)  # a tail read from the session tier meanwhile
        run = [index for offset, index in enumerate(dropped) if index == dropped[0] + offset
               and (stop is None or index < stop)]
        blocks = run[:budget // block_size]
        while blocks and not self.kv.allocate_restore(seq.seq_id, blocks):
            if self.reclaim.trim_for_room(len(blocks), exclude={seq.seq_id}):
                continue
            victim = self._cheapest_victim(exclude=self._busy | {seq.seq_id})
            if victim is not None:
                self._pause(victim, batch)
            else:
                blocks = blocks[:self.kv.restore_room(seq.seq_id, blocks)]
        if not blocks:
            if self.running == [seq]:  # its own blocks and index fill the pool: recompute it whole
                self._pause(seq, batch)
            return 0
        self.replay.start(seq, self.num_steps)
        batch.replays.append(ReplayChunk(seq, blocks[0] * block_size, len(blocks) * block_size, blocks))
        self._busy.add(seq.seq_id)
        self.reclaim.chunked.add(seq.seq_id)
        return len(blocks) * block_size

    def end_step(self, prefilled: list[Sequence]) -> None:
        """The step's model run is done: policy trimming (engine/reclaim.py)."""
        self.reclaim.trim_after_step(prefilled, self.num_steps)

    # ------------------------------------------------------------------ memory pressure
    def _decode_growth(self) -> int:
        return sum(self.kv.num_blocks_needed(seq.seq_id, 1) for seq in self.running
                   if seq.num_uncomputed_tokens == 1)

    def _reclaim(self, batch: ScheduledBatch) -> None:
        """Hysteresis: start when the pool (kept heads included) goes above `high`, then pause
        until the running sequences' blocks are under `low`, never the last runner.

        The kept head of a paused sequence counts as reclaimed: it is released on demand (see
        `release_paused_pins`), and counting it as used would pause more sequences per reclaim
        in protected mode than in recompute mode for the same room (see `kvreplay.kv.policy`)."""
        total = self.kv.num_blocks
        if self.kv.num_used_blocks + self._decode_growth() <= self.watermarks.high * total:
            return
        self._busy, self.reclaim.chunked = set(), set()
        self.reclaim.trim_for_room(0, target_used=int(self.watermarks.low * total) - self._decode_growth())
        while len(self.running) > 1 and self.kv.num_used_blocks - self._paused_head_blocks() + \
                self._decode_growth() > self.watermarks.low * total:
            victim = self._cheapest_victim(exclude=set())
            if victim is None:
                return
            self._pause(victim, batch)

    def _paused_head_blocks(self) -> int:
        """Blocks that only kept heads of paused sequences hold (what releasing them frees)."""
        return sum(self.kv.pause_preview(seq.seq_id, keep_pinned=False)[1]
                   for seq in self.waiting if self.kv.num_slots(seq.seq_id))

    def _cheapest_victim(self, exclude: set[int]) -> Sequence | None:
        """The running sequence with the fewest replay tokens per byte freed; ties: the newest."""
        best, best_key = None, None
        for seq in self.running:
            if seq.seq_id in exclude or seq.beam is not None:  # beams step together: never paused
                continue
            replay_tokens, freed_blocks = self.kv.pause_preview(seq.seq_id, self.keep_pinned)
            cost = pause_cost(replay_tokens, freed_blocks * self.block_bytes)
            key = (round(cost, 12), -seq.seq_id)
            if cost != float("inf") and (best_key is None or key < best_key):
                best, best_key = seq, key
        return best

    def _pause(self, seq: Sequence, batch: ScheduledBatch) -> None:
        computed = seq.num_computed_tokens
        kept = self.kv.pause(seq.seq_id, keep_pinned=self.keep_pinned)
        seq.num_computed_tokens = kept
        self.replay.paused(seq, computed)
        seq.stats.pauses += 1
        seq.stats.dropped_tokens += computed - kept
        seq.layered = None  # the KV manager released its working memory
        if kept == 0:
            seq.stats.preemptions += 1
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.paused.append(seq)

    def recompute(self, seq: Sequence) -> None:
        """Drop all of `seq` and queue it to be recomputed from its first token."""
        computed = seq.num_computed_tokens
        self.kv.pause(seq.seq_id, keep_pinned=False)
        seq.num_computed_tokens = 0
        self.replay.paused(seq, computed)
        seq.layered = None
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _recompute_for_replay(self, seq: Sequence) -> None:
        """A replay on a hybrid pool (ReplayTracker.recomputes_whole): recompute all of `seq`;
        a need-replay's middle is held afterwards as after any need-replay."""
        needed, judged, kept = seq.replay.needed, set(seq.replay.judged), set(seq.replay.kept)
        self.recompute(seq)
        if needed:  # (judged: asked for once per token, as a replayed block is: no livelock)
            seq.replay.last_step = self.num_steps
            seq.replay.judged |= judged
            seq.replay.kept |= kept

    def release_paused_pins(self, exclude: Sequence | None) -> bool:
        """Last resort when pinned heads of paused sequences fill the pool: drop one entirely,
        the one paused longest ago first (it resumes last: paused sequences resume newest
        first). Running sequences' pins are never touched."""
        for seq in reversed(self.waiting):
            if seq is not exclude and self.kv.num_slots(seq.seq_id) > 0:
                kept = seq.num_computed_tokens
                self.kv.pause(seq.seq_id, keep_pinned=False)
                seq.num_computed_tokens = 0
                seq.stats.dropped_tokens += kept
                seq.stats.preemptions += 1
                return True
        return False

    def _fit_chunk(self, seq: Sequence, want: int) -> int:
        """Allocate room for up to `want` tokens of `seq`; returns how many fit."""
        while want > 0 and not self.kv.allocate(seq.seq_id, want):
            room = self.kv.num_free_blocks * self.kv.block_size + self._tail_room(seq)
            want = min(want - 1, room)
        return max(want, 0)

    def _tail_room(self, seq: Sequence) -> int:
        """Free slots left in the sequence's last block."""
        slots = self.kv.num_slots(seq.seq_id)
        return -slots % self.kv.block_size
