// Compact panels for the small-M linear (layers/cpu_gemv_kernel.cpp): weights that are exactly
// GGUF block-quantized values, kept in their blocks and rebuilt as the same fp32 numbers.
//
// A model loaded from a Q4_1 or Q8_0 GGUF file holds, as fp32, w = (d * q) + m (Q4_1: q in
// 0..15, one d and m per 32 inputs of a row, each operation rounded) or w = d * q (Q8_0: q in
// -127..127). Such a weight packs into panels of 16 output columns that store, per block of
// 32 k steps, the 16 columns' scales (fp16, as GGUF stores them) and then their levels. The
// packer recovers every block's scales and levels and checks that each weight rebuilds bit for
// bit; if one does not, it returns an empty tensor and the caller keeps the fp32 panels. The
// kernel rebuilds the 16 weights of a k step in two registers with the same roundings, so its
// output is bitwise that of the fp32 panels, for 0.625 (Q4_1) or 1.0625 (Q8_0) bytes a weight
// instead of 4.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace gemv_blocks {

constexpr int64_t kCols = 16;    // output columns per panel
constexpr int64_t kSteps = 32;   // k steps per block of scales

inline bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof(float)) == 0; }

// Whether v is an fp16 number (a GGUF block's d and m are), kept then in two bytes.
inline bool is_half(float v) { return same_bits(static_cast<float>(c10::Half(v)), v); }
inline uint16_t half_bits(float v) { return c10::Half(v).x; }
// The block's index-th fp16 scale (d of column c at c; Q4_1's m at kCols + c) as a float.
inline float scale(const uint8_t* block, int64_t index) {
  return static_cast<float>(
      c10::Half(reinterpret_cast<const uint16_t*>(block)[index], c10::Half::from_bits()));
}

// The candidates for a block's step d, nearest to `base` first (base, +1 ulp, -1 ulp, ...):
// the stored d rebuilt the extreme weight through one or two roundings, so it is a few ulps
// from what that weight implies.
inline float candidate(float base, int index) {
  float value = base;
  for (int s = 0; s < (index + 1) / 2; ++s)
    value = std::nextafter(value, index % 2 ? INFINITY : -INFINITY);
  return value;
}
constexpr int kCandidates = 17;

// w = (d * q) + m, q in 0..15, d and m fp16 numbers (as a GGUF file stores them; other weights
// take no compact panels). Block: d[16], m[16] (fp16: 64 bytes where fp32 took 128, a sixth of
// the block), then the levels, by the build:
// - with AVX-512, in groups of eight k steps, one 32-bit word per column: word c of group j
//   holds column c's levels of steps 8j .. 8j + 7, four bits each from the lowest. A step's
//   16 levels are then one shift of a group away, in the low four bits of 16 words, which
//   the AVX-512 tiles look up in a table of 0..15 (vpermps reads no other bits);
// - otherwise per k step 8 bytes whose low nibbles are columns 0-7 and high nibbles columns
//   8-15: one byte-to-word widening serves both halves, where the words took AVX2 a shift
//   more per half (20% slower at one row).
struct Q4_1 {
  static constexpr int64_t kScaleBytes = 2 * kCols * 2;
#if defined(__AVX512F__)
  static constexpr bool kColumnWords = true;
#else
  static constexpr bool kColumnWords = false;
#endif
  static constexpr int64_t kGroupSteps = 8;
  static constexpr int64_t kGroupBytes = kCols * 4;
  static constexpr int64_t kBlockBytes = kScaleBytes + kSteps * kCols / 2;   // 320
  static constexpr auto kDtype = torch::kUInt8;
  static constexpr bool kHalfTiles = false;   // see the kernel's block_half_tile

  // One row's 32 weights -> scales {d, m} and levels, or false. m is the minimum (q = 0).
  // An fp16 d first, where one rebuilds them (a GGUF block's does): the panels keep only such.
  static bool fit(const float* w, float* scales, int* q) {
    return fit_with(w, scales, q, true) || fit_with(w, scales, q, false);
  }

  // Whether the panels can hold a block of these scales.
  static bool storable(const float* scales) { return is_half(scales[0]) && is_half(scales[1]); }

  static bool fit_with(const float* w, float* scales, int* q, bool half_d) {
    float lo = w[0], hi = w[0];
    for (int i = 1; i < kSteps; ++i) lo = std::min(lo, w[i]), hi = std::max(hi, w[i]);
    const float base = (hi - lo) / 15.f;
    for (int c = 0; c < (base > 0.f ? kCandidates : 1); ++c) {
      const float d = candidate(base, c);
      bool ok = std::isfinite(d) && d >= 0.f && (!half_d || is_half(d));
      for (int i = 0; ok && i < kSteps; ++i) {
        const float level = d > 0.f ? std::nearbyint((w[i] - lo) / d) : 0.f;
        float product = d * level;
        __asm__("" : "+x"(product));   // two roundings, never a fused multiply-add
        ok = level >= 0.f && level <= 15.f && same_bits(product + lo, w[i]);
        q[i] = static_cast<int>(level);
      }
      if (ok) {
        scales[0] = d, scales[1] = lo;
        return true;
      }
    }
    return false;
  }

  static void store(uint8_t* block, int64_t col, const float* scales, const int* q) {
    reinterpret_cast<uint16_t*>(block)[col] = half_bits(scales[0]);
    reinterpret_cast<uint16_t*>(block)[kCols + col] = half_bits(scales[1]);
    for (int64_t i = 0; i < kSteps; ++i) {
      if (!kColumnWords) {
        block[kScaleBytes + i * kCols / 2 + col % 8] |=
            static_cast<uint8_t>(q[i] << (col < 8 ? 0 : 4));
        continue;
      }
      const int64_t step = i % kGroupSteps;   // little-endian: the word's byte step / 2
      block[kScaleBytes + i / kGroupSteps * kGroupBytes + col * 4 + step / 2] |=
          static_cast<uint8_t>(q[i] << (step % 2 * 4));
    }
  }

  static inline const uint8_t* group(const uint8_t* block, int64_t kk) {
    return block + kScaleBytes + kk / kGroupSteps * kGroupBytes;
  }

  // One weight, column col of step i, rebuilt as the packer checked it: d * q, rounded, + m.
  static float weight(const uint8_t* block, int64_t col, int64_t i) {
    const uint8_t byte = kColumnWords
        ? block[kScaleBytes + i / kGroupSteps * kGroupBytes + col * 4 + i % kGroupSteps / 2]
        : block[kScaleBytes + i * kCols / 2 + col % 8];
    const int shift = kColumnWords ? static_cast<int>(i % kGroupSteps % 2 * 4) : col < 8 ? 0 : 4;
    float product = scale(block, col) * static_cast<float>((byte >> shift) & 15);
    __asm__("" : "+x"(product));   // two roundings, never a fused multiply-add
    return product + scale(block, kCols + col);
  }

#if defined(__AVX2__) && defined(__FMA__)
  // Eight of the block's d (which 0) or m (1) as floats: columns [8 half, 8 half + 8).
  static inline __m256 scales8(const uint8_t* block, int which, int half) {
    return _mm256_cvtph_ps(_mm_loadu_si128(
        reinterpret_cast<const __m128i*>(block + which * kCols * 2 + half * 16)));
  }

  // Step kk's 16 levels as floats (columns 0-7 in lo, 8-15 in hi).
  static inline void levels8(const uint8_t* block, int64_t kk, __m256& lo, __m256& hi) {
    const __m256i low = _mm256_set1_epi32(15);
    __m256i lo_levels, hi_levels;
    if constexpr (kColumnWords) {   // AVX2 tiles in an AVX-512 build: tests only
      const __m256i* words = reinterpret_cast<const __m256i*>(group(block, kk));
      const int shift = static_cast<int>(kk % kGroupSteps * 4);
      lo_levels = _mm256_and_si256(_mm256_srli_epi32(_mm256_loadu_si256(words), shift), low);
      hi_levels = _mm256_and_si256(_mm256_srli_epi32(_mm256_loadu_si256(words + 1), shift), low);
    } else {
      const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
          reinterpret_cast<const __m128i*>(block + kScaleBytes + kk * kCols / 2)));
      lo_levels = _mm256_and_si256(bytes, low);
      hi_levels = _mm256_srli_epi32(bytes, 4);
    }
    lo = _mm256_cvtepi32_ps(lo_levels);
    hi = _mm256_cvtepi32_ps(hi_levels);
  }

  // The 16 weights of step kk (columns 0-7 in lo, 8-15 in hi).
  static inline void expand(const uint8_t* block, int64_t kk, __m256& lo, __m256& hi) {
    levels8(block, kk, lo, hi);
    __m256 p_lo = _mm256_mul_ps(lo, scales8(block, 0, 0));
    __m256 p_hi = _mm256_mul_ps(hi, scales8(block, 0, 1));
    __asm__("" : "+x"(p_lo), "+x"(p_hi));   // keep both roundings
    lo = _mm256_add_ps(p_lo, scales8(block, 1, 0));
    hi = _mm256_add_ps(p_hi, scales8(block, 1, 1));
  }
#endif

  static constexpr bool kHasMins = true;   // the factored form's m sum(x) term

#if defined(__AVX512F__)

  // The block's 16 d (which 0) or m (1) as floats.
  static inline __m512 scales16(const uint8_t* block, int which) {
    return _mm512_cvtph_ps(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(block + which * kCols * 2)));
  }

  // Step kk's 16 levels as floats: the shifted group's low four bits looked up in 0..15.
  static inline __m512 levels16(const uint8_t* block, int64_t kk) {
    const __m512i words = _mm512_srli_epi32(
        _mm512_loadu_si512(group(block, kk)), static_cast<unsigned>(kk % kGroupSteps * 4));
    return _mm512_permutexvar_ps(words, _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f,
                                                       9.f, 10.f, 11.f, 12.f, 13.f, 14.f, 15.f));
  }

  // expand()'s 16 weights in one register, by the same operations: d * q, rounded, then + m,
  // rounded.
  // The block's d and m as floats, converted once for its 32 steps: a caller that also
  // stores between steps (staging_tile) would otherwise have them converted again each step,
  // the compiler unable to tell its stores from the block's bytes.
  struct Scales {
    __m512 d, m;
  };
  static inline Scales scales(const uint8_t* block) {
    return {scales16(block, 0), scales16(block, 1)};
  }

  static inline __m512 expand16_with(const uint8_t* block, int64_t kk, const Scales& s) {
    __m512 product = _mm512_mul_ps(levels16(block, kk), s.d);
    __asm__("" : "+v"(product));   // keep both roundings
    return _mm512_add_ps(product, s.m);
  }

  static inline __m512 expand16(const uint8_t* block, int64_t kk) {
    return expand16_with(block, kk, scales(block));
  }
#endif
};

// w = d * q, q in -127..127, d an fp16 number (as GGUF stores it). Block: d[16] (fp16), then
// per k step 16 signed bytes (columns).
struct Q8_0 {
  static constexpr int64_t kScaleBytes = kCols * 2;
  static constexpr int64_t kBlockBytes = kScaleBytes + kSteps * kCols;   // 544
  static constexpr auto kDtype = torch::kInt8;
  static constexpr bool kHalfTiles = true;

  // An fp16 d first, as Q4_1's fit.
  static bool fit(const float* w, float* scales, int* q) {
    return fit_with(w, scales, q, true) || fit_with(w, scales, q, false);
  }

  static bool storable(const float* scales) { return is_half(scales[0]); }

  static bool fit_with(const float* w, float* scales, int* q, bool half_d) {
    float amax = 0.f;
    for (int i = 0; i < kSteps; ++i) amax = std::max(amax, std::fabs(w[i]));
    const float base = amax / 127.f;
    for (int c = 0; c < (base > 0.f ? kCandidates : 1); ++c) {
      const float d = candidate(base, c);
      bool ok = std::isfinite(d) && d >= 0.f && (!half_d || is_half(d));
      for (int i = 0; ok && i < kSteps; ++i) {
        const float level = d > 0.f ? std::nearbyint(w[i] / d) : 0.f;
        ok = level >= -128.f && level <= 127.f && same_bits(d * level, w[i]);
        q[i] = static_cast<int>(level);
      }
      if (ok) {
        scales[0] = d;
        return true;
      }
    }
    return false;
  }

  static void store(uint8_t* block, int64_t col, const float* scales, const int* q) {
    reinterpret_cast<uint16_t*>(block)[col] = half_bits(scales[0]);
    for (int64_t i = 0; i < kSteps; ++i)
      reinterpret_cast<int8_t*>(block + kScaleBytes)[i * kCols + col] = static_cast<int8_t>(q[i]);
  }

  // One weight, column col of step i: d * q.
  static float weight(const uint8_t* block, int64_t col, int64_t i) {
    const int8_t level = reinterpret_cast<const int8_t*>(block + kScaleBytes)[i * kCols + col];
    return scale(block, col) * static_cast<float>(level);
  }

#if defined(__AVX2__) && defined(__FMA__)
  // Eight of the block's d as floats: columns [8 half, 8 half + 8) (which: 0, as Q4_1's
  // scales8, which Q8_0 shares so that the tiles take either format).
  static inline __m256 scales8(const uint8_t* block, int /*which*/, int half) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block + half * 16)));
  }

  // Step kk's 16 levels as floats (columns 0-7 in lo, 8-15 in hi).
  static inline void levels8(const uint8_t* block, int64_t kk, __m256& lo, __m256& hi) {
    const __m128i bytes =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kScaleBytes + kk * kCols));
    lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
    hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
  }

  static inline void expand(const uint8_t* block, int64_t kk, __m256& lo, __m256& hi) {
    levels8(block, kk, lo, hi);
    lo = _mm256_mul_ps(lo, scales8(block, 0, 0));
    hi = _mm256_mul_ps(hi, scales8(block, 0, 1));
  }

  // expand()'s lo (half 0) or hi (half 1) alone: the 8 weights of step kk in columns
  // [8 half, 8 half + 8), by the same operations.
  static inline __m256 expand_half(const uint8_t* block, int64_t kk, int half) {
    const __m128i bytes = _mm_loadl_epi64(
        reinterpret_cast<const __m128i*>(block + kScaleBytes + kk * kCols + 8 * half));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes)), scales8(block, 0, half));
  }
#endif

  static constexpr bool kHasMins = false;

#if defined(__AVX512F__)

  // The block's 16 d as floats (which: 0, as Q4_1's d).
  static inline __m512 scales16(const uint8_t* block, int) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(block)));
  }

  static inline __m512 levels16(const uint8_t* block, int64_t kk) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(block + kScaleBytes + kk * kCols))));
  }

  struct Scales {   // as Q4_1's
    __m512 d;
  };
  static inline Scales scales(const uint8_t* block) { return {scales16(block, 0)}; }

  static inline __m512 expand16_with(const uint8_t* block, int64_t kk, const Scales& s) {
    return _mm512_mul_ps(levels16(block, kk), s.d);
  }

  static inline __m512 expand16(const uint8_t* block, int64_t kk) {
    return expand16_with(block, kk, scales(block));
  }
#endif
};

// [N/16, K/32 * kBlockBytes] panels of a [N, K] float32 weight in format F, or an empty tensor
// when some weight is not exactly an F value (or the shape or the CPU does not allow them).
template <typename F>
torch::Tensor pack(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32,
              "pack_gemv_blocks: a 2-D float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  auto none = torch::empty({0}, F::kDtype);
#if defined(__AVX2__) && defined(__FMA__)
  if (n % kCols != 0 || k % kSteps != 0 || k == 0) return none;
  auto w = weight.contiguous();
  const int64_t blocks = k / kSteps;
  auto packed = torch::zeros({n / kCols, blocks * F::kBlockBytes}, F::kDtype);
  const float* wp = w.data_ptr<float>();
  auto* out = static_cast<uint8_t*>(packed.data_ptr());
  std::atomic<bool> exact{true};
  // Whole panels per thread: store() ORs levels into bytes (two steps of a column a byte).
  // (When Q4_1 packed two columns a byte, a split by rows, at::parallel_for cutting 48 rows into
  // 24 and 24 on two threads, lost nibbles of the middle panel now and then.)
  at::parallel_for(0, n / kCols, 1, [&](int64_t first_panel, int64_t last_panel) {
    float scales[2];
    int q[kSteps];
    for (int64_t row = first_panel * kCols; row < last_panel * kCols && exact; ++row)
      for (int64_t b = 0; b < blocks; ++b) {
        if (!F::fit(wp + row * k + b * kSteps, scales, q) || !F::storable(scales)) {
          exact = false;
          return;
        }
        F::store(out + (row / kCols * blocks + b) * F::kBlockBytes, row % kCols, scales, q);
      }
  });
  return exact ? packed : none;
#else
  return none;
#endif
}

}  // namespace gemv_blocks
