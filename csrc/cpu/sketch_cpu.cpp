// The CPU update sketch (nanscan::sketch, behind watch_updates(sketch=k)): each tensor's CountSketch
// (common/sketch_rules.h) and its sum of squares, in one read. Chunked as the scan is (runs.h: chunks
// fixed by the sizes alone, results combined in chunk order), so that the same weights always give the
// same bits, whatever the thread count: an unchanged tensor's two sketches are then equal and its
// update reads exactly 0.

#include <algorithm>
#include <cstring>
#include <memory>

#include "../common/sketch_rules.h"
#include "runs.h"
#include "scan_cpu.h"

namespace nanscan::cpu {
namespace {

// Lanes of the sum of squares: eight fp64 partial sums, combined in the scan's fixed tree (sum_lanes).
constexpr int64_t kSquareLanes = 8;

struct ChunkSums {
  double lanes[kSquareLanes] = {};
  double total() const { return sum_lanes(lanes); }
};

// A tensor of at most k elements: its values are its buckets.
template <class Codec>
NANSCAN_INLINE void copy_values(const typename Codec::Raw* p, int64_t n, double* buckets, ChunkSums& sums) {
  for (int64_t e = 0; e < n; ++e) {
    const auto v = static_cast<double>(Codec::decode(p[e]));
    buckets[e] = v;
    sums.lanes[e % kSquareLanes] += v * v;
  }
}

// Eight fp64 lanes (GCC's vector extension: one AVX-512 register in the x86-64-v4 clone, two AVX2 ones
// in the x86-64-v3 clone, four SSE2 ones in the baseline), written out because the auto-vectoriser
// leaves the bucket update scalar (13.5x a torch.sum; this, 2x: benchmarks/NOTES.md entry 43).
using Doubles = double __attribute__((vector_size(64)));
using Words = uint64_t __attribute__((vector_size(64)));
constexpr int64_t kVector = 8;
static_assert(kVector == kSquareLanes, "hash_values folds a vector's lanes into the lanes of the sums");

template <class Codec>
NANSCAN_INLINE Doubles load_values(const typename Codec::Raw* from) {
  double values[kVector];
  for (int64_t l = 0; l < kVector; ++l) values[l] = static_cast<double>(Codec::decode(from[l]));
  Doubles v;
  std::memcpy(&v, values, sizeof v);
  return v;
}

// Elements [begin, end) of a tensor of more than k elements (begin a multiple of kSketchBlock) into
// `buckets`, k + kSketchBlock of them: a block whose offset is near k runs past bucket k - 1 into the
// spill, which the caller folds back onto buckets 0..63. A full block is 64 contiguous loads added to
// 64 contiguous buckets, eight lanes at a time (a block's buckets never repeat), each value's sign bit
// flipped where the block's sign bit is set.
template <class Codec>
NANSCAN_INLINE void hash_values(const typename Codec::Raw* p, int64_t begin, int64_t end, int64_t k,
                                uint32_t tensor_seed, double* buckets, ChunkSums& sums) {
  Doubles ss[2] = {};
  const Words lane = {0, 1, 2, 3, 4, 5, 6, 7};
  const int64_t full_end = begin + (end - begin) / kSketchBlock * kSketchBlock;
  for (int64_t e0 = begin; e0 < full_end; e0 += kSketchBlock) {
    const SketchBlock block = sketch_block(tensor_seed, static_cast<uint64_t>(e0 / kSketchBlock), k);
    double* into = buckets + block.offset;
    const typename Codec::Raw* from = p + e0;
    const Words signs = {block.signs, block.signs, block.signs, block.signs,
                         block.signs, block.signs, block.signs, block.signs};
    for (int64_t g = 0; g < kSketchBlock; g += kVector) {
      const Doubles v = load_values<Codec>(from + g);
      ss[(g / kVector) & 1] += v * v;
      const Words flip = ((signs >> (lane + static_cast<uint64_t>(g))) & 1u) << 63;
      Doubles b;
      std::memcpy(&b, into + g, sizeof b);
      b += reinterpret_cast<Doubles>(reinterpret_cast<Words>(v) ^ flip);
      std::memcpy(into + g, &b, sizeof b);
    }
  }
  for (int64_t l = 0; l < kVector; ++l) sums.lanes[l] += ss[0][l] + ss[1][l];
  if (full_end < end) {
    const SketchBlock block = sketch_block(tensor_seed, static_cast<uint64_t>(full_end / kSketchBlock), k);
    for (int64_t q = 0; q < end - full_end; ++q) {
      const auto v = static_cast<double>(Codec::decode(p[full_end + q]));
      sums.lanes[q % kSquareLanes] += v * v;
      buckets[block.offset + q] += sketch_sign(block.signs, q) * v;
    }
  }
}

// Cloned per x86 level: the pass is compute-bound on a 2-core VM (the hash and the sign flips), and
// AVX-512 ran it a quarter faster on one core; the file is small enough that the third clone costs
// seconds of compile time.
NANSCAN_X86_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
double sketch_chunk(const TensorInfo& t, DType dtype, int64_t begin, int64_t end, int64_t k, uint32_t tensor_seed,
                    double* buckets) {
  ChunkSums sums;
  const bool whole = t.numel <= k;
#define NANSCAN_SKETCH(CODEC)                                           \
  {                                                                     \
    const auto* p = static_cast<const typename CODEC::Raw*>(t.data);    \
    if (whole) {                                                        \
      copy_values<CODEC>(p, t.numel, buckets, sums);                    \
    } else {                                                            \
      hash_values<CODEC>(p, begin, end, k, tensor_seed, buckets, sums); \
    }                                                                   \
  }
  switch (dtype) {
    case DType::Float32: NANSCAN_SKETCH(Float32Codec) break;
    case DType::Float64: NANSCAN_SKETCH(Float64Codec) break;
    case DType::Float16: NANSCAN_SKETCH(Float16Codec) break;
    case DType::BFloat16: NANSCAN_SKETCH(BFloat16Codec) break;
    case DType::Float8E4M3FN: NANSCAN_SKETCH(Float8E4M3FNCodec) break;
    case DType::Float8E5M2: NANSCAN_SKETCH(Float8E5M2Codec) break;
  }
#undef NANSCAN_SKETCH
  return sums.total();
}

// Chunks whose partial buckets are held at once: bounds the pass's scratch memory (32 MB at 4096
// buckets) whatever the model's size; the chunks of one group run in parallel.
constexpr int64_t kChunksPerGroup = 1024;

}  // namespace

void sketch(const std::vector<TensorInfo>& tensors, const std::vector<DType>& dtypes, int64_t k, uint32_t seed,
            double* sketches, double* sumsq) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  std::vector<int64_t> numels(n), element_bytes(n), offsets(n + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    numels[i] = tensors[i].numel;
    element_bytes[i] = element_size(dtypes[i]);
    offsets[i + 1] = offsets[i] + sketch_buckets_of(numels[i], k);
  }
  // Chunks of at least 32,768 elements, a multiple of the block: a tensor of up to k (<= 4096)
  // elements is one chunk, which writes its values straight into its buckets.
  const ChunkPlan plan = plan_chunks(numels, element_bytes);
  std::fill(sketches, sketches + offsets[n], 0.0);
  std::fill(sumsq, sumsq + n, 0.0);
  const int64_t stride = k + kSketchBlock;
  const int64_t num_chunks = static_cast<int64_t>(plan.chunks.size());
  // Zeroed by the chunks that use them (a small tensor's chunk writes its buckets in place).
  const std::unique_ptr<double[]> partial_buckets(new double[std::min(num_chunks, kChunksPerGroup) * stride]);
  std::vector<double> partial_sumsq;
  for (int64_t first = 0; first < num_chunks; first += kChunksPerGroup) {
    const int64_t last = std::min(num_chunks, first + kChunksPerGroup);
    partial_sumsq.assign(last - first, 0.0);
    run_chunks(plan, first, last, [&](int64_t c) {
      const Chunk& ch = plan.chunks[c];
      const int64_t i = ch.tensor;
      double* into = sketches + offsets[i];
      if (numels[i] > k) {
        into = partial_buckets.get() + (c - first) * stride;
        std::fill(into, into + stride, 0.0);
      }
      const uint32_t tensor_seed = sketch_tensor_seed(seed, static_cast<uint32_t>(i));
      partial_sumsq[c - first] = sketch_chunk(tensors[i], dtypes[i], ch.begin, ch.end, k, tensor_seed, into);
    });
    // In chunk order, so that the bits depend on the sizes alone.
    for (int64_t c = first; c < last; ++c) {
      const int64_t i = plan.chunks[c].tensor;
      sumsq[i] += partial_sumsq[c - first];
      if (numels[i] <= k) continue;
      const double* from = partial_buckets.get() + (c - first) * stride;
      double* out = sketches + offsets[i];
      for (int64_t b = 0; b < kSketchBlock; ++b) out[b] += from[b] + from[k + b];
      for (int64_t b = kSketchBlock; b < k; ++b) out[b] += from[b];
    }
  }
}

}  // namespace nanscan::cpu
