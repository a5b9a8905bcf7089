// Prototype: what nanscan's port needs, compiled against torch 2.13 headers with TORCH_TARGET_VERSION=2.10.
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/accelerator.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/core/Dispatch.h>
#include <torch/headeronly/util/Exception.h>

#include <Python.h>
#include <optional>
#include <tuple>
#include <vector>
#include <atomic>

using torch::stable::Tensor;
using torch::headeronly::ScalarType;
namespace sd = torch::stable::detail;

extern "C" PyObject* PyInit_stable_proto(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "stable_proto", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&def);
}

static Tensor call1(const char* op, const char* overload, StableIValue* stack) {
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(op, overload, stack, TORCH_ABI_VERSION));
  return sd::to<Tensor>(stack[0]);
}

using Five = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>;

Five scan(std::vector<Tensor> tensors, bool fp16_range, bool checksum) {
  STD_TORCH_CHECK(!tensors.empty(), "proto.scan: expected at least one tensor");
  STD_TORCH_CHECK(!(fp16_range && checksum), "proto.scan: fp16_range and checksum are separate scans; ask for one");
  const auto dev = tensors[0].device();
  int64_t n = tensors.size();
  Tensor counts = torch::stable::empty({2, n}, ScalarType::Long, std::nullopt, dev);
  Tensor stats = torch::stable::empty({3, n}, ScalarType::Double, std::nullopt, dev);
  Tensor total = torch::stable::empty({}, ScalarType::Double, std::nullopt, dev);
  Tensor finite = torch::stable::empty({}, ScalarType::Bool, std::nullopt, dev);
  Tensor cast = torch::stable::empty({}, ScalarType::Float, std::nullopt, dev);
  double* s = stats.mutable_data_ptr<double>();
  int64_t* c = counts.mutable_data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) {
    const Tensor& t = tensors[i];
    STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float, "proto.scan: tensors[", i, "] has dtype ", t.scalar_type());
    const float* p = t.const_data_ptr<float>();
    std::atomic<int64_t> nan{0};
    torch::stable::parallel_for(0, t.numel(), 4096, [&](int64_t b, int64_t e) {
      int64_t k = 0;
      for (int64_t j = b; j < e; ++j) k += p[j] != p[j];
      nan += k;
    });
    c[i] = nan; c[n + i] = 0; s[i] = s[n + i] = s[2 * n + i] = 0;
  }
  *total.mutable_data_ptr<double>() = 0;
  *finite.mutable_data_ptr<bool>() = true;
  *cast.mutable_data_ptr<float>() = 0;
  return {counts, stats, total, finite, cast};
}

// No work: measures boxing of Tensor[].
void noop_list(std::vector<Tensor> tensors) { (void)tensors; }

void scale_(std::vector<Tensor> tensors, Tensor coef) {
  double v = 0;
  STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_item_float64(coef.get(), &v));  // item() of a float32 tensor?
  if (v == 1.0) return;
  for (auto& t : tensors) {
    StableIValue st[2] = {sd::from(t), sd::from(coef)};
    (void)call1("aten::mul_", "Tensor", st);
  }
}

// Raw write: does anything bump the version counter?
void raw_write_(Tensor t) { *t.mutable_data_ptr<float>() = 42.0f; }

// Try calling an op with a Scalar argument (add_.Tensor has Scalar alpha).
void add_one_scalar_(Tensor t) {
  Tensor one = torch::stable::full({}, 1.0, t.scalar_type(), std::nullopt, t.device());
  StableIValue st[3] = {sd::from(t), sd::from(one), sd::from(1.0)};
  (void)call1("aten::add_", "Tensor", st);
}

bool is_inference(Tensor t) {
  StableIValue st[1] = {sd::from(t)};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::is_inference", "", st, TORCH_ABI_VERSION));
  return sd::to<bool>(st[0]);
}

int64_t version_of(Tensor t) {
  StableIValue st[1] = {sd::from(t)};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::_version", "", st, TORCH_ABI_VERSION));
  return sd::to<int64_t>(st[0]);
}

void record_(Tensor rows, Tensor counter, std::vector<Tensor> sources, std::optional<Tensor> attribution,
             std::vector<Tensor> attribution_sources) {
  // composite: row = staged sources via as_strided views + _foreach_copy_, index_copy_ into rows, counter += 1
  int64_t len = rows.size(1);
  Tensor row = torch::stable::new_empty(rows, {1, len});
  std::vector<Tensor> views;
  int64_t off = 0;
  for (auto& s : sources) {
    std::vector<int64_t> sizes(s.sizes().begin(), s.sizes().end()), strides(s.dim(), 1);
    for (int64_t d = s.dim() - 2; d >= 0; --d) strides[d] = strides[d + 1] * std::max<int64_t>(sizes[d + 1], 1);
    StableIValue st[4] = {sd::from(row), sd::from(sizes), sd::from(strides), sd::from(std::optional<int64_t>(off))};
    views.push_back(call1("aten::as_strided", "", st));
    off += s.numel();
  }
  if (!views.empty()) {
    StableIValue st[3] = {sd::from(views), sd::from(sources), sd::from(false)};
    STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::_foreach_copy_", "", st, TORCH_ABI_VERSION));
  }
  Tensor cap = torch::stable::full({1}, (double)rows.size(0), ScalarType::Long, std::nullopt, rows.device());
  Tensor flat = torch::stable::reshape(counter, {1});
  StableIValue rs[2] = {sd::from(flat), sd::from(cap)};
  Tensor slot = call1("aten::remainder", "Tensor", rs);
  StableIValue ic[4] = {sd::from(rows), sd::from(int64_t(0)), sd::from(slot), sd::from(row)};
  (void)call1("aten::index_copy_", "", ic);
  // counter += 1 without a Scalar: ~x then neg -> x+1
  StableIValue b[1] = {sd::from(counter)};
  (void)call1("aten::bitwise_not_", "", b);
  StableIValue ng[1] = {sd::from(counter)};
  (void)call1("aten::neg_", "", ng);
  (void)attribution; (void)attribution_sources;
}

STABLE_TORCH_LIBRARY(proto, m) {
  m.def("scan(Tensor[] tensors, bool fp16_range=False, bool checksum=False) -> (Tensor counts, Tensor stats, Tensor total_norm, Tensor finite, Tensor total_norm_cast)");
  m.def("noop_list(Tensor[] tensors) -> ()");
  m.def("scale_(Tensor(a!)[] tensors, Tensor coef) -> ()");
  m.def("raw_write_(Tensor(a!) t) -> ()");
  m.def("add_one_scalar_(Tensor(a!) t) -> ()");
  m.def("is_inference(Tensor t) -> bool");
  m.def("version_of(Tensor t) -> int");
  m.def("record_(Tensor(a!) rows, Tensor(b!) counter, Tensor[] sources, Tensor(c!)? attribution, Tensor[] attribution_sources) -> ()");
}

STABLE_TORCH_LIBRARY_IMPL(proto, CPU, m) {
  m.impl("scan", TORCH_BOX(&scan));
  m.impl("noop_list", TORCH_BOX(&noop_list));
  m.impl("scale_", TORCH_BOX(&scale_));
  m.impl("raw_write_", TORCH_BOX(&raw_write_));
  m.impl("add_one_scalar_", TORCH_BOX(&add_one_scalar_));
}
STABLE_TORCH_LIBRARY_IMPL(proto, CompositeExplicitAutograd, m) {
  m.impl("record_", TORCH_BOX(&record_));
  m.impl("is_inference", TORCH_BOX(&is_inference));
  m.impl("version_of", TORCH_BOX(&version_of));
}

int64_t check_list(std::vector<Tensor> tensors) {
  int64_t acc = 0;
  const auto dev = tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const Tensor& t = tensors[i];
    STD_TORCH_CHECK(t.defined(), "undef");
    STD_TORCH_CHECK(t.layout() == torch::headeronly::Layout::Strided, "layout");
    STD_TORCH_CHECK(t.device() == dev, "device");
    STD_TORCH_CHECK(t.dim() <= 64, "dims");
    STD_TORCH_CHECK(t.scalar_type() == ScalarType::Float, "dtype");
    acc += t.numel() + (t.is_contiguous() ? 1 : 0) + reinterpret_cast<intptr_t>(t.const_data_ptr()) % 2;
  }
  return acc;
}
STABLE_TORCH_LIBRARY_FRAGMENT(proto, m) { m.def("check_list(Tensor[] tensors) -> int"); }
STABLE_TORCH_LIBRARY_IMPL(proto, CPU, m) { m.impl("check_list", TORCH_BOX(&check_list)); }

int64_t count_inference(std::vector<Tensor> tensors) {
  int64_t k = 0;
  for (auto& t : tensors) {
    StableIValue st[1] = {sd::from(t)};
    STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::is_inference", "", st, TORCH_ABI_VERSION));
    k += sd::to<bool>(st[0]);
  }
  return k;
}
void mul_each_(std::vector<Tensor> tensors, Tensor coef) {
  for (auto& t : tensors) {
    StableIValue st[2] = {sd::from(t), sd::from(coef)};
    STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::mul_", "Tensor", st, TORCH_ABI_VERSION));
    (void)sd::to<Tensor>(st[0]);
  }
}
void foreach_mul_(std::vector<Tensor> tensors, Tensor coef) {
  StableIValue st[2] = {sd::from(tensors), sd::from(coef)};
  STABLE_TORCH_ERROR_CODE_CHECK(torch_call_dispatcher("aten::_foreach_mul_", "Tensor", st, TORCH_ABI_VERSION));
}
Tensor empty_many(int64_t n) {
  Tensor last;
  for (int64_t i = 0; i < n; ++i) last = torch::stable::empty({4}, ScalarType::Float);
  return last;
}
Tensor empty_strided_many(int64_t n) {
  Tensor last;
  int64_t size = 4, stride = 1;
  for (int64_t i = 0; i < n; ++i) {
    AtenTensorHandle h;
    STABLE_TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(1, &size, &stride, aoti_torch_dtype_float32(), aoti_torch_device_type_cpu(), 0, &h));
    last = Tensor(h);
  }
  return last;
}
STABLE_TORCH_LIBRARY_FRAGMENT(proto, m) {
  m.def("count_inference(Tensor[] tensors) -> int");
  m.def("mul_each_(Tensor(a!)[] tensors, Tensor coef) -> ()");
  m.def("foreach_mul_(Tensor(a!)[] tensors, Tensor coef) -> ()");
  m.def("empty_many(int n) -> Tensor");
  m.def("empty_strided_many(int n) -> Tensor");
}
STABLE_TORCH_LIBRARY_IMPL(proto, CompositeExplicitAutograd, m) {
  m.impl("count_inference", TORCH_BOX(&count_inference));
  m.impl("mul_each_", TORCH_BOX(&mul_each_));
  m.impl("foreach_mul_", TORCH_BOX(&foreach_mul_));
  m.impl("empty_many", TORCH_BOX(&empty_many));
  m.impl("empty_strided_many", TORCH_BOX(&empty_strided_many));
}

struct NoGradGuard {
  bool prev = aoti_torch_grad_mode_is_enabled();
  NoGradGuard() { aoti_torch_grad_mode_set_enabled(false); }
  ~NoGradGuard() { aoti_torch_grad_mode_set_enabled(prev); }
};
void scale_nograd_(std::vector<Tensor> tensors, Tensor coef) {
  NoGradGuard g;
  for (auto& t : tensors) {
    StableIValue st[2] = {sd::from(t), sd::from(coef)};
    (void)call1("aten::mul_", "Tensor", st);
  }
}
STABLE_TORCH_LIBRARY_FRAGMENT(proto, m) { m.def("scale_nograd_(Tensor(a!)[] tensors, Tensor coef) -> ()"); }
STABLE_TORCH_LIBRARY_IMPL(proto, CPU, m) { m.impl("scale_nograd_", TORCH_BOX(&scale_nograd_)); }

// The same no-op list op with a hand-written boxed kernel: the list's tensor handles are read and
// released one by one, without a torch::stable::Tensor (a shared_ptr control block) per element.
static void noop_list_raw(StableIValue* stack, uint64_t, uint64_t) {
  auto list = sd::to<StableListHandle>(stack[0]);
  size_t n = 0;
  torch_list_size(list, &n);
  thread_local std::vector<AtenTensorHandle> handles;
  handles.resize(n);
  for (size_t i = 0; i < n; ++i) {
    StableIValue e;
    torch_list_get_item(list, i, &e);
    handles[i] = sd::to<AtenTensorHandle>(e);
  }
  // per-tensor metadata as nanscan needs it
  int64_t sum = 0;
  for (size_t i = 0; i < n; ++i) {
    int32_t dt, dev, idx; int64_t dim, numel; void* p; int64_t* sz;
    aoti_torch_get_dtype(handles[i], &dt);
    aoti_torch_get_device_type(handles[i], &dev);
    aoti_torch_get_device_index(handles[i], &idx);
    aoti_torch_get_dim(handles[i], &dim);
    aoti_torch_get_numel(handles[i], &numel);
    aoti_torch_get_sizes(handles[i], &sz);
    aoti_torch_get_strides(handles[i], &sz);
    aoti_torch_get_data_ptr(handles[i], &p);
    sum += dt + dev + idx + dim + numel;
  }
  for (size_t i = 0; i < n; ++i) aoti_torch_delete_tensor_object(handles[i]);
  torch_delete_list(list);
  (void)sum;
}
STABLE_TORCH_LIBRARY_FRAGMENT(proto, m) { m.def("noop_list_raw(Tensor[] tensors) -> ()"); }
STABLE_TORCH_LIBRARY_IMPL(proto, CPU, m) { m.impl("noop_list_raw", &noop_list_raw); }
