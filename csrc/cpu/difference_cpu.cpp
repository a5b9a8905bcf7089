// The CPU difference scan (nanscan::scan_difference, behind the update ratios): each pair's chunk
// through the run kernels (runs.h), the differences made run by run on the stack, never written.

#include "scan_cpu.h"

#include <type_traits>

#include "runs.h"

namespace nanscan::cpu {
namespace {

// Elements [begin, end) of a pair held dense with the same strides: run by run, the differences into a
// stack buffer and scanned from there, and `after`'s run scanned while it is still in L1 from making
// them. One read of each tensor, no write.
template <class Before, class After>
NANSCAN_INLINE void difference_dense(const TensorInfo& b, const TensorInfo& a, int64_t begin, int64_t end,
                                     TensorStats& diff, TensorStats& after) {
  const auto* pb = static_cast<const typename Before::Raw*>(b.data);
  const auto* pa = static_cast<const typename After::Raw*>(a.data);
  typename Before::Raw buffer[kRunElements];
  RunScale<Before> carried_diff;
  RunScale<After> carried_after;
  for (int64_t i = begin; i < end; i += kRunElements) {
    const int64_t len = std::min(kRunElements, end - i);
    for (int64_t k = 0; k < len; ++k) buffer[k] = difference_of<Before, After>(pb[i + k], pa[i + k]);
    scan_run<Before, false>(buffer, len, diff, carried_diff, false);
    scan_run<After, false>(pa + i, len, after, carried_after, i + len < end);
  }
}

// Elements [begin, end) in logical order of a pair not both dense with the same strides: both gathered
// a row at a time (RowWalk), each by its own strides.
template <class Before, class After>
NANSCAN_INLINE void difference_strided(const TensorInfo& b, const TensorInfo& a, int64_t begin, int64_t end,
                                       TensorStats& diff, TensorStats& after) {
  const auto* pb = static_cast<const typename Before::Raw*>(b.data);
  const auto* pa = static_cast<const typename After::Raw*>(a.data);
  RowWalk<2> walk({&a, &b}, begin);
  const int64_t stride_a = walk.row_stride(0), stride_b = walk.row_stride(1);
  typename Before::Raw diffs[kRunElements];
  typename After::Raw afters[kRunElements];
  RunScale<Before> carried_diff;
  RunScale<After> carried_after;
  for (int64_t i = begin; i < end; i += kRunElements) {
    const int64_t len = std::min(kRunElements, end - i);
    walk.walk(len, [&](int64_t k, const int64_t (&offset)[2], int64_t n) NANSCAN_INLINE_LAMBDA {
      copy_row(afters + k, pa + offset[0], n, stride_a);
      const typename Before::Raw* before = pb + offset[1];
      for (int64_t j = 0; j < n; ++j) diffs[k + j] = difference_of<Before, After>(before[j * stride_b], afters[k + j]);
    });
    scan_run<Before, false>(diffs, len, diff, carried_diff, false);
    scan_run<After, false>(afters, len, after, carried_after, false);
  }
}

struct PairStats {
  TensorStats diff;
  TensorStats after;
};

// One chunk of one dtype pair, dense or strided: the hot loops, inlined into a function compiled for
// AVX2 and the baseline (an AVX-512 clone of a pass that runs on sampled steps and is memory-bound
// would add a third to its compile time). One function per case, as the scan's (scan_cpu.cpp).
template <class Before, class After, bool kDense>
NANSCAN_X86_CLONES("arch=x86-64-v3", "default")
PairStats difference_chunk_of(const TensorInfo& b, const TensorInfo& a, int64_t begin, int64_t end) {
  PairStats s{empty_stats(), empty_stats()};
  if constexpr (kDense) {
    difference_dense<Before, After>(b, a, begin, end, s.diff, s.after);
  } else {
    difference_strided<Before, After>(b, a, begin, end, s.diff, s.after);
  }
  return s;
}

template <class Before, class After>
PairStats difference_chunk_by_layout(const TensorInfo& b, const TensorInfo& a, bool dense, int64_t begin, int64_t end) {
  return dense ? difference_chunk_of<Before, After, true>(b, a, begin, end)
               : difference_chunk_of<Before, After, false>(b, a, begin, end);
}

template <class Before>
PairStats difference_chunk_after(const TensorInfo& b, const TensorInfo& a, DType after_dtype, bool dense, int64_t begin,
                                 int64_t end) {
  switch (after_dtype) {
    case DType::Float32: return difference_chunk_by_layout<Before, Float32Codec>(b, a, dense, begin, end);
    case DType::Float16: return difference_chunk_by_layout<Before, Float16Codec>(b, a, dense, begin, end);
    case DType::BFloat16: return difference_chunk_by_layout<Before, BFloat16Codec>(b, a, dense, begin, end);
    case DType::Float8E4M3FN: return difference_chunk_by_layout<Before, Float8E4M3FNCodec>(b, a, dense, begin, end);
    case DType::Float8E5M2: return difference_chunk_by_layout<Before, Float8E5M2Codec>(b, a, dense, begin, end);
    case DType::Float64:
      // Only after a float64 before: the op refuses an after wider than its before.
      if constexpr (std::is_same_v<Before, Float64Codec>)
        return difference_chunk_by_layout<Before, Float64Codec>(b, a, dense, begin, end);
      break;
  }
  return PairStats{empty_stats(), empty_stats()};
}

PairStats difference_chunk(const TensorInfo& b, DType before_dtype, const TensorInfo& a, DType after_dtype, bool dense,
                           int64_t begin, int64_t end) {
  // The op admits float32 and float64 befores only.
  return before_dtype == DType::Float64 ? difference_chunk_after<Float64Codec>(b, a, after_dtype, dense, begin, end)
                                        : difference_chunk_after<Float32Codec>(b, a, after_dtype, dense, begin, end);
}

}  // namespace

void scan_difference(const std::vector<TensorInfo>& before, const std::vector<DType>& before_dtypes,
                     const std::vector<TensorInfo>& after, const std::vector<DType>& after_dtypes,
                     const ResultPointers& out) {
  const int64_t n = static_cast<int64_t>(before.size());
  std::vector<int64_t> numels(n), element_bytes(n);
  std::vector<bool> dense(n);
  for (int64_t i = 0; i < n; ++i) {
    numels[i] = after[i].numel;
    element_bytes[i] = element_size(before_dtypes[i]) + element_size(after_dtypes[i]);  // both are read
    dense[i] = same_dense_layout(before[i], after[i]);
  }
  const ChunkPlan plan = plan_chunks(numels, element_bytes);
  std::vector<PairStats> partial(plan.chunks.size(), PairStats{empty_stats(), empty_stats()});
  run_chunks(plan, [&](int64_t c) {
    const Chunk& ch = plan.chunks[c];
    const int64_t i = ch.tensor;
    partial[c] = difference_chunk(before[i], before_dtypes[i], after[i], after_dtypes[i], dense[i], ch.begin, ch.end);
  });

  TensorStats total = empty_stats();
  for (int64_t i = 0; i < n; ++i) {
    PairStats s{empty_stats(), empty_stats()};
    for (int64_t c = plan.first_chunk[i]; c < plan.first_chunk[i + 1]; ++c) {
      s.diff = combine(s.diff, partial[c].diff);
      s.after = combine(s.after, partial[c].after);
    }
    write_tensor_result(out, i, s.diff);
    write_tensor_result(out, n + i, s.after);
    total = combine(combine(total, s.diff), s.after);
  }
  write_totals(out, total);
}

}  // namespace nanscan::cpu
