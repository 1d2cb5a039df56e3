// decode_layer / decode_layers: a decode-only step's decoder layers as compiled calls, the layer
// ops of the other sources and the decode attention kernel in the order llama.py calls them.
#include "layer_ops.h"

namespace kvreplay_layer_ops {
// ---- decode_layer / decode_layers: decoder layers of a decode-only step in one call ----
// The layer ops of the other sources in the order kvreplay/models/llama.py calls them, with the CPU decode attention
// kernel (kvreplay_cpu::decode_attention, loaded by the caller) in the middle: the same functions
// on the same tensors, so the same bits, without ~12 Python-level calls a layer (measured ~50 us
// a layer at batch 1, ~100 at batch 32 on the Xeon of docs/benchmarks.md: 1.5-3 ms a step). With
// want_mass, the mass output is the importance signal attention.py takes from the kernel: per
// row and block, the largest mass over KV heads. decode_layers runs a stack of layers in one
// call: the Python call a layer (~28 us at batch 32) goes, and the layers share one set of
// buffers (allocating ~10 a layer cost ~0.5 ms a batch-32 step in the allocator's free lists).
namespace {
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
}  // namespace


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
}  // namespace kvreplay_layer_ops
