// Shared between the simulated device (device.cpp) and its collective backend (backend.cpp).
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <string>

#include <ATen/ATen.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>

namespace comm_sim {

constexpr c10::DeviceType kDevice = c10::DeviceType::PrivateUse1;

// What comm.testing.counters() reports.
inline std::atomic<int64_t> transfers{0};
inline std::atomic<int64_t> collectives{0};

// A CPU tensor over the same host memory as a simulated-device tensor; it keeps the
// device tensor's storage alive for as long as it lives (a collective may outlive its
// caller's tensor). Resizing that storage while a collective runs frees the memory
// under it, as it would on a real device.
at::Tensor host_view(const at::Tensor& tensor);

// The collective backend of the simulated device: runs each collective with `host`
// (a gloo backend) on host views of the device tensors, by HCCL's rules unless `lenient`.
c10::intrusive_ptr<c10d::Backend> make_backend(
    c10::intrusive_ptr<c10d::Backend> host,
    std::string name,
    std::map<int64_t, std::string> unsupported_ops,
    bool lenient);

// The next `calls` collectives of any simulated backend fail: when issued, or on wait.
void fail_next(bool on_wait, int64_t calls);

} // namespace comm_sim
