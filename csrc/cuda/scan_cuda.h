// Launcher API of the CUDA backend. Plain C++ and the CUDA runtime: no torch headers, so nvcc alone
// compiles the kernels on machines whose torch has no CUDA (tools/check_cuda_build.sh does, in CI).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../common/scan_rules.h"

namespace nanscan::cuda {

// One tensor as the kernels see it: a dense span of `numel` elements of `dtype` starting at `data`.
struct TensorArg {
  const void* data;
  int64_t numel;
  DType dtype;
};

// Device memory the caller provides for one scan call (from the caching allocator; contents need not
// be initialised). Its size depends only on the tensor sizes.
size_t scan_workspace_bytes(const TensorArg* tensors, int64_t num_tensors);

// Scans `tensors` (a host array) into `out` (device pointers) on `stream`: one launch per
// kMaxTensorsPerLaunch tensors (one launch for any list of up to that many), each finishing its own
// tensors in its last block, the last launch also writing the totals. Graph-capturable: no host sync,
// no allocation, and the only state carried between blocks (a ticket per launch) is reset by a memset
// node in the same call.
// With `multiply_by` (a device float; not with the fp16-range option, and not for float8), every
// element is first replaced in place by round(x * *multiply_by) as GradScaler's unscale does, in the
// same pass, and the statistics are of the products.
cudaError_t scan(const TensorArg* tensors, int64_t num_tensors, const ResultPointers& out, void* workspace,
                 int num_sms, cudaStream_t stream, const float* multiply_by = nullptr);

// How scale() treats its coefficient, mirroring the torch op it stands in for.
enum class CoefRounding {
  ToTensorDtype,  // tensor.mul_(coef_tensor): the coefficient is cast to the tensor's dtype first
  None,           // GradScaler's unscale: the float coefficient multiplies in float (double for fp64)
};

// Multiplies every tensor in place by *coef (a device scalar of dtype coef_dtype), computing in the
// tensor's Wide type and rounding once, as torch does. Blocks read the coefficient first and return at
// once when it is exactly 1, so a step that needs no clipping writes nothing.
// Float8 tensors are rejected (cudaErrorInvalidValue), as torch's mul_ rejects them.
cudaError_t scale(const TensorArg* tensors, int64_t num_tensors, const void* coef, DType coef_dtype,
                  CoefRounding rounding, int num_sms, cudaStream_t stream);

}  // namespace nanscan::cuda
