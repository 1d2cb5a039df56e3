"""Projection: packed oneDNN weights in bf16 on CPU must give F.linear's numbers exactly; where
oneDNN takes no bf16 products, the fp32 product rounded once; the panel kernel within one rounding."""
import pytest
import torch
import torch.nn.functional as F
from kernel_helpers import built_or_skip, run_with_switch, torch_threads

from kvreplay.kernels import cpu_kernels
from kvreplay.layers import linear
from kvreplay.layers.linear import (PANEL_ROWS, PANEL_ROWS_AMX, PANEL_ROWS_AMX_ONEDNN_ONLY, PANEL_ROWS_ANY,
                                    Projection, can_pack, machine_panel_rows, onednn_bf16_products, silu_pair_order)


@pytest.mark.parametrize("rows", [1, 7, 32, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_bf16_equals_plain_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    # an odd input width: the panel kernel cannot take it, so every row count goes to oneDNN
    weight = torch.randn(96, 41, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, 41, generator=gen).bfloat16()
    proj = Projection(weight, bias)
    if not can_pack(weight):
        pytest.skip("oneDNN takes no bf16 products here (no oneDNN, or an AVX2-only CPU)")
    assert proj.packed and proj.panel_linear is None
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


def test_onednn_probe_agrees_with_packing():
    """The probe is asked once; where it says yes, a bf16 weight packs and its product is exact."""
    assert onednn_bf16_products() is onednn_bf16_products()
    weight = torch.randn(16, 32).bfloat16()
    assert can_pack(weight) == onednn_bf16_products()
    assert not linear.widens(weight) == onednn_bf16_products()
    assert not linear.widens(weight.float()) and not linear.widens(weight.to("meta"))


@pytest.mark.parametrize("rows", [1, 5, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_widened_projection_is_the_fp32_product_rounded_once(monkeypatch, rows, with_bias):
    """As on a CPU where oneDNN takes no bf16 products: an fp32 copy, the fp32 product rounded to
    bf16, within one rounding of F.linear in bf16; non-bf16 inputs refused clearly."""
    monkeypatch.setattr(linear, "onednn_bf16_products", lambda: False)
    gen = torch.Generator().manual_seed(rows)
    weight = (torch.randn(96, 41, generator=gen) * 0.1).bfloat16()  # no panel copy: odd width
    bias = torch.randn(96, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, 41, generator=gen).bfloat16()
    proj = Projection(weight, bias)
    assert proj.widened and not proj.packed and proj.weight.dtype == torch.float32
    got = proj(x)
    assert got.dtype == torch.bfloat16
    expected = F.linear(x.float(), weight.float(), None if bias is None else bias.float()).bfloat16()
    assert torch.equal(got, expected)
    exact = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-6).all()
    assert torch.equal(proj.float_output(x), got.float())
    assert torch.equal(proj.argmax(x), got.float().argmax(-1))
    with pytest.raises(ValueError, match="bf16 projection got a torch.float32 input"):
        proj(x.float())
    assert not Projection(weight, bias, pack=False).widened  # the plain reference stays plain


def test_packed_rejects_other_inputs_clearly():
    weight = torch.randn(8, 4).bfloat16()
    proj = Projection(weight)
    if not proj.packed:
        pytest.skip("oneDNN takes no bf16 products here (no oneDNN, or an AVX2-only CPU)")
    with pytest.raises(ValueError, match="packed bf16 projection"):
        proj(torch.randn(3, 4))  # fp32 input


def _panel_projection(weight, bias=None, panel_rows=PANEL_ROWS):
    """A projection whose first `panel_rows` rows go to the panel kernel, whatever this CPU's
    default (on an AMX CPU oneDNN takes all but the smallest row counts)."""
    proj = Projection(weight, bias, panel_rows=panel_rows)
    if proj.panel_linear is None:
        if cpu_kernels.should_build():  # a failed build where a toolchain exists fails here
            built_or_skip(cpu_kernels.layer_ops(), "layer ops")
        pytest.skip("no panel kernel here (no compiler, or neither AVX512-BF16 nor AVX2)")
    return proj


# 1-8 rows: one row block; 9, 13, 32: balanced blocks (5 + 4, 7 + 6, 8 x 4); 128: the largest
# count the kernel takes. 112 outputs: two full panels of 48 and a last one of 16.
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 13, 32, 128])
@pytest.mark.parametrize("with_bias", [False, True])
def test_panel_kernel_within_one_rounding_of_exact(rows, with_bias):
    gen = torch.Generator().manual_seed(10 + rows)
    weight = torch.randn(112, 578, generator=gen).bfloat16()
    bias = torch.randn(112, generator=gen).bfloat16() if with_bias else None
    x = torch.randn(rows, 578, generator=gen).bfloat16()
    proj = _panel_projection(weight, bias)
    got = proj(x)
    exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 112)
    # fp32 sums in another order than the exact product: at most one bf16 step from it
    step = exact.abs().clamp_min(1e-3) * 2 ** -7
    assert ((got.float() - exact).abs() <= step).all()
    # rows are independent: each equals itself computed alone, whatever block it fell in
    for row in {0, rows // 2, rows - 1}:
        assert torch.equal(proj(x[row:row + 1]), got[row:row + 1])


def test_panel_kernel_narrow_weights_and_thread_counts():
    """Weights of one or two tiles (a lone narrow panel) and 1 or 2 threads give the same bits."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(11, 64, generator=gen).bfloat16()
    for outputs in (16, 32, 48):
        weight = torch.randn(outputs, 64, generator=gen).bfloat16()
        proj = _panel_projection(weight)
        with torch_threads(1):
            one = proj(x)
        with torch_threads(2):
            two = proj(x)
        exact = F.linear(x.float(), weight.float())
        assert ((one.float() - exact).abs() <= exact.abs().clamp_min(1e-3) * 2 ** -7).all()
        assert torch.equal(two, one)


@pytest.mark.parametrize("outputs", [16, 32, 48, 112])
def test_panel_kernel_row_alone_equals_it_among_others(outputs):
    """A row's outputs do not depend on the rows that come with it (one row takes its own path
    on some CPUs: the AVX2 kernel widens the pairs in registers), bias and widening included."""
    gen = torch.Generator().manual_seed(outputs)
    weight = torch.randn(outputs, 96, generator=gen).bfloat16()
    bias = torch.randn(outputs, generator=gen).bfloat16()
    proj = _panel_projection(weight, bias)
    x = torch.randn(9, 96, generator=gen).bfloat16()
    together, widened = proj.panel_linear(x, proj.panels, bias), proj.panel_linear_float(x, proj.panels, bias)
    for row in (0, 4, 8):
        assert torch.equal(proj.panel_linear(x[row:row + 1], proj.panels, bias), together[row:row + 1])
        assert torch.equal(proj.panel_linear_float(x[row:row + 1], proj.panels, bias), widened[row:row + 1])
    assert torch.equal(widened, together.float())


def test_panel_kernel_rejects_bad_inputs():
    proj = _panel_projection(torch.randn(32, 64).bfloat16())
    with pytest.raises(RuntimeError, match="panel_linear: x must be"):
        proj.panel_linear(torch.randn(1, 32).bfloat16(), proj.panels, None)
    with pytest.raises(RuntimeError, match="panel_linear: x must be"):
        proj.panel_linear(torch.randn(1, 64), proj.panels, None)  # fp32
    with pytest.raises(RuntimeError, match="bias must be"):
        proj.panel_linear(torch.randn(1, 64).bfloat16(), proj.panels, torch.zeros(31).bfloat16())
    with pytest.raises(RuntimeError, match="must come from pack_panels"):
        proj.panel_linear(torch.randn(1, 64).bfloat16(), torch.zeros(32, 64).bfloat16(), None)
    with pytest.raises(RuntimeError, match="pack_panels"):
        torch.ops.kvreplay_layer.pack_panels(torch.randn(30, 64).bfloat16())
    with pytest.raises(RuntimeError, match="pack_panels"):
        torch.ops.kvreplay_layer.pack_panels(torch.randn(32, 63).bfloat16())
    assert Projection(torch.randn(30, 64).bfloat16()).panel_linear is None  # shape it cannot take
    assert proj.panel_linear(torch.zeros(0, 64).bfloat16(), proj.panels, None).shape == (0, 32)


@pytest.mark.parametrize("rows", [1, 9, 32, 200])
def test_float_output_is_the_bf16_result_widened(rows):
    """The LM head's fp32 logits: bit for bit what the bf16 projection rounds to, widened (the
    panel kernel widens as it stores; oneDNN above PANEL_ROWS rows, then .float())."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(112, 64, generator=gen).bfloat16()
    bias = torch.randn(112, generator=gen).bfloat16()
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    proj = _panel_projection(weight, bias)
    got = proj.float_output(x)
    assert got.dtype == torch.float32 and torch.equal(got, proj(x).float())
    plain = Projection(weight.float())  # fp32 weights: F.linear
    assert torch.equal(plain.float_output(x.float()), F.linear(x.float(), weight.float()))
    with pytest.raises(RuntimeError, match="panel_linear_float: x must be"):
        proj.panel_linear_float(torch.randn(1, 64), proj.panels, None)


def _above_panels(x, weight):
    """What a bf16 projection gives above its panel rows: oneDNN's product (F.linear's bits), or
    where oneDNN takes no bf16 products the fp32 product rounded once."""
    if can_pack(weight):
        return F.linear(x, weight)
    return F.linear(x.float(), weight.float()).bfloat16()


def test_rows_go_to_the_panel_kernel_up_to_the_machines_crossover(monkeypatch):
    """Up to `panel_rows` rows the panel kernel, above them oneDNN (F.linear's bits, or the
    widened product); the default comes from the CPU (every row count where oneDNN takes no
    bf16 products), KVREPLAY_PANEL_ROWS overrides it, and a bad value is a clear error."""
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(64, 96, generator=gen).bfloat16()
    x = torch.randn(6, 96, generator=gen).bfloat16()
    proj = _panel_projection(weight, panel_rows=3)
    assert proj.panel_rows == 3
    assert torch.equal(proj(x[:3]), proj.panel_linear(x[:3], proj.panels, None))
    assert torch.equal(proj(x), _above_panels(x, weight))
    assert torch.equal(proj.float_output(x), _above_panels(x, weight).float())
    monkeypatch.setenv("KVREPLAY_PANEL_ROWS", "0")
    assert machine_panel_rows() == 0
    none = Projection(weight)
    assert none.panel_linear is None and none.panels is None  # no second copy of the weight
    assert torch.equal(none(x[:1]), _above_panels(x[:1], weight))
    monkeypatch.setenv("KVREPLAY_PANEL_ROWS", "7")
    assert machine_panel_rows() == 7 and Projection(weight).panel_rows == 7
    for bad in ("-1", "129", "many"):
        monkeypatch.setenv("KVREPLAY_PANEL_ROWS", bad)
        with pytest.raises(ValueError, match="KVREPLAY_PANEL_ROWS must be"):
            machine_panel_rows()
    monkeypatch.delenv("KVREPLAY_PANEL_ROWS")
    amx_panels = cpu_kernels.layer_ops().has_amx_panels()
    expected = PANEL_ROWS if not cpu_kernels.has_amx_bf16() else PANEL_ROWS_AMX if amx_panels else PANEL_ROWS_AMX_ONEDNN_ONLY
    assert machine_panel_rows() == (expected if onednn_bf16_products() else PANEL_ROWS_ANY)
    if not onednn_bf16_products():  # every row count on the panels, and no fp32 copy beside them
        every = Projection(weight)
        assert every.panel_rows == PANEL_ROWS_ANY and not every.widened
        assert torch.equal(every(x), every.panel_linear(x, every.panels, None))


@pytest.mark.parametrize("rows", [1, 2, 3, 16, 17, 31, 32, 33, 64, 100, 128])
def test_amx_tiles_within_one_rounding_and_rows_independent(rows):
    """On a CPU with AMX tiles every row count runs on them (K a multiple of 32): each output
    within one bf16 step of the exact product, each row what it is computed alone, bias and
    widening included."""
    ops = cpu_kernels.layer_ops()
    gen = torch.Generator().manual_seed(100 + rows)
    # 112 outputs: two panels of three tiles and a last one of one; K = 576 and 1536 as in the model
    for k in (576, 1536):
        weight = (torch.randn(112, k, generator=gen) * 0.05).bfloat16()
        bias = torch.randn(112, generator=gen).bfloat16()
        x = torch.randn(rows, k, generator=gen).bfloat16()
        proj = _panel_projection(weight, bias)
        if not ops.has_amx_panels():
            pytest.skip("no AMX tiles here")
        got = proj.panel_linear(x, proj.panels, bias)
        exact = F.linear(x.float(), weight.float(), bias.float())
        assert ((got.float() - exact).abs() <= exact.abs().clamp_min(1e-3) * 2 ** -7).all()
        for row in {0, rows // 2, rows - 1}:
            assert torch.equal(proj.panel_linear(x[row:row + 1], proj.panels, bias), got[row:row + 1])
        widened = proj.panel_linear_float(x, proj.panels, bias)
        assert widened.dtype == torch.float32 and torch.equal(widened, got.float())


def _argmax_cases(gen, k=64):
    """(weight, bias, x): ties between outputs (a repeated weight row), a NaN output, rows of
    -inf, and plain rows."""
    weight = (torch.randn(112, k, generator=gen) * 0.1).bfloat16()
    weight[7] = weight[90] = 0  # outputs 7 and 90 equal (their bias) in every row...
    bias = torch.randn(112, generator=gen).bfloat16()
    bias[7] = bias[90] = 50  # ... and the largest: the first of them must win
    nan_bias = bias.clone()
    nan_bias[61] = float("nan")  # output 61 NaN in every row: torch.argmax answers it
    return weight, bias, nan_bias


@pytest.mark.parametrize("rows", [1, 5, 32, 64])
def test_panel_argmax_is_argmax_of_the_logits(rows):
    """The greedy LM head: each row's argmax of what panel_linear_float stores (the first on ties,
    a NaN's index where there is one), without storing it; bias, ties and NaN included."""
    gen = torch.Generator().manual_seed(200 + rows)
    weight, bias, nan_bias = _argmax_cases(gen)
    proj = _panel_projection(weight, bias)
    if proj.panel_argmax is None:
        pytest.skip("layer ops without panel_argmax")
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    for b in (bias, nan_bias, None):
        logits = proj.panel_linear_float(x, proj.panels, b)
        got = proj.panel_argmax(x, proj.panels, b)
        assert got.dtype == torch.int64 and torch.equal(got, logits.argmax(-1))
        with torch_threads(2):  # the panels' parts claimed by two threads: the same answer
            assert torch.equal(proj.panel_argmax(x, proj.panels, b), got)
    assert (proj.panel_argmax(x, proj.panels, bias) == 7).all()  # the first of the tied leaders
    assert (proj.panel_argmax(x, proj.panels, nan_bias) == 61).all()
    plain = torch.randn(rows, 64, generator=gen).bfloat16()
    assert torch.equal(proj.argmax(plain), proj.float_output(plain).argmax(-1))
    assert torch.equal(Projection(weight.float(), bias.float()).argmax(plain.float()),
                       F.linear(plain.float(), weight.float(), bias.float()).argmax(-1))  # no panels: plain
    with pytest.raises(RuntimeError, match="panel_argmax: x must be"):
        proj.panel_argmax(torch.randn(1, 32).bfloat16(), proj.panels, None)
    with pytest.raises(RuntimeError, match="bias must be"):
        proj.panel_argmax(x, proj.panels, torch.zeros(5).bfloat16())
    assert proj.panel_argmax(torch.zeros(0, 64).bfloat16(), proj.panels, None).shape == (0,)


def test_panel_argmax_on_the_vector_kernel(tmp_path):
    """KVREPLAY_AMX_PANELS=0 (read once per process, hence a subprocess): the vector kernel's
    argmax is the argmax of its logits too, for bf16 and Q8_0 panels."""
    ops = cpu_kernels.layer_ops()
    if ops is None or not ops.has_panel_linear() or not hasattr(ops, "panel_argmax"):
        pytest.skip("no panel kernel here")
    result = run_with_switch(
        tmp_path, "KVREPLAY_AMX_PANELS",
        "import torch\n"
        "from test_linear import _argmax_cases\n"
        "from test_quant_panels import _blocks\n"
        "from kvreplay.kernels import cpu_kernels\n"
        "ops = cpu_kernels.layer_ops()\n"
        "assert not ops.has_amx_panels()\n"
        "gen = torch.Generator().manual_seed(9)\n"
        "weight, bias, nan_bias = _argmax_cases(gen)\n"
        "panels = [ops.pack_panels(weight), ops.pack_quant_panels(torch.from_numpy(_blocks('Q8_0', 112, 64, seed=4)), 64, 'Q8_0')]\n"
        "for packed in panels:\n"
        "    for rows in (1, 9, 32, 100):\n"
        "        x = torch.randn(rows, 64, generator=gen).bfloat16()\n"
        "        for b in (bias, nan_bias, None):\n"
        "            logits = ops.panel_linear_float(x, packed, b)\n"
        "            assert torch.equal(ops.panel_argmax(x, packed, b), logits.argmax(-1)), rows\n"
        "print('vector argmax ok')\n")
    assert "vector argmax ok" in result.stdout


def test_silu_pair_order():
    """Each panel of 48 rows: gate rows, then the up rows of the same outputs; every row once."""
    assert silu_pair_order(12) is None and silu_pair_order(0) is None
    order = silu_pair_order(40).tolist()  # a panel of 24 + 24, then one of 16 + 16
    assert order[:48] == list(range(0, 24)) + list(range(40, 64))
    assert order[48:] == list(range(24, 40)) + list(range(64, 80))
    assert sorted(silu_pair_order(1536).tolist()) == list(range(3072))


# (F, K, rows): one panel and a narrow last one (F = 40), a single half-tile panel (8), rows in
# three blocks (33), the default model's shape (1536 x 576) at 1 and 32 rows
SILU_CASES = [(40, 64, 7), (8, 32, 3), (56, 96, 33), (1536, 576, 1), (1536, 576, 32)]


def _check_panel_silu(ops, gen, packs):
    """panel_silu_mul over pair-ordered panels = silu_mul of the [gate | up] product, bit for bit,
    for every (name, pack) in `packs` (pack: weight rows -> panels)."""
    for F_, K, rows in SILU_CASES:
        weight = (torch.randn(2 * F_, K, generator=gen) / K ** 0.5).bfloat16()
        bias = torch.randn(2 * F_, generator=gen).bfloat16()
        x = torch.randn(rows, K, generator=gen).bfloat16()
        order = silu_pair_order(F_)
        for name, pack in packs:
            for b in (None, bias):
                expected = ops.silu_mul(ops.panel_linear(x, pack(weight), b))
                got = ops.panel_silu_mul(x, pack(weight[order]), None if b is None else b[order])
                assert got.shape == (rows, F_) and torch.equal(got, expected), (name, F_, rows)


def test_panel_silu_mul_is_silu_of_the_product():
    proj = _panel_projection(torch.randn(96, 64).bfloat16())  # skips without the kernel
    ops = cpu_kernels.layer_ops()
    gen = torch.Generator().manual_seed(17)
    _check_panel_silu(ops, gen, [("bf16", ops.pack_panels)])
    assert proj.panels is not None
    with pytest.raises(RuntimeError, match="x must be bf16"):
        ops.panel_silu_mul(torch.randn(3, 64), ops.pack_panels(torch.randn(96, 64).bfloat16()), None)
    with pytest.raises(RuntimeError, match="bias must be bf16"):
        ops.panel_silu_mul(torch.randn(3, 64).bfloat16(), ops.pack_panels(torch.randn(96, 64).bfloat16()),
                           torch.randn(95).bfloat16())
    assert ops.panel_silu_mul(torch.zeros(0, 64).bfloat16(), ops.pack_panels(torch.randn(96, 64).bfloat16()),
                              None).shape == (0, 48)


def test_panel_silu_mul_on_quantized_blocks_and_the_vector_kernel(tmp_path):
    """Q4_1 blocks in pair order give the same SiLU as their [gate | up] product; with
    KVREPLAY_AMX_PANELS=0 (a subprocess) the vector kernel's too."""
    _panel_projection(torch.randn(96, 64).bfloat16())
    ops = cpu_kernels.layer_ops()
    from test_quant_panels import _blocks
    gen = torch.Generator().manual_seed(23)
    for F_, K, rows in ((40, 64, 7), (1536, 576, 32)):
        blocks = torch.from_numpy(_blocks("Q4_1", 2 * F_, K, seed=F_))
        order = silu_pair_order(F_)
        x = torch.randn(rows, K, generator=gen).bfloat16()
        expected = ops.silu_mul(ops.panel_linear(x, ops.pack_quant_panels(blocks, K, "Q4_1"), None))
        got = ops.panel_silu_mul(x, ops.pack_quant_panels(blocks[order], K, "Q4_1"), None)
        assert torch.equal(got, expected), (F_, rows)
    result = run_with_switch(
        tmp_path, "KVREPLAY_AMX_PANELS",
        "import torch\n"
        "from test_linear import _check_panel_silu\n"
        "from kvreplay.kernels import cpu_kernels\n"
        "ops = cpu_kernels.layer_ops()\n"
        "assert not ops.has_amx_panels()\n"
        "_check_panel_silu(ops, torch.Generator().manual_seed(5), [('bf16', ops.pack_panels)])\n"
        "print('vector silu ok')\n")
    assert "vector silu ok" in result.stdout


@pytest.mark.parametrize("rows", [1, 32, 200])
def test_projection_with_a_panel_order_answers_in_its_own_order(rows):
    """The panel copy in another row order (the MLP's pair order): calls still give the weight's
    own order, through the panel kernel and through oneDNN alike."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(96, 64, generator=gen).bfloat16()
    bias = torch.randn(96, generator=gen).bfloat16()
    plain = _panel_projection(weight, bias)
    ordered = Projection(weight, bias, panel_rows=PANEL_ROWS, panel_order=silu_pair_order(48))
    x = torch.randn(rows, 64, generator=gen).bfloat16()
    assert torch.equal(ordered(x), plain(x))
    assert torch.equal(ordered.float_output(x), plain.float_output(x))
    assert torch.equal(ordered.argmax(x), plain.argmax(x))
    assert torch.equal(ordered.panel_bias, bias[silu_pair_order(48)])
