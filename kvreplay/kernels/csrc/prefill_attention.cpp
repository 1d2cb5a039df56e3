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
#include "attention.h"

namespace kvreplay_attention {
namespace {
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

}  // namespace

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
}  // namespace kvreplay_attention
