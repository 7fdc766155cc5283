// The work of a staged call, and the write-back that completes it.
#include <algorithm>
#include <thread>

#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>

#include <c10/core/Event.h>
#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

#include "staging.h"

namespace comm_native {

namespace {

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

int64_t bytesOf(const Tensors& buffers) {
  int64_t bytes = 0;
  for (const auto& buffer : buffers) bytes += static_cast<int64_t>(buffer.storage().nbytes());
  return bytes;
}

} // namespace

WorkPtr doneWork() {
  return c10::make_intrusive<DoneWork>();
}

WriteBack::WriteBack(std::string name, std::function<std::string()> what, std::vector<Piece> pieces, Tensors results,
                     int64_t divisor, Tensors held)
    : name_(std::move(name)), what_(std::move(what)), pieces_(std::move(pieces)), writes_(!pieces_.empty()),
      results_(std::move(results)), divisor_(divisor), held_(std::move(held)), heldBytes_(bytesOf(held_)) {}

namespace {

// Whether a piece's results travel from an accelerator to the host.
bool toHost(const Piece& piece) {
  return !piece.staged.device().is_cpu() && piece.callers.front().device().is_cpu();
}

// `source` (the results, end to end) into `callers`: one transfer to their device, then
// each caller takes its part.
void distribute(at::Tensor source, Tensors& callers) {
  if (callers.size() == 1) { // its copy, or a flat buffer of one tensor
    auto& caller = callers.front();
    caller.copy_(source.sizes() == caller.sizes() ? source : source.reshape(caller.sizes()));
    return;
  }
  if (source.device() != callers.front().device()) {
    source = at::_to_copy(source, source.options().device(callers.front().device()));
  }
  int64_t offset = 0;
  for (auto& caller : callers) {
    caller.copy_(source.narrow(0, offset, caller.numel()).view(caller.sizes()));
    offset += caller.numel();
  }
}

} // namespace

void WriteBack::copyBack() {
  if (!writes_) return; // nothing comes back (a send, a broadcast's source)
  std::lock_guard<std::mutex> lock(mutex_);
  if (queued_) return;
  at::AutoDispatchBelowADInplaceOrView belowAutograd; // as torch's backends write their outputs
  RECORD_FUNCTION("comm.copy_back", std::vector<c10::IValue>());
  if (!divided_ && divisor_ != 1) {
    for (auto& piece : pieces_) piece.staged.div_(divisor_);
  }
  divided_ = true; // never twice, should a copy below fail and copyBack run again
  // Non-blocking copies into pinned memory, on the current stream: the host waits for
  // them alone (awaitCopies), never for the caller's compute stream, as a blocking copy would.
  landed_.resize(pieces_.size());
  std::optional<at::Device> device;
  for (size_t i = 0; i < pieces_.size(); ++i) {
    const auto& piece = pieces_[i];
    if (!toHost(piece) || landed_[i].defined()) continue;
    auto buffer = at::empty(piece.staged.sizes(), piece.staged.options().device(at::kCPU).pinned_memory(true));
    buffer.copy_(piece.staged, /*non_blocking=*/true);
    landed_[i] = buffer;
    device = piece.staged.device();
  }
  if (device) {
    copied_.emplace(device->type());
    copied_->record(c10::impl::getDeviceGuardImpl(device->type())->getStream(*device));
  }
  queued_ = true;
}

bool WriteBack::awaitCopies(bool covered) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!copied_) return covered;
  if (!covered) copied_->synchronize();
  return true;
}

void WriteBack::land(bool failed) {
  std::call_once(landOnce_, [this, failed] {
    at::AutoDispatchBelowADInplaceOrView belowAutograd;
    RECORD_FUNCTION("comm.write_back", std::vector<c10::IValue>());
    Tally copied;
    auto start = nowNs();
    for (size_t i = 0; i < pieces_.size(); ++i) {
      const auto& piece = pieces_[i];
      if (failed && !piece.reads) continue;
      copied.transfers += 1;
      copied.bytes += static_cast<int64_t>(piece.staged.nbytes());
      distribute(i < landed_.size() && landed_[i].defined() ? landed_[i] : piece.staged, pieces_[i].callers);
    }
    copied.nanoseconds = nowNs() - start;
    if (copied.transfers > 0) tally(name_, copied);
    pieces_.clear(); // the copies are not needed once written
    landed_.clear();
  });
}

void WriteBack::release(bool recorded) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (recorded) {
    for (const auto& buffer : held_) {
      const auto* impl = c10::impl::getDeviceGuardImpl(buffer.device().type());
      impl->recordDataPtrOnStream(buffer.storage().data_ptr(), impl->getStream(buffer.device()));
    }
  }
  held_.clear();
  heldBytes_ = 0;
}

int64_t WriteBack::heldBytes() const {
  return heldBytes_;
}

void rethrowStaged(const std::string& what) {
  try {
    throw;
  } catch (c10::Error& error) {
    error.add_context(what);
    throw;
  } catch (const std::exception& error) {
    TORCH_CHECK(false, error.what(), "\n", what);
  }
}

StagedWork::StagedWork(std::vector<WorkPtr> inner, std::vector<std::shared_ptr<WriteBack>> backs, c10d::OpType type,
                       std::optional<c10::Stream> stream, Tensors results, Completes completes)
    : Work(-1, type), inner_(std::move(inner)), backs_(std::move(backs)), stream_(stream),
      results_(std::move(results)), completes_(completes) {
  inner_.erase(std::remove(inner_.begin(), inner_.end(), WorkPtr()), inner_.end());
}

void StagedWork::writeAll() {
  c10::OptionalStreamGuard guard(stream_);
  for (auto& back : backs_) back->copyBack();
  // One wait, for the last copies: they ran on one stream, after the earlier ones.
  bool covered = false;
  for (auto back = backs_.rbegin(); back != backs_.rend(); ++back) covered = (*back)->awaitCopies(covered);
  // A collective that failed without raising leaves its tensors as the served call would
  // only where comm's copy began as the caller's data (an all-reduce's: what the collective
  // left in place, garbage or not); a fresh output buffer's stale contents never land.
  bool failed = failedQuietly();
  for (auto& back : backs_) back->land(failed);
}

bool StagedWork::failedQuietly() {
  return std::any_of(inner_.begin(), inner_.end(), [](const WorkPtr& work) {
    work->isCompleted(); // NCCL's and HCCL's works learn of an error here (isSuccess() is deprecated on NCCL's)
    return work->exception() != nullptr;
  });
}

bool StagedWork::isCompleted() {
  for (auto& work : inner_) {
    if (!work->isCompleted()) return false;
  }
  // exception(), not isSuccess(): NCCL's isSuccess() throws that it is deprecated
  // (torch's ProcessGroupNCCL.cpp, WorkNCCL::isSuccess); every work has set its error by now.
  if (exception() == nullptr) writeAll();
  releaseBuffers(/*recorded=*/false); // the collectives are done with them
  return true;
}

void StagedWork::releaseBuffers(bool recorded) {
  // Recorded on stream_, which wait() ordered after the collectives: the caller's own
  // stream is not, and a buffer recorded there could go to its next copy before the
  // communicator has read it.
  c10::OptionalStreamGuard guard(stream_);
  for (auto& back : backs_) back->release(recorded);
}

bool StagedWork::isSuccess() const {
  for (const auto& work : inner_) {
    if (!work->isSuccess()) return false;
  }
  return true;
}

std::exception_ptr StagedWork::exception() const {
  for (const auto& work : inner_) {
    if (auto error = work->exception()) return error;
  }
  return nullptr;
}

int StagedWork::sourceRank() const {
  TORCH_CHECK(inner_.size() == 1, "sourceRank() needs the work of one receive");
  return inner_.front()->sourceRank();
}

Tensors StagedWork::result() {
  if (!results_.empty()) return results_;
  Tensors all;
  for (const auto& back : backs_) all.insert(all.end(), back->results().begin(), back->results().end());
  return all;
}

void StagedWork::waitInner(std::chrono::milliseconds timeout, bool copyEachBack) {
  {
    c10::OptionalStreamGuard guard(stream_); // the collective's wait() orders the stream the call was staged on
    for (size_t i = 0; i < inner_.size(); ++i) {
      try {
        inner_[i]->wait(timeout);
      } catch (...) {
        rethrowStaged(backs_.at(std::min(i, backs_.size() - 1))->what());
      }
      // A chunk's copies back go as soon as its collective is waited for, beside the next
      // collective; nothing reaches the caller's tensors until every work has succeeded.
      if (copyEachBack) backs_[i]->copyBack();
    }
  }
  orderCallersStream();
}

void StagedWork::orderCallersStream() {
  if (completes_ != Completes::Block || !stream_) return;
  // Through an event on stream_, not by waiting for each work again on the caller's stream:
  // a communicator's work waited twice may wait for ever (gloo's send waits for a second send).
  // Called outside stream_'s guard: the device's current stream is then the caller's.
  const auto* impl = c10::impl::getDeviceGuardImpl(stream_->device_type());
  c10::Event waited(stream_->device_type());
  waited.record(*stream_);
  waited.block(impl->getStream(stream_->device()));
}

void StagedWork::synchronize() {
  {
    c10::OptionalStreamGuard guard(stream_);
    for (auto& work : inner_) work->synchronize();
  }
  orderCallersStream();
  releaseBuffers(/*recorded=*/true); // on stream_, which now waits for the collectives
}

bool StagedWork::wait(std::chrono::milliseconds timeout) {
  if (waited_) return true; // its results are written; a communicator's work waited twice may wait for ever
  if (failed_) std::rethrow_exception(failure_); // the same failure, never a second, silent attempt
  try {
    waitInner(timeout, /*copyEachBack=*/completes_ == Completes::Calls && inner_.size() == backs_.size());
    writeAll();
  } catch (...) {
    failure_ = std::current_exception();
    failed_ = true;
    throw;
  }
  releaseBuffers(/*recorded=*/true); // on stream_, which now waits for the collectives
  waited_ = true;
  return true;
}

int64_t StagedWork::heldBytes() {
  if (failed_) return 0; // see failed_
  int64_t bytes = 0;
  for (auto& back : backs_) bytes += back->heldBytes();
  return bytes;
}

void StagedWork::release_resources() {
  inner_.clear();
  backs_.clear();
  results_.clear();
}

void StagedWork::retire() {
  if (heldBytes() == 0) return; // waited for already, failed, or it holds nothing
  try {
    wait(kNoTimeout);
  } catch (...) {
    return; // the failure is this work's: its own wait() raises it, not the call that makes room
  }
  if (stream_) {
    // The buffers went back recorded on stream_: the allocator hands them out again once
    // stream_ has passed that point.
    c10::Event passed(stream_->device_type());
    passed.record(*stream_);
    passed.synchronize();
  }
  // A communicator's work may keep its tensors (comm's copies) alive as long as it lives;
  // the caller may keep this work long after. Dropped here, unless a future's thread may be
  // reading them: the work then reports success, which it has.
  if (!futureMade_) inner_.clear();
}

void StagedWork::abort() {
  for (auto& work : inner_) work->abort();
}

c10::intrusive_ptr<c10::ivalue::Future> StagedWork::getFuture() {
  // Completed by a thread of its own, so that getFuture() returns at once: a communicator's
  // future may be complete as soon as the collective is queued (HCCL's is,
  // ProcessGroupHCCL.cpp:4208-4212), and results bound for the host are written back only
  // once the collective itself has run. A thread per future, not one shared queue: a
  // callback that waits for another staged future must not wait behind itself.
  futureMade_ = true;
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  auto self = c10::intrusive_ptr<StagedWork>::reclaim_copy(this);
  std::thread([self, future] {
    try {
      self->wait(kNoTimeout); // rethrows the collective's error, with what was staged
      future->markCompleted(c10::IValue(self->result()));
    } catch (...) {
      future->setError(std::current_exception());
    }
  }).detach();
  return future;
}

} // namespace comm_native
