// torch.autocast("npu"): the casts torch_npu registers at AutocastPrivateUse1.
//
// A copy of torch_npu's registrations (Ascend/pytorch master 9e73e708,
// torch_npu/csrc/aten/AutoCastOps.cpp, last changed in f52c7394), written with the
// KERNEL_PRIVATEUSEONE macros torch provides for a plugin (ATen/autocast_mode.h): its lists
// are CUDA's as torch had them before linalg_vecdot, rms_norm, vdot and the upsampling
// operators joined (those run in their input's dtype here, as on torch_npu), plus the two
// cuDNN convolutions. Operators not listed pass through, uncast.
#include <optional>

#include <ATen/autocast_mode.h>
#include <torch/library.h>

namespace comm_sim {
namespace {

using namespace at::autocast;  // the policies' names, as the macros expect them
// Names torch's norm signatures (AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE) use unqualified.
#if __has_include(<ATen/core/Dimname.h>)
using at::DimnameList;  // the list names it where the release still has named tensors (2.9; gone by 2.13)
#endif
using at::IntArrayRef;
using at::Scalar;
using at::ScalarType;
using at::Tensor;

// torch_npu's (and CUDA's) refusal: binary_cross_entropy is unsafe in lower precision.
at::Tensor binary_cross_entropy_banned(const at::Tensor&, const at::Tensor&, const std::optional<at::Tensor>&,
                                       int64_t) {
  TORCH_CHECK(false,
              "torch.nn.functional.binary_cross_entropy and torch.nn.BCELoss are unsafe to autocast.\n"
              "Many models use a sigmoid layer right before the binary cross entropy layer.\n"
              "In this case, combine the two layers using torch.nn.functional.binary_cross_entropy_with_logits\n"
              "or torch.nn.BCEWithLogitsLoss.  binary_cross_entropy_with_logits and BCEWithLogits are\n"
              "safe to autocast.");
}

TORCH_LIBRARY_IMPL(_, AutocastPrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFallthrough());
}

// The operators of each policy, in torch_npu's order: one table per policy, written as torch
// writes its own (AT_FORALL_FP32 and its kin in ATen/autocast_mode.h), each entry `_(op)` or
// `_(op, overload)`.
// lower_precision_fp: run in the autocast dtype.
#define NPU_AUTOCAST_LOWER_PRECISION_FP(_) \
  _(_convolution, deprecated) _(_convolution) _(conv1d) _(conv2d) _(conv3d) _(conv_tbc) _(conv_transpose1d) \
  _(conv_transpose2d, input) _(conv_transpose3d, input) _(convolution) _(cudnn_convolution) \
  _(cudnn_convolution_transpose) _(prelu) _(addmm) _(addmv) _(addr) _(matmul) _(einsum) _(mm) _(mv) _(linear) \
  _(addbmm) _(baddbmm) _(bmm) _(chain_matmul) _(linalg_multi_dot) _(_thnn_fused_lstm_cell) \
  _(_thnn_fused_gru_cell) _(lstm_cell) _(gru_cell) _(rnn_tanh_cell) _(rnn_relu_cell) \
  _(_scaled_dot_product_flash_attention) _(scaled_dot_product_attention)

// fp32: run in float32.
#define NPU_AUTOCAST_FP32(_) \
  _(acos) _(asin) _(cosh) _(erfinv) _(exp) _(expm1) _(log) _(log10) _(log2) _(log1p) _(reciprocal) _(rsqrt) \
  _(sinh) _(tan) _(pow, Tensor_Scalar) _(pow, Tensor_Tensor) _(pow, Scalar) _(softplus) _(layer_norm) \
  _(native_layer_norm) _(group_norm) _(frobenius_norm, dim) _(nuclear_norm) _(nuclear_norm, dim) \
  _(cosine_similarity) _(poisson_nll_loss) _(cosine_embedding_loss) _(nll_loss) _(nll_loss2d) \
  _(hinge_embedding_loss) _(kl_div) _(l1_loss) _(smooth_l1_loss) _(huber_loss) _(mse_loss) \
  _(margin_ranking_loss) _(multilabel_margin_loss) _(soft_margin_loss) _(triplet_margin_loss) \
  _(multi_margin_loss) _(binary_cross_entropy_with_logits) _(dist) _(pdist) _(cdist) _(renorm) _(logsumexp)

// fp32_set_opt_dtype: float32, unless the caller chose a dtype.
#define NPU_AUTOCAST_FP32_SET_OPT_DTYPE(_) \
  _(prod) _(prod, dim_int) _(softmax, int) _(log_softmax, int) _(cumprod) _(cumsum) _(linalg_vector_norm) \
  _(linalg_matrix_norm) _(linalg_matrix_norm, str_ord) _(sum) _(sum, dim_IntList)

// promote: the widest of the inputs' dtypes.
#define NPU_AUTOCAST_PROMOTE(_) \
  _(addcdiv) _(addcmul) _(atan2) _(bilinear) _(cross) _(dot) _(grid_sampler) _(index_put) _(tensordot) \
  _(scatter_add)

TORCH_LIBRARY_IMPL(aten, AutocastPrivateUse1, m) {
#define REGISTER_LOWER_PRECISION_FP(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, lower_precision_fp)
#define REGISTER_FP32(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32)
#define REGISTER_FP32_SET_OPT_DTYPE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, fp32_set_opt_dtype)
#define REGISTER_PROMOTE(...) KERNEL_PRIVATEUSEONE(__VA_ARGS__, promote)
  NPU_AUTOCAST_LOWER_PRECISION_FP(REGISTER_LOWER_PRECISION_FP)
  NPU_AUTOCAST_FP32(REGISTER_FP32)
  NPU_AUTOCAST_FP32_SET_OPT_DTYPE(REGISTER_FP32_SET_OPT_DTYPE)
  // fp32_append_dtype: norm, redispatched with a float32 dtype (torch's own table).
  AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE(KERNEL_DIFFERENT_REDISPATCH_SIGNATURE_PRIVATEUSEONE)
  NPU_AUTOCAST_PROMOTE(REGISTER_PROMOTE)
  m.impl(TORCH_SELECTIVE_NAME("aten::binary_cross_entropy"), TORCH_FN((&binary_cross_entropy_banned)));
}

} // namespace
} // namespace comm_sim
