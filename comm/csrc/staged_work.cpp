// The work of a staged call, and the write-back that completes it.
#include <ATen/core/ivalue.h>
#include <ATen/record_function.h>

#include <c10/core/StreamGuard.h>

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

} // namespace

WorkPtr doneWork() {
  return c10::make_intrusive<DoneWork>();
}

WriteBack::WriteBack(std::string name, std::string what, std::vector<Piece> pieces, Tensors results,
                     int64_t divisor)
    : name_(std::move(name)), what_(std::move(what)), pieces_(std::move(pieces)), results_(std::move(results)),
      divisor_(divisor) {}

void WriteBack::write() {
  std::call_once(once_, [this] {
    at::AutoDispatchBelowADInplaceOrView belowAutograd; // as torch's backends write their outputs
    RECORD_FUNCTION("comm.write_back", std::vector<c10::IValue>());
    Tally copied;
    auto start = nowNs();
    for (auto& piece : pieces_) {
      if (divisor_ != 1) piece.staged.div_(divisor_);
      copied.transfers += 1;
      copied.bytes += static_cast<int64_t>(piece.staged.nbytes());
      if (piece.callers.size() == 1) { // its copy, or a flat buffer of one tensor
        auto& caller = piece.callers.front();
        caller.copy_(piece.staged.sizes() == caller.sizes() ? piece.staged : piece.staged.reshape(caller.sizes()));
        continue;
      }
      // A list: its flat buffer comes back in one transfer, then each tensor takes its part.
      auto back = at::_to_copy(piece.staged, piece.staged.options().device(piece.callers.front().device()));
      int64_t offset = 0;
      for (auto& caller : piece.callers) {
        caller.copy_(back.narrow(0, offset, caller.numel()).view(caller.sizes()));
        offset += caller.numel();
      }
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
  auto type = c10::ListType::create(c10::TensorType::get());
  c10::intrusive_ptr<c10::ivalue::Future> done;
  if (inner_.size() == 1) {
    done = inner_.front()->getFuture();
  } else {
    c10::List<c10::intrusive_ptr<c10::ivalue::Future>> futures(c10::FutureType::create(c10::AnyType::get()));
    for (auto& work : inner_) futures.push_back(work->getFuture());
    done = c10::collectAll(futures);
  }
  return done->then(
      [backs = backs_](c10::ivalue::Future& finished) {
        try {
          finished.value(); // rethrows the collective's error into the returned future
        } catch (...) {
          rethrowStaged(backs.front()->what());
        }
        Tensors callers;
        for (const auto& back : backs) {
          back->write();
          callers.insert(callers.end(), back->results().begin(), back->results().end());
        }
        return c10::IValue(callers);
      },
      type);
}

} // namespace comm_native
