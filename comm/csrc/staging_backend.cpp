// The staging backend itself: which communicator a thread's staged calls run on (the
// group's own on the group's thread, comm's made one elsewhere), the target device fixed
// at the first staged call; the four steps every call goes through; split.
#include <algorithm>

#include <c10/core/StreamGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "staging.h"

namespace comm_native {

StagingBackend::StagingBackend(int rank, int size, at::Device target, BackendPtr own, CommunicatorFactory factory,
                               CommunicatorFactory cpuFactory, int64_t chunkBytes, int64_t budgetBytes,
                               std::chrono::milliseconds timeout, std::set<std::string> averagesIntegers)
    : Backend(rank, size), target_(target), own_(std::move(own)), owner_(std::this_thread::get_id()),
      factory_(std::move(factory)), cpuFactory_(std::move(cpuFactory)), timeout_(timeout),
      chunkBytes_(chunkBytes), averagesIntegers_(std::move(averagesIntegers)), budget_(budgetBytes),
      coalesces_(own_ && own_->supportsCoalescing()) {}

StagingBackend::StagingBackend(int rank, int size, at::Device target, BackendPtr communicator, int64_t chunkBytes,
                               int64_t budgetBytes, std::chrono::milliseconds timeout,
                               std::set<std::string> averagesIntegers)
    : Backend(rank, size), target_(target), owner_(std::this_thread::get_id()),
      communicator_(std::move(communicator)), timeout_(timeout), chunkBytes_(chunkBytes),
      averagesIntegers_(std::move(averagesIntegers)), budget_(budgetBytes),
      coalesces_(communicator_->supportsCoalescing()) {}

at::Device StagingBackend::target() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return target_;
}

void StagingBackend::adoptThread() {
  std::lock_guard<std::mutex> lock(mutex_);
  owner_ = std::this_thread::get_id();
}

std::map<std::string, int64_t> StagingBackend::communicatorsMade() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return {{"collectives", communicator_ ? 1 : 0}, {"cpu", cpuCommunicator_ ? 1 : 0}};
}

void StagingBackend::fixTarget() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!target_.has_index() && !target_.is_cpu()) {
    // The device the first staged call's thread is on: fixed from then on, for
    // every thread (a checkpoint's background thread starts on device 0).
    target_ = c10::impl::getDeviceGuardImpl(target_.type())->getDevice();
  }
}

bool StagingBackend::onOwn() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return own_ && (std::this_thread::get_id() == owner_ || block_.followedHere());
}

c10d::Backend& StagingBackend::communicator() {
  fixTarget();
  if (onOwn()) return *own_; // own_ is set once, at construction, and held while the backend lives
  return madeCommunicator();
}

c10d::Backend& StagingBackend::madeCommunicator() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!communicator_) {
    TORCH_CHECK(factory_, "comm's staging backend has no communicator");
    communicator_ = factory_(timeout_);
    factory_ = nullptr; // drop what the factory holds (Python objects) once it has made the communicator
    TORCH_CHECK(communicator_, "comm's staging backend: the communicator factory returned nothing");
  }
  return *communicator_;
}

std::optional<c10::Stream> StagingBackend::commStream(std::optional<c10::Stream>& held, at::Device target) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!held) held = c10::impl::getDeviceGuardImpl(target.type())->getStreamFromGlobalPool(target);
  return held;
}

std::optional<c10::Stream> StagingBackend::issueStream(bool onGroupsKind, at::Device target) {
  if (!onGroupsKind || target.is_cpu() || onOwn()) return std::nullopt;
  return commStream(stream_, target);
}

std::optional<c10::Stream> StagingBackend::waitStream(bool onGroupsKind, at::Device target) {
  if (!onGroupsKind || target.is_cpu()) return std::nullopt;
  return onOwn() ? commStream(writeBackStream_, target) : commStream(stream_, target);
}

c10d::Backend& StagingBackend::cpuCommunicator() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!cpuCommunicator_) {
    TORCH_CHECK(cpuFactory_, "comm's staging backend has no CPU communicator");
    cpuCommunicator_ = cpuFactory_(timeout_);
    cpuFactory_ = nullptr;
    TORCH_CHECK(cpuCommunicator_, "comm's staging backend: the CPU communicator factory returned nothing");
  }
  return *cpuCommunicator_;
}

namespace {

// Why `backend` cannot run the reduction `function` on `dtype`; empty where it can. HCCL reduces
// int8, int16, int32, int64, float16, float32 and bfloat16, by its own API reference for
// HcclAllReduce (CANN 8.0.RC1 and RC2 hcclapiref, the Atlas A2 training series; it lists no
// bfloat16 for the older training series); comm takes the same list for the other reductions,
// which that reference was not read for. torch_npu casts bool and uint8 to int32 first in
// allreduce, allreduce_coalesced and reduce, not in the reduce-scatters (ProcessGroupHCCL.cpp
// :4793-4796, 5070, 5153 on master). The simulated HCCL's table
// (comm/testing/csrc/backend.cpp) is read from torch_npu's own check instead
// (checkSupportedDataType), so that a misreading of either shows as a failing staged reduction.
std::string unreducible(const std::string& backend, const std::string& function, at::ScalarType dtype) {
  if (backend != "hccl") return "";
  bool casts = function == "allreduce" || function == "allreduce_coalesced" || function == "reduce";
  switch (dtype) {
    case at::kChar: case at::kShort: case at::kInt: case at::kLong: case at::kHalf: case at::kFloat:
    case at::kBFloat16:
      return "";
    case at::kBool: case at::kByte:
      if (casts) return "";
      return "hccl reduces bool and uint8 in all_reduce and reduce only";
    default:
      return "hccl reduces int8, int16, int32, int64, float16, float32 and bfloat16 only";
  }
}

} // namespace

std::vector<BackendPtr> StagingBackend::communicators() const {
  std::lock_guard<std::mutex> lock(mutex_);
  std::vector<BackendPtr> made;
  for (const auto& comm : {communicator_, cpuCommunicator_}) {
    if (comm) made.push_back(comm);
  }
  return made;
}

void StagingBackend::abort() {
  for (auto& comm : communicators()) comm->abort();
}

void StagingBackend::shutdown() {
  for (auto& comm : communicators()) comm->shutdown();
}

c10::intrusive_ptr<c10d::Backend::Options> StagingBackend::getBackendOptions() {
  std::lock_guard<std::mutex> lock(mutex_);
  return c10::make_intrusive<Options>("comm", timeout_);
}

void StagingBackend::setTimeout(std::chrono::milliseconds timeout) {
  std::lock_guard<std::mutex> lock(mutex_);
  timeout_ = timeout;
  if (communicator_) communicator_->setTimeout(timeout);
  if (cpuCommunicator_) cpuCommunicator_->setTimeout(timeout);
}

StagingBackend::Issued StagingBackend::issue(const char* name, const std::function<WorkPtr(StagedCall&)>& run,
                                              const Reduction* reduction) {
  c10d::Backend* comm = &communicator();
  auto target = this->target();
  bool onGroupsKind = true; // on the communicator of the group's kind (not the gloo one for the CPU)
  if (reduction != nullptr) {
    for (const auto& tensor : reduction->tensors) {
      auto why = unreducible(comm->getBackendName(), reduction->function, tensor.scalar_type());
      if (why.empty()) continue;
      bool onCpu = std::all_of(reduction->tensors.begin(), reduction->tensors.end(),
                               [](const at::Tensor& t) { return t.device().is_cpu(); });
      bool hasCpu = false;
      {
        std::lock_guard<std::mutex> lock(mutex_);
        hasCpu = cpuFactory_ || cpuCommunicator_;
      }
      // A CPU tensor needs no device: gloo reduces it where it is, in its own dtype.
      TORCH_CHECK(onCpu && hasCpu, "comm cannot stage ", name, " of ", tensor.scalar_type(), " tensors onto ",
                  target.str(), ": ", why, "; nothing was copied or written");
      comm = &cpuCommunicator();
      target = at::Device(at::kCPU);
      onGroupsKind = false;
      break;
    }
  }
  StagedCall call(name, target, getSize(), *comm, averagesIntegers_);
  WorkPtr work;
  try {
    c10::OptionalStreamGuard guard(issueStream(onGroupsKind, target));
    work = run(call); // copy in, call the communicator
  } catch (...) {
    rethrowStaged(call.what());
  }
  call.issued();
  return Issued{work, call.writeBack(), waitStream(onGroupsKind, target), onGroupsKind};
}

namespace {

// Whether a call of `type` counts against the staging budget: collectives do, point-to-point
// calls do not (see StagingBackend::setBudget).
bool budgeted(c10d::OpType type) {
  return type != c10d::OpType::SEND && type != c10d::OpType::RECV && type != c10d::OpType::RECVANYSOURCE;
}

} // namespace

void StagingBackend::makeRoom() {
  while (true) {
    c10::intrusive_ptr<StagedWork> oldest;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (budget_ <= 0 || block_.openHere()) return;
      auto mine = inFlight_.find(std::this_thread::get_id());
      if (mine == inFlight_.end()) return;
      auto& flight = mine->second;
      while (!oldest && flight.bytes >= budget_ && !flight.works.empty()) {
        auto [weak, bytes] = std::move(flight.works.front());
        flight.works.pop_front();
        flight.bytes -= bytes;
        auto work = weak.lock();
        if (work && work->heldBytes() > 0) oldest = work; // still holds its buffers: retired below
      }
      if (flight.works.empty()) inFlight_.erase(mine);
      if (!oldest) return;
    }
    oldest->retire(); // outside the lock: it waits for the collective
  }
}

void StagingBackend::track(const c10::intrusive_ptr<StagedWork>& work) {
  auto bytes = work->heldBytes();
  if (budget_ <= 0 || bytes == 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  auto& flight = inFlight_[std::this_thread::get_id()];
  flight.works.emplace_back(c10::weak_intrusive_ptr<StagedWork>(work), bytes);
  flight.bytes += bytes;
}

WorkPtr StagingBackend::stage(const char* name, c10d::OpType type, const std::function<WorkPtr(StagedCall&)>& run,
                              const Reduction* reduction) {
  if (budgeted(type)) makeRoom();
  auto issued = issue(name, run, reduction);
  if (block_.join(issued.work, issued.back)) {
    // The call is the block's: the work that ends the block waits for it and writes it
    // back, the one work torch's coalescing manager waits for. The work returned here is
    // done at once: where the communicator coalesces, the call has not run yet (nccl returns
    // no work, hccl none for point-to-point), so a wait now must write nothing; and the
    // communicator's work is the block's to wait for, once (a work waited twice may wait
    // for ever: gloo's send waits for a second send).
    return doneWork();
  }
  std::vector<WorkPtr> works;
  if (issued.work) works.push_back(issued.work);
  auto work = c10::make_intrusive<StagedWork>(std::move(works), std::vector<std::shared_ptr<WriteBack>>{issued.back},
                                              type, issued.waitOn);
  if (budgeted(type)) track(work);
  return work;
}

void StagingBackend::startCoalescing() {
  // The block is the calling thread's, on its communicator: on the group's thread the
  // group's own backend, whose block then holds these calls as it would the group's own.
  block_.open(communicator(), /*followed=*/false);
}

WorkPtr StagingBackend::endCoalescing() {
  return block_.end(waitStream(true, target()));
}

void StagingBackend::followBlock() {
  // Without the group's own backend comm's calls never run there: there is nothing to join.
  if (own_) {
    block_.open(*own_, /*followed=*/true);
  } else {
    block_.abandon();
  }
}

WorkPtr StagingBackend::endFollowedBlock(WorkPtr torchsWork) {
  return block_.endFollowed(std::move(torchsWork), waitStream(true, target()));
}

StagingBackend* stagingBesideOwn(c10d::ProcessGroup& group, c10::DeviceType type) {
  if (!group.hasBackends() || dynamic_cast<StagingBackend*>(group.getBackend(type).get()) != nullptr) return nullptr;
  for (const auto& device : group.getDeviceTypes()) {
    if (auto* staging = dynamic_cast<StagingBackend*>(group.getBackend(device.type()).get())) return staging;
  }
  return nullptr;
}

BackendPtr StagingBackend::split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                                 const c10::intrusive_ptr<Options>& opts) {
  // From comm's communicator, not the group's own backend: c10d splits that one itself, for
  // the new group's own slot, and the split backend here has no group to find it in.
  auto& comm = madeCommunicator();
  fixTarget();
  // A store of its own: the group's own backend splits with the same store and keys.
  auto prefixed = c10::make_intrusive<c10d::PrefixStore>("comm-staging", store);
  auto part = comm.split(prefixed, ranks, comm.getBackendOptions());
  if (!part) return nullptr; // this rank is in none of the new groups
  auto timeout = opts ? opts->timeout : getBackendOptions()->timeout;
  return c10::make_intrusive<StagingBackend>(part->getRank(), part->getSize(), target(), part, chunkBytes_, budget_, timeout,
                                          averagesIntegers_);
}

} // namespace comm_native
