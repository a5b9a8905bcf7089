// The one place nanscan's ops are declared, validated and given their CPU implementations, on
// PyTorch's stable ABI (torch_api.h). CUDA implementations register for the same schemas in
// cuda_binding.cpp; both libraries check arguments with op_args.cpp. What the stable ABI cannot express lives in
// nanscan/_ops.py: the Autograd key falls through to these kernels (they are not differentiable), and the writing ops'
// version-counter bumps and inference-tensor refusal run in Python kernels at ADInplaceOrView.
#include <Python.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <optional>
#include <string>
#include <vector>

#include "common/scan_rules.h"
#include "cpu/record_cpu.h"
#include "cpu/scan_cpu.h"
#include "ops.h"
#include "torch_api.h"

// Importing nanscan._C loads this library, which runs the STABLE_TORCH_LIBRARY registrations below:
// the schemas and the CPU kernels. The CUDA kernels are libraries of their own, one per CUDA major
// (cuda_binding.cpp), which nanscan/_ops.py loads for the torch it runs with. Python's limited API
// only: the library loads into every CPython from 3.10 on.
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef module_def = {
      PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr, nullptr, nullptr, nullptr, nullptr};
  return PyModule_Create(&module_def);
}

namespace nanscan {
namespace {

constexpr const char* kRecordOp = "nanscan.record_";

// The dtypes record_ converts from, as torch's copy_ does (the CPU kernel dispatches on the same list;
// why float16/bfloat16 are not among them: cpu/record_cpu.cpp).
bool is_record_source_dtype(int32_t code) {
  const DTypeCodes& c = dtype_codes();
  return code == c.boolean || code == c.uint8 || code == c.int8 || code == c.int16 || code == c.int32 ||
         code == c.int64 || code == c.float32 || code == c.float64;
}

// One block of record_: `target` ([capacity, length] rows) and the sources that fill one of its rows.
void check_record_block(const TensorInfo& target, const char* target_name, const TensorListArg& sources,
                        const char* sources_name, const TensorInfo& rows) {
  NANSCAN_CHECK(target.defined, kRecordOp, ": ", target_name, " is undefined (None)");
  NANSCAN_CHECK(target.strided(), kRecordOp, ": ", target_name, " has layout ", layout_name(target.layout),
                "; expected a dense (strided) tensor");
  NANSCAN_CHECK(target.dim == 2, kRecordOp, ": ", target_name, " must be 2-D [capacity, row length], got shape ",
                shape_string(target.sizes, target.dim));
  NANSCAN_CHECK(target.dtype == dtype_codes().float32 || target.dtype == dtype_codes().float64, kRecordOp, ": ",
                target_name, " has dtype ", dtype_name(target.dtype), "; supported: float32, float64");
  NANSCAN_CHECK(target.same_device(rows), kRecordOp, ": ", target_name, " is on ", target.device(), " but rows are on ",
                rows.device());
  NANSCAN_CHECK(target.size(0) == rows.size(0), kRecordOp, ": ", target_name, " has ", target.size(0),
                " rows but rows has ", rows.size(0), "; both are indexed by the same counter");
  int64_t total = 0;
  for (size_t i = 0; i < sources.size(); ++i) {
    const TensorInfo& t = sources[i];
    NANSCAN_CHECK(t.defined, kRecordOp, ": ", sources_name, "[", i, "] is undefined (None)");
    NANSCAN_CHECK(t.strided(), kRecordOp, ": ", sources_name, "[", i, "] has layout ", layout_name(t.layout),
                  "; expected a dense (strided) tensor");
    NANSCAN_CHECK(t.same_device(rows), kRecordOp, ": ", sources_name, "[", i, "] is on ", t.device(),
                  " but rows are on ", rows.device());
    NANSCAN_CHECK(is_record_source_dtype(t.dtype), kRecordOp, ": ", sources_name, "[", i, "] has dtype ",
                  dtype_name(t.dtype), "; supported: bool, uint8, int8, int16, int32, int64, float32, float64");
    total += t.numel;
  }
  NANSCAN_CHECK(total == target.size(1), kRecordOp, ": ", sources_name, " hold ", total, " values but a row of ",
                target_name, " holds ", target.size(1), "; the sources must fill one row exactly");
}

// A record_ call's arguments, owned, read and checked (everything, on every device, before anything
// is written): rows (and attribution) 2-D float32/float64 with the same number of rows, counter one
// int64, every source on their device with a supported dtype, the sources' elements exactly filling
// one row of each. Errors name the offending argument.
struct RecordArgs {
  OwnedTensor rows_tensor, counter_tensor;
  TensorListArg sources;
  std::optional<OwnedTensor> attribution_tensor;
  TensorListArg attribution_sources;
  TensorInfo rows, counter;
  std::optional<TensorInfo> attribution;

  RecordArgs(StableIValue* stack, uint64_t num_args, uint64_t num_outputs)
      : rows_tensor(tensor_arg(stack[0])),
        counter_tensor(tensor_arg(stack[1])),
        sources(stack[2]),
        attribution_tensor(optional_tensor_arg(stack[3])),
        attribution_sources(stack[4]) {
    check_stack(num_args, num_outputs, 5, 0, kRecordOp);
    rows = TensorInfo::of(rows_tensor.get());
    counter = TensorInfo::of(counter_tensor.get());
    if (attribution_tensor.has_value()) attribution = TensorInfo::of(attribution_tensor->get());
    NANSCAN_CHECK(rows.defined, kRecordOp, ": rows is undefined (None)");
    NANSCAN_CHECK(!rows.strided() || rows.dim != 2 || rows.size(0) > 0, kRecordOp,
                  ": rows has no row to write (capacity 0)");
    check_record_block(rows, "rows", sources, "sources", rows);
    NANSCAN_CHECK(counter.defined && counter.strided() && counter.dtype == dtype_codes().int64 && counter.numel == 1,
                  kRecordOp, ": counter must be a one-element int64 tensor, got ",
                  counter.defined ? dtype_name(counter.dtype) : std::string("None"), " of shape ",
                  !counter.defined    ? std::string("[]")
                  : counter.strided() ? shape_string(counter.sizes, counter.dim)
                                      : layout_name(counter.layout));
    NANSCAN_CHECK(counter.same_device(rows), kRecordOp, ": counter is on ", counter.device(), " but rows are on ",
                  rows.device());
    if (attribution.has_value()) {
      check_record_block(*attribution, "attribution", attribution_sources, "attribution_sources", rows);
      check_writable(*attribution);
    } else {
      NANSCAN_CHECK(attribution_sources.empty(), kRecordOp,
                    ": attribution_sources given but attribution is None: there is no row to write them to");
    }
    check_writable(rows);
    check_writable(counter);
  }
};

}  // namespace

namespace {

// ---- the CPU kernels (boxed: the stack holds the schema's arguments, then its returns) ----------

// scan(Tensor[] tensors, bool fp16_range, bool checksum) -> 5 tensors
void scan_cpu(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const ScanArgs args(stack, num_args, num_outputs);
  ScanOutputs out = allocate_scan_outputs(args.tags, args.tensors[0], args.options);
  cpu::scan(args.tensors.infos(), args.tags,
            result_pointers(out, static_cast<int64_t>(args.tags.size()), args.options));
  return_outputs(stack, std::move(out));
}

// scan_into_(Tensor[] tensors, bool fp16_range, Tensor(a!) counts, Tensor(b!) stats, int column) -> ()
void scan_into_cpu(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const ScanIntoArgs args(stack, num_args, num_outputs);
  cpu::scan(args.tensors.infos(), args.tags, args.out);
}

// unscale_scan_(Tensor(a!)[] tensors, Tensor inv_scale) -> 5 tensors. torch's GradScaler unscale
// and the scan in one pass: each element becomes round(x * inv_scale) (torch's arithmetic; nothing is
// written when inv_scale is 1) and the statistics are of the result.
void unscale_scan_cpu(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const UnscaleScanArgs args(stack, num_args, num_outputs);
  const auto factor = static_cast<float>(item_double(args.inv_scale.handle));
  if (factor != 1.0f) {
    // The kernel fuses the multiply for dense tensors; the rare strided view is multiplied here.
    const NoGradGuard no_grad;
    for (const TensorInfo& t : args.tensors.infos()) {
      if (t.numel > 0 && !t.dense) mul_(t.handle, args.inv_scale.handle);
    }
  }
  ScanOutputs out = allocate_scan_outputs(args.tags, args.tensors[0], ScanOptions{});
  cpu::scan(args.tensors.infos(), args.tags,
            result_pointers(out, static_cast<int64_t>(args.tags.size()), ScanOptions{}), factor);
  return_outputs(stack, std::move(out));
}

// scan_difference(Tensor[] before, Tensor[] after) -> 5 tensors, of 2N entries: the differences
// before[i] - after[i], then the afters. The update watch's pass (nanscan/updates.py): the weights
// before and after an optimizer step, each read once, the differences never written to memory.
void scan_difference_cpu(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const DifferenceArgs args(stack, num_args, num_outputs);
  ScanOutputs out = allocate_scan_outputs(args.tags.all, args.after[0], ScanOptions{});
  cpu::scan_difference(args.before.infos(), args.tags.before, args.after.infos(), args.tags.after,
                       result_pointers(out, static_cast<int64_t>(args.tags.all.size()), ScanOptions{}));
  return_outputs(stack, std::move(out));
}

// sketch(Tensor[] tensors, int buckets, int seed) -> (sketches, sumsq). Each tensor's CountSketch and
// sum of squares (common/sketch_rules.h), in one read: the update watch's copy-free ratio.
void sketch_cpu(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const TensorListArg tensors(stack[0]);
  SketchCall call = prepare_sketch(tensors, stack, num_args, num_outputs);
  cpu::sketch(call.tensors, call.tags, call.buckets, call.seed, static_cast<double*>(call.sketches.data()),
              static_cast<double*>(call.sumsq.data()));
  return_sketch(stack, std::move(call));
}

// A list argument for an ATen op: new handles of the same tensors (the op takes ownership).
StableIValue list_of(const TensorListArg& tensors) {
  StableListHandle list = nullptr;
  NANSCAN_SHIM(torch_new_list_reserve_size(tensors.size(), &list));
  for (const TensorInfo& t : tensors.infos()) NANSCAN_SHIM(torch_list_push_back(list, borrow(t.handle)));
  return torch::stable::detail::from(list);
}

// scale_(Tensor(a!)[] tensors, Tensor coef) -> (). Multiplies every tensor by coef in place, unless
// coef is exactly 1: a step that needs no clipping then costs no write pass. The multiply is ATen's
// (one _foreach_mul_, which multiplies tensor by tensor as mul_ does), so the values equal torch's
// clipping. Every entry is validated before any is written.
void scale_cpu(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const ScaleArgs args(stack, num_args, num_outputs);
  const TensorInfo& coef = args.coef;
  if (args.tensors.empty() || item_double(coef.handle) == 1.0) return;
  const NoGradGuard no_grad;
  // _foreach_mul_ takes its factor 0-dim; coef may be any one-element shape.
  const torch::stable::Tensor factor =
      coef.dim == 0 ? stable(coef.handle) : torch::stable::reshape(stable(coef.handle), {});
  StableIValue aten_args[2] = {list_of(args.tensors), torch::stable::detail::from(factor)};
  call_aten("aten::_foreach_mul_", "Tensor", aten_args);
}

// record_(rows, counter, sources, attribution, attribution_sources) -> (). One recorder append
// (nanscan/recorder.py) in one dispatch: the sources' values into row counter % capacity, the
// counter advanced. The direct kernel (cpu/record_cpu.cpp).
void record_cpu(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const RecordArgs args(stack, num_args, num_outputs);
  cpu::record(args.rows, args.counter, args.sources, args.attribution, args.attribution_sources);
}

// ---- the composite record_, for every device without a kernel of its own --------------------------

torch::stable::Tensor call_returning_tensor(const char* op, const char* overload, StableIValue* stack) {
  call_aten(op, overload, stack);
  return torch::stable::Tensor(torch::stable::detail::to<AtenTensorHandle>(stack[0]));
}

// A [1, length] row of `target`'s dtype holding the sources' values, cast as copy_ casts: one
// _foreach_copy_ into views of it, each of its source's shape (as_strided: one dispatch a view).
torch::stable::Tensor staged_row(const TensorInfo& target, const TensorListArg& sources) {
  const torch::stable::Tensor row =
      stable(empty({1, target.size(1)}, target.dtype, target.device_type, target.device_index).get());
  if (sources.empty()) return row;
  StableListHandle views = nullptr;
  NANSCAN_SHIM(torch_new_list_reserve_size(sources.size(), &views));
  int64_t offset = 0;
  for (const TensorInfo& source : sources.infos()) {
    const std::vector<int64_t> sizes(source.sizes, source.sizes + source.dim);
    std::vector<int64_t> strides(source.dim, 1);  // contiguous strides of the source's shape
    for (int64_t d = source.dim - 2; d >= 0; --d) strides[d] = strides[d + 1] * std::max<int64_t>(sizes[d + 1], 1);
    StableIValue view_args[4] = {torch::stable::detail::from(row), torch::stable::detail::from(sizes),
                                 torch::stable::detail::from(strides),
                                 torch::stable::detail::from(std::optional<int64_t>(offset))};
    call_aten("aten::as_strided", "", view_args);
    NANSCAN_SHIM(torch_list_push_back(views, view_args[0]));
    offset += source.numel;
  }
  StableIValue copy_args[3] = {torch::stable::detail::from(views), list_of(sources),
                               torch::stable::detail::from(false)};
  call_aten("aten::_foreach_copy_", "", copy_args);
  return row;
}

void index_copy_row(const TensorInfo& target, const torch::stable::Tensor& slot, const torch::stable::Tensor& row) {
  StableIValue args[4] = {borrow(target.handle), torch::stable::detail::from(int64_t{0}),
                          torch::stable::detail::from(slot), torch::stable::detail::from(row)};
  (void)call_returning_tensor("aten::index_copy_", "", args);
}

// The append in ATen ops (CUDA: each a kernel on the current stream, no host sync, capturable in a
// CUDA graph; the recorder's append did exactly these before the op existed). The order of reads and
// writes is the CPU kernel's: every source into the staging rows, then the rows, then the counter.
// counter + 1 is ~counter then its negation (the stable ABI passes no Scalar, which add_ takes);
// both wrap at 2^63 as add_ does.
void record_composite(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const RecordArgs args(stack, num_args, num_outputs);
  const NoGradGuard no_grad;
  const torch::stable::Tensor capacity =
      torch::stable::full({1}, static_cast<double>(args.rows.size(0)), torch::headeronly::ScalarType::Long,
                          std::nullopt, torch::stable::Device(stable(args.rows.handle).device()));
  StableIValue remainder_args[2] = {
      torch::stable::detail::from(torch::stable::reshape(stable(args.counter.handle), {1})),
      torch::stable::detail::from(capacity)};
  const torch::stable::Tensor slot = call_returning_tensor("aten::remainder", "Tensor", remainder_args);
  const torch::stable::Tensor row = staged_row(args.rows, args.sources);
  const torch::stable::Tensor attribution_row =
      args.attribution.has_value() ? staged_row(*args.attribution, args.attribution_sources) : row;
  index_copy_row(args.rows, slot, row);
  if (args.attribution.has_value()) index_copy_row(*args.attribution, slot, attribution_row);
  StableIValue not_args[1] = {borrow(args.counter.handle)};
  (void)call_returning_tensor("aten::bitwise_not_", "", not_args);
  StableIValue neg_args[1] = {borrow(args.counter.handle)};
  (void)call_returning_tensor("aten::neg_", "", neg_args);
}

}  // namespace
}  // namespace nanscan

STABLE_TORCH_LIBRARY(nanscan, m) {
  // fp16_range adds two rows to counts: finite values that overflow fp16, and non-zero values that
  // fp16 would flush to zero (the AMP advisor's evidence). checksum adds one: each tensor's replica
  // checksum (scan_rules.h), a value in [0, 2^32). One option or the other. total_norm_cast is
  // total_norm in the dtype torch gives this list's total norm (norm_dtype_of): what a clip divides by.
  m.def(
      "scan(Tensor[] tensors, bool fp16_range=False, bool checksum=False) -> (Tensor counts, Tensor stats, Tensor "
      "total_norm, Tensor finite, Tensor total_norm_cast)");
  // The scan's per-tensor results (no totals) written into columns [column, column + N) of counts
  // (int64 [2, W], or [4, W] with fp16_range) and stats (float64 [3, W]), which the caller keeps: a
  // scan that allocates nothing (ops.h, ScanIntoArgs).
  m.def("scan_into_(Tensor[] tensors, bool fp16_range, Tensor(a!) counts, Tensor(b!) stats, int column) -> ()");
  m.def("scale_(Tensor(a!)[] tensors, Tensor coef) -> ()");
  // The statistics of before[i] - after[i] (in before[i]'s dtype, float32 or float64, as torch's
  // subtraction rounds it), then of after[i]: 2N entries. Fused on the CPU; elsewhere the composite
  // (nanscan/_ops.py: torch's _foreach_sub, then scan).
  m.def(
      "scan_difference(Tensor[] before, Tensor[] after) -> (Tensor counts, Tensor stats, Tensor total_norm, "
      "Tensor finite, Tensor total_norm_cast)");
  // A CountSketch of each tensor (common/sketch_rules.h): its buckets, float64, all the tensors' in list
  // order (min(numel, buckets) each), and each tensor's sum of squares, float64 [N]. The update watch's
  // copy-free ratio (nanscan/updates.py). seed in [0, 2^32).
  m.def("sketch(Tensor[] tensors, int buckets, int seed) -> (Tensor sketches, Tensor sumsq)");
  m.def(
      "unscale_scan_(Tensor(a!)[] tensors, Tensor inv_scale) -> "
      "(Tensor counts, Tensor stats, Tensor total_norm, Tensor finite, Tensor total_norm_cast)");
  // A recorder's append: the sources' values (flattened, in order, cast to the rows' dtype) into row
  // counter % capacity of rows, attribution_sources' into the same row of attribution, counter + 1.
  m.def(
      "record_(Tensor(a!) rows, Tensor(b!) counter, Tensor[] sources, Tensor(c!)? attribution, "
      "Tensor[] attribution_sources) -> ()");
  // The same op, always by its composite implementation (the one non-CPU devices run): what the
  // tests compare the CPU kernel with, on the CPU.
  m.def(
      "_record_composite_(Tensor(a!) rows, Tensor(b!) counter, Tensor[] sources, Tensor(c!)? attribution, "
      "Tensor[] attribution_sources) -> ()");
}

// Every device without a record_ kernel of its own (CUDA among them) runs the composite.
STABLE_TORCH_LIBRARY_IMPL(nanscan, CompositeExplicitAutograd, m) {
  m.impl("record_", &nanscan::record_composite);
  m.impl("_record_composite_", &nanscan::record_composite);
}

STABLE_TORCH_LIBRARY_IMPL(nanscan, CPU, m) {
  m.impl("scan", &nanscan::scan_cpu);
  m.impl("scan_into_", &nanscan::scan_into_cpu);
  m.impl("scan_difference", &nanscan::scan_difference_cpu);
  m.impl("sketch", &nanscan::sketch_cpu);
  m.impl("scale_", &nanscan::scale_cpu);
  m.impl("unscale_scan_", &nanscan::unscale_scan_cpu);
  m.impl("record_", &nanscan::record_cpu);
}
