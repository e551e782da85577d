// fp32 linear on the AMX bf16 tile unit, for long (prefill) steps: y[M, N] = x[M, K] @ W[N, K]^T.
//
// Exact products. The hi + lo form takes W only when every weight is the sum of two bf16
// numbers (16 significant bits; the weights a GGUF Q4_1 file loads as are, and so are fp16 and
// bf16 checkpoints); pack_amx_weight checks each one and returns an empty tensor otherwise. Each
// row of x is split into three bf16 numbers, hi + mid + lo, which hold its 24 bits exactly.
// A bf16 product is exact in fp32 and the tile unit sums in fp32, so x . w is the sum of the
// term products: five of the six are computed; x.lo * w.lo, at most 2^-24 of |x w| (fp32's
// unit roundoff), is left out. The result is as accurate as an fp32 GEMM (tests/layers/
// test_cpu_amx.py: within twice F.linear's distance from the float64 product, mostly
// closer), not bitwise the same: it sums in another order.
//
// Tiles: 16 rows x 64 bytes. Three accumulators (16 rows x 48 columns of y), three weight
// tiles (one per 16 columns) and two x tiles, taken in turn so that a load overlaps the
// products of the other: 8 tiles. Per 32 k steps, fifteen tile products from eleven 1 KB
// loads (6 weight, 5 x); both operands are packed tile by tile, each tile 1 KB contiguous.
// The work items are (a block of row tiles, three column tiles): a block's split rows
// (~768 KB) stay in L2 while the column groups pass over them.
//
// Q4_1 weights (w = d q + m, one d and m per 32 inputs of a row, q in 0..15) go faster in
// their factored form, y = sum over blocks of d (x . q) + m sum(x): a level is one exact bf16,
// so a block's x . q takes three tile products (x.hi, x.mid, x.lo against the levels), read
// out of the accumulators and scaled by the block's d with FMAs while the next block's products
// run; each accumulator starts from its m terms, the rows' block sums times the minimums (FMAs
// over the blocks). Nine tile products per block of
// three column tiles instead of fifteen, from half the weight bytes. Each x . q is exact
// products summed in fp32, so the result is as accurate as an fp32 GEMM too (the same test).
// The factored form, SmolLM2's ffn_up at 2048 rows against the hi + lo tiles, alternating
// (twenty-ninth session): 1.42x while the VM's tile unit ran slow, 1.0-1.15x while it ran
// fast (then tile loads and the readouts, not the products, set the pace).
//
// Q4_1 steps of every size read the levels in four bits, rebuilt as bf16 tiles in L1 a block at
// a time (expand_levels). Decode steps of up to 16 rows (the C++ layer loop calls
// amx_linear_factored_into) configure the accumulators and x tiles for their rows only.
// SmolLM2's 120 layer linears, thirtieth session, medians of 9: 16 rows 13.95 ms against 15.09
// from the bf16 tiles and 15.61 from the compact panels; 12 rows 12.62, 13.76, 12.71; 8 rows
// 10.84, 13.14, 9.46 (the panels keep those). Longer steps rebuild a block's levels once for a
// run of up to kTileRun row tiles: 30 layers' GEMMs at 512 rows with cold weights, alternating
// processes (forty-fourth session), 192-193 ms against 209-211 from the bf16 tiles (which take
// 2.7x the bytes: SmolLM2's Q4_1 tiles 379 -> 166 MB); 128 rows 0.85-0.88x, 2048 0.96-0.97x.
//
// On a 2-core Sapphire Rapids-class VM, SmolLM2's four layer GEMMs at 2048 rows against
// oneDNN's packed fp32 GEMM, alternating: 1.11-1.15x in the median pair, 1.58x at best (the
// VM's tile unit ran at 0.9-2.4 TFLOP/s a core from minute to minute); offline prefill
// 1.07-1.21x in paired medians (docs/benchmarks.md, twenty-seventh session).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <memory>
#include <vector>
#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__) && \
    defined(__AVX512F__)
#define TOKENMILL_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace amx {

constexpr int64_t kRows = 16;          // rows of a tile
constexpr int64_t kCols = 16;          // fp32 output columns of a tile
constexpr int64_t kSteps = 32;         // k steps of a tile product (bf16 pairs)
constexpr int64_t kTile = 512;         // bf16 values in a 1 KB tile
constexpr int64_t kXTerms = 3;         // hi, mid, lo of each x
constexpr int64_t kWTerms = 2;         // hi, lo of each weight
constexpr int64_t kColGroup = 3;       // column tiles of a work item
constexpr int64_t kL2Budget = 768 * 1024;  // split rows of a work item's row block
constexpr int64_t kTileRun = 8;        // row tiles that share a block's level tiles
constexpr int64_t kNibbleTile = kTile / 2;  // bytes of a tile of four-bit levels
constexpr int64_t kScaleBytes = kCols * 4;    // a column tile's d (or m) of one block
// Bytes of one block of a column group in the short steps' records: the group's four-bit level
// tiles, then their d, then their m (GroupRecords).
constexpr int64_t kGroupRecord = kColGroup * (kNibbleTile + 2 * kScaleBytes);
// The same for Q8_0: the group's levels a byte each (half the bf16 tiles' bytes), then their d
// (Q8Records).
constexpr int64_t kQ8Record = kColGroup * (kTile + kScaleBytes);

#ifdef TOKENMILL_AMX
// Linux hands out the tile state on request, once per process (arch_prctl).
inline bool request_tiles() {
  constexpr int kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  static const bool granted =
      syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  return granted;
}

// Every tile of 64-byte rows, for the calling thread; released when it goes. The weight tiles
// (4-6) have 16 rows (k pairs); the accumulators (0-2) and x tiles (3, 7) `rows` (of y and x):
// a step of fewer than 16 rows pays for its rows only, in products and readouts.
struct TileSession {
  explicit TileSession(int64_t rows = kRows) {
    struct alignas(64) {
      uint8_t palette = 1, start_row = 0, reserved[14] = {};
      uint16_t bytes_per_row[16] = {};
      uint8_t rows[16] = {};
    } config;
    for (int i = 0; i < 8; ++i)
      config.bytes_per_row[i] = 64, config.rows[i] = i >= 4 && i <= 6 ? kRows : rows;
    _tile_loadconfig(&config);
  }
  ~TileSession() { _tile_release(); }
  TileSession(const TileSession&) = delete;
  TileSession& operator=(const TileSession&) = delete;
};

inline uint16_t bf16_bits(float exact) {   // `exact` is a bf16 value: its top half
  uint32_t bits;
  std::memcpy(&bits, &exact, sizeof bits);
  return static_cast<uint16_t>(bits >> 16);
}

inline float round_to_bf16(float v) {
  const __m128i half = reinterpret_cast<__m128i>(_mm_cvtneps_pbh(_mm_set_ss(v)));
  return _mm_cvtss_f32(_mm_castsi128_ps(_mm_slli_epi32(_mm_cvtepu16_epi32(half), 16)));
}

// A bf16 the tile unit reads as itself: zero or normal (it treats subnormals as zero).
inline bool tile_exact(float v) { return v == 0.f || std::fabs(v) >= 0x1p-126f; }

// bf16 -> fp32 of 16 values.
inline __m512 widen(__m256bh h) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(h)), 16));
}

// Row tiles [first, last) of x [rows, K] into xs [last - first][K / 32][3][16 x 32] (rows
// past `rows` zero), each value as hi + mid + lo, on the calling thread.
void split_row_tiles(const float* x, int64_t rows, int64_t k, int64_t first, int64_t last,
                     uint16_t* xs) {
  const int64_t blocks = k / kSteps;
  for (int64_t r = first * kRows; r < last * kRows; ++r)
    for (int64_t c = 0; c < k; c += 16) {
      const __m512 v = r < rows ? _mm512_loadu_ps(x + r * k + c) : _mm512_setzero_ps();
      const __m256bh hi = _mm512_cvtneps_pbh(v);
      const __m512 rest = _mm512_sub_ps(v, widen(hi));
      const __m256bh mid = _mm512_cvtneps_pbh(rest);
      const __m256bh lo = _mm512_cvtneps_pbh(_mm512_sub_ps(rest, widen(mid)));
      uint16_t* out = xs + (((r / kRows - first) * blocks + c / kSteps) * kXTerms) * kTile +
                      (r % kRows) * kSteps + c % kSteps;
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), reinterpret_cast<__m256i>(hi));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kTile),
                          reinterpret_cast<__m256i>(mid));
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 2 * kTile),
                          reinterpret_cast<__m256i>(lo));
    }
}

// All rows of x (one row tile for the short steps' ShortStep).
void split_rows(const float* x, int64_t rows, int64_t k, uint16_t* xs) {
  split_row_tiles(x, rows, k, 0, (rows + kRows - 1) / kRows, xs);
}

// The first `count` of a block's x terms (tiles 3 and 7 in turn, so that a load overlaps the
// products of the other) times weight tiles 4-6, into accumulators 0-2.
template <int kColTiles>
__attribute__((always_inline)) inline void x_terms_times_weights(const uint16_t* ab, int count) {
#pragma GCC unroll 3
  for (int s = 0; s < count; ++s) {
    if (s % 2 == 0) {
      _tile_loadd(3, ab + s * kTile, 64);
      _tile_dpbf16ps(0, 3, 4);
      if (kColTiles > 1) _tile_dpbf16ps(1, 3, 5);
      if (kColTiles > 2) _tile_dpbf16ps(2, 3, 6);
    } else {
      _tile_loadd(7, ab + s * kTile, 64);
      _tile_dpbf16ps(0, 7, 4);
      if (kColTiles > 1) _tile_dpbf16ps(1, 7, 5);
      if (kColTiles > 2) _tile_dpbf16ps(2, 7, 6);
    }
  }
}

// y rows [row0, row0 + 16) x columns [col0, col0 + 16 kColTiles), over all k: x tiles (3 and
// 7 in turn) against up to three weight tiles (4-6) into accumulators 0-2. x.lo * w.lo is
// left out (t = 1 takes x.hi and x.mid only). `a`: the row tile's split terms [K / 32][3][512].
template <int kColTiles>
void row_block(const uint16_t* a, const uint16_t* w, int64_t blocks, int64_t row0,
               int64_t rows, int64_t col0, float* y, int64_t n) {
  _tile_zero(0);
  if (kColTiles > 1) _tile_zero(1);
  if (kColTiles > 2) _tile_zero(2);
  const int64_t w_tile_stride = blocks * kWTerms * kTile;
  const uint16_t* w0 = w + (col0 / kCols) * w_tile_stride;
  for (int64_t b = 0; b < blocks; ++b) {
    const uint16_t* ab = a + b * kXTerms * kTile;
    const uint16_t* wb = w0 + b * kWTerms * kTile;
#pragma GCC unroll 2
    for (int t = 0; t < kWTerms; ++t) {
      _tile_loadd(4, wb + t * kTile, 64);
      if (kColTiles > 1) _tile_loadd(5, wb + w_tile_stride + t * kTile, 64);
      if (kColTiles > 2) _tile_loadd(6, wb + 2 * w_tile_stride + t * kTile, 64);
      x_terms_times_weights<kColTiles>(ab, kXTerms - t);
    }
  }
  if (row0 + kRows <= rows) {
    float* out = y + row0 * n + col0;
    _tile_stored(0, out, n * 4);
    if (kColTiles > 1) _tile_stored(1, out + kCols, n * 4);
    if (kColTiles > 2) _tile_stored(2, out + 2 * kCols, n * 4);
    return;
  }
  alignas(64) float scratch[kRows][3 * kCols];
  _tile_stored(0, &scratch[0][0], sizeof scratch[0]);
  if (kColTiles > 1) _tile_stored(1, &scratch[0][kCols], sizeof scratch[0]);
  if (kColTiles > 2) _tile_stored(2, &scratch[0][2 * kCols], sizeof scratch[0]);
  for (int64_t r = 0; row0 + r < rows; ++r)
    std::memcpy(y + (row0 + r) * n + col0, scratch[r], kColTiles * kCols * 4);
}

// sums[r][b] = the sum of x[r][32 b, 32 b + 32): what a block's minimum m multiplies.
void block_sums(const float* x, int64_t rows, int64_t k, float* sums) {
  const int64_t blocks = k / kSteps;
  at::parallel_for(0, rows, 16, [&](int64_t first, int64_t last) {
    for (int64_t r = first; r < last; ++r)
      for (int64_t b = 0; b < blocks; ++b) {
        const float* v = x + r * k + b * kSteps;
        sums[r * blocks + b] =
            _mm512_reduce_add_ps(_mm512_add_ps(_mm512_loadu_ps(v), _mm512_loadu_ps(v + 16)));
      }
  });
}

// Q4_1 levels four bits each, for the tiles' VNNI order (tile row i: k = 2i and 2i + 1 of each
// of the 16 columns, 32 words): a tile is 256 bytes, not 1 KB. Rows 2p and 2p + 1 share 32
// bytes: byte w holds word w of row 2p in its low nibble and of row 2p + 1 in its high one.
inline int64_t nibble_at(int64_t c, int64_t col) { return c / 4 * 32 + col * 2 + c % 2; }
inline int nibble_shift(int64_t c) { return 4 * (c / 2 % 2); }

// A tile of levels from its nibbles, as bf16 (16 rows of 32), into `out`: a row pair's 32
// bytes widened to 16-bit words, which a table turns into bf16, the words as they are for the
// first row and shifted down four bits for the second. A 16-bit permute reads only an index's
// low five bits, and the table holds bf16 of 0..15 twice over, so the first row's words need
// no mask. Two vector operations a row: the tile unit's products and the vector work of a
// block take turns, not overlap (docs/benchmarks.md, forty-eighth session), so each counts.
inline void expand_levels(const uint8_t* nibbles, uint16_t* out) {
  alignas(64) static const uint16_t kLevels[32] = {
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,   // bf16 of 0..15
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170,
      0x0000, 0x3f80, 0x4000, 0x4040, 0x4080, 0x40a0, 0x40c0, 0x40e0,   // and again
      0x4100, 0x4110, 0x4120, 0x4130, 0x4140, 0x4150, 0x4160, 0x4170};
  const __m512i table = _mm512_load_si512(kLevels);
#pragma GCC unroll 4
  for (int pair = 0; pair < kRows / 2; ++pair) {
    const __m512i words = _mm512_cvtepu8_epi16(
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles + pair * 32)));
    _mm512_store_si512(out + pair * 64, _mm512_permutexvar_epi16(words, table));
    _mm512_store_si512(out + pair * 64 + 32,
                       _mm512_permutexvar_epi16(_mm512_srli_epi16(words, 4), table));
  }
}

// Q8_0 levels a byte each, in the tiles' VNNI order: a tile of them as bf16 (exact: |q| <=
// 128) into `out`, 32 levels a row widened to fp32 and narrowed again.
inline void expand_q8_levels(const uint8_t* bytes, uint16_t* out) {
#pragma GCC unroll 4
  for (int row = 0; row < kRows; ++row) {
    const auto* at = reinterpret_cast<const __m128i*>(bytes + row * 32);
    const __m512 first = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at)));
    const __m512 second = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(at + 1)));
    _mm512_store_si512(out + row * 32,
                       reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(second, first)));
  }
}

// Where a work item's block b comes from: its column tiles' levels (tile(j, b), bf16), their
// steps d (d(j, b), 16 floats) and, for Q4_1, minimums m (m(j, b)); ahead(b) asks for the
// blocks after b before they are needed.
//
// TiledLevels: the bf16 level tiles [col tiles, blocks, 512], d [col tiles, blocks, 16] and m
// [blocks, n] (m: Q4_1 only) as packed on request (the tests' oracle for the records).
struct TiledLevels {
  const uint16_t* levels;  // the work item's first column tile
  int64_t stride;          // from one column tile to the next
  const float* steps;      // the item's first column tile's d
  int64_t blocks;
  const float* mins;       // m of the item's first column, block 0 (null for Q8_0)
  int64_t n;
  const uint16_t* tile(int j, int64_t b) { return levels + j * stride + b * kTile; }
  const float* d(int j, int64_t b) const { return steps + (j * blocks + b) * kCols; }
  const float* m(int j, int64_t b) const { return mins + b * n + j * kCols; }
  void ahead(int64_t) const {}   // their row tiles' passes keep the blocks in L2
};

// GroupRecords: a Q4_1 column group's blocks, which a work item streams once, as one run of
// records [blocks][kGroupRecord]: the four-bit levels (a quarter of the bf16 tiles' bytes),
// rebuilt as bf16 tiles in L1, then d and m; Q8Records the same for Q8_0, its levels a byte
// each and no m. With the levels, d and m in
// three tensors an item read seven short streams (m's 12 KB apart a block), and in real
// 16-row decode steps a layer's linears took 1.45x what the same calls took with their
// weights just read into L2 (481 against ~330 us). One stream, asked for into L2
// kAheadL2 blocks ahead and into L1 one block ahead: 435 us (docs/benchmarks.md,
// forty-third session).
template <int64_t kLevelBytes, int64_t kRecord, void (*kExpand)(const uint8_t*, uint16_t*)>
struct BlockRecords {
  const uint8_t* first;    // the group's block 0
  int64_t blocks;
  alignas(64) uint16_t rebuilt[kColGroup][kTile];
  const uint8_t* record(int64_t b) const { return first + b * kRecord; }
  const uint16_t* tile(int j, int64_t b) {
    kExpand(record(b) + j * kLevelBytes, rebuilt[j]);
    return rebuilt[j];
  }
  const float* d(int j, int64_t b) const {
    return reinterpret_cast<const float*>(record(b) + kColGroup * kLevelBytes) + j * kCols;
  }
  const float* m(int j, int64_t b) const { return d(j, b) + kColGroup * kCols; }  // Q4_1
  static constexpr int64_t kAheadL2 = 6;
  void ahead(int64_t b) const {
    if (b == 0)   // the item's first blocks: nothing asked for them yet
      for (int64_t next = 1; next < kAheadL2; ++next) fetch<_MM_HINT_T1>(next);
    fetch<_MM_HINT_T1>(b + kAheadL2);
    fetch<_MM_HINT_T0>(b + 1);
  }
  template <_mm_hint kHint>
  void fetch(int64_t b) const {
    if (b >= blocks) return;
    const char* at = reinterpret_cast<const char*>(record(b));
    for (int64_t line = 0; line < kRecord; line += 64) _mm_prefetch(at + line, kHint);
  }
};
using GroupRecords = BlockRecords<kNibbleTile, kGroupRecord, expand_levels>;
using Q8Records = BlockRecords<kTile, kQ8Record, expand_q8_levels>;

// The factored form of row_block, for `tiles` row tiles (at most kTileRun) from row0, their
// split terms from `a`, tile_terms apart: y rows x columns [col0, col0 + 16 kColTiles) = sum over
// blocks of d (x . q) + the block's m terms. Per block the column tiles' levels are loaded (4-6)
// once for all the row tiles; per row tile x.hi, x.mid and x.lo (tiles 3 and 7 in turn) against
// them into accumulators 0-2, zeroed; they are stored to one of two scratch buffers, and the
// (block, row tile) before is scaled into its `acc` meanwhile, its m terms (the rows' block sums
// times the minimums) with it. Every output adds its blocks in order, whatever the run.
// The m terms used to come first, all blocks of a row and column tile in one dependent chain
// of FMAs (a quarter of the kernel's samples at 768 rows); here they ride in the readout's
// shadow. SmolLM2's four layer GEMMs, the two kernels called in turn (medians of 30, 2-core
// Xeon): 12-16 rows 1.03-1.05x, 32-48 1.07-1.08x, 128-256 1.09-1.12x, 768 0.99x (where the
// tile loads and products set the pace); the Q8_0 lm_head (no m terms) 0.98-1.01x. The sums
// are as accurate (about half the distance from float64 in that run), not bitwise the same.
template <int kColTiles, typename Source>
void factored_row_block(const uint16_t* a, int64_t tile_terms, int64_t tiles, Source& source,
                        const float* block_sums, int64_t blocks, int64_t row0, int64_t rows,
                        int64_t col0, float* y, int64_t n) {
  constexpr int64_t kWidth = kColTiles * kCols;
  alignas(64) float acc[kTileRun][kRows][kWidth];
  alignas(64) float products[2][kRows][kWidth];
  std::memset(acc, 0, tiles * sizeof acc[0]);
  // (block, row tile) b * tiles + t's products, in products[its parity], into acc[t]
  auto scale_in = [&](int64_t step) {
    const int64_t b = step / tiles, t = step % tiles, first = row0 + t * kRows;
    const int64_t live = std::min(kRows, rows - first);
    float (*block)[kWidth] = products[step % 2];
    float (*into)[kWidth] = acc[t];
    const float* sums = block_sums != nullptr ? block_sums + first * blocks : nullptr;
#pragma GCC unroll 3
    for (int j = 0; j < kColTiles; ++j) {
      const __m512 d = _mm512_loadu_ps(source.d(j, b));
      if (sums == nullptr) {
        for (int64_t r = 0; r < live; ++r)
          _mm512_store_ps(&into[r][j * kCols],
                          _mm512_fmadd_ps(d, _mm512_load_ps(&block[r][j * kCols]),
                                          _mm512_load_ps(&into[r][j * kCols])));
        continue;
      }
      const __m512 m = _mm512_loadu_ps(source.m(j, b));
      for (int64_t r = 0; r < live; ++r) {
        const __m512 with_min = _mm512_fmadd_ps(_mm512_set1_ps(sums[r * blocks + b]), m,
                                                _mm512_load_ps(&into[r][j * kCols]));
        _mm512_store_ps(&into[r][j * kCols],
                        _mm512_fmadd_ps(d, _mm512_load_ps(&block[r][j * kCols]), with_min));
      }
    }
  };
  int64_t step = 0;
  for (int64_t b = 0; b < blocks; ++b) {
    source.ahead(b);
    _tile_loadd(4, source.tile(0, b), 64);
    if (kColTiles > 1) _tile_loadd(5, source.tile(1, b), 64);
    if (kColTiles > 2) _tile_loadd(6, source.tile(2, b), 64);
    for (int64_t t = 0; t < tiles; ++t, ++step) {
      _tile_zero(0);
      if (kColTiles > 1) _tile_zero(1);
      if (kColTiles > 2) _tile_zero(2);
      x_terms_times_weights<kColTiles>(a + t * tile_terms + b * kXTerms * kTile, kXTerms);
      if (step > 0) scale_in(step - 1);
      float (*out)[kWidth] = products[step % 2];
      _tile_stored(0, &out[0][0], sizeof out[0]);
      if (kColTiles > 1) _tile_stored(1, &out[0][kCols], sizeof out[0]);
      if (kColTiles > 2) _tile_stored(2, &out[0][2 * kCols], sizeof out[0]);
    }
  }
  scale_in(step - 1);
  for (int64_t t = 0; t < tiles; ++t)
    for (int64_t r = 0; r < std::min(kRows, rows - row0 - t * kRows); ++r)
      std::memcpy(y + (row0 + t * kRows + r) * n + col0, acc[t][r], kWidth * 4);
}

// One work item's columns [col0, col0 + 16 cols) over `tiles` row tiles from row0 (at most
// kTileRun), its blocks from `source` (TiledLevels or GroupRecords, pointed at the item's first
// column tile); `a` the first row tile's split terms, the next tile_terms further each.
template <typename Source>
void factored_item(const uint16_t* a, int64_t tile_terms, int64_t tiles, Source source,
                   const float* sums, int64_t blocks, int64_t row0, int64_t rows, int64_t col0,
                   int64_t cols, float* y, int64_t n) {
  if (cols == 3)
    factored_row_block<3>(a, tile_terms, tiles, source, sums, blocks, row0, rows, col0, y, n);
  else if (cols == 2)
    factored_row_block<2>(a, tile_terms, tiles, source, sums, blocks, row0, rows, col0, y, n);
  else
    factored_row_block<1>(a, tile_terms, tiles, source, sums, blocks, row0, rows, col0, y, n);
}

// A thread's tiles and the split rows of the row block it last took (kept between calls).
struct LongSteps {
  TileSession session;
  std::vector<uint16_t>& split;
  int64_t block = -1;
  explicit LongSteps(int64_t size) : split(buffer()) {
    if (static_cast<int64_t>(split.size()) < size) split.resize(size);
  }
  static std::vector<uint16_t>& buffer() {
    thread_local std::vector<uint16_t> kept;
    return kept;
  }
};

// Every (row tile, up to three column tiles) of y [rows, 16 col_tiles] = x [rows, k] @ W^T in
// work items that keep a block of split rows in L2: fn(a, tile_terms, tiles, row0, col0, column
// tiles) for runs of up to kTileRun row tiles from row0, `a` the split terms of the first, the
// next tile_terms further each. The row blocks are shared out among the threads, each
// splitting its own (kernels/work_sharing.h's owned items). Split up front by both threads,
// half of every block's terms were written by the other core, which on the 2-core VM reads a
// core's fresh lines several times slower than its own (see ShortStep); split by every thread
// that took one of its column groups, each thread split all of x.
template <typename Fn>
void for_each_tile(const float* x, int64_t rows, int64_t k, int64_t col_tiles, const Fn& fn) {
  const int64_t row_tiles = (rows + kRows - 1) / kRows;
  const int64_t tile_terms = k / kSteps * kXTerms * kTile;
  const int64_t threads = at::get_num_threads();
  const int64_t most_per_block = std::max<int64_t>(1, kL2Budget / (tile_terms * 2));
  // as many row blocks as `rounds` times the threads (each thread owns `rounds` of them), as
  // few rounds as keep a block's split rows within the L2 budget
  const int64_t rounds = (row_tiles + threads * most_per_block - 1) / (threads * most_per_block);
  const int64_t tiles_per_block = std::max<int64_t>(
      1, (row_tiles + threads * rounds - 1) / (threads * rounds));
  const int64_t row_blocks = (row_tiles + tiles_per_block - 1) / tiles_per_block;
  const int64_t col_groups = (col_tiles + kColGroup - 1) / kColGroup;
  tokenmill_parallel::parallel_owned_items(
      row_blocks * col_groups,
      [&] { return std::make_unique<LongSteps>(tiles_per_block * tile_terms); },
      [&](const std::unique_ptr<LongSteps>& steps, int64_t item) {
        const int64_t block = item / col_groups, first_col = item % col_groups * kColGroup;
        const int64_t cols = std::min(kColGroup, col_tiles - first_col);
        const int64_t first = block * tiles_per_block;
        const int64_t last = std::min(row_tiles, first + tiles_per_block);
        if (steps->block != block) {
          split_row_tiles(x, rows, k, first, last, steps->split.data());
          steps->block = block;
        }
        for (int64_t tile = first; tile < last; tile += kTileRun)
          fn(steps->split.data() + (tile - first) * tile_terms, tile_terms,
             std::min(kTileRun, last - tile), tile * kRows, first_col * kCols, cols);
      });
}

// A step of at most 16 rows as one thread's tiles read it: x split into its bf16 terms and the
// rows' block sums (for Q4_1's minimums), made by that thread. Split once by the calling
// thread, the terms (1.5x x's bytes, fresh in that core's cache) crossed to the other core at
// every linear: on the 2-core VM an OpenMP region whose second thread reads 96 KB the first
// has just written takes 21.6 us, 3.2 us when the data stays put. Now each thread reads x (half
// of it written by the other core) and splits it itself. Real 16-request decode steps over a
// 1,056-token context, the old and new kernels in turn in one process (paired medians of 93
// steps): 16 rows 1.032x and 1.036x, 12 rows 1.038x; 0.98-1.03x in a slow, noisy hour.
struct ShortStep {
  TileSession session;
  const uint16_t* xs;
  const float* sums;   // null without minimums
  ShortStep(const float* x, int64_t rows, int64_t k, bool with_sums) : session(rows) {
    thread_local std::vector<uint16_t> split;
    thread_local std::vector<float> block_sum;
    split.resize(k / kSteps * kXTerms * kTile);
    split_rows(x, rows, k, split.data());   // one row tile: serial, on this thread
    xs = split.data();
    sums = nullptr;
    if (with_sums) {
      block_sum.resize(rows * (k / kSteps));
      block_sums(x, rows, k, block_sum.data());
      sums = block_sum.data();
    }
  }
};

// Every group of up to three column tiles of y [rows <= 16, 16 col_tiles] = x [rows, k] @ W^T:
// fn(step, col0, column tiles), the tiles configured for `rows`. Each thread takes a run of
// neighbouring groups (work_sharing.h's owned items), so it streams one stretch of the records
// (and writes one stretch of y's columns), where from a shared counter the threads took every
// other group: real 16-row decode steps, alternating processes (forty-fourth session), 16
// prompts of 300 tokens 0.91-0.96x, 16 requests over a shared 1,024-token prefix 0.87-0.98x.
template <typename Fn>
void for_each_short_tile(const float* x, int64_t rows, int64_t k, bool with_sums,
                         int64_t col_tiles, const Fn& fn) {
  const int64_t col_groups = (col_tiles + kColGroup - 1) / kColGroup;
  tokenmill_parallel::parallel_owned_items(
      col_groups,
      [&] { return std::make_unique<ShortStep>(x, rows, k, with_sums); },
      [&](const std::unique_ptr<ShortStep>& step, int64_t item) {
        const int64_t first_col = item * kColGroup;
        fn(*step, first_col * kCols, std::min(kColGroup, col_tiles - first_col));
      });
}

#endif

}  // namespace amx

// Whether this build has the tile kernel and the OS lets this process use the tiles.
bool amx_available() {
#ifdef TOKENMILL_AMX
  return amx::request_tiles();
#else
  return false;
#endif
}

// W [N, K] fp32 -> [N / 16, K / 32, 2, 512] bf16 tiles (hi, lo), or an empty tensor when some
// weight is not exactly hi + lo (or N is not a multiple of 16, K of 32, or no AMX build).
torch::Tensor pack_amx_weight(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32,
              "pack_amx_weight: a 2-D float32 weight");
  auto none = torch::empty({0}, torch::kBFloat16);
#ifdef TOKENMILL_AMX
  const int64_t n = weight.size(0), k = weight.size(1);
  if (n % amx::kCols != 0 || k % amx::kSteps != 0 || k == 0 || !amx_available()) return none;
  auto w = weight.contiguous();
  const int64_t blocks = k / amx::kSteps;
  auto packed = torch::empty({n / amx::kCols, blocks, amx::kWTerms, amx::kTile},
                             torch::kBFloat16);
  const float* wp = w.data_ptr<float>();
  auto* out = reinterpret_cast<uint16_t*>(packed.data_ptr());
  std::atomic<bool> exact{true};
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    for (int64_t row = first; row < last && exact; ++row)
      for (int64_t c = 0; c < k; ++c) {
        const float v = wp[row * k + c], hi = amx::round_to_bf16(v), lo = v - hi;
        if (hi + lo != v || amx::round_to_bf16(lo) != lo || !amx::tile_exact(hi) ||
            !amx::tile_exact(lo)) {
          exact = false;
          return;
        }
        // VNNI order: tile row = k pair, then the 16 columns, then the pair's two k steps
        const int64_t at = ((row / amx::kCols * blocks + c / amx::kSteps) * amx::kWTerms) *
                               amx::kTile +
                           (c % amx::kSteps / 2) * 2 * amx::kCols + (row % amx::kCols) * 2 + c % 2;
        out[at] = amx::bf16_bits(hi);
        out[at + amx::kTile] = amx::bf16_bits(lo);
      }
  });
  return exact ? packed : none;
#else
  return none;
#endif
}

// y = x @ W^T for x [M, K] fp32 and W packed by pack_amx_weight.
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "amx_linear: a contiguous 2-D float32 input");
  TORCH_CHECK(packed.dim() == 4 && packed.scalar_type() == torch::kBFloat16 &&
                  packed.size(2) == amx::kWTerms && packed.size(3) == amx::kTile &&
                  packed.size(1) * amx::kSteps == x.size(1),
              "amx_linear: weight tiles do not match x");
#ifdef TOKENMILL_AMX
  const int64_t rows = x.size(0), blocks = x.size(1) / amx::kSteps;
  const int64_t col_tiles = packed.size(0), n = col_tiles * amx::kCols;
  auto y = torch::empty({rows, n}, x.options());
  if (rows == 0) return y;
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  float* yp = y.data_ptr<float>();
  amx::for_each_tile(x.data_ptr<float>(), rows, x.size(1), col_tiles,
                     [&](const uint16_t* a, int64_t tile_terms, int64_t tiles, int64_t row0,
                         int64_t col0, int64_t cols) {
    for (int64_t t = 0; t < tiles; ++t, a += tile_terms, row0 += amx::kRows) {
      if (cols == 3)
        amx::row_block<3>(a, wp, blocks, row0, rows, col0, yp, n);
      else if (cols == 2)
        amx::row_block<2>(a, wp, blocks, row0, rows, col0, yp, n);
      else
        amx::row_block<1>(a, wp, blocks, row0, rows, col0, yp, n);
    }
  });
  return y;
#else
  TORCH_CHECK(false, "amx_linear: this build has no AMX tiles");
#endif
}

namespace {

// W [N, K] of Format's values (as gemv_blocks rebuilds them, bit for bit) -> {levels [N / 16,
// K / 32, 512] bf16 tiles (VNNI order; only with `tiles`, the tests' oracle, else [0, K / 32,
// 512]), steps d [N / 16, K / 32, 16] fp32, minimums m [K / 32, N] fp32 (Q4_1; else empty),
// and the column groups' records, which steps of every size read: [N / 48 rounded up, K / 32,
// kGroupRecord] uint8 for Q4_1 (GroupRecords: the levels in four bits, d and m), [...,
// kQ8Record] int8 for Q8_0 (Q8Records: the levels a byte each, d)}; an empty list when some
// block is not of the format (or the shape or the build does not allow the tiles).
template <typename Format>
std::vector<torch::Tensor> pack_factored(const torch::Tensor& weight, bool with_minimums,
                                         bool tiles = true) {
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == torch::kFloat32,
              "pack_amx_factored: a 2-D float32 weight");
#ifdef TOKENMILL_AMX
  const int64_t n = weight.size(0), k = weight.size(1);
  if (n % amx::kCols != 0 || k % amx::kSteps != 0 || k == 0 || !amx_available()) return {};
  auto w = weight.contiguous();
  const int64_t blocks = k / amx::kSteps, col_tiles = n / amx::kCols;
  auto levels = torch::empty({tiles ? col_tiles : 0, blocks, amx::kTile}, torch::kBFloat16);
  auto steps = torch::empty({col_tiles, blocks, amx::kCols}, torch::kFloat32);
  auto mins = torch::empty({with_minimums ? blocks : 0, n}, torch::kFloat32);
  const int64_t col_groups = (col_tiles + amx::kColGroup - 1) / amx::kColGroup;
  const int64_t record_bytes = with_minimums ? amx::kGroupRecord : amx::kQ8Record;
  auto records = torch::zeros({col_groups, blocks, record_bytes},
                              with_minimums ? torch::kUInt8 : torch::kInt8);
  const float* wp = w.data_ptr<float>();
  auto* lp = reinterpret_cast<uint16_t*>(levels.data_ptr());
  float* dp = steps.data_ptr<float>();
  float* mp = mins.data_ptr<float>();
  auto* rp = reinterpret_cast<uint8_t*>(records.data_ptr());
  std::atomic<bool> exact{true};
  at::parallel_for(0, n, 16, [&](int64_t first, int64_t last) {
    float scales[2];
    int q[amx::kSteps];
    for (int64_t row = first; row < last && exact; ++row)
      for (int64_t b = 0; b < blocks; ++b) {
        if (!Format::fit(wp + row * k + b * amx::kSteps, scales, q)) {
          exact = false;
          return;
        }
        const int64_t tile = row / amx::kCols * blocks + b, col = row % amx::kCols;
        dp[tile * amx::kCols + col] = scales[0];
        for (int64_t c = 0; c < amx::kSteps && tiles; ++c)   // VNNI order, as pack_amx_weight
          lp[tile * amx::kTile + (c / 2) * 2 * amx::kCols + col * 2 + c % 2] =
              amx::bf16_bits(static_cast<float>(q[c]));
        // The group's record of block b: level tile j, then the d of every tile, then m.
        const int64_t j = row / amx::kCols % amx::kColGroup;
        uint8_t* record = rp + (row / amx::kCols / amx::kColGroup * blocks + b) * record_bytes;
        if (!with_minimums) {   // Q8_0: bytes in the tiles' VNNI order
          for (int64_t c = 0; c < amx::kSteps; ++c)
            record[j * amx::kTile + (c / 2) * 2 * amx::kCols + col * 2 + c % 2] =
                static_cast<uint8_t>(static_cast<int8_t>(q[c]));
          reinterpret_cast<float*>(record + amx::kColGroup * amx::kTile)[j * amx::kCols + col] =
              scales[0];
          continue;
        }
        mp[b * n + row] = scales[1];
        for (int64_t c = 0; c < amx::kSteps; ++c)
          record[j * amx::kNibbleTile + amx::nibble_at(c, col)] |= q[c] << amx::nibble_shift(c);
        float* scale_at = reinterpret_cast<float*>(record + amx::kColGroup * amx::kNibbleTile);
        scale_at[j * amx::kCols + col] = scales[0];
        scale_at[(amx::kColGroup + j) * amx::kCols + col] = scales[1];
      }
  });
  if (!exact) return {};
  return {levels, steps, mins, records};
#else
  return {};
#endif
}

}  // namespace

// Q4_1 values: {levels (bf16 tiles only with `tiles`: the tests' oracle), steps, mins, records}.
std::vector<torch::Tensor> pack_amx_q4_1(torch::Tensor weight, bool tiles) {
  return pack_factored<gemv_blocks::Q4_1>(weight, true, tiles);
}

// Q8_0 values (w = d q, q in -128..127: one exact bf16 too): {levels (bf16 tiles only with
// `tiles`: the tests' oracle), steps, no mins, records}.
std::vector<torch::Tensor> pack_amx_q8_0(torch::Tensor weight, bool tiles) {
  return pack_factored<gemv_blocks::Q8_0>(weight, false, tiles);
}

namespace {

// levels: bf16 tiles, or the column groups' records (uint8: Q4_1's, int8: Q8_0's); mins empty
// for Q8_0. steps and mins as packed, records or not: they give the shape.
void check_factored(int64_t k, const torch::Tensor& levels, const torch::Tensor& steps,
                    const torch::Tensor& mins) {
  const bool nibbles = levels.scalar_type() == torch::kUInt8;
  const bool bytes = levels.scalar_type() == torch::kChar, records = nibbles || bytes;
  TORCH_CHECK(!nibbles || mins.numel() > 0, "amx_linear_factored: four-bit records are Q4_1's");
  TORCH_CHECK(!bytes || mins.numel() == 0, "amx_linear_factored: byte records are Q8_0's");
  TORCH_CHECK(steps.dim() == 3 && steps.is_contiguous() &&
                  steps.scalar_type() == torch::kFloat32 && steps.size(2) == amx::kCols &&
                  steps.size(1) * amx::kSteps == k && levels.dim() == 3 &&
                  levels.is_contiguous() &&
                  levels.sizes() ==
                      (records ? torch::IntArrayRef({(steps.size(0) + amx::kColGroup - 1) /
                                                         amx::kColGroup,
                                                     steps.size(1),
                                                     nibbles ? amx::kGroupRecord : amx::kQ8Record})
                               : torch::IntArrayRef({steps.size(0), steps.size(1), amx::kTile})) &&
                  (records || levels.scalar_type() == torch::kBFloat16) &&
                  mins.scalar_type() == torch::kFloat32 &&
                  (mins.numel() == 0 || mins.sizes() == torch::IntArrayRef(
                                            {steps.size(1), steps.size(0) * amx::kCols})),
              "amx_linear_factored: weight tiles do not match x");
}

}  // namespace

// y [rows, N] = x [rows, k] @ W^T, both dense rows, W packed by pack_amx_q4_1: the rows' block
// sums times the minimums, then each block's x . q scaled by its d. The raw
// form is what the C++ layer loop calls (kernels/entry_points.h).
void amx_linear_factored_into(const float* x, int64_t rows, int64_t k, const torch::Tensor& levels,
                          const torch::Tensor& steps, const torch::Tensor& mins, float* y) {
  check_factored(k, levels, steps, mins);
#ifdef TOKENMILL_AMX
  TORCH_CHECK(amx_available(), "amx_linear_factored: this process may not use the AMX tiles");
  const int64_t blocks = k / amx::kSteps, col_tiles = steps.size(0), n = col_tiles * amx::kCols;
  if (rows == 0) return;
  const float* dp = steps.data_ptr<float>();
  const float* mp = mins.numel() ? mins.data_ptr<float>() : nullptr;
  const int64_t stride = blocks * amx::kTile;
  // The bf16 tiles from the item's first column (col0).
  auto tiled = [&, lp = reinterpret_cast<const uint16_t*>(levels.data_ptr())](int64_t col0) {
    return amx::TiledLevels{lp + col0 / amx::kCols * stride, stride,
                            dp + col0 / amx::kCols * blocks * amx::kCols, blocks,
                            mp != nullptr ? mp + col0 : nullptr, n};
  };
  // the records of the item's column group (col0 / 48): Q4_1's (uint8) or Q8_0's (int8)
  const auto type = levels.scalar_type();
  const auto* rp = reinterpret_cast<const uint8_t*>(levels.data_ptr());
  auto group = [&](int64_t col0, int64_t record_bytes) {
    return rp + col0 / amx::kCols / amx::kColGroup * blocks * record_bytes;
  };
  // one work item from the weight's own source
  auto item = [&](const uint16_t* a, int64_t tile_terms, int64_t tiles, const float* sums,
                  int64_t row0, int64_t col0, int64_t cols) {
    if (type == torch::kUInt8)
      return amx::factored_item(a, tile_terms, tiles,
                                amx::GroupRecords{group(col0, amx::kGroupRecord), blocks}, sums,
                                blocks, row0, rows, col0, cols, y, n);
    if (type == torch::kChar)
      return amx::factored_item(a, tile_terms, tiles,
                                amx::Q8Records{group(col0, amx::kQ8Record), blocks}, sums,
                                blocks, row0, rows, col0, cols, y, n);
    amx::factored_item(a, tile_terms, tiles, tiled(col0), sums, blocks, row0, rows, col0, cols,
                       y, n);
  };
  if (rows <= amx::kRows) {
    amx::for_each_short_tile(x, rows, k, mp != nullptr, col_tiles,
                             [&](const amx::ShortStep& step, int64_t col0, int64_t cols) {
                               item(step.xs, 0, 1, step.sums, 0, col0, cols);
                             });
    return;
  }
  auto sums = torch::empty({mp != nullptr ? rows : 0, blocks}, torch::kFloat32);
  if (mp != nullptr) amx::block_sums(x, rows, k, sums.data_ptr<float>());
  const float* sp = mp != nullptr ? sums.data_ptr<float>() : nullptr;
  amx::for_each_tile(x, rows, k, col_tiles,
                     [&](const uint16_t* a, int64_t tile_terms, int64_t tiles, int64_t row0,
                         int64_t col0, int64_t cols) {
    item(a, tile_terms, tiles, sp, row0, col0, cols);
  });
#else
  TORCH_CHECK(false, "amx_linear_factored: this build has no AMX tiles");
#endif
}

// y = x @ W^T for x [M, K] fp32 and W packed by pack_amx_q4_1.
torch::Tensor amx_linear_factored(torch::Tensor x, torch::Tensor levels, torch::Tensor steps,
                              torch::Tensor mins) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous(),
              "amx_linear_factored: a contiguous 2-D float32 input");
  check_factored(x.size(1), levels, steps, mins);
  auto y = torch::empty({x.size(0), steps.size(0) * amx::kCols}, x.options());
  amx_linear_factored_into(x.data_ptr<float>(), x.size(0), x.size(1), levels, steps, mins,
                       y.data_ptr<float>());
  return y;
}

// For the C++ layer loop (kernels/entry_points.h).
std::vector<pybind11::capsule> entry_points() {
  using namespace tokenmill_entry;
  return {export_entry<AmxLinearFactoredIntoFn>(&amx_linear_factored_into,
                                            "tokenmill.amx_linear_factored_into")};
}
