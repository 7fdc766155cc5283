// The staging backend itself: its communicator and target device, made and fixed at the
// first staged call; the four steps every call goes through; coalescing blocks; split.
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>

#include "staging.h"

namespace comm_native {

StagingBackend::StagingBackend(int rank, int size, at::Device target, CommunicatorFactory factory)
    : Backend(rank, size), target_(target), factory_(std::move(factory)), timeout_(kBackendDefaultTimeout) {}

StagingBackend::StagingBackend(int rank, int size, at::Device target, BackendPtr communicator)
    : Backend(rank, size), target_(target), communicator_(std::move(communicator)),
      timeout_(kBackendDefaultTimeout) {}

at::Device StagingBackend::target() const {
  std::lock_guard<std::mutex> lock(mutex_);
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
  std::lock_guard<std::mutex> lock(mutex_);
  return c10::make_intrusive<Options>("comm", timeout_);
}

void StagingBackend::setTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  timeout_ = timeout;
  if (communicator_) communicator_->setTimeout(timeout);
}

WorkPtr StagingBackend::stage(const char* name, c10d::OpType type, const std::function<WorkPtr(StagedCall&)>& run) {
  auto& comm = communicator();
  StagedCall call(name, target(), getSize(), comm);
  WorkPtr work;
  try {
    work = run(call); // copy in, call the communicator
  } catch (...) {
    rethrowStaged(call.what());
  }
  call.issued();
  auto back = call.writeBack();
  std::lock_guard<std::mutex> lock(mutex_);
  if (coalescing_) {
    coalescedBacks_.push_back(back);
    if (work) coalescedWorks_.push_back(work);
    if (communicatorCoalesces_) return doneWork();
  }
  std::vector<WorkPtr> works;
  if (work) works.push_back(work);
  return c10::make_intrusive<StagedWork>(std::move(works), std::vector<std::shared_ptr<WriteBack>>{back}, type);
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
  auto split = c10::make_intrusive<StagingBackend>(part->getRank(), part->getSize(), target(), part);
  auto timeout = opts ? opts->timeout : getBackendOptions()->timeout;
  std::lock_guard<std::mutex> lock(split->mutex_);
  split->timeout_ = timeout;
  return split;
}

} // namespace comm_native
