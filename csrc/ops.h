// Shared by the op layer and the device bindings: input validation, dtype tags, output allocation.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/core/TensorBody.h>

#include <optional>
#include <vector>

#include "common/scan_rules.h"

namespace nanscan {

struct ScanOutputs {
  at::Tensor counts;      // int64 [2, N]
  at::Tensor stats;       // float64 [3, N]
  at::Tensor total_norm;  // float64 []
  at::Tensor finite;      // bool []
};

std::optional<DType> dtype_tag(at::ScalarType t);

// Checks every entry (defined, strided, one device, supported dtype) and returns the dtype tags.
// Errors name the offending index.
std::vector<DType> check_scan_inputs(at::TensorList tensors, const char* op);

ScanOutputs allocate_scan_outputs(int64_t num_tensors, const at::TensorOptions& device);

ResultPointers result_pointers(const ScanOutputs& outputs, int64_t num_tensors);

}  // namespace nanscan
