"""kv/cold_pool on CPU: round trips per kind, per-head gathers, summaries, slot reuse and growth."""
from __future__ import annotations

import pytest
import torch

from kvreplay.kv.cold_pool import KEY_AXIS, ColdPool
from kvreplay.kv.quant import FP8_MAX, INT4_GROUP, block_upper_bound, dequantize, fp8_supported, quantize

LAYERS, KV_HEADS, BLOCK, HEAD_DIM = 2, 3, 16, 64
OUTLIER_CHANNELS = [3, 17, 40]
KINDS = [pytest.param("int8"), pytest.param("int4"),
         pytest.param("fp8", marks=pytest.mark.skipif(not fp8_supported("cpu"),
                                                      reason="no float8_e4m3fn casts on CPU"))]


def _blocks(num_blocks: int, seed: int = 0, dtype: torch.dtype = torch.float32):
    """Random K and V [L, Hkv, n, bs, D]; keys carry a channel bias and a few 20x outlier channels."""
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, KV_HEADS, num_blocks, BLOCK, HEAD_DIM)
    keys = torch.randn(shape, generator=g) + 0.5 * torch.randn(HEAD_DIM, generator=g)
    keys[..., OUTLIER_CHANNELS] *= 20
    values = torch.randn(shape, generator=g)
    return keys.to(dtype), values.to(dtype)


def _pool(kind: str, initial_slots: int = 4) -> ColdPool:
    return ColdPool(LAYERS, KV_HEADS, BLOCK, HEAD_DIM, kind, initial_slots=initial_slots)


def _bound(x: torch.Tensor, kind: str, axis: str) -> torch.Tensor:
    """quant.quantize's documented error bound for each element of x [..., T, D] (float32)."""
    reduce_dim = -1 if axis == "token" else -2
    if kind == "int4":
        if axis == "token":
            groups = x.unflatten(-1, (HEAD_DIM // INT4_GROUP, INT4_GROUP))
            span = groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)
            span = span.expand_as(groups).flatten(-2)
        else:
            span = x.amax(-2, keepdim=True) - x.amin(-2, keepdim=True)
        return span / 15 / 2 * (1 + 2 ** -9) + 1e-6  # fp16 scale rounded up, min rounded down
    absmax = x.abs().amax(dim=reduce_dim, keepdim=True)
    if kind == "int8":
        return absmax / 127 / 2 * (1 + 1e-5) + 1e-6
    return 2 ** -4 * x.abs() + 2 ** -10 * absmax / FP8_MAX + 1e-6


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_round_trip_within_quant_bounds(kind, dtype):
    keys, values = _blocks(3, dtype=dtype)
    pool = _pool(kind)
    slots = pool.add(keys, values)
    assert slots == [0, 1, 2] and pool.num_used == 3
    k, v = pool.dequantize_slots(slots, torch.float32)
    assert k.shape == v.shape == keys.shape and k.dtype == torch.float32
    # The pool holds exactly what quant.quantize produced: same values as its own round trip.
    assert torch.equal(k, dequantize(quantize(keys, kind, KEY_AXIS[kind]), torch.float32))
    assert torch.equal(v, dequantize(quantize(values, kind, "token"), torch.float32))
    k32, v32 = keys.float(), values.float()
    assert ((k - k32).abs() <= _bound(k32, kind, KEY_AXIS[kind])).all()
    assert ((v - v32).abs() <= _bound(v32, kind, "token")).all()
    # Per-channel keys keep the ordinary channels precise next to 20x outliers.
    ordinary = [c for c in range(HEAD_DIM) if c not in OUTLIER_CHANNELS]
    rel = ((k - k32)[..., ordinary].norm() / k32[..., ordinary].norm()).item()
    assert rel < {"int8": 0.01, "fp8": 0.04, "int4": 0.12}[kind]
    assert pool.dequantize_slots(slots, torch.bfloat16)[0].dtype == torch.bfloat16
    pool.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_gather_per_head_matches_dequantize_slots(kind):
    keys, values = _blocks(5, seed=1)
    pool = _pool(kind)
    slots = pool.add(keys, values)
    k_all, v_all = pool.dequantize_slots(slots, torch.float32)  # [L, Hkv, 5, bs, D]
    # Two rows, each KV head picking its own 3 slots (in any order, repeats allowed).
    picks = torch.tensor([[[4, 0, 2], [1, 1, 3], [0, 3, 4]],
                          [[2, 2, 2], [4, 3, 0], [1, 0, 3]]])  # [R=2, Hkv, k=3]
    layer = 1
    k, v = pool.gather(layer, picks, torch.float32)
    assert k.shape == v.shape == (2, KV_HEADS, 3, BLOCK, HEAD_DIM)
    for r in range(2):
        for h in range(KV_HEADS):
            for j in range(3):
                block = slots.index(picks[r, h, j].item())
                assert torch.equal(k[r, h, j], k_all[layer, h, block])
                assert torch.equal(v[r, h, j], v_all[layer, h, block])
    assert pool.gather(layer, picks[0], torch.bfloat16)[1].dtype == torch.bfloat16  # no leading dims


@pytest.mark.parametrize("kind", KINDS)
def test_gather_all_heads_matches_dequantize_slots(kind):
    keys, values = _blocks(4, seed=2)
    pool = _pool(kind)
    slots = pool.add(keys, values)
    picks = torch.tensor([slots[3], slots[0], slots[3]])
    k_all, v_all = pool.dequantize_slots(slots, torch.float32)
    for layer in range(LAYERS):
        k, v = pool.gather_all_heads(layer, picks, torch.float32)
        assert k.shape == (KV_HEADS, 3, BLOCK, HEAD_DIM)
        assert torch.equal(k, k_all[layer][:, [3, 0, 3]]) and torch.equal(v, v_all[layer][:, [3, 0, 3]])
        per_head = pool.gather(layer, picks.expand(KV_HEADS, 3), torch.float32)
        assert torch.equal(k, per_head[0]) and torch.equal(v, per_head[1])


@pytest.mark.parametrize("kind", KINDS)
def test_summaries_bound_keys_and_logits(kind):
    keys, values = _blocks(3, seed=3)
    pool = _pool(kind)
    slots = pool.add(keys, values)
    g = torch.Generator().manual_seed(4)
    query = torch.randn(KV_HEADS, 4, HEAD_DIM, generator=g)  # [Hkv, G=4, D]
    for layer in range(LAYERS):
        lo, hi = pool.summaries(layer)
        assert lo.shape == hi.shape == (KV_HEADS, pool.capacity, HEAD_DIM)
        assert lo.dtype == hi.dtype == torch.float16
        true_lo, true_hi = keys[layer].amin(2), keys[layer].amax(2)  # [Hkv, n, D]
        lo, hi = lo[:, slots].float(), hi[:, slots].float()
        # Outward fp16 rounding: covers the keys, off by at most one fp16 step (2^-10 relative).
        assert (lo <= true_lo).all() and (hi >= true_hi).all()
        torch.testing.assert_close(lo, true_lo, rtol=2 ** -10, atol=1e-7)
        torch.testing.assert_close(hi, true_hi, rtol=2 ** -10, atol=1e-7)
        bound = block_upper_bound(query, lo, hi)                        # [Hkv, G, n]
        logits = torch.einsum("hgd,hntd->hgnt", query, keys[layer])      # [Hkv, G, n, bs]
        assert (bound >= logits.amax(-1) - 1e-4).all()


def test_remove_then_add_reuses_slots():
    pool = _pool("int8", initial_slots=4)
    keys, values = _blocks(4, seed=5)
    assert pool.add(keys, values) == [0, 1, 2, 3] and pool.num_used == 4
    pool.remove([2, 0])
    assert pool.num_used == 2 and pool.capacity == 4
    new_keys, new_values = _blocks(2, seed=6)
    assert pool.add(new_keys, new_values) == [0, 2]  # last freed first: LIFO
    assert pool.capacity == 4 and pool.num_used == 4
    k, _ = pool.dequantize_slots([0, 1, 2, 3])
    expected = dequantize(quantize(torch.stack(
        [new_keys[:, :, 0], keys[:, :, 1], new_keys[:, :, 1], keys[:, :, 3]], dim=2), "int8", "channel"))
    assert torch.equal(k, expected)
    pool.check_integrity()
    assert pool.add(*_blocks(0)) == [] and pool.num_used == 4


@pytest.mark.parametrize("kind", KINDS)
def test_growth_keeps_earlier_contents(kind):
    pool = _pool(kind, initial_slots=2)
    first_keys, first_values = _blocks(2, seed=7)
    first = pool.add(first_keys, first_values)
    before = pool.dequantize_slots(first)
    lo_before, hi_before = (s.clone() for s in pool.summaries(1))
    more = pool.add(*_blocks(3, seed=8))  # 3 more than the free 0: grows by max(capacity, 3)
    assert first == [0, 1] and more == [2, 3, 4] and pool.capacity == 5 and pool.num_used == 5
    after = pool.dequantize_slots(first)
    assert torch.equal(before[0], after[0]) and torch.equal(before[1], after[1])
    lo, hi = pool.summaries(1)
    assert torch.equal(lo[:, :2], lo_before) and torch.equal(hi[:, :2], hi_before)
    pool.add(*_blocks(1, seed=9))  # doubling: 5 -> 10
    assert pool.capacity == 10 and pool.num_used == 6
    pool.check_integrity()


@pytest.mark.parametrize("kind", KINDS)
def test_slot_bytes_is_what_is_stored(kind):
    pool = _pool(kind, initial_slots=3)
    stored = sum(t.numel() * t.element_size() for t in pool.stored.values())
    assert pool.slot_bytes * pool.capacity == stored
    pool.add(*_blocks(4))  # growth keeps the per-slot count
    assert pool.slot_bytes * pool.capacity == sum(t.numel() * t.element_size() for t in pool.stored.values())


@pytest.mark.parametrize("kind, slot_bytes", [("int8", 236_160), ("fp8", 218_880), ("int4", 138_240)])
def test_slot_bytes_for_default_model(kind, slot_bytes):
    if kind == "fp8" and not fp8_supported("cpu"):
        pytest.skip("no float8_e4m3fn casts on CPU")
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64, 16-token blocks; bf16 K+V is 368,640 bytes.
    assert ColdPool(30, 3, 16, 64, kind, initial_slots=1).slot_bytes == slot_bytes


def test_unknown_kind_lists_kinds():
    with pytest.raises(ValueError, match="'int2'.*int8, fp8, int4"):
        _pool("int2")


def test_int4_head_dim_not_groupable():
    with pytest.raises(ValueError, match="head_dim=48"):
        ColdPool(LAYERS, KV_HEADS, BLOCK, 48, "int4")


def test_add_mismatched_shapes():
    pool = _pool("int8")
    keys, values = _blocks(2)
    with pytest.raises(ValueError, match=r"\[2, 3, n, 16, 64\]; got keys \[2, 3, 2, 16, 64\] and values"):
        pool.add(keys, values[:, :, :1])
    with pytest.raises(ValueError, match="got keys"):
        pool.add(keys[..., :32], values[..., :32])
    with pytest.raises(ValueError, match="got keys"):
        pool.add(keys[0], values[0])
    assert pool.num_used == 0


def test_check_integrity_catches_double_free():
    pool = _pool("int4")
    pool.add(*_blocks(2))
    pool.remove([1])
    pool.remove([1])
    with pytest.raises(AssertionError, match="freed twice"):
        pool.check_integrity()


def test_growth_hands_out_free_slots_before_new_ones():
    pool = _pool("int8", initial_slots=4)
    pool.add(*_blocks(4))
    pool.remove([1])
    assert pool.add(*_blocks(3, seed=1)) == [1, 4, 5] and pool.capacity == 8
    assert pool.add(*_blocks(2, seed=2)) == [6, 7]
    pool.check_integrity()
