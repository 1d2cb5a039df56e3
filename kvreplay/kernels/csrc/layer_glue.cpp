// The decoder layer's glue as single ops (add_rms_norm, rope_write_cache, silu_mul; layer_ops.cpp
// describes them), and the SiLU of a gate/up panel that panel_silu_mul combines in L1.
#include "layer_ops.h"

namespace kvreplay_layer_ops {
namespace {

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
}  // namespace

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

namespace {
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
}  // namespace

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

namespace {
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
}  // namespace

at::Tensor silu_mul(const at::Tensor& gate_up) { return silu_mul_into(gate_up, at::Tensor()); }

#if defined(__AVX512BF16__) || defined(KVREPLAY_AVX2)
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
}  // namespace kvreplay_layer_ops
