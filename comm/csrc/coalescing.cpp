// A coalescing block: which thread has one open, on which communicator, what comm issued
// inside it, and the one work that ends it.
#include "staging.h"

namespace comm_native {

void CoalescingBlock::open(c10d::Backend& communicator, bool followed) {
  abandon();
  std::lock_guard<std::mutex> lock(mutex_);
  // A followed block is torch's, on the group's own backend: torch opens and ends the
  // communicator's block there. comm's own block opens the communicator's where it coalesces.
  open_ = Open{std::this_thread::get_id(), &communicator, followed, !followed && communicator.supportsCoalescing(),
               {}, {}};
  if (open_->opensCommunicators) communicator.startCoalescing();
}

bool CoalescingBlock::openHere() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return isCallers();
}

bool CoalescingBlock::followedHere() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return isCallers() && open_->followed;
}

bool CoalescingBlock::join(const WorkPtr& work, const std::shared_ptr<WriteBack>& back) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!isCallers()) return false;
  open_->backs.push_back(back);
  if (work) open_->works.push_back(work);
  return true;
}

WorkPtr CoalescingBlock::end(std::optional<c10::Stream> waitOn) {
  auto block = take(/*followed=*/false);
  TORCH_CHECK(block, "comm's staging backend: endCoalescing without startCoalescing");
  if (block->opensCommunicators) {
    // One work for the calls that joined the communicator's block, or none where none
    // joined (HCCL's plain calls run outside its block, each with a work of its own).
    if (auto work = block->communicator->endCoalescing()) block->works.push_back(work);
  }
  if (block->backs.empty()) {
    block->backs.push_back(std::make_shared<WriteBack>(
        "coalesced", [] { return std::string("comm staged nothing"); }, std::vector<Piece>{}, Tensors{}, 1, Tensors{}));
  }
  return endingWork(std::move(*block), waitOn);
}

WorkPtr CoalescingBlock::endFollowed(WorkPtr torchsWork, std::optional<c10::Stream> waitOn) {
  auto block = take(/*followed=*/true);
  if (!block || block->backs.empty()) return torchsWork; // comm staged nothing in it: torch's work as it is
  if (torchsWork) block->works.push_back(torchsWork);
  return endingWork(std::move(*block), waitOn);
}

void CoalescingBlock::abandon() {
  std::optional<Open> block;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    block.swap(open_);
  }
  if (block && block->opensCommunicators) block->communicator->endCoalescing();
}

bool CoalescingBlock::isCallers() const {
  return open_ && open_->thread == std::this_thread::get_id();
}

std::optional<CoalescingBlock::Open> CoalescingBlock::take(bool followed) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!isCallers() || open_->followed != followed) return std::nullopt;
  std::optional<Open> block;
  block.swap(open_);
  return block;
}

WorkPtr CoalescingBlock::endingWork(Open block, std::optional<c10::Stream> waitOn) {
  return c10::make_intrusive<StagedWork>(std::move(block.works), std::move(block.backs), c10d::OpType::COALESCED,
                                         waitOn, Tensors{}, StagedWork::Completes::Block);
}

} // namespace comm_native
