"""Seeded random prompts of token ids for the engine tests (ids clear of special tokens)."""
from __future__ import annotations

import torch


def seeded_tokens(count: int, seed: int) -> list[int]:
    """`count` token ids in [100, 40000), the same for the same seed."""
    return torch.randint(100, 40000, (count,), generator=torch.Generator().manual_seed(seed)).tolist()
