"""Projection: packed oneDNN weights in bf16 on CPU must give F.linear's numbers exactly."""
import pytest
import torch
import torch.nn.functional as F

from kvreplay.engine import cpu_kernels
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


def _small_projection(weight, bias=None):
    proj = Projection(weight, bias)
    if proj.small_linear is None:
        ops = cpu_kernels.layer_ops()
        # With a compiler, ninja and AVX512-BF16 on the machine the kernel must be there.
        assert not (can_pack(weight) and ops is None and cpu_kernels.should_build()), \
            "the layer ops failed to build (see the log)"
        pytest.skip("no small-batch kernel here (no oneDNN, compiler or AVX512-BF16)")
    return proj


@pytest.mark.parametrize("rows", [1, 2, 4, 5])
@pytest.mark.parametrize("with_bias", [False, True])
def test_small_batch_kernel_within_one_rounding_of_exact(rows, with_bias):
    gen = torch.Generator().manual_seed(10 + rows)
    weight = torch.randn(96, 576, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, 576, generator=gen).bfloat16()
    proj = _small_projection(weight, bias)
    got = proj(x)
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    # fp32 sums in another order than the exact product: at most one bf16 step from it
    step = exact.abs().clamp_min(1e-3) * 2 ** -7
    assert ((got.float() - exact).abs() <= step).all()
    if rows <= 4:  # rows are independent: each equals itself computed alone
        for row in range(rows):
            assert torch.equal(proj(x[row:row + 1]), got[row:row + 1])


def test_small_batch_kernel_rejects_bad_inputs():
    proj = _small_projection(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="small_linear: x must be"):
        proj.small_linear(torch.randn(1, 32).bfloat16(), proj.tiled, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        proj.small_linear(torch.randn(1, 64).bfloat16(), proj.tiled, torch.zeros(31).bfloat16())
    with pytest.raises(RuntimeError, match="pack_rows"):
        torch.ops.kvreplay_layer.pack_rows(torch.randn(30, 64).bfloat16())
    assert Projection(torch.randn(30, 64).bfloat16()).small_linear is None  # shape it cannot tile
