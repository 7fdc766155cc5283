// The ACL runtime: devices, device memory, streams, events, host callbacks, and the
// initialisation queries torch_npu makes (acl_rt.h, acl_base.h, acl.h of CANN; see fake_cann.h).
#include "fake_cann.h"

#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <vector>

namespace fake_cann {

namespace {

thread_local std::string last_error;
// The latest error of any thread: HCCL's are made on a stream's worker and read by torch_npu's watchdog.
std::mutex any_error_mutex;
std::string any_error;
thread_local int thread_device = -1;

int64_t env_int(const char* name, int64_t fallback) {
  const char* value = std::getenv(name);
  return value != nullptr && *value != '\0' ? std::strtoll(value, nullptr, 10) : fallback;
}

// Device memory: host pages, counted per device against its capacity.
struct Memory {
  std::mutex mutex;
  std::map<void*, std::pair<size_t, int>> blocks;  // pointer -> (bytes, device)
  std::vector<size_t> used;
  size_t capacity = 0;
};

Memory& memory() {
  static Memory* m = [] {
    auto* made = new Memory();  // never destroyed: streams may free blocks while the process exits
    made->used.assign(device_count(), 0);
    made->capacity = static_cast<size_t>(env_int("COMM_FAKE_CANN_MEMORY", int64_t{64} << 30));
    return made;
  }();
  return *m;
}

struct Streams {
  std::mutex mutex;
  std::vector<Stream*> defaults;
  std::vector<Stream*> all;
};

Streams& streams() {
  static Streams* s = new Streams();  // never destroyed, as Memory
  return *s;
}

// An event's records are numbered; each completes when its stream reaches it. Records on
// different streams complete in any order, so a wait is for one record, the latest when the
// wait was made, not for "some record at least as new" (as a CUDA or ACL event is waited for).
struct Event {
  std::mutex mutex;
  std::condition_variable cv;
  uint64_t recorded = 0;        // the number of the latest record
  std::set<uint64_t> pending;   // records queued whose stream has not reached them
  std::chrono::steady_clock::time_point when;
  bool done(uint64_t record) const { return pending.count(record) == 0; }
};

bool event_done(Event* e) {
  std::lock_guard<std::mutex> lock(e->mutex);
  return e->done(e->recorded);
}

aclError allocate(void** pointer, size_t size) {
  int device = current_device();
  if (pointer == nullptr) return kInvalidParam;
  if (device < 0) return kContextNull;
  size = std::max<size_t>(size, 1);
  Memory& m = memory();
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    if (m.used[device] + size > m.capacity) {
      set_error("aclrtMalloc: out of device memory: " + std::to_string(size) + " bytes asked, " +
                std::to_string(m.capacity - m.used[device]) + " free of " + std::to_string(m.capacity));
      return kMemoryAllocation;
    }
    m.used[device] += size;
  }
  void* block = mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (block == MAP_FAILED) {
    std::lock_guard<std::mutex> lock(m.mutex);
    m.used[device] -= size;
    return kMemoryAllocation;
  }
  std::lock_guard<std::mutex> lock(m.mutex);
  m.blocks[block] = {size, device};
  *pointer = block;
  return kSuccess;
}

}  // namespace

void set_error(const std::string& message) {
  last_error = message;
  std::lock_guard<std::mutex> lock(any_error_mutex);
  any_error = message;
}

int device_count() {
  static int count = static_cast<int>(env_int("COMM_FAKE_CANN_DEVICES", 8));
  return count;
}

int current_device() { return thread_device; }

Stream::Stream(int device) : device_(device), worker_([this] { run(); }) {}

Stream::~Stream() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  worker_.join();
}

void Stream::enqueue(std::function<void()> task) {
  static const bool inline_mode = std::getenv("COMM_FAKE_CANN_SYNC") != nullptr;
  if (inline_mode) {  // a debugging mode: each task runs at once, on the caller's thread
    synchronize();
    task();
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    tasks_.push_back(std::move(task));
    ++queued_;
  }
  cv_.notify_all();
}

void Stream::run() {
  thread_device = device_;  // a device's work runs on that device
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    cv_.wait(lock, [this] { return stopping_ || !tasks_.empty(); });
    if (tasks_.empty()) return;
    std::function<void()> task = std::move(tasks_.front());
    tasks_.pop_front();
    lock.unlock();
    task();
    task = nullptr;  // what the task held goes before the host hears it ended
    lock.lock();
    ++done_;
    cv_.notify_all();
  }
}

bool Stream::synchronize(int64_t timeout_ms) {
  std::unique_lock<std::mutex> lock(mutex_);
  uint64_t target = queued_;
  auto reached = [&] { return done_ >= target; };
  if (timeout_ms < 0) {
    cv_.wait(lock, reached);
    return true;
  }
  return cv_.wait_for(lock, std::chrono::milliseconds(timeout_ms), reached);
}

bool Stream::idle() {
  std::lock_guard<std::mutex> lock(mutex_);
  return done_ >= queued_;
}

Stream* stream_of(void* handle) {
  if (handle != nullptr) return static_cast<Stream*>(handle);
  int device = std::max(current_device(), 0);
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.defaults.empty()) s.defaults.assign(device_count(), nullptr);
  if (s.defaults[device] == nullptr) {
    s.defaults[device] = new Stream(device);
    s.all.push_back(s.defaults[device]);
  }
  return s.defaults[device];
}

}  // namespace fake_cann

using namespace fake_cann;
using aclrtStream = void*;
using aclrtEvent = void*;
using aclrtContext = void*;

extern "C" {

// --- initialisation and queries --------------------------------------------------------------

aclError aclInit(const char*) { return kSuccess; }
aclError aclFinalize() { return kSuccess; }

const char* aclGetRecentErrMsg() {
  if (!last_error.empty()) return last_error.c_str();
  std::lock_guard<std::mutex> lock(any_error_mutex);
  last_error = any_error;  // a copy this thread owns
  return last_error.empty() ? nullptr : last_error.c_str();
}
aclError aclrtPeekAtLastError(int) { return kSuccess; }
aclError aclrtGetLastError(int) { return kSuccess; }

struct aclCANNPackageVersion {
  char version[128], major[64], minor[64], release[64], patch[64], reserved[128];
};

// The CANN release the fake says it is: 8.5.0 (COMM_FAKE_CANN_VERSION overrides, as "major.minor.release").
static const char* cann_version() {
  const char* value = std::getenv("COMM_FAKE_CANN_VERSION");
  return value != nullptr && *value != '\0' ? value : "8.5.0";
}

aclError aclsysGetCANNVersion(int, aclCANNPackageVersion* version) {
  if (version == nullptr) return kInvalidParam;
  std::memset(version, 0, sizeof(*version));
  std::string full = cann_version();
  std::snprintf(version->version, sizeof(version->version), "%s", full.c_str());
  std::string parts[3];
  size_t start = 0;
  for (int i = 0; i < 3; ++i) {
    size_t dot = full.find('.', start);
    parts[i] = full.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  std::snprintf(version->major, sizeof(version->major), "%s", parts[0].c_str());
  std::snprintf(version->minor, sizeof(version->minor), "%s", parts[1].c_str());
  std::snprintf(version->release, sizeof(version->release), "%s", parts[2].c_str());
  return kSuccess;
}

aclError aclsysGetVersionStr(char*, char* versionStr) {
  if (versionStr == nullptr) return kInvalidParam;
  std::strcpy(versionStr, cann_version());
  return kSuccess;
}

aclError aclGetCannAttribute(int, int32_t* value) {
  if (value != nullptr) *value = 0;
  return kSuccess;
}

aclError aclGetDeviceCapability(uint32_t, int, int64_t* value) {
  if (value != nullptr) *value = 0;
  return kSuccess;
}

// The SoC torch_npu identifies the part by: an Atlas A2 training card.
const char* aclrtGetSocName() { return "Ascend910B1"; }

aclError aclSetCompileopt(int, const char*) { return kSuccess; }
size_t aclGetCompileoptSize(int) { return 256; }
aclError aclGetCompileopt(int, char* value, size_t length) {
  if (value != nullptr && length > 0) value[0] = '\0';
  return kSuccess;
}

aclError aclrtGetSysParamOpt(int, int64_t* value) {
  if (value != nullptr) *value = 0;
  return kSuccess;
}
aclError aclrtSetSysParamOpt(int, int64_t) { return kSuccess; }
aclError aclrtCtxSetSysParamOpt(int, int64_t) { return kSuccess; }
aclError aclrtSetDeviceSatMode(int) { return kSuccess; }
aclError aclrtSetOpExecuteTimeOut(uint32_t) { return kSuccess; }
aclError aclrtSetOpExecuteTimeOutV2(uint64_t timeout, uint64_t* actual) {
  if (actual != nullptr) *actual = timeout;
  return kSuccess;
}
aclError aclrtSetOpWaitTimeout(uint32_t) { return kSuccess; }

// --- devices ---------------------------------------------------------------------------------

aclError aclrtGetDeviceCount(uint32_t* count) {
  if (count == nullptr) return kInvalidParam;
  *count = static_cast<uint32_t>(device_count());
  return kSuccess;
}

aclError aclrtSetDevice(int32_t device) {
  if (device < 0 || device >= device_count()) {
    set_error("aclrtSetDevice: invalid device id " + std::to_string(device));
    return kInvalidParam;
  }
  thread_device = device;
  return kSuccess;
}

aclError aclrtGetDevice(int32_t* device) {
  if (device == nullptr) return kInvalidParam;
  if (thread_device < 0) return kContextNull;
  *device = thread_device;
  return kSuccess;
}

aclError aclrtResetDevice(int32_t) { return kSuccess; }
aclError aclrtResetDeviceForce(int32_t) { return kSuccess; }

// A context is its device: the handle is the device id plus one (never null).
aclError aclrtGetCurrentContext(aclrtContext* context) {
  if (context == nullptr) return kInvalidParam;
  if (thread_device < 0) return kContextNull;
  *context = reinterpret_cast<aclrtContext>(static_cast<intptr_t>(thread_device + 1));
  return kSuccess;
}

aclError aclrtSetCurrentContext(aclrtContext context) {
  thread_device = static_cast<int>(reinterpret_cast<intptr_t>(context)) - 1;
  return kSuccess;
}

aclError aclrtDeviceCanAccessPeer(int32_t* can, int32_t, int32_t) {
  if (can != nullptr) *can = 1;
  return kSuccess;
}
aclError aclrtDeviceEnablePeerAccess(int32_t, uint32_t) { return kSuccess; }

aclError aclrtDeviceGetBareTgid(int32_t* pid) {
  if (pid != nullptr) *pid = static_cast<int32_t>(getpid());
  return kSuccess;
}

// --- memory ----------------------------------------------------------------------------------

aclError aclrtMalloc(void** pointer, size_t size, int) { return allocate(pointer, size); }
aclError aclrtMallocAlign32(void** pointer, size_t size, int) { return allocate(pointer, size); }

aclError aclrtFree(void* pointer) {
  Memory& m = memory();
  size_t size = 0;
  {
    std::lock_guard<std::mutex> lock(m.mutex);
    auto found = m.blocks.find(pointer);
    if (found == m.blocks.end()) return kInvalidParam;
    size = found->second.first;
    m.used[found->second.second] -= size;
    m.blocks.erase(found);
  }
  munmap(pointer, size);
  return kSuccess;
}

// Page-locked host memory is ordinary host memory here.
aclError aclrtMallocHost(void** pointer, size_t size) {
  if (pointer == nullptr) return kInvalidParam;
  *pointer = std::calloc(1, std::max<size_t>(size, 1));
  return *pointer == nullptr ? kMemoryAllocation : kSuccess;
}
aclError aclrtFreeHost(void* pointer) {
  std::free(pointer);
  return kSuccess;
}

aclError aclrtGetMemInfo(int, size_t* free, size_t* total) {
  int device = std::max(current_device(), 0);
  Memory& m = memory();
  std::lock_guard<std::mutex> lock(m.mutex);
  if (free != nullptr) *free = m.capacity - m.used[device];
  if (total != nullptr) *total = m.capacity;
  return kSuccess;
}

// A synchronous copy acts at once; the caller orders it against the streams (torch_npu
// synchronises the current stream before a blocking copy).
aclError aclrtMemcpy(void* dst, size_t dstMax, const void* src, size_t count, int) {
  if (count > dstMax) return kInvalidParam;
  if (count > 0) std::memmove(dst, src, count);
  return kSuccess;
}

aclError aclrtMemcpyAsync(void* dst, size_t dstMax, const void* src, size_t count, int, aclrtStream stream) {
  if (count > dstMax) return kInvalidParam;
  if (count > 0) stream_of(stream)->enqueue([dst, src, count] { std::memmove(dst, src, count); });
  return kSuccess;
}

aclError aclrtMemset(void* dst, size_t dstMax, int32_t value, size_t count) {
  if (count > dstMax) return kInvalidParam;
  std::memset(dst, value, count);
  return kSuccess;
}

aclError aclrtMemsetAsync(void* dst, size_t dstMax, int32_t value, size_t count, aclrtStream stream) {
  if (count > dstMax) return kInvalidParam;
  stream_of(stream)->enqueue([dst, value, count] { std::memset(dst, value, count); });
  return kSuccess;
}

// --- streams ---------------------------------------------------------------------------------

aclError aclrtCreateStream(aclrtStream* stream) {
  if (stream == nullptr) return kInvalidParam;
  if (current_device() < 0) return kContextNull;
  auto* made = new Stream(current_device());
  Streams& s = streams();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.all.push_back(made);
  *stream = made;
  return kSuccess;
}

aclError aclrtCreateStreamWithConfig(aclrtStream* stream, uint32_t, uint32_t) { return aclrtCreateStream(stream); }

// A stream's worker is kept for the life of the process: work torch_npu queued may still name it.
aclError aclrtDestroyStream(aclrtStream stream) {
  stream_of(stream)->synchronize();
  return kSuccess;
}
aclError aclrtDestroyStreamForce(aclrtStream) { return kSuccess; }

aclError aclrtSetStreamOverflowSwitch(aclrtStream, uint32_t) { return kSuccess; }
aclError aclrtGetStreamOverflowSwitch(aclrtStream, uint32_t* flag) {
  if (flag != nullptr) *flag = 0;
  return kSuccess;
}
aclError aclrtSetStreamFailureMode(aclrtStream, uint64_t) { return kSuccess; }

aclError aclrtSynchronizeStream(aclrtStream stream) {
  stream_of(stream)->synchronize();
  return kSuccess;
}

aclError aclrtSynchronizeStreamWithTimeout(aclrtStream stream, int32_t timeout_ms) {
  return stream_of(stream)->synchronize(timeout_ms) ? kSuccess : kStreamSyncTimeout;
}

aclError aclrtStreamQuery(aclrtStream stream, int* status) {
  // ACL_STREAM_STATUS_COMPLETE = 0, ACL_STREAM_STATUS_NOT_READY = 1
  if (status != nullptr) *status = stream_of(stream)->idle() ? 0 : 1;
  return kSuccess;
}

aclError aclrtStreamGetId(aclrtStream stream, int32_t* id) {
  if (id != nullptr) *id = static_cast<int32_t>(reinterpret_cast<uintptr_t>(stream_of(stream)) & 0x7fffffff);
  return kSuccess;
}

aclError aclrtSynchronizeDeviceWithTimeout(int32_t timeout_ms) {
  std::vector<Stream*> mine;
  {
    Streams& s = streams();
    std::lock_guard<std::mutex> lock(s.mutex);
    for (Stream* stream : s.all)
      if (stream->device() == current_device()) mine.push_back(stream);
  }
  for (Stream* stream : mine)
    if (!stream->synchronize(timeout_ms)) return kStreamSyncTimeout;
  return kSuccess;
}

aclError aclrtSynchronizeDevice() { return aclrtSynchronizeDeviceWithTimeout(-1); }

// --- events ----------------------------------------------------------------------------------

aclError aclrtCreateEvent(aclrtEvent* event) {
  if (event == nullptr) return kInvalidParam;
  *event = new Event();
  return kSuccess;
}
aclError aclrtCreateEventWithFlag(aclrtEvent* event, uint32_t) { return aclrtCreateEvent(event); }
aclError aclrtCreateEventExWithFlag(aclrtEvent* event, uint32_t) { return aclrtCreateEvent(event); }

// An event may still be queued on a stream when torch_npu destroys it; it is kept.
aclError aclrtDestroyEvent(aclrtEvent) { return kSuccess; }

aclError aclrtRecordEvent(aclrtEvent event, aclrtStream stream) {
  auto* e = static_cast<Event*>(event);
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    generation = ++e->recorded;
    e->pending.insert(generation);
  }
  stream_of(stream)->enqueue([e, generation] {
    {
      std::lock_guard<std::mutex> lock(e->mutex);
      e->pending.erase(generation);
      e->when = std::chrono::steady_clock::now();
    }
    e->cv.notify_all();
  });
  return kSuccess;
}

aclError aclrtResetEvent(aclrtEvent, aclrtStream) { return kSuccess; }

// The stream waits, on the device, for the event's latest record so far.
aclError aclrtStreamWaitEvent(aclrtStream stream, aclrtEvent event) {
  auto* e = static_cast<Event*>(event);
  uint64_t generation;
  {
    std::lock_guard<std::mutex> lock(e->mutex);
    generation = e->recorded;
  }
  stream_of(stream)->enqueue([e, generation] {
    std::unique_lock<std::mutex> lock(e->mutex);
    e->cv.wait(lock, [&] { return e->done(generation); });
  });
  return kSuccess;
}

aclError aclrtSynchronizeEvent(aclrtEvent event) {
  auto* e = static_cast<Event*>(event);
  std::unique_lock<std::mutex> lock(e->mutex);
  uint64_t generation = e->recorded;
  e->cv.wait(lock, [&] { return e->done(generation); });
  return kSuccess;
}

// ACL_EVENT_RECORDED_STATUS_NOT_READY = 0, ACL_EVENT_RECORDED_STATUS_COMPLETE = 1
aclError aclrtQueryEventStatus(aclrtEvent event, int* status) {
  if (status == nullptr) return kInvalidParam;
  *status = event_done(static_cast<Event*>(event)) ? 1 : 0;
  return kSuccess;
}

// ACL_EVENT_WAIT_STATUS_COMPLETE = 0, ACL_EVENT_WAIT_STATUS_NOT_READY = 1
aclError aclrtQueryEventWaitStatus(aclrtEvent event, int* status) {
  if (status == nullptr) return kInvalidParam;
  *status = event_done(static_cast<Event*>(event)) ? 0 : 1;
  return kSuccess;
}

aclError aclrtEventElapsedTime(float* ms, aclrtEvent start, aclrtEvent end) {
  if (ms == nullptr) return kInvalidParam;
  auto* a = static_cast<Event*>(start);
  auto* b = static_cast<Event*>(end);
  *ms = std::chrono::duration<float, std::milli>(b->when - a->when).count();
  return kSuccess;
}

aclError aclrtEventGetTimestamp(aclrtEvent event, uint64_t* timestamp) {
  if (timestamp == nullptr) return kInvalidParam;
  auto* e = static_cast<Event*>(event);
  *timestamp = static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(e->when.time_since_epoch()).count());
  return kSuccess;
}

// --- host functions on a stream --------------------------------------------------------------

using aclrtCallback = void (*)(void*);

// The callback runs on the stream's worker, in the stream's order (ACL_CALLBACK_BLOCK).
aclError aclrtLaunchCallback(aclrtCallback fn, void* data, int, aclrtStream stream) {
  stream_of(stream)->enqueue([fn, data] { fn(data); });
  return kSuccess;
}
aclError aclrtLaunchHostFunc(aclrtStream stream, aclrtCallback fn, void* data) {
  stream_of(stream)->enqueue([fn, data] { fn(data); });
  return kSuccess;
}
aclError aclrtSubscribeReport(uint64_t, aclrtStream) { return kSuccess; }
aclError aclrtUnSubscribeReport(uint64_t, aclrtStream) { return kSuccess; }

// Callbacks run on the streams' workers, so a thread that processes reports finds none.
aclError aclrtProcessReport(int32_t timeout_ms) {
  std::this_thread::sleep_for(std::chrono::milliseconds(std::max(0, std::min(timeout_ms, 100))));
  return 107031;  // ACL_ERROR_RT_REPORT_TIMEOUT
}

}  // extern "C"
