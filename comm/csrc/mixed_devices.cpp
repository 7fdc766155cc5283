// Collectives whose tensors lie on two device types (an output on the accelerator
// gathered from a CPU input, as Accelerate's gather does; a CPU gather_list for an
// accelerator tensor). c10d hands such a call whole to the backend of the device that
// dispatches first, the accelerator, which may not serve the other device: nccl and
// hccl fail on the CPU tensor, and on a gloo group comm's staging backend would copy
// everything to the CPU that the call could have run there. This is comm's one stager
// for such calls, torch's own and comm's explicit ones alike. On a group comm has
// equipped, the kernel below picks the device type the group's own backend serves
// among the call's (the accelerator where both are), copies each tensor of the other
// type onto the call's device of that type, calls c10d again (which now hands the call
// to the group's own backend, as on every other rank), and writes the copies back into
// the caller's tensors when the work completes, as comm's staging backend does: one
// round trip for each tensor not on that device.
//
// c10d's schemas name what each argument is: "input..." is read, "output..." written,
// "tensors" both (in-place calls). The kernel sits on the BackendSelect key, which
// every call passes (under torch.inference_mode() too, where autograd keys are
// skipped), between autograd and c10d's kernel for the device; calls on one device
// type go straight on. It is registered once, when comm equips its first group.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include <c10/util/SmallVector.h>

#include <mutex>

#include "staging.h"

namespace comm_native {
namespace {

// The first device of each type among a call's tensors; inline for the usual one or two.
using Devices = c10::SmallVector<c10::Device, 2>;

// The device type the group's own backend serves among `devices` (the accelerator where
// it serves both), or none: the group is not equipped, or serves none of them. `staging`:
// comm's backend on the group.
std::optional<c10::Device> targetOf(c10d::ProcessGroup& group, const Devices& devices, StagingBackend*& staging) {
  staging = nullptr;
  std::optional<c10::Device> target;
  for (const auto& type : group.getDeviceTypes()) {
    if (auto* backend = dynamic_cast<StagingBackend*>(group.getBackend(type.type()).get())) {
      staging = backend;
      continue;
    }
    for (const auto& device : devices) {
      if (device.type() == type.type() && (!target || target->is_cpu())) target = device;
    }
  }
  return staging != nullptr ? target : std::nullopt;
}

void noteDevice(const at::Tensor& tensor, Devices& devices) {
  const auto device = tensor.device();
  for (const auto& seen : devices) {
    if (seen.type() == device.type()) return;
  }
  devices.push_back(device);
}

// Adds the devices of a call's argument: a tensor, a list of them, or a list of lists.
void collectDevices(const c10::IValue& value, Devices& devices) {
  if (value.isTensor()) {
    noteDevice(value.toTensor(), devices);
  } else if (value.isTensorList()) {
    for (const at::Tensor& tensor : value.toTensorList()) noteDevice(tensor, devices);
  } else if (value.isList()) {
    for (const c10::IValue& item : value.toListRef()) collectDevices(item, devices);
  }
}

// A call's tensors of other device types than the target's, replaced by copies on the target.
class Copies {
 public:
  explicit Copies(c10::Device target) : target_(target) {}

  // The argument with its other tensors replaced; `reads`/`writes`: whether the
  // collective reads the argument's data and whether its results come back.
  c10::IValue replace(const c10::IValue& value, bool reads, bool writes) {
    return mapTensors(value, [&](const at::Tensor& tensor) { return one(tensor, reads, writes); });
  }
  // Returned tensors: the caller's, where the collective ran on copies.
  c10::IValue restore(const c10::IValue& value) {
    return mapTensors(value, [this](const at::Tensor& tensor) { return callerOf(tensor); });
  }

  // Counts the call and its copies in, under `name`, once the collective has been issued.
  void issued(const std::string& name) {
    copied_.calls = 1;
    tally(name, copied_);
  }

  std::shared_ptr<WriteBack> writeBack(const std::string& name) {
    std::string what = c10::str("comm staged ", name, ": the tensors not on ", target_.str(),
                                "; the caller's tensors were not written");
    Tensors held;
    for (const auto& copy : callers_) {
      if (!copy.first.device().is_cpu()) held.push_back(copy.first);
    }
    return std::make_shared<WriteBack>(name, [what = std::move(what)] { return what; }, std::move(pieces_),
                                       std::move(written_), 1, std::move(held));
  }

 private:
  // `value` with each tensor (alone, in a list, or in a list of lists) replaced by `change(tensor)`.
  template <typename F>
  static c10::IValue mapTensors(const c10::IValue& value, F&& change) {
    if (value.isTensor()) return change(value.toTensor());
    if (value.isTensorList()) {
      c10::List<at::Tensor> list;
      for (const at::Tensor& tensor : value.toTensorList()) list.push_back(change(tensor));
      return list;
    }
    if (value.isList() && !value.toListRef().empty() && value.toListRef().front().isTensorList()) {
      c10::List<c10::List<at::Tensor>> lists;
      for (const c10::IValue& item : value.toListRef()) lists.push_back(mapTensors(item, change).toTensorList());
      return lists;
    }
    return value;
  }
  at::Tensor one(const at::Tensor& tensor, bool reads, bool writes) {
    if (tensor.device().type() == target_.type()) return tensor;
    at::AutoDispatchBelowADInplaceOrView belowAutograd; // as torch's backends write
    auto start = nowNs();
    // Contiguous, as copyOnto's copies are: HCCL and NCCL refuse a tensor that is not dense
    // (a transposed view), and read and write in memory order, which for a contiguous
    // buffer is the logical order; the write-back copies into the caller's layout.
    auto staged = reads ? copyOnto(tensor, target_)
                        : at::empty_like(tensor, tensor.options().device(target_), at::MemoryFormat::Contiguous);
    if (reads) {
      copied_.nanoseconds += nowNs() - start;
      copied_.transfers += 1;
      copied_.bytes += static_cast<int64_t>(tensor.nbytes());
    }
    if (writes) {
      pieces_.push_back(Piece{{tensor}, staged, reads});
      written_.push_back(tensor);
    }
    callers_.emplace_back(staged, tensor);
    return staged;
  }
  at::Tensor callerOf(const at::Tensor& tensor) const {
    for (const auto& [staged, caller] : callers_) {
      if (staged.is_same(tensor)) return caller;
    }
    return tensor;
  }

  c10::Device target_;
  Tally copied_;
  std::vector<Piece> pieces_;
  Tensors written_;
  std::vector<std::pair<at::Tensor, at::Tensor>> callers_;
};

void routeByDevices(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  auto first = stack->size() - arguments.size();
  Devices devices;
  std::optional<size_t> groupAt;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto& value = (*stack)[first + i];
    if (!value.isObject()) { // a tag test: the group is a torchbind object, the tensors are not
      collectDevices(value, devices);
    } else if (arguments[i].name() == "process_group") {
      groupAt = i;
    }
  }
  auto below = keys & c10::DispatchKeySet(c10::DispatchKeySet::FULL_AFTER, c10::DispatchKey::BackendSelect);
  if (devices.size() < 2 || !groupAt) return op.redispatchBoxed(below, stack);
  auto group = (*stack)[first + *groupAt].toCustomClass<c10d::ProcessGroup>();
  StagingBackend* staging = nullptr;
  auto target = targetOf(*group, devices, staging);
  if (!target) return op.redispatchBoxed(below, stack);
  Copies copies(*target);
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto& name = arguments[i].name();
    bool output = name.rfind("output", 0) == 0;
    bool input = name.rfind("input", 0) == 0;
    (*stack)[first + i] = copies.replace((*stack)[first + i], /*reads=*/!output, /*writes=*/!input);
  }
  // comm.stats() names it after c10d's operator: "c10d::_allgather_base_ (mixed devices)".
  auto name = schema.name() + " (mixed devices)";
  auto back = copies.writeBack(name);
  // From the top: the call's tensors now lie on one device type, whose kernel c10d picks.
  op.callBoxed(stack);
  copies.issued(name);
  for (auto i = stack->size() - schema.returns().size(); i < stack->size(); ++i) {
    auto& value = (*stack)[i];
    if (value.isCustomClass()) {
      auto work = value.toCustomClass<c10d::Work>();
      // Inside the thread's coalescing block the call is the block's, as the staging
      // backend's calls are (StagingBackend::stage): the block's work completes it.
      WorkPtr staged = doneWork();
      if (!staging->block().join(work, back)) {
        staged = c10::make_intrusive<StagedWork>(std::vector<WorkPtr>{work},
                                                 std::vector<std::shared_ptr<WriteBack>>{back},
                                                 work->retrieveOpType());
      }
      value = c10::IValue(staged); // as a c10d Work, the class torch registered
    } else {
      value = copies.restore(value);
    }
  }
}

} // namespace

// Puts routeByDevices in front of c10d's device kernels of every c10d operator that has one.
void routeMixedDevices() {
  static std::once_flag once;
  std::call_once(once, []() {
    static torch::Library library(torch::Library::IMPL, "c10d", c10::DispatchKey::BackendSelect, __FILE__, __LINE__);
    auto& dispatcher = c10::Dispatcher::singleton();
    for (const auto& name : dispatcher.getAllOpNames()) {
      if (name.name.rfind("c10d::", 0) != 0) continue;
      auto handle = dispatcher.findOp(name);
      if (!handle || !handle->hasKernelForDispatchKey(c10::DispatchKey::CPU)) continue;
      auto op = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
      library.impl(op.c_str(), torch::CppFunction::makeFromBoxedFunction<&routeByDevices>());
    }
  });
}

} // namespace comm_native
