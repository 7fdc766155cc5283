// Random numbers on the simulated device: torch.Generator("npu"), the devices' default
// generators, and what a random operator's CPU kernel draws from.
//
// torch_npu's generator (NPUGeneratorImpl, Ascend/pytorch master 9e73e708
// torch_npu/csrc/aten/NPUGeneratorImpl.cpp) is a Philox generator: its state is a seed
// and an offset, 16 bytes (get_state/set_state, :373-440; 8 bytes set the seed alone),
// each random kernel draws the numbers at (seed, offset) and moves the offset past them.
// The simulated generator keeps that state, and a random operator's CPU kernel draws
// from a CPU generator seeded from (seed, offset): the seed itself at offset 0, so a
// device seeded as the CPU is draws the CPU's numbers in its first operator. The offset
// then advances by the numbers the operator made, rounded up to a multiple of 4 as
// Philox offsets are. The same state gives the same numbers (DTensor's random tracker,
// activation checkpointing's replay), another offset others.
#include <array>
#include <cstring>
#include <mutex>
#include <optional>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <c10/core/GeneratorImpl.h>

#include "simulated.h"

namespace comm_sim {
namespace {

constexpr uint64_t kGolden = 0x9E3779B97F4A7C15ULL;

// splitmix64's finaliser: spreads (seed, offset) over the CPU generator's seeds.
uint64_t mixed(uint64_t value) {
  value = (value ^ (value >> 30)) * 0xBF58476D1CE4E5B9ULL;
  value = (value ^ (value >> 27)) * 0x94D049BB133111EBULL;
  return value ^ (value >> 31);
}

struct SimGenerator final : c10::GeneratorImpl {
  explicit SimGenerator(c10::DeviceIndex index)
      : c10::GeneratorImpl(c10::Device(kDevice, index), c10::DispatchKeySet(c10::DispatchKey::PrivateUse1)) {}

  void set_current_seed(uint64_t seed) override {
    seed_ = seed;
    offset_ = 0;
  }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override {
    auto chosen = c10::detail::getNonDeterministicRandom(true);
    set_current_seed(chosen);
    return chosen;
  }

  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    at::Tensor state = at::empty({16}, at::kByte);
    auto offset = static_cast<int64_t>(offset_);
    std::memcpy(state.data_ptr(), &seed_, 8);
    std::memcpy(static_cast<uint8_t*>(state.data_ptr()) + 8, &offset, 8);
    return state.getIntrusivePtr();
  }

  void set_state(const c10::TensorImpl& state) override {
    at::detail::check_rng_state(state);
    auto size = state.numel();
    TORCH_CHECK(size == 16 || size == 8, "RNG state is wrong size: the simulated ", c10::get_privateuse1_backend(),
                "'s is 16 bytes (seed, offset), or 8 (the seed), as torch_npu's, got ", size);
    const auto* bytes = static_cast<const uint8_t*>(state.data());
    int64_t offset = 0;
    std::memcpy(&seed_, bytes, 8);
    if (size == 16) std::memcpy(&offset, bytes + 8, 8);
    offset_ = static_cast<uint64_t>(offset);
    // Also the CPU's generator, from the same (seed, offset): DTensor's random tracker sets
    // the device's state inside torch.random.fork_rng, which restores the CPU's afterwards,
    // so the CPU-offloaded shards it initialises (torchtitan with CPU offload) would draw
    // the same numbers every time, and a rejection sampler (nn.init.trunc_normal_) would
    // never end. Where real torch_npu's offloaded shards draw from is not established.
    auto cpu = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(cpu.mutex());
    cpu.set_current_seed(stream());
  }

  // The seed of the CPU generator the next random operator draws from.
  uint64_t stream() const { return offset_ == 0 ? seed_ : mixed(seed_ ^ (offset_ * kGolden)); }

  // Past `drawn` numbers, rounded up to a multiple of 4 (at least 4).
  void advance(uint64_t drawn) { offset_ += std::max<uint64_t>(4, (drawn + 3) / 4 * 4); }

 private:
  SimGenerator* clone_impl() const override {
    auto* copy = new SimGenerator(device_.index());
    copy->seed_ = seed_;
    copy->offset_ = offset_;
    return copy;
  }

  uint64_t seed_ = c10::default_rng_seed_val;
  uint64_t offset_ = 0;
};

std::mutex defaults_mutex;
std::array<std::optional<at::Generator>, kMaxDevices> defaults;

// The tensors among `values` and how many numbers they hold.
uint64_t numbers_in(c10::ArrayRef<c10::IValue> values) {
  uint64_t count = 0;
  for (const auto& value : values) {
    if (value.isTensor()) {
      count += static_cast<uint64_t>(value.toTensor().numel());
    } else if (value.isTensorList()) {
      for (const at::Tensor& tensor : value.toTensorList()) count += static_cast<uint64_t>(tensor.numel());
    }
  }
  return count;
}

bool is_generator_slot(const c10::Argument& argument) {
  auto type = argument.type();
  if (auto optional = type->cast<c10::OptionalType>()) type = optional->getElementType();
  return type->kind() == c10::TypeKind::GeneratorType;
}

} // namespace

const at::Generator& default_generator(c10::DeviceIndex index) {
  std::lock_guard<std::mutex> lock(defaults_mutex);
  auto& made = defaults.at(static_cast<size_t>(index));
  if (!made) made = at::make_generator<SimGenerator>(index);
  return *made;
}

at::Generator new_generator(c10::DeviceIndex index) { return at::make_generator<SimGenerator>(index); }

bool draws_random_numbers(const c10::OperatorHandle& op, c10::ArrayRef<c10::IValue> arguments) {
  if (op.hasTag(at::Tag::nondeterministic_seeded)) return true;
  return std::any_of(arguments.begin(), arguments.end(), [](const c10::IValue& value) { return value.isGenerator(); });
}

RandomDraw::RandomDraw(const c10::OperatorHandle& op, torch::jit::Stack* stack, size_t first, c10::DeviceIndex index) {
  const auto& arguments = op.schema().arguments();
  std::optional<size_t> slot;
  for (size_t i = 0; i < arguments.size(); ++i) {
    if (is_generator_slot(arguments[i])) slot = first + i;
  }
  at::Generator chosen = default_generator(index);
  if (slot && (*stack)[*slot].isGenerator()) {
    chosen = (*stack)[*slot].toGenerator();
    TORCH_CHECK(chosen.device().type() == kDevice, "Expected a '", c10::get_privateuse1_backend(),
                "' device type for generator but found '", chosen.device().type(), "'");
  }
  generator_ = chosen;
  uint64_t seed = 0;
  {
    std::lock_guard<std::mutex> lock(chosen.mutex());
    seed = chosen.get<SimGenerator>()->stream();
  }
  if (slot) {
    (*stack)[*slot] = at::detail::createCPUGenerator(seed);
    return;
  }
  // A kernel that draws from the CPU's default generator itself (native_dropout's): that
  // generator draws this operator's numbers, and is put back as it was afterwards.
  // Another thread drawing on the CPU meanwhile would draw from the device's stream.
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  saved_cpu_state_ = cpu.get_state();
  std::lock_guard<std::mutex> lock(cpu.mutex());
  cpu.set_current_seed(seed);
}

void RandomDraw::done(c10::ArrayRef<c10::IValue> results) {
  std::lock_guard<std::mutex> lock(generator_.mutex());
  generator_.get<SimGenerator>()->advance(numbers_in(results));
}

RandomDraw::~RandomDraw() {
  if (!saved_cpu_state_.defined()) return;
  at::Generator cpu = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(cpu.mutex());
  cpu.set_state(saved_cpu_state_);
}

} // namespace comm_sim
