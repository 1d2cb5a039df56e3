"""Continuous batching under a KV budget: which sequences run this step, how many tokens each
computes, and which pause when memory is short.

Every step has a token budget and follows the same order:

0. Reclaim: if this step's decodes would lift usage above the `high` watermark, pause the
   cheapest victims (see `kvreplay.kv.policy`) until the running sequences' blocks are back
   under `low` (hysteresis; kept heads of paused sequences count as reclaimed).
1. Decodes of running sequences, oldest first. If the pool still cannot hold one, pause another
   sequence at once (cheapest first; a paused sequence's pins as a last resort).
2. Prefill chunks of running sequences (long prompts and replays continue where they left off).
3. Admission, only in a step that paused nobody: paused sequences first (they resume with an
   exact replay of their dropped range at the original positions), then new ones, while usage
   after admitting stays under `admit`. A prefix-cache hit is adopted first and not recomputed.

Dropping policies (window, replay; SPEC §6) add two actions. Before pausing anyone, reclaim drops
middle blocks (oldest positions first; sequences that replayed recently last). A running sequence
whose dropped ranges are needed (the need detector fired, or a prefill chunk must see them) replays
them in order, whole blocks at their original positions, before it decodes or prefills again;
room for a replay is made by trimming or pausing *other* sequences, so one sequence may replay
while the rest stay trimmed.

With `layered_prefill`, a prompt (or a resumed range) whose middle would be dropped right after
its prefill is computed one layer at a time over its whole range instead of in token chunks:
its middle starts out dropped and only its kept blocks, key-index slots and working memory count
at admission. Each step hands it about a token budget's worth of layers.

Pausing keeps the sequence's pinned head (protected span and sinks, `pause_mode="protected"`)
or nothing (`"recompute"`, vLLM's recompute preemption). The KV manager does every block change;
the scheduler only asks and then tells it what to do.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from kvreplay.kv.manager import KVManager
from kvreplay.kv.policy import POLICIES, KVPolicy, Watermarks, middle_block_range, pause_cost
from kvreplay.engine.sequence import LayeredPrefill, Sequence, SequenceStatus


RETRIM_AFTER_STEPS = 32  # steps after its last replay before resident_ratio trims a sequence again
# A layered prefill cannot pick heavy hitters after the fact (the middle's K/V never exist for
# every layer at once), so it keeps this many times `heavy_tokens` of the middle's last blocks
# hot as candidates, and the usual trim after prefill keeps the heavy ones among them. On
# SmolLM2-135M over the serving bench's 3,000-token prompts, 24 of the 28 top-2 blocks by the
# prompt's observed attention lie in the middle's last 16 blocks (bench note in
# docs/benchmarks/replay.md).
HEAVY_CANDIDATES = 8


@dataclass
class ReplayChunk:
    """Dropped blocks `block_indices` of `seq`, recomputed at positions [start, start + num_tokens)."""
    seq: Sequence
    start: int
    num_tokens: int
    block_indices: list[int]


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk tokens)
    replays: list[ReplayChunk] = field(default_factory=list)
    layers: list[tuple[Sequence, range]] = field(default_factory=list)  # layered prefills' layers
    paused: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills) + \
            sum(r.num_tokens for r in self.replays)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills or self.replays or self.layers)


class Scheduler:
    def __init__(self, kv: KVManager, max_num_batched_tokens: int, max_num_seqs: int,
                 watermarks: Watermarks = Watermarks(), pause_mode: str = "protected",
                 block_bytes: int = 1, policy: KVPolicy = POLICIES["full"],
                 window_tokens: int = 512, trim: str = "pressure", approx_prefill: bool = False,
                 heavy_tokens: int = 0, trim_order: str = "importance",
                 resident_ratio: float | None = None, num_layers: int = 1,
                 layered_work: Callable[[int, int], int] | None = None):
        self.kv = kv
        # Layered prefill (None: off): working bytes of computing positions [start, end) layer
        # by layer, and the model's layer count.
        self.layered_work = layered_work
        self.num_layers = num_layers
        self.resident_ratio = resident_ratio
        self.heavy_blocks = heavy_tokens // kv.block_size
        self.by_importance = trim_order == "importance"
        self.policy = policy
        self.window_tokens = window_tokens
        self.trim = trim
        self.approx_prefill = approx_prefill
        self.num_steps = 0
        self._busy: set[int] = set()
        self._chunked: set[int] = set()
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.watermarks = watermarks
        self.keep_pinned = pause_mode == "protected"
        self.block_bytes = block_bytes
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
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

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finish or abort) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)

    # ------------------------------------------------------------------ the step
    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens
        self.num_steps += 1
        self._reclaim(batch)

        # 1. Decodes, oldest first. A pause here is forced: the pool is full.
        scheduled: set[int] = set()
        self._busy = scheduled  # sequences with work in this batch: never paused
        self._chunked: set[int] = set()  # prefill or replay chunk in this batch: never trimmed
        for seq in self.running:
            if self._wants_replay(seq):  # what the prefix cache still holds comes back for free
                self._restore_cached(seq)
        for seq in list(self.running):
            if seq not in self.running or seq.num_uncomputed_tokens != 1 or budget == 0 \
                    or self._wants_replay(seq):
                continue
            while not self.kv.allocate(seq.seq_id, 1):
                if self._trim_for_room(1):
                    continue
                victim = self._cheapest_victim(exclude=scheduled | {seq.seq_id})
                if victim is None and self._release_paused_pins(exclude=None):
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
            elif self._wants_replay(seq):
                budget -= self._schedule_replay(seq, budget, batch)
            elif seq.num_uncomputed_tokens > 1:
                budget -= self._schedule_prefill(seq, budget, batch)

        # 3. Admission (resumes first: paused sequences sit at the front of the queue).
        admit_blocks = self.watermarks.admit * self.kv.num_blocks
        # Running prompts still to prefill are committed already: project them in.
        # (A layered prefill holds its blocks from the start.)
        committed = self.kv.num_used_blocks + sum(
            self.kv.num_blocks_needed(seq.seq_id, seq.num_uncomputed_tokens)
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
            if self.running:
                if committed + projected > admit_blocks:
                    break
            elif projected > self.kv.num_free_blocks:
                # Alone it must fit whatever the watermarks say; make room from paused pins.
                if self._release_paused_pins(exclude=seq):
                    continue
                if not self.kv.can_allocate(seq.seq_id, 1):
                    break
            if layered is not None and not self._begin_layered(seq, layered) and self.running:
                break  # (alone, it prefills in chunks instead)
            self.waiting.popleft()
            hit_tokens = self.kv.adopt_prefix(seq.seq_id, hits)
            seq.num_computed_tokens += hit_tokens
            seq.stats.prefix_hit_tokens += hit_tokens
            if seq.replay_end > seq.num_computed_tokens:
                seq.stats.replays += 1
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            committed += projected
            if seq.layered is not None:
                budget -= self._schedule_layers(seq, budget, batch)
            else:
                budget -= self._schedule_prefill(seq, budget, batch)
        return batch

    def _schedule_prefill(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        """The next prefill chunk of `seq` that fits the budget and the pool; tokens used."""
        chunk = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, budget))
        if chunk:
            batch.prefills.append((seq, chunk))
            self._busy.add(seq.seq_id)
            self._chunked.add(seq.seq_id)
        return chunk

    # ------------------------------------------------------------------ layered prefill
    def _layered_middle(self, seq: Sequence) -> range | None:
        """The middle blocks a layered prefill of `seq`'s uncomputed tokens would leave dropped
        from the start, or None when `seq` prefills in token chunks: layered prefill is off,
        the preset keeps the middle after prefill, the range does not start on a block
        boundary or something is dropped already, or it would save no memory."""
        if self.layered_work is None or self.approx_prefill or seq.beam is not None or seq.forks:
            return None
        if not self.policy.drops_middle or self.policy.demotes or \
                not (self.policy.slides or self.trim == "prefill"):
            return None
        start, end = seq.num_computed_tokens, seq.num_tokens
        block_size = self.kv.block_size
        if start % block_size or self.kv.num_slots(seq.seq_id) != start or \
                self.kv.dropped_blocks(seq.seq_id) or end - start < 2:
            return None
        middle = middle_block_range(end, seq.pinned_tokens, self.window_tokens, block_size)
        middle = range(max(middle.start, start // block_size),
                       max(middle.start, middle.stop - HEAVY_CANDIDATES * self.heavy_blocks))
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
        self._chunked.add(seq.seq_id)
        return min(budget, -(-count * tokens // self.num_layers))

    # ------------------------------------------------------------------ dropped ranges
    def _wants_replay(self, seq: Sequence) -> bool:
        """Replay first: the detector asked, or a prefill chunk must see the dropped ranges
        (a layered prefill computes its range whole: nothing before it is dropped)."""
        return seq.needs_replay or (seq.num_uncomputed_tokens > 1 and not self.approx_prefill
                                    and seq.layered is None
                                    and bool(self.kv.dropped_blocks(seq.seq_id)))

    def _schedule_replay(self, seq: Sequence, budget: int, batch: ScheduledBatch) -> int:
        """Schedule the oldest run of `seq`'s dropped blocks (exact: everything before it is
        resident). Blocks still in the prefix cache come back for free. Returns tokens used."""
        block_size = self.kv.block_size
        if not self._restore_cached(seq):
            return 0
        dropped = self.replay_left(seq)
        run = [index for offset, index in enumerate(dropped) if index == dropped[0] + offset]
        blocks = run[:budget // block_size]
        while blocks and not self.kv.allocate_restore(seq.seq_id, blocks):
            if self._trim_for_room(len(blocks), exclude={seq.seq_id}):
                continue
            victim = self._cheapest_victim(exclude=self._busy | {seq.seq_id})
            if victim is not None:
                self._pause(victim, batch)
            else:
                blocks = blocks[:self.kv.num_free_blocks]
        if not blocks:
            return 0
        self._start_replay(seq)
        batch.replays.append(ReplayChunk(seq, blocks[0] * block_size, len(blocks) * block_size, blocks))
        self._busy.add(seq.seq_id)
        self._chunked.add(seq.seq_id)
        return len(blocks) * block_size

    def _restore_cached(self, seq: Sequence) -> bool:
        """Take back dropped blocks still in the prefix cache: for a need-replay, the judged
        block alone when the cache holds it, else those before it; otherwise all. False when
        the replay has nothing left to bring back."""
        if seq.replay_until is None:
            restored = self.kv.restore_cached(seq.seq_id, seq.token_ids)
        else:
            restored = self.kv.restore_cached(seq.seq_id, seq.token_ids, [seq.replay_until]) \
                or self.kv.restore_cached(seq.seq_id, seq.token_ids, self.replay_left(seq))
        if restored:
            self._start_replay(seq)
        if self.replay_left(seq):
            return True
        self.end_replay(seq)
        return False

    def replay_left(self, seq: Sequence) -> list[int]:
        """Dropped blocks the replay under way must still bring back, oldest first: all of them,
        or for a need-replay with a judged block, those up to it while it is still dropped
        (restored from the prefix cache, it needs nothing before it: cached K/V are exact)."""
        dropped = self.kv.dropped_blocks(seq.seq_id)
        until = seq.replay_until  # set only while a need-replay is asked for (end_replay clears it)
        if until is None:
            return dropped
        if until not in dropped:
            return []
        return [index for index in dropped if index <= until]

    def end_replay(self, seq: Sequence) -> None:
        seq.needs_replay = seq.replaying = False
        seq.replay_until = None

    def _start_replay(self, seq: Sequence) -> None:
        if not seq.replaying:
            seq.replaying = True
            seq.stats.replays += 1
        seq.last_replay_step = self.num_steps

    def _middle(self, seq: Sequence) -> list[int]:
        """Hot middle blocks of `seq` that dropping would free, less its heavy hitters (the
        `heavy_tokens` worth of middle blocks with the most observed attention)."""
        if seq.beam is not None or seq.forks:  # beams and unforked parents keep their blocks
            return []
        hot_from = seq.hot_from if self.policy.demotes else None
        blocks = middle_block_range(seq.num_computed_tokens, seq.pinned_tokens, self.window_tokens,
                                    self.kv.block_size, hot_from)
        middle = self.kv.droppable(seq.seq_id, blocks)
        heavy = self.kv.importance.most_important(seq.seq_id, middle, self.heavy_blocks)
        return [index for index in middle if index not in heavy]

    def _trim_keys(self, seq: Sequence, indices: list[int], cold: int) -> list[tuple]:
        """Reclaim order: sequences that replayed recently last; hot blocks before cold ones;
        then the least observed attention (trim_order="importance") or the oldest block."""
        scores = self.kv.importance.scores(seq.seq_id, indices) if self.by_importance else [0.0] * len(indices)
        return [((seq.last_replay_step, cold, score, index, seq.seq_id), seq)
                for score, index in zip(scores, indices)]

    def _trim_for_room(self, num_blocks: int, exclude: set[int] = frozenset(),
                       target_used: int | None = None) -> bool:
        """Take middle blocks out of the hot tier until `num_blocks` are free (or usage reaches
        `target_used`): hot middle blocks first (demoted to cold, or dropped), then cold ones
        (dropped); least observed attention (or oldest) first; sequences that replayed most
        recently last. True if anything moved."""
        if not (self.policy.drops_middle or self.policy.demotes):
            return False
        drops_cold = self.policy.drops_middle and self.policy.demotes
        candidates = []
        for seq in self.running:
            if seq.seq_id in exclude or not self._trimmable(seq):
                continue
            candidates += self._trim_keys(seq, self._middle(seq), 0)
            if drops_cold and seq.beam is None:
                candidates += self._trim_keys(seq, self.kv.cold_blocks(seq.seq_id), 1)
        candidates.sort(key=lambda c: c[0])
        moved = False
        for (_, cold, _, index, _), seq in candidates:
            if target_used is None and self.kv.num_free_blocks >= num_blocks:
                break
            if target_used is not None and self.kv.num_used_blocks <= target_used:
                break
            if cold:
                self._drop_cold(seq, [index])
            else:
                self._evict(seq, [index])
            moved = True
        return moved

    def _trimmable(self, seq: Sequence) -> bool:
        """Not replaying, no prefill chunk in this batch, and, while it prefills, only when
        later chunks may attend approximately (else they would replay at once)."""
        if self._wants_replay(seq) or seq.seq_id in self._chunked:
            return False
        return seq.num_uncomputed_tokens == 1 or self.approx_prefill

    def _drop_cold(self, seq: Sequence, indices: list[int]) -> None:
        """Cold blocks leave the cold tier: dropped (their keys kept in the key index)."""
        self.kv.drop_cold(seq.seq_id, indices, keep_index=self.policy.keeps_key_index)
        seq.stats.dropped_tokens += len(indices) * self.kv.block_size

    def _evict(self, seq: Sequence, block_indices: list[int]) -> None:
        """Hot middle blocks leave the hot tier: demoted to cold, or dropped."""
        if self.policy.demotes:
            self.kv.demote(seq.seq_id, block_indices)
            seq.stats.cold_blocks += len(block_indices)
        else:
            self.kv.drop(seq.seq_id, block_indices, keep_index=self.policy.keeps_key_index)
            seq.stats.dropped_tokens += len(block_indices) * self.kv.block_size

    def trim_after_step(self, prefilled: list[Sequence]) -> None:
        """Policy trimming at the end of a step: sliding presets (window, sparse, replay+cold)
        move whatever left the window out of the hot tier; `replay` with trim="prefill" drops
        the middle of prompts whose prefill just ended."""
        if self.policy.slides:
            targets = [seq for seq in self.running if seq.num_uncomputed_tokens == 1]
        elif self.policy.drops_middle and self.trim == "prefill":
            targets = [seq for seq in prefilled if seq in self.running]
        else:
            return
        for seq in targets:
            blocks = self._middle(seq)
            if blocks:
                self._evict(seq, blocks)
        if self.resident_ratio is not None and self.policy.drops_middle:
            for seq in self.running:  # the step is done: a chunk that just ran is safe to trim
                replayed_lately = seq.last_replay_step >= 0 and \
                    self.num_steps - seq.last_replay_step <= RETRIM_AFTER_STEPS
                if seq.num_uncomputed_tokens == 1 and not self._wants_replay(seq) and not replayed_lately:
                    self._fit_ratio(seq)

    def _fit_ratio(self, seq: Sequence) -> None:
        """Drop `seq`'s middle blocks, least important first (cold ones once the hot middle is
        gone), until its resident KV (hot + cold + key index) is within `resident_ratio` of
        the blocks `full` would hold for it. A sequence that replayed in the last
        `RETRIM_AFTER_STEPS` steps keeps its replayed middle: trimming it at once let the need
        detector fire again at the next step, one replay per token."""
        kv = self.kv
        limit = self.resident_ratio * -(-seq.num_computed_tokens // kv.block_size) * kv.block_bytes
        excess = kv.resident_bytes(seq.seq_id) - limit
        if excess <= 0:
            return
        candidates = self._trim_keys(seq, self._middle(seq), 0)
        if self.policy.demotes:
            candidates += self._trim_keys(seq, kv.cold_blocks(seq.seq_id), 1)
        keep_index = self.policy.keeps_key_index
        chosen: tuple[list[int], list[int]] = ([], [])  # hot, cold table indices
        for (_, cold, _, index, _), _ in sorted(candidates, key=lambda c: c[0]):
            if excess <= 0:
                break
            chosen[cold].append(index)
            excess -= kv.bytes_freed_by_drop(bool(cold), keep_index)
        # one call per tier: after a replay this drops the whole middle again (~180 blocks for
        # a 3,000-token prompt), and per-block calls cost ~0.4 ms each
        kv.drop(seq.seq_id, chosen[0], keep_index=keep_index)
        seq.stats.dropped_tokens += len(chosen[0]) * kv.block_size
        self._drop_cold(seq, chosen[1])

    # ------------------------------------------------------------------ memory pressure
    def _decode_growth(self) -> int:
        return sum(self.kv.num_blocks_needed(seq.seq_id, 1) for seq in self.running
                   if seq.num_uncomputed_tokens == 1)

    def _reclaim(self, batch: ScheduledBatch) -> None:
        """Hysteresis: start when the pool (kept heads included) goes above `high`, then pause
        until the running sequences' blocks are under `low`, never the last runner.

        The kept head of a paused sequence counts as reclaimed: it is released on demand (see
        `_release_paused_pins`), and counting it as used would pause more sequences per reclaim
        in protected mode than in recompute mode for the same room (see `kvreplay.kv.policy`)."""
        total = self.kv.num_blocks
        if self.kv.num_used_blocks + self._decode_growth() <= self.watermarks.high * total:
            return
        self._busy, self._chunked = set(), set()
        self._trim_for_room(0, target_used=int(self.watermarks.low * total) - self._decode_growth())
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
            if seq.seq_id in exclude:
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
        seq.replay_end = max(seq.replay_end, computed)
        seq.stats.pauses += 1
        seq.stats.dropped_tokens += computed - kept
        self.end_replay(seq)
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
        seq.replay_end = max(seq.replay_end, computed)
        self.end_replay(seq)
        seq.layered = None
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)

    def _release_paused_pins(self, exclude: Sequence | None) -> bool:
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
