// The simulated device's collective backend (say hccl): a real c10d Backend.
//
// c10d registers a C++ Backend per device type on the process group it creates, so
// the group dispatches by device as it does with nccl or hccl: a CPU tensor never
// reaches this backend, the group itself raises "No backend type associated with
// device type cpu", and the functional collectives (DTensor) find it. A Python
// subclass of ProcessGroup cannot get there: c10d puts it in place of the group.
// Each collective runs with a gloo backend on host views of the device tensors.
#include <algorithm>
#include <cctype>
#include <mutex>

#include "simulated.h"
#include "torch_releases.h"

namespace comm_sim {
namespace {

using Tensors = std::vector<at::Tensor>;
using TensorLists = std::vector<std::vector<at::Tensor>>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// Failures injected on purpose (comm.testing.fail_next): calls numbered [from, to),
// counted across every simulated backend of the process, fail when issued or on wait,
// as a link that breaks does.
struct FaultPlan {
  std::mutex mutex;
  int64_t calls = 0;
  int64_t from = 0;
  int64_t to = 0;
  bool on_wait = false;
};
FaultPlan faults;

// Whether this call fails on wait; raises now for a call that fails when issued.
bool injected_fault(const WorkPtr& host) {
  int64_t call = 0;
  bool on_wait = false;
  {
    std::lock_guard<std::mutex> lock(faults.mutex);
    call = ++faults.calls;
    if (call < faults.from || call >= faults.to) return false;
    on_wait = faults.on_wait;
  }
  if (on_wait) return true;
  host->wait(); // the peers' matching collective has run: leave nothing in flight
  TORCH_CHECK(false, "injected backend failure (on call ", call, ")");
}

std::exception_ptr injected_on_wait() {
  return std::make_exception_ptr(c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "injected backend failure (on wait)"));
}

// The host collective's work, reporting the device tensors as its result.
class DeviceWork final : public c10d::Work {
 public:
  DeviceWork(WorkPtr host, Tensors outputs, c10d::OpType type, bool fails)
      : Work(-1, type), host_(std::move(host)), outputs_(std::move(outputs)), fails_(fails) {}

  bool isCompleted() override { return host_->isCompleted(); }
  bool isSuccess() const override { return !fails_ && host_->isSuccess(); }
  std::exception_ptr exception() const override { return fails_ ? injected_on_wait() : host_->exception(); }
  int sourceRank() const override { return host_->sourceRank(); }
  Tensors result() override { return outputs_; }
  void synchronize() override { host_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override {
    auto done = host_->wait(timeout);
    if (fails_) std::rethrow_exception(injected_on_wait());
    return done;
  }
  void abort() override { host_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return host_->getFuture()->then(
        [outputs = outputs_, fails = fails_](c10::ivalue::Future& done) {
          done.value(); // rethrows the collective's error into the returned future
          if (fails) std::rethrow_exception(injected_on_wait());
          return c10::IValue(outputs);
        },
        c10::ListType::create(c10::TensorType::get()));
  }

 private:
  WorkPtr host_;
  Tensors outputs_;
  bool fails_;
};

// The work endCoalescing returns for the calls that joined a coalescing block.
class JoinedWork final : public c10d::Work {
 public:
  explicit JoinedWork(std::vector<WorkPtr> works) : Work(-1, c10d::OpType::COALESCED), works_(std::move(works)) {}

  bool isCompleted() override {
    return std::all_of(works_.begin(), works_.end(), [](const WorkPtr& work) { return work->isCompleted(); });
  }
  bool isSuccess() const override {
    return std::all_of(works_.begin(), works_.end(), [](const WorkPtr& work) { return work->isSuccess(); });
  }
  void synchronize() override {
    for (auto& work : works_) work->synchronize();
  }
  bool wait(std::chrono::milliseconds timeout) override {
    for (auto& work : works_) work->wait(timeout);
    return true;
  }

 private:
  std::vector<WorkPtr> works_;
};

class SimulatedBackend final : public c10d::Backend {
 public:
  SimulatedBackend(c10::intrusive_ptr<c10d::Backend> host, std::string name, std::map<int64_t, std::string> unsupported)
      : Backend(host->getRank(), host->getSize()),
        host_(std::move(host)),
        name_(std::move(name)),
        unsupported_(std::move(unsupported)) {}

  const std::string getBackendName() const override { return name_; }

  // Coalescing as HCCL does it (torch_npu's ProcessGroupHCCL: supportsCoalescing() is
  // true, ProcessGroupHCCL.hpp:566 in the 2.13 wheel; collectiveCoalesced and p2p join a
  // block, a plain collective() never does; endCoalescing returns nullptr when nothing
  // joined, ProcessGroupHCCL.cpp:6403 on master, :6060 in 2.9.1). Every call still runs
  // when it is made; a joined call's work is endCoalescing's to wait for.
  bool supportsCoalescing() const override { return true; }
  void startCoalescing() override {
    std::lock_guard<std::mutex> lock(mutex_);
    coalescing_ = true;
    joined_.clear();
  }
  WorkPtr endCoalescing() override {
    std::lock_guard<std::mutex> lock(mutex_);
    coalescing_ = false;
    if (joined_.empty()) return nullptr; // "There is no actual work being coalesced"
    std::vector<WorkPtr> joined;
    joined.swap(joined_);
    return c10::make_intrusive<JoinedWork>(std::move(joined));
  }

  WorkPtr broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) override {
    return in_place(&c10d::Backend::broadcast, tensors, opts, c10d::OpType::BROADCAST);
  }
  WorkPtr allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override {
    check(opts.reduceOp);
    return in_place(&c10d::Backend::allreduce, tensors, opts, c10d::OpType::ALLREDUCE);
  }
  WorkPtr allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    check(opts.reduceOp);
    return join(in_place(&c10d::Backend::allreduce_coalesced, tensors, opts, c10d::OpType::ALLREDUCE_COALESCED));
  }
  WorkPtr reduce(Tensors& tensors, const c10d::ReduceOptions& opts) override {
    check(opts.reduceOp);
    return in_place(&c10d::Backend::reduce, tensors, opts, c10d::OpType::REDUCE);
  }
  WorkPtr allgather(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override {
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->allgather(host_outputs, host_inputs, opts), flat(outputs), c10d::OpType::ALLGATHER);
  }
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    auto host_output = to_host(output);
    auto host_input = to_host(input);
    return done(host_->_allgather_base(host_output, host_input, opts), {output}, c10d::OpType::_ALLGATHER_BASE);
  }
  WorkPtr allgather_coalesced(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override {
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->allgather_coalesced(host_outputs, host_inputs, opts), flat(outputs),
                c10d::OpType::ALLGATHER_COALESCED);
  }
  WorkPtr allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::AllgatherOptions& opts) override {
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return join(done(host_->allgather_into_tensor_coalesced(host_outputs, host_inputs, opts), outputs,
                     c10d::OpType::COALESCED));
  }
  WorkPtr gather(TensorLists& outputs, Tensors& inputs, const c10d::GatherOptions& opts) override {
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->gather(host_outputs, host_inputs, opts), flat(outputs), c10d::OpType::GATHER);
  }
  WorkPtr scatter(Tensors& outputs, TensorLists& inputs, const c10d::ScatterOptions& opts) override {
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->scatter(host_outputs, host_inputs, opts), outputs, c10d::OpType::SCATTER);
  }
  WorkPtr reduce_scatter(Tensors& outputs, TensorLists& inputs, const c10d::ReduceScatterOptions& opts) override {
    check(opts.reduceOp);
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->reduce_scatter(host_outputs, host_inputs, opts), outputs, c10d::OpType::REDUCE_SCATTER);
  }
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    check(opts.reduceOp);
    auto host_output = to_host(output);
    auto host_input = to_host(input);
    return done(host_->_reduce_scatter_base(host_output, host_input, opts), {output},
                c10d::OpType::_REDUCE_SCATTER_BASE);
  }
  WorkPtr reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    check(opts.reduceOp);
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return join(done(host_->reduce_scatter_tensor_coalesced(host_outputs, host_inputs, opts), outputs,
                     comm_releases::kReduceScatterTensorCoalesced));
  }
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override {
    auto host_output = to_host(output);
    auto host_input = to_host(input);
    return done(host_->alltoall_base(host_output, host_input, output_splits, input_splits, opts), {output},
                c10d::OpType::ALLTOALL_BASE);
  }
  WorkPtr alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) override {
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->alltoall(host_outputs, host_inputs, opts), outputs, c10d::OpType::ALLTOALL);
  }
  WorkPtr send(Tensors& tensors, int dst, int tag) override {
    auto hosts = to_host(tensors);
    return join(done(host_->send(hosts, dst, tag), tensors, c10d::OpType::SEND), /*p2p=*/true);
  }
  WorkPtr recv(Tensors& tensors, int src, int tag) override {
    auto hosts = to_host(tensors);
    return join(done(host_->recv(hosts, src, tag), tensors, c10d::OpType::RECV), /*p2p=*/true);
  }
  WorkPtr recvAnysource(Tensors& tensors, int tag) override {
    auto hosts = to_host(tensors);
    return done(host_->recvAnysource(hosts, tag), tensors, c10d::OpType::RECVANYSOURCE);
  }
  WorkPtr barrier(const c10d::BarrierOptions& opts) override {
    return done(host_->barrier(opts), {}, c10d::OpType::BARRIER);
  }

 private:
  // The real backend refuses a reduce op its hardware lacks when the call is made.
  void check(const c10d::ReduceOp& op) const {
    auto found = unsupported_.find(static_cast<int64_t>(op.op_));
    if (found == unsupported_.end()) return;
    std::string upper = name_;
    std::transform(upper.begin(), upper.end(), upper.begin(), [](unsigned char c) { return std::toupper(c); });
    TORCH_CHECK(false, "Cannot use ReduceOp.", found->second, " with ", upper);
  }

  // Reached only by a group that does not dispatch by device (a Python ProcessGroup
  // wrapping this backend): the error the group's dispatch would have raised.
  static at::Tensor to_host(const at::Tensor& tensor) {
    TORCH_CHECK(tensor.device().type() == kDevice, "No backend type associated with device type ",
                tensor.device().type());
    return host_view(tensor);
  }
  static Tensors to_host(const Tensors& tensors) {
    Tensors hosts;
    hosts.reserve(tensors.size());
    for (const auto& tensor : tensors) hosts.push_back(to_host(tensor));
    return hosts;
  }
  static TensorLists to_host(const TensorLists& lists) {
    TensorLists hosts;
    hosts.reserve(lists.size());
    for (const auto& list : lists) hosts.push_back(to_host(list));
    return hosts;
  }
  static Tensors flat(const TensorLists& lists) {
    Tensors all;
    for (const auto& list : lists) all.insert(all.end(), list.begin(), list.end());
    return all;
  }
  // A collective on one list of tensors, written in place: the host backend's `method` on their host views.
  template <typename Options>
  WorkPtr in_place(WorkPtr (c10d::Backend::*method)(Tensors&, const Options&), Tensors& tensors, const Options& opts,
                   c10d::OpType type) {
    auto hosts = to_host(tensors);
    return done((host_.get()->*method)(hosts, opts), tensors, type);
  }

  // A call that joins an open coalescing block: its work is endCoalescing's; p2p then returns none.
  WorkPtr join(WorkPtr work, bool p2p = false) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!coalescing_) return work;
    joined_.push_back(work);
    return p2p ? nullptr : work;
  }

  static WorkPtr done(WorkPtr host, Tensors outputs, c10d::OpType type) {
    ++collectives;
    bool fails = injected_fault(host);
    return c10::make_intrusive<DeviceWork>(std::move(host), std::move(outputs), type, fails);
  }

  c10::intrusive_ptr<c10d::Backend> host_;
  std::string name_;
  std::map<int64_t, std::string> unsupported_;
  std::mutex mutex_;
  bool coalescing_ = false;
  std::vector<WorkPtr> joined_;
};

} // namespace

void fail_next(bool on_wait, int64_t calls) {
  std::lock_guard<std::mutex> lock(faults.mutex);
  faults.from = faults.calls + 1;
  faults.to = faults.from + calls;
  faults.on_wait = on_wait;
}

c10::intrusive_ptr<c10d::Backend> make_backend(
    c10::intrusive_ptr<c10d::Backend> host, std::string name, std::map<int64_t, std::string> unsupported_ops) {
  return c10::make_intrusive<SimulatedBackend>(std::move(host), std::move(name), std::move(unsupported_ops));
}

} // namespace comm_sim
