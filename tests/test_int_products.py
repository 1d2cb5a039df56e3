"""Integer products (layer_ops.cpp int_panel, KVREPLAY_INT_PRODUCTS=1): the decode products read a
GGUF file's Q4_0 / Q4_1 / Q8_0 blocks as integers and x as 16-bit integers per 32-k block, so each
output is the file's own weights times x, rounded once to bf16 (not the bf16 panels' products of
the weights' bf16 roundings). Checked against float64 products of gguf-py's dequantized weights."""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from kernel_helpers import built_or_skip, torch_threads
from test_quant_panels import _blocks

from kvreplay.kernels import cpu_kernels
from kvreplay.layers.linear import Projection, QuantizedWeight, int_products_bits, silu_pair_order

INT_RECORD_BYTES = {"Q4_0": 384, "Q4_1": 384, "Q8_0": 576}


@pytest.fixture(scope="module")
def ops():
    ops = built_or_skip(cpu_kernels.layer_ops(), "layer ops")
    if not ops.has_panel_linear() or not ops.has_int_products():
        pytest.skip("no integer products in this build (they run on the AVX2 panel kernel)")
    return ops


def _weight(fmt: str, raw: np.ndarray) -> torch.Tensor:
    """The file's weights in float64 (gguf-py's dequantization: d * q + m in fp32, exact here but
    for the fp32 rounding of the sum)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    values = dequantize(raw, getattr(GGMLQuantizationType, fmt)).astype(np.float64)
    return torch.from_numpy(np.array(values.reshape(raw.shape[0], -1)))


@pytest.fixture(autouse=True)
def _seeded():
    torch.manual_seed(0)


def _check(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None,
           rounded_share: float = 0.98):
    """y (bf16 or its fp32 widening) is x W^T (+ bias) rounded once to bf16, up to x's rounding
    to its block scale (at most 2^-15 of the block's largest |x| a value) and the fp32 sums
    (2^-20 of sum |x| |w|): within half a bf16 step of the exact value plus those; and most
    outputs are exactly the correctly rounded product (`rounded_share` of them)."""
    exact = x.double() @ w.T + (0 if bias is None else bias.double())
    bound = x.double().abs() @ w.abs().T + (0 if bias is None else bias.double().abs())
    rows, k = x.shape
    block_max = x.double().abs().view(rows, k // 32, 32).amax(-1, keepdim=True).expand(rows, k // 32, 32)
    x_rounding = block_max.reshape(rows, k) @ w.abs().T * 2.0 ** -15
    err = (y.double() - exact).abs()
    # (+ half a step of bf16's subnormals, 2^-134: an output that small keeps few bits)
    limit = exact.abs() * 2.0 ** -8 + x_rounding + bound * 2.0 ** -20 + 2.0 ** -134
    assert (err <= limit).all(), float((err / limit).max())
    correctly_rounded = (y.double() == exact.to(torch.bfloat16).double()).double().mean().item()
    assert correctly_rounded >= rounded_share, correctly_rounded


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 17, 32, 33, 130])  # 130: 64-row passes and 2
def test_products_are_the_files_weights_times_x(ops, fmt, rows):
    n, k = 112, 192  # 7 tiles: panels of 3, 3 and 1; 6 blocks along k
    raw = _blocks(fmt, n, k, seed=rows)
    packed = ops.pack_quant_panels(torch.from_numpy(raw), k, fmt, True)
    assert packed.dtype == torch.uint8 and packed.shape == (n // 16, k // 32, INT_RECORD_BYTES[fmt])
    w = _weight(fmt, raw)
    x = torch.randn(rows, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    for b in (None, bias):
        y = ops.panel_linear(x, packed, b)
        assert y.dtype == torch.bfloat16 and y.shape == (rows, n)
        _check(y, x, w, b)
        assert torch.equal(ops.panel_linear_float(x, packed, b), y.float())
        with torch_threads(2):
            assert torch.equal(ops.panel_linear(x, packed, b), y)
    # a row's result does not depend on the other rows
    assert torch.equal(ops.panel_linear(x[-1:], packed, None), ops.panel_linear(x, packed, None)[-1:])


@pytest.mark.parametrize("n,k", [(16, 32), (80, 576), (576, 1536)])
def test_model_shapes_and_wide_x(ops, n, k):
    """x spread over many binades: a block's small values go in rounded to its scale (fewer
    outputs are then the correctly rounded product: 97% in the smallest case here)."""
    raw = _blocks("Q4_1", n, k, seed=k)
    packed = ops.pack_quant_panels(torch.from_numpy(raw), k, "Q4_1", True)
    x = (torch.randn(9, k) * 10.0 ** torch.randint(-6, 3, (9, k))).bfloat16()
    _check(ops.panel_linear(x, packed, None), x, _weight("Q4_1", raw), rounded_share=0.9)


def test_zeros_tiny_values_and_non_finite_rows(ops):
    n, k = 48, 96
    raw = _blocks("Q8_0", n, k, seed=7)
    packed = ops.pack_quant_panels(torch.from_numpy(raw), k, "Q8_0", True)
    w = _weight("Q8_0", raw)
    x = torch.randn(6, k)
    x[0] = 0                                # all blocks zero
    x[1, :32] = 0                           # one block zero
    x[2] *= 1e-36                           # blocks below 2^-113: scaled in two steps
    x[3, 5] = 3e-39                         # a subnormal bf16 next to normal values
    x[4, 40] = float("nan")
    x[5, 70] = float("inf")
    x = x.bfloat16()
    y = ops.panel_linear_float(x, packed, None)
    _check(y[:4], x[:4], w, rounded_share=0.9)  # row 2's outputs: bf16 subnormals
    assert (y[0] == 0).all()
    assert torch.isnan(y[4]).all() and torch.isnan(y[5]).all()  # an inf gives NaN here, not +-inf
    assert torch.equal(ops.panel_linear_float(x[:4], packed, None), y[:4])  # the others untouched


def test_argmax_and_silu_read_integer_records(ops):
    n, k = 112, 64
    raw = _blocks("Q4_1", n, k, seed=3)
    packed = ops.pack_quant_panels(torch.from_numpy(raw), k, "Q4_1", True)
    x = torch.randn(5, k).bfloat16()
    assert torch.equal(ops.panel_argmax(x, packed, None), ops.argmax_rows(ops.panel_linear_float(x, packed, None)))
    order = silu_pair_order(n // 2)
    blocks = torch.from_numpy(raw)
    expected = ops.silu_mul(ops.panel_linear(x, ops.pack_quant_panels(blocks, k, "Q4_1", True), None))
    got = ops.panel_silu_mul(x, ops.pack_quant_panels(blocks[order], k, "Q4_1", True), None)
    assert torch.equal(got, expected)


def _x8(x: torch.Tensor) -> torch.Tensor:
    """x as the 8-bit form takes it: per row and 32-k block, round(x * 127 / max |x|) (fp32, ties
    to even) times max |x| / 127."""
    rows, k = x.shape
    blocks = x.float().view(rows, k // 32, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    # (127 / largest as a tensor division: `127 / tensor` multiplies by a reciprocal, off by an
    # ulp at times, which moved a tie x * 127 / largest = 63.5 to 63)
    v = torch.round(blocks * torch.div(torch.full_like(largest, 127.0), largest)).clamp(-127, 127)
    return (v.double() * (largest / 127).double()).view(rows, k)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 17, 32, 33, 130])
def test_eight_bit_x_products(ops, fmt, rows):
    """x at 8 bits (lossy): the outputs are the products of the file's weights with x rounded to
    1/127 of its block's largest, rounded once to bf16 (most of them exactly that)."""
    n, k = 112, 192
    raw = _blocks(fmt, n, k, seed=rows)
    packed = ops.pack_quant_panels(torch.from_numpy(raw), k, fmt, True, 8)
    assert packed.dtype == torch.int8 and packed.shape == (n // 16, k // 32, 384)
    w = _weight(fmt, raw)
    x = torch.randn(rows, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    for b in (None, bias):
        y = ops.panel_linear(x, packed, b)
        _check(y, _x8(x), w, b, rounded_share=0.97)
        assert torch.equal(ops.panel_linear_float(x, packed, b), y.float())
        with torch_threads(2):
            assert torch.equal(ops.panel_linear(x, packed, b), y)
        # and within the rounding of x from the exact product: half a step of 1/127 a block
        exact = x.double() @ w.T + (0 if b is None else b.double())
        largest = x.double().abs().view(rows, k // 32, 32).amax(-1, keepdim=True).expand(rows, k // 32, 32)
        limit = exact.abs() * 2.0 ** -8 + largest.reshape(rows, k) / 254 @ w.abs().T * 1.0001
        assert ((y.double() - exact).abs() <= limit).all()
    assert torch.equal(ops.panel_linear(x[-1:], packed, None), ops.panel_linear(x, packed, None)[-1:])
    assert torch.equal(ops.panel_argmax(x, packed, None), ops.argmax_rows(ops.panel_linear_float(x, packed, None)))
    x[0, 3] = float("nan")
    y = ops.panel_linear_float(x, packed, None)
    assert torch.isnan(y[0]).all() and (rows == 1 or not torch.isnan(y[1:]).any())


def test_integer_records_are_refused_where_bf16_is_meant(ops):
    packed = ops.pack_quant_panels(torch.from_numpy(_blocks("Q4_1", 32, 64)), 64, "Q4_1", True)
    with pytest.raises(RuntimeError, match="not one for integer products"):
        ops.expand_quant_panels(packed)
    with pytest.raises(RuntimeError, match="x must be bf16"):
        ops.panel_linear(torch.randn(2, 64), packed, None)
    with pytest.raises(RuntimeError, match="must come from pack_panels or pack_quant_panels"):
        ops.panel_linear(torch.randn(2, 64).bfloat16(), packed[:, :, :380].contiguous(), None)
    eight = ops.pack_quant_panels(torch.from_numpy(_blocks("Q4_1", 32, 64)), 64, "Q4_1", True, 8)
    with pytest.raises(RuntimeError, match="expand_quant_panels"):
        ops.expand_quant_panels(eight)
    with pytest.raises(RuntimeError, match="must come from pack_panels or pack_quant_panels"):
        ops.panel_linear(torch.randn(2, 64).bfloat16(), eight[:, :, :380].contiguous(), None)
    for fmt, integer, bits in (("Q8_0", True, 8), ("Q4_1", False, 8), ("Q4_1", True, 12)):
        with pytest.raises(RuntimeError, match="x_bits must be 16, or 8 for integer products on Q4_0 / Q4_1"):
            ops.pack_quant_panels(torch.from_numpy(_blocks(fmt, 32, 64)), 64, fmt, integer, bits)


def test_projection_takes_integer_records_on_request(ops, monkeypatch):
    n, k = 96, 64
    raw = _blocks("Q4_1", n, k, seed=11)
    w = _weight("Q4_1", raw)
    blocks = QuantizedWeight("Q4_1", torch.from_numpy(raw))
    monkeypatch.setenv("KVREPLAY_INT_PRODUCTS", "1")
    proj = Projection(w.bfloat16(), quantized=blocks)
    assert proj.panel_format == "Q4_1/int" and proj.panels.shape[2] == 384
    x = torch.randn(3, k).bfloat16()
    _check(proj(x), x, w)
    # rows in pair order for the kernel, outputs in the weight's own order for the caller
    paired = Projection(w.bfloat16(), quantized=blocks, panel_order=silu_pair_order(n // 2))
    assert torch.equal(paired(x), proj(x))
    monkeypatch.setenv("KVREPLAY_INT_PRODUCTS", "8")
    proj8 = Projection(w.bfloat16(), quantized=blocks)
    assert proj8.panel_format == "Q4_1/int8" and proj8.panels.dtype == torch.int8
    _check(proj8(x), _x8(x), w, rounded_share=0.95)
    q8 = _blocks("Q8_0", n, k, seed=12)
    assert Projection(_weight("Q8_0", q8).bfloat16(), quantized=QuantizedWeight("Q8_0", torch.from_numpy(q8))) \
        .panel_format == "Q8_0/int"  # Q8_0 blocks keep 16-bit x
    monkeypatch.setenv("KVREPLAY_INT_PRODUCTS", "0")
    assert "/int" not in Projection(w.bfloat16(), quantized=blocks).panel_format
    monkeypatch.setenv("KVREPLAY_INT_PRODUCTS", "yes")
    with pytest.raises(ValueError, match="KVREPLAY_INT_PRODUCTS must be 0, 1"):
        Projection(w.bfloat16(), quantized=blocks)


def test_the_default_width_of_x(monkeypatch):
    """Unset, x goes in at 8 bits where the kernel has integer products and at none where it has
    not, or where KVREPLAY_QUANT_PANELS asks for a form of its own; the variable overrides both."""
    monkeypatch.delenv("KVREPLAY_INT_PRODUCTS", raising=False)
    monkeypatch.delenv("KVREPLAY_QUANT_PANELS", raising=False)
    assert int_products_bits(True) == 8 and int_products_bits(False) == 0
    monkeypatch.setenv("KVREPLAY_QUANT_PANELS", "0")
    assert int_products_bits(True) == 0
    for setting, bits in (("1", 16), ("16", 16), ("8", 8), ("0", 0), (" 8 ", 8)):
        monkeypatch.setenv("KVREPLAY_INT_PRODUCTS", setting)
        assert int_products_bits(True) == bits, setting


@pytest.mark.parametrize("setting,formats,least", [("1", {"Q4_1/int", "Q8_0/int"}, 0.96),
                                                    ("8", {"Q4_1/int8", "Q8_0/int"}, 0.94)])
def test_engine_with_integer_products_stays_near_fp32(ops, monkeypatch, llm32, real_text, setting, formats, least):
    """The default model in bf16 with integer products (every projection and the LM head, through
    prefill and decode_layers): greedy generation runs clean, and on 512 tokens of real text its
    top-1 tokens agree with the fp32 model's nearly always (bench/int_products.py, 1,024 tokens:
    16-bit x 98.3%, 8-bit x 96.3%, the bf16 panels 98.0%)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench"))
    from int_products import _logits

    from kvreplay import LLM, SamplingParams
    monkeypatch.setenv("KVREPLAY_INT_PRODUCTS", setting)
    llm = LLM(dtype="bfloat16", kv_cache_memory="32MiB", enable_prefix_caching=False)
    model = llm.engine.runner.model
    projections = [model.lm_head] + [layer[n] for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
    assert {p.panel_format for p in projections} == formats
    outs = llm.generate(["The capital of France is", "def add(a, b):"],
                        SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                        on_step=lambda e: e.check_integrity())
    assert all(len(o.token_ids) == 12 for o in outs) and any(model.fused_rows)
    ids = llm32.tokenizer(real_text).input_ids[:512]
    ours, reference = _logits(model, ids), _logits(llm32.engine.runner.model, ids)
    agree = (ours.argmax(-1) == reference.argmax(-1)).float().mean().item()
    assert agree > least, agree
    assert (ours - reference).abs().mean().item() < 0.25
