// Launcher API of the CUDA update sketch (nanscan::sketch; the rule: common/sketch_rules.h). Plain C++
// and the CUDA runtime, as scan_cuda.h, so that nvcc alone compiles it and tests/cuda_emulator runs it.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <vector>

#include "../common/sketch_rules.h"
#include "list_plan.h"

namespace nanscan::cuda {

// Elements of a tensor of more than k elements that one warp sketches into its shared buckets before
// adding them to the output: k atomic adds per 16,384 elements, and a GPT-2's weights still cut into
// more units than an H100 has warps.
constexpr int64_t kSketchUnitElements = 16 * 1024;

// A tensor of at most k elements is one unit (its values are its buckets); others one per
// kSketchUnitElements.
NANSCAN_HD int64_t sketch_units(int64_t numel, int64_t k) {
  return numel <= k ? 1 : ceil_div(numel, kSketchUnitElements);
}

// One tensor of a sketch call, as the kernel reads it from its device table.
struct SketchTensor {
  const void* data;  // contiguous, numel elements of dtype
  int64_t numel;
  int64_t out_offset;  // its first bucket in the output
  int64_t unit_begin;  // its first unit of work; the table's units are numbered tensor by tensor
  int32_t dtype;       // DType
  int32_t unused;
};

// A list's table (to be copied to the device: upload_bytes) and its totals.
struct SketchTable {
  std::vector<SketchTensor> tensors;
  int64_t units = 0;
  int64_t buckets = 0;  // the output's length: sketch_buckets_of(numel, k) summed
};

SketchTable sketch_table(const TensorArg* tensors, int64_t n, int64_t k);

// Zeroes `sketches` and `sumsq` and launches the kernel that fills them: every tensor's buckets and
// sum of squares (common/sketch_rules.h), tensor i hashed with sketch_tensor_seed(seed, i).
// `device_table` is table.tensors in device memory. The units' contributions to a bucket are added
// by atomics in no fixed order, so the last bits of a bucket vary from call to call (float64: about
// 1e-16 of the values summed). No host sync, no allocation: graph-capturable.
cudaError_t sketch(const SketchTable& table, const SketchTensor* device_table, int64_t k, uint32_t seed,
                   double* sketches, double* sumsq, int num_sms, cudaStream_t stream);

}  // namespace nanscan::cuda
