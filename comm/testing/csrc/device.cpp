// The simulated accelerator: PrivateUse1 tensors whose storage is host memory.
//
// What a real accelerator plugin registers with torch, each piece as small as
// comm's tests need: a device guard (current device and stream per thread), an
// allocator, the PrivateUse1 hooks (device count, pinned host memory, storage
// resizing), copy kernels between the host and the device (counted as transfers),
// and one fallback kernel that runs every other operator with the CPU kernel on
// CPU tensors over the same memory, then hands the results back as device tensors
// (with kernels of its own, which compute on the host what the CPU would, for the
// routes torch keeps for a plugin: convolutions and fused attention).
#include <algorithm>
#include <array>
#include <optional>
#include <chrono>
#include <cstring>
#include <sstream>
#include <string>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

#include <ATen/EmptyTensor.h>
#include <ATen/SDPBackend.h>
#include <ATen/detail/PrivateUse1HooksInterface.h>
#include <ATen/native/transformers/attention.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include "simulated.h"

namespace comm_sim {
namespace {

constexpr c10::DispatchKey kKey = c10::DispatchKey::PrivateUse1;

std::atomic<int> device_count{0};
thread_local c10::DeviceIndex current_index = 0;
thread_local std::array<c10::StreamId, kMaxDevices> current_stream{}; // 0: the default stream
std::atomic<c10::StreamId> next_stream{1};
// Each device's memory, as torch_npu's caching allocator counts it (memory_stats' "all"
// figures): `allocated`, the blocks tensors hold; `reserved`, the blocks taken from the
// device, held or cached; each with its peak since reset_peak_memory_stats. Memory a CPU
// kernel allocated for a device tensor (the fallback's results) is reserved, not
// allocated: it is freed outside the allocator.
struct Memory {
  std::atomic<int64_t> allocated{0};
  std::atomic<int64_t> peak_allocated{0};
  std::atomic<int64_t> reserved{0};
  std::atomic<int64_t> peak_reserved{0};
};
std::array<Memory, kMaxDevices> device_memory{};
// Pinned host memory, counted the same way (comm.testing.pinned_memory; torch_npu reports none).
Memory pinned_memory;
// Each device's capacity: what allocation respects and mem_get_info reports (set_capacity).
std::atomic<int64_t> capacity{int64_t{16} << 30};

void add(std::atomic<int64_t>& value, std::atomic<int64_t>& peak, int64_t bytes) {
  auto now = value += bytes;
  auto seen = peak.load();
  while (now > seen && !peak.compare_exchange_weak(seen, now)) {
  }
}

Memory& memory_of(c10::Device device) {
  return device_memory[device.index()];
}

void add_reserved(c10::DeviceIndex index, int64_t bytes) {
  add(device_memory[index].reserved, device_memory[index].peak_reserved, bytes);
}

// ---- what each stream was told to wait for ----------------------------------
//
// Operators run on the host when called, so the only work queued on a device is a
// collective some stream was told to wait for (WorkHCCL::wait makes the current stream
// wait for the collective's end event and returns: src@master ProcessGroupHCCL.cpp
// :1016-1021). Every later operation on that stream waits for it first (the host waits
// here, where hardware queues the operation behind it); a read that was never ordered
// after the collective on its stream (no wait, or a wait on another stream) reads
// whatever is there. Threads share a device's default stream (stream 0) unless they
// set one of their own, as on torch_npu, so on the default stream one thread's copy
// waits for the collectives another thread waited for.
std::mutex pending_mutex;
std::array<std::vector<CompletionPtr>, kMaxDevices> pending;
// The stream told to wait for each.
std::array<std::vector<c10::StreamId>, kMaxDevices> pending_stream;
thread_local CompletionPtr recording_with;

// What `stream` of device `index` waits for; every stream's when `stream` is empty.
std::vector<CompletionPtr> pending_on(c10::DeviceIndex index, std::optional<c10::StreamId> stream = std::nullopt) {
  std::lock_guard<std::mutex> lock(pending_mutex);
  if (!stream) return pending[index];
  std::vector<CompletionPtr> on;
  for (size_t i = 0; i < pending[index].size(); ++i) {
    if (pending_stream[index][i] == *stream) on.push_back(pending[index][i]);
  }
  return on;
}

c10::DeviceIndex checked(c10::DeviceIndex index) {
  TORCH_CHECK(
      index >= 0 && index < device_count.load(),
      "Invalid device index ", static_cast<int>(index), ": the simulated ",
      c10::get_privateuse1_backend(), " has ", device_count.load(), " devices");
  return index;
}

c10::DeviceIndex index_of(c10::Device device) {
  return device.has_index() ? checked(device.index()) : current_index;
}

// ---- device guard -------------------------------------------------------------

c10::Stream make_stream(c10::DeviceIndex index, c10::StreamId id) {
  return c10::Stream(c10::Stream::UNSAFE, c10::Device(kDevice, index), id);
}

// An event holds the host time it was last recorded at (the time between two events is
// the host's) and the collectives its stream's device had been told to wait for: it
// completes when they have (torch_npu's NPUEvent over aclrtRecordEvent); a stream that
// waits for it (block) waits for them.
using EventClock = std::chrono::steady_clock;
struct SimEvent {
  EventClock::time_point time;
  c10::DeviceIndex index = 0;
  std::vector<CompletionPtr> pending;
};

void host_waits(c10::DeviceIndex index, std::optional<c10::StreamId> stream = std::nullopt) {
  drain_stream(index, stream);
  ++device_counters[index].host_syncs;
}

struct Guard final : c10::impl::DeviceGuardImplInterface {
  c10::DeviceType type() const override { return kDevice; }
  c10::Device exchangeDevice(c10::Device device) const override {
    c10::Device previous = getDevice();
    setDevice(device);
    return previous;
  }
  c10::Device getDevice() const override { return {kDevice, current_index}; }
  void setDevice(c10::Device device) const override { current_index = index_of(device); }
  void uncheckedSetDevice(c10::Device device) const noexcept override {
    if (device.has_index()) current_index = device.index();
  }
  c10::Stream getStream(c10::Device device) const override {
    auto index = index_of(device);
    return make_stream(index, current_stream[index]);
  }
  c10::Stream getDefaultStream(c10::Device device) const override { return make_stream(index_of(device), 0); }
  c10::Stream getStreamFromGlobalPool(c10::Device device, bool) const override { return getNewStream(device, 0); }
  c10::Stream getNewStream(c10::Device device, int) const override {
    return make_stream(index_of(device), next_stream++);
  }
  c10::Stream exchangeStream(c10::Stream stream) const override {
    auto index = index_of(stream.device());
    c10::Stream previous = make_stream(index, current_stream[index]);
    current_stream[index] = stream.id();
    return previous;
  }
  void record(void** event, const c10::Stream& stream, c10::DeviceIndex, c10::EventFlag) const override {
    if (*event == nullptr) *event = new SimEvent();
    auto* recorded = static_cast<SimEvent*>(*event);
    recorded->time = EventClock::now();
    recorded->index = stream.device_index();
    recorded->pending = pending_on(recorded->index, stream.id());
    if (recording_with) recorded->pending.push_back(recording_with);
  }
  void destroyEvent(void* event, c10::DeviceIndex) const noexcept override { delete static_cast<SimEvent*>(event); }
  double elapsedTime(void* first, void* second, c10::DeviceIndex) const override {
    auto interval = static_cast<SimEvent*>(second)->time - static_cast<SimEvent*>(first)->time;
    return std::chrono::duration<double, std::milli>(interval).count();
  }
  // aclrtStreamWaitEvent: the stream's device waits for what the event waits for.
  void block(void* event, const c10::Stream& stream) const override {
    if (event == nullptr) return;
    for (const auto& done : static_cast<SimEvent*>(event)->pending) {
      if (!done->finished()) stream_waits_for(stream.device_index(), stream.id(), done);
    }
  }
  bool queryEvent(void* event) const override {
    if (event == nullptr) return true;
    const auto& all = static_cast<SimEvent*>(event)->pending;
    return std::all_of(all.begin(), all.end(), [](const CompletionPtr& done) { return done->finished(); });
  }
  // aclrtSynchronizeEvent: the host waits.
  void synchronizeEvent(void* event) const override {
    if (event == nullptr) return;
    auto* recorded = static_cast<SimEvent*>(event);
    for (const auto& done : recorded->pending) done->wait();
    ++device_counters[recorded->index].host_syncs;
  }
  bool queryStream(const c10::Stream& stream) const override {
    auto all = pending_on(stream.device_index(), stream.id());
    return std::all_of(all.begin(), all.end(), [](const CompletionPtr& done) { return done->finished(); });
  }
  // aclrtSynchronizeStream: the host waits for the stream; aclrtSynchronizeDevice: for all of the device's.
  void synchronizeStream(const c10::Stream& stream) const override {
    host_waits(stream.device_index(), stream.id());
  }
  void synchronizeDevice(c10::DeviceIndex index) const override { host_waits(index); }
  c10::DeviceIndex deviceCount() const noexcept override { return static_cast<c10::DeviceIndex>(device_count.load()); }
};

C10_REGISTER_GUARD_IMPL(PrivateUse1, Guard);

// ---- allocators ---------------------------------------------------------------
//
// Device and pinned memory are cached, as torch_npu caches them: a freed block is kept
// and handed to the next request of its size, and only empty_cache gives device blocks
// back (torch_npu/csrc/core/npu/NPUCachingAllocator.cpp, "Yet another caching allocator
// for NPU device allocations"; pinned memory: torch's ATen/core/CachingHostAllocator.h,
// which torch_npu's CachingHostAllocator builds on). Device sizes are rounded up to 512
// bytes (both caching allocators' smallest block), pinned sizes to a power of two
// (CachingHostAllocator.h, allocate); a block serves requests of its own rounded size
// only, where torch_npu's would also split a bigger one. Without the cache every large
// buffer would be fresh pages from the kernel, faulted in at first touch, at each
// allocation: a cost no caching allocator charges.
//
// A block returns to the cache as soon as its last tensor is freed. Nothing can still be
// using it then: operators run on the host when called, and a collective in flight holds
// its tensors (its gloo work keeps the host views, which keep the device storage), where
// torch_npu's allocator needs the streams' events to tell.

constexpr size_t kPinnedPool = kMaxDevices; // the pools: one per device, then pinned memory
constexpr size_t kDeviceRound = 512;

struct Blocks {
  std::mutex mutex;
  std::array<std::unordered_map<size_t, std::vector<void*>>, kMaxDevices + 1> cached; // by rounded size
  std::unordered_map<void*, std::pair<size_t, size_t>> in_use;                          // (pool, rounded size)
};

// Never destroyed: tensors are still freed while the process exits, after static objects
// are (torch keeps its own allocators' state alive for the same reason).
Blocks& blocks() {
  static auto* state = new Blocks();
  return *state;
}

size_t rounded(size_t pool, size_t nbytes) {
  if (pool != kPinnedPool) return (nbytes + kDeviceRound - 1) / kDeviceRound * kDeviceRound;
  size_t size = 1;
  while (size < nbytes) size <<= 1;
  return size;
}

// Frees `pool`'s cached blocks (torch.<name>.empty_cache), less what a device had reserved.
// Holds blocks().mutex.
void release_cached_locked(Blocks& all, size_t pool) {
  int64_t freed = 0;
  for (auto& [size, cached] : all.cached[pool]) {
    for (void* data : cached) c10::free_cpu(data);
    freed += static_cast<int64_t>(size * cached.size());
  }
  all.cached[pool].clear();
  (pool == kPinnedPool ? pinned_memory : device_memory[pool]).reserved -= freed;
}

void release_cached(size_t pool) {
  auto& all = blocks();
  std::lock_guard<std::mutex> lock(all.mutex);
  release_cached_locked(all, pool);
}

// Whether `size` more bytes taken from device `pool` would pass its capacity, beside what its
// HCCL communicators hold (allocated outside the caching allocator).
bool past_capacity(size_t pool, size_t size) {
  return device_memory[pool].reserved.load() + device_counters[pool].communicator_bytes.load() +
             static_cast<int64_t>(size) > capacity.load();
}

// A block of `pool` for `nbytes` (nullptr for none): a cached one, or else fresh host memory.
// A device pool past its capacity first frees its cached blocks, as torch_npu's allocator
// does before it gives up (NPUCachingAllocator.cpp, malloc: release_cached_blocks, then
// alloc_block again); still past it, nothing is taken and `size` says how much was asked.
void* take_block(size_t pool, size_t nbytes, size_t& size) {
  size = 0;
  if (nbytes == 0) return nullptr;
  size = rounded(pool, nbytes);
  auto& all = blocks();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto& cached = all.cached[pool][size];
  void* data = nullptr;
  if (!cached.empty()) {
    data = cached.back();
    cached.pop_back();
  } else {
    if (pool != kPinnedPool && past_capacity(pool, size)) {
      release_cached_locked(all, pool);
      if (past_capacity(pool, size)) return nullptr;
    }
    data = c10::alloc_cpu(size);
    if (pool == kPinnedPool) {
      add(pinned_memory.reserved, pinned_memory.peak_reserved, static_cast<int64_t>(size));
    } else {
      add_reserved(static_cast<c10::DeviceIndex>(pool), static_cast<int64_t>(size));
    }
  }
  all.in_use.emplace(data, std::make_pair(pool, size));
  auto& counted = pool == kPinnedPool ? pinned_memory : device_memory[pool];
  add(counted.allocated, counted.peak_allocated, static_cast<int64_t>(size));
  return data;
}

// A DataPtr's deleter: the block goes back to its pool's cache.
void give_block(void* data) {
  if (data == nullptr) return;
  auto& all = blocks();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto block = all.in_use.find(data);
  auto [pool, size] = block->second;
  all.cached[pool][size].push_back(data);
  all.in_use.erase(block);
  (pool == kPinnedPool ? pinned_memory : device_memory[pool]).allocated -= static_cast<int64_t>(size);
}

// A size as torch_npu's allocator writes it in its messages (format_size).
std::string format_size(int64_t bytes) {
  std::ostringstream out;
  out.precision(2);
  out << std::fixed;
  if (bytes <= 1024) {
    out << bytes << " bytes";
  } else if (bytes <= 1048576) {
    out << bytes / 1024.0 << " KiB";
  } else if (bytes <= 1073741824LL) {
    out << bytes / 1048576.0 << " MiB";
  } else {
    out << bytes / 1073741824.0 << " GiB";
  }
  return out.str();
}

struct DeviceAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    auto index = current_index;
    size_t size = 0;
    void* data = take_block(static_cast<size_t>(index), nbytes, size);
    if (data == nullptr && size > 0) {
      // torch_npu's message and error type (NPUCachingAllocator.cpp, malloc: "NPU out of
      // memory. Tried to allocate ..."), which Python sees as torch.OutOfMemoryError.
      auto& counted = device_memory[index];
      auto total = capacity.load();
      auto free = std::max<int64_t>(0, total - counted.reserved.load() - device_counters[index].communicator_bytes.load());
      TORCH_CHECK_WITH(OutOfMemoryError, false, "NPU out of memory. Tried to allocate ",
                       format_size(static_cast<int64_t>(size)), " (NPU ", static_cast<int>(index), "; ",
                       format_size(total), " total capacity; ", format_size(counted.allocated.load()),
                       " already allocated; ", format_size(counted.allocated.load()), " current active; ",
                       format_size(free), " free; ", format_size(counted.reserved.load()),
                       " reserved in total by PyTorch)");
    }
    return {data, data, &give_block, c10::Device(kDevice, index)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &give_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

DeviceAllocator device_allocator;
REGISTER_ALLOCATOR(kDevice, &device_allocator);

// Pinned host memory is plain host memory that remembers it was pinned (is_pinned()): a
// block the pinned pool handed out and has not taken back.
bool pinned_block(const void* data) {
  auto& all = blocks();
  std::lock_guard<std::mutex> lock(all.mutex);
  auto block = all.in_use.find(const_cast<void*>(data));
  return block != all.in_use.end() && block->second.first == kPinnedPool;
}

struct PinnedAllocator final : c10::Allocator {
  c10::DataPtr allocate(size_t nbytes) override {
    size_t size = 0;
    void* data = take_block(kPinnedPool, nbytes, size);
    return {data, data, &give_block, c10::Device(c10::kCPU)};
  }
  c10::DeleterFnPtr raw_deleter() const override { return &give_block; }
  void copy_data(void* dest, const void* src, std::size_t count) const override { std::memcpy(dest, src, count); }
};

PinnedAllocator pinned_allocator;

// ---- hooks --------------------------------------------------------------------

struct Hooks final : at::PrivateUse1HooksInterface {
  bool isBuilt() const override { return true; }
  bool isAvailable() const override { return true; }
  bool hasPrimaryContext(c10::DeviceIndex) const override { return true; }
  void init() const override {}
  c10::DeviceIndex deviceCount() const override { return static_cast<c10::DeviceIndex>(device_count.load()); }
  void setCurrentDevice(c10::DeviceIndex index) const override { current_index = checked(index); }
  c10::DeviceIndex getCurrentDevice() const override { return current_index; }
  c10::DeviceIndex exchangeDevice(c10::DeviceIndex index) const override {
    auto previous = current_index;
    current_index = checked(index);
    return previous;
  }
  c10::DeviceIndex maybeExchangeDevice(c10::DeviceIndex index) const override { return exchangeDevice(index); }
  bool isPinnedPtr(const void* data) const override { return pinned_block(data); }
  c10::Allocator* getPinnedMemoryAllocator() const override { return &pinned_allocator; }
  // torch.<name>.default_generators and torch.Generator("npu") (random.cpp).
  const at::Generator& getDefaultGenerator(c10::DeviceIndex index) const override {
    return default_generator(index < 0 ? current_index : checked(index));
  }
  at::Generator getNewGenerator(c10::DeviceIndex index) const override {
    return new_generator(index < 0 ? current_index : checked(index));
  }
  // untyped_storage().resize_(n): what FSDP2 does to free and refill unsharded parameters.
  void resizePrivateUse1Bytes(const c10::Storage& storage, size_t nbytes) const override {
    auto* impl = storage.unsafeGetStorageImpl();
    TORCH_CHECK(impl->resizable(), "Trying to resize storage that is not resizable");
    drain(storage.device().index());
    c10::DeviceGuard guard(storage.device());
    c10::DataPtr fresh = device_allocator.allocate(nbytes);
    auto kept = std::min(nbytes, impl->nbytes());
    if (kept > 0) std::memcpy(fresh.get(), impl->data(), kept);
    impl->set_data_ptr_noswap(std::move(fresh));
    impl->set_nbytes(nbytes);
  }
};

Hooks hooks;

// ---- host views ---------------------------------------------------------------

bool on_device(const at::Tensor& tensor) { return tensor.defined() && tensor.device().type() == kDevice; }

// What a storage seen on another device keeps alive: the storage that owns the memory,
// and, where the memory is new to a simulated device (a CPU kernel made it for a device
// tensor), the bytes that device counts as allocated and reserved until it is freed.
struct Owner {
  c10::Storage memory;
  c10::DeviceIndex index;
  int64_t counted;
};

void release_storage(void* context) {
  auto* owner = static_cast<Owner*>(context);
  if (owner->counted > 0) {
    device_memory[owner->index].allocated -= owner->counted;
    device_memory[owner->index].reserved -= owner->counted;
  }
  delete owner;
}

// `memory` seen as a storage on `device`, which keeps `memory`'s owner alive. `counted`:
// the memory is new to `device`, which counts it until it is freed.
c10::Storage storage_over(const c10::Storage& memory, c10::Device device, c10::Allocator* allocator,
                          bool counted = false) {
  auto bytes = counted ? static_cast<int64_t>(memory.nbytes()) : 0;
  if (bytes > 0) {
    add(memory_of(device).allocated, memory_of(device).peak_allocated, bytes);
    add_reserved(device.index(), bytes);
  }
  c10::DataPtr data(memory.unsafeGetStorageImpl()->mutable_data(), new Owner{memory, device.index(), bytes},
                    &release_storage, device);
  return c10::Storage(c10::Storage::use_byte_size_t(), memory.nbytes(), std::move(data), allocator, memory.resizable());
}

// `like`'s view (sizes, strides, offset, and its conjugate and negative bits) of `storage`, on `key`'s device.
// A zero tensor (the ZeroTensor key: autograd's gradient of a constant, such as sgn's
// of real numbers, which has no memory and reads as zeros) stays one.
at::Tensor tensor_over(c10::Storage storage, c10::DispatchKey key, const at::Tensor& like) {
  c10::DispatchKeySet keys(key);
  if (like._is_zerotensor()) keys = keys.add(c10::DispatchKey::ZeroTensor);
  auto tensor = at::detail::make_tensor<c10::TensorImpl>(std::move(storage), keys, like.dtype());
  auto* impl = tensor.unsafeGetTensorImpl();
  impl->set_sizes_and_strides(like.sizes(), like.strides(), like.storage_offset());
  impl->_set_conj(like.is_conj());
  impl->_set_neg(like.is_neg());
  return tensor;
}

// Host views of one operator call's device tensors, and the way back.
class HostViews {
 public:
  at::Tensor to_host(const at::Tensor& tensor) {
    if (!on_device(tensor)) return tensor;
    for (auto& [host, device] : tensors_) {
      if (device.unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl()) return host;
    }
    at::Tensor host = tensor_over(to_host(tensor.storage()), c10::DispatchKey::CPU, tensor);
    tensors_.emplace_back(host, tensor);
    return host;
  }

  c10::Storage to_host(const c10::Storage& storage) {
    for (auto& [host, device] : storages_) {
      if (device.unsafeGetStorageImpl() == storage.unsafeGetStorageImpl()) return host;
    }
    auto host = storage_over(storage, c10::Device(c10::kCPU), c10::GetCPUAllocator());
    storages_.emplace_back(host, storage);
    return host;
  }

  // A result of the CPU kernel: an input itself (in-place and out= operators), a
  // view of an input's storage, or new memory that the device now owns.
  at::Tensor to_device(const at::Tensor& result, c10::DeviceIndex index) {
    if (!result.defined() || result.device().type() != c10::kCPU) return result;
    for (auto& [host, device] : tensors_) {
      if (host.unsafeGetTensorImpl() == result.unsafeGetTensorImpl()) return device;
    }
    return tensor_over(to_device(result.storage(), index), kKey, result);
  }

  // Apply what the CPU kernel did to the inputs' metadata and storages (resize_,
  // set_, as_strided_, out= arguments it resized) to the device tensors.
  void write_back() {
    for (auto& [host, device] : storages_) {
      auto* from = host.unsafeGetStorageImpl();
      auto* to = device.unsafeGetStorageImpl();
      if (from->data() != to->data()) { // the CPU kernel reallocated it
        c10::DataPtr moved = from->set_data_ptr(c10::DataPtr(nullptr, c10::Device(c10::kCPU)));
        c10::Storage made(c10::Storage::use_byte_size_t(), from->nbytes(), std::move(moved), c10::GetCPUAllocator());
        auto over = storage_over(made, device.device(), &device_allocator, /*counted=*/true);
        to->set_data_ptr_noswap(std::move(over.unsafeGetStorageImpl()->mutable_data_ptr()));
      }
      to->set_nbytes(from->nbytes());
    }
    for (auto& [host, device] : tensors_) {
      auto* impl = device.unsafeGetTensorImpl();
      c10::Storage storage = to_device(host.storage(), device.device().index());
      if (storage.unsafeGetStorageImpl() != device.storage().unsafeGetStorageImpl()) {
        impl->set_storage_keep_dtype(std::move(storage));
      }
      if (host.sizes() != device.sizes() || host.strides() != device.strides() ||
          host.storage_offset() != device.storage_offset()) {
        impl->set_sizes_and_strides(host.sizes(), host.strides(), host.storage_offset());
      }
    }
  }

 private:
  c10::Storage to_device(const c10::Storage& storage, c10::DeviceIndex index) {
    for (auto& [host, device] : storages_) {
      if (host.unsafeGetStorageImpl() == storage.unsafeGetStorageImpl()) return device;
    }
    auto device = storage_over(storage, c10::Device(kDevice, index), &device_allocator, /*counted=*/true);
    storages_.emplace_back(storage, device);
    return device;
  }

  std::vector<std::pair<c10::Storage, c10::Storage>> storages_; // (host, device)
  std::vector<std::pair<at::Tensor, at::Tensor>> tensors_; // (host, device)
};

// ---- kernels ------------------------------------------------------------------

at::Tensor empty_memory_format(
    c10::IntArrayRef size, std::optional<c10::ScalarType> dtype, std::optional<c10::Layout>,
    std::optional<c10::Device> device, std::optional<bool>, std::optional<c10::MemoryFormat> memory_format) {
  c10::OptionalDeviceGuard guard;
  if (device && device->has_index()) guard.reset_device(*device);
  return at::detail::empty_generic(
      size, &device_allocator, c10::DispatchKeySet(kKey), c10::dtype_or_default(dtype), memory_format);
}

at::Tensor empty_strided(
    c10::IntArrayRef size, c10::IntArrayRef stride, std::optional<c10::ScalarType> dtype,
    std::optional<c10::Layout>, std::optional<c10::Device> device, std::optional<bool>) {
  c10::OptionalDeviceGuard guard;
  if (device && device->has_index()) guard.reset_device(*device);
  return at::detail::empty_strided_generic(
      size, stride, &device_allocator, c10::DispatchKeySet(kKey), c10::dtype_or_default(dtype));
}

at::Tensor host_or_self(const at::Tensor& tensor) { return on_device(tensor) ? host_view(tensor) : tensor; }

// Whether a host tensor lies in pinned memory.
bool in_pinned(const at::Tensor& tensor) { return pinned_block(tensor.storage().data()); }

// A copy between pageable host memory and the device, charged as the runtime does it: the
// host first copies the pageable side into a page-locked buffer of the runtime's, which the
// device then transfers (CUDA's driver does, per its C++ Best Practices Guide, "Pinned
// memory"; assumed of Ascend's runtime, not verified). Here both steps are host copies, the
// second standing for the transfer as a pinned buffer's copy does: a pageable copy costs
// what a copy into pinned memory and its transfer cost, as comm's staging does. The
// runtime keeps its buffer; here it comes from the pinned pool's cache.
void through_staging(const at::Tensor& self, const at::Tensor& src) {
  auto staging = at::empty(src.sizes(), src.options().pinned_memory(true));
  staging.copy_(src);
  self.copy_(staging);
}

// A copy waits for what its devices were told to wait for. A blocking copy between the
// host and the device is a host synchronisation, and a drain when work was queued on the
// device: torch_npu's copy_ synchronises the current stream before a blocking H2D or D2H
// copy (AclrtSynchronizeStreamWithTimeout, src@master torch_npu/csrc/aten/common/
// CopyKernel.cpp:125-160), then copies synchronously. A non-blocking copy is queued on the
// stream only when its host side is pinned; from or to pageable memory it blocks as a
// blocking copy does: torch_npu's process_non_blocking_copy synchronises the stream
// (AclrtSynchronizeStreamWithTimeout) unless the host memory is registered with the
// runtime, and records an event on torch_npu's pinned blocks (Ascend/pytorch
// torch_npu/csrc/core/npu/CachingHostAllocator.cpp, process_unregistered_mem_location_type
// and process_non_blocking_copy, commit 189fb9bd); CUDA stages pageable memory
// synchronously too.
at::Tensor& copy(at::Tensor& self, const at::Tensor& src, bool non_blocking) {
  bool crosses = self.device().type() != src.device().type();
  if (crosses) ++transfers;
  bool queued = false;
  std::optional<c10::DeviceIndex> device_side;
  for (const at::Tensor* tensor : {&src, static_cast<const at::Tensor*>(&self)}) {
    if (!on_device(*tensor)) continue;
    queued = drain(tensor->device().index()) || queued;
    if (!device_side) device_side = tensor->device().index();
  }
  const at::Tensor& host = on_device(self) ? src : self;
  bool blocks = !non_blocking || !in_pinned(host);
  if (crosses && blocks && device_side) {
    ++device_counters[*device_side].host_syncs;
    if (queued) ++device_counters[*device_side].drains;
  }
  if (crosses && !in_pinned(host)) {
    through_staging(host_or_self(self), host_or_self(src));
  } else {
    host_or_self(self).copy_(host_or_self(src), non_blocking);
  }
  return self;
}

at::Tensor copy_from(const at::Tensor& self, const at::Tensor& dst, bool non_blocking) {
  at::Tensor target = dst;
  copy(target, self, non_blocking);
  return dst;
}

at::Tensor copy_from_and_resize(const at::Tensor& self, const at::Tensor& dst) {
  if (dst.sizes() != self.sizes()) dst.resize_(self.sizes());
  return copy_from(self, dst, false);
}

// `param.data = tensor.to(device)` (FSDP2 moving parameters): as CUDA's dense
// tensors do, host and device tensors may swap their data.
bool has_compatible_shallow_copy_type(const at::Tensor& self, const at::Tensor& from) {
  auto dense = [](const at::Tensor& t) {
    return t.layout() == c10::kStrided && (t.device().type() == c10::kCPU || t.device().type() == kDevice);
  };
  return dense(self) && dense(from);
}

// ---- the fallback -------------------------------------------------------------

// Operators that take tensors on two devices: CPU index tensors, as CUDA allows.
bool mixes_devices(const c10::OperatorName& name) {
  static const std::unordered_set<std::string> names{"aten::index", "aten::index_put_", "aten::index_put",
                                                     "aten::_index_put_impl_"};
  return names.count(name.name) > 0;
}

void collect_devices(const at::Tensor& tensor, std::vector<c10::Device>& devices) {
  if (!tensor.defined() || (tensor.device().type() == c10::kCPU && tensor.dim() == 0)) return;
  // A CPU scalar mixes with accelerator tensors, as on CUDA.
  if (std::find(devices.begin(), devices.end(), tensor.device()) == devices.end()) devices.push_back(tensor.device());
}

void check_same_device(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> arguments) {
  if (mixes_devices(op.schema().operator_name())) return;
  std::vector<c10::Device> devices;
  for (const auto& value : arguments) {
    if (value.isTensor()) {
      collect_devices(value.toTensor(), devices);
    } else if (value.isTensorList()) {
      for (const at::Tensor& tensor : value.toTensorList()) collect_devices(tensor, devices);
    }
  }
  TORCH_CHECK(
      devices.size() < 2, "Expected all tensors to be on the same device, but found at least two devices, ",
      devices.size() > 1 ? devices[0] : c10::Device(c10::kCPU), " and ",
      devices.size() > 1 ? devices[1] : c10::Device(c10::kCPU), "!");
}

// One operator call on the host: the device tensors (and storages) among `op`'s
// arguments are replaced by host views of the same memory, `run` computes on those
// as a CPU kernel does (it leaves `op`'s results on the stack in place of its
// arguments), and the results come back as device tensors. `run` is the CPU's own
// kernel for most operators (run_on_host); where the CPU has none, the host
// computes what it would have (convolution_on_host, attention_on_host).
template <typename Run>
void on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack, const Run& run) {
  const auto& schema = op.schema();
  const size_t first = stack->size() - schema.arguments().size();
  check_same_device(op, c10::ArrayRef<c10::IValue>(*stack).slice(first));
  std::optional<c10::DeviceIndex> index;
  std::vector<c10::DeviceIndex> touched; // devices whose memory the operator reads or writes
  auto touch = [&](c10::DeviceIndex device) {
    if (std::find(touched.begin(), touched.end(), device) == touched.end()) touched.push_back(device);
  };
  HostViews views;
  for (size_t i = first; i < stack->size(); ++i) {
    c10::IValue& value = (*stack)[i];
    if (value.isTensor()) {
      const at::Tensor& tensor = value.toTensor();
      if (on_device(tensor)) {
        if (!index) index = tensor.device().index();
        touch(tensor.device().index());
        value = views.to_host(tensor);
      }
    } else if (value.isTensorList()) {
      c10::List<at::Tensor> hosts;
      for (const at::Tensor& tensor : value.toTensorList()) {
        if (on_device(tensor)) {
          if (!index) index = tensor.device().index();
          touch(tensor.device().index());
        }
        hosts.push_back(views.to_host(tensor));
      }
      value = hosts;
    } else if (value.isOptionalTensorList()) {
      c10::List<std::optional<at::Tensor>> hosts;
      for (const std::optional<at::Tensor>& tensor : value.toOptionalTensorList()) {
        if (tensor && on_device(*tensor)) touch(tensor->device().index());
        hosts.push_back(tensor ? std::optional<at::Tensor>(views.to_host(*tensor)) : std::nullopt);
      }
      value = hosts;
    } else if (value.isDevice() && value.toDevice().type() == kDevice) {
      if (!index) index = index_of(value.toDevice());
      value = c10::Device(c10::kCPU);
    } else if (value.isStorage() && value.toStorage().device().type() == kDevice) {
      touch(value.toStorage().device().index());
      value = views.to_host(value.toStorage());
    }
  }
  // The operator runs after what its devices were told to wait for. item() reads a
  // value back to the host: a blocking D2H copy on torch_npu, counted as copies are.
  bool reads_back = schema.operator_name().name == "aten::_local_scalar_dense";
  for (auto device : touched) {
    bool queued = drain(device);
    if (reads_back) {
      ++device_counters[device].host_syncs;
      if (queued) ++device_counters[device].drains;
    }
  }
  auto target = index.value_or(current_index);
  // A random operator draws from the device's generator (random.cpp).
  std::optional<RandomDraw> random;
  if (index && draws_random_numbers(op, c10::ArrayRef<c10::IValue>(*stack).slice(first))) {
    random.emplace(op, stack, first, *index);
  }
  run(stack);
  views.write_back();
  for (size_t i = stack->size() - schema.returns().size(); i < stack->size(); ++i) {
    c10::IValue& value = (*stack)[i];
    if (value.isTensor()) {
      value = views.to_device(value.toTensor(), target);
    } else if (value.isTensorList()) {
      c10::List<at::Tensor> devices;
      for (const at::Tensor& tensor : value.toTensorList()) devices.push_back(views.to_device(tensor, target));
      value = devices;
    }
  }
  if (random) random->done(c10::ArrayRef<c10::IValue>(*stack).slice(stack->size() - schema.returns().size()));
}

// `op` as the CPU runs it, on the host arguments on `stack`.
void run_on_cpu(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  op.redispatchBoxed(c10::DispatchKeySet(c10::DispatchKey::CPU), stack);
}

// The fallback: every operator without a kernel of its own runs the CPU's.
void run_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  on_host(op, stack, [&op](torch::jit::Stack* host) { run_on_cpu(op, host); });
}

c10::OperatorHandle aten_operator(const char* name) { return c10::Dispatcher::singleton().findSchemaOrThrow(name, ""); }

// ---- convolutions -------------------------------------------------------------
//
// torch sends the convolutions of a device it has no kernels for (PrivateUse1 among
// them) to convolution_overrideable and, backward, convolution_backward_overrideable
// (ConvBackend::Overrideable in aten/src/ATen/native/Convolution.cpp), which no CPU
// kernel serves: a plugin implements them (torch_npu does, natively, with CANN's
// convolutions). The simulation computes them with the CPU's convolution on the same
// memory, as the fallback does every other operator.

// convolution_overrideable takes exactly at::convolution's arguments.
void convolution_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const c10::OperatorHandle convolution = aten_operator("aten::convolution");
  on_host(op, stack, [](torch::jit::Stack* host) { run_on_cpu(convolution, host); });
}

// convolution_backward_overrideable takes at::convolution_backward's arguments but
// the bias's sizes (the fourth), by which that sizes the bias's gradient: the bias has
// one value per output channel, grad_output's second dimension.
void convolution_backward_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  static const c10::OperatorHandle convolution_backward = aten_operator("aten::convolution_backward");
  on_host(op, stack, [&op](torch::jit::Stack* host) {
    const size_t first = host->size() - op.schema().arguments().size();
    const at::Tensor& grad_output = (*host)[first].toTensor();
    bool wants_bias = (*host)[host->size() - 1].toBoolList().get(2);
    c10::IValue bias_sizes;
    if (wants_bias) bias_sizes = std::vector<int64_t>{grad_output.size(1)};
    host->insert(host->begin() + static_cast<std::ptrdiff_t>(first + 3), std::move(bias_sizes));
    run_on_cpu(convolution_backward, host);
  });
}

// ---- attention ----------------------------------------------------------------
//
// scaled_dot_product_attention asks the device's _fused_sdp_choice_stub which kernel to
// run (aten/src/ATen/native/transformers/attention.cpp). A device without one runs the
// math (matmul, softmax, ... one by one); a plugin answers "overrideable" and implements
// _scaled_dot_product_fused_attention_overrideable and its _backward (torch's own test
// device, openreg, does). The simulated device answers as the CPU does for the same
// tensors, its fused kernel standing for the CPU's flash attention, and that kernel is the
// CPU's flash attention, run on the host: attention computes what it computes on the CPU.

// A host tensor with `tensor`'s sizes, strides, dtype and requires_grad, and no memory:
// what the CPU's choice looks at (it reads no values, and while torch.compile traces,
// the tensors have none).
at::Tensor host_for_choice(const at::Tensor& tensor) {
  if (!on_device(tensor)) return tensor;
  c10::Storage none(c10::Storage::use_byte_size_t(), 0, c10::DataPtr(nullptr, c10::Device(c10::kCPU)), nullptr, false);
  at::Tensor host = tensor_over(std::move(none), c10::DispatchKey::CPU, tensor);
  if (tensor.requires_grad()) host.requires_grad_(true);
  return host;
}

int64_t choose_attention(
    const at::Tensor& query, const at::Tensor& key, const at::Tensor& value, const std::optional<at::Tensor>& mask,
    double dropout_p, bool is_causal, std::optional<double> scale, bool enable_gqa) {
  std::optional<at::Tensor> host_mask;
  if (mask && mask->defined()) host_mask = host_for_choice(*mask);
  // Straight to the CPU's kernel: torch.compile's fake tensor mode, which would intercept
  // a call through the dispatcher, has no part in it.
  auto choice = static_cast<at::SDPBackend>(at::_ops::_fused_sdp_choice::redispatch(
      c10::DispatchKeySet(c10::DispatchKey::CPU), host_for_choice(query), host_for_choice(key),
      host_for_choice(value), host_mask, dropout_p, is_causal, scale, enable_gqa));
  return static_cast<int64_t>(choice == at::SDPBackend::flash_attention ? at::SDPBackend::overrideable : choice);
}

// _scaled_dot_product_fused_attention_overrideable(query, key, value, attn_bias, dropout_p,
// is_causal, return_debug_mask, *, scale): the CPU's flash attention gives the output and
// the logsumexp; what else a fused kernel returns (cumulative sequence lengths, its
// dropout's seed and offset, a debug mask) the CPU's has not: none, the lengths, zeros.
void attention_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  const size_t first = stack->size() - op.schema().arguments().size();
  const c10::IValue& bias = (*stack)[first + 3];
  // The CPU's flash attention has no derivative for its mask: torch refuses a mask that
  // needs a gradient there as here (the CPU never chooses it for one).
  TORCH_CHECK(!(c10::GradMode::is_enabled() && bias.isTensor() && bias.toTensor().requires_grad()),
              "the derivative for 'attn_bias' is not implemented: the simulated ",
              c10::get_privateuse1_backend(), "'s fused attention is the CPU's flash attention");
  on_host(op, stack, [](torch::jit::Stack* host) {
    auto args = torch::jit::pop(*host, 8);
    const at::Tensor& query = args[0].toTensor();
    const at::Tensor& key = args[1].toTensor();
    auto [output, logsumexp] = at::_scaled_dot_product_flash_attention_for_cpu(
        query, key, args[2].toTensor(), args[4].toDouble(), args[5].toBool(), args[3].toOptional<at::Tensor>(),
        args[7].toOptional<double>());
    torch::jit::push(*host, output, logsumexp, at::Tensor(), at::Tensor(), query.size(-2), key.size(-2),
                     at::zeros({}, at::kLong), at::zeros({}, at::kLong), at::Tensor());
  });
}

// _scaled_dot_product_fused_attention_overrideable_backward(grad_out, query, key, value,
// attn_bias, grad_input_mask, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
// is_causal, philox_seed, philox_offset, *, scale): the CPU's flash attention backward,
// which gives the query's, key's and value's gradients (none for the mask).
void attention_backward_on_host(const c10::OperatorHandle& op, torch::jit::Stack* stack) {
  on_host(op, stack, [](torch::jit::Stack* host) {
    auto args = torch::jit::pop(*host, 17);
    const at::Tensor& bias = args[4].toTensor();
    auto [grad_query, grad_key, grad_value] = at::_scaled_dot_product_flash_attention_for_cpu_backward(
        args[0].toTensor(), args[1].toTensor(), args[2].toTensor(), args[3].toTensor(), args[6].toTensor(),
        args[7].toTensor(), args[12].toDouble(), args[13].toBool(),
        bias.defined() ? std::optional<at::Tensor>(bias) : std::nullopt, args[16].toOptional<double>());
    torch::jit::push(*host, grad_query, grad_key, grad_value, at::Tensor());
  });
}

TORCH_LIBRARY_IMPL(_, PrivateUse1, m) {
  m.fallback(torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
}

TORCH_LIBRARY_IMPL(aten, PrivateUse1, m) {
  m.impl("empty.memory_format", empty_memory_format);
  m.impl("empty_strided", empty_strided);
  m.impl("copy_", copy);
  m.impl("_copy_from", copy_from);
  m.impl("_copy_from_and_resize", copy_from_and_resize);
  m.impl("_has_compatible_shallow_copy_type", has_compatible_shallow_copy_type);
  m.impl("convolution_overrideable", torch::CppFunction::makeFromBoxedFunction<&convolution_on_host>());
  m.impl("convolution_backward_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&convolution_backward_on_host>());
  m.impl("_scaled_dot_product_fused_attention_overrideable",
         torch::CppFunction::makeFromBoxedFunction<&attention_on_host>());
  m.impl("_scaled_dot_product_fused_attention_overrideable_backward",
         torch::CppFunction::makeFromBoxedFunction<&attention_backward_on_host>());
}

// Structured operators (add, mul, mse_loss, ...) fill every backend's slot with a
// composite kernel that allocates the output and calls the out= variant, and a few
// others (native_layer_norm, native_group_norm, ...) with one that decomposes them into
// other operators, whose numerics are not the CPU kernel's. A real plugin registers its
// own kernels there; this one routes those operators to the CPU's kernel through the
// fallback (one dispatch instead of three, and the CPU's numerics).
void run_on_host_for(const std::vector<std::string>& names) {
  static torch::Library library(torch::Library::IMPL, "aten", c10::DispatchKey::PrivateUse1, __FILE__, __LINE__);
  for (const auto& name : names) library.impl(name.c_str(), torch::CppFunction::makeFromBoxedFunction<&run_on_host>());
}

// Operators without an autograd kernel of their own (c10d's collectives) pass the
// device's autograd key through to its kernel, as torch 2.13 does for every
// PrivateUse1 device (VariableFallbackKernel.cpp); torch 2.9 has no such fallback, and a plugin
// registers one (torch's own test plugin, open_registration_extension.cpp, did).
void pass_autograd_through_where_torch_does_not() {
  if (c10::Dispatcher::singleton().hasBackendFallbackForDispatchKey(c10::DispatchKey::AutogradPrivateUse1)) return;
  static torch::Library library(torch::Library::IMPL, "_", c10::DispatchKey::AutogradPrivateUse1, __FILE__, __LINE__);
  library.fallback(torch::CppFunction::makeFallthrough());
}

} // namespace

void device_waits_for(c10::DeviceIndex index, CompletionPtr done) {
  stream_waits_for(index, current_stream[index], std::move(done));
}

void stream_waits_for(c10::DeviceIndex index, c10::StreamId stream, CompletionPtr done) {
  std::lock_guard<std::mutex> lock(pending_mutex);
  // What this stream waited for and has finished since goes: the next operation on the
  // stream waits for `done` (a drain, if it is a blocking copy) just the same, and a stream
  // nothing drains (one only ever told to wait) keeps no growing list.
  auto& now = pending[index];
  auto& on = pending_stream[index];
  for (size_t i = now.size(); i-- > 0;) {
    if (on[i] == stream && now[i]->finished()) {
      now.erase(now.begin() + static_cast<std::ptrdiff_t>(i));
      on.erase(on.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  pending[index].push_back(std::move(done));
  pending_stream[index].push_back(stream);
}

bool drain_stream(c10::DeviceIndex index, std::optional<c10::StreamId> stream) {
  auto waited = pending_on(index, stream);
  if (waited.empty()) return false;
  for (const auto& done : waited) done->wait();
  std::lock_guard<std::mutex> lock(pending_mutex);
  auto& now = pending[index];
  auto& on = pending_stream[index];
  for (size_t i = now.size(); i-- > 0;) {
    if (std::find(waited.begin(), waited.end(), now[i]) != waited.end()) {
      now.erase(now.begin() + static_cast<std::ptrdiff_t>(i));
      on.erase(on.begin() + static_cast<std::ptrdiff_t>(i));
    }
  }
  return true;
}

bool drain(c10::DeviceIndex index) { return drain_stream(index, current_stream[index]); }

c10::DeviceIndex current_device() { return current_index; }

RecordingWith::RecordingWith(CompletionPtr done) { recording_with = std::move(done); }
RecordingWith::~RecordingWith() { recording_with = nullptr; }

at::Tensor host_view(const at::Tensor& tensor) {
  return tensor_over(storage_over(tensor.storage(), c10::Device(c10::kCPU), c10::GetCPUAllocator()),
                     c10::DispatchKey::CPU, tensor);
}

} // namespace comm_sim

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace comm_sim;
  m.def("install", [](int count) {
    TORCH_CHECK(count > 0 && count <= kMaxDevices, "device_count must be in [1, ", kMaxDevices, "]");
    device_count = count;
    at::RegisterPrivateUse1HooksInterface(&hooks);
    at::native::_fused_sdp_choice_stub.set_privateuse1_dispatch_ptr(&choose_attention);
    pass_autograd_through_where_torch_does_not();
  });
  m.def("run_on_host_for", &run_on_host_for);
  m.def("default_generator", [](int index) -> at::Generator {
    return default_generator(checked(static_cast<c10::DeviceIndex>(index)));
  });
  m.def("device_count", []() { return device_count.load(); });
  m.def("current_device", []() { return static_cast<int>(current_index); });
  m.def("set_device", [](int index) { current_index = checked(static_cast<c10::DeviceIndex>(index)); });
  // index -1: pinned host memory.
  m.def("memory", [](int index) {
    auto& counted = index == -1 ? pinned_memory : device_memory[checked(static_cast<c10::DeviceIndex>(index))];
    return std::map<std::string, int64_t>{{"allocated", counted.allocated.load()},
                                          {"peak_allocated", counted.peak_allocated.load()},
                                          {"reserved", counted.reserved.load()},
                                          {"peak_reserved", counted.peak_reserved.load()}};
  });
  m.def("reset_peak_memory", [](int index) {
    auto& counted = index == -1 ? pinned_memory : device_memory[checked(static_cast<c10::DeviceIndex>(index))];
    counted.peak_allocated = counted.allocated.load();
    counted.peak_reserved = counted.reserved.load();
  });
  m.def("capacity", []() { return capacity.load(); });
  m.def("set_capacity", [](int64_t bytes) {
    TORCH_CHECK(bytes > 0, "capacity must be positive, got ", bytes);
    capacity = bytes;
  });
  m.def("synchronize", [](int index) {
    pybind11::gil_scoped_release released;
    host_waits(checked(static_cast<c10::DeviceIndex>(index)));
  });
  m.def("device_counters", [](int index) {
    auto& counted = device_counters[checked(static_cast<c10::DeviceIndex>(index))];
    return std::map<std::string, int64_t>{{"host_syncs", counted.host_syncs.load()},
                                          {"drains", counted.drains.load()},
                                          {"communicators", counted.communicators.load()},
                                          {"communicator_bytes", counted.communicator_bytes.load()}};
  });
  m.def("empty_cache", [](int index) {
    auto device = checked(static_cast<c10::DeviceIndex>(index));
    release_cached(static_cast<size_t>(device));
  });
  m.def("counters", []() {
    return std::map<std::string, int64_t>{{"transfers", transfers.load()}, {"collectives", collectives.load()}};
  });
  m.def("reset_counters", []() {
    transfers = 0;
    collectives = 0;
    for (auto& counted : device_counters) {
      counted.host_syncs = 0;
      counted.drains = 0;
    }
  });
  m.def("fail_next", &fail_next, pybind11::arg("mode"), pybind11::arg("calls"), pybind11::arg("after") = 0);
  m.def("make_backend", &make_backend, pybind11::arg("host"), pybind11::arg("name"),
        pybind11::arg("unsupported_ops"), pybind11::arg("lenient"), pybind11::arg("blocking_wait"));
}
