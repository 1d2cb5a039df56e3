"""Beam search as a group of sequences that share blocks through the KV manager's forks.

Each step every live beam yields log-probabilities for its next token; once all have, the group
picks the next beams the way transformers' `generate(num_beams=k)` does (do_sample=False,
length_penalty=1.0, early_stopping=False):

    candidates = top 2k of (beam score + log p(token)) over all beams and tokens
    a candidate that ends the beam (EOS, or the max_tokens-th token) and ranks in the top k
        is finished, scored (sum of log-probs) / (generated tokens ** length_penalty)
    the best k candidates that do not end continue: a parent chosen once keeps its sequence,
        chosen again it forks (blocks shared, the first write copies the partial block),
        not chosen it is freed
    stop at max_tokens, or once k beams finished and the best live beam, normalised at its
        current length, cannot beat the worst of them

The result is the best finished beam.

Beams step together, so one paused beam would stall its group while the group holds the room it
needs to come back: beams are never paused. Instead a group is admitted only when its worst case
(`BeamGroup.max_blocks`: the prompt's full blocks shared, each beam's own tail to max_tokens) fits
the pool beside the other running groups' (`beams_fit`), and a request whose worst case exceeds
the whole pool is refused when it is added.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvreplay.engine.sequence import Sequence


class BeamHost(Protocol):
    """What beam search asks of the engine, and nothing more."""
    eos_token_ids: set[int]

    def request_of(self, seq: Sequence):
        """The request `seq` belongs to (its `request_id` and `seqs`, the beams shown)."""

    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Start `child` running on `parent`'s blocks."""

    def prune(self, seq: Sequence) -> None:
        """Take `seq` out of the queues and free its blocks; it is finished, unreported."""

    def complete(self, seq: Sequence, reason: str) -> None:
        """`seq` holds the winning tokens: detokenize it and finish it with `reason`."""

    def count_generated(self) -> None:
        """One more generated token for the engine's totals (one per beam step)."""


@dataclass
class BeamGroup:
    width: int
    max_tokens: int
    stop_ids: set[int]
    length_penalty: float = 1.0
    live: list[Sequence] = field(default_factory=list)
    scores: dict[int, float] = field(default_factory=dict)     # seq_id -> sum of log-probs
    pending: dict[int, torch.Tensor] = field(default_factory=dict)  # seq_id -> [V] log-probs
    finished: list[tuple[float, list[int]]] = field(default_factory=list)  # best first, <= width
    done: bool = False
    _heuristic_open: bool = True
    max_blocks: int = 0  # the group's KV blocks at most (worst_case_blocks)

    @classmethod
    def start(cls, seq: Sequence, max_tokens: int, num_blocks: int, block_size: int,
              window_blocks: int = 0) -> "BeamGroup":
        """The group of `seq`'s beams; ValueError when even the whole pool cannot hold them.
        `window_blocks`: what each beam holds beside, a hybrid pool's local windows."""
        width = seq.params.beam_width
        need = worst_case_blocks(seq.num_prompt_tokens, max_tokens, width, block_size) + width * window_blocks
        if need > num_blocks:
            raise ValueError(f"beam search of width {width} over {seq.num_prompt_tokens} prompt tokens "
                             f"with max_tokens={max_tokens} may need {need} KV blocks, and the pool "
                             f"has {num_blocks}: lower beam_width or max_tokens, or give the KV "
                             "cache more memory")
        return cls(width, max_tokens, seq.stop_ids, live=[seq], max_blocks=need)

    def receive(self, seq: Sequence, logits: torch.Tensor) -> None:
        self.pending[seq.seq_id] = torch.log_softmax(logits.float(), dim=-1)

    @property
    def ready(self) -> bool:
        return all(seq.seq_id in self.pending for seq in self.live)

    def advance(self) -> list[tuple[Sequence, int, float]]:
        """Choose the next beams from the pending log-probs: (parent, token, score) each."""
        k = self.width
        logprobs = torch.stack([self.pending[s.seq_id] for s in self.live])      # [B, V]
        scores = torch.tensor([self.scores.get(s.seq_id, 0.0) for s in self.live], device=logprobs.device)
        total = (logprobs + scores[:, None]).view(-1)                           # [B * V]
        vocab = logprobs.shape[1]
        values, indices = total.topk(min(2 * k, total.numel()))
        generated = self.live[0].num_output_tokens + 1
        last = generated >= self.max_tokens
        chosen, ended = [], []
        for rank, (value, index) in enumerate(zip(values.tolist(), indices.tolist())):
            parent, token = self.live[index // vocab], index % vocab
            if last or token in self.stop_ids:
                if rank < k and self._heuristic_open:
                    ended.append((value / generated ** self.length_penalty,
                                  parent.output_token_ids + [token]))
            elif len(chosen) < k:
                chosen.append((parent, token, value))
        self.finished = sorted(self.finished + ended, key=lambda item: -item[0])[:k]
        self.pending.clear()
        if chosen and len(self.finished) >= k:
            best_live = chosen[0][2] / generated ** self.length_penalty
            self._heuristic_open = best_live > self.finished[-1][0]
        self.done = last or not chosen or not self._heuristic_open
        return [] if self.done else chosen

    def best(self) -> list[int]:
        return self.finished[0][1]


def worst_case_blocks(prompt_tokens: int, max_tokens: int, width: int, block_size: int) -> int:
    """Blocks `width` beams hold at most: the prompt's full blocks once (shared), and each beam's
    own blocks from there to prompt + max_tokens tokens."""
    shared = prompt_tokens // block_size
    return shared + width * (-(-(prompt_tokens + max_tokens) // block_size) - shared)


def beams_fit(seq: Sequence, running: list[Sequence], num_blocks: int) -> bool:
    """Whether `seq` (to be admitted) may start: a beam group's worst case, with those of the
    groups already running, fits the pool (other sequences can be paused for them)."""
    if seq.beam is None:
        return True
    groups = {id(other.beam): other.beam.max_blocks for other in running if other.beam is not None}
    return sum(groups.values()) + seq.beam.max_blocks <= num_blocks


def step_beams(engine: BeamHost, logits: torch.Tensor, sampled: list[Sequence],
               touched: dict) -> tuple[torch.Tensor, list[Sequence]]:
    """Hand beams' logits to their groups; advance each group whose beams all reported.
    Returns the logits and sequences left for ordinary sampling."""
    groups = {}
    for row, seq in enumerate(sampled):
        if seq.beam is not None:
            seq.beam.receive(seq, logits[row])
            groups[id(seq.beam)] = seq.beam
    for group in groups.values():
        if group.ready:
            request = engine.request_of(group.live[0])
            _advance(engine, group, request)
            touched[request.request_id] = request
    keep = [row for row, seq in enumerate(sampled) if seq.beam is None]
    return logits[torch.tensor(keep, dtype=torch.long, device=logits.device)], \
        [sampled[row] for row in keep]


def _advance(engine: BeamHost, group: BeamGroup, request) -> None:
    """Apply the group's choice: reuse, fork or free beams; on completion keep only the best."""
    chosen = group.advance()
    plan, kept = [], set()
    for parent, token, score in chosen:  # fork before any parent changes or is freed
        beam = parent
        if parent.seq_id in kept:
            beam = Sequence(parent.request_id, parent.prompt_token_ids, parent.params,
                            engine.eos_token_ids, None)
            beam.token_ids, beam.max_tokens = list(parent.token_ids), parent.max_tokens
            beam.pinned_tokens, beam.beam = parent.pinned_tokens, group
            engine.fork(parent, beam)
        kept.add(beam.seq_id)
        plan.append((beam, token, score))
    winner = group.live[0]
    for seq in group.live:
        if seq.seq_id not in kept and (chosen or seq is not winner):
            engine.prune(seq)  # its blocks go back (shared ones stay)
    if group.done:
        engine.prune(winner)
        best = group.best()
        winner.token_ids = winner.prompt_token_ids + best
        winner.stats.completion_tokens = len(best)
        engine.count_generated()
        engine.complete(winner, "stop" if best[-1] in winner.stop_ids else "length")
        request.seqs = [winner]
        return
    group.live = [beam for beam, _, _ in plan]
    group.scores = {beam.seq_id: score for beam, _, score in plan}
    for beam, token, _ in plan:
        beam.token_ids.append(token)
        beam.stats.completion_tokens = beam.num_output_tokens
    engine.count_generated()
    request.seqs = list(group.live)
