// Integer products on a GGUF file's own blocks (AVX2; records from pack_quant_panels(..., integer)):
// the kernel that panel_product (panels.cpp) runs over a panel of integer records, with x as
// 16-bit or 8-bit integers per 32-k block. Layouts and the two forms: layer_ops.h.
#include "layer_ops.h"

namespace kvreplay_layer_ops {
#if defined(KVREPLAY_AVX2)
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
// (kIntPairs, the pairs (k, k + 1) a block: layer_ops.h)
namespace {
// the running sums before the first block, for the folds in asm (int_block, int8_block)
alignas(32) constexpr float kZeroSums[4 * kWide] = {};
}  // namespace


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

namespace {

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

}  // namespace


// ---- the same with x at 8 bits (Q4 records as an int8 tensor: pack_quant_panels(..., x_bits=8)) ----
// x per row and 32-k block as s * v, s = max |x| / 127 and v = round(x / s) in [-127, 127]: each
// value off by up to s / 2 (llama.cpp's Q8 rounding of x for these blocks; lossy, unlike the
// 16-bit form). Then VPMADDUBSW multiplies 32 weight nibbles (0-15) by 32 values of v and adds
// pairs into 16-bit sums (8 quads of k a block: at most 8 * 2 * 15 * 127 = 30,480, no
// saturation), VPMADDWD by ones widens them, and the block folds in as above.
// (kQuads, 4 k's a byte group: layer_ops.h)

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

namespace {

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

}  // namespace

// the forms' widening and block kernels (declared in layer_ops.h)
void Int16Form::widen(const uint8_t* q, int64_t record, int64_t width, int64_t kb, W* buf, float* d, float* mn) {
  widen_int_block(q, record, width, kb, buf, d, mn);
}
template <int MB, int C, typename... Args> void Int16Form::block(Args... args) { int_block<MB, C>(args...); }
void Int8Form::widen(const uint8_t* q, int64_t, int64_t width, int64_t kb, W* buf, float* d, float* mn) {
  widen_int8_block(q, width, kb, buf, d, mn);
}
template <int MB, int C, typename... Args> void Int8Form::block(Args... args) { int8_block<MB, C>(args...); }

namespace {

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
}  // namespace


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

template void int_panel<Int16Form, uint16_t>(const Int16Form::X*, const float*, const float*, const uint8_t*, int64_t, int64_t,
                          const uint16_t*, uint16_t*, int64_t, int64_t, int64_t);
template void int_panel<Int16Form, float>(const Int16Form::X*, const float*, const float*, const uint8_t*, int64_t, int64_t,
                          const uint16_t*, float*, int64_t, int64_t, int64_t);
template void int_panel<Int8Form, uint16_t>(const Int8Form::X*, const float*, const float*, const uint8_t*, int64_t, int64_t,
                          const uint16_t*, uint16_t*, int64_t, int64_t, int64_t);
template void int_panel<Int8Form, float>(const Int8Form::X*, const float*, const float*, const uint8_t*, int64_t, int64_t,
                          const uint16_t*, float*, int64_t, int64_t, int64_t);
#endif
}  // namespace kvreplay_layer_ops
