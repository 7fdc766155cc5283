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
#include <functional>
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

// What a collective does on the device once the host collective has finished (HCCL's
// divide for ReduceOp.AVG); run once, by whoever first sees the work complete.
struct After {
  std::function<void()> step;
  std::once_flag once;
  void run() {
    if (step) std::call_once(once, step);
  }
};

// The host collective's work, reporting the device tensors as its result.
class DeviceWork final : public c10d::Work {
 public:
  DeviceWork(WorkPtr host, Tensors outputs, c10d::OpType type, bool fails, std::function<void()> after)
      : Work(-1, type), host_(std::move(host)), outputs_(std::move(outputs)), fails_(fails),
        after_(std::make_shared<After>()) {
    after_->step = std::move(after);
  }

  bool isCompleted() override {
    if (!host_->isCompleted()) return false;
    if (isSuccess()) after_->run();
    return true;
  }
  bool isSuccess() const override { return !fails_ && host_->isSuccess(); }
  std::exception_ptr exception() const override { return fails_ ? injected_on_wait() : host_->exception(); }
  int sourceRank() const override { return host_->sourceRank(); }
  Tensors result() override { return outputs_; }
  void synchronize() override { host_->synchronize(); }
  bool wait(std::chrono::milliseconds timeout) override {
    auto done = host_->wait(timeout);
    if (fails_) std::rethrow_exception(injected_on_wait());
    after_->run();
    return done;
  }
  void abort() override { host_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    return host_->getFuture()->then(
        [outputs = outputs_, fails = fails_, after = after_](c10::ivalue::Future& done) {
          done.value(); // rethrows the collective's error into the returned future
          if (fails) std::rethrow_exception(injected_on_wait());
          after->run();
          return c10::IValue(outputs);
        },
        c10::ListType::create(c10::TensorType::get()));
  }

 private:
  WorkPtr host_;
  Tensors outputs_;
  bool fails_;
  std::shared_ptr<After> after_;
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

// HCCL's rules, as torch_npu's ProcessGroupHCCL applies them (torch_npu 2.13 and 2.9.1;
// sources read: Ascend/pytorch master and v2.9.0-26.0.0, torch_npu/csrc/distributed/,
// cited "master:" and "2.9.1:" below; ../shared/reference/torch-npu-reality.md has the
// findings). A simulation made `lenient` skips them all and runs what gloo runs.
namespace hccl {

// getHcclDataType's table: a dtype outside it fails every collective
// (master:HCCLUtils.cpp:48-65 and :84-91).
bool mapped(at::ScalarType dtype) {
  switch (dtype) {
    case at::kByte: case at::kChar: case at::kShort: case at::kInt: case at::kLong: case at::kHalf:
    case at::kFloat: case at::kDouble: case at::kBool: case at::kBFloat16: case at::ScalarType::UInt16:
    case at::ScalarType::UInt32: case at::ScalarType::UInt64: case at::ScalarType::Float8_e4m3fn:
    case at::ScalarType::Float8_e5m2:
      return true;
    default:
      return false;
  }
}

// checkSupportedDataType: what a reduction accepts, int8/16/32/64, fp16, fp32 and bf16
// (master:ProcessGroupHCCL.cpp:168-189, where Ascend950 adds fp64 and uint64;
// 2.9.1:ProcessGroupHCCL.cpp:170-184, no exception).
bool reducible(at::ScalarType dtype) {
  switch (dtype) {
    case at::kChar: case at::kShort: case at::kInt: case at::kLong: case at::kHalf: case at::kFloat:
    case at::kBFloat16:
      return true;
    default:
      return false;
  }
}

// getHcclDataTypeSerialString (master:HCCLUtils.cpp:67-82): how its messages name a dtype.
std::string serial(at::ScalarType dtype) {
  switch (dtype) {
    case at::kByte: case at::kBool: return "at::kByte/at::kBool";
    case at::kChar: return "at::kChar";
    case at::kShort: return "at::kShort";
    case at::kInt: return "at::kInt";
    case at::kLong: return "at::kLong";
    case at::kHalf: return "at::kHalf";
    case at::kFloat: return "at::kFloat";
    case at::kDouble: return "at::kDouble";
    case at::kBFloat16: return "at::kBFloat16";
    default: return c10::str("at::ScalarType::", dtype);
  }
}

} // namespace hccl

class SimulatedBackend final : public c10d::Backend {
 public:
  SimulatedBackend(c10::intrusive_ptr<c10d::Backend> host, std::string name, std::map<int64_t, std::string> unsupported,
                   bool lenient)
      : Backend(host->getRank(), host->getSize()),
        host_(std::move(host)),
        name_(std::move(name)),
        unsupported_(std::move(unsupported)),
        lenient_(lenient) {
    upper_ = name_;
    std::transform(upper_.begin(), upper_.end(), upper_.begin(), [](unsigned char c) { return std::toupper(c); });
  }

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
    mapped(tensors);
    auto hosts = to_host(tensors);
    return done(host_->broadcast(hosts, opts), tensors, c10d::OpType::BROADCAST);
  }
  // bool and uint8 go to HCCL as int32 in allreduce, allreduce_coalesced and reduce
  // (master:ProcessGroupHCCL.cpp:4793-4796, 5070, 5153) and come back by copy_: the values
  // are gloo's on the bool or uint8 tensors themselves (OR for a bool SUM, sums modulo 256).
  WorkPtr allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override {
    reducible("allreduce", tensors, /*casts=*/true);
    auto hosts = to_host(tensors);
    auto host_opts = opts;
    auto after = reduce_op(host_opts.reduceOp, hosts, tensors);
    return done(host_->allreduce(hosts, host_opts), tensors, c10d::OpType::ALLREDUCE, after);
  }
  WorkPtr allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    reducible("allreduce_coalesced", tensors, /*casts=*/true);
    auto hosts = to_host(tensors);
    auto host_opts = opts;
    auto after = reduce_op(host_opts.reduceOp, hosts, tensors);
    return join(done(host_->allreduce_coalesced(hosts, host_opts), tensors, c10d::OpType::ALLREDUCE_COALESCED,
                     after));
  }
  WorkPtr reduce(Tensors& tensors, const c10d::ReduceOptions& opts) override {
    reducible("reduce", tensors, /*casts=*/true);
    auto hosts = to_host(tensors);
    auto host_opts = opts;
    auto after = reduce_op(host_opts.reduceOp, hosts, tensors);
    return done(host_->reduce(hosts, host_opts), tensors, c10d::OpType::REDUCE, after);
  }
  WorkPtr allgather(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override {
    mapped(inputs);
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->allgather(host_outputs, host_inputs, opts), flat(outputs), c10d::OpType::ALLGATHER);
  }
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    mapped({input});
    auto host_output = to_host(output);
    auto host_input = to_host(input);
    return done(host_->_allgather_base(host_output, host_input, opts), {output}, c10d::OpType::_ALLGATHER_BASE);
  }
  WorkPtr allgather_coalesced(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override {
    // ProcessGroupHCCL does not override allgather_coalesced (the 2.13 wheel's
    // ProcessGroupHCCL.hpp:577-715 lists its overrides; so does 2.9.1's): torch's Backend
    // refuses it, "Backend hccl does not support allgather_coalesced" (torch Backend.hpp).
    if (!lenient_) return c10d::Backend::allgather_coalesced(outputs, inputs, opts);
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->allgather_coalesced(host_outputs, host_inputs, opts), flat(outputs),
                c10d::OpType::ALLGATHER_COALESCED);
  }
  WorkPtr allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::AllgatherOptions& opts) override {
    mapped(inputs);
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return join(done(host_->allgather_into_tensor_coalesced(host_outputs, host_inputs, opts), outputs,
                     c10d::OpType::COALESCED));
  }
  WorkPtr gather(TensorLists& outputs, Tensors& inputs, const c10d::GatherOptions& opts) override {
    mapped(inputs);
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->gather(host_outputs, host_inputs, opts), flat(outputs), c10d::OpType::GATHER);
  }
  WorkPtr scatter(Tensors& outputs, TensorLists& inputs, const c10d::ScatterOptions& opts) override {
    mapped(outputs);
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->scatter(host_outputs, host_inputs, opts), outputs, c10d::OpType::SCATTER);
  }
  // The reduce-scatters check dtypes with no cast of bool or uint8 (master:ProcessGroupHCCL.cpp:5982, 6234, 6307).
  WorkPtr reduce_scatter(Tensors& outputs, TensorLists& inputs, const c10d::ReduceScatterOptions& opts) override {
    reducible("reduce_scatter", outputs, /*casts=*/false);
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    auto host_opts = opts;
    if (!lenient_) { // HCCL scales flattened copies of the inputs (master:ProcessGroupHCCL.cpp:6035-6039)
      for (auto& list : host_inputs) {
        for (auto& tensor : list) tensor = tensor.clone();
      }
    }
    auto after = reduce_op(host_opts.reduceOp, flat(host_inputs), outputs);
    return done(host_->reduce_scatter(host_outputs, host_inputs, host_opts), outputs, c10d::OpType::REDUCE_SCATTER,
                after);
  }
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    reducible("_reduce_scatter_base", {input}, /*casts=*/false);
    auto host_output = to_host(output);
    auto host_input = to_host(input);
    auto host_opts = opts;
    auto after = reduce_op(host_opts.reduceOp, {host_input}, {output});
    return done(host_->_reduce_scatter_base(host_output, host_input, host_opts), {output},
                c10d::OpType::_REDUCE_SCATTER_BASE, after);
  }
  WorkPtr reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    reducible("reduce_scatter_tensor_coalesced", inputs, /*casts=*/false);
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    auto host_opts = opts;
    auto after = reduce_op(host_opts.reduceOp, host_inputs, outputs);
    return join(done(host_->reduce_scatter_tensor_coalesced(host_outputs, host_inputs, host_opts), outputs,
                     comm_releases::kReduceScatterTensorCoalesced, after));
  }
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override {
    mapped({input});
    auto host_output = to_host(output);
    auto host_input = to_host(input);
    return done(host_->alltoall_base(host_output, host_input, output_splits, input_splits, opts), {output},
                c10d::OpType::ALLTOALL_BASE);
  }
  WorkPtr alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) override {
    mapped(inputs);
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->alltoall(host_outputs, host_inputs, opts), outputs, c10d::OpType::ALLTOALL);
  }
  WorkPtr send(Tensors& tensors, int dst, int tag) override {
    mapped(tensors);
    auto hosts = to_host(tensors);
    return join(done(host_->send(hosts, dst, tag), tensors, c10d::OpType::SEND), /*p2p=*/true);
  }
  WorkPtr recv(Tensors& tensors, int src, int tag) override {
    mapped(tensors);
    auto hosts = to_host(tensors);
    return join(done(host_->recv(hosts, src, tag), tensors, c10d::OpType::RECV), /*p2p=*/true);
  }
  WorkPtr recvAnysource(Tensors& tensors, int tag) override {
    // master:ProcessGroupHCCL.cpp:6988-6992; 2.9.1:ProcessGroupHCCL.cpp:6652-6655.
    TORCH_CHECK(lenient_, "ProcessGroup", upper_, " does not support recv");
    auto hosts = to_host(tensors);
    return done(host_->recvAnysource(hosts, tag), tensors, c10d::OpType::RECVANYSOURCE);
  }
  WorkPtr barrier(const c10d::BarrierOptions& opts) override {
    return done(host_->barrier(opts), {}, c10d::OpType::BARRIER);
  }

 private:
  // getHcclDataType refuses a dtype outside its table in every call that moves tensors.
  void mapped(const Tensors& tensors) const {
    if (lenient_) return;
    for (const auto& tensor : tensors) {
      TORCH_CHECK(hccl::mapped(tensor.scalar_type()), "Unsupported data type for ", upper_, " process group");
    }
  }
  // checkSupportedDataType in the reductions, named by ProcessGroupHCCL's function;
  // `casts`: bool and uint8 are cast to int32 first (allreduce, allreduce_coalesced, reduce).
  void reducible(const char* function, const Tensors& tensors, bool casts) const {
    mapped(tensors);
    if (lenient_) return;
    for (const auto& tensor : tensors) {
      auto dtype = tensor.scalar_type();
      if (casts && (dtype == at::kBool || dtype == at::kByte)) dtype = at::kInt;
      TORCH_CHECK(hccl::reducible(dtype), upper_, " ", function, ": Unsupported data type ", hccl::serial(dtype));
    }
  }

  // The reduce op the host runs for `op`, rewritten in place; returns what the device
  // does once the collective has finished. `inputs`: the host tensors it reads;
  // `outputs`: the device tensors it writes.
  std::function<void()> reduce_op(c10d::ReduceOp& op, const Tensors& inputs, const Tensors& outputs) const {
    // A part's own refusals, asked for by unsupported_ops (ReduceOp.AVG on some parts).
    auto found = unsupported_.find(static_cast<int64_t>(op.op_));
    if (found != unsupported_.end()) TORCH_CHECK(false, "Cannot use ReduceOp.", found->second, " with ", upper_);
    if (lenient_) return nullptr;
    // getHcclReduceOp's unsupportedOp (master:ProcessGroupHCCL.cpp:94-97, 159-161; 2.9.1 :87, 161).
    static const std::map<c10d::ReduceOp::RedOpType, const char*> bitwise = {
        {c10d::ReduceOp::BAND, "BAND"}, {c10d::ReduceOp::BOR, "BOR"}, {c10d::ReduceOp::BXOR, "BXOR"}};
    auto refused = bitwise.find(op.op_);
    if (refused != bitwise.end()) TORCH_CHECK(false, "Cannot use ReduceOp.", refused->second, " with ", upper_);
    switch (op.op_) {
      case c10d::ReduceOp::AVG: {
        // SUM, then each output divided by the group's size on the device
        // (master:ProcessGroupHCCL.cpp:136-141, 4808-4816). An integer tensor's div_
        // raises torch's error there (except on Ascend950, which truncates): here
        // before the collective, on hardware after it.
        for (const auto& tensor : outputs) at::empty({0}, tensor.options().device(at::kCPU)).div_(getSize());
        op = c10d::ReduceOp(c10d::ReduceOp::SUM);
        auto size = getSize();
        return [outputs, size]() {
          for (auto tensor : outputs) tensor.div_(size);
        };
      }
      case c10d::ReduceOp::PREMUL_SUM: {
        // The inputs scaled by the factor's double_factor, then SUM (master:ProcessGroupHCCL.cpp:143-150, 4797-4806).
        for (const auto& tensor : inputs) {
          auto dtype = tensor.scalar_type();
          TORCH_CHECK(dtype == at::kHalf || dtype == at::kFloat || dtype == at::kBFloat16 || dtype == at::kDouble,
                      "PreMulSum Data type must be half, float, bfloat16 or double");
        }
        auto* factor = dynamic_cast<comm_releases::PreMulSumFactor*>(op.supplement_.get());
        TORCH_CHECK(factor != nullptr, "ReduceOp.PREMUL_SUM without its factor");
        for (auto tensor : inputs) tensor.mul_(factor->double_factor);
        op = c10d::ReduceOp(c10d::ReduceOp::SUM);
        return nullptr;
      }
      default:
        return nullptr;
    }
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

  // A call that joins an open coalescing block: its work is endCoalescing's; p2p then returns none.
  WorkPtr join(WorkPtr work, bool p2p = false) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!coalescing_) return work;
    joined_.push_back(work);
    return p2p ? nullptr : work;
  }

  static WorkPtr done(WorkPtr host, Tensors outputs, c10d::OpType type, std::function<void()> after = nullptr) {
    ++collectives;
    bool fails = injected_fault(host);
    return c10::make_intrusive<DeviceWork>(std::move(host), std::move(outputs), type, fails, std::move(after));
  }

  c10::intrusive_ptr<c10d::Backend> host_;
  std::string name_;
  std::string upper_;
  std::map<int64_t, std::string> unsupported_;
  bool lenient_;
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
    c10::intrusive_ptr<c10d::Backend> host, std::string name, std::map<int64_t, std::string> unsupported_ops,
    bool lenient) {
  return c10::make_intrusive<SimulatedBackend>(std::move(host), std::move(name), std::move(unsupported_ops), lenient);
}

} // namespace comm_sim
