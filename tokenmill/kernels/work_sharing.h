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
#include <cstdint>
#include <memory>

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

// fn(state, item) for every item of [0, total), each thread first taking the items of its own
// share (the t-th of `threads` equal runs) from the front, then, when its share is done, one
// at a time from the back of the share with the most left. Items next to each other stay on
// one thread (for kernels whose neighbouring items read the same data, made by the thread that
// first needs it), while a faster thread still takes over the slower one's last items.
// Fewer than 2^32 items (a share's ends are 32 bits each).
template <typename MakeState, typename Fn>
void parallel_owned_items(int64_t total, const MakeState& make_state, const Fn& fn) {
  if (total <= 0) return;
  const int threads = static_cast<int>(std::min<int64_t>(at::get_num_threads(), total));
  // a share's [front, back) packed in one word, so that its owner and a thief cannot both
  // claim its last item
  std::unique_ptr<std::atomic<uint64_t>[]> shares(new std::atomic<uint64_t>[threads]);
  const auto pack = [](uint64_t front, uint64_t back) { return front << 32 | back; };
  for (int t = 0; t < threads; ++t)
    shares[t] = pack(total * t / threads, total * (t + 1) / threads);
  // the share's front (own) or back (stolen) item, or -1 when it is empty
  const auto claim = [&](int t, bool own) -> int64_t {
    uint64_t word = shares[t].load();
    while (true) {
      const uint64_t front = word >> 32, back = word & 0xffffffffu;
      if (front >= back) return -1;
      const uint64_t next = own ? pack(front + 1, back) : pack(front, back - 1);
      if (shares[t].compare_exchange_weak(word, next)) return own ? front : back - 1;
    }
  };
  const auto most_left = [&] {
    int best = -1;
    uint64_t left = 0;
    for (int t = 0; t < threads; ++t) {
      const uint64_t word = shares[t].load(), front = word >> 32, back = word & 0xffffffffu;
      if (back > front && back - front > left) best = t, left = back - front;
    }
    return best;
  };
  at::parallel_for(0, threads, 1, [&](int64_t first, int64_t last) {
    auto state = make_state();
    for (int64_t t = first; t < last; ++t) {
      for (int64_t item = claim(t, true); item >= 0; item = claim(t, true)) fn(state, item);
      for (int victim = most_left(); victim >= 0; victim = most_left()) {
        const int64_t item = claim(victim, false);
        if (item >= 0) fn(state, item);
      }
    }
  });
}

}  // namespace tokenmill_parallel
