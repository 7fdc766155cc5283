// The work of a staged call, and the write-back that completes it.
#include <unistd.h>

#include <condition_variable>
#include <deque>

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

// The thread that completes staged works' futures, so that getFuture() returns at once: a
// communicator's future may be complete as soon as the collective is queued (HCCL's is,
// ProcessGroupHCCL.cpp:4208-4212), and results bound for the host are written back only
// once the collective itself has run. Futures complete in the order they were asked for.
class Completer {
 public:
  // The process's completer; a forked child starts its own, since the parent's thread is not in it.
  static Completer& get() {
    static std::mutex mutex;
    static Completer* current = nullptr;
    std::lock_guard<std::mutex> lock(mutex);
    // Never deleted: its thread may still run while the process's statics are destroyed.
    if (current == nullptr || current->pid_ != getpid()) current = new Completer();
    return *current;
  }

  void post(std::function<void()> task) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      tasks_.push_back(std::move(task));
    }
    ready_.notify_one();
  }

 private:
  Completer() : pid_(getpid()) {
    std::thread([this] { run(); }).detach();
  }

  void run() {
    for (;;) {
      std::function<void()> task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return !tasks_.empty(); });
        task = std::move(tasks_.front());
        tasks_.pop_front();
      }
      task();
    }
  }

  pid_t pid_;
  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> tasks_;
};

} // namespace

WorkPtr doneWork() {
  return c10::make_intrusive<DoneWork>();
}

WriteBack::WriteBack(std::string name, std::string what, std::vector<Piece> pieces, Tensors results,
                     int64_t divisor)
    : name_(std::move(name)), what_(std::move(what)), pieces_(std::move(pieces)), results_(std::move(results)),
      divisor_(divisor) {}

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
  if (source.device() != callers.front().device()) source = at::_to_copy(source, source.options().device(callers.front().device()));
  int64_t offset = 0;
  for (auto& caller : callers) {
    caller.copy_(source.narrow(0, offset, caller.numel()).view(caller.sizes()));
    offset += caller.numel();
  }
}

} // namespace

void WriteBack::write() {
  std::call_once(once_, [this] {
    at::AutoDispatchBelowADInplaceOrView belowAutograd; // as torch's backends write their outputs
    RECORD_FUNCTION("comm.write_back", std::vector<c10::IValue>());
    Tally copied;
    auto start = nowNs();
    // Results bound for the host are copied into pinned memory without blocking, on the
    // current stream (which wait() ordered after the collective, and nothing else of the
    // caller's), and the host waits once, for those copies only: never for the caller's
    // compute stream, as a blocking copy would.
    std::vector<at::Tensor> landed(pieces_.size());
    std::optional<at::Device> device;
    for (size_t i = 0; i < pieces_.size(); ++i) {
      auto& piece = pieces_[i];
      if (divisor_ != 1) piece.staged.div_(divisor_);
      copied.transfers += 1;
      copied.bytes += static_cast<int64_t>(piece.staged.nbytes());
      if (!toHost(piece)) continue;
      landed[i] = at::empty(piece.staged.sizes(), piece.staged.options().device(at::kCPU).pinned_memory(true));
      landed[i].copy_(piece.staged, /*non_blocking=*/true);
      device = piece.staged.device();
    }
    if (device) {
      c10::Event copiedBack(device->type());
      copiedBack.record(c10::impl::getDeviceGuardImpl(device->type())->getStream(*device));
      copiedBack.synchronize();
    }
    for (size_t i = 0; i < pieces_.size(); ++i) {
      distribute(landed[i].defined() ? landed[i] : pieces_[i].staged, pieces_[i].callers);
    }
    copied.nanoseconds = nowNs() - start;
    if (copied.transfers > 0) tally(name_, copied);
    pieces_.clear(); // the copies are not needed once written
    written_ = true;
  });
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
                       std::optional<c10::Stream> stream)
    : Work(-1, type), inner_(std::move(inner)), backs_(std::move(backs)), stream_(stream) {}

void StagedWork::writeAll() {
  c10::OptionalStreamGuard guard(stream_);
  for (auto& back : backs_) back->write();
}

bool StagedWork::isCompleted() {
  for (auto& work : inner_) {
    if (!work->isCompleted()) return false;
  }
  if (isSuccess()) writeAll();
  return true;
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
  Tensors all;
  for (const auto& back : backs_) all.insert(all.end(), back->results().begin(), back->results().end());
  return all;
}

void StagedWork::synchronize() {
  c10::OptionalStreamGuard guard(stream_);
  for (auto& work : inner_) work->synchronize();
}

bool StagedWork::wait(std::chrono::milliseconds timeout) {
  c10::OptionalStreamGuard guard(stream_); // the collective's wait() orders the stream the call was staged on
  for (size_t i = 0; i < inner_.size(); ++i) {
    try {
      inner_[i]->wait(timeout);
    } catch (...) {
      rethrowStaged(backs_.at(std::min(i, backs_.size() - 1))->what());
    }
  }
  writeAll();
  return true;
}

void StagedWork::abort() {
  for (auto& work : inner_) work->abort();
}

c10::intrusive_ptr<c10::ivalue::Future> StagedWork::getFuture() {
  auto future = c10::make_intrusive<c10::ivalue::Future>(c10::ListType::create(c10::TensorType::get()));
  auto self = c10::intrusive_ptr<StagedWork>::reclaim_copy(this);
  Completer::get().post([self, future] {
    try {
      self->wait(kNoTimeout); // rethrows the collective's error, with what was staged
      future->markCompleted(c10::IValue(self->result()));
    } catch (...) {
      future->setError(std::current_exception());
    }
  });
  return future;
}

} // namespace comm_native
