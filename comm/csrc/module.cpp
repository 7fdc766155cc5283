// The Python face of comm's native part: make a staging backend, read its counters.
#include <pybind11/chrono.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/utils/pybind.h>

#include "staging.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace comm_native;
  m.def(
      "staging_backend",
      [](int rank, int size, c10::Device target, std::optional<BackendPtr> own, std::chrono::milliseconds timeout,
         CommunicatorFactory factory, CommunicatorFactory cpuFactory, int64_t chunkBytes, int64_t budgetBytes,
         std::set<std::string> averagesIntegers) -> BackendPtr {
        return c10::make_intrusive<StagingBackend>(rank, size, target, own ? *own : BackendPtr(), std::move(factory),
                                                   std::move(cpuFactory), chunkBytes, budgetBytes, timeout,
                                                   std::move(averagesIntegers));
      },
      pybind11::arg("rank"), pybind11::arg("size"), pybind11::arg("target"), pybind11::arg("own"),
      pybind11::arg("timeout"), pybind11::arg("communicator"), pybind11::arg("cpu_communicator") = pybind11::none(),
      pybind11::arg("chunk_bytes") = 0, pybind11::arg("budget_bytes") = 0,
      pybind11::arg("averages_integers") = std::set<std::string>{},
      "A c10d Backend that stages each call onto `target` and runs it on `own` (the group's backend there) "
      "from the calling thread, on the backend `communicator(timeout)` makes from any other thread; CPU reductions "
      "of dtypes those cannot reduce run on the gloo backend `cpu_communicator(timeout)` makes. A host tensor's all-reduce "
      "of at least 2 x `chunk_bytes` runs pipelined in chunks of that size (0: never). A thread's staged collectives "
      "hold at most about `budget_bytes` of device memory at once (0: no bound). An integer ReduceOp.AVG runs "
      "where the communicator's backend is in `averages_integers`, and is refused elsewhere. `timeout`: the group's, which "
      "each factory is called with (as is a later set_timeout's).");
  m.def(
      "backend_timeout",
      [](const BackendPtr& backend) -> std::optional<std::chrono::milliseconds> {
        try {
          if (auto options = backend->getBackendOptions()) return options->timeout;
        } catch (const c10::Error&) { // c10d's Backend::getBackendOptions refuses where a backend keeps none
        }
        return std::nullopt;
      },
      "A backend's timeout as its getBackendOptions() reports it, on every torch release (Python sees that "
      "method as `options` from torch 2.14 only), or None where it keeps none.");
  m.def(
      "communicators_made",
      [](const BackendPtr& backend) -> std::map<std::string, int64_t> {
        auto* staging = dynamic_cast<StagingBackend*>(backend.get());
        if (staging == nullptr) return {};
        return staging->communicatorsMade();
      },
      "How many communicators a staging backend has made, by use: {'collectives': n, 'cpu': n}.");
  m.def(
      "adopt_thread",
      [](const BackendPtr& backend) {
        auto* staging = dynamic_cast<StagingBackend*>(backend.get());
        TORCH_CHECK(staging != nullptr, "not comm's staging backend");
        staging->adoptThread();
      },
      "Staged calls from the calling thread run on the group's own backend from now on.");
  m.def(
      "set_staging_budget",
      [](const BackendPtr& backend, int64_t bytes) {
        auto* staging = dynamic_cast<StagingBackend*>(backend.get());
        TORCH_CHECK(staging != nullptr, "not comm's staging backend");
        staging->setBudget(bytes);
      },
      "The device memory a thread's staged collectives on this backend hold at once (0: no bound).");
  m.def("staging_budget", [](const BackendPtr& backend) -> std::optional<int64_t> {
    auto* staging = dynamic_cast<StagingBackend*>(backend.get());
    if (staging == nullptr) return std::nullopt;
    return staging->budget();
  });
  m.def("staging_target", [](const BackendPtr& backend) -> std::optional<c10::Device> {
    auto* staging = dynamic_cast<StagingBackend*>(backend.get());
    if (staging == nullptr) return std::nullopt;
    return staging->target();
  });
  m.def(
      "follow_block",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, const c10::Device& device) {
        if (auto* staging = stagingBesideOwn(*group, device.type())) staging->followBlock();
      },
      "torch opened a coalescing block on `group`'s own backend for `device` from this thread: comm's calls from "
      "this thread join it.");
  m.def(
      "end_followed_block",
      [](const c10::intrusive_ptr<c10d::ProcessGroup>& group, const c10::Device& device,
         std::optional<WorkPtr> torchsWork) -> std::optional<WorkPtr> {
        auto* staging = stagingBesideOwn(*group, device.type());
        auto work = torchsWork.value_or(WorkPtr());
        if (staging != nullptr) work = staging->endFollowedBlock(std::move(work));
        if (!work) return std::nullopt;
        return work;
      },
      "The work that ends a block `follow_block` followed, given the one `group`'s own backend returned (None "
      "where it raised): it completes comm's calls in the block too.");
  m.def("route_mixed_devices", &routeMixedDevices,
        "Collectives whose tensors lie on the CPU and an accelerator stage on an equipped group's own backend.");
  m.def("tallies", []() {
    std::map<std::string, std::map<std::string, int64_t>> out;
    for (const auto& [name, t] : tallies()) {
      out[name] = {{"calls", t.calls}, {"transfers", t.transfers}, {"bytes", t.bytes}, {"nanoseconds", t.nanoseconds}};
    }
    return out;
  });
  m.def("reset_tallies", &resetTallies);
}
