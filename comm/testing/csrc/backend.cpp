// The simulated device's collective backend (say hccl): a real c10d Backend.
//
// c10d registers a C++ Backend per device type on the process group it creates, so
// the group dispatches by device as it does with nccl or hccl: a CPU tensor never
// reaches this backend, the group itself raises "No backend type associated with
// device type cpu", and the functional collectives (DTensor) find it. A Python
// subclass of ProcessGroup cannot get there: c10d puts it in place of the group.
// Each collective runs with a gloo backend on host views of the device tensors.
#include <ATen/ThreadLocalState.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <deque>
#include <functional>
#include <iostream>
#include <limits>
#include <mutex>
#include <set>
#include <thread>

#include "simulated.h"
#include "torch_releases.h"

namespace comm_sim {
namespace {

using Tensors = std::vector<at::Tensor>;
using TensorLists = std::vector<std::vector<at::Tensor>>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;

// Failures injected on purpose (comm.testing.fail_next): calls numbered [from, to),
// counted across every simulated backend of the process, fail as a link that breaks
// does: when issued (HCCL's enqueue returns an error: C10D_HCCL_CHECK raises at the
// call), or on the device, where the failure is reported by wait() (kReportedByWait:
// what HCCL does under blocking wait) or as the backend's error model reports it
// (kOnDevice: HCCL's default, see ErrorModel).
enum Fault { kNone = -1, kOnIssue = 0, kReportedByWait = 1, kOnDevice = 2 };
struct FaultPlan {
  std::mutex mutex;
  int64_t calls = 0;
  int64_t from = 0;
  int64_t to = 0;
  int mode = kOnIssue;
};
FaultPlan faults;

// How this call fails on the device (kNone: it does not); raises now for a call that fails when issued.
Fault injected_fault(const WorkPtr& host) {
  int64_t call = 0;
  int mode = kOnIssue;
  {
    std::lock_guard<std::mutex> lock(faults.mutex);
    call = ++faults.calls;
    if (call < faults.from || call >= faults.to) return kNone;
    mode = faults.mode;
  }
  if (mode != kOnIssue) return static_cast<Fault>(mode);
  host->wait(); // the peers' matching collective has run: leave nothing in flight
  TORCH_CHECK(false, "injected backend failure (on call ", call, ")");
}

std::exception_ptr injected_on_wait() {
  return std::make_exception_ptr(c10::Error({__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, "injected backend failure (on wait)"));
}

// HCCL's error model, read from the environment when a communicator is made, as
// ProcessGroupHCCL's constructor does (src@master ProcessGroupHCCL.cpp:1223; the
// variables: torch_npu docs, environment_variable/collective_communication/
// TORCH_HCCL_BLOCKING_WAIT.md and HCCL_ASYNC_ERROR_HANDLING.md).
struct ErrorModel {
  // TORCH_HCCL_BLOCKING_WAIT (HCCL_BLOCKING_WAIT in older releases): wait() blocks the
  // host until the collective ends and raises its error (WorkHCCL::synchronizeInternal,
  // src@master ProcessGroupHCCL.cpp:1016-1113).
  bool blocking_wait = false;
  // HCCL_ASYNC_ERROR_HANDLING: 0 nothing; otherwise the watchdog tears the process down
  // when a collective fails (TearDown: handleException rethrows on the watchdog's
  // thread, src@master ProcessGroupHCCL.cpp:987-1002). Blocking wait turns it off, as
  // ProcessGroupNCCL's constructor does ("Only TORCH_NCCL_BLOCKING_WAIT is being used").
  int async_error_handling = 1;
  int rank = 0;
};

bool env_flag(const char* name, bool fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  return std::string(value) != "0";
}

int64_t env_int(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  return std::strtoll(value, nullptr, 10);
}

// What a failed collective leaves in its outputs: not the result (a link that breaks
// mid-collective leaves them partly written); NaN, or -7 for integers.
void leave_garbage(const Tensors& outputs) {
  for (auto output : outputs) {
    if (at::isFloatingType(output.scalar_type()) || at::isComplexType(output.scalar_type())) {
      output.fill_(std::numeric_limits<double>::quiet_NaN());
    } else {
      output.fill_(output.scalar_type() == at::kBool ? 1 : -7);
    }
  }
}

// A collective queued on its communicator's stream.
struct Queued {
  WorkPtr host;                // the gloo collective, issued when the call was made
  CompletionPtr done;
  std::function<void()> after; // what the device does once it has finished (HCCL's divide for AVG)
  Fault fault = kNone;
  Tensors outputs;             // host views of what it writes
  // The issuing thread's state (inference mode among it), which the worker runs under: what
  // it does stands for the device's work, which a real device does not check against the
  // host thread it runs on (gloo's worker threads take the issuer's state too).
  at::ThreadLocalState issuer;
};

// A communicator's stream: a worker of its own that finishes each collective in the order
// issued (the host collective's end, then the device's step after it), and its watchdog
// (ProcessGroupHCCL's workCleanupLoop: src@master ProcessGroupHCCL.cpp:1245-1247 starts
// it, :987-1002 tears down). Threads live as long as the process or the communicator.
class Stream {
 public:
  explicit Stream(ErrorModel model) : state_(std::make_shared<State>()) { state_->model = model; }
  ~Stream() {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->stopping = true;
    }
    state_->ready.notify_all();
  }

  void enqueue(Queued queued) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      state_->queue.push_back(std::move(queued));
      if (!state_->started) {
        state_->started = true;
        std::thread(&Stream::run, state_).detach();
      }
    }
    state_->ready.notify_all();
  }

 private:
  struct State {
    std::mutex mutex;
    std::condition_variable ready;
    std::deque<Queued> queue;
    bool started = false;
    bool stopping = false;
    ErrorModel model;
  };

  static void run(std::shared_ptr<State> state) {
    for (;;) {
      CompletionPtr done;
      std::exception_ptr error;
      bool watched = false;
      {
        Queued next;
        {
          std::unique_lock<std::mutex> lock(state->mutex);
          state->ready.wait(lock, [&] { return state->stopping || !state->queue.empty(); });
          if (state->queue.empty()) return;
          next = std::move(state->queue.front());
          state->queue.pop_front();
        }
        done = next.done;
        at::ThreadLocalStateGuard issuer(next.issuer);
        try {
          next.host->wait();
        } catch (...) {
          error = std::current_exception();
        }
        if (!error && next.fault != kNone) {
          error = injected_on_wait();
          if (next.fault == kOnDevice) leave_garbage(next.outputs);
        }
        if (!error && next.after) {
          try {
            next.after();
          } catch (...) {
            error = std::current_exception();
          }
        }
        watched = next.fault != kReportedByWait;
        // On hardware a collective that has ended no longer holds its buffers; gloo's worker
        // lets go of its work (and the host views in it) only just after marking it complete
        // (ProcessGroupGloo::runLoop resets workInProgress_ after the work ran), so the host's
        // collective is let go here once this is its last holder: memory a caller frees after
        // the wait is free then, as on a device (the staging budget's tests count it).
        for (int spins = 0; spins < 2000 && next.host && next.host.use_count() > 1; ++spins) {
          std::this_thread::sleep_for(std::chrono::microseconds(50));
        }
      }
      // The host's collective is let go before the host learns this one has ended: gloo's
      // barrier waits for every earlier work still alive and raises a failed one's error,
      // so a failed collective kept here a moment longer would fail the caller's next
      // barrier, or not, by timing.
      done->finish(error);
      if (error && watched && !state->model.blocking_wait && state->model.async_error_handling != 0) {
        tear_down(error, state->model.rank);
      }
    }
  }

  // TearDown (src@master ProcessGroupHCCL.cpp:987-1002): log, then rethrow on the
  // watchdog's thread, which ends the process (std::terminate). The watchdog finds the
  // failure at its next poll, not at the instant the collective ends (its loop sleeps
  // between polls: kWatchdogThreadSleepMillis, 100 ms, in ProcessGroupNCCL, which
  // ProcessGroupHCCL's workCleanupLoop follows); the host runs on meanwhile.
  [[noreturn]] static void tear_down(std::exception_ptr error, int rank) {
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    std::cerr << "[Rank " << rank << "] Some HCCL operations have failed or timed out. Due to the "
              << "asynchronous nature of HCCL operations, subsequent NPU operations might run on "
              << "corrupted/incomplete data. To avoid data inconsistency, we are taking the entire "
              << "process down (simulated HCCL watchdog; HCCL_ASYNC_ERROR_HANDLING=0 or "
              << "TORCH_HCCL_BLOCKING_WAIT=1 turn this off)." << std::endl;
    std::rethrow_exception(error);
  }

  std::shared_ptr<State> state_;
};

// WorkHCCL as torch_npu has it: the collective runs on its communicator's stream and
// finishes there; wait() orders the device, not the host; the future is complete at enqueue.
class DeviceWork final : public c10d::Work {
 public:
  DeviceWork(Tensors outputs, c10d::OpType type, CompletionPtr done, bool blocking, Fault fault)
      : Work(-1, type), outputs_(std::move(outputs)), done_(std::move(done)),
        host_waits_(blocking || fault == kReportedByWait || outputs_.empty()) {
    // WorkHCCL's future is marked completed when the collective is enqueued, under the
    // communicator's stream, with events a callback's stream waits for
    // (src@master ProcessGroupHCCL.cpp:4208-4212).
    std::vector<c10::Device> devices;
    for (const auto& tensor : outputs_) {
      if (std::find(devices.begin(), devices.end(), tensor.device()) == devices.end()) {
        devices.push_back(tensor.device());
      }
    }
    future_ = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()), devices);
    RecordingWith recording(done_);
    future_->markCompleted(c10::IValue(outputs_));
  }

  // The collective's end event has been reached (WorkHCCL::isCompleted queries it).
  bool isCompleted() override { return done_->finished(); }
  bool isSuccess() const override { return done_->error() == nullptr; }
  std::exception_ptr exception() const override { return done_->error(); }
  Tensors result() override { return outputs_; }
  // WorkHCCL::synchronize is wait() without a timeout.
  void synchronize() override { wait(std::chrono::milliseconds(0)); }
  // Without blocking wait: the work's device waits for the collective and wait() returns
  // at once, raising nothing (src@master ProcessGroupHCCL.cpp:1016-1021). With it (and for
  // a barrier, whose wait synchronises its device), the host waits and a failure raises.
  bool wait(std::chrono::milliseconds) override {
    auto index = outputs_.empty() ? current_device() : outputs_.front().device().index();
    if (!host_waits_) {
      for (const auto& tensor : outputs_) device_waits_for(tensor.device().index(), done_);
      return true;
    }
    done_->wait();
    ++device_counters[index].host_syncs;
    if (auto error = done_->error()) std::rethrow_exception(error);
    return true;
  }
  void abort() override {}
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return future_; }

 private:
  Tensors outputs_;
  CompletionPtr done_;
  bool host_waits_;
  c10::intrusive_ptr<c10::ivalue::Future> future_;
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

// A message a rank sends to itself, as the host side of a send or receive: gloo has no
// pair to the rank itself ("Pair is not connected"). The send's work is done once its
// tensor is copied into the message; the receive's once the message has been copied out.
class SelfMessage final : public c10d::Work {
 public:
  explicit SelfMessage(c10d::OpType type) : Work(-1, type) {}
  // The send: the data, copied now (the caller may reuse its tensor once the send is waited).
  void post(const Tensors& sent) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      for (const auto& tensor : sent) data_.push_back(tensor.clone());
      posted_ = true;
    }
    ready_.notify_all();
  }
  // The receive: `into` gets the message once it is posted.
  void deliver_into(Tensors into) {
    std::lock_guard<std::mutex> lock(mutex_);
    into_ = std::move(into);
  }
  bool isCompleted() override {
    std::lock_guard<std::mutex> lock(mutex_);
    return posted_;
  }
  bool wait(std::chrono::milliseconds) override {
    std::unique_lock<std::mutex> lock(mutex_);
    ready_.wait(lock, [this] { return posted_; });
    for (size_t i = 0; i < into_.size() && i < data_.size(); ++i) into_[i].copy_(data_[i]);
    into_.clear();
    return true;
  }

 private:
  std::mutex mutex_;
  std::condition_variable ready_;
  bool posted_ = false;
  Tensors data_;
  Tensors into_;
};

// HCCL's rules, as torch_npu's ProcessGroupHCCL applies them (torch_npu 2.13 and 2.9.1;
// sources read: Ascend/pytorch master and v2.9.0-26.0.0, torch_npu/csrc/distributed/,
// cited "master:" and "2.9.1:" below). A simulation made `lenient` skips them all and runs what gloo runs.
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
  // blocking_wait: 1 or 0 as asked, -1 as the environment says.
  SimulatedBackend(c10::intrusive_ptr<c10d::Backend> host, std::string name, std::map<int64_t, std::string> unsupported,
                   bool lenient, int blocking_wait)
      : Backend(host->getRank(), host->getSize()),
        host_(std::move(host)),
        name_(std::move(name)),
        unsupported_(std::move(unsupported)),
        lenient_(lenient) {
    upper_ = name_;
    std::transform(upper_.begin(), upper_.end(), upper_.begin(), [](unsigned char c) { return std::toupper(c); });
    ErrorModel model;
    model.rank = getRank();
    model.blocking_wait = blocking_wait >= 0 ? blocking_wait == 1
                                             : env_flag("TORCH_HCCL_BLOCKING_WAIT", env_flag("HCCL_BLOCKING_WAIT", false));
    model.async_error_handling = model.blocking_wait ? 0 : static_cast<int>(env_int("HCCL_ASYNC_ERROR_HANDLING", 1));
    blocking_wait_ = model.blocking_wait;
    stream_ = std::make_unique<Stream>(model);
  }

  // HcclCommDestroy gives the communicators' memory back: when the group is shut down
  // (destroy_process_group calls ProcessGroup::shutdown, which shuts each backend down;
  // ProcessGroupHCCL's destroys its communicators), or at the latest when it is destroyed.
  void shutdown() override { release(); }
  ~SimulatedBackend() override { release(); }

  const std::string getBackendName() const override { return name_; }
  // ProcessGroupHCCL keeps its options, the group's timeout among them (torch_npu binds them to Python as
  // `options`, ProcessGroupHCCL::getOptions), and takes a new timeout (setTimeout): here the host's.
  c10::intrusive_ptr<Options> getBackendOptions() override {
    return c10::make_intrusive<Options>(name_, host_->getBackendOptions()->timeout);
  }
  void setTimeout(std::chrono::milliseconds timeout) override { host_->setTimeout(timeout); }

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

  // One of the reductions that cast bool and uint8 to int32 for HCCL (allreduce,
  // allreduce_coalesced, reduce: master:ProcessGroupHCCL.cpp:4793-4796, 5070, 5153):
  // `run` calls the host backend on host views of `tensors`, with the op as the host runs it.
  // They come back by copy_: the values are gloo's on the bool or uint8 tensors themselves
  // (OR for a bool SUM, sums modulo 256).
  template <typename Options, typename Run>
  WorkPtr casting(const char* function, Tensors& tensors, const Options& opts, c10d::OpType type, Run&& run) {
    reducible(function, tensors, /*casts=*/true);
    dense(tensors);
    auto hosts = to_host(tensors);
    auto host_opts = opts;
    auto after = reduce_op(host_opts.reduceOp, hosts, tensors);
    return done(run(hosts, host_opts), tensors, type, after);
  }
  WorkPtr broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) override {
    mapped(tensors);
    dense(tensors);
    auto hosts = to_host(tensors);
    return done(host_->broadcast(hosts, opts), tensors, c10d::OpType::BROADCAST);
  }
  WorkPtr allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override {
    return casting("allreduce", tensors, opts, c10d::OpType::ALLREDUCE,
                   [&](Tensors& hosts, c10d::AllreduceOptions& o) { return host_->allreduce(hosts, o); });
  }
  WorkPtr allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) override {
    return join(casting("allreduce_coalesced", tensors, opts, c10d::OpType::ALLREDUCE_COALESCED,
                        [&](Tensors& hosts, c10d::AllreduceCoalescedOptions& o) {
                          return host_->allreduce_coalesced(hosts, o);
                        }));
  }
  WorkPtr reduce(Tensors& tensors, const c10d::ReduceOptions& opts) override {
    return casting("reduce", tensors, opts, c10d::OpType::REDUCE,
                   [&](Tensors& hosts, c10d::ReduceOptions& o) { return host_->reduce(hosts, o); });
  }
  WorkPtr allgather(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override {
    mapped(inputs);
    dense(inputs, flat(outputs));
    if (!lenient_ && outputs.size() == 1 && inputs.size() == 1 && !same_sizes(outputs[0])) {
      return uneven_allgather(outputs[0], inputs[0], opts);
    }
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->allgather(host_outputs, host_inputs, opts), flat(outputs), c10d::OpType::ALLGATHER);
  }
  // HCCL and NCCL check the element count, not the shape: Accelerate passes a flat output
  // (ProcessGroupHCCL::_allgather_base, Ascend/pytorch torch_npu/csrc/distributed/ProcessGroupHCCL.cpp,
  // master; ProcessGroupNCCL's is alike). gloo wants world size rows of the input's shape.
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override {
    mapped({input});
    dense({input, output});
    TORCH_CHECK(input.dtype() == output.dtype(), "output tensor must have the same type as input tensor");
    TORCH_CHECK(input.numel() * getSize() == output.numel(),
                "output tensor size must be equal to world_size times input tensor size");
    auto host_output = stacked(to_host(output), input);
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
    dense(inputs, outputs);
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return join(done(host_->allgather_into_tensor_coalesced(host_outputs, host_inputs, opts), outputs,
                     c10d::OpType::COALESCED));
  }
  WorkPtr gather(TensorLists& outputs, Tensors& inputs, const c10d::GatherOptions& opts) override {
    mapped(inputs);
    dense(inputs, flat(outputs));
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->gather(host_outputs, host_inputs, opts), flat(outputs), c10d::OpType::GATHER);
  }
  WorkPtr scatter(Tensors& outputs, TensorLists& inputs, const c10d::ScatterOptions& opts) override {
    mapped(outputs);
    dense(outputs, flat(inputs));
    auto host_outputs = to_host(outputs);
    auto host_inputs = to_host(inputs);
    return done(host_->scatter(host_outputs, host_inputs, opts), outputs, c10d::OpType::SCATTER);
  }
  // The reduce-scatters check dtypes with no cast of bool or uint8 (master:ProcessGroupHCCL.cpp:5982, 6234, 6307).
  WorkPtr reduce_scatter(Tensors& outputs, TensorLists& inputs, const c10d::ReduceScatterOptions& opts) override {
    reducible("reduce_scatter", outputs, /*casts=*/false);
    dense(outputs, flat(inputs));
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
  // As _allgather_base: the element count is checked (ProcessGroupHCCL::_reduce_scatter_base, master).
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override {
    reducible("_reduce_scatter_base", {input}, /*casts=*/false);
    dense({input, output});
    TORCH_CHECK(input.dtype() == output.dtype(), "input tensor must be the same type as the output tensor.");
    TORCH_CHECK(input.numel() == output.numel() * getSize(),
                "input tensor must be the same size as output size times world size");
    auto host_output = to_host(output);
    auto host_input = stacked(to_host(input), output);
    auto host_opts = opts;
    auto after = reduce_op(host_opts.reduceOp, {host_input}, {output});
    return done(host_->_reduce_scatter_base(host_output, host_input, host_opts), {output},
                c10d::OpType::_REDUCE_SCATTER_BASE, after);
  }
  WorkPtr reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::ReduceScatterOptions& opts) override {
    reducible("reduce_scatter_tensor_coalesced", inputs, /*casts=*/false);
    dense(inputs, outputs);
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
    dense({input, output});
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
    dense(tensors);
    peer(tensors, dst);
    auto hosts = to_host(tensors);
    WorkPtr host = dst == getRank() && !lenient_ ? to_self(hosts, tag) : host_->send(hosts, dst, tag);
    return join(done(host, tensors, c10d::OpType::SEND), /*p2p=*/true);
  }
  WorkPtr recv(Tensors& tensors, int src, int tag) override {
    mapped(tensors);
    dense(tensors);
    peer(tensors, src);
    auto hosts = to_host(tensors);
    WorkPtr host = src == getRank() && !lenient_ ? from_self(hosts, tag) : host_->recv(hosts, src, tag);
    return join(done(host, tensors, c10d::OpType::RECV), /*p2p=*/true);
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
  // check_npu_single_tensor and check_npu_tensors_different_devices (ProcessGroupHCCL.cpp,
  // Ascend/pytorch master): a tensor HCCL reads or writes in place must be dense in its
  // suggested memory format ("Tensors must be contiguous": Ascend's fault case
  // error_discontinuous_tensor), where gloo would compute on the view's storage as if it
  // were; lists of tensors HCCL copies through a flat buffer (`others`) need not be. And a
  // call's tensors lie on one NPU (Ascend's fault case error_size asserts "... must all
  // reside on the same device" of a reduce-scatter whose inputs are on another NPU).
  void dense(const Tensors& tensors, const Tensors& others = {}) const {
    if (lenient_) return;
    for (const auto& tensor : tensors) {
      if (tensor.device().type() != kDevice) continue; // another device type: to_host says the group's error
      TORCH_CHECK(tensor.is_contiguous(tensor.suggest_memory_format()), "Tensors must be contiguous");
    }
    std::optional<c10::Device> first;
    for (const auto* list : {&tensors, &others}) {
      for (const auto& tensor : *list) {
        if (tensor.device().type() != kDevice) continue; // another device type: to_host says the group's error
        if (!first) first = tensor.device();
        TORCH_CHECK(tensor.device() == *first, "Tensors must all reside on the same device, got ", *first, " and ",
                    tensor.device());
      }
    }
  }
  // A rank's sends to itself and receives from itself (Ascend's batch_isend_irecv tests
  // include them, and every receive holds what was sent), matched in order per tag, in
  // whichever order the two are issued: one message each, which the send posts and the
  // receive's work copies out.
  c10::intrusive_ptr<SelfMessage> message_for(int tag, bool sending) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto& waiting = sending ? self_receives_[tag] : self_sends_[tag];
    if (!waiting.empty()) {
      auto message = waiting.front();
      waiting.pop_front();
      return message;
    }
    auto message = c10::make_intrusive<SelfMessage>(c10d::OpType::SEND);
    (sending ? self_sends_[tag] : self_receives_[tag]).push_back(message);
    return message;
  }
  WorkPtr to_self(const Tensors& hosts, int tag) {
    auto message = message_for(tag, /*sending=*/true);
    message->post(hosts);
    return message;
  }
  WorkPtr from_self(const Tensors& hosts, int tag) {
    auto message = message_for(tag, /*sending=*/false);
    message->deliver_into(hosts);
    return message;
  }
  static bool same_sizes(const Tensors& tensors) {
    return std::all_of(tensors.begin(), tensors.end(),
                       [&](const at::Tensor& tensor) { return tensor.sizes() == tensors.front().sizes(); });
  }
  // A list all-gather whose ranks' tensors differ in shape, as HCCL gathers them (Ascend's
  // test/distributed test_all_gather_dist_different_shape: every rank gets every rank's
  // tensor; ProcessGroupHCCL::allgather checks check_same_size and gathers unequal ones
  // apart). gloo gathers equal sizes only: each rank's elements go padded to the largest,
  // and each output takes its own count back once the gather has run.
  WorkPtr uneven_allgather(Tensors& outputs, at::Tensor& input, const c10d::AllgatherOptions& opts) {
    TORCH_CHECK(static_cast<int>(outputs.size()) == getSize(), "allgather: the output list must have one tensor per rank");
    TORCH_CHECK(outputs[getRank()].numel() == input.numel(), "allgather: this rank's output must match its input's size");
    int64_t largest = 0;
    for (const auto& output : outputs) {
      TORCH_CHECK(output.scalar_type() == input.scalar_type(), "Tensors must have identical type");
      largest = std::max(largest, output.numel());
    }
    auto host_input = to_host(input);
    Tensors padded_outputs;
    for (int rank = 0; rank < getSize(); ++rank) padded_outputs.push_back(at::empty({largest}, host_input.options()));
    std::vector<Tensors> gathered{padded_outputs};
    Tensors padded_input{at::zeros({largest}, host_input.options())};
    padded_input[0].narrow(0, 0, input.numel()).copy_(host_input.reshape({-1}));
    Tensors hosts;
    for (const auto& output : outputs) hosts.push_back(host_view(output));
    auto after = [hosts, padded_outputs]() {
      for (size_t rank = 0; rank < hosts.size(); ++rank) {
        auto target = hosts[rank];
        target.copy_(padded_outputs[rank].narrow(0, 0, target.numel()).view(target.sizes()));
      }
    };
    return done(host_->allgather(gathered, padded_input, opts), outputs, c10d::OpType::ALLGATHER, after);
  }
  // `whole` (world size pieces of `piece`'s elements) viewed as gloo wants it: the pieces
  // stacked along the first dimension, each of `piece`'s shape. A view, so gloo writes
  // through it; left as it is where it cannot be viewed so (gloo then says why).
  at::Tensor stacked(const at::Tensor& whole, const at::Tensor& piece) const {
    std::vector<int64_t> shape(piece.sizes().begin(), piece.sizes().end());
    if (shape.empty()) {
      shape.push_back(getSize());
    } else {
      shape[0] *= getSize();
    }
    if (!whole.is_contiguous() || whole.sizes().vec() == shape) return whole;
    return whole.view(shape);
  }
  // checkSupportedDataType in the reductions, named by ProcessGroupHCCL's function;
  // `casts`: bool and uint8 are cast to int32 first (allreduce, allreduce_coalesced, reduce).
  void reducible(const char* function, const Tensors& tensors, bool casts) const {
    // gloo, under the simulation, cannot reduce int16 (HCCL can): refused at the call with
    // gloo's message, not on the stream's worker, where it would reach the watchdog.
    for (const auto& tensor : tensors) TORCH_CHECK(tensor.scalar_type() != at::kShort, "Invalid scalar type");
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
    // gloo refuses PREMUL_SUM on its worker; lenient runs what gloo runs, refused at the call
    // rather than on the stream's worker, where it would reach the watchdog.
    TORCH_CHECK(!lenient_ || op.op_ != c10d::ReduceOp::PREMUL_SUM, "Cannot use ReduceOp.PREMUL_SUM with Gloo");
    if (lenient_) return nullptr;
    // getHcclReduceOp's unsupportedOp (master:ProcessGroupHCCL.cpp:94-97, 159-161; 2.9.1 :87, 161).
    static const std::map<c10d::ReduceOp::RedOpType, const char*> bitwise = {
        {c10d::ReduceOp::BAND, "BAND"}, {c10d::ReduceOp::BOR, "BOR"}, {c10d::ReduceOp::BXOR, "BXOR"}};
    auto refused = bitwise.find(op.op_);
    if (refused != bitwise.end()) TORCH_CHECK(false, "Cannot use ReduceOp.", refused->second, " with ", upper_);
    switch (op.op_) {
      case c10d::ReduceOp::AVG: {
        // The simulation's own reading of HCCL, kept apart from comm's (StagedCall::reduceOp,
        // comm/gaps.py) on purpose, so that a misreading in either shows as a failing test.
        // SUM, then each output divided by the group's size on the device
        // (master:ProcessGroupHCCL.cpp:136-141, 4808-4816). Integers average to integers:
        // Ascend's own tests assert it of int32 and uint8 on every part (test/distributed
        // test_allreduce.py, test_dist_all_reduce_avg and _uint8_avg, whose expected values
        // are the sum floor-divided by the world size); how HCCL rounds a negative sum that
        // does not divide is not read from its source: floor, as the tests compute.
        // A bool has no average: refused at the call, as NCCL refuses it (HCCL's answer not read).
        for (const auto& tensor : outputs) {
          TORCH_CHECK(tensor.scalar_type() != at::kBool, "Cannot use ReduceOp.AVG with boolean inputs");
        }
        op = c10d::ReduceOp(c10d::ReduceOp::SUM);
        auto size = getSize();
        Tensors hosts; // the device's step runs on the stream's worker, on host views
        for (const auto& tensor : outputs) hosts.push_back(host_view(tensor));
        return [hosts, size]() {
          for (auto tensor : hosts) {
            if (at::isIntegralType(tensor.scalar_type(), /*includeBool=*/false)) {
              tensor.div_(size, "floor");
            } else {
              tensor.div_(size);
            }
          }
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
  // The communicator's stream waits for the current stream (ProcessGroupHCCL's
  // syncStreams before each collective): the collective reads and writes after what the
  // current stream was told to wait for. The host waits here where hardware does not.
  static at::Tensor to_host(const at::Tensor& tensor) {
    TORCH_CHECK(tensor.device().type() == kDevice, "No backend type associated with device type ",
                tensor.device().type());
    drain(tensor.device().index());
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

  // The collective queued on the communicator's stream; its work.
  WorkPtr done(WorkPtr host, Tensors outputs, c10d::OpType type, std::function<void()> after = nullptr) {
    ++collectives;
    auto index = outputs.empty() ? current_device() : outputs.front().device().index();
    if (type != c10d::OpType::SEND && type != c10d::OpType::RECV) charge(index, "", env_int("HCCL_BUFFSIZE", 200));
    Fault fault = injected_fault(host);
    Queued queued;
    queued.host = std::move(host);
    queued.done = std::make_shared<Completion>();
    queued.after = std::move(after);
    queued.fault = fault;
    for (const auto& output : outputs) queued.outputs.push_back(host_view(output));
    auto completion = queued.done;
    stream_->enqueue(std::move(queued));
    return c10::make_intrusive<DeviceWork>(std::move(outputs), type, std::move(completion), blocking_wait_, fault);
  }

  // Communicator memory. HCCL makes a group's communicator at its first collective, with a
  // buffer of HCCL_BUFFSIZE MB (200 by default), and one communicator per point-to-point
  // peer with 2 x P2P_HCCL_BUFFSIZE MB (20 by default): torch_npu docs, environment_variable/
  // collective_communication/P2P_HCCL_BUFFSIZE.md (Ascend/pytorch docs/zh/api/). HCCL allocates it outside torch_npu's caching allocator: mem_get_info sees
  // it, memory_reserved does not.
  void charge(c10::DeviceIndex index, const std::string& key, int64_t megabytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!made_.insert(key).second) return;
    int64_t bytes = std::max<int64_t>(megabytes, 0) << 20;
    device_counters[index].communicators += 1;
    device_counters[index].communicator_bytes += bytes;
    charged_.emplace_back(index, bytes);
  }
  void release() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const auto& [index, bytes] : charged_) {
      device_counters[index].communicators -= 1;
      device_counters[index].communicator_bytes -= bytes;
    }
    charged_.clear();
    made_.clear();
  }
  void peer(const Tensors& tensors, int rank) {
    auto index = tensors.empty() ? current_device() : tensors.front().device().index();
    charge(index, c10::str("p2p:", rank), 2 * env_int("P2P_HCCL_BUFFSIZE", 20));
  }

  std::map<int, std::deque<c10::intrusive_ptr<SelfMessage>>> self_sends_;
  std::map<int, std::deque<c10::intrusive_ptr<SelfMessage>>> self_receives_;
  c10::intrusive_ptr<c10d::Backend> host_;
  std::string name_;
  std::string upper_;
  std::map<int64_t, std::string> unsupported_;
  bool lenient_;
  std::mutex mutex_;
  bool coalescing_ = false;
  std::vector<WorkPtr> joined_;
  bool blocking_wait_ = false;
  std::unique_ptr<Stream> stream_;
  std::set<std::string> made_;                                     // communicators made: "" and "p2p:<peer>"
  std::vector<std::pair<c10::DeviceIndex, int64_t>> charged_;      // what they hold, per device
};

} // namespace

void fail_next(int mode, int64_t calls, int64_t after) {
  TORCH_CHECK(mode >= kOnIssue && mode <= kOnDevice, "fail_next: unknown mode ", mode);
  std::lock_guard<std::mutex> lock(faults.mutex);
  faults.from = faults.calls + 1 + after;
  faults.to = faults.from + calls;
  faults.mode = mode;
}

c10::intrusive_ptr<c10d::Backend> make_backend(
    c10::intrusive_ptr<c10d::Backend> host, std::string name, std::map<int64_t, std::string> unsupported_ops,
    bool lenient, int blocking_wait) {
  return c10::make_intrusive<SimulatedBackend>(std::move(host), std::move(name), std::move(unsupported_ops), lenient,
                                               blocking_wait);
}

} // namespace comm_sim
