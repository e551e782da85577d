// AVX-512 tiles for the small-M linear (layers/cpu_gemv_kernel.cpp), used where the build has
// AVX-512F. A panel's 16 output columns fill one register, so a tile holds up to 12 rows
// against 2 panels (24 accumulators) where the AVX2 tiles hold 6 rows against one, and each
// FMA does twice the work. Every output still sums its k steps in order, one FMA each, over
// the same (rebuilt) weights: the result is bitwise that of the AVX2 tiles, whatever the rows
// beside it. The exception, by default: compact panels in steps of up to 6 rows (12 on AMD
// Zen 4 and 5), in the factored form (factored_linear, at the end).
//
// The plan is the AVX2 one: up to one row group (12 rows), one pass over the panels, several
// side by side; more rows go in equal groups over K blocks, the panels' slice staying in L1
// while every group passes over it. On Zen 4, compact panels of 13-40 rows take tall tiles
// instead (one panel, up to 24 rows: tall_linear). Threads take the panels in chunks
// (kernels/work_sharing.h).

#include <algorithm>
#include <vector>
#if defined(__AVX512F__)
#include <cpuid.h>
#include <immintrin.h>
#endif

namespace gemv_avx512 {

#if defined(__AVX512F__)
constexpr bool kAvailable = true;
constexpr int64_t kPanel = 16;            // output columns per panel: one register
constexpr int64_t kMaxRows = 12;          // rows of x per tile
constexpr int64_t kBlockK = 128;          // k steps per pass over the panels' slice
constexpr int64_t kSpreadGroups = 6;      // up to this many row groups prefetch the next slice
constexpr int64_t kPrefetch = 32;         // k steps ahead to prefetch a panel (2 KB)

using gemv_rows::with_rows_in;

// Panels side by side in a tile of R rows: enough independent accumulators to hide the FMA
// latency, all of them in registers (R * P + P + 1 of 32). Nine rows take three panels (31
// registers): 5-8% faster than two at M = 9, a decode step of 8 streams and one more request.
constexpr int side_panels(int64_t rows) { return rows <= 6 ? 4 : rows <= 9 ? 3 : 2; }

// m rows in groups of at most kMaxRows.
struct RowGroups : gemv_rows::RowGroups {
  explicit RowGroups(int64_t m) : gemv_rows::RowGroups(m, kMaxRows) {}
};

// The CPU's family if it is an AMD one. A Zen 4 core (family 19h, the only one of that family
// with AVX-512) runs a 512-bit FMA as two 256-bit halves, one a cycle where the Xeons do two,
// so routes that spend load-port work or registers to save vector operations (tall tiles,
// longer factored steps) pay there; Zen 5 (1Ah) does two, and keeps the longer factored steps
// only (factored_max_rows). Other CPUs keep the Xeons' routes.
inline int amd_family() {   // 0 on other vendors
  static const int family = [] {
    unsigned a, b, c, d;
    if (!__get_cpuid(0, &a, &b, &c, &d) || b != 0x68747541) return 0;   // "Auth"enticAMD
    if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
    return static_cast<int>(((a >> 8) & 0xf) + ((a >> 20) & 0xff));
  }();
  return family;
}

inline bool zen4_fma_rate() { return amd_family() == 0x19; }

// One k step of a tile: x[r][k] (x points at column k, rows ldx apart) times the P panels'
// weights. Row by row, one broadcast live at a time: with all R broadcasts loaded first, GCC
// kept them in registers and spilled accumulators to the stack every step.
template <int R, int P>
__attribute__((always_inline)) inline void fma_rows(__m512 (&acc)[R][P], const float* x,
                                                    int64_t ldx, const __m512 (&w)[P]) {
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r) {
    __m512 xv = _mm512_set1_ps(x[r * ldx]);
    if (P > 1) __asm__("" : "+v"(xv));   // its load here, not hoisted
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) acc[r][p] = _mm512_fmadd_ps(xv, w[p], acc[r][p]);
  }
}

template <int R, int P>
__attribute__((always_inline)) inline void start_tile(__m512 (&acc)[R][P], const float* y,
                                                      int64_t ldy, bool accumulate) {
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p)
      acc[r][p] = accumulate ? _mm512_loadu_ps(y + r * ldy + p * kPanel) : _mm512_setzero_ps();
}

template <int R, int P>
__attribute__((always_inline)) inline void store_tile(const __m512 (&acc)[R][P], float* y,
                                                      int64_t ldy) {
#pragma GCC unroll 24
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) _mm512_storeu_ps(y + r * ldy + p * kPanel, acc[r][p]);
}

// y[R, 16 P] (+)= x[R, k_len] @ P fp32 panels [k_len, 16] (`panel_stride` floats apart).
// With `later`, one line of each panel from there on every `later_every` steps is asked for.
template <int R, int P, bool Prefetch>
void tile(const float* x, int64_t ldx, const float* panel, int64_t panel_stride, int64_t k_len,
          float* y, int64_t ldy, bool accumulate, const float* later = nullptr,
          int64_t later_every = 1) {
  __m512 acc[R][P];
  start_tile<R, P>(acc, y, ldy, accumulate);
  for (int64_t k = 0; k < k_len; ++k) {
    if (later && k % later_every == 0)
#pragma GCC unroll 4
      for (int p = 0; p < P; ++p)
        _mm_prefetch(reinterpret_cast<const char*>(later + p * panel_stride +
                                                   k / later_every * kPanel), _MM_HINT_T1);
    __m512 w[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const float* step = panel + p * panel_stride + k * kPanel;
      if (Prefetch)
        _mm_prefetch(reinterpret_cast<const char*>(step + kPrefetch * kPanel), _MM_HINT_T0);
      w[p] = _mm512_loadu_ps(step);
      if (R > 1) __asm__("" : "+v"(w[p]));   // one load, not one folded into every FMA
    }
    fma_rows<R, P>(acc, x + k, ldx, w);
  }
  store_tile<R, P>(acc, y, ldy);
}

// k steps unrolled at a time over a compact block: a Q4_1 group (its levels' shifts are then
// constants).
constexpr int64_t kUnrollSteps = 8;
static_assert(gemv_blocks::Q4_1::kGroupSteps == kUnrollSteps);

// acc += x[R, steps g .. g + 7 of a block] (xg: step g's) @ P panels' weights for them, each
// step's from weights(the panel's block, step).
template <int R, int P, typename Weights>
__attribute__((always_inline)) inline void group_steps(__m512 (&acc)[R][P], const float* xg,
                                                       int64_t ldx, const uint8_t* block,
                                                       int64_t panel_stride, int64_t g,
                                                       const Weights& weights) {
#pragma GCC unroll 8
  for (int64_t i = 0; i < kUnrollSteps; ++i) {
    __m512 w[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) w[p] = weights(block + p * panel_stride, g + i);
    fma_rows<R, P>(acc, xg + i, ldx, w);
  }
}

// Asks for quarter `quarter` (of four) of the P panels' blocks at `next`, a 64-byte line at a
// time: spread over a block's four groups of steps, one block ahead.
template <typename F, int P>
__attribute__((always_inline)) inline void ask_for_quarter(const uint8_t* next,
                                                           int64_t panel_stride, int64_t quarter) {
  constexpr int64_t kLine = 64;
  const int64_t first = quarter * F::kBlockBytes / 4 / kLine * kLine;
  const int64_t last = (quarter + 1) * F::kBlockBytes / 4;
#pragma GCC unroll 4
  for (int p = 0; p < P; ++p)
    for (int64_t at = first; at < last; at += kLine)
      _mm_prefetch(reinterpret_cast<const char*>(next + p * panel_stride + at), _MM_HINT_T0);
}

// acc += x[R, one block's 32 steps] (xb: its first) @ the P panels' weights for them, each
// step's from weights(the panel's block, step), while asking for the P panels' blocks at
// `next` (the next block, or the next tile's first; null: none). Left to the hardware
// prefetcher, which starts over at each 4 KB page and each new stream (four panels, then a
// new tile), the one-row kernel read its 66 MB a token at 13-15 GB/s where a plain two-thread
// read of as many bytes ran at 18-35 GB/s.
template <typename F, int R, int P, typename Weights>
__attribute__((always_inline)) inline void block_steps_asking(__m512 (&acc)[R][P],
                                                              const float* xb, int64_t ldx,
                                                              const uint8_t* block,
                                                              int64_t panel_stride,
                                                              const uint8_t* next,
                                                              const Weights& weights) {
  for (int64_t g = 0; g < gemv_blocks::kSteps; g += kUnrollSteps) {
    if (next != nullptr) ask_for_quarter<F, P>(next, panel_stride, g / kUnrollSteps);
    group_steps<R, P>(acc, xb + g, ldx, block, panel_stride, g, weights);
  }
}

// tile()'s product over P compact panels of format F (`panel_stride` bytes apart), k_len a
// multiple of 32: each k step's weights rebuilt once, then the same FMAs in the same order.
// `after`: the next tile's first panel (asked for during the last block), or null.
template <typename F, int R, int P>
void block_tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t panel_stride,
                int64_t k_len, float* y, int64_t ldy, const uint8_t* after) {
  __m512 acc[R][P];
  start_tile<R, P>(acc, y, ldy, false);
  const int64_t blocks = k_len / gemv_blocks::kSteps;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * F::kBlockBytes;
    block_steps_asking<F, R, P>(acc, x + b * gemv_blocks::kSteps, ldx, block, panel_stride,
                                b + 1 < blocks ? block + F::kBlockBytes : after, F::expand16);
  }
  store_tile<R, P>(acc, y, ldy);
}

// `rows` rows against `count` panels, each pass over a run of side panels covering the whole
// k range (no blocking: one row group reads each weight once).
template <typename TileFn>
void side_by_side(int64_t rows, int64_t count, TileFn&& tile_fn) {
  with_rows_in<1, kMaxRows>(rows, [&]<int R>() {
    constexpr int kSide = side_panels(R);
    int64_t p = 0;
    for (; p + kSide <= count; p += kSide) tile_fn.template operator()<R, kSide>(p);
    for (; p < count; ++p) tile_fn.template operator()<R, 1>(p);
  });
}

// More than one row group: tiles of kGroupSide panels (R * 2 accumulators, R >= 6).
constexpr int64_t kGroupSide = 2;

// m rows in `groups` against panels [begin, end), one slice of kBlockK steps at a time. Only
// the first group's pass reads the slice from memory, so with a few groups the stream would
// idle during the others': each group also asks for its share of the next slice (into L2),
// which made M = 16-32 3-6% faster.
inline void grouped_pass(const RowGroups& groups, const float* x, int64_t k_len,
                         const float* wp, int64_t begin, int64_t end, float* y, int64_t n) {
  const int64_t stride = k_len * kPanel;
  const int64_t share = (kBlockK + groups.count - 1) / groups.count;
  const bool spread = groups.count <= kSpreadGroups;
  for (int64_t p = begin; p < end; p += kGroupSide) {
    const bool whole = p + kGroupSide <= end;   // else one panel, the chunk's last
    for (int64_t k0 = 0; k0 < k_len; k0 += kBlockK) {
      const int64_t k_step = std::min(kBlockK, k_len - k0);
      const float* panel = wp + p * stride + k0 * kPanel;
      const bool more = spread && k0 + kBlockK < k_len;
      for (int64_t g = 0, row = 0; g < groups.count; row += groups.size(g++)) {
        const float* xg = x + row * k_len + k0;
        float* yg = y + row * n + p * kPanel;
        const float* later = more ? panel + (kBlockK + g * share) * kPanel : nullptr;
        with_rows_in<1, kMaxRows>(groups.size(g), [&]<int R>() {
          if (whole)
            tile<R, kGroupSide, true>(xg, k_len, panel, stride, k_step, yg, n, k0 > 0, later,
                                      groups.count);
          else
            tile<R, 1, true>(xg, k_len, panel, stride, k_step, yg, n, k0 > 0, later,
                             groups.count);
        });
      }
    }
  }
}

// y[m, 16 panels] = x[m, k_len] @ fp32 panels [panels, k_len, 16]; y rows n floats apart.
inline void linear(int64_t m, const float* x, int64_t k_len, const float* wp, int64_t panels,
                   float* y, int64_t n) {
  const RowGroups groups(m);
  const int64_t stride = k_len * kPanel;
  const int64_t unit = groups.count == 1 ? side_panels(m) : kGroupSide;
  const int64_t chunk = tokenmill_parallel::chunk_for(panels, unit);
  tokenmill_parallel::parallel_chunks(panels, chunk, [&](int64_t begin, int64_t end) {
    if (groups.count > 1) return grouped_pass(groups, x, k_len, wp, begin, end, y, n);
    // Software prefetch made 2-12 rows 5-15% faster here; one row (bound by the stream
    // alone) measured even.
    side_by_side(m, end - begin, [&]<int R, int P>(int64_t p) {
      const int64_t panel = begin + p;
      tile<R, P, (R >= 2)>(x, k_len, wp + panel * stride, stride, k_len, y + panel * kPanel, n,
                           false);
    });
  });
}

// Past the tall tiles' rows (below), compact panels are rebuilt a slice at a time into fp32 in
// L1 (`staged`, kStageK steps of kGroupSide panels) and every other group's fp32 tile passes
// over that: the rebuild (about as many instructions as the FMAs of a few rows) is paid once,
// not once per group.
constexpr int64_t kStageK = 128;   // a multiple of gemv_blocks::kSteps
static_assert(kStageK % gemv_blocks::kSteps == 0);

// The first group's tile<R, P> over steps [k0, k0 + k_step) of P compact panels: each step's
// weights rebuilt in registers as block_tile does, and also stored to `staged` (kStageK steps
// a panel) for the other groups. The rebuild then runs beside this group's FMAs; staging the
// slice before any group's pass left the FMA units idle meanwhile (SmolLM2's 120 layer
// linears on a 2-core Zen 4, the two in turn, when this route took every step of two groups
// or more: M = 13 1.07-1.08x, 16 1.03-1.05x, 32 1.03x, 64 1.02x, 128 1.015x; bitwise the
// same output). Each block's scales are converted once (F::scales), not at every step: the
// stores to `staged` kept the compiler from reusing them (on the 2-core EPYC family 1Ah, the
// 120 layer linears and lm_head at M = 16 / 24 / 32 1.047x / 1.024x / 1.025x faster).
template <typename F, int R, int P>
void staging_tile(const float* x, int64_t ldx, const uint8_t* panel, int64_t panel_stride,
                  int64_t k0, int64_t k_step, float* staged, float* y, int64_t ldy,
                  bool accumulate) {
  __m512 acc[R][P];
  start_tile<R, P>(acc, y, ldy, accumulate);
  for (int64_t k = 0; k < k_step; k += gemv_blocks::kSteps) {
    const uint8_t* block = panel + (k0 + k) / gemv_blocks::kSteps * F::kBlockBytes;
    typename F::Scales scales[P];
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) scales[p] = F::scales(block + p * panel_stride);
    for (int64_t g = 0; g < gemv_blocks::kSteps; g += kUnrollSteps) {
#pragma GCC unroll 8
      for (int64_t i = 0; i < kUnrollSteps; ++i) {
        __m512 w[P];
#pragma GCC unroll 4
        for (int p = 0; p < P; ++p) {
          w[p] = F::expand16_with(block + p * panel_stride, g + i, scales[p]);
          _mm512_store_ps(staged + (p * kStageK + k + g + i) * kPanel, w[p]);
        }
        fma_rows<R, P>(acc, x + k + g + i, ldx, w);
      }
    }
  }
  store_tile<R, P>(acc, y, ldy);
}

template <typename F>
inline void staged_pass(const RowGroups& groups, const float* x, int64_t k_len,
                        const uint8_t* wp, int64_t panel_stride, int64_t begin, int64_t end,
                        float* y, int64_t n) {
  alignas(64) float staged[kGroupSide * kStageK * kPanel];
  for (int64_t p = begin; p < end; p += kGroupSide) {
    const int64_t count = std::min(kGroupSide, end - p);
    for (int64_t k0 = 0; k0 < k_len; k0 += kStageK) {
      const int64_t k_step = std::min(kStageK, k_len - k0);
      with_rows_in<1, kMaxRows>(groups.size(0), [&]<int R>() {
        if (count == kGroupSide)
          staging_tile<F, R, kGroupSide>(x + k0, k_len, wp + p * panel_stride, panel_stride, k0,
                                         k_step, staged, y + p * kPanel, n, k0 > 0);
        else
          staging_tile<F, R, 1>(x + k0, k_len, wp + p * panel_stride, panel_stride, k0, k_step,
                                staged, y + p * kPanel, n, k0 > 0);
      });
      for (int64_t g = 1, row = groups.size(0); g < groups.count; row += groups.size(g++)) {
        const float* xg = x + row * k_len + k0;
        float* yg = y + row * n + p * kPanel;
        with_rows_in<1, kMaxRows>(groups.size(g), [&]<int R>() {
          if (count == kGroupSide)
            tile<R, kGroupSide, false>(xg, k_len, staged, kStageK * kPanel, k_step, yg, n,
                                       k0 > 0);
          else
            tile<R, 1, false>(xg, k_len, staged, kStageK * kPanel, k_step, yg, n, k0 > 0);
        });
      }
    }
  }
}

// Tall tiles: from 13 rows, one panel a tile and up to 24 rows (R + 5 of the 32 registers).
// A compact step's rebuild (four operations for 16 weights) then serves R FMAs rather than
// the 6-12 of a 12-row group's tile, so two 8-row groups (16 rows) rebuild each weight once,
// not twice. Zen 4 does one 512-bit FMA a cycle, so a tile's broadcast a FMA fits its load
// ports; the Xeons do two (not measured there: zen4_fma_rate()).
// SmolLM2's 120 layer linears and the lm_head against two 12-row groups or the staged slice,
// in turn in one process (medians of 9, 2-core Zen 4): M = 16 1.04-1.05x, 18 1.10x, 20
// 1.08x, 24 1.07x, 32 1.03-1.05x (two groups of 16), 40 1.05x, 48 0.99x (so two groups at
// most); bitwise the same output. Offline decode steps (16 / 20 prompts of 128 tokens, same
// tokens): 1.036x / 1.076x.
constexpr int64_t kTallMaxRows = 24;
constexpr int64_t kTallRouteMaxRows = 40;

// y[m, 16 panels] = x[m, k_len] @ compact panels of format F, kMaxRows < m <=
// kTallRouteMaxRows: one or two equal row groups, each over every panel in tall tiles.
template <typename F>
void tall_linear(int64_t m, const float* x, int64_t k_len, const uint8_t* wp, int64_t panels,
                 float* y, int64_t n) {
  const gemv_rows::RowGroups groups(m, kTallMaxRows);
  const int64_t stride = k_len / gemv_blocks::kSteps * F::kBlockBytes;
  const int64_t chunk = tokenmill_parallel::chunk_for(panels, 1);
  tokenmill_parallel::parallel_chunks(panels, chunk, [&](int64_t begin, int64_t end) {
    for (int64_t g = 0, row = 0; g < groups.count; row += groups.size(g++)) {
      const auto tiles = [&]<int R, int P>(int64_t p) {
        const int64_t panel = begin + p;
        const uint8_t* after = panel + P < end ? wp + (panel + P) * stride : nullptr;
        block_tile<F, R, P>(x + row * k_len, k_len, wp + panel * stride, stride, k_len,
                            y + row * n + panel * kPanel, n, after);
      };
      if (groups.size(g) <= kMaxRows) {   // 25 rows: 13 + 12
        side_by_side(groups.size(g), end - begin, tiles);
        continue;
      }
      with_rows_in<kMaxRows + 1, kTallMaxRows>(groups.size(g), [&]<int R>() {
        for (int64_t p = 0; p < end - begin; ++p) tiles.template operator()<R, 1>(p);
      });
    }
  });
}

// fn(begin, end) over the panels [0, panels) in chunks of whole `unit`s, kChunksPerThread a
// thread: each thread streams its own share front to back and takes the other's last chunks
// when done first (kernels/work_sharing.h's owned items); the tiles ask for the panels past
// their chunk's end too (`after`), mostly the same thread's next chunk. Chunks from a shared
// counter (8 a thread) broke each thread's stream at every chunk's end and sent the two
// threads through the weights interleaved. Whole decode steps offline, the two switched step
// by step in one process (medians, 2-core Xeon): factored, 1 row 6.51 -> 6.21 ms and 5.92 ->
// 5.53, 4 rows 11.14 -> 10.39, 6 rows 15.00 -> 14.45; rebuilt, 7 rows 18.65 -> 18.19, 8 rows
// 20.32 -> 19.81, 10 rows 25.95 -> 25.36, 11 rows 26.37 -> 26.32. (One chunk a thread, no
// stealing: factored 6.23, 5.55, 10.26 and 14.04; owned chunks without the ask across their
// ends gained little: 5.91, 11.01.)
constexpr int64_t kChunksPerThread = 4;

template <typename Fn>
void owned_chunks(int64_t panels, int64_t unit, const Fn& fn) {
  const int64_t chunk = tokenmill_parallel::chunk_for(panels, unit, kChunksPerThread);
  tokenmill_parallel::parallel_owned_items(
      (panels + chunk - 1) / chunk, [] { return 0; },
      [&](int, int64_t item) { fn(item * chunk, std::min(panels, item * chunk + chunk)); });
}

// The same over compact panels of format F: one row group rebuilds every weight in registers
// as it goes (block_tile, several panels side by side), on Zen 4 up to kTallRouteMaxRows rows
// take tall tiles, and more rows share a staged slice (staged_pass). Staged steps take owned
// chunks too: from a shared counter, a thread's panels changed from one call to the next, and
// SmolLM2's 120 layer linears and lm_head (2-core EPYC family 1Ah, the two in turn in one
// process, medians of 15) ran 1.050x / 1.054x / 1.052x / 1.071x slower at M = 13 / 16 / 24 /
// 32, streamed from memory; bitwise the same output.
template <typename F>
void block_linear(int64_t m, const float* x, int64_t k_len, const uint8_t* wp, int64_t panels,
                  float* y, int64_t n) {
  if (m > kMaxRows && m <= kTallRouteMaxRows && zen4_fma_rate())
    return tall_linear<F>(m, x, k_len, wp, panels, y, n);
  const RowGroups groups(m);
  const int64_t stride = k_len / gemv_blocks::kSteps * F::kBlockBytes;
  const int64_t unit = groups.count == 1 ? side_panels(m) : kGroupSide;
  owned_chunks(panels, unit, [&](int64_t begin, int64_t end) {
    if (groups.count > 1) return staged_pass<F>(groups, x, k_len, wp, stride, begin, end, y, n);
    side_by_side(m, end - begin, [&]<int R, int P>(int64_t p) {
      const int64_t panel = begin + p;
      const uint8_t* after = panel + P < panels ? wp + (panel + P) * stride : nullptr;
      block_tile<F, R, P>(x, k_len, wp + panel * stride, stride, k_len, y + panel * kPanel, n,
                          after);
    });
  });
}

// ---- Q4_1 (and Q8_0) in the factored form, for one row group ----
// A Q4_1 weight is w = d q + m per block of 32 inputs, so a row's product over a block is
// d (q . x) + m sum(x): the levels convert to floats and meet x directly, and each block's
// two scales come in once per row and panel (two FMAs a block), where block_tile rebuilds
// every weight (a multiply and an add a step and panel). Not bitwise the fp32 panels' output
// (the roundings differ, as in the AMX tiles' factored form, layers/cpu_amx_kernel.cpp), and
// closer to the exact products (SmolLM2's linears against float64: largest error 5e-7 of the
// output's range, 1.5e-6 rebuilt; one rounding less a weight). SmolLM2's 120 layer linears
// streamed from memory, medians of 25 alternating (2-core Xeon): M = 1: 4.13 -> 3.17 ms;
// M = 2: 5.20 -> 4.02; M = 4: 5.62 -> 4.83; M = 6: 8.13 -> 7.25. Whole decode steps offline
// (`LLM.generate`, alternating, medians): 1 row 10.11 -> 8.93 ms, 6 rows 19.27 -> 18.24.
// Prefetching blocks ahead measured no faster then, on the linears alone; in whole decode
// steps, beside the lm_head and the attention, it pays (block_steps_asking). A step's levels
// are a shift of their group and a table lookup (gemv_blocks.h), two instructions where
// unpacking bytes and converting them took three and a store and reload: the same 120
// linears with their weights in L2 (four linears thirty times), medians of 25 alternating,
// M = 1: 2.56 -> 2.17 ms; M = 2: 3.16 -> 2.73; M = 4: 4.51 -> 3.85; M = 6: 5.76 -> 5.51
// (rebuilt at M = 8: 7.86 -> 7.64), the same outputs bit for bit. Streamed from memory they
// measured even in a busy hour (M = 1: 4.70 against 4.71 ms): the stream bounds them there,
// as it now does the kernel in a quiet one.
//
// Q8_0 (w = d q: the default model's lm_head) takes the same tiles without the m term: a
// widening and a conversion a step and panel, one FMA a block, where rebuilding took a
// multiply more a step. The lm_head (49152 x 576) from huge pages while it sat in the VM's
// L3 (bound by the rebuild, not the bytes), 31 paired rounds: M = 1 0.78 -> 0.65 ms, M = 2
// 1.13 -> 0.94, M = 4 1.31 -> 1.16, M = 6 1.65 -> 1.55; largest error against float64 at
// M = 1 2.6e-6 (rebuilt 1.0e-5).

// The longest step taken in the factored form. From 7 rows the rows' FMAs bound the step,
// and the tiles that fit hold one panel (2 R accumulators). On the Xeons (two 512-bit FMAs a
// cycle) those measured even with block_tile's three panels at 7-12 rows in isolation and 5%
// slower in 8-row decode steps, so there those steps rebuild the weights. On Zen 4 (one a
// cycle: zen4_fma_rate()) the factored form's two operations a step and panel, against the
// rebuild's four, pay: SmolLM2's linears and lm_head, both forms in turn (medians of 9): M = 7
// 1.10x, 8 1.12x, 9 1.16x, 10 1.13x, 12 1.11x; offline 8-row decode steps 1.06-1.08x, the
// same tokens. (A row's result then depends on whether its step has more rows than this, by
// rounding, as it already does at the AMX tiles' threshold.)
// Zen 5 (family 1Ah) does two 512-bit FMAs a cycle, as the Xeons do, and still gains there:
// offline decode steps (128-token prompts, medians, the two routes in separate processes
// alternating, 2-core EPYC family 1Ah): 8 rows 8.80 -> 8.27 ms, 10 rows even (10.37 /
// 10.41), 12 rows 12.98 -> 12.14;
// SmolLM2's 120 layer linears streamed, M = 8 321 -> 338 GFLOP/s, M = 12 326 -> 352. Its
// tall tiles (13-40 rows) measured 3-7% slower there than the staged slices, so they stay
// Zen 4's.
constexpr int64_t kFactoredMaxRowsAnywhere = 12;
inline int64_t factored_max_rows() {
  return amd_family() >= 0x19 ? kFactoredMaxRowsAnywhere : 6;
}

// Panels side by side for R rows: 2 R P accumulators (the block's products, and the scaled
// sum), P levels and a broadcast in 32 registers.
constexpr int factored_side_panels(int64_t rows) {
  return rows <= 3 ? 4 : rows == 4 ? 3 : rows <= 6 ? 2 : 1;
}

// Blocks ahead of the one in hand that a factored tile asks for (its P panels' blocks, a
// quarter each step group), into the next tile's first ones at the end. One block ahead left
// the stream short of requests: whole decode steps offline, one, two and three blocks ahead
// switched step by step in one process (medians of 600-1,200 steps, 2-core Xeon): 1 row 6.54
// / 6.30 / 6.35 ms and 6.34 / 6.11 / 6.19 ms, 2 rows 7.83 / 7.58 / 7.76, 4 rows 11.87 / 11.53 /
// 11.82, 6 rows 15.72 / 15.21 / 15.45; at 1 row, 1 / 2 / 4 / 8 blocks ahead 6.26 / 6.00 / 6.14
// / 6.32 ms. With each thread streaming its own chunks (owned_chunks), further ahead paid
// again: two / three / four / six, 1 row 6.43 / 6.26 / 6.19 and 6.19 / 5.96 / 6.00 / 6.01 ms,
// 2 rows 8.53 / 8.38 / 8.52 / 8.40, 4 rows 11.20 / 10.95 / 11.03, 6 rows 14.97 / 14.70 /
// 14.85 / 14.66. The same bytes in fewer waits; the outputs do not change. (block_tile's
// rebuilding steps of 8 and 10 rows measured even at two ahead: left at one.)
constexpr int64_t kFactoredAhead = 3;

// y[R, 16 P] = x[R, k_len] @ P compact panels of format F (`panel_stride` bytes apart),
// factored; sums[r * blocks + b] (Q4_1's m terms): row r's sum of x over block b. A block's
// products gather in their own accumulators, scaled once at its end. `after`: as block_tile's.
template <typename F, int R, int P>
void factored_tile(const float* x, int64_t ldx, const float* sums, int64_t blocks,
                   const uint8_t* panel, int64_t panel_stride, float* y, int64_t ldy,
                   const uint8_t* after) {
  __m512 acc[R][P];
  start_tile<R, P>(acc, y, ldy, false);
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* block = panel + b * F::kBlockBytes;
    const float* xb = x + b * gemv_blocks::kSteps;
    __m512 part[R][P];
    start_tile<R, P>(part, y, ldy, false);   // zeros (y is not read)
    const int64_t ahead = b + kFactoredAhead;   // past the last block: the next tile's
    const uint8_t* next = ahead < blocks ? panel + ahead * F::kBlockBytes
                          : after != nullptr ? after + (ahead - blocks) * F::kBlockBytes
                                             : nullptr;
    block_steps_asking<F, R, P>(part, xb, ldx, block, panel_stride, next, F::levels16);
#pragma GCC unroll 4
    for (int p = 0; p < P; ++p) {
      const __m512 d = F::scales16(block + p * panel_stride, 0);
#pragma GCC unroll 24
      for (int r = 0; r < R; ++r) acc[r][p] = _mm512_fmadd_ps(part[r][p], d, acc[r][p]);
      if constexpr (F::kHasMins) {
        const __m512 mn = F::scales16(block + p * panel_stride, 1);
#pragma GCC unroll 24
        for (int r = 0; r < R; ++r)
          acc[r][p] = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * blocks + b]), mn, acc[r][p]);
      }
    }
  }
  store_tile<R, P>(acc, y, ldy);
}

// y[m, 16 panels] = x[m, k_len] @ compact panels of format F, m <= factored_max_rows(),
// factored.
// A row's result does not depend on m (the same sums and FMAs in the same order) nor on the
// thread.
template <typename F>
void factored_linear(int64_t m, const float* x, int64_t k_len, const uint8_t* wp,
                     int64_t panels, float* y, int64_t n) {
  const int64_t blocks = k_len / gemv_blocks::kSteps;
  // Kept between calls (no allocation once large enough); the caller's, so the threads below
  // read it through a pointer (by name, each would see its own).
  thread_local std::vector<float> kept;
  kept.resize(F::kHasMins ? m * blocks : 0);
  float* sums = kept.data();
  for (int64_t r = 0; r < (F::kHasMins ? m : 0); ++r)
    for (int64_t b = 0; b < blocks; ++b) {
      const float* xb = x + r * k_len + b * gemv_blocks::kSteps;
      sums[r * blocks + b] = _mm512_reduce_add_ps(
          _mm512_add_ps(_mm512_loadu_ps(xb), _mm512_loadu_ps(xb + 16)));
    }
  const int64_t stride = blocks * F::kBlockBytes;
  owned_chunks(panels, factored_side_panels(m), [&](int64_t begin, int64_t end) {
    with_rows_in<1, kFactoredMaxRowsAnywhere>(m, [&]<int R>() {
      constexpr int kSide = factored_side_panels(R);
      const auto at = [&]<int P>(int64_t panel) {
        const uint8_t* after = panel + P < panels ? wp + (panel + P) * stride : nullptr;
        factored_tile<F, R, P>(x, k_len, sums, blocks, wp + panel * stride, stride,
                               y + panel * kPanel, n, after);
      };
      int64_t p = begin;
      for (; p + kSide <= end; p += kSide) at.template operator()<kSide>(p);
      for (; p < end; ++p) at.template operator()<1>(p);
    });
  });
}

#else
constexpr bool kAvailable = false;
#endif

}  // namespace gemv_avx512
