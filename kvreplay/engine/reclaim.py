"""Reclaim: what leaves the hot tier, and in which order.

The policy preset decides how middle blocks leave (demoted to the cold tier, dropped with their
keys kept in the key index, or evicted for good); this module decides which, and when:

- under pressure (`trim_for_room`), and with trim="admission" also when a waiting request does
  not fit under the `admit` watermark (`room_to_admit`): hot middle blocks first, then cold
  ones; sequences that replayed most recently last; then the least observed attention
  (trim_order="importance", the H2O/SnapKV scores in kv/importance.py) or the oldest position;
- after a step (`trim_after_step`): sliding presets move what left the window out; `replay`
  with trim="prefill" drops the middle of prompts whose prefill just ended (with a
  `resident_ratio`, only down to it: SnapKV's choice, which `snapkv` evicts for good); presets
  that cap each step (replay, replay+cold, h2o) fit every decoding sequence to `resident_ratio`.

Under `resident_ratio` a preset may size its recent window from the budget (kv/policy.py
`recent_window_tokens`); `quest` keeps everything and only says which middle blocks decode
attention reads (`attention_selection`). The baselines work on whole blocks and one choice per
sequence (every layer and head keeps the same blocks), scored as kv/importance.py scores them;
the published SnapKV and H2O choose tokens per head (SnapKV after pooling its scores).

A middle block is never the protected head, the sinks, the window, a chat's hot rounds, or one
of the `heavy_tokens` most attended middle blocks. The KV manager carries out every move.
"""
from __future__ import annotations

from kvreplay.engine.replay import ReplayTracker
from kvreplay.engine.sequence import Sequence
from kvreplay.kv import KVManager
from kvreplay.kv.policy import KVPolicy, middle_block_range, quest_selection, recent_window_tokens


class Reclaimer:
    def __init__(self, kv: KVManager, policy: KVPolicy, replay: ReplayTracker, running: list[Sequence],
                 window_tokens: int = 512, trim: str = "pressure", heavy_tokens: int = 0,
                 trim_order: str = "importance", resident_ratio: float | None = None):
        self.kv = kv
        self.policy = policy
        self.replay = replay
        self.running = running  # the scheduler's running list (read only here)
        self.window_tokens = window_tokens
        self.trim = trim
        self.heavy_blocks = heavy_tokens // kv.block_size
        self.by_importance = trim_order == "importance"
        assert resident_ratio is not None or not policy.needs_ratio, f"{policy.name} needs a resident_ratio"
        self.resident_ratio = resident_ratio
        self.chunked: set[int] = set()  # prefill or replay chunk in this batch: never trimmed
        self.importance_pool = 0  # neighbour blocks whose mass a block's score takes (EngineConfig)

    def middle(self, seq: Sequence) -> list[int]:
        """Hot middle blocks of `seq` that dropping would free, less its heavy hitters (the
        `heavy_tokens` worth of middle blocks with the most observed attention)."""
        return self._middle_split(seq)[0]

    def _middle_split(self, seq: Sequence) -> tuple[list[int], list[int]]:
        """`seq`'s droppable hot middle blocks as (the rest, its heavy hitters)."""
        if seq.beam is not None or seq.forks:  # beams and unforked parents keep their blocks
            return [], []
        middle = self.kv.droppable(seq.seq_id, self.middle_range(seq))
        heavy = self.kv.importance.most_important(seq.seq_id, middle, self.heavy_blocks, self.importance_pool)
        split: tuple[list[int], list[int]] = ([], [])
        for index in middle:
            split[index in heavy].append(index)
        return split

    def heavy_hitters(self, seq: Sequence) -> list[int]:
        """Of `seq`'s droppable hot middle blocks, the `heavy_tokens` most attended ones."""
        return self._middle_split(seq)[1]

    def middle_range(self, seq: Sequence) -> range:
        """Table indices of `seq`'s middle zone: past the pinned head, older than the recent
        window (and, for the cold presets, than a chat's last rounds)."""
        hot_from = seq.hot_from if self.policy.demotes else None
        recent = self.recent_tokens(seq.num_computed_tokens, seq.pinned_tokens)
        return middle_block_range(seq.num_computed_tokens, seq.pinned_tokens, recent,
                                  self.kv.block_size, hot_from)

    def recent_tokens(self, num_tokens: int, pinned_tokens: int) -> int:
        """The recent window of a sequence of `num_tokens` (window_tokens, or the preset's)."""
        return recent_window_tokens(self.policy, num_tokens, pinned_tokens, self.kv.block_size,
                                    self.window_tokens, self.resident_ratio)

    @property
    def selects_at_prefill(self) -> bool:
        """A prompt's middle is cut to `resident_ratio` by importance when its prefill ends
        (snapkv; replay, replay+cold with trim="prefill" and a ratio), not dropped whole."""
        return self.resident_ratio is not None and self.policy.drops_middle and \
            (self.policy.selects_at_prefill or self.trim == "prefill")

    def attention_selection(self, seq: Sequence) -> tuple[range, int] | None:
        """Quest (`selects_per_step`): the middle blocks of `seq`'s decode step each KV head
        chooses among and how many it reads; None when it reads them all."""
        if not self.policy.selects_per_step:
            return None
        middle, keep = quest_selection(self.policy, seq.num_computed_tokens + 1, seq.pinned_tokens,
                                       self.kv.block_size, self.resident_ratio)
        return (middle, keep) if keep < len(middle) else None

    def resident_share(self, seq: Sequence) -> float:
        """`seq`'s KV against the blocks `full` would hold for it: resident bytes (hot + cold +
        key index), or for quest, whose memory is full's, the share its decode attention reads."""
        num_tokens = seq.num_computed_tokens
        num_blocks = -(-num_tokens // self.kv.block_size)
        if self.policy.selects_per_step:
            middle, keep = quest_selection(self.policy, num_tokens, seq.pinned_tokens,
                                           self.kv.block_size, self.resident_ratio)
            return (num_blocks - len(middle) + min(keep, len(middle))) / num_blocks
        return self.kv.resident_bytes(seq.seq_id) / (num_blocks * self.kv.block_bytes)

    def _order(self, seq: Sequence, indices: list[int], cold: int) -> list[tuple]:
        """Reclaim order: sequences that replayed recently last; hot blocks before cold ones;
        then the least observed attention (trim_order="importance") or the oldest block."""
        scores = self.kv.importance.ranks(seq.seq_id, indices, self.importance_pool) if self.by_importance \
            else [0.0] * len(indices)
        return [((seq.replay.last_step, cold, score, index, seq.seq_id), seq)
                for score, index in zip(scores, indices)]

    def trim_for_room(self, num_blocks: int, exclude: set[int] = frozenset(),
                      target_used: int | None = None) -> bool:
        """Take middle blocks out of the hot tier until `num_blocks` are free (or usage reaches
        `target_used`): hot middle blocks first (demoted to cold, or dropped), then cold ones
        (dropped), in reclaim order. True if anything moved."""
        if not (self.policy.drops_middle or self.policy.demotes) or not self.policy.trims_under_pressure:
            return False
        drops_cold = self.policy.drops_middle and self.policy.demotes
        candidates = []
        for seq in self.running:
            if seq.seq_id in exclude or not self._trimmable(seq):
                continue
            candidates += self._order(seq, self.middle(seq), 0)
            if drops_cold and seq.beam is None:
                candidates += self._order(seq, self.kv.cold_blocks(seq.seq_id), 1)
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

    def room_to_admit(self, num_blocks: int, step: int) -> int:
        """trim="admission": a waiting request does not fit under the `admit` watermark, so take
        up to `num_blocks` middle blocks of decoding sequences out of the hot tier, in reclaim
        order, for it. Returns the blocks freed (0 under the other trim modes).

        A sequence that replayed in the last HOLD_STEPS steps (engine/replay.py) is left alone,
        whatever replay_hold says for the ratio cap: a request the trim still does not let in
        (its prefix hits are the very blocks the trim frees, say) would otherwise have it replay, be trimmed and replay
        again at every step without decoding a token."""
        if self.trim != "admission" or not (self.policy.drops_middle and self.policy.trims_under_pressure):
            return 0
        spared = {seq.seq_id for seq in self.running if self.replay.replayed_lately(seq, step)}
        # Drop nothing unless it lets the request in: a partial trim would only cost quality.
        per_block = self.kv.bytes_freed_by_drop(False, self.policy.keeps_key_index) / self.kv.block_bytes
        middles = sum(len(self.middle(seq)) for seq in self.running
                      if seq.seq_id not in spared and self._trimmable(seq))
        if middles * per_block < num_blocks:
            return 0
        used = self.kv.num_used_blocks
        self.trim_for_room(0, exclude=spared, target_used=used - num_blocks)
        return used - self.kv.num_used_blocks

    def _trimmable(self, seq: Sequence) -> bool:
        """Not replaying, no prefill chunk in this batch, and, while it prefills, only when
        later chunks may attend approximately (else they would replay at once)."""
        if self.replay.wants_replay(seq) or seq.seq_id in self.chunked:
            return False
        return seq.num_uncomputed_tokens == 1 or self.replay.approx_prefill

    def _drop_cold(self, seq: Sequence, indices: list[int]) -> None:
        """Cold blocks leave the cold tier: dropped (their keys kept in the key index)."""
        self.kv.drop_cold(seq.seq_id, indices, keep_index=self.policy.keeps_key_index)
        seq.stats.dropped_tokens += len(indices) * self.kv.block_size

    def _evict_middle(self, seq: Sequence) -> None:
        blocks = self.middle(seq)
        if blocks:
            self._evict(seq, blocks)

    def _evict(self, seq: Sequence, block_indices: list[int]) -> None:
        """Hot middle blocks leave the hot tier: demoted to cold, or dropped."""
        if self.policy.demotes:
            self.kv.demote(seq.seq_id, block_indices)
            seq.stats.cold_blocks += len(block_indices)
        else:
            self.kv.drop(seq.seq_id, block_indices, keep_index=self.policy.keeps_key_index)
            seq.stats.dropped_tokens += len(block_indices) * self.kv.block_size

    def trim_after_step(self, prefilled: list[Sequence], step: int) -> None:
        """Policy trimming at the end of a step: sliding presets (window, sparse, replay+cold)
        move whatever left the window out of the hot tier; `replay` with trim="prefill" drops
        the middle of prompts whose prefill just ended, and `snapkv` (or replay with trim="prefill"
        and a ratio) cuts it to `resident_ratio`, least observed attention first; then the
        `resident_ratio` cap of the presets that cap each step."""
        targets = []
        if self.policy.slides:  # not mid-replay: a replay of several runs would never end
            targets = [seq for seq in self.running
                       if seq.num_uncomputed_tokens == 1 and not seq.replay.active]
        elif self.selects_at_prefill:
            for seq in prefilled:
                if seq in self.running and seq.num_uncomputed_tokens == 1:
                    self._fit_ratio(seq)
        elif self.policy.drops_middle and self.trim == "prefill":
            targets = [seq for seq in prefilled if seq in self.running]
        for seq in targets:
            self._evict_middle(seq)
        if self.resident_ratio is not None and self.policy.caps_each_step:
            for seq in self.running:  # the step is done: a chunk that just ran is safe to trim
                if seq.num_uncomputed_tokens == 1 and not self.replay.wants_replay(seq) \
                        and not self.replay.holds_middle(seq, step):
                    self._fit_ratio(seq, step)
        for seq in self.running:
            self.replay.step_done(seq, step)

    def cut_parked(self, seq: Sequence) -> None:
        """A kept session parks as its policy leaves a decoding sequence after a step: cut to
        `resident_ratio` (the presets with one), or its middle moved out of the hot tier
        (trim="prefill", the sliding presets). Without this a request that finished as its
        prefill ended (max_tokens=1: a context sent ahead of its question) would park whole,
        and SnapKV would choose its blocks only when the question came."""
        if seq.beam is not None or seq.num_computed_tokens == 0:
            return
        if self.resident_ratio is not None and (self.selects_at_prefill or self.policy.caps_each_step):
            self._fit_ratio(seq)
        elif self.policy.slides or (self.policy.drops_middle and self.trim == "prefill"):
            self._evict_middle(seq)

    def _fit_ratio(self, seq: Sequence, step: int | None = None) -> None:
        """Drop `seq`'s middle blocks until its resident KV (hot + cold + key index) is within
        `resident_ratio` of the blocks `full` would hold for it: the hot middle least important
        first, then cold blocks, then the heavy hitters (they count inside the ratio, so a
        policy with them keeps no more than one without), then the blocks the need detector
        judged needed (replay_hold="judged"). After a need-replay the caller waits as
        ReplayTracker.holds_middle says."""
        kv = self.kv
        # (the slack: r x n landing a hair under a whole number of blocks, as in ratio_blocks)
        limit = (self.resident_ratio * -(-seq.num_computed_tokens // kv.block_size) + 1e-9) * kv.block_bytes
        excess = kv.resident_bytes(seq.seq_id) - limit
        if excess <= 0:
            return
        light, heavy = self._middle_split(seq)
        judged = seq.replay.kept
        order = [self._order(seq, [i for i in light if i not in judged], 0)]
        if self.policy.demotes:
            order.append(self._order(seq, kv.cold_blocks(seq.seq_id), 1))
        order.append(self._order(seq, [i for i in heavy if i not in judged], 0))
        order.append(self._order(seq, [i for i in light + heavy if i in judged], 0))
        keep_index = self.policy.keeps_key_index
        chosen: tuple[list[int], list[int]] = ([], [])  # hot, cold table indices
        for group in order:
            for (_, cold, _, index, _), _ in sorted(group, key=lambda c: c[0]):
                if excess <= 0:
                    break
                chosen[cold].append(index)
                excess -= kv.bytes_freed_by_drop(bool(cold), keep_index)
        # one call per tier: after a replay this drops the whole middle again (~180 blocks for
        # a 3,000-token prompt), and per-block calls cost ~0.4 ms each
        kv.drop(seq.seq_id, chosen[0], keep_index=keep_index)
        seq.stats.dropped_tokens += len(chosen[0]) * kv.block_size
        self._drop_cold(seq, chosen[1])
        self.replay.cut_after_replay(seq, chosen[0] + chosen[1], step)
