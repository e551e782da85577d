// Row bookkeeping shared by the small-M linear's AVX2 tiles (layers/cpu_gemv_kernel.cpp) and
// AVX-512 tiles (layers/gemv_avx512.h).
#include <algorithm>
#include <cstdint>

namespace gemv_rows {

// Runs fn.template operator()<R>() with R = rows as a compile-time count, rows in [Lo, Hi]
// (fewer: Lo).
template <int Lo, int Hi, typename Fn>
void with_rows_in(int64_t rows, Fn&& fn) {
  if constexpr (Lo < Hi) {
    if (rows > Lo) return with_rows_in<Lo + 1, Hi>(rows, fn);
  }
  fn.template operator()<Lo>();
}

// m rows split into groups of at most max_rows, of equal size (8 rows in groups of 6: 4 + 4,
// not 6 + 2), since a tile of few rows has too few accumulators to hide the FMA latency.
struct RowGroups {
  int64_t count, base, extra;
  RowGroups(int64_t m, int64_t max_rows)
      : count(std::max<int64_t>(1, (m + max_rows - 1) / max_rows)), base(m / count),
        extra(m % count) {}
  int64_t size(int64_t g) const { return base + (g < extra ? 1 : 0); }
};

}  // namespace gemv_rows
