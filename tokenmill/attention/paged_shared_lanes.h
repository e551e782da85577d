// Rows in lanes, for decodes over a shared prefix (cpu_paged_kernel.cpp's attend_with_groups;
// the build puts this file after paged_row_tiles.h, whose Lanes8 / Lanes16 it uses).
//
// The query rows of a group's requests for one kv head (requests x query heads of the kv
// head) lie across the vector lanes; keys and dims run along the registers. A key's score is
// a broadcast of each of its elements against the transposed queries, so the cache's keys are
// read in place (no transposed copy); the online softmax is vertical (each lane a row: maxima,
// exponentials and sums with no horizontal step); the values are added by broadcasting each of
// their elements against the rows' probabilities. Each row gets the same operations in the
// same order whatever the lane width, so 8- and 16-lane builds agree bit for bit.
//
// Against the row tiles (keys transposed per step, 6-row register tiles, a softmax per row),
// SmolLM2's shapes (3 query heads a kv head), a 1,024-token prefix and 40-85 tokens of each
// request's own, 30 layers' caches on huge pages, the two kernels called in turn in one process
// (medians of 40, 2-core Xeon): 16 requests 13.0 -> 10.9 and 15.7 -> 13.3 ms a step (1.19x),
// 8 1.06x, 4 1.07x. The prefetches go one a loop iteration of the tiles (PrefetchRun): a
// tile's 32 lines at once filled the miss queue, and the loads of a step's values waited on
// memory (1.11x only, then).
#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

namespace {

#ifdef __AVX2__

// Register tiles: KT keys (scores) or dims (values) by RV vectors of rows. 16 lanes take up
// to 3 vectors (48 rows) a pass, 8 lanes 2 (16 ymm registers); both tile sizes divide 8, and
// keys a step and head dims are multiples of 8.
template <typename L>
constexpr int kMaxRowVectors = L::kWidth == 16 ? 3 : 2;
template <typename L, int RV>
constexpr int kLaneTile = L::kWidth == 16 || RV == 1 ? 8 : 4;

// Rows of a cache to ask for, a 64-byte line at a time (one() per loop iteration of a tile:
// all of a tile's lines at once filled the miss queue, and the prefetches waited on it).
struct PrefetchRun {
  const float* const* row;
  const float* const* end;
  int lines, line = 0;

  __attribute__((always_inline)) inline void one() {
    if (row == end) return;
    _mm_prefetch(reinterpret_cast<const char*>(*row + 16 * line), _MM_HINT_T0);
    if (++line == lines) line = 0, ++row;
  }
};

// st[t][lanes] = qt [dim][rp] . key t, for KT keys (keys[t]: the key's row in the cache).
template <typename L, int RV, int KT>
inline void lane_scores(const float* qt, int rp, int dim, const float* const* keys, float* st,
                        PrefetchRun ahead) {
  typename L::Vec acc[KT][RV];
#pragma GCC unroll 8
  for (int t = 0; t < KT; ++t)
#pragma GCC unroll 3
    for (int r = 0; r < RV; ++r) acc[t][r] = L::zero();
  for (int d = 0; d < dim; ++d) {
    ahead.one();
    typename L::Vec qv[RV];
#pragma GCC unroll 3
    for (int r = 0; r < RV; ++r) qv[r] = L::load_pinned(qt + d * rp + L::kWidth * r);
#pragma GCC unroll 8
    for (int t = 0; t < KT; ++t) {
      const typename L::Vec k = L::broadcast(keys[t] + d);
#pragma GCC unroll 3
      for (int r = 0; r < RV; ++r) acc[t][r] = L::fmadd(k, qv[r], acc[t][r]);
    }
  }
#pragma GCC unroll 8
  for (int t = 0; t < KT; ++t)
#pragma GCC unroll 3
    for (int r = 0; r < RV; ++r) L::store(st + t * rp + L::kWidth * r, acc[t][r]);
}

// ot[d0 + d][lanes] += sum over the n keys of value t's element d0 + d times pt[t][lanes], for
// DT dims, keys in order.
template <typename L, int RV, int DT>
inline void lane_values(const float* pt, int rp, const float* const* values, int n, float* ot,
                        int d0, PrefetchRun ahead) {
  typename L::Vec acc[DT][RV];
#pragma GCC unroll 8
  for (int d = 0; d < DT; ++d)
#pragma GCC unroll 3
    for (int r = 0; r < RV; ++r) acc[d][r] = L::load(ot + (d0 + d) * rp + L::kWidth * r);
  for (int t = 0; t < n; ++t) {
    ahead.one();
    typename L::Vec pv[RV];
#pragma GCC unroll 3
    for (int r = 0; r < RV; ++r) pv[r] = L::load_pinned(pt + t * rp + L::kWidth * r);
    const float* v = values[t] + d0;
#pragma GCC unroll 8
    for (int d = 0; d < DT; ++d) {
      const typename L::Vec e = L::broadcast(v + d);
#pragma GCC unroll 3
      for (int r = 0; r < RV; ++r) acc[d][r] = L::fmadd(e, pv[r], acc[d][r]);
    }
  }
#pragma GCC unroll 8
  for (int d = 0; d < DT; ++d)
#pragma GCC unroll 3
    for (int r = 0; r < RV; ++r) L::store(ot + (d0 + d) * rp + L::kWidth * r, acc[d][r]);
}

// One online-softmax step of every lane over n scores (st [n][rp], turned into their
// exp(score - max)): the running max and sum (mx, sm [rp]) move on, ot [dim][rp] is rescaled.
template <typename L, int RV>
inline void lane_softmax(float* st, int rp, int n, int dim, float* ot, float* mx, float* sm) {
  for (int r = 0; r < RV; ++r) {
    const int lane = L::kWidth * r;
    const typename L::Vec old_max = L::load(mx + lane);
    typename L::Vec part[4] = {old_max, old_max, old_max, old_max};   // n % 8 == 0
    for (int t = 0; t < n; t += 4)   // four chains: one waited on each max's latency
#pragma GCC unroll 4
      for (int u = 0; u < 4; ++u) part[u] = L::max(part[u], L::load(st + (t + u) * rp + lane));
    const typename L::Vec m = L::max(L::max(part[0], part[1]), L::max(part[2], part[3]));
    const typename L::Vec alpha = L::exp(L::sub(old_max, m));   // ~1e-38 on the first step
    typename L::Vec sum = L::zero();
    for (int t = 0; t < n; ++t) {
      const typename L::Vec p = L::exp(L::sub(L::load(st + t * rp + lane), m));
      L::store(st + t * rp + lane, p);
      sum = L::add(sum, p);
    }
    L::store(sm + lane, L::add(L::mul(L::load(sm + lane), alpha), sum));
    L::store(mx + lane, m);
    for (int d = 0; d < dim; ++d)
      L::store(ot + d * rp + lane, L::mul(L::load(ot + d * rp + lane), alpha));
  }
}

// Scratch of one thread for attend_lanes: rows in lanes, padded to whole vectors.
struct LaneScratch {
  std::vector<float> qt, st, ot, mx, sm;   // [dim][rp], [keys][rp], [dim][rp], [rp] x2
  std::vector<float> rows;                 // [rp][dim]: the rows before and after, untransposed
  std::vector<const float*> keys, values, next_keys;   // a step's rows in the caches

  LaneScratch(int64_t dim, int64_t step_keys, int64_t rp)
      : qt(dim * rp), st(step_keys * rp), ot(dim * rp), mx(rp), sm(rp), rows(rp * dim),
        keys(step_keys), values(step_keys), next_keys(step_keys) {}
};

// out [cols][rows] = in [rows][cols] transposed, both multiples of 8.
inline void transpose_tiles(const float* in, int64_t rows, int64_t cols, float* out) {
  for (int64_t r = 0; r < rows; r += 8)
    for (int64_t c = 0; c < cols; c += 8)
      transpose8x8(in + r * cols + c, cols, out + c * rows + r, static_cast<int>(rows));
};

// rows[t] = where token t of `blocks` blocks from block b of `table` keeps kv head h's row.
inline void step_rows(const float* cache, const int64_t* table, int64_t b, int64_t blocks,
                      int64_t h, const Shape& s, const float** rows) {
  for (int64_t j = 0; j < blocks; ++j)
    for (int64_t t = 0; t < s.block_size; ++t)
      *rows++ = cache + table[b + j] * s.block_stride + t * s.token_stride + h * s.dim;
}

// The softmax state (ot, mx, sm of `sc`) of the rows in sc.qt (pre-scaled, transposed to
// [dim][rp], RV vectors of L's lanes; padding rows zero) over blocks [b0, b1) of `table`, kv
// head h, whole blocks, a step (step_blocks) at a time.
template <typename L, int RV>
void attend_lanes(const float* k_cache, const float* v_cache, const int64_t* table, int64_t b0,
                  int64_t b1, int64_t h, const Shape& s, LaneScratch& sc) {
  constexpr int rp = RV * L::kWidth, kt = kLaneTile<L, RV>;
  const int dim = static_cast<int>(s.dim), bs = static_cast<int>(s.block_size);
  std::fill(sc.mx.begin(), sc.mx.begin() + rp, -std::numeric_limits<float>::infinity());
  std::fill(sc.sm.begin(), sc.sm.begin() + rp, 0.0f);
  std::fill(sc.ot.begin(), sc.ot.begin() + dim * rp, 0.0f);
  const int per_step = step_blocks(bs), lines = (dim + 15) / 16;   // 64-byte lines a row
  step_rows(k_cache, table, b0, std::min<int64_t>(per_step, b1 - b0), h, s, sc.keys.data());
  for (int64_t b = b0; b < b1; b += per_step) {
    const int blocks = static_cast<int>(std::min<int64_t>(per_step, b1 - b)), n = blocks * bs;
    const int next = static_cast<int>(std::min<int64_t>(per_step, b1 - b - blocks)) * bs;
    step_rows(v_cache, table, b, blocks, h, s, sc.values.data());
    step_rows(k_cache, table, b + blocks, next / bs, h, s, sc.next_keys.data());
    // this step's values while its keys are scored (a tile's keys' values a tile), the next
    // step's keys while the values are added (a share a dim tile)
    const float* const* values = sc.values.data();
    for (int t = 0; t < n; t += kt)
      lane_scores<L, RV, kt>(sc.qt.data(), rp, dim, sc.keys.data() + t, sc.st.data() + t * rp,
                             {values + t, values + t + kt, lines});
    lane_softmax<L, RV>(sc.st.data(), rp, n, dim, sc.ot.data(), sc.mx.data(), sc.sm.data());
    const float* const* keys = sc.next_keys.data();
    for (int d = 0; d < dim; d += kt)
      lane_values<L, RV, kt>(sc.st.data(), rp, values, n, sc.ot.data(), d,
                             {keys + next * d / dim, keys + next * (d + kt) / dim, lines});
    std::swap(sc.keys, sc.next_keys);
  }
}

using AttendLanesFn = void (*)(const float*, const float*, const int64_t*, int64_t, int64_t,
                               int64_t, const Shape&, LaneScratch&);

// Lanes and the attend_lanes for a pass of `rows` rows (at most lane_pass_rows): 16 lanes
// where the build has them and `wide`, except for 8 rows or fewer (half a vector of padding
// otherwise); the outputs are the same either way.
struct LanePick {
  int width, vectors;
  AttendLanesFn fn;
};

inline int lane_pass_rows(bool wide) {
#if defined(__AVX512F__)
  if (wide) return 16 * kMaxRowVectors<Lanes16>;
#endif
  (void)wide;
  return 8 * kMaxRowVectors<Lanes8>;
}

inline LanePick pick_lanes(int rows, bool wide) {
#if defined(__AVX512F__)
  if (wide && rows > 8) {
    static constexpr AttendLanesFn fns[3] = {attend_lanes<Lanes16, 1>, attend_lanes<Lanes16, 2>,
                                             attend_lanes<Lanes16, 3>};
    const int vectors = (rows + 15) / 16;
    return {16, vectors, fns[vectors - 1]};
  }
#endif
  (void)wide;
  static constexpr AttendLanesFn fns[2] = {attend_lanes<Lanes8, 1>, attend_lanes<Lanes8, 2>};
  const int vectors = (rows + 7) / 8;
  return {8, vectors, fns[vectors - 1]};
}

#endif

}  // namespace
