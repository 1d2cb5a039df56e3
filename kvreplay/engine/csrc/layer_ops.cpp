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
//
// Built without -ffast-math and with -ffp-contract=off so that every rounding above happens
// where it is written. Built on first use by kvreplay/engine/cpu_kernels.py.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <cmath>
#include <cstdint>
#include <tuple>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

template <typename T> inline float f32(T v) { return static_cast<float>(v); }
template <typename T> inline float round_to(float v) { return static_cast<float>(static_cast<T>(v)); }

template <typename T>
void rms_rows(const T* x, const T* res, const T* w, T* out, T* hidden, int64_t rows, int64_t H,
              float eps) {
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(H);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * H;
      float* h = row.data();
      if (res) {
        const T* rr = res + r * H;
        T* hr = hidden + r * H;
        for (int64_t i = 0; i < H; ++i) {
          const T v = static_cast<T>(f32(xr[i]) + f32(rr[i]));
          hr[i] = v;
          h[i] = f32(v);
        }
      } else {
        for (int64_t i = 0; i < H; ++i) h[i] = f32(xr[i]);
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < H; ++i) ss += h[i] * h[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(H) + eps);
      T* o = out + r * H;
      for (int64_t i = 0; i < H; ++i) o[i] = static_cast<T>(f32(w[i]) * round_to<T>(h[i] * inv));
    }
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
    std::vector<T> tmp(D);
    for (int64_t t = begin; t < end; ++t) {
      T* row = qkv + t * width;
      const T* c = cos + t * D;
      const T* s = sin + t * D;
      for (int64_t head = 0; head < num_q + num_kv; ++head) {
        T* x = row + head * D;
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
        T* vd = kd + kv_plane;
        for (int64_t d = 0; d < D; ++d) { kd[d] = k[d]; vd[d] = v[d]; }
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

}  // namespace

TORCH_LIBRARY(kvreplay_layer, m) {
  m.def("add_rms_norm(Tensor x, Tensor? residual, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rope_write_cache(Tensor(a!) qkv, Tensor cos, Tensor sin, int num_q, int num_kv, "
        "Tensor(b!) kv_cache, Tensor slot_mapping) -> ()");
  m.impl("add_rms_norm", c10::DispatchKey::CPU, &add_rms_norm);
  m.impl("rope_write_cache", c10::DispatchKey::CPU, &rope_write_cache);
}
