// The run kernels the CPU passes share: the scan (scan_cpu.cpp) and the difference scan
// (difference_cpu.cpp). The fast, scaled and checked rules of scan_rules.h over one run in SIMD lanes,
// the strided walk by rows, and the chunking that keeps results independent of the thread count. Everything
// here is inlined into the passes' chunk functions, one per dtype (pair), each cloned per x86 level:
// a header, so that the two passes are translation units of their own and compile side by side.
#pragma once

#include <torch/csrc/stable/ops.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include "../ops.h"  // kMaxDims
#include "scan_cpu.h"

namespace nanscan::cpu {

// Lanes per SIMD group: 32 fp32 values are two AVX-512 or four AVX2 registers per accumulator,
// enough independent sums to hide the add latency without running out of registers.
constexpr int64_t kLanes = 32;
// Elements per fast run. Each lane adds at most 128 squares in fp32 before the run is folded into
// fp64: 9.5e-7 relative of an fp64 reference measured on constant-valued tensors (every rounding
// error has one sign), about 3e-9 on random data, and at worst 127 x 2^-25 = 3.8e-6 where a lane's
// first square is large and the next 127 each fall below half its ulp (docs/semantics.md).
constexpr int64_t kRunElements = 128 * kLanes;
// Bytes per chunk: the unit of parallel work and of partial results. Fixed by tensor sizes only.
constexpr int64_t kChunkBytes = 256 * 1024;
// Below this many bytes in total the scan runs on the calling thread.
constexpr int64_t kMinParallelBytes = 512 * 1024;

#define NANSCAN_INLINE inline __attribute__((always_inline))
#define NANSCAN_INLINE_LAMBDA __attribute__((always_inline))
// A function compiled once per listed x86 level, the best one for the CPU picked at load time (an
// ifunc); never inlined, so that its callers stay small. Where GCC's target_clones is unavailable,
// one baseline build.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define NANSCAN_X86_CLONES(...) __attribute__((target_clones(__VA_ARGS__), noinline))
#else
#define NANSCAN_X86_CLONES(...) __attribute__((noinline))
#endif

// The lanes' sums of squares, added in fp64 in a fixed pairwise tree (vectorises, unlike a serial fold).
template <class Wide, int64_t kN>
NANSCAN_INLINE double sum_lanes(const Wide (&ss)[kN]) {
  double ds[kN];
  for (int64_t l = 0; l < kN; ++l) ds[l] = static_cast<double>(ss[l]);
  for (int64_t width = kN / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) ds[l] += ds[l + width];
  }
  return ds[0];
}

// The lanes' min and max, in the same tree (overwrites the arrays).
struct MinMax {
  double min;
  double max;
};

template <class Wide, int64_t kN>
NANSCAN_INLINE MinMax merge_min_max(Wide (&mn)[kN], Wide (&mx)[kN]) {
  for (int64_t width = kN / 2; width > 0; width /= 2) {
    for (int64_t l = 0; l < width; ++l) {
      mn[l] = mn[l + width] < mn[l] ? mn[l + width] : mn[l];
      mx[l] = mx[l + width] > mx[l] ? mx[l + width] : mx[l];
    }
  }
  return MinMax{static_cast<double>(mn[0]), static_cast<double>(mx[0])};
}

// A fast run's lanes merged.
struct MergedLanes {
  double min;
  double max;
  double sumsq;
};

// The fast rule (scan_rules.h) over a run in kLanes lanes, its squares scaled by `scale` (Unscaled, or
// the RunScale carried from the tensor's previous run); the sum is of the scaled squares. With
// kHalfRange, also counts the values fp16 cannot hold, per lane, into over/under.
template <class Codec, bool kHalfRange, class Scale>
NANSCAN_INLINE MergedLanes fast_run(const typename Codec::Raw* p, int64_t len, const Scale& scale,
                                    int32_t (&over)[kLanes], int32_t (&under)[kLanes]) {
  using Wide = typename Codec::Wide;
  Wide mn[kLanes], mx[kLanes], ss[kLanes];
  const FastRun<Codec> init = empty_run<Codec>();
  for (int64_t l = 0; l < kLanes; ++l) {
    mn[l] = init.min;
    mx[l] = init.max;
    ss[l] = init.sumsq;
  }
  auto element = [&](int64_t l, typename Codec::Raw raw) NANSCAN_INLINE_LAMBDA {
    accumulate_fast<Codec>(mn[l], mx[l], ss[l], raw, scale);
    if constexpr (kHalfRange) count_half_range(over[l], under[l], Codec::decode(raw));
  };
  const int64_t full = len - len % kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) element(l, p[i + l]);
  }
  for (int64_t i = full; i < len; ++i) element(i - full, p[i]);
  const MinMax extremes = merge_min_max(mn, mx);
  return MergedLanes{extremes.min, extremes.max, sum_lanes(ss)};
}

// The sum of squares of a run of finite values through the scaled rule (scan_rules.h) with `scale`, in
// the fast rule's lanes; undone to the values' own scale.
template <class Codec>
NANSCAN_INLINE double scaled_run_sumsq(const typename Codec::Raw* p, int64_t len, const RunScale<Codec>& scale) {
  using Wide = typename Codec::Wide;
  Wide ss[kLanes] = {};
  const int64_t full = len - len % kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
    for (int64_t l = 0; l < kLanes; ++l) accumulate_scaled<Codec>(ss[l], p[i + l], scale);
  }
  for (int64_t i = full; i < len; ++i) accumulate_scaled<Codec>(ss[i - full], p[i], scale);
  return scale.undo(sum_lanes(ss));
}

// One run through the checked rule (scan_rules.h), in the fast rule's lanes: NaN/Inf counted by their
// bits, min/max of the finite values (and their fp16-range counts); no sum of squares (the tensor's
// norm is NaN or Inf). With prefetch_next_run (a dense tensor, whose next run follows this one in
// memory), each step also prefetches the next run's lines at the same offset: the memory then
// streams in while this run, read from L1, is classified, as during the checksum's pass; an overflow
// step, whose runs all hold an Inf, then costs the classification's compute, not that plus the
// memory's time.
template <class Codec, bool kHalfRange>
NANSCAN_INLINE TensorStats checked_run(const typename Codec::Raw* p, int64_t len, bool prefetch_next_run) {
  using Wide = typename Codec::Wide;
  // Counts as wide as the elements: no widening of the masks (at most 256 per lane: int16 will do).
  using Count = std::conditional_t<sizeof(typename Codec::Raw) <= 2, int16_t, std::make_signed_t<typename Codec::Raw>>;
  static_assert(kRunElements / kLanes <= 32767, "a lane's counts must fit in its Count");
  Wide mn[kLanes], mx[kLanes];
  Count nonfinite[kLanes] = {}, nan[kLanes] = {};
  int32_t over[kLanes] = {}, under[kLanes] = {};
  const FastRun<Codec> init = empty_run<Codec>();
  for (int64_t l = 0; l < kLanes; ++l) {
    mn[l] = init.min;
    mx[l] = init.max;
  }
  auto element = [&](int64_t l, typename Codec::Raw raw) NANSCAN_INLINE_LAMBDA {
    const Wide v = accumulate_checked<Codec>(mn[l], mx[l], nonfinite[l], nan[l], raw);
    if constexpr (kHalfRange) count_half_range(over[l], under[l], v);
  };
  constexpr int64_t kStepBytes = kLanes * sizeof(typename Codec::Raw);
  constexpr int64_t kLineBytes = 64;
  // An address, not a pointer: past the tensor's end it points at nothing (a prefetch never faults).
  const uintptr_t next_run = reinterpret_cast<uintptr_t>(p + len);
  const int64_t full = len - len % kLanes;
  for (int64_t i = 0; i < full; i += kLanes) {
    if (prefetch_next_run) {
      for (int64_t b = 0; b < kStepBytes; b += kLineBytes) {
        __builtin_prefetch(reinterpret_cast<const void*>(next_run + i * sizeof(typename Codec::Raw) + b));
      }
    }
    for (int64_t l = 0; l < kLanes; ++l) element(l, p[i + l]);
  }
  for (int64_t i = full; i < len; ++i) element(i - full, p[i]);

  TensorStats s = empty_stats();
  for (int64_t l = 0; l < kLanes; ++l) {
    checked_counts(s, static_cast<int64_t>(nonfinite[l]), static_cast<int64_t>(nan[l]));
    if constexpr (kHalfRange) {
      s.half_overflow += over[l];
      s.half_underflow += under[l];
    }
  }
  const MinMax extremes = merge_min_max(mn, mx);
  s.min = extremes.min;
  s.max = extremes.max;
  return s;
}

// Scans one run of at most kRunElements contiguous elements into `s`: the fast rule, and where its
// result is not exact, what it tells or a second read from L1 (scan_rules.h); with kHalfRange, also
// counts the values fp16 cannot hold (a separate instantiation, so the plain scan pays nothing for
// it). `carried`: the scale that made the previous run of the same tensor and chunk exact when its
// values were tiny (else 2^0), which the fast rule applies to this run too: a tensor of vanishing
// gradients then takes one read per run, not two. The runs of a chunk are always read in the same
// order from the chunk's start, so results do not depend on threads. prefetch_next_run: see
// checked_run.
template <class Codec, bool kHalfRange>
NANSCAN_INLINE void scan_run(const typename Codec::Raw* p, int64_t len, TensorStats& s, RunScale<Codec>& carried,
                             bool prefetch_next_run) {
  int32_t over[kLanes] = {}, under[kLanes] = {};
  const bool scaled = carried.exponent != 0;
  const MergedLanes fast = scaled ? fast_run<Codec, kHalfRange>(p, len, carried, over, under)
                                  : fast_run<Codec, kHalfRange>(p, len, Unscaled{}, over, under);
  const bool exact = run_is_exact<Codec>(fast.min, fast.max, fast.sumsq);
  bool finite = exact || fast_run_was_finite(fast.sumsq);
  double sumsq = scaled ? carried.undo(fast.sumsq) : fast.sumsq;
  if (!exact && (finite || squares_may_have_overflowed<Codec>(fast.min, fast.max, scaled))) {
    // Tiny values, or squares that may have overflowed the sum (values of 2^56 and more, or the
    // carried scale too large for this run): the sum alone is redone, scaled, from L1; finite, it
    // proves every element was. Only a scale that enlarges is carried to the next run (RunScale).
    const RunScale<Codec> scale = scale_for_run<Codec>(fast.min, fast.max);
    sumsq = scaled_run_sumsq<Codec>(p, len, scale);
    finite = fast_run_was_finite(sumsq);
    carried = finite && scale.exponent > 0 ? scale : RunScale<Codec>{};
  }
  if (finite) {
    merge_run(s, fast.min, fast.max, sumsq);
    if constexpr (kHalfRange) {
      for (int64_t l = 0; l < kLanes; ++l) {
        s.half_overflow += over[l];
        s.half_underflow += under[l];
      }
    }
    return;
  }
  // A NaN or an Inf (or fp64 squares that overflowed): told by the fast result, or classified from L1.
  carried = RunScale<Codec>{};
  if (uniform_nonfinite_run(fast.min, fast.max, fast.sumsq, len, s)) return;
  TensorStats checked = checked_run<Codec, kHalfRange>(p, len, prefetch_next_run);
  if (all_finite(checked)) checked.sumsq = fast.sumsq;  // fp64 only: +Inf, as torch's (squares_may_have_overflowed)
  s = combine(s, checked);
}

// The logical (row-major) order of the elements of kTensors tensors of the same sizes, each with its
// own strides, walked in rows: stretches of consecutive elements along the innermost dimension. The
// dimensions are simplified first, without changing the order: size-1 dimensions are dropped, and a
// dimension is merged into the one outside it where every tensor steps through the pair as through one
// (stride[outer] == stride[inner] * size[inner]). A split-heads view of a fused projection is then rows
// of 64 unit-stride elements, a chunk of it rows of 768: a row is one copy, and the offsets move by
// adds where a row ends, not by a multi-index summed over every dimension per element (NOTES.md
// entry 44). Kept on the stack (kMaxDims).
template <int kTensors>
class RowWalk {
 public:
  // The walk of `tensors` (sizes of the first; every tensor's own strides) from logical element `begin`.
  RowWalk(const TensorInfo* const (&tensors)[kTensors], int64_t begin) {
    const TensorInfo& shape = *tensors[0];
    for (int64_t d = 0; d < shape.dim; ++d) {
      if (shape.sizes[d] == 1) continue;
      bool merges = ndim_ > 0;
      for (int t = 0; t < kTensors && merges; ++t) {
        merges = tensors[t]->strides[d] * shape.sizes[d] == stride_[t][ndim_ - 1];
      }
      const int64_t into = merges ? ndim_ - 1 : ndim_++;
      size_[into] = merges ? size_[into] * shape.sizes[d] : shape.sizes[d];
      for (int t = 0; t < kTensors; ++t) stride_[t][into] = tensors[t]->strides[d];
    }
    if (ndim_ == 0) {  // a single element (size-1 dimensions only)
      size_[0] = 1;
      for (int t = 0; t < kTensors; ++t) stride_[t][0] = 0;
      ndim_ = 1;
    }
    int64_t rest = begin;
    for (int64_t d = ndim_ - 1; d >= 0; --d) {
      index_[d] = rest % size_[d];
      rest /= size_[d];
    }
    for (int t = 0; t < kTensors; ++t) {
      offset_[t] = 0;
      for (int64_t d = 0; d < ndim_; ++d) offset_[t] += index_[d] * stride_[t][d];
    }
  }

  // The step between the elements of a row, in elements, of tensor t.
  int64_t row_stride(int t) const { return stride_[t][ndim_ - 1]; }

  // Walks the next `len` elements, a row (or the part of one left in `len`) at a time:
  // visit(k, offsets, n) for the n elements at positions [k, k + n) of the walk, the j-th of them in
  // tensor t at offsets[t] + j * row_stride(t).
  template <class Visit>
  NANSCAN_INLINE void walk(int64_t len, Visit&& visit) {
    const int64_t inner = ndim_ - 1;
    for (int64_t k = 0; k < len;) {
      const int64_t n = std::min(len - k, size_[inner] - index_[inner]);
      visit(k, offset_, n);
      k += n;
      index_[inner] += n;
      for (int t = 0; t < kTensors; ++t) offset_[t] += n * stride_[t][inner];
      for (int64_t d = inner; d > 0 && index_[d] == size_[d]; --d) {  // the carry into outer dimensions
        index_[d] = 0;
        ++index_[d - 1];
        for (int t = 0; t < kTensors; ++t) offset_[t] += stride_[t][d - 1] - size_[d] * stride_[t][d];
      }
    }
  }

 private:
  int64_t ndim_ = 0;
  int64_t size_[kMaxDims];
  int64_t stride_[kTensors][kMaxDims];
  int64_t index_[kMaxDims];
  int64_t offset_[kTensors];
};

// Copies n elements of a row, `stride` apart from `from` on, to `to`: one memcpy at unit stride.
template <class Raw>
NANSCAN_INLINE void copy_row(Raw* to, const Raw* from, int64_t n, int64_t stride) {
  if (stride == 1) {
    std::memcpy(to, from, static_cast<size_t>(n) * sizeof(Raw));
  } else {
    for (int64_t j = 0; j < n; ++j) to[j] = from[j * stride];
  }
}

// One unit of parallel work and of partial results: an element range of one tensor (or pair).
struct Chunk {
  int64_t tensor;
  int64_t begin;  // element range, in memory order for dense tensors, logical order otherwise
  int64_t end;
};

// Chunks of a list of tensors (or pairs): each of at most kChunkBytes, fixed by the sizes alone, and
// their starting bytes, by which the threads are balanced.
struct ChunkPlan {
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk;  // per tensor, and one past the last
  std::vector<int64_t> start_byte;
  int64_t total_bytes = 0;
};

inline ChunkPlan plan_chunks(const std::vector<int64_t>& numels, const std::vector<int64_t>& element_bytes) {
  const int64_t n = static_cast<int64_t>(numels.size());
  ChunkPlan plan;
  plan.first_chunk.resize(n + 1);
  plan.chunks.reserve(n);
  plan.start_byte.reserve(n);
  for (int64_t i = 0; i < n; ++i) {
    plan.first_chunk[i] = static_cast<int64_t>(plan.chunks.size());
    const int64_t per_chunk = std::max<int64_t>(1, kChunkBytes / element_bytes[i]);
    for (int64_t b = 0; b < numels[i]; b += per_chunk) {
      plan.chunks.push_back(Chunk{i, b, std::min(numels[i], b + per_chunk)});
      plan.start_byte.push_back(plan.total_bytes);
      plan.total_bytes += (plan.chunks.back().end - b) * element_bytes[i];
    }
  }
  plan.first_chunk[n] = static_cast<int64_t>(plan.chunks.size());
  return plan;
}

// Runs `work(chunk index)` for chunks [first, last) (all of them by default), in parallel: each task
// owns the chunks that start inside its byte range, so which thread computes a chunk never changes the
// chunk's result.
template <class Work>
void run_chunks(const ChunkPlan& plan, int64_t first, int64_t last, Work&& work) {
  if (first >= last) return;
  const int64_t begin = plan.start_byte[first];
  const int64_t end = last < static_cast<int64_t>(plan.chunks.size()) ? plan.start_byte[last] : plan.total_bytes;
  torch::stable::parallel_for(begin, end, kMinParallelBytes, [&](int64_t byte_begin, int64_t byte_end) {
    auto c = std::lower_bound(plan.start_byte.begin() + first, plan.start_byte.begin() + last, byte_begin) -
             plan.start_byte.begin();
    for (; c < last && plan.start_byte[c] < byte_end; ++c) work(c);
  });
}

template <class Work>
void run_chunks(const ChunkPlan& plan, Work&& work) {
  if (plan.total_bytes == 0) return;
  run_chunks(plan, 0, static_cast<int64_t>(plan.chunks.size()), std::forward<Work>(work));
}

}  // namespace nanscan::cpu
