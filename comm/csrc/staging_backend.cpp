// Every collective and point-to-point call of c10d's Backend, staged: copy the
// caller's tensors onto the target device (one copy per tensor), run the group
// backend's own call on the copies, write the results back when the work completes.
#include <ATen/record_function.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/Types.hpp>

#include "staging.h"
#include "torch_releases.h"

namespace comm_native {
namespace {

// A finished work, for calls that return before the communicator runs them (inside
// a coalescing block of a communicator that coalesces: endCoalescing's work runs them).
class DoneWork final : public c10d::Work {
 public:
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
    future->markCompleted(c10::IValue(Tensors{}));
    return future;
  }
};

Tensors flat(const TensorLists& lists) {
  Tensors all;
  for (const auto& list : lists) all.insert(all.end(), list.begin(), list.end());
  return all;
}

} // namespace

// One staged call: the copies it makes, and which of them are written back where.
class StagingBackend::Call {
 public:
  Call(const char* name, const at::Device& target) : name_(name), target_(target) {}

  // A copy of `tensor` on the target device, for the collective to read.
  at::Tensor in(const at::Tensor& tensor) {
    RECORD_FUNCTION("comm.stage_in", std::vector<c10::IValue>());
    auto start = nowNs();
    auto staged = at::_to_copy(tensor, tensor.options().device(target_), /*non_blocking=*/false,
                               at::MemoryFormat::Contiguous);
    copied_.nanoseconds += nowNs() - start;
    copied_.transfers += 1;
    copied_.bytes += static_cast<int64_t>(tensor.nbytes());
    if (source_.empty()) source_ = tensor.device().str();
    return staged;
  }
  // A buffer on the target device for a result the collective writes into `tensor`;
  // `reads`: the collective also reads it (in-place calls), so its data is copied in.
  at::Tensor out(const at::Tensor& tensor, bool reads = false) {
    auto staged = reads ? in(tensor) : at::empty(tensor.sizes(), tensor.options().device(target_));
    pieces_.push_back(Piece{{tensor}, staged});
    results_.push_back(tensor);
    if (source_.empty()) source_ = tensor.device().str();
    return staged;
  }
  // A list the collective reads: views of one flat copy, so one transfer for the list.
  Tensors in(const Tensors& list) {
    if (!flattens(list)) return each(list, [this](const at::Tensor& t) { return in(t); });
    return views(in(joined(list)), list);
  }
  // A list the collective writes: views of one flat buffer, written back in one transfer.
  Tensors out(const Tensors& list, bool reads = false) {
    if (!flattens(list)) return each(list, [this, reads](const at::Tensor& t) { return out(t, reads); });
    return views(outFlat(list, reads), list);
  }
  // The flat buffer itself, for a coalesced all-reduce that runs as one all-reduce.
  at::Tensor outFlat(const Tensors& list, bool reads) {
    auto staged = reads ? in(joined(list)) : at::empty({total(list)}, list.front().options().device(target_));
    pieces_.push_back(Piece{list, staged});
    results_.insert(results_.end(), list.begin(), list.end());
    if (source_.empty()) source_ = list.front().device().str();
    return staged;
  }
  // Tensors the collective only reads, which its work still reports as its result
  // (a broadcast's source, a reduce's non-destination ranks), as torch's work does.
  Tensors inReported(const Tensors& list) {
    results_.insert(results_.end(), list.begin(), list.end());
    return in(list);
  }
  TensorLists in(const TensorLists& lists) {
    TensorLists staged;
    for (const auto& list : lists) staged.push_back(in(list));
    return staged;
  }
  TensorLists out(const TensorLists& lists) {
    TensorLists staged;
    for (const auto& list : lists) staged.push_back(out(list));
    return staged;
  }

  // Whether a list can travel as one flat buffer: several tensors of one dtype on one device.
  static bool flattens(const Tensors& list) {
    if (list.size() < 2) return false;
    for (const auto& tensor : list) {
      if (tensor.dtype() != list.front().dtype() || tensor.device() != list.front().device()) return false;
    }
    return true;
  }

  // The reduce op to run on the copies: ReduceOp.AVG becomes SUM, divided at the
  // write-back; PREMUL_SUM becomes SUM of the copies scaled first. Backends lack
  // both (gloo has no PREMUL_SUM, some HCCL and XCCL parts no AVG), and the copies
  // are comm's to scale. `inputs`: the copies the collective reads.
  c10d::ReduceOp reduceOp(const c10d::ReduceOp& op, const Tensors& inputs, int size) {
    if (op.op_ == c10d::ReduceOp::AVG) {
      for (const auto& tensor : inputs) at::empty({0}, tensor.options()).div_(2); // torch's error for integers
      divisor_ = size;
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
  c10d::ReduceOp reduceOp(const c10d::ReduceOp& op, const at::Tensor& input, int size) {
    return reduceOp(op, Tensors{input}, size);
  }

  // What the write-back writes, and what an error says was staged.
  std::shared_ptr<WriteBack> writeBack() {
    std::string what = c10::str(
        "comm staged ", name_, ": ", copied_.transfers, " tensor(s), ", copied_.bytes, " bytes, ",
        source_.empty() ? "-" : source_, " -> ", target_.str(), "; the caller's tensors were not written");
    return std::make_shared<WriteBack>(name_, std::move(what), std::move(pieces_), std::move(results_), divisor_);
  }

  // Counts the call and its copies in: once the communicator has taken it.
  void issued() {
    copied_.calls = 1;
    tally(name_, copied_);
  }

 private:
  template <typename F>
  static Tensors each(const Tensors& tensors, F&& stage) {
    Tensors staged;
    staged.reserve(tensors.size());
    for (const auto& tensor : tensors) staged.push_back(stage(tensor));
    return staged;
  }
  static int64_t total(const Tensors& list) {
    int64_t numel = 0;
    for (const auto& tensor : list) numel += tensor.numel();
    return numel;
  }
  // The list's tensors end to end, where they are (on the host for CPU tensors): no transfer.
  static at::Tensor joined(const Tensors& list) {
    Tensors flat;
    flat.reserve(list.size());
    for (const auto& tensor : list) flat.push_back(tensor.reshape(-1));
    return at::cat(flat);
  }
  static Tensors views(const at::Tensor& flat, const Tensors& like) {
    Tensors parts;
    int64_t offset = 0;
    for (const auto& tensor : like) {
      parts.push_back(flat.narrow(0, offset, tensor.numel()).view(tensor.sizes()));
      offset += tensor.numel();
    }
    return parts;
  }

  // Staging is the collective's own work, below autograd as torch's backends write:
  // no graph for the copies, no version bump, inference tensors included.
  at::AutoDispatchBelowADInplaceOrView belowAutograd_;
  const char* name_;
  at::Device target_;
  std::vector<Piece> pieces_;
  Tensors results_;
  int64_t divisor_ = 1;
  Tally copied_;
  std::string source_;
};

StagingBackend::StagingBackend(int rank, int size, at::Device target, CommunicatorFactory factory)
    : Backend(rank, size), target_(target), factory_(std::move(factory)), timeout_(kBackendDefaultTimeout) {}

StagingBackend::StagingBackend(int rank, int size, at::Device target, BackendPtr communicator)
    : Backend(rank, size), target_(target), communicator_(std::move(communicator)),
      timeout_(kBackendDefaultTimeout) {}

const at::Device& StagingBackend::stagingTarget() {
  communicator();
  return target_;
}

c10d::Backend& StagingBackend::communicator() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!communicator_) {
    if (!target_.has_index() && !target_.is_cpu()) {
      // The device the first staged call's thread is on: fixed from then on, for
      // every thread (a checkpoint's background thread starts on device 0).
      target_ = c10::impl::getDeviceGuardImpl(target_.type())->getDevice();
    }
    TORCH_CHECK(factory_, "comm's staging backend has no communicator");
    communicator_ = factory_();
    factory_ = nullptr; // drop what the factory holds (Python objects) once it has made the communicator
    TORCH_CHECK(communicator_, "comm's staging backend: the communicator factory returned nothing");
  }
  return *communicator_;
}

c10::intrusive_ptr<c10d::Backend::Options> StagingBackend::getBackendOptions() {
  return c10::make_intrusive<Options>("comm", timeout_);
}

void StagingBackend::setTimeout(std::chrono::milliseconds timeout) {
  timeout_ = timeout;
  std::lock_guard<std::mutex> lock(mutex_);
  if (communicator_) communicator_->setTimeout(timeout);
}

void StagingBackend::startCoalescing() {
  auto& comm = communicator();
  std::lock_guard<std::mutex> lock(mutex_);
  if (coalescing_) {
    // A block that raised before its end (torch's coalescing manager then never calls
    // endCoalescing): forget what it issued, and close the communicator's block.
    coalescedWorks_.clear();
    coalescedBacks_.clear();
    if (communicatorCoalesces_) comm.endCoalescing();
  }
  coalescing_ = true;
  communicatorCoalesces_ = comm.supportsCoalescing();
  if (communicatorCoalesces_) comm.startCoalescing();
}

WorkPtr StagingBackend::endCoalescing() {
  auto& comm = communicator();
  std::vector<WorkPtr> works;
  std::vector<std::shared_ptr<WriteBack>> backs;
  bool coalesces = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    TORCH_CHECK(coalescing_, "comm's staging backend: endCoalescing without startCoalescing");
    coalescing_ = false;
    coalesces = communicatorCoalesces_;
    works.swap(coalescedWorks_);
    backs.swap(coalescedBacks_);
  }
  if (coalesces) {
    // A communicator that coalesces returns one work for the calls that joined its block,
    // or none where none joined: HCCL's plain calls (and so comm's flattened coalesced
    // all-reduce) run outside its block, each with a work of its own to wait for.
    auto work = comm.endCoalescing();
    if (work) works = {work};
  }
  if (backs.empty()) backs.push_back(std::make_shared<WriteBack>("coalesced", "comm staged nothing",
                                                                 std::vector<Piece>{}, Tensors{}, 1));
  return c10::make_intrusive<StagedWork>(std::move(works), std::move(backs), c10d::OpType::COALESCED);
}

BackendPtr StagingBackend::split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                 const c10::intrusive_ptr<Options>& opts) {
  auto& comm = communicator();
  // A store of its own: the group's own backend splits with the same store and keys.
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("comm-staging", store);
  auto part = comm.split(prefixed, ranks, comm.getBackendOptions());
  if (!part) return nullptr; // this rank is in none of the new groups
  auto split = c10::make_intrusive<StagingBackend>(part->getRank(), part->getSize(), target_, part);
  split->timeout_ = opts ? opts->timeout : timeout_;
  return split;
}

WorkPtr StagingBackend::finish(Call& call, c10d::OpType type, const std::function<WorkPtr(c10d::Backend&)>& issue) {
  auto back = call.writeBack();
  auto& comm = communicator();
  WorkPtr work;
  try {
    work = issue(comm);
  } catch (...) {
    rethrowStaged(*back);
  }
  call.issued();
  std::lock_guard<std::mutex> lock(mutex_);
  if (coalescing_) {
    coalescedBacks_.push_back(back);
    if (work) coalescedWorks_.push_back(work);
    if (communicatorCoalesces_) return c10::make_intrusive<DoneWork>();
  }
  std::vector<WorkPtr> works;
  if (work) works.push_back(work);
  return c10::make_intrusive<StagedWork>(std::move(works), std::vector<std::shared_ptr<WriteBack>>{back}, type);
}

WorkPtr StagingBackend::broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) {
  Call call("broadcast", stagingTarget());
  // The source's tensors are only read: nothing comes back to them.
  auto staged = getRank() == opts.rootRank ? call.inReported(tensors) : call.out(tensors, /*reads=*/true);
  return finish(call, c10d::OpType::BROADCAST, [&](c10d::Backend& comm) { return comm.broadcast(staged, opts); });
}

WorkPtr StagingBackend::allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) {
  Call call("all_reduce", stagingTarget());
  auto staged = call.out(tensors, /*reads=*/true);
  auto staged_opts = opts;
  staged_opts.reduceOp = call.reduceOp(opts.reduceOp, staged, getSize());
  return finish(call, c10d::OpType::ALLREDUCE, [&](c10d::Backend& comm) { return comm.allreduce(staged, staged_opts); });
}

WorkPtr StagingBackend::allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) {
  Call call("all_reduce_coalesced", stagingTarget());
  if (Call::flattens(tensors)) { // one flat buffer: one transfer each way, one all-reduce
    Tensors staged{call.outFlat(tensors, /*reads=*/true)};
    c10d::AllreduceOptions staged_opts = opts;
    staged_opts.reduceOp = call.reduceOp(opts.reduceOp, staged, getSize());
    return finish(call, c10d::OpType::ALLREDUCE_COALESCED,
                  [&](c10d::Backend& comm) { return comm.allreduce(staged, staged_opts); });
  }
  auto staged = call.out(tensors, /*reads=*/true);
  auto staged_opts = opts;
  staged_opts.reduceOp = call.reduceOp(opts.reduceOp, staged, getSize());
  return finish(call, c10d::OpType::ALLREDUCE_COALESCED,
                [&](c10d::Backend& comm) { return comm.allreduce_coalesced(staged, staged_opts); });
}

WorkPtr StagingBackend::reduce(Tensors& tensors, const c10d::ReduceOptions& opts) {
  Call call("reduce", stagingTarget());
  // Only the destination's tensors are written.
  auto staged = getRank() == opts.rootRank ? call.out(tensors, /*reads=*/true) : call.inReported(tensors);
  auto staged_opts = opts;
  staged_opts.reduceOp = call.reduceOp(opts.reduceOp, staged, getSize());
  return finish(call, c10d::OpType::REDUCE, [&](c10d::Backend& comm) { return comm.reduce(staged, staged_opts); });
}

WorkPtr StagingBackend::allgather(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) {
  Call call("all_gather", stagingTarget());
  auto staged_in = call.in(inputs);
  auto staged_out = call.out(outputs);
  return finish(call, c10d::OpType::ALLGATHER,
                [&](c10d::Backend& comm) { return comm.allgather(staged_out, staged_in, opts); });
}

WorkPtr StagingBackend::_allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) {
  Call call("all_gather_into_tensor", stagingTarget());
  auto staged_in = call.in(input);
  auto staged_out = call.out(output);
  return finish(call, c10d::OpType::_ALLGATHER_BASE,
                [&](c10d::Backend& comm) { return comm._allgather_base(staged_out, staged_in, opts); });
}

WorkPtr StagingBackend::allgather_coalesced(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) {
  Call call("all_gather_coalesced", stagingTarget());
  auto staged_in = call.in(inputs);
  auto staged_out = call.out(outputs);
  return finish(call, c10d::OpType::ALLGATHER_COALESCED,
                [&](c10d::Backend& comm) { return comm.allgather_coalesced(staged_out, staged_in, opts); });
}

WorkPtr StagingBackend::allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                        const c10d::AllgatherOptions& opts) {
  Call call("all_gather_into_tensor_coalesced", stagingTarget());
  auto staged_in = call.in(inputs);
  auto staged_out = call.out(outputs);
  return finish(call, c10d::OpType::COALESCED, [&](c10d::Backend& comm) {
    return comm.allgather_into_tensor_coalesced(staged_out, staged_in, opts);
  });
}

WorkPtr StagingBackend::gather(TensorLists& outputs, Tensors& inputs, const c10d::GatherOptions& opts) {
  Call call("gather", stagingTarget());
  auto staged_in = call.in(inputs);
  auto staged_out = call.out(outputs); // empty except on the root
  return finish(call, c10d::OpType::GATHER,
                [&](c10d::Backend& comm) { return comm.gather(staged_out, staged_in, opts); });
}

WorkPtr StagingBackend::scatter(Tensors& outputs, TensorLists& inputs, const c10d::ScatterOptions& opts) {
  Call call("scatter", stagingTarget());
  auto staged_in = call.in(inputs); // empty except on the root
  auto staged_out = call.out(outputs);
  return finish(call, c10d::OpType::SCATTER,
                [&](c10d::Backend& comm) { return comm.scatter(staged_out, staged_in, opts); });
}

WorkPtr StagingBackend::reduce_scatter(Tensors& outputs, TensorLists& inputs, const c10d::ReduceScatterOptions& opts) {
  Call call("reduce_scatter", stagingTarget());
  auto staged_in = call.in(inputs);
  auto staged_out = call.out(outputs);
  auto staged_opts = opts;
  staged_opts.reduceOp = call.reduceOp(opts.reduceOp, flat(staged_in), getSize());
  return finish(call, c10d::OpType::REDUCE_SCATTER,
                [&](c10d::Backend& comm) { return comm.reduce_scatter(staged_out, staged_in, staged_opts); });
}

WorkPtr StagingBackend::_reduce_scatter_base(at::Tensor& output, at::Tensor& input,
                                             const c10d::ReduceScatterOptions& opts) {
  Call call("reduce_scatter_tensor", stagingTarget());
  auto staged_in = call.in(input);
  auto staged_out = call.out(output);
  auto staged_opts = opts;
  staged_opts.reduceOp = call.reduceOp(opts.reduceOp, staged_in, getSize());
  return finish(call, c10d::OpType::_REDUCE_SCATTER_BASE,
                [&](c10d::Backend& comm) { return comm._reduce_scatter_base(staged_out, staged_in, staged_opts); });
}

WorkPtr StagingBackend::reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                                        const c10d::ReduceScatterOptions& opts) {
  Call call("reduce_scatter_tensor_coalesced", stagingTarget());
  auto staged_in = call.in(inputs);
  auto staged_out = call.out(outputs);
  auto staged_opts = opts;
  staged_opts.reduceOp = call.reduceOp(opts.reduceOp, staged_in, getSize());
  return finish(call, comm_releases::kReduceScatterTensorCoalesced, [&](c10d::Backend& comm) {
    return comm.reduce_scatter_tensor_coalesced(staged_out, staged_in, staged_opts);
  });
}

WorkPtr StagingBackend::alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                                      std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) {
  Call call("all_to_all_single", stagingTarget());
  auto staged_in = call.in(input);
  auto staged_out = call.out(output);
  return finish(call, c10d::OpType::ALLTOALL_BASE, [&](c10d::Backend& comm) {
    return comm.alltoall_base(staged_out, staged_in, output_splits, input_splits, opts);
  });
}

WorkPtr StagingBackend::alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) {
  Call call("all_to_all", stagingTarget());
  auto staged_in = call.in(inputs);
  auto staged_out = call.out(outputs);
  return finish(call, c10d::OpType::ALLTOALL,
                [&](c10d::Backend& comm) { return comm.alltoall(staged_out, staged_in, opts); });
}

WorkPtr StagingBackend::send(Tensors& tensors, int dst, int tag) {
  Call call("send", stagingTarget());
  auto staged = call.in(tensors);
  return finish(call, c10d::OpType::SEND, [&](c10d::Backend& comm) { return comm.send(staged, dst, tag); });
}

WorkPtr StagingBackend::recv(Tensors& tensors, int src, int tag) {
  Call call("recv", stagingTarget());
  auto staged = call.out(tensors);
  return finish(call, c10d::OpType::RECV, [&](c10d::Backend& comm) { return comm.recv(staged, src, tag); });
}

WorkPtr StagingBackend::recvAnysource(Tensors& tensors, int tag) {
  Call call("recv", stagingTarget());
  auto staged = call.out(tensors);
  return finish(call, c10d::OpType::RECVANYSOURCE, [&](c10d::Backend& comm) {
    TORCH_CHECK(comm.getBackendName() != "nccl",
                "a receive from any source (src=None) cannot be staged onto ", target_.str(),
                ": the group's backend there, nccl, cannot receive from any source; name the sender");
    return comm.recvAnysource(staged, tag);
  });
}

WorkPtr StagingBackend::barrier(const c10d::BarrierOptions& opts) {
  Call call("barrier", stagingTarget());
  return finish(call, c10d::OpType::BARRIER, [&](c10d::Backend& comm) { return comm.barrier(opts); });
}

} // namespace comm_native
