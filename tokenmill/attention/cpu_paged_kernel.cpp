// Paged decode attention on CPU (fp32): one new query token per request attends to its
// context straight from the paged KV cache through its block table. No gather, no padding:
// blocks shared between requests (a common prefix) are read in place and stay in cache.
//
// Work item = one request, all its kv heads; with too few requests to keep every thread busy,
// one slice of whole blocks of a request's context, the slices' partial softmax states merged
// after (as in flash-decoding). Inside an item a block is read span by span (8 tokens, all
// kv heads), front to back; the `groups` query heads of a kv head are scored against each
// key together, four keys per reduction. Softmax is online, one block at a time (block
// max, one rescale per block, vectorized exp).
//
// Decode attention is bound by memory: the KV of a batch is hundreds of MB and is read once a
// step. The hardware prefetcher loses the stream at every block boundary (a request's blocks
// are anywhere in the pool), and the block's arithmetic did not overlap the misses, so the
// kernel read at a third of the copy bandwidth. Each pass over a block therefore prefetches
// a share of the next block into L2, a few lines per inner iteration. Asking for all of it at
// the start of the block saved far less time (6-13% against 34%), probably because hundreds
// of requests at once fill the miss queue and stall the arithmetic; prefetching into L1
// instead of L2 made decode steps 6% slower (2-core Xeon). Even so the kernel reads ~17-19
// GB/s from memory where a plain read of the same blocks gets ~24: the prefetches wait for
// free fill buffers (perf: most samples of the value loop on the instruction after them).
//
// Requests over a common prefix of at least 4 blocks (a system prompt in the prefix cache)
// take another route, attend_with_groups below: the shared blocks are attended by all of
// the group's query heads at once, and each request's own blocks after them by the path above.
//
// Prefill chunks (paged_prefill_attention) use that route's row tiles too: a chunk's tokens
// times the query heads of a kv head are the rows, causal limits mask each row's later keys.
// Against SDPA over a gathered copy with a mask (the reference path), 30 layers of SmolLM2's
// shapes: 256 new tokens over 256 cached, 98.9 -> 74.1 ms; 84 over 450, 55.8 -> 46.8 ms (AVX2
// machine). Where the build has AVX-512, those row tiles are AVX-512 ones (RowTiles), bitwise
// the same. On a 2-core Xeon, per-block AVX2 tiles -> 4-block steps with AVX-512 tiles (SDPA):
// 512 new over 2560 cached, 739 -> 409 ms (549-595); 512 over 1536, 465 -> 282 (350-383); 84
// over 450, 23.1 -> 14.4 (21-23); 3000 uncached 1.35 s (1.47-1.63).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <vector>

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

// out[g] = dot(q + g * dim, k) for g < groups.
inline void score_key(const float* q, const float* k, int groups, int dim, float* out,
                      int out_stride) {
  for (int g = 0; g < groups; ++g) {
    const float* qg = q + g * dim;
    int d = 0;
    float sum = 0.0f;
#ifdef __AVX2__
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    for (; d + 16 <= dim; d += 16) {
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(k + d), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d + 8), _mm256_loadu_ps(k + d + 8), a1);
    }
    for (; d + 8 <= dim; d += 8)
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(k + d), a0);
    sum = hsum(_mm256_add_ps(a0, a1));
#endif
    for (; d < dim; ++d) sum += qg[d] * k[d];
    out[g * out_stride] = sum;
  }
}

// acc[g] += p[g] * v for g < groups.
inline void accumulate_value(float* acc, const float* p, int p_stride, const float* v,
                             int groups, int dim) {
  int d = 0;
#ifdef __AVX2__
  for (; d + 8 <= dim; d += 8) {
    const __m256 vv = _mm256_loadu_ps(v + d);
    for (int g = 0; g < groups; ++g) {
      float* ag = acc + g * dim + d;
      _mm256_storeu_ps(ag, _mm256_fmadd_ps(_mm256_set1_ps(p[g * p_stride]), vv,
                                           _mm256_loadu_ps(ag)));
    }
  }
#endif
  for (; d < dim; ++d)
    for (int g = 0; g < groups; ++g) acc[g * dim + d] += p[g * p_stride] * v[d];
}

// Cache lines a block step asks for ahead of use: `lines` lines from `base` (null: none).
struct Prefetch {
  const char* base;
  int lines;

  // Lines [part, part + 1) * lines / parts: the share of one of `parts` loop iterations.
  inline void part(int index, int parts) const {
    if (base == nullptr) return;
    for (int l = lines * index / parts; l < lines * (index + 1) / parts; ++l)
      __builtin_prefetch(base + l * 64, 0, 2);
  }
};

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

// Block-level steps: scores[g * stride + i] = dot(q_g, key_i) for the block's `len` keys, and
// acc[g] += sum_i scores[g * stride + i] * value_i. Keys/values are `token_stride` apart.
// Both spread `ahead` over their loop.
using ScoreFn = void (*)(const float* q, const float* k, int64_t token_stride, int len,
                         int groups, int dim, float* scores, int stride, Prefetch ahead);
using AccumulateFn = void (*)(const float* p, int stride, const float* v, int64_t token_stride,
                              int len, int groups, int dim, float* acc, Prefetch ahead);

void score_block(const float* q, const float* k, int64_t token_stride, int len, int groups,
                 int dim, float* scores, int stride, Prefetch ahead) {
  ahead.part(0, 1);
  for (int i = 0; i < len; ++i)
    score_key(q, k + i * token_stride, groups, dim, scores + i, stride);
}

void accumulate_block(const float* p, int stride, const float* v, int64_t token_stride, int len,
                      int groups, int dim, float* acc, Prefetch ahead) {
  ahead.part(0, 1);
  for (int i = 0; i < len; ++i)
    accumulate_value(acc, p + i, stride, v + i * token_stride, groups, dim);
}

#ifdef __AVX2__
// [sum(a0), sum(a1), sum(a2), sum(a3)]: four horizontal sums in one reduction tree.
inline __m128 hsum4(__m256 a0, __m256 a1, __m256 a2, __m256 a3) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// Scores of keys [i, i + KP) for G query heads (dim a multiple of 8). One accumulator per
// (head, key) over the whole dim; the per-key horizontal sums were the kernel's largest cost,
// so four keys share one reduction tree.
template <int G, int KP>
inline void score_keys(const float* q, const float* k, int64_t token_stride, int dim,
                       float* scores, int stride) {
  __m256 a[G][KP];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < KP; ++j) a[g][j] = _mm256_setzero_ps();
  for (int d = 0; d < dim; d += 8) {
    __m256 kv[KP];
    for (int j = 0; j < KP; ++j) {
      kv[j] = _mm256_loadu_ps(k + j * token_stride + d);
      __asm__("" : "+x"(kv[j]));   // one load per key, not one per FMA (see cpu_gemv)
    }
    for (int g = 0; g < G; ++g) {
      const __m256 qv = _mm256_loadu_ps(q + g * dim + d);
      for (int j = 0; j < KP; ++j) a[g][j] = _mm256_fmadd_ps(qv, kv[j], a[g][j]);
    }
  }
  for (int g = 0; g < G; ++g) {
    if constexpr (KP == 4) {
      _mm_storeu_ps(scores + g * stride, hsum4(a[g][0], a[g][1], a[g][2], a[g][3]));
    } else {
      for (int j = 0; j < KP; ++j) scores[g * stride + j] = hsum(a[g][j]);
    }
  }
}

// Fixed group count G: every key/value load serves all G query heads.
template <int G>
void score_block_g(const float* q, const float* k, int64_t token_stride, int len, int,
                   int dim, float* scores, int stride, Prefetch ahead) {
  constexpr int KP = G <= 3 ? 4 : 1;   // 4 keys x G heads of accumulators fit 16 registers
  const int steps = len / KP;
  if (steps == 0) ahead.part(0, 1);
  int i = 0;
  for (; i + KP <= len; i += KP) {
    ahead.part(i / KP, steps);
    score_keys<G, KP>(q, k + i * token_stride, token_stride, dim, scores + i, stride);
  }
  for (; i < len; ++i)
    score_keys<G, 1>(q, k + i * token_stride, token_stride, dim, scores + i, stride);
}

template <int G>
void accumulate_block_g(const float* p, int stride, const float* v, int64_t token_stride,
                        int len, int, int dim, float* acc, Prefetch ahead) {
  const int steps = dim / 16;
  if (steps == 0) ahead.part(0, 1);
  int d = 0;
  for (; d + 16 <= dim; d += 16) {
    ahead.part(d / 16, steps);
    __m256 a[G], b[G];
    for (int g = 0; g < G; ++g) {
      a[g] = _mm256_loadu_ps(acc + g * dim + d);
      b[g] = _mm256_loadu_ps(acc + g * dim + d + 8);
    }
    for (int i = 0; i < len; ++i) {
      const float* vi = v + i * token_stride + d;
      __m256 v0 = _mm256_loadu_ps(vi), v1 = _mm256_loadu_ps(vi + 8);
      __asm__("" : "+x"(v0), "+x"(v1));
      for (int g = 0; g < G; ++g) {
        const __m256 w = _mm256_broadcast_ss(p + g * stride + i);
        a[g] = _mm256_fmadd_ps(w, v0, a[g]);
        b[g] = _mm256_fmadd_ps(w, v1, b[g]);
      }
    }
    for (int g = 0; g < G; ++g) {
      _mm256_storeu_ps(acc + g * dim + d, a[g]);
      _mm256_storeu_ps(acc + g * dim + d + 8, b[g]);
    }
  }
  for (; d < dim; d += 8) {
    __m256 a[G];
    for (int g = 0; g < G; ++g) a[g] = _mm256_loadu_ps(acc + g * dim + d);
    for (int i = 0; i < len; ++i) {
      __m256 v0 = _mm256_loadu_ps(v + i * token_stride + d);
      __asm__("" : "+x"(v0));
      for (int g = 0; g < G; ++g)
        a[g] = _mm256_fmadd_ps(_mm256_broadcast_ss(p + g * stride + i), v0, a[g]);
    }
    for (int g = 0; g < G; ++g) _mm256_storeu_ps(acc + g * dim + d, a[g]);
  }
}
#endif

#if defined(__AVX2__) && defined(__AVX512F__)
// accumulate_block_g with 16-lane registers: NZ registers (16 dims each) of all G rows stay in
// registers across the block's keys, so a key's value row is loaded once and each weight
// broadcast once per slice (AVX2: once per 16 dims). Each lane adds the same products in the
// same order as the 8-lane version: bitwise its result.
template <int G, int NZ>
void accumulate_block_wide(const float* p, int stride, const float* v, int64_t token_stride,
                           int len, int, int dim, float* acc, Prefetch ahead) {
  constexpr int W = NZ * 16;
  const int slices = dim / W;
  for (int d = 0; d < dim; d += W) {
    __m512 a[G][NZ];
    for (int g = 0; g < G; ++g)
      for (int z = 0; z < NZ; ++z) a[g][z] = _mm512_loadu_ps(acc + g * dim + d + z * 16);
    for (int i = 0; i < len; ++i) {
      ahead.part((d / W) * len + i, slices * len);
      const float* vi = v + i * token_stride + d;
      __m512 vz[NZ];
      for (int z = 0; z < NZ; ++z) {
        vz[z] = _mm512_loadu_ps(vi + z * 16);
        __asm__("" : "+v"(vz[z]));
      }
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(p[g * stride + i]);
        for (int z = 0; z < NZ; ++z) a[g][z] = _mm512_fmadd_ps(w, vz[z], a[g][z]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int z = 0; z < NZ; ++z) _mm512_storeu_ps(acc + g * dim + d + z * 16, a[g][z]);
  }
}

// The 16-lane accumulate for G rows and `dim`, or null: registers for up to 24 accumulators.
template <int G>
AccumulateFn wide_accumulate_for(int64_t dim) {
  if (dim % 64 == 0 && G * 4 <= 24) return accumulate_block_wide<G, 4>;
  if (dim % 32 == 0 && G * 2 <= 24) return accumulate_block_wide<G, 2>;
  if (dim % 16 == 0) return accumulate_block_wide<G, 1>;
  return nullptr;
}

AccumulateFn wide_accumulate(int64_t groups, int64_t dim) {
  switch (groups) {
#define TOKENMILL_GROUPS(G) case G: return wide_accumulate_for<G>(dim);
    TOKENMILL_GROUPS(1) TOKENMILL_GROUPS(2) TOKENMILL_GROUPS(3) TOKENMILL_GROUPS(4)
    TOKENMILL_GROUPS(5) TOKENMILL_GROUPS(6) TOKENMILL_GROUPS(7) TOKENMILL_GROUPS(8)
#undef TOKENMILL_GROUPS
    default: return nullptr;
  }
}
#endif

// The fastest implementation of both steps for this shape.
// `wide`: the 16-lane accumulate where the build has AVX-512.
void pick_block_fns(int64_t groups, int64_t dim, bool wide, ScoreFn* score,
                    AccumulateFn* accumulate) {
  (void)wide;
  *score = score_block;
  *accumulate = accumulate_block;
#ifdef __AVX2__
  if (dim % 8 != 0) return;
  switch (groups) {
#define TOKENMILL_GROUPS(G) \
    case G: *score = score_block_g<G>; *accumulate = accumulate_block_g<G>; break;
    TOKENMILL_GROUPS(1) TOKENMILL_GROUPS(2) TOKENMILL_GROUPS(3) TOKENMILL_GROUPS(4)
    TOKENMILL_GROUPS(5) TOKENMILL_GROUPS(6) TOKENMILL_GROUPS(7) TOKENMILL_GROUPS(8)
#undef TOKENMILL_GROUPS
    default: break;
  }
#if defined(__AVX512F__)
  if (AccumulateFn f = wide ? wide_accumulate(groups, dim) : nullptr) *accumulate = f;
#endif
#endif
}

struct Shape {
  int64_t heads, kv_heads, groups, dim, block_size, max_blocks;
  int64_t block_stride, token_stride;   // in floats, for the caches
  ScoreFn score;
  AccumulateFn accumulate;
  bool wide;   // attend_rows takes the AVX-512 register tiles
};

// Tokens of a block one pass of `attend` reads before moving on: every kv head's rows of a
// span are scored (or accumulated) together, so the block is read front to back in a few KB
// steps rather than in kv_heads strided passes.
constexpr int kSpanTokens = 8;

// The share of `ahead` for call `index` of `calls`: its lines split into equal runs.
inline Prefetch share_of(Prefetch ahead, int index, int calls) {
  if (ahead.base == nullptr) return ahead;
  const int first = ahead.lines * index / calls, last = ahead.lines * (index + 1) / calls;
  return Prefetch{ahead.base + first * 64, last - first};
}

// One request's query heads over positions [start, seq_len), a block at a time: the scores
// of every head, the online softmax step of every row, then the values. Within a block each
// pass goes span by span (kSpanTokens), all kv heads of a span together: a head at a time
// read every block kv_heads times at a stride. With the 16-lane values step and prefetches
// into L2, offline decode steps (SmolLM2, 2-core Xeon, alternating builds): 8 x 400 tokens
// of context 23.2 -> 21.6 ms, 16 x 370 40.8 -> 39.7, 1 x 3000 15.4 -> 15.1.
// Leaves the unnormalized softmax state: acc (heads * dim floats) = sum of
// exp(score - running_max) * value, and running_max/running_sum (heads each).
// q: heads * dim scratch; scores: heads * block_size scratch.
void attend(const float* query, const float* k_cache, const float* v_cache,
            const int64_t* table, int64_t start, int64_t seq_len, float scale, const Shape& s,
            float* q, float* scores, float* acc, float* running_max, float* running_sum) {
  const int groups = static_cast<int>(s.groups), dim = static_cast<int>(s.dim);
  const int bs = static_cast<int>(s.block_size), rows = static_cast<int>(s.heads);
  const int kv_heads = static_cast<int>(s.kv_heads);
  for (int i = 0; i < rows * dim; ++i) q[i] = query[i] * scale;   // pre-scaled queries
  std::fill(running_max, running_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(running_sum, running_sum + rows, 0.0f);
  std::fill(acc, acc + rows * dim, 0.0f);
  const int block_lines = static_cast<int>(s.block_stride * sizeof(float) / 64);
  for (int64_t bi = start / bs; bi * bs < seq_len; ++bi) {
    const int64_t t0 = std::max(start, bi * bs), t1 = std::min(seq_len, (bi + 1) * bs);
    const int len = static_cast<int>(t1 - t0);
    const int64_t block_first = table[bi] * s.block_stride + (t0 - bi * bs) * s.token_stride;
    // the next block, spread over this block's calls
    const bool has_next = t1 < seq_len;
    const int64_t next_first = has_next ? table[bi + 1] * s.block_stride : 0;
    const Prefetch next_k{has_next ? reinterpret_cast<const char*>(k_cache + next_first) : nullptr,
                          block_lines};
    const Prefetch next_v{has_next ? reinterpret_cast<const char*>(v_cache + next_first) : nullptr,
                          block_lines};
    const int spans = (len + kSpanTokens - 1) / kSpanTokens, calls = spans * kv_heads;
    // step(i0, n, h, offset, call): kv head h's n rows from token i0 (cache `offset`)
    const auto each_span_head = [&](auto&& step) {
      for (int sp = 0; sp < spans; ++sp) {
        const int i0 = sp * kSpanTokens, n = std::min(kSpanTokens, len - i0);
        for (int h = 0; h < kv_heads; ++h)
          step(i0, n, h, block_first + i0 * s.token_stride + h * dim, sp * kv_heads + h);
      }
    };
    each_span_head([&](int i0, int n, int h, int64_t offset, int call) {
      s.score(q + h * groups * dim, k_cache + offset, s.token_stride, n, groups, dim,
              scores + h * groups * bs + i0, bs, share_of(next_k, call, calls));
    });
    for (int row = 0; row < rows; ++row)
      softmax_step(scores + row * bs, len, acc + row * dim, dim, running_max[row],
                   running_sum[row], s.wide);
    each_span_head([&](int i0, int n, int h, int64_t offset, int call) {
      s.accumulate(scores + h * groups * bs + i0, bs, v_cache + offset, s.token_stride, n,
                   groups, dim, acc + h * groups * dim, share_of(next_v, call, calls));
    });
  }
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

// Work per request when there are too few requests to keep every thread busy: the context is
// cut into this many slices of whole blocks (each at least kMinSliceBlocks long), all kv heads
// per slice, merged after. Slices read contiguous rows; one kv head per item read a third of
// each row at a stride and left threads idle when kv_heads did not divide evenly.
constexpr int64_t kMinSliceBlocks = 4;
// With enough requests, only a long context is cut, into slices of this many blocks, so one
// thread does not read it alone while the other waits (a 3000-token request beside 8 short ones
// took 14 ms a step more than they did alone). The cut depends on the request's length only.
constexpr int64_t kLongSliceBlocks = 64;

int64_t slices_per_request(int64_t num, int64_t max_len, int64_t block_size, int threads) {
  if (num >= 2 * threads) return 1;
  const int64_t blocks = (max_len + block_size - 1) / block_size;
  int64_t wanted = (4 * threads + num - 1) / num;
  while ((num * wanted) % threads != 0) ++wanted;   // the same number of slices per thread
  return std::max<int64_t>(1, std::min(wanted, blocks / kMinSliceBlocks));
}

// One (request, slice) of the per-request route: context positions [start, stop), on block
// boundaries but for the window's first; its partial softmax state goes to part `part`, merged
// with the request's other parts unless it is the request's only (`whole`) slice.
struct Slice {
  int64_t request, start, stop, part;
  bool whole;
};

// Every request's slices, longest first, so the long ones are not left for the end.
std::vector<Slice> decode_slices(const int64_t* lens, int64_t num, int64_t block_size,
                                 int64_t sliding_window, int threads,
                                 std::vector<int64_t>& first_part) {
  const int64_t max_len = *std::max_element(lens, lens + num);
  const int64_t uniform = slices_per_request(num, max_len, block_size, threads);
  std::vector<Slice> slices;
  first_part.assign(num + 1, 0);
  for (int64_t r = 0; r < num; ++r) {
    const int64_t first = sliding_window > 0 ? std::max<int64_t>(0, lens[r] - sliding_window) : 0;
    const int64_t first_block = first / block_size;
    const int64_t blocks = (lens[r] + block_size - 1) / block_size - first_block;
    const int64_t count = num >= 2 * threads ? (blocks + kLongSliceBlocks - 1) / kLongSliceBlocks
                                             : uniform;
    for (int64_t i = 0; i < count; ++i) {
      const int64_t b0 = first_block + blocks * i / count;
      const int64_t b1 = first_block + blocks * (i + 1) / count;
      slices.push_back({r, std::max(first, b0 * block_size), std::min(lens[r], b1 * block_size),
                        first_part[r] + i, count == 1});
    }
    first_part[r + 1] = first_part[r] + count;
  }
  std::stable_sort(slices.begin(), slices.end(), [](const Slice& a, const Slice& b) {
    return a.stop - a.start > b.stop - b.start;
  });
  return slices;
}

// ---- Requests over a shared prefix: their query heads against each shared block together ----
//
// With a common prefix (a system prompt in the prefix cache), every request of a batch reads the
// same blocks. Per request, a kv head's key row serves only its `groups` query heads, with a
// horizontal sum per key, and the loops wait on loads (about 0.6 FMA a cycle, measured). Here
// all the requests' query heads of a kv head score a shared block at once, as a small matrix
// product: the block's keys are transposed once into a [dim, block] tile, and each register tile
// of 6 query rows x 16 keys adds rank-1 updates, 12 FMAs per 8 loads, with no horizontal sums.
// The values go the same way (6 rows x 16 dims). Each (group, kv head, chunk of shared blocks)
// is a work item; each request attends its own blocks after the prefix as one more item; the
// partial softmax states are merged per request (as the slices are).
constexpr int64_t kMinSharedBlocks = 4;   // shorter common prefixes: the per-request path
constexpr int64_t kChunkBlocks = 16;      // shared blocks per work item
constexpr int kRowTile = 6;               // query rows per register tile
#if defined(__AVX2__) && defined(__AVX512F__)
constexpr bool kWideTiles = true;         // attend_rows has AVX-512 register tiles
#else
constexpr bool kWideTiles = false;
#endif

struct SharedGroup {
  std::vector<int64_t> members;   // request indices, ascending
  int64_t blocks;                 // leading blocks every member has, all before its last token
  int64_t chunks() const { return (blocks + kChunkBlocks - 1) / kChunkBlocks; }
};

// Requests grouped by their first block id, each group's common leading blocks; groups with
// fewer than kMinSharedBlocks of them, or one member, are left out.
std::vector<SharedGroup> find_shared_groups(const int64_t* table, const int64_t* lens,
                                            int64_t num, const Shape& s) {
  std::vector<int64_t> order(num);
  for (int64_t r = 0; r < num; ++r) order[r] = r;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return table[a * s.max_blocks] < table[b * s.max_blocks];
  });
  std::vector<SharedGroup> groups;
  for (int64_t i = 0; i < num;) {
    int64_t j = i;
    while (j < num && table[order[j] * s.max_blocks] == table[order[i] * s.max_blocks]) ++j;
    SharedGroup group{std::vector<int64_t>(order.begin() + i, order.begin() + j), 0};
    const int64_t* lead = table + order[i] * s.max_blocks;
    int64_t common = (lens[order[i]] - 1) / s.block_size;   // full blocks before the last token
    for (int64_t k = i + 1; k < j && common > 0; ++k) {
      const int64_t* row = table + order[k] * s.max_blocks;
      common = std::min(common, (lens[order[k]] - 1) / s.block_size);
      int64_t same = 0;
      while (same < common && row[same] == lead[same]) ++same;
      common = same;
    }
    group.blocks = common;
    std::sort(group.members.begin(), group.members.end());
    if (group.members.size() >= 2 && common >= kMinSharedBlocks) groups.push_back(group);
    i = j;
  }
  return groups;
}

#ifdef __AVX2__
// The right operand of a rank-1 tile: n rows of floats, row k at
// segment[k / seg_len] + col + (k % seg_len) * ld. The values of a step's blocks are rows in
// several blocks of the cache; transposed keys are one segment.
struct RowSource {
  const float* const* segment;
  int seg_len;
  int64_t ld, col;

  RowSource at(int64_t offset) const { return {segment, seg_len, ld, col + offset}; }
};

// Walks a RowSource's rows in order, one pointer that jumps at segment ends. (A loop over
// segments around a loop over their rows made GCC spill every accumulator each row.)
struct RowCursor {
  const RowSource& b;
  const float* row;
  int segment = 0, left;

  explicit RowCursor(const RowSource& source)
      : b(source), row(source.segment[0] + source.col), left(source.seg_len) {}
  // To row k + 1, given that row k < n - 1 was the current one.
  __attribute__((always_inline)) inline void next() {
    row += b.ld;
    if (--left == 0) {
      row = b.segment[++segment] + b.col;
      left = b.seg_len;
    }
  }
};

// The vector operations of rank1_tile, 8 lanes (AVX2) or 16 (AVX-512). Each load and
// broadcast is pinned to one instruction (the empty asm): else GCC folded the loads into every
// FMA (the load ports, not the FMAs, became the limit) or hoisted all the broadcasts of a step
// and spilled accumulators.
struct Lanes8 {
  using Vec = __m256;
  static constexpr int kWidth = 8;
  static Vec zero() { return _mm256_setzero_ps(); }
  static Vec load(const float* p) { return _mm256_loadu_ps(p); }
  static Vec load_pinned(const float* p) {
    Vec v = _mm256_loadu_ps(p);
    __asm__("" : "+x"(v));
    return v;
  }
  static Vec broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
  static void store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
};

// c[r][0 .. NV * width) = (accumulate ? c[r] : 0) + sum_{k < n} a[r * lda + k] * b row k, for
// R rows: rank-1 updates into R NV registers, NV loads of b and R broadcasts of a per k.
// Scores are q rows against transposed keys; values are probabilities against value rows.
// Each output gets the same FMAs in the same order whatever the lanes.
template <typename L, int R, int NV>
inline void rank1_lanes(const float* a, int64_t lda, const RowSource& b, int n, float* c,
                        int64_t ldc, bool accumulate) {
  typename L::Vec acc[R][NV];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j)
      acc[r][j] = accumulate ? L::load(c + r * ldc + L::kWidth * j) : L::zero();
  RowCursor cursor(b);
  for (int k = 0; k < n; ++k) {
    typename L::Vec bv[NV];
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) bv[j] = L::load_pinned(cursor.row + L::kWidth * j);
#pragma GCC unroll 8
    for (int r = 0; r < R; ++r) {
      const typename L::Vec av = L::broadcast(a + r * lda + k);
#pragma GCC unroll 4
      for (int j = 0; j < NV; ++j) acc[r][j] = L::fmadd(av, bv[j], acc[r][j]);
    }
    if (k + 1 < n) cursor.next();
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int j = 0; j < NV; ++j) L::store(c + r * ldc + L::kWidth * j, acc[r][j]);
}

template <int R, int NV>
inline void rank1_tile(const float* a, int64_t lda, const RowSource& b, int n, float* c,
                       int64_t ldc, bool accumulate) {
  rank1_lanes<Lanes8, R, NV>(a, lda, b, n, c, ldc, accumulate);
}

using Rank1Tile = void (*)(const float*, int64_t, const RowSource&, int, float*, int64_t, bool);

#if defined(__AVX512F__)
struct Lanes16 {
  using Vec = __m512;
  static constexpr int kWidth = 16;
  static Vec zero() { return _mm512_setzero_ps(); }
  static Vec load(const float* p) { return _mm512_loadu_ps(p); }
  static Vec load_pinned(const float* p) {
    Vec v = _mm512_loadu_ps(p);
    __asm__("" : "+v"(v));
    return v;
  }
  static Vec broadcast(const float* p) {
    Vec v = _mm512_set1_ps(*p);
    __asm__("" : "+v"(v));   // one broadcast live at a time: no accumulator spilled
    return v;
  }
  static Vec fmadd(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
  static void store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
};

template <int R, int NV>
inline void rank1_tile16(const float* a, int64_t lda, const RowSource& b, int n, float* c,
                         int64_t ldc, bool accumulate) {
  rank1_lanes<Lanes16, R, NV>(a, lda, b, n, c, ldc, accumulate);
}
#endif

// The register tiles of attend_rows, kRowTile rows against a run of columns: AVX2 tiles of
// 16 and 8 columns, or with AVX-512 (`wide`) tiles of 64, 48, 32 and 16 (a causal step's
// trimmed width, tile_keys, is often not a multiple of 64, and 16-column tiles take a
// broadcast per FMA). Any split of the columns makes the same FMAs in the same order per
// output.
struct RowTiles {
  bool wide;

  // c[rows, cols] (+)= a[rows, n] . b [n rows, cols], rows <= kRowTile, cols % 8 == 0.
  void run(int rows, const float* a, int64_t lda, const RowSource& b, int n, float* c,
           int64_t ldc, int cols, bool accumulate) const {
    for (int col = 0; col < cols;) {
      const int left = cols - col;
      const int width = wide ? (left >= 16 ? std::min(left, 64) / 16 * 16 : left)
                             : left >= 16 ? 16 : 8;
      pick(rows, width)(a, lda, b.at(col), n, c + col, ldc, accumulate);
      col += width;
    }
  }

  Rank1Tile pick(int rows, int width) const {
    static constexpr Rank1Tile narrow[2][kRowTile] = {
        {rank1_tile<1, 1>, rank1_tile<2, 1>, rank1_tile<3, 1>, rank1_tile<4, 1>,
         rank1_tile<5, 1>, rank1_tile<6, 1>},
        {rank1_tile<1, 2>, rank1_tile<2, 2>, rank1_tile<3, 2>, rank1_tile<4, 2>,
         rank1_tile<5, 2>, rank1_tile<6, 2>}};
#if defined(__AVX512F__)
    static constexpr Rank1Tile wide_tiles[4][kRowTile] = {
        {rank1_tile16<1, 1>, rank1_tile16<2, 1>, rank1_tile16<3, 1>, rank1_tile16<4, 1>,
         rank1_tile16<5, 1>, rank1_tile16<6, 1>},
        {rank1_tile16<1, 2>, rank1_tile16<2, 2>, rank1_tile16<3, 2>, rank1_tile16<4, 2>,
         rank1_tile16<5, 2>, rank1_tile16<6, 2>},
        {rank1_tile16<1, 3>, rank1_tile16<2, 3>, rank1_tile16<3, 3>, rank1_tile16<4, 3>,
         rank1_tile16<5, 3>, rank1_tile16<6, 3>},
        {rank1_tile16<1, 4>, rank1_tile16<2, 4>, rank1_tile16<3, 4>, rank1_tile16<4, 4>,
         rank1_tile16<5, 4>, rank1_tile16<6, 4>}};
    if (wide && width >= 16) return wide_tiles[width / 16 - 1][rows - 1];
#endif
    return narrow[width == 16][rows - 1];
  }
};

// out[i * out_stride + j] = in[j * in_stride + i] for an 8 x 8 tile.
inline void transpose8x8(const float* in, int64_t in_stride, float* out, int out_stride) {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * in_stride);
  __m256 t[8];
  for (int i = 0; i < 4; ++i) {   // pairs of rows interleaved
    t[2 * i] = _mm256_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm256_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  __m256 q[8];   // four rows' elements together, per 128-bit lane
  for (int i = 0; i < 2; ++i) {
    q[4 * i] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0x44);
    q[4 * i + 1] = _mm256_shuffle_ps(t[4 * i], t[4 * i + 2], 0xEE);
    q[4 * i + 2] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0x44);
    q[4 * i + 3] = _mm256_shuffle_ps(t[4 * i + 1], t[4 * i + 3], 0xEE);
  }
  for (int i = 0; i < 4; ++i) {   // the lanes of rows 0-3 and 4-7 joined
    _mm256_storeu_ps(out + i * out_stride, _mm256_permute2f128_ps(q[i], q[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * out_stride, _mm256_permute2f128_ps(q[i], q[i + 4], 0x31));
  }
}

// attend_rows takes blocks a step at a time, as many as make kStepKeys keys (at least one):
// one online-softmax update and one pass of the value tiles per step, not per block, and
// 64-key score tiles. 16-token blocks, 4 a step, 30 layers of SmolLM2's shapes, 512 new tokens
// over 2560 cached: 623 -> 533 ms with AVX-512 tiles, 739 -> 681 with AVX2 ones (2-core Xeon);
// 128 keys a step measured no faster.
constexpr int kStepKeys = 64;
constexpr int kMaxStepBlocks = kStepKeys / 8;   // block sizes are multiples of 8
inline int step_blocks(int64_t block_size) {
  return static_cast<int>(std::max<int64_t>(1, kStepKeys / block_size));
}
// Keys of a whole step: the width of attend_rows' scratch (kt [dim, w], scores [rows, w]).
inline int64_t step_keys(int64_t block_size) { return step_blocks(block_size) * block_size; }

// One head's rows in `count` blocks of a cache (their ids in `blocks`), to be prefetched in
// `parts` shares (count 0: nothing to fetch).
struct StepRows {
  const float* cache;
  const int64_t* blocks;
  int count;
  const Shape& s;
  int64_t head;

  inline void prefetch(int part, int parts) const {
    const int per_row = static_cast<int>(s.dim * sizeof(float) / 64);
    const int per_block = static_cast<int>(s.block_size) * per_row, lines = count * per_block;
    for (int l = lines * part / parts; l < lines * (part + 1) / parts; ++l) {
      const int line = l % per_block;
      const float* row = cache + blocks[l / per_block] * s.block_stride + head * s.dim +
                         (line / per_row) * s.token_stride;
      __builtin_prefetch(reinterpret_cast<const char*>(row) + (line % per_row) * 64);
    }
  }
};

// Which keys attend_rows' rows may see: row r the positions up to pos[r] (null: every key of
// the blocks), and no position from `end` on (the context's last block may be partly filled).
struct RowLimits {
  const int64_t* pos;
  int64_t end;
};
constexpr RowLimits kWholeBlocks{nullptr, std::numeric_limits<int64_t>::max()};

// Scores of keys a row may not see (RowLimits) set to -inf, for the `width` keys from
// position `first` (rows `ld` floats apart).
inline void mask_step(float* scores, int rows, int width, int ld, int64_t first,
                      RowLimits limits) {
  const float none = -std::numeric_limits<float>::infinity();
  for (int r = 0; r < rows; ++r) {
    int64_t last = std::min<int64_t>(limits.end - 1, limits.pos ? limits.pos[r] : limits.end);
    last = std::max<int64_t>(last - first, -1);
    if (last < width - 1) std::fill(scores + r * ld + last + 1, scores + r * ld + width, none);
  }
}

// How many of a step's `width` keys from position `first` rows [r0, r0 + n) need scored:
// up to the last any of them may see (RowLimits), rounded up to a whole `round` columns;
// mask_step sets the rest to -inf for each of them anyway. An item's rows (32 tokens) see
// fewer keys in their last step than it has (64). Trimmed, 30 layers, A/B in alternating
// processes (2-core Xeon): 16 prompts of 64-512 tokens in 512-token steps 44.3 / 43.2 / 44.7
// -> 42.8 / 41.5 / 41.2 ms a step; 3000 uncached tokens in 512-token chunks 2% less.
inline int tile_keys(RowLimits limits, int r0, int n, int64_t first, int width, int round) {
  if (limits.pos == nullptr) return width;
  int64_t last = limits.pos[r0];
  for (int r = r0 + 1; r < r0 + n; ++r) last = std::max(last, limits.pos[r]);
  last = std::min(last, limits.end - 1) - first;
  if (last < 0) return 0;
  return static_cast<int>(std::min<int64_t>(width, (last + round) / round * round));
}

// Keys of head h in `blocks` blocks from block b of `table`, transposed side by side into
// kt [dim, step_keys] (one tile for all of a step's score rows).
void transpose_step_keys(const float* k_cache, const int64_t* table, int64_t b, int blocks,
                         int64_t h, const Shape& s, float* kt) {
  const int64_t ld = step_keys(s.block_size);
  for (int j = 0; j < blocks; ++j) {
    const float* k = k_cache + table[b + j] * s.block_stride + h * s.dim;
    for (int64_t t = 0; t < s.block_size; t += 8)
      for (int64_t d = 0; d < s.dim; d += 8)
        transpose8x8(k + t * s.token_stride + d, s.token_stride,
                     kt + d * ld + j * s.block_size + t, static_cast<int>(ld));
  }
}

// `rows` pre-scaled query rows (q, [rows, dim]) of one kv head `h` over the blocks [b0, b1)
// of `table`, within `limits`; leaves their softmax state in acc [rows, dim], running max and
// sum. Every row must see the first key of block b0. Scratch: kt [dim, step_keys] (unless
// `keys_ready` holds every step's transposed keys from b0 on, step after step), scores
// [rows, step_keys]. Needs dim, block_size % 8 == 0.
void attend_rows(const float* q, int rows, const float* k_cache, const float* v_cache,
                 const int64_t* table, int64_t b0, int64_t b1, int64_t h, const Shape& s,
                 RowLimits limits, const float* keys_ready, float* kt, float* scores,
                 float* acc, float* running_max, float* running_sum) {
  const int dim = static_cast<int>(s.dim), bs = static_cast<int>(s.block_size);
  std::fill(running_max, running_max + rows, -std::numeric_limits<float>::infinity());
  std::fill(running_sum, running_sum + rows, 0.0f);
  std::fill(acc, acc + rows * dim, 0.0f);
  const RowTiles tiling{s.wide};
  const int per_step = step_blocks(bs), ld = per_step * bs;
  const int tiles = (rows + kRowTile - 1) / kRowTile;
  const int slice_width = s.wide ? 64 : 16, slices = (dim + slice_width - 1) / slice_width;
  const float* key_rows[1];
  const float* value_rows[kMaxStepBlocks];
  for (int64_t b = b0; b < b1; b += per_step) {
    const int blocks = static_cast<int>(std::min<int64_t>(per_step, b1 - b));
    for (int j = 0; j < blocks; ++j)
      value_rows[j] = v_cache + table[b + j] * s.block_stride + h * s.dim;
    if (keys_ready != nullptr) {
      key_rows[0] = keys_ready + (b - b0) / per_step * dim * ld;
    } else {
      transpose_step_keys(k_cache, table, b, blocks, h, s, kt);
      key_rows[0] = kt;
    }
    // The next step's rows of this head are asked for a phase ahead, a share per tile (its
    // values while this step is scored, its keys while this step's values are added): all
    // at once stalled on the full miss queue, none left the loads waiting on L3.
    const int next = static_cast<int>(std::min<int64_t>(per_step, b1 - b - blocks));
    const StepRows next_v{v_cache, table + b + blocks, next, s, h};
    const StepRows next_k{k_cache, table + b + blocks, keys_ready ? 0 : next, s, h};
    // keys [first, first + len) exist; the rows after them in the last block are masked
    const int64_t first = b * bs;
    const int width = blocks * bs, round = s.wide ? 16 : 8;
    const int len = static_cast<int>(std::min<int64_t>(width, limits.end - first));
    // each row tile scores the keys its rows may see (tile_keys), and adds their values only
    const auto keys_of = [&](int r0) {
      return tile_keys(limits, r0, std::min(kRowTile, rows - r0), first, width, round);
    };
    for (int tile = 0; tile < tiles; ++tile) {
      next_v.prefetch(tile, tiles);
      const int r0 = tile * kRowTile, keys = keys_of(r0);
      if (keys > 0)
        tiling.run(std::min(kRowTile, rows - r0), q + r0 * dim, dim, {key_rows, dim, ld, 0},
                   dim, scores + r0 * ld, ld, keys, false);
    }
    if (limits.pos != nullptr || len < width) mask_step(scores, rows, width, ld, first, limits);
    for (int r = 0; r < rows; ++r)
      softmax_step(scores + r * ld, width, acc + r * dim, dim, running_max[r], running_sum[r],
                   s.wide);
    // dims outer: a slice of the step's values stays in L1 while every row tile reads it
    const RowSource values{value_rows, bs, s.token_stride, 0};
    for (int slice = 0; slice < slices; ++slice) {
      next_k.prefetch(slice, slices);
      const int d = slice * slice_width, cols = std::min(slice_width, dim - d);
      for (int r0 = 0; r0 < rows; r0 += kRowTile) {
        // keys past keys_of(r0) are masked for every row of the tile: their p is exp_ps's
        // floor (~1e-38), below the rounding of the sums that skip them (outputs bitwise
        // the untrimmed ones in the A/B above)
        const int keys = std::min(len, keys_of(r0));
        if (keys > 0)
          tiling.run(std::min(kRowTile, rows - r0), scores + r0 * ld, ld, values.at(d), keys,
                     acc + r0 * dim + d, dim, cols, true);
      }
    }
  }
}

// One unit of work of attend_with_groups: a (group, kv head, chunk) of shared blocks, or a
// request's own blocks after its group's prefix (group < 0: a request in no group, whole).
struct WorkItem {
  int64_t group, head, chunk, request;
};

// The batch when some requests share a prefix (find_shared_groups): every request's state is
// kept in parts, one per chunk of its group's shared blocks plus one for its own blocks, then
// merged. Items are claimed from a shared counter, as their sizes differ widely.
void attend_with_groups(const std::vector<SharedGroup>& groups, const float* q, const float* kc,
                        const float* vc, const int64_t* table, const int64_t* lens, int64_t num,
                        float scale, const Shape& s, float* out) {
  const int64_t rows = s.heads, dim = s.dim, bs = s.block_size;
  std::vector<int64_t> group_of(num, -1), first_part(num + 1, 0);
  for (size_t g = 0; g < groups.size(); ++g)
    for (int64_t r : groups[g].members) group_of[r] = static_cast<int64_t>(g);
  for (int64_t r = 0; r < num; ++r)
    first_part[r + 1] = first_part[r] + 1 + (group_of[r] >= 0 ? groups[group_of[r]].chunks() : 0);
  std::vector<WorkItem> items;
  int64_t max_rows = s.groups;
  for (size_t g = 0; g < groups.size(); ++g) {
    max_rows = std::max<int64_t>(max_rows, groups[g].members.size() * s.groups);
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t c = 0; c < groups[g].chunks(); ++c)
        items.push_back({static_cast<int64_t>(g), h, c, -1});
  }
  for (int64_t r = 0; r < num; ++r) items.push_back({group_of[r], 0, 0, r});
  const int64_t parts = first_part[num];
  std::vector<float> part_acc(parts * rows * dim), part_max(parts * rows), part_sum(parts * rows);
  struct Scratch {
    std::vector<float> q_buf, scores, kt, acc, mx, sm;
  };
  const auto make_scratch = [&] {
    return Scratch{std::vector<float>(std::max(max_rows, rows) * dim),
                   std::vector<float>(std::max(max_rows * step_keys(bs), rows * bs)),
                   std::vector<float>(dim * step_keys(bs)),
                   std::vector<float>(max_rows * dim), std::vector<float>(max_rows),
                   std::vector<float>(max_rows)};
  };
  // one work item at a time from the shared counter (kernels/work_sharing.h)
  tokenmill_parallel::parallel_chunks_with(static_cast<int64_t>(items.size()), 1, make_scratch,
                                           [&](Scratch& scratch, int64_t begin, int64_t end) {
    auto& [q_buf, scores, kt, acc, mx, sm] = scratch;
    for (int64_t i = begin; i < end; ++i) {
      const WorkItem& item = items[i];
      if (item.request >= 0) {   // a request's own blocks, after its group's prefix if any
        const int64_t r = item.request, p = first_part[r + 1] - 1;
        const int64_t start = item.group >= 0 ? groups[item.group].blocks * bs : 0;
        attend(q + r * rows * dim, kc, vc, table + r * s.max_blocks, start, lens[r], scale, s,
               q_buf.data(), scores.data(), part_acc.data() + p * rows * dim,
               part_max.data() + p * rows, part_sum.data() + p * rows);
        continue;
      }
      const SharedGroup& group = groups[item.group];
      const int64_t n_rows = group.members.size() * s.groups;
      const int64_t b0 = item.chunk * kChunkBlocks;
      const int64_t b1 = std::min(group.blocks, b0 + kChunkBlocks);
      const int64_t* shared = table + group.members[0] * s.max_blocks;
      const int first_step = static_cast<int>(std::min<int64_t>(step_blocks(bs), b1 - b0));
      StepRows{kc, shared + b0, first_step, s, item.head}.prefetch(0, 1);   // while the
      StepRows{vc, shared + b0, first_step, s, item.head}.prefetch(0, 1);   // queries gather
      for (size_t m = 0; m < group.members.size(); ++m)   // pre-scaled rows of kv head `head`
        for (int64_t g = 0; g < s.groups; ++g) {
          const float* src = q + (group.members[m] * rows + item.head * s.groups + g) * dim;
          float* dst = q_buf.data() + (m * s.groups + g) * dim;
          for (int64_t d = 0; d < dim; ++d) dst[d] = src[d] * scale;
        }
      attend_rows(q_buf.data(), static_cast<int>(n_rows), kc, vc,
                  table + group.members[0] * s.max_blocks, b0, b1, item.head, s, kWholeBlocks,
                  nullptr, kt.data(), scores.data(), acc.data(), mx.data(), sm.data());
      for (size_t m = 0; m < group.members.size(); ++m) {
        const int64_t p = first_part[group.members[m]] + item.chunk;
        for (int64_t g = 0; g < s.groups; ++g) {
          const int64_t row = m * s.groups + g, dst = p * rows + item.head * s.groups + g;
          std::copy(acc.data() + row * dim, acc.data() + (row + 1) * dim,
                    part_acc.data() + dst * dim);
          part_max[dst] = mx[row];
          part_sum[dst] = sm[row];
        }
      }
    }
  });
  for (int64_t r = 0; r < num; ++r) {
    const int64_t p = first_part[r];
    merge_parts(part_acc.data() + p * rows * dim, part_max.data() + p * rows,
                part_sum.data() + p * rows, first_part[r + 1] - p, rows, dim,
                out + r * rows * dim);
  }
}
#endif

// Whether attend_rows takes the AVX-512 tiles where the build has them; tests switch them off
// to compare. Set before a call, read once by it (checked_shape).
std::atomic<bool> use_wide_tiles{kWideTiles};

// The checks both entry points make on query/out and the caches, and the shape they imply.
Shape checked_shape(const torch::Tensor& out, const torch::Tensor& query,
                    const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    int64_t max_blocks) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "query/out must be [num, heads, head_dim] of the same shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [num_blocks, block_size, kv_heads, head_dim] of the same shape");
  for (const auto* t : {&out, &query, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "paged attention: float32 only");
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "tensors must be contiguous, CPU");
  }
  Shape s;
  s.heads = query.size(1);
  s.dim = query.size(2);
  s.block_size = k_cache.size(1);
  s.kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == s.dim, "head_dim of query and caches differ");
  TORCH_CHECK(s.heads % s.kv_heads == 0, "heads must be a multiple of kv_heads");
  s.groups = s.heads / s.kv_heads;
  s.max_blocks = max_blocks;
  s.token_stride = s.kv_heads * s.dim;
  s.block_stride = s.block_size * s.token_stride;
  s.wide = use_wide_tiles;
  pick_block_fns(s.groups, s.dim, s.wide, &s.score, &s.accumulate);
  return s;
}

}  // namespace

bool paged_attention_has_avx512() { return kWideTiles; }

bool paged_attention_use_avx512(bool on) {
  use_wide_tiles = on && kWideTiles;
  return use_wide_tiles;
}

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.dim() == 2 &&
                  block_table.is_contiguous(), "block_table must be contiguous int64 [num, max]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int64 [num]");
  const Shape s = checked_shape(out, query, k_cache, v_cache, block_table.size(1));
  const int64_t num = query.size(0);
  TORCH_CHECK(block_table.size(0) == num && seq_lens.numel() == num,
              "block_table/seq_lens must have one row per query");
  if (num == 0) return;

  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t num_blocks = k_cache.size(0);
  // Checked up front: nothing may throw inside the parallel region.
  for (int64_t r = 0; r < num; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= s.max_blocks * s.block_size,
                "seq_len out of range of the block table");
    const int64_t* row = table + r * s.max_blocks;
    for (int64_t bi = 0; bi * s.block_size < lens[r]; ++bi)
      TORCH_CHECK(row[bi] >= 0 && row[bi] < num_blocks, "block id out of range");
  }
  const float fscale = static_cast<float>(scale);
#ifdef __AVX2__
  if (sliding_window <= 0 && s.dim % 8 == 0 && s.block_size % 8 == 0) {
    const std::vector<SharedGroup> groups = find_shared_groups(table, lens, num, s);
    if (!groups.empty()) {
      attend_with_groups(groups, q, kc, vc, table, lens, num, fscale, s, o);
      return;
    }
  }
#endif
  std::vector<int64_t> first_part;
  const std::vector<Slice> slices = decode_slices(lens, num, s.block_size, sliding_window,
                                                  at::get_num_threads(), first_part);
  const int64_t rows = s.heads;   // query heads of one request
  const int64_t parts = first_part[num];
  // Partial softmax state of every slice; a request in one slice is normalized in place.
  std::vector<float> part_acc(parts > num ? parts * rows * s.dim : 0), part_max(parts * rows),
      part_sum(parts * rows);
  struct Scratch {
    std::vector<float> q_buf, scores, acc;
  };
  const auto make_scratch = [&] {
    return Scratch{std::vector<float>(rows * s.dim),
                   std::vector<float>(rows * s.block_size), std::vector<float>(rows * s.dim)};
  };
  // one slice at a time from the shared counter (kernels/work_sharing.h)
  tokenmill_parallel::parallel_chunks_with(static_cast<int64_t>(slices.size()), 1, make_scratch,
                                           [&](Scratch& scratch, int64_t begin, int64_t end) {
    auto& [q_buf, scores, acc] = scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Slice& slice = slices[i];
      const int64_t r = slice.request;
      float* mx = part_max.data() + slice.part * rows;
      float* sm = part_sum.data() + slice.part * rows;
      float* a = slice.whole ? acc.data() : part_acc.data() + slice.part * rows * s.dim;
      attend(q + r * rows * s.dim, kc, vc, table + r * s.max_blocks, slice.start, slice.stop,
             fscale, s, q_buf.data(), scores.data(), a, mx, sm);
      if (slice.whole) normalize(a, sm, rows, s.dim, o + r * rows * s.dim);
    }
  });
  // few requests or few long ones, and tiny work: no second fork
  for (int64_t r = 0; r < num; ++r) {
    const int64_t p = first_part[r], count = first_part[r + 1] - p;
    if (count > 1)
      merge_parts(part_acc.data() + p * rows * s.dim, part_max.data() + p * rows,
                  part_sum.data() + p * rows, count, rows, s.dim, o + r * rows * s.dim);
  }
}

namespace {

// One request's prefill chunk in a step: query rows [start, start + len) at positions
// [seq_len - len, seq_len), its block table, and where its keys are transposed up front.
struct PrefillChunk {
  int64_t start, len, seq_len;
  const int64_t* table;
  int64_t steps = 0;      // kStepKeys-key steps of its context (transpose_keys_up_front)
  int64_t keys = -1;      // offset of its kv_heads * steps transposed steps (-1: none)

  int64_t rows(const Shape& s) const { return len * s.groups; }   // (token, head) rows
};

// A work item: query rows [r0, r0 + n) of a chunk (row = token * groups + head in the group)
// for one kv head; cost = rows x the keys the last of them sees.
struct PrefillItem {
  int64_t chunk, head, r0, n, cost;
};

// The chunks of `spec` ([n, 4]: first query row, query rows, seq_len, offset of the block
// table in `tables`), each checked (nothing may throw inside the parallel region); empty ones
// left out.
std::vector<PrefillChunk> checked_chunks(const torch::Tensor& spec, const torch::Tensor& tables,
                                         int64_t num_tokens, int64_t num_blocks, const Shape& s) {
  TORCH_CHECK(spec.scalar_type() == torch::kInt64 && spec.dim() == 2 && spec.size(1) == 4 &&
                  spec.is_contiguous(), "chunks must be contiguous int64 [num_chunks, 4]");
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.dim() == 1 &&
                  tables.is_contiguous(), "tables must be contiguous int64 [blocks]");
  const int64_t* row = spec.data_ptr<int64_t>();
  const int64_t* all_tables = tables.data_ptr<int64_t>();
  std::vector<PrefillChunk> chunks;
  for (int64_t c = 0; c < spec.size(0); ++c, row += 4) {
    const int64_t start = row[0], len = row[1], seq_len = row[2], offset = row[3];
    const int64_t blocks = (seq_len + s.block_size - 1) / s.block_size;
    TORCH_CHECK(start >= 0 && len >= 0 && start + len <= num_tokens,
                "chunk rows out of range of the query");
    TORCH_CHECK(len <= seq_len && offset >= 0 && offset + blocks <= tables.size(0),
                "seq_len must cover the query and fit the block table");
    for (int64_t b = offset; b < offset + blocks; ++b)
      TORCH_CHECK(all_tables[b] >= 0 && all_tables[b] < num_blocks, "block id out of range");
    if (len > 0) chunks.push_back({start, len, seq_len, all_tables + offset});
  }
  return chunks;
}

// Query rows per work item: 96 when that leaves at least 4 items a thread, else 48. An item
// streams its whole context through once, so the more rows it takes the less is read (30
// layers, 48 -> 96 rows: 512 new tokens over 2560 cached 533 -> 478 ms; 3000 uncached 1.62 ->
// 1.42 s), but a short chunk over a long context needs the items to share out (32 tokens over
// 3000: 38 ms at 48 rows, 46 at 96).
int64_t prefill_rows_per_item(const std::vector<PrefillChunk>& chunks, const Shape& s,
                              int threads) {
  constexpr int64_t kMostRows = 16 * kRowTile, kItemsPerThread = 4;
  int64_t items = 0;
  for (const PrefillChunk& chunk : chunks)
    items += (chunk.rows(s) + kMostRows - 1) / kMostRows * s.kv_heads;
  return items >= kItemsPerThread * threads ? kMostRows : kMostRows / 2;
}

// Every chunk's items, the most work first across the whole step, so that the long ones are
// not left for the end.
std::vector<PrefillItem> prefill_items(const std::vector<PrefillChunk>& chunks, int64_t row_block,
                                       const Shape& s) {
  std::vector<PrefillItem> items;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    const PrefillChunk& chunk = chunks[c];
    const int64_t rows = chunk.rows(s);
    for (int64_t r0 = 0; r0 < rows; r0 += row_block) {
      const int64_t n = std::min(row_block, rows - r0);
      const int64_t keys = chunk.seq_len - chunk.len + (r0 + n - 1) / s.groups + 1;
      for (int64_t h = 0; h < s.kv_heads; ++h) items.push_back({c, h, r0, n, n * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const PrefillItem& a, const PrefillItem& b) {
    return a.cost > b.cost;
  });
  return items;
}

#ifdef __AVX2__
// With more than two items a kv head, each would transpose the same keys: a chunk's keys are
// transposed once, up front, into the returned buffer at its `keys` offset (30 layers: 3000
// uncached tokens 1.41 -> 1.35 s, 512 over 2560 cached 471 -> 409 ms; with 2 items a head it
// did not pay, 32 tokens over 3000: 38 -> 40 ms). One fork for every chunk's steps.
std::vector<float> transpose_keys_up_front(std::vector<PrefillChunk>& chunks, int64_t row_block,
                                           const float* k_cache, const Shape& s) {
  const int64_t step_floats = s.dim * step_keys(s.block_size);
  struct KeyStep {
    const PrefillChunk* chunk;
    int64_t head, step;
  };
  std::vector<KeyStep> steps;
  int64_t floats = 0;
  for (PrefillChunk& chunk : chunks) {
    chunk.steps = (chunk.seq_len + step_keys(s.block_size) - 1) / step_keys(s.block_size);
    if ((chunk.rows(s) + row_block - 1) / row_block <= 2) continue;
    chunk.keys = floats;
    floats += s.kv_heads * chunk.steps * step_floats;
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t i = 0; i < chunk.steps; ++i) steps.push_back({&chunk, h, i});
  }
  std::vector<float> keys(floats);
  const int64_t per_step = step_blocks(s.block_size);
  tokenmill_parallel::parallel_chunks(static_cast<int64_t>(steps.size()), 1,
                                      [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const PrefillChunk& chunk = *steps[i].chunk;
      const int64_t b = steps[i].step * per_step;
      const int64_t blocks = (chunk.seq_len + s.block_size - 1) / s.block_size;
      transpose_step_keys(k_cache, chunk.table, b,
                          static_cast<int>(std::min(per_step, blocks - b)), steps[i].head, s,
                          keys.data() + chunk.keys +
                              (steps[i].head * chunk.steps + steps[i].step) * step_floats);
    }
  });
  return keys;
}
#endif

}  // namespace

// Causal attention of a step's prefill chunks, all in one call: work items across requests,
// one fork for the keys and one for the items (one call a chunk forked twice a chunk; offline,
// 16 prompts of 64-512 tokens at once in 512-token steps: the last first token 3.96 -> 3.84 s,
// 2-core Xeon). query [T, heads, head_dim], its token stride free (a view of the qkv
// projection's output); out [T, heads, head_dim]. chunks [n, 4] int64: first query row, query
// rows, seq_len, offset of the chunk's block table in `tables`. A chunk's rows are the
// positions [seq_len - rows, seq_len) of a request, attending causally to its context read in
// place through its blocks (in order; the chunk's keys and values already written). Rows of
// out in no chunk are left alone. Work item = (chunk, kv head, 48-96 query rows), rows being
// (token, query head of the group) pairs scored against each block at once (attend_rows).
// Returns false, leaving out untouched, for what it does not take (no AVX2, head_dim or
// block_size not a multiple of 8): the caller's reference path does.
bool paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                             torch::Tensor v_cache, torch::Tensor chunks, torch::Tensor tables,
                             double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && query.stride(2) == 1 &&
                  query.stride(1) == query.size(2) &&
                  query.stride(0) >= query.size(1) * query.size(2),
              "query must be [num, heads, head_dim] with contiguous heads, out of its shape");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.device().is_cpu(),
              "query must be float32 on the CPU");
  const Shape s = checked_shape(out, out, k_cache, v_cache, 0);
  std::vector<PrefillChunk> batch = checked_chunks(chunks, tables, query.size(0),
                                                   k_cache.size(0), s);
#ifdef __AVX2__
  if (s.dim % 8 != 0 || s.block_size % 8 != 0) return false;
  if (batch.empty()) return true;
  const int64_t row_block = prefill_rows_per_item(batch, s, at::get_num_threads());
  const int64_t dim = s.dim, step_floats = dim * step_keys(s.block_size);
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const std::vector<float> keys = transpose_keys_up_front(batch, row_block, kc, s);
  const std::vector<PrefillItem> items = prefill_items(batch, row_block, s);
  const float* q = query.data_ptr<float>();
  const int64_t q_stride = query.stride(0);
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  struct Scratch {
    std::vector<float> q_buf, kt, scores, acc, mx, sm;
    std::vector<int64_t> pos;
  };
  const auto make_scratch = [&] {
    return Scratch{std::vector<float>(row_block * dim),
                   std::vector<float>(dim * step_keys(s.block_size)),
                   std::vector<float>(row_block * step_keys(s.block_size)),
                   std::vector<float>(row_block * dim), std::vector<float>(row_block),
                   std::vector<float>(row_block), std::vector<int64_t>(row_block)};
  };
  tokenmill_parallel::parallel_chunks_with(static_cast<int64_t>(items.size()), 1, make_scratch,
                                           [&](Scratch& scratch, int64_t begin, int64_t end) {
    auto& [q_buf, kt, scores, acc, mx, sm, pos] = scratch;
    for (int64_t i = begin; i < end; ++i) {
      const PrefillItem& item = items[i];
      const PrefillChunk& chunk = batch[item.chunk];
      const int64_t h = item.head, n = item.n;
      const auto row_of = [&](int64_t r) {   // (query row of out, query head)
        return std::pair{chunk.start + (item.r0 + r) / s.groups,
                         h * s.groups + (item.r0 + r) % s.groups};
      };
      for (int64_t r = 0; r < n; ++r) {
        const auto [token, head] = row_of(r);
        const float* src = q + token * q_stride + head * dim;
        for (int64_t d = 0; d < dim; ++d) q_buf[r * dim + d] = src[d] * fscale;
        pos[r] = chunk.seq_len - chunk.len + (token - chunk.start);
      }
      const float* ready =
          chunk.keys < 0 ? nullptr : keys.data() + chunk.keys + h * chunk.steps * step_floats;
      attend_rows(q_buf.data(), static_cast<int>(n), kc, vc, chunk.table, 0,
                  pos[n - 1] / s.block_size + 1, h, s, RowLimits{pos.data(), chunk.seq_len},
                  ready, kt.data(), scores.data(), acc.data(), mx.data(), sm.data());
      for (int64_t r = 0; r < n; ++r) {
        const auto [token, head] = row_of(r);
        normalize(acc.data() + r * dim, sm.data() + r, 1, dim, o + (token * s.heads + head) * dim);
      }
    }
  });
  return true;
#else
  return false;
#endif
}

// For the C++ decode loop (kernels/entry_points.h).
std::vector<pybind11::capsule> entry_points() {
  using namespace tokenmill_entry;
  return {export_entry<PagedDecodeAttentionFn>(&paged_decode_attention,
                                               "tokenmill.paged_decode_attention")};
}
