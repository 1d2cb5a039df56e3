"""Weight projections (`y = x W^T + b`) in the fastest form the device offers.

On CPU in bf16, oneDNN re-lays the weight matrix into its blocked format on every plain
`F.linear` call; packing it once at load time skips that work (measured in bench/profile_decode.py
and docs/benchmarks.md: ~15-25% off the decode step's matmuls, more at batch 1). The packed
product is bit-identical to `F.linear` in bf16 on this torch build (tests/test_linear.py checks it),
so packing changes speed, never tokens. Everything else (fp32, CUDA, a torch without oneDNN) uses
`F.linear` on the plain weight.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# oneDNN chooses its blocked layout for a typical row count; any row count works with it.
PACK_BATCH_HINT = 32


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class Projection:
    """One linear layer's weight (and bias), packed for oneDNN where that pays."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True):
        self.bias = bias
        self.packed = pack and can_pack(weight)
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT) \
            if self.packed else weight

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed and x.dtype == torch.bfloat16 and x.dim() == 2:
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.packed:
            raise ValueError(f"packed bf16 projection got a {x.dtype} input of shape {tuple(x.shape)}")
        return F.linear(x, self.weight, self.bias)
