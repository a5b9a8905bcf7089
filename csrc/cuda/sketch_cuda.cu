// The CUDA update sketch (nanscan::sketch, behind watch_updates(sketch=k)): each tensor's CountSketch
// and sum of squares in one read (the rule: common/sketch_rules.h).
//
// The list is cut into units: a tensor of at most k elements is one (a warp writes its values as its
// buckets), a larger one a unit per kSketchUnitElements. A warp takes units in turn; for a unit of a
// large tensor it adds the unit's blocks of 64 elements into k buckets of its own in shared memory
// (lane l takes a block's elements l and l + 32, whose buckets no other lane touches until the warp
// synchronises), then adds its buckets to the output with one atomic each. The sums of squares go by
// one atomic per unit.
#include "sketch_cuda.h"

#include <algorithm>

#ifndef NANSCAN_LAUNCH
#define NANSCAN_LAUNCH(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif

namespace nanscan::cuda {
namespace {

constexpr int kWarpSize = 32;
// Blocks of 64 elements a warp loads before adding them: 1.5 KB of fp32 in flight per warp, at 80
// registers for the four-warp shape (six resident blocks, as its shared memory allows; eight blocks
// took 96).
constexpr int kSketchBlocksInFlight = 6;

struct SketchParams {
  const SketchTensor* tensors;
  int32_t num_tensors;
  int64_t units;
  int64_t k;
  uint32_t seed;
  double* sketches;
  double* sumsq;
};

__device__ double warp_sum(double v) {
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

// The tensor whose units hold unit u: the last t with unit_begin <= u.
__device__ int32_t tensor_of_unit(const SketchParams& p, int64_t u) {
  int32_t lo = 0, hi = p.num_tensors - 1;
  while (lo < hi) {
    const int32_t mid = lo + (hi - lo + 1) / 2;
    if (p.tensors[mid].unit_begin <= u) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// One unit of tensor `index`; returns this lane's share of its sum of squares. `mine`: the warp's
// k + kSketchBlock shared buckets (the spill past k - 1 is folded back onto buckets 0..63).
template <class Codec>
__device__ double sketch_unit(const SketchParams& p, const SketchTensor& t, int32_t index, int64_t unit, double* mine,
                              int lane) {
  const auto* data = static_cast<const typename Codec::Raw*>(t.data);
  double ss = 0.0;
  if (t.numel <= p.k) {  // its values are its buckets
    for (int64_t e = lane; e < t.numel; e += kWarpSize) {
      const auto v = static_cast<double>(Codec::decode(data[e]));
      p.sketches[t.out_offset + e] = v;
      ss += v * v;
    }
    return ss;
  }
  const int64_t k = p.k;
  for (int64_t b = lane; b < k + kSketchBlock; b += kWarpSize) mine[b] = 0.0;
  __syncwarp();
  const uint32_t tensor_seed = sketch_tensor_seed(p.seed, static_cast<uint32_t>(index));
  const int64_t begin = unit * kSketchUnitElements;
  const int64_t end = begin + kSketchUnitElements < t.numel ? begin + kSketchUnitElements : t.numel;
  // kSketchBlocksInFlight blocks at a time: their values are loaded first, then added block by block
  // in the order of one at a time (the same sums, bit for bit). A block at a time, each warp waited on
  // one 256-byte load per block; the update watch's sketch read GPT-2-small's weights at a seventh of
  // the GPU's bandwidth (benchmarks/NOTES.md entry 53).
  for (int64_t e0 = begin; e0 < end; e0 += kSketchBlock * kSketchBlocksInFlight) {
    typename Codec::Raw raw[kSketchBlocksInFlight][2] = {};  // past the unit's end: never read
#pragma unroll
    for (int j = 0; j < kSketchBlocksInFlight; ++j) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const int64_t e = e0 + j * kSketchBlock + lane + half * kWarpSize;
        if (e < end) raw[j][half] = data[e];
      }
    }
#pragma unroll
    for (int j = 0; j < kSketchBlocksInFlight; ++j) {
      const int64_t b0 = e0 + j * kSketchBlock;
      if (b0 < end) {
        const SketchBlock block = sketch_block(tensor_seed, static_cast<uint64_t>(b0 / kSketchBlock), k);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int q = lane + half * kWarpSize;
          if (b0 + q < end) {
            const auto v = static_cast<double>(Codec::decode(raw[j][half]));
            ss += v * v;
            mine[block.offset + q] += sketch_sign(block.signs, q) * v;
          }
        }
      }
      __syncwarp();  // the next block's buckets may be ones another lane just wrote
    }
  }
  for (int64_t b = lane; b < k; b += kWarpSize) {
    const double v = b < kSketchBlock ? mine[b] + mine[k + b] : mine[b];
    if (v != 0.0) atomicAdd(&p.sketches[t.out_offset + b], v);  // NaN != 0: added
  }
  __syncwarp();  // the buckets are zeroed again by the next unit
  return ss;
}

template <int64_t kCapacity, int kWarps>
__global__ void __launch_bounds__(kWarps* kWarpSize) sketch_kernel(const __grid_constant__ SketchParams p) {
  __shared__ double buckets[kWarps][kCapacity + kSketchBlock];
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t u = static_cast<int64_t>(blockIdx.x) * kWarps + warp; u < p.units; u += warps) {
    const int32_t index = tensor_of_unit(p, u);
    const SketchTensor t = p.tensors[index];
    const int64_t unit = u - t.unit_begin;
    double ss = 0.0;
    switch (static_cast<DType>(t.dtype)) {
      case DType::Float32: ss = sketch_unit<Float32Codec>(p, t, index, unit, buckets[warp], lane); break;
      case DType::Float64: ss = sketch_unit<Float64Codec>(p, t, index, unit, buckets[warp], lane); break;
      case DType::Float16: ss = sketch_unit<Float16Codec>(p, t, index, unit, buckets[warp], lane); break;
      case DType::BFloat16: ss = sketch_unit<BFloat16Codec>(p, t, index, unit, buckets[warp], lane); break;
      case DType::Float8E4M3FN: ss = sketch_unit<Float8E4M3FNCodec>(p, t, index, unit, buckets[warp], lane); break;
      case DType::Float8E5M2: ss = sketch_unit<Float8E5M2Codec>(p, t, index, unit, buckets[warp], lane); break;
    }
    ss = warp_sum(ss);
    if (lane == 0) atomicAdd(&p.sumsq[index], ss);
  }
}

// Two shapes of the kernel, both with 34-35 KB of static shared memory (under the 48 KB that needs
// no opt-in): four warps of up to 1024 buckets, or one warp of up to 4096.
constexpr int64_t kSmallCapacity = 1024;
constexpr int kSmallWarps = 4;
static_assert(kMaxSketchBuckets == 4096, "the large shape holds the largest bucket count");

}  // namespace

SketchTable sketch_table(const TensorArg* tensors, int64_t n, int64_t k) {
  SketchTable table;
  table.tensors.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) {
    const TensorArg& t = tensors[i];
    table.tensors[i] = SketchTensor{t.data, t.numel, table.buckets, table.units, static_cast<int32_t>(t.dtype), 0};
    table.buckets += sketch_buckets_of(t.numel, k);
    table.units += sketch_units(t.numel, k);
  }
  return table;
}

cudaError_t sketch(const SketchTable& table, const SketchTensor* device_table, int64_t k, uint32_t seed,
                   double* sketches, double* sumsq, int num_sms, cudaStream_t stream) {
  if (!valid_sketch_buckets(k) || table.tensors.empty() || table.tensors.size() > INT32_MAX) {
    return cudaErrorInvalidValue;
  }
  cudaError_t err = cudaMemsetAsync(sketches, 0, static_cast<size_t>(table.buckets) * sizeof(double), stream);
  if (err == cudaSuccess) err = cudaMemsetAsync(sumsq, 0, table.tensors.size() * sizeof(double), stream);
  if (err != cudaSuccess) return err;
  const SketchParams params{device_table, static_cast<int32_t>(table.tensors.size()), table.units, k, seed, sketches,
                            sumsq};
  // A wave of blocks (at most eight a multiprocessor: shared memory allows six of the small shape),
  // fewer when the list has fewer units than that wave has warps.
  const int warps = k <= kSmallCapacity ? kSmallWarps : 1;
  const int64_t wanted = (table.units + warps - 1) / warps;
  const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, int64_t{num_sms} * 8)));
  if (k <= kSmallCapacity) {
    NANSCAN_LAUNCH((sketch_kernel<kSmallCapacity, kSmallWarps>), grid, kSmallWarps * kWarpSize, stream, params);
  } else {
    NANSCAN_LAUNCH((sketch_kernel<kMaxSketchBuckets, 1>), grid, kWarpSize, stream, params);
  }
  return cudaGetLastError();
}

}  // namespace nanscan::cuda
