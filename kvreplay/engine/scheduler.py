"""Continuous batching: which sequences run this step and how many tokens each computes.

Every step has a token budget. Running sequences that decode come first (one token each),
then prefill chunks of running sequences, then new sequences admitted from the waiting queue.
When the pool cannot hold a decode, the newest running sequence is preempted: its blocks are
freed and it goes back to the front of the queue, to be recomputed exactly later.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvreplay.engine.kv_manager import KVManager
from kvreplay.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledBatch:
    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)  # (sequence, chunk tokens)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


class Scheduler:
    def __init__(self, kv: KVManager, max_num_batched_tokens: int, max_num_seqs: int):
        self.kv = kv
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues (finish or abort) and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.seq_id)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.kv.free(seq.seq_id)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.stats.preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch()
        budget = self.max_num_batched_tokens

        # 1. Decodes of running sequences, oldest first; preempt the newest when the pool is full.
        for seq in list(self.running):
            if seq not in self.running or seq.num_uncomputed_tokens != 1 or budget == 0:
                continue
            while not self.kv.allocate(seq.seq_id, 1):
                victim = self.running[-1]
                self._preempt(victim)
                batch.preempted.append(victim)
                if victim is seq:
                    break
            else:
                batch.decodes.append(seq)
                budget -= 1

        # 2. Prefill chunks of running sequences (long prompts continue where they left off).
        for seq in self.running:
            if budget == 0:
                break
            if seq.num_uncomputed_tokens > 1:
                chunk = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, budget))
                if chunk:
                    batch.prefills.append((seq, chunk))
                    budget -= chunk

        # 3. Admit waiting sequences. Never admit in a step that had to preempt: the pool is full.
        while self.waiting and budget > 0 and not batch.preempted \
                and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Admit only when the whole remaining prefill fits, so admissions do not thrash.
            if self.kv.num_blocks_needed(seq.seq_id, seq.num_uncomputed_tokens) > self.kv.num_free_blocks:
                break
            chunk = self._fit_chunk(seq, min(seq.num_uncomputed_tokens, budget))
            if not chunk:
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            batch.prefills.append((seq, chunk))
            budget -= chunk
        return batch

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
