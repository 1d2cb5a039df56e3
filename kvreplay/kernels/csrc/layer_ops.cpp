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
//       weight load feeds up to 8 rows (layout at the kernel below). Products are exact, sums
//       fp32 (AVX512-BF16 pair dot products), one rounding to bf16 at the end. On a Zen 4 core
//       all matmuls of a decode step take 6-8 ms at batch 1 (oneDNN: ~13 ms), ~10 ms at batch 12
//       (oneDNN: ~15 ms) and ~23 ms at batch 32 (oneDNN: ~28 ms). On a CPU with AMX tiles
//       (K a multiple of 32) the same panels go through the tiles instead: ~10.5 ms from 2 to
//       16 rows, ~14.5 ms at 32 (oneDNN, on the same tiles: ~14.5 and ~17.5 ms). On an
//       AVX2-only CPU (no bf16 instructions: a Zen 3) each thread widens a slice of a panel to
//       fp32 at a time and runs fp32 FMAs (below): the same sums, within one rounding.
//   pack_quant_panels(blocks, K, format, integer=False, x_bits=16) / expand_quant_panels(packed)
//       The panel copy of a GGUF tensor kept as its Q4_0 / Q4_1 / Q8_0 blocks (a third or half
//       of the bf16 panels' bytes); panel_linear and decode_layer take it like a bf16 panel and
//       expand it as they go, to the same bf16 weights (layout and arithmetic below).
//       expand_quant_panels gives the bf16 panels it stands for (tests, benches). With integer
//       (AVX2 builds, has_int_products()): records that the products read as integers, with x
//       as 16-bit integers per 32-k block: the file's own weights, not their bf16 rounding
//       (int_panel below); with x_bits=8 (Q4 blocks), x rounded to 8 bits per block, lossy
//       (int_panel with Int8Form below).
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
//
// Built without -ffast-math and with -ffp-contract=off so that every rounding above happens
// where it is written. Built on first use by kvreplay/kernels/cpu_kernels.py.
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

namespace {

template <typename T> inline float f32(T v) { return static_cast<float>(v); }
template <typename T> inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

// The AVX2 kernels below (bf16 widened to fp32, FMAs) serve where the AVX512-BF16 ones cannot:
// an AVX2-only CPU, or AVX-512 without BF16 (Skylake to Ice Lake).
#if !defined(__AVX512BF16__) && defined(KVREPLAY_HAVE_AVX2)
#define KVREPLAY_AVX2 1
#endif

template <typename T> constexpr bool kVecT = false;  // dtypes with a vector path (16 lanes, or 8 with AVX2)
#if defined(__AVX512BF16__)
template <> constexpr bool kVecT<float> = true;
template <> constexpr bool kVecT<c10::BFloat16> = true;
// Vec: kVecLanes fp32 lanes; vadd / vmul / vset: its add, multiply and broadcast (the vector
// loops below are written once, for either width).
using Vec = __m512;
constexpr int64_t kVecLanes = 16;
inline Vec vadd(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec vset(float v) { return _mm512_set1_ps(v); }
// 16 lanes at a time. For bf16, `rnd` rounds fp32 lanes to bf16 (nearest-even, as c10 does) and
// back, so vector code rounds exactly where the scalar code does; for fp32 it is the identity.
using kvreplay_simd::exp16;
inline __m512 ld(const float* p) { return kvreplay_simd::load16(p); }
inline __m512 ld(const c10::BFloat16* p) { return kvreplay_simd::load16(p); }
inline void st(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void st(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 rnd(__m512 v, float*) { return v; }
inline __m512 rnd(__m512 v, c10::BFloat16*) {
  return kvreplay_simd::widen16((__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 neg(__m512 v) {  // flips the sign bit, as PyTorch's neg (0 -> -0)
  return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(v), _mm512_set1_epi32(INT32_MIN)));
}
#elif defined(KVREPLAY_AVX2)
template <> constexpr bool kVecT<float> = true;  // (8 lanes here)
template <> constexpr bool kVecT<c10::BFloat16> = true;
using Vec = __m256;
constexpr int64_t kVecLanes = 8;
inline Vec vadd(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline Vec vmul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec vset(float v) { return _mm256_set1_ps(v); }
// The same helpers on 8 lanes: rnd rounds as c10 does (kvreplay_simd::round_bf16x8), so the
// vector loops below round exactly where the scalar code does.
inline __m256 ld(const float* p) { return kvreplay_simd::load8(p); }
inline __m256 ld(const c10::BFloat16* p) { return kvreplay_simd::load8(p); }
inline void st(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void st(c10::BFloat16* p, __m256 v) { kvreplay_simd::store_rounded8(reinterpret_cast<uint16_t*>(p), v); }
inline __m256 rnd(__m256 v, float*) { return v; }
inline __m256 rnd(__m256 v, c10::BFloat16*) { return kvreplay_simd::round_bf16x8(v); }
inline __m256 neg(__m256 v) { return _mm256_xor_ps(v, _mm256_set1_ps(-0.0f)); }
#endif

// The sum of h[i]^2 in one fixed order: 16 running sums (lane i % 16), then the tail, then the
// lanes pairwise. (An `omp simd` reduction let the compiler peel iterations up to the buffer's
// alignment, which differs between the threads' buffers: a row's sum then depended on which
// thread took it, i.e. on how many rows came with it, seen on an AVX2 CPU.)
inline float sum_of_squares(const float* h, int64_t H) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= H; i += 16)
    for (int l = 0; l < 16; ++l) lanes[l] += h[i + l] * h[i + l];
  for (; i < H; ++i) lanes[i % 16] += h[i] * h[i];
  for (int width = 8; width >= 1; width /= 2)
    for (int l = 0; l < width; ++l) lanes[l] += lanes[l + width];
  return lanes[0];
}

template <typename T>
void rms_rows(const T* x, const T* res, const T* w, T* out, T* hidden, int64_t rows, int64_t H,
              float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    float* h = kvreplay_scratch::thread_buffer<float>(H);  // the row's hidden values, widened
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * H;
      if (res) {
        const T* rr = res + r * H;
        T* hr = hidden + r * H;
        int64_t i = 0;
#if defined(__AVX512BF16__) || defined(KVREPLAY_AVX2)
        if constexpr (kVecT<T>) for (; i + kVecLanes <= H; i += kVecLanes) {  // sum rounded, stored, kept widened
          const Vec v = rnd(vadd(ld(xr + i), ld(rr + i)), hr);
          st(hr + i, v);
          st(h + i, v);
        }
#endif
        for (; i < H; ++i) {
          const T v = static_cast<T>(f32(xr[i]) + f32(rr[i]));
          hr[i] = v;
          h[i] = f32(v);
        }
      } else {
        int64_t i = 0;
#if defined(__AVX512BF16__) || defined(KVREPLAY_AVX2)
        if constexpr (kVecT<T>) for (; i + kVecLanes <= H; i += kVecLanes) st(h + i, ld(xr + i));
#endif
        for (; i < H; ++i) h[i] = f32(xr[i]);
        if (hidden) std::memcpy(hidden + r * H, xr, H * sizeof(T));  // the stream starts as x
      }
      const float ss = sum_of_squares(h, H);
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* o = out + r * H;
      int64_t i = 0;
#if defined(__AVX512BF16__) || defined(KVREPLAY_AVX2)
      const Vec scale = vset(inv);
      if constexpr (kVecT<T>) for (; i + kVecLanes <= H; i += kVecLanes)
        st(o + i, vmul(ld(w + i), rnd(vmul(ld(h + i), scale), o)));
#endif
      for (; i < H; ++i) o[i] = static_cast<T>(f32(w[i]) * round_to<T>(h[i] * inv));
    }
  });
}

// add_rms_norm writing into `out` and `hidden` ([T, H] like x; hidden may be the residual itself,
// each element is read before it is written). Without a residual, hidden gets a copy of x.
void add_rms_norm_into(const at::Tensor& x, const at::Tensor* residual, const at::Tensor& weight, double eps,
                       at::Tensor& out, at::Tensor& hidden) {
  const int64_t rows = x.size(0), H = x.size(1);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), residual ? residual->data_ptr<scalar_t>() : nullptr,
                       weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), hidden.data_ptr<scalar_t>(), rows, H,
                       static_cast<float>(eps));
  });
}

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const c10::optional<at::Tensor>& residual,
                                                const at::Tensor& weight, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "add_rms_norm: x must be a contiguous [T, H] tensor");
  const int64_t rows = x.size(0), H = x.size(1);
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == H && weight.scalar_type() == x.scalar_type(),
              "add_rms_norm: weight must be [H] in x's dtype");
  const bool has_res = residual.has_value() && residual->defined();
  if (has_res)
    TORCH_CHECK(residual->sizes() == x.sizes() && residual->is_contiguous() &&
                residual->scalar_type() == x.scalar_type(), "add_rms_norm: residual must match x");
  auto w = weight.contiguous();
  auto out = at::empty_like(x);
  auto hidden = has_res ? at::empty_like(x) : x;
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    rms_rows<scalar_t>(x.data_ptr<scalar_t>(), has_res ? residual->data_ptr<scalar_t>() : nullptr,
                       w.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                       has_res ? hidden.data_ptr<scalar_t>() : nullptr, rows, H, static_cast<float>(eps));
  });
  return {out, hidden};
}

template <typename T>
void rope_rows(T* qkv, const T* cos, const T* sin, const int64_t* slots, T* cache, int64_t T_,
               int64_t num_q, int64_t num_kv, int64_t D, int64_t cache_rows) {
  const int64_t half = D / 2, width = (num_q + 2 * num_kv) * D;
  const int64_t kv_plane = num_kv * cache_rows * D;  // K plane, then V plane
  at::parallel_for(0, T_, 8, [&](int64_t begin, int64_t end) {
    T* tmp = kvreplay_scratch::thread_buffer<T>(D);
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * width;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t head = 0; head < num_q + num_kv; ++head) {
        T* x = row + head * D;
#if defined(__AVX512BF16__) || defined(KVREPLAY_AVX2)
        if constexpr (kVecT<T>) {
          if (half % kVecLanes == 0) {  // out = x cos + rotate_half(x) sin, rounded after each op
            for (int64_t d = 0; d < half; d += kVecLanes) {
              const Vec x1 = ld(x + d), x2 = ld(x + half + d);
              const Vec lo = rnd(vadd(rnd(vmul(x1, ld(c + d)), x), rnd(vmul(neg(x2), ld(s + d)), x)), x);
              const Vec hi = rnd(vadd(rnd(vmul(x2, ld(c + half + d)), x), rnd(vmul(x1, ld(s + half + d)), x)), x);
              st(x + d, lo);
              st(x + half + d, hi);
            }
            continue;
          }
        }
#endif
        for (int64_t d = 0; d < D; ++d) {
          const float rotated = d < half ? -f32(x[d + half]) : f32(x[d - half]);
          const float a = round_to<T>(f32(x[d]) * f32(c[d]));
          const float b = round_to<T>(rotated * f32(s[d]));
          tmp[d] = static_cast<T>(a + b);
        }
        for (int64_t d = 0; d < D; ++d) x[d] = tmp[d];
      }
      const int64_t slot = slots[t];
      for (int64_t h = 0; h < num_kv; ++h) {
        const T* k = row + (num_q + h) * D;
        const T* v = row + (num_q + num_kv + h) * D;
        T* kd = cache + h * cache_rows * D + slot * D;
        std::memcpy(kd, k, D * sizeof(T));  // (an element loop here ran as scalar copies)
        std::memcpy(kd + kv_plane, v, D * sizeof(T));
      }
    }
  });
}

void rope_write_cache(at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin, int64_t num_q,
                      int64_t num_kv, at::Tensor& kv_cache, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.is_contiguous(),
              "rope_write_cache: kv_cache must be a contiguous [2, Hkv, blocks, block_size, D] tensor");
  const int64_t D = kv_cache.size(4), T_ = qkv.size(0);
  TORCH_CHECK(kv_cache.size(1) == num_kv && D % 2 == 0, "rope_write_cache: cache heads disagree");
  TORCH_CHECK(qkv.dim() == 2 && qkv.is_contiguous() && qkv.size(1) == (num_q + 2 * num_kv) * D,
              "rope_write_cache: qkv must be a contiguous [T, (Hq + 2 Hkv) * D] tensor");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.dim() == 2 && cos.size(0) == T_ && cos.size(1) == D &&
              cos.is_contiguous() && sin.is_contiguous(), "rope_write_cache: cos/sin must be [T, D]");
  TORCH_CHECK(qkv.scalar_type() == kv_cache.scalar_type() && cos.scalar_type() == qkv.scalar_type() &&
              sin.scalar_type() == qkv.scalar_type(), "rope_write_cache: one dtype expected");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.numel() == T_,
              "rope_write_cache: one int64 slot per token");
  auto slots = slot_mapping.contiguous();
  const int64_t cache_rows = kv_cache.size(2) * kv_cache.size(3);
  const int64_t* sp = slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T_; ++t)
    TORCH_CHECK(sp[t] >= 0 && sp[t] < cache_rows, "rope_write_cache: slot ", sp[t], " outside the cache");
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_write_cache", [&] {
    rope_rows<scalar_t>(qkv.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(), sin.data_ptr<scalar_t>(), sp,
                        kv_cache.data_ptr<scalar_t>(), T_, num_q, num_kv, D, cache_rows);
  });
}

#if defined(KVREPLAY_AVX2)
// 8 bf16 outputs of silu(gate) * up with the 16-lane code's arithmetic (exp8 = exp16 lane for lane)
inline void silu8(const uint16_t* gate, const uint16_t* up, uint16_t* out) {
  const __m256 x = kvreplay_simd::widen8(gate);
  const __m256 minus = _mm256_castsi256_ps(_mm256_xor_si256(_mm256_castps_si256(x), _mm256_set1_epi32(INT32_MIN)));
  const __m256 silu = kvreplay_simd::round_bf16x8(
      _mm256_div_ps(x, _mm256_add_ps(_mm256_set1_ps(1.f), kvreplay_simd::exp8(minus))));
  kvreplay_simd::store_rounded8(out, _mm256_mul_ps(silu, kvreplay_simd::widen8(up)));
}
#endif

// silu(gate) * up for gate_up = [gate | up] rows: silu rounded to the dtype, then the product,
// as F.silu(gate) * up does. silu(x) = x / (1 + e^-x); the vector exp below is within ~2e-7
// relative of the library's (simd.h), so a bf16 result differs from PyTorch's by one step at
// most, rarely.
// One row of it: o[i] = silu(g[i]) * u[i] for i < n (silu_rows, and silu_panel on AVX2)
template <typename T>
void silu_row(const T* g, const T* u, T* o, int64_t n) {
  int64_t i = 0;
#if defined(__AVX512BF16__)
  if constexpr (kVecT<T>) {
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= n; i += 16) {
      const __m512 x = ld(g + i);
      const __m512 silu = rnd(_mm512_div_ps(x, _mm512_add_ps(one, exp16(neg(x)))), o);
      st(o + i, _mm512_mul_ps(silu, ld(u + i)));
    }
  }
#endif
#if defined(KVREPLAY_AVX2)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const auto* gb = reinterpret_cast<const uint16_t*>(g);
    const auto* ub = reinterpret_cast<const uint16_t*>(u);
    for (; i + 8 <= n; i += 8) silu8(gb + i, ub + i, reinterpret_cast<uint16_t*>(o) + i);
  }
#endif
  for (; i < n; ++i) {
    const float x = f32(g[i]);
    o[i] = static_cast<T>(round_to<T>(x / (1.f + std::exp(-x))) * f32(u[i]));
  }
}

template <typename T>
void silu_rows(const T* gate_up, T* out, int64_t rows, int64_t F) {
  at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) silu_row(gate_up + r * 2 * F, gate_up + r * 2 * F + F, out + r * F, F);
  });
}

// `out`: [T, F] to write into, or undefined for a new tensor
at::Tensor silu_mul_into(const at::Tensor& gate_up, at::Tensor out) {
  TORCH_CHECK(gate_up.dim() == 2 && gate_up.size(1) % 2 == 0 && gate_up.is_contiguous(),
              "silu_mul: gate_up must be a contiguous [T, 2F] tensor");
  const int64_t rows = gate_up.size(0), F = gate_up.size(1) / 2;
  if (!out.defined()) out = at::empty({rows, F}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, gate_up.scalar_type(), "silu_mul", [&] {
    silu_rows<scalar_t>(gate_up.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(), rows, F);
  });
  return out;
}

at::Tensor silu_mul(const at::Tensor& gate_up) { return silu_mul_into(gate_up, at::Tensor()); }

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

bool can_pack_panels(const at::Tensor& w) {
  return w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.size(0) % kLanes == 0 && w.size(1) % 2 == 0 &&
         w.size(0) > 0 && w.size(1) > 0;
}

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
// d[16]). The kernel multiplies the blocks' integers by 16-bit integers of x (int_panel below),
// so the weights are the file's exactly (d * q + m in real numbers), not their bf16 rounding.
constexpr int64_t kQ4IntRecord = 384, kQ8IntRecord = 576;
inline bool is_int_record(int64_t record) { return record == kQ4IntRecord || record == kQ8IntRecord; }
#if defined(KVREPLAY_AVX2)
constexpr bool kIntProducts = true;
#else
constexpr bool kIntProducts = false;
#endif

int64_t quant_record(const std::string& format) {
  if (format == "Q4_0" || format == "Q4_1") return kQ4_1Record;
  if (format == "Q8_0") return kQ8_0Record;
  TORCH_CHECK(false, "pack_quant_panels: format must be Q4_0, Q4_1 or Q8_0, got ", format);
  return 0;
}

inline float half_to_float(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return static_cast<float>(c10::Half(h, c10::Half::from_bits()));
}

// blocks: [N, K / 32 * block bytes] uint8, a GGUF tensor's rows (Q4_1: d, m fp16, 16 bytes of
// nibbles, weight i < 16 in byte i's low nibble, weight 16 + i in its high one; Q8_0: d fp16,
// 32 int8). Out: [N / 16, K / 32, record] uint8, the records in the order above.
// integer: records for integer products (kQ4IntRecord / kQ8IntRecord), refused on a build
// without the AVX2 kernel. x_bits: the width x goes in at, 16 or (Q4_0 / Q4_1 only) 8; the
// records for 8-bit x are the same bytes as an int8 tensor, which is how the kernel tells them.
at::Tensor pack_quant_panels(const at::Tensor& blocks, int64_t K, const std::string& format, bool integer,
                             int64_t x_bits) {
  TORCH_CHECK(!integer || kIntProducts, "pack_quant_panels: integer products run on the AVX2 kernel only; this "
              "build has AVX512-BF16 (its products expand the blocks to bf16) or no AVX2");
  TORCH_CHECK(x_bits == 16 || (x_bits == 8 && integer && (format == "Q4_0" || format == "Q4_1")),
              "pack_quant_panels: x_bits must be 16, or 8 for integer products on Q4_0 / Q4_1 blocks; got ", x_bits,
              " for ", format, integer ? " (integer)" : "");
  // Q4_0 (d fp16, 16 bytes of nibbles; gguf-py: d * (q - 8)) goes into Q4_1 records with
  // m = -8 d: d * q + m is then exactly d * (q - 8) (both exact in fp32), and -8 d is exact in
  // fp16 unless it overflows (|d| >= 8192, refused below)
  const bool q4_0 = format == "Q4_0";
  const int64_t record = quant_record(format), block_bytes = q4_0 ? 18 : record == kQ4_1Record ? 20 : 34;
  const int64_t nibbles_at = q4_0 ? 2 : 4;
  TORCH_CHECK(blocks.dim() == 2 && blocks.scalar_type() == at::kByte && K > 0 && K % kQuantBlock == 0 &&
              blocks.size(0) > 0 && blocks.size(0) % kLanes == 0 && blocks.size(1) == K / kQuantBlock * block_bytes,
              "pack_quant_panels: ", format, " blocks [N, ", K / kQuantBlock * block_bytes,
              "] uint8 with N a multiple of 16 expected for K = ", K, ", got ", blocks.scalar_type(), " ",
              blocks.sizes());
  const int64_t N = blocks.size(0), tiles = N / kLanes, kblocks = K / kQuantBlock, row_bytes = blocks.size(1);
  auto src_t = blocks.contiguous();
  const uint8_t* src = src_t.data_ptr<uint8_t>();
  auto out = at::empty({tiles, kblocks, record}, blocks.options());
  uint8_t* dst = out.data_ptr<uint8_t>();
  const bool q4 = record == kQ4_1Record;
  // weight (n, k) of a source block: its quantized value
  auto q4_value = [&](int64_t n, int64_t k) -> uint8_t {
    const uint8_t* b = src + n * row_bytes + (k / kQuantBlock) * block_bytes + nibbles_at;
    const int64_t i = k % kQuantBlock;
    return i < 16 ? b[i] & 0x0F : b[i - 16] >> 4;
  };
  at::parallel_for(0, (tiles + kPanelTiles - 1) / kPanelTiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t t0 = p * kPanelTiles, width = std::min(kPanelTiles, tiles - t0);
      uint8_t* panel = dst + t0 * kblocks * record;
      for (int64_t kb = 0; kb < kblocks; ++kb)
        for (int64_t t = 0; t < width; ++t) {
          uint8_t* rec = panel + (kb * width + t) * record;
          const int64_t n0 = (t0 + t) * kLanes;
          for (int64_t j = 0; j < 16; ++j)
            for (int64_t i = 0; i < 32; ++i) {
              const int64_t n = n0 + i / 2, k = kb * kQuantBlock + 2 * j + i % 2;  // lane i's weight
              if (q4) {
                if (i < 16) rec[j * 16 + i] = q4_value(n, k) | static_cast<uint8_t>(q4_value(n + 8, k) << 4);
              } else {
                rec[j * 32 + i] = src[n * row_bytes + (k / kQuantBlock) * block_bytes + 2 + k % kQuantBlock];
              }
            }
          uint8_t* scales = rec + (q4 ? 256 : 512);
          for (int64_t o = 0; o < kLanes; ++o) {
            const uint8_t* b = src + (n0 + o) * row_bytes + kb * block_bytes;
            std::memcpy(scales + 2 * o, b, 2);  // d
            if (q4_0) {
              const float m = -8.f * half_to_float(b);
              const c10::Half h(m);
              TORCH_CHECK((std::isfinite(m) && static_cast<float>(h) == m) || std::isnan(m), "pack_quant_panels: a Q4_0 "
                          "scale of ", -m / 8, " is too large for the panel form (|d| < 8192 needed)");
              std::memcpy(scales + 32 + 2 * o, &h.x, 2);
            } else if (q4) {
              std::memcpy(scales + 32 + 2 * o, b + 2, 2);  // m
            }
          }
        }
    }
  });
  if (!integer) return out;
  // the same records with their scales widened to fp32
  const int64_t body = q4 ? 256 : 512, int_record = q4 ? kQ4IntRecord : kQ8IntRecord, count = tiles * kblocks;
  auto ints = at::empty({tiles, kblocks, int_record}, blocks.options());
  const uint8_t* from = out.data_ptr<uint8_t>();
  uint8_t* to = ints.data_ptr<uint8_t>();
  at::parallel_for(0, count, 64, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* rec = from + r * record;
      uint8_t* dst_rec = to + r * int_record;
      std::memcpy(dst_rec, rec, static_cast<size_t>(body));
      for (int64_t i = 0; i < (q4 ? 32 : 16); ++i) {  // d[16] (and m[16]) fp16 -> fp32
        const float v = half_to_float(rec + body + 2 * i);
        std::memcpy(dst_rec + body + 4 * i, &v, sizeof v);
      }
    }
  });
  return x_bits == 8 ? ints.view(at::kChar) : ints;
}

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

// One panel of `width` tiles (records at q) expanded into the bf16 panel layout at out.
void expand_quant_panel(const uint8_t* q, int64_t record, int64_t width, int64_t K, uint16_t* out) {
  for (int64_t kb = 0; kb < K / kQuantBlock; ++kb)
    for (int64_t t = 0; t < width; ++t)
      expand_record(q + (kb * width + t) * record, record == kQ4_1Record, out + (kb * 16 * width + t) * 32,
                    width * 32);
}
#endif

// The bf16 panels (pack_panels' layout) that quantized panels expand to (tests, checks at load).
at::Tensor expand_quant_panels(const at::Tensor& packed) {
  TORCH_CHECK(packed.dim() == 3 && packed.scalar_type() == at::kByte && packed.is_contiguous() &&
              (packed.size(2) == kQ4_1Record || packed.size(2) == kQ8_0Record),
              "expand_quant_panels: a pack_quant_panels tensor expected (not one for integer products: "
              "their weights are the file's, not bf16)");
  const int64_t tiles = packed.size(0), K = packed.size(1) * kQuantBlock, record = packed.size(2);
  auto out = at::empty({tiles, K / 2, kLanes, 2}, packed.options().dtype(at::kBFloat16));
#if defined(__AVX512BF16__)
  const uint8_t* q = packed.data_ptr<uint8_t>();
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  at::parallel_for(0, (tiles + kPanelTiles - 1) / kPanelTiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t t0 = p * kPanelTiles;
      expand_quant_panel(q + t0 * (K / kQuantBlock) * record, record, std::min(kPanelTiles, tiles - t0), K,
                         o + t0 * kLanes * K);
    }
  });
#else
  // the same arithmetic one weight at a time (tests and checks only on such a build)
  const uint8_t* q = packed.data_ptr<uint8_t>();
  auto* o = reinterpret_cast<uint16_t*>(out.data_ptr());
  const int64_t kblocks = K / kQuantBlock;
  for (int64_t t = 0; t < tiles; ++t) {
    const int64_t p = t / kPanelTiles, t0 = p * kPanelTiles, width = std::min(kPanelTiles, tiles - t0);
    const uint8_t* panel = q + t0 * kblocks * record;
    for (int64_t kb = 0; kb < kblocks; ++kb) {
      const uint8_t* rec = panel + (kb * width + (t - t0)) * record;
      for (int64_t j = 0; j < 16; ++j)
        for (int64_t i = 0; i < 32; ++i) {
          const int64_t lane_out = i < 16 ? i / 2 : 8 + (i - 16) / 2, e = i % 2;
          const float d = half_to_float(rec + (record == kQ4_1Record ? 256 : 512) + 2 * lane_out);
          float v;
          if (record == kQ4_1Record) {
            const uint8_t byte = rec[j * 16 + i % 16];
            v = std::fma(d, static_cast<float>(i < 16 ? byte & 0x0F : byte >> 4), half_to_float(rec + 288 + 2 * lane_out));
          } else {
            v = static_cast<float>(static_cast<int8_t>(rec[j * 32 + i])) * d;
          }
          // bf16 panel layout: panel t0, pair kb * 16 + j, output (t - t0) * 16 + lane_out, e
          o[((t0 * kLanes * K / 2) + (kb * 16 + j) * width * kLanes + (t - t0) * kLanes + lane_out) * 2 + e] =
              c10::BFloat16(v).x;
        }
    }
  }
#endif
  return out;
}

#if defined(__AVX512BF16__)
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
#endif

#if defined(KVREPLAY_AVX2)
// ---- the same products on AVX2 (CPUs without bf16 instructions: a Zen 3, a Skylake-X) ----
// Each thread takes a panel kAvx2Chunk input columns (k) at a time: it widens that slice of the
// panel to fp32, k-major ([kc][48] floats, 12 KB: L1), from the bf16 pairs or the quantized
// records with the arithmetic above, then runs every block of up to 4 rows of x (widened once
// per call) over it, 12 fp32 FMA accumulators for 4 rows x 24 outputs, one weight load feeding
// 4 rows; the running sums wait in an [M][48] fp32 array between slices. bf16 x bf16 products
// are exact in fp32 and an FMA rounds once, so every output is one fp32 sum over k in order,
// plus the bias, rounded once to bf16, as on the AVX-512 kernel (whose pair dot products add
// each pair's odd product first: results agree within that one rounding).
constexpr int64_t kWide = kPanelTiles * kLanes;  // floats a k-row of the widened slice
constexpr int64_t kAvx2Chunk = 64;               // k a slice (a multiple of the 32-k blocks)

using kvreplay_simd::round_bf16x8;
using kvreplay_simd::store_rounded8;
using kvreplay_simd::widen8;

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

// ---- integer products on the file's blocks (AVX2; records from pack_quant_panels(..., integer)) ----
// A 32-k block of a Q4_0 / Q4_1 / Q8_0 weight row is d * q + m with q small integers (Q4: 0-15,
// m = -8 d for Q4_0; Q8_0: -128-127, m = 0), so its product with 32 values of x is
//   d * sum(q * x) + m * sum(x).
// x (bf16) is written per row and block as s * v: s a power of two, v 16-bit integers
// (quantize_rows), exact for every value within 2^7 of the block's largest magnitude; then
// sum(q * v) is an exact int32 (VPMADDWD pairs, |sum| < 2^24: exact again in fp32 for Q4), and
// each block adds d * (s * sum(q * v)) and m * (s * sum(v)) to an fp32 running sum by two FMAs.
// Against the bf16 path: the weights are the file's own numbers rather than their bf16 roundings
// (each off by up to 2^-9 relative), x is the same bf16 up to the rare tiny value far below its
// block's largest, and on a Zen 3 core VPMADDWD + VPADDD do 16 products where an FMA does 8,
// with no widening of the weights to fp32; measured in decode there, the per-block fold and
// the block widening take that gain back at batch 32 (0.99x the bf16 panels) while batch 1
// gains from reading a third of the bytes (1.21x; docs/benchmarks.md). A row's result still
// does not depend on the other rows, the blocking or the threads.
constexpr int64_t kIntPairs = kQuantBlock / 2;  // pairs (k, k + 1) a block
// the running sums before the first block, for the folds in asm (int_block, int8_block)
alignas(32) constexpr float kZeroSums[4 * kWide] = {};

// x ([M][K] bf16 bits) as v ([M][K] int16) and, per row and 32-k block (index m * K / 32 + b),
// its scale s = 2^(E - 14) (E: the exponent of the block's largest |x|, so |v| < 2^15) and
// s * sum(v). A block of zeros: s = 1; one holding an inf or NaN: s = NaN (its row's outputs
// are NaN, as a float product would give for a NaN; an inf gives NaN here, not +-inf).
void quantize_rows(const uint16_t* x, int64_t M, int64_t K, int16_t* v, float* scale, float* sum) {
  const int64_t blocks = K / kQuantBlock;
  const __m256i magnitude = _mm256_set1_epi16(0x7FFF);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* xb = x + m * K + b * kQuantBlock;
      int16_t* vb = v + m * K + b * kQuantBlock;
      const int64_t at = m * blocks + b;
      const __m256i r0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
      const __m256i r1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 16));
      __m256i top = _mm256_max_epu16(_mm256_and_si256(r0, magnitude), _mm256_and_si256(r1, magnitude));
      __m128i t = _mm_max_epu16(_mm256_castsi256_si128(top), _mm256_extracti128_si256(top, 1));
      t = _mm_max_epu16(t, _mm_srli_si128(t, 8));
      t = _mm_max_epu16(t, _mm_srli_si128(t, 4));
      t = _mm_max_epu16(t, _mm_srli_si128(t, 2));
      const int largest = _mm_extract_epi16(t, 0);  // a bf16's magnitude bits: ordered as its value
      if (largest == 0 || largest >= 0x7F80) {
        std::memset(vb, 0, kQuantBlock * sizeof(int16_t));
        scale[at] = largest == 0 ? 1.f : std::numeric_limits<float>::quiet_NaN();
        sum[at] = largest == 0 ? 0.f : scale[at];
        continue;
      }
      const int E = std::max((largest >> 7) - 127, -126);  // a subnormal block: below 2^-126
      scale[at] = std::ldexp(1.f, E - 14);                   // >= 2^-140: representable
      // x * 2^(14 - E) in one or two exact steps (2^(14 - E) alone overflows below E = -113)
      const int up = 14 - E, first = std::min(up, 126);
      const __m256 f1 = _mm256_set1_ps(std::ldexp(1.f, first)), f2 = _mm256_set1_ps(std::ldexp(1.f, up - first));
      __m256i ints[4];
      for (int i = 0; i < 4; ++i) {
        const __m256 scaled = _mm256_mul_ps(_mm256_mul_ps(widen8(xb + 8 * i), f1), f2);
        ints[i] = _mm256_cvtps_epi32(scaled);  // nearest, ties to even (MXCSR's default)
      }
      const __m256i total = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
      // packs interleaves 128-bit lanes: 0xD8 puts the 16 values back in order
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vb), _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[0], ints[1]), 0xD8));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vb + 16),
                          _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[2], ints[3]), 0xD8));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      s4 = _mm_add_epi32(s4, _mm_srli_si128(s4, 8));
      s4 = _mm_add_epi32(s4, _mm_srli_si128(s4, 4));
      sum[at] = static_cast<float>(_mm_cvtsi128_si32(s4)) * scale[at];  // |sum(v)| < 2^20: exact
    }
}

// Block kb of a panel of `width` tiles (integer records at q) into buf ([16 pairs][kWide
// outputs][2] int16: VPMADDWD's operand, 8 outputs x 2 k's a vector) and its scales into d and
// mn ([kWide] fp32; mn zeros for Q8_0). A record row's 32 lanes are already in that order.
void widen_int_block(const uint8_t* q, int64_t record, int64_t width, int64_t kb, int16_t* buf, float* d, float* mn) {
  const bool q4 = record == kQ4IntRecord;
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t t = 0; t < width; ++t) {
    const uint8_t* rec = q + (kb * width + t) * record;
    for (int64_t j = 0; j < kIntPairs; ++j) {
      __m256i lo, hi;  // outputs 0-7 and 8-15 of the tile
      if (q4) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + j * 16));
        lo = _mm256_cvtepu8_epi16(_mm_and_si128(raw, nibble));
        hi = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(raw, 4), nibble));
      } else {
        lo = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + j * 32)));
        hi = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + j * 32 + 16)));
      }
      int16_t* row = buf + (j * kWide + t * kLanes) * 2;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row), lo);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + 16), hi);
    }
    std::memcpy(d + t * kLanes, rec + (q4 ? 256 : 512), kLanes * sizeof(float));
    if (q4)
      std::memcpy(mn + t * kLanes, rec + 256 + kLanes * sizeof(float), kLanes * sizeof(float));
    else
      std::memset(mn + t * kLanes, 0, kLanes * sizeof(float));
  }
}

// MB rows of x (v: row 0's block, row stride ldx; scale and sum: row 0's, stride lds) over one
// widened block, C x 8 outputs of it (buf, d, mn at the first): 12 int32 sums in registers, then
// folded into the fp32 running sums (row m at sums + m * kWide), started when `first`.
template <int MB, int C>
void int_block(const int16_t* v, int64_t ldx, const float* scale, const float* sum, int64_t lds,
               const int16_t* buf, const float* d, const float* mn, float* sums, bool first) {
  static_assert(MB >= 1 && MB <= 4 && C >= 1 && C <= 3, "4 rows x 3 columns of 8 at most");
  const __m256i z = _mm256_setzero_si256();
  __m256i a00 = z, a01 = z, a02 = z, a10 = z, a11 = z, a12 = z, a20 = z, a21 = z, a22 = z, a30 = z, a31 = z, a32 = z;
  if constexpr (MB == 4 && C == 3) {
    // the full block (every one but the last rows and narrow panels) as one loop in asm: written
    // as intrinsics, GCC kept 5-8 of the 12 sums on the stack and moved the rest between
    // registers every pair (VPMADDWD does not accumulate, so each product needs a register of
    // its own). Here the sums stay in ymm0-11, x's broadcast and the product in ymm12-13, the
    // weights come from L1 as memory operands; then each row's fold in the same statement, the
    // C fold's arithmetic below step for step (cvt, times s, + d * that + the running sums,
    // + m * total).
    const int16_t* x0 = v;
    const int16_t* w = buf;
    const int64_t ld = ldx * 2, ld3 = 3 * ldx * 2;
    int64_t n = kIntPairs;
    static_assert(kWide * 2 * sizeof(int16_t) == 192, "the asm steps a pair's row of the widened block");
#define KVREPLAY_INT_STEP(offset, acc) \
    "vpmaddwd " #offset "(%[w]), %%ymm12, %%ymm13\n\tvpaddd %%ymm13, %%ymm" #acc ", %%ymm" #acc "\n\t"
#define KVREPLAY_INT_FOLD1(acc, col, at)                                                                      \
    "vcvtdq2ps %%ymm" #acc ", %%ymm" #acc "\n\tvmulps %%ymm12, %%ymm" #acc ", %%ymm" #acc "\n\t"            \
    "vmovups " #at "(%[prev]), %%ymm13\n\t"                                                                   \
    "vfmadd231ps " #col "(%[d]), %%ymm" #acc ", %%ymm13\n\tvfmadd231ps " #col "(%[mn]), %%ymm15, %%ymm13\n\t"  \
    "vmovups %%ymm13, " #at "(%[sums])\n\t"
#define KVREPLAY_INT_FOLD(scale_at, total_at, a0, a1, a2, at0, at1, at2)                                      \
    "vbroadcastss " scale_at ", %%ymm12\n\tvbroadcastss " total_at ", %%ymm15\n\t"                           \
    KVREPLAY_INT_FOLD1(a0, 0, at0) KVREPLAY_INT_FOLD1(a1, 32, at1) KVREPLAY_INT_FOLD1(a2, 64, at2)
    asm volatile(
        "vpxor %%xmm0, %%xmm0, %%xmm0\n\tvpxor %%xmm1, %%xmm1, %%xmm1\n\tvpxor %%xmm2, %%xmm2, %%xmm2\n\t"
        "vpxor %%xmm3, %%xmm3, %%xmm3\n\tvpxor %%xmm4, %%xmm4, %%xmm4\n\tvpxor %%xmm5, %%xmm5, %%xmm5\n\t"
        "vpxor %%xmm6, %%xmm6, %%xmm6\n\tvpxor %%xmm7, %%xmm7, %%xmm7\n\tvpxor %%xmm8, %%xmm8, %%xmm8\n\t"
        "vpxor %%xmm9, %%xmm9, %%xmm9\n\tvpxor %%xmm10, %%xmm10, %%xmm10\n\tvpxor %%xmm11, %%xmm11, %%xmm11\n\t"
        "1:\n\t"
        "vpbroadcastd (%[x]), %%ymm12\n\t"
        KVREPLAY_INT_STEP(0, 0) KVREPLAY_INT_STEP(32, 1) KVREPLAY_INT_STEP(64, 2)
        "vpbroadcastd (%[x],%[ld],1), %%ymm12\n\t"
        KVREPLAY_INT_STEP(0, 3) KVREPLAY_INT_STEP(32, 4) KVREPLAY_INT_STEP(64, 5)
        "vpbroadcastd (%[x],%[ld],2), %%ymm12\n\t"
        KVREPLAY_INT_STEP(0, 6) KVREPLAY_INT_STEP(32, 7) KVREPLAY_INT_STEP(64, 8)
        "vpbroadcastd (%[x],%[ld3],1), %%ymm12\n\t"
        KVREPLAY_INT_STEP(0, 9) KVREPLAY_INT_STEP(32, 10) KVREPLAY_INT_STEP(64, 11)
        "add $4, %[x]\n\t"
        "add $192, %[w]\n\t"  // kWide * 2 int16: the next pair's row
        "dec %[n]\n\t"
        "jnz 1b\n\t"
        KVREPLAY_INT_FOLD("(%[sc])", "(%[tot])", 0, 1, 2, 0, 32, 64)
        KVREPLAY_INT_FOLD("(%[sc],%[lds],1)", "(%[tot],%[lds],1)", 3, 4, 5, 192, 224, 256)
        KVREPLAY_INT_FOLD("(%[sc],%[lds],2)", "(%[tot],%[lds],2)", 6, 7, 8, 384, 416, 448)
        KVREPLAY_INT_FOLD("(%[sc],%[lds3],1)", "(%[tot],%[lds3],1)", 9, 10, 11, 576, 608, 640)
        : [x] "+r"(x0), [w] "+r"(w), [n] "+r"(n)
        : [ld] "r"(ld), [ld3] "r"(ld3), [sc] "r"(scale), [tot] "r"(sum), [lds] "r"(lds * 4), [lds3] "r"(3 * lds * 4),
          [d] "r"(d), [mn] "r"(mn), [prev] "r"(first ? kZeroSums : sums), [sums] "r"(sums)
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",
          "xmm12", "xmm13", "xmm15", "cc", "memory");
#undef KVREPLAY_INT_FOLD
#undef KVREPLAY_INT_FOLD1
#undef KVREPLAY_INT_STEP
    static_assert(kWide * sizeof(float) == 192, "the fold steps a row of the running sums");
    return;
  } else {
    for (int64_t j = 0; j < kIntPairs; ++j) {
      const int16_t* wj = buf + j * kWide * 2;
      const __m256i w0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj));
      const __m256i w1 = C > 1 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 16)) : z;
      const __m256i w2 = C > 2 ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wj + 32)) : z;
#define KVREPLAY_INT_ROW(m, r0, r1, r2)                                              \
      if constexpr (MB > m) {                                                        \
        int32_t pair;                                                                \
        std::memcpy(&pair, v + m * ldx + 2 * j, sizeof pair);                        \
        const __m256i xb = _mm256_set1_epi32(pair);                                  \
        r0 = _mm256_add_epi32(r0, _mm256_madd_epi16(xb, w0));                        \
        if constexpr (C > 1) r1 = _mm256_add_epi32(r1, _mm256_madd_epi16(xb, w1));   \
        if constexpr (C > 2) r2 = _mm256_add_epi32(r2, _mm256_madd_epi16(xb, w2));   \
      }
      KVREPLAY_INT_ROW(0, a00, a01, a02)
      KVREPLAY_INT_ROW(1, a10, a11, a12)
      KVREPLAY_INT_ROW(2, a20, a21, a22)
      KVREPLAY_INT_ROW(3, a30, a31, a32)
#undef KVREPLAY_INT_ROW
    }
  }
  const __m256i rows[4][3] = {{a00, a01, a02}, {a10, a11, a12}, {a20, a21, a22}, {a30, a31, a32}};
  for (int m = 0; m < MB; ++m) {
    const __m256 s = _mm256_set1_ps(scale[m * lds]), total = _mm256_set1_ps(sum[m * lds]);
    for (int c = 0; c < C; ++c) {
      float* at = sums + m * kWide + 8 * c;
      const __m256 prev = first ? _mm256_setzero_ps() : _mm256_loadu_ps(at);
      // s * sum(q * v) is exact (a power of two times an integer below 2^24 for Q4)
      const __m256 r = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(rows[m][c]), s), _mm256_loadu_ps(d + 8 * c), prev);
      _mm256_storeu_ps(at, _mm256_fmadd_ps(_mm256_loadu_ps(mn + 8 * c), total, r));
    }
  }
}


// ---- the same with x at 8 bits (Q4 records as an int8 tensor: pack_quant_panels(..., x_bits=8)) ----
// x per row and 32-k block as s * v, s = max |x| / 127 and v = round(x / s) in [-127, 127]: each
// value off by up to s / 2 (llama.cpp's Q8 rounding of x for these blocks; lossy, unlike the
// 16-bit form). Then VPMADDUBSW multiplies 32 weight nibbles (0-15) by 32 values of v and adds
// pairs into 16-bit sums (8 quads of k a block: at most 8 * 2 * 15 * 127 = 30,480, no
// saturation), VPMADDWD by ones widens them, and the block folds in as above.
constexpr int64_t kQuads = kQuantBlock / 4;  // 4 k's a byte group

// x ([M][K] bf16 bits) as v ([M][K] int8), scale and s * sum(v) per row and block (as
// quantize_rows: zeros -> s = 1; an inf or NaN -> NaN)
void quantize_rows8(const uint16_t* x, int64_t M, int64_t K, int8_t* v, float* scale, float* sum) {
  const int64_t blocks = K / kQuantBlock;
  const __m256 sign = _mm256_set1_ps(-0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < blocks; ++b) {
      const uint16_t* xb = x + m * K + b * kQuantBlock;
      int8_t* vb = v + m * K + b * kQuantBlock;
      const int64_t at = m * blocks + b;
      __m256 f[4];
      __m256 top = _mm256_setzero_ps();
      bool finite = true;
      for (int i = 0; i < 4; ++i) {
        f[i] = widen8(xb + 8 * i);
        const __m256 a = _mm256_andnot_ps(sign, f[i]);
        finite = finite && _mm256_movemask_ps(_mm256_cmp_ps(a, _mm256_set1_ps(std::numeric_limits<float>::max()),
                                                            _CMP_NLE_UQ)) == 0;
        top = _mm256_max_ps(top, a);
      }
      __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
      t = _mm_max_ps(t, _mm_movehl_ps(t, t));
      t = _mm_max_ss(t, _mm_shuffle_ps(t, t, 1));
      const float largest = _mm_cvtss_f32(t);
      if (!finite || largest == 0.f) {
        std::memset(vb, 0, kQuantBlock);
        scale[at] = finite ? 1.f : std::numeric_limits<float>::quiet_NaN();
        sum[at] = finite ? 0.f : scale[at];
        continue;
      }
      scale[at] = largest / 127.f;
      const __m256 inverse = _mm256_set1_ps(127.f / largest);
      __m256i ints[4];
      for (int i = 0; i < 4; ++i) {  // |x| * 127 / largest <= 127 (+ rounding): clamped below
        ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(f[i], inverse));
        ints[i] = _mm256_max_epi32(_mm256_min_epi32(ints[i], _mm256_set1_epi32(127)), _mm256_set1_epi32(-127));
      }
      const __m256i total = _mm256_add_epi32(_mm256_add_epi32(ints[0], ints[1]), _mm256_add_epi32(ints[2], ints[3]));
      // 32 int32 -> 32 int8 in order: packs interleave 128-bit lanes, the permute puts them back
      const __m256i words = _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[0], ints[1]), 0xD8);
      const __m256i words2 = _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[2], ints[3]), 0xD8);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(vb),
                          _mm256_permute4x64_epi64(_mm256_packs_epi16(words, words2), 0xD8));
      __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
      s4 = _mm_add_epi32(s4, _mm_srli_si128(s4, 8));
      s4 = _mm_add_epi32(s4, _mm_srli_si128(s4, 4));
      sum[at] = static_cast<float>(_mm_cvtsi128_si32(s4)) * scale[at];
    }
}

// Block kb of a panel of `width` tiles of Q4 integer records into buf ([8 quads][kWide
// outputs][4] uint8: VPMADDUBSW's operand, 8 outputs x 4 k's a vector) and scales as
// widen_int_block. A record row j holds pairs (2j, 2j + 1): rows 2q and 2q + 1 interleaved by
// 16 bits give quad q.
void widen_int8_block(const uint8_t* q, int64_t width, int64_t kb, uint8_t* buf, float* d, float* mn) {
  const __m128i nibble = _mm_set1_epi8(0x0F);
  for (int64_t t = 0; t < width; ++t) {
    const uint8_t* rec = q + (kb * width + t) * kQ4IntRecord;
    for (int64_t quad = 0; quad < kQuads; ++quad) {
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + 2 * quad * 16));
      const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(rec + (2 * quad + 1) * 16));
      const __m128i alo = _mm_and_si128(a, nibble), blo = _mm_and_si128(b, nibble);
      const __m128i ahi = _mm_and_si128(_mm_srli_epi16(a, 4), nibble), bhi = _mm_and_si128(_mm_srli_epi16(b, 4), nibble);
      uint8_t* row = buf + (quad * kWide + t * kLanes) * 4;
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row), _mm_unpacklo_epi16(alo, blo));       // outputs 0-3
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 16), _mm_unpackhi_epi16(alo, blo));  // 4-7
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 32), _mm_unpacklo_epi16(ahi, bhi));  // 8-11
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + 48), _mm_unpackhi_epi16(ahi, bhi));  // 12-15
    }
    std::memcpy(d + t * kLanes, rec + 256, kLanes * sizeof(float));
    std::memcpy(mn + t * kLanes, rec + 256 + kLanes * sizeof(float), kLanes * sizeof(float));
  }
}

// MB rows of v (int8, row 0's block, row stride ldx) over one widened block, C x 8 outputs:
// 16-bit sums in registers, widened and folded as int_block does.
template <int MB, int C>
void int8_block(const int8_t* v, int64_t ldx, const float* scale, const float* sum, int64_t lds,
                const uint8_t* buf, const float* d, const float* mn, float* sums, bool first) {
  static_assert(MB >= 1 && MB <= 3 && C >= 1 && C <= 3, "3 rows x 3 columns of 8 at most");
  alignas(32) int16_t ints[9][16];
  if constexpr (C == 3) {
    // in asm for the reason int_block's loop is (GCC spilled the 16-bit sums): the sums in
    // ymm0-8 (3 a row), the quad's 3 weight vectors in ymm9-11 (VPMADDUBSW takes its unsigned
    // bytes from a register), x's broadcast in ymm12, the product in ymm13; then each row's fold
    // in the same statement (written in C after a store of the sums, it was ~35% of this
    // function's time)
    const int8_t* x0 = v;
    const uint8_t* w = buf;
    const int64_t ld = ldx;
    int64_t n = kQuads;
    static_assert(kWide * 4 == 192, "the asm steps a quad's row of the widened block");
#define KVREPLAY_INT8_STEP(wr, acc) \
    "vpmaddubsw %%ymm12, %%ymm" #wr ", %%ymm13\n\tvpaddw %%ymm13, %%ymm" #acc ", %%ymm" #acc "\n\t"
#define KVREPLAY_INT8_ROW(address, a0, a1, a2) \
    "vpbroadcastd " address ", %%ymm12\n\t" KVREPLAY_INT8_STEP(9, a0) KVREPLAY_INT8_STEP(10, a1) KVREPLAY_INT8_STEP(11, a2)
// row m's fold after the loop: its 3 sums widened (VPMADDWD by ones in ymm14), to fp32, times
// s (ymm12), + d * that + the running sums (from prev), + m * total (ymm15), into sums: the
// C fold's arithmetic below, step for step
#define KVREPLAY_INT8_FOLD1(acc, col, at)                                                                     \
    "vpmaddwd %%ymm14, %%ymm" #acc ", %%ymm" #acc "\n\tvcvtdq2ps %%ymm" #acc ", %%ymm" #acc "\n\t"             \
    "vmulps %%ymm12, %%ymm" #acc ", %%ymm" #acc "\n\tvmovups " #at "(%[prev]), %%ymm13\n\t"                    \
    "vfmadd231ps " #col "(%[d]), %%ymm" #acc ", %%ymm13\n\tvfmadd231ps " #col "(%[mn]), %%ymm15, %%ymm13\n\t"  \
    "vmovups %%ymm13, " #at "(%[sums])\n\t"
#define KVREPLAY_INT8_FOLD2(scale_at, total_at, a0, a1, a2, at0, at1, at2)                                     \
    "vbroadcastss " scale_at ", %%ymm12\n\t"                                                                  \
    "vbroadcastss " total_at ", %%ymm15\n\t"                                                                  \
    KVREPLAY_INT8_FOLD1(a0, 0, at0) KVREPLAY_INT8_FOLD1(a1, 32, at1) KVREPLAY_INT8_FOLD1(a2, 64, at2)
#define KVREPLAY_INT8_LOOP(rows, folds)                                                                        \
    asm volatile(                                                                                              \
        "vpxor %%xmm0, %%xmm0, %%xmm0\n\tvpxor %%xmm1, %%xmm1, %%xmm1\n\tvpxor %%xmm2, %%xmm2, %%xmm2\n\t"     \
        "vpxor %%xmm3, %%xmm3, %%xmm3\n\tvpxor %%xmm4, %%xmm4, %%xmm4\n\tvpxor %%xmm5, %%xmm5, %%xmm5\n\t"     \
        "vpxor %%xmm6, %%xmm6, %%xmm6\n\tvpxor %%xmm7, %%xmm7, %%xmm7\n\tvpxor %%xmm8, %%xmm8, %%xmm8\n\t"     \
        "1:\n\t"                                                                                               \
        "vmovdqu (%[w]), %%ymm9\n\tvmovdqu 32(%[w]), %%ymm10\n\tvmovdqu 64(%[w]), %%ymm11\n\t"                 \
        rows                                                                                                   \
        "add $4, %[x]\n\t"                                                                                     \
        "add $192, %[w]\n\t"                                                                                   \
        "dec %[n]\n\t"                                                                                         \
        "jnz 1b\n\t"                                                                                           \
        "vpcmpeqw %%ymm14, %%ymm14, %%ymm14\n\tvpsrlw $15, %%ymm14, %%ymm14\n\t"                                \
        folds                                                                                                  \
        : [x] "+r"(x0), [w] "+r"(w), [n] "+r"(n)                                                               \
        : [ld] "r"(ld), [sc] "r"(scale), [tot] "r"(sum), [lds] "r"(lds * 4), [d] "r"(d), [mn] "r"(mn),         \
          [prev] "r"(first ? kZeroSums : sums), [sums] "r"(sums)                                               \
        : "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm10", "xmm11",    \
          "xmm12", "xmm13", "xmm14", "xmm15", "cc", "memory")
    if constexpr (MB == 1)
      KVREPLAY_INT8_LOOP(KVREPLAY_INT8_ROW("(%[x])", 0, 1, 2),
                         KVREPLAY_INT8_FOLD2("(%[sc])", "(%[tot])", 0, 1, 2, 0, 32, 64));
    else if constexpr (MB == 2)
      KVREPLAY_INT8_LOOP(KVREPLAY_INT8_ROW("(%[x])", 0, 1, 2) KVREPLAY_INT8_ROW("(%[x],%[ld],1)", 3, 4, 5),
                         KVREPLAY_INT8_FOLD2("(%[sc])", "(%[tot])", 0, 1, 2, 0, 32, 64)
                         KVREPLAY_INT8_FOLD2("(%[sc],%[lds],1)", "(%[tot],%[lds],1)", 3, 4, 5, 192, 224, 256));
    else
      KVREPLAY_INT8_LOOP(KVREPLAY_INT8_ROW("(%[x])", 0, 1, 2) KVREPLAY_INT8_ROW("(%[x],%[ld],1)", 3, 4, 5)
                             KVREPLAY_INT8_ROW("(%[x],%[ld],2)", 6, 7, 8),
                         KVREPLAY_INT8_FOLD2("(%[sc])", "(%[tot])", 0, 1, 2, 0, 32, 64)
                         KVREPLAY_INT8_FOLD2("(%[sc],%[lds],1)", "(%[tot],%[lds],1)", 3, 4, 5, 192, 224, 256)
                         KVREPLAY_INT8_FOLD2("(%[sc],%[lds],2)", "(%[tot],%[lds],2)", 6, 7, 8, 384, 416, 448));
    static_assert(kWide * sizeof(float) == 192, "the fold steps a row of the running sums");
    return;
#undef KVREPLAY_INT8_LOOP
#undef KVREPLAY_INT8_FOLD2
#undef KVREPLAY_INT8_FOLD1
#undef KVREPLAY_INT8_ROW
#undef KVREPLAY_INT8_STEP
  } else {
    __m256i acc[MB][C];
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < C; ++c) acc[m][c] = _mm256_setzero_si256();
    for (int64_t quad = 0; quad < kQuads; ++quad) {
      const uint8_t* wq = buf + quad * kWide * 4;
      for (int m = 0; m < MB; ++m) {
        int32_t four;
        std::memcpy(&four, v + m * ldx + 4 * quad, sizeof four);
        const __m256i xb = _mm256_set1_epi32(four);
        for (int c = 0; c < C; ++c)
          acc[m][c] = _mm256_add_epi16(acc[m][c], _mm256_maddubs_epi16(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wq + 32 * c)), xb));
      }
    }
    for (int m = 0; m < MB; ++m)
      for (int c = 0; c < C; ++c) _mm256_store_si256(reinterpret_cast<__m256i*>(ints[m * 3 + c]), acc[m][c]);
  }
  const __m256i ones = _mm256_set1_epi16(1);
  for (int m = 0; m < MB; ++m) {
    const __m256 s = _mm256_set1_ps(scale[m * lds]), total = _mm256_set1_ps(sum[m * lds]);
    for (int c = 0; c < C; ++c) {
      const __m256i wide = _mm256_madd_epi16(_mm256_load_si256(reinterpret_cast<const __m256i*>(ints[m * 3 + c])), ones);
      float* at = sums + m * kWide + 8 * c;
      const __m256 prev = first ? _mm256_setzero_ps() : _mm256_loadu_ps(at);
      const __m256 r = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(wide), s), _mm256_loadu_ps(d + 8 * c), prev);
      _mm256_storeu_ps(at, _mm256_fmadd_ps(_mm256_loadu_ps(mn + 8 * c), total, r));
    }
  }
}


// The two forms of integer products for int_rows / int_panel: the type of x's integers and of the
// widened weights, the most rows a block kernel takes, the widened block's size, and its widening
// and block kernels.
struct Int16Form {  // 16-bit x (int_block)
  using X = int16_t;
  using W = int16_t;
  static constexpr int kMaxRows = 4;
  static constexpr int64_t kBuffer = kIntPairs * kWide * 2, kBytesAnOutput = 2;  // (a k pair: 2 int16)
  static void widen(const uint8_t* q, int64_t record, int64_t width, int64_t kb, W* buf, float* d, float* mn) {
    widen_int_block(q, record, width, kb, buf, d, mn);
  }
  template <int MB, int C, typename... Args> static void block(Args... args) { int_block<MB, C>(args...); }
};
struct Int8Form {  // 8-bit x, Q4 records only (int8_block)
  using X = int8_t;
  using W = uint8_t;
  static constexpr int kMaxRows = 3;
  static constexpr int64_t kBuffer = kQuads * kWide * 4, kBytesAnOutput = 4;  // (a k quad: 4 bytes)
  static void widen(const uint8_t* q, int64_t, int64_t width, int64_t kb, W* buf, float* d, float* mn) {
    widen_int8_block(q, width, kb, buf, d, mn);
  }
  template <int MB, int C, typename... Args> static void block(Args... args) { int8_block<MB, C>(args...); }
};

// M rows in balanced blocks of up to `most` rows (as panel_rows): their sizes into sizes[],
// their number returned (M <= kIntRowChunk)
int64_t row_blocks(int64_t M, int64_t most, int8_t* sizes) {
  const int64_t blocks = (M + most - 1) / most;
  for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
    sizes[b] = static_cast<int8_t>((M - m0) / (blocks - b));
    m0 += sizes[b];
  }
  return blocks;
}

// All rows (blocks of sizes[0 .. blocks - 1] rows, from row_blocks) over one widened block, C x 8
// outputs (buf, d, mn at the first). (The sizes come in worked out once a panel: a division per
// block here was ~10% of this function's time at batch 32.)
template <typename Form, int C>
void int_rows(const typename Form::X* v, const float* scale, const float* sum, int64_t K,
              const typename Form::W* buf, const float* d, const float* mn, float* sums, const int8_t* sizes,
              int64_t blocks, bool first) {
  const int64_t lds = K / kQuantBlock;
  for (int64_t b = 0, m0 = 0; b < blocks; ++b) {
    const int64_t rows = sizes[b];
    const auto* vm = v + m0 * K;
    const float *sm = scale + m0 * lds, *tm = sum + m0 * lds;
    float* out = sums + m0 * kWide;
    if (rows == 1)
      Form::template block<1, C>(vm, K, sm, tm, lds, buf, d, mn, out, first);
    else if (rows == 2)
      Form::template block<2, C>(vm, K, sm, tm, lds, buf, d, mn, out, first);
    else if (rows == 3)
      Form::template block<3, C>(vm, K, sm, tm, lds, buf, d, mn, out, first);
    else
      Form::template block<Form::kMaxRows, C>(vm, K, sm, tm, lds, buf, d, mn, out, first);
    m0 += rows;
  }
}

// Rows an int_panel pass takes: their running sums (192 bytes a row) stay in L1 while every
// block of the panel folds into them. With all of a prefill chunk's rows at once (2,048), the
// sums went through L2 once a 32-k block: prefill ran at 0.81x the bf16 panels (bench/int_products.py).
constexpr int64_t kIntRowChunk = 64;

// All M rows (quantize_rows' or quantize_rows8's v, scale, sum) against one panel of `width`
// tiles of integer records (q), into out (row stride ld): kIntRowChunk rows at a time, block by
// block, columns in groups of 24 (then 16 or 8). (Each chunk widens the blocks again: a small
// cost beside 64 rows of products.)
template <typename Form, typename OutT>
void int_panel(const typename Form::X* v, const float* scale, const float* sum, const uint8_t* q, int64_t record,
               int64_t width, const uint16_t* bias, OutT* out, int64_t M, int64_t ld, int64_t K) {
  auto* buf = kvreplay_scratch::thread_buffer<typename Form::W, 5>(Form::kBuffer);
  float* scales = kvreplay_scratch::thread_buffer<float, 6>(2 * kWide);
  float* sums = kvreplay_scratch::thread_buffer<float, 3>(std::min(M, kIntRowChunk) * kWide);
  const int64_t cols = width * kLanes, lds = K / kQuantBlock;
  int8_t sizes[kIntRowChunk];
  for (int64_t r0 = 0; r0 < M; r0 += kIntRowChunk) {
    const int64_t rows = std::min(kIntRowChunk, M - r0), blocks = row_blocks(rows, Form::kMaxRows, sizes);
    const auto* vr = v + r0 * K;
    const float *sr = scale + r0 * lds, *tr = sum + r0 * lds;
    for (int64_t kb = 0; kb < lds; ++kb) {
      Form::widen(q, record, width, kb, buf, scales, scales + kWide);
      const int64_t k0 = kb * kQuantBlock;
      for (int64_t c0 = 0; c0 < cols;) {
        const int64_t groups = std::min<int64_t>(3, (cols - c0) / 8);
        const auto* b = buf + c0 * Form::kBytesAnOutput;
        const float *d = scales + c0, *mn = scales + kWide + c0;
        switch (groups) {
          case 3: int_rows<Form, 3>(vr + k0, sr + kb, tr + kb, K, b, d, mn, sums + c0, sizes, blocks, kb == 0); break;
          case 2: int_rows<Form, 2>(vr + k0, sr + kb, tr + kb, K, b, d, mn, sums + c0, sizes, blocks, kb == 0); break;
          default: int_rows<Form, 1>(vr + k0, sr + kb, tr + kb, K, b, d, mn, sums + c0, sizes, blocks, kb == 0); break;
        }
        c0 += groups * 8;
      }
    }
    store_sums(sums, bias, out + r0 * ld, rows, ld, cols);
  }
}
#endif

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && defined(__linux__)
#define KVREPLAY_AMX 1
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
using kvreplay_amx::TileConfig;

// Whether the tiles are ours (simd.h); KVREPLAY_AMX_PANELS=0 before the first call keeps the
// vector kernel (its tests on such a CPU).
bool amx_permitted() {
  static const bool ok = !kvreplay_amx::switched_off("KVREPLAY_AMX_PANELS") && kvreplay_amx::tiles_granted();
  return ok;
}

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
#endif

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

// The SiLU x up of one panel of a gate/up product whose rows are in pair order (see
// panel_silu_mul): `stage` holds the panel's bf16 outputs, rows kPanelTiles * 16 apart, the 8 *
// width gate outputs first and then their up partners; out (row stride F) gets silu(gate) * up
// from column col0 on, with silu_rows' arithmetic (the same bits where it runs 16 lanes).
void silu_panel(const uint16_t* stage, int64_t M, int64_t width, uint16_t* out, int64_t F, int64_t col0) {
  constexpr int64_t kStageRow = kPanelTiles * kLanes;
  const int64_t half = 8 * width;
#if !defined(__AVX512BF16__)  // silu_rows' arithmetic, as this build's silu_mul runs it
  const auto* typed = reinterpret_cast<const c10::BFloat16*>(stage);
  for (int64_t m = 0; m < M; ++m)
    silu_row(typed + m * kStageRow, typed + m * kStageRow + half,
             reinterpret_cast<c10::BFloat16*>(out) + m * F + col0, half);
#else
  const __m512 one = _mm512_set1_ps(1.f);
  auto* typed = reinterpret_cast<c10::BFloat16*>(out);
  for (int64_t m = 0; m < M; ++m) {
    const uint16_t* g = stage + m * kStageRow;
    for (int64_t i = 0; i < half; i += 16) {
      const __mmask16 lanes = half - i >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (half - i)) - 1u);
      const __m512 x = kvreplay_simd::widen16(_mm256_maskz_loadu_epi16(lanes, g + i));
      const __m512 up = kvreplay_simd::widen16(_mm256_maskz_loadu_epi16(lanes, g + half + i));
      const __m512 silu = rnd(_mm512_div_ps(x, _mm512_add_ps(one, kvreplay_simd::exp16(neg(x)))), typed);
      _mm256_mask_storeu_epi16(out + m * F + col0 + i, lanes, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(silu, up)));
    }
  }
#endif
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

// `out`: [M, N] (fp32 when widen, else bf16) to write into, or undefined for a new tensor.
// `argmax` (with widen): no outputs stored; instead argmax[m] = the index of row m's largest
// output as `out` would hold it (the first on ties, a NaN's if any): what argmax_rows answers.
// `silu` (bf16, a gate/up weight in pair order): out is [M, N / 2], silu(gate) * up (panel_silu_mul).
at::Tensor panel_product(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                         bool widen, const char* name, at::Tensor out = at::Tensor(), int64_t* argmax = nullptr,
                         bool silu = false) {
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

// ---- argmax_rows ----
// One pass per row: 16 lanes keep their largest value and its first index (a later equal value
// does not replace it), then the lanes are reduced to the smallest index holding the maximum.
// A NaN anywhere sends the row to the scalar rule (torch.argmax: the first NaN).
int64_t argmax_scalar(const float* row, int64_t n) {
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (std::isnan(row[i])) return i;
    if (row[i] > row[best]) best = i;
  }
  return best;
}

int64_t argmax_row(const float* row, int64_t n) {
#if defined(__AVX512F__)
  if (n >= 16 && n <= INT32_MAX) {  // lane indices are int32
    __m512 best = _mm512_loadu_ps(row);
    __m512i best_index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    __m512i index = best_index;
    const __m512i step = _mm512_set1_epi32(16);
    __mmask16 nan = _mm512_cmp_ps_mask(best, best, _CMP_UNORD_Q);
    int64_t i = 16;
    for (; i + 16 <= n; i += 16) {
      const __m512 v = _mm512_loadu_ps(row + i);
      index = _mm512_add_epi32(index, step);
      nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
      const __mmask16 greater = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_blend_ps(greater, best, v);
      best_index = _mm512_mask_blend_epi32(greater, best_index, index);
    }
    if (nan) return argmax_scalar(row, n);
    float values[16];
    int32_t indices[16];
    _mm512_storeu_ps(values, best);
    _mm512_storeu_si512(indices, best_index);
    int64_t result = indices[0];
    float top = values[0];
    for (int lane = 1; lane < 16; ++lane)
      if (values[lane] > top || (values[lane] == top && indices[lane] < result)) {
        top = values[lane];
        result = indices[lane];
      }
    for (; i < n; ++i) {
      if (std::isnan(row[i])) return i;
      if (row[i] > top) {
        top = row[i];
        result = i;
      }
    }
    return result;
  }
#endif
  return argmax_scalar(row, n);
}

at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.size(1) > 0,
              "argmax_rows: x must be a float32 [rows, n] tensor with n > 0, got ", x.scalar_type(), " ",
              x.sizes());
  auto xc = x.contiguous();
  const int64_t rows = x.size(0), n = x.size(1);
  auto out = at::empty({rows}, x.options().dtype(at::kLong));
  const float* xp = xc.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) op[r] = argmax_row(xp + r * n, n);
  });
  return out;
}

// ---- decode_layer / decode_layers: decoder layers of a decode-only step in one call ----
// The ops above in the order kvreplay/models/llama.py calls them, with the CPU decode attention
// kernel (kvreplay_cpu::decode_attention, loaded by the caller) in the middle: the same functions
// on the same tensors, so the same bits, without ~12 Python-level calls a layer (measured ~50 us
// a layer at batch 1, ~100 at batch 32 on the Xeon of docs/benchmarks.md: 1.5-3 ms a step). With
// want_mass, the mass output is the importance signal attention.py takes from the kernel: per
// row and block, the largest mass over KV heads. decode_layers runs a stack of layers in one
// call: the Python call a layer (~28 us at batch 32) goes, and the layers share one set of
// buffers (allocating ~10 a layer cost ~0.5 ms a batch-32 step in the allocator's free lists).
struct LayerWeights {
  at::Tensor input_norm, post_norm, qkv, o, gate_up, down;
  c10::optional<at::Tensor> qkv_bias, o_bias, gate_up_bias, down_bias;
};

// The weights' shapes for a hidden size H (checked before anything is written); returns F.
int64_t check_layer(const LayerWeights& w, int64_t H, int64_t num_q, int64_t num_kv, int64_t D,
                    const std::string& where) {
  auto check = [&](const at::Tensor& packed, int64_t n, int64_t k, const char* name) {
    const std::string what = where + name;
    const auto [N, K] = panel_shape(packed, what.c_str());
    TORCH_CHECK((n < 0 || N == n) && K == k, what, " weight is [", N, ", ", K,
                "], expected [", n < 0 ? "any" : std::to_string(n), ", ", k, "]");
    return N;
  };
  auto bias = [&](const c10::optional<at::Tensor>& b, int64_t n, const char* name) {
    if (b.has_value() && b->defined())
      TORCH_CHECK(b->dim() == 1 && b->size(0) == n && b->scalar_type() == at::kBFloat16, where, name,
                  " bias must be bf16 [", n, "]");
  };
  const int64_t qkv_width = check(w.qkv, (num_q + 2 * num_kv) * D, H, "qkv");
  check(w.o, H, num_q * D, "o");
  const int64_t F = check(w.gate_up, -1, H, "gate_up") / 2;
  check(w.down, H, F, "down");
  bias(w.qkv_bias, qkv_width, "qkv");
  bias(w.o_bias, H, "o");
  bias(w.gate_up_bias, 2 * F, "gate_up");
  bias(w.down_bias, H, "down");
  for (const auto* norm : {&w.input_norm, &w.post_norm})
    TORCH_CHECK(norm->dim() == 1 && norm->size(0) == H && norm->is_contiguous() &&
                norm->scalar_type() == at::kBFloat16, where, "norm weights must be contiguous bf16 [", H, "]");
  return F;
}

// Where a layer writes: x, qkv and mlp are scratch, delta (the layer's output) and hidden (the
// residual stream) carry on to the next layer.
struct LayerBuffers {
  at::Tensor x, hidden, delta, qkv, mlp;
};

LayerBuffers layer_buffers(const at::Tensor& delta, int64_t qkv_width, int64_t F) {
  const int64_t T_ = delta.size(0), H = delta.size(1);
  const auto options = delta.options();
  return {at::empty({T_, H}, options), at::empty({T_, H}, options), at::empty({T_, H}, options),
          at::empty({T_, qkv_width}, options), at::empty({T_, F}, options)};
}

// One layer from delta and the residual stream (null: it starts at this layer) into buf.delta
// and buf.hidden; either input may be those buffers themselves. Returns the mass (see above).
at::Tensor run_layer(const at::Tensor& delta, const at::Tensor* residual, const LayerWeights& w, double eps,
                     const at::Tensor& cos, const at::Tensor& sin, int64_t num_q, int64_t num_kv,
                     at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
                     const at::Tensor& context_lens, double scale, bool want_mass, LayerBuffers& buf) {
  static const auto attention =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("kvreplay_cpu::decode_attention", "")
          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&,
                                                                const at::Tensor&, const at::Tensor&,
                                                                const at::Tensor&, double, bool, bool)>();
  const int64_t T_ = delta.size(0), D = kv_cache.size(4);
  add_rms_norm_into(delta, residual, w.input_norm, eps, buf.x, buf.hidden);
  panel_product(buf.x, w.qkv, w.qkv_bias, false, "decode_layer: qkv", buf.qkv);
  rope_write_cache(buf.qkv, cos, sin, num_q, num_kv, kv_cache, slot_mapping);
  const auto q = buf.qkv.view({T_, -1, D}).narrow(1, 0, num_q);
  const auto caches = kv_cache.unbind(0);
  const auto [attn, lse, mass] =
      attention.call(q, caches[0], caches[1], block_tables, context_lens, scale, false, want_mass);
  panel_product(attn.view({T_, num_q * D}), w.o, w.o_bias, false, "decode_layer: o", buf.delta);
  add_rms_norm_into(buf.delta, &buf.hidden, w.post_norm, eps, buf.x, buf.hidden);
  panel_product(buf.x, w.gate_up, w.gate_up_bias, false, "decode_layer: gate_up", buf.mlp, nullptr, true);
  panel_product(buf.mlp, w.down, w.down_bias, false, "decode_layer: down", buf.delta);
  return want_mass ? mass.amax(1) : mass;
}

void check_stream(const at::Tensor& delta, const c10::optional<at::Tensor>& residual, const char* name) {
  TORCH_CHECK(delta.dim() == 2 && delta.is_contiguous() && delta.scalar_type() == at::kBFloat16,
              name, ": delta must be a contiguous bf16 [T, H] tensor");
  if (residual.has_value() && residual->defined())
    TORCH_CHECK(residual->sizes() == delta.sizes() && residual->is_contiguous() &&
                residual->scalar_type() == delta.scalar_type(), name, ": residual must match delta");
}

void check_cache(const at::Tensor& kv_cache, int64_t num_kv, const char* name) {
  TORCH_CHECK(kv_cache.dim() == 5 && kv_cache.size(0) == 2 && kv_cache.size(1) == num_kv &&
              kv_cache.is_contiguous() && kv_cache.scalar_type() == at::kBFloat16,
              name, ": kv_cache must be a contiguous bf16 [2, ", num_kv, ", blocks, block_size, D] tensor");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> decode_layer(
    const at::Tensor& delta, const c10::optional<at::Tensor>& residual, const at::Tensor& input_norm,
    const at::Tensor& post_norm, double eps, const at::Tensor& qkv, const c10::optional<at::Tensor>& qkv_bias,
    const at::Tensor& o, const c10::optional<at::Tensor>& o_bias, const at::Tensor& gate_up,
    const c10::optional<at::Tensor>& gate_up_bias, const at::Tensor& down,
    const c10::optional<at::Tensor>& down_bias, const at::Tensor& cos, const at::Tensor& sin, int64_t num_q,
    int64_t num_kv, at::Tensor& kv_cache, const at::Tensor& slot_mapping, const at::Tensor& block_tables,
    const at::Tensor& context_lens, double scale, bool want_mass) {
  check_stream(delta, residual, "decode_layer");
  check_cache(kv_cache, num_kv, "decode_layer");
  const LayerWeights w{input_norm, post_norm, qkv, o, gate_up, down, qkv_bias, o_bias, gate_up_bias, down_bias};
  // the weights' shapes first, so that a wrong one fails before the cache is written
  const int64_t D = kv_cache.size(4), F = check_layer(w, delta.size(1), num_q, num_kv, D, "decode_layer: ");
  auto buf = layer_buffers(delta, (num_q + 2 * num_kv) * D, F);
  const bool has_res = residual.has_value() && residual->defined();
  auto mass = run_layer(delta, has_res ? &*residual : nullptr, w, eps, cos, sin, num_q, num_kv, kv_cache,
                        slot_mapping, block_tables, context_lens, scale, want_mass, buf);
  return {buf.delta, buf.hidden, mass};
}

// weights: per layer input_norm, post_norm, qkv, o, gate_up, down (6 a layer, in order); biases:
// per layer those of qkv, o, gate_up, down (4 a layer, None where there is none); one cache a
// layer. Returns the last layer's (delta, residual) and, with want_mass, each layer's mass.
std::tuple<at::Tensor, at::Tensor, std::vector<at::Tensor>> decode_layers(
    const at::Tensor& delta, const c10::optional<at::Tensor>& residual, at::TensorList weights,
    const c10::List<c10::optional<at::Tensor>>& biases, double eps, const at::Tensor& cos, const at::Tensor& sin,
    int64_t num_q, int64_t num_kv, at::TensorList kv_caches, const at::Tensor& slot_mapping,
    const at::Tensor& block_tables, const at::Tensor& context_lens, double scale, bool want_mass) {
  const int64_t L = static_cast<int64_t>(kv_caches.size());
  TORCH_CHECK(L > 0 && static_cast<int64_t>(weights.size()) == 6 * L && static_cast<int64_t>(biases.size()) == 4 * L,
              "decode_layers: ", L, " caches need 6 weights and 4 biases a layer, got ", weights.size(), " and ",
              biases.size());
  check_stream(delta, residual, "decode_layers");
  // every layer's weights and cache before anything is written
  std::vector<LayerWeights> layers;
  int64_t F = 0;
  for (int64_t i = 0; i < L; ++i) {
    const std::string where = "decode_layers: layer " + std::to_string(i) + " ";
    check_cache(kv_caches[i], num_kv, where.c_str());
    TORCH_CHECK(kv_caches[i].sizes() == kv_caches[0].sizes(), where, "kv_cache differs from layer 0's");
    const at::Tensor* lw = weights.data() + 6 * i;
    auto bias = [&](int64_t j) { return biases.get(4 * i + j); };
    layers.push_back({lw[0], lw[1], lw[2], lw[3], lw[4], lw[5], bias(0), bias(1), bias(2), bias(3)});
    const int64_t f = check_layer(layers.back(), delta.size(1), num_q, num_kv, kv_caches[0].size(4), where);
    TORCH_CHECK(i == 0 || f == F, where, "MLP width ", f, " differs from layer 0's ", F);
    F = f;
  }
  auto buf = layer_buffers(delta, (num_q + 2 * num_kv) * kv_caches[0].size(4), F);
  const bool has_res = residual.has_value() && residual->defined();
  const at::Tensor* stream = has_res ? &*residual : nullptr;
  std::vector<at::Tensor> masses;
  for (int64_t i = 0; i < L; ++i) {
    at::Tensor cache = kv_caches[i];
    auto mass = run_layer(i == 0 ? delta : buf.delta, stream, layers[i], eps, cos, sin, num_q, num_kv, cache,
                          slot_mapping, block_tables, context_lens, scale, want_mass, buf);
    if (want_mass) masses.push_back(std::move(mass));
    stream = &buf.hidden;
  }
  return {buf.delta, buf.hidden, masses};
}

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
