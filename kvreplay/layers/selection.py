"""Quest's per-step selection over hot blocks (the `quest` preset, docs/architecture.md §6).

Every block stays hot; at each decode step each KV head scores its sequence's middle blocks by
the Quest bound (per-channel key min/max of the block against the step's queries, the same bound
the sparse path uses for cold blocks) and attends only to the best few of them beside the pinned
head and the recent window. The other middle blocks' scores are masked before the softmax, so
the step's attention is exactly attention over the chosen blocks. The min/max summaries are taken
from the gathered keys at each step: the baseline's point is what it selects, not its speed.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvreplay.kv.quant import block_upper_bound


@dataclass
class HotSelection:
    """Which hot blocks of each decode row may be skipped, and how many of them each KV head reads."""
    candidates: torch.Tensor   # [B, W] bool: columns of the decode block table in the middle
    keep_blocks: torch.Tensor  # [B] long: middle blocks each KV head attends to
    selected_blocks: int = 0   # middle blocks attended, summed over layers and KV heads
    candidate_blocks: int = 0  # middle blocks that could have been


def mask_unselected(selection: HotSelection, query: torch.Tensor, keys: torch.Tensor,
                    scores: torch.Tensor, num_kv: int, num_seqs: int, block_size: int) -> None:
    """Set to -inf, in place, the scores of each KV head's middle blocks outside its top
    `keep_blocks` by Quest bound.

    query: [Hkv*B, G, D] scaled queries; keys: [Hkv*B, W*bs, D] the gathered hot keys, in decode
    block-table order; scores: [Hkv*B, G, W*bs] their logits.
    """
    head_dim = query.shape[-1]
    width = selection.candidates.shape[1]
    blocks = keys.view(num_kv, num_seqs, width, block_size, head_dim)
    lo, hi = blocks.amin(3).float(), blocks.amax(3).float()                        # [Hkv, B, W, D]
    q = query.view(num_kv, num_seqs, -1, head_dim).float()                         # [Hkv, B, G, D]
    bound = block_upper_bound(q, lo, hi).amax(2)                                   # [Hkv, B, W]
    candidates = selection.candidates.unsqueeze(0).expand(num_kv, -1, -1)         # [Hkv, B, W]
    bound = bound.masked_fill(~candidates, float("-inf"))
    # rank of each block by bound (ties: the older block first); candidates outrank the rest
    order = bound.sort(dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(-1, order, torch.arange(width, device=order.device)
                                            .expand_as(order).contiguous())
    skipped = candidates & (rank >= selection.keep_blocks[None, :, None])           # [Hkv, B, W]
    selection.candidate_blocks += int(candidates.sum())
    selection.selected_blocks += int((candidates & ~skipped).sum())
    columns = skipped.unsqueeze(-1).expand(-1, -1, -1, block_size).reshape(num_kv * num_seqs, 1, -1)
    scores.masked_fill_(columns, float("-inf"))
