// Python.h first, as Python asks (it sets feature macros the system headers read); the limited API only.
#include <Python.h>

#include "torch_api.h"

#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <numeric>

// torch's message of the exception it caught last on this thread arrived in 2.13
// (torch_exception_get_what_without_backtrace), after the 2.10 this library targets: declared weak,
// it is the running torch's where it has one, and null on 2.10-2.12 (a weak reference, not dlsym:
// dlsym's symbol version on a glibc of 2.34 or later would raise the wheel's glibc floor).
extern "C" __attribute__((weak)) const char* torch_exception_get_what_without_backtrace();

// Built against a glibc of 2.32 or later, libstdc++'s headers read glibc's __libc_single_threaded
// (a GLIBC_2.32 symbol) to skip the atomic reference counts of shared_ptr in a single-threaded
// process; that one reference would keep the library from loading on the glibc 2.28 that
// manylinux_2_28 promises. A definition inside the library, always 0 ("threads may exist": the
// atomic path, correct in every process), resolves it here; it is hidden like every symbol of ours.
extern "C" {
char __libc_single_threaded = 0;  // NOLINT: the name is glibc's
}

namespace nanscan {
namespace {

std::string last_torch_error() {
  if (torch_exception_get_what_without_backtrace == nullptr) return {};
  const char* what = torch_exception_get_what_without_backtrace();
  return what != nullptr ? std::string(what) : std::string();
}

}  // namespace

void check_shim(AOTITorchError err, const char* call) {
  if (err == AOTI_TORCH_SUCCESS) return;
  const std::string what = last_torch_error();
  fail(what.empty() ? concat("nanscan: torch failed in ", call) : what);
}

void call_aten(const char* op, const char* overload, StableIValue* stack) {
  if (torch_call_dispatcher(op, overload, stack, TORCH_ABI_VERSION) == AOTI_TORCH_SUCCESS) return;
  const std::string what = last_torch_error();
  fail(what.empty() ? concat("nanscan: ", op, ".", overload, " failed (torch before 2.13 does not say why)") : what);
}

const DTypeCodes& dtype_codes() {
  static const DTypeCodes codes{
      aoti_torch_dtype_float32(),  aoti_torch_dtype_float64(),       aoti_torch_dtype_float16(),
      aoti_torch_dtype_bfloat16(), aoti_torch_dtype_float8_e4m3fn(), aoti_torch_dtype_float8_e5m2(),
      aoti_torch_dtype_bool(),     aoti_torch_dtype_uint8(),         aoti_torch_dtype_int8(),
      aoti_torch_dtype_int16(),    aoti_torch_dtype_int32(),         aoti_torch_dtype_int64()};
  return codes;
}

std::optional<DType> dtype_tag(int32_t code) {
  const DTypeCodes& c = dtype_codes();
  if (code == c.float32) return DType::Float32;
  if (code == c.float64) return DType::Float64;
  if (code == c.float16) return DType::Float16;
  if (code == c.bfloat16) return DType::BFloat16;
  if (code == c.float8_e4m3fn) return DType::Float8E4M3FN;
  if (code == c.float8_e5m2) return DType::Float8E5M2;
  return std::nullopt;
}

int32_t dtype_code(DType tag) {
  const DTypeCodes& c = dtype_codes();
  switch (tag) {
    case DType::Float32: return c.float32;
    case DType::Float64: return c.float64;
    case DType::Float16: return c.float16;
    case DType::BFloat16: return c.bfloat16;
    case DType::Float8E4M3FN: return c.float8_e4m3fn;
    case DType::Float8E5M2: return c.float8_e5m2;
  }
  return c.float32;
}

std::string dtype_name(int32_t code) {
  const std::pair<int32_t, const char*> names[] = {
      {aoti_torch_dtype_float32(), "Float"},
      {aoti_torch_dtype_float64(), "Double"},
      {aoti_torch_dtype_float16(), "Half"},
      {aoti_torch_dtype_bfloat16(), "BFloat16"},
      {aoti_torch_dtype_float8_e4m3fn(), "Float8_e4m3fn"},
      {aoti_torch_dtype_float8_e5m2(), "Float8_e5m2"},
      {aoti_torch_dtype_float8_e4m3fnuz(), "Float8_e4m3fnuz"},
      {aoti_torch_dtype_float8_e5m2fnuz(), "Float8_e5m2fnuz"},
      {aoti_torch_dtype_bool(), "Bool"},
      {aoti_torch_dtype_uint8(), "Byte"},
      {aoti_torch_dtype_int8(), "Char"},
      {aoti_torch_dtype_int16(), "Short"},
      {aoti_torch_dtype_int32(), "Int"},
      {aoti_torch_dtype_int64(), "Long"},
      {aoti_torch_dtype_uint16(), "UInt16"},
      {aoti_torch_dtype_uint32(), "UInt32"},
      {aoti_torch_dtype_uint64(), "UInt64"},
      {aoti_torch_dtype_complex32(), "ComplexHalf"},
      {aoti_torch_dtype_complex64(), "ComplexFloat"},
      {aoti_torch_dtype_complex128(), "ComplexDouble"},
  };
  for (const auto& [c, name] : names) {
    if (c == code) return name;
  }
  return concat("dtype #", code);
}

std::string device_name(int32_t device_type, int32_t device_index) {
  const std::pair<int32_t, const char*> names[] = {
      {aoti_torch_device_type_cpu(), "cpu"},   {aoti_torch_device_type_cuda(), "cuda"},
      {aoti_torch_device_type_meta(), "meta"}, {aoti_torch_device_type_xpu(), "xpu"},
      {aoti_torch_device_type_mps(), "mps"},   {aoti_torch_device_type_privateuse1(), "privateuseone"},
  };
  std::string name = concat("device type #", device_type);
  for (const auto& [c, n] : names) {
    if (c == device_type) name = n;
  }
  return device_index >= 0 ? concat(name, ":", device_index) : name;
}

std::string layout_name(int32_t layout) {
  const std::pair<int32_t, const char*> names[] = {
      {aoti_torch_layout_strided(), "Strided"},      {aoti_torch_layout_sparse_coo(), "Sparse"},
      {aoti_torch_layout_sparse_csr(), "SparseCsr"}, {aoti_torch_layout_sparse_csc(), "SparseCsc"},
      {aoti_torch_layout_sparse_bsr(), "SparseBsr"}, {aoti_torch_layout_sparse_bsc(), "SparseBsc"},
      {aoti_torch_layout__mkldnn(), "Mkldnn"},       {aoti_torch_layout_jagged(), "Jagged"},
  };
  for (const auto& [c, name] : names) {
    if (c == layout) return name;
  }
  return concat("layout #", layout);
}

std::string shape_string(const int64_t* sizes, int64_t dim) {
  if (sizes == nullptr) return "(not strided: no sizes read)";  // a caller's slip, never a crash
  std::ostringstream out;
  out << "[";
  for (int64_t d = 0; d < dim; ++d) out << (d > 0 ? ", " : "") << sizes[d];
  out << "]";
  return out.str();
}

// c10's rule (c10/core/Contiguity.h, _compute_non_overlapping_and_dense): sorted by stride, with
// dimensions of size 0 or 1 last, each stride must be the product of the sizes before it.
bool is_non_overlapping_and_dense(const int64_t* sizes, const int64_t* strides, int64_t dim) {
  if (dim == 1) return sizes[0] < 2 || strides[0] == 1;
  constexpr int64_t kOnStack = 8;
  int64_t order_on_stack[kOnStack];
  std::vector<int64_t> order_on_heap;
  int64_t* order = order_on_stack;
  if (dim > kOnStack) {
    order_on_heap.resize(dim);
    order = order_on_heap.data();
  }
  std::iota(order, order + dim, int64_t{0});
  std::sort(order, order + dim, [&](int64_t a, int64_t b) {
    if (sizes[a] < 2) return false;
    if (sizes[b] < 2) return true;
    return strides[a] < strides[b];
  });
  int64_t expected = 1;
  for (int64_t i = 0; i < dim; ++i) {
    const int64_t size = sizes[order[i]];
    if (size < 2) return true;
    if (strides[order[i]] != expected) return false;
    expected *= size;
  }
  return true;
}

bool is_contiguous(const int64_t* sizes, const int64_t* strides, int64_t dim) {
  int64_t expected = 1;
  for (int64_t d = dim - 1; d >= 0; --d) {
    if (sizes[d] == 0) return true;
    if (sizes[d] != 1 && strides[d] != expected) return false;
    expected *= sizes[d];
  }
  return true;
}

TensorInfo TensorInfo::of(AtenTensorHandle handle) {
  TensorInfo t;
  t.handle = handle;
  NANSCAN_SHIM(aoti_torch_is_defined(handle, &t.defined));
  if (!t.defined) return t;
  NANSCAN_SHIM(aoti_torch_get_dtype(handle, &t.dtype));
  NANSCAN_SHIM(aoti_torch_get_device_type(handle, &t.device_type));
  NANSCAN_SHIM(aoti_torch_get_device_index(handle, &t.device_index));
  NANSCAN_SHIM(aoti_torch_get_layout(handle, &t.layout));
  NANSCAN_SHIM(aoti_torch_get_dim(handle, &t.dim));
  if (!t.strided()) return t;  // sparse and MKL-DNN tensors have no strides (nor data to read)
  int64_t* sizes = nullptr;
  int64_t* strides = nullptr;
  NANSCAN_SHIM(aoti_torch_get_numel(handle, &t.numel));
  NANSCAN_SHIM(aoti_torch_get_sizes(handle, &sizes));
  NANSCAN_SHIM(aoti_torch_get_strides(handle, &strides));
  NANSCAN_SHIM(aoti_torch_get_data_ptr(handle, &t.data));
  t.sizes = sizes;
  t.strides = strides;
  t.dense = is_non_overlapping_and_dense(sizes, strides, t.dim);
  return t;
}

bool TensorInfo::strided() const {
  static const int32_t strided_layout = aoti_torch_layout_strided();
  return layout == strided_layout;
}

void* OwnedTensor::data() const {
  void* p = nullptr;
  NANSCAN_SHIM(aoti_torch_get_data_ptr(handle_, &p));
  return p;
}

TensorListArg::TensorListArg(StableIValue list) {
  const auto handle = torch::stable::detail::to<StableListHandle>(list);
  size_t n = 0;
  AOTITorchError err = torch_list_size(handle, &n);
  if (err == AOTI_TORCH_SUCCESS) {
    // Every handle is owned (and so freed by the destructor) before anything can throw.
    infos_.reserve(n);
    for (size_t i = 0; i < n && err == AOTI_TORCH_SUCCESS; ++i) {
      StableIValue element = 0;
      err = torch_list_get_item(handle, i, &element);
      if (err == AOTI_TORCH_SUCCESS) infos_.push_back(TensorInfo{torch::stable::detail::to<AtenTensorHandle>(element)});
    }
  }
  (void)torch_delete_list(handle);
  try {
    check_shim(err, "torch_list_get_item");
    for (TensorInfo& info : infos_) info = TensorInfo::of(info.handle);
  } catch (...) {
    for (const TensorInfo& info : infos_) (void)aoti_torch_delete_tensor_object(info.handle);
    throw;
  }
}

// Dropping the last C++ reference to a tensor that Python also holds hands the reference back to its
// Python object, and torch takes the GIL for that, once a tensor: the kernels run with the GIL
// released (torch's op binding lets it go), so a list of N tensors took and dropped it N times, ~12%
// of the scan op's host time on a list of small tensors (benchmarks/NOTES.md entry 55). Taken here
// once for the whole list instead, on a thread Python knows (the caller of every op from Python;
// torch's per-tensor hand-back takes the GIL at this same point anyway). A thread Python has never
// seen frees the handles as before.
TensorListArg::~TensorListArg() {
  const bool python_thread = PyGILState_GetThisThreadState() != nullptr;
  PyGILState_STATE gil{};
  if (python_thread) gil = PyGILState_Ensure();
  for (const TensorInfo& info : infos_) (void)aoti_torch_delete_tensor_object(info.handle);
  if (python_thread) PyGILState_Release(gil);
}

std::optional<OwnedTensor> optional_tensor_arg(StableIValue value) {
  std::optional<AtenTensorHandle> handle = torch::stable::detail::to<std::optional<AtenTensorHandle>>(value);
  if (!handle.has_value()) return std::nullopt;
  return OwnedTensor(*handle);
}

OwnedTensor empty(const std::vector<int64_t>& sizes, int32_t dtype, int32_t device_type, int32_t device_index) {
  std::vector<int64_t> strides(sizes.size(), 1);
  for (int64_t d = static_cast<int64_t>(sizes.size()) - 2; d >= 0; --d)
    strides[d] = strides[d + 1] * std::max<int64_t>(sizes[d + 1], 1);
  AtenTensorHandle made = nullptr;
  NANSCAN_SHIM(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(), strides.data(), dtype,
                                        device_type, device_index, &made));
  return OwnedTensor(made);
}

OwnedTensor empty(std::initializer_list<int64_t> sizes, int32_t dtype, int32_t device_type, int32_t device_index) {
  return empty(std::vector<int64_t>(sizes), dtype, device_type, device_index);
}

double item_double(AtenTensorHandle tensor) {
  double value = 0;
  NANSCAN_SHIM(aoti_torch_item_float64(tensor, &value));
  return value;
}

void mul_(AtenTensorHandle self, AtenTensorHandle other) {
  StableIValue stack[2] = {borrow(self), borrow(other)};
  call_aten("aten::mul_", "Tensor", stack);
  OwnedTensor returned(torch::stable::detail::to<AtenTensorHandle>(stack[0]));  // self again: released
}

OwnedTensor contiguous(AtenTensorHandle self) {
  const torch::stable::Tensor result = torch::stable::contiguous(stable(self));
  return OwnedTensor(torch::stable::detail::to<AtenTensorHandle>(borrow(result.get())));
}

}  // namespace nanscan
