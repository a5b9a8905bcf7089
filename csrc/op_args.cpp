// The ops' argument checks and outputs, shared by the CPU library (ops.cpp) and every CUDA library
// (cuda_binding.cpp): one definition of each rule, compiled into each library (their symbols are
// hidden, so the copies never meet).
#include <optional>
#include <string>
#include <vector>

#include "ops.h"
#include "torch_api.h"

namespace nanscan {

void check_stack(uint64_t num_args, uint64_t num_outputs, uint64_t expected_args, uint64_t expected_outputs,
                 const char* op) {
  NANSCAN_CHECK(num_args == expected_args && num_outputs == expected_outputs, op, ": registered with ", num_args,
                " arguments and ", num_outputs, " outputs, but its kernel takes ", expected_args, " and returns ",
                expected_outputs);
}

std::vector<DType> check_scan_inputs(const TensorListArg& tensors, const char* op, const char* list) {
  NANSCAN_CHECK(!tensors.empty(), op, ": expected at least one tensor");
  std::vector<DType> tags;
  tags.reserve(tensors.size());
  const TensorInfo& first = tensors[0];
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInfo& t = tensors[i];
    NANSCAN_CHECK(t.defined, op, ": ", list, "[", i, "] is undefined (None)");
    NANSCAN_CHECK(t.strided(), op, ": ", list, "[", i, "] has layout ", layout_name(t.layout),
                  "; only dense (strided) tensors can be scanned");
    NANSCAN_CHECK(t.same_device(first), op, ": ", list, "[", i, "] is on ", t.device(), " but ", list, "[0] is on ",
                  first.device(), "; call once per device (nanscan.scan groups by device for you)");
    NANSCAN_CHECK(t.dim <= kMaxDims, op, ": ", list, "[", i, "] has ", t.dim, " dimensions; at most ", kMaxDims,
                  " are supported");
    const std::optional<DType> tag = dtype_tag(t.dtype);
    NANSCAN_CHECK(tag.has_value(), op, ": ", list, "[", i, "] has dtype ", dtype_name(t.dtype),
                  "; supported: float32, float64, float16, bfloat16, float8_e4m3fn, float8_e5m2");
    tags.push_back(*tag);
  }
  return tags;
}

bool same_dense_layout(const TensorInfo& a, const TensorInfo& b) {
  if (!a.dense || !b.dense || a.dim != b.dim) return false;
  for (int64_t d = 0; d < a.dim; ++d) {
    if (a.sizes[d] > 1 && a.strides[d] != b.strides[d]) return false;
  }
  return true;
}

void check_difference_pairs(const TensorListArg& before, const std::vector<DType>& before_tags,
                            const TensorListArg& after, const std::vector<DType>& after_tags, const char* op) {
  NANSCAN_CHECK(before.size() == after.size(), op, ": before holds ", before.size(), " tensors and after ",
                after.size(), "; one before per after");
  NANSCAN_CHECK(before[0].same_device(after[0]), op, ": before is on ", before[0].device(), " but after is on ",
                after[0].device());
  for (size_t i = 0; i < before.size(); ++i) {
    const TensorInfo& b = before[i];
    const TensorInfo& a = after[i];
    NANSCAN_CHECK(keeps_differences(before_tags[i]), op, ": before[", i, "] has dtype ", dtype_name(b.dtype),
                  "; the differences are kept in float32 or float64");
    NANSCAN_CHECK(no_wider_than(after_tags[i], before_tags[i]), op, ": after[", i, "] is float64 but before[", i,
                  "] is float32: keep a float64 tensor's copy in float64");
    bool same_shape = b.dim == a.dim;
    for (int64_t d = 0; same_shape && d < a.dim; ++d) same_shape = b.sizes[d] == a.sizes[d];
    NANSCAN_CHECK(same_shape, op, ": before[", i, "] has shape ", shape_string(b.sizes, b.dim), " but after[", i,
                  "] has shape ", shape_string(a.sizes, a.dim));
  }
}

void check_multipliable(const std::vector<DType>& tags, const char* op) {
  for (size_t i = 0; i < tags.size(); ++i) {
    NANSCAN_CHECK(tags[i] != DType::Float8E4M3FN && tags[i] != DType::Float8E5M2, op, ": tensors[", i,
                  "] is float8; torch cannot multiply float8 tensors either");
  }
}

// torch's own rule and message (ATen's assert_no_internal_overlap): a tensor that is not dense and
// has a dimension of stride 0 and size > 1 repeats an element.
void check_writable(const TensorInfo& t) {
  if (t.numel <= 1 || t.dense) return;
  for (int64_t d = 0; d < t.dim; ++d) {
    NANSCAN_CHECK(!(t.strides[d] == 0 && t.sizes[d] > 1),
                  "unsupported operation: more than one element of the written-to tensor refers to a single memory "
                  "location. Please clone() the tensor before performing the operation.");
  }
}

void check_writable(const TensorListArg& tensors) {
  for (const TensorInfo& t : tensors.infos()) check_writable(t);
}

ScanArgs::ScanArgs(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) : tensors(stack[0]) {
  constexpr const char* kOp = "nanscan.scan";
  check_stack(num_args, num_outputs, 3, 5, kOp);
  const bool fp16_range = bool_arg(stack[1]);
  const bool checksum = bool_arg(stack[2]);
  NANSCAN_CHECK(!(fp16_range && checksum), kOp, ": fp16_range and checksum are separate scans; ask for one");
  options = ScanOptions{fp16_range, checksum};
  tags = check_scan_inputs(tensors, kOp);
}

UnscaleScanArgs::UnscaleScanArgs(StableIValue* stack, uint64_t num_args, uint64_t num_outputs)
    : tensors(stack[0]), inv_scale_tensor(tensor_arg(stack[1])), inv_scale(TensorInfo::of(inv_scale_tensor.get())) {
  constexpr const char* kOp = "nanscan.unscale_scan_";
  check_stack(num_args, num_outputs, 2, 5, kOp);
  tags = check_scan_inputs(tensors, kOp);
  check_multipliable(tags, kOp);
  check_writable(tensors);
  NANSCAN_CHECK(inv_scale.defined && inv_scale.strided(), kOp, ": inv_scale must be a dense (strided) tensor, got ",
                inv_scale.defined ? layout_name(inv_scale.layout) : std::string("None"));
  NANSCAN_CHECK(inv_scale.numel == 1 && inv_scale.dtype == dtype_codes().float32, kOp,
                ": inv_scale must be a one-element float32 tensor (as GradScaler makes it), got ",
                dtype_name(inv_scale.dtype), " of shape ", shape_string(inv_scale.sizes, inv_scale.dim));
  NANSCAN_CHECK(inv_scale.same_device(tensors[0]), kOp, ": inv_scale is on ", inv_scale.device(),
                " but the tensors are on ", tensors[0].device());
}

ScaleArgs::ScaleArgs(StableIValue* stack, uint64_t num_args, uint64_t num_outputs)
    : tensors(stack[0]), coef_tensor(tensor_arg(stack[1])), coef(TensorInfo::of(coef_tensor.get())) {
  constexpr const char* kOp = "nanscan.scale_";
  check_stack(num_args, num_outputs, 2, 0, kOp);
  NANSCAN_CHECK(coef.defined && coef.strided(), kOp, ": coef must be a dense (strided) tensor, got ",
                coef.defined ? layout_name(coef.layout) : std::string("None"));
  NANSCAN_CHECK(coef.numel == 1, kOp, ": coef must have one element, got shape ", shape_string(coef.sizes, coef.dim));
  NANSCAN_CHECK(dtype_tag(coef.dtype).has_value(), kOp, ": coef has unsupported dtype ", dtype_name(coef.dtype));
  if (tensors.empty()) return;
  tags = check_scan_inputs(tensors, kOp);
  check_multipliable(tags, kOp);
  check_writable(tensors);
  NANSCAN_CHECK(coef.same_device(tensors[0]), kOp, ": coef is on ", coef.device(), " but the tensors are on ",
                tensors[0].device());
}

DifferenceArgs::DifferenceArgs(StableIValue* stack, uint64_t num_args, uint64_t num_outputs)
    : before(stack[0]), after(stack[1]) {
  constexpr const char* kOp = "nanscan.scan_difference";
  check_stack(num_args, num_outputs, 2, 5, kOp);
  tags.before = check_scan_inputs(before, kOp, "before");
  tags.after = check_scan_inputs(after, kOp, "after");
  check_difference_pairs(before, tags.before, after, tags.after, kOp);
  tags.all = tags.before;
  tags.all.insert(tags.all.end(), tags.after.begin(), tags.after.end());
}

SketchCall prepare_sketch(const TensorListArg& tensors, StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  constexpr const char* op = "nanscan.sketch";
  check_stack(num_args, num_outputs, 3, 2, op);
  const auto buckets = torch::stable::detail::to<int64_t>(stack[1]);
  const auto seed = torch::stable::detail::to<int64_t>(stack[2]);
  SketchCall call{check_scan_inputs(tensors, op), {}, {}, buckets, 0, {}, {}};
  NANSCAN_CHECK(valid_sketch_buckets(buckets), op, ": buckets must be a power of two in [", kMinSketchBuckets, ", ",
                kMaxSketchBuckets, "], got ", buckets);
  NANSCAN_CHECK(seed >= 0 && seed <= int64_t{UINT32_MAX}, op, ": seed must be in [0, 2^32), got ", seed);
  call.seed = static_cast<uint32_t>(seed);
  int64_t total = 0;
  call.tensors.reserve(tensors.size());
  for (const TensorInfo& t : tensors.infos()) {
    if (t.numel > 0 && !is_contiguous(t)) {
      call.copies.push_back(contiguous(t.handle));
      call.tensors.push_back(TensorInfo::of(call.copies.back().get()));
    } else {
      call.tensors.push_back(t);
    }
    total += sketch_buckets_of(t.numel, buckets);
  }
  const TensorInfo& first = tensors[0];
  call.sketches = empty({total}, dtype_codes().float64, first.device_type, first.device_index);
  call.sumsq =
      empty({static_cast<int64_t>(tensors.size())}, dtype_codes().float64, first.device_type, first.device_index);
  return call;
}

void return_sketch(StableIValue* stack, SketchCall call) {
  set_output(stack, 0, std::move(call.sketches));
  set_output(stack, 1, std::move(call.sumsq));
}

DType norm_dtype_of(const std::vector<DType>& tags) {
  // The float lattice of torch's promote_types, float8 counted as float32: float64 wins, then
  // float32; float16 with bfloat16 gives float32; one half type alone stays itself.
  const auto counted = [](DType t) { return t == DType::Float8E4M3FN || t == DType::Float8E5M2 ? DType::Float32 : t; };
  DType dtype = counted(tags[0]);
  for (DType tag : tags) {
    const DType t = counted(tag);
    if (t == dtype) continue;
    if (t == DType::Float64 || dtype == DType::Float64) {
      dtype = DType::Float64;
    } else {
      dtype = DType::Float32;  // two different types among float32, float16, bfloat16
    }
  }
  return dtype;
}

ScanOutputs allocate_scan_outputs(const std::vector<DType>& tags, const TensorInfo& like, ScanOptions options) {
  const int64_t num_tensors = static_cast<int64_t>(tags.size());
  const int64_t count_rows = 2 + (options.half_range ? 2 : 0) + (options.checksum ? 1 : 0);
  const DTypeCodes& c = dtype_codes();
  const int32_t type = like.device_type;
  const int32_t index = like.device_index;
  return ScanOutputs{empty({count_rows, num_tensors}, c.int64, type, index),
                     empty({3, num_tensors}, c.float64, type, index), empty({}, c.float64, type, index),
                     empty({}, c.boolean, type, index), empty({}, dtype_code(norm_dtype_of(tags)), type, index)};
}

void return_outputs(StableIValue* stack, ScanOutputs o) {
  set_output(stack, 0, std::move(o.counts));
  set_output(stack, 1, std::move(o.stats));
  set_output(stack, 2, std::move(o.total_norm));
  set_output(stack, 3, std::move(o.finite));
  set_output(stack, 4, std::move(o.total_norm_cast));
}

ResultPointers result_pointers(const ScanOutputs& o, int64_t num_tensors, ScanOptions options) {
  int32_t cast_dtype = 0;
  NANSCAN_SHIM(aoti_torch_get_dtype(o.total_norm_cast.get(), &cast_dtype));
  return ResultPointers{static_cast<int64_t*>(o.counts.data()),
                        static_cast<double*>(o.stats.data()),
                        static_cast<double*>(o.total_norm.data()),
                        static_cast<bool*>(o.finite.data()),
                        num_tensors,
                        num_tensors,
                        options.half_range,
                        options.checksum,
                        o.total_norm_cast.data(),
                        *dtype_tag(cast_dtype)};
}

ScanIntoArgs::ScanIntoArgs(StableIValue* stack, uint64_t num_args, uint64_t num_outputs)
    : tensors(stack[0]), counts_tensor(tensor_arg(stack[2])), stats_tensor(tensor_arg(stack[3])) {
  constexpr const char* kOp = "nanscan.scan_into_";
  check_stack(num_args, num_outputs, 5, 0, kOp);
  const bool fp16_range = bool_arg(stack[1]);
  const auto column = torch::stable::detail::to<int64_t>(stack[4]);
  tags = check_scan_inputs(tensors, kOp);
  const TensorInfo& first = tensors[0];
  const auto n = static_cast<int64_t>(tensors.size());
  const int64_t count_rows = fp16_range ? 4 : 2;
  // One rule for both buffers: defined, dense, 2-D [rows, W] of its dtype, contiguous, on the tensors' device.
  const auto check_buffer = [&](const TensorInfo& t, const char* name, int32_t dtype, int64_t rows) {
    NANSCAN_CHECK(t.defined, kOp, ": ", name, " is undefined (None)");
    NANSCAN_CHECK(t.strided(), kOp, ": ", name, " has layout ", layout_name(t.layout),
                  "; expected a dense (strided) tensor");
    NANSCAN_CHECK(t.dtype == dtype, kOp, ": ", name, " has dtype ", dtype_name(t.dtype), "; expected ",
                  dtype_name(dtype));
    NANSCAN_CHECK(t.dim == 2 && t.size(0) == rows, kOp, ": ", name, " must be 2-D [", rows, ", width]",
                  rows == 4 ? " (fp16_range adds two rows of counts)" : "", ", got shape ",
                  shape_string(t.sizes, t.dim));
    NANSCAN_CHECK(is_contiguous(t), kOp, ": ", name, " must be contiguous (its columns are written in place)");
    NANSCAN_CHECK(t.same_device(first), kOp, ": ", name, " is on ", t.device(), " but the tensors are on ",
                  first.device());
  };
  const TensorInfo counts = TensorInfo::of(counts_tensor.get());
  const TensorInfo stats = TensorInfo::of(stats_tensor.get());
  check_buffer(counts, "counts", dtype_codes().int64, count_rows);
  check_buffer(stats, "stats", dtype_codes().float64, 3);
  const int64_t width = counts.size(1);
  NANSCAN_CHECK(stats.size(1) == width, kOp, ": counts has ", width, " columns but stats has ", stats.size(1),
                "; a tensor's results go in the same column of both");
  NANSCAN_CHECK(column >= 0 && column <= width - n, kOp, ": the ", n, " tensors' columns [", column, ", ", column + n,
                ") do not lie within the ", width, " columns of counts and stats");
  out = ResultPointers{static_cast<int64_t*>(counts.data) + column,
                       static_cast<double*>(stats.data) + column,
                       nullptr,  // no totals
                       nullptr,
                       n,
                       width,
                       fp16_range,
                       false,
                       nullptr,
                       DType::Float32};
}

}  // namespace nanscan
