"""Continuous batching under a KV budget: which sequences run this step, how many tokens each
computes, and which pause when memory is short.

Every step has a token budget and follows the same order:

0. Reclaim: if this step's decodes would lift usage above the `high` watermark, pause the
   cheapest victims (see `kvreplay.kv.policy`) until it is back under `low` (hysteresis).
1. Decodes of running sequences, oldest first. If the pool still cannot hold one, pause another
   sequence at once (cheapest first; a paused sequence's pins as a last resort).
2. Prefill chunks of running sequences (long prompts and replays continue where they left off).
3. Admission, only in a step that paused nobody: paused sequences first (they resume with an
   exact replay of their dropped range at the original positions), then new ones, while usage
   after admitting stays under `admit`. A prefix-cache hit is adopted first and not recomputed.

Pausing keeps the sequence's pinned head (protected span and sinks, `pause_mode="protected"`)
or nothing (`"recompute"`, vLLM's recompute preemption). The KV manager does every block change;
the scheduler only asks and then tells it what to do.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvreplay.kv.manager import KVManager
from kvreplay.kv.policy import Watermarks, pause_cost
from kvreplay.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk tokens)
    paused: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    def __init__(self, kv: KVManager, max_num_batched_tokens: int, max_num_seqs: int,
                 watermarks: Watermarks = Watermarks(), pause_mode: str = "protected",
                 block_bytes: int = 1):
        self.kv = kv
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
        self._reclaim(batch)

        # 1. Decodes, oldest first. A pause here is forced: the pool is full.
        scheduled: set[int] = set()
        for seq in list(self.running):
            if seq not in self.running or seq.num_uncomputed_tokens != 1 or budget == 0:
                continue
            while not self.kv.allocate(seq.seq_id, 1):
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

        # 2. Prefill chunks of running sequences.
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncomputed_tokens > 1:
                chunk = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, budget))
                if chunk:
                    batch.prefills.append((seq, chunk))
                    budget -= chunk

        # 3. Admission (resumes first: paused sequences sit at the front of the queue).
        admit_blocks = self.watermarks.admit * self.kv.num_blocks
        # Running prompts still to prefill are committed already: project them in.
        committed = self.kv.num_used_blocks + sum(
            self.kv.num_blocks_needed(seq.seq_id, seq.num_uncomputed_tokens)
            for seq in self.running if seq.num_uncomputed_tokens > 1)
        while self.waiting and budget > 0 and not batch.paused \
                and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hits = self.kv.match_prefix(seq.seq_id, seq.token_ids)
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
            self.waiting.popleft()
            hit_tokens = self.kv.adopt_prefix(seq.seq_id, hits)
            seq.num_computed_tokens += hit_tokens
            seq.stats.prefix_hit_tokens += hit_tokens
            if seq.replay_end > seq.num_computed_tokens:
                seq.stats.replays += 1
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            committed += projected
            chunk = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, budget))
            if chunk:
                batch.prefills.append((seq, chunk))
                budget -= chunk
        return batch

    # ------------------------------------------------------------------ memory pressure
    def _decode_growth(self) -> int:
        return sum(self.kv.num_blocks_needed(seq.seq_id, 1) for seq in self.running
                   if seq.num_uncomputed_tokens == 1)

    def _reclaim(self, batch: ScheduledBatch) -> None:
        """Hysteresis: start above `high`, then pause down to `low`, never the last runner."""
        total = self.kv.num_blocks
        if self.kv.num_used_blocks + self._decode_growth() <= self.watermarks.high * total:
            return
        while len(self.running) > 1 and \
                self.kv.num_used_blocks + self._decode_growth() > self.watermarks.low * total:
            victim = self._cheapest_victim(exclude=set())
            if victim is None:
                return
            self._pause(victim, batch)

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
        if kept == 0:
            seq.stats.preemptions += 1
        self.running.remove(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        batch.paused.append(seq)

    def _release_paused_pins(self, exclude: Sequence | None) -> bool:
        """Last resort when pinned heads of paused sequences fill the pool: drop one (newest
        first) entirely. Running sequences' pins are never touched."""
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
