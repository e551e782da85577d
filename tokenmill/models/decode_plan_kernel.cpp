// The decode plan's layer loop in C++ (models/decode_plan.py): for a decode-only step, every
// decoder layer as the same kernel calls, in the same order, on the same tensors as the layer
// modules, so the output is bitwise theirs.
//
// From Python the loop cost about 20 dispatches per layer (the kernels, slices and views, the
// cache write, an allocation), some 600 per token at 30 layers. Here they are plain calls:
// the kernels' entry points come from their own modules as capsules (kernels/entry_points.h),
// and the new keys and values are copied into their cache slots directly. It keeps the GIL,
// as the kernels do: releasing it let the server's thread run during a step, which measured
// within the noise again (docs/benchmarks.md, 2026-11-24).
#include <cstring>

namespace {

constexpr size_t kWeightsPerLayer = 7;   // input norm, post norm, qkv, qkv bias, o, gate_up, down

struct Kernels {
  tokenmill_entry::AddRmsNormFn* add_rms_norm;
  tokenmill_entry::RotateHalfFn* rotate_half;
  tokenmill_entry::SiluAndMulFn* silu_and_mul;
  tokenmill_entry::GemvLinearFn* gemv;
  tokenmill_entry::PagedDecodeAttentionFn* attention;
};

Kernels import_kernels(const std::vector<pybind11::capsule>& capsules) {
  using namespace tokenmill_entry;
  return {import_entry<AddRmsNormFn>(capsules, "tokenmill.add_rms_norm"),
          import_entry<RotateHalfFn>(capsules, "tokenmill.rotate_half"),
          import_entry<SiluAndMulFn>(capsules, "tokenmill.silu_and_mul"),
          import_entry<GemvLinearFn>(capsules, "tokenmill.gemv_linear"),
          import_entry<PagedDecodeAttentionFn>(capsules, "tokenmill.paged_decode_attention")};
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
              "decode_layers: 7 weights and 2 caches per layer");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous(), "decode_layers: hidden [tokens, h]");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
              slot_mapping.numel() == hidden.size(0), "decode_layers: one int64 slot per token");
  for (const auto& cache : caches)   // all alike, so one range check serves every layer
    TORCH_CHECK(cache.dim() == 4 && cache.is_contiguous() &&
                cache.scalar_type() == torch::kFloat32 && cache.size(2) == kv_heads &&
                cache.size(3) == dim && cache.sizes() == caches[0].sizes(),
                "decode_layers: contiguous fp32 caches of kv_heads x dim, all of one shape");
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = caches[0].size(0) * caches[0].size(1);
  for (int64_t t = 0; t < slot_mapping.numel(); ++t)
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "decode_layers: slot out of range");
}

}  // namespace

// hidden [tokens, hidden] embeddings -> (last layer's output, residual), as the layer modules
// leave them. cos/sin [tokens, head_dim]; block_table, seq_lens as paged_decode_attention's.
std::vector<torch::Tensor> decode_layers(torch::Tensor hidden, std::vector<torch::Tensor> weights,
                                         std::vector<torch::Tensor> caches, torch::Tensor cos,
                                         torch::Tensor sin, torch::Tensor slot_mapping,
                                         torch::Tensor block_table, torch::Tensor seq_lens,
                                         double eps, int64_t heads, int64_t kv_heads,
                                         double scale, int64_t sliding_window,
                                         std::vector<pybind11::capsule> kernel_capsules) {
  const Kernels k = import_kernels(kernel_capsules);
  const int64_t n = hidden.size(0), dim = cos.size(1), qk_width = (heads + kv_heads) * dim;
  check_step(weights, caches, hidden, slot_mapping, kv_heads, dim);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  // The capsules are read: the layers need no Python, so the server's event loop runs beside
  // them. Declared after the arguments, so the GIL is back before the capsules are released.
  pybind11::gil_scoped_release no_gil;
  torch::Tensor residual = hidden.new_empty({0});   // the first norm has no residual to add
  for (size_t layer = 0; layer < caches.size() / 2; ++layer) {
    const torch::Tensor* w = weights.data() + layer * kWeightsPerLayer;
    torch::Tensor& k_cache = caches[2 * layer];
    torch::Tensor& v_cache = caches[2 * layer + 1];
    auto normed = k.add_rms_norm(hidden, residual, w[0], eps);
    residual = normed[1];
    torch::Tensor qkv = k.gemv(normed[0], w[2]);
    if (w[3].numel() > 0) qkv.add_(w[3]);
    const int64_t qkv_width = qkv.size(1);
    TORCH_CHECK(qkv_width == qk_width + kv_heads * dim, "decode_layers: qkv width");
    torch::Tensor qk = k.rotate_half(qkv.slice(1, 0, qk_width).view({n, heads + kv_heads, dim}),
                                     cos, sin);
    write_slots(qk.data_ptr<float>() + heads * dim, qk_width, slots, n, k_cache);
    write_slots(qkv.data_ptr<float>() + qk_width, qkv_width, slots, n, v_cache);
    torch::Tensor out = hidden.new_empty({n, heads, dim});
    k.attention(out, qk.slice(1, 0, heads).contiguous(), k_cache, v_cache, block_table,
                seq_lens, scale, sliding_window);
    normed = k.add_rms_norm(k.gemv(out.view({n, -1}), w[4]), residual, w[1], eps);
    residual = normed[1];
    hidden = k.gemv(k.silu_and_mul(k.gemv(normed[0], w[5])), w[6]);
  }
  return {hidden, residual};
}
