// Entry points of the CPU kernels, passed from one extension module to another as named
// Python capsules (each kernel is its own module, built with its own flags). The layer loop
// (models/layer_plan_kernel.cpp) calls them directly, without a trip through Python.

#include <cstring>
#include <vector>

namespace tokenmill_entry {

// Raw rows in, raw rows out (dense, row-major): the layer loop keeps one workspace a step,
// so no kernel allocates or dispatches per layer.
using AddRmsNormIntoFn = void(const float* x, const float* residual, const float* weight,
                              float eps, int64_t rows, int64_t n, float* out, float* sum);
using RotateHalfIntoFn = void(const float* x, int64_t tokens, int64_t heads, int64_t dim,
                              int64_t token_stride, const float* cos, const float* sin,
                              float* out);
using SiluAndMulIntoFn = void(const float* gate_up, int64_t rows, int64_t n, float* out);
using GemvIntoFn = void(const float* x, int64_t m, int64_t k, const torch::Tensor& packed,
                        float* y);
using GemvOutFeaturesFn = int64_t(const torch::Tensor& packed);
// y [m, N] = x [m, k] @ W^T for W as GGUF Q4_1 or Q8_0 values on the AMX tiles, factored
// (layers/cpu_amx.py).
using AmxLinearFactoredIntoFn = void(const float* x, int64_t m, int64_t k,
                                     const torch::Tensor& levels, const torch::Tensor& steps,
                                     const torch::Tensor& mins, float* y);
using PagedDecodeAttentionFn = void(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                                    torch::Tensor v_cache, torch::Tensor block_table,
                                    torch::Tensor seq_lens, double scale, int64_t sliding_window);
// Every prefill chunk's causal attention (chunks: [num, 4] rows of query_start, query_len,
// seq_len, offset in tables); false where the kernel does not take these shapes.
using PagedPrefillAttentionFn = bool(torch::Tensor out, torch::Tensor query, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor chunks,
                                     torch::Tensor tables, double scale);

// The template argument names the type the caller will cast back to, so a kernel whose
// signature drifts from its declaration above fails to compile.
template <typename Fn>
pybind11::capsule export_entry(Fn* fn, const char* name) {
  return pybind11::capsule(reinterpret_cast<void*>(fn), name);
}

// A kernel not `required` may be missing (null): the caller checks before it calls.
template <typename Fn>
Fn* import_entry(const std::vector<pybind11::capsule>& capsules, const char* name,
                 bool required = true) {
  for (const auto& capsule : capsules)
    if (std::strcmp(capsule.name(), name) == 0)
      return reinterpret_cast<Fn*>(capsule.get_pointer<void>());
  TORCH_CHECK(!required, "kernel entry point ", name, " not given");
  return nullptr;
}

}  // namespace tokenmill_entry
