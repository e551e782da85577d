// The layer plan's layer loop in C++ (models/layer_plan.py): for a step of decodes and
// prefill chunks, every decoder layer as the same kernel calls, in the same order, on the same
// tensors as the layer modules, so the output is bitwise theirs.
//
// From Python the loop cost about 20 dispatches per layer (the kernels, slices and views, the
// cache write, an allocation), some 600 per token at 30 layers. Here they are plain calls:
// the kernels' entry points come from their own modules as capsules (kernels/entry_points.h),
// and the new keys and values are copied into their cache slots directly. The activations live
// in one workspace a step and the kernels take raw rows (their "_into" forms): tensor
// allocations, views and copies per layer had cost about 5% of an 8-request step, on the main
// thread alone while the other waited.
#include <cstring>

namespace {

// input norm, post norm, qkv bias, then q|k|v, o, gate|up and down as three tensors each: the
// small-M kernel's panels and two empty tensors, or Q4_1 (Q8_0) levels on the AMX tiles, their
// steps and their minimums (none) (layers/cpu_amx.py)
constexpr size_t kWeightsPerLayer = 3 + 4 * 3;
enum LinearAt : size_t { kQkv = 3, kO = 6, kGateUp = 9, kDown = 12 };

struct Kernels {
  tokenmill_entry::AddRmsNormIntoFn* add_rms_norm;
  tokenmill_entry::RotateHalfIntoFn* rotate_half;
  tokenmill_entry::SiluAndMulIntoFn* silu_and_mul;
  tokenmill_entry::GemvIntoFn* gemv;
  tokenmill_entry::GemvOutFeaturesFn* gemv_out_features;
  tokenmill_entry::PagedDecodeAttentionFn* attention;
  tokenmill_entry::PagedPrefillAttentionFn* prefill_attention;
  tokenmill_entry::AmxLinearFactoredIntoFn* amx_linear_factored;   // null without AMX tiles

  // y [n, out] = x [n, k] @ the linear's weight (w: its three tensors).
  void linear(const float* x, int64_t n, int64_t k, const torch::Tensor* w, float* y) const {
    if (w[1].numel() == 0) return gemv(x, n, k, w[0], y);
    TORCH_CHECK(amx_linear_factored != nullptr, "run_layers: AMX tiles but no AMX kernel");
    amx_linear_factored(x, n, k, w[0], w[1], w[2], y);
  }

  int64_t out_features(const torch::Tensor* w) const {
    return w[1].numel() == 0 ? gemv_out_features(w[0]) : w[1].size(0) * w[1].size(2);
  }
};

Kernels import_kernels(const std::vector<pybind11::capsule>& capsules) {
  using namespace tokenmill_entry;
  return {import_entry<AddRmsNormIntoFn>(capsules, "tokenmill.add_rms_norm_into"),
          import_entry<RotateHalfIntoFn>(capsules, "tokenmill.rotate_half_into"),
          import_entry<SiluAndMulIntoFn>(capsules, "tokenmill.silu_and_mul_into"),
          import_entry<GemvIntoFn>(capsules, "tokenmill.gemv_into"),
          import_entry<GemvOutFeaturesFn>(capsules, "tokenmill.gemv_out_features"),
          import_entry<PagedDecodeAttentionFn>(capsules, "tokenmill.paged_decode_attention"),
          import_entry<PagedPrefillAttentionFn>(capsules, "tokenmill.paged_prefill_attention"),
          import_entry<AmxLinearFactoredIntoFn>(capsules, "tokenmill.amx_linear_factored_into",
                                            /*required=*/false)};
}

// A step's activations, [tokens, width] each, made once a step and reused by every layer;
// each tensor's rows are also kept as a raw pointer for the kernels.
struct Workspace {
  torch::Tensor hidden, residual, normed, qkv, q, k, attention, o, gate_up, act, cos, sin;
  float *hidden_p, *residual_p, *normed_p, *qkv_p, *q_p, *k_p, *attention_p, *o_p, *gate_up_p,
      *act_p, *cos_p, *sin_p;

  Workspace(const torch::Tensor& input, int64_t qkv_width, int64_t heads, int64_t kv_heads,
            int64_t dim, int64_t gate_up_width) {
    const int64_t n = input.size(0);
    const auto rows = [&](int64_t width, float*& p) {
      torch::Tensor t = input.new_empty({n, width});
      p = t.data_ptr<float>();
      return t;
    };
    hidden = rows(input.size(1), hidden_p), residual = rows(input.size(1), residual_p);
    normed = rows(input.size(1), normed_p), qkv = rows(qkv_width, qkv_p);
    q = rows(heads * dim, q_p).view({n, heads, dim}), k = rows(kv_heads * dim, k_p);
    attention = rows(heads * dim, attention_p).view({n, heads, dim});
    o = rows(input.size(1), o_p), gate_up = rows(gate_up_width, gate_up_p);
    act = rows(gate_up_width / 2, act_p);
    cos = rows(dim, cos_p), sin = rows(dim, sin_p);
  }
};

// The rotary tables' rows [max positions, dim] at each token's position, into `out` [tokens,
// dim] (positions checked by check_rotary).
void gather_rows(const torch::Tensor& table, const int64_t* positions, int64_t tokens,
                 float* out) {
  const int64_t dim = table.size(1);
  const float* rows = table.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(out + t * dim, rows + positions[t] * dim, dim * sizeof(float));
}

void check_rotary(const torch::Tensor& positions, const torch::Tensor& cos,
                  const torch::Tensor& sin, int64_t tokens) {
  TORCH_CHECK(positions.scalar_type() == torch::kInt64 && positions.is_contiguous() &&
              positions.numel() == tokens, "run_layers: one int64 position per token");
  TORCH_CHECK(cos.dim() == 2 && cos.scalar_type() == torch::kFloat32 && cos.is_contiguous() &&
              sin.is_contiguous() && cos.sizes() == sin.sizes() &&
              sin.scalar_type() == torch::kFloat32 && cos.size(1) % 2 == 0,
              "run_layers: contiguous float32 cos/sin tables [positions, head_dim], "
              "head_dim even");
  const int64_t* at = positions.data_ptr<int64_t>();
  for (int64_t t = 0; t < tokens; ++t)
    TORCH_CHECK(at[t] >= 0 && at[t] < cos.size(0), "run_layers: position ", at[t],
                " past the rotary tables (", cos.size(0), ")");
}

// rows [tokens, kv_heads * dim] (row stride `stride` floats) into the cache's slots.
void write_slots(const float* rows, int64_t stride, const int64_t* slots, int64_t tokens,
                 torch::Tensor& cache) {
  const int64_t width = cache.size(2) * cache.size(3);
  float* base = cache.data_ptr<float>();
  for (int64_t t = 0; t < tokens; ++t)
    std::memcpy(base + slots[t] * width, rows + t * stride, width * sizeof(float));
}

void check_step(const std::vector<torch::Tensor>& weights, const std::vector<torch::Tensor>& caches,
                const torch::Tensor& hidden, const torch::Tensor& slot_mapping, int64_t kv_heads,
                int64_t dim) {
  TORCH_CHECK(!weights.empty() && weights.size() % kWeightsPerLayer == 0 &&
              caches.size() == 2 * (weights.size() / kWeightsPerLayer),
              "run_layers: 15 weights and 2 caches per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "run_layers: hidden [tokens, h]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == hidden.size(0), "run_layers: one int64 slot per token");
  for (const auto& cache : caches)   // all alike, so one range check serves every layer
    TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() &&
                cache.scalar_type() == torch::kFloat32 && cache.size(2) == kv_heads &&
                cache.size(3) == dim && cache.sizes() == caches[0].sizes(),
                "run_layers: contiguous fp32 caches of kv_heads x dim, all of one shape");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = caches[0].size(0) * caches[0].size(1);
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "run_layers: slot out of range");
}

// The prefill chunks ([num, 4]: query_start, query_len, seq_len, offset in tables) cover the
// rows after the decodes and read blocks of the caches: checked before the first layer writes
// the cache, as the attention kernel checks them in each layer.
void check_chunks(const torch::Tensor& chunks, const torch::Tensor& tables, int64_t num_decodes,
                  int64_t tokens, const torch::Tensor& cache) {
  TORCH_CHECK(chunks.scalar_type() == torch::kInt64 && chunks.dim() == 2 &&
              chunks.size(1) == 4 && chunks.is_contiguous() &&
              tables.scalar_type() == torch::kInt64 && tables.dim() == 1 &&
              tables.is_contiguous(), "run_layers: int64 chunks [num, 4] and tables [blocks]");
  TORCH_CHECK(num_decodes >= 0 && num_decodes <= tokens, "run_layers: num_decodes");
  const int64_t *row = chunks.data_ptr<int64_t>(), *table = tables.data_ptr<int64_t>();
  const int64_t block_size = cache.size(1);
  for (int64_t c = 0; c < chunks.size(0); ++c, row += 4) {
    const int64_t start = row[0], len = row[1], seq_len = row[2], offset = row[3];
    const int64_t blocks = (seq_len + block_size - 1) / block_size;
    TORCH_CHECK(start >= num_decodes && len >= 0 && start + len <= tokens && len <= seq_len &&
                offset >= 0 && offset + blocks <= tables.size(0),
                "run_layers: chunk ", c, " out of range of the step or its tables");
    for (int64_t b = offset; b < offset + blocks; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < cache.size(0), "run_layers: block id");
  }
}

}  // namespace

// hidden [tokens, hidden] embeddings -> (the final norm of the last layer's output and its
// residual, the residual), as the layer modules and the model's norm leave them. cos/sin: the
// rotary tables [positions, head_dim], looked up at each token's position here (from Python,
// two index_selects took ~40 us of a one-token step). The first num_decodes tokens are decodes
// (block_table, seq_lens as paged_decode_attention's), the rest prefill chunks (chunks,
// tables as paged_prefill_attention's).
std::vector<torch::Tensor> run_layers(torch::Tensor hidden, std::vector<torch::Tensor> weights,
                                      torch::Tensor final_norm,
                                      std::vector<torch::Tensor> caches, torch::Tensor positions,
                                      torch::Tensor cos, torch::Tensor sin,
                                      torch::Tensor slot_mapping,
                                      int64_t num_decodes, torch::Tensor block_table,
                                      torch::Tensor seq_lens, torch::Tensor chunks,
                                      torch::Tensor tables, double eps, int64_t heads,
                                      int64_t kv_heads, double scale, int64_t sliding_window,
                                      std::vector<pybind11::capsule> kernel_capsules) {
  const Kernels k = import_kernels(kernel_capsules);
  check_rotary(positions, cos, sin, hidden.size(0));
  const int64_t n = hidden.size(0), h = hidden.size(1), dim = cos.size(1);
  const int64_t qk_width = (heads + kv_heads) * dim, qkv_width = qk_width + kv_heads * dim;
  check_step(weights, caches, hidden, slot_mapping, kv_heads, dim);
  check_chunks(chunks, tables, num_decodes, n, caches[0]);
  TORCH_CHECK(chunks.size(0) == 0 || sliding_window < 0,
              "run_layers: prefill chunks take no sliding window");
  TORCH_CHECK(hidden.scalar_type() == torch::kFloat32, "run_layers: float32 hidden");
  const int64_t gate_up_width = k.out_features(&weights[kGateUp]);
  // every layer checked before the first writes the cache (the linears check their K)
  const auto vector_of = [](const torch::Tensor& t, int64_t size) {
    return t.numel() == size && t.is_contiguous() && t.scalar_type() == torch::kFloat32;
  };
  TORCH_CHECK(vector_of(final_norm, h), "run_layers: a float32 final norm weight [hidden]");
  for (size_t layer = 0; layer < caches.size() / 2; ++layer) {
    const torch::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    TORCH_CHECK(vector_of(w[0], h) && vector_of(w[1], h) &&
                (w[2].numel() == 0 || vector_of(w[2], qkv_width)) &&
                k.out_features(w + kQkv) == qkv_width && k.out_features(w + kO) == h &&
                k.out_features(w + kGateUp) == gate_up_width && k.out_features(w + kDown) == h,
                "run_layers: layer ", layer, "'s weights do not fit the step's shapes");
  }
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  Workspace ws(hidden, qkv_width, heads, kv_heads, dim, gate_up_width);
  gather_rows(cos, positions.data_ptr<int64_t>(), n, ws.cos_p);
  gather_rows(sin, positions.data_ptr<int64_t>(), n, ws.sin_p);
  const float *cos_p = ws.cos_p, *sin_p = ws.sin_p;
  // the decodes' rows, as views made once (a view a layer cost ~1 us)
  const bool all_decodes = num_decodes == n;
  const torch::Tensor decode_out =
      all_decodes ? ws.attention : ws.attention.narrow(0, 0, num_decodes);
  const torch::Tensor decode_q = all_decodes ? ws.q : ws.q.narrow(0, 0, num_decodes);
  const float eps_f = static_cast<float>(eps);
  // The capsules are read: the layers need no Python, so the server's event loop runs beside
  // them. Declared after the arguments, so the GIL is back before the capsules are released.
  pybind11::gil_scoped_release no_gil;
  for (size_t layer = 0; layer < caches.size() / 2; ++layer) {
    const torch::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    // the first layer's input is the embeddings (no residual yet: the sum is the input)
    const float* input = layer == 0 ? hidden.data_ptr<float>() : ws.hidden_p;
    k.add_rms_norm(input, layer == 0 ? nullptr : ws.residual_p, w[0].data_ptr<float>(), eps_f,
                   n, h, ws.normed_p, ws.residual_p);
    k.linear(ws.normed_p, n, h, w + kQkv, ws.qkv_p);
    if (w[2].numel() > 0) {
      const float* bias = w[2].data_ptr<float>();
      for (int64_t t = 0; t < n; ++t)
        for (int64_t j = 0; j < qkv_width; ++j) ws.qkv_p[t * qkv_width + j] += bias[j];
    }
    k.rotate_half(ws.qkv_p, n, heads, dim, qkv_width, cos_p, sin_p, ws.q_p);
    k.rotate_half(ws.qkv_p + heads * dim, n, kv_heads, dim, qkv_width, cos_p, sin_p, ws.k_p);
    write_slots(ws.k_p, kv_heads * dim, slots, n, caches[2 * layer]);
    write_slots(ws.qkv_p + qk_width, qkv_width, slots, n, caches[2 * layer + 1]);
    if (num_decodes > 0)
      k.attention(decode_out, decode_q, caches[2 * layer], caches[2 * layer + 1], block_table,
                  seq_lens, scale, sliding_window);
    if (chunks.size(0) > 0)   // the plan takes such steps only where the kernel does
      TORCH_CHECK(k.prefill_attention(ws.attention, ws.q, caches[2 * layer],
                                      caches[2 * layer + 1], chunks, tables, scale),
                  "run_layers: the prefill kernel does not take these shapes");
    k.linear(ws.attention_p, n, heads * dim, w + kO, ws.o_p);
    k.add_rms_norm(ws.o_p, ws.residual_p, w[1].data_ptr<float>(), eps_f, n, h, ws.normed_p,
                   ws.residual_p);
    k.linear(ws.normed_p, n, h, w + kGateUp, ws.gate_up_p);
    k.silu_and_mul(ws.gate_up_p, n, gate_up_width / 2, ws.act_p);
    k.linear(ws.act_p, n, gate_up_width / 2, w + kDown, ws.hidden_p);
  }
  // the model's final norm, as LlamaModel.forward applies it after the layers
  k.add_rms_norm(ws.hidden_p, ws.residual_p, final_norm.data_ptr<float>(), eps_f, n, h,
                 ws.normed_p, ws.residual_p);
  return {ws.normed, ws.residual};
}
