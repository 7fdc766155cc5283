// The aclop path: operators described by tensor descriptions, data buffers and attributes,
// run by aclopCompileAndExecute (acl_op.h, acl_op_compiler.h of CANN). torch_npu takes it for
// what has no aclnn operator, chiefly tensors in private formats. Only the operators below run;
// any other fails with its name, never succeeding having done nothing.
#include "fake_cann.h"

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <cstdio>
#include <cstring>
#include <map>
#include <string>
#include <vector>

using namespace fake_cann;

struct aclTensorDesc {
  int dtype;
  std::vector<int64_t> dims;  // as stored: aclSetTensorShape's, where torch_npu sets a private format's
  int format;
  std::vector<int64_t> origin;  // as created: the logical shape
};
struct aclDataBuffer {
  void* data;
  size_t size;
};
struct aclopAttr {
  std::map<std::string, int64_t> ints;  // the integer attributes, the only kind the operators below read
};

namespace {

constexpr int kFractalNz = 29;  // aclFormat ACL_FORMAT_FRACTAL_NZ (acl_base.h)

bool base_format(int format) { return format == 0 || format == 1 || format == 2; }  // NCHW, NHWC, ND

bool same_layout(const aclTensorDesc* a, const aclTensorDesc* b) {
  return a != nullptr && b != nullptr && a->dtype == b->dtype && a->dims == b->dims && a->format == b->format;
}

at::Tensor on(const aclDataBuffer* buffer, const aclTensorDesc* desc) {
  return at::from_blob(buffer->data, desc->dims, at::TensorOptions().dtype(to_scalar_type(desc->dtype)));
}

// A matrix [..., M, N] of a base format seen as FRACTAL_NZ's blocks [..., N1, M1, m0, n0] (a 1-D
// tensor as one row), the layout CANN's TransData writes: the matrix padded with zeros to whole
// m0 x n0 blocks, the blocks column-major, each block row-major.
at::Tensor nz_from_nd(at::Tensor nd, at::IntArrayRef nz) {
  if (nd.dim() == 1) nd = nd.unsqueeze(0);
  int64_t d = static_cast<int64_t>(nz.size());
  int64_t n1 = nz[d - 4], m1 = nz[d - 3], m0 = nz[d - 2], n0 = nz[d - 1];
  at::Tensor padded = at::constant_pad_nd(nd, {0, n1 * n0 - nd.size(-1), 0, m1 * m0 - nd.size(-2)});
  std::vector<int64_t> blocks(nd.sizes().begin(), nd.sizes().end() - 2);
  for (int64_t size : {m1, m0, n1, n0}) blocks.push_back(size);
  int64_t b = static_cast<int64_t>(blocks.size());
  std::vector<int64_t> order;
  for (int64_t i = 0; i < b - 4; ++i) order.push_back(i);
  for (int64_t i : {b - 2, b - 4, b - 3, b - 1}) order.push_back(i);
  return padded.reshape(blocks).permute(order);
}

at::Tensor nd_from_nz(const at::Tensor& nz, at::IntArrayRef nd) {
  int64_t d = nz.dim();
  std::vector<int64_t> order;
  for (int64_t i = 0; i < d - 4; ++i) order.push_back(i);
  for (int64_t i : {d - 3, d - 2, d - 4, d - 1}) order.push_back(i);
  std::vector<int64_t> matrix(nz.sizes().begin(), nz.sizes().end() - 4);
  matrix.push_back(nz.size(d - 3) * nz.size(d - 2));
  matrix.push_back(nz.size(d - 4) * nz.size(d - 1));
  at::Tensor full = nz.permute(order).reshape(matrix);
  int64_t rows = nd.size() == 1 ? 1 : nd[nd.size() - 2];
  return full.narrow(-2, 0, rows).narrow(-1, 0, nd.back()).reshape(nd);
}

// What Identity writes from `in` into `out`: a copy within one layout, or a change between a base
// format and FRACTAL_NZ (the runtime inserts TransData there); nullptr for what it cannot do.
std::function<void()> identity(const aclTensorDesc* in_desc, const aclDataBuffer* in, const aclTensorDesc* out_desc,
                               const aclDataBuffer* out) {
  if (in_desc == nullptr || out_desc == nullptr || in_desc->dtype != out_desc->dtype) return nullptr;
  aclTensorDesc src = *in_desc, dst = *out_desc;
  aclDataBuffer from = *in, to = *out;
  if (same_layout(in_desc, out_desc) || (base_format(src.format) && base_format(dst.format))) {
    return [from, to] { std::memmove(to.data, from.data, std::min(from.size, to.size)); };
  }
  if (base_format(src.format) && dst.format == kFractalNz && dst.dims.size() >= 4) {
    return [src, dst, from, to] { on(&to, &dst).copy_(nz_from_nd(on(&from, &src), dst.dims)); };
  }
  if (src.format == kFractalNz && base_format(dst.format) && src.dims.size() >= 4) {
    return [src, dst, from, to] { on(&to, &dst).copy_(nd_from_nz(on(&from, &src), dst.dims)); };
  }
  return nullptr;
}

// Whether a tensor of `desc` can be read or written as its logical shape: a base format, or
// FRACTAL_NZ (through the conversions above).
bool convertible(const aclTensorDesc* desc) {
  return desc != nullptr && (base_format(desc->format) || (desc->format == kFractalNz && desc->dims.size() >= 4));
}

// A tensor's logical contents (a copy where it is stored as FRACTAL_NZ).
at::Tensor logical(const aclDataBuffer* buffer, const aclTensorDesc* desc) {
  if (base_format(desc->format)) return on(buffer, desc);
  return nd_from_nz(on(buffer, desc), desc->origin);
}

// What ConcatD writes: its inputs x0 .. x{N-1}, all of one dtype, joined along the attribute
// concat_dim (already wrapped to >= 0) into its output, as op-plugin's cat_output_nocheck asks
// (Ascend/op-plugin at 0c14e042603e393b7ac541a6cafee9aa954efa85,
// op_plugin/ops/aclops/CatKernelNpu.cpp). Tensors in FRACTAL_NZ are joined by their logical
// shapes, as the runtime's TransData around the operator would; nullptr for what it cannot do.
std::function<void()> concat(int count, const aclTensorDesc* const in_desc[], const aclDataBuffer* const in[],
                             const aclTensorDesc* out_desc, const aclDataBuffer* out, const aclopAttr* attr) {
  if (attr == nullptr || attr->ints.count("concat_dim") == 0 || !convertible(out_desc)) return nullptr;
  std::vector<aclTensorDesc> descs;
  std::vector<aclDataBuffer> buffers;
  for (int i = 0; i < count; ++i) {
    if (!convertible(in_desc[i]) || in_desc[i]->dtype != out_desc->dtype) return nullptr;
    descs.push_back(*in_desc[i]);
    buffers.push_back(*in[i]);
  }
  aclTensorDesc dst = *out_desc;
  aclDataBuffer to = *out;
  int64_t dim = attr->ints.at("concat_dim");
  return [descs, buffers, dst, to, dim] {
    std::vector<at::Tensor> parts;
    for (size_t i = 0; i < descs.size(); ++i) parts.push_back(logical(&buffers[i], &descs[i]));
    at::Tensor joined = at::cat(parts, dim);
    at::Tensor target = on(&to, &dst);
    target.copy_(base_format(dst.format) ? joined.reshape(dst.dims) : nz_from_nd(joined, dst.dims));
  };
}

}  // namespace

extern "C" {

aclTensorDesc* aclCreateTensorDesc(int dtype, int numDims, const int64_t* dims, int format) {
  std::vector<int64_t> shape(dims, dims + std::max(numDims, 0));
  return new aclTensorDesc{dtype, shape, format, shape};
}
void aclDestroyTensorDesc(const aclTensorDesc* desc) { delete desc; }
int aclSetTensorFormat(aclTensorDesc* desc, int format) {
  desc->format = format;
  return kSuccess;
}
int aclSetTensorShape(aclTensorDesc* desc, int numDims, const int64_t* dims) {
  desc->dims.assign(dims, dims + std::max(numDims, 0));
  return kSuccess;
}
int aclSetTensorPlaceMent(aclTensorDesc*, int) { return kSuccess; }
void aclSetTensorDescName(aclTensorDesc*, const char*) {}
int aclGetTensorDescType(const aclTensorDesc* desc) { return desc->dtype; }
int aclGetTensorDescFormat(const aclTensorDesc* desc) { return desc->format; }
size_t aclGetTensorDescNumDims(const aclTensorDesc* desc) { return desc->dims.size(); }
int aclGetTensorDescDimV2(const aclTensorDesc* desc, size_t index, int64_t* size) {
  if (size == nullptr || index >= desc->dims.size()) return kInvalidParam;
  *size = desc->dims[index];
  return kSuccess;
}

aclDataBuffer* aclCreateDataBuffer(void* data, size_t size) { return new aclDataBuffer{data, size}; }
int aclDestroyDataBuffer(const aclDataBuffer* buffer) {
  delete buffer;
  return kSuccess;
}

aclopAttr* aclopCreateAttr() { return new aclopAttr(); }
void aclopDestroyAttr(const aclopAttr* attr) { delete attr; }
int aclopSetAttrString(aclopAttr*, const char*, const char*) { return kSuccess; }
int aclopSetAttrBool(aclopAttr*, const char*, uint8_t) { return kSuccess; }
int aclopSetAttrInt(aclopAttr* attr, const char* name, int64_t value) {
  attr->ints[name] = value;
  return kSuccess;
}
int aclopSetAttrFloat(aclopAttr*, const char*, float) { return kSuccess; }
int aclopSetAttrDataType(aclopAttr*, const char*, int) { return kSuccess; }
int aclopSetAttrListBool(aclopAttr*, const char*, int, const uint8_t*) { return kSuccess; }
int aclopSetAttrListInt(aclopAttr*, const char*, int, const int64_t*) { return kSuccess; }
int aclopSetAttrListFloat(aclopAttr*, const char*, int, const float*) { return kSuccess; }
int aclopSetAttrListListInt(aclopAttr*, const char*, int, const int*, const int64_t* const[]) { return kSuccess; }

// Identity and ConcatD run (see identity and concat above); every other operator fails with its name.
int aclopCompileAndExecute(const char* opType, int numInputs, const aclTensorDesc* const inputDesc[],
                           const aclDataBuffer* const inputs[], int numOutputs, const aclTensorDesc* const outputDesc[],
                           aclDataBuffer* const outputs[], const aclopAttr* attr, int, int, const char*, void* stream) {
  std::string name = opType == nullptr ? "" : opType;
  std::function<void()> run;
  if (name == "Identity" && numInputs == 1 && numOutputs == 1)
    run = identity(inputDesc[0], inputs[0], outputDesc[0], outputs[0]);
  if (name == "ConcatD" && numInputs >= 1 && numOutputs == 1)
    run = concat(numInputs, inputDesc, inputs, outputDesc[0], outputs[0], attr);
  if (run) {
    stream_of(stream)->enqueue([run] {
      c10::InferenceMode no_autograd;
      run();
    });
    return kSuccess;
  }
  std::string message = "fake CANN: aclop operator " + name + " has no body in comm's fake CANN (comm/testing/cann)";
  std::fprintf(stderr, "%s\n", message.c_str());
  set_error(message);
  return kAclnnInner;
}

int aclopCompileAndExecuteV2(const char* opType, int numInputs, aclTensorDesc* inputDesc[], aclDataBuffer* inputs[],
                             int numOutputs, aclTensorDesc* outputDesc[], aclDataBuffer* outputs[], aclopAttr* attr,
                             int engine, int compile, const char* path, void* stream) {
  return aclopCompileAndExecute(opType, numInputs, inputDesc, inputs, numOutputs, outputDesc, outputs, attr, engine,
                                compile, path, stream);
}

}  // extern "C"
