// Dynamic work sharing for the CPU kernels: threads take chunks of a range from one counter.
//
// at::parallel_for hands each thread an equal, fixed share. On this VM the two cores often run
// at different speeds (the host's other load: a busy loop pinned to each core once ran 40%
// slower on one of them), and with fixed shares the faster thread then waits at the barrier: a
// profile of 12-request decode steps found the OpenMP worker idle in libgomp for 38% of its
// time while the main thread was still in the linears and attention. Taking chunks from a
// counter lets the faster thread do more of them. Which thread computes a chunk does not change
// its result, so the kernels' output stays bitwise the same.

#include <algorithm>
#include <atomic>

namespace tokenmill_parallel {

// The chunk size that gives each thread `per_thread` to 2 * `per_thread` chunks of [0, total),
// whole units (a tile's width), at least one. Rounded down, not up: 36 panels in chunks of 4
// made 9, and one thread ran the last alone (M = 16 decode linears 6% slower).
inline int64_t chunk_for(int64_t total, int64_t unit, int64_t per_thread = 8) {
  const int64_t parts = std::max<int64_t>(1, at::get_num_threads() * per_thread);
  const int64_t units = (total + unit - 1) / unit;
  return std::max<int64_t>(1, units / parts) * unit;
}

// fn(state, begin, end) over [0, total) in chunks of `chunk`, taken by the threads in turn as
// each finishes its last one. Each thread makes its `state` (scratch buffers) once, with
// make_state(), for all the chunks it takes. Inside another parallel region it all runs on
// the calling thread.
template <typename MakeState, typename Fn>
void parallel_chunks_with(int64_t total, int64_t chunk, const MakeState& make_state,
                          const Fn& fn) {
  if (total <= 0) return;
  const int64_t count = (total + chunk - 1) / chunk;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), count), 1, [&](int64_t, int64_t) {
    auto state = make_state();
    for (int64_t c = next++; c < count; c = next++)
      fn(state, c * chunk, std::min(total, (c + 1) * chunk));
  });
}

// The same without scratch: fn(begin, end).
template <typename Fn>
void parallel_chunks(int64_t total, int64_t chunk, const Fn& fn) {
  parallel_chunks_with(total, chunk, [] { return 0; },
                       [&](int, int64_t begin, int64_t end) { fn(begin, end); });
}

}  // namespace tokenmill_parallel
