"""kv/quant on CPU: int4 packing, the int4 key index, cold-tier round trips, the Quest bound."""
from __future__ import annotations

import pytest
import torch

from kvreplay.kv.quant import (KeyCodes, QTensor, block_upper_bound, bytes_per_token, dequantize,
                               dequantize_keys_int4, fp8_supported, pack_int4, quantize,
                               quantize_keys_int4, unpack_int4)

SHAPE = (2, 3, 16, 64)  # [blocks, kv heads, block tokens, head_dim]
OUTLIER_CHANNELS = [3, 17, 40]


def _keys(outliers: bool, seed: int = 0) -> torch.Tensor:
    """Random keys; with `outliers`, a few channels 20x larger (the reason keys go per channel)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g) + 0.5 * torch.randn(SHAPE[-1], generator=g)  # channel bias
    if outliers:
        x[..., OUTLIER_CHANNELS] *= 20
    return x


# ---------------------------------------------------------------------------------------------
# int4 packing


def test_pack_unpack_all_byte_values():
    every = torch.arange(256, dtype=torch.uint8)
    codes = unpack_int4(every)  # [512]
    assert torch.equal(codes[0::2], every & 0xF) and torch.equal(codes[1::2], every >> 4)
    assert torch.equal(pack_int4(codes), every)


def test_pack_unpack_random_codes_and_layout():
    g = torch.Generator().manual_seed(1)
    codes = torch.randint(0, 16, (3, 5, 64), dtype=torch.uint8, generator=g)
    packed = pack_int4(codes)
    assert packed.shape == (3, 5, 32) and packed.dtype == torch.uint8
    assert torch.equal(unpack_int4(packed), codes)
    assert pack_int4(torch.tensor([1, 2, 15, 0], dtype=torch.uint8)).tolist() == [0x21, 0x0F]


def test_pack_rejects_odd_dim_and_wrong_dtype():
    with pytest.raises(AssertionError, match="even last dim"):
        pack_int4(torch.zeros(3, 5, dtype=torch.uint8))
    with pytest.raises(AssertionError, match="uint8"):
        pack_int4(torch.zeros(4, dtype=torch.int32))


# ---------------------------------------------------------------------------------------------
# Key index


@pytest.mark.parametrize("outliers", [False, True])
def test_key_index_round_trip(outliers):
    keys = _keys(outliers)
    codes = quantize_keys_int4(keys)
    assert codes.packed.shape == (*SHAPE[:-1], 32) and codes.packed.dtype == torch.uint8
    assert codes.lo.shape == codes.hi.shape == (*SHAPE[:2], 1, 64)
    assert codes.lo.dtype == codes.hi.dtype == torch.float16
    lo, hi = codes.lo.float(), codes.hi.float()
    # lo/hi are the true min/max, rounded outward to fp16 (at most one fp16 ulp, 2^-10 relative).
    true_lo, true_hi = keys.amin(-2, keepdim=True), keys.amax(-2, keepdim=True)
    assert (lo <= true_lo).all() and (hi >= true_hi).all()
    assert torch.allclose(lo, true_lo, rtol=2 ** -10, atol=1e-7)
    assert torch.allclose(hi, true_hi, rtol=2 ** -10, atol=1e-7)
    restored = dequantize_keys_int4(codes, torch.float32)
    assert restored.shape == keys.shape
    # Half a step of the stored range per element; the outward fp16 range means no clamp error.
    half_step = (hi - lo) / 30  # [..., 1, D]
    assert ((restored - keys).abs() <= half_step * (1 + 1e-5) + 1e-6).all()
    assert ((restored >= lo) & (restored <= hi)).all()


def test_key_index_per_channel_shields_normal_channels_from_outliers():
    keys = _keys(outliers=True)
    normal = [c for c in range(SHAPE[-1]) if c not in OUTLIER_CHANNELS]
    per_channel = (dequantize_keys_int4(quantize_keys_int4(keys)) - keys)[..., normal].abs().max()
    per_token = (dequantize(quantize(keys, "int4", "token")) - keys)[..., normal].abs().max()
    # Measured 0.19 vs 3.0: a token-wise group holding an outlier channel has a 20x coarser step.
    assert per_channel < 0.25 and per_token > 3 * per_channel


def test_key_index_constant_input_is_exact():
    # Constant over tokens per channel (scale 0); bf16 values are exact in fp16 at this range.
    row = torch.linspace(-3, 3, 64).to(torch.bfloat16)
    keys = row.expand(2, 16, 64).clone()
    restored = dequantize_keys_int4(quantize_keys_int4(keys), torch.bfloat16)
    assert torch.equal(restored, keys)


def test_key_codes_nbytes():
    codes = quantize_keys_int4(torch.randn(3, 16, 64, dtype=torch.bfloat16))
    assert isinstance(codes, KeyCodes)
    # packed 3*16*32 + lo 3*64*2 + hi 3*64*2 = 1536 + 384 + 384; bf16 keys were 6144 bytes.
    assert codes.nbytes == 2304


def test_key_index_rejects_odd_head_dim():
    with pytest.raises(ValueError, match="head_dim=7 is odd"):
        quantize_keys_int4(torch.randn(4, 7))


# ---------------------------------------------------------------------------------------------
# Cold tier


def _round_trip(kind: str, axis: str, x: torch.Tensor) -> tuple[QTensor, torch.Tensor]:
    q = quantize(x, kind, axis)
    restored = dequantize(q, torch.float32)
    assert restored.shape == x.shape
    return q, (restored - x.float()).abs()


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_int8_error_within_half_step(axis):
    x = _keys(outliers=True)
    q, err = _round_trip("int8", axis, x)
    assert q.data.dtype == torch.int8 and q.scale.dtype == torch.float32 and q.zero is None
    reduce_dim = -1 if axis == "token" else -2
    half_step = x.abs().amax(reduce_dim, keepdim=True) / 127 / 2  # per token row / channel column
    assert (err <= half_step * (1 + 1e-5)).all()


def test_fp8_error_within_three_mantissa_bits():
    if not fp8_supported("cpu"):
        pytest.skip("this torch cannot cast to float8_e4m3fn on CPU")
    x = _keys(outliers=True)
    q, err = _round_trip("fp8", "token", x)
    assert q.data.dtype == torch.float8_e4m3fn
    # e4m3 rounds to 3 mantissa bits: 2^-4 relative, plus half the subnormal step near zero.
    assert (err <= x.abs() * 2 ** -4 + q.scale * 2 ** -10 + 1e-6).all()
    # Measured 0.0357 of the token's absmax: the worst case, 16/448 (half of ulp 32 near 448).
    assert (err.amax(-1) / x.abs().amax(-1)).max() <= 16 / 448 + 1e-6


@pytest.mark.parametrize("axis", ["token", "channel"])
def test_int4_error_within_half_step(axis):
    x = _keys(outliers=False)
    q, err = _round_trip("int4", axis, x)
    assert q.data.dtype == torch.uint8 and q.data.shape == (*SHAPE[:-1], 32)
    assert q.scale.dtype == q.zero.dtype == torch.float16
    if axis == "token":
        groups = x.unflatten(-1, (2, 32))  # [..., T, G, 32]
        group_range = groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)
        half_step = (group_range / 15 / 2).expand_as(groups).reshape(x.shape)
    else:
        half_step = (x.amax(-2, keepdim=True) - x.amin(-2, keepdim=True)) / 15 / 2
    # fp16 slack: the stored scale is the range / 15 rounded up by at most one fp16 ulp.
    assert (err <= half_step * (1 + 2 ** -9) + 1e-6).all()


def test_dequantize_defaults_to_input_dtype():
    x = torch.randn(3, 16, 64, dtype=torch.bfloat16)
    for kind in ("int8", "int4"):
        assert dequantize(quantize(x, kind)).dtype == torch.bfloat16


@pytest.mark.parametrize("kind,axis,expected", [
    ("int8", "token", 3072 + 3 * 16 * 4),  # int8 data + one fp32 scale per token
    ("int8", "channel", 3072 + 3 * 64 * 4),  # one fp32 scale per channel per block
    ("fp8", "token", 3072 + 3 * 16 * 4),
    ("int4", "token", 1536 + 3 * 16 * 2 * 4),  # 2 groups of 32 per token, fp16 min + scale each
    ("int4", "channel", 1536 + 3 * 64 * 4),
])
def test_qtensor_nbytes_and_bytes_per_token(kind, axis, expected):
    if kind == "fp8" and not fp8_supported("cpu"):
        pytest.skip("this torch cannot cast to float8_e4m3fn on CPU")
    x = torch.randn(3, 16, 64, dtype=torch.bfloat16)  # 6144 bytes
    q = quantize(x, kind, axis)
    assert q.nbytes == expected
    assert bytes_per_token(kind, 64, axis, block_tokens=16) == expected / (3 * 16)


def test_bytes_per_token_figures():
    assert bytes_per_token("int8", 64) == 68
    assert bytes_per_token("fp8", 128) == 132
    assert bytes_per_token("int4", 64) == 40
    assert bytes_per_token("int4", 64, "channel", block_tokens=64) == 36


def test_bad_inputs_raise_clear_errors():
    x = torch.randn(16, 64)
    with pytest.raises(ValueError, match="int8, fp8, int4"):
        quantize(x, "bogus")
    with pytest.raises(ValueError, match="token, channel"):
        quantize(x, "int8", "row")
    with pytest.raises(ValueError, match="head_dim=48 is not a multiple of 32"):
        quantize(torch.randn(16, 48), "int4")
    with pytest.raises(ValueError, match="head_dim=7 is odd"):
        quantize(torch.randn(16, 7), "int4", "channel")
    with pytest.raises(ValueError, match="int8, fp8, int4"):
        bytes_per_token("int2", 64)


# ---------------------------------------------------------------------------------------------
# Quest bound


def _brute_force_bound(q: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    q = q[..., :, None, :]  # [..., G, 1, D]
    return torch.maximum(q * lo[..., None, :, :], q * hi[..., None, :, :]).sum(-1)  # [..., G, N]


def test_block_upper_bound_bounds_every_block_and_matches_brute_force():
    g = torch.Generator().manual_seed(2)
    keys = torch.randn(3, 10, 16, 64, generator=g)  # [H, N, T, D]
    query = torch.randn(3, 4, 64, generator=g)  # [H, G, D]
    lo, hi = keys.amin(-2), keys.amax(-2)  # [H, N, D]
    bound = block_upper_bound(query, lo, hi)
    assert bound.shape == (3, 4, 10)
    assert torch.allclose(bound, _brute_force_bound(query, lo, hi), atol=1e-4)
    logits = torch.einsum("hgd,hntd->hgnt", query, keys)  # [H, G, N, T]
    assert (bound >= logits.amax(-1) - 1e-4).all()
    # The key index's fp16 summaries are rounded outward, so they bound the fp32 keys too.
    codes = quantize_keys_int4(keys)
    index_bound = block_upper_bound(query.bfloat16(), codes.lo.squeeze(-2), codes.hi.squeeze(-2))
    assert index_bound.dtype == torch.float32  # bf16 query with fp16 summaries promotes
    assert (index_bound >= logits.amax(-1) - 1e-2).all()  # slack: the query was rounded to bf16


def test_block_upper_bound_broadcasts_leading_dims():
    query = torch.randn(4, 64)  # [G, D], shared by every head
    lo = torch.randn(3, 10, 64)
    hi = lo + torch.rand(3, 10, 64)
    bound = block_upper_bound(query, lo, hi)
    assert bound.shape == (3, 4, 10)
    assert torch.allclose(bound, _brute_force_bound(query.expand(3, 4, 64), lo, hi), atol=1e-4)


def test_bound_ranking_finds_planted_key():
    g = torch.Generator().manual_seed(3)
    num_heads, num_blocks = 4, 32
    keys = torch.randn(num_heads, num_blocks, 16, 64, generator=g)  # [H, N, T, D]
    query = torch.randn(num_heads, 1, 64, generator=g)  # [H, 1, D]
    planted = torch.tensor([5, 17, 0, 31])  # the block holding the matching key, per head
    keys[torch.arange(num_heads), planted, 7] = 4 * query[:, 0]
    codes = quantize_keys_int4(keys)
    bound = block_upper_bound(query, codes.lo.squeeze(-2), codes.hi.squeeze(-2))  # [H, 1, N]
    assert torch.equal(bound[:, 0].argmax(-1), planted)
    # The dequantized index keys agree: the planted block takes the most attention.
    scores = torch.einsum("hgd,hntd->hgnt", query, dequantize_keys_int4(codes)) / 8
    block_mass = scores.flatten(-2).softmax(-1).unflatten(-1, (num_blocks, 16)).sum(-1)  # [H, 1, N]
    assert torch.equal(block_mass[:, 0].argmax(-1), planted)
    assert (block_mass[:, 0].amax(-1) > 0.9).all()
