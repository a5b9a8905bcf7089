// The update sketch, written once for every backend: a CountSketch of a tensor, a short float64
// vector that is linear in the tensor's values, so that the sketch of an update is the difference of
// two sketches of the weights, and its squared length estimates the update's squared norm without
// bias. nanscan.watch_updates(sketch=k) keeps one per weight between the two sides of an optimizer
// step instead of a copy of the weights (nanscan/updates.py: the error it makes, and its proof).
//
// A tensor of n elements in logical (row-major) order and k buckets (a power of two):
//  * n <= k: the sketch is the values themselves, in float64 (n buckets): exact.
//  * n > k: element e lies in block e / 64, at position p = e % 64. Each block draws, from a hash of
//    the block's index and the tensor's seed, an offset o in [0, k) and 64 sign bits; element e is
//    added to bucket (o + p) mod k, negated when sign bit p is set. So the 64 elements of a block go
//    to 64 distinct buckets (k >= 64) and two elements of different blocks meet in a bucket with
//    probability exactly 1/k, with independent signs: the estimate's variance is at most 2||v||^4/k,
//    whatever the vector (a few rows, one column, dense), and a backend reads a block as one run of
//    64 contiguous elements added to 64 contiguous buckets (mod k): vector loads and no conflicts
//    between the lanes of a warp or of a SIMD group.
// Buckets are summed in float64, so that two sketches of weights that an update moved by 1e-10 of
// themselves still differ by the update's sketch (a float32 bucket would round the update away).
#pragma once

#include <cstdint>

#include "dtypes.h"
#include "murmur.h"

namespace nanscan {

constexpr int64_t kSketchBlock = 64;
// The bucket counts the op takes: powers of two in [kMinSketchBuckets, kMaxSketchBuckets]. 64 so that a
// block's elements never share a bucket; 4096 so that a CUDA warp's buckets (32 KB) fit its shared memory.
constexpr int64_t kMinSketchBuckets = 64;
constexpr int64_t kMaxSketchBuckets = 4096;

NANSCAN_HD constexpr bool valid_sketch_buckets(int64_t k) {
  return k >= kMinSketchBuckets && k <= kMaxSketchBuckets && (k & (k - 1)) == 0;
}

// A tensor's buckets: its elements themselves up to k, else k.
NANSCAN_HD constexpr int64_t sketch_buckets_of(int64_t numel, int64_t k) { return numel <= k ? numel : k; }

// The hash's mixing step: MurmurHash3's 32-bit finalizer (murmur.h), as the replica checksum's.
NANSCAN_HD uint32_t sketch_mix(uint32_t x) { return murmur_finalizer(x); }

// The seed of the tensor at `index` in the op's list, from the op's seed (the update watch passes 0 on
// every rank, so that replicated weights are sketched alike everywhere).
NANSCAN_HD uint32_t sketch_tensor_seed(uint32_t seed, uint32_t index) {
  return sketch_mix(seed ^ sketch_mix(index + 0x9e3779b9u));
}

// What block `block` of a tensor hashed with `tensor_seed` draws: its offset in [0, k) and its 64 sign bits.
struct SketchBlock {
  uint32_t offset;
  uint64_t signs;  // bit p set: the block's element p is subtracted
};

NANSCAN_HD SketchBlock sketch_block(uint32_t tensor_seed, uint64_t block, int64_t k) {
  const uint32_t key =
      sketch_mix(static_cast<uint32_t>(block >> 32) ^ sketch_mix(static_cast<uint32_t>(block) ^ tensor_seed));
  const uint64_t signs = (static_cast<uint64_t>(sketch_mix(key ^ 0x68e31da4u)) << 32) | sketch_mix(key ^ 0xb5297a4du);
  return SketchBlock{sketch_mix(key ^ 0x1b56c4e9u) & static_cast<uint32_t>(k - 1), signs};
}

// Element p's sign from its block's bits, as a multiplier.
NANSCAN_HD constexpr double sketch_sign(uint64_t signs, int64_t p) { return ((signs >> p) & 1u) != 0 ? -1.0 : 1.0; }

}  // namespace nanscan
