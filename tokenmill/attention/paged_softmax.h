// Online softmax pieces of the paged attention kernels (cpu_paged_kernel.cpp, which the build
// compiles with this file in front of it): exponentials and maxima of score rows, one online
// softmax step over a block of scores, and the normalization or merge of partial states.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

#ifdef __AVX2__
using tokenmill_avx2::exp_ps;
using tokenmill_avx2::hsum;
#endif

// x[i] = exp(x[i] - max), returns the sum. `wide`: 16 lanes an exp where the build has
// AVX-512, the same values, summed in the 8-lane order (bitwise the narrow result); in the
// prefill kernel's softmax the exps were most of the time outside the register tiles.
inline float exp_shift_sum(float* x, int len, float max, bool wide) {
  int i = 0;
  float sum = 0.0f;
#ifdef __AVX2__
  const __m256 m = _mm256_set1_ps(max);
  __m256 acc = _mm256_setzero_ps();
#if defined(__AVX512F__)
  if (wide) {
    const __m512 m16 = _mm512_set1_ps(max);
    for (; i + 16 <= len; i += 16) {
      const __m512 e = tokenmill_avx2::exp_ps16(_mm512_sub_ps(_mm512_loadu_ps(x + i), m16));
      _mm512_storeu_ps(x + i, e);
      acc = _mm256_add_ps(acc, _mm512_castps512_ps256(e));
      acc = _mm256_add_ps(acc, _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(e), 1)));
    }
  }
#endif
  for (; i + 8 <= len; i += 8) {
    const __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + i), m));
    _mm256_storeu_ps(x + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum(acc);
#endif
  for (; i < len; ++i) {
    x[i] = std::exp(x[i] - max);
    sum += x[i];
  }
  return sum;
}

// The largest of x[0..len).
inline float max_of(const float* x, int len) {
  int i = 0;
  float best = -std::numeric_limits<float>::infinity();
#ifdef __AVX2__
  if (len >= 8) {
    __m256 m = _mm256_loadu_ps(x);
    for (i = 8; i + 8 <= len; i += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(x + i));
    __m128 h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    h = _mm_max_ps(h, _mm_movehl_ps(h, h));
    best = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
  }
#endif
  for (; i < len; ++i) best = std::max(best, x[i]);
  return best;
}

// Online softmax over one more block of a row's scores: rescales the row's state (acc, max,
// sum) to the new running max and turns `scores` into their exp(score - max).
inline void softmax_step(float* scores, int len, float* acc, int dim, float& running_max,
                         float& running_sum, bool wide) {
  const float new_max = std::max(running_max, max_of(scores, len));
  if (new_max != running_max) {   // else alpha = exp(0) = 1: nothing to rescale
    const float alpha = std::exp(running_max - new_max);   // 0 on the first block
    running_sum *= alpha;
    for (int d = 0; d < dim; ++d) acc[d] *= alpha;
  }
  running_max = new_max;
  running_sum += exp_shift_sum(scores, len, new_max, wide);
}

// out[row] = acc[row] / sum[row] for `rows` rows of `dim`.
void normalize(const float* acc, const float* sum, int64_t rows, int64_t dim, float* out) {
  for (int64_t row = 0; row < rows; ++row) {
    const float inv = 1.0f / sum[row];
    for (int64_t d = 0; d < dim; ++d) out[row * dim + d] = acc[row * dim + d] * inv;
  }
}

// Combines `parts` partial softmax states of the same rows (each from a disjoint slice of
// the context; a part over no keys has max -inf and sum 0) into the normalized output.
void merge_parts(const float* acc, const float* max, const float* sum, int64_t parts,
                 int64_t rows, int64_t dim, float* out) {
  for (int64_t row = 0; row < rows; ++row) {
    float best = -std::numeric_limits<float>::infinity();
    for (int64_t p = 0; p < parts; ++p) best = std::max(best, max[p * rows + row]);
    float total = 0.0f;
    float* o = out + row * dim;
    std::fill(o, o + dim, 0.0f);
    for (int64_t p = 0; p < parts; ++p) {
      if (sum[p * rows + row] == 0.0f) continue;
      const float w = std::exp(max[p * rows + row] - best);
      total += w * sum[p * rows + row];
      const float* a = acc + (p * rows + row) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] += w * a[d];
    }
    const float inv = 1.0f / total;
    for (int64_t d = 0; d < dim; ++d) o[d] *= inv;
  }
}

}  // namespace
