"""Quantized panels: the decode products read a GGUF file's Q4_0 / Q4_1 / Q8_0 blocks and expand them to
the very bf16 weights the bf16 panels hold (kvreplay/kernels/csrc/layer_ops.cpp
pack_quant_panels), so every product is bit-identical to the bf16 panels'."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_helpers import built_or_skip, run_with_switch

from kvreplay.kernels import cpu_kernels
from kvreplay.layers.linear import Projection, QuantizedWeight

BLOCK_BYTES = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}
RECORD_BYTES = {"Q4_0": 320, "Q4_1": 320, "Q8_0": 544}


@pytest.fixture(scope="module")
def ops():
    ops = built_or_skip(cpu_kernels.layer_ops(), "layer ops")
    if not ops.has_panel_linear():
        pytest.skip("no AVX512-BF16 here: no panel kernel")
    return ops


def _blocks(fmt: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """Random GGUF rows [n, k / 32 * block bytes]: scales spread over fp16's range (subnormal,
    negative, zero, large offsets against small steps), random quants."""
    rng = np.random.default_rng(seed)
    count = n * k // 32
    scale = (rng.standard_normal(count) * 10.0 ** rng.integers(-7, 1, count)).astype(np.float16)
    scale[::97] = 0
    scale[1::89] = np.float16(3e-7)  # subnormal in fp16
    if fmt == "Q4_1":
        offset = (-8 * scale.astype(np.float32) * rng.uniform(0.5, 1.5, count)).astype(np.float16)
        offset[2::53] = np.float16(-1000.0)  # a sum that rounds in fp32: m large, d * q small
        quants = rng.integers(0, 256, (count, 16), dtype=np.uint8)
        raw = np.concatenate([scale.view(np.uint8).reshape(count, 2), offset.view(np.uint8).reshape(count, 2),
                              quants], axis=1)
    elif fmt == "Q4_0":
        scale[3::61] = np.float16(4000.0)  # -8 d still within fp16
        quants = rng.integers(0, 256, (count, 16), dtype=np.uint8)
        raw = np.concatenate([scale.view(np.uint8).reshape(count, 2), quants], axis=1)
    else:
        quants = rng.integers(-128, 128, (count, 32), dtype=np.int8).view(np.uint8)
        raw = np.concatenate([scale.view(np.uint8).reshape(count, 2), quants], axis=1)
    return np.ascontiguousarray(raw.reshape(n, k // 32 * BLOCK_BYTES[fmt]))


def _bf16_weight(fmt: str, raw: np.ndarray) -> torch.Tensor:
    """What the loader makes of the blocks: gguf-py's dequantization, rounded to bf16."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize
    values = dequantize(raw, getattr(GGMLQuantizationType, fmt)).astype(np.float32)
    return torch.from_numpy(np.array(values.reshape(raw.shape[0], -1))).to(torch.bfloat16)


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("n,k", [(16, 32), (48, 64), (80, 576), (1536, 576), (576, 1536)])
def test_blocks_expand_to_the_loaders_bf16_weights(ops, fmt, n, k):
    """Panels of 1-3 tiles (n 16, 80 = 3 + 2 tiles), one or many blocks along k."""
    raw = _blocks(fmt, n, k, seed=n + k)
    packed = ops.pack_quant_panels(torch.from_numpy(raw), k, fmt)
    assert packed.dtype == torch.uint8 and packed.numel() == n * k // 32 * RECORD_BYTES[fmt] // 16
    assert torch.equal(ops.expand_quant_panels(packed), ops.pack_panels(_bf16_weight(fmt, raw)))


@pytest.mark.parametrize("fmt", ["Q4_0", "Q4_1", "Q8_0"])
@pytest.mark.parametrize("rows", [1, 3, 16, 17, 32, 33, 64])
def test_products_are_the_bf16_panels_products(ops, fmt, rows):
    n, k = 112, 192  # 7 tiles: panels of 3, 3 and 1
    raw = _blocks(fmt, n, k, seed=rows)
    quant = ops.pack_quant_panels(torch.from_numpy(raw), k, fmt)
    plain = ops.pack_panels(_bf16_weight(fmt, raw))
    x = torch.randn(rows, k).bfloat16()
    bias = torch.randn(n).bfloat16()
    for b in (None, bias):
        assert torch.equal(ops.panel_linear(x, quant, b), ops.panel_linear(x, plain, b))
        assert torch.equal(ops.panel_linear_float(x, quant, b), ops.panel_linear_float(x, plain, b))
    # a row's result does not depend on the other rows
    assert torch.equal(ops.panel_linear(x[:1], quant, None), ops.panel_linear(x, quant, None)[:1])


def test_vector_kernel_reads_blocks_too(ops, tmp_path):
    """KVREPLAY_AMX_PANELS=0 (read once per process, hence a subprocess) sends every row count
    to the AVX512-BF16 vector kernel, which expands a whole panel at a time: the same bits as its
    bf16 panels there too. (On a CPU without AMX the tests above run this path already.)"""
    result = run_with_switch(
        tmp_path, "KVREPLAY_AMX_PANELS",
        "import torch\n"
        "from test_quant_panels import _blocks, _bf16_weight\n"
        "from kvreplay.kernels import cpu_kernels\n"
        "ops = cpu_kernels.layer_ops()\n"
        "assert not ops.has_amx_panels()\n"
        "for fmt in ('Q4_0', 'Q4_1', 'Q8_0'):\n"
        "    raw = _blocks(fmt, 112, 192, seed=5)\n"
        "    quant = ops.pack_quant_panels(torch.from_numpy(raw), 192, fmt)\n"
        "    plain = ops.pack_panels(_bf16_weight(fmt, raw))\n"
        "    for rows in (1, 9, 32, 100):\n"
        "        x = torch.randn(rows, 192).bfloat16()\n"
        "        assert torch.equal(ops.panel_linear(x, quant, None), ops.panel_linear(x, plain, None)), (fmt, rows)\n"
        "print('vector kernel ok')\n")
    assert "vector kernel ok" in result.stdout


def test_bad_blocks_are_clear_errors(ops):
    raw = torch.from_numpy(_blocks("Q4_1", 32, 64))
    with pytest.raises(RuntimeError, match="format must be Q4_0, Q4_1 or Q8_0"):
        ops.pack_quant_panels(raw, 64, "Q5_0")
    with pytest.raises(RuntimeError, match="pack_quant_panels: Q4_1 blocks"):
        ops.pack_quant_panels(raw, 96, "Q4_1")  # rows too short for K
    with pytest.raises(RuntimeError, match="pack_quant_panels: Q8_0 blocks"):
        ops.pack_quant_panels(raw, 64, "Q8_0")  # Q4_1 rows read as Q8_0
    with pytest.raises(RuntimeError, match="N a multiple of 16"):
        ops.pack_quant_panels(raw[:24], 64, "Q4_1")
    with pytest.raises(RuntimeError, match="pack_quant_panels"):
        ops.pack_quant_panels(raw.view(torch.int8), 64, "Q4_1")
    packed = ops.pack_quant_panels(raw, 64, "Q4_1")
    with pytest.raises(RuntimeError, match="panel_linear: x must be bf16"):
        ops.panel_linear(torch.randn(2, 32).bfloat16(), packed, None)
    with pytest.raises(RuntimeError, match="must come from pack_panels or pack_quant_panels"):
        ops.panel_linear(torch.randn(2, 64).bfloat16(), packed[:, :, :300].contiguous(), None)
    with pytest.raises(RuntimeError, match="expand_quant_panels"):
        ops.expand_quant_panels(torch.zeros(2, 2, 100, dtype=torch.uint8))


def test_projection_keeps_the_blocks_where_it_can(ops, monkeypatch):
    monkeypatch.setenv("KVREPLAY_QUANT_PANELS", "1")  # unset: the CPU decides (test below)
    raw = _blocks("Q4_1", 64, 128)
    weight = _bf16_weight("Q4_1", raw)
    blocks = QuantizedWeight("Q4_1", torch.from_numpy(raw))
    proj = Projection(weight, quantized=blocks)
    if proj.panels is None:
        pytest.skip("no panel kernel for this weight here")
    assert proj.panel_format == "Q4_1" and proj.panels.dtype == torch.uint8
    x = torch.randn(4, 128).bfloat16()
    assert torch.equal(proj(x), Projection(weight)(x))
    assert Projection(weight.float(), quantized=blocks).panels is None  # fp32: F.linear, no panels
    monkeypatch.setenv("KVREPLAY_QUANT_PANELS", "0")
    assert Projection(weight, quantized=blocks).panel_format == "bf16"
    monkeypatch.setenv("KVREPLAY_QUANT_PANELS", "yes")
    with pytest.raises(ValueError, match="KVREPLAY_QUANT_PANELS must be 0 or 1"):
        Projection(weight, quantized=blocks)
    monkeypatch.delenv("KVREPLAY_QUANT_PANELS")  # the default: integer products on the AVX2 kernel,
    monkeypatch.delenv("KVREPLAY_INT_PRODUCTS", raising=False)  # else blocks unless the CPU is AVX2-only
    without = "Q4_1" if cpu_kernels.has_avx512_bf16() or not cpu_kernels.cpu_flags() else "bf16"
    assert Projection(weight, quantized=blocks).panel_format == ("Q4_1/int8" if ops.has_int_products() else without)
    monkeypatch.setenv("KVREPLAY_INT_PRODUCTS", "0")
    assert Projection(weight, quantized=blocks).panel_format == without


def test_q4_0_scale_too_large_for_the_panel_form(ops, caplog, monkeypatch):
    """Q4_0 becomes d * q - 8 d: with |d| >= 8192 that offset overflows fp16, so such blocks are
    refused by the op and the Projection keeps bf16 panels (same products)."""
    raw = _blocks("Q4_0", 16, 32)
    raw[5, :2] = np.frombuffer(np.float16(9000.0).tobytes(), dtype=np.uint8)
    with pytest.raises(RuntimeError, match="too large for the panel form"):
        ops.pack_quant_panels(torch.from_numpy(raw), 32, "Q4_0")
    weight = _bf16_weight("Q4_0", raw)
    monkeypatch.setenv("KVREPLAY_QUANT_PANELS", "1")
    proj = Projection(weight, quantized=QuantizedWeight("Q4_0", torch.from_numpy(raw)))
    if proj.panels is not None:
        assert proj.panel_format == "bf16" and "kept as bf16 panels" in caplog.text
        x = torch.randn(3, 32).bfloat16()
        assert torch.equal(proj(x), Projection(weight)(x))


def test_concat_needs_one_format():
    a = QuantizedWeight("Q4_1", torch.zeros(16, 20, dtype=torch.uint8))
    b = QuantizedWeight("Q4_1", torch.ones(32, 20, dtype=torch.uint8))
    both = QuantizedWeight.concat([a, b])
    assert both.format == "Q4_1" and torch.equal(both.blocks, torch.cat([a.blocks, b.blocks]))
    assert QuantizedWeight.concat([a]) is a
    assert QuantizedWeight.concat([a, None]) is None
    assert QuantizedWeight.concat([a, QuantizedWeight("Q8_0", torch.zeros(16, 34, dtype=torch.uint8))]) is None
    assert QuantizedWeight.concat([]) is None


def test_the_default_models_blocks_are_its_weights(ops):
    """Every Q4_1 / Q8_0 tensor the loader keeps (the q and k rows un-permuted like the weights)
    expands to the bf16 weight the loader dequantized."""
    from kvreplay.models.loader import load_model
    loaded = load_model(None)
    formats = {q.format for q in loaded.quantized.values()}
    assert formats == {"Q4_1", "Q8_0"} and len(loaded.quantized) == 30 * 7 + 1
    for name, q in loaded.quantized.items():
        weight = loaded.weights[name].bfloat16()
        packed = ops.pack_quant_panels(q.blocks, weight.shape[1], q.format)
        assert torch.equal(ops.expand_quant_panels(packed), ops.pack_panels(weight)), name


def test_engine_gives_the_same_bits_with_and_without_the_blocks(ops, monkeypatch):
    """The default model in bf16 reads its blocks (every projection and the LM head), and a
    generation gives the logits of bf16 panels bit for bit, through decode_layer and prefill."""
    from kvreplay import LLM, SamplingParams
    prompts = ["The capital of France is", "def add(a, b):", "A B C D E F G H I J K"]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("KVREPLAY_QUANT_PANELS", flag)
        llm = LLM(dtype="bfloat16", kv_cache_memory="32MiB", enable_prefix_caching=False)
        model = llm.engine.runner.model
        projections = [model.lm_head] + [layer[n] for layer in model.layers for n in ("qkv", "o", "gate_up", "down")]
        if model.lm_head.panels is None:
            pytest.skip("no panel kernel here")
        formats = {p.panel_format for p in projections}
        assert formats == ({"Q4_1", "Q8_0"} if flag == "1" else {"bf16"})
        assert model.lm_head.panel_format == ("Q8_0" if flag == "1" else "bf16")
        logits = []
        forward = model.forward

        def capture(*args, **kwargs):
            out = forward(*args, **kwargs)
            logits.append(out.clone())
            return out
        model.forward = capture
        outs = llm.generate(prompts, params, on_step=lambda e: e.check_integrity())
        runs[flag] = ([o.token_ids for o in outs], logits)
        assert any(model.fused_rows)  # decode steps went through decode_layer
    assert runs["1"][0] == runs["0"][0]
    assert len(runs["1"][1]) == len(runs["0"][1])
    for a, b in zip(runs["1"][1], runs["0"][1]):
        assert torch.equal(a, b)
