// Small-M fp32 linear for CPU: y[M, N] = x[M, K] @ W[N, K]^T for the few-token steps of decoding.
//
// At M <= 8 the step is bound by streaming the weights from memory. oneDNN's packed GEMM read
// them at 15-18 GB/s there; this loop reaches the machine's ~25 GB/s. W is repacked once into
// [N/16, K, 16] panels, so each k step reads one 64-byte line of 16 output columns, and up to 6
// rows of x are accumulated in 12 AVX2 registers against it. Threads split the panels.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

constexpr int64_t kPanel = 16;   // output columns per panel
constexpr int64_t kMaxRows = 6;  // rows of x per register tile

torch::Tensor pack_gemv_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32,
              "pack_gemv_weight: a 2-D float32 weight");
  const int64_t n = weight.size(0), k = weight.size(1);
  TORCH_CHECK(n % kPanel == 0, "pack_gemv_weight: out_features must be a multiple of 16");
  return weight.contiguous().view({n / kPanel, kPanel, k}).transpose(1, 2).contiguous();
}

#if defined(__AVX2__) && defined(__FMA__)
template <int R>
static void tile(const float* x, int64_t ldx, const float* panel, int64_t k_len, float* y,
                 int64_t ldy) {
  __m256 lo[R], hi[R];
  for (int r = 0; r < R; ++r) { lo[r] = _mm256_setzero_ps(); hi[r] = _mm256_setzero_ps(); }
  for (int64_t k = 0; k < k_len; ++k) {
    const __m256 w_lo = _mm256_loadu_ps(panel + k * kPanel);
    const __m256 w_hi = _mm256_loadu_ps(panel + k * kPanel + 8);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_broadcast_ss(x + r * ldx + k);
      lo[r] = _mm256_fmadd_ps(xv, w_lo, lo[r]);
      hi[r] = _mm256_fmadd_ps(xv, w_hi, hi[r]);
    }
  }
  for (int r = 0; r < R; ++r) {
    _mm256_storeu_ps(y + r * ldy, lo[r]);
    _mm256_storeu_ps(y + r * ldy + 8, hi[r]);
  }
}
#else
template <int R>
static void tile(const float* x, int64_t ldx, const float* panel, int64_t k_len, float* y,
                 int64_t ldy) {
  float acc[R][kPanel] = {};
  for (int64_t k = 0; k < k_len; ++k)
    for (int r = 0; r < R; ++r)
      for (int64_t c = 0; c < kPanel; ++c) acc[r][c] += x[r * ldx + k] * panel[k * kPanel + c];
  for (int r = 0; r < R; ++r)
    for (int64_t c = 0; c < kPanel; ++c) y[r * ldy + c] = acc[r][c];
}
#endif

static void panel_rows(int64_t rows, const float* x, int64_t ldx, const float* panel,
                       int64_t k_len, float* y, int64_t ldy) {
  while (rows > 0) {
    const int64_t now = rows < kMaxRows ? rows : kMaxRows;
    switch (now) {
      case 6: tile<6>(x, ldx, panel, k_len, y, ldy); break;
      case 5: tile<5>(x, ldx, panel, k_len, y, ldy); break;
      case 4: tile<4>(x, ldx, panel, k_len, y, ldy); break;
      case 3: tile<3>(x, ldx, panel, k_len, y, ldy); break;
      case 2: tile<2>(x, ldx, panel, k_len, y, ldy); break;
      default: tile<1>(x, ldx, panel, k_len, y, ldy); break;
    }
    rows -= now; x += now * ldx; y += now * ldy;
  }
}

torch::Tensor gemv_linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32,
              "gemv_linear: x must be contiguous 2-D float32");
  TORCH_CHECK(packed.dim() == 3 && packed.size(1) == x.size(1) && packed.size(2) == kPanel,
              "gemv_linear: packed weight does not match x");
  const int64_t m = x.size(0), k_len = x.size(1), panels = packed.size(0), n = panels * kPanel;
  auto y = torch::empty({m, n}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p)
      panel_rows(m, xp, k_len, wp + p * k_len * kPanel, k_len, yp + p * kPanel, n);
  });
  return y;
}
