// How the CUDA kernels see a tensor list: its metadata blob, its chunks, how the list's work is cut
// into one contiguous share per warp, and the fold tree that turns a tensor's partial results (one
// per warp whose share it spans) into that tensor's result.
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

// A warp scans a tensor a chunk at a time: at most this many bytes, read with 16-byte loads.
constexpr int64_t kChunkBytes = 32 * 1024;
// Partial results are folded 32 at a time: one per lane of the folding warp.
constexpr int32_t kFoldFanIn = 32;

NANSCAN_HD int64_t chunk_elements(DType d) { return kChunkBytes / element_size(d); }

// An empty tensor still gets one (empty) chunk, so that the warp that visits it writes its result.
NANSCAN_HD int64_t num_chunks(int64_t numel, DType d) {
  const int64_t per = chunk_elements(d);
  return numel == 0 ? 1 : (numel + per - 1) / per;
}

// The cost of a chunk, which is what the warps' shares balance: one unit per 512 bytes (a 16-byte load
// in each lane of a warp) plus a fixed kChunkOverheadCost for the warp reduction and the result that
// every chunk pays, so that a warp given a run of 1-element tensors is not also given a share of
// bytes as large as a warp given a run of full chunks.
constexpr int64_t kCostGrainBytes = 512;
constexpr int64_t kChunkOverheadCost = 8;
NANSCAN_HD constexpr int64_t chunk_cost(int64_t bytes) {
  return kChunkOverheadCost + (bytes + kCostGrainBytes - 1) / kCostGrainBytes;
}
constexpr int64_t kFullChunkCost = chunk_cost(kChunkBytes);

// Every chunk of a tensor but the last is full, so its chunk j starts j * kFullChunkCost into its cost.
NANSCAN_HD int64_t tensor_cost(int64_t numel, DType d) {
  const int64_t chunks = num_chunks(numel, d);
  const int64_t last_bytes = numel * element_size(d) - (chunks - 1) * kChunkBytes;
  return (chunks - 1) * kFullChunkCost + chunk_cost(last_bytes);
}

// The metadata blob of N tensors: four arrays back to back, each naturally aligned when the blob is
// 16-byte aligned:
//   data[N] (pointers) | numel[N] (int64) | cost_begin[N + 1] (int64) | dtype[N] (uint8)
// cost_begin[t] is the cost of the tensors before t (strictly increasing: every tensor costs at least
// kChunkOverheadCost); cost_begin[N] is the cost of the list.
NANSCAN_HD constexpr size_t numel_offset(int32_t n) { return sizeof(void*) * static_cast<size_t>(n); }
NANSCAN_HD constexpr size_t cost_begin_offset(int32_t n) {
  return numel_offset(n) + sizeof(int64_t) * static_cast<size_t>(n);
}
NANSCAN_HD constexpr size_t dtype_offset(int32_t n) {
  return cost_begin_offset(n) + sizeof(int64_t) * (static_cast<size_t>(n) + 1);
}
// Rounded up to 16 bytes, the unit the upload kernel copies.
NANSCAN_HD constexpr size_t blob_bytes(int32_t n) { return (dtype_offset(n) + static_cast<size_t>(n) + 15) / 16 * 16; }

// Elements [begin, end) of a tensor.
struct ElementRange {
  int64_t begin;
  int64_t end;
};

// Chunks [begin, end) of a tensor (possibly none).
struct ChunkRange {
  int64_t begin;
  int64_t end;
};

NANSCAN_HD int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The small-tensor path (scan_cuda.cu): runs of up to kSubWarpTensors consecutive tensors of one
// dtype, each at most kSubWarpMaxBytes (so one chunk) and of at most 8 elements per 16-byte vector
// (float8's 16 would need two head elements per lane), are scanned by one warp at once,
// kWarpSize / kSubWarpTensors lanes a tensor.
constexpr int32_t kSubWarpTensors = 4;
constexpr int64_t kSubWarpMaxBytes = 8 * 1024;

NANSCAN_HD bool fits_sub_warp(int64_t numel, DType d) {
  return element_size(d) >= 2 && numel * element_size(d) <= kSubWarpMaxBytes;
}

// A read-only view of a blob, wherever it lives (kernel parameters or device memory).
struct ListView {
  const void* const* data;
  const int64_t* numel;
  const int64_t* cost_begin;
  const uint8_t* dtype;
  int32_t num_tensors;

  NANSCAN_HD static ListView over(const unsigned char* blob, int32_t n) {
    return ListView{reinterpret_cast<const void* const*>(blob),
                    reinterpret_cast<const int64_t*>(blob + numel_offset(n)),
                    reinterpret_cast<const int64_t*>(blob + cost_begin_offset(n)), blob + dtype_offset(n), n};
  }

  NANSCAN_HD DType dtype_of(int32_t t) const { return static_cast<DType>(dtype[t]); }
  NANSCAN_HD int64_t total_cost() const { return cost_begin[num_tensors]; }
  NANSCAN_HD int64_t chunks_of(int32_t t) const { return cuda::num_chunks(numel[t], dtype_of(t)); }
  // Where tensor t's last chunk starts on the cost axis (its first chunk starts at cost_begin[t]).
  NANSCAN_HD int64_t last_chunk_start(int32_t t) const { return cost_begin[t] + (chunks_of(t) - 1) * kFullChunkCost; }

  // The tensor whose cost range holds `cost` (0 <= cost < total_cost()): the last t with
  // cost_begin[t] <= cost.
  NANSCAN_HD int32_t find_tensor(int64_t cost) const {
    int32_t lo = 0, hi = num_tensors - 1;
    while (lo < hi) {
      const int32_t mid = lo + (hi - lo + 1) / 2;
      if (cost_begin[mid] <= cost) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    return lo;
  }

  // The same answer as find_tensor, from 32 probes at a time: count_at_or_below(lo, step, hi) says
  // how many of the 32 probes lo, lo + step, ... that are <= hi have cost_begin <= cost (at least
  // one: lo). A warp makes the 32 probes at once (a load per lane and a ballot), so a 10,000-tensor
  // table in device memory costs 3 rounds of loads instead of 14 dependent ones.
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

  // How many of tensors t, t + 1, ... (at most `max`) form a run for the small-tensor path: each
  // fits_sub_warp, of t's dtype, and starting before `share_end` (the cost where the visiting warp's
  // share ends). A tensor of one chunk is met by one warp only (Shares), so the warp that meets t
  // meets every tensor of the run and writes their results itself. 0 when t does not fit.
  NANSCAN_HD int32_t sub_warp_run(int32_t t, int64_t share_end, int32_t max) const {
    const DType d = dtype_of(t);
    int32_t run = 0;
    while (run < max && t + run < num_tensors && cost_begin[t + run] < share_end && dtype_of(t + run) == d &&
           fits_sub_warp(numel[t + run], d)) {
      ++run;
    }
    return run;
  }

  // The chunks of tensor t that start in the cost range [lo, hi).
  NANSCAN_HD ChunkRange chunks_starting_in(int32_t t, int64_t lo, int64_t hi) const {
    const int64_t begin = cost_begin[t], n = chunks_of(t);
    const int64_t first = lo > begin ? ceil_div(lo - begin, kFullChunkCost) : 0;
    const int64_t end = hi > begin ? ceil_div(hi - begin, kFullChunkCost) : 0;
    return ChunkRange{first < n ? first : n, end < n ? end : n};
  }

  // The elements of chunks [chunks.begin, chunks.end) of tensor t (none for no chunks).
  NANSCAN_HD ElementRange elements_of(int32_t t, ChunkRange chunks) const {
    const int64_t per = chunk_elements(dtype_of(t));
    const int64_t begin = chunks.begin * per, end = chunks.end * per;
    return ElementRange{begin < numel[t] ? begin : numel[t], end < numel[t] ? end : numel[t]};
  }
};

// A difference scan's plan (scan_cuda.cu) lists N befores, then their N afters; its warps' shares
// cover the befores alone, each after read beside its before: the list as that kernel cuts it.
NANSCAN_HD ListView befores_of(const ListView& pairs) {
  ListView befores = pairs;
  befores.num_tensors = pairs.num_tensors / 2;
  return befores;
}

// A range of warps, both ends included.
struct WarpRange {
  int32_t first;
  int32_t last;
};

// The list's cost cut into `warps` contiguous shares, the k-th [begin(k), begin(k + 1)): each warp
// scans the chunks that start in its share. Balanced by cost, so warps get about equal work however
// the list mixes tiny and large tensors; contiguous, so a share reads one run of memory per tensor.
// A warp "meets" tensor t when its share meets [cost_begin[t], last_chunk_start(t)], the span of t's
// chunk starts: a tensor with one chunk is met by one warp, which writes its result directly. A
// tensor's partial results are one per warp that meets it (not one per chunk), and the partial of the
// pair (tensor t, warp w) can live in slot t + w: two partitions of one interval meet in at most
// N + W - 1 pieces, and t + w is one-to-one on those that meet. That keeps the workspace O(tensors +
// grid). A warp whose share lies inside one chunk scans nothing of it and still leaves an (empty)
// partial, so the warps that meet a tensor are exactly meeting(t): no gaps.
struct Shares {
  int64_t total_cost;
  int32_t warps;  // at most total_cost, so that no share is empty; warps launched beyond it idle

  // The bound that keeps cost * warps under 2^63 (see kMaxChunks); a grid is far smaller.
  static constexpr int64_t kMaxWarps = int64_t{1} << 24;

  NANSCAN_HD static Shares of(int64_t total_cost, int64_t warps_launched) {
    int64_t warps = warps_launched < total_cost ? warps_launched : total_cost;
    warps = warps < kMaxWarps ? warps : kMaxWarps;
    return Shares{total_cost, static_cast<int32_t>(warps)};
  }
  // ceil(w * total / warps); products stay under 2^63 (see kMaxChunks).
  NANSCAN_HD int64_t begin(int32_t w) const { return (static_cast<int64_t>(w) * total_cost + warps - 1) / warps; }
  // The share that holds `cost`: the last w with begin(w) <= cost, which is floor(cost * warps / total).
  NANSCAN_HD int32_t owner(int64_t cost) const { return static_cast<int32_t>(cost * warps / total_cost); }
  // The warps that meet tensor t: from the share that holds its first chunk's start to the one that
  // holds its last chunk's start.
  NANSCAN_HD WarpRange meeting(const ListView& list, int32_t t) const {
    return WarpRange{owner(list.cost_begin[t]), owner(list.last_chunk_start(t))};
  }
  // Fold-tree slots (and arrival counters) of a scan: one per (tensor, warp) pair that can meet.
  NANSCAN_HD int64_t fold_slots(int32_t num_tensors) const { return static_cast<int64_t>(num_tensors) + warps - 1; }
};

// Calls visit(t, chunks, share_end) for each tensor t that warp w meets (see Shares), in list order,
// with the chunks of t that start in the share (possibly none) and the cost where the share ends. `first_tensor` is
// list.find_tensor() of the share's begin, found by whichever search suits where the table lives.
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Visit>
NANSCAN_HD void walk_share(const ListView& list, const Shares& shares, int32_t w, int32_t first_tensor, Visit&& visit) {
  const int64_t lo = shares.begin(w), hi = shares.begin(w + 1);
  for (int32_t t = first_tensor; t < list.num_tensors && list.cost_begin[t] < hi; ++t) {
    // Only the first tensor can start before the share; if its last chunk starts there too, the share
    // holds nothing of it but the tail of that chunk's cost.
    if (list.last_chunk_start(t) < lo) continue;
    visit(t, list.chunks_starting_in(t, lo, hi), hi);
  }
}

// The fold tree of a tensor met by n >= 2 warps, the first of them warp f: warp f + i leaves
// its partial in slot b + i, where b = t + f. Partials form groups of kFoldFanIn; the last of a group
// to arrive folds the group, in warp order, into the slot of the group's first partial (b +
// kFoldFanIn * g, which it has just read). With more than one group, the last group to arrive folds
// the groups, in group order, into the tensor's result. Arrivals are counted in a counter array
// indexed like the slots: group g at b + kFoldFanIn * g, the tensor's groups at b + 1 (not a group's
// slot: n > kFoldFanIn there). So a tensor's workspace is its own slot range [b, b + n), and every
// fold has a fixed order.
struct FoldTree {
  int64_t first_slot;  // b
  int32_t parts;       // n

  NANSCAN_HD int32_t group_of(int32_t part) const { return part / kFoldFanIn; }
  NANSCAN_HD int32_t num_groups() const { return (parts + kFoldFanIn - 1) / kFoldFanIn; }
  NANSCAN_HD int32_t group_size(int32_t g) const {
    const int32_t rest = parts - g * kFoldFanIn;
    return rest < kFoldFanIn ? rest : kFoldFanIn;
  }
  NANSCAN_HD int64_t group_slot(int32_t g) const { return first_slot + static_cast<int64_t>(g) * kFoldFanIn; }
  NANSCAN_HD int64_t groups_counter() const { return first_slot + 1; }
};

// What warp w does with its partial s of tensor t once its share has been scanned: write t's result
// if no other warp meets t; otherwise leave s in t's fold tree and fold whatever this arrival
// completes. Written once for the kernel and for the CPU emulation in tests/cpp, which differ only
// in `sync`:
//   sync.write_result(t, stats)
//   sync.arrive_last(slot, stats, counter, expected) -> bool: leave stats in partial slot `slot`, count
//       an arrival at counter `counter`; true for the arrival that makes `expected`
//   sync.fold(first_slot, count, stride) -> stats: combine slots first, first + stride, ... in order
#if defined(__CUDACC__)
#pragma nv_exec_check_disable
#endif
template <class Stats, class Sync>
NANSCAN_HD void finish_share(const ListView& list, const Shares& shares, int32_t t, int32_t w, const Stats& s,
                             Sync& sync) {
  const WarpRange met = shares.meeting(list, t);
  if (met.first == met.last) {
    sync.write_result(t, s);
    return;
  }
  const FoldTree tree{static_cast<int64_t>(t) + met.first, met.last - met.first + 1};
  const int32_t part = w - met.first;
  const int32_t g = tree.group_of(part);
  if (!sync.arrive_last(tree.first_slot + part, s, tree.group_slot(g), tree.group_size(g))) return;
  const Stats group = sync.fold(tree.group_slot(g), tree.group_size(g), 1);
  if (tree.num_groups() == 1) {
    sync.write_result(t, group);
    return;
  }
  if (!sync.arrive_last(tree.group_slot(g), group, tree.groups_counter(), tree.num_groups())) return;
  sync.write_result(t, sync.fold(tree.first_slot, tree.num_groups(), kFoldFanIn));
}

// Lists over this many chunks (~64 TiB) are refused: with the cost of a full chunk under 2^7 and at
// most Shares::kMaxWarps = 2^24 shares, cost * warps in Shares stays under 2^63.
constexpr int64_t kMaxChunks = INT32_MAX - (int64_t{1} << 24);
static_assert(kFullChunkCost < 128, "Shares' products assume a full chunk costs under 2^7");

// The host side of a list: builds the blob once per call (reusing its buffer across calls).
class ListPlan {
 public:
  // Returns false for an empty list or one of more than kMaxChunks chunks.
  bool build(const TensorArg* tensors, int64_t n) {
    if (n <= 0 || n > INT32_MAX) return false;
    const auto count = static_cast<int32_t>(n);
    blob_.assign(blob_bytes(count), 0);
    unsigned char* base = blob_.data();
    int64_t chunks = 0, cost = 0;
    for (int32_t i = 0; i < count; ++i) {
      const TensorArg& t = tensors[i];
      memcpy(base + sizeof(void*) * i, &t.data, sizeof(void*));
      memcpy(base + numel_offset(count) + sizeof(int64_t) * i, &t.numel, sizeof(int64_t));
      memcpy(base + cost_begin_offset(count) + sizeof(int64_t) * i, &cost, sizeof(int64_t));
      base[dtype_offset(count) + i] = static_cast<uint8_t>(t.dtype);
      chunks += cuda::num_chunks(t.numel, t.dtype);
      if (chunks > kMaxChunks) return false;
      cost += tensor_cost(t.numel, t.dtype);
    }
    memcpy(base + cost_begin_offset(count) + sizeof(int64_t) * count, &cost, sizeof(int64_t));
    num_tensors_ = count;
    num_chunks_ = chunks;
    total_cost_ = cost;
    return true;
  }

  const unsigned char* blob() const { return blob_.data(); }
  size_t bytes() const { return blob_.size(); }
  int32_t num_tensors() const { return num_tensors_; }
  int64_t num_chunks() const { return num_chunks_; }
  int64_t total_cost() const { return total_cost_; }
  ListView view() const { return ListView::over(blob_.data(), num_tensors_); }

 private:
  std::vector<unsigned char> blob_;
  int32_t num_tensors_ = 0;
  int64_t num_chunks_ = 0;
  int64_t total_cost_ = 0;
};

}  // namespace nanscan::cuda
