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
// GEMM up to M = 256 on SmolLM2's shapes. Threads split the panels.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <algorithm>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

constexpr int64_t kPanel = 16;     // output columns per panel
constexpr int64_t kMaxRows = 6;    // rows of x per register tile
constexpr int64_t kShortBlockK = 64;      // k steps per pass over a panel slice...
constexpr int64_t kShortBlockGroups = 6;  // ...for up to this many row groups
constexpr int64_t kLongBlockK = 256;      // k steps per pass for more row groups
constexpr int64_t kPrefetch = 32;  // k steps ahead to prefetch the panel (2 KB)

torch::Tensor pack_gemv_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32,
              "pack_gemv_weight: a 2-D float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kPanel == 0, "pack_gemv_weight: out_features must be a multiple of 16");
  return weight.contiguous().view({n / kPanel, kPanel, k}).transpose(1, 2).contiguous();
}

// y[R, 16 P] (+)= x[R, k_len] @ P panels [k_len, 16] (`panel_stride` floats apart). Each output
// sums its k steps in order, one FMA each, whatever R and P: a row's result does not depend on
// the rows beside it. The r and p loops are unrolled by pragma: without it GCC keeps the
// accumulator arrays in memory and stores all of them every k step (a third of the FMA rate).
#if defined(__AVX2__) && defined(__FMA__)
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
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
        lo[r][p] = _mm256_fmadd_ps(xv, w_lo, lo[r][p]);
        hi[r][p] = _mm256_fmadd_ps(xv, w_hi, hi[r][p]);
      }
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int p = 0; p < P; ++p) {
      _mm256_storeu_ps(y + r * ldy + p * kPanel, lo[r][p]);
      _mm256_storeu_ps(y + r * ldy + p * kPanel + 8, hi[r][p]);
    }
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

template <bool Prefetch>
static void row_tile(int64_t rows, const float* x, int64_t ldx, const float* panel,
                     int64_t k_len, float* y, int64_t ldy, bool accumulate) {
  switch (rows) {
    case 6: tile<6, 1, Prefetch>(x, ldx, panel, 0, k_len, y, ldy, accumulate); break;
    case 5: tile<5, 1, Prefetch>(x, ldx, panel, 0, k_len, y, ldy, accumulate); break;
    case 4: tile<4, 1, Prefetch>(x, ldx, panel, 0, k_len, y, ldy, accumulate); break;
    case 3: tile<3, 1, Prefetch>(x, ldx, panel, 0, k_len, y, ldy, accumulate); break;
    case 2: tile<2, 1, Prefetch>(x, ldx, panel, 0, k_len, y, ldy, accumulate); break;
    default: tile<1, 1, Prefetch>(x, ldx, panel, 0, k_len, y, ldy, accumulate); break;
  }
}

// m <= 6 rows (one row group) against `count` panels, each read once in one pass, plainly:
// blocking and software prefetch made the memory-bound M = 1 step 10-20% slower. A tile of
// few rows spans several panels, so that it has enough independent accumulators to hide the
// FMA latency (one row against one panel has two): at M = 1, four panels side by side made
// the 30 layers' linears 17-21% faster with the weights streamed from memory.
template <int R>
static void one_row_group(const float* x, int64_t k_total, const float* panels, int64_t count,
                          float* y, int64_t ldy) {
  constexpr int kSide = R == 1 ? 4 : R <= 3 ? 2 : 1;   // panels per tile
  const int64_t stride = k_total * kPanel;
  int64_t p = 0;
  for (; p + kSide <= count; p += kSide)
    tile<R, kSide, false>(x, k_total, panels + p * stride, stride, k_total, y + p * kPanel, ldy,
                          false);
  for (; p < count; ++p)
    tile<R, 1, false>(x, k_total, panels + p * stride, stride, k_total, y + p * kPanel, ldy,
                      false);
}

static void one_row_group(int64_t m, const float* x, int64_t k_total, const float* panels,
                          int64_t count, float* y, int64_t ldy) {
  switch (m) {
    case 6: one_row_group<6>(x, k_total, panels, count, y, ldy); break;
    case 5: one_row_group<5>(x, k_total, panels, count, y, ldy); break;
    case 4: one_row_group<4>(x, k_total, panels, count, y, ldy); break;
    case 3: one_row_group<3>(x, k_total, panels, count, y, ldy); break;
    case 2: one_row_group<2>(x, k_total, panels, count, y, ldy); break;
    default: one_row_group<1>(x, k_total, panels, count, y, ldy); break;
  }
}

// m > 6 rows against one panel. Rows are split into groups of equal size (8 rows: 4 + 4, not
// 6 + 2), since a tile of few rows has too few accumulators to hide the FMA latency.
static void panel_rows(int64_t m, const float* x, int64_t k_total, const float* panel, float* y,
                       int64_t ldy) {
  const int64_t groups = (m + kMaxRows - 1) / kMaxRows;
  const int64_t base = m / groups, extra = m % groups;
  const int64_t block = groups <= kShortBlockGroups ? kShortBlockK : kLongBlockK;
  for (int64_t k0 = 0; k0 < k_total; k0 += block) {
    const int64_t k_len = std::min(block, k_total - k0);
    int64_t row = 0;
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t rows = base + (g < extra ? 1 : 0);
      row_tile<true>(rows, x + row * k_total + k0, k_total, panel + k0 * kPanel, k_len,
                     y + row * ldy, ldy, k0 > 0);
      row += rows;
    }
  }
}

torch::Tensor gemv_linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "gemv_linear: x must be contiguous 2-D float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == kPanel,
              "gemv_linear: packed weight does not match x");
  const int64_t m = x.size(0), k_len = x.size(1), panels = packed.size(0), n = panels * kPanel;
  auto y = torch::empty({m, n}, x.options());
  if (m == 0 || k_len == 0) return y.zero_();
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    if (m <= kMaxRows) {
      one_row_group(m, xp, k_len, wp + begin * k_len * kPanel, end - begin, yp + begin * kPanel, n);
      return;
    }
    for (int64_t p = begin; p < end; ++p)
      panel_rows(m, xp, k_len, wp + p * k_len * kPanel, yp + p * kPanel, n);
  });
  return y;
}

// For the C++ decode loop (kernels/entry_points.h).
std::vector<pybind11::capsule> entry_points() {
  using namespace tokenmill_entry;
  return {export_entry<GemvLinearFn>(&gemv_linear, "tokenmill.gemv_linear")};
}
