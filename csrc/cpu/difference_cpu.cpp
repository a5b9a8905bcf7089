// The CPU difference scan (nanscan::scan_difference, behind the update ratios): each pair's chunk
// through the run kernels (runs.h), the differences made run by run on the stack, never written.

#include "scan_cpu.h"

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

// Cloned for AVX2 and the baseline only: the pass runs on sampled steps and is memory-bound, and an
// AVX-512 clone of its eleven dtype pairs would add a third to the library's compile time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v3", "default")))
#endif
PairStats difference_chunk(const TensorInfo& b, DType before_dtype, const TensorInfo& a, DType after_dtype, bool dense,
                           int64_t begin, int64_t end) {
  PairStats s{empty_stats(), empty_stats()};
  // Written out (no lambdas): the hot loops must inline into this function, which is cloned per x86
  // level, not into a lambda's operator(), which would not be.
#define NANSCAN_PAIR(BEFORE, AFTER)                                       \
  if (dense) {                                                            \
    difference_dense<BEFORE, AFTER>(b, a, begin, end, s.diff, s.after);   \
  } else {                                                                \
    difference_strided<BEFORE, AFTER>(b, a, begin, end, s.diff, s.after); \
  }
#define NANSCAN_AFTER(BEFORE, FLOAT64_AFTER)                                 \
  switch (after_dtype) {                                                     \
    case DType::Float32: NANSCAN_PAIR(BEFORE, Float32Codec) break;           \
    case DType::Float64: FLOAT64_AFTER break;                                \
    case DType::Float16: NANSCAN_PAIR(BEFORE, Float16Codec) break;           \
    case DType::BFloat16: NANSCAN_PAIR(BEFORE, BFloat16Codec) break;         \
    case DType::Float8E4M3FN: NANSCAN_PAIR(BEFORE, Float8E4M3FNCodec) break; \
    case DType::Float8E5M2: NANSCAN_PAIR(BEFORE, Float8E5M2Codec) break;     \
  }
  if (before_dtype == DType::Float64) {
    NANSCAN_AFTER(Float64Codec, NANSCAN_PAIR(Float64Codec, Float64Codec))
  } else {  // float32 (the op admits float32 and float64 only), never with a float64 after (refused)
    NANSCAN_AFTER(Float32Codec, )
  }
#undef NANSCAN_AFTER
#undef NANSCAN_PAIR
  return s;
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
