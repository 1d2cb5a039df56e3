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
// (and at 64 their values too) from tile multiplies instead (attention.h; KVREPLAY_AMX_ATTENTION=0
// keeps the vector path): ~1.3x less time with the cache in L2, about the same from memory.
// The extension also holds causal prefill attention (prefill_causal, prefill_attention.cpp) and the
// need detector's scoring of dropped blocks (need_block_mass, need_detector.cpp); block steps in
// attention.h, vector helpers in simd.h. This file registers the extension's ops.
// Built on first use by kvreplay/kernels/cpu_kernels.py; the pure PyTorch path in attention.py
// computes the same thing and stays the reference.
#include "attention.h"

namespace kvreplay_attention {
namespace {

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


// Whether bf16 decode attention (16-token blocks, head size 64 or 128) runs on AMX tiles here.
bool has_amx_attention() { return kHaveAmxScores && amx_scores_permitted(); }

}  // namespace
}  // namespace kvreplay_attention

using namespace kvreplay_attention;

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
