"""Weight projections (`y = x W^T + b`) in the fastest form the device offers.

On CPU in bf16 a weight can be kept in up to two layouts, each for the row counts where it wins:
- oneDNN's blocked layout, packed once at load (a plain `F.linear` re-lays the matrix on every
  call), bit-identical to `F.linear`: above `machine_panel_rows()` rows (prefill chunks), padded
  with zero rows to one of a few sizes (`onednn_rows`).
- a panel copy for the compiled `panel_linear` op: up to `machine_panel_rows()` rows (decode
  steps; every row count on an AVX2-only CPU). It reads the weights strictly in order, so a
  decode step runs at the speed weights stream from memory; fp32 sums like oneDNN's, in another
  order (within one bf16 rounding step), and a row's result never depends on the other rows.
  The cost is a second copy of the weights.
A GGUF weight stored as Q4_0, Q4_1 or Q8_0 blocks keeps those blocks in its panel copy where that
pays (`quant_panels_enabled`): the kernel expands them to the same bf16 weights as it goes, a
third of the bytes to read. Where the kernel is its AVX2 build, the blocks serve integer
products instead (`int_products_bits`: x at 8 bits by default, or 16).
Where oneDNN takes no bf16 products (`onednn_bf16_products`) a bf16 weight outside the panel
kernel's rows keeps an fp32 copy for PyTorch's fp32 matmul, rounded to bf16 (the same arithmetic
as a bf16 product). Everything else (fp32, CUDA, no compiler) uses `F.linear` on the plain weight.
How the kernels work: docs/kernels.md; measured figures: docs/benchmarks.md.
"""
from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvreplay.kernels import huge_pages
from kvreplay.kernels import cpu_kernels
from kvreplay.kernels.switches import choice, integer, is_set, switch

log = logging.getLogger(__name__)

# oneDNN chooses its blocked layout for a typical row count; any row count works with it.
PACK_BATCH_HINT = 32
# oneDNN keeps native memory for each row count it has multiplied, and a new row count costs new
# primitives: a server's prefill steps come in any row count, and its resident memory grew with
# each new one (docs/benchmarks.md, the server soak; SmolLM2-135M's 4 projections at each of 129
# to 512 rows: +476 MiB, +294 MiB with oneDNN's primitive cache off). So oneDNN sees rows padded
# up to one of this many sizes an octave (1/8 more rows at most): 16 sizes from 129 to 512 rows.
ONEDNN_SIZES_PER_OCTAVE = 8
# Up to this many rows go to the panel kernel (above it oneDNN's blocking wins), on a CPU whose
# bf16 products run on the vector units...
PANEL_ROWS = 128
# ...on one with AMX tiles, where the panel kernel runs on them too (layer_ops has_amx_panels)...
PANEL_ROWS_AMX = 64
# ...and where oneDNN has the tiles but the panel kernel does not (an older compiler).
PANEL_ROWS_AMX_ONEDNN_ONLY = 2
# ...and where oneDNN takes no bf16 products (an AVX2-only CPU), every row count: there the panel
# kernel beats PyTorch's fp32 matmul of the widened weights at any row count measured
# (docs/benchmarks.md), and a row's result then never depends on how many rows came with it.
PANEL_ROWS_ANY = sys.maxsize


# GGUF block formats the panel kernel reads as they are (csrc/quant_blocks.cpp pack_quant_panels)
QUANT_FORMATS = ("Q4_0", "Q4_1", "Q8_0")
# Outputs in one panel of the panel kernel (csrc/layer_ops.h: kPanelTiles x 16)
PANEL_OUTPUTS = 48


def onednn_rows(rows: int) -> int:
    """The row count oneDNN computes `rows` rows as: rounded up to a multiple of 1/8 of the
    power of two at or below it (rows itself below 16). The padded rows' outputs are dropped;
    the others' are the same bits (tests/test_onednn_rows.py checks F.linear's)."""
    step = max(1, (1 << (rows.bit_length() - 1)) // ONEDNN_SIZES_PER_OCTAVE)
    return -(-rows // step) * step


def silu_pair_order(width: int) -> torch.Tensor | None:
    """The row order of a fused [gate | up] weight (2 x `width` rows) that `panel_silu_mul` takes:
    each panel of PANEL_OUTPUTS rows holds some gate rows and then the up rows of the same
    outputs (24 and 24; the last panel fewer), so that a panel's outputs give their SiLU x up
    without the other panels. None when `width` is not a multiple of 8 (a panel's halves are
    whole half-tiles)."""
    if width <= 0 or width % 8:
        return None
    half = PANEL_OUTPUTS // 2
    order = []
    for start in range(0, width, half):
        count = min(half, width - start)
        order += list(range(start, start + count)) + list(range(width + start, width + start + count))
    return torch.tensor(order, dtype=torch.long)


@dataclass
class QuantizedWeight:
    """A weight as a GGUF file stores it: `blocks` [N, K / 32 * block bytes] uint8, one row per
    output, in `format` (one of QUANT_FORMATS)."""
    format: str
    blocks: torch.Tensor

    @staticmethod
    def concat(parts: list[QuantizedWeight | None]) -> QuantizedWeight | None:
        """The row-wise concatenation (a fused projection's), or None unless every part is
        quantized in one format."""
        if not parts or any(p is None for p in parts) or len({p.format for p in parts}) != 1:
            return None
        if len(parts) == 1:
            return parts[0]
        return QuantizedWeight(parts[0].format, torch.cat([p.blocks for p in parts]))


def quant_panels_enabled() -> bool:
    """Whether GGUF block weights keep their blocks in the panel copy: KVREPLAY_QUANT_PANELS=1
    yes, 0 no (bf16 panels like any other weight). Unset: yes where the CPU has AVX512-BF16 (or
    is unknown); no without it, where widening blocks to fp32 per use costs more than reading
    the bf16 weight (docs/kernels.md)."""
    if not is_set("KVREPLAY_QUANT_PANELS") and cpu_kernels.cpu_flags():
        return cpu_kernels.has_avx512_bf16()
    return switch("KVREPLAY_QUANT_PANELS")


def int_products_bits(available: bool = True) -> int:
    """The width x goes into integer products at, 0 for none: KVREPLAY_INT_PRODUCTS=8: 8 bits
    for Q4_0 / Q4_1 blocks (x rounded to 1/127 of its 32-k block's largest, as llama.cpp does;
    lossy; Q8_0 blocks keep 16 bits); 1 (or 16): 16 bits (the file's own weights times x, nearly
    always exact); 0: none. Unset: 8 where the kernel has them (`available`: its AVX2 build),
    the fastest form there, unless KVREPLAY_QUANT_PANELS asks for a form of its own. Accuracy
    and speed of each width: docs/kernels.md."""
    bits = choice("KVREPLAY_INT_PRODUCTS", {"0": 0, "1": 16, "16": 16, "8": 8})
    if bits is None:
        return 8 if available and not is_set("KVREPLAY_QUANT_PANELS") else 0
    return bits


@functools.cache
def _warn_no_int_products() -> None:
    log.warning("KVREPLAY_INT_PRODUCTS asks for integer products, but this build's panel kernel expands GGUF "
                "blocks to bf16 (integer products run on its AVX2 kernel only): the blocks are read as bf16")


def machine_panel_rows() -> int:
    """Most rows a bf16 projection hands to the panel kernel on this machine (every count where
    oneDNN takes no bf16 products); KVREPLAY_PANEL_ROWS (0-128) overrides it."""
    rows = integer("KVREPLAY_PANEL_ROWS", 0, PANEL_ROWS)
    if rows is not None:
        return rows
    if not onednn_bf16_products():
        return PANEL_ROWS_ANY
    if not cpu_kernels.has_amx_bf16():
        return PANEL_ROWS
    ops = cpu_kernels.layer_ops()
    amx_panels = ops is not None and ops.has_panel_linear() and ops.has_amx_panels()
    return PANEL_ROWS_AMX if amx_panels else PANEL_ROWS_AMX_ONEDNN_ONLY


@functools.cache
def onednn_bf16_products() -> bool:
    """Whether oneDNN takes bf16 products on this CPU. It needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT: on an AVX2-only CPU (a Zen 3, say) its weight reorder refuses bf16, and
    PyTorch's own bf16 matmul there is far slower than its fp32 one. Tried once on a tiny weight."""
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
            and hasattr(torch.ops.mkldnn, "_linear_pointwise")):
        return False
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(torch.ones(16, 32, dtype=torch.bfloat16), 1)
        y = torch.ops.mkldnn._linear_pointwise(torch.ones(1, 32, dtype=torch.bfloat16), packed, None,
                                               "none", [], "")
        return bool((y == 32).all())
    except RuntimeError as exc:
        log.info("oneDNN takes no bf16 products on this CPU (%s): bf16 projections run in fp32",
                 str(exc).splitlines()[0])
        return False


def _cpu_bf16_matrix(weight: torch.Tensor) -> bool:
    return weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2


def can_pack(weight: torch.Tensor) -> bool:
    return _cpu_bf16_matrix(weight) and onednn_bf16_products()


def widens(weight: torch.Tensor) -> bool:
    """Whether a bf16 projection of `weight` runs as an fp32 product (rounded back to bf16): on a
    CPU where oneDNN takes no bf16 products. Same arithmetic as a bf16 product (exact products,
    fp32 sums, one rounding), at the fp32 matmul's speed."""
    return _cpu_bf16_matrix(weight) and not onednn_bf16_products()


def _panel_ops(weight: torch.Tensor):
    """The layer ops when the panel kernel can take this weight, else None."""
    if not (_cpu_bf16_matrix(weight) and weight.shape[0] % 16 == 0 and weight.shape[1] % 2 == 0):
        return None
    ops = cpu_kernels.layer_ops()
    return ops if ops is not None and ops.has_panel_linear() else None


def onto_huge_pages(projections: list) -> int:
    """Move the panel copies of `projections` (CPU) into one buffer on 2 MiB pages where Linux
    gives them (kvreplay/huge_pages.py): a decode step streams all of them, most smaller than
    one such page. Same tensors (shape, dtype, bytes), 64-byte aligned views of the buffer.
    Returns the buffer's bytes (0: nothing moved)."""
    owners = [p for p in projections if p.panels is not None and p.panels.device.type == "cpu"]
    sizes = [-(-p.panels.nbytes // 64) * 64 for p in owners]
    if not owners:
        return 0
    arena = huge_pages.empty(sum(sizes), dtype=torch.uint8)
    offset = 0
    for owner, size in zip(owners, sizes):
        panels = owner.panels
        view = arena[offset:offset + panels.nbytes].view(panels.dtype).view(panels.shape)
        view.copy_(panels)
        owner.panels = view
        offset += size
    return offset


class Projection:
    """One linear layer's weight (and bias), packed for oneDNN and the panel kernel where that
    pays."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, pack: bool = True,
                 panel_rows: int | None = None, quantized: QuantizedWeight | None = None,
                 panel_order: torch.Tensor | None = None):
        """`panel_rows`: most rows for the panel kernel (default: `machine_panel_rows()`).
        `quantized`: the file's blocks that `weight` was dequantized from, for the panel copy.
        `panel_order`: the panel copy holds the weight's rows (and `panel_bias` the bias) in this
        order, for the compiled ops that read it so (`silu_pair_order`); calls of this object
        still answer in the weight's own order."""
        self.bias = bias
        self.packed = pack and can_pack(weight)
        ops = _panel_ops(weight) if pack else None
        self.panel_rows = 0 if ops is None else machine_panel_rows() if panel_rows is None \
            else min(panel_rows, PANEL_ROWS)
        if self.panel_rows == 0:
            ops = None  # no row count goes to it: skip the panel copy of the weight
        self.panel_linear = None if ops is None else ops.panel_linear
        self.panel_linear_float = None if ops is None else ops.panel_linear_float
        self.panel_argmax = None if ops is None else getattr(ops, "panel_argmax", None)
        # the blocks, where given and the kernel reads their format ("Q4_1"; "Q4_1/int" for
        # integer products, "Q4_1/int8" with 8-bit x); else bf16
        self.panel_format = "bf16"
        self.panels = None
        self.panel_bias = bias
        self.panel_order = self.output_order = None  # output_order: panel outputs -> the weight's
        if ops is not None:
            if panel_order is not None:
                self.panel_order = panel_order
                self.output_order = torch.argsort(panel_order)
                weight = weight[panel_order]
                quantized = None if quantized is None else QuantizedWeight(quantized.format,
                                                                           quantized.blocks[panel_order])
                self.panel_bias = None if bias is None else bias[panel_order].contiguous()
            available = ops.has_int_products()
            bits = int_products_bits(available)
            integer = quantized is not None and quantized.format in QUANT_FORMATS and bits > 0
            if integer and not available:
                _warn_no_int_products()
                integer = False
            if quantized is not None and quantized.format in QUANT_FORMATS and (integer or quant_panels_enabled()):
                try:
                    x_bits = 8 if integer and bits == 8 and quantized.format != "Q8_0" else 16
                    self.panels = ops.pack_quant_panels(quantized.blocks, weight.shape[1], quantized.format, integer,
                                                        x_bits)
                    self.panel_format = quantized.format + ("" if not integer else "/int8" if x_bits == 8 else "/int")
                except RuntimeError as exc:  # a Q4_0 scale past fp16's reach: the bf16 copy serves
                    log.warning("%s blocks kept as bf16 panels: %s", quantized.format, str(exc).splitlines()[0])
            if self.panels is None:
                self.panels = ops.pack_panels(weight)
        if self.output_order is not None:
            weight = weight[self.output_order]  # back in its own order for oneDNN
        # where oneDNN takes no bf16 products: an fp32 copy for PyTorch's fp32 matmul instead,
        # unless the panel kernel takes every row count
        self.widened = pack and widens(weight) and self.panel_rows < PANEL_ROWS_ANY
        if self.widened:
            weight = weight.float()
            self.bias = None if bias is None else bias.float()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_BATCH_HINT) \
            if self.packed else weight

    def on_panels(self, x: torch.Tensor) -> bool:
        """Whether input `x` goes to the panel kernel: a 2-D bf16 batch of at most `panel_rows`
        rows, where a panel copy exists."""
        return self.panel_linear is not None and x.dtype == torch.bfloat16 and x.dim() == 2 \
            and x.shape[0] <= self.panel_rows

    def _in_order(self, y: torch.Tensor) -> torch.Tensor:
        """Panel outputs in the weight's own row order."""
        return y if self.output_order is None else y[:, self.output_order]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.on_panels(x):
            return self._in_order(self.panel_linear(x, self.panels, self.panel_bias))
        if self.packed and x.dtype == torch.bfloat16 and x.dim() == 2:
            rows = x.shape[0]
            padded = onednn_rows(rows)
            if padded != rows:
                return torch.ops.mkldnn._linear_pointwise(F.pad(x, (0, 0, 0, padded - rows)), self.weight,
                                                          self.bias, "none", [], "")[:rows]
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        if self.packed:
            raise ValueError(f"packed bf16 projection got a {x.dtype} input of shape {tuple(x.shape)}")
        if self.widened:
            if x.dtype != torch.bfloat16:
                raise ValueError(f"bf16 projection got a {x.dtype} input of shape {tuple(x.shape)}")
            return F.linear(x.float(), self.weight, self.bias).to(torch.bfloat16)
        return F.linear(x, self.weight, self.bias)

    def float_output(self, x: torch.Tensor) -> torch.Tensor:
        """`self(x).float()` (the LM head's logits); the panel kernel widens as it stores
        instead of a second pass."""
        if self.on_panels(x):
            return self._in_order(self.panel_linear_float(x, self.panels, self.panel_bias))
        return self(x).float()

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """`self.float_output(x).argmax(-1)` (the first index on ties, a NaN's if any): the LM
        head of a greedy step. The panel kernel keeps each row's running maximum instead of
        storing the logits and reading them again."""
        if self.panel_argmax is not None and self.output_order is None and self.on_panels(x):
            return self.panel_argmax(x, self.panels, self.panel_bias)
        return self.float_output(x).argmax(dim=-1)
