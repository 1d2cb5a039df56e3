// Shared by the sources of the decode-attention extension (torch.ops.kvreplay_cpu;
// decode_attention.cpp lists them): the includes, the block-level score and value steps for each
// instruction set (inline: they run in the kernels' innermost loops), the AMX score tiles, and
// the entry points registered in decode_attention.cpp.
#pragma once
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <algorithm>
#include <limits>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include <tuple>
#include <type_traits>
#include <vector>

#include "simd.h"

namespace kvreplay_attention {

// Widen n values to fp32 (bf16 -> fp32 is a 16-bit shift; written so the compiler vectorizes it).
inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void widen(const double* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}
inline void widen(const c10::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* raw = reinterpret_cast<const uint16_t*>(src);
  uint32_t* out = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) out[i] = static_cast<uint32_t>(raw[i]) << 16;
}

struct Outputs {
  float* lse = nullptr;   // [B, Hq] or null
  float* mass = nullptr;  // [B, Hkv, W] or null
};

// Block-level score and value steps. With AVX-512, 16-token blocks and a head size fixed at
// compile time (a multiple of 16), one block's 16 dot products per query head reduce together
// (a transpose-and-add tree instead of 16 horizontal sums) and each head's output accumulator
// stays in registers across the block's rows. With AVX2 only, the same steps on 8 lanes (below).
// Otherwise plain loops the compiler vectorizes.
#if defined(__AVX512F__) || defined(KVREPLAY_HAVE_AVX2)
// Blocks lie anywhere in the cache, so the hardware prefetcher cannot run ahead of the score
// pass: it asks for the keys of the block kPrefetchAhead on into L2 (which takes more misses in
// flight than L1; 8 measured best of 4/8/12/16 on this machine), for the next block's keys into
// L1, and for the current block's values into L2 (read by the second pass). With 30 layers of
// cache in memory (not L3) and scattered blocks: 12 x 650 tokens 429 -> ~320 us per layer.
constexpr int64_t kPrefetchAhead = 8;
template <typename T>
inline void prefetch_to_l1(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(c + i, _MM_HINT_T0);
}
template <typename T>
inline void prefetch_to_l2(const T* p, int64_t n) {
  const char* c = reinterpret_cast<const char*>(p);
  for (int64_t i = 0; i < n * static_cast<int64_t>(sizeof(T)); i += 64) _mm_prefetch(c + i, _MM_HINT_T1);
}
// the element types the block steps load (widened to fp32 in registers)
template <typename T> constexpr bool kLoads16 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;
#endif

#if defined(__AVX512F__)
constexpr bool kVectorBlocks = true;  // the block steps below exist on this build
using kvreplay_simd::exp16;
using kvreplay_simd::lane_sums16;
using kvreplay_simd::load16;

// sg[t] = e^(sg[t] - m) for t < L; returns their sum
inline float exp_shifted(float* sg, int64_t L, float m) {
  const __m512 shift = _mm512_set1_ps(m);
  __m512 total = _mm512_setzero_ps();
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sg + t), shift));
    _mm512_storeu_ps(sg + t, e);
    total = _mm512_add_ps(total, e);
  }
  if (t < L) {
    const __mmask16 keep = static_cast<__mmask16>((1u << (L - t)) - 1u);
    const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(keep, sg + t), shift));
    _mm512_mask_storeu_ps(sg + t, keep, e);
    total = _mm512_add_ps(total, _mm512_maskz_mov_ps(keep, e));
  }
  return _mm512_reduce_add_ps(total);
}

// the largest of sg[0 .. L - 1] (a scalar loop waits on each comparison: ~4 cycles a score)
inline float max_of(const float* sg, int64_t L) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) best = _mm512_max_ps(best, _mm512_loadu_ps(sg + t));
  if (t < L) best = _mm512_mask_max_ps(best, static_cast<__mmask16>((1u << (L - t)) - 1u), best,
                                       _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << (L - t)) - 1u), sg + t));
  return _mm512_reduce_max_ps(best);
}

// scores[g * L + r] = qf[g] . k[r] for the block's `rows` (<= 16) keys k (cache rows, D apart)
template <int D, typename T>
inline void block_scores16(const float* qf, const T* buf, int64_t rows, int64_t G, int64_t L,
                           float* scores) {
  constexpr int C = D / 16;
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1u);
  for (int64_t g = 0; g < G; ++g) {
    __m512 q[C];
    for (int c = 0; c < C; ++c) q[c] = _mm512_loadu_ps(qf + g * D + 16 * c);
    __m512 partial[16];
    for (int64_t r = 0; r < 16; ++r) {
      if (r >= rows) { partial[r] = _mm512_setzero_ps(); continue; }
      __m512 sum = _mm512_mul_ps(q[0], load16(buf + r * D));
      for (int c = 1; c < C; ++c) sum = _mm512_fmadd_ps(q[c], load16(buf + r * D + 16 * c), sum);
      partial[r] = sum;
    }
    _mm512_mask_storeu_ps(scores + g * L, keep, lane_sums16(partial));
  }
}

// acc[g] += sum_r p[g * L + r] * v[r] for NG query heads at once: each value row is widened
// once and feeds every head (NG * D / 16 accumulators stay in registers)
template <int D, int NG, typename T>
inline void block_values16_heads(const float* probs, const T* buf, int64_t rows, int64_t L, float* acc) {
  constexpr int C = D / 16;
  __m512 a[NG][C];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) a[g][c] = _mm512_loadu_ps(acc + g * D + 16 * c);
  for (int64_t r = 0; r < rows; ++r) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(buf + r * D + 16 * c);
    for (int g = 0; g < NG; ++g) {
      const __m512 p = _mm512_set1_ps(probs[g * L + r]);
      for (int c = 0; c < C; ++c) a[g][c] = _mm512_fmadd_ps(p, v[c], a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(acc + g * D + 16 * c, a[g][c]);
}

// acc[g] += sum_r p[g * L + r] * v[r] over the block's rows (cache rows, D apart), all G heads
template <int D, typename T>
inline void block_values16(const float* probs, const T* buf, int64_t rows, int64_t G, int64_t L,
                           float* acc) {
  constexpr int NG = D <= 64 ? 4 : 2;  // accumulators + one value row within 32 registers
  int64_t g = 0;
  for (; g + NG <= G; g += NG) block_values16_heads<D, NG>(probs + g * L, buf, rows, L, acc + g * D);
  switch (G - g) {
    case 3: block_values16_heads<D, 3>(probs + g * L, buf, rows, L, acc + g * D); break;
    case 2: block_values16_heads<D, 2>(probs + g * L, buf, rows, L, acc + g * D); break;
    case 1: block_values16_heads<D, 1>(probs + g * L, buf, rows, L, acc + g * D); break;
    default: break;
  }
}

#if defined(__AVX512BF16__)
constexpr bool kHaveBf16Dot = true;
// scores[g * L + r] = scale * (q[g] . k[r]) straight from bf16 query and keys: pair dot products
// (exact products, fp32 sums), no widening
template <int D>
inline void block_scores16_bf16(const c10::BFloat16* q, const c10::BFloat16* buf, int64_t rows,
                                int64_t G, int64_t L, float scale, float* scores) {
  constexpr int C = D / 32;
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1u);
  const __m512 scaling = _mm512_set1_ps(scale);
  for (int64_t g = 0; g < G; ++g) {
    __m512bh qv[C];
    for (int c = 0; c < C; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + g * D + 32 * c);
    __m512 partial[16];
    for (int64_t r = 0; r < 16; ++r) {
      __m512 sum = _mm512_setzero_ps();
      if (r < rows)
        for (int c = 0; c < C; ++c)
          sum = _mm512_dpbf16_ps(sum, qv[c], (__m512bh)_mm512_loadu_si512(buf + r * D + 32 * c));
      partial[r] = sum;
    }
    _mm512_mask_storeu_ps(scores + g * L, keep, _mm512_mul_ps(lane_sums16(partial), scaling));
  }
}
#endif
#elif defined(KVREPLAY_HAVE_AVX2)
// The same block steps with AVX2 (8 lanes): a block's keys in two groups of 8, each group's 8 dot
// products per query head reduced by one transpose-and-add tree (lane_sums8), the values
// accumulated for up to 3 heads at a time, 32 dimensions at a time, in registers. Softmax with
// exp8 (exp16's arithmetic lane for lane). No bf16 dot products here: keys and values are
// widened in registers as they load.
constexpr bool kVectorBlocks = true;
using kvreplay_simd::exp8;
using kvreplay_simd::load8;

// out lane r = sum of the 8 lanes of p[r]
inline __m256 lane_sums8(const __m256* p) {
  const __m256 h01 = _mm256_hadd_ps(p[0], p[1]), h23 = _mm256_hadd_ps(p[2], p[3]);
  const __m256 h45 = _mm256_hadd_ps(p[4], p[5]), h67 = _mm256_hadd_ps(p[6], p[7]);
  // per 128-bit lane: one partial sum for each of rows 0..3 (low) and 4..7 (high)
  const __m256 lo = _mm256_hadd_ps(h01, h23), hi = _mm256_hadd_ps(h45, h67);
  return _mm256_add_ps(_mm256_permute2f128_ps(lo, hi, 0x20), _mm256_permute2f128_ps(lo, hi, 0x31));
}

// sg[t] = e^(sg[t] - m) for t < L; returns their sum
inline float exp_shifted(float* sg, int64_t L, float m) {
  const __m256 shift = _mm256_set1_ps(m);
  __m256 total = _mm256_setzero_ps();
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), shift));
    _mm256_storeu_ps(sg + t, e);
    total = _mm256_add_ps(total, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, total);
  float sum = ((lanes[0] + lanes[1]) + (lanes[2] + lanes[3])) + ((lanes[4] + lanes[5]) + (lanes[6] + lanes[7]));
  if (t < L) {  // the tail through one padded vector (its padding never stored nor added)
    alignas(32) float tail[8] = {};
    for (int64_t i = t; i < L; ++i) tail[i - t] = sg[i] - m;
    _mm256_store_ps(tail, exp8(_mm256_load_ps(tail)));
    for (int64_t i = t; i < L; ++i) {
      sg[i] = tail[i - t];
      sum += tail[i - t];
    }
  }
  return sum;
}

// the largest of sg[0 .. L - 1]
inline float max_of(const float* sg, int64_t L) {
  __m256 best = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t t = 0;
  for (; t + 8 <= L; t += 8) best = _mm256_max_ps(best, _mm256_loadu_ps(sg + t));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, best);
  float m = lanes[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, lanes[i]);
  for (; t < L; ++t) m = std::max(m, sg[t]);
  return m;
}

// scores[g * L + r] = qf[g] . k[r] for the block's `rows` (<= 16) keys k (cache rows, D apart).
// Rows past `rows` (stale cache rows of the block's last part) are summed in their own lanes and
// never stored.
template <int D, typename T>
inline void block_scores16(const float* qf, const T* buf, int64_t rows, int64_t G, int64_t L,
                           float* scores) {
  constexpr int C = D / 8;
  for (int64_t g = 0; g < G; ++g) {
    const float* q = qf + g * D;
    for (int64_t r0 = 0; r0 < rows; r0 += 8) {
      __m256 partial[8];
      for (int r = 0; r < 8; ++r) partial[r] = _mm256_setzero_ps();
      for (int c = 0; c < C; ++c) {
        const __m256 qc = _mm256_loadu_ps(q + 8 * c);
        for (int r = 0; r < 8; ++r)
          partial[r] = _mm256_fmadd_ps(qc, load8(buf + (r0 + r) * D + 8 * c), partial[r]);
      }
      const __m256 sums = lane_sums8(partial);
      float* out = scores + g * L + r0;
      if (rows - r0 >= 8) {
        _mm256_storeu_ps(out, sums);
      } else {
        alignas(32) float lanes[8];
        _mm256_store_ps(lanes, sums);
        for (int64_t r = 0; r < rows - r0; ++r) out[r] = lanes[r];
      }
    }
  }
}

// acc[g] += sum_r p[g * L + r] * v[r] for NG (<= 3) query heads and dimensions d0 .. d0 + 31:
// each value row's 32 dimensions are widened once and feed every head
template <int D, int NG, typename T>
inline void block_values8_heads(const float* probs, const T* buf, int64_t rows, int64_t L, float* acc, int d0) {
  __m256 a[NG][4];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 4; ++c) a[g][c] = _mm256_loadu_ps(acc + g * D + d0 + 8 * c);
  for (int64_t r = 0; r < rows; ++r) {  // only the context's rows: a stale value row may be NaN
    __m256 p[NG];
    for (int g = 0; g < NG; ++g) p[g] = _mm256_broadcast_ss(probs + g * L + r);
    for (int c = 0; c < 4; ++c) {
      const __m256 v = load8(buf + r * D + d0 + 8 * c);
      for (int g = 0; g < NG; ++g) a[g][c] = _mm256_fmadd_ps(p[g], v, a[g][c]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(acc + g * D + d0 + 8 * c, a[g][c]);
}

// acc[g] += sum_r p[g * L + r] * v[r] over the block's rows (cache rows, D apart), all G heads
template <int D, typename T>
inline void block_values16(const float* probs, const T* buf, int64_t rows, int64_t G, int64_t L,
                           float* acc) {
  static_assert(D % 32 == 0, "32 dimensions at a time");
  for (int d0 = 0; d0 < D; d0 += 32) {
    int64_t g = 0;
    for (; g + 3 <= G; g += 3) block_values8_heads<D, 3>(probs + g * L, buf, rows, L, acc + g * D, d0);
    if (G - g == 2) block_values8_heads<D, 2>(probs + g * L, buf, rows, L, acc + g * D, d0);
    else if (G - g == 1) block_values8_heads<D, 1>(probs + g * L, buf, rows, L, acc + g * D, d0);
  }
}

// bf16 rows in pair order: with AVX2 a bf16 widens to fp32 by a 16-bit shift, so one 32-byte
// load of 16 values gives two fp32 vectors with two single-cycle operations, the even-indexed
// values (shifted up) and the odd-indexed ones (the high halves, masked) -- against one
// shuffle-load and one shift for every 8 values in load8. The query (and the values'
// accumulators) are kept in that order instead: within each 16 dimensions, the 8 even ones
// then the 8 odd ones (to_pair_order / from_pair_order). A key row is widened once for all G
// query heads (scores for 4 keys x up to 3 heads in 12 registers), a value row once for up to
// 3 heads as in block_values8_heads. Sums run over the dimensions in another order than
// block_scores16's, so bf16 outputs may differ from it in the last bit; fp32 rows keep
// block_scores16 / block_values16.
constexpr bool kPairSteps = true;

inline void widen_pairs16(const c10::BFloat16* p, __m256& even, __m256& odd) {
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(raw, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(raw, _mm256_set1_epi32(static_cast<int>(0xFFFF0000u))));
}

// n (a multiple of 16) fp32 values into pair order, in place; and back
inline void to_pair_order(float* v, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __m256 a = _mm256_loadu_ps(v + j), b = _mm256_loadu_ps(v + j + 8);  // values 0-7, 8-15
    // shuffle_ps picks within 128-bit lanes: evens [0 2 8 10 | 4 6 12 14], then 0xD8 orders them
    const __m256 ev = _mm256_shuffle_ps(a, b, 0x88), od = _mm256_shuffle_ps(a, b, 0xDD);
    _mm256_storeu_ps(v + j, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(ev), 0xD8)));
    _mm256_storeu_ps(v + j + 8, _mm256_castpd_ps(_mm256_permute4x64_pd(_mm256_castps_pd(od), 0xD8)));
  }
}
inline void from_pair_order(float* v, int64_t n) {
  for (int64_t j = 0; j < n; j += 16) {
    const __m256 ev = _mm256_loadu_ps(v + j), od = _mm256_loadu_ps(v + j + 8);
    const __m256 lo = _mm256_unpacklo_ps(ev, od), hi = _mm256_unpackhi_ps(ev, od);  // [0-3 | 8-11], [4-7 | 12-15]
    _mm256_storeu_ps(v + j, _mm256_permute2f128_ps(lo, hi, 0x20));
    _mm256_storeu_ps(v + j + 8, _mm256_permute2f128_ps(lo, hi, 0x31));
  }
}

// lane r = the sum of the 8 lanes of p_r
inline __m128 lane_sums4(__m256 p0, __m256 p1, __m256 p2, __m256 p3) {
  const __m256 h = _mm256_hadd_ps(_mm256_hadd_ps(p0, p1), _mm256_hadd_ps(p2, p3));
  return _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1));
}

// scores[g * L + r] = qp[g] . k[r] for NG (<= 3) heads (qp in pair order), the block's rows in
// groups of 4 (rows past `rows` summed in their own lanes, never stored)
template <int D, int NG>
inline void pair_scores_heads(const float* qp, const c10::BFloat16* k, int64_t rows, int64_t L, float* scores) {
  for (int64_t r0 = 0; r0 < rows; r0 += 4) {
    __m256 acc[4][NG];
    for (int r = 0; r < 4; ++r)
      for (int g = 0; g < NG; ++g) acc[r][g] = _mm256_setzero_ps();
    for (int j = 0; j < D; j += 16)
      for (int r = 0; r < 4; ++r) {
        __m256 even, odd;
        widen_pairs16(k + (r0 + r) * D + j, even, odd);
        for (int g = 0; g < NG; ++g) {
          acc[r][g] = _mm256_fmadd_ps(even, _mm256_loadu_ps(qp + g * D + j), acc[r][g]);
          acc[r][g] = _mm256_fmadd_ps(odd, _mm256_loadu_ps(qp + g * D + j + 8), acc[r][g]);
        }
      }
    for (int g = 0; g < NG; ++g) {
      const __m128 sums = lane_sums4(acc[0][g], acc[1][g], acc[2][g], acc[3][g]);
      float* out = scores + g * L + r0;
      if (rows - r0 >= 4) {
        _mm_storeu_ps(out, sums);
      } else {
        alignas(16) float lanes[4];
        _mm_store_ps(lanes, sums);
        for (int64_t r = 0; r < rows - r0; ++r) out[r] = lanes[r];
      }
    }
  }
}

template <int D>
inline void pair_scores16(const float* qp, const c10::BFloat16* k, int64_t rows, int64_t G, int64_t L, float* scores) {
  int64_t g = 0;
  for (; g + 3 <= G; g += 3) pair_scores_heads<D, 3>(qp + g * D, k, rows, L, scores + g * L);
  if (G - g == 2) pair_scores_heads<D, 2>(qp + g * D, k, rows, L, scores + g * L);
  else if (G - g == 1) pair_scores_heads<D, 1>(qp + g * D, k, rows, L, scores + g * L);
}

// acc[g] (pair order) += sum_r p[g * L + r] * v[r] for NG (<= 3) heads, dimensions d0 .. d0 + 15
// (6 sums, the 3 probabilities, a value row's two halves and the mask in registers: with 32
// dimensions at a time GCC kept one of the 12 sums on the stack, a store and reload every row)
template <int D, int NG>
inline void pair_values_heads(const float* probs, const c10::BFloat16* v, int64_t rows, int64_t L, float* acc, int d0) {
  __m256 a[NG][2];
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 2; ++c) a[g][c] = _mm256_loadu_ps(acc + g * D + d0 + 8 * c);
  for (int64_t r = 0; r < rows; ++r) {  // only the context's rows: a stale value row may be NaN
    __m256 even, odd;
    widen_pairs16(v + r * D + d0, even, odd);
    for (int g = 0; g < NG; ++g) {
      const __m256 p = _mm256_broadcast_ss(probs + g * L + r);
      a[g][0] = _mm256_fmadd_ps(p, even, a[g][0]);
      a[g][1] = _mm256_fmadd_ps(p, odd, a[g][1]);
    }
  }
  for (int g = 0; g < NG; ++g)
    for (int c = 0; c < 2; ++c) _mm256_storeu_ps(acc + g * D + d0 + 8 * c, a[g][c]);
}

template <int D>
inline void pair_values16(const float* probs, const c10::BFloat16* v, int64_t rows, int64_t G, int64_t L, float* acc) {
  static_assert(D % 16 == 0, "16 dimensions at a time");
  for (int d0 = 0; d0 < D; d0 += 16) {
    int64_t g = 0;
    for (; g + 3 <= G; g += 3) pair_values_heads<D, 3>(probs + g * L, v, rows, L, acc + g * D, d0);
    if (G - g == 2) pair_values_heads<D, 2>(probs + g * L, v, rows, L, acc + g * D, d0);
    else if (G - g == 1) pair_values_heads<D, 1>(probs + g * L, v, rows, L, acc + g * D, d0);
  }
}
#else
constexpr bool kVectorBlocks = false;
constexpr int64_t kPrefetchAhead = 8;
template <typename T> inline void prefetch_to_l1(const T*, int64_t) {}
template <typename T> inline void prefetch_to_l2(const T*, int64_t) {}
inline float exp_shifted(float*, int64_t, float) { return 0.f; }
inline float max_of(const float*, int64_t) { return 0.f; }
template <typename T> constexpr bool kLoads16 = false;
template <int D, typename T>
inline void block_scores16(const float*, const T*, int64_t, int64_t, int64_t, float*) {}
template <int D, typename T>
inline void block_values16(const float*, const T*, int64_t, int64_t, int64_t, float*) {}
#endif
#if !defined(KVREPLAY_HAVE_AVX2) || defined(__AVX512F__)
constexpr bool kPairSteps = false;  // (AVX2 builds only: AVX-512 widens 16 lanes a step already)
inline void to_pair_order(float*, int64_t) {}
inline void from_pair_order(float*, int64_t) {}
template <int D>
inline void pair_scores16(const float*, const c10::BFloat16*, int64_t, int64_t, int64_t, float*) {}
template <int D>
inline void pair_values16(const float*, const c10::BFloat16*, int64_t, int64_t, int64_t, float*) {}
#endif
#if !(defined(__AVX512F__) && defined(__AVX512BF16__))
constexpr bool kHaveBf16Dot = false;  // no bf16 pair dot products on this build
template <int D>
inline void block_scores16_bf16(const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t, int64_t,
                                float, float*) {}
#endif

// Scores on AMX tiles (bf16 caches, head size 64 or 128, G <= 16 query heads a KV head, 16-token
// blocks). A block's keys are a tile as the cache holds them (16 rows, 32 dimensions each, D
// apart), so they load straight from the cache; the G query rows are laid out once per (sequence,
// KV head) as the other operand (16 pairs of dimensions x G heads, tiles 2 ..) and stay loaded
// across the blocks. One tile multiply a 32 dimensions gives the block's 16 x G dot products
// (exact products, fp32 sums over the dimensions in order): the work that took ~300 vector
// operations a block (pair dot products and their transpose-and-add tree, for each head) is two
// tile multiplies, a tile store and a gather a head. The sums run in another order than the
// vector kernel's, so scores differ from its in the last bits.
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
constexpr bool kHaveAmxScores = true;

// The tiles once granted (simd.h), and KVREPLAY_AMX_ATTENTION not "0" at this call (read each
// call, so that bench/attention_tiles.py can time both paths in one process).
inline bool amx_scores_permitted() {
  static const bool granted = kvreplay_amx::tiles_granted();
  return granted && !kvreplay_amx::switched_off("KVREPLAY_AMX_ATTENTION");
}

// Every tile 16 rows x 64 bytes, set once per thread and call. The score pass uses tiles 0 and 7
// for a block's scores [16 keys x 16 heads, those past G zero], 1 and 6 for its keys [16 x 32
// dimensions], 2 .. 1 + D/32 for the query [16 dimension pairs x 16 heads]; the value pass
// (values_on_tiles) reuses them.
inline void attention_tiles_config() {
  kvreplay_amx::TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.rows[t] = 16;
    config.colsb[t] = 64;
  }
  _tile_loadconfig(&config);
}
inline void release_tiles() { _tile_release(); }

// The G query rows (bf16, [G, D] contiguous) into tiles 2 ..: row i of tile c holds, for each head
// g, its dimensions 32c + 2i and 32c + 2i + 1.
template <int D>
inline void load_query_tiles(const c10::BFloat16* q, int64_t G) {
  alignas(64) uint32_t staging[D / 32][16 * 16] = {};  // heads past G: zero
  const uint32_t* pairs = reinterpret_cast<const uint32_t*>(q);
  for (int c = 0; c < D / 32; ++c)
    for (int i = 0; i < 16; ++i)
      for (int64_t g = 0; g < G; ++g) staging[c][i * 16 + g] = pairs[g * (D / 2) + c * 16 + i];
  kvreplay_amx::before_tile_loads();
  _tile_loadd(2, staging[0], 64);
  _tile_loadd(3, staging[1], 64);
  if constexpr (D == 128) {
    _tile_loadd(4, staging[2], 64);
    _tile_loadd(5, staging[3], 64);
  }
}

// A block's 16 x G dot products into score tile C (0 or 7): the keys' 16 rows are all read (a
// block is whole in the cache; rows past the context are dropped when collected).
// (the tile intrinsics take the tile's number as a literal, hence the macro)
#define KVREPLAY_SCORE_PRODUCTS(C)        \
  _tile_zero(C);                          \
  _tile_loadd(1, keys, D * 2);            \
  _tile_loadd(6, keys + 32, D * 2);       \
  _tile_dpbf16ps(C, 1, 2);                \
  _tile_dpbf16ps(C, 6, 3);                \
  if constexpr (D == 128) {               \
    _tile_loadd(1, keys + 64, D * 2);     \
    _tile_loadd(6, keys + 96, D * 2);     \
    _tile_dpbf16ps(C, 1, 4);              \
    _tile_dpbf16ps(C, 6, 5);              \
  }
template <int D, int C>
inline void issue_block_scores(const c10::BFloat16* keys) {
  static_assert(C == 0 || C == 7);
  if constexpr (C == 0) {
    KVREPLAY_SCORE_PRODUCTS(0)
  } else {
    KVREPLAY_SCORE_PRODUCTS(7)
  }
}
#undef KVREPLAY_SCORE_PRODUCTS

// scores[g * L + r] = scale * (q[g] . k[r]) for the block's first `rows` keys, from score tile C
template <int C>
inline void collect_block_scores(int64_t rows, int64_t G, int64_t L, float scale, float* scores) {
  alignas(64) float sums[16 * 16];
  if constexpr (C == 0) _tile_stored(0, sums, 64);
  else _tile_stored(7, sums, 64);
  const __mmask16 keep = static_cast<__mmask16>((1u << rows) - 1u);
  const __m512 scaling = _mm512_set1_ps(scale);
  const __m512i column = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                            _mm512_set1_epi32(16));
  for (int64_t g = 0; g < G; ++g) {
    const __m512 v = _mm512_i32gather_ps(_mm512_add_epi32(column, _mm512_set1_epi32(static_cast<int>(g))), sums, 4);
    _mm512_mask_storeu_ps(scores + g * L, keep, _mm512_mul_ps(v, scaling));
  }
}

// The score pass of one (sequence, KV head) over its `nblocks` blocks (keys of block i at
// keys(i)), two blocks in flight: block i's products run on the tiles while block i - 1's
// scores are stored and spread out per head (each waiting on its own products cost ~2x).
template <int D, typename Keys, typename Prefetch>
inline void scores_on_tiles(Keys keys, Prefetch prefetch, int64_t nblocks, int64_t bs, int64_t L, int64_t G,
                            float scale, float* scores) {
  auto collect = [&](int64_t blk) {
    const int64_t rows = std::min(bs, L - blk * bs);
    if (blk & 1) collect_block_scores<7>(rows, G, L, scale, scores + blk * bs);
    else collect_block_scores<0>(rows, G, L, scale, scores + blk * bs);
  };
  for (int64_t blk = 0; blk < nblocks; ++blk) {
    prefetch(blk);
    if (blk & 1) issue_block_scores<D, 7>(keys(blk));
    else issue_block_scores<D, 0>(keys(blk));
    if (blk > 0) collect(blk - 1);
  }
  if (nblocks > 0) collect(nblocks - 1);
}

// The value pass on tiles for D = 64, 32 keys (two blocks) at a time: tile 4 holds the G heads'
// probabilities of the 32 keys in bf16 and tile 5 what bf16 missed of them (p - hi, in bf16: the
// two carry ~16 significant bits of the fp32 probability, where one would carry 8), tiles 6 / 7
// the keys' values for one group of 16 dimensions with each pair of keys interleaved (what the
// tile multiply pairs), and tiles 0-3 the G x 64 outputs, fp32. Each group's tile takes, per
// 128-bit lane of the value row, dimensions 8l .. 8l + 3 (unpacklo) or 8l + 4 .. 8l + 7
// (unpackhi), of the first 32 dimensions (tiles 0, 1) or the last (2, 3): output column c of
// tile t is dimension 32 (t / 2) + 8 (c / 4) + 4 (t % 2) + c % 4. Keys past L get probability 0
// and values 0 (never the cache's stale rows: 0 x NaN would be NaN). The sums run in another
// order than the vector kernel's fp32 products, so outputs differ from its in the last bits.
inline void values_on_tiles(const float* probs, const c10::BFloat16* vh, const int64_t* table, int64_t L,
                            int64_t G, int64_t bs, float* acc) {
  constexpr int D = 64;
  alignas(64) uint16_t hi[16][32] = {}, lo[16][32] = {};  // heads past G stay zero
  alignas(64) uint32_t values[4][16][16];  // [dimension group][pair of keys][dimension]
  const int64_t nblocks = (L + bs - 1) / bs;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t t0 = 0; t0 < L; t0 += 32) {
    const int64_t left = L - t0;
    const __mmask16 first = left >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << left) - 1u);
    const __mmask16 second = left >= 32 ? 0xFFFF : left <= 16 ? 0 : static_cast<__mmask16>((1u << (left - 16)) - 1u);
    for (int64_t g = 0; g < G; ++g) {
      const __m512 p0 = _mm512_maskz_loadu_ps(first, probs + g * L + t0);
      const __m512 p1 = _mm512_maskz_loadu_ps(second, probs + g * L + t0 + 16);
      __m256i lo0, lo1;
      _mm256_store_si256(reinterpret_cast<__m256i*>(hi[g]), kvreplay_simd::split_bf16(p0, &lo0));
      _mm256_store_si256(reinterpret_cast<__m256i*>(hi[g] + 16), kvreplay_simd::split_bf16(p1, &lo1));
      _mm256_store_si256(reinterpret_cast<__m256i*>(lo[g]), lo0);
      _mm256_store_si256(reinterpret_cast<__m256i*>(lo[g] + 16), lo1);
    }
    for (int half = 0; half < 2; ++half) {
      const int64_t blk = t0 / bs + half;
      const int64_t rows = blk < nblocks ? std::min(bs, L - blk * bs) : 0;
      const c10::BFloat16* v = rows > 0 ? vh + table[blk] * bs * D : nullptr;
      for (int k = 0; k < 8; ++k) {
        const int64_t key = 2 * k;
        const __m512i a0 = key < rows ? _mm512_loadu_si512(v + key * D) : _mm512_setzero_si512();
        const __m512i a1 = key < rows ? _mm512_loadu_si512(v + key * D + 32) : _mm512_setzero_si512();
        const __m512i b0 = key + 1 < rows ? _mm512_loadu_si512(v + (key + 1) * D) : _mm512_setzero_si512();
        const __m512i b1 = key + 1 < rows ? _mm512_loadu_si512(v + (key + 1) * D + 32) : _mm512_setzero_si512();
        const int row = half * 8 + k;
        _mm512_store_si512(values[0][row], _mm512_unpacklo_epi16(a0, b0));
        _mm512_store_si512(values[1][row], _mm512_unpackhi_epi16(a0, b0));
        _mm512_store_si512(values[2][row], _mm512_unpacklo_epi16(a1, b1));
        _mm512_store_si512(values[3][row], _mm512_unpackhi_epi16(a1, b1));
      }
    }
    kvreplay_amx::before_tile_loads();
    _tile_loadd(4, hi, 64);
    _tile_loadd(5, lo, 64);
    _tile_loadd(6, values[0], 64);
    _tile_loadd(7, values[1], 64);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(0, 5, 6);
    _tile_dpbf16ps(1, 5, 7);
    _tile_loadd(6, values[2], 64);
    _tile_loadd(7, values[3], 64);
    _tile_dpbf16ps(2, 4, 6);
    _tile_dpbf16ps(3, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
    kvreplay_amx::before_tile_loads();  // the next round's stores stay after these loads
  }
  alignas(64) float out[4][16][16];
  _tile_stored(0, out[0], 64);
  _tile_stored(1, out[1], 64);
  _tile_stored(2, out[2], 64);
  _tile_stored(3, out[3], 64);
  for (int64_t g = 0; g < G; ++g)
    for (int t = 0; t < 4; ++t)
      for (int c = 0; c < 16; ++c) acc[g * D + 32 * (t / 2) + 8 * (c / 4) + 4 * (t % 2) + c % 4] = out[t][g][c];
}
#else
constexpr bool kHaveAmxScores = false;
inline bool amx_scores_permitted() { return false; }
inline void attention_tiles_config() {}
inline void values_on_tiles(const float*, const c10::BFloat16*, const int64_t*, int64_t, int64_t, int64_t, float*) {}
inline void release_tiles() {}
template <int D> inline void load_query_tiles(const c10::BFloat16*, int64_t) {}
template <int D, typename Keys, typename Prefetch>
inline void scores_on_tiles(Keys, Prefetch, int64_t, int64_t, int64_t, int64_t, float, float*) {}
#endif

// ---- the entry points of the other sources (registered in decode_attention.cpp) ----
// prefill_attention.cpp
bool has_prefill_causal();
at::Tensor prefill_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                          int64_t offset);
// need_detector.cpp
std::tuple<at::Tensor, at::Tensor> need_block_mass(
    const at::Tensor& query, const at::Tensor& codes, const at::Tensor& lo, const at::Tensor& hi,
    const at::Tensor& slot_table, const at::Tensor& valid, const at::Tensor& resident_lse, int64_t top_blocks);

}  // namespace kvreplay_attention
