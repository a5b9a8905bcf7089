// CPU backend of the scan: one call over a whole list of CPU tensors.
#pragma once

#include <optional>
#include <vector>

#include "../common/scan_rules.h"
#include "../torch_api.h"

namespace nanscan::cpu {

// Fills `out` for `tensors` (all on the CPU, dtypes[i] the tag of tensors[i]). Work is split into
// byte-sized chunks fixed by the tensor sizes alone, scanned in parallel, and combined in chunk order,
// so the result does not depend on the thread count. Non-contiguous tensors are read in place.
// With `multiply_dense_by`, every dense tensor is first multiplied in place (fused into the same pass;
// the caller multiplies non-dense ones beforehand), and the statistics are of the products.
// Tensors have at most kMaxDims (ops.h) dimensions: the strided reader keeps an index per dimension
// on the stack.
void scan(const std::vector<TensorInfo>& tensors, const std::vector<DType>& dtypes, const ResultPointers& out,
          std::optional<float> multiply_dense_by = std::nullopt);

// Fills `out` for 2N tensors: first the differences before[i] - after[i] (each in before[i]'s dtype,
// float32 or float64, rounded once as torch's subtraction rounds it; after[i] of that dtype or a
// narrower one, of the same shape), then after[i] themselves. Each pair is read once and nothing is
// written: the differences live run by run in a stack buffer. Chunked and combined as scan() is.
void scan_difference(const std::vector<TensorInfo>& before, const std::vector<DType>& before_dtypes,
                     const std::vector<TensorInfo>& after, const std::vector<DType>& after_dtypes,
                     const ResultPointers& out);

// Fills `sketches` (every tensor's sketch_buckets_of(numel, k) buckets, in list order) and `sumsq` (each
// tensor's sum of squares, in float64) with the CountSketch of common/sketch_rules.h; tensor i is hashed
// with sketch_tensor_seed(seed, i). Tensors are contiguous (the op copies others first). Chunked and
// combined as scan() is, so the bits depend on the tensors alone.
void sketch(const std::vector<TensorInfo>& tensors, const std::vector<DType>& dtypes, int64_t k, uint32_t seed,
            double* sketches, double* sumsq);

}  // namespace nanscan::cpu
