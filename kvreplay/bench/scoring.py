"""Teacher-forced scoring with full attention, and the comparisons built on it.

`FullAttentionScorer` runs the engine's model over a private paged pool, chunk by chunk, exactly
as the `full` policy attends (every earlier token, nothing evicted). It is the reference the
quality bench holds every policy against, computed on the same weights in the same run.
"""
from __future__ import annotations

import math

import torch

from kvreplay.layers.attention import AttentionMetadata, PrefillSlice
from kvreplay.kv import KVManager


class FullAttentionScorer:
    """Log-probabilities of given tokens under full attention (no policy, no eviction)."""

    def __init__(self, model, chunk_tokens: int = 512, block_size: int = 16):
        self.model = model
        self.chunk_tokens = chunk_tokens
        self.block_size = block_size

    def _chunks(self, token_ids: list[int], wanted: set[int] | None):
        """Yield (first position, rows, logits [rows, V]) per chunk, for the wanted positions in
        the chunk (every position when `wanted` is None). Stops after the last wanted position."""
        cfg, device, block_size = self.model.config, self.model.device, self.block_size
        limit = max(wanted) + 1 if wanted else len(token_ids)
        num_blocks = -(-limit // block_size)
        kv = KVManager(num_blocks, block_size, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim,
                       self.model.dtype, device)
        table = torch.arange(num_blocks, dtype=torch.long)
        for start in range(0, limit, self.chunk_tokens):
            end = min(start + self.chunk_tokens, limit)
            rows = [p - start for p in range(start, end) if wanted is None or p in wanted]
            positions = torch.arange(start, end)
            slots = table[positions // block_size] * block_size + positions % block_size
            mask = None if start == 0 else (torch.arange(end)[None, :] <= positions[:, None]).to(device)
            meta = AttentionMetadata(slot_mapping=slots.to(device),
                                     prefills=[PrefillSlice(0, end - start, end, table.to(device), mask)])
            logits = self.model.forward(torch.tensor(token_ids[start:end], device=device),
                                        positions.to(device), kv.kv_caches, meta,
                                        torch.tensor(rows, dtype=torch.long, device=device))
            if rows:
                yield start, rows, logits

    def logprobs_at(self, token_ids: list[int], positions: list[int]) -> torch.Tensor:
        """[len(positions), V] log-probabilities of the token after each position."""
        wanted = set(positions)
        found: dict[int, torch.Tensor] = {}
        for start, rows, logits in self._chunks(token_ids, wanted):
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            for row, values in zip(rows, logprobs):
                found[start + row] = values
        return torch.stack([found[p] for p in positions])

    def perplexity(self, token_ids: list[int]) -> float:
        """exp(mean negative log-likelihood) of tokens 1..T-1 given everything before them."""
        total, count = 0.0, 0
        for start, rows, logits in self._chunks(token_ids, None):
            targets = [start + row + 1 for row in rows]
            keep = [i for i, t in enumerate(targets) if t < len(token_ids)]
            if not keep:
                continue
            logprobs = torch.log_softmax(logits[keep].float(), dim=-1)
            target_ids = torch.tensor([token_ids[targets[i]] for i in keep])
            total -= logprobs.gather(1, target_ids[:, None].to(logprobs.device)).sum().item()
            count += len(keep)
        return math.exp(total / count)


def compare_continuation(reference: torch.Tensor, tokens: list[int],
                         policy_logprobs: list[dict[int, float]] | None) -> dict:
    """Agreement of a policy's greedy continuation with full attention, teacher-forced on it.

    Args:
        reference: [N, V] full-attention log-probabilities before each continuation token, with the
            policy's own earlier tokens as context (so both saw the same prefix at every step).
        tokens: the policy's N greedy tokens.
        policy_logprobs: the policy's top-k log-probabilities per step (SamplingParams.logprobs).
    Returns:
        top1_agreement: fraction of steps where full's argmax is the policy's token;
        matching_prefix: steps before the first disagreement (where full's own greedy run would
            have diverged);
        kl: mean KL(policy || full) over the policy's top-k tokens plus one bucket for the rest --
            a lower bound of the true KL (merging outcomes never increases KL).
    """
    argmax = reference.argmax(-1).tolist()
    agree = [a == t for a, t in zip(argmax, tokens)]
    matching = next((i for i, ok in enumerate(agree) if not ok), len(agree))
    result = {"top1_agreement": sum(agree) / len(agree) if agree else None, "matching_prefix": matching,
              "num_tokens": len(tokens), "kl": None}
    if policy_logprobs:
        kls = [_bucketed_kl(step, reference[i]) for i, step in enumerate(policy_logprobs[:len(tokens)])]
        result["kl"] = sum(kls) / len(kls)
    return result


def _bucketed_kl(policy_top: dict[int, float], reference: torch.Tensor, floor: float = 1e-12) -> float:
    ids = list(policy_top)
    p = torch.tensor([math.exp(policy_top[i]) for i in ids], dtype=torch.float64)
    q = reference[ids].double().exp().cpu()
    p_rest = max(1.0 - p.sum().item(), 0.0)
    q_rest = max(1.0 - q.sum().item(), floor)
    kl = (p * (p.clamp_min(floor).log() - q.clamp_min(floor).log())).sum().item()
    if p_rest > floor:
        kl += p_rest * math.log(p_rest / q_rest)
    return max(kl, 0.0)
