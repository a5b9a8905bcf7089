// Launcher API of the CUDA backend. Plain C++ and the CUDA runtime: no torch headers, so nvcc alone
// compiles the kernels on machines whose torch has no CUDA (CI's wheel build, on a CPU torch, does).
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "../common/scan_rules.h"
#include "list_plan.h"

namespace nanscan::cuda {

// Lists of up to this many tensors can travel inside the kernel parameters (past the 4 KB of old: up
// to 32 KB since CUDA 12.1 on sm_70+). Longer lists are read from a device copy of their blob (see
// upload_list).
int32_t max_tensors_in_parameters();

inline bool fits_in_parameters(const ListPlan& plan) { return plan.num_tensors() <= max_tensors_in_parameters(); }

// Copies a plan's blob into `device_blob` (device memory of plan.bytes(), 16-byte aligned) on
// `stream` with small kernels that carry the bytes in their parameters: no pinned host buffer, so a
// CUDA graph that captures the copy replays it correctly for as long as it lives.
cudaError_t upload_list(const ListPlan& plan, void* device_blob, cudaStream_t stream);

// The same copy of any `size` bytes (a multiple of 16) into `device` (16-byte aligned): the update
// sketch's tensor table (sketch_cuda.h).
cudaError_t upload_bytes(const void* bytes, size_t size, void* device, cudaStream_t stream);

// Which scan: the plain one, with the fp16-range counts, with the replica checksums, fused with
// GradScaler's unscale, or of differences: a plan of N befores then N afters (nanscan::scan_difference;
// befores float32 or float64, afters of the same sizes and no wider), whose 2N results are the
// differences before - after, then the afters.
enum class ScanKind { Plain, HalfRange, Unscale, Checksum, Difference };

// Whether `kind` has a kernel that takes a list in its parameters. The kinds that run on every step
// over lists whose addresses change from call to call (an activation watch's module outputs, a
// gradient list after zero_grad(set_to_none=True)) do: a device copy would be uploaded on each of
// those calls. The replica checksums (verify_replicas) and the difference scan (an update ratio's
// sampled step) read every list from its device copy, found in the binding's cache when the
// addresses repeat: each inline kernel is another instance to compile for every architecture
// (benchmarks/NOTES.md, entry 59).
constexpr bool has_inline_kernel(ScanKind kind) { return kind != ScanKind::Checksum && kind != ScanKind::Difference; }

// Whether a scan of `kind` over `plan` takes the list in its parameters; if not, the caller passes
// the blob's device copy.
inline bool list_in_parameters(const ListPlan& plan, ScanKind kind) {
  return has_inline_kernel(kind) && fits_in_parameters(plan);
}

// Device memory a scan needs (from the caching allocator; its contents need not be initialised):
// a partial-result slot and an arrival counter per (tensor, warp) pair that can meet (tensors + warps
// - 1 of each, see Shares) and a total per block: O(tensors + grid), whatever the gradients' bytes.
size_t scan_workspace_bytes(const ListPlan& plan, ScanKind kind, int num_sms);

// One launch (after one memset of its counters) scans every tensor of the plan into `out`: each
// tensor's result is written by the warp that finishes it, and the last block writes the totals.
// `device_blob` is null when list_in_parameters(plan, kind), else the plan's device copy.
// Graph-capturable: no host sync, no allocation, and the counters are zeroed by the captured memset.
// With ScanKind::Unscale, every element is first replaced in place by round(x * *multiply_by) as
// GradScaler's unscale does (not for float8), in the same pass, and the statistics are of the
// products.
cudaError_t scan(const ListPlan& plan, const void* device_blob, ScanKind kind, const ResultPointers& out,
                 void* workspace, size_t workspace_bytes, int num_sms, cudaStream_t stream,
                 const float* multiply_by = nullptr);

// How scale() treats its coefficient, mirroring the torch op it stands in for.
enum class CoefRounding {
  ToTensorDtype,  // tensor.mul_(coef_tensor): the coefficient is cast to the tensor's dtype first
  None,           // GradScaler's unscale: the float coefficient multiplies in float (double for fp64)
};

// Multiplies every tensor of the plan in place by *coef (a device scalar of dtype coef_dtype),
// computing in the tensor's Wide type and rounding once, as torch does. Blocks read the coefficient
// first and return at once when it is exactly 1, so a step that needs no clipping writes nothing.
// Float8 tensors are rejected (cudaErrorInvalidValue), as torch's mul_ rejects them. `device_blob`
// is null when fits_in_parameters(plan), else the plan's device copy.
cudaError_t scale(const ListPlan& plan, const void* device_blob, const void* coef, DType coef_dtype,
                  CoefRounding rounding, int num_sms, cudaStream_t stream);

}  // namespace nanscan::cuda
