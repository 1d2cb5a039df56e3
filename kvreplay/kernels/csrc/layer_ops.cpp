// Per-layer glue of the decoder as single CPU ops: at batch 1 a decode step is ~1,000 small
// PyTorch ops, and RMSNorm alone is eight of them. Each op here does in one pass what
// kvreplay/models/llama.py otherwise does in several, with the same arithmetic:
//
//   add_rms_norm(x, residual?, weight, eps) -> (normed, hidden)
//       hidden = x + residual (rounded to the dtype, as PyTorch's add), then RMSNorm of hidden:
//       fp32 mean of squares, x * rsqrt(mean + eps) rounded to the dtype, times weight.
//       Bit-identical to the PyTorch version except for the order of the sum of squares
//       (fp32; it moves the last bit of ~0.01% of bf16 outputs).
//   rope_write_cache(qkv, cos, sin, num_q, num_kv, kv_cache, slot_mapping)
//       In place: rotates the q and k heads of the fused projection output (rotate-half RoPE,
//       rounding after each product and after the sum, exactly as PyTorch does in the dtype),
//       then copies each token's k and v heads into the paged cache at its slot.
//   silu_mul(gate_up) -> silu(gate) * up, rounded after the silu and after the product.
//   pack_panels(weight) / panel_linear(x, packed, bias?)
//       y = x W^T (+ b) in bf16 for 1 to a few dozen rows of x (decode steps; the LM head of a
//       prefill). At one row the product is a pass over the weights, so its speed is how fast
//       they stream from memory; at 8-32 rows it is how many products a core does per cycle.
//       pack_panels lays W out once so that the kernel reads it strictly in order and every
//       weight load feeds up to 8 rows (layout: layer_ops.h). Products are exact, sums
//       fp32 (AVX512-BF16 pair dot products), one rounding to bf16 at the end. On a Zen 4 core
//       all matmuls of a decode step take 6-8 ms at batch 1 (oneDNN: ~13 ms), ~10 ms at batch 12
//       (oneDNN: ~15 ms) and ~23 ms at batch 32 (oneDNN: ~28 ms). On a CPU with AMX tiles
//       (K a multiple of 32) the same panels go through the tiles instead: ~10.5 ms from 2 to
//       16 rows, ~14.5 ms at 32 (oneDNN, on the same tiles: ~14.5 and ~17.5 ms). On an
//       AVX2-only CPU (no bf16 instructions: a Zen 3) each thread widens a slice of a panel to
//       fp32 at a time and runs fp32 FMAs (panel_avx2.cpp): the same sums, within one rounding.
//   pack_quant_panels(blocks, K, format, integer=False, x_bits=16) / expand_quant_panels(packed)
//       The panel copy of a GGUF tensor kept as its Q4_0 / Q4_1 / Q8_0 blocks (a third or half
//       of the bf16 panels' bytes); panel_linear and decode_layer take it like a bf16 panel and
//       expand it as they go, to the same bf16 weights (layout: layer_ops.h).
//       expand_quant_panels gives the bf16 panels it stands for (tests, benches). With integer
//       (AVX2 builds, has_int_products()): records that the products read as integers, with x
//       as 16-bit integers per 32-k block: the file's own weights, not their bf16 rounding
//       (int_panel, int_products.cpp); with x_bits=8 (Q4 blocks), x rounded to 8 bits per block, lossy
//       (int_panel with Int8Form).
//   panel_linear_float(x, packed, bias?)
//       The same products and roundings, each output rounded to bf16 as above and stored widened
//       to fp32: what `panel_linear(...).float()` gives, without a second pass (the LM head).
//   panel_argmax(x, packed, bias?) -> for each row, argmax_rows(panel_linear_float(...)) without
//       storing the outputs: the LM head of a greedy step (its 32 x 49,152 fp32 logits written
//       and read again cost ~0.3 ms a batch-32 step here).
//   panel_silu_mul(x, packed, bias?) -> silu(gate) * up of the gate/up product, for a weight
//       packed with its rows in pair order (each panel: some gate rows, then their up rows), each
//       panel combined in L1 as it is done: the [M, 2F] gate/up outputs are never stored, and
//       the SiLU needs no pass of its own (its rows split by row between the threads, half of
//       them in the other core's cache).
//   decode_layer(delta, residual?, norms, eps, panels and biases, cos, sin, heads, kv_cache, slots,
//                tables, lengths, scale, want_mass) -> (delta, residual, mass)
//       A whole decoder layer of a decode-only step: the ops above and the decode attention
//       kernel in the order kvreplay/models/llama.py calls them (same bits), one call a layer.
//       gate_up (and its bias) in pair order: the MLP is panel_silu_mul, then down.
//   decode_layers(delta, residual?, weights[], biases[], eps, cos, sin, heads, kv_caches[], ...)
//       -> (delta, residual, masses[])
//       decode_layer over a stack of layers in one call, the layers sharing one set of buffers.
//   argmax_rows(x) -> for each row of a 2-D fp32 tensor, the index of its largest value, the
//       first one on ties, a NaN's when the row has one: torch.argmax's answer. At 32 rows of
//       49,152 logits torch.argmax takes ~0.7 ms here, most of it outside the memory reads.
//   apply_token_bitmask(logits, bitmask) -> (), in place: -inf at each token whose bit is 0 in
//       its row of a packed int32 mask (bit j of word w is token 32 w + j): structured output.
//
//
// Sources (built together as one extension; shared declarations in layer_ops.h, vector helpers
// in simd.h): layer_glue.cpp (add_rms_norm, rope_write_cache, silu_mul), panels.cpp (pack_panels,
// panel_linear, panel_linear_float, panel_argmax, panel_silu_mul), panel_avx512.cpp (the panel
// kernels on AVX512-BF16 and AMX tiles), panel_avx2.cpp (on AVX2), quant_blocks.cpp
// (pack_quant_panels, expand_quant_panels), int_products.cpp (the integer products), argmax.cpp
// (argmax_rows, apply_token_bitmask), decode_layers.cpp (decode_layer, decode_layers); this file registers the ops.
//
// Built without -ffast-math and with -ffp-contract=off so that every rounding above happens
// where it is written. Built on first use by kvreplay/kernels/cpu_kernels.py.
#include "layer_ops.h"

namespace kvreplay_layer_ops {
namespace {

// Whether panel_linear runs rows on AMX tiles here (built for them and allowed by the kernel).
bool has_amx_panels() {
#if defined(KVREPLAY_AMX)
  return amx_permitted();
#else
  return false;
#endif
}

bool has_int_products() { return kIntProducts; }

bool has_panel_linear() {
#if defined(__AVX512BF16__) || defined(KVREPLAY_AVX2)
  return true;
#else
  return false;
#endif
}

}  // namespace
}  // namespace kvreplay_layer_ops

using namespace kvreplay_layer_ops;

TORCH_LIBRARY(kvreplay_layer, m) {
  m.def("silu_mul(Tensor gate_up) -> Tensor");
  m.impl("silu_mul", c10::DispatchKey::CPU, &silu_mul);
  m.def("pack_panels(Tensor weight) -> Tensor");
  m.def("panel_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("panel_linear_float(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("has_panel_linear() -> bool", &has_panel_linear);
  m.def("has_amx_panels() -> bool", &has_amx_panels);
  m.def("has_int_products() -> bool", &has_int_products);
  m.impl("pack_panels", c10::DispatchKey::CPU, &pack_panels);
  m.def("pack_quant_panels(Tensor blocks, int K, str format, bool integer=False, int x_bits=16) -> Tensor");
  m.impl("pack_quant_panels", c10::DispatchKey::CPU, &pack_quant_panels);
  m.def("expand_quant_panels(Tensor packed) -> Tensor");
  m.impl("expand_quant_panels", c10::DispatchKey::CPU, &expand_quant_panels);
  m.impl("panel_linear", c10::DispatchKey::CPU, &panel_linear);
  m.impl("panel_linear_float", c10::DispatchKey::CPU, &panel_linear_float);
  m.def("panel_argmax(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.def("panel_silu_mul(Tensor x, Tensor packed, Tensor? bias) -> Tensor");
  m.impl("panel_silu_mul", c10::DispatchKey::CPU, &panel_silu_mul);
  m.impl("panel_argmax", c10::DispatchKey::CPU, &panel_argmax);
  m.def("argmax_rows(Tensor x) -> Tensor");
  m.impl("argmax_rows", c10::DispatchKey::CPU, &argmax_rows);
  m.def("apply_token_bitmask(Tensor(a!) logits, Tensor bitmask) -> ()");
  m.impl("apply_token_bitmask", c10::DispatchKey::CPU, &apply_token_bitmask);

  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_write_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_q, int num_kv, "
        "Tensor(b!) kv_cache, Tensor slot_mapping) -> ()");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("rope_write_cache", c10::DispatchKey::CPU, &rope_write_cache);
  m.def("decode_layer(Tensor delta, Tensor? residual, Tensor input_norm, Tensor post_norm, float eps, "
        "Tensor qkv, Tensor? qkv_bias, Tensor o, Tensor? o_bias, Tensor gate_up, Tensor? gate_up_bias, "
        "Tensor down, Tensor? down_bias, Tensor cos, Tensor sin, int num_q, int num_kv, Tensor(a!) kv_cache, "
        "Tensor slot_mapping, Tensor block_tables, Tensor context_lens, float scale, bool want_mass=False) "
        "-> (Tensor, Tensor, Tensor)");
  m.impl("decode_layer", c10::DispatchKey::CPU, &decode_layer);
  m.def("decode_layers(Tensor delta, Tensor? residual, Tensor[] weights, Tensor?[] biases, float eps, "
        "Tensor cos, Tensor sin, int num_q, int num_kv, Tensor(a!)[] kv_caches, Tensor slot_mapping, "
        "Tensor block_tables, Tensor context_lens, float scale, bool want_mass=False) "
        "-> (Tensor, Tensor, Tensor[])");
  m.impl("decode_layers", c10::DispatchKey::CPU, &decode_layers);
}
