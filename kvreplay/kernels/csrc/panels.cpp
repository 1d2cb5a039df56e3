// panel_linear and its relatives (panel_linear_float, panel_argmax, panel_silu_mul): pack_panels'
// layout (layer_ops.h) and panel_product, which runs one of the panel kernels (panel_avx512.cpp,
// panel_avx2.cpp, int_products.cpp) over the panels that the threads claim, and scans or combines
// each panel's outputs where they are staged (argmax, SiLU).
#include "layer_ops.h"

namespace kvreplay_layer_ops {
namespace {
bool can_pack_panels(const at::Tensor& w) {
  return w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) % kLanes == 0 && w.size(1) % 2 == 0 &&
         w.size(0) > 0 && w.size(1) > 0;
}
}  // namespace

at::Tensor pack_panels(const at::Tensor& weight) {
  TORCH_CHECK(can_pack_panels(weight), "pack_panels: a bf16 [N, K] weight with N a multiple of 16 and K "
              "even expected, got ", weight.scalar_type(), " ", weight.sizes());
  const int64_t N = weight.size(0), K = weight.size(1), tiles = N / kLanes;
  auto w = weight.contiguous();
  auto out = at::empty({tiles, K / 2, kLanes, 2}, weight.options());  // nominal shape; order above
  const uint32_t* src = reinterpret_cast<const uint32_t*>(w.data_ptr());  // one element: a pair
  uint32_t* dst = reinterpret_cast<uint32_t*>(out.data_ptr());
  at::parallel_for(0, (tiles + kPanelTiles - 1) / kPanelTiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanelTiles * kLanes, width = std::min(kPanelTiles * kLanes, N - n0);
      uint32_t* panel = dst + n0 * K / 2;
      for (int64_t o = 0; o < width; ++o)
        for (int64_t j = 0; j < K / 2; ++j) panel[j * width + o] = src[(n0 + o) * K / 2 + j];
    }
  });
  return out;
}

// (N, K) of the weight a pack_panels or pack_quant_panels tensor holds; an error naming `name`
// for any other tensor
std::pair<int64_t, int64_t> panel_shape(const at::Tensor& packed, const char* name) {
  if (packed.scalar_type() == at::kChar) {  // Q4 records for 8-bit x
    TORCH_CHECK(packed.dim() == 3 && packed.size(2) == kQ4IntRecord && packed.is_contiguous(), name,
                ": weight must come from pack_panels or pack_quant_panels");
    return {packed.size(0) * kLanes, packed.size(1) * kQuantBlock};
  }
  if (packed.scalar_type() == at::kByte) {
    TORCH_CHECK(packed.dim() == 3 && (packed.size(2) == kQ4_1Record || packed.size(2) == kQ8_0Record ||
                                      is_int_record(packed.size(2))) &&
                packed.is_contiguous(), name, ": weight must come from pack_panels or pack_quant_panels");
    return {packed.size(0) * kLanes, packed.size(1) * kQuantBlock};
  }
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == kLanes && packed.size(3) == 2 &&
              packed.scalar_type() == at::kBFloat16 && packed.is_contiguous(),
              name, ": weight must come from pack_panels or pack_quant_panels");
  return {packed.size(0) * kLanes, packed.size(1) * 2};
}

namespace {
#if defined(__AVX512BF16__) || defined(KVREPLAY_AVX2)
// Each row's largest output over the panels one thread computes, in panel order: 16 lanes per row
// keep their largest value and its first index (a later equal value does not replace it), and the
// first NaN is noted (torch.argmax answers a NaN's index, the first). Threads' results merge in
// the order of their panel ranges.
struct RowArgmax {
  int64_t begin = 0;                   // the thread's first panel
  std::vector<float> best;             // [M, 16]
  std::vector<int32_t> index;          // [M, 16]
  std::vector<int64_t> nan;            // [M], -1: none seen
  explicit RowArgmax(int64_t M, int64_t first)
      : begin(first), best(M * 16, -std::numeric_limits<float>::infinity()), index(M * 16, INT32_MAX), nan(M, -1) {}
  // outputs [M, width] (row stride ld) of the panel whose first output is n0
  void scan(const float* outputs, int64_t ld, int64_t M, int64_t n0, int64_t width) {
#if defined(KVREPLAY_AVX2) && !defined(__AVX512BF16__)
    // the 16 lanes as two vectors of 8 (lane j % 16, as below). One output at a time, this was
    // ~1.7% of a batch-32 decode step's samples on the Zen 3 (32 x 49,152 logits a step).
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    for (int64_t m = 0; m < M; ++m) {
      if (nan[m] >= 0) continue;
      __m256 b0 = _mm256_loadu_ps(best.data() + m * 16), b1 = _mm256_loadu_ps(best.data() + m * 16 + 8);
      __m256i i0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index.data() + m * 16));
      __m256i i1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(index.data() + m * 16 + 8));
      for (int64_t j = 0; j < width; j += 16) {
        const __m256 v0 = _mm256_loadu_ps(outputs + m * ld + j), v1 = _mm256_loadu_ps(outputs + m * ld + j + 8);
        const int unordered = _mm256_movemask_ps(_mm256_cmp_ps(v0, v0, _CMP_UNORD_Q)) |
                              (_mm256_movemask_ps(_mm256_cmp_ps(v1, v1, _CMP_UNORD_Q)) << 8);
        if (unordered) {
          nan[m] = n0 + j + __builtin_ctz(unordered);
          break;
        }
        const __m256i at = _mm256_add_epi32(lanes, _mm256_set1_epi32(static_cast<int32_t>(n0 + j)));
        const __m256 g0 = _mm256_cmp_ps(v0, b0, _CMP_GT_OQ), g1 = _mm256_cmp_ps(v1, b1, _CMP_GT_OQ);
        b0 = _mm256_blendv_ps(b0, v0, g0);
        b1 = _mm256_blendv_ps(b1, v1, g1);
        i0 = _mm256_blendv_epi8(i0, at, _mm256_castps_si256(g0));
        i1 = _mm256_blendv_epi8(i1, _mm256_add_epi32(at, _mm256_set1_epi32(8)), _mm256_castps_si256(g1));
      }
      _mm256_storeu_ps(best.data() + m * 16, b0);
      _mm256_storeu_ps(best.data() + m * 16 + 8, b1);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(index.data() + m * 16), i0);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(index.data() + m * 16 + 8), i1);
    }
#elif !defined(__AVX512BF16__)  // one output at a time, lane j % 16: what the vector code keeps
    for (int64_t m = 0; m < M; ++m)
      for (int64_t j = 0; j < width && nan[m] < 0; ++j) {
        const float v = outputs[m * ld + j];
        if (std::isnan(v)) {
          nan[m] = n0 + j;
        } else if (v > best[m * 16 + j % 16]) {
          best[m * 16 + j % 16] = v;
          index[m * 16 + j % 16] = static_cast<int32_t>(n0 + j);
        }
      }
#else
    const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t m = 0; m < M; ++m) {
      if (nan[m] >= 0) continue;
      __m512 b = _mm512_loadu_ps(best.data() + m * 16);
      __m512i bi = _mm512_loadu_si512(index.data() + m * 16);
      for (int64_t j = 0; j < width; j += 16) {
        const __m512 v = _mm512_loadu_ps(outputs + m * ld + j);
        const __mmask16 unordered = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        if (unordered) {
          nan[m] = n0 + j + __builtin_ctz(unordered);
          break;
        }
        const __mmask16 greater = _mm512_cmp_ps_mask(v, b, _CMP_GT_OQ);
        b = _mm512_mask_blend_ps(greater, b, v);
        bi = _mm512_mask_blend_epi32(greater, bi, _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int32_t>(n0 + j))));
      }
      _mm512_storeu_ps(best.data() + m * 16, b);
      _mm512_storeu_si512(index.data() + m * 16, bi);
    }
#endif
  }
};

// Row m's answer over the threads' results (in any order: sorted here by panel range).
void merge_argmax(std::vector<RowArgmax>& parts, int64_t M, int64_t* out) {
  std::sort(parts.begin(), parts.end(), [](const RowArgmax& a, const RowArgmax& b) { return a.begin < b.begin; });
  for (int64_t m = 0; m < M; ++m) {
    int64_t result = -1;
    float top = -std::numeric_limits<float>::infinity();
    for (const auto& part : parts) {
      if (part.nan[m] >= 0) {  // every earlier range held no NaN: this is the first
        result = part.nan[m];
        break;
      }
      for (int lane = 0; lane < 16; ++lane) {
        const float v = part.best[m * 16 + lane];
        const int64_t i = part.index[m * 16 + lane];
        if (i == INT32_MAX) continue;  // the lane saw nothing (or only -inf, kept below)
        if (result < 0 || v > top || (v == top && i < result)) {
          top = v;
          result = i;
        }
      }
    }
    out[m] = result < 0 ? 0 : result;  // every output -inf: torch.argmax says 0
  }
}
#endif

// body(begin, end) over [0, panels) in chunks the threads claim (kvreplay_scratch::ChunkClaims).
// body may run on any thread, several times; chunks come in ascending order, not all to one
// thread (so an argmax keeps one part a chunk).
//
// With jobs > 0, prep(0) .. prep(jobs - 1) first (x's rows quantized, a few rows a job), claimed
// one at a time, and no thread starts on the panels before every job is done. Inside the same
// parallel region rather than before it: on the main thread alone that was ~15 us of a batch-32
// product that the other thread spent waiting (a region of its own cost as much as it saved).
// No thread can wait on a job nobody runs: a job is claimed only by a thread that then runs it.
template <typename Prep, typename Body>
void claim_panels(int64_t jobs, Prep&& prep, int64_t panels, Body&& body) {
  kvreplay_scratch::ChunkClaims claims(panels, at::get_num_threads());
  std::atomic<int64_t> next_job{0}, jobs_done{0};
  at::parallel_for(0, claims.threads(), 1, [&](int64_t, int64_t) {
    for (int64_t job; (job = next_job.fetch_add(1)) < jobs;) {
      prep(job);
      jobs_done.fetch_add(1, std::memory_order_release);
    }
    while (jobs_done.load(std::memory_order_acquire) < jobs) {
#if defined(__x86_64__)
      _mm_pause();
#endif
    }
    claims.run(body);
  });
}
template <typename Body>
void claim_panels(int64_t panels, Body&& body) {
  claim_panels(0, [](int64_t) {}, panels, std::forward<Body>(body));
}
}  // namespace

// `out`: [M, N] (fp32 when widen, else bf16) to write into, or undefined for a new tensor.
// `argmax` (with widen): no outputs stored; instead argmax[m] = the index of row m's largest
// output as `out` would hold it (the first on ties, a NaN's if any): what argmax_rows answers.
// `silu` (bf16, a gate/up weight in pair order): out is [M, N / 2], silu(gate) * up (panel_silu_mul).
at::Tensor panel_product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         bool widen, const char* name, at::Tensor out, int64_t* argmax, bool silu) {
  const auto shape = panel_shape(packed, name);  // plain names: lambdas below capture them
  const int64_t N = shape.first, K = shape.second;
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K && x.scalar_type() == at::kBFloat16,
              name, ": x must be bf16 [M, ", K, "], got ", x.scalar_type(), " ", x.sizes());
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias)
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->scalar_type() == at::kBFloat16,
                name, ": bias must be bf16 [", N, "]");
  auto xc = x.contiguous();
  auto bc = has_bias ? bias->contiguous() : at::Tensor();
  const int64_t M = x.size(0);
  TORCH_CHECK(!silu || (!widen && !argmax && N % 16 == 0), name, ": the SiLU output takes bf16 pairs");
  const int64_t F = N / 2;  // silu: the MLP width
  if (!out.defined() && !argmax)
    out = at::empty({M, silu ? F : N}, x.options().dtype(widen ? at::kFloat : at::kBFloat16));
#if defined(__AVX512BF16__) || defined(KVREPLAY_AVX2)
  if (M == 0) return out;
  // argmax, silu: each thread's panels go to a small buffer (L1) and are scanned / combined there
  constexpr int64_t kPanelWidth = kPanelTiles * kLanes;
  const bool staged = argmax || silu;
  auto* silu_out = silu ? reinterpret_cast<uint16_t*>(out.data_ptr()) : nullptr;
  std::vector<RowArgmax> parts;
  std::mutex parts_lock;
  auto keep_part = [&](RowArgmax&& part) {
    std::lock_guard<std::mutex> guard(parts_lock);
    parts.push_back(std::move(part));
  };
  // a staged panel's outputs (in `local`), once computed: scanned for the argmax, or combined
  auto finish_panel = [&](RowArgmax& part, const float* local, int64_t n0, int64_t width) {
    if (argmax) part.scan(local, kPanelWidth, M, n0, width * kLanes);
    if (silu) silu_panel(reinterpret_cast<const uint16_t*>(local), M, width, silu_out, F, n0 / 2);
  };
  // `run` (either kernel's loop) with where the outputs go: their type, and null when staged
  auto for_outputs = [&](auto&& run) {
    if (argmax)
      run(static_cast<float*>(nullptr));
    else if (silu)
      run(static_cast<uint16_t*>(nullptr));
    else if (widen)
      run(out.data_ptr<float>());
    else
      run(reinterpret_cast<uint16_t*>(out.data_ptr()));
    if (argmax) merge_argmax(parts, M, argmax);
  };
  const auto* xp = reinterpret_cast<const uint16_t*>(xc.data_ptr());
  const auto* bp = has_bias ? reinterpret_cast<const uint16_t*>(bc.data_ptr()) : nullptr;
  const int64_t tiles = N / kLanes;
  // panel p's bf16 weights: in place, or expanded from quantized records into `buffer`
  const bool x8 = packed.scalar_type() == at::kChar;  // Q4 integer records for 8-bit x
  const bool quant = packed.scalar_type() == at::kByte || x8;
  const int64_t record = quant ? packed.size(2) : 0;
  TORCH_CHECK(!is_int_record(record) || kIntProducts, name, ": integer records need the AVX2 kernel");
  const auto* wp = quant ? nullptr : reinterpret_cast<const uint16_t*>(packed.data_ptr());
  const auto* qp = quant ? reinterpret_cast<const uint8_t*>(packed.data_ptr()) : nullptr;
  auto records = [=](int64_t p) { return qp + p * kPanelTiles * (K / kQuantBlock) * record; };  // panel p's
#if defined(__AVX512BF16__)
  const int64_t buffer_size = quant ? kPanelTiles * kLanes * K : 0;
  auto panel_weights = [=](int64_t p, uint16_t* buffer) -> const uint16_t* {
    const int64_t t0 = p * kPanelTiles;
    if (!quant) return wp + t0 * kLanes * K;
    expand_quant_panel(records(p), record, std::min(kPanelTiles, tiles - t0), K, buffer);
    return buffer;
  };
#endif
#if defined(KVREPLAY_AMX)
  if (K % 32 == 0 && amx_permitted()) {
    // blocks of r <= 16 rows, all of r rows, read from x in place; when the rows do not split
    // evenly, the last block's are copied into a zero-padded buffer. (A copy of all of x, as
    // this once did, cost 1.06-1.18x on a step's products at 8-32 rows measured alone, the
    // other thread reading the copy from the first one's cache; docs/benchmarks.md.)
    const int64_t blocks = (M + 15) / 16, r = (M + blocks - 1) / blocks, last = (blocks - 1) * r;
    std::vector<uint16_t> pad;
    if (blocks * r != M) {
      pad.assign(static_cast<size_t>(r * K), 0);
      std::memcpy(pad.data(), xp + last * K, static_cast<size_t>((M - last) * K) * sizeof(uint16_t));
      kvreplay_amx::before_tile_loads();
    }
    const uint16_t* tail = pad.empty() ? nullptr : pad.data();
    auto run_amx = [&](auto* op) {
      claim_panels((tiles + kPanelTiles - 1) / kPanelTiles, [&](int64_t begin, int64_t end) {
        TileConfig config;
        for (int t = 0; t < 8; ++t) {
          config.rows[t] = static_cast<uint8_t>(t == 7 ? 16 : r);  // tile 7: 16 pairs of weights
          config.colsb[t] = 64;
        }
        _tile_loadconfig(&config);
        float* local = staged ? kvreplay_scratch::thread_buffer<float, 1>(M * kPanelWidth) : nullptr;
        RowArgmax part(argmax ? M : 0, begin);
        for (int64_t p = begin; p < end; ++p) {
          const int64_t n0 = p * kPanelTiles * kLanes, width = std::min(kPanelTiles, tiles - p * kPanelTiles);
          const uint16_t* w = quant ? nullptr : wp + n0 * K;
          const uint8_t* q = quant ? records(p) : nullptr;
          const uint16_t* b = bp ? bp + n0 : nullptr;
          auto* o = staged ? reinterpret_cast<decltype(op)>(local) : op + n0;
          const int64_t ld = staged ? kPanelWidth : N;
          switch (width) {
            case 1: amx_rows<1>(xp, tail, r, M, w, q, record, b, o, ld, K); break;
            case 2: amx_rows<2>(xp, tail, r, M, w, q, record, b, o, ld, K); break;
            default: amx_rows<kPanelTiles>(xp, tail, r, M, w, q, record, b, o, ld, K); break;
          }
          finish_panel(part, local, n0, width);
        }
        _tile_release();
        if (argmax) keep_part(std::move(part));
      });
    };
    for_outputs(run_amx);
    return out;
  }
#endif
#if defined(KVREPLAY_AVX2)
  // x widened once, read by every panel (a buffer kept across calls: a fresh one of 128 KiB or
  // more is a new mapping, its pages faulted in and zeroed on every call); for integer records,
  // x as 16-bit integers and their block scales instead
  const bool ints = quant && is_int_record(record);
  float* xf = nullptr;
  int16_t* xv = nullptr;
  int8_t* xv8 = nullptr;
  float *xscale = nullptr, *xsum = nullptr;
  constexpr int64_t kQuantizeRows = 4;  // rows a quantizing job (claim_panels' prep)
  const int64_t lds = K / kQuantBlock, quantize_jobs = ints ? (M + kQuantizeRows - 1) / kQuantizeRows : 0;
  if (ints) {
    xscale = kvreplay_scratch::thread_buffer<float, 5>(2 * M * lds);
    xsum = xscale + M * lds;
    if (x8)
      xv8 = kvreplay_scratch::thread_buffer<int8_t, 4>(M * K);
    else
      xv = kvreplay_scratch::thread_buffer<int16_t, 4>(M * K);
  } else {
    xf = kvreplay_scratch::thread_buffer<float, 4>(M * K);
    int64_t widened = 0;
    for (; widened + 8 <= M * K; widened += 8) _mm256_storeu_ps(xf + widened, widen8(xp + widened));
    for (; widened < M * K; ++widened) xf[widened] = f32(c10::BFloat16(xp[widened], c10::BFloat16::from_bits()));
  }
  auto quantize = [&](int64_t job) {  // x's rows kQuantizeRows * job on, as integers and scales
    const int64_t m0 = job * kQuantizeRows, rows = std::min(kQuantizeRows, M - m0);
    if (x8)
      quantize_rows8(xp + m0 * K, rows, K, xv8 + m0 * K, xscale + m0 * lds, xsum + m0 * lds);
    else
      quantize_rows(xp + m0 * K, rows, K, xv + m0 * K, xscale + m0 * lds, xsum + m0 * lds);
  };
  auto run = [&](auto* op) {
    claim_panels(quantize_jobs, quantize, (tiles + kPanelTiles - 1) / kPanelTiles, [&](int64_t begin, int64_t end) {
      float* local = staged ? kvreplay_scratch::thread_buffer<float, 1>(M * kPanelWidth) : nullptr;
      RowArgmax part(argmax ? M : 0, begin);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanelTiles * kLanes, width = std::min(kPanelTiles, tiles - p * kPanelTiles);
        auto* o = staged ? reinterpret_cast<decltype(op)>(local) : op + n0;
        if (x8)
          int_panel<Int8Form>(xv8, xscale, xsum, records(p), record, width, bp ? bp + n0 : nullptr, o, M,
                              staged ? kPanelWidth : N, K);
        else if (ints)
          int_panel<Int16Form>(xv, xscale, xsum, records(p), record, width, bp ? bp + n0 : nullptr, o, M,
                               staged ? kPanelWidth : N, K);
        else
          avx2_panel(xf, quant ? nullptr : wp + n0 * K, quant ? records(p) : nullptr, record, width,
                     bp ? bp + n0 : nullptr, o, M, staged ? kPanelWidth : N, K);
        finish_panel(part, local, n0, width);
      }
      if (argmax) keep_part(std::move(part));
    });
  };
#else
  auto run = [&](auto* op) {
    claim_panels((tiles + kPanelTiles - 1) / kPanelTiles, [&](int64_t begin, int64_t end) {
      uint16_t* buffer = kvreplay_scratch::thread_buffer<uint16_t>(buffer_size);  // kept across chunks
      float* local = staged ? kvreplay_scratch::thread_buffer<float, 1>(M * kPanelWidth) : nullptr;
      RowArgmax part(argmax ? M : 0, begin);
      for (int64_t p = begin; p < end; ++p) {
        const int64_t n0 = p * kPanelTiles * kLanes, width = std::min(kPanelTiles, tiles - p * kPanelTiles);
        const uint16_t* w = panel_weights(p, buffer);
        const uint16_t* b = bp ? bp + n0 : nullptr;
        auto* o = staged ? reinterpret_cast<decltype(op)>(local) : op + n0;
        const int64_t ld = staged ? kPanelWidth : N;
        switch (width) {
          case 1: panel_rows<1>(xp, w, b, o, M, ld, K); break;
          case 2: panel_rows<2>(xp, w, b, o, M, ld, K); break;
          default: panel_rows<kPanelTiles>(xp, w, b, o, M, ld, K); break;
        }
        finish_panel(part, local, n0, width);
      }
      if (argmax) keep_part(std::move(part));
    });
  };
#endif
  for_outputs(run);
#else
  TORCH_CHECK(false, name, ": this build has neither AVX512-BF16 nor AVX2 (check has_panel_linear first)");
#endif
  return out;
}

at::Tensor panel_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return panel_product(x, packed, bias, false, "panel_linear");
}

at::Tensor panel_linear_float(const at::Tensor& x, const at::Tensor& packed,
                              const c10::optional<at::Tensor>& bias) {
  return panel_product(x, packed, bias, true, "panel_linear_float");
}

at::Tensor panel_argmax(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  auto tokens = at::empty({x.dim() == 2 ? x.size(0) : 0}, x.options().dtype(at::kLong));  // every row written
  panel_product(x, packed, bias, true, "panel_argmax", at::Tensor(), tokens.data_ptr<int64_t>());
  return tokens;
}

// silu(gate) * up of the gate/up product y = x W^T (+ b) for a W whose 2F rows are in pair order:
// panel p (kPanelTiles x 16 rows; the last may be narrower) holds gate rows 24p .. 24p + 8w - 1
// and then up rows 24p .. 24p + 8w - 1 (w: its tiles), kvreplay/layers/linear.py silu_pair_order.
// The products are panel_linear's and the SiLU silu_mul's, so the result equals silu_mul of the
// product in [gate | up] order, without writing or reading the [M, 2F] gate/up outputs.
at::Tensor panel_silu_mul(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias) {
  return panel_product(x, packed, bias, false, "panel_silu_mul", at::Tensor(), nullptr, true);
}
}  // namespace kvreplay_layer_ops
