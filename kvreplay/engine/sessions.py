"""Kept sessions: a finished request's sequence, parked with its KV as its policy left it, so the
next round of a chat extends it instead of starting over (docs/architecture.md §5, "Kept
sessions").

What a lossy policy removed stays removed: SnapKV's and H2O's evicted blocks are gone and the
next round attends without them; replay's dropped blocks are replayed before the next round's
prefill (exact), as for any prefill over a dropped range. Parked sequences hold pool blocks but
belong to no queue; the engine releases the oldest when a waiting request could not start
otherwise.
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from kvreplay.engine.sequence import ReplayState, Sequence, SequenceStatus
from kvreplay.outputs import RequestStats
from kvreplay.sampling import SamplingParams


class KeptSessions:
    """Parked sequences by the request id that produced them, oldest first."""

    def __init__(self, free):
        self._free = free  # frees a sequence's blocks in the KV manager (by seq_id)
        self._kept: OrderedDict[str, Sequence] = OrderedDict()

    def __len__(self) -> int:
        return len(self._kept)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._kept

    def sequences(self) -> list[Sequence]:
        return list(self._kept.values())

    def park(self, seq: Sequence) -> None:
        self._kept[seq.request_id] = seq

    def release(self, request_id: str) -> bool:
        """Free a kept session's blocks; False when none is kept under that id."""
        seq = self._kept.pop(request_id, None)
        if seq is None:
            return False
        self._free(seq.seq_id)
        return True

    def release_oldest(self) -> bool:
        if not self._kept:
            return False
        return self.release(next(iter(self._kept)))

    def release_while(self, over) -> None:
        """Release the oldest kept sessions while `over()` says the pool is too full."""
        while over() and self.release_oldest():
            pass

    def take(self, request_id: str, token_ids: list[int]) -> Sequence:
        """The kept sequence `token_ids` extends (its computed tokens must open them), taken out
        of the store; a ValueError naming the problem otherwise (the session stays kept)."""
        seq = self._kept.get(request_id)
        if seq is None:
            raise ValueError(f"no kept session {request_id!r}: it was never kept (keep=True), "
                             f"was continued already, or was released to make room")
        computed = seq.num_computed_tokens
        if len(token_ids) <= computed or token_ids[:computed] != seq.token_ids[:computed]:
            raise ValueError(f"the prompt does not extend kept session {request_id!r}: its first "
                             f"{computed:,} tokens must be the session's and at least one more must follow")
        del self._kept[request_id]
        return seq


    def resume(self, continues: str, request_id: str, token_ids: list[int], params: SamplingParams,
               max_tokens: int, eos_ids: set[int], rng, hot_from: int | None) -> Sequence:
        """The kept sequence of request `continues`, turned into the only sequence of request
        `request_id` whose prompt is `token_ids` (queue it with `Scheduler.add(kept=True)`)."""
        seq = self.take(continues, token_ids)
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos_ids)
        generator = None if params.greedy else torch.Generator().manual_seed(
            params.seed if params.seed is not None else rng.getrandbits(63))
        _continue(seq, request_id, token_ids, params, stop_ids, generator, max_tokens)
        seq.hot_from = hot_from
        return seq


def _continue(seq: Sequence, request_id: str, token_ids: list[int], params: SamplingParams,
              stop_ids: set[int], generator, max_tokens: int) -> None:
    """Reset a parked sequence's request state for a new prompt `token_ids`: its K/V up to
    `num_computed_tokens` stay, the rest is prefilled."""
    seq.request_id = request_id
    seq.params = params
    seq.prompt_token_ids = list(token_ids)
    seq.token_ids = list(token_ids)
    seq.num_prompt_tokens = len(token_ids)
    seq.status = SequenceStatus.WAITING
    seq.finish_reason = None
    seq.stop_ids = stop_ids
    seq.generator = generator
    seq.logprobs = []
    seq.text = ""
    # a new object (the last round's output keeps its own); the kept tokens count as a prefix hit
    seq.stats = RequestStats(prompt_tokens=len(token_ids), prefix_hit_tokens=seq.num_computed_tokens)
    seq.max_tokens = max_tokens
    seq.replay = ReplayState()
    seq.forks = []
    seq.beam = None
