// A fake of Huawei CANN's runtime (ACL), collective library (HCCL) and operator library
// (aclnn), written here so that the real torch_npu wheel runs on a machine without an Ascend
// device. Device memory is host memory; each stream is a worker thread that runs what was
// queued on it in order; HCCL's ranks are processes that meet in POSIX shared memory; aclnn's
// operators run libtorch's CPU kernels on the device memory.
//
// Only the names, signatures and documented behaviour of CANN's C API come from outside, from
// the headers torch_npu builds against (Ascend/pytorch, third_party/acl/inc/acl/acl_rt.h,
// acl_base.h, third_party/hccl/inc/hccl/hccl.h and hccl_types.h at commit
// 00ac88a97ec19e837903fc2276efd6b3b7eb87af) and from op-plugin's calls of each operator.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include <c10/core/ScalarType.h>

namespace fake_cann {

using aclError = int;
// Return codes (acl_base.h and error_codes/rt_error_codes.h).
constexpr aclError kSuccess = 0;
constexpr aclError kInvalidParam = 100000;
constexpr aclError kContextNull = 107002;           // ACL_ERROR_RT_CONTEXT_NULL: no device set on this thread
constexpr aclError kStreamSyncTimeout = 107034;     // ACL_ERROR_RT_STREAM_SYNC_TIMEOUT
constexpr aclError kFeatureNotSupport = 207000;     // ACL_ERROR_RT_FEATURE_NOT_SUPPORT
constexpr aclError kMemoryAllocation = 207001;      // ACL_ERROR_RT_MEMORY_ALLOCATION: out of device memory
constexpr aclError kAclnnInner = 561000;            // ACLNN_ERR_INNER: an operator this fake has no body for

// The last error a call on this thread made, with its text (aclGetRecentErrMsg).
void set_error(const std::string& message);

// How many devices the fake has (COMM_FAKE_CANN_DEVICES, default 8) and each one's memory
// (COMM_FAKE_CANN_MEMORY in bytes, default 64 GiB as an Atlas 800T A2's 910B card).
int device_count();

// A stream: a worker thread that runs its tasks in the order they were queued, as a device
// stream runs kernels. A task that fails marks the stream failed; later tasks still run.
class Stream {
 public:
  explicit Stream(int device);
  ~Stream();
  int device() const { return device_; }
  void enqueue(std::function<void()> task);
  // Blocks the host until every task queued so far has run; false when timeout_ms (>= 0) passed first.
  bool synchronize(int64_t timeout_ms = -1);
  bool idle();

 private:
  void run();
  const int device_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  uint64_t queued_ = 0, done_ = 0;
  bool stopping_ = false;
  std::thread worker_;
};

// torch's dtype for an aclDataType (acl_base.h); an error for one torch has no dtype for (aclnn.cpp).
c10::ScalarType to_scalar_type(int type);

// The stream a call names: nullptr is the current device's default stream.
Stream* stream_of(void* handle);
// The current device of the calling thread, or -1 when it set none.
int current_device();

}  // namespace fake_cann
