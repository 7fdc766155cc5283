// One staged call's copies: the caller's tensors copied onto the target device (one
// transfer per tensor, one per list as a flat buffer), buffers for the results, and
// which of them the write-back writes where.
#include <ATen/record_function.h>

#include "staging.h"
#include "torch_releases.h"

namespace comm_native {
namespace {

template <typename F>
Tensors each(const Tensors& tensors, F&& stage) {
  Tensors staged;
  staged.reserve(tensors.size());
  for (const auto& tensor : tensors) staged.push_back(stage(tensor));
  return staged;
}

int64_t total(const Tensors& list) {
  int64_t numel = 0;
  for (const auto& tensor : list) numel += tensor.numel();
  return numel;
}

// The list's tensors end to end, where they are (on the host for CPU tensors): no transfer.
at::Tensor joined(const Tensors& list) {
  Tensors flat;
  flat.reserve(list.size());
  for (const auto& tensor : list) flat.push_back(tensor.reshape(-1));
  return at::cat(flat);
}

// Views of `flat` shaped as the tensors of `like`, end to end.
Tensors views(const at::Tensor& flat, const Tensors& like) {
  Tensors parts;
  int64_t offset = 0;
  for (const auto& tensor : like) {
    parts.push_back(flat.narrow(0, offset, tensor.numel()).view(tensor.sizes()));
    offset += tensor.numel();
  }
  return parts;
}

} // namespace

StagedCall::StagedCall(const char* name, at::Device target, int groupSize, c10d::Backend& communicator,
                       const std::set<std::string>& averagesIntegers)
    : name_(name), target_(target), groupSize_(groupSize), communicator_(communicator),
      averagesIntegers_(averagesIntegers) {}

void StagedCall::noteSource(const at::Tensor& tensor) {
  if (!source_) source_ = tensor.device();
}

at::Tensor copyOnto(const at::Tensor& tensor, at::Device target) {
  if (!tensor.device().is_cpu() || target.is_cpu()) {
    return at::_to_copy(tensor, tensor.options().device(target), /*non_blocking=*/false, at::MemoryFormat::Contiguous);
  }
  // From pageable memory a copy to the device blocks the host until the current stream
  // has run everything queued on it, non-blocking or not (torch_npu synchronises that
  // stream: CopyKernel.cpp:125-160 for a blocking copy, CachingHostAllocator.cpp
  // process_non_blocking_copy for a non-blocking one; CUDA stages pageable memory
  // synchronously). So the tensor goes into a pinned buffer of comm's own, whose copy to
  // the device is queued on the stream while the host goes on. comm's, even where the
  // caller's tensor is pinned: a call that writes nothing back (a send, a broadcast's
  // source) returns from wait() without waiting for that copy, and the caller may then
  // refill its tensor. The buffer is freed at once: torch's caching pinned allocator
  // (ATen/core/CachingHostAllocator.h, which torch_npu's uses) records an event on the
  // stream the copy ran on when a block is freed, and reuses the block only once it has passed.
  auto host = at::empty(tensor.sizes(), tensor.options().pinned_memory(true));
  host.copy_(tensor);
  auto staged = at::empty(tensor.sizes(), tensor.options().device(target));
  staged.copy_(host, /*non_blocking=*/true);
  return staged;
}

at::Tensor StagedCall::in(const at::Tensor& tensor) {
  RECORD_FUNCTION("comm.stage_in", std::vector<c10::IValue>());
  auto start = nowNs();
  auto staged = hold(copyOnto(tensor, target_));
  copied_.nanoseconds += nowNs() - start;
  copied_.transfers += 1;
  copied_.bytes += static_cast<int64_t>(tensor.nbytes());
  noteSource(tensor);
  return staged;
}

Tensors StagedCall::in(const Tensors& list) {
  if (!flattens(list)) return each(list, [this](const at::Tensor& t) { return in(t); });
  return views(in(joined(list)), list);
}

TensorLists StagedCall::in(const TensorLists& lists) {
  TensorLists staged;
  for (const auto& list : lists) staged.push_back(in(list));
  return staged;
}

Tensors StagedCall::inReported(const Tensors& list) {
  results_.insert(results_.end(), list.begin(), list.end());
  return in(list);
}

at::Tensor StagedCall::buffer(const at::Tensor& tensor, bool reads) {
  auto staged = reads ? in(tensor) : hold(at::empty(tensor.sizes(), tensor.options().device(target_)));
  pieces_.push_back(Piece{{tensor}, staged, reads});
  results_.push_back(tensor);
  noteSource(tensor);
  return staged;
}

at::Tensor StagedCall::out(const at::Tensor& tensor) {
  return buffer(tensor, /*reads=*/false);
}

Tensors StagedCall::out(const Tensors& list) {
  if (!flattens(list)) return each(list, [this](const at::Tensor& t) { return buffer(t, /*reads=*/false); });
  return views(flat(list, /*reads=*/false), list);
}

TensorLists StagedCall::out(const TensorLists& lists) {
  TensorLists staged;
  for (const auto& list : lists) staged.push_back(out(list));
  return staged;
}

Tensors StagedCall::inOut(const Tensors& list) {
  if (!flattens(list)) return each(list, [this](const at::Tensor& t) { return buffer(t, /*reads=*/true); });
  return views(flat(list, /*reads=*/true), list);
}

at::Tensor StagedCall::flat(const Tensors& list, bool reads) {
  auto staged = reads ? in(joined(list)) : hold(at::empty({total(list)}, list.front().options().device(target_)));
  pieces_.push_back(Piece{list, staged, reads});
  results_.insert(results_.end(), list.begin(), list.end());
  noteSource(list.front());
  return staged;
}

at::Tensor StagedCall::inFlat(const Tensors& list) {
  return in(joined(list));
}

Tensors StagedCall::scratch(const Tensors& like, int count) {
  TORCH_CHECK(like.size() == 1, "comm: one tensor expected, got ", like.size());
  Tensors buffers;
  for (int i = 0; i < count; ++i) buffers.push_back(hold(at::empty_like(like.front())));
  return buffers;
}

bool StagedCall::flattens(const Tensors& list) {
  if (list.size() < 2) return false;
  for (const auto& tensor : list) {
    if (tensor.dtype() != list.front().dtype() || tensor.device() != list.front().device()) return false;
  }
  return true;
}

c10d::ReduceOp StagedCall::reduceOp(const c10d::ReduceOp& op, const Tensors& inputs) {
  if (op.op_ == c10d::ReduceOp::AVG) {
    for (const auto& tensor : inputs) {
      if (!at::isIntegralType(tensor.scalar_type(), /*includeBool=*/true)) continue;
      auto backend = communicator_.getBackendName();
      if (averagesIntegers_.count(backend) > 0) return op;
      // gloo divides in floating point (ProcessGroupGloo), where an integer tensor fails:
      // "result type Float can't be cast to the desired output type Long".
      TORCH_CHECK(false, "ReduceOp.AVG of ", tensor.scalar_type(), " tensors cannot be staged onto ", target_.str(),
                  ": the group's backend there, ", backend,
                  ", cannot average integers (result type Float can't be cast to the desired output type ",
                  tensor.scalar_type(), "); reduce with SUM and divide");
    }
    divisor_ = groupSize_;
    return c10d::ReduceOp(c10d::ReduceOp::SUM);
  }
  if (op.op_ == c10d::ReduceOp::PREMUL_SUM) {
    auto* factor = dynamic_cast<comm_releases::PreMulSumFactor*>(op.supplement_.get());
    TORCH_CHECK(factor != nullptr, "ReduceOp.PREMUL_SUM without its factor");
    for (const auto& tensor : inputs) {
      if (factor->tensor_factor.defined()) {
        tensor.mul_(factor->tensor_factor.to(tensor.device()));
      } else {
        tensor.mul_(factor->double_factor);
      }
    }
    return c10d::ReduceOp(c10d::ReduceOp::SUM);
  }
  return op;
}

namespace {

std::string describe(const char* name, const Tally& copied, std::optional<at::Device> source, at::Device target) {
  return c10::str("comm staged ", name, ": ", copied.transfers, " tensor(s), ", copied.bytes, " bytes, ",
                  source ? source->str() : "-", " -> ", target.str(), "; the caller's tensors were not written");
}

} // namespace

std::string StagedCall::what() const {
  return describe(name_, copied_, source_, target_);
}

std::shared_ptr<WriteBack> StagedCall::writeBack() {
  auto what = [name = name_, copied = copied_, source = source_, target = target_] {
    return describe(name, copied, source, target);
  };
  return std::make_shared<WriteBack>(name_, what, std::move(pieces_), std::move(results_), divisor_,
                                     std::move(held_));
}

at::Tensor StagedCall::hold(at::Tensor buffer) {
  if (!buffer.device().is_cpu()) held_.push_back(buffer);
  return buffer;
}

void StagedCall::issued() {
  copied_.calls = 1;
  tally(name_, copied_);
}

} // namespace comm_native
