// The C++ half of the simulated GPU (bpt.gpusim): lets a CPU-only libtorch run FakeTensorMode tensors on
// device "cuda" through forward AND backward. It computes nothing and allocates nothing; only fake tensors
// ever carry the device. Three registrations, each answering a question the CPU build cannot:
//   1. a do-nothing DeviceGuardImpl for CUDA: autograd records the current stream of every CUDA input, and
//      .to("cuda") resolves the current device through the guard (without it the process aborts with
//      "PyTorch is not linked with support for cuda devices");
//   2. CUDA hooks reporting CUDA as built and present, so the autograd engine's accelerator is CUDA
//      (without: "Cannot access accelerator device when none is available");
//   3. CUDA generators that keep only a seed and an offset (torch.Generator("cuda"), dropout under fake mode
//      draws nothing).
// torch.cuda.is_available() stays False: Python asks torch._C._cuda_getDeviceCount, which this does not add.
// The hooks are read once per process, so the library must be loaded before torch is imported
// (bpt.gpusim.shim.boot_command). Static initialisers do the registering.
#include <ATen/core/Generator.h>
#include <ATen/detail/CUDAHooksInterface.h>
#include <c10/core/GeneratorImpl.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>

namespace {
using c10::Device;
using c10::DeviceIndex;
using c10::DeviceType;
using c10::Stream;

struct GuardImpl final : public c10::impl::DeviceGuardImplInterface {
  DeviceType type() const override { return DeviceType::CUDA; }
  Device exchangeDevice(Device d) const override {
    Device previous = getDevice();
    index_ = d.index();
    return previous;
  }
  Device getDevice() const override { return Device(DeviceType::CUDA, index_); }
  void setDevice(Device d) const override { index_ = d.index(); }
  void uncheckedSetDevice(Device d) const noexcept override { index_ = d.index(); }
  Stream getStream(Device d) const noexcept override { return Stream(Stream::DEFAULT, d); }
  Stream getDefaultStream(Device d) const override { return Stream(Stream::DEFAULT, d); }
  Stream exchangeStream(Stream s) const noexcept override { return Stream(Stream::DEFAULT, s.device()); }
  DeviceIndex deviceCount() const noexcept override { return 1; }
  void record(void**, const Stream&, const DeviceIndex, const c10::EventFlag) const override {}
  void block(void*, const Stream&) const override {}
  bool queryEvent(void*) const override { return true; }
  void destroyEvent(void*, const DeviceIndex) const noexcept override {}
  bool queryStream(const Stream&) const override { return true; }
  void synchronizeStream(const Stream&) const override {}
  void synchronizeDevice(const DeviceIndex) const override {}

 private:
  static thread_local DeviceIndex index_;
};
thread_local DeviceIndex GuardImpl::index_ = 0;

struct SeedOnlyGenerator final : public c10::GeneratorImpl {
  explicit SeedOnlyGenerator(DeviceIndex index)
      : c10::GeneratorImpl(Device(DeviceType::CUDA, index), c10::DispatchKeySet(c10::DispatchKey::CUDA)) {}
  void set_current_seed(uint64_t seed) override { seed_ = seed; offset_ = 0; }
  uint64_t current_seed() const override { return seed_; }
  uint64_t seed() override { return seed_; }
  void set_offset(uint64_t offset) override { offset_ = offset; }
  uint64_t get_offset() const override { return offset_; }
  void set_state(const c10::TensorImpl&) override {}
  c10::intrusive_ptr<c10::TensorImpl> get_state() const override {
    TORCH_CHECK(false, "simulated CUDA generator has no state (bpt.gpusim stubs torch.cuda.get_rng_state)");
  }
  SeedOnlyGenerator* clone_impl() const override {
    auto copy = new SeedOnlyGenerator(device().index());
    copy->seed_ = seed_;
    copy->offset_ = offset_;
    return copy;
  }

 private:
  uint64_t seed_ = 0;
  uint64_t offset_ = 0;
};

struct Hooks final : public at::CUDAHooksInterface {
  explicit Hooks(at::CUDAHooksArgs) {}
  void init() const override {}
  bool hasCUDA() const override { return true; }
  bool isBuilt() const override { return true; }
  bool hasPrimaryContext(DeviceIndex) const override { return true; }
  DeviceIndex deviceCount() const override { return 1; }
  int getNumGPUs() const override { return 1; }
  DeviceIndex getCurrentDevice() const override { return 0; }
  DeviceIndex current_device() const override { return 0; }
  const at::Generator& getDefaultGenerator(DeviceIndex = -1) const override {
    static at::Generator generator = at::make_generator<SeedOnlyGenerator>(0);
    return generator;
  }
  at::Generator getNewGenerator(DeviceIndex index = -1) const override {
    return at::make_generator<SeedOnlyGenerator>(index < 0 ? 0 : index);
  }
};

struct RegisterGuard {
  RegisterGuard() {
    if (!c10::impl::hasDeviceGuardImpl(DeviceType::CUDA)) {
      c10::impl::registerDeviceGuard(DeviceType::CUDA, new GuardImpl());
    }
  }
} register_guard;
}  // namespace

namespace at {
C10_REGISTER_TYPED_CLASS(CUDAHooksRegistry, "CUDAHooks", Hooks)
}  // namespace at

// For bpt.gpusim.shim.active(): 1 when this process runs with the simulated device.
extern "C" int bpt_gpusim_active() {
  return c10::impl::hasDeviceGuardImpl(c10::DeviceType::CUDA) && at::detail::getCUDAHooks().hasCUDA() ? 1 : 0;
}
