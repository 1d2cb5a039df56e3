"""Projection: packed oneDNN weights in bf16 on CPU must give F.linear's numbers exactly."""
import pytest
import torch
import torch.nn.functional as F

from kvreplay.models.linear import Projection, can_pack


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_equals_plain_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 40, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, 40, generator=gen).bfloat16()
    proj = Projection(weight, bias)
    if not can_pack(weight):
        pytest.skip("this torch build has no oneDNN packing")
    assert proj.packed
    assert torch.equal(proj(x), F.linear(x, weight, bias))


def test_fp32_and_opt_out_stay_plain():
    weight = torch.randn(8, 4)
    x = torch.randn(3, 4)
    proj = Projection(weight)
    assert not proj.packed and proj.weight is weight
    assert torch.equal(proj(x), F.linear(x, weight))
    plain = Projection(weight.bfloat16(), pack=False)
    assert not plain.packed
    assert torch.equal(plain(x.bfloat16()), F.linear(x.bfloat16(), weight.bfloat16()))


def test_packed_rejects_other_inputs_clearly():
    weight = torch.randn(8, 4).bfloat16()
    proj = Projection(weight)
    if not proj.packed:
        pytest.skip("this torch build has no oneDNN packing")
    with pytest.raises(ValueError, match="packed bf16 projection"):
        proj(torch.randn(3, 4))  # fp32 input
