// GGUF blocks (Q4_0, Q4_1, Q8_0) as panel records: pack_quant_panels lays a file's blocks out in
// the record layout of layer_ops.h (for bf16 expansion, or for integer products), and
// expand_quant_panel(s) turns records back into the bf16 panels they stand for.
#include "layer_ops.h"

namespace kvreplay_layer_ops {
namespace {
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
}  // namespace

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
}  // namespace kvreplay_layer_ops
