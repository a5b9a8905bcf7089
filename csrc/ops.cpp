// The one place nanscan's ops are declared, validated and given their CPU implementations.
// CUDA implementations register for the same schemas in cuda_binding.cpp.
#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/core/LegacyTypeDispatch.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <Python.h>
#include <c10/core/InferenceMode.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "common/scan_rules.h"
#include "cpu/record_cpu.h"
#include "cpu/scan_cpu.h"
#include "ops.h"

#ifdef NANSCAN_WITH_CUDA
#include "nanscan_cuda_archs.h"  // NANSCAN_CUDA_ARCHS, written by setup.py into the build tree
#else
#define NANSCAN_CUDA_ARCHS ""
#endif

// Importing nanscan._C loads this library, which runs the TORCH_LIBRARY registrations below. The
// module's attributes say which backends were built: with_cuda, and cuda_archs, the
// TORCH_CUDA_ARCH_LIST the kernels were compiled for ("" without CUDA; tests/test_build.py compares it
// with the fatbinary's contents).
extern "C" PyObject* PyInit__C(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  PyObject* module = PyModule_Create(&module_def);
#ifdef NANSCAN_WITH_CUDA
  constexpr long kWithCuda = 1;
#else
  constexpr long kWithCuda = 0;
#endif
  if (module != nullptr && (PyModule_AddIntConstant(module, "with_cuda", kWithCuda) != 0 ||
                            PyModule_AddStringConstant(module, "cuda_archs", NANSCAN_CUDA_ARCHS) != 0)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}

namespace nanscan {

std::optional<DType> dtype_tag(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return DType::Float32;
    case at::kDouble: return DType::Float64;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    case at::kFloat8_e4m3fn: return DType::Float8E4M3FN;
    case at::kFloat8_e5m2: return DType::Float8E5M2;
    default: return std::nullopt;
  }
}

std::vector<DType> check_scan_inputs(const at::TensorList tensors, const char* op) {
  std::vector<DType> tags;
  tags.reserve(tensors.size());
  TORCH_CHECK(!tensors.empty(), op, ": expected at least one tensor");
  const at::Device device = tensors[0].device();
  for (size_t i = 0; i < tensors.size(); ++i) {
    const at::Tensor& t = tensors[i];
    TORCH_CHECK(t.defined(), op, ": tensors[", i, "] is undefined (None)");
    TORCH_CHECK(t.layout() == at::kStrided, op, ": tensors[", i, "] has layout ", t.layout(),
                "; only dense (strided) tensors can be scanned");
    TORCH_CHECK(t.device() == device, op, ": tensors[", i, "] is on ", t.device(), " but tensors[0] is on ", device,
                "; call once per device (nanscan.scan groups by device for you)");
    TORCH_CHECK(t.dim() <= cpu::kMaxDims, op, ": tensors[", i, "] has ", t.dim(), " dimensions; at most ",
                cpu::kMaxDims, " are supported");
    const auto tag = dtype_tag(t.scalar_type());
    TORCH_CHECK(tag.has_value(), op, ": tensors[", i, "] has dtype ", t.scalar_type(),
                "; supported: float32, float64, float16, bfloat16, float8_e4m3fn, float8_e5m2");
    tags.push_back(*tag);
  }
  return tags;
}

void bump_versions_of_dense(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.is_non_overlapping_and_dense()) t.unsafeGetTensorImpl()->bump_version();
  }
}

void check_multipliable(at::TensorList tensors, const std::vector<DType>& tags, const char* op) {
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK(tags[i] != DType::Float8E4M3FN && tags[i] != DType::Float8E5M2, op, ": tensors[", i,
                "] is float8; torch cannot multiply float8 tensors either");
  }
}

void check_writable(at::TensorList tensors) {
  // torch's own checks, with its messages, for the tensors an in-place multiply refuses: one whose
  // elements share memory (an expand()ed view: one location would be multiplied several times), and
  // an inference tensor outside inference mode. Checked for every entry before any is written, so a
  // bad entry leaves the whole list as it was.
  for (const at::Tensor& t : tensors) {
    if (t.numel() > 1) at::assert_no_internal_overlap(t);
    TORCH_CHECK(!t.is_inference() || c10::InferenceMode::is_enabled(),
                "Inplace update to inference tensor outside InferenceMode is not allowed."
                "You can make a clone to get a normal tensor before doing inplace update."
                "See https://github.com/pytorch/rfcs/pull/17 for more details.");
  }
}

std::vector<DType> check_scale_inputs(at::TensorList tensors, const at::Tensor& coef, const char* op) {
  TORCH_CHECK(coef.numel() == 1, op, ": coef must have one element, got shape ", coef.sizes());
  TORCH_CHECK(dtype_tag(coef.scalar_type()).has_value(), op, ": coef has unsupported dtype ", coef.scalar_type());
  if (tensors.empty()) return {};
  std::vector<DType> tags = check_scan_inputs(tensors, op);
  check_multipliable(tensors, tags, op);
  check_writable(tensors);
  TORCH_CHECK(coef.device() == tensors[0].device(), op, ": coef is on ", coef.device(), " but the tensors are on ",
              tensors[0].device());
  return tags;
}

void check_inv_scale(const at::Tensor& inv_scale, const at::Tensor& first, const char* op) {
  TORCH_CHECK(inv_scale.numel() == 1 && inv_scale.scalar_type() == at::kFloat, op,
              ": inv_scale must be a one-element float32 tensor (as GradScaler makes it), got ",
              inv_scale.scalar_type(), " of shape ", inv_scale.sizes());
  TORCH_CHECK(inv_scale.device() == first.device(), op, ": inv_scale is on ", inv_scale.device(),
              " but the tensors are on ", first.device());
}

namespace {

constexpr const char* kRecordOp = "nanscan.record_";

// The dtypes record_ converts from, as torch's copy_ does (the CPU kernel dispatches on the same list;
// why float16/bfloat16 are not among them: cpu/record_cpu.cpp).
bool is_record_source_dtype(at::ScalarType t) {
  switch (t) {
    case at::kBool:
    case at::kByte:
    case at::kChar:
    case at::kShort:
    case at::kInt:
    case at::kLong:
    case at::kFloat:
    case at::kDouble: return true;
    default: return false;
  }
}

// One block of record_: `target` ([capacity, length] rows) and the sources that fill one of its rows.
void check_record_block(const at::Tensor& target, const char* target_name, at::TensorList sources,
                        const char* sources_name, const at::Tensor& rows) {
  TORCH_CHECK(target.defined(), kRecordOp, ": ", target_name, " is undefined (None)");
  TORCH_CHECK(target.layout() == at::kStrided, kRecordOp, ": ", target_name, " has layout ", target.layout(),
              "; expected a dense (strided) tensor");
  TORCH_CHECK(target.dim() == 2, kRecordOp, ": ", target_name, " must be 2-D [capacity, row length], got shape ",
              target.sizes());
  TORCH_CHECK(target.scalar_type() == at::kFloat || target.scalar_type() == at::kDouble, kRecordOp, ": ", target_name,
              " has dtype ", target.scalar_type(), "; supported: float32, float64");
  TORCH_CHECK(target.device() == rows.device(), kRecordOp, ": ", target_name, " is on ", target.device(),
              " but rows are on ", rows.device());
  TORCH_CHECK(target.size(0) == rows.size(0), kRecordOp, ": ", target_name, " has ", target.size(0),
              " rows but rows has ", rows.size(0), "; both are indexed by the same counter");
  int64_t total = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    const at::Tensor& t = sources[i];
    TORCH_CHECK(t.defined(), kRecordOp, ": ", sources_name, "[", i, "] is undefined (None)");
    TORCH_CHECK(t.layout() == at::kStrided, kRecordOp, ": ", sources_name, "[", i, "] has layout ", t.layout(),
                "; expected a dense (strided) tensor");
    TORCH_CHECK(t.device() == rows.device(), kRecordOp, ": ", sources_name, "[", i, "] is on ", t.device(),
                " but rows are on ", rows.device());
    TORCH_CHECK(is_record_source_dtype(t.scalar_type()), kRecordOp, ": ", sources_name, "[", i, "] has dtype ",
                t.scalar_type(), "; supported: bool, uint8, int8, int16, int32, int64, float32, float64");
    total += t.numel();
  }
  TORCH_CHECK(total == target.size(1), kRecordOp, ": ", sources_name, " hold ", total, " values but a row of ",
              target_name, " holds ", target.size(1), "; the sources must fill one row exactly");
}

}  // namespace

void check_record_inputs(const at::Tensor& rows, const at::Tensor& counter, at::TensorList sources,
                         const std::optional<at::Tensor>& attribution, at::TensorList attribution_sources) {
  TORCH_CHECK(rows.defined(), kRecordOp, ": rows is undefined (None)");
  TORCH_CHECK(rows.dim() != 2 || rows.size(0) > 0, kRecordOp, ": rows has no row to write (capacity 0)");
  check_record_block(rows, "rows", sources, "sources", rows);
  TORCH_CHECK(counter.defined() && counter.layout() == at::kStrided && counter.scalar_type() == at::kLong &&
                  counter.numel() == 1,
              kRecordOp, ": counter must be a one-element int64 tensor, got ",
              counter.defined() ? c10::toString(counter.scalar_type()) : "None", " of shape ",
              counter.defined() ? counter.sizes() : at::IntArrayRef{});
  TORCH_CHECK(counter.device() == rows.device(), kRecordOp, ": counter is on ", counter.device(), " but rows are on ",
              rows.device());
  if (attribution.has_value()) {
    check_record_block(*attribution, "attribution", attribution_sources, "attribution_sources", rows);
    check_writable({rows, counter, *attribution});
  } else {
    TORCH_CHECK(attribution_sources.empty(), kRecordOp,
                ": attribution_sources given but attribution is None: there is no row to write them to");
    check_writable({rows, counter});
  }
}

at::ScalarType norm_dtype_of(at::TensorList tensors) {
  const auto counted = [](at::ScalarType t) { return at::isFloat8Type(t) ? at::kFloat : t; };
  at::ScalarType dtype = counted(tensors[0].scalar_type());
  for (const at::Tensor& t : tensors) dtype = c10::promoteTypes(dtype, counted(t.scalar_type()));
  return dtype;
}

ScanOutputs allocate_scan_outputs(at::TensorList tensors, const at::TensorOptions& device, ScanOptions options) {
  const int64_t num_tensors = static_cast<int64_t>(tensors.size());
  const int64_t count_rows = 2 + (options.half_range ? 2 : 0) + (options.checksum ? 1 : 0);
  return ScanOutputs{at::empty({count_rows, num_tensors}, device.dtype(at::kLong)),
                     at::empty({3, num_tensors}, device.dtype(at::kDouble)), at::empty({}, device.dtype(at::kDouble)),
                     at::empty({}, device.dtype(at::kBool)), at::empty({}, device.dtype(norm_dtype_of(tensors)))};
}

ScanResultTuple as_tuple(const ScanOutputs& o) {
  return {o.counts, o.stats, o.total_norm, o.finite, o.total_norm_cast};
}

ResultPointers result_pointers(const ScanOutputs& o, int64_t num_tensors, ScanOptions options) {
  return ResultPointers{o.counts.data_ptr<int64_t>(),
                        o.stats.data_ptr<double>(),
                        o.total_norm.data_ptr<double>(),
                        o.finite.data_ptr<bool>(),
                        num_tensors,
                        options.half_range,
                        options.checksum,
                        o.total_norm_cast.data_ptr(),
                        *dtype_tag(o.total_norm_cast.scalar_type())};
}

ScanOptions scan_options(bool fp16_range, bool checksum) {
  TORCH_CHECK(!(fp16_range && checksum), "nanscan.scan: fp16_range and checksum are separate scans; ask for one");
  return ScanOptions{fp16_range, checksum};
}

namespace {

ScanResultTuple scan_cpu(at::TensorList tensors, bool fp16_range, bool checksum) {
  const ScanOptions options = scan_options(fp16_range, checksum);
  const std::vector<DType> tags = check_scan_inputs(tensors, "nanscan.scan");
  const int64_t n = static_cast<int64_t>(tensors.size());
  ScanOutputs out = allocate_scan_outputs(tensors, at::TensorOptions().device(at::kCPU), options);
  cpu::scan(tensors, tags, result_pointers(out, n, options));
  return as_tuple(out);
}

// torch's GradScaler unscale and the scan in one pass: each element becomes round(x * inv_scale)
// (torch's arithmetic; nothing is written when inv_scale is 1) and the statistics are of the result.
ScanResultTuple unscale_scan_cpu(at::TensorList tensors, const at::Tensor& inv_scale) {
  const std::vector<DType> tags = check_scan_inputs(tensors, "nanscan.unscale_scan_");
  check_multipliable(tensors, tags, "nanscan.unscale_scan_");
  check_writable(tensors);
  check_inv_scale(inv_scale, tensors[0], "nanscan.unscale_scan_");
  const float factor = inv_scale.item<float>();
  for (const at::Tensor& t : tensors) {
    // The kernel fuses the multiply for dense tensors; the rare strided view is multiplied here.
    if (factor != 1.0f && t.numel() > 0 && !t.is_non_overlapping_and_dense())
      const_cast<at::Tensor&>(t).mul_(inv_scale);
  }
  const int64_t n = static_cast<int64_t>(tensors.size());
  ScanOutputs out = allocate_scan_outputs(tensors, at::TensorOptions().device(at::kCPU), ScanOptions{});
  cpu::scan(tensors, tags, result_pointers(out, n, ScanOptions{}), factor);
  if (factor != 1.0f) bump_versions_of_dense(tensors);  // written by the kernel, not through ATen
  return as_tuple(out);
}

// Multiplies every tensor by coef in place, unless coef is exactly 1: a step that needs no clipping
// then costs no write pass. The multiply itself is ATen's, so the values equal torch's clipping.
// Every entry is validated before any is written.
void scale_cpu(at::TensorList tensors, const at::Tensor& coef) {
  check_scale_inputs(tensors, coef, "nanscan.scale_");
  if (coef.item<double>() == 1.0) return;
  for (const at::Tensor& t : tensors) const_cast<at::Tensor&>(t).mul_(coef);
}

// One recorder append (nanscan/recorder.py) in one dispatch: the sources' values into row
// counter % capacity, the counter advanced. The direct kernel (cpu/record_cpu.cpp).
void record_cpu(const at::Tensor& rows, const at::Tensor& counter, at::TensorList sources,
                const std::optional<at::Tensor>& attribution, at::TensorList attribution_sources) {
  check_record_inputs(rows, counter, sources, attribution, attribution_sources);
  cpu::record(rows, counter, sources, attribution, attribution_sources);
  // Written by the kernel, not through ATen: the versions say so, as an in-place ATen op's would.
  rows.unsafeGetTensorImpl()->bump_version();
  counter.unsafeGetTensorImpl()->bump_version();
  if (attribution.has_value()) attribution->unsafeGetTensorImpl()->bump_version();
}

// A [1, length] row of `target`'s dtype holding the sources' values, cast as copy_ casts: one
// _foreach_copy_ into views of it, each of its source's shape. One as_strided per view: a narrow and
// a view would be two dispatches with their checks, and doubled the composite's host time.
at::Tensor staged_row(const at::Tensor& target, at::TensorList sources) {
  at::Tensor row = at::empty({1, target.size(1)}, target.options());
  std::vector<at::Tensor> views;
  views.reserve(sources.size());
  std::vector<int64_t> strides;
  int64_t offset = 0;
  for (const at::Tensor& source : sources) {
    strides.assign(source.dim(), 1);  // contiguous strides of the source's shape
    for (int64_t d = source.dim() - 2; d >= 0; --d)
      strides[d] = strides[d + 1] * std::max<int64_t>(source.size(d + 1), 1);
    views.push_back(row.as_strided(source.sizes(), strides, offset));
    offset += source.numel();
  }
  if (!views.empty()) at::_foreach_copy_(views, sources);
  return row;
}

// The same append in ATen ops, for every device without a kernel of its own (CUDA: each op is a
// kernel on the current stream, no host sync, capturable in a CUDA graph; the recorder's append did
// exactly these before the op existed). The order of reads and writes is the CPU kernel's: every
// source into the staging rows, then the rows, then the counter.
void record_composite(const at::Tensor& rows, const at::Tensor& counter, at::TensorList sources,
                      const std::optional<at::Tensor>& attribution, at::TensorList attribution_sources) {
  check_record_inputs(rows, counter, sources, attribution, attribution_sources);
  const at::Tensor slot = counter.reshape({1}).remainder(rows.size(0));
  const at::Tensor row = staged_row(rows, sources);
  const at::Tensor attribution_row = attribution.has_value() ? staged_row(*attribution, attribution_sources) : row;
  rows.index_copy_(0, slot, row);
  if (attribution.has_value()) attribution->index_copy_(0, slot, attribution_row);
  counter.add_(1);
}

// The Autograd kernels. nanscan's ops are not differentiable: their outputs are counts, extrema and
// norms for diagnosis, and their writes are the multiplies of clipping and unscaling, which torch
// runs under no_grad too. Saying so here (autograd excluded, the op called again below it) gives
// outputs that never require grad; without it, autograd's fallback would hang a grad_fn on them
// that fails only when someone calls backward through a norm.
template <class Signature>
c10::TypedOperatorHandle<Signature> op_handle(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

ScanResultTuple scan_autograd(at::TensorList tensors, bool fp16_range, bool checksum) {
  static const auto op = op_handle<ScanResultTuple(at::TensorList, bool, bool)>("nanscan::scan");
  const at::AutoDispatchBelowAutograd below_autograd;
  return op.call(tensors, fp16_range, checksum);
}

void scale_autograd(at::TensorList tensors, const at::Tensor& coef) {
  static const auto op = op_handle<void(at::TensorList, const at::Tensor&)>("nanscan::scale_");
  const at::AutoDispatchBelowAutograd below_autograd;
  op.call(tensors, coef);
}

ScanResultTuple unscale_scan_autograd(at::TensorList tensors, const at::Tensor& inv_scale) {
  static const auto op = op_handle<ScanResultTuple(at::TensorList, const at::Tensor&)>("nanscan::unscale_scan_");
  const at::AutoDispatchBelowAutograd below_autograd;
  return op.call(tensors, inv_scale);
}

using RecordSignature = void(const at::Tensor&, const at::Tensor&, at::TensorList, const std::optional<at::Tensor>&,
                             at::TensorList);

void record_autograd(const at::Tensor& rows, const at::Tensor& counter, at::TensorList sources,
                     const std::optional<at::Tensor>& attribution, at::TensorList attribution_sources) {
  static const auto op = op_handle<RecordSignature>("nanscan::record_");
  const at::AutoDispatchBelowAutograd below_autograd;
  op.call(rows, counter, sources, attribution, attribution_sources);
}

void record_composite_autograd(const at::Tensor& rows, const at::Tensor& counter, at::TensorList sources,
                               const std::optional<at::Tensor>& attribution, at::TensorList attribution_sources) {
  static const auto op = op_handle<RecordSignature>("nanscan::_record_composite_");
  const at::AutoDispatchBelowAutograd below_autograd;
  op.call(rows, counter, sources, attribution, attribution_sources);
}

#ifndef NANSCAN_WITH_CUDA
// A build without the CUDA backend (torch without CUDA, or NANSCAN_CPU_ONLY=1) still registers CUDA
// kernels, which say so: otherwise the first CUDA call fails with the dispatcher's "Could not run
// 'nanscan::scan' with arguments from the 'CUDA' backend", which names neither cause nor fix.
[[noreturn]] void built_without_cuda(const char* op) {
  TORCH_CHECK(false, op,
              ": this nanscan was built without its CUDA backend, so it cannot read CUDA tensors. Reinstall it "
              "against a CUDA build of torch, with a CUDA toolkit (CUDA_HOME): pip install --no-build-isolation "
              "-e . (setup.py prints which backends it builds, and why)");
}

ScanResultTuple scan_without_cuda(at::TensorList, bool, bool) { built_without_cuda("nanscan.scan"); }
void scale_without_cuda(at::TensorList, const at::Tensor&) { built_without_cuda("nanscan.scale_"); }
ScanResultTuple unscale_scan_without_cuda(at::TensorList, const at::Tensor&) {
  built_without_cuda("nanscan.unscale_scan_");
}
#endif

}  // namespace
}  // namespace nanscan

TORCH_LIBRARY(nanscan, m) {
  // fp16_range adds two rows to counts: finite values that overflow fp16, and non-zero values that
  // fp16 would flush to zero (the AMP advisor's evidence). checksum adds one: each tensor's replica
  // checksum (scan_rules.h), a value in [0, 2^32). One option or the other. total_norm_cast is
  // total_norm in the dtype torch gives this list's total norm (norm_dtype_of): what a clip divides by.
  m.def(
      "scan(Tensor[] tensors, bool fp16_range=False, bool checksum=False) -> (Tensor counts, Tensor stats, Tensor "
      "total_norm, Tensor finite, Tensor total_norm_cast)");
  m.def("scale_(Tensor(a!)[] tensors, Tensor coef) -> ()");
  m.def(
      "unscale_scan_(Tensor(a!)[] tensors, Tensor inv_scale) -> "
      "(Tensor counts, Tensor stats, Tensor total_norm, Tensor finite, Tensor total_norm_cast)");
  // A recorder's append: the sources' values (flattened, in order, cast to the rows' dtype) into row
  // counter % capacity of rows, attribution_sources' into the same row of attribution, counter + 1.
  const char* record_schema =
      "(Tensor(a!) rows, Tensor(b!) counter, Tensor[] sources, Tensor(c!)? attribution, "
      "Tensor[] attribution_sources) -> ()";
  m.def((std::string("record_") + record_schema).c_str());
  // The same op, always by its composite implementation (the one non-CPU devices run): what the
  // tests compare the CPU kernel with, on the CPU.
  m.def((std::string("_record_composite_") + record_schema).c_str());
}

TORCH_LIBRARY_IMPL(nanscan, Autograd, m) {
  m.impl("scan", &nanscan::scan_autograd);
  m.impl("scale_", &nanscan::scale_autograd);
  m.impl("unscale_scan_", &nanscan::unscale_scan_autograd);
  m.impl("record_", &nanscan::record_autograd);
  m.impl("_record_composite_", &nanscan::record_composite_autograd);
}

// Every device without a record_ kernel of its own (CUDA among them) runs the composite.
TORCH_LIBRARY_IMPL(nanscan, CompositeExplicitAutograd, m) {
  m.impl("record_", &nanscan::record_composite);
  m.impl("_record_composite_", &nanscan::record_composite);
}

#ifndef NANSCAN_WITH_CUDA
TORCH_LIBRARY_IMPL(nanscan, CUDA, m) {
  m.impl("scan", &nanscan::scan_without_cuda);
  m.impl("scale_", &nanscan::scale_without_cuda);
  m.impl("unscale_scan_", &nanscan::unscale_scan_without_cuda);
}
#endif

TORCH_LIBRARY_IMPL(nanscan, CPU, m) {
  m.impl("scan", &nanscan::scan_cpu);
  m.impl("scale_", &nanscan::scale_cpu);
  m.impl("unscale_scan_", &nanscan::unscale_scan_cpu);
  m.impl("record_", &nanscan::record_cpu);
}
