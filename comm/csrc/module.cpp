// The Python face of comm's native part: make a staging backend, read its counters.
#include <pybind11/functional.h>
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include "staging.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace comm_native;
  m.def(
      "staging_backend",
      [](int rank, int size, c10::Device target, CommunicatorFactory factory,
         CommunicatorFactory cpuFactory) -> BackendPtr {
        return c10::make_intrusive<StagingBackend>(rank, size, target, std::move(factory), std::move(cpuFactory));
      },
      pybind11::arg("rank"), pybind11::arg("size"), pybind11::arg("target"), pybind11::arg("communicator"),
      pybind11::arg("cpu_communicator") = pybind11::none(),
      "A c10d Backend that stages each call onto `target` and runs it on the backend `communicator()` makes; "
      "CPU reductions of dtypes that backend cannot reduce run on the gloo backend `cpu_communicator()` makes.");
  m.def("staging_target", [](const BackendPtr& backend) -> std::optional<c10::Device> {
    auto* staging = dynamic_cast<StagingBackend*>(backend.get());
    if (staging == nullptr) return std::nullopt;
    return staging->target();
  });
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
