// Shared by the op layer and the device bindings: input validation, dtype tags, output allocation.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/TensorBody.h>

#include <optional>
#include <tuple>
#include <vector>

#include "common/scan_rules.h"

namespace nanscan {

struct ScanOutputs {
  at::Tensor counts;           // int64 [2, N]; [4, N] with the fp16-range counts; [3, N] with the checksums
  at::Tensor stats;            // float64 [3, N]
  at::Tensor total_norm;       // float64 []
  at::Tensor finite;           // bool []
  at::Tensor total_norm_cast;  // [] of norm_dtype_of(tensors): total_norm as torch's .to() rounds it
};

// What the scan ops return, in the schema's order.
using ScanResultTuple = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

ScanResultTuple as_tuple(const ScanOutputs& outputs);

std::optional<DType> dtype_tag(at::ScalarType t);

// The dtype torch's get_total_norm gives the norm of these tensors: their dtypes promoted, float8
// counted as float32 (torch has no float8 norm to promote). nanscan/_ops.py's norm_dtype states the
// same rule for the fake kernels; tests/test_ops.py compares the two.
at::ScalarType norm_dtype_of(at::TensorList tensors);

// Checks every entry (defined, strided, one device, supported dtype) and returns the dtype tags.
// Errors name the offending index.
std::vector<DType> check_scan_inputs(at::TensorList tensors, const char* op);

// Rejects float8 tensors for ops that write (torch has no float8 arithmetic to match).
void check_multipliable(at::TensorList tensors, const std::vector<DType>& tags, const char* op);

// Kernels that write tensors directly (not through ATen ops) bump the version counters themselves, so
// that autograd (and anything else that keys on versions) sees the change. Non-dense tensors are written
// through ATen, which bumps them already.
void bump_versions_of_dense(at::TensorList tensors);

// Rejects, with torch's messages, tensors an in-place multiply refuses: elements that share memory
// (expanded views) and inference tensors outside inference mode. Ops that write call it for every
// entry before writing any.
void check_writable(at::TensorList tensors);

// Everything scale_ needs of its arguments (the scan's checks, multipliable, writable, coef: one
// element of a supported dtype on the tensors' device); returns the dtype tags.
std::vector<DType> check_scale_inputs(at::TensorList tensors, const at::Tensor& coef, const char* op);

// inv_scale must be a one-element float32 tensor on the tensors' device.
void check_inv_scale(const at::Tensor& inv_scale, const at::Tensor& first, const char* op);

// What a scan computes besides the statistics: the fp16-range counts, or the replica checksums.
struct ScanOptions {
  bool half_range = false;
  bool checksum = false;
};

// The options of scan(fp16_range, checksum), refused when both are asked for.
ScanOptions scan_options(bool fp16_range, bool checksum);

// Everything record_ needs of its arguments, on every device, before anything is written: rows (and
// attribution) 2-D float32/float64 with the same number of rows, counter one int64, every source on
// their device with a supported dtype, the sources' elements exactly filling one row of each.
// Errors name the offending argument.
void check_record_inputs(const at::Tensor& rows, const at::Tensor& counter, at::TensorList sources,
                         const std::optional<at::Tensor>& attribution, at::TensorList attribution_sources);

// The outputs of a scan of `tensors` (already checked: at least one) on `device`.
ScanOutputs allocate_scan_outputs(at::TensorList tensors, const at::TensorOptions& device, ScanOptions options);

ResultPointers result_pointers(const ScanOutputs& outputs, int64_t num_tensors, ScanOptions options);

}  // namespace nanscan
