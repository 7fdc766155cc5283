// HCCL: communicators whose ranks are processes on this machine (hccl.h, hccl_types.h of CANN).
//
// Ranks meet in POSIX shared memory named by the root info rank 0 made. Each rank has a
// window, a sparse shared segment it publishes its input in; a collective, run on the stream it
// was issued on, publishes, waits for every rank at a barrier, reads what it needs from the
// others' windows, and waits again before anyone may publish the next input. Point-to-point calls
// go through a ring per ordered pair of ranks. Every wait ends: at the operation's timeout
// (HCCL_EXEC_TIMEOUT, seconds, default 1836 as CANN's), or when a peer process has died, with the
// communicator's asynchronous error set, which torch_npu's watchdog reads.
#include "fake_cann.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <ATen/ATen.h>
#include <c10/core/InferenceMode.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

namespace fake_cann {
namespace {

enum HcclResult : int {
  kOk = 0,
  kParameter = 1,
  kPointer = 2,
  kMemory = 3,
  kInternal = 4,
  kNotSupport = 5,
  kSyscall = 8,
  kTimeout = 9,
  kRemote = 21,
};

enum ReduceOp : int { kSum = 0, kProd = 1, kMax = 2, kMin = 3 };

constexpr int kMaxRanks = 64;
constexpr size_t kRootInfoBytes = 4108;
constexpr size_t kWindowBytes = size_t{16} << 30;  // sparse: only what a collective writes takes memory
constexpr size_t kMetaBytes = 2 * kMaxRanks * sizeof(uint64_t);
constexpr size_t kRingBytes = size_t{4} << 20;

// What a rank calls, compared across the ranks at the collective's first barrier: HCCL's ranks must
// call the same collective with the same count, dtype, reduction and root (a count of 0 for the
// calls whose counts differ by rank).
struct Call {
  int32_t kind, type, op, root;
  uint64_t count;
  bool operator==(const Call& o) const {
    return kind == o.kind && type == o.type && op == o.op && root == o.root && count == o.count;
  }
};

enum Kind : int32_t {
  kAllReduceCall = 1, kReduceCall, kBroadcastCall, kAllGatherCall, kAllGatherVCall, kReduceScatterCall,
  kReduceScatterVCall, kScatterCall, kAlltoAllCall, kBarrierCall,
};

struct Header {
  std::atomic<uint32_t> attached;
  std::atomic<uint32_t> mapped;
  std::atomic<int32_t> pids[kMaxRanks];
  std::atomic<uint64_t> arrived[kMaxRanks];
  Call calls[kMaxRanks];  // each rank's current collective, read by the others after the first barrier
};

struct Ring {
  std::atomic<uint64_t> written;
  std::atomic<uint64_t> read;
  char data[kRingBytes];
};

at::ScalarType scalar_type(int hccl_type, bool* ok) {
  *ok = true;
  switch (hccl_type) {
    case 0: return at::kChar;
    case 1: return at::kShort;
    case 2: return at::kInt;
    case 3: return at::kHalf;
    case 4: return at::kFloat;
    case 5: return at::kLong;
    case 6: return at::kUInt64;
    case 7: return at::kByte;
    case 8: return at::kUInt16;
    case 9: return at::kUInt32;
    case 10: return at::kDouble;
    case 11: return at::kBFloat16;
    default: *ok = false; return at::kByte;
  }
}

// The dtypes HCCL reduces on an Atlas A2 (hccl.h's HcclAllReduce: int8, int16, int32, float16,
// float32, bfloat16; int64 added from CANN 8.0 on that part).
bool reducible(int hccl_type) { return hccl_type == 0 || hccl_type == 1 || hccl_type == 2 || hccl_type == 3 ||
                                       hccl_type == 4 || hccl_type == 5 || hccl_type == 11; }

double seconds_from_env(const char* name, double fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::strtod(value, nullptr) : fallback;
}

std::string shm_name(const std::string& token, const std::string& what) { return "/" + token + what; }

void* map_shared(const std::string& name, size_t bytes, bool create) {
  int fd = shm_open(name.c_str(), O_RDWR | (create ? O_CREAT : 0), 0600);
  if (fd < 0) return nullptr;
  if (create && ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    close(fd);
    return nullptr;
  }
  void* address = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_NORESERVE, fd, 0);
  close(fd);
  return address == MAP_FAILED ? nullptr : address;
}

class Comm {
 public:
  Comm(std::string token, uint32_t nranks, uint32_t rank) : token_(std::move(token)), nranks_(nranks), rank_(rank) {}

  HcclResult connect();
  void destroy();

  uint32_t nranks() const { return nranks_; }
  uint32_t rank() const { return rank_; }
  const std::string& name() const { return token_; }
  HcclResult async_error() const { return static_cast<HcclResult>(error_.load()); }

  // Runs `body` on `stream` as one operation of this communicator: skipped once the
  // communicator has failed, its failure recorded for the watchdog.
  void issue(void* stream, std::function<HcclResult(Comm&)> body) {
    ++in_flight_;
    stream_of(stream)->enqueue([this, body = std::move(body)] {
      if (error_.load() == kOk) {
        c10::InferenceMode no_autograd;
        if (busy_.exchange(true))
          std::fprintf(stderr, "fake CANN: two streams run operations of communicator %s at once\n", token_.c_str());
        HcclResult result = body(*this);
        busy_.store(false);
        if (result != kOk) error_.store(result);
      }
      --in_flight_;
    });
  }

  // Publishing and reading: this rank's window, and where another rank's window starts.
  char* window(uint32_t rank) { return windows_[rank] + kMetaBytes; }
  uint64_t* meta(uint32_t rank) { return reinterpret_cast<uint64_t*>(windows_[rank]); }
  HcclResult publish(const void* data, size_t bytes) {
    if (bytes > kWindowBytes - kMetaBytes) return kMemory;
    if (bytes > 0) std::memcpy(window(rank_), data, bytes);
    return kOk;
  }
  // Every rank has reached this point, or an error when a peer died or the timeout passed.
  HcclResult barrier();
  // The first barrier of a collective: every rank there, calling the same collective, or an error
  // (HCCL_E_PARA) on every rank, where HCCL would wait for a matching call until its timeout.
  HcclResult meet(const Call& call);

  HcclResult send(const void* data, size_t bytes, uint32_t peer);
  HcclResult recv(void* data, size_t bytes, uint32_t peer);
  // Moves what it can of a send (or receive) without waiting; true once it is all moved.
  bool push(Ring* ring, const char* data, size_t bytes, size_t* done);
  bool pull(Ring* ring, char* data, size_t bytes, size_t* done);
  Ring* ring(uint32_t from, uint32_t to);
  // Waits, polling `ready`, until it holds; an error at the timeout or when `peer` (or any rank) died.
  HcclResult wait_until(const std::function<bool()>& ready, int peer);

 private:
  bool peer_dead(int peer);

  const std::string token_;
  const uint32_t nranks_, rank_;
  Header* header_ = nullptr;
  std::vector<char*> windows_;
  std::vector<Ring*> rings_;
  uint64_t generation_ = 0;
  std::atomic<int> error_{kOk};
  std::atomic<int> in_flight_{0};
  std::atomic<bool> busy_{false};
  std::mutex rings_mutex_;
};

HcclResult Comm::wait_until(const std::function<bool()>& ready, int peer) {
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration<double>(seconds_from_env("HCCL_EXEC_TIMEOUT", 1836));
  auto next_check = std::chrono::steady_clock::now();
  int spins = 0;
  while (!ready()) {
    auto now = std::chrono::steady_clock::now();
    if (now >= next_check) {
      if (now >= deadline) {
        set_error("HCCL: operation timed out waiting for a peer (HCCL_EXEC_TIMEOUT)");
        return kTimeout;
      }
      if (peer_dead(peer)) {
        set_error("HCCL: a peer process of communicator " + token_ + " has exited");
        return kRemote;
      }
      next_check = now + std::chrono::milliseconds(100);
    }
    if (++spins < 64) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(std::min(spins, 500)));
    }
  }
  return kOk;
}

bool Comm::peer_dead(int peer) {
  for (uint32_t r = 0; r < nranks_; ++r) {
    if (peer >= 0 && static_cast<int>(r) != peer) continue;
    int pid = header_->pids[r].load();
    if (pid > 0 && kill(pid, 0) != 0 && errno == ESRCH) return true;
  }
  return false;
}

HcclResult Comm::connect() {
  header_ = static_cast<Header*>(map_shared(shm_name(token_, ""), sizeof(Header), true));
  char* own = static_cast<char*>(map_shared(shm_name(token_, "-w" + std::to_string(rank_)), kWindowBytes, true));
  if (header_ == nullptr || own == nullptr) return kSyscall;
  header_->pids[rank_].store(getpid());
  header_->attached.fetch_add(1);
  auto deadline = std::chrono::steady_clock::now() +
                  std::chrono::duration<double>(seconds_from_env("HCCL_CONNECT_TIMEOUT", 120));
  while (header_->attached.load() < nranks_) {
    if (std::chrono::steady_clock::now() > deadline) {
      set_error("HCCL: not every rank joined communicator " + token_ + " within HCCL_CONNECT_TIMEOUT");
      return kTimeout;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  windows_.assign(nranks_, nullptr);
  for (uint32_t r = 0; r < nranks_; ++r) {
    windows_[r] = r == rank_ ? own
                             : static_cast<char*>(map_shared(shm_name(token_, "-w" + std::to_string(r)),
                                                             kWindowBytes, false));
    if (windows_[r] == nullptr) return kSyscall;
  }
  rings_.assign(size_t{nranks_} * nranks_, nullptr);
  // The last rank to map every window removes the names; the mappings stay.
  if (header_->mapped.fetch_add(1) + 1 == nranks_) {
    shm_unlink(shm_name(token_, "").c_str());
    for (uint32_t r = 0; r < nranks_; ++r) shm_unlink(shm_name(token_, "-w" + std::to_string(r)).c_str());
  }
  return kOk;
}

void Comm::destroy() {
  // What this communicator still has queued ends first (a failed peer ends it with an error).
  while (in_flight_.load() > 0) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  for (uint32_t r = 0; r < windows_.size(); ++r)
    if (windows_[r] != nullptr) munmap(windows_[r], kWindowBytes);
  for (Ring* ring : rings_)
    if (ring != nullptr) munmap(ring, sizeof(Ring));
  if (header_ != nullptr) munmap(header_, sizeof(Header));
}

HcclResult Comm::barrier() {
  uint64_t generation = ++generation_;
  header_->arrived[rank_].store(generation);
  return wait_until(
      [&] {
        for (uint32_t r = 0; r < nranks_; ++r)
          if (header_->arrived[r].load() < generation) return false;
        return true;
      },
      -1);
}

HcclResult Comm::meet(const Call& call) {
  header_->calls[rank_] = call;
  if (HcclResult r = barrier()) return r;
  for (uint32_t r = 0; r < nranks_; ++r) {
    const Call& other = header_->calls[r];
    if (other == call) continue;
    set_error("HCCL: the ranks of communicator " + token_ + " called different collectives: rank " +
              std::to_string(rank_) + " kind " + std::to_string(call.kind) + " of " + std::to_string(call.count) +
              " (dtype " + std::to_string(call.type) + ", root " + std::to_string(call.root) + "), rank " +
              std::to_string(r) + " kind " + std::to_string(other.kind) + " of " + std::to_string(other.count) +
              " (dtype " + std::to_string(other.type) + ", root " + std::to_string(other.root) + ")");
    return kParameter;
  }
  return kOk;
}

Ring* Comm::ring(uint32_t from, uint32_t to) {
  std::lock_guard<std::mutex> lock(rings_mutex_);
  Ring*& ring = rings_[size_t{from} * nranks_ + to];
  if (ring == nullptr) {
    // Both ends create it the same size; it is removed when the first end maps it for the second time.
    std::string name = shm_name(token_, "-p" + std::to_string(from) + "-" + std::to_string(to));
    ring = static_cast<Ring*>(map_shared(name, sizeof(Ring), true));
  }
  return ring;
}

bool Comm::push(Ring* ring, const char* data, size_t bytes, size_t* done) {
  while (*done < bytes) {
    uint64_t written = ring->written.load(), read = ring->read.load();
    size_t space = kRingBytes - static_cast<size_t>(written - read);
    if (space == 0) return false;
    size_t at = written % kRingBytes;
    size_t n = std::min({space, bytes - *done, kRingBytes - at});
    std::memcpy(ring->data + at, data + *done, n);
    ring->written.store(written + n);
    *done += n;
  }
  return true;
}

bool Comm::pull(Ring* ring, char* data, size_t bytes, size_t* done) {
  while (*done < bytes) {
    uint64_t written = ring->written.load(), read = ring->read.load();
    size_t available = static_cast<size_t>(written - read);
    if (available == 0) return false;
    size_t at = read % kRingBytes;
    size_t n = std::min({available, bytes - *done, kRingBytes - at});
    std::memcpy(data + *done, ring->data + at, n);
    ring->read.store(read + n);
    *done += n;
  }
  return true;
}

HcclResult Comm::send(const void* data, size_t bytes, uint32_t peer) {
  Ring* r = ring(rank_, peer);
  if (r == nullptr) return kSyscall;
  size_t done = 0;
  return wait_until([&] { return push(r, static_cast<const char*>(data), bytes, &done); }, static_cast<int>(peer));
}

HcclResult Comm::recv(void* data, size_t bytes, uint32_t peer) {
  Ring* r = ring(peer, rank_);
  if (r == nullptr) return kSyscall;
  size_t done = 0;
  return wait_until([&] { return pull(r, static_cast<char*>(data), bytes, &done); }, static_cast<int>(peer));
}

// --- the arithmetic of a reduction -----------------------------------------------------------

at::Tensor view(const void* data, uint64_t count, at::ScalarType type) {
  return at::from_blob(const_cast<void*>(data), {static_cast<int64_t>(count)}, at::TensorOptions().dtype(type));
}

void reduce_into(at::Tensor& acc, const at::Tensor& other, int op) {
  switch (op) {
    case kSum: acc.add_(other); break;
    case kProd: acc.mul_(other); break;
    case kMax: at::maximum_out(acc, acc, other); break;
    default: at::minimum_out(acc, acc, other); break;
  }
}

// The reduction over every rank of `count` elements at `offset` (in elements) of each window.
at::Tensor reduce_windows(Comm& comm, uint64_t offset, uint64_t count, at::ScalarType type, int op,
                          const std::vector<uint64_t>* offsets = nullptr) {
  size_t size = c10::elementSize(type);
  auto at_rank = [&](uint32_t r) {
    uint64_t start = offsets != nullptr ? (*offsets)[r] : offset;
    return view(comm.window(r) + start * size, count, type);
  };
  at::Tensor acc = at_rank(0).clone();
  for (uint32_t r = 1; r < comm.nranks(); ++r) reduce_into(acc, at_rank(r), op);
  return acc;
}

// --- argument checks made when a call is issued, as HCCL makes them --------------------------

HcclResult check(void* comm, int type, bool reduction, int op = kSum) {
  bool ok;
  scalar_type(type, &ok);
  if (comm == nullptr) return kPointer;
  if (!ok || (reduction && !reducible(type))) {
    set_error("HCCL: unsupported data type " + std::to_string(type));
    return kNotSupport;
  }
  if (reduction && (op < kSum || op > kMin)) return kParameter;
  return kOk;
}

size_t bytes_of(uint64_t count, int type) {
  bool ok;
  return count * c10::elementSize(scalar_type(type, &ok));
}

at::ScalarType type_of(int type) {
  bool ok;
  return scalar_type(type, &ok);
}

std::atomic<uint64_t> root_counter{0};

}  // namespace
}  // namespace fake_cann

using namespace fake_cann;
using aclrtStream = void*;
using HcclComm = void*;

extern "C" {

struct HcclRootInfo {
  char internal[4108];
};

struct HcclSendRecvItem {
  int type;  // HCCL_SEND = 0, HCCL_RECV = 1
  void* buf;
  uint64_t count;
  int dataType;
  uint32_t remoteRank;
};

// The root info names the communicator's shared memory: unique per machine and call.
int HcclGetRootInfo(HcclRootInfo* info) {
  if (info == nullptr) return kPointer;
  std::memset(info, 0, sizeof(*info));
  std::random_device random;
  std::snprintf(info->internal, sizeof(info->internal), "fakecann-%d-%llu-%08x", static_cast<int>(getpid()),
                static_cast<unsigned long long>(root_counter.fetch_add(1)), random());
  return kOk;
}

int HcclCommInitRootInfo(uint32_t nranks, const HcclRootInfo* info, uint32_t rank, HcclComm* comm) {
  if (info == nullptr || comm == nullptr) return kPointer;
  if (nranks == 0 || nranks > static_cast<uint32_t>(kMaxRanks) || rank >= nranks) return kParameter;
  auto* made = new Comm(std::string(info->internal, strnlen(info->internal, kRootInfoBytes)), nranks, rank);
  HcclResult result = made->connect();
  if (result != kOk) {
    delete made;
    return result;
  }
  *comm = made;
  return kOk;
}

int HcclCommInitRootInfoConfig(uint32_t nranks, const HcclRootInfo* info, uint32_t rank, const void*,
                               HcclComm* comm) {
  return HcclCommInitRootInfo(nranks, info, rank, comm);
}

int HcclCommDestroy(HcclComm comm) {
  if (comm == nullptr) return kPointer;
  auto* c = static_cast<Comm*>(comm);
  c->destroy();
  delete c;
  return kOk;
}

int HcclGetCommName(HcclComm comm, char* name) {
  if (comm == nullptr || name == nullptr) return kPointer;
  std::snprintf(name, 128, "%s", static_cast<Comm*>(comm)->name().c_str());
  return kOk;
}

int HcclGetRankSize(HcclComm comm, uint32_t* size) {
  if (comm == nullptr || size == nullptr) return kPointer;
  *size = static_cast<Comm*>(comm)->nranks();
  return kOk;
}

int HcclGetRankId(HcclComm comm, uint32_t* rank) {
  if (comm == nullptr || rank == nullptr) return kPointer;
  *rank = static_cast<Comm*>(comm)->rank();
  return kOk;
}

int HcclGetCommAsyncError(HcclComm comm, int* error) {
  if (comm == nullptr || error == nullptr) return kPointer;
  *error = static_cast<Comm*>(comm)->async_error();
  return kOk;
}

const char* HcclGetErrorString(int code) {
  switch (code) {
    case kOk: return "success";
    case kTimeout: return "timeout";
    case kRemote: return "error cqe (a remote rank failed)";
    case kNotSupport: return "not support feature";
    default: return "HCCL error";
  }
}

int HcclAllReduce(void* send, void* recv, uint64_t count, int type, int op, HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, type, true, op)) return bad;
  static_cast<Comm*>(comm)->issue(stream, [=](Comm& c) -> HcclResult {
    if (HcclResult r = c.publish(send, bytes_of(count, type))) return r;
    if (HcclResult r = c.meet({kAllReduceCall, type, op, 0, count})) return r;
    at::Tensor result = reduce_windows(c, 0, count, type_of(type), op);
    if (HcclResult r = c.barrier()) return r;
    view(recv, count, type_of(type)).copy_(result);
    return kOk;
  });
  return kOk;
}

int HcclReduce(void* send, void* recv, uint64_t count, int type, int op, uint32_t root, HcclComm comm,
               aclrtStream stream) {
  if (HcclResult bad = check(comm, type, true, op)) return bad;
  static_cast<Comm*>(comm)->issue(stream, [=](Comm& c) -> HcclResult {
    if (HcclResult r = c.publish(send, bytes_of(count, type))) return r;
    if (HcclResult r = c.meet({kReduceCall, type, op, static_cast<int32_t>(root), count})) return r;
    at::Tensor result;
    if (c.rank() == root) result = reduce_windows(c, 0, count, type_of(type), op);
    if (HcclResult r = c.barrier()) return r;
    if (c.rank() == root) view(recv, count, type_of(type)).copy_(result);
    return kOk;
  });
  return kOk;
}

int HcclBroadcast(void* buf, uint64_t count, int type, uint32_t root, HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, type, false)) return bad;
  static_cast<Comm*>(comm)->issue(stream, [=](Comm& c) -> HcclResult {
    size_t bytes = bytes_of(count, type);
    if (c.rank() == root)
      if (HcclResult r = c.publish(buf, bytes)) return r;
    if (HcclResult r = c.meet({kBroadcastCall, type, 0, static_cast<int32_t>(root), count})) return r;
    if (c.rank() != root && bytes > 0) std::memcpy(buf, c.window(root), bytes);
    return c.barrier();
  });
  return kOk;
}

int HcclAllGather(void* send, void* recv, uint64_t count, int type, HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, type, false)) return bad;
  static_cast<Comm*>(comm)->issue(stream, [=](Comm& c) -> HcclResult {
    size_t bytes = bytes_of(count, type);
    if (HcclResult r = c.publish(send, bytes)) return r;
    if (HcclResult r = c.meet({kAllGatherCall, type, 0, 0, count})) return r;
    for (uint32_t r = 0; r < c.nranks() && bytes > 0; ++r)
      std::memcpy(static_cast<char*>(recv) + r * bytes, c.window(r), bytes);
    return c.barrier();
  });
  return kOk;
}

int HcclAllGatherV(void* send, uint64_t count, void* recv, const void* recvCounts, const void* recvDispls, int type,
                   HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, type, false)) return bad;
  uint32_t n = static_cast<Comm*>(comm)->nranks();
  std::vector<uint64_t> counts(static_cast<const uint64_t*>(recvCounts), static_cast<const uint64_t*>(recvCounts) + n);
  std::vector<uint64_t> displs(static_cast<const uint64_t*>(recvDispls), static_cast<const uint64_t*>(recvDispls) + n);
  static_cast<Comm*>(comm)->issue(stream, [=](Comm& c) -> HcclResult {
    if (HcclResult r = c.publish(send, bytes_of(count, type))) return r;
    if (HcclResult r = c.meet({kAllGatherVCall, type, 0, 0, 0})) return r;
    for (uint32_t r = 0; r < c.nranks(); ++r)
      std::memcpy(static_cast<char*>(recv) + bytes_of(displs[r], type), c.window(r), bytes_of(counts[r], type));
    return c.barrier();
  });
  return kOk;
}

int HcclReduceScatter(void* send, void* recv, uint64_t count, int type, int op, HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, type, true, op)) return bad;
  static_cast<Comm*>(comm)->issue(stream, [=](Comm& c) -> HcclResult {
    if (HcclResult r = c.publish(send, bytes_of(count * c.nranks(), type))) return r;
    if (HcclResult r = c.meet({kReduceScatterCall, type, op, 0, count})) return r;
    at::Tensor result = reduce_windows(c, count * c.rank(), count, type_of(type), op);
    if (HcclResult r = c.barrier()) return r;
    view(recv, count, type_of(type)).copy_(result);
    return kOk;
  });
  return kOk;
}

int HcclReduceScatterV(void* send, const void* sendCounts, const void* sendDispls, void* recv, uint64_t count,
                       int type, int op, HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, type, true, op)) return bad;
  uint32_t n = static_cast<Comm*>(comm)->nranks();
  std::vector<uint64_t> counts(static_cast<const uint64_t*>(sendCounts), static_cast<const uint64_t*>(sendCounts) + n);
  std::vector<uint64_t> displs(static_cast<const uint64_t*>(sendDispls), static_cast<const uint64_t*>(sendDispls) + n);
  static_cast<Comm*>(comm)->issue(stream, [=](Comm& c) -> HcclResult {
    uint64_t extent = 0;
    for (uint32_t r = 0; r < n; ++r) extent = std::max(extent, displs[r] + counts[r]);
    if (HcclResult r = c.publish(send, bytes_of(extent, type))) return r;
    std::memcpy(c.meta(c.rank()), displs.data(), n * sizeof(uint64_t));
    if (HcclResult r = c.meet({kReduceScatterVCall, type, op, 0, 0})) return r;
    std::vector<uint64_t> offsets(n);
    for (uint32_t r = 0; r < n; ++r) offsets[r] = c.meta(r)[c.rank()];
    at::Tensor result = reduce_windows(c, 0, count, type_of(type), op, &offsets);
    if (HcclResult r = c.barrier()) return r;
    view(recv, count, type_of(type)).copy_(result);
    return kOk;
  });
  return kOk;
}

int HcclScatter(void* send, void* recv, uint64_t count, int type, uint32_t root, HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, type, false)) return bad;
  static_cast<Comm*>(comm)->issue(stream, [=](Comm& c) -> HcclResult {
    size_t bytes = bytes_of(count, type);
    if (c.rank() == root)
      if (HcclResult r = c.publish(send, bytes * c.nranks())) return r;
    if (HcclResult r = c.meet({kScatterCall, type, 0, static_cast<int32_t>(root), count})) return r;
    if (bytes > 0) std::memcpy(recv, c.window(root) + bytes * c.rank(), bytes);
    return c.barrier();
  });
  return kOk;
}

// All-to-all with counts and displacements (in elements) per peer: each rank publishes its send
// buffer and its displacements; each reads its part of every other's.
static int alltoallv(const void* send, std::vector<uint64_t> sendCounts, std::vector<uint64_t> sdispls, int sendType,
                     const void* recv, std::vector<uint64_t> recvCounts, std::vector<uint64_t> rdispls,
                     HcclComm comm, aclrtStream stream) {
  static_cast<Comm*>(comm)->issue(stream, [=](Comm& c) -> HcclResult {
    uint32_t n = c.nranks();
    uint64_t extent = 0;
    for (uint32_t r = 0; r < n; ++r) extent = std::max(extent, sdispls[r] + sendCounts[r]);
    if (HcclResult r = c.publish(send, bytes_of(extent, sendType))) return r;
    std::memcpy(c.meta(c.rank()), sdispls.data(), n * sizeof(uint64_t));
    if (HcclResult r = c.meet({kAlltoAllCall, sendType, 0, 0, 0})) return r;
    for (uint32_t r = 0; r < n; ++r)
      std::memcpy(static_cast<char*>(const_cast<void*>(recv)) + bytes_of(rdispls[r], sendType),
                  c.window(r) + bytes_of(c.meta(r)[c.rank()], sendType), bytes_of(recvCounts[r], sendType));
    return c.barrier();
  });
  return kOk;
}

int HcclAlltoAllV(const void* send, const void* sendCounts, const void* sdispls, int sendType, const void* recv,
                  const void* recvCounts, const void* rdispls, int recvType, HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, sendType, false)) return bad;
  if (sendType != recvType) return kParameter;
  uint32_t n = static_cast<Comm*>(comm)->nranks();
  auto list = [n](const void* p) {
    return std::vector<uint64_t>(static_cast<const uint64_t*>(p), static_cast<const uint64_t*>(p) + n);
  };
  return alltoallv(send, list(sendCounts), list(sdispls), sendType, recv, list(recvCounts), list(rdispls), comm,
                   stream);
}

int HcclAlltoAll(const void* send, uint64_t sendCount, int sendType, const void* recv, uint64_t recvCount,
                 int recvType, HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, sendType, false)) return bad;
  if (sendType != recvType || sendCount != recvCount) return kParameter;
  uint32_t n = static_cast<Comm*>(comm)->nranks();
  std::vector<uint64_t> counts(n, sendCount), displs(n);
  for (uint32_t r = 0; r < n; ++r) displs[r] = r * sendCount;
  return alltoallv(send, counts, displs, sendType, recv, counts, displs, comm, stream);
}

// The count matrix says what each rank sends each other rank; displacements follow in rank order.
int HcclAlltoAllVC(const void* send, const void* sendCountMatrix, int sendType, const void* recv, int recvType,
                   HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, sendType, false)) return bad;
  if (sendType != recvType) return kParameter;
  auto* c = static_cast<Comm*>(comm);
  uint32_t n = c->nranks(), me = c->rank();
  const auto* matrix = static_cast<const uint64_t*>(sendCountMatrix);
  std::vector<uint64_t> sendCounts(n), sdispls(n), recvCounts(n), rdispls(n);
  for (uint32_t r = 0; r < n; ++r) {
    sendCounts[r] = matrix[me * n + r];
    recvCounts[r] = matrix[r * n + me];
    sdispls[r] = r == 0 ? 0 : sdispls[r - 1] + sendCounts[r - 1];
    rdispls[r] = r == 0 ? 0 : rdispls[r - 1] + recvCounts[r - 1];
  }
  return alltoallv(send, sendCounts, sdispls, sendType, recv, recvCounts, rdispls, comm, stream);
}

int HcclBarrier(HcclComm comm, aclrtStream stream) {
  if (comm == nullptr) return kPointer;
  static_cast<Comm*>(comm)->issue(stream, [](Comm& c) -> HcclResult {
    if (HcclResult r = c.meet({kBarrierCall, 0, 0, 0, 0})) return r;
    return c.barrier();
  });
  return kOk;
}

int HcclSend(void* buf, uint64_t count, int type, uint32_t peer, HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, type, false)) return bad;
  if (peer >= static_cast<Comm*>(comm)->nranks()) return kParameter;
  static_cast<Comm*>(comm)->issue(stream, [=](Comm& c) { return c.send(buf, bytes_of(count, type), peer); });
  return kOk;
}

int HcclRecv(void* buf, uint64_t count, int type, uint32_t peer, HcclComm comm, aclrtStream stream) {
  if (HcclResult bad = check(comm, type, false)) return bad;
  if (peer >= static_cast<Comm*>(comm)->nranks()) return kParameter;
  static_cast<Comm*>(comm)->issue(stream, [=](Comm& c) { return c.recv(buf, bytes_of(count, type), peer); });
  return kOk;
}

// Every send and receive of the batch moves as far as it can in turn, so that opposite
// sends of two ranks cannot hold each other up.
int HcclBatchSendRecv(HcclSendRecvItem* items, uint32_t count, HcclComm comm, aclrtStream stream) {
  if (comm == nullptr || (items == nullptr && count > 0)) return kPointer;
  std::vector<HcclSendRecvItem> batch(items, items + count);
  for (const auto& item : batch)
    if (HcclResult bad = check(comm, item.dataType, false)) return bad;
  static_cast<Comm*>(comm)->issue(stream, [batch](Comm& c) -> HcclResult {
    std::vector<size_t> done(batch.size(), 0);
    std::vector<Ring*> rings(batch.size());
    for (size_t i = 0; i < batch.size(); ++i) {
      const auto& item = batch[i];
      rings[i] = item.type == 0 ? c.ring(c.rank(), item.remoteRank) : c.ring(item.remoteRank, c.rank());
      if (rings[i] == nullptr) return kSyscall;
    }
    return c.wait_until(
        [&] {
          bool all = true;
          for (size_t i = 0; i < batch.size(); ++i) {
            const auto& item = batch[i];
            size_t bytes = bytes_of(item.count, item.dataType);
            bool finished = item.type == 0 ? c.push(rings[i], static_cast<const char*>(item.buf), bytes, &done[i])
                                           : c.pull(rings[i], static_cast<char*>(item.buf), bytes, &done[i]);
            all = all && finished;
          }
          return all;
        },
        -1);
  });
  return kOk;
}

int HcclGroupStart() { return kOk; }
int HcclGroupEnd() { return kOk; }
uint32_t HcclGetCommConfigCapability() { return 0; }
int HcclSetConfig(int, int) { return kOk; }

}  // extern "C"
