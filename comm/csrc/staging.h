// comm's staging backend: a c10d Backend for the device types a group's own backend
// does not serve.
//
// A ProcessGroup holds one backend per device type and hands every call, whoever
// makes it (torch.distributed's Python functions, functional collectives, DDP's C++
// reducer, the coalescing manager), to the backend of its tensors' device. comm puts
// this backend in the slots the group leaves empty (the CPU on an nccl or hccl group,
// the accelerator on a gloo group). Each call copies its tensors onto a device the
// group's backend serves, runs that backend's collective on the copies, and writes
// the results back into the caller's tensors when the work completes.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace comm_native {

using Tensors = std::vector<at::Tensor>;
using TensorLists = std::vector<std::vector<at::Tensor>>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
// Makes the communicator staged calls run on; called once, at the first staged call.
using CommunicatorFactory = std::function<BackendPtr()>;

// What staging cost, per collective (torch.distributed's name for it), for comm.stats():
// staged calls, host-device copies, their bytes and the time spent copying.
struct Tally {
  int64_t calls = 0;
  int64_t transfers = 0;
  int64_t bytes = 0;
  int64_t nanoseconds = 0;
};
void tally(const std::string& name, const Tally& more);
std::map<std::string, Tally> tallies();
void resetTallies();
int64_t nowNs();

// Caller tensors and the one staged buffer their results come back from: a tensor's
// copy, or a list's flat buffer, which comes back in one transfer and is then split.
struct Piece {
  Tensors callers;
  at::Tensor staged;
};

// What one staged call writes back once its collective has completed: each piece
// into the caller's tensors it stands for, after dividing by `divisor` (a
// ReduceOp.AVG run as SUM). Written at most once, whoever asks first (wait(), the
// work's future, is_completed()); never written when the collective failed.
class WriteBack {
 public:
  // `results`: the caller's tensors the work reports as its result (torch's: the outputs).
  WriteBack(std::string name, std::string what, std::vector<Piece> pieces, Tensors results, int64_t divisor);

  void write();
  bool written() const { return written_.load(); }
  const Tensors& results() const { return results_; }
  // Says what was staged, for an error raised by the collective.
  const std::string& what() const { return what_; }

 private:
  std::string name_;
  std::string what_;
  std::vector<Piece> pieces_;
  Tensors results_;
  int64_t divisor_;
  std::once_flag once_;
  std::atomic<bool> written_{false};
};

// The work of a staged call: the group backend's work on the copies, completed by
// the write-back. Its future completes after the write-back, with the caller's tensors.
class StagedWork final : public c10d::Work {
 public:
  StagedWork(std::vector<WorkPtr> inner, std::vector<std::shared_ptr<WriteBack>> backs, c10d::OpType type);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  Tensors result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout) override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

 private:
  void writeAll();

  std::vector<WorkPtr> inner_;
  std::vector<std::shared_ptr<WriteBack>> backs_;
};

// Rethrows the exception in flight with a note of what `back` staged.
[[noreturn]] void rethrowStaged(const WriteBack& back);

class StagingBackend final : public c10d::Backend {
 public:
  StagingBackend(int rank, int size, at::Device target, CommunicatorFactory factory);
  StagingBackend(int rank, int size, at::Device target, BackendPtr communicator);

  const std::string getBackendName() const override { return "comm"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  bool supportsCoalescing() const override { return true; }
  bool supportsSplitting() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void startCoalescing() override;
  WorkPtr endCoalescing() override;
  BackendPtr split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                   const c10::intrusive_ptr<Options>& opts) override;

  WorkPtr broadcast(Tensors& tensors, const c10d::BroadcastOptions& opts) override;
  WorkPtr allreduce(Tensors& tensors, const c10d::AllreduceOptions& opts) override;
  WorkPtr allreduce_coalesced(Tensors& tensors, const c10d::AllreduceCoalescedOptions& opts) override;
  WorkPtr reduce(Tensors& tensors, const c10d::ReduceOptions& opts) override;
  WorkPtr allgather(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override;
  WorkPtr _allgather_base(at::Tensor& output, at::Tensor& input, const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather_coalesced(TensorLists& outputs, Tensors& inputs, const c10d::AllgatherOptions& opts) override;
  WorkPtr allgather_into_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::AllgatherOptions& opts) override;
  WorkPtr gather(TensorLists& outputs, Tensors& inputs, const c10d::GatherOptions& opts) override;
  WorkPtr scatter(Tensors& outputs, TensorLists& inputs, const c10d::ScatterOptions& opts) override;
  WorkPtr reduce_scatter(Tensors& outputs, TensorLists& inputs, const c10d::ReduceScatterOptions& opts) override;
  WorkPtr _reduce_scatter_base(at::Tensor& output, at::Tensor& input, const c10d::ReduceScatterOptions& opts) override;
  WorkPtr reduce_scatter_tensor_coalesced(Tensors& outputs, Tensors& inputs,
                                          const c10d::ReduceScatterOptions& opts) override;
  WorkPtr alltoall_base(at::Tensor& output, at::Tensor& input, std::vector<int64_t>& output_splits,
                        std::vector<int64_t>& input_splits, const c10d::AllToAllOptions& opts) override;
  WorkPtr alltoall(Tensors& outputs, Tensors& inputs, const c10d::AllToAllOptions& opts) override;
  WorkPtr send(Tensors& tensors, int dst, int tag) override;
  WorkPtr recv(Tensors& tensors, int src, int tag) override;
  WorkPtr recvAnysource(Tensors& tensors, int tag) override;
  WorkPtr barrier(const c10d::BarrierOptions& opts) override;

  // Where staged calls run; a device without an index until the first staged call fixes it.
  const at::Device& target() const { return target_; }

 private:
  class Call;

  // The communicator staged calls run on, made at the first one.
  c10d::Backend& communicator();
  // The target device, fixed at the first staged call where it names no index.
  const at::Device& stagingTarget();
  // Runs `issue` on a call's staged copies; hands back its work, or keeps it while coalescing.
  WorkPtr finish(Call& call, c10d::OpType type, const std::function<WorkPtr(c10d::Backend&)>& issue);

  at::Device target_;
  std::mutex mutex_;
  CommunicatorFactory factory_;
  BackendPtr communicator_;
  std::chrono::milliseconds timeout_;
  // Between startCoalescing and endCoalescing: the works and write-backs issued so far.
  bool coalescing_ = false;
  bool communicatorCoalesces_ = false;
  std::vector<WorkPtr> coalescedWorks_;
  std::vector<std::shared_ptr<WriteBack>> coalescedBacks_;
};

// From the first call on: a collective whose tensors lie on the CPU and an accelerator,
// on a group comm has equipped, runs on the group's own backend with the CPU tensors
// staged onto the accelerator (mixed_devices.cpp).
void routeMixedDevices();

} // namespace comm_native
