// What a kernel module needs from torch, put in front of every kernel's text by
// kernels/cpp_build.py (kernels include no torch header themselves): tensors and their
// factories, TORCH_CHECK, the pybind11 casters for tensors and the GIL-free function wrappers,
// at::parallel_for. Not <torch/extension.h>, whose C++ frontend (nn, optim, data loaders) the
// kernels never use: parsing it took 30 of a kernel's ~40 s build, this 18.
#include <torch/types.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/Parallel.h>
