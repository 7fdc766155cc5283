// Collectives whose tensors lie on two device types (an output on the accelerator
// gathered from a CPU input, as Accelerate's gather does; a CPU gather_list for an
// accelerator tensor). c10d hands such a call to the backend of the device that
// dispatches first, the accelerator, whose backend (nccl, hccl) serves only its own
// device and fails on the CPU tensor. On a group comm has equipped, the kernel below
// copies each tensor of another device type onto the call's accelerator device, runs
// c10d's own kernel (the group's own backend, as on every other rank, whose tensors
// may all lie on the accelerator), and writes the copies back into the caller's
// tensors when the work completes, as comm's staging backend does.
//
// c10d's schemas name what each argument is: "input..." is read, "output..." written,
// "tensors" both (in-place calls). The kernel sits on the accelerator's autograd key,
// in front of c10d's kernel (c10d's collectives have no autograd kernel of their own);
// calls on one device type go straight on. Under torch.inference_mode() autograd keys
// are skipped, so there mixed-device calls fail as without comm.
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/library.h>

#include <mutex>

#include "staging.h"

namespace comm_native {
namespace {

bool isEquipped(c10d::ProcessGroup& group) {
  for (const auto& device : group.getDeviceTypes()) {
    if (dynamic_cast<StagingBackend*>(group.getBackend(device.type()).get()) != nullptr) return true;
  }
  return false;
}

// A call's tensors of other device types than `served`, replaced by copies on the
// call's device of type `served`.
class Copies {
 public:
  explicit Copies(c10::DeviceType served) : served_(served) {}

  // Scans one argument: whether it holds tensors of `served` and of other types.
  void scan(const c10::IValue& value) {
    forEachTensor(value, [this](const at::Tensor& tensor) {
      if (tensor.device().type() == served_) {
        if (!target_) target_ = tensor.device();
      } else {
        foreign_ = true;
      }
    });
  }
  bool mixed() const { return target_.has_value() && foreign_; }

  // The argument with its foreign tensors replaced; `reads`/`writes`: whether the
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
    std::string what = c10::str("comm staged ", name, ": the tensors not on ", target_->str(),
                                "; the caller's tensors were not written");
    return std::make_shared<WriteBack>(name, [what = std::move(what)] { return what; }, std::move(pieces_),
                                       std::move(written_), 1);
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
  template <typename F>
  static void forEachTensor(const c10::IValue& value, F&& visit) {
    if (value.isTensor()) {
      visit(value.toTensor());
    } else if (value.isTensorList()) {
      for (const at::Tensor& tensor : value.toTensorList()) visit(tensor);
    } else if (value.isList()) {
      for (const c10::IValue& item : value.toListRef()) forEachTensor(item, visit);
    }
  }
  at::Tensor one(const at::Tensor& tensor, bool reads, bool writes) {
    if (tensor.device().type() == served_) return tensor;
    at::AutoDispatchBelowADInplaceOrView belowAutograd; // as torch's backends write
    auto start = nowNs();
    auto staged = reads ? copyOnto(tensor, *target_)
                        : at::empty_like(tensor, tensor.options().device(*target_));
    if (reads) {
      copied_.nanoseconds += nowNs() - start;
      copied_.transfers += 1;
      copied_.bytes += static_cast<int64_t>(tensor.nbytes());
    }
    if (writes) {
      pieces_.push_back(Piece{{tensor}, staged});
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

  c10::DeviceType served_;
  Tally copied_;
  std::optional<c10::Device> target_;
  bool foreign_ = false;
  std::vector<Piece> pieces_;
  Tensors written_;
  std::vector<std::pair<at::Tensor, at::Tensor>> callers_;
};

template <c10::DeviceType Served>
void routeByDevices(const c10::OperatorHandle& op, c10::DispatchKeySet keys, torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& arguments = schema.arguments();
  auto first = stack->size() - arguments.size();
  Copies copies(Served);
  c10::intrusive_ptr<c10d::ProcessGroup> group;
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto& value = (*stack)[first + i];
    if (arguments[i].name() == "process_group") {
      group = value.toCustomClass<c10d::ProcessGroup>();
    } else {
      copies.scan(value);
    }
  }
  auto below = keys & c10::after_autograd_keyset;
  if (!group || !copies.mixed() || !isEquipped(*group)) return op.redispatchBoxed(below, stack);
  for (size_t i = 0; i < arguments.size(); ++i) {
    const auto& name = arguments[i].name();
    bool output = name.rfind("output", 0) == 0;
    bool input = name.rfind("input", 0) == 0;
    (*stack)[first + i] = copies.replace((*stack)[first + i], /*reads=*/!output, /*writes=*/!input);
  }
  // comm.stats() names it after c10d's operator: "c10d::_allgather_base_ (mixed devices)".
  auto name = schema.name() + " (mixed devices)";
  auto back = copies.writeBack(name);
  op.redispatchBoxed(below, stack);
  copies.issued(name);
  for (auto i = stack->size() - schema.returns().size(); i < stack->size(); ++i) {
    auto& value = (*stack)[i];
    if (value.isCustomClass()) {
      auto work = value.toCustomClass<c10d::Work>();
      auto type = work->retrieveOpType();
      WorkPtr staged = c10::make_intrusive<StagedWork>(std::vector<WorkPtr>{work},
                                                       std::vector<std::shared_ptr<WriteBack>>{back}, type);
      value = c10::IValue(staged); // as a c10d Work, the class torch registered
    } else {
      value = copies.restore(value);
    }
  }
}

// Puts routeByDevices in front of c10d's kernel for `device` of every c10d operator that has one.
template <c10::DeviceType Served>
void route(c10::DispatchKey autograd, c10::DispatchKey device) {
  static torch::Library library(torch::Library::IMPL, "c10d", autograd, __FILE__, __LINE__);
  auto& dispatcher = c10::Dispatcher::singleton();
  for (const auto& name : dispatcher.getAllOpNames()) {
    if (name.name.rfind("c10d::", 0) != 0) continue;
    auto handle = dispatcher.findOp(name);
    if (!handle || !handle->hasKernelForDispatchKey(device)) continue;
    auto op = name.name.substr(6) + (name.overload_name.empty() ? "" : "." + name.overload_name);
    library.impl(op.c_str(), torch::CppFunction::makeFromBoxedFunction<&routeByDevices<Served>>());
  }
}

} // namespace

void routeMixedDevices() {
  static std::once_flag once;
  std::call_once(once, []() {
    route<c10::DeviceType::PrivateUse1>(c10::DispatchKey::AutogradPrivateUse1, c10::DispatchKey::PrivateUse1);
    route<c10::DeviceType::CUDA>(c10::DispatchKey::AutogradCUDA, c10::DispatchKey::CUDA);
  });
}

} // namespace comm_native
