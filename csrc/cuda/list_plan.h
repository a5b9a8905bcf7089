// How the CUDA kernels see a tensor list: its metadata blob, its chunks, and the fold tree that turns
// the partial results of a multi-chunk tensor into that tensor's result.
//
// Plain C++ with host+device functions and no CUDA headers, so that g++ compiles it too:
// tests/cpp/test_list_plan.cpp checks the index arithmetic here on the CPU (CI has no GPU).
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <vector>

#include "../common/dtypes.h"

namespace nanscan::cuda {

// One tensor as the kernels see it: a dense span of `numel` elements of `dtype` starting at `data`.
struct TensorArg {
  const void* data;
  int64_t numel;
  DType dtype;
};

// One warp scans one chunk: at most this many bytes of one tensor.
constexpr int64_t kChunkBytes = 32 * 1024;
// Partial results are folded 32 at a time: one per lane of the folding warp.
constexpr int32_t kFoldFanIn = 32;

NANSCAN_HD int64_t chunk_elements(DType d) { return kChunkBytes / element_size(d); }

// An empty tensor still gets one (empty) chunk, so that the warp that visits it writes its result.
NANSCAN_HD int64_t num_chunks(int64_t numel, DType d) {
  const int64_t per = chunk_elements(d);
  return numel == 0 ? 1 : (numel + per - 1) / per;
}

// The metadata blob of N tensors: four arrays back to back, each naturally aligned when the blob is
// 16-byte aligned:
//   data[N] (pointers) | numel[N] (int64) | chunk_begin[N + 1] (int32) | dtype[N] (uint8)
// chunk_begin[t] is the index of tensor t's first chunk; chunk_begin[N] is the number of chunks.
NANSCAN_HD constexpr size_t numel_offset(int32_t n) { return sizeof(void*) * static_cast<size_t>(n); }
NANSCAN_HD constexpr size_t chunk_begin_offset(int32_t n) { return numel_offset(n) + sizeof(int64_t) * static_cast<size_t>(n); }
NANSCAN_HD constexpr size_t dtype_offset(int32_t n) { return chunk_begin_offset(n) + sizeof(int32_t) * (static_cast<size_t>(n) + 1); }
// Rounded up to 16 bytes, the unit the upload kernel copies.
NANSCAN_HD constexpr size_t blob_bytes(int32_t n) { return (dtype_offset(n) + static_cast<size_t>(n) + 15) / 16 * 16; }

// Elements [begin, end) of tensor `tensor`.
struct ChunkSpan {
  int32_t tensor;
  int64_t begin;
  int64_t end;
};

// A read-only view of a blob, wherever it lives (kernel parameters or device memory).
struct ListView {
  const void* const* data;
  const int64_t* numel;
  const int32_t* chunk_begin;
  const uint8_t* dtype;
  int32_t num_tensors;

  NANSCAN_HD static ListView over(const unsigned char* blob, int32_t n) {
    return ListView{reinterpret_cast<const void* const*>(blob), reinterpret_cast<const int64_t*>(blob + numel_offset(n)),
                    reinterpret_cast<const int32_t*>(blob + chunk_begin_offset(n)), blob + dtype_offset(n), n};
  }

  NANSCAN_HD DType dtype_of(int32_t t) const { return static_cast<DType>(dtype[t]); }
  NANSCAN_HD int32_t num_chunks() const { return chunk_begin[num_tensors]; }
  NANSCAN_HD int32_t chunks_of(int32_t t) const { return chunk_begin[t + 1] - chunk_begin[t]; }

  // The tensor that owns chunk c: the last whose first chunk is <= c (every tensor has >= 1 chunk).
  NANSCAN_HD int32_t find_tensor(int32_t c) const {
    int32_t lo = 0, hi = num_tensors - 1;
    while (lo < hi) {
      const int32_t mid = lo + (hi - lo + 1) / 2;
      if (chunk_begin[mid] <= c) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }

  // The same answer as find_tensor, from 32 probes at a time: count_at_or_below(lo, step, hi) says
  // how many of the 32 probes lo, lo + step, ... that are <= hi have chunk_begin <= c (at least one:
  // lo). A warp makes the 32 probes at once (a load per lane and a ballot), so a 10,000-tensor table
  // in device memory costs 3 rounds of loads instead of 14 dependent ones.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
  template <class CountAtOrBelow>
  NANSCAN_HD int32_t find_tensor_wide(CountAtOrBelow&& count_at_or_below) const {
    int32_t lo = 0, hi = num_tensors - 1;
    while (lo < hi) {
      const int32_t step = (hi - lo) / kFoldFanIn + 1;  // 32 probes cover [lo, hi]
      lo += (count_at_or_below(lo, step, hi) - 1) * step;
      hi = lo + step - 1 < hi ? lo + step - 1 : hi;
    }
    return lo;
  }

  NANSCAN_HD ChunkSpan span(int32_t c) const { return span_in(c, find_tensor(c)); }

  // Chunk c's elements, given the tensor t that owns it.
  NANSCAN_HD ChunkSpan span_in(int32_t c, int32_t t) const {
    const int64_t per = chunk_elements(dtype_of(t));
    const int64_t begin = static_cast<int64_t>(c - chunk_begin[t]) * per;
    const int64_t end = begin + per < numel[t] ? begin + per : numel[t];
    return ChunkSpan{t, begin, end};
  }
};

// The fold tree of a tensor with n >= 2 chunks starting at global chunk b. Chunk i (local) leaves its
// partial in slot b + i. Chunks form groups of kFoldFanIn; the last chunk of a group to arrive folds
// the group, in chunk order, into the slot of the group's first chunk (b + kFoldFanIn * g, whose
// partial it has just read). With more than one group, the last group to arrive folds the groups, in
// group order, into the tensor's result. Arrivals are counted in a counter array indexed like the
// slots: group g at b + kFoldFanIn * g, the tensor's groups at b + 1 (not a group's slot: n > kFoldFanIn
// there). So a tensor's workspace is its own chunk range, and every fold has a fixed order.
struct FoldTree {
  int32_t first_chunk;  // b
  int32_t chunks;       // n

  NANSCAN_HD int32_t group_of(int32_t local_chunk) const { return local_chunk / kFoldFanIn; }
  NANSCAN_HD int32_t num_groups() const { return (chunks + kFoldFanIn - 1) / kFoldFanIn; }
  NANSCAN_HD int32_t group_size(int32_t g) const {
    const int32_t rest = chunks - g * kFoldFanIn;
    return rest < kFoldFanIn ? rest : kFoldFanIn;
  }
  NANSCAN_HD int32_t group_slot(int32_t g) const { return first_chunk + g * kFoldFanIn; }
  NANSCAN_HD int32_t groups_counter() const { return first_chunk + 1; }
};

// What a warp does after scanning chunk c of tensor t into s: write t's result if that was its only
// chunk; otherwise leave s in the fold tree and fold whatever this arrival completes. Written once for
// the kernel and for the CPU emulation in tests/cpp, which differ only in `sync`:
//   sync.write_result(t, stats)
//   sync.arrive_last(slot, stats, counter, expected) -> bool: leave stats in partial slot `slot`, count
//       an arrival at counter `counter`; true for the arrival that makes `expected`
//   sync.fold(first_slot, count, stride) -> stats: combine slots first, first + stride, ... in order
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Stats, class Sync>
NANSCAN_HD void finish_chunk(const ListView& list, int32_t t, int32_t c, const Stats& s, Sync& sync) {
  const FoldTree tree{list.chunk_begin[t], list.chunks_of(t)};
  if (tree.chunks == 1) {
    sync.write_result(t, s);
    return;
  }
  const int32_t g = tree.group_of(c - tree.first_chunk);
  if (!sync.arrive_last(c, s, tree.group_slot(g), tree.group_size(g))) return;
  const Stats group = sync.fold(tree.group_slot(g), tree.group_size(g), 1);
  if (tree.num_groups() == 1) {
    sync.write_result(t, group);
    return;
  }
  if (!sync.arrive_last(tree.group_slot(g), group, tree.groups_counter(), tree.num_groups())) return;
  sync.write_result(t, sync.fold(tree.first_chunk, tree.num_groups(), kFoldFanIn));
}

// Lists over this many chunks (~64 TiB) are refused: a grid-stride loop over int32 chunk indices
// must not overflow (a stride is at most a few hundred thousand).
constexpr int64_t kMaxChunks = INT32_MAX - (int64_t{1} << 24);

// The host side of a list: builds the blob once per call (reusing its buffer across calls).
class ListPlan {
 public:
  // Returns false for an empty list or one of more than kMaxChunks chunks.
  bool build(const TensorArg* tensors, int64_t n) {
    if (n <= 0 || n > INT32_MAX) return false;
    const auto count = static_cast<int32_t>(n);
    blob_.assign(blob_bytes(count), 0);
    unsigned char* base = blob_.data();
    auto* chunk_begin = reinterpret_cast<int32_t*>(base + chunk_begin_offset(count));
    int64_t chunks = 0;
    for (int32_t i = 0; i < count; ++i) {
      const TensorArg& t = tensors[i];
      memcpy(base + sizeof(void*) * i, &t.data, sizeof(void*));
      memcpy(base + numel_offset(count) + sizeof(int64_t) * i, &t.numel, sizeof(int64_t));
      chunk_begin[i] = static_cast<int32_t>(chunks);
      base[dtype_offset(count) + i] = static_cast<uint8_t>(t.dtype);
      chunks += cuda::num_chunks(t.numel, t.dtype);
      if (chunks > kMaxChunks) return false;
    }
    chunk_begin[count] = static_cast<int32_t>(chunks);
    num_tensors_ = count;
    num_chunks_ = static_cast<int32_t>(chunks);
    return true;
  }

  const unsigned char* blob() const { return blob_.data(); }
  size_t bytes() const { return blob_.size(); }
  int32_t num_tensors() const { return num_tensors_; }
  int32_t num_chunks() const { return num_chunks_; }
  ListView view() const { return ListView::over(blob_.data(), num_tensors_); }

 private:
  std::vector<unsigned char> blob_;
  int32_t num_tensors_ = 0;
  int32_t num_chunks_ = 0;
};

}  // namespace nanscan::cuda
