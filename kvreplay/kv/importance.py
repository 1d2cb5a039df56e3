"""Observed attention mass per block: the importance signal that orders demotion and dropping.

Two cheap observations feed it (docs/architecture.md §4 reclaim order; H2O and SnapKV in the literature):

- prefill: when a prompt's last chunk runs, its last `OBSERVED_QUERIES` queries (the question at
  the end of a pasted document, the latest user turn) are scored against every key the chunk
  attends to, in every layer;
- decode: every decode step's attention probabilities over the hot blocks and the cold blocks it
  read, in every layer.

Under replay a prompt's observation restarts the scores (`observe(..., restart=True)`): the newest
prompt's last queries rank what stays, as SnapKV scores by its observation window alone. A
chat's next turn, or a context's question, replays what an earlier cut dropped, and without the
restart the blocks the earlier turns' answers read (each decode step adds up to a unit per layer)
outrank the block the new question asks for. The other presets accumulate (H2O's running sums).

A block's score adds, per layer, the largest mass any query head put on it at any observed
query: a block that one retrieval head reads for one query scores high even when every other
head and query ignore it (a sum over the prompt's last queries ranked a planted fact's block
lower: the question's other tokens spread their mass over the text around it). Scores only
grow (H2O's accumulated mass), so a block that mattered once keeps its rank; the prefill and
each decode step add at most one unit per layer.

The KV manager owns the store (it forgets a sequence with its blocks); the model runner writes
observations; the scheduler reads scores when it picks blocks to keep hot, demote or drop.
"""
from __future__ import annotations

import torch

OBSERVED_QUERIES = 32  # SnapKV's observation window: the last queries of a prompt


def prompt_chunk(uncomputed: int, policy, want: int) -> int:
    """A prompt chunk of at most `want` of its `uncomputed` tokens; under a policy that observes
    attention (it drops or demotes middle blocks), shortened so that the chunk that ends the
    prompt still holds its last OBSERVED_QUERIES queries (or, on a tiny budget, at least two
    tokens): a prompt whose last token ran as a decode row would have its observation and its
    cut at prefill (snapkv, trim="prefill") skipped."""
    if not (policy.drops_middle or policy.demotes):
        return want
    left = uncomputed - want
    if 0 < left < OBSERVED_QUERIES and want > OBSERVED_QUERIES - left:
        return want - (OBSERVED_QUERIES - left)
    return want - 1 if left == 1 and want > 1 else want


class BlockImportance:
    """Accumulated attention mass per (sequence, block index), grown on demand."""

    def __init__(self):
        self._mass: dict[int, torch.Tensor] = {}  # seq -> [capacity] float32, by table index

    def observe(self, seq_id: int, block_indices: torch.Tensor | list[int], mass: torch.Tensor,
                restart: bool = False) -> None:
        """Add `mass[i]` to block `block_indices[i]` of `seq_id` (both 1-D, same length); with
        `restart`, after forgetting what was observed before."""
        if restart:
            self.forget(seq_id)
        if len(block_indices) == 0:
            return
        block_indices = torch.as_tensor(block_indices, dtype=torch.long, device="cpu")
        need = int(block_indices.max()) + 1
        scores = self._mass.get(seq_id)
        if scores is None or len(scores) < need:
            grown = torch.zeros(max(need, 2 * (0 if scores is None else len(scores)), 16))
            if scores is not None:
                grown[:len(scores)] = scores
            scores = self._mass[seq_id] = grown
        scores.index_add_(0, block_indices, mass.detach().to("cpu", torch.float32))

    def scores(self, seq_id: int, block_indices: list[int], pool: int = 0) -> list[float]:
        """The accumulated mass of each block (0 for a block never observed); with `pool`, the
        largest over it and the blocks within `pool` of it among `block_indices` (the middle:
        the sinks' and the window's mass, always large, must not lift their neighbours)."""
        own = self._own(seq_id, block_indices)
        return _pooled(own, block_indices, pool) if pool and block_indices else own

    def _own(self, seq_id: int, block_indices: list[int]) -> list[float]:
        scores = self._mass.get(seq_id)
        if scores is None:
            return [0.0] * len(block_indices)
        values = scores.tolist()
        return [values[i] if i < len(values) else 0.0 for i in block_indices]

    def ranks(self, seq_id: int, block_indices: list[int], pool: int = 0) -> list:
        """Sort keys of `block_indices`, least important first: the score (`scores`), then with
        `pool` the block's own mass (a peak before the neighbours that took its score)."""
        own = self._own(seq_id, block_indices)
        return list(zip(_pooled(own, block_indices, pool), own)) if pool and block_indices else own

    def most_important(self, seq_id: int, block_indices: list[int], count: int, pool: int = 0) -> set[int]:
        """The `count` blocks of `block_indices` that rank highest (`ranks`; ties: the older block)."""
        if count <= 0 or not block_indices:
            return set()
        ranks = self.ranks(seq_id, block_indices, pool)
        order = sorted(range(len(block_indices)), key=lambda i: (ranks[i], -block_indices[i]), reverse=True)
        return {block_indices[i] for i in order[:count]}

    def copy(self, parent_id: int, child_id: int) -> None:
        if parent_id in self._mass:
            self._mass[child_id] = self._mass[parent_id].clone()

    def forget(self, seq_id: int) -> None:
        self._mass.pop(seq_id, None)

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._mass


def _pooled(own: list[float], block_indices: list[int], pool: int) -> list[float]:
    """Each of `own` (the mass of `block_indices`) as the largest within `pool` of it among them."""
    among = torch.zeros(max(block_indices) + 1)
    among[torch.tensor(block_indices)] = torch.tensor(own)
    pooled = torch.nn.functional.max_pool1d(among[None, None], 2 * pool + 1, 1, pool)[0, 0].tolist()
    return [pooled[i] for i in block_indices]


def block_mass(probs: torch.Tensor, block_size: int) -> torch.Tensor:
    """Attention probabilities [..., heads, queries, keys] (keys a whole number of blocks) ->
    [..., blocks]: per block, the largest mass any head put on it at any of the queries."""
    *lead, heads, queries, keys = probs.shape
    per_block = probs.reshape(*lead, heads, queries, keys // block_size, block_size).sum(-1)
    return per_block.flatten(-3, -2).amax(-2)
