// Fused elementwise ops for CPU fp32: the residual add + RMSNorm pair, the rotary embedding and
// the gated MLP activation SiLU(gate) * up; and the greedy pick of a token a row (argmax_rows).
//
// In torch each is a chain of small ops (RMSNorm on CPU: add, pow, mean, add, rsqrt, mul, mul;
// rotary: two slices, neg, cat, two muls, add; SiLU·mul: chunk, silu, mul), every one a dispatch
// and a pass over memory.
// At decode sizes the dispatch cost dominates: about 20 ops per layer, several milliseconds per
// token for a 30-layer model. Here each is one pass. Built with -ffp-contract=off so the rotary
// rounds exactly like the torch ops it replaces; the norm's sum of squares is reduced in another
// order than torch's, and SiLU's exp is our own polynomial (relative error ~1e-7), differences
// at the level of float rounding. Each op has a raw-row form (`*_into`) that the C++ decode
// loop calls on its workspace; the tensor form allocates the output and wraps it.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>
#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace {

// rows per parallel chunk: enough work (~32k floats) that waking a second thread pays
int64_t row_grain(int64_t row_len) { return std::max<int64_t>(1, 32768 / row_len); }

// elements per chunk of SiLU·mul, split by elements: an 8-row step (12k outputs) takes both
// threads, which read the gate_up rows both just wrote (1.0-1.4% off an 8-row decode step)
constexpr int64_t kSiluGrain = 4096;

#if defined(__AVX2__)
using tokenmill_avx2::exp_ps;
#if defined(__AVX512F__)
using tokenmill_avx2::exp_ps16;
#endif
using tokenmill_avx2::hsum;
#endif

// s = x (+ residual), stored to `sum` when given; out = s * rsqrt(mean(s^2) + eps) * weight
void norm_row(const float* x, const float* residual, const float* weight, float eps, int64_t n,
              float* out, float* sum) {
  int64_t d = 0;
  float squares = 0.f;
#if defined(__AVX2__)
  __m256 acc = _mm256_setzero_ps();
  for (; d + 8 <= n; d += 8) {
    __m256 v = _mm256_loadu_ps(x + d);
    if (residual) v = _mm256_add_ps(v, _mm256_loadu_ps(residual + d));
    if (sum) _mm256_storeu_ps(sum + d, v);
    acc = _mm256_add_ps(acc, _mm256_mul_ps(v, v));
  }
  squares = hsum(acc);
#endif
  for (; d < n; ++d) {
    const float v = residual ? x[d] + residual[d] : x[d];
    if (sum) sum[d] = v;
    squares += v * v;
  }
  const float inv = 1.f / std::sqrt(squares / static_cast<float>(n) + eps);
  const float* s = sum ? sum : x;
  d = 0;
#if defined(__AVX2__)
  const __m256 inv8 = _mm256_set1_ps(inv);
  for (; d + 8 <= n; d += 8)
    _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(s + d), inv8),
                                            _mm256_loadu_ps(weight + d)));
#endif
  for (; d < n; ++d) out[d] = (s[d] * inv) * weight[d];
}

// out[d] = silu(gate[d]) * up[d] = gate * up / (1 + e^-gate)
void silu_mul_row(const float* gate, const float* up, int64_t n, float* out) {
  int64_t d = 0;
#if defined(__AVX512F__)
  const __m512 one16 = _mm512_set1_ps(1.0f);
  for (; d + 16 <= n; d += 16) {   // exp_ps16 is exp_ps lane for lane: the same results
    const __m512 g = _mm512_loadu_ps(gate + d);
    const __m512 denom = _mm512_add_ps(one16, exp_ps16(_mm512_sub_ps(_mm512_setzero_ps(), g)));
    _mm512_storeu_ps(out + d, _mm512_mul_ps(_mm512_div_ps(g, denom), _mm512_loadu_ps(up + d)));
  }
#endif
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; d + 8 <= n; d += 8) {
    const __m256 g = _mm256_loadu_ps(gate + d);
    const __m256 denom = _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), g)));
    _mm256_storeu_ps(out + d, _mm256_mul_ps(_mm256_div_ps(g, denom), _mm256_loadu_ps(up + d)));
  }
#endif
  for (; d < n; ++d) out[d] = gate[d] / (1.0f + std::exp(-gate[d])) * up[d];
}

void check_rows(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.dim() == 2 && t.is_contiguous() && t.scalar_type() == torch::kFloat32,
              what, " must be contiguous 2-D float32");
}

}  // namespace

// out = rms_norm(s) * weight with s = x (+ residual), written to `sum` when given (it may be
// `residual` itself: each element is read before it is written); rows of n floats.
void add_rms_norm_into(const float* x, const float* residual, const float* weight, float eps,
                       int64_t rows, int64_t n, float* out, float* sum) {
  at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_row(x + r * n, residual ? residual + r * n : nullptr, weight, eps, n, out + r * n,
               sum ? sum + r * n : nullptr);
    }
  });
}

// (normed, sum) with sum = x + residual; an empty residual means none (sum is then x).
std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual,
                                        torch::Tensor weight, double eps) {
  check_rows(x, "add_rms_norm: x");
  const bool has_residual = residual.numel() > 0;
  if (has_residual) {
    check_rows(residual, "add_rms_norm: residual");
    TORCH_CHECK(residual.sizes() == x.sizes(), "add_rms_norm: residual shape != x shape");
  }
  const int64_t rows = x.size(0), n = x.size(1);
  TORCH_CHECK(weight.numel() == n && weight.is_contiguous() &&
              weight.scalar_type() == torch::kFloat32, "add_rms_norm: weight must be [hidden]");
  auto out = torch::empty_like(x);
  auto sum = has_residual ? torch::empty_like(x) : x;
  add_rms_norm_into(x.data_ptr<float>(), has_residual ? residual.data_ptr<float>() : nullptr,
                    weight.data_ptr<float>(), static_cast<float>(eps), rows, n,
                    out.data_ptr<float>(), has_residual ? sum.data_ptr<float>() : nullptr);
  return {out, sum};
}

// One head's row: out = x * cos + cat(-x2, x1) * sin. Two loops over the halves with
// unaliased pointers, so the compiler vectorizes them (the single loop writing both halves
// stayed scalar); each element still takes two products and a sum, as the reference does.
inline void rotate_row(const float* __restrict x, const float* __restrict c,
                       const float* __restrict s, float* __restrict out, int64_t half) {
  for (int64_t d = 0; d < half; ++d) out[d] = x[d] * c[d] + (-x[d + half]) * s[d];
  for (int64_t d = half; d < 2 * half; ++d) out[d] = x[d] * c[d] + x[d - half] * s[d];
}

// Rotate-half rotary embedding of `heads` heads of `dim` per token (tokens `token_stride`
// floats apart, heads dense) with cos/sin [tokens, dim], into out [tokens, heads, dim]:
// x * cos + cat(-x2, x1) * sin.
void rotate_half_into(const float* x, int64_t tokens, int64_t heads, int64_t dim,
                      int64_t token_stride, const float* cos, const float* sin, float* out) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, row_grain(heads * dim), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = cos + t * dim;
      const float* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h)
        rotate_row(x + t * token_stride + h * dim, c, s, out + (t * heads + h) * dim, half);
    }
  });
}

// x [tokens, heads, dim] (dim contiguous, heads dense) with cos/sin [tokens, dim] -> a new
// contiguous [tokens, heads, dim] tensor (rotate_half_into).
torch::Tensor rotate_half(torch::Tensor x, torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1 &&
              x.stride(1) == x.size(2), "rotate_half: x must be float32 [tokens, heads, dim] "
              "with dense heads");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(dim % 2 == 0, "rotate_half: dim must be even");
  check_rows(cos, "rotate_half: cos");
  check_rows(sin, "rotate_half: sin");
  TORCH_CHECK(cos.size(0) == tokens && cos.size(1) == dim && sin.sizes() == cos.sizes(),
              "rotate_half: cos/sin must be [tokens, dim]");
  auto out = torch::empty({tokens, heads, dim}, x.options());
  rotate_half_into(x.data_ptr<float>(), tokens, heads, dim, x.stride(0), cos.data_ptr<float>(),
                   sin.data_ptr<float>(), out.data_ptr<float>());
  return out;
}

// Gated activation, gate_up rows [gate (n) | up (n)] -> out rows of n: silu(gate) * up.
void silu_and_mul_into(const float* gate_up, int64_t rows, int64_t n, float* out) {
  at::parallel_for(0, rows * n, kSiluGrain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin / n; r * n < end; ++r) {
      const int64_t first = std::max(begin - r * n, int64_t{0});
      const int64_t last = std::min(end - r * n, n);
      const float* gate = gate_up + r * 2 * n;
      silu_mul_row(gate + first, gate + n + first, last - first, out + r * n + first);
    }
  });
}

// gate_up [tokens, 2 * d] (gate | up) -> [tokens, d] = silu(gate) * up.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "silu_and_mul: gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "silu_and_mul: gate_up width must be even");
  const int64_t rows = gate_up.size(0), n = gate_up.size(1) / 2;
  auto out = torch::empty({rows, n}, gate_up.options());
  silu_and_mul_into(gate_up.data_ptr<float>(), rows, n, out.data_ptr<float>());
  return out;
}

// ---- Greedy picks: the first index of each row's maximum, NaN counting as the maximum ----
//
// torch.argmax's answer. The sampler's torch form (a chunked amax, an argmax, a gather, an
// argmax: sample/sampler.py) made four passes and dispatches over logits fresh from the
// lm_head's two threads. One scan here, each thread a piece of every row, the pieces merged in
// order. Real decode steps, the two picks in turn (medians): 16 rows 0.59 -> 0.29 ms, one row
// 0.21-0.26 -> 0.06-0.08 ms (8 us on warm logits: the rest is reading them from the core that
// wrote them).

namespace {

struct Pick {
  float value;
  int64_t index;   // -1: no NaN and nothing scanned yet
  bool nan;
};

// The first maximum (or first NaN) of x[begin, end): the max (four chains, each waited on
// max's latency alone), then the first lane equal to it, eight at a time.
Pick pick_in(const float* x, int64_t begin, int64_t end) {
  float best = -std::numeric_limits<float>::infinity();
  bool nan = false;
  int64_t i = begin;
#if defined(__AVX2__)
  __m256 m[4], unordered = _mm256_setzero_ps();
  for (auto& v : m) v = _mm256_set1_ps(best);
  for (; i + 32 <= end; i += 32)
    for (int u = 0; u < 4; ++u) {
      const __m256 v = _mm256_loadu_ps(x + i + 8 * u);
      unordered = _mm256_or_ps(unordered, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
      m[u] = _mm256_max_ps(m[u], v);
    }
  nan = _mm256_movemask_ps(unordered) != 0;
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3])));
  for (float lane : lanes) best = std::max(best, lane);
#endif
  for (; i < end; ++i) {
    if (std::isnan(x[i])) nan = true;
    else best = std::max(best, x[i]);
  }
  int64_t j = begin;
#if defined(__AVX2__)
  const __m256 target = _mm256_set1_ps(best);
  for (; j + 8 <= end; j += 8) {
    const __m256 v = _mm256_loadu_ps(x + j);
    const int hits = _mm256_movemask_ps(nan ? _mm256_cmp_ps(v, v, _CMP_UNORD_Q)
                                            : _mm256_cmp_ps(v, target, _CMP_EQ_OQ));
    if (hits != 0) {
      j += __builtin_ctz(hits);
      return {x[j], j, nan};
    }
  }
#endif
  for (; j < end; ++j)
    if (nan ? std::isnan(x[j]) : x[j] == best) return {x[j], j, nan};
  return {best, -1, false};   // an empty piece
}

}  // namespace

// logits [rows, vocab] float32 -> [rows] int64, exactly logits.argmax(dim=-1).
torch::Tensor argmax_rows(torch::Tensor logits) {
  check_rows(logits, "argmax_rows: logits");
  TORCH_CHECK(logits.size(1) > 0, "argmax_rows: logits need at least one column");
  const int64_t rows = logits.size(0), vocab = logits.size(1), stride = logits.stride(0);
  auto out = torch::empty({rows}, logits.options().dtype(torch::kInt64));
  // a piece per thread of each row: a lone row's 49,152 logits take two threads ~2x faster
  const int64_t pieces = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(),
                                                                 vocab / 4096));
  const int64_t piece = (vocab + pieces - 1) / pieces;
  std::vector<Pick> picks(rows * pieces);
  const float* x = logits.data_ptr<float>();
  at::parallel_for(0, rows * pieces, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / pieces, first = item % pieces * piece;
      picks[item] = pick_in(x + row * stride, first, std::min(vocab, first + piece));
    }
  });
  int64_t* ids = out.data_ptr<int64_t>();
  for (int64_t row = 0; row < rows; ++row) {
    Pick best = picks[row * pieces];
    for (int64_t p = 1; p < pieces && !best.nan; ++p) {
      const Pick& next = picks[row * pieces + p];
      if (next.index >= 0 && (next.nan || best.index < 0 || next.value > best.value))
        best = next;
    }
    ids[row] = best.index;
  }
  return out;
}

// For the C++ layer loop (kernels/entry_points.h).
std::vector<pybind11::capsule> entry_points() {
  using namespace tokenmill_entry;
  return {export_entry<AddRmsNormIntoFn>(&add_rms_norm_into, "tokenmill.add_rms_norm_into"),
          export_entry<RotateHalfIntoFn>(&rotate_half_into, "tokenmill.rotate_half_into"),
          export_entry<SiluAndMulIntoFn>(&silu_and_mul_into, "tokenmill.silu_and_mul_into")};
}
