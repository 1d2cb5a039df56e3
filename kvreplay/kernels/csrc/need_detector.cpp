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
#include "attention.h"

namespace kvreplay_attention {
namespace {
inline void widen_half(const at::Half* src, float* dst, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(dst + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))));
#endif
  for (; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

}  // namespace

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
}  // namespace kvreplay_attention
