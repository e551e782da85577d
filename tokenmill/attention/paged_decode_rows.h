// Paged decode attention, one request at a time (cpu_paged_kernel.cpp, which the build compiles
// with this file in front of it): one new query token per request attends to its context
// straight from the paged KV cache through its block table. No gather, no padding.
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
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

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

#if defined(__AVX512F__)
// score_keys<G, 4> with two keys a 16-lane register (keys j and j + 1 in its low and high
// eight lanes): half the FMAs, each lane adding the same products in the same order as the
// 8-lane version, and the same reduction tree after: bitwise its scores. On the Xeon it
// measured 0.98x from memory and 1.03x slower from cache (fifty-second session); on the
// 2-core EPYC family 1Ah, where decode attention runs at ~40-55 GB/s of ~100 a plain read
// gets, SmolLM2's 30 layers of decode attention, the two in turn in one process (medians of
// 21): one 3,000-token request 1.060x faster (1.098x with its blocks in the L3), 8 of 300-600
// tokens 1.004x (1.090x), 16 of 200-400 1.014x.
template <int G>
inline void score_keys_paired(const float* q, const float* k, int64_t token_stride, int dim,
                              float* scores, int stride) {
  __m512 a[G][2];
  for (int g = 0; g < G; ++g) a[g][0] = a[g][1] = _mm512_setzero_ps();
  for (int d = 0; d < dim; d += 8) {
    __m512 kv[2];
    for (int j = 0; j < 2; ++j) {
      const float* kj = k + 2 * j * token_stride + d;
      kv[j] = _mm512_insertf32x8(_mm512_castps256_ps512(_mm256_loadu_ps(kj)),
                                 _mm256_loadu_ps(kj + token_stride), 1);
    }
    for (int g = 0; g < G; ++g) {
      const __m512 qv = _mm512_broadcast_f32x8(_mm256_loadu_ps(q + g * dim + d));
      for (int j = 0; j < 2; ++j) a[g][j] = _mm512_fmadd_ps(qv, kv[j], a[g][j]);
    }
  }
  for (int g = 0; g < G; ++g)
    _mm_storeu_ps(scores + g * stride,
                  hsum4(_mm512_castps512_ps256(a[g][0]), _mm512_extractf32x8_ps(a[g][0], 1),
                        _mm512_castps512_ps256(a[g][1]), _mm512_extractf32x8_ps(a[g][1], 1)));
}
#endif

// Fixed group count G: every key/value load serves all G query heads (`Paired`: four keys
// as two pairs, score_keys_paired, G <= 3 only).
template <int G, bool Paired = false>
void score_block_g(const float* q, const float* k, int64_t token_stride, int len, int,
                   int dim, float* scores, int stride, Prefetch ahead) {
  constexpr int KP = G <= 3 ? 4 : 1;   // 4 keys x G heads of accumulators fit 16 registers
  static_assert(!Paired || KP == 4, "pairs of keys need four keys a step");
  const int steps = len / KP;
  if (steps == 0) ahead.part(0, 1);
  int i = 0;
  for (; i + KP <= len; i += KP) {
    ahead.part(i / KP, steps);
#if defined(__AVX512F__)
    if constexpr (Paired) {
      score_keys_paired<G>(q, k + i * token_stride, token_stride, dim, scores + i, stride);
      continue;
    }
#endif
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
  if (wide) {
    if (groups == 1) *score = score_block_g<1, true>;
    if (groups == 2) *score = score_block_g<2, true>;
    if (groups == 3) *score = score_block_g<3, true>;
  }
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

// Work per request when there are too few requests to keep every thread busy: the context is
// cut into this many slices of whole blocks (each at least kMinSliceBlocks long), all kv heads
// per slice, merged after. Slices read contiguous rows; one kv head per item read a third of
// each row at a stride and left threads idle when kv_heads did not divide evenly. Slices of 8
// blocks, not 4: a short slice costs more in its start and merge than its share of the reads
// (one request, SmolLM2's 30 layers, the two in turn: 128 tokens 1.40x, 256 1.04x, 512 1.11x,
// 1,024 even; real one-request decode steps 1.02x).
constexpr int64_t kMinSliceBlocks = 8;
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

}  // namespace
