// The panel products on AVX512-BF16 (pair dot products) and on AMX tiles: the kernels that
// panel_product (panels.cpp) runs over a panel on such CPUs. Layouts: layer_ops.h.
#include "layer_ops.h"

namespace kvreplay_layer_ops {
#if defined(__AVX512BF16__)
namespace {
// Stores 16 sums rounded to bf16: as bf16 (OutT = uint16_t) or widened back to fp32 (float).
inline void store_rounded(uint16_t* out, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), (__m256i)_mm512_cvtneps_pbh(v));
}
inline void store_rounded(float* out, __m512 v) {
  _mm512_storeu_ps(out, kvreplay_simd::widen16((__m256i)_mm512_cvtneps_pbh(v)));
}

// MB rows of x against one panel of T tiles: MB x T accumulators stay in registers.
template <int MB, int T, typename OutT>
void panel_block(const uint16_t* x, const uint16_t* w, const uint16_t* bias, OutT* out, int64_t N,
                 int64_t K) {
  __m512 acc[MB][T];
  for (int m = 0; m < MB; ++m)
    for (int t = 0; t < T; ++t) acc[m][t] = _mm512_setzero_ps();
  for (int64_t j = 0; j < K / 2; ++j) {
    __m512bh wv[T];
    for (int t = 0; t < T; ++t) wv[t] = (__m512bh)_mm512_loadu_si512(w + (j * T + t) * 2 * kLanes);
    for (int m = 0; m < MB; ++m) {
      int32_t pair;
      std::memcpy(&pair, x + m * K + 2 * j, sizeof pair);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int t = 0; t < T; ++t) acc[m][t] = _mm512_dpbf16_ps(acc[m][t], xb, wv[t]);
    }
  }
  for (int t = 0; t < T; ++t) {
    const __m512 b = bias ? kvreplay_simd::load16(reinterpret_cast<const c10::BFloat16*>(bias) + t * kLanes)
                          : _mm512_setzero_ps();
    for (int m = 0; m < MB; ++m) store_rounded(out + m * N + t * kLanes, _mm512_add_ps(acc[m][t], b));
  }
}
}  // namespace

template <int T, typename OutT>
void panel_rows(const uint16_t* x, const uint16_t* w, const uint16_t* bias, OutT* out, int64_t M,
                int64_t N, int64_t K) {
  const int64_t blocks = (M + kRowBlock - 1) / kRowBlock;
  for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
    const int64_t rows = (M - m0) / (blocks - b);  // balanced: 9 rows -> 5 + 4, not 8 + 1
    const uint16_t* xm = x + m0 * K;
    OutT* om = out + m0 * N;
    m0 += rows;
    switch (rows) {
      case 1: panel_block<1, T>(xm, w, bias, om, N, K); break;
      case 2: panel_block<2, T>(xm, w, bias, om, N, K); break;
      case 3: panel_block<3, T>(xm, w, bias, om, N, K); break;
      case 4: panel_block<4, T>(xm, w, bias, om, N, K); break;
      case 5: panel_block<5, T>(xm, w, bias, om, N, K); break;
      case 6: panel_block<6, T>(xm, w, bias, om, N, K); break;
      case 7: panel_block<7, T>(xm, w, bias, om, N, K); break;
      default: panel_block<kRowBlock, T>(xm, w, bias, om, N, K); break;
    }
  }
}

template void panel_rows<1, uint16_t>(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t);
template void panel_rows<1, float>(const uint16_t*, const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t);
template void panel_rows<2, uint16_t>(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t);
template void panel_rows<2, float>(const uint16_t*, const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t);
template void panel_rows<kPanelTiles, uint16_t>(const uint16_t*, const uint16_t*, const uint16_t*, uint16_t*, int64_t, int64_t, int64_t);
template void panel_rows<kPanelTiles, float>(const uint16_t*, const uint16_t*, const uint16_t*, float*, int64_t, int64_t, int64_t);
#endif

#if defined(KVREPLAY_AMX)
// ---- the same products on AMX tiles (Sapphire Rapids and later) ----
// A panel's layout is the tile multiply's: for 16 consecutive pairs j, one tile's 16 outputs
// (64 bytes) sit every kPanelTiles * 64 bytes, so a B tile loads straight from the panel with
// that stride. x's rows go in blocks of r <= 16 rows (all blocks alike: x is copied into a
// zero-padded buffer), two blocks at a time: C tiles 0-2 and 3-5 hold a block's sums for the
// panel's three 16-output tiles, tile 6 the block's 32 columns of x, tile 7 the weights.
// Every row count runs here on such a CPU: at one row as fast as the vector kernel (the weights'
// stream is the cost), from 3 to 16 rows in the time of that stream (~4x the vector kernel's
// rate; bench/machine_limits.py). Sums are fp32 over k ascending as above, but TDPBF16PS adds a
// pair's two products in the other order than VDPBF16PS: a few outputs in 10,000 differ from
// the vector kernel's in the last bf16 bit. A row's result still does not depend on the other
// rows or their number (tests/test_linear.py).

// Whether the tiles are ours (simd.h); KVREPLAY_AMX_PANELS=0 before the first call keeps the
// vector kernel (its tests on such a CPU).
bool amx_permitted() {
  static const bool ok = !kvreplay_amx::switched_off("KVREPLAY_AMX_PANELS") && kvreplay_amx::tiles_granted();
  return ok;
}

namespace {
// The panel's weights: bf16 at w, or (q not null) quantized records, each 32-k block expanded
// into a small buffer just before its tiles load (it stays in L1).
template <int T, bool Two, typename OutT>
void amx_panel(const uint16_t* xa, const uint16_t* xb, int64_t rows_a, int64_t rows_b, const uint16_t* w,
               const uint8_t* q, int64_t record, const uint16_t* bias, OutT* out_a, OutT* out_b, int64_t N,
               int64_t K) {
  // two buffers: block k + 1 expands on the vector units while block k's products run on the tiles
  constexpr int64_t kExpanded = 16 * T * 2 * kLanes;
  alignas(64) uint16_t expanded[2][kExpanded];
  auto expand = [&](int64_t k0) {
    for (int t = 0; t < T; ++t)
      expand_record(q + ((k0 / kQuantBlock) * T + t) * record, record == kQ4_1Record,
                    expanded[(k0 / kQuantBlock) & 1] + t * 2 * kLanes, T * 2 * kLanes);
    kvreplay_amx::before_tile_loads();
  };
  if (q) expand(0);
  _tile_zero(0);
  if (T > 1) _tile_zero(1);
  if (T > 2) _tile_zero(2);
  if (Two) {
    _tile_zero(3);
    if (T > 1) _tile_zero(4);
    if (T > 2) _tile_zero(5);
  }
  const int64_t x_stride = K * 2, w_stride = T * 64;
  for (int64_t k0 = 0; k0 < K; k0 += 32) {
    const uint16_t* wk = q ? expanded[(k0 / kQuantBlock) & 1] : w + (k0 / 2) * T * 2 * kLanes;
    _tile_loadd(6, xa + k0, x_stride);
    _tile_loadd(7, wk, w_stride);
    _tile_dpbf16ps(0, 6, 7);
    if (T > 1) { _tile_loadd(7, wk + 2 * kLanes, w_stride); _tile_dpbf16ps(1, 6, 7); }
    if (T > 2) { _tile_loadd(7, wk + 4 * kLanes, w_stride); _tile_dpbf16ps(2, 6, 7); }
    if (Two) {
      _tile_loadd(6, xb + k0, x_stride);
      _tile_loadd(7, wk, w_stride);
      _tile_dpbf16ps(3, 6, 7);
      if (T > 1) { _tile_loadd(7, wk + 2 * kLanes, w_stride); _tile_dpbf16ps(4, 6, 7); }
      if (T > 2) { _tile_loadd(7, wk + 4 * kLanes, w_stride); _tile_dpbf16ps(5, 6, 7); }
    }
    if (q && k0 + 32 < K) {
      // the records kPrefetchBlocks blocks ahead (past a panel's end: the next panel's, which
      // this thread reads next; a prefetch never faults): without it the stream stalls (~20%)
      const char* ahead = reinterpret_cast<const char*>(q) + ((k0 / kQuantBlock) + kPrefetchBlocks) * T * record;
      for (int64_t b = 0; b < T * record; b += 64) _mm_prefetch(ahead + b, _MM_HINT_T0);
      expand(k0 + 32);
    }
  }
  alignas(64) float sums[Two ? 2 : 1][T][16 * kLanes];
  _tile_stored(0, sums[0][0], 64);
  if (T > 1) _tile_stored(1, sums[0][T > 1 ? 1 : 0], 64);
  if (T > 2) _tile_stored(2, sums[0][T > 2 ? 2 : 0], 64);
  if (Two) {
    _tile_stored(3, sums[Two ? 1 : 0][0], 64);
    if (T > 1) _tile_stored(4, sums[Two ? 1 : 0][T > 1 ? 1 : 0], 64);
    if (T > 2) _tile_stored(5, sums[Two ? 1 : 0][T > 2 ? 2 : 0], 64);
  }
  for (int t = 0; t < T; ++t) {
    const __m512 b = bias ? kvreplay_simd::load16(reinterpret_cast<const c10::BFloat16*>(bias) + t * kLanes)
                          : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows_a; ++m)
      store_rounded(out_a + m * N + t * kLanes, _mm512_add_ps(_mm512_load_ps(sums[0][t] + m * kLanes), b));
    if (Two)
      for (int64_t m = 0; m < rows_b; ++m)
        store_rounded(out_b + m * N + t * kLanes,
                      _mm512_add_ps(_mm512_load_ps(sums[Two ? 1 : 0][t] + m * kLanes), b));
  }
}
}  // namespace

// x's rows in blocks of r: block b at x + b * r * K, except a last block with fewer than r rows,
// which reads `tail` (those rows copied into r zero-padded ones) so that no tile load runs past x
template <int T, typename OutT>
void amx_rows(const uint16_t* x, const uint16_t* tail, int64_t r, int64_t M, const uint16_t* w, const uint8_t* q,
              int64_t record, const uint16_t* bias, OutT* out, int64_t N, int64_t K) {
  const int64_t blocks = (M + r - 1) / r;
  auto rows_of = [&](int64_t b) { return b == blocks - 1 && tail ? tail : x + b * r * K; };
  for (int64_t b = 0; b < blocks; b += 2) {
    const int64_t m0 = b * r, rows_a = std::min(r, M - m0);
    if (b + 1 < blocks) {
      const int64_t rows_b = std::min(r, M - m0 - r);
      amx_panel<T, true>(rows_of(b), rows_of(b + 1), rows_a, rows_b, w, q, record, bias, out + m0 * N,
                         out + (m0 + r) * N, N, K);
    } else {
      amx_panel<T, false>(rows_of(b), x, rows_a, int64_t{0}, w, q, record, bias, out + m0 * N, out, N, K);
    }
  }
}

template void amx_rows<1, uint16_t>(const uint16_t*, const uint16_t*, int64_t, int64_t, const uint16_t*, const uint8_t*,
                          int64_t, const uint16_t*, uint16_t*, int64_t, int64_t);
template void amx_rows<1, float>(const uint16_t*, const uint16_t*, int64_t, int64_t, const uint16_t*, const uint8_t*,
                          int64_t, const uint16_t*, float*, int64_t, int64_t);
template void amx_rows<2, uint16_t>(const uint16_t*, const uint16_t*, int64_t, int64_t, const uint16_t*, const uint8_t*,
                          int64_t, const uint16_t*, uint16_t*, int64_t, int64_t);
template void amx_rows<2, float>(const uint16_t*, const uint16_t*, int64_t, int64_t, const uint16_t*, const uint8_t*,
                          int64_t, const uint16_t*, float*, int64_t, int64_t);
template void amx_rows<kPanelTiles, uint16_t>(const uint16_t*, const uint16_t*, int64_t, int64_t, const uint16_t*, const uint8_t*,
                          int64_t, const uint16_t*, uint16_t*, int64_t, int64_t);
template void amx_rows<kPanelTiles, float>(const uint16_t*, const uint16_t*, int64_t, int64_t, const uint16_t*, const uint8_t*,
                          int64_t, const uint16_t*, float*, int64_t, int64_t);
#endif
}  // namespace kvreplay_layer_ops
