// nanscan's one door into torch: PyTorch's stable C ABI (torch/csrc/stable, the aoti_torch_* and
// torch_* C functions), targeted at torch 2.10 (TORCH_TARGET_VERSION, set by setup.py), so that one
// build loads into every torch from 2.10 on. Nothing here or in any file of the library includes an
// ATen or c10 header (those headers refuse to compile with TORCH_TARGET_VERSION set), and
// tests/test_build.py checks that the built libraries import no C++ symbol of torch.
//
// Why raw handles, not torch::stable::Tensor, for tensor lists: a stable kernel is always called
// boxed, and torch::stable's own unboxing wraps each element of a Tensor[] in a shared_ptr (a heap
// block per tensor). Reading the list's handles directly halves the per-tensor cost of crossing
// the ABI (benchmarks/NOTES.md entry 37: 186 -> 156 ns a tensor with eight metadata reads, from
// Python, on the CPU), which matters for a scan of 10,000 one-element gradients.
#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/stable/c/shim.h>
#include <torch/csrc/stable/stableivalue_conversions.h>
#include <torch/csrc/stable/tensor.h>

#include <cstdint>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/scan_rules.h"

namespace nanscan {

// ---- errors -------------------------------------------------------------------------------------

// Raised to Python as RuntimeError with exactly this text (torch's STD_TORCH_CHECK would prefix the
// C++ function, file and line, which users need not read).
[[noreturn]] inline void fail(const std::string& message) { throw std::runtime_error(message); }

template <class... Parts>
std::string concat(const Parts&... parts) {
  std::ostringstream out;
  (out << ... << parts);
  return out.str();
}

#define NANSCAN_CHECK(cond, ...)                                  \
  do {                                                            \
    if (!(cond)) ::nanscan::fail(::nanscan::concat(__VA_ARGS__)); \
  } while (0)

// A shim call that cannot fail on valid handles; a failure is torch's, reported with the call.
void check_shim(AOTITorchError err, const char* call);
#define NANSCAN_SHIM(call) ::nanscan::check_shim((call), #call)

// ---- dtypes, devices, layouts -------------------------------------------------------------------

// torch's dtype codes as the shim numbers them, read once (they are libtorch's, not fixed here).
struct DTypeCodes {
  int32_t float32, float64, float16, bfloat16, float8_e4m3fn, float8_e5m2;
  int32_t boolean, uint8, int8, int16, int32, int64;
};
const DTypeCodes& dtype_codes();

// nanscan's tag of a dtype code, for the dtypes the scan reads.
std::optional<DType> dtype_tag(int32_t code);
int32_t dtype_code(DType tag);

// torch's name of a dtype code ("Float", "Long", "ComplexFloat", as torch's messages print them).
std::string dtype_name(int32_t code);
// "cpu", "cuda:0", "meta": as torch prints a device.
std::string device_name(int32_t device_type, int32_t device_index);
// "Strided", "Sparse", "SparseCsr", ...: as torch prints a layout.
std::string layout_name(int32_t layout);
// "[2, 3]"
std::string shape_string(const int64_t* sizes, int64_t dim);

// ---- tensors ------------------------------------------------------------------------------------

// Whether the elements fill one contiguous span of memory in some order of the dimensions (torch's
// is_non_overlapping_and_dense, written again: the stable ABI has no call for it).
bool is_non_overlapping_and_dense(const int64_t* sizes, const int64_t* strides, int64_t dim);

// Whether the elements lie in row-major order with no gaps (torch's is_contiguous()).
bool is_contiguous(const int64_t* sizes, const int64_t* strides, int64_t dim);

// A tensor's metadata, read through the shim once: every later read is a field. Borrowed pointers
// (sizes, strides) stay valid while the tensor's handle lives. Sizes, strides, numel and data are read
// for strided tensors only (null and 0 otherwise: a sparse tensor has no strides, a nested one no
// sizes), so every check reads them after it has checked strided().
struct TensorInfo {
  AtenTensorHandle handle = nullptr;
  bool defined = false;
  int32_t dtype = -1;
  int32_t device_type = -1;
  int32_t device_index = -1;
  int32_t layout = -1;
  int64_t dim = 0;
  int64_t numel = 0;
  const int64_t* sizes = nullptr;
  const int64_t* strides = nullptr;
  void* data = nullptr;
  // The elements fill one span of memory in some order of the dimensions (is_non_overlapping_and_dense):
  // worked out once here, where the validation, the multiply and the kernels each ask.
  bool dense = false;

  static TensorInfo of(AtenTensorHandle handle);
  bool strided() const;
  bool same_device(const TensorInfo& other) const {
    return device_type == other.device_type && device_index == other.device_index;
  }
  std::string device() const { return device_name(device_type, device_index); }
  int64_t size(int64_t d) const { return sizes[d]; }
};

inline bool is_contiguous(const TensorInfo& t) { return is_contiguous(t.sizes, t.strides, t.dim); }

// One owned tensor handle (an argument taken from the dispatcher's stack, or a tensor made here).
class OwnedTensor {
 public:
  OwnedTensor() = default;
  explicit OwnedTensor(AtenTensorHandle handle) : handle_(handle) {}
  OwnedTensor(OwnedTensor&& other) noexcept : handle_(std::exchange(other.handle_, nullptr)) {}
  OwnedTensor& operator=(OwnedTensor&& other) noexcept {
    std::swap(handle_, other.handle_);
    return *this;
  }
  OwnedTensor(const OwnedTensor&) = delete;
  OwnedTensor& operator=(const OwnedTensor&) = delete;
  ~OwnedTensor() {
    if (handle_ != nullptr) (void)aoti_torch_delete_tensor_object(handle_);
  }
  AtenTensorHandle get() const { return handle_; }
  // Hands the handle on (to the dispatcher's stack, as an output).
  AtenTensorHandle release() { return std::exchange(handle_, nullptr); }
  void* data() const;

 private:
  AtenTensorHandle handle_ = nullptr;
};

// A Tensor[] argument, taken from the dispatcher's stack: owns its handles and frees them (and the
// list) when it goes, whatever happens in between. infos[i] holds tensor i's metadata.
class TensorListArg {
 public:
  explicit TensorListArg(StableIValue list);
  TensorListArg(const TensorListArg&) = delete;
  TensorListArg& operator=(const TensorListArg&) = delete;
  ~TensorListArg();
  size_t size() const { return infos_.size(); }
  bool empty() const { return infos_.empty(); }
  const TensorInfo& operator[](size_t i) const { return infos_[i]; }
  const std::vector<TensorInfo>& infos() const { return infos_; }

 private:
  std::vector<TensorInfo> infos_;
};

// The dispatcher's stack, read and written by a hand-written boxed kernel.
inline OwnedTensor tensor_arg(StableIValue value) {
  return OwnedTensor(torch::stable::detail::to<AtenTensorHandle>(value));
}
std::optional<OwnedTensor> optional_tensor_arg(StableIValue value);
inline bool bool_arg(StableIValue value) { return torch::stable::detail::to<bool>(value); }
inline void set_output(StableIValue* stack, size_t i, OwnedTensor tensor) {
  stack[i] = torch::stable::detail::from(tensor.release());
}

// A new uninitialised contiguous tensor.
OwnedTensor empty(std::initializer_list<int64_t> sizes, int32_t dtype, int32_t device_type, int32_t device_index);
OwnedTensor empty(const std::vector<int64_t>& sizes, int32_t dtype, int32_t device_type, int32_t device_index);

// The one element of a tensor, converted to double (a host read: a sync for a CUDA tensor).
double item_double(AtenTensorHandle tensor);

// ---- ATen ops, through the dispatcher -----------------------------------------------------------

// Calls an ATen op by name with every argument of its schema on `stack` (defaults included); its
// returns replace stack[0...]. torch's own error message is kept where the running torch can give
// it (2.13 on); older ones say only which op failed.
void call_aten(const char* op, const char* overload, StableIValue* stack);
inline StableIValue borrow(AtenTensorHandle t) {  // a new handle of the same tensor, for the stack
  AtenTensorHandle copy = nullptr;
  NANSCAN_SHIM(aoti_torch_new_tensor_handle(t, &copy));
  return torch::stable::detail::from(copy);
}
// A torch::stable::Tensor of the same tensor (a new handle), for torch::stable's op wrappers.
inline torch::stable::Tensor stable(AtenTensorHandle t) {
  return torch::stable::Tensor(torch::stable::detail::to<AtenTensorHandle>(borrow(t)));
}

// Runs ATen ops as below autograd: nanscan's kernels are not differentiable (the Autograd key falls
// through to them: nanscan/_ops.py), and torch's in-place ops refuse leaves that require grad
// while grad mode is on.
class NoGradGuard {
 public:
  NoGradGuard() : previous_(aoti_torch_grad_mode_is_enabled()) { aoti_torch_grad_mode_set_enabled(false); }
  ~NoGradGuard() { aoti_torch_grad_mode_set_enabled(previous_); }
  NoGradGuard(const NoGradGuard&) = delete;
  NoGradGuard& operator=(const NoGradGuard&) = delete;

 private:
  bool previous_;
};

// self *= other (aten::mul_.Tensor), torch's arithmetic.
void mul_(AtenTensorHandle self, AtenTensorHandle other);
// A contiguous copy (aten::contiguous), for the rare tensor that is not dense.
OwnedTensor contiguous(AtenTensorHandle self);

}  // namespace nanscan
