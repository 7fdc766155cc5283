// aclnn: CANN's operator API, each operator computed by libtorch's CPU kernel on device memory.
//
// torch_npu (op-plugin) calls an operator in two steps: aclnnXGetWorkspaceSize(args...,
// &workspaceSize, &executor) on the host, then aclnnX(workspace, workspaceSize, executor,
// stream), which queues it on the stream. Here the first step turns each argument into a
// value (a tensor on the device memory it names, a scalar, a list) and keeps them in the
// executor; the second queues the computation on the stream's worker.
//
// Each operator is one line of the table at the end: its name, the C types of its arguments
// in op-plugin's order, and the libtorch computation. An operator torch_npu looks up that the
// table lacks is exported too (stubs.cpp, generated at build time) and fails with its name.
#include "fake_cann.h"

#include <ATen/ATen.h>
#include <ATen/Functions.h>
#include <c10/core/InferenceMode.h>

#include <cstdio>
#include <cstdlib>
#include <set>
#include <tuple>
#include <vector>

using aclDataType = int;

namespace fake_cann {

// aclDataType (acl_base.h) to torch's dtypes.
at::ScalarType to_scalar_type(aclDataType type) {
  switch (type) {
    case 0: return at::kFloat;
    case 1: return at::kHalf;
    case 2: return at::kChar;
    case 3: return at::kInt;
    case 4: return at::kByte;
    case 6: return at::kShort;
    case 7: return at::kUInt16;
    case 8: return at::kUInt32;
    case 9: return at::kLong;
    case 10: return at::kUInt64;
    case 11: return at::kDouble;
    case 12: return at::kBool;
    case 16: return at::kComplexFloat;
    case 17: return at::kComplexDouble;
    case 27: return at::kBFloat16;
    default: TORCH_CHECK(false, "fake CANN: aclDataType ", type, " has no torch dtype here");
  }
}

}  // namespace fake_cann

using namespace fake_cann;

// The handles op-plugin creates for each argument (aclCreateTensor and the rest).
struct aclTensor {
  at::Tensor tensor;
  std::vector<int64_t> view;  // what aclGetViewShape reports
};
struct aclScalar {
  at::Scalar value;
};
struct aclIntArray {
  std::vector<int64_t> values;
};
struct aclFloatArray {
  std::vector<float> values;
};
struct aclBoolArray {
  std::vector<bool> values;
};
struct aclTensorList {
  std::vector<aclTensor*> tensors;  // owned: aclDestroyTensorList destroys them
};
struct aclScalarList {
  std::vector<aclScalar*> scalars;  // owned, as a tensor list's
};
struct aclOpExecutor {
  std::string name;
  std::function<void()> run;
  bool repeatable = false;
};

namespace fake_cann {
namespace {

// An argument as the computation reads it, kept after op-plugin destroys its handle.
at::Tensor value_of(const aclTensor* t) { return t == nullptr ? at::Tensor() : t->tensor; }
at::Scalar value_of(const aclScalar* s) { return s == nullptr ? at::Scalar() : s->value; }
std::vector<int64_t> value_of(const aclIntArray* a) { return a == nullptr ? std::vector<int64_t>{} : a->values; }
std::vector<float> value_of(const aclFloatArray* a) { return a == nullptr ? std::vector<float>{} : a->values; }
std::vector<bool> value_of(const aclBoolArray* a) { return a == nullptr ? std::vector<bool>{} : a->values; }
std::vector<at::Tensor> value_of(const aclTensorList* l) {
  std::vector<at::Tensor> tensors;
  if (l != nullptr)
    for (const aclTensor* t : l->tensors) tensors.push_back(value_of(t));
  return tensors;
}
std::vector<at::Scalar> value_of(const aclScalarList* l) {
  std::vector<at::Scalar> scalars;
  if (l != nullptr)
    for (const aclScalar* s : l->scalars) scalars.push_back(value_of(s));
  return scalars;
}
template <typename T>
T value_of(T plain) {
  return plain;
}

// The first step of an operator: keep its arguments' values and what to compute with them.
template <typename Fn, typename... Args>
int prepare(const char* name, uint64_t* workspace, aclOpExecutor** executor, Fn fn, Args... args) {
  if (workspace == nullptr || executor == nullptr) return kInvalidParam;
  *workspace = 0;
  auto values = std::make_tuple(value_of(args)...);
  *executor = new aclOpExecutor{name, [fn, values]() mutable { std::apply(fn, values); }};
  return kSuccess;
}

// The second step: queue the computation on the stream. An operator that fails on the device
// says so on standard error, as a failed kernel's task error would be reported.
int launch(aclOpExecutor* executor, void* stream) {
  if (executor == nullptr) return kInvalidParam;
  stream_of(stream)->enqueue([executor] {
    try {
      c10::InferenceMode no_autograd;
      executor->run();
    } catch (const std::exception& error) {
      std::fprintf(stderr, "fake CANN: aclnn%s failed on the device: %s\n", executor->name.c_str(), error.what());
    }
    if (!executor->repeatable) delete executor;
  });
  return kSuccess;
}

}  // namespace
}  // namespace fake_cann

// Declares `aclnn<name>GetWorkspaceSize(<types>..., uint64_t*, aclOpExecutor**)` and
// `aclnn<name>(void*, uint64_t, aclOpExecutor*, aclrtStream)`, computing `fn(values...)`.
#define FC_N(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, N, ...) N
#define FC_COUNT(...) FC_N(__VA_ARGS__, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0)
#define FC_CAT_(a, b) a##b
#define FC_CAT(a, b) FC_CAT_(a, b)
#define FC_P1(t1) t1 a1
#define FC_P2(t1, t2) FC_P1(t1), t2 a2
#define FC_P3(t1, t2, t3) FC_P2(t1, t2), t3 a3
#define FC_P4(t1, t2, t3, t4) FC_P3(t1, t2, t3), t4 a4
#define FC_P5(t1, t2, t3, t4, t5) FC_P4(t1, t2, t3, t4), t5 a5
#define FC_P6(t1, t2, t3, t4, t5, t6) FC_P5(t1, t2, t3, t4, t5), t6 a6
#define FC_P7(t1, t2, t3, t4, t5, t6, t7) FC_P6(t1, t2, t3, t4, t5, t6), t7 a7
#define FC_P8(t1, t2, t3, t4, t5, t6, t7, t8) FC_P7(t1, t2, t3, t4, t5, t6, t7), t8 a8
#define FC_P9(t1, t2, t3, t4, t5, t6, t7, t8, t9) FC_P8(t1, t2, t3, t4, t5, t6, t7, t8), t9 a9
#define FC_P10(t1, t2, t3, t4, t5, t6, t7, t8, t9, t10) FC_P9(t1, t2, t3, t4, t5, t6, t7, t8, t9), t10 a10
#define FC_P11(t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11) \
  FC_P10(t1, t2, t3, t4, t5, t6, t7, t8, t9, t10), t11 a11
#define FC_P12(t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11, t12) \
  FC_P11(t1, t2, t3, t4, t5, t6, t7, t8, t9, t10, t11), t12 a12
#define FC_A1 a1
#define FC_A2 FC_A1, a2
#define FC_A3 FC_A2, a3
#define FC_A4 FC_A3, a4
#define FC_A5 FC_A4, a5
#define FC_A6 FC_A5, a6
#define FC_A7 FC_A6, a7
#define FC_A8 FC_A7, a8
#define FC_A9 FC_A8, a9
#define FC_A10 FC_A9, a10
#define FC_A11 FC_A10, a11
#define FC_A12 FC_A11, a12
#define ACLNN(name, fn, ...)                                                                                  \
  extern "C" int aclnn##name##GetWorkspaceSize(FC_CAT(FC_P, FC_COUNT(__VA_ARGS__))(__VA_ARGS__),            \
                                               uint64_t* workspace, aclOpExecutor** executor) {              \
    return prepare(#name, workspace, executor, fn, FC_CAT(FC_A, FC_COUNT(__VA_ARGS__)));                    \
  }                                                                                                           \
  extern "C" int aclnn##name(void*, uint64_t, aclOpExecutor* executor, void* stream) {                        \
    return launch(executor, stream);                                                                          \
  }

extern "C" {

// --- the argument handles --------------------------------------------------------------------

// A tensor is a view of device memory: `storageDims` elements from `data`, seen with `viewDims`
// and `strides` from `offset` (in elements), as torch's as_strided.
aclTensor* aclCreateTensor(const int64_t* viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t* stride,
                           int64_t offset, int format, const int64_t* storageDims, uint64_t storageDimsNum,
                           void* data) {
  (void)format;
  std::vector<int64_t> view(viewDims, viewDims + viewDimsNum);
  std::vector<int64_t> strides(stride, stride + viewDimsNum);
  int64_t storage = 1;
  for (uint64_t i = 0; i < storageDimsNum; ++i) storage *= storageDims[i];
  at::TensorOptions options = at::TensorOptions().dtype(to_scalar_type(dataType));
  at::Tensor base = data == nullptr ? at::empty({storage}, options) : at::from_blob(data, {storage}, options);
  return new aclTensor{base.as_strided(view, strides, offset), view};
}

int aclDestroyTensor(const aclTensor* tensor) {
  delete tensor;
  return kSuccess;
}

int aclGetViewShape(const aclTensor* tensor, int64_t** dims, uint64_t* count) {
  if (tensor == nullptr || dims == nullptr || count == nullptr) return kInvalidParam;
  *count = tensor->view.size();
  *dims = new int64_t[tensor->view.size() + 1];
  std::copy(tensor->view.begin(), tensor->view.end(), *dims);
  return kSuccess;
}

aclScalar* aclCreateScalar(void* value, aclDataType dataType) {
  at::ScalarType type = to_scalar_type(dataType);
  at::Scalar scalar;
  AT_DISPATCH_ALL_TYPES_AND_COMPLEX_AND3(at::kHalf, at::kBFloat16, at::kBool, type, "aclCreateScalar",
                                         [&] { scalar = at::Scalar(*static_cast<scalar_t*>(value)); });
  return new aclScalar{scalar};
}

int aclDestroyScalar(const aclScalar* scalar) {
  delete scalar;
  return kSuccess;
}

aclIntArray* aclCreateIntArray(const int64_t* values, uint64_t size) {
  return new aclIntArray{std::vector<int64_t>(values, values + size)};
}
int aclDestroyIntArray(const aclIntArray* array) {
  delete array;
  return kSuccess;
}

aclFloatArray* aclCreateFloatArray(const float* values, uint64_t size) {
  return new aclFloatArray{std::vector<float>(values, values + size)};
}
int aclDestroyFloatArray(const aclFloatArray* array) {
  delete array;
  return kSuccess;
}

aclBoolArray* aclCreateBoolArray(const bool* values, uint64_t size) {
  return new aclBoolArray{std::vector<bool>(values, values + size)};
}
int aclDestroyBoolArray(const aclBoolArray* array) {
  delete array;
  return kSuccess;
}

aclTensorList* aclCreateTensorList(const aclTensor* const* tensors, uint64_t size) {
  auto* list = new aclTensorList();
  for (uint64_t i = 0; i < size; ++i) list->tensors.push_back(const_cast<aclTensor*>(tensors[i]));
  return list;
}
int aclDestroyTensorList(const aclTensorList* list) {
  if (list != nullptr)
    for (aclTensor* t : list->tensors) delete t;
  delete list;
  return kSuccess;
}

aclScalarList* aclCreateScalarList(const aclScalar* const* scalars, uint64_t size) {
  auto* list = new aclScalarList();
  for (uint64_t i = 0; i < size; ++i) list->scalars.push_back(const_cast<aclScalar*>(scalars[i]));
  return list;
}
int aclDestroyScalarList(const aclScalarList* list) {
  if (list != nullptr)
    for (aclScalar* s : list->scalars) delete s;
  delete list;
  return kSuccess;
}

int aclSetAclOpExecutorRepeatable(aclOpExecutor* executor) {
  if (executor != nullptr) executor->repeatable = true;
  return kSuccess;
}
int aclDestroyAclOpExecutor(aclOpExecutor* executor) {
  delete executor;
  return kSuccess;
}

int InitHugeMemThreadLocal(void*, bool) { return kSuccess; }
void UnInitHugeMemThreadLocal(void*, bool) {}
void ReleaseHugeMem(void*, bool) {}

}  // extern "C"

// --- the operators ---------------------------------------------------------------------------

using T = const aclTensor*;
using S = const aclScalar*;
using IA = const aclIntArray*;
using TL = const aclTensorList*;
using SL = const aclScalarList*;

namespace fake_cann {
namespace {

using Tensor = at::Tensor;
using Scalar = at::Scalar;
using Ints = std::vector<int64_t>;
using Tensors = std::vector<at::Tensor>;

// Writes `value` into `out` (an operator's output), casting as a CANN kernel writes its output dtype.
void put(Tensor out, const Tensor& value) { out.copy_(value); }

}  // namespace
}  // namespace fake_cann

using namespace fake_cann;

ACLNN(InplaceZero, [](Tensor self) { self.zero_(); }, T)
ACLNN(InplaceOne, [](Tensor self) { self.fill_(1); }, T)
ACLNN(InplaceFillScalar, [](Tensor self, Scalar value) { self.fill_(value); }, T, S)
ACLNN(InplaceFillTensor, [](Tensor self, Tensor value) { self.fill_(value); }, T, T)
ACLNN(InplaceCopy, [](Tensor self, Tensor src) { self.copy_(src); }, T, T)
ACLNN(Cast, [](Tensor self, aclDataType, Tensor out) { put(out, self); }, T, aclDataType, T)
ACLNN(Add, [](Tensor a, Tensor b, Scalar alpha, Tensor out) { put(out, at::add(a, b, alpha)); }, T, T, S, T)
ACLNN(Adds, [](Tensor a, Scalar b, Scalar alpha, Tensor out) { put(out, at::add(a, b, alpha)); }, T, S, S, T)
ACLNN(InplaceAdd, [](Tensor a, Tensor b, Scalar alpha) { a.add_(b, alpha); }, T, T, S)
ACLNN(InplaceAdds, [](Tensor a, Scalar b, Scalar alpha) { a.add_(b, alpha); }, T, S, S)
ACLNN(Sub, [](Tensor a, Tensor b, Scalar alpha, Tensor out) { put(out, at::sub(a, b, alpha)); }, T, T, S, T)
ACLNN(Subs, [](Tensor a, Scalar b, Scalar alpha, Tensor out) { put(out, at::sub(a, b, alpha)); }, T, S, S, T)
ACLNN(InplaceSub, [](Tensor a, Tensor b, Scalar alpha) { a.sub_(b, alpha); }, T, T, S)
ACLNN(InplaceSubs, [](Tensor a, Scalar b, Scalar alpha) { a.sub_(b, alpha); }, T, S, S)
ACLNN(Mul, [](Tensor a, Tensor b, Tensor out) { put(out, at::mul(a, b)); }, T, T, T)
ACLNN(Muls, [](Tensor a, Scalar b, Tensor out) { put(out, at::mul(a, b)); }, T, S, T)
ACLNN(InplaceMul, [](Tensor a, Tensor b) { a.mul_(b); }, T, T)
ACLNN(InplaceMuls, [](Tensor a, Scalar b) { a.mul_(b); }, T, S)

// What every other stub returns: success, having done nothing (profiling, dumps, attributes of the
// aclop path). COMM_FAKE_CANN_TRACE=1 names each the first time it is called.
extern "C" int fake_cann_ignored(const char* name) {
  static const bool trace = std::getenv("COMM_FAKE_CANN_TRACE") != nullptr;
  static std::mutex mutex;
  static std::set<std::string> seen;
  if (trace) {
    std::lock_guard<std::mutex> lock(mutex);
    if (seen.insert(name).second) std::fprintf(stderr, "fake CANN: %s does nothing here\n", name);
  }
  return kSuccess;
}

// What every operator stub (stubs.c) returns: torch_npu reports the failure with this text.
extern "C" int fake_cann_missing(const char* name) {
  std::string message = std::string("fake CANN: ") + name + " has no body in comm's fake CANN (comm/testing/cann)";
  std::fprintf(stderr, "%s\n", message.c_str());
  set_error(message);
  return kAclnnInner;
}

// Each line: aclnn's name, the computation, and its arguments' C types in the order op-plugin
// passes them (Ascend/op-plugin at 517f2e7d0f202f38b76310706cb977ca2388ad21, op_plugin/ops/opapi/
// <Name>KernelNpuOpApi.cpp and op_plugin/config/op_plugin_functions.yaml, the `EXEC_NPU_CMD` calls).
namespace fake_cann {
namespace {

// DivMod's rounding mode (DivKernelNpuOpApi.cpp): 0 true division, 1 toward zero, 2 floor.
Tensor divide(const Tensor& a, const Tensor& b, int mode) {
  if (mode == 1) return at::div(a, b, "trunc");
  if (mode == 2) return at::div(a, b, "floor");
  return at::div(a, b);
}

std::optional<Scalar> maybe(const Scalar& s) {
  return s.isIntegral(false) || s.isFloatingPoint() || s.isBoolean() || s.isComplex() ? std::optional<Scalar>(s)
                                                                                        : std::nullopt;
}

at::OptionalIntArrayRef dims(const Ints& d) { return d.empty() ? at::OptionalIntArrayRef() : at::IntArrayRef(d); }

// `fn` of each tensor of a list, written into the matching output.
template <typename Fn>
void each(const Tensors& out, Fn fn) {
  for (size_t i = 0; i < out.size(); ++i) put(out[i], fn(i));
}

}  // namespace
}  // namespace fake_cann

using DT = aclDataType;

ACLNN(InplaceDiv, [](Tensor a, Tensor b) { a.copy_(at::div(a, b)); }, T, T)
ACLNN(InplaceDivs, [](Tensor a, Scalar b) { a.copy_(at::div(a, b)); }, T, S)
ACLNN(Div, [](Tensor a, Tensor b, Tensor out) { put(out, at::div(a, b)); }, T, T, T)
ACLNN(Divs, [](Tensor a, Scalar b, Tensor out) { put(out, at::div(a, at::scalar_tensor(b, a.options()))); }, T, S, T)
ACLNN(DivMod, [](Tensor a, Tensor b, int mode, Tensor out) { put(out, divide(a, b, mode)); }, T, T, int, T)
ACLNN(DivMods, [](Tensor a, Scalar b, int mode, Tensor out) {
  put(out, divide(a, at::scalar_tensor(b, a.options()), mode)); }, T, S, int, T)
ACLNN(InplaceDivMod, [](Tensor a, Tensor b, int mode) { a.copy_(divide(a, b, mode)); }, T, T, int)
ACLNN(InplaceDivMods, [](Tensor a, Scalar b, int mode) {
  a.copy_(divide(a, at::scalar_tensor(b, a.options()), mode)); }, T, S, int)
ACLNN(ReduceSum, [](Tensor a, Ints d, bool keep, DT type, Tensor out) {
  put(out, at::sum(a, dims(d), keep, to_scalar_type(type))); }, T, IA, bool, DT, T)
ACLNN(Mean, [](Tensor a, Ints d, bool keep, DT type, Tensor out) {
  put(out, at::mean(a, dims(d), keep, to_scalar_type(type))); }, T, IA, bool, DT, T)
ACLNN(EqTensor, [](Tensor a, Tensor b, Tensor out) { put(out, at::eq(a, b)); }, T, T, T)
ACLNN(EqScalar, [](Tensor a, Scalar b, Tensor out) { put(out, at::eq(a, b)); }, T, S, T)
ACLNN(NeTensor, [](Tensor a, Tensor b, Tensor out) { put(out, at::ne(a, b)); }, T, T, T)
ACLNN(NeScalar, [](Tensor a, Scalar b, Tensor out) { put(out, at::ne(a, b)); }, T, S, T)
ACLNN(GtTensor, [](Tensor a, Tensor b, Tensor out) { put(out, at::gt(a, b)); }, T, T, T)
ACLNN(GtScalar, [](Tensor a, Scalar b, Tensor out) { put(out, at::gt(a, b)); }, T, S, T)
ACLNN(LtTensor, [](Tensor a, Tensor b, Tensor out) { put(out, at::lt(a, b)); }, T, T, T)
ACLNN(LtScalar, [](Tensor a, Scalar b, Tensor out) { put(out, at::lt(a, b)); }, T, S, T)
ACLNN(Equal, [](Tensor a, Tensor b, Tensor out) { out.fill_(at::equal(a, b)); }, T, T, T)
ACLNN(IsClose, [](Tensor a, Tensor b, double rtol, double atol, bool nan, Tensor out) {
  put(out, at::isclose(a, b, rtol, atol, nan)); }, T, T, double, double, bool, T)
ACLNN(IsFinite, [](Tensor a, Tensor out) { put(out, at::isfinite(a)); }, T, T)
ACLNN(Max, [](Tensor a, Tensor out) { put(out, at::max(a)); }, T, T)
ACLNN(Min, [](Tensor a, Tensor out) { put(out, at::min(a)); }, T, T)
ACLNN(Maximum, [](Tensor a, Tensor b, Tensor out) { put(out, at::maximum(a, b)); }, T, T, T)
ACLNN(Minimum, [](Tensor a, Tensor b, Tensor out) { put(out, at::minimum(a, b)); }, T, T, T)
ACLNN(ArgMax, [](Tensor a, int64_t d, bool keep, Tensor out) { put(out, at::argmax(a, d, keep)); }, T, int64_t, bool, T)
ACLNN(Cumsum, [](Tensor a, int64_t d, DT type, Tensor out) { put(out, at::cumsum(a, d, to_scalar_type(type))); },
      T, int64_t, DT, T)
ACLNN(LinalgVectorNorm, [](Tensor a, Scalar ord, Ints d, bool keep, DT type, Tensor out) {
  put(out, at::linalg_vector_norm(a, ord, dims(d), keep, to_scalar_type(type))); }, T, S, IA, bool, DT, T)
ACLNN(Norm, [](Tensor a, Scalar p, Ints d, bool keep, Tensor out) {
  put(out, at::linalg_vector_norm(a.to(out.scalar_type()), p, dims(d), keep)); }, T, S, IA, bool, T)
ACLNN(Arange, [](Scalar start, Scalar end, Scalar step, Tensor out) {
  put(out, at::arange(start, end, step, out.options().dtype(at::kDouble))); }, S, S, S, T)
ACLNN(Cat, [](Tensors list, int64_t d, Tensor out) { put(out, at::cat(list, d)); }, TL, int64_t, T)
ACLNN(Stack, [](Tensors list, int64_t d, Tensor out) { put(out, at::stack(list, d)); }, TL, int64_t, T)
ACLNN(ConstantPadNd, [](Tensor a, Ints pad, Scalar value, Tensor out) {
  put(out, at::constant_pad_nd(a, pad, value)); }, T, IA, S, T)
ACLNN(IndexSelect, [](Tensor a, int64_t d, Tensor index, Tensor out) { put(out, at::index_select(a, d, index)); },
      T, int64_t, T, T)
ACLNN(Mm, [](Tensor a, Tensor b, Tensor out, int8_t) { put(out, at::mm(a, b)); }, T, T, T, int8_t)
ACLNN(Matmul, [](Tensor a, Tensor b, Tensor out, int8_t) { put(out, at::matmul(a, b)); }, T, T, T, int8_t)
ACLNN(BatchMatMul, [](Tensor a, Tensor b, Tensor out, int8_t) { put(out, at::bmm(a, b)); }, T, T, T, int8_t)
ACLNN(Addmm, [](Tensor bias, Tensor a, Tensor b, Scalar beta, Scalar alpha, Tensor out, int8_t) {
  put(out, at::addmm(bias, a, b, beta, alpha)); }, T, T, T, S, S, T, int8_t)
ACLNN(Baddbmm, [](Tensor bias, Tensor a, Tensor b, Scalar beta, Scalar alpha, Tensor out, int8_t) {
  put(out, at::baddbmm(bias, a, b, beta, alpha)); }, T, T, T, S, S, T, int8_t)
// Random numbers: the CPU generator seeded with (seed, offset): reproducible, not Philox's numbers.
ACLNN(InplaceNormal, [](Tensor a, float mean, float std, int64_t seed, int64_t offset) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed ^ (offset * 0x9E3779B97F4A7C15LL)));
  a.copy_(at::normal(mean, std, a.sizes(), gen, a.options())); }, T, float, float, int64_t, int64_t)
ACLNN(InplaceUniform, [](Tensor a, double from, double to, int64_t seed, int64_t offset) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed ^ (offset * 0x9E3779B97F4A7C15LL)));
  a.copy_(at::empty(a.sizes(), a.options()).uniform_(from, to, gen)); }, T, double, double, int64_t, int64_t)
ACLNN(Abs, [](Tensor a, Tensor out) { put(out, at::abs(a)); }, T, T)
ACLNN(Neg, [](Tensor a, Tensor out) { put(out, at::neg(a)); }, T, T)
ACLNN(Sqrt, [](Tensor a, Tensor out) { put(out, at::sqrt(a)); }, T, T)
ACLNN(InplaceSqrt, [](Tensor a) { a.sqrt_(); }, T)
ACLNN(Rsqrt, [](Tensor a, Tensor out) { put(out, at::rsqrt(a)); }, T, T)
ACLNN(Reciprocal, [](Tensor a, Tensor out) { put(out, at::reciprocal(a)); }, T, T)
ACLNN(Exp, [](Tensor a, Tensor out) { put(out, at::exp(a)); }, T, T)
ACLNN(Log, [](Tensor a, Tensor out) { put(out, at::log(a)); }, T, T)
ACLNN(LogicalNot, [](Tensor a, Tensor out) { put(out, at::logical_not(a)); }, T, T)
ACLNN(PowTensorScalar, [](Tensor a, Scalar e, Tensor out) { put(out, at::pow(a, e)); }, T, S, T)
ACLNN(PowTensorTensor, [](Tensor a, Tensor e, Tensor out) { put(out, at::pow(a, e)); }, T, T, T)
ACLNN(InplacePowTensorScalar, [](Tensor a, Scalar e) { a.pow_(e); }, T, S)
ACLNN(Clamp, [](Tensor a, Scalar lo, Scalar hi, Tensor out) { put(out, at::clamp(a, maybe(lo), maybe(hi))); },
      T, S, S, T)
ACLNN(ClampMax, [](Tensor a, Scalar hi, Tensor out) { put(out, at::clamp_max(a, hi)); }, T, S, T)
ACLNN(InplaceClampMax, [](Tensor a, Scalar hi) { a.clamp_max_(hi); }, T, S)
ACLNN(ClampMin, [](Tensor a, Scalar lo, Tensor out) { put(out, at::clamp_min(a, lo)); }, T, S, T)
ACLNN(SWhere, [](Tensor c, Tensor a, Tensor b, Tensor out) { put(out, at::where(c, a, b)); }, T, T, T, T)
ACLNN(Relu, [](Tensor a, Tensor out) { put(out, at::relu(a)); }, T, T)
ACLNN(InplaceRelu, [](Tensor a) { a.relu_(); }, T)
ACLNN(ThresholdBackward, [](Tensor g, Tensor a, Scalar t, Tensor out) { put(out, at::threshold_backward(g, a, t)); },
      T, T, S, T)
ACLNN(Silu, [](Tensor a, Tensor out) { put(out, at::silu(a)); }, T, T)
ACLNN(SiluBackward, [](Tensor g, Tensor a, Tensor out) { put(out, at::silu_backward(g, a)); }, T, T, T)
ACLNN(Softmax, [](Tensor a, int64_t d, Tensor out) { put(out, at::_softmax(a, d, false)); }, T, int64_t, T)
ACLNN(SoftmaxBackward, [](Tensor g, Tensor y, int64_t d, Tensor out) {
  put(out, at::_softmax_backward_data(g, y, d, out.scalar_type())); }, T, T, int64_t, T)
ACLNN(LogSoftmax, [](Tensor a, int64_t d, Tensor out) { put(out, at::_log_softmax(a, d, false)); }, T, int64_t, T)
ACLNN(LogSoftmaxBackward, [](Tensor g, Tensor y, int64_t d, Tensor out) {
  put(out, at::_log_softmax_backward_data(g, y, d, out.scalar_type())); }, T, T, int64_t, T)
ACLNN(NLLLoss, [](Tensor a, Tensor target, Tensor weight, int64_t reduction, int64_t ignore, Tensor out,
                  Tensor total) {
  auto result = at::nll_loss_forward(a, target, weight, reduction, ignore);
  put(out, std::get<0>(result));
  put(total, std::get<1>(result)); }, T, T, T, int64_t, int64_t, T, T)
ACLNN(NLLLossBackward, [](Tensor g, Tensor a, Tensor target, Tensor weight, int64_t reduction, int64_t ignore,
                          Tensor total, Tensor out) {
  put(out, at::nll_loss_backward(g, a, target, weight, reduction, ignore, total)); },
      T, T, T, T, int64_t, int64_t, T, T)
ACLNN(MseLoss, [](Tensor a, Tensor b, int64_t reduction, Tensor out) { put(out, at::mse_loss(a, b, reduction)); },
      T, T, int64_t, T)
ACLNN(MseLossBackward, [](Tensor g, Tensor a, Tensor b, int64_t reduction, Tensor out) {
  put(out, at::mse_loss_backward(g, a, b, reduction)); }, T, T, T, int64_t, T)
ACLNN(Embedding, [](Tensor w, Tensor index, Tensor out) { put(out, at::embedding(w, index)); }, T, T, T)
ACLNN(EmbeddingDenseBackward, [](Tensor g, Tensor index, int64_t n, int64_t pad, bool freq, Tensor out) {
  put(out, at::embedding_dense_backward(g, index, n, pad, freq)); }, T, T, int64_t, int64_t, bool, T)

// The foreach operators: V2 takes its scalar as a scalar; the first versions as a one-element tensor.
ACLNN(ForeachNorm, [](Tensors x, Scalar ord, Tensors out) {
  each(out, [&](size_t i) { return at::linalg_vector_norm(x[i], ord); }); }, TL, S, TL)
ACLNN(ForeachCopy, [](Tensors src, Tensors dst) { each(dst, [&](size_t i) { return src[i]; }); }, TL, TL)
ACLNN(ForeachZeroInplace, [](Tensors x) { for (auto& t : x) t.zero_(); }, TL)
ACLNN(ForeachSqrt, [](Tensors x, Tensors out) { each(out, [&](size_t i) { return at::sqrt(x[i]); }); }, TL, TL)
ACLNN(ForeachMulScalarV2, [](Tensors x, Scalar s, Tensors out) { each(out, [&](size_t i) { return x[i] * s; }); },
      TL, S, TL)
ACLNN(ForeachMulScalar, [](Tensors x, Tensor s, Tensors out) { each(out, [&](size_t i) { return x[i] * s; }); },
      TL, T, TL)
ACLNN(ForeachMulScalarList, [](Tensors x, std::vector<Scalar> s, Tensors out) {
  each(out, [&](size_t i) { return x[i] * s[i]; }); }, TL, SL, TL)
ACLNN(ForeachMulList, [](Tensors x, Tensors y, Tensors out) { each(out, [&](size_t i) { return x[i] * y[i]; }); },
      TL, TL, TL)
ACLNN(ForeachAddListV2, [](Tensors x, Tensors y, Scalar alpha, Tensors out) {
  each(out, [&](size_t i) { return at::add(x[i], y[i], alpha); }); }, TL, TL, S, TL)
ACLNN(ForeachAddList, [](Tensors x, Tensors y, Tensor alpha, Tensors out) {
  each(out, [&](size_t i) { return x[i] + y[i] * alpha; }); }, TL, TL, T, TL)
ACLNN(ForeachAddScalarV2, [](Tensors x, Scalar s, Tensors out) { each(out, [&](size_t i) { return x[i] + s; }); },
      TL, S, TL)
ACLNN(ForeachAddScalar, [](Tensors x, Tensor s, Tensors out) { each(out, [&](size_t i) { return x[i] + s; }); },
      TL, T, TL)
ACLNN(ForeachAddScalarList, [](Tensors x, std::vector<Scalar> s, Tensors out) {
  each(out, [&](size_t i) { return x[i] + s[i]; }); }, TL, SL, TL)
ACLNN(ForeachSubListV2, [](Tensors x, Tensors y, Scalar alpha, Tensors out) {
  each(out, [&](size_t i) { return at::sub(x[i], y[i], alpha); }); }, TL, TL, S, TL)
ACLNN(ForeachSubScalarV2, [](Tensors x, Scalar s, Tensors out) { each(out, [&](size_t i) { return x[i] - s; }); },
      TL, S, TL)
ACLNN(ForeachDivScalarV2, [](Tensors x, Scalar s, Tensors out) { each(out, [&](size_t i) { return x[i] / s; }); },
      TL, S, TL)
ACLNN(ForeachDivScalar, [](Tensors x, Tensor s, Tensors out) { each(out, [&](size_t i) { return x[i] / s; }); },
      TL, T, TL)
ACLNN(ForeachDivList, [](Tensors x, Tensors y, Tensors out) { each(out, [&](size_t i) { return x[i] / y[i]; }); },
      TL, TL, TL)
ACLNN(ForeachDivScalarList, [](Tensors x, std::vector<Scalar> s, Tensors out) {
  each(out, [&](size_t i) { return x[i] / s[i]; }); }, TL, SL, TL)
ACLNN(ForeachLerpScalar, [](Tensors x, Tensors y, Scalar w, Tensors out) {
  each(out, [&](size_t i) { return at::lerp(x[i], y[i], w); }); }, TL, TL, S, TL)
ACLNN(ForeachAddcmulScalarV2, [](Tensors x, Tensors a, Tensors b, Scalar v, Tensors out) {
  each(out, [&](size_t i) { return at::addcmul(x[i], a[i], b[i], v); }); }, TL, TL, TL, S, TL)
ACLNN(ForeachAddcdivScalarV2, [](Tensors x, Tensors a, Tensors b, Scalar v, Tensors out) {
  each(out, [&](size_t i) { return at::addcdiv(x[i], a[i], b[i], v); }); }, TL, TL, TL, S, TL)
ACLNN(ChunkCat, [](Tensors list, int64_t d, int64_t chunks, Tensor out) { put(out, at::_chunk_cat(list, d, chunks)); },
      TL, int64_t, int64_t, T)
ACLNN(Repeat, [](Tensor a, Ints repeats, Tensor out) { put(out, a.repeat(repeats)); }, T, IA, T)
