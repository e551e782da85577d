// Register tiles of rows against paged blocks (cpu_paged_kernel.cpp, which the build compiles
// with this file in front of it): attend_rows scores many query rows of one kv head against a
// run of blocks as small matrix products (the keys transposed into a [dim, keys] tile, rank-1
// updates of 6-row register tiles, no horizontal sums), then adds the values the same way.
// The decode route over a shared prefix and the prefill kernel both use it.
#include <algorithm>
#include <cstdint>
#include <limits>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

constexpr int kRowTile = 6;               // query rows per register tile
#if defined(__AVX2__) && defined(__AVX512F__)
constexpr bool kWideTiles = true;         // attend_rows has AVX-512 register tiles
#else
constexpr bool kWideTiles = false;
#endif

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

// The vector operations of rank1_tile (and of paged_shared_lanes.h), 8 lanes (AVX2) or 16
// (AVX-512). Each load and broadcast is pinned to one instruction (the empty asm): else GCC
// folded the loads into every FMA (the load ports, not the FMAs, became the limit) or hoisted
// all the broadcasts of a step and spilled accumulators.
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
  static Vec max(Vec a, Vec b) { return _mm256_max_ps(a, b); }
  static Vec add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm256_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
  static Vec exp(Vec a) { return exp_ps(a); }
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
  static Vec max(Vec a, Vec b) { return _mm512_max_ps(a, b); }
  static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
  static Vec sub(Vec a, Vec b) { return _mm512_sub_ps(a, b); }
  static Vec mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
  static Vec exp(Vec a) { return tokenmill_avx2::exp_ps16(a); }   // bitwise exp_ps per lane
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
#endif

}  // namespace
