// Shared by the op layer and the device bindings: input validation, output allocation, the boxed
// kernels' argument handling. Every tensor is seen through torch_api.h (the stable ABI).
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "common/scan_rules.h"
#include "common/sketch_rules.h"
#include "torch_api.h"

namespace nanscan {

// Tensors with more dimensions than this are rejected (the CPU's strided reader keeps an index per
// dimension on the stack).
constexpr int64_t kMaxDims = 64;

struct ScanOutputs {
  OwnedTensor counts;           // int64 [2, N]; [4, N] with the fp16-range counts; [3, N] with the checksums
  OwnedTensor stats;            // float64 [3, N]
  OwnedTensor total_norm;       // float64 []
  OwnedTensor finite;           // bool []
  OwnedTensor total_norm_cast;  // [] of norm_dtype_of(tensors): total_norm as torch's .to() rounds it
};

// Puts the outputs on the dispatcher's stack, in the schema's order.
void return_outputs(StableIValue* stack, ScanOutputs outputs);

// The dtype torch's get_total_norm gives the norm of these tensors: their dtypes promoted, float8
// counted as float32 (torch has no float8 norm to promote). nanscan/_ops.py's norm_dtype states the
// same rule for the fake kernels; tests/test_ops.py compares the two.
DType norm_dtype_of(const std::vector<DType>& tags);

// Checks every entry (defined, strided, one device, supported dtype) and returns the dtype tags.
// Errors name the offending entry, as `list`[index].
std::vector<DType> check_scan_inputs(const TensorListArg& tensors, const char* op, const char* list = "tensors");

// scan_difference's pairs: as many befores as afters, on one device, each before float32 or float64
// and its after of the same shape and no wider dtype (the difference is computed in before's).
void check_difference_pairs(const TensorListArg& before, const std::vector<DType>& before_tags,
                            const TensorListArg& after, const std::vector<DType>& after_tags, const char* op);

// scan_difference's dtype tags: the befores', the afters', and both in the outputs' order.
struct DifferenceTags {
  std::vector<DType> before;
  std::vector<DType> after;
  std::vector<DType> all;  // the befores' then the afters'
};

// Whether a pair's elements lie in the same order in memory, each tensor dense: then they are paired
// by memory offset, whatever the order of the dimensions (scan_difference's backends read such pairs
// in place).
bool same_dense_layout(const TensorInfo& a, const TensorInfo& b);

// sketch's arguments, checked as every backend checks them (the list as a scan's; buckets a power of two
// in [64, 4096]; seed in [0, 2^32)), each tensor as the kernels read it: in logical order, contiguous
// (a copy, owned here, of one that is not), and the outputs: every tensor's buckets (float64
// [sum of sketch_buckets_of]) and sums of squares (float64 [N]) on the tensors' device.
struct SketchCall {
  std::vector<DType> tags;
  std::vector<TensorInfo> tensors;  // contiguous: the arguments, or the copies below
  std::vector<OwnedTensor> copies;
  int64_t buckets;
  uint32_t seed;
  OwnedTensor sketches;
  OwnedTensor sumsq;
};
// The call's arguments read from a boxed kernel's stack (after `tensors`, stack[0]: buckets, seed),
// checked; and its outputs put back on the stack, in the schema's order.
SketchCall prepare_sketch(const TensorListArg& tensors, StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
void return_sketch(StableIValue* stack, SketchCall call);

// Rejects float8 tensors for ops that write (torch has no float8 arithmetic to match).
void check_multipliable(const std::vector<DType>& tags, const char* op);

// Rejects, with torch's message, a tensor an in-place multiply refuses because its elements share
// memory (an expand()ed view: one location would be multiplied several times). Ops that write check
// every entry before writing any. (Inference tensors outside inference mode are refused before the
// kernel, with torch's message, by nanscan/_ops.py: the stable ABI cannot see that a tensor is one.)
void check_writable(const TensorInfo& t);
void check_writable(const TensorListArg& tensors);

// What a scan computes besides the statistics: the fp16-range counts, or the replica checksums.
struct ScanOptions {
  bool half_range = false;
  bool checksum = false;
};

// The outputs of a scan of tensors with these tags (at least one) on the device of `like`.
ScanOutputs allocate_scan_outputs(const std::vector<DType>& tags, const TensorInfo& like, ScanOptions options);

ResultPointers result_pointers(const ScanOutputs& outputs, int64_t num_tensors, ScanOptions options);

// The list ops' arguments, one struct an op: read from a boxed kernel's stack and checked by its
// constructor as every backend checks them, everything before anything is written. The CPU library
// (ops.cpp) and each CUDA library (cuda_binding.cpp) differ only in what they then run.

// scan(Tensor[] tensors, bool fp16_range, bool checksum) -> 5 tensors: at least one tensor, each
// defined, dense, of a supported dtype, all on one device (check_scan_inputs); fp16_range and checksum
// are separate scans, refused together.
struct ScanArgs {
  TensorListArg tensors;
  ScanOptions options;
  std::vector<DType> tags;
  ScanArgs(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
};

// unscale_scan_(Tensor(a!)[] tensors, Tensor inv_scale) -> 5 tensors: the tensors as a scan's, each
// of a dtype torch multiplies (no float8) and writable; inv_scale one float32 element on their device,
// as GradScaler makes it.
struct UnscaleScanArgs {
  TensorListArg tensors;
  OwnedTensor inv_scale_tensor;
  TensorInfo inv_scale;
  std::vector<DType> tags;
  UnscaleScanArgs(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
};

// scale_(Tensor(a!)[] tensors, Tensor coef) -> (): coef one element of a supported dtype, dense; the
// tensors, none at all or as unscale_scan_'s, on coef's device. `tags` is empty for an empty list.
struct ScaleArgs {
  TensorListArg tensors;
  OwnedTensor coef_tensor;
  TensorInfo coef;
  std::vector<DType> tags;
  ScaleArgs(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
};

// scan_difference(Tensor[] before, Tensor[] after) -> 5 tensors: each list as a scan's, then the
// pairs (check_difference_pairs).
struct DifferenceArgs {
  TensorListArg before;
  TensorListArg after;
  DifferenceTags tags;
  DifferenceArgs(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
};

// scan_into_(Tensor[] tensors, bool fp16_range, Tensor(a!) counts, Tensor(b!) stats, int column) -> ():
// the scan's per-tensor results written into columns [column, column + N) of buffers the caller
// keeps, with no totals and nothing allocated (the activation watch's call per module:
// nanscan/activations.py). The tensors as a scan's; counts int64 [2 or, with fp16_range, 4, W] and
// stats float64 [3, W], both contiguous on the tensors' device; the N columns inside the W. `out`
// points at the first of them.
struct ScanIntoArgs {
  TensorListArg tensors;
  OwnedTensor counts_tensor, stats_tensor;
  std::vector<DType> tags;
  ResultPointers out{};
  ScanIntoArgs(StableIValue* stack, uint64_t num_args, uint64_t num_outputs);
};

// The boxed kernels' arguments: checks the counts the schema promises (a kernel registered for a
// schema it does not match would misread the stack).
void check_stack(uint64_t num_args, uint64_t num_outputs, uint64_t expected_args, uint64_t expected_outputs,
                 const char* op);

}  // namespace nanscan
