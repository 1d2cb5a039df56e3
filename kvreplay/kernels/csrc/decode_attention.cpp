// Paged decode attention for CPU: one query token per sequence, reading K/V straight from the
// block-paged cache (no gathered copy), fp32 softmax and accumulation, each row attending to
// exactly its own context length (no padding to the longest row).
//
//   query        [B, Hq, D]              bf16 or fp32; a row's heads contiguous, rows any stride
//   key_cache    [Hkv, num_blocks, bs, D] same dtype (one layer's K); value_cache likewise
//   block_tables [B, W] int64           row b's blocks in position order (padding never read)
//   context_lens [B] int64              tokens row b attends to (its last block may be partial)
//
// Returns (out [B, Hq, D], lse [B, Hq] fp32, mass [B, Hkv, W] fp32). lse (log-sum-exp of the scaled
// scores, for the need detector) and mass (per block, the largest share any of the KV head's G
// query heads gives it, for the importance signal) are filled only when asked, else empty.
//
// Work is split over (sequence, KV head) pairs, a long row's pairs into chunks of 32 blocks
// (merged by their log-sum-exps; see decode_rows), which the threads claim a few at a time; the
// G = Hq / Hkv query heads that share a KV head are handled together: each value row is widened
// to fp32 once for all of them, and with AVX512-BF16 the bf16 keys are never widened (pair dot
// products on the raw bf16 rows); with AVX2 only, the same block steps run on 8 lanes, bf16 keys
// and values widened in registers once for all heads, in pair order (widen_pairs16). On a CPU
// with AMX tiles, bf16 rows with 16-token blocks and a head size of 64 or 128 take their scores
// (and at 64 their values too) from tile multiplies instead (below; KVREPLAY_AMX_ATTENTION=0
// keeps the vector path): ~1.3x less time with the cache in L2, about the same from memory.
// The file also holds the need detector's scoring of dropped blocks (need_block_mass, below).
// Built on first use by kvreplay/kernels/cpu_kernels.py; the pure PyTorch path in attention.py
// computes the same thing and stays the reference.
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

namespace {

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
bool amx_scores_permitted() {
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

// o[i] = acc[i] rounded to T (to nearest even, as static_cast); 16 lanes at a time for bf16
template <typename T>
inline void store_rows(const float* acc, T* o, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>)
    for (; i + 16 <= n; i += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + i), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(acc + i)));
#elif defined(KVREPLAY_HAVE_AVX2) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, c10::BFloat16>)  // (store_rounded8 rounds as c10 does, NaN included)
    for (; i + 8 <= n; i += 8) kvreplay_simd::store_rounded8(reinterpret_cast<uint16_t*>(o + i), _mm256_loadu_ps(acc + i));
#endif
  for (; i < n; ++i) o[i] = static_cast<T>(acc[i]);
}

// The element types and head sizes the tiles take (with 16-token blocks and G <= 16, checked per call).
template <typename T, int FixedD>
constexpr bool kTilesTake = kHaveAmxScores && std::is_same_v<T, c10::BFloat16> && (FixedD == 64 || FixedD == 128);

// One (sequence, KV head) pair: G query rows against the L keys and values listed by `table`.
// FixedD > 0 makes the head size a compile-time constant (unrolled, vectorized dot products).
// `scores` holds G * L floats, `buf` one widened block (bs * D floats).
template <typename T, int FixedD>
void attend_one(const T* __restrict q, const T* __restrict kh, const T* __restrict vh,
                const int64_t* __restrict table, int64_t L, int64_t G, int64_t head_dim, int64_t bs,
                float scale, float* __restrict qf, float* __restrict acc, float* __restrict scores,
                float* __restrict buf, T* __restrict o, float* __restrict lse, float* __restrict mass,
                float* __restrict o_fp32 = nullptr, bool on_tiles = false) {
  const int64_t D = FixedD > 0 ? FixedD : head_dim;
  widen(q, qf, G * D);
  for (int64_t i = 0; i < G * D; ++i) { qf[i] *= scale; acc[i] = 0.f; }
  const int64_t nblocks = (L + bs - 1) / bs;
  constexpr bool fast = kVectorBlocks && kLoads16<T> && FixedD > 0 && FixedD % 32 == 0;
  const bool blocks16 = fast && bs == 16;
  // bf16 rows on AVX2: the query and the accumulators in pair order (see widen_pairs16)
  constexpr bool pair_steps = fast && kPairSteps && std::is_same_v<T, c10::BFloat16>;
  if constexpr (pair_steps) {
    if (blocks16) to_pair_order(qf, G * D);
  }
  // on_tiles: the caller set attention_tiles_config (bf16, D 64 or 128, G <= 16, 16-token blocks)
  if constexpr (kTilesTake<T, FixedD>) {
    if (on_tiles) load_query_tiles<FixedD>(reinterpret_cast<const c10::BFloat16*>(q), G);
  }
  if constexpr (fast) {
    if (blocks16)
      for (int64_t blk = 0; blk < std::min(kPrefetchAhead, nblocks); ++blk)
        prefetch_to_l1(kh + table[blk] * bs * D, bs * D);
  }
  auto prefetch = [&](int64_t blk) {
    if (blk + kPrefetchAhead < nblocks) prefetch_to_l2(kh + table[blk + kPrefetchAhead] * bs * D, bs * D);
    if (blk + 1 < nblocks) prefetch_to_l1(kh + table[blk + 1] * bs * D, bs * D);
    prefetch_to_l2(vh + table[blk] * bs * D, bs * D);
  };
  bool scored = false;
  if constexpr (kTilesTake<T, FixedD>) {
    if (on_tiles) {
      auto keys = [&](int64_t blk) { return reinterpret_cast<const c10::BFloat16*>(kh + table[blk] * bs * D); };
      scores_on_tiles<FixedD>(keys, prefetch, nblocks, bs, L, G, scale, scores);
      scored = true;
    }
  }
  for (int64_t blk = 0; blk < nblocks && !scored; ++blk) {  // scores, one cache block at a time
    const int64_t rows = std::min(bs, L - blk * bs);
    if constexpr (fast) {
      if (blocks16) {
        prefetch(blk);
        if constexpr (kHaveBf16Dot && std::is_same_v<T, c10::BFloat16> && FixedD % 32 == 0)
          block_scores16_bf16<FixedD>(q, kh + table[blk] * bs * D, rows, G, L, scale, scores + blk * bs);
        else if constexpr (pair_steps)
          pair_scores16<FixedD>(qf, reinterpret_cast<const c10::BFloat16*>(kh + table[blk] * bs * D), rows, G, L,
                                scores + blk * bs);
        else
          block_scores16<FixedD>(qf, kh + table[blk] * bs * D, rows, G, L, scores + blk * bs);
        continue;
      }
    }
    widen(kh + table[blk] * bs * D, buf, rows * D);
    for (int64_t r = 0; r < rows; ++r) {
      const float* k = buf + r * D;
      for (int64_t g = 0; g < G; ++g) {
        const float* qg = qf + g * D;
        float s = 0.f;
#pragma omp simd reduction(+ : s)
        for (int64_t d = 0; d < D; ++d) s += qg[d] * k[d];
        scores[g * L + blk * bs + r] = s;
      }
    }
  }
  for (int64_t g = 0; g < G; ++g) {  // softmax per query row, in fp32
    float* sg = scores + g * L;
    float m = sg[0];
    float sum = 0.f;
    if constexpr (kVectorBlocks) {
      m = max_of(sg, L);
      sum = exp_shifted(sg, L, m);
    } else {
      for (int64_t t = 1; t < L; ++t) m = std::max(m, sg[t]);
      for (int64_t t = 0; t < L; ++t) { sg[t] = std::exp(sg[t] - m); sum += sg[t]; }
    }
    const float inv = 1.f / sum;
#pragma omp simd
    for (int64_t t = 0; t < L; ++t) sg[t] *= inv;
    if (lse) lse[g] = m + std::log(sum);
  }
  if (mass) {
    for (int64_t blk = 0; blk < nblocks; ++blk) {
      const int64_t rows = std::min(bs, L - blk * bs);
      float best = 0.f;
      for (int64_t g = 0; g < G; ++g) {
        const float* sg = scores + g * L + blk * bs;
        float share = 0.f;
        for (int64_t r = 0; r < rows; ++r) share += sg[r];
        best = std::max(best, share);
      }
      mass[blk] = best;
    }
  }
  bool valued = false;
  if constexpr (kTilesTake<T, FixedD> && FixedD == 64) {
    if (on_tiles) {
      values_on_tiles(scores, reinterpret_cast<const c10::BFloat16*>(vh), table, L, G, bs, acc);
      valued = true;
    }
  }
  for (int64_t blk = 0; blk < nblocks && !valued; ++blk) {  // probabilities times values
    const int64_t rows = std::min(bs, L - blk * bs);
    if constexpr (fast) {
      if (blocks16) {
        // the values two blocks on into L1 (the score pass only asked for them into L2): with
        // scattered blocks, 30 layers x 32 rows x 144 tokens took 16 -> 10 ms with this and the
        // pair steps (8.9 ms in the cache's order, where the hardware prefetcher follows)
        if (blk == 0)
          for (int64_t i = 0; i < std::min<int64_t>(2, nblocks); ++i) prefetch_to_l1(vh + table[i] * bs * D, bs * D);
        if (blk + 2 < nblocks) prefetch_to_l1(vh + table[blk + 2] * bs * D, bs * D);
        if constexpr (pair_steps)
          pair_values16<FixedD>(scores + blk * bs, reinterpret_cast<const c10::BFloat16*>(vh + table[blk] * bs * D),
                                rows, G, L, acc);
        else
          block_values16<FixedD>(scores + blk * bs, vh + table[blk] * bs * D, rows, G, L, acc);
        continue;
      }
    }
    widen(vh + table[blk] * bs * D, buf, rows * D);
    for (int64_t r = 0; r < rows; ++r) {
      const float* v = buf + r * D;
      for (int64_t g = 0; g < G; ++g) {
        const float p = scores[g * L + blk * bs + r];
        float* ag = acc + g * D;
#pragma omp simd
        for (int64_t d = 0; d < D; ++d) ag[d] += p * v[d];
      }
    }
  }
  if constexpr (pair_steps) {
    if (blocks16 && !valued) from_pair_order(acc, G * D);
  }
  if (o_fp32)  // a chunk of a split row: merged with the others' before rounding
    std::memcpy(o_fp32, acc, G * D * sizeof(float));
  else
    store_rows(acc, o, G * D);
}

// A row longer than kSplitBlocks cache blocks is split into chunks of that many, each its own
// task (softmax over its own keys; fp32 output and log-sum-exp), merged once all are done. With
// two threads and a few (sequence, KV head) pairs the threads otherwise wait on the odd pair
// out: one 3,000-token row has 3 pairs, one thread reads two and the other one. The split
// depends only on the row's own length, so a row's output does not depend on the other rows.
// Not when mass is asked for (its shares need the whole row's normalization).
constexpr int64_t kSplitBlocks = 32;

template <typename T, int FixedD>
void decode_rows(const T* q, int64_t q_row, const T* kc, const T* vc, const int64_t* tables,
                 const int64_t* ctx, T* out, Outputs extra, int64_t B, int64_t Hkv, int64_t G, int64_t D,
                 int64_t NB, int64_t bs, int64_t W, float scale) {
  const int64_t head_stride = NB * bs * D;  // one KV head's slab of the cache
  const int64_t chunk_tokens = extra.mass ? std::numeric_limits<int64_t>::max() / 2 : kSplitBlocks * bs;
  // row b's tasks are first[b] .. first[b + 1] - 1: for each KV head in order, its chunks in order
  std::vector<int64_t> first(B + 1, 0);
  int64_t longest = 0;
  for (int64_t b = 0; b < B; ++b) {
    longest = std::max(longest, std::min(ctx[b], chunk_tokens));
    first[b + 1] = first[b] + Hkv * ((ctx[b] + chunk_tokens - 1) / chunk_tokens);
  }
  const int64_t tasks = first[B];
  const bool any_split = tasks > B * Hkv;
  std::vector<float> part_out(any_split ? tasks * G * D : 0), part_lse(any_split ? tasks * G : 0);
  struct Task { int64_t b, h, c, chunks; };
  auto locate = [&](int64_t task) {
    const int64_t b = std::upper_bound(first.begin(), first.end(), task) - first.begin() - 1;
    const int64_t chunks = (first[b + 1] - first[b]) / Hkv, local = task - first[b];
    return Task{b, local / chunks, local % chunks, chunks};
  };
  const bool on_tiles = kTilesTake<T, FixedD> && bs == 16 &&
                        G <= 16 && amx_scores_permitted();
  // the threads claim chunks of tasks as they finish the last (ChunkClaims): with fixed halves
  // the faster thread waited at the end of every layer's attention
  kvreplay_scratch::ChunkClaims claims(tasks, at::get_num_threads());
  auto run_tasks = [&](int64_t begin, int64_t end, float* qf) {
    float* acc = qf + G * D;
    float* scores = acc + G * D;
    float* buf = scores + G * longest;
    Task t = locate(begin);
    for (int64_t task = begin; task < end; ++task) {
      const Task next = task + 1 < end ? locate(task + 1) : t;
      if (task + 1 < end) {  // the next task's first key blocks, so that it does not start on a stall
        const int64_t blocks = std::min(kPrefetchAhead, (std::min(chunk_tokens, ctx[next.b] - next.c * chunk_tokens) + bs - 1) / bs);
        const int64_t* row = tables + next.b * W + next.c * (chunk_tokens / bs);
        for (int64_t i = 0; i < blocks; ++i) prefetch_to_l2(kc + next.h * head_stride + row[i] * bs * D, bs * D);
      }
      const int64_t head = t.b * Hkv * G + t.h * G;  // query heads h*G .. h*G+G-1 of sequence b
      const T* qh = q + t.b * q_row + t.h * G * D;
      if (t.chunks == 1) {
        attend_one<T, FixedD>(qh, kc + t.h * head_stride, vc + t.h * head_stride, tables + t.b * W,
                              ctx[t.b], G, D, bs, scale, qf, acc, scores, buf, out + head * D,
                              extra.lse ? extra.lse + head : nullptr,
                              extra.mass ? extra.mass + (t.b * Hkv + t.h) * W : nullptr, nullptr, on_tiles);
      } else {
        const int64_t start = t.c * chunk_tokens;
        attend_one<T, FixedD>(qh, kc + t.h * head_stride, vc + t.h * head_stride,
                              tables + t.b * W + start / bs, std::min(chunk_tokens, ctx[t.b] - start), G, D, bs,
                              scale, qf, acc, scores, buf, nullptr, part_lse.data() + task * G, nullptr,
                              part_out.data() + task * G * D, on_tiles);
      }
      t = next;
    }
  };
  at::parallel_for(0, claims.threads(), 1, [&](int64_t, int64_t) {
    if (on_tiles) attention_tiles_config();
    float* qf = kvreplay_scratch::thread_buffer<float>(2 * G * D + G * longest + bs * D);
    claims.run([&](int64_t begin, int64_t end) { run_tasks(begin, end, qf); });
    if (on_tiles) release_tiles();
  });
  if (!any_split) return;
  at::parallel_for(0, B * Hkv, 1, [&](int64_t begin, int64_t end) {  // merge the split rows' chunks
    std::vector<float> merged(D), weights;
    for (int64_t pair = begin; pair < end; ++pair) {
      const int64_t b = pair / Hkv, h = pair % Hkv, chunks = (first[b + 1] - first[b]) / Hkv;
      if (chunks == 1) continue;
      const int64_t task0 = first[b] + h * chunks, head = b * Hkv * G + h * G;
      weights.resize(chunks);
      for (int64_t g = 0; g < G; ++g) {
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t c = 0; c < chunks; ++c) m = std::max(m, part_lse[(task0 + c) * G + g]);
        float total = 0.f;
        for (int64_t c = 0; c < chunks; ++c) {
          weights[c] = std::exp(part_lse[(task0 + c) * G + g] - m);
          total += weights[c];
        }
        std::fill(merged.begin(), merged.end(), 0.f);
        for (int64_t c = 0; c < chunks; ++c) {
          const float* o = part_out.data() + ((task0 + c) * G + g) * D;
          const float w = weights[c] / total;
          for (int64_t d = 0; d < D; ++d) merged[d] += w * o[d];
        }
        T* dst = out + (head + g) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<T>(merged[d]);
        if (extra.lse) extra.lse[head + g] = m + std::log(total);
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_attention(
    const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, bool want_lse,
    bool want_mass) {
  TORCH_CHECK(query.dim() == 3 && key_cache.dim() == 4, "query [B, Hq, D], cache [Hkv, NB, bs, D]");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "contiguous caches expected");
  // a row's query heads must lie together (a view into the fused QKV output is taken as it is)
  const at::Tensor q = query.stride(2) == 1 && (query.size(1) == 1 || query.stride(1) == query.size(2))
                           ? query : query.contiguous();
  TORCH_CHECK(key_cache.scalar_type() == query.scalar_type() &&
              value_cache.scalar_type() == query.scalar_type() && value_cache.sizes() == key_cache.sizes(),
              "query, key and value caches must share dtype (and the caches their shape)");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "int64 tables and lengths expected");
  const int64_t B = query.size(0), Hq = query.size(1), D = query.size(2);
  const int64_t Hkv = key_cache.size(0), NB = key_cache.size(1), bs = key_cache.size(2);
  TORCH_CHECK(Hq % Hkv == 0 && key_cache.size(3) == D, "head shapes disagree");
  auto tables = block_tables.contiguous();
  auto ctx = context_lens.contiguous();
  TORCH_CHECK(tables.dim() == 2 && tables.size(0) == B && ctx.numel() == B, "one table row per query");
  const int64_t W = tables.size(1);
  {  // one pass over what will be read (tensor reductions cost ~20 us per call, 30 calls a step)
    const int64_t* lens = ctx.data_ptr<int64_t>();
    const int64_t* ids = tables.data_ptr<int64_t>();
    for (int64_t b = 0; b < B; ++b) {
      TORCH_CHECK(lens[b] >= 1 && lens[b] <= W * bs,
                  "context lengths must lie in [1, table width x block size], got ", lens[b]);
      for (int64_t i = 0; i < (lens[b] + bs - 1) / bs; ++i)
        TORCH_CHECK(ids[b * W + i] >= 0 && ids[b * W + i] < NB, "block ids outside the cache: ", ids[b * W + i]);
    }
  }
  auto out = at::empty({B, Hq, D}, query.options());
  auto fp32 = query.options().dtype(at::kFloat);
  auto lse = want_lse ? at::empty({B, Hq}, fp32) : at::empty({0}, fp32);
  auto mass = want_mass ? at::zeros({B, Hkv, W}, fp32) : at::empty({0}, fp32);
  Outputs extra;
  if (want_lse) extra.lse = lse.data_ptr<float>();
  if (want_mass) extra.mass = mass.data_ptr<float>();
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "decode_attention", [&] {
    auto run = [&](auto kernel) {
      kernel(q.data_ptr<scalar_t>(), B > 1 ? q.stride(0) : Hq * D, key_cache.data_ptr<scalar_t>(),
             value_cache.data_ptr<scalar_t>(),
             tables.data_ptr<int64_t>(), ctx.data_ptr<int64_t>(), out.data_ptr<scalar_t>(), extra, B,
             Hkv, Hq / Hkv, D, NB, bs, W, static_cast<float>(scale));
    };
    if (D == 64) run(decode_rows<scalar_t, 64>);
    else if (D == 128) run(decode_rows<scalar_t, 128>);
    else run(decode_rows<scalar_t, 0>);
  });
  return {out, lse, mass};
}


// ---------------------------------------------------------------------------------------------
// Causal attention of a prompt chunk over its cached positions and itself, bf16 with AVX512-BF16:
// the prefill path of attention.py when every position before the chunk is resident. PyTorch's
// CPU SDPA spends ~360 us on one 128-token chunk of the default model's 9 heads (~27 GFLOP/s);
// here both products run as pair dot products on the raw bf16 values.
//
//   q [C, Hq, D] bf16, its heads D apart (a view into the fused QKV output); k and v [offset + C,
//   Hkv, D], keys of positions 0 .. offset + C - 1 in order, any token and head strides (the
//   chunk's own K/V, or the cache's gathered rows). Query i is position offset + i and sees keys
//   up to it. Returns out [C, Hq, D] bf16.
//
// Per KV head, K is packed once into 16-key blocks whose lanes hold (k[key][2j], k[key][2j+1])
// pairs, and V into key pairs whose lanes hold (v[2i][d], v[2i+1][d]). A task is one KV head and
// a tile of 16 query tokens: its G x 16 query rows score every key block up to the tile's last
// position (fp32 sums, scaled, keys past each row's position masked), take an fp32 softmax per
// row, split each probability into two bf16 parts (high + low: ~16 bits kept) and sum the values
// with fp32 sums (one pair dot product per part).
#if defined(__AVX512F__) && defined(__AVX512BF16__)
constexpr bool kHavePrefillKernel = true;

inline __m512 bcast_pair(const c10::BFloat16* p) {
  int32_t pair;
  std::memcpy(&pair, p, sizeof(pair));
  return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
}

// out rows r0 .. r0 + RV of a task = their probabilities (bf16 high parts rows Lp apart, low parts
// `low` further on) times the packed values of the task's KV head, fp32 sums; rows past the
// chunk's last token are not written
template <int D, int RV>
inline void prefill_values(const c10::BFloat16* probs, int64_t low, int64_t Lp, const uint32_t* vh, int64_t L, int64_t r0,
                           int64_t first, int64_t tokens, int64_t h, int64_t G, int64_t Hq, c10::BFloat16* out) {
  constexpr int NC = D / 16;
  __m512 acc[RV][NC];
  for (int r = 0; r < RV; ++r)
    for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < L / 2; ++pair) {
    __m512bh vv[NC];  // the key pair's values, loaded once for every row
    for (int c = 0; c < NC; ++c) vv[c] = (__m512bh)_mm512_loadu_si512(vh + (pair * NC + c) * 16);
    for (int r = 0; r < RV; ++r) {
      const __m512bh hi = (__m512bh)bcast_pair(probs + r * Lp + 2 * pair);
      const __m512bh lo = (__m512bh)bcast_pair(probs + low + r * Lp + 2 * pair);
      for (int c = 0; c < NC; ++c) acc[r][c] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(acc[r][c], hi, vv[c]), lo, vv[c]);
    }
  }
  for (int r = 0; r < RV; ++r) {
    const int64_t row = r0 + r, g = row / 16, i = row % 16;
    if (i >= tokens) continue;
    c10::BFloat16* dst = out + ((first + i) * Hq + h * G + g) * D;
    for (int c = 0; c < NC; ++c)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 16 * c), (__m256i)_mm512_cvtneps_pbh(acc[r][c]));
  }
}

template <int D>
void prefill_causal_rows(const c10::BFloat16* q, const c10::BFloat16* k, const c10::BFloat16* v,
                         int64_t sq, int64_t skt, int64_t skh, int64_t svt, int64_t svh,
                         c10::BFloat16* out, int64_t C, int64_t Lk, int64_t offset, int64_t Hkv,
                         int64_t G, float scale) {
  constexpr int J = D / 2;   // key pairs per row of K (dot-product steps)
  constexpr int NC = D / 16; // 16-lane chunks of a value row
  const int64_t nkb = (Lk + 15) / 16, Lp = nkb * 16, ntiles = (C + 15) / 16, Hq = Hkv * G;
  // Packed K: [Hkv][nkb][J][16] pairs; packed V: [Hkv][Lp / 2][NC][16] pairs (32-bit each).
  std::vector<uint32_t> kp(Hkv * nkb * J * 16), vp(Hkv * (Lp / 2) * NC * 16);
  at::parallel_for(0, Hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      uint32_t* kh = kp.data() + h * nkb * J * 16;
      for (int64_t key = 0; key < Lp; ++key) {
        const uint32_t* row = key < Lk ? reinterpret_cast<const uint32_t*>(k + key * skt + h * skh) : nullptr;
        for (int j = 0; j < J; ++j) kh[((key / 16) * J + j) * 16 + key % 16] = row ? row[j] : 0u;
      }
      uint16_t* vh = reinterpret_cast<uint16_t*>(vp.data() + h * (Lp / 2) * NC * 16);
      for (int64_t key = 0; key < Lp; ++key) {
        const uint16_t* row = key < Lk ? reinterpret_cast<const uint16_t*>(v + key * svt + h * svh) : nullptr;
        for (int d = 0; d < D; ++d)  // lane d % 16 of chunk d / 16 of pair key / 2, half key % 2
          vh[(((key / 2) * NC + d / 16) * 16 + d % 16) * 2 + key % 2] = row ? row[d] : 0;
      }
    }
  });
  const int64_t R = G * 16;  // query rows of a task: row g * 16 + i is token 16 t + i, head h G + g
  at::parallel_for(0, Hkv * ntiles, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(R * Lp);
    std::vector<c10::BFloat16> probs(2 * R * Lp), qrows(R * D);  // high parts, then low parts
    for (int64_t task = begin; task < end; ++task) {
      const int64_t t = task % ntiles, h = task / ntiles;  // tiles of one head in a row: K stays warm
      const int64_t first = t * 16, tokens = std::min<int64_t>(16, C - first);
      // token first + i (position offset + first + i) sees keys 0 .. offset + first + i
      const int64_t limit = offset + first, blocks = std::min(nkb, (limit + 15) / 16 + 1), L = blocks * 16;
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < 16; ++i) {
          c10::BFloat16* dst = qrows.data() + (g * 16 + i) * D;
          if (i < tokens) std::memcpy(dst, q + (first + i) * sq + (h * G + g) * D, D * sizeof(c10::BFloat16));
          else std::memset(dst, 0, D * sizeof(c10::BFloat16));
        }
      const uint32_t* kh = kp.data() + h * nkb * J * 16;
      const __m512 scaling = _mm512_set1_ps(scale);
      const __m512 minus_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
      const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
      constexpr int RG = 8;  // query rows sharing each loaded key pair
      for (int64_t r0 = 0; r0 < R; r0 += RG) {
        for (int64_t kb = 0; kb < blocks; ++kb) {
          __m512 acc[RG];
          for (int r = 0; r < RG; ++r) acc[r] = _mm512_setzero_ps();
          const uint32_t* block = kh + kb * J * 16;
          for (int j = 0; j < J; ++j) {
            const __m512bh kv = (__m512bh)_mm512_loadu_si512(block + j * 16);
            for (int r = 0; r < RG; ++r)
              acc[r] = _mm512_dpbf16_ps(acc[r], (__m512bh)bcast_pair(qrows.data() + (r0 + r) * D + 2 * j), kv);
          }
          for (int r = 0; r < RG; ++r) {
            __m512 s = _mm512_mul_ps(acc[r], scaling);
            if (kb * 16 + 15 > limit) {  // a block reaching past the tile's first token: mask by row
              const int64_t last = limit + (r0 + r) % 16 - kb * 16;  // the row's last key, in lanes
              const __mmask16 future = _mm512_cmpgt_epi32_mask(lanes, _mm512_set1_epi32(static_cast<int>(last)));
              s = _mm512_mask_mov_ps(s, future, minus_inf);
            }
            _mm512_storeu_ps(scores.data() + (r0 + r) * Lp + kb * 16, s);
          }
        }
      }
      for (int64_t r = 0; r < R; ++r) {  // fp32 softmax per row, probabilities in two bf16 parts
        float* sr = scores.data() + r * Lp;
        __m512 mv = minus_inf;
        for (int64_t c = 0; c < L; c += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sr + c));
        const float inv = 1.f / exp_shifted(sr, L, _mm512_reduce_max_ps(mv));
        c10::BFloat16* pr = probs.data() + r * Lp;
        const int64_t last = limit + r % 16;  // masked scores leave exp16's clamp (~1e-38): zero them
        for (int64_t c = 0; c < L; c += 16) {
          __m512 p = _mm512_mul_ps(_mm512_loadu_ps(sr + c), _mm512_set1_ps(inv));
          if (c + 15 > last)
            p = _mm512_maskz_mov_ps(_mm512_cmple_epi32_mask(lanes, _mm512_set1_epi32(static_cast<int>(last - c))), p);
          __m256i lo;  // p = hi + lo, two bf16 parts (~16 bits)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + c), kvreplay_simd::split_bf16(p, &lo));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(pr + Lp * R + c), lo);
        }
      }
      const uint32_t* vh = vp.data() + h * (Lp / 2) * NC * 16;
      constexpr int RV = D <= 64 ? 6 : 2;  // rows whose NC accumulators (and NC values) fit 32 registers
      int64_t r0 = 0;
      for (; r0 + RV <= R; r0 += RV)
        prefill_values<D, RV>(probs.data() + r0 * Lp, R * Lp, Lp, vh, L, r0, first, tokens, h, G, Hq, out);
      switch (R - r0) {  // G * 16 rows: a tail of 4 or 2 rows when G is not a multiple of 3
        case 4: prefill_values<D, 4>(probs.data() + r0 * Lp, R * Lp, Lp, vh, L, r0, first, tokens, h, G, Hq, out); break;
        case 2: prefill_values<D, 2>(probs.data() + r0 * Lp, R * Lp, Lp, vh, L, r0, first, tokens, h, G, Hq, out); break;
        default: break;
      }
    }
  });
}
#else
constexpr bool kHavePrefillKernel = false;
template <int D>
void prefill_causal_rows(const c10::BFloat16*, const c10::BFloat16*, const c10::BFloat16*, int64_t, int64_t,
                         int64_t, int64_t, int64_t, c10::BFloat16*, int64_t, int64_t, int64_t, int64_t,
                         int64_t, float) {}
#endif

bool has_prefill_causal() { return kHavePrefillKernel; }

at::Tensor prefill_causal(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                          int64_t offset) {
  TORCH_CHECK(kHavePrefillKernel, "prefill_causal needs AVX512-BF16 (see has_prefill_causal)");
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_causal: q [C, Hq, D], k and v [L, Hkv, D]");
  TORCH_CHECK(q.scalar_type() == at::kBFloat16 && k.scalar_type() == at::kBFloat16 && v.scalar_type() == at::kBFloat16,
              "prefill_causal: bf16 inputs");
  const int64_t C = q.size(0), Hq = q.size(1), D = q.size(2), Lk = k.size(0), Hkv = k.size(1);
  TORCH_CHECK(C >= 1 && offset >= 0 && Lk == offset + C, "prefill_causal: keys must be the offset's ", offset,
              " cached positions plus the chunk's ", C, ", got ", Lk);
  TORCH_CHECK(k.sizes() == v.sizes() && k.size(2) == D && Hkv >= 1 && Hq % Hkv == 0, "prefill_causal: shapes disagree");
  TORCH_CHECK(D == 64 || D == 128, "prefill_causal: head size 64 or 128");
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D && k.stride(2) == 1 && v.stride(2) == 1,
              "prefill_causal: each head's values must be contiguous (and a token's query heads D apart)");
  auto out = at::empty({C, Hq, D}, q.options());
  auto run = [&](auto kernel) {
    kernel(q.data_ptr<c10::BFloat16>(), k.data_ptr<c10::BFloat16>(), v.data_ptr<c10::BFloat16>(), q.stride(0),
           k.stride(0), k.stride(1), v.stride(0), v.stride(1), out.data_ptr<c10::BFloat16>(), C, Lk, offset, Hkv,
           Hq / Hkv, static_cast<float>(scale));
  };
  if (D == 64) run(prefill_causal_rows<64>);
  else run(prefill_causal_rows<128>);
  return out;
}
}  // namespace

// ---------------------------------------------------------------------------------------------
// Need detector (kvreplay/kv/key_index.py, KeyIndex.max_block_mass): for each probed sequence,
// the largest share of some query head's attention one of its dropped blocks would take. Per
// (sequence, KV head): Quest bounds of every dropped block from the int4 index's min/max, the
// top `top_blocks` dequantized and scored, each block's log-sum-exp set against the resident
// keys' (from the decode kernel) plus those blocks'. Same arithmetic as the PyTorch version.
//
//   query [R, Hkv, G, D] fp32 scaled; codes [Hkv, S, bs, D/2] uint8 (low nibble = even channel);
//   lo, hi [Hkv, S, D] fp16; slot_table [R, N] int64; valid [R, N] bool; resident_lse [R, Hkv, G]
//   fp32. Returns ([R] fp32 the largest share, [R] int64 the slot-table column of the block
//   that takes it: what a replay must bring back).
namespace {

inline void widen_half(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

std::tuple<at::Tensor, at::Tensor> need_block_mass(
    const at::Tensor& query, const at::Tensor& codes, const at::Tensor& lo, const at::Tensor& hi,
    const at::Tensor& slot_table, const at::Tensor& valid, const at::Tensor& resident_lse, int64_t top_blocks) {
  TORCH_CHECK(query.dim() == 4 && query.scalar_type() == at::kFloat, "need_block_mass: fp32 query [R, Hkv, G, D]");
  TORCH_CHECK(codes.dim() == 4 && codes.scalar_type() == at::kByte, "need_block_mass: uint8 codes [Hkv, S, bs, D/2]");
  const int64_t R = query.size(0), Hkv = query.size(1), G = query.size(2), D = query.size(3);
  const int64_t S = codes.size(1), bs = codes.size(2);
  TORCH_CHECK(codes.size(0) == Hkv && codes.size(3) * 2 == D, "need_block_mass: codes disagree with the query");
  TORCH_CHECK(lo.sizes() == hi.sizes() && lo.dim() == 3 && lo.size(0) == Hkv && lo.size(1) == S &&
              lo.size(2) == D && lo.scalar_type() == at::kHalf && hi.scalar_type() == at::kHalf,
              "need_block_mass: fp16 lo/hi [Hkv, S, D]");
  TORCH_CHECK(slot_table.dim() == 2 && slot_table.size(0) == R && slot_table.scalar_type() == at::kLong &&
              valid.sizes() == slot_table.sizes() && valid.scalar_type() == at::kBool,
              "need_block_mass: int64 slot_table and bool valid [R, N]");
  TORCH_CHECK(resident_lse.dim() == 3 && resident_lse.size(0) == R && resident_lse.size(1) == Hkv &&
              resident_lse.size(2) == G && resident_lse.scalar_type() == at::kFloat,
              "need_block_mass: fp32 resident_lse [R, Hkv, G]");
  TORCH_CHECK(top_blocks >= 1, "need_block_mass: top_blocks must be >= 1");
  TORCH_CHECK(codes.size(2) <= 256 && D % 2 == 0, "need_block_mass: blocks of at most 256 tokens, even head size");
  auto q = query.contiguous(); auto cd = codes.contiguous(); auto l = lo.contiguous(); auto h = hi.contiguous();
  auto st = slot_table.contiguous(); auto vd = valid.contiguous(); auto rl = resident_lse.contiguous();
  const int64_t N = st.size(1);
  const int64_t* slots = st.data_ptr<int64_t>();
  const bool* ok = vd.data_ptr<bool>();
  for (int64_t i = 0; i < R * N; ++i)
    TORCH_CHECK(!ok[i] || (slots[i] >= 0 && slots[i] < S), "need_block_mass: slot ", slots[i], " outside the index");
  auto per_head = at::zeros({R, Hkv}, query.options());
  auto per_head_column = at::zeros({R, Hkv}, query.options().dtype(at::kLong));  // where that share is
  const float* qp = q.data_ptr<float>();
  const uint8_t* cp = cd.data_ptr<uint8_t>();
  const at::Half* lp = l.data_ptr<at::Half>();
  const at::Half* hp = h.data_ptr<at::Half>();
  const float* rp = rl.data_ptr<float>();
  float* out = per_head.data_ptr<float>();
  int64_t* out_column = per_head_column.data_ptr<int64_t>();
  const float neg_inf = -std::numeric_limits<float>::infinity();
  const float inv15 = 1.f / 15.f;
  at::parallel_for(0, R * Hkv, 1, [&](int64_t begin, int64_t end) {
    // per task: q split by sign (bounds), q with channels reordered evens-then-odds (the order
    // the packed codes unpack in), one slot's lo/hi, 16 slots' lo/hi (vector bounds), one
    // dequantized block, scores
    std::vector<float> qpos(G * D), qneg(G * D), qperm(G * D), lof(D), hif(D), lop(D), dif(D),
        bound(N), keys(bs * D), summaries(32 * D), block_lse;
    std::vector<int64_t> order;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t r = task / Hkv, kv = task % Hkv;
      const float* qh = qp + task * G * D;  // [G, D]
      for (int64_t i = 0; i < G * D; ++i) {
        qpos[i] = std::max(qh[i], 0.f);
        qneg[i] = std::min(qh[i], 0.f);
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t i = 0; i < D / 2; ++i) {
          qperm[g * D + i] = qh[g * D + 2 * i];
          qperm[g * D + D / 2 + i] = qh[g * D + 2 * i + 1];
        }
      order.clear();
      for (int64_t n = 0; n < N; ++n)
        if (ok[r * N + n]) order.push_back(n);
      // Quest bound of each dropped block: sum_d max(q_d lo_d, q_d hi_d), the max over the heads.
#if defined(__AVX512F__)
      if (D % 16 == 0) {
        // 16 blocks at a time: per head, each block's 16-lane partial sums, then one transposing
        // reduction (lane_sums16) gives the 16 blocks' bounds in one vector.
        __m512 partial[16];
        for (size_t first = 0; first < order.size(); first += 16) {
          const int64_t count = std::min<int64_t>(16, static_cast<int64_t>(order.size() - first));
          for (int64_t i = 0; i < count; ++i) {  // the 16 blocks' lo and hi, widened once for all heads
            const int64_t at = (kv * S + slots[r * N + order[first + i]]) * D;
            widen_half(lp + at, summaries.data() + 2 * i * D, D);
            widen_half(hp + at, summaries.data() + (2 * i + 1) * D, D);
          }
          __m512 best = _mm512_set1_ps(neg_inf);
          for (int64_t g = 0; g < G; ++g) {
            const float* a = qpos.data() + g * D;
            const float* b = qneg.data() + g * D;
            for (int64_t i = 0; i < 16; ++i) {
              __m512 acc = _mm512_setzero_ps();
              const float* lo_i = summaries.data() + 2 * i * D;
              const float* hi_i = lo_i + D;
              if (i < count)
                for (int64_t d = 0; d < D; d += 16) {
                  acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + d), _mm512_loadu_ps(hi_i + d), acc);
                  acc = _mm512_fmadd_ps(_mm512_loadu_ps(b + d), _mm512_loadu_ps(lo_i + d), acc);
                }
              partial[i] = acc;
            }
            best = _mm512_max_ps(best, kvreplay_simd::lane_sums16(partial));
          }
          float sums[16];
          _mm512_storeu_ps(sums, best);
          for (int64_t i = 0; i < count; ++i) bound[order[first + i]] = sums[i];
        }
      } else
#endif
      for (const int64_t n : order) {
        const int64_t at = (kv * S + slots[r * N + n]) * D;
        widen_half(lp + at, lof.data(), D);
        widen_half(hp + at, hif.data(), D);
        float best = -std::numeric_limits<float>::infinity();
        for (int64_t g = 0; g < G; ++g) {
          const float* a = qpos.data() + g * D;
          const float* b = qneg.data() + g * D;
          float sum = 0.f;
#pragma omp simd reduction(+ : sum)
          for (int64_t d = 0; d < D; ++d) sum += a[d] * hif[d] + b[d] * lof[d];
          best = std::max(best, sum);
        }
        bound[n] = best;
      }
      const int64_t k = std::min<int64_t>(top_blocks, static_cast<int64_t>(order.size()));
      std::partial_sort(order.begin(), order.begin() + k, order.end(),
                        [&](int64_t a, int64_t b) { return bound[a] > bound[b]; });
      block_lse.assign(k * G, 0.f);
      for (int64_t j = 0; j < k; ++j) {  // the top blocks: dequantize, score, log-sum-exp
        const int64_t slot = slots[r * N + order[j]];
        widen_half(lp + (kv * S + slot) * D, lof.data(), D);
        widen_half(hp + (kv * S + slot) * D, hif.data(), D);
        for (int64_t i = 0; i < D / 2; ++i) {
          lop[i] = lof[2 * i];
          lop[D / 2 + i] = lof[2 * i + 1];
          dif[i] = (hif[2 * i] - lof[2 * i]) * inv15;
          dif[D / 2 + i] = (hif[2 * i + 1] - lof[2 * i + 1]) * inv15;
        }
        const uint8_t* c = cp + (kv * S + slot) * bs * (D / 2);
        for (int64_t t = 0; t < bs; ++t) {
          const uint8_t* row = c + t * (D / 2);
          float* key = keys.data() + t * D;
#pragma omp simd
          for (int64_t i = 0; i < D / 2; ++i) {
            key[i] = lop[i] + static_cast<float>(row[i] & 0xF) * dif[i];
            key[D / 2 + i] = lop[D / 2 + i] + static_cast<float>(row[i] >> 4) * dif[D / 2 + i];
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qperm.data() + g * D;
#if defined(__AVX512F__)
          if (bs == 16 && D % 16 == 0) {  // the block's 16 scores as one vector, one vector exp
            __m512 partial[16];
            for (int64_t t = 0; t < 16; ++t) {
              __m512 acc = _mm512_setzero_ps();
              for (int64_t d = 0; d < D; d += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + d), _mm512_loadu_ps(keys.data() + t * D + d), acc);
              partial[t] = acc;
            }
            const __m512 scores = kvreplay_simd::lane_sums16(partial);
            const float m = _mm512_reduce_max_ps(scores);
            const float sum = _mm512_reduce_add_ps(kvreplay_simd::exp16(_mm512_sub_ps(scores, _mm512_set1_ps(m))));
            block_lse[j * G + g] = m + std::log(sum);
            continue;
          }
#endif
          float m = -std::numeric_limits<float>::infinity(), sum = 0.f;
          float s[256];
          const int64_t rows = std::min<int64_t>(bs, 256);
          for (int64_t t = 0; t < rows; ++t) {
            const float* key = keys.data() + t * D;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < D; ++d) dot += qg[d] * key[d];
            s[t] = dot;
            m = std::max(m, dot);
          }
          for (int64_t t = 0; t < rows; ++t) sum += std::exp(s[t] - m);
          block_lse[j * G + g] = m + std::log(sum);
        }
      }
      float best = 0.f;  // exp(block lse - lse over resident keys and the top blocks)
      int64_t best_column = order.empty() ? 0 : order[0];
      for (int64_t g = 0; g < G; ++g) {
        const float resident = rp[task * G + g];
        float m = resident;
        for (int64_t j = 0; j < k; ++j) m = std::max(m, block_lse[j * G + g]);
        if (m == -std::numeric_limits<float>::infinity()) continue;
        float sum = std::exp(resident - m);
        for (int64_t j = 0; j < k; ++j) sum += std::exp(block_lse[j * G + g] - m);
        const float total = m + std::log(sum);
        for (int64_t j = 0; j < k; ++j) {
          const float share = std::exp(block_lse[j * G + g] - total);
          if (share > best) {
            best = share;
            best_column = order[j];
          }
        }
      }
      out[task] = best;
      out_column[task] = best_column;
    }
  });
  auto [mass, head] = per_head.max(1);
  return {mass, per_head_column.gather(1, head.unsqueeze(1)).squeeze(1)};
}

// Whether bf16 decode attention (16-token blocks, head size 64 or 128) runs on AMX tiles here.
bool has_amx_attention() { return kHaveAmxScores && amx_scores_permitted(); }

}  // namespace

TORCH_LIBRARY(kvreplay_cpu, m) {
  m.def("decode_attention(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_tables, "
        "Tensor context_lens, float scale, bool want_lse=False, bool want_mass=False) "
        "-> (Tensor, Tensor, Tensor)");
  m.impl("decode_attention", c10::DispatchKey::CPU, &decode_attention);
  m.def("need_block_mass(Tensor query, Tensor codes, Tensor lo, Tensor hi, Tensor slot_table, "
        "Tensor valid, Tensor resident_lse, int top_blocks) -> (Tensor, Tensor)");
  m.impl("need_block_mass", c10::DispatchKey::CPU, &need_block_mass);
  m.def("prefill_causal(Tensor q, Tensor k, Tensor v, float scale, int offset=0) -> Tensor");
  m.impl("prefill_causal", c10::DispatchKey::CPU, &prefill_causal);
  m.def("has_prefill_causal() -> bool", &has_prefill_causal);
  m.def("has_amx_attention() -> bool", &has_amx_attention);
}
