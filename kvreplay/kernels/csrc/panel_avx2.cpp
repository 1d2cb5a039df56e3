// The panel products on AVX2 (bf16 or quantized records widened to fp32, FMAs): the kernel that
// panel_product (panels.cpp) runs over a panel where no bf16 instructions exist. Layouts: layer_ops.h.
#include "layer_ops.h"

namespace kvreplay_layer_ops {
#if defined(KVREPLAY_AVX2)
// ---- the same products on AVX2 (CPUs without bf16 instructions: a Zen 3, a Skylake-X) ----
// Each thread takes a panel kAvx2Chunk input columns (k) at a time: it widens that slice of the
// panel to fp32, k-major ([kc][48] floats, 12 KB: L1), from the bf16 pairs or the quantized
// records with the arithmetic of layer_ops.h, then runs every block of up to 4 rows of x (widened once
// per call) over it, 12 fp32 FMA accumulators for 4 rows x 24 outputs, one weight load feeding
// 4 rows; the running sums wait in an [M][48] fp32 array between slices. bf16 x bf16 products
// are exact in fp32 and an FMA rounds once, so every output is one fp32 sum over k in order,
// plus the bias, rounded once to bf16, as on the AVX-512 kernel (whose pair dot products add
// each pair's odd product first: results agree within that one rounding).
// (kWide, the floats a k-row of the widened slice: layer_ops.h)
constexpr int64_t kAvx2Chunk = 64;               // k a slice (a multiple of the 32-k blocks)

namespace {

// Input columns [k0, k0 + kc) of a panel of `width` tiles into buf ([kc][kWide] fp32), from
// bf16 pairs (w: the panel) or quantized records (q: the panel's; k0 and kc multiples of 32)
void widen_slice(const uint16_t* w, const uint8_t* q, int64_t record, int64_t width, int64_t k0, int64_t kc,
                 float* buf) {
  const int64_t outputs = width * kLanes;
  if (w) {  // pair j: the outputs' (k = 2j, 2j + 1) side by side
    const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
    for (int64_t j = k0 / 2; j < (k0 + kc) / 2; ++j) {
      float* row = buf + (2 * j - k0) * kWide;
      for (int64_t o = 0; o < outputs; o += 8) {
        const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + (j * outputs + o) * 2));
        _mm256_storeu_ps(row + o, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)));
        _mm256_storeu_ps(row + kWide + o, _mm256_castsi256_ps(_mm256_and_si256(v, high)));
      }
    }
    return;
  }
  const bool q4 = record == kQ4_1Record;
  // a record row's 16 bytes: even lanes (k = 2j) to bytes 0-7, odd lanes (k = 2j + 1) to 8-15
  const __m128i split = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t kb = k0 / kQuantBlock; kb < (k0 + kc) / kQuantBlock; ++kb)
    for (int64_t t = 0; t < width; ++t) {
      const uint8_t* rec = q + (kb * width + t) * record;
      const uint8_t* scales = rec + (q4 ? 256 : 512);
      const __m256 d[2] = {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales))),
                           _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + 16)))};
      __m256 m[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
      if (q4) {
        m[0] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 288)));
        m[1] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 304)));
      }
      for (int64_t j = 0; j < 16; ++j) {
        __m128i half[2];  // outputs 0-7 and 8-15 of the tile, even lanes then odd ones
        if (q4) {
          const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + j * 16));
          half[0] = _mm_shuffle_epi8(_mm_and_si128(raw, nibble), split);
          half[1] = _mm_shuffle_epi8(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble), split);
        } else {
          half[0] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + j * 32)), split);
          half[1] = _mm_shuffle_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + j * 32 + 16)), split);
        }
        float* row = buf + (kb * kQuantBlock - k0 + 2 * j) * kWide + t * kLanes;
        for (int h = 0; h < 2; ++h)
          for (int e = 0; e < 2; ++e) {
            const __m128i bytes = e ? _mm_srli_si128(half[h], 8) : half[h];
            const __m256 value = q4 ? _mm256_fmadd_ps(d[h], _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes)), m[h])
                                    : _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), d[h]);
            _mm256_storeu_ps(row + e * kWide + h * 8, round_bf16x8(value));
          }
      }
    }
}

// MB rows of x (fp32, row stride ldx, at the slice's first k) over a widened slice of kc k's,
// C x 8 columns of it (buf at the first): running sums (row m at sums + m * kWide) carried on,
// or started at zero when `first`. The 12 accumulators are named variables: as an array GCC
// kept them in memory and stored each one after every FMA (x's float loads may alias __m256).
template <int MB, int C>
void avx2_block(const float* x, int64_t ldx, const float* buf, int64_t kc, float* sums, bool first) {
  static_assert(MB >= 1 && MB <= 4 && C >= 1 && C <= 3, "4 rows x 3 columns of 8 at most");
  const __m256 zero = _mm256_setzero_ps();
  auto start = [&](int m, int c) {
    return (m < MB && c < C && !first) ? _mm256_loadu_ps(sums + m * kWide + 8 * c) : zero;
  };
  __m256 a00 = start(0, 0), a01 = start(0, 1), a02 = start(0, 2), a10 = start(1, 0), a11 = start(1, 1),
         a12 = start(1, 2), a20 = start(2, 0), a21 = start(2, 1), a22 = start(2, 2), a30 = start(3, 0),
         a31 = start(3, 1), a32 = start(3, 2);
  for (int64_t k = 0; k < kc; ++k) {
    const float* wk = buf + k * kWide;
    __m256 w0 = _mm256_loadu_ps(wk);
    __m256 w1 = C > 1 ? _mm256_loadu_ps(wk + 8) : zero;
    __m256 w2 = C > 2 ? _mm256_loadu_ps(wk + 16) : zero;
    // in registers: folded into each FMA as memory operands (GCC's choice), the 3 loads a k
    // became 3 x MB, and the loads, not the FMAs, set the pace
    asm("" : "+x"(w0), "+x"(w1), "+x"(w2));
#define KVREPLAY_AVX2_ROW(m, r0, r1, r2)                           \
    if constexpr (MB > m) {                                        \
      const __m256 xv = _mm256_broadcast_ss(x + m * ldx + k);      \
      r0 = _mm256_fmadd_ps(xv, w0, r0);                            \
      if constexpr (C > 1) r1 = _mm256_fmadd_ps(xv, w1, r1);       \
      if constexpr (C > 2) r2 = _mm256_fmadd_ps(xv, w2, r2);       \
    }
    KVREPLAY_AVX2_ROW(0, a00, a01, a02)
    KVREPLAY_AVX2_ROW(1, a10, a11, a12)
    KVREPLAY_AVX2_ROW(2, a20, a21, a22)
    KVREPLAY_AVX2_ROW(3, a30, a31, a32)
#undef KVREPLAY_AVX2_ROW
  }
  const __m256 rows[4][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32}};
  for (int m = 0; m < MB; ++m)
    for (int c = 0; c < C; ++c) _mm256_storeu_ps(sums + m * kWide + 8 * c, rows[m][c]);
}

template <int C>
void avx2_rows(const float* x, int64_t ldx, const float* buf, int64_t kc, float* sums, int64_t M, bool first) {
  const int64_t blocks = (M + 3) / 4;
  for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
    const int64_t rows = (M - m0) / (blocks - b);  // balanced, as panel_rows
    const float* xm = x + m0 * ldx;
    float* sm = sums + m0 * kWide;
    switch (rows) {
      case 1: avx2_block<1, C>(xm, ldx, buf, kc, sm, first); break;
      case 2: avx2_block<2, C>(xm, ldx, buf, kc, sm, first); break;
      case 3: avx2_block<3, C>(xm, ldx, buf, kc, sm, first); break;
      default: avx2_block<4, C>(xm, ldx, buf, kc, sm, first); break;
    }
    m0 += rows;
  }
}

// One row of x against a bf16 panel of W tiles (16 W outputs), the pairs widened in registers
// as they stream in: at one row the slice buffer's store and reload cost more than the FMAs.
// The same FMAs in the same order (k = 2j, then 2j + 1) as the sliced path, so the same bits.
template <int W, typename OutT>
void avx2_row_pairs(const float* x, const uint16_t* w, const uint16_t* bias, OutT* out, int64_t K) {
  static_assert(W >= 1 && W <= 3, "a panel holds 1 to 3 tiles");
  constexpr int64_t outputs = W * kLanes;
  const __m256i high = _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u));
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0;  // 8 outputs each
  for (int64_t j = 0; j < K / 2; ++j) {
    const __m256 even = _mm256_broadcast_ss(x + 2 * j), odd = _mm256_broadcast_ss(x + 2 * j + 1);
    const uint16_t* pairs = w + j * outputs * 2;
    auto step = [&](__m256& acc, int g) {  // outputs 8g .. 8g + 7
      const __m256i v = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(pairs + 16 * g));
      acc = _mm256_fmadd_ps(even, _mm256_castsi256_ps(_mm256_slli_epi32(v, 16)), acc);
      acc = _mm256_fmadd_ps(odd, _mm256_castsi256_ps(_mm256_and_si256(v, high)), acc);
    };
    step(a0, 0);
    step(a1, 1);
    if constexpr (W > 1) {
      step(a2, 2);
      step(a3, 3);
    }
    if constexpr (W > 2) {
      step(a4, 4);
      step(a5, 5);
    }
  }
  const __m256 sums[6] = {a0, a1, a2, a3, a4, a5};
  for (int g = 0; g < 2 * W; ++g)
    store_rounded8(out + 8 * g, _mm256_add_ps(sums[g], bias ? widen8(bias + 8 * g) : _mm256_setzero_ps()));
}
}  // namespace


// All M rows (x: [M][K] fp32) against one panel of `width` tiles (w or q, as widen_slice takes
// them), into out (row stride ld): slice by slice, columns in groups of 24 (then 16 or 8); one
// row of a bf16 panel straight from the pairs
template <typename OutT>
void avx2_panel(const float* x, const uint16_t* w, const uint8_t* q, int64_t record, int64_t width,
                const uint16_t* bias, OutT* out, int64_t M, int64_t ld, int64_t K) {
  if (M == 1 && w) {
    switch (width) {
      case 1: avx2_row_pairs<1>(x, w, bias, out, K); break;
      case 2: avx2_row_pairs<2>(x, w, bias, out, K); break;
      default: avx2_row_pairs<3>(x, w, bias, out, K); break;
    }
    return;
  }
  float* buf = kvreplay_scratch::thread_buffer<float, 2>(kAvx2Chunk * kWide);
  float* sums = kvreplay_scratch::thread_buffer<float, 3>(M * kWide);
  const int64_t cols = width * kLanes;
  for (int64_t k0 = 0; k0 < K; k0 += kAvx2Chunk) {
    const int64_t kc = std::min(kAvx2Chunk, K - k0);
    widen_slice(w, q, record, width, k0, kc, buf);
    for (int64_t c0 = 0; c0 < cols;) {
      const int64_t groups = std::min<int64_t>(3, (cols - c0) / 8);
      switch (groups) {
        case 3: avx2_rows<3>(x + k0, K, buf + c0, kc, sums + c0, M, k0 == 0); break;
        case 2: avx2_rows<2>(x + k0, K, buf + c0, kc, sums + c0, M, k0 == 0); break;
        default: avx2_rows<1>(x + k0, K, buf + c0, kc, sums + c0, M, k0 == 0); break;
      }
      c0 += groups * 8;
    }
  }
  store_sums(sums, bias, out, M, ld, cols);
}

template void avx2_panel<uint16_t>(const float*, const uint16_t*, const uint8_t*, int64_t, int64_t, const uint16_t*, uint16_t*,
                          int64_t, int64_t, int64_t);
template void avx2_panel<float>(const float*, const uint16_t*, const uint8_t*, int64_t, int64_t, const uint16_t*, float*,
                          int64_t, int64_t, int64_t);
#endif
}  // namespace kvreplay_layer_ops
