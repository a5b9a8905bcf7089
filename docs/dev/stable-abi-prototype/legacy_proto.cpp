#include <torch/library.h>
#include <ATen/core/Tensor.h>
void noop_list(at::TensorList t) { (void)t; }
TORCH_LIBRARY(legacy, m) { m.def("noop_list(Tensor[] tensors) -> ()"); }
TORCH_LIBRARY_IMPL(legacy, CPU, m) { m.impl("noop_list", &noop_list); }
int64_t check_list(at::TensorList tensors) {
  int64_t acc = 0;
  const auto dev = tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), "undef");
    TORCH_CHECK(t.layout() == at::kStrided, "layout");
    TORCH_CHECK(t.device() == dev, "device");
    TORCH_CHECK(t.dim() <= 64, "dims");
    TORCH_CHECK(t.scalar_type() == at::kFloat, "dtype");
    acc += t.numel() + (t.is_contiguous() ? 1 : 0) + reinterpret_cast<intptr_t>(t.const_data_ptr()) % 2;
  }
  return acc;
}
TORCH_LIBRARY_FRAGMENT(legacy, m) { m.def("check_list(Tensor[] tensors) -> int"); }
TORCH_LIBRARY_IMPL(legacy, CPU, m) { m.impl("check_list", &check_list); }
#include <ATen/ATen.h>
void mul_each_(at::TensorList tensors, const at::Tensor& coef) { for (auto& t : tensors) const_cast<at::Tensor&>(t).mul_(coef); }
int64_t empty_many(int64_t n) { for (int64_t i = 0; i < n; ++i) (void)at::empty({4}); return n; }
TORCH_LIBRARY_FRAGMENT(legacy, m) { m.def("mul_each_(Tensor(a!)[] tensors, Tensor coef) -> ()"); m.def("empty_many(int n) -> int"); }
TORCH_LIBRARY_IMPL(legacy, CPU, m) { m.impl("mul_each_", &mul_each_); }
TORCH_LIBRARY_IMPL(legacy, CompositeExplicitAutograd, m) { m.impl("empty_many", &empty_many); }
