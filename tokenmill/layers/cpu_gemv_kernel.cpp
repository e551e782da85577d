// Small-M fp32 linear for CPU: y[M, N] = x[M, K] @ W[N, K]^T for decode-sized steps (M up to a
// few hundred rows).
//
// W is repacked once into [N/16, K, 16] panels, so each k step reads one 64-byte line of 16
// output columns. A register tile accumulates up to 6 rows of x against it in 12 AVX2
// registers. K is cut into blocks (a slice of the panel, which stays in L1 while every row
// group of x passes over it), so the weights stream from memory once per step whatever M is.
// Only the first row group's pass reads new weights, so at decode sizes (up to 6 groups) the
// blocks are short, 64 steps (4 KB), to keep the stream's pauses short: 256-step blocks were
// 5-20% slower at M = 8-32 with the weights out of cache, and 5-10% faster above M = 36.
// Up to 6 rows a tile spans several panels instead (one_row_group), so the step is bound by
// the weights' stream; from M = 24 up it runs at 75-90% of the FMA peak, above oneDNN's packed
// GEMM up to M = 384 on SmolLM2's shapes (layers/cpu_gemv.py has the figures). Threads take
// the panels in chunks (kernels/work_sharing.h).
//
// Compact panels (layers/gemv_blocks.h): weights that are exactly GGUF Q4_1 or Q8_0 values
// also stream in their blocks, a fifth or a quarter of the bytes, and are rebuilt in
// registers as the same fp32 numbers; the output is bitwise that of the fp32 panels. Short
// steps take them in the factored form instead (fewer operations a weight, as accurate, not
// bitwise): up to 6 rows where the build has AVX-512 (12 on AMD Zen 4 and 5, gemv_avx512.h),
// one row on the AVX2 tiles (factored_row).
#include <algorithm>
#include <atomic>
#include <vector>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

constexpr int64_t kPanel = 16;     // output columns per panel
constexpr int64_t kMaxRows = 6;    // rows of x per register tile
constexpr int64_t kHalfMaxRows = 12;  // rows of a half-panel tile (compact Q8_0 panels)
constexpr int64_t kShortBlockK = 64;      // k steps per pass over a panel slice...
constexpr int64_t kShortBlockGroups = 6;  // ...for up to this many row groups
constexpr int64_t kLongBlockK = 256;      // k steps per pass for more row groups
constexpr int64_t kPrefetch = 32;  // k steps ahead to prefetch the panel (2 KB)
static_assert(kPanel == gemv_blocks::kCols, "compact panels have the fp32 panels' width");

torch::Tensor pack_gemv_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32,
              "pack_gemv_weight: a 2-D float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kPanel == 0, "pack_gemv_weight: out_features must be a multiple of 16");
  return weight.contiguous().view({n / kPanel, kPanel, k}).transpose(1, 2).contiguous();
}

torch::Tensor pack_gemv_q4(torch::Tensor weight) {
  return gemv_blocks::pack<gemv_blocks::Q4_1>(weight);
}
torch::Tensor pack_gemv_q8(torch::Tensor weight) {
  return gemv_blocks::pack<gemv_blocks::Q8_0>(weight);
}

// y[R, 16 P] (+)= x[R, k_len] @ P panels [k_len, 16] (`panel_stride` floats apart). Each output
// sums its k steps in order, one FMA each, whatever R and P: a row's result does not depend on
// the rows beside it. The r and p loops are unrolled by pragma: without it GCC keeps the
// accumulator arrays in memory and stores all of them every k step (a third of the FMA rate).
#if defined(__AVX2__) && defined(__FMA__)
// One k step of a tile: x[r][k] (x points at column k, rows ldx apart) times panel p's 16
// weights, into that panel's accumulators of every row.
template <int R, int P>
__attribute__((always_inline)) inline void fma_rows(__m256 (&lo)[R][P], __m256 (&hi)[R][P],
                                                    int p, const float* x, int64_t ldx,
                                                    __m256 w_lo, __m256 w_hi) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r) {
    const __m256 xv = _mm256_broadcast_ss(x + r * ldx);
    lo[r][p] = _mm256_fmadd_ps(xv, w_lo, lo[r][p]);
    hi[r][p] = _mm256_fmadd_ps(xv, w_hi, hi[r][p]);
  }
}

template <int R, int P>
__attribute__((always_inline)) inline void store_tile(const __m256 (&lo)[R][P],
                                                      const __m256 (&hi)[R][P], float* y,
                                                      int64_t ldy) {
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      _mm256_storeu_ps(y + r * ldy + p * kPanel, lo[r][p]);
      _mm256_storeu_ps(y + r * ldy + p * kPanel + 8, hi[r][p]);
    }
}

template <int R, int P, bool Prefetch>
static void tile(const float* x, int64_t ldx, const float* panel, int64_t panel_stride,
                 int64_t k_len, float* y, int64_t ldy, bool accumulate) {
  __m256 lo[R][P], hi[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      lo[r][p] = accumulate ? _mm256_loadu_ps(y + r * ldy + p * kPanel) : _mm256_setzero_ps();
      hi[r][p] = accumulate ? _mm256_loadu_ps(y + r * ldy + p * kPanel + 8) : _mm256_setzero_ps();
    }
  for (int64_t k = 0; k < k_len; ++k) {
    if (Prefetch)
      _mm_prefetch(reinterpret_cast<const char*>(panel + (k + kPrefetch) * kPanel), _MM_HINT_T0);
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      __m256 w_lo = _mm256_loadu_ps(panel + p * panel_stride + k * kPanel);
      __m256 w_hi = _mm256_loadu_ps(panel + p * panel_stride + k * kPanel + 8);
      // Without this GCC folds the two loads into every FMA: 2R + R loads per 2R FMAs, which
      // made the load ports, not the FMAs, the limit (4 rows: 11 -> 8.5 ms in cache).
      if (R > 1) __asm__("" : "+x"(w_lo), "+x"(w_hi));
      fma_rows<R, P>(lo, hi, p, x + k, ldx, w_lo, w_hi);
    }
  }
  store_tile<R, P>(lo, hi, y, ldy);
}

// tile() over P compact panels of format F (`panel_stride` bytes apart) for a whole k range
// (k_len a multiple of 32): the same FMAs in the same order on the same weight values.
template <typename F, int R, int P>
static void block_tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t panel_stride,
                       int64_t k_len, float* y, int64_t ldy) {
  __m256 lo[R][P], hi[R][P];
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) lo[r][p] = hi[r][p] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < k_len; k0 += gemv_blocks::kSteps) {
    const uint8_t* block = panel + (k0 / gemv_blocks::kSteps) * F::kBlockBytes;
    for (int64_t kk = 0; kk < gemv_blocks::kSteps; ++kk) {
#pragma GCC unroll 8
      for (int p = 0; p < P; ++p) {
        __m256 w_lo, w_hi;
        F::expand(block + p * panel_stride, kk, w_lo, w_hi);
        fma_rows<R, P>(lo, hi, p, x + k0 + kk, ldx, w_lo, w_hi);
      }
    }
  }
  store_tile<R, P>(lo, hi, y, ldy);
}

// R rows against half of one compact panel (its 8 columns `half`), the whole k range. With
// one accumulator a row, up to 12 rows rebuild each weight once; a 16-column tile holds at most
// 6 rows, so more rows rebuild it once per row group. Same FMAs, same order. It pays where
// rebuilding is cheap, for Q8_0 (the lm_head, 49152 x 576, M = 8: 5.50 -> 4.27 ms); for
// Q4_1, whose half-panels each unpack the shared nibbles again, it measured no faster.
template <typename F, int R>
static void block_half_tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t k_len,
                            int half, float* y, int64_t ldy) {
  __m256 acc[R];
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < k_len; k0 += gemv_blocks::kSteps) {
    const uint8_t* block = panel + (k0 / gemv_blocks::kSteps) * F::kBlockBytes;
    for (int64_t kk = 0; kk < gemv_blocks::kSteps; ++kk) {
      const __m256 w = F::expand_half(block, kk, half);
#pragma GCC unroll 16
      for (int r = 0; r < R; ++r)
        acc[r] = _mm256_fmadd_ps(_mm256_broadcast_ss(x + r * ldx + k0 + kk), w, acc[r]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + r * ldy + 8 * half, acc[r]);
}

#else
template <int R, int P, bool Prefetch>
static void tile(const float* x, int64_t ldx, const float* panel, int64_t panel_stride,
                 int64_t k_len, float* y, int64_t ldy, bool accumulate) {
  for (int p = 0; p < P; ++p) {
    const float* w = panel + p * panel_stride;
    float acc[R][kPanel];
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kPanel; ++c)
        acc[r][c] = accumulate ? y[r * ldy + p * kPanel + c] : 0.f;
    for (int64_t k = 0; k < k_len; ++k)
      for (int r = 0; r < R; ++r)
        for (int64_t c = 0; c < kPanel; ++c) acc[r][c] += x[r * ldx + k] * w[k * kPanel + c];
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kPanel; ++c) y[r * ldy + p * kPanel + c] = acc[r][c];
  }
}
#endif

using gemv_rows::with_rows_in;

template <typename Fn>
static void with_rows(int64_t rows, Fn&& fn) {
  with_rows_in<1, kMaxRows>(rows, fn);
}

// Panels side by side in a tile of R rows, so that it has enough independent accumulators to
// hide the FMA latency (one row against one panel has two).
constexpr int side_panels(int rows) { return rows == 1 ? 4 : rows <= 3 ? 2 : 1; }

template <bool Prefetch>
static void row_tile(int64_t rows, const float* x, int64_t ldx, const float* panel,
                     int64_t k_len, float* y, int64_t ldy, bool accumulate) {
  with_rows(rows, [&]<int R>() {
    tile<R, 1, Prefetch>(x, ldx, panel, 0, k_len, y, ldy, accumulate);
  });
}

// m <= 6 rows (one row group) against `count` panels, each read once in one pass, plainly:
// blocking and software prefetch made the memory-bound M = 1 step 10-20% slower. A tile of
// few rows spans several panels (side_panels): at M = 1, four panels side by side made the 30
// layers' linears 17-21% faster with the weights streamed from memory.
template <int R>
static void one_row_group(const float* x, int64_t k_total, const float* panels, int64_t count,
                          float* y, int64_t ldy) {
  constexpr int kSide = side_panels(R);
  const int64_t stride = k_total * kPanel;
  int64_t p = 0;
  for (; p + kSide <= count; p += kSide)
    tile<R, kSide, false>(x, k_total, panels + p * stride, stride, k_total, y + p * kPanel, ldy,
                          false);
  for (; p < count; ++p)
    tile<R, 1, false>(x, k_total, panels + p * stride, stride, k_total, y + p * kPanel, ldy,
                      false);
}

#if defined(__AVX2__) && defined(__FMA__)
template <typename F, int R>
static void block_row_group(const float* x, int64_t k_total, const uint8_t* panels,
                            int64_t count, float* y, int64_t ldy) {
  constexpr int kSide = side_panels(R);
  const int64_t stride = k_total / gemv_blocks::kSteps * F::kBlockBytes;
  int64_t p = 0;
  for (; p + kSide <= count; p += kSide)
    block_tile<F, R, kSide>(x, k_total, panels + p * stride, stride, k_total, y + p * kPanel, ldy);
  for (; p < count; ++p)
    block_tile<F, R, 1>(x, k_total, panels + p * stride, stride, k_total, y + p * kPanel, ldy);
}

template <typename F>
static void block_row_group(int64_t m, const float* x, int64_t k_total, const uint8_t* panels,
                            int64_t count, float* y, int64_t ldy) {
  with_rows(m, [&]<int R>() { block_row_group<F, R>(x, k_total, panels, count, y, ldy); });
}

// ---- One row of compact panels in the factored form (as gemv_avx512.h's factored_tile) ----
// y = sum over blocks of d (q . x) + m sum(x) (Q8_0: no m term): the levels convert to floats
// and meet x directly, and each block's scales come in once, where block_tile rebuilds every
// weight (a multiply and an add a step and panel more). Each lane does what the AVX-512 tile
// does for its column, in the same order, and the block sums are added as
// _mm512_reduce_add_ps adds them, so both builds give the same bits. One row only: the
// decode of a lone request, where the rebuild bound the AVX2 tiles (SmolLM2's 120 layer
// linears, AVX2 builds of both called in turn on this 2-core Xeon: 1.17-1.22x).
// (More rows would need more registers than AVX2's 16.)

// x[0, 32) summed as gemv_avx512.h's factored_linear sums it (_mm512_reduce_add_ps of x[0, 16)
// + x[16, 32): halves, then quarters, then pairs).
inline float block_sum(const float* x) {
  const __m256 lo = _mm256_add_ps(_mm256_loadu_ps(x), _mm256_loadu_ps(x + 16));
  const __m256 hi = _mm256_add_ps(_mm256_loadu_ps(x + 8), _mm256_loadu_ps(x + 24));
  const __m256 eight = _mm256_add_ps(hi, lo);
  const __m128 four = _mm_add_ps(_mm256_extractf128_ps(eight, 1), _mm256_castps256_ps128(eight));
  const __m128 two = _mm_add_ps(four, _mm_shuffle_ps(four, four, _MM_SHUFFLE(1, 0, 3, 2)));
  return _mm_cvtss_f32(_mm_add_ps(two, _mm_shuffle_ps(two, two, _MM_SHUFFLE(2, 3, 0, 1))));
}

// Panels side by side for one row: 4 P accumulators, two levels and a broadcast in 16.
constexpr int kFactoredSide = 3;

// y[16 P] = x[k_len] @ P compact panels of format F, factored; sums[b]: x's sum over block b.
template <typename F, int P>
static void factored_row_tile(const float* x, const float* sums, int64_t blocks,
                              const uint8_t* panel, int64_t panel_stride, float* y) {
  __m256 lo[P], hi[P];
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) lo[p] = hi[p] = _mm256_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * F::kBlockBytes;
    __m256 part_lo[P], part_hi[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) part_lo[p] = part_hi[p] = _mm256_setzero_ps();
#pragma GCC unroll 8
    for (int64_t kk = 0; kk < gemv_blocks::kSteps; ++kk) {
      const __m256 xv = _mm256_broadcast_ss(x + b * gemv_blocks::kSteps + kk);
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p) {
        __m256 level_lo, level_hi;
        F::levels8(block + p * panel_stride, kk, level_lo, level_hi);
        part_lo[p] = _mm256_fmadd_ps(xv, level_lo, part_lo[p]);
        part_hi[p] = _mm256_fmadd_ps(xv, level_hi, part_hi[p]);
      }
    }
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const uint8_t* scales = block + p * panel_stride;
      lo[p] = _mm256_fmadd_ps(part_lo[p], F::scales8(scales, 0, 0), lo[p]);
      hi[p] = _mm256_fmadd_ps(part_hi[p], F::scales8(scales, 0, 1), hi[p]);
      if constexpr (F::kHasMins) {
        const __m256 sum = _mm256_set1_ps(sums[b]);
        lo[p] = _mm256_fmadd_ps(sum, F::scales8(scales, 1, 0), lo[p]);
        hi[p] = _mm256_fmadd_ps(sum, F::scales8(scales, 1, 1), hi[p]);
      }
    }
  }
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p) {
    _mm256_storeu_ps(y + p * kPanel, lo[p]);
    _mm256_storeu_ps(y + p * kPanel + 8, hi[p]);
  }
}

// y[16 panels] = x[k_len] @ compact panels of format F, one row, factored.
template <typename F>
static void factored_row(const float* x, int64_t k_len, const uint8_t* wp, int64_t panels,
                         float* y) {
  const int64_t blocks = k_len / gemv_blocks::kSteps;
  thread_local std::vector<float> kept;   // the caller's; the threads read it by pointer
  kept.resize(blocks);
  float* sums = kept.data();
  for (int64_t b = 0; b < blocks; ++b) sums[b] = block_sum(x + b * gemv_blocks::kSteps);
  const int64_t stride = blocks * F::kBlockBytes;
  const int64_t chunk = tokenmill_parallel::chunk_for(panels, kFactoredSide);
  tokenmill_parallel::parallel_chunks(panels, chunk, [&](int64_t begin, int64_t end) {
    int64_t p = begin;
    for (; p + kFactoredSide <= end; p += kFactoredSide)
      factored_row_tile<F, kFactoredSide>(x, sums, blocks, wp + p * stride, stride,
                                          y + p * kPanel);
    for (; p < end; ++p)
      factored_row_tile<F, 1>(x, sums, blocks, wp + p * stride, stride, y + p * kPanel);
  });
}

// m rows (kMaxRows < m <= kHalfMaxRows) against `count` compact panels in half-panel tiles.
template <typename F>
static void block_half_panels(int64_t m, const float* x, int64_t k_len, const uint8_t* panels,
                              int64_t stride, int64_t count, float* y, int64_t ldy) {
  with_rows_in<kMaxRows + 1, kHalfMaxRows>(m, [&]<int R>() {
    for (int64_t p = 0; p < count; ++p)
      for (int half = 0; half < 2; ++half)
        block_half_tile<F, R>(x, k_len, panels + p * stride, k_len, half, y + p * kPanel, ldy);
  });
}
#endif

static void one_row_group(int64_t m, const float* x, int64_t k_total, const float* panels,
                          int64_t count, float* y, int64_t ldy) {
  with_rows(m, [&]<int R>() { one_row_group<R>(x, k_total, panels, count, y, ldy); });
}

// m > 6 rows against one panel, in RowGroups.
static void panel_rows(int64_t m, const float* x, int64_t k_total, const float* panel, float* y,
                       int64_t ldy) {
  const gemv_rows::RowGroups groups(m, kMaxRows);
  const int64_t block = groups.count <= kShortBlockGroups ? kShortBlockK : kLongBlockK;
  for (int64_t k0 = 0; k0 < k_total; k0 += block) {
    const int64_t k_len = std::min(block, k_total - k0);
    int64_t row = 0;
    for (int64_t g = 0; g < groups.count; ++g) {
      const int64_t rows = groups.size(g);
      row_tile<true>(rows, x + row * k_total + k0, k_total, panel + k0 * kPanel, k_len,
                     y + row * ldy, ldy, k0 > 0);
      row += rows;
    }
  }
}

// Compact panels: rows in RowGroups (as panel_rows), each group's tiles rebuilding
// the weights in registers from the whole panel, which stays in L2 for the next group; Q8_0
// panels take 7-12 rows in half-panel tiles instead, rebuilding each weight once. Meant for
// few rows: from about 12 rows the fp32 panels, bound by the FMAs, are as fast.
template <typename F>
static void block_gemv(int64_t m, const float* x, int64_t k_len, const uint8_t* wp,
                       int64_t panels, float* y, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  const int64_t stride = k_len / gemv_blocks::kSteps * F::kBlockBytes;
  const gemv_rows::RowGroups groups(m, kMaxRows);
  const int64_t chunk = tokenmill_parallel::chunk_for(panels, side_panels(groups.size(0)));
  tokenmill_parallel::parallel_chunks(panels, chunk, [&](int64_t begin, int64_t end) {
    if (groups.count == 1) {
      block_row_group<F>(m, x, k_len, wp + begin * stride, end - begin, y + begin * kPanel, n);
      return;
    }
    if constexpr (F::kHalfTiles) {
      if (m <= kHalfMaxRows) {
        block_half_panels<F>(m, x, k_len, wp + begin * stride, stride, end - begin,
                             y + begin * kPanel, n);
        return;
      }
    }
    for (int64_t p = begin; p < end; ++p) {
      int64_t row = 0;
      for (int64_t g = 0; g < groups.count; ++g) {
        const int64_t rows = groups.size(g);
        block_row_group<F>(rows, x + row * k_len, k_len, wp + p * stride, 1,
                           y + row * n + p * kPanel, n);
        row += rows;
      }
    }
  });
#else
  TORCH_CHECK(false, "gemv_linear: compact panels need AVX2");
#endif
}

template <typename F>
static bool matches(const torch::Tensor& packed, int64_t k_len) {
  return packed.dim() == 2 && packed.is_contiguous() && k_len % gemv_blocks::kSteps == 0 &&
         packed.size(1) == k_len / gemv_blocks::kSteps * F::kBlockBytes;
}

// Which tiles gemv_linear takes: the AVX-512 ones (layers/gemv_avx512.h) where the build has
// them, else the AVX2 ones above. Both give bitwise the same output; tests switch between them.
static std::atomic<bool> use_avx512{gemv_avx512::kAvailable};

bool gemv_use_avx512(bool on) {
  use_avx512 = on && gemv_avx512::kAvailable;
  return use_avx512;
}

// Whether compact panels take the factored form rather than rebuilding the fp32 weights: the
// AVX-512 route for up to 6 rows (gemv_avx512.h), the AVX2 one for one row (factored_row);
// tests switch it off to compare.
#if defined(__AVX2__) && defined(__FMA__)
constexpr bool kFactoredAvailable = true;
#else
constexpr bool kFactoredAvailable = false;
#endif
static std::atomic<bool> use_factored{kFactoredAvailable};

bool gemv_use_factored(bool on) {
  use_factored = on && kFactoredAvailable;
  return use_factored;
}

// The longest step the route in use takes in the factored form (0: none), for tests.
int64_t gemv_factored_max_rows() {
  if (!use_factored) return 0;
#if defined(__AVX512F__)
  if (use_avx512) return gemv_avx512::factored_max_rows();
#endif
  return 1;
}

#if defined(__AVX512F__)
template <typename F>
static void compact_linear(int64_t m, const float* x, int64_t k_len, const torch::Tensor& packed,
                           float* y, int64_t n) {
  const auto* wp = static_cast<const uint8_t*>(packed.data_ptr());
  if (use_factored && m <= gemv_avx512::factored_max_rows())
    return gemv_avx512::factored_linear<F>(m, x, k_len, wp, packed.size(0), y, n);
  gemv_avx512::block_linear<F>(m, x, k_len, wp, packed.size(0), y, n);
}
#endif

static void avx512_linear(int64_t m, const float* x, int64_t k_len, const torch::Tensor& packed,
                          float* y, int64_t n) {
#if defined(__AVX512F__)
  const int64_t panels = packed.size(0);
  switch (packed.scalar_type()) {
    case torch::kUInt8:
      return compact_linear<gemv_blocks::Q4_1>(m, x, k_len, packed, y, n);
    case torch::kInt8:
      return compact_linear<gemv_blocks::Q8_0>(m, x, k_len, packed, y, n);
    default:
      return gemv_avx512::linear(m, x, k_len, packed.data_ptr<float>(), panels, y, n);
  }
#endif
}

// The width of the output rows of a packed weight (compact or fp32 panels).
int64_t gemv_out_features(const torch::Tensor& packed) { return packed.size(0) * kPanel; }

// y[m, out_features] = x[m, k_len] @ W^T, both dense rows, W packed by pack_gemv_*.
void gemv_into(const float* xp, int64_t m, int64_t k_len, const torch::Tensor& packed, float* yp) {
  const int64_t panels = packed.size(0), n = panels * kPanel;
  const auto kind = packed.scalar_type();   // uint8: Q4_1 panels, int8: Q8_0, float: fp32
  if (kind == torch::kUInt8 || kind == torch::kInt8) {
    TORCH_CHECK(kind == torch::kUInt8 ? matches<gemv_blocks::Q4_1>(packed, k_len)
                                      : matches<gemv_blocks::Q8_0>(packed, k_len),
                "gemv_linear: compact panels do not match x");
  } else {
    TORCH_CHECK(packed.dim() == 3 && packed.size(1) == k_len && packed.size(2) == kPanel,
                "gemv_linear: packed weight does not match x");
  }
  if (m == 0) return;
  if (k_len == 0) return std::fill(yp, yp + m * n, 0.0f);
  if (use_avx512) return avx512_linear(m, xp, k_len, packed, yp, n);
  if (kind == torch::kUInt8 || kind == torch::kInt8) {
    const auto* wp = static_cast<const uint8_t*>(packed.data_ptr());
#if defined(__AVX2__) && defined(__FMA__)
    if (use_factored && m == 1)
      return kind == torch::kUInt8 ? factored_row<gemv_blocks::Q4_1>(xp, k_len, wp, panels, yp)
                                   : factored_row<gemv_blocks::Q8_0>(xp, k_len, wp, panels, yp);
#endif
    if (kind == torch::kUInt8)
      block_gemv<gemv_blocks::Q4_1>(m, xp, k_len, wp, panels, yp, n);
    else
      block_gemv<gemv_blocks::Q8_0>(m, xp, k_len, wp, panels, yp, n);
    return;
  }
  const float* wp = packed.data_ptr<float>();
  const int64_t unit = m <= kMaxRows ? side_panels(m) : 1;
  const int64_t chunk = tokenmill_parallel::chunk_for(panels, unit);
  tokenmill_parallel::parallel_chunks(panels, chunk, [&](int64_t begin, int64_t end) {
    if (m <= kMaxRows) {
      one_row_group(m, xp, k_len, wp + begin * k_len * kPanel, end - begin, yp + begin * kPanel, n);
      return;
    }
    for (int64_t p = begin; p < end; ++p)
      panel_rows(m, xp, k_len, wp + p * k_len * kPanel, yp + p * kPanel, n);
  });
}

torch::Tensor gemv_linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "gemv_linear: x must be contiguous 2-D float32");
  auto y = torch::empty({x.size(0), gemv_out_features(packed)}, x.options());
  gemv_into(x.data_ptr<float>(), x.size(0), x.size(1), packed, y.data_ptr<float>());
  return y;
}

// Rows `ids` of the weight that compact panels hold ([n] -> [n, K]), rebuilt as the fp32
// values the packer checked: a tied lm_head's panels serve as the token embedding table. One
// row reads its panel's blocks (16 rows' worth), but those stay warm from the lm_head's reads
// every step, where rows of a separate fp32 table sit cold (layers/embedding.py).
template <typename F>
static void compact_rows(const uint8_t* panels, int64_t blocks, const int64_t* ids, int64_t n,
                         float* out) {
  const int64_t k = blocks * gemv_blocks::kSteps;
  at::parallel_for(0, n, 64, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const uint8_t* block = panels + ids[t] / kPanel * blocks * F::kBlockBytes;
      const int64_t col = ids[t] % kPanel;
      float* row = out + t * k;
      for (int64_t b = 0; b < blocks; ++b, block += F::kBlockBytes)
        for (int64_t i = 0; i < gemv_blocks::kSteps; ++i)
          row[b * gemv_blocks::kSteps + i] = F::weight(block, col, i);
    }
  });
}

torch::Tensor compact_panel_rows(torch::Tensor packed, torch::Tensor ids) {
  const auto kind = packed.scalar_type();
  TORCH_CHECK((kind == torch::kUInt8 || kind == torch::kInt8) && packed.dim() == 2 &&
              packed.is_contiguous(), "compact_panel_rows: compact (Q4_1 or Q8_0) panels");
  TORCH_CHECK(ids.scalar_type() == torch::kInt64, "compact_panel_rows: int64 ids");
  const auto flat = ids.contiguous().view(-1);
  const int64_t n = flat.numel(), rows = gemv_out_features(packed);
  const int64_t block_bytes = kind == torch::kUInt8 ? gemv_blocks::Q4_1::kBlockBytes
                                                    : gemv_blocks::Q8_0::kBlockBytes;
  TORCH_CHECK(packed.size(1) % block_bytes == 0, "compact_panel_rows: not whole blocks");
  const int64_t blocks = packed.size(1) / block_bytes;
  const int64_t* id = flat.data_ptr<int64_t>();
  for (int64_t t = 0; t < n; ++t)
    TORCH_CHECK(id[t] >= 0 && id[t] < rows, "compact_panel_rows: id ", id[t],
                " out of range [0, ", rows, ")");
  auto sizes = ids.sizes().vec();
  sizes.push_back(blocks * gemv_blocks::kSteps);
  auto out = torch::empty(sizes, torch::kFloat32);
  const auto* panels = static_cast<const uint8_t*>(packed.data_ptr());
  if (kind == torch::kUInt8)
    compact_rows<gemv_blocks::Q4_1>(panels, blocks, id, n, out.data_ptr<float>());
  else
    compact_rows<gemv_blocks::Q8_0>(panels, blocks, id, n, out.data_ptr<float>());
  return out;
}

// For the C++ layer loop (kernels/entry_points.h).
std::vector<pybind11::capsule> entry_points() {
  using namespace tokenmill_entry;
  return {export_entry<GemvIntoFn>(&gemv_into, "tokenmill.gemv_into"),
          export_entry<GemvOutFeaturesFn>(&gemv_out_features, "tokenmill.gemv_out_features")};
}
