// Paged attention on CPU (fp32), the kernels' entry points: decode steps and prefill chunks
// read K/V in place from the paged cache through their block tables. No gather, no padding:
// blocks shared between requests (a common prefix) are read in place and stay in cache.
//
// The build puts four files in front of this one (attention/cpu_paged.py): paged_softmax.h
// (the online softmax), paged_decode_rows.h (a decode, one request at a time),
// paged_row_tiles.h (register tiles of many query rows against a run of blocks) and
// paged_shared_lanes.h (many query rows across the vector lanes).
//
// Decodes over a common prefix of at least 4 blocks (a system prompt in the prefix cache)
// take another route, attend_with_groups below: the shared blocks are attended by all of
// the group's query heads at once (row tiles for a few rows, lanes for 12 or more), and each
// request's own blocks after them one request at a time.
//
// Prefill chunks (paged_prefill_attention) use that route's row tiles too: a chunk's tokens
// times the query heads of a kv head are the rows, causal limits mask each row's later keys.
// Against SDPA over a gathered copy with a mask (the reference path), 30 layers of SmolLM2's
// shapes: 256 new tokens over 256 cached, 98.9 -> 74.1 ms; 84 over 450, 55.8 -> 46.8 ms (AVX2
// machine). Where the build has AVX-512, those row tiles are AVX-512 ones (RowTiles), bitwise
// the same. On a 2-core Xeon, per-block AVX2 tiles -> 4-block steps with AVX-512 tiles (SDPA):
// 512 new over 2560 cached, 739 -> 409 ms (549-595); 512 over 1536, 465 -> 282 (350-383); 84
// over 450, 23.1 -> 14.4 (21-23); 3000 uncached 1.35 s (1.47-1.63).

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#ifdef __AVX2__
#include <immintrin.h>
#endif

namespace {

// ---- Requests over a shared prefix: their query heads against each shared block together ----
//
// With a common prefix (a system prompt in the prefix cache), every request of a batch reads the
// same blocks. Per request, a kv head's key row serves only its `groups` query heads, with a
// horizontal sum per key, and the loops wait on loads (about 0.6 FMA a cycle, measured). Here
// all the requests' query heads of a kv head score a shared block at once, as a small matrix
// product. A few rows: the block's keys are transposed once into a [dim, block] tile, and each
// register tile of 6 query rows x 16 keys adds rank-1 updates, 12 FMAs per 8 loads, with no
// horizontal sums; the values go the same way (6 rows x 16 dims). Many rows: the rows lie
// across the lanes, each key element broadcast against them (paged_shared_lanes.h). Each
// (group, kv head, chunk of shared blocks, pass of rows) is a work item; each request attends
// its own blocks after the prefix as one more item; the partial softmax states are merged per
// request (as the slices are).
constexpr int64_t kMinSharedBlocks = 4;   // shorter common prefixes: the per-request path

// Shared blocks per work item: the prefix cut into as few chunks as still give each thread two
// of a group's (kv head, chunk) items, at least kMinChunkBlocks long. Every item pays for its
// rows' transposes, its partial states and their merge, and its first keys' wait. 16-block
// chunks against longer ones, whole decode steps offline switched step by step in one process
// (medians, 2-core Xeon, 3 kv heads: two chunks a head): 16 requests over 1,024 shared tokens
// 16 / 32 / 64 blocks 28.54 / 28.11 / 27.88 ms, over 2,048 35.23 / 34.48 / 33.80, over 3,968
// 51.16 / 48.30 / 47.40 (124: 46.44); 8 requests over 1,024 20.25 / 20.27 / 20.43; 4 requests
// 12.80 / 12.46 (32).
constexpr int64_t kMinChunkBlocks = 16;

int64_t chunk_blocks_for(int64_t blocks, int64_t kv_heads, int64_t threads) {
  const int64_t per_head = std::max<int64_t>(1, (2 * threads + kv_heads - 1) / kv_heads);
  return std::max(kMinChunkBlocks, (blocks + per_head - 1) / per_head);
}

struct SharedGroup {
  std::vector<int64_t> members;   // request indices, ascending
  int64_t blocks;                 // leading blocks every member has, all before its last token
  int64_t chunk = kMinChunkBlocks;   // of those, per work item (chunk_blocks_for)
  int64_t chunks() const { return (blocks + chunk - 1) / chunk; }
};

// Requests grouped by their first block id, each group's common leading blocks; groups with
// fewer than kMinSharedBlocks of them, or one member, are left out.
std::vector<SharedGroup> find_shared_groups(const int64_t* table, const int64_t* lens,
                                            int64_t num, const Shape& s) {
  std::vector<int64_t> order(num);
  for (int64_t r = 0; r < num; ++r) order[r] = r;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return table[a * s.max_blocks] < table[b * s.max_blocks];
  });
  std::vector<SharedGroup> groups;
  for (int64_t i = 0; i < num;) {
    int64_t j = i;
    while (j < num && table[order[j] * s.max_blocks] == table[order[i] * s.max_blocks]) ++j;
    SharedGroup group{std::vector<int64_t>(order.begin() + i, order.begin() + j), 0};
    const int64_t* lead = table + order[i] * s.max_blocks;
    int64_t common = (lens[order[i]] - 1) / s.block_size;   // full blocks before the last token
    for (int64_t k = i + 1; k < j && common > 0; ++k) {
      const int64_t* row = table + order[k] * s.max_blocks;
      common = std::min(common, (lens[order[k]] - 1) / s.block_size);
      int64_t same = 0;
      while (same < common && row[same] == lead[same]) ++same;
      common = same;
    }
    group.blocks = common;
    group.chunk = chunk_blocks_for(common, s.kv_heads, at::get_num_threads());
    std::sort(group.members.begin(), group.members.end());
    if (group.members.size() >= 2 && common >= kMinSharedBlocks) groups.push_back(group);
    i = j;
  }
  return groups;
}

// Grows v to at least n elements, for scratch kept from call to call (whatever an earlier
// call left in it stays: the kernels write every element before they read it).
template <typename T>
void grow_to(std::vector<T>& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(n);
}

#ifdef __AVX2__
// Groups of fewer rows (requests x query heads of a kv head) take the row tiles over
// transposed keys (attend_rows), more the rows in lanes (paged_shared_lanes.h): with few rows
// the lanes are mostly padding or the broadcasts cost as much as the FMAs. Requests of
// 1,025-1,109 tokens over a 1,024-token prefix, 30 layers, SmolLM2's shapes (3 query heads a
// kv head), alternating calls (2-core Xeon), lanes against tiles: 2 requests 0.81x, 3 0.94x,
// 4 1.03-1.07x, 8 1.06-1.07x, 16 1.19-1.26x. The choice depends on the rows only, not the
// lane width.
constexpr int64_t kMinLaneRows = 12;

// One unit of work of attend_with_groups: a pass of rows (from row0 of the group's members x
// query heads) over a (group, kv head, chunk) of shared blocks, or a request's own blocks after
// its group's prefix (group < 0: a request in no group, whole).
struct WorkItem {
  int64_t group, head, chunk, request, row0;
};

// The work items of attend_with_groups: the shared ones (a pass of `pass` rows each where a
// group takes the lanes, else all its rows), then one per request.
std::vector<WorkItem> group_items(const std::vector<SharedGroup>& groups,
                                  const std::vector<int64_t>& group_of, int64_t pass,
                                  const Shape& s) {
  std::vector<WorkItem> items;
  for (size_t g = 0; g < groups.size(); ++g) {
    const int64_t rows = static_cast<int64_t>(groups[g].members.size()) * s.groups;
    const int64_t step = rows >= kMinLaneRows ? pass : rows;
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t c = 0; c < groups[g].chunks(); ++c)
        for (int64_t row0 = 0; row0 < rows; row0 += step)
          items.push_back({static_cast<int64_t>(g), h, c, -1, row0});
  }
  for (int64_t r = 0; r < static_cast<int64_t>(group_of.size()); ++r)
    items.push_back({group_of[r], 0, 0, r, 0});
  return items;
}

// What every item of attend_with_groups reads, and the parts its states go to (part p of the
// batch: heads x dim floats of acc, heads of max and sum).
struct GroupBatch {
  const std::vector<SharedGroup>& groups;
  const float *q, *kc, *vc;
  const int64_t *table, *lens;
  const std::vector<int64_t>& first_part;
  float scale;
  const Shape& s;
  float *part_acc, *part_max, *part_sum;

  // where row `row` of a group item's rows, chunk `chunk`, keeps its state; its query row
  std::pair<int64_t, const float*> row_of(const WorkItem& item, int64_t row) const {
    const int64_t request = groups[item.group].members[row / s.groups];
    const int64_t head = item.head * s.groups + row % s.groups;
    return {(first_part[request] + item.chunk) * s.heads + head,
            q + (request * s.heads + head) * s.dim};
  }
};

// A thread's scratch: attend's and the row tiles' (groups of fewer than kMinLaneRows rows),
// and the lanes'.
struct GroupScratch {
  int64_t heads, dim, block_size, pass;   // what the sizes follow
  std::vector<float> q_buf, scores, kt, acc, mx, sm;
  LaneScratch lanes;

  GroupScratch(const Shape& s, int64_t pass)
      : heads(s.heads), dim(s.dim), block_size(s.block_size), pass(pass),
        q_buf(std::max(kMinLaneRows, s.heads) * s.dim),
        scores(std::max(kMinLaneRows * step_keys(s.block_size), s.heads * s.block_size)),
        kt(s.dim * step_keys(s.block_size)), acc(kMinLaneRows * s.dim), mx(kMinLaneRows),
        sm(kMinLaneRows), lanes(s.dim, step_keys(s.block_size), pass) {}

  bool fits(const Shape& s, int64_t p) const {
    return heads == s.heads && dim == s.dim && block_size == s.block_size && pass == p;
  }
};

// The calling thread's scratch, kept from call to call rather than built anew (allocated and
// zeroed) at every call of every layer of every step.
GroupScratch& kept_scratch(const Shape& s, int64_t pass) {
  thread_local std::unique_ptr<GroupScratch> kept;
  if (kept == nullptr || !kept->fits(s, pass)) kept = std::make_unique<GroupScratch>(s, pass);
  return *kept;
}

// Calls each(request) for every request whose parts `item` writes.
template <typename Each>
void requests_of(const WorkItem& item, const std::vector<SharedGroup>& groups, int64_t pass,
                 const Shape& s, const Each& each) {
  if (item.request >= 0) return each(item.request);
  const std::vector<int64_t>& members = groups[item.group].members;
  const int64_t rows = static_cast<int64_t>(members.size()) * s.groups;
  const int64_t last = rows >= kMinLaneRows ? std::min(rows, item.row0 + pass) : rows;
  for (int64_t m = item.row0 / s.groups; m < (last + s.groups - 1) / s.groups; ++m)
    each(members[m]);
}

// The item's chunk of shared blocks and their first step asked for (while the queries gather).
std::pair<int64_t, int64_t> chunk_blocks(const WorkItem& item, const GroupBatch& batch) {
  const SharedGroup& group = batch.groups[item.group];
  const int64_t b0 = item.chunk * group.chunk, b1 = std::min(group.blocks, b0 + group.chunk);
  const int64_t* shared = batch.table + group.members[0] * batch.s.max_blocks;
  const int first = static_cast<int>(std::min<int64_t>(step_blocks(batch.s.block_size), b1 - b0));
  StepRows{batch.kc, shared + b0, first, batch.s, item.head}.prefetch(0, 1);
  StepRows{batch.vc, shared + b0, first, batch.s, item.head}.prefetch(0, 1);
  return {b0, b1};
}

// A group item of fewer than kMinLaneRows rows: all of them, in row tiles.
void attend_tile_item(const WorkItem& item, const GroupBatch& batch, GroupScratch& sc) {
  const Shape& s = batch.s;
  const int64_t dim = s.dim;
  const int n = static_cast<int>(batch.groups[item.group].members.size() * s.groups);
  const auto [b0, b1] = chunk_blocks(item, batch);
  for (int j = 0; j < n; ++j) {   // pre-scaled rows of kv head `head`
    const float* src = batch.row_of(item, j).second;
    for (int64_t d = 0; d < dim; ++d) sc.q_buf[j * dim + d] = src[d] * batch.scale;
  }
  attend_rows(sc.q_buf.data(), n, batch.kc, batch.vc,
              batch.table + batch.groups[item.group].members[0] * s.max_blocks, b0, b1,
              item.head, s, kWholeBlocks, nullptr, sc.kt.data(), sc.scores.data(),
              sc.acc.data(), sc.mx.data(), sc.sm.data());
  for (int j = 0; j < n; ++j) {
    const int64_t dst = batch.row_of(item, j).first;
    std::copy(sc.acc.data() + j * dim, sc.acc.data() + (j + 1) * dim, batch.part_acc + dst * dim);
    batch.part_max[dst] = sc.mx[j];
    batch.part_sum[dst] = sc.sm[j];
  }
}

// A group item of a pass of rows in lanes: from row0, at most `pass` of them, transposed and
// pre-scaled into the lanes' qt.
void attend_lane_item(const WorkItem& item, const GroupBatch& batch, int64_t pass,
                      LaneScratch& sc) {
  const Shape& s = batch.s;
  const int64_t dim = s.dim;
  const int64_t group_rows = static_cast<int64_t>(batch.groups[item.group].members.size()) * s.groups;
  const int n = static_cast<int>(std::min(pass, group_rows - item.row0));
  const LanePick pick = pick_lanes(n, s.wide);
  const int rp = pick.width * pick.vectors;
  const auto [b0, b1] = chunk_blocks(item, batch);
  float* rows = sc.rows.data();   // [rp][dim], then transposed (8 x 8 tiles) into qt [dim][rp]
  for (int j = 0; j < rp; ++j) {
    if (j >= n) {
      std::fill(rows + j * dim, rows + (j + 1) * dim, 0.0f);
      continue;
    }
    const float* src = batch.row_of(item, item.row0 + j).second;
    for (int64_t d = 0; d < dim; ++d) rows[j * dim + d] = src[d] * batch.scale;
  }
  transpose_tiles(rows, rp, dim, sc.qt.data());
  pick.fn(batch.kc, batch.vc, batch.table + batch.groups[item.group].members[0] * s.max_blocks,
          b0, b1, item.head, s, sc);
  transpose_tiles(sc.ot.data(), dim, rp, rows);
  for (int j = 0; j < n; ++j) {
    const int64_t dst = batch.row_of(item, item.row0 + j).first;
    std::copy(rows + j * dim, rows + (j + 1) * dim, batch.part_acc + dst * dim);
    batch.part_max[dst] = sc.mx[j];
    batch.part_sum[dst] = sc.sm[j];
  }
}

// A request's own blocks, after its group's prefix if any: its last part.
void attend_own_item(const WorkItem& item, const GroupBatch& batch, GroupScratch& sc) {
  const Shape& s = batch.s;
  const int64_t r = item.request, p = batch.first_part[r + 1] - 1, rows = s.heads;
  const int64_t start = item.group >= 0 ? batch.groups[item.group].blocks * s.block_size : 0;
  attend(batch.q + r * rows * s.dim, batch.kc, batch.vc, batch.table + r * s.max_blocks, start,
         batch.lens[r], batch.scale, s, sc.q_buf.data(), sc.scores.data(),
         batch.part_acc + p * rows * s.dim, batch.part_max + p * rows, batch.part_sum + p * rows);
}

// The batch when some requests share a prefix (find_shared_groups): every request's state is
// kept in parts, one per chunk of its group's shared blocks plus one for its own blocks, then
// merged by the thread that finishes the request's last item (a count of its items left).
// Items are claimed from a shared counter, as their sizes differ widely. The merges ran on the
// calling thread after the items, ~0.5 ms of a 16-request step over a shared prefix.
void attend_with_groups(const std::vector<SharedGroup>& groups, const float* q, const float* kc,
                        const float* vc, const int64_t* table, const int64_t* lens, int64_t num,
                        float scale, const Shape& s, float* out) {
  const int64_t rows = s.heads, dim = s.dim;
  std::vector<int64_t> group_of(num, -1), first_part(num + 1, 0);
  for (size_t g = 0; g < groups.size(); ++g)
    for (int64_t r : groups[g].members) group_of[r] = static_cast<int64_t>(g);
  for (int64_t r = 0; r < num; ++r)
    first_part[r + 1] = first_part[r] + 1 + (group_of[r] >= 0 ? groups[group_of[r]].chunks() : 0);
  const int64_t pass = lane_pass_rows(s.wide);
  const std::vector<WorkItem> items = group_items(groups, group_of, pass, s);
  const int64_t parts = first_part[num];
  // Kept by the calling thread from call to call (the other threads reach them through
  // `batch`); every part is written before it is merged.
  thread_local std::vector<float> part_acc, part_max, part_sum;
  part_acc.resize(std::max<size_t>(part_acc.size(), parts * rows * dim));
  part_max.resize(std::max<size_t>(part_max.size(), parts * rows));
  part_sum.resize(std::max<size_t>(part_sum.size(), parts * rows));
  const GroupBatch batch{groups, q, kc, vc, table, lens, first_part, scale, s,
                         part_acc.data(), part_max.data(), part_sum.data()};
  const std::unique_ptr<std::atomic<int64_t>[]> items_left(new std::atomic<int64_t>[num]());
  for (const WorkItem& item : items)
    requests_of(item, groups, pass, s, [&](int64_t r) { ++items_left[r]; });
  const auto merge = [&](int64_t r) {   // through batch: by name, each thread sees its own
    const int64_t p = first_part[r];
    merge_parts(batch.part_acc + p * rows * dim, batch.part_max + p * rows,
                batch.part_sum + p * rows, first_part[r + 1] - p, rows, dim,
                out + r * rows * dim);
  };
  // one work item at a time from the shared counter (kernels/work_sharing.h)
  tokenmill_parallel::parallel_chunks_with(
      static_cast<int64_t>(items.size()), 1, [&] { return &kept_scratch(s, pass); },
      [&](GroupScratch* scratch, int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
          const WorkItem& item = items[i];
          if (item.request >= 0)
            attend_own_item(item, batch, *scratch);
          else if (groups[item.group].members.size() * s.groups >= kMinLaneRows)
            attend_lane_item(item, batch, pass, scratch->lanes);
          else
            attend_tile_item(item, batch, *scratch);
          requests_of(item, groups, pass, s, [&](int64_t r) {
            if (items_left[r].fetch_sub(1, std::memory_order_acq_rel) == 1) merge(r);
          });
        }
      });
}
#endif

// Whether attend_rows takes the AVX-512 tiles where the build has them; tests switch them off
// to compare. Set before a call, read once by it (checked_shape).
std::atomic<bool> use_wide_tiles{kWideTiles};

// The checks both entry points make on query/out and the caches, and the shape they imply.
Shape checked_shape(const torch::Tensor& out, const torch::Tensor& query,
                    const torch::Tensor& k_cache, const torch::Tensor& v_cache,
                    int64_t max_blocks) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(),
              "query/out must be [num, heads, head_dim] of the same shape");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes(),
              "caches must be [num_blocks, block_size, kv_heads, head_dim] of the same shape");
  for (const auto* t : {&out, &query, &k_cache, &v_cache}) {
    TORCH_CHECK(t->scalar_type() == torch::kFloat32, "paged attention: float32 only");
    TORCH_CHECK(t->is_contiguous() && t->device().is_cpu(), "tensors must be contiguous, CPU");
  }
  Shape s;
  s.heads = query.size(1);
  s.dim = query.size(2);
  s.block_size = k_cache.size(1);
  s.kv_heads = k_cache.size(2);
  TORCH_CHECK(k_cache.size(3) == s.dim, "head_dim of query and caches differ");
  TORCH_CHECK(s.heads % s.kv_heads == 0, "heads must be a multiple of kv_heads");
  s.groups = s.heads / s.kv_heads;
  s.max_blocks = max_blocks;
  s.token_stride = s.kv_heads * s.dim;
  s.block_stride = s.block_size * s.token_stride;
  s.wide = use_wide_tiles;
  pick_block_fns(s.groups, s.dim, s.wide, &s.score, &s.accumulate);
  return s;
}

}  // namespace

bool paged_attention_has_avx512() { return kWideTiles; }

bool paged_attention_use_avx512(bool on) {
  use_wide_tiles = on && kWideTiles;
  return use_wide_tiles;
}

void paged_decode_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor block_table,
                            torch::Tensor seq_lens, double scale, int64_t sliding_window) {
  TORCH_CHECK(block_table.scalar_type() == torch::kInt64 && block_table.dim() == 2 &&
                  block_table.is_contiguous(), "block_table must be contiguous int64 [num, max]");
  TORCH_CHECK(seq_lens.scalar_type() == torch::kInt64 && seq_lens.is_contiguous(),
              "seq_lens must be contiguous int64 [num]");
  const Shape s = checked_shape(out, query, k_cache, v_cache, block_table.size(1));
  const int64_t num = query.size(0);
  TORCH_CHECK(block_table.size(0) == num && seq_lens.numel() == num,
              "block_table/seq_lens must have one row per query");
  if (num == 0) return;

  const float* q = query.data_ptr<float>();
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = seq_lens.data_ptr<int64_t>();
  float* o = out.data_ptr<float>();
  const int64_t num_blocks = k_cache.size(0);
  // Checked up front: nothing may throw inside the parallel region.
  for (int64_t r = 0; r < num; ++r) {
    TORCH_CHECK(lens[r] >= 1 && lens[r] <= s.max_blocks * s.block_size,
                "seq_len out of range of the block table");
    const int64_t* row = table + r * s.max_blocks;
    for (int64_t bi = 0; bi * s.block_size < lens[r]; ++bi)
      TORCH_CHECK(row[bi] >= 0 && row[bi] < num_blocks, "block id out of range");
  }
  const float fscale = static_cast<float>(scale);
#ifdef __AVX2__
  if (sliding_window <= 0 && s.dim % 8 == 0 && s.block_size % 8 == 0) {
    const std::vector<SharedGroup> groups = find_shared_groups(table, lens, num, s);
    if (!groups.empty()) {
      attend_with_groups(groups, q, kc, vc, table, lens, num, fscale, s, o);
      return;
    }
  }
#endif
  std::vector<int64_t> first_part;
  const std::vector<Slice> slices = decode_slices(lens, num, s.block_size, sliding_window,
                                                  at::get_num_threads(), first_part);
  const int64_t rows = s.heads;   // query heads of one request
  const int64_t parts = first_part[num];
  // Partial softmax state of every slice; a request in one slice is normalized in place.
  std::vector<float> part_acc(parts > num ? parts * rows * s.dim : 0), part_max(parts * rows),
      part_sum(parts * rows);
  // Each thread's scratch is kept from call to call (thread_local). Made inside the parallel
  // region, both threads' buffers came from the one heap (worker/host_memory.py) at once and
  // one slept on its lock: 15-19 futex sleeps of the main thread a step, 16 requests of 200-264
  // tokens (0.03 kept), and such decode steps 1.0-3.0% longer, in one process alternately.
  struct Scratch {
    std::vector<float> q_buf, scores, acc;
  };
  const auto make_scratch = [&] {
    thread_local Scratch kept;
    grow_to(kept.q_buf, rows * s.dim), grow_to(kept.scores, rows * s.block_size);
    grow_to(kept.acc, rows * s.dim);
    return &kept;
  };
  // one slice at a time from the shared counter (kernels/work_sharing.h)
  tokenmill_parallel::parallel_chunks_with(static_cast<int64_t>(slices.size()), 1, make_scratch,
                                           [&](Scratch* scratch, int64_t begin, int64_t end) {
    auto& [q_buf, scores, acc] = *scratch;
    for (int64_t i = begin; i < end; ++i) {
      const Slice& slice = slices[i];
      const int64_t r = slice.request;
      float* mx = part_max.data() + slice.part * rows;
      float* sm = part_sum.data() + slice.part * rows;
      float* a = slice.whole ? acc.data() : part_acc.data() + slice.part * rows * s.dim;
      attend(q + r * rows * s.dim, kc, vc, table + r * s.max_blocks, slice.start, slice.stop,
             fscale, s, q_buf.data(), scores.data(), a, mx, sm);
      if (slice.whole) normalize(a, sm, rows, s.dim, o + r * rows * s.dim);
    }
  });
  // few requests or few long ones, and tiny work: no second fork
  for (int64_t r = 0; r < num; ++r) {
    const int64_t p = first_part[r], count = first_part[r + 1] - p;
    if (count > 1)
      merge_parts(part_acc.data() + p * rows * s.dim, part_max.data() + p * rows,
                  part_sum.data() + p * rows, count, rows, s.dim, o + r * rows * s.dim);
  }
}

namespace {

// One request's prefill chunk in a step: query rows [start, start + len) at positions
// [seq_len - len, seq_len), its block table, and where its keys are transposed up front.
struct PrefillChunk {
  int64_t start, len, seq_len;
  const int64_t* table;
  int64_t steps = 0;      // kStepKeys-key steps of its context (transpose_keys_up_front)
  int64_t keys = -1;      // offset of its kv_heads * steps transposed steps (-1: none)

  int64_t rows(const Shape& s) const { return len * s.groups; }   // (token, head) rows
};

// A work item: query rows [r0, r0 + n) of a chunk (row = token * groups + head in the group)
// for one kv head; cost = rows x the keys the last of them sees.
struct PrefillItem {
  int64_t chunk, head, r0, n, cost;
};

// The chunks of `spec` ([n, 4]: first query row, query rows, seq_len, offset of the block
// table in `tables`), each checked (nothing may throw inside the parallel region); empty ones
// left out.
std::vector<PrefillChunk> checked_chunks(const torch::Tensor& spec, const torch::Tensor& tables,
                                         int64_t num_tokens, int64_t num_blocks, const Shape& s) {
  TORCH_CHECK(spec.scalar_type() == torch::kInt64 && spec.dim() == 2 && spec.size(1) == 4 &&
                  spec.is_contiguous(), "chunks must be contiguous int64 [num_chunks, 4]");
  TORCH_CHECK(tables.scalar_type() == torch::kInt64 && tables.dim() == 1 &&
                  tables.is_contiguous(), "tables must be contiguous int64 [blocks]");
  const int64_t* row = spec.data_ptr<int64_t>();
  const int64_t* all_tables = tables.data_ptr<int64_t>();
  std::vector<PrefillChunk> chunks;
  for (int64_t c = 0; c < spec.size(0); ++c, row += 4) {
    const int64_t start = row[0], len = row[1], seq_len = row[2], offset = row[3];
    const int64_t blocks = (seq_len + s.block_size - 1) / s.block_size;
    TORCH_CHECK(start >= 0 && len >= 0 && start + len <= num_tokens,
                "chunk rows out of range of the query");
    TORCH_CHECK(len <= seq_len && offset >= 0 && offset + blocks <= tables.size(0),
                "seq_len must cover the query and fit the block table");
    for (int64_t b = offset; b < offset + blocks; ++b)
      TORCH_CHECK(all_tables[b] >= 0 && all_tables[b] < num_blocks, "block id out of range");
    if (len > 0) chunks.push_back({start, len, seq_len, all_tables + offset});
  }
  return chunks;
}

// Query rows per work item: 96 when that leaves at least 4 items a thread, else 48. An item
// streams its whole context through once, so the more rows it takes the less is read (30
// layers, 48 -> 96 rows: 512 new tokens over 2560 cached 533 -> 478 ms; 3000 uncached 1.62 ->
// 1.42 s), but a short chunk over a long context needs the items to share out (32 tokens over
// 3000: 38 ms at 48 rows, 46 at 96).
int64_t prefill_rows_per_item(const std::vector<PrefillChunk>& chunks, const Shape& s,
                              int threads) {
  constexpr int64_t kMostRows = 16 * kRowTile, kItemsPerThread = 4;
  int64_t items = 0;
  for (const PrefillChunk& chunk : chunks)
    items += (chunk.rows(s) + kMostRows - 1) / kMostRows * s.kv_heads;
  return items >= kItemsPerThread * threads ? kMostRows : kMostRows / 2;
}

// Every chunk's items, the most work first across the whole step, so that the long ones are
// not left for the end.
std::vector<PrefillItem> prefill_items(const std::vector<PrefillChunk>& chunks, int64_t row_block,
                                       const Shape& s) {
  std::vector<PrefillItem> items;
  for (int64_t c = 0; c < static_cast<int64_t>(chunks.size()); ++c) {
    const PrefillChunk& chunk = chunks[c];
    const int64_t rows = chunk.rows(s);
    for (int64_t r0 = 0; r0 < rows; r0 += row_block) {
      const int64_t n = std::min(row_block, rows - r0);
      const int64_t keys = chunk.seq_len - chunk.len + (r0 + n - 1) / s.groups + 1;
      for (int64_t h = 0; h < s.kv_heads; ++h) items.push_back({c, h, r0, n, n * keys});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const PrefillItem& a, const PrefillItem& b) {
    return a.cost > b.cost;
  });
  return items;
}

#ifdef __AVX2__
// With more than two items a kv head, each would transpose the same keys: a chunk's keys are
// transposed once, up front, into the returned buffer at its `keys` offset (30 layers: 3000
// uncached tokens 1.41 -> 1.35 s, 512 over 2560 cached 471 -> 409 ms; with 2 items a head it
// did not pay, 32 tokens over 3000: 38 -> 40 ms). One fork for every chunk's steps.
std::vector<float> transpose_keys_up_front(std::vector<PrefillChunk>& chunks, int64_t row_block,
                                           const float* k_cache, const Shape& s) {
  const int64_t step_floats = s.dim * step_keys(s.block_size);
  struct KeyStep {
    const PrefillChunk* chunk;
    int64_t head, step;
  };
  std::vector<KeyStep> steps;
  int64_t floats = 0;
  for (PrefillChunk& chunk : chunks) {
    chunk.steps = (chunk.seq_len + step_keys(s.block_size) - 1) / step_keys(s.block_size);
    if ((chunk.rows(s) + row_block - 1) / row_block <= 2) continue;
    chunk.keys = floats;
    floats += s.kv_heads * chunk.steps * step_floats;
    for (int64_t h = 0; h < s.kv_heads; ++h)
      for (int64_t i = 0; i < chunk.steps; ++i) steps.push_back({&chunk, h, i});
  }
  std::vector<float> keys(floats);
  const int64_t per_step = step_blocks(s.block_size);
  tokenmill_parallel::parallel_chunks(static_cast<int64_t>(steps.size()), 1,
                                      [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const PrefillChunk& chunk = *steps[i].chunk;
      const int64_t b = steps[i].step * per_step;
      const int64_t blocks = (chunk.seq_len + s.block_size - 1) / s.block_size;
      transpose_step_keys(k_cache, chunk.table, b,
                          static_cast<int>(std::min(per_step, blocks - b)), steps[i].head, s,
                          keys.data() + chunk.keys +
                              (steps[i].head * chunk.steps + steps[i].step) * step_floats);
    }
  });
  return keys;
}
#endif

}  // namespace

// Causal attention of a step's prefill chunks, all in one call: work items across requests,
// one fork for the keys and one for the items (one call a chunk forked twice a chunk; offline,
// 16 prompts of 64-512 tokens at once in 512-token steps: the last first token 3.96 -> 3.84 s,
// 2-core Xeon). query [T, heads, head_dim], its token stride free (a view of the qkv
// projection's output); out [T, heads, head_dim]. chunks [n, 4] int64: first query row, query
// rows, seq_len, offset of the chunk's block table in `tables`. A chunk's rows are the
// positions [seq_len - rows, seq_len) of a request, attending causally to its context read in
// place through its blocks (in order; the chunk's keys and values already written). Rows of
// out in no chunk are left alone. Work item = (chunk, kv head, 48-96 query rows), rows being
// (token, query head of the group) pairs scored against each block at once (attend_rows).
// Returns false, leaving out untouched, for what it does not take (no AVX2, head_dim or
// block_size not a multiple of 8): the caller's reference path does.
bool paged_prefill_attention(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                             torch::Tensor v_cache, torch::Tensor chunks, torch::Tensor tables,
                             double scale) {
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes() && query.stride(2) == 1 &&
                  query.stride(1) == query.size(2) &&
                  query.stride(0) >= query.size(1) * query.size(2),
              "query must be [num, heads, head_dim] with contiguous heads, out of its shape");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && query.device().is_cpu(),
              "query must be float32 on the CPU");
  const Shape s = checked_shape(out, out, k_cache, v_cache, 0);
  std::vector<PrefillChunk> batch = checked_chunks(chunks, tables, query.size(0),
                                                   k_cache.size(0), s);
#ifdef __AVX2__
  if (s.dim % 8 != 0 || s.block_size % 8 != 0) return false;
  if (batch.empty()) return true;
  const int64_t row_block = prefill_rows_per_item(batch, s, at::get_num_threads());
  const int64_t dim = s.dim, step_floats = dim * step_keys(s.block_size);
  const float* kc = k_cache.data_ptr<float>();
  const float* vc = v_cache.data_ptr<float>();
  const std::vector<float> keys = transpose_keys_up_front(batch, row_block, kc, s);
  const std::vector<PrefillItem> items = prefill_items(batch, row_block, s);
  const float* q = query.data_ptr<float>();
  const int64_t q_stride = query.stride(0);
  float* o = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  struct Scratch {
    std::vector<float> q_buf, kt, scores, acc, mx, sm;
    std::vector<int64_t> pos;
  };
  // kept by each thread, as paged_decode_attention's (16- and 128-token prefills 3.5% and 4.8%
  // shorter than with a new one a call)
  const auto make_scratch = [&] {
    thread_local Scratch kept;
    grow_to(kept.q_buf, row_block * dim), grow_to(kept.kt, dim * step_keys(s.block_size));
    grow_to(kept.scores, row_block * step_keys(s.block_size));
    grow_to(kept.acc, row_block * dim), grow_to(kept.mx, row_block);
    grow_to(kept.sm, row_block), grow_to(kept.pos, row_block);
    return &kept;
  };
  tokenmill_parallel::parallel_chunks_with(static_cast<int64_t>(items.size()), 1, make_scratch,
                                           [&](Scratch* scratch, int64_t begin, int64_t end) {
    auto& [q_buf, kt, scores, acc, mx, sm, pos] = *scratch;
    for (int64_t i = begin; i < end; ++i) {
      const PrefillItem& item = items[i];
      const PrefillChunk& chunk = batch[item.chunk];
      const int64_t h = item.head, n = item.n;
      const auto row_of = [&](int64_t r) {   // (query row of out, query head)
        return std::pair{chunk.start + (item.r0 + r) / s.groups,
                         h * s.groups + (item.r0 + r) % s.groups};
      };
      for (int64_t r = 0; r < n; ++r) {
        const auto [token, head] = row_of(r);
        const float* src = q + token * q_stride + head * dim;
        for (int64_t d = 0; d < dim; ++d) q_buf[r * dim + d] = src[d] * fscale;
        pos[r] = chunk.seq_len - chunk.len + (token - chunk.start);
      }
      const float* ready =
          chunk.keys < 0 ? nullptr : keys.data() + chunk.keys + h * chunk.steps * step_floats;
      attend_rows(q_buf.data(), static_cast<int>(n), kc, vc, chunk.table, 0,
                  pos[n - 1] / s.block_size + 1, h, s, RowLimits{pos.data(), chunk.seq_len},
                  ready, kt.data(), scores.data(), acc.data(), mx.data(), sm.data());
      for (int64_t r = 0; r < n; ++r) {
        const auto [token, head] = row_of(r);
        normalize(acc.data() + r * dim, sm.data() + r, 1, dim, o + (token * s.heads + head) * dim);
      }
    }
  });
  return true;
#else
  return false;
#endif
}

// The step's new keys and values into their cache slots: key/value [tokens, kv_heads,
// head_dim], each token's heads contiguous (views into the qkv projection's rows), caches
// [num_blocks, block_size, kv_heads, head_dim]. A copy of each token's row, as index_copy_
// makes (bitwise the same), where index_copy_ cost 30-80 us a call: 3-6.5% of a prefill step
// of 16-512 tokens in its 60 calls (30 layers, K and V).
void write_kv_slots(torch::Tensor key, torch::Tensor value, torch::Tensor k_cache,
                    torch::Tensor v_cache, torch::Tensor slot_mapping) {
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() &&
                  k_cache.is_contiguous() && v_cache.is_contiguous(),
              "caches must be contiguous [num_blocks, block_size, kv_heads, head_dim] alike");
  const int64_t tokens = key.size(0), width = k_cache.size(2) * k_cache.size(3);
  for (const auto* t : {&key, &value}) {
    TORCH_CHECK(t->dim() == 3 && t->size(0) == tokens && t->size(1) == k_cache.size(2) &&
                    t->size(2) == k_cache.size(3) && t->stride(2) == 1 &&
                    t->stride(1) == t->size(2),
                "key/value must be [tokens, kv_heads, head_dim] with each token's heads "
                "contiguous");
  }
  for (const auto* t : {&key, &value, &k_cache, &v_cache})
    TORCH_CHECK(t->scalar_type() == torch::kFloat32 && t->device().is_cpu(),
                "key/value and caches must be float32 on the CPU");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == tokens, "slot_mapping must be int64, one per token");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot out of range of the caches");
  const float *k = key.data_ptr<float>(), *v = value.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t) {
    std::memcpy(kc + slots[t] * width, k + t * key.stride(0), width * sizeof(float));
    std::memcpy(vc + slots[t] * width, v + t * value.stride(0), width * sizeof(float));
  }
}

// For the C++ layer loop (kernels/entry_points.h).
std::vector<pybind11::capsule> entry_points() {
  using namespace tokenmill_entry;
  return {export_entry<PagedDecodeAttentionFn>(&paged_decode_attention,
                                               "tokenmill.paged_decode_attention"),
          export_entry<PagedPrefillAttentionFn>(&paged_prefill_attention,
                                                "tokenmill.paged_prefill_attention")};
}
