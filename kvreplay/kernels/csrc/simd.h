// SIMD helpers shared by the CPU kernels (decode_attention.cpp, layer_ops.cpp), AVX-512 (and a
// few on AVX2 for CPUs without it), and the per-thread scratch buffers and work claiming both use.
#pragma once
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

namespace kvreplay_scratch {
// A buffer of at least n elements owned by the calling thread, kept across calls: what a kernel's
// parallel region needs for its working rows. (A fresh std::vector there cost a malloc and a
// zero fill per thread per call, ~1% of a batch-32 decode step in perf, most of it in glibc's
// _int_malloc.) `Slot` tells apart buffers that are live at the same time on one thread; the
// contents are not kept between uses.
template <typename T, int Slot = 0>
inline T* thread_buffer(int64_t n) {
  thread_local std::vector<T> buffer;
  if (static_cast<int64_t>(buffer.size()) < n) buffer.resize(static_cast<size_t>(n));
  return buffer.data();
}

// Chunks of [0, n) that a parallel region's threads claim one after another as they finish the
// last, rather than one fixed share each: a step's threads do not run at one speed on a shared
// machine (a Zen 3 VM, batch-32 decode: with fixed halves one thread's products took 26% longer
// than the other's, which then spent a quarter of its time waiting; docs/benchmarks.md).
// About 8 chunks a thread, then a quarter of what is left a thread once that is smaller, down
// to one, so that the threads finish together (with fixed chunks the last one, 1/16 of a
// batch-32 gate/up product, was the other thread's wait). Chunks are contiguous and handed out
// in ascending order; each thread of the region calls run(body), body(begin, end) a chunk.
class ChunkClaims {
 public:
  ChunkClaims(int64_t n, int64_t threads)
      : n_(n), threads_(std::max<int64_t>(1, std::min(threads, n))), chunk_(std::max<int64_t>(1, n / (8 * threads_))) {}
  int64_t threads() const { return threads_; }  // the most threads worth starting
  template <typename Body>
  void run(Body&& body) {
    for (int64_t begin = next_.load(std::memory_order_relaxed), take; begin < n_;) {
      take = std::max<int64_t>(1, std::min(chunk_, (n_ - begin) / (4 * threads_)));
      if (next_.compare_exchange_weak(begin, begin + take, std::memory_order_relaxed)) {
        body(begin, std::min(n_, begin + take));
        begin = next_.load(std::memory_order_relaxed);
      }
    }
  }

 private:
  const int64_t n_, threads_, chunk_;
  std::atomic<int64_t> next_{0};
};
}  // namespace kvreplay_scratch

namespace kvreplay_simd {
// e^x's constants, one set for exp16 and exp8 (which thus agree lane for lane): inputs clamped to
// [kExpLow, kExpHigh] (normal results), n = round(x log2 e), r = x - n ln2 with ln2 in two parts,
// e^r by its degree-7 Taylor polynomial (Horner, highest coefficient first)
constexpr float kExpLow = -87.0f, kExpHigh = 88.0f, kLog2e = 1.44269504f;
constexpr float kLn2High = 0.693145752f, kLn2Low = 1.42860677e-6f;
constexpr float kExpTaylor[8] = {1.f / 5040.f, 1.f / 720.f, 1.f / 120.f, 1.f / 24.f, 1.f / 6.f, 0.5f, 1.f, 1.f};
}  // namespace kvreplay_simd
#if defined(__AMX_TILE__) && defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#include <cstdint>
#include <cstdlib>
#include <string>

namespace kvreplay_amx {
// The 64-byte operand of LDTILECFG (palette 1): each tile's rows and bytes a row.
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux hands a process the tile registers once it asks (arch_prctl ARCH_REQ_XCOMP_PERM for
// XFEATURE_XTILEDATA); false when the kernel refuses. Callers keep the answer.
inline bool tiles_granted() { return syscall(SYS_arch_prctl, 0x1023, 18) == 0; }

// Whether the environment variable `name` is "0": the kernels' switches off the tiles (tests and
// benches of the vector code on a CPU with tiles).
inline bool switched_off(const char* name) {
  const char* env = std::getenv(name);
  return env && std::string(env) == "0";
}
// GCC's _tile_loadd is an asm statement that does not tell the compiler it reads memory, so
// stores into a buffer that only tile loads read can be dropped as dead or moved past the load.
// Call this between writing such a buffer and loading tiles from it (it emits no instruction).
inline void before_tile_loads() { __asm__ volatile("" ::: "memory"); }
}  // namespace kvreplay_amx
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// (AVX2 intrinsics only: on an AVX-512 CPU without BF16 the layer ops' AVX2 kernels use them too)
#define KVREPLAY_HAVE_AVX2 1
#include <immintrin.h>
#include <c10/util/BFloat16.h>

namespace kvreplay_simd {
// exp16's arithmetic on 8 lanes (AVX2): the same clamp, reduction and polynomial; 2^n (n in
// [-126, 127] after the clamp) built from its exponent bits, so the same result lane for lane.
inline __m256 exp8(__m256 x) {
  x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(kExpLow)), _mm256_set1_ps(kExpHigh));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2High), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2Low), r);
  __m256 p = _mm256_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpTaylor[i]));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}

// bf16 <-> fp32 on 8 lanes. bf16_bits8: v rounded to bf16 (nearest-even, a NaN to 0x7FC0, as
// c10 rounds), the 16-bit patterns in the low halves of the 32-bit lanes.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), nan);
}
inline __m256 round_bf16x8(__m256 v) { return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16)); }
inline __m256 widen8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
// 8 values widened to fp32 (load16's 8-lane twin)
inline __m256 load8(const float* src) { return _mm256_loadu_ps(src); }
inline __m256 load8(const c10::BFloat16* src) { return widen8(reinterpret_cast<const uint16_t*>(src)); }
inline void store_rounded8(uint16_t* out, __m256 v) {
  const __m256i bits = bf16_bits8(v);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0xD8);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm256_castsi256_si128(packed));
}
inline void store_rounded8(float* out, __m256 v) { _mm256_storeu_ps(out, round_bf16x8(v)); }
}  // namespace kvreplay_simd
#endif
#if defined(__AVX512F__)
#include <immintrin.h>
#include <c10/util/BFloat16.h>

namespace kvreplay_simd {

// e^x, 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-7 Taylor polynomial
// (relative error ~2e-7), times 2^n by scalef; x is clamped to [-87, 88] (normal results).
// glibc's vector expf is not picked up by the compiler here, and the scalar one took a third
// of the decode kernel's time.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(kExpLow)), _mm512_set1_ps(kExpHigh));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2High), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(kLn2Low), r);
  __m512 p = _mm512_set1_ps(kExpTaylor[0]);
  for (int i = 1; i < 8; ++i) p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpTaylor[i]));
  return _mm512_scalef_ps(p, n);
}

// out lane r = sum of the 16 lanes of p[r]
inline __m512 lane_sums16(const __m512* p) {
  __m512 pairs[8], quads[4];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: partial sums of rows 2i and 2i+1, interleaved
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(p[2 * i], p[2 * i + 1]),
                             _mm512_unpackhi_ps(p[2 * i], p[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: one partial sum for each of rows 4i..4i+3
    const __m512d a = _mm512_castps_pd(pairs[2 * i]), b = _mm512_castps_pd(pairs[2 * i + 1]);
    quads[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                             _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // add the four 128-bit lanes of each quad: lanes 4i..4i+3 of the result hold rows 4i..4i+3
  const __m512 w01 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                                   _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
  const __m512 w23 = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                                   _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(w01, w23, 0x88), _mm512_shuffle_f32x4(w01, w23, 0xDD));
}

// 16 bf16 values widened to fp32 (bf16 -> fp32 is a 16-bit shift)
inline __m512 widen16(__m256i raw) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)); }

// 16 values widened to fp32
inline __m512 load16(const float* src) { return _mm512_loadu_ps(src); }
inline __m512 load16(const c10::BFloat16* src) {
  return widen16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src)));
}

#if defined(__AVX512BF16__)
// p in two bf16 parts, returned hi = bf16(p) and *lo = bf16(p - hi): together ~16 significant
// bits of p, where one bf16 carries 8 (probabilities fed to bf16 products)
inline __m256i split_bf16(__m512 p, __m256i* lo) {
  const __m256i hi = (__m256i)_mm512_cvtneps_pbh(p);
  *lo = (__m256i)_mm512_cvtneps_pbh(_mm512_sub_ps(p, widen16(hi)));
  return hi;
}
#endif
}  // namespace kvreplay_simd
#endif
