// Shared by the sources of the layer-ops extension (torch.ops.kvreplay_layer; layer_ops.cpp lists
// its ops and the file each lives in): the includes, the instruction-set switches, the panel and
// quantized-record layouts that several kernels read, the small helpers they share (inline here,
// so that they still inline into the hot loops), and the functions one source calls in another.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <climits>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <type_traits>
#include <vector>
#include "simd.h"

namespace kvreplay_layer_ops {

template <typename T> inline float f32(T v) { return static_cast<float>(v); }
template <typename T> inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

// The AVX2 kernels (panel_avx2.cpp, int_products.cpp: bf16 widened to fp32, FMAs) serve where the AVX512-BF16 ones cannot:
// an AVX2-only CPU, or AVX-512 without BF16 (Skylake to Ice Lake).
#if !defined(__AVX512BF16__) && defined(KVREPLAY_HAVE_AVX2)
#define KVREPLAY_AVX2 1
#endif

// ---- panel_linear: y = x W^T (+ b) for up to a few dozen rows ----
// pack_panels lays W out once in panels of kPanelTiles x 16 output rows; inside a panel, for each
// pair of input columns (k, k+1), the 16 x kPanelTiles outputs' two weights side by side:
//   panel p, pair j, output o, e in {0, 1}  ->  W[p * 48 + o, 2j + e]
// (a last, narrower panel when N / 16 is not a multiple of kPanelTiles). One 64-byte load then
// holds two weights of 16 outputs, and one AVX512-BF16 pair dot product against a broadcast
// (x[m, 2j], x[m, 2j + 1]) adds both products to 16 fp32 sums at once. A block of up to kRowBlock
// rows of x shares every weight load, so the panel is read from memory once for the first block
// and from cache for the next: at one row the pass streams the weights in order (memory-bound),
// at 8-32 rows each load feeds 8 x kPanelTiles products (compute-bound).
// Every output is one fp32 sum over k in order (exact products), plus the bias, rounded once to
// bf16: it does not depend on the other rows, the blocking or the thread count.
constexpr int64_t kLanes = 16, kPanelTiles = 3, kRowBlock = 8;

// ---- quantized panels: a GGUF file's own Q4_0 / Q4_1 / Q8_0 weights, expanded to bf16 per use ----
// The bf16 weights the panels above hold are, for a GGUF model, bf16(dequantize(file blocks)):
// Q4_1: d * q + m (fp32, rounded after the product and after the sum, as gguf-py computes it),
// Q4_0: d * (q - 8), Q8_0: q * d, each then rounded to bf16 (nearest-even). pack_quant_panels
// keeps the blocks instead (5 bits a weight for Q4_x, 8.5 for Q8_0, against 16), re-laid so that
// one 16-output tile of one 32-k block is one record:
//   Q4_0 / Q4_1 (320 bytes): 16 rows (pairs j) x 16 bytes, then d[16], m[16] (fp16, per output;
//                            Q4_0: m = -8 d)
//   Q8_0 (544 bytes): 16 rows x 32 bytes (int8), then d[16]
// Row j of a record is one 64-byte row of the bf16 tile: lanes 0-15 are outputs 0-7 (k = 2j,
// 2j + 1 each), lanes 16-31 outputs 8-15; a Q4 byte holds lane i in its low nibble and lane
// 16 + i in its high one, a Q8_0 row lanes 0-31 in order. A panel's records go block by block,
// tile by tile (the bf16 panel's order). On AMX tiles panel_product expands one block of a
// panel at a time into an L1 buffer just before its tiles load (amx_panel); the vector kernel
// expands a whole panel into a per-thread buffer (48 x K bf16, cache-resident). Same arithmetic,
// so the same bits as the bf16 panels, with a third (Q4) or half (Q8_0) of the bytes to read.
constexpr int64_t kQuantBlock = 32, kQ4_1Record = 320, kQ8_0Record = 544;
constexpr int64_t kPrefetchBlocks = 4;
// The same blocks for integer products (pack_quant_panels(..., integer=true), AVX2 builds only):
// each record's weight bytes as above, its scales widened to fp32 (Q4: d[16] then m[16]; Q8_0:
// d[16]). The kernel multiplies the blocks' integers by 16-bit integers of x (int_panel, int_products.cpp),
// so the weights are the file's exactly (d * q + m in real numbers), not their bf16 rounding.
constexpr int64_t kQ4IntRecord = 384, kQ8IntRecord = 576;
inline bool is_int_record(int64_t record) { return record == kQ4IntRecord || record == kQ8IntRecord; }
#if defined(KVREPLAY_AVX2)
constexpr bool kIntProducts = true;
#else
constexpr bool kIntProducts = false;
#endif

#if defined(__AVX512BF16__)
// One record's 16 rows of 32 bf16 into dst, row j at dst + j * stride. Q4_1: d * q + m by one
// FMA, which is the same number as the product rounded and then the sum (d has 11 significant
// bits and q 4, so d * q is exact in fp32); q's value comes from a 16-entry table indexed by
// the nibble (vpermps reads an index's low 4 bits). Q8_0: q * d, exact in fp32 too.
inline void expand_record(const uint8_t* rec, bool q4, uint16_t* dst, int64_t stride) {
  const __m512i lo_pairs = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i hi_pairs = _mm512_add_epi32(lo_pairs, _mm512_set1_epi32(8));
  const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + (q4 ? 256 : 512))));
  const __m512 da = _mm512_permutexvar_ps(lo_pairs, d), db = _mm512_permutexvar_ps(hi_pairs, d);
  if (q4) {
    const __m512 values = _mm512_set_ps(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(rec + 288)));
    const __m512 ma = _mm512_permutexvar_ps(lo_pairs, m), mb = _mm512_permutexvar_ps(hi_pairs, m);
    for (int64_t j = 0; j < 16; ++j) {
      const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + j * 16)));
      const __m512 a = _mm512_fmadd_ps(da, _mm512_permutexvar_ps(raw, values), ma);
      const __m512 b = _mm512_fmadd_ps(db, _mm512_permutexvar_ps(_mm512_srli_epi32(raw, 4), values), mb);
      _mm512_storeu_si512(dst + j * stride, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  } else {
    for (int64_t j = 0; j < 16; ++j) {
      const __m128i* row = reinterpret_cast<const __m128i*>(rec + j * 32);
      const __m512 a = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row))), da);
      const __m512 b = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(row + 1))), db);
      _mm512_storeu_si512(dst + j * stride, (__m512i)_mm512_cvtne2ps_pbh(b, a));
    }
  }
}
#endif

#if defined(KVREPLAY_AVX2)
// the AVX2 kernels' shared pieces (panel_avx2.cpp, int_products.cpp; panels.cpp widens x)
constexpr int64_t kWide = kPanelTiles * kLanes;  // floats a k-row of the widened slice

using kvreplay_simd::round_bf16x8;
using kvreplay_simd::store_rounded8;
using kvreplay_simd::widen8;

// The running sums of a panel's `cols` outputs (row m at sums + m * kWide) plus the bias,
// rounded once to bf16, into out (row stride ld): the end of every AVX2 panel kernel.
template <typename OutT>
void store_sums(const float* sums, const uint16_t* bias, OutT* out, int64_t M, int64_t ld, int64_t cols) {
  // row by row: a row's outputs are neighbours in `out` (column by column, every store went to
  // another row's cache line, and the stores waited on them)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < cols; c += 8) {
      const __m256 b = bias ? widen8(bias + c) : _mm256_setzero_ps();
      store_rounded8(out + m * ld + c, _mm256_add_ps(_mm256_loadu_ps(sums + m * kWide + c), b));
    }
}

constexpr int64_t kIntPairs = kQuantBlock / 2;  // pairs (k, k + 1) a block
constexpr int64_t kQuads = kQuantBlock / 4;  // 4 k's a byte group


// The two forms of integer products for int_rows / int_panel: the type of x's integers and of the
// widened weights, the most rows a block kernel takes, the widened block's size, and its widening
// and block kernels (defined in int_products.cpp).
struct Int16Form {  // 16-bit x (int_block)
  using X = int16_t;
  using W = int16_t;
  static constexpr int kMaxRows = 4;
  static constexpr int64_t kBuffer = kIntPairs * kWide * 2, kBytesAnOutput = 2;  // (a k pair: 2 int16)
  static void widen(const uint8_t* q, int64_t record, int64_t width, int64_t kb, W* buf, float* d, float* mn);
  template <int MB, int C, typename... Args> static void block(Args... args);
};
struct Int8Form {  // 8-bit x, Q4 records only (int8_block)
  using X = int8_t;
  using W = uint8_t;
  static constexpr int kMaxRows = 3;
  static constexpr int64_t kBuffer = kQuads * kWide * 4, kBytesAnOutput = 4;  // (a k quad: 4 bytes)
  static void widen(const uint8_t* q, int64_t, int64_t width, int64_t kb, W* buf, float* d, float* mn);
  template <int MB, int C, typename... Args> static void block(Args... args);
};
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define KVREPLAY_AMX 1
using kvreplay_amx::TileConfig;
#endif

// ---- what one source calls in another (each defined in the file named) ----
// layer_glue.cpp
void add_rms_norm_into(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                       at::Tensor& out, at::Tensor& hidden);
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps);
void rope_write_cache(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_q,
                      int64_t num_kv, at::Tensor& kv_cache, const at::Tensor& slot_mapping);
at::Tensor silu_mul(const at::Tensor& gate_up);
#if defined(__AVX512BF16__) || defined(KVREPLAY_AVX2)
void silu_panel(const uint16_t* stage, int64_t M, int64_t width, uint16_t* out, int64_t F, int64_t col0);
#endif

// panels.cpp
at::Tensor pack_panels(const at::Tensor& weight);
std::pair<int64_t, int64_t> panel_shape(const at::Tensor& packed, const char* name);
at::Tensor panel_product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         bool widen, const char* name, at::Tensor out = at::Tensor(), int64_t* argmax = nullptr,
                         bool silu = false);
at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor panel_linear_float(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor panel_argmax(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);
at::Tensor panel_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias);

// quant_blocks.cpp
at::Tensor pack_quant_panels(const at::Tensor& blocks, int64_t K, const std::string& format, bool integer,
                             int64_t x_bits);
at::Tensor expand_quant_panels(const at::Tensor& packed);
#if defined(__AVX512BF16__)
void expand_quant_panel(const uint8_t* q, int64_t record, int64_t width, int64_t K, uint16_t* out);
#endif

// panel_avx512.cpp (instantiated there for T = 1, 2, kPanelTiles and OutT = uint16_t, float)
#if defined(__AVX512BF16__)
template <int T, typename OutT>
void panel_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, OutT* out, int64_t M,
                int64_t N, int64_t K);
#endif
#if defined(KVREPLAY_AMX)
bool amx_permitted();
template <int T, typename OutT>
void amx_rows(const uint16_t* x, const uint16_t* tail, int64_t r, int64_t M, const uint16_t* w, const uint8_t* q,
              int64_t record, const uint16_t* bias, OutT* out, int64_t N, int64_t K);
#endif

#if defined(KVREPLAY_AVX2)
// panel_avx2.cpp (OutT = uint16_t, float)
template <typename OutT>
void avx2_panel(const float* x, const uint16_t* w, const uint8_t* q, int64_t record, int64_t width,
                const uint16_t* bias, OutT* out, int64_t M, int64_t ld, int64_t K);

// int_products.cpp (Form = Int16Form, Int8Form; OutT = uint16_t, float)
void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int16_t* v, float* scale, float* sum);
void quantize_rows8(const uint16_t* x, int64_t M, int64_t K, int8_t* v, float* scale, float* sum);
template <typename Form, typename OutT>
void int_panel(const typename Form::X* v, const float* scale, const float* sum, const uint8_t* q, int64_t record,
               int64_t width, const uint16_t* bias, OutT* out, int64_t M, int64_t ld, int64_t K);
#endif

// argmax.cpp
at::Tensor argmax_rows(const at::Tensor& x);
void apply_token_bitmask(at::Tensor& logits, const at::Tensor& bitmask);

// decode_layers.cpp
std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& delta, const c10::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias,
    const at::Tensor& o, const c10::optional<at::Tensor>& o_bias, const at::Tensor& gate_up,
    const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
    const c10::optional<at::Tensor>& down_bias, const at::Tensor& cos, const at::Tensor& sin, int64_t num_q,
    int64_t num_kv, at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, double scale, bool want_mass);
std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> decode_layers(
    const at::Tensor& delta, const c10::optional<at::Tensor>& residual, at::TensorList weights,
    const c10::List<c10::optional<at::Tensor>>& biases, double eps, const at::Tensor& cos, const at::Tensor& sin,
    int64_t num_q, int64_t num_kv, at::TensorList kv_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, bool want_mass);

}  // namespace kvreplay_layer_ops
