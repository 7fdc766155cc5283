// What differs between the torch releases comm builds against (2.9 to 2.15), in one place.
//
// Each name below stands for a c10d type or constant that a release renamed or added;
// the rest of the C++ uses these names only.
#pragma once

#include <torch/csrc/distributed/c10d/Types.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/version.h>

namespace comm_releases {

// ReduceOp.PREMUL_SUM's factor. Torch 2.13 renamed NCCLPreMulSumSupplement to
// PreMulSumSupplement and kept the old name as an alias, so the old name serves 2.9 to 2.15.
using PreMulSumFactor = c10d::NCCLPreMulSumSupplement;

// The OpType of reduce_scatter_tensor_coalesced: its own from torch 2.12, COALESCED before.
#if TORCH_VERSION_MAJOR > 2 || (TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR >= 12)
constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::REDUCE_SCATTER_TENSOR_COALESCED;
#else
constexpr c10d::OpType kReduceScatterTensorCoalesced = c10d::OpType::COALESCED;
#endif

} // namespace comm_releases
