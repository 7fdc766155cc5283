// Shared between the simulated device (device.cpp) and its collective backend (backend.cpp).
#pragma once

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/utils/pybind.h>

namespace comm_sim {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;

constexpr int kMaxDevices = 64;

// What comm.testing.counters() reports.
inline std::atomic<int64_t> transfers{0};
inline std::atomic<int64_t> collectives{0};

// What comm.testing.device_counters(device) reports, per device.
struct DeviceCounters {
  // The host waited on the device: a blocking copy between host and device (torch_npu's
  // CopyKernel.cpp:125-160 synchronises the current stream first), item(), synchronize()
  // of the device, a stream or an event, a wait() in blocking-wait mode, a barrier's wait.
  std::atomic<int64_t> host_syncs{0};
  // Blocking copies that found work queued on the device (a collective the device was
  // told to wait for that no later device operation had waited for yet): the copy
  // drains the compute stream, AclrtSynchronizeStreamWithTimeout in CopyKernel.cpp.
  std::atomic<int64_t> drains{0};
  // HCCL communicators living on the device (made at their first collective) and the
  // device memory HCCL holds for them (HCCL_BUFFSIZE; 2 x P2P_HCCL_BUFFSIZE per p2p peer).
  std::atomic<int64_t> communicators{0};
  std::atomic<int64_t> communicator_bytes{0};
};
inline std::array<DeviceCounters, kMaxDevices> device_counters{};

// A collective's completion on its communicator's stream: finished by the
// communicator's worker, with the collective's error if it failed.
class Completion {
 public:
  void finish(std::exception_ptr error) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      done_ = true;
      error_ = std::move(error);
    }
    cv_.notify_all();
  }
  bool finished() {
    std::lock_guard<std::mutex> lock(mutex_);
    return done_;
  }
  std::exception_ptr error() {
    std::lock_guard<std::mutex> lock(mutex_);
    return error_;
  }
  // The host waits for the collective. Not while holding Python's lock: the backend's
  // thread (gloo's) may need it to finish an earlier call first (destroying a work that
  // carries Python state), and would wait for this thread for ever. A device's operators
  // do not block the host on hardware; here they do, so they must let Python run.
  void wait() {
    std::optional<pybind11::gil_scoped_release> unlocked;
    if (Py_IsInitialized() && PyGILState_Check() == 1) unlocked.emplace();
    std::unique_lock<std::mutex> lock(mutex_);
    cv_.wait(lock, [this] { return done_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr error_;
};
using CompletionPtr = std::shared_ptr<Completion>;

// The calling thread's current stream on device `index` waits for `done` before its
// next operation, as WorkHCCL::wait makes the current stream wait for the collective's
// end event (src@master ProcessGroupHCCL.cpp:1016-1021).
void device_waits_for(c10::DeviceIndex index, CompletionPtr done);
// Stream `stream` of device `index` waits for `done` (aclrtStreamWaitEvent).
void stream_waits_for(c10::DeviceIndex index, c10::StreamId stream, CompletionPtr done);
// The host waits for what the calling thread's current stream on device `index` was
// told to wait for: what a blocking copy synchronises (torch_npu's CopyKernel.cpp
// :125-160 synchronises the current stream only) and what an operator on that stream
// runs after; whether there was any.
bool drain(c10::DeviceIndex index);
// The host waits for what stream `stream` of device `index` was told to wait for, or
// every stream of the device when `stream` is empty (aclrtSynchronizeDevice).
bool drain_stream(c10::DeviceIndex index, std::optional<c10::StreamId> stream);
// The calling thread's current simulated device.
c10::DeviceIndex current_device();
// While alive, events recorded on this thread also wait for `done` (a future marked
// completed at enqueue, under the communicator's stream, as WorkHCCL's).
struct RecordingWith {
  explicit RecordingWith(CompletionPtr done);
  ~RecordingWith();
};

// A CPU tensor over the same host memory as a simulated-device tensor; it keeps the
// device tensor's storage alive for as long as it lives (a collective may outlive its
// caller's tensor). Resizing that storage while a collective runs frees the memory
// under it, as it would on a real device.
at::Tensor host_view(const at::Tensor& tensor);

// The collective backend of the simulated device: runs each collective with `host`
// (a gloo backend) on host views of the device tensors, by HCCL's rules unless `lenient`.
c10::intrusive_ptr<c10d::Backend> make_backend(
    c10::intrusive_ptr<c10d::Backend> host,
    std::string name,
    std::map<int64_t, std::string> unsupported_ops,
    bool lenient,
    int blocking_wait);

// The next `calls` collectives of any simulated backend, after `after` more that succeed,
// fail: 0 when issued, 1 on the device and reported by wait() (as under blocking wait), 2
// on the device and reported as HCCL reports it (the backend's error model).
void fail_next(int mode, int64_t calls, int64_t after);

// The default generator of device `index` (torch.<name>.default_generators), and a new
// one (torch.Generator("npu")): torch_npu's seed-and-offset state (random.cpp).
const at::Generator& default_generator(c10::DeviceIndex index);
at::Generator new_generator(c10::DeviceIndex index);

// Whether `op` draws random numbers: tagged nondeterministic_seeded, or handed a generator.
bool draws_random_numbers(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> arguments);

// One random operator run by its CPU kernel on device `index`'s behalf: the kernel draws
// from a CPU generator seeded from the device generator's (seed, offset) (the generator
// argument's, else the device's default), handed to it in place of the generator argument
// (or, for a kernel without one, the CPU's default generator, whose state is put back
// when the draw ends). done() advances the device generator's offset past the numbers
// in `results`.
class RandomDraw {
 public:
  RandomDraw(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first, c10::DeviceIndex index);
  RandomDraw(const RandomDraw&) = delete;
  RandomDraw& operator=(const RandomDraw&) = delete;
  ~RandomDraw();
  void done(c10::ArrayRef<c10::IValue> results);

 private:
  at::Generator generator_;
  at::Tensor saved_cpu_state_;
};

} // namespace comm_sim
