"""Replay tracking: the one owner of each sequence's replay state (`Sequence.replay`).

A sequence replays when the need detector judged one of its dropped blocks needed (then only
the dropped run up to that block), when a prefill chunk must see its dropped ranges, or when it
resumes after a pause (its range past the kept head). A replay recomputes whole blocks at their
original positions; each replayed block is checked against the fingerprint taken when it left,
and a mismatch recomputes the whole sequence. docs/architecture.md draws the state machine.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from kvreplay.engine.sequence import Sequence
from kvreplay.kv import KVManager
from kvreplay.kv.policy import REPLAY_HOLDS

logger = logging.getLogger(__name__)

HOLD_STEPS = 32  # steps after a need-replay while its replayed middle (or its cut) is held


@dataclass
class NeedOutcome:
    """What the need detector saw for one decoding sequence at one step: the largest share of
    some head's attention any of its dropped blocks would take, and that block's table index."""
    seq: Sequence
    mass: float
    flagged: int | None


class ReplayTracker:
    def __init__(self, kv: KVManager, approx_prefill: bool = False, threshold: float = 0.65,
                 replayable: bool = True, hold: str = "middle"):
        assert hold in REPLAY_HOLDS, hold
        self.kv = kv
        # after a need-replay, what a resident_ratio cut spares: the whole replayed middle for
        # HOLD_STEPS steps, or (threshold > 0) only the blocks the detector judged needed
        self.hold_judged = hold == "judged" and threshold > 0
        self.approx_prefill = approx_prefill  # prefill chunks attend to what is resident instead
        self.replayable = replayable          # False: dropped means evicted for good (snapkv, h2o, window)
        self.threshold = threshold            # need share above which a dropped block comes back
        self.loader = None  # the session tier's TierLoader (engine/tier_loads.py), when one is on
        # A hybrid pool's local layers keep only their window, and a dropped block's K/V at a
        # global layer depend on every local window before it, layer by layer: no dropped run
        # can be recomputed alone, so a replay recomputes the whole sequence (still exact).
        self.recomputes_whole = bool(kv.local.num_groups)

    # ------------------------------------------------------------------ questions
    def wants_replay(self, seq: Sequence) -> bool:
        """Replay first: the detector asked, or a prefill chunk must see the dropped ranges
        (a layered prefill computes its range whole: nothing before it is dropped; a policy
        that evicts for good attends to what is resident, as in a kept session's next round)."""
        return seq.replay.needed or (seq.num_uncomputed_tokens > 1 and not self.approx_prefill
                                     and self.replayable and seq.layered is None
                                     and bool(self.kv.dropped_blocks(seq.seq_id)))

    def replay_left(self, seq: Sequence) -> list[int]:
        """Dropped blocks the replay under way must still bring back, oldest first: all of them,
        or for a need-replay with a judged block, those up to it while it is still dropped
        (restored from the prefix cache, it needs nothing before it: cached K/V are exact)."""
        dropped = self.kv.dropped_blocks(seq.seq_id)
        until = seq.replay.until  # set only while a need-replay is asked for (end clears it)
        if until is None:
            return dropped
        if until not in dropped:
            return []
        return [index for index in dropped if index <= until]

    def holds_middle(self, seq: Sequence, step: int) -> bool:
        """Whether the resident_ratio cap must leave `seq` alone at `step`: it replayed in the
        last HOLD_STEPS steps (hold "middle": cutting right after the redone step let the
        detector fire again at the next one, a replay per token), or (hold "judged") a block it
        asked for has not been read by a committed token yet."""
        if self.hold_judged:
            return bool(seq.replay.judged)
        return self.replayed_lately(seq, step)

    @staticmethod
    def replayed_lately(seq: Sequence, step: int) -> bool:
        """Whether `seq` replayed in the last HOLD_STEPS steps."""
        return seq.replay.last_step >= 0 and step - seq.replay.last_step <= HOLD_STEPS

    def cut_after_replay(self, seq: Sequence, indices: list[int], step: int | None) -> None:
        """Hold "judged": blocks a ratio cut took within HOLD_STEPS steps of a need-replay were
        just read exactly by the redone step and judged not needed: the probe skips them
        until the hold ends, so the detector's overestimates cannot replay them again."""
        if self.hold_judged and step is not None and self.replayed_lately(seq, step):
            seq.replay.cleared.update(indices)

    def step_done(self, seq: Sequence, step: int) -> None:
        """The hold of `seq`'s last need-replay is over: its cut blocks may be probed again."""
        if seq.replay.cleared and not self.replayed_lately(seq, step):
            seq.replay.cleared.clear()

    def replayed_tokens(self, seq: Sequence, start: int, end: int) -> int:
        """Of positions [start, end) now computed, those that had been computed before a pause."""
        return max(0, min(end, seq.replay.end) - start)

    # ------------------------------------------------------------------ transitions
    def restore_cached(self, seq: Sequence, step: int) -> bool:
        """Take back dropped blocks still in the prefix cache: for a need-replay, the judged
        block alone when the cache holds it, else those before it; otherwise all. False when
        the replay has nothing left to bring back (it ends). On a hybrid pool what is left is
        then recomputed whole; what came back is exact either way (the bits that left)."""
        kv = self.kv
        if seq.replay.until is None:
            restored = kv.restore_cached(seq.seq_id, seq.token_ids)
        else:
            restored = kv.restore_cached(seq.seq_id, seq.token_ids, [seq.replay.until]) \
                or kv.restore_cached(seq.seq_id, seq.token_ids, self.replay_left(seq))
        if self.loader is not None and self.replay_left(seq):  # then what the session tier holds
            restored = self.loader.restore(seq, self.replay_left(seq)) or restored
        if restored:
            self.start(seq, step)
        if self.replay_left(seq):
            return True
        self.end(seq)
        return False

    def load_prefix(self, seq: Sequence) -> int:
        """At admission: tokens after the prefix-cache hit loaded from the session tier."""
        return self.loader.load_prefix(seq) if self.loader is not None else 0

    def prefill_cap(self, seq: Sequence) -> int | None:
        """The most tokens `seq`'s next prefill chunk may compute (a session-tier tail being
        read comes next), or None."""
        return self.loader.prefill_cap(seq) if self.loader is not None else None

    def replay_stop(self, seq: Sequence) -> int | None:
        """The table index where `seq`'s replay chunks stop (a session-tier tail being read
        starts there), or None."""
        return self.loader.replay_stop(seq) if self.loader is not None else None

    def start(self, seq: Sequence, step: int) -> None:
        if not seq.replay.active:
            seq.replay.active = True
            seq.stats.replays += 1
        if seq.replay.needed:  # (one a prefill asked for is cut again when that prefill ends)
            seq.replay.last_step = step

    def end(self, seq: Sequence) -> None:
        seq.replay.needed = seq.replay.active = False
        seq.replay.until = None

    def paused(self, seq: Sequence, computed: int) -> None:
        """`seq` was paused with `computed` tokens computed: what it recomputes up to there on
        resume is replay."""
        seq.replay.end = max(seq.replay.end, computed)
        seq.approx_from = None  # whatever it recomputes is computed with everything before it
        seq.replay.kept.clear()
        seq.replay.cleared.clear()
        # What it recomputes is exact and cut anew: no hold outlives the pause (a held middle,
        # or judged blocks waiting for a token, kept the recomputed prefill over its ratio).
        seq.replay.last_step = -1
        if self.hold_judged:
            seq.replay.judged.clear()
        self.end(seq)
        if self.loader is not None:
            self.loader.forget(seq)

    def resumed(self, seq: Sequence) -> None:
        if seq.replay.end > seq.num_computed_tokens:
            seq.stats.replays += 1

    def judge_needs(self, outcomes: list[NeedOutcome]) -> set[Sequence]:
        """Sequences whose dropped blocks the detector judged needed at this step: they replay
        the dropped blocks up to the needed one, in order (or only it, when the prefix cache
        still holds it), then redo the step; threshold 0 asks for every dropped block.

        A block is asked for at most once per token: when pressure (a full pool, an admission)
        takes it again before the redone step reads it, that step decodes without it rather
        than replay it again, so a sequence always makes progress."""
        fired = set()
        for outcome in outcomes:
            seq = outcome.seq
            if self.threshold > 0 and outcome.flagged in seq.replay.judged:
                continue  # brought back for this token already, and taken again: decode without it
            if outcome.mass > self.threshold or self.threshold == 0:
                fired.add(seq)
                seq.replay.until = outcome.flagged if self.threshold > 0 else None
                seq.replay.needed = True
                seq.replay.judged.add(outcome.flagged)
                if self.hold_judged:
                    seq.replay.kept.add(outcome.flagged)
        return fired

    def token_committed(self, seq: Sequence) -> None:
        seq.replay.judged.clear()

    def check_replayed(self, seq: Sequence, block_indices: list[int], num_tokens: int) -> int:
        """A replay chunk of `seq` has written its K/V: compare each block with its fingerprint
        (not blocks from `approx_from` on: their dropped K/V were computed without some range,
        the replay's are exact). Returns the mismatches (then the caller recomputes it all)."""
        seq.stats.replayed_tokens += num_tokens
        mismatches = self.kv.finish_restore(seq.seq_id, block_indices, seq.token_ids, seq.approx_from)
        if mismatches:
            seq.stats.replay_mismatches += mismatches
            logger.warning("request %s: %d replayed block(s) failed the fingerprint check; "
                           "recomputing the sequence", seq.request_id, mismatches)
        elif not self.replay_left(seq):
            self.end(seq)
        return mismatches
