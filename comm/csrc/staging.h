// comm's staging backend: a c10d Backend for the device types a group's own backend
// does not serve.
//
// A ProcessGroup holds one backend per device type and hands every call, whoever
// makes it (torch.distributed's Python functions, functional collectives, DDP's C++
// reducer, the coalescing manager), to the backend of its tensors' device. comm puts
// this backend in the slots the group leaves empty (the CPU on an nccl or hccl group,
// the accelerator on a gloo group). Every call goes through the same four steps:
// copy the caller's tensors onto a device the group's backend serves (StagedCall),
// call that backend's collective on the copies (StagingBackend::stage), wrap its work
// (StagedWork), and write the results back into the caller's tensors when the work
// completes (WriteBack).
//
// Files, by concept: calls.cpp (each c10d call: what it stages, what it calls),
// staging_backend.cpp (the backend: its communicator, target, the four steps),
// coalescing.cpp (coalescing blocks), staged_call.cpp (copies in, buffers out),
// staged_work.cpp (the work and the write-back), tallies.cpp (what staging cost),
// mixed_devices.cpp (calls that mix device types), module.cpp (Python).
#pragma once

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/Event.h>
#include <c10/core/Stream.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace c10d {
class ProcessGroup;
} // namespace c10d

namespace comm_native {

using Tensors = std::vector<at::Tensor>;
using TensorLists = std::vector<std::vector<at::Tensor>>;
using WorkPtr = c10::intrusive_ptr<c10d::Work>;
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;
// Makes the communicator staged calls run on, with the group's timeout at that moment;
// called once, at the first staged call that needs it.
using CommunicatorFactory = std::function<BackendPtr(std::chrono::milliseconds)>;

// ---- tallies.cpp: what staging cost, per collective (torch.distributed's name for it),
// for comm.stats(): staged calls, host-device copies, their bytes and the time spent copying.
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

// ---- staged_work.cpp: the work of a staged call, and the write-back that completes it.

// Caller tensors and the one staged buffer their results come back from: a tensor's
// copy, or a list's flat buffer, which comes back in one transfer and is then split.
struct Piece {
  Tensors callers;
  at::Tensor staged;
  // Whether `staged` began as a copy of the callers' data (an in-place collective's
  // tensor): then it holds what the collective left in them, failed or not.
  bool reads;
};

// What one staged call writes back once its collective has completed: each piece
// into the caller's tensors it stands for, after dividing by `divisor` (a
// ReduceOp.AVG run as SUM). Two steps, so that a work of several collectives (a
// chunked all-reduce) can queue each one's copies back as soon as it is waited for and
// write nothing into the caller's tensors until every one has succeeded: copyBack()
// queues the copies of results bound for the host into pinned memory on the current
// stream (which wait() ordered after the collective), land() writes the caller's tensors
// once the host has waited for those copies (awaitCopies). Landed at most once, whoever
// asks first (wait(), the work's future, is_completed()); never when the collective failed.
class WriteBack {
 public:
  // `results`: the caller's tensors the work reports as its result (torch's: the outputs).
  // `what`: says what was staged, for an error raised by the collective (made only then).
  // `held`: every device buffer the call made, kept until release().
  WriteBack(std::string name, std::function<std::string()> what, std::vector<Piece> pieces, Tensors results,
            int64_t divisor, Tensors held);

  void copyBack();
  // The host waits for copyBack's copies, unless `covered` (copies queued later on the same
  // stream were waited for); whether they are done now.
  bool awaitCopies(bool covered);
  // `failed`: the collective failed without raising (failedQuietly): only pieces that
  // read land, which hold what the served collective leaves in its tensors.
  void land(bool failed);
  const Tensors& results() const { return results_; }
  // Gives the call's device buffers back to the allocator, recorded on the current stream of
  // their device where `recorded`: the stream that now waits for the collective. A
  // communicator need not keep a synchronous call's buffers (ProcessGroupNCCL and
  // ProcessGroupHCCL rely on the issuing stream waiting for the collective), and comm's
  // waits run on its own stream: freed earlier, a buffer could be reused on the issuing
  // stream while the collective still reads or writes it.
  void release(bool recorded);
  // The bytes of device memory the call holds until release(). Never waits: another thread
  // may hold mutex_ while the host waits for the collective (awaitCopies).
  int64_t heldBytes() const;
  // Says what was staged, for an error raised by the collective.
  std::string what() const { return what_(); }

 private:
  std::string name_;
  std::function<std::string()> what_;
  std::vector<Piece> pieces_;
  const bool writes_; // whether anything comes back (pieces_ empties once landed)
  Tensors results_;
  int64_t divisor_;
  std::mutex mutex_; // copyBack and awaitCopies may come from two threads (wait() and the future's)
  bool divided_ = false;
  bool queued_ = false;
  std::vector<at::Tensor> landed_; // pinned host buffers the results come back into
  std::optional<c10::Event> copied_; // recorded after the copies back, where there are any
  std::once_flag landOnce_;
  Tensors held_; // the device buffers, until release()
  std::atomic<int64_t> heldBytes_;
};

// The work of a staged call: the group backend's works on the copies, completed by
// the write-backs. Its future completes after the write-back, with the caller's tensors.
class StagedWork final : public c10d::Work {
 public:
  // What a work completes, which decides how its wait() goes.
  enum class Completes {
    // Staged calls: one call, or a chunked call's chunks. Where there are as many works as
    // write-backs, each write-back belongs to the work beside it, and its copies back go as
    // soon as that work is waited for.
    Calls,
    // A coalescing block (CoalescingBlock): the communicator's works are not the calls'
    // one by one (calls that joined the communicator's block have none of their own), and
    // the block may hold calls on the group's own devices, whose results the caller reads on
    // its current stream: wait() orders that stream after the block too, as the group's
    // own work would.
    Block,
  };
  // `stream`: the stream its wait() orders after the collectives and the copies back run
  // on (StagingBackend::waitStream); none: the caller's current stream. `results`: the
  // work's result, where it is not the write-backs' (a chunked call's whole tensor). Null
  // works (a call that joined a block returns none) are left out.
  StagedWork(std::vector<WorkPtr> inner, std::vector<std::shared_ptr<WriteBack>> backs, c10d::OpType type,
             std::optional<c10::Stream> stream = std::nullopt, Tensors results = {},
             Completes completes = Completes::Calls);

  bool isCompleted() override;
  bool isSuccess() const override;
  std::exception_ptr exception() const override;
  int sourceRank() const override;
  Tensors result() override;
  void synchronize() override;
  bool wait(std::chrono::milliseconds timeout) override;
  void abort() override;
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override;

  // The bytes of device memory the work's calls still hold (none once waited for, or once a
  // wait has failed: see failed_).
  int64_t heldBytes();
  // When the last reference goes (a budget's weak one may keep the object itself a while):
  // the communicator's works and the write-backs, with the copies they hold, go at once.
  void release_resources() override;
  // Waits for the work as wait() does, then holds the host until the stream its buffers
  // went back on has passed them, so that the device allocator can hand them out again:
  // how a staging budget makes room (StagingBackend::makeRoom). A work already waited
  // for is not waited again. Drops the communicator's works, which may hold comm's copies.
  void retire();

 private:
  // Every write-back's device buffers back to the allocator (WriteBack::release), recorded on
  // `stream_` where `recorded`.
  void releaseBuffers(bool recorded);
  // The write-backs' three steps, each for every write-back before the next step.
  void writeAll();
  // Whether a collective failed without raising from wait() (HCCL and NCCL with their
  // asynchronous error handling off): its work reports it once it has ended.
  bool failedQuietly();
  // Each communicator's work waited for once, on `stream_`; for a block, the caller's
  // current stream is then ordered after `stream_`. Rethrows a work's error with what was
  // staged. `copyEachBack`: each write-back's copies go as its work is waited for.
  void waitInner(std::chrono::milliseconds timeout, bool copyEachBack);
  // For a block, the caller's current stream waits for what `stream_` has been ordered
  // after, as it would wait for the group's own work.
  void orderCallersStream();

  std::vector<WorkPtr> inner_;
  std::vector<std::shared_ptr<WriteBack>> backs_;
  std::optional<c10::Stream> stream_;
  Tensors results_;
  Completes completes_;
  std::atomic<bool> waited_{false}; // a wait() returned: later waits return at once
  // A wait() raised `failure_`, which every later wait() raises again. The work stops counting
  // against the budget: retiring it would raise its failure in whichever later call made room.
  std::atomic<bool> failed_{false};
  std::exception_ptr failure_; // set once, before failed_
  std::atomic<bool> futureMade_{false}; // getFuture() started a thread that waits for it
};

// A finished work, for calls inside a coalescing block: the work that ends the block
// completes them.
WorkPtr doneWork();

// Rethrows the exception in flight with `what` (what a call staged) added to its message.
[[noreturn]] void rethrowStaged(const std::string& what);

// ---- staged_call.cpp: one staged call's copies onto the target device, and which of
// them are written back where.
// A contiguous copy of `tensor` on `target`. A host tensor's copy does not block the host:
// it goes through a pinned buffer of comm's and is queued on `target`'s current stream,
// after whatever that stream holds.
at::Tensor copyOnto(const at::Tensor& tensor, at::Device target);

class StagedCall {
 public:
  // `averagesIntegers`: the backends whose ReduceOp.AVG of integers is their own (comm/gaps.py).
  StagedCall(const char* name, at::Device target, int groupSize, c10d::Backend& communicator,
             const std::set<std::string>& averagesIntegers);

  // The communicator the call runs on.
  c10d::Backend& communicator() { return communicator_; }

  // Copies of what the collective only reads: one per tensor, one flat copy per list.
  at::Tensor in(const at::Tensor& tensor);
  Tensors in(const Tensors& list);
  TensorLists in(const TensorLists& lists);
  // Tensors the collective only reads, which its work still reports as its result
  // (a broadcast's source, a reduce's non-destination ranks), as torch's work does.
  Tensors inReported(const Tensors& list);
  // Buffers for what the collective writes, written back when the work completes.
  at::Tensor out(const at::Tensor& tensor);
  Tensors out(const Tensors& list);
  TensorLists out(const TensorLists& lists);
  // Copies of what the collective reads and writes (in-place calls), written back.
  Tensors inOut(const Tensors& list);
  // A list as one flat buffer, for a call that runs on it whole; `reads`: copied in too.
  at::Tensor flat(const Tensors& list, bool reads);
  // A copy of a list as one flat tensor the collective only reads.
  at::Tensor inFlat(const Tensors& list);
  // `count` device buffers shaped as `like`'s one tensor, which the collective writes and nothing reads back.
  Tensors scratch(const Tensors& like, int count);

  // Whether a list can travel as one flat buffer: several tensors of one dtype on one device.
  static bool flattens(const Tensors& list);

  // The reduce op to run on `inputs` (the copies the collective reads): ReduceOp.AVG
  // becomes SUM, divided at the write-back; PREMUL_SUM becomes SUM of the copies
  // scaled first. Backends lack both (gloo has no PREMUL_SUM, some HCCL and XCCL parts
  // no AVG), and the copies are comm's to scale. An integer AVG goes to a communicator
  // that averages integers itself (averagesIntegers), and is refused elsewhere.
  c10d::ReduceOp reduceOp(const c10d::ReduceOp& op, const Tensors& inputs);
  c10d::ReduceOp reduceOp(const c10d::ReduceOp& op, const at::Tensor& input) { return reduceOp(op, Tensors{input}); }

  // What an error says was staged.
  std::string what() const;
  // What the write-back writes; taken once, after the call was issued.
  std::shared_ptr<WriteBack> writeBack();
  // Counts the call and its copies in: once the communicator has taken it.
  void issued();

 private:
  at::Tensor buffer(const at::Tensor& tensor, bool reads);
  void noteSource(const at::Tensor& tensor);
  // `buffer`, kept for the write-back to hold where it is on a device.
  at::Tensor hold(at::Tensor buffer);

  // Staging is the collective's own work, below autograd as torch's backends write:
  // no graph for the copies, no version bump, inference tensors included.
  at::AutoDispatchBelowADInplaceOrView belowAutograd_;
  const char* name_;
  at::Device target_;
  int groupSize_;
  c10d::Backend& communicator_;
  const std::set<std::string>& averagesIntegers_;
  std::vector<Piece> pieces_;
  Tensors results_;
  int64_t divisor_ = 1;
  Tally copied_;
  std::optional<at::Device> source_;
  Tensors held_; // every device buffer made, for the write-back to hold (WriteBack::release)
};

// ---- coalescing.cpp: a coalescing block.
//
// torch opens a block on the backend of one device type (c10d's startCoalescing on that
// slot) and waits for the one work that ends it (its coalescing manager, batch_isend_irecv).
// comm's calls on the other device type inside it must complete with that work. A block is
// comm's own where torch opened it on comm's slot (StagingBackend::startCoalescing), or
// followed where torch opened it on the group's own backend (StagingBackend::followBlock).
// It belongs to the thread that opened it, on that thread's communicator: calls from other
// threads meanwhile run outside it. Each staging backend owns one; every verb on a block is here.
class CoalescingBlock {
 public:
  // Opens the calling thread's block on `communicator`, abandoning an earlier one (one whose
  // calls raised before its end: torch's coalescing manager then never ends it). `followed`:
  // torch opened it on the group's own backend, and opens and ends that backend's block itself;
  // else comm opens the communicator's block, where it coalesces.
  void open(c10d::Backend& communicator, bool followed);
  // Whether the calling thread has a block open; one torch opened on the group's own backend.
  bool openHere() const;
  bool followedHere() const;
  // A staged call issued in the calling thread's block: its work (may be none) and write-back
  // become the block's, completed by the work that ends it. False where no block is open here.
  bool join(const WorkPtr& work, const std::shared_ptr<WriteBack>& back);
  // Ends comm's own block: the work that waits for the communicator's block and every call
  // that joined, its wait() ordered on `waitOn`. Refuses where the calling thread has none open.
  WorkPtr end(std::optional<c10::Stream> waitOn);
  // Ends a followed block, given the work torch's own endCoalescing returned (may be none):
  // that work itself where comm staged nothing in the block.
  WorkPtr endFollowed(WorkPtr torchsWork, std::optional<c10::Stream> waitOn);
  // Forgets the open block, ending the communicator's block comm opened.
  void abandon();

 private:
  struct Open {
    std::thread::id thread;
    c10d::Backend* communicator; // the opening thread's; held by the staging backend while it lives
    bool followed;
    bool opensCommunicators; // comm opened `communicator`'s block, and ends it
    std::vector<WorkPtr> works; // every work a call in it returned, the CPU communicator's too
    std::vector<std::shared_ptr<WriteBack>> backs;
  };
  // Whether the calling thread has the open block. Holds mutex_.
  bool isCallers() const;
  // The calling thread's open block of that kind, now closed; none where it has none.
  std::optional<Open> take(bool followed);
  static WorkPtr endingWork(Open block, std::optional<c10::Stream> waitOn);

  mutable std::mutex mutex_;
  std::optional<Open> open_;
};

// ---- staging_backend.cpp and calls.cpp: the backend.

// Elements [start, start + length) of a flat tensor: one chunk of a call staged in chunks.
struct Span {
  int64_t start;
  int64_t length;
  at::Tensor of(const at::Tensor& flat) const { return flat.narrow(0, start, length); }
};
// The spans of `length` elements in chunks of `chunk` (the last may be shorter).
std::vector<Span> spans(int64_t length, int64_t chunk);
//
// Which communicator a staged call runs on depends on the thread that makes it:
// * the group's thread (the thread that made this backend: equip() runs where the
//   group is created, or where comm.equip() is called) runs staged calls on the
//   group's own backend for the target device (`own`), the communicator its calls on
//   that device already use, in the order that thread issues them;
// * any other thread (dcp.async_save's, a DDP hook on autograd's device thread) runs
//   them on a communicator comm makes at that thread's first staged call (`factory`),
//   so that they never interleave with the group's thread's calls on the group's own.
// Without `own` every thread uses the made communicator.
class StagingBackend final : public c10d::Backend {
 public:
  // `own` (may be null): the group's own backend for the target device. `factory`
  // makes the communicator of other threads. `cpuFactory` (may be empty): makes a gloo
  // communicator over the group's store, for CPU reductions of dtypes the group's
  // backend cannot reduce (made at the first one).
  // `chunkBytes`: a host tensor's all-reduce of at least twice this many bytes runs
  // pipelined, in chunks of this size (0: never). `budgetBytes`: the device memory a
  // thread's staged calls may hold at once (setBudget). `timeout`: the group's; every
  // communicator comm makes takes it (and a later setTimeout's) when it is made.
  // `averagesIntegers`: the backends whose ReduceOp.AVG of integers is their own, an
  // integer, read from comm/gaps.py (AVERAGES_INTEGERS), the one place that says so.
  StagingBackend(int rank, int size, at::Device target, BackendPtr own, CommunicatorFactory factory,
                 CommunicatorFactory cpuFactory, int64_t chunkBytes, int64_t budgetBytes,
                 std::chrono::milliseconds timeout, std::set<std::string> averagesIntegers);
  // A backend split from another: every thread runs on `communicator`, comm's own.
  StagingBackend(int rank, int size, at::Device target, BackendPtr communicator, int64_t chunkBytes,
                 int64_t budgetBytes, std::chrono::milliseconds timeout, std::set<std::string> averagesIntegers);

  const std::string getBackendName() const override { return "comm"; }
  c10::intrusive_ptr<Options> getBackendOptions() override;
  // Whether the communicator of the group's kind coalesces (nccl, hccl; gloo does not).
  // torch's batch_isend_irecv opens a block only where the backend of its first op's
  // device says so; on a gloo group it then issues each op on its own and returns every
  // op's work, as it does for the group's own CPU ops.
  bool supportsCoalescing() const override { return coalesces_; }
  bool supportsSplitting() const override { return true; }
  void setTimeout(std::chrono::milliseconds timeout) override;
  void startCoalescing() override;
  WorkPtr endCoalescing() override;
  BackendPtr split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                   const c10::intrusive_ptr<Options>& opts) override;
  // Forwarded to comm's communicators (c10d's abort and destroy_process_group reach them).
  void abort() override;
  void shutdown() override;

  // calls.cpp
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
  at::Device target() const;
  // How many communicators this backend has made: "collectives" (other threads'), "cpu" (gloo).
  std::map<std::string, int64_t> communicatorsMade() const;
  // Makes the calling thread the group's thread (see the class comment).
  void adoptThread();

  // The staging budget: the bytes of device memory one thread's staged collectives hold at
  // once. A chunked all-reduce keeps at most budget / chunk size chunks on the device (at
  // least one); a collective waits, before it copies anything in, for the thread's earlier
  // staged collectives that nobody has waited for yet, oldest first, until what they hold
  // is below the budget (makeRoom). 0: no bound. Point-to-point calls neither wait nor
  // count: a send may need its peer to receive after sending in turn, and waiting for it
  // here would deadlock where the served call does not.
  void setBudget(int64_t bytes) { budget_ = bytes; }
  int64_t budget() const { return budget_; }

  // A block torch opened on the group's own backend, which comm follows (see
  // CoalescingBlock): comm is told by ProcessGroup's _start_coalescing and _end_coalescing
  // (comm/slot.py). followBlock: the calling thread opened one; its staged calls run on the
  // group's own backend, joining it, until it ends. endFollowedBlock: `torchsWork` (may be
  // none) is what the group's own backend's endCoalescing returned; the work that completes
  // both the block and comm's calls in it.
  void followBlock();
  WorkPtr endFollowedBlock(WorkPtr torchsWork);
  // The calling thread's coalescing block, if open: a call the mixed-device kernel issued
  // on the group's own backend joins it (CoalescingBlock::join).
  CoalescingBlock& block() { return block_; }

 private:
  // A reduction's facts that decide where it runs: its c10d function (the group's
  // backend may accept a dtype in one function and not another) and its tensors.
  struct Reduction {
    const char* function;
    Tensors tensors;
  };
  // The four steps of every staged call: `run` copies the caller's tensors in (onto the
  // call's target) and calls the communicator on the copies; its work comes back
  // wrapped, writing back when it completes (or kept for endCoalescing's work). A
  // `reduction` of a dtype the group's backend cannot reduce runs on the CPU
  // communicator, or is refused before anything is copied.
  WorkPtr stage(const char* name, c10d::OpType type, const std::function<WorkPtr(StagedCall&)>& run,
                const Reduction* reduction = nullptr);
  // Before a staged collective copies anything in: retires the calling thread's earlier
  // staged collectives, oldest first, while what they held when issued, of those not yet
  // retired or dropped, reaches the budget (one waited for already is dropped without a wait).
  void makeRoom();
  // Counts `work` against the calling thread's budget until it is waited for.
  void track(const c10::intrusive_ptr<StagedWork>& work);
  // One staged call issued: the communicator's work (may be none), its write-back, and
  // the stream its wait belongs on; whether it ran on the communicator of the group's kind.
  struct Issued {
    WorkPtr work;
    std::shared_ptr<WriteBack> back;
    std::optional<c10::Stream> waitOn;
    bool onGroupsKind;
  };
  // stage's first steps: copy in and call the communicator.
  Issued issue(const char* name, const std::function<WorkPtr(StagedCall&)>& run, const Reduction* reduction);
  // The elements per chunk a host call on `tensors` runs in, pipelined, or 0 where it runs
  // whole. The first tensor's elements are cut into chunks of chunkBytes / (`deviceCopies`
  // x element size): the bytes of one chunk and what it needs beside it on the device (an
  // all-gather's chunk of input and its rows of output: size + 1). Each chunk is copied in
  // and runs as a collective of its own, so that on the device one chunk's copy overlaps
  // another's collective (the copies in and the collectives are queued at the call; at the
  // wait, each chunk's copy back is queued once its collective is waited for). Whole where
  // a tensor is on a device or not contiguous, for a CPU target, in the calling thread's
  // coalescing block, and below two chunks. Every rank must chunk alike: the same
  // COMM_STAGING_CHUNK_BYTES everywhere, and the call's tensors on the same device type on
  // every rank (as the group's own collectives need anyway).
  int64_t chunkLength(const Tensors& tensors, int64_t deviceCopies);
  // A call run as one collective per span of `chunks`: `run` stages that chunk and calls the
  // communicator; `results`: the work's result. At most budget / chunk size chunks are on
  // the device at once: before chunk i is copied in, chunk i - depth is waited for, written
  // back and its buffers handed back, for chunk i to take. The caller's tensor is thus
  // written chunk by chunk: a chunk that fails leaves the earlier ones written, as the
  // served in-place collective leaves whatever it wrote. `reduction`: the call's, checked
  // for each chunk as for a whole call (issue()); null for none.
  WorkPtr stageChunks(const char* name, c10d::OpType type, const Tensors& results, const std::vector<Span>& chunks,
                      const Reduction* reduction, const std::function<WorkPtr(StagedCall&, Span)>& run);
  // An elementwise call on one host tensor (all-reduce, broadcast, reduce) through stageChunks,
  // its chunks spans of the flat tensor, each staged by `run`; none where chunkLength says
  // whole, or where the call has more than one tensor.
  WorkPtr stageOneInChunks(const char* name, c10d::OpType type, Tensors& tensors, const Reduction* reduction,
                           const std::function<WorkPtr(StagedCall&, Tensors)>& run);
  // The communicator the calling thread's staged calls run on: the group's own backend on
  // the group's thread, else comm's, made at the first such call. Fixes the target at
  // the first staged call.
  c10d::Backend& communicator();
  // Whether the calling thread's staged calls run on the group's own backend: the group's
  // thread, and a thread inside a block it opened there (followBlock).
  bool onOwn() const;
  // comm's communicator for threads other than the group's; made at the first call.
  c10d::Backend& madeCommunicator();
  // The stream a staged call's copies in and its collective are issued on: none (the
  // caller's current stream, as the fix written by hand does) on the group's thread and
  // for a CPU target; on comm's communicator, a stream of comm's own on the target
  // device (stream_). On an accelerator whose threads share the default stream
  // (torch_npu, CUDA), a wait() makes that stream wait for the collective and a blocking
  // copy synchronises it: were comm's communicator's calls on it, the training thread's
  // copies would wait for another thread's communicator and that thread's for the
  // group's, and two ranks whose threads run in different orders would wait on each
  // other for ever.
  std::optional<c10::Stream> issueStream(bool onGroupsKind, at::Device target);
  // The stream a staged call's wait() orders after the collective and its results are
  // copied back on: never the caller's compute stream, so that the host waits for the
  // collective and those copies alone. On the group's thread a stream of comm's own for
  // the group (writeBackStream_), on comm's communicator its stream; none for a CPU target.
  std::optional<c10::Stream> waitStream(bool onGroupsKind, at::Device target);
  // comm's stream on `target` held in `held`, taken from the device's pool at first use.
  std::optional<c10::Stream> commStream(std::optional<c10::Stream>& held, at::Device target);
  void fixTarget();
  // The gloo communicator for CPU reductions the group's backend cannot run; made at the first.
  c10d::Backend& cpuCommunicator();
  // The communicators comm made so far (never the group's own: c10d aborts, shuts down
  // and times out that one itself).
  std::vector<BackendPtr> communicators() const;

  // Guards every field below: staged calls come from any thread (dcp.async_save's too).
  mutable std::mutex mutex_;
  at::Device target_;
  BackendPtr own_;
  std::thread::id owner_;
  CommunicatorFactory factory_;
  BackendPtr communicator_;
  CommunicatorFactory cpuFactory_;
  BackendPtr cpuCommunicator_;
  std::optional<c10::Stream> stream_; // comm's communicator's stream (issueStream)
  std::optional<c10::Stream> writeBackStream_; // the group's thread's write-backs (waitStream)
  std::chrono::milliseconds timeout_;
  const int64_t chunkBytes_;
  const std::set<std::string> averagesIntegers_;
  std::atomic<int64_t> budget_;
  // Per thread (makeRoom retires only the calling thread's): the staged collectives it issued
  // that makeRoom has not yet dropped, oldest first, each with the bytes it held when issued,
  // and their sum. makeRoom walks them only while that sum reaches the budget, dropping each
  // entry as it goes (retiring it first where it still holds memory), so a loop of many
  // small calls costs a constant amount per call, however many are in flight.
  struct InFlight {
    std::deque<std::pair<c10::weak_intrusive_ptr<StagedWork>, int64_t>> works;
    int64_t bytes = 0;
  };
  std::map<std::thread::id, InFlight> inFlight_;
  const bool coalesces_; // whether the communicator of the group's kind coalesces
  CoalescingBlock block_; // guarded by its own mutex, which is taken after mutex_, never before
};

// comm's staging backend on `group`, where the slot of `type` holds the group's own
// backend (a block torch opens there is one comm follows); else null.
StagingBackend* stagingBesideOwn(c10d::ProcessGroup& group, c10::DeviceType type);

// From the first call on: a collective whose tensors lie on the CPU and an accelerator,
// on a group comm has equipped, runs on the group's own backend with the CPU tensors
// staged onto the accelerator (mixed_devices.cpp).
void routeMixedDevices();

} // namespace comm_native
