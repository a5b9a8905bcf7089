#include "scan_cpu.h"

#include <torch/csrc/stable/ops.h>

#include "../ops.h"  // kMaxDims

#include <algorithm>
#include <cstring>
#include <type_traits>

// The checksum's SIMD vectors pass only between always-inline functions of this file, so no ABI
// carries them; gcc's note that 32-byte vector arguments changed ABI in GCC 4.6 does not apply.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace nanscan::cpu {
namespace {

// Lanes per SIMD group: 32 fp32 values are two AVX-512 or four AVX2 registers per accumulator,
// enough independent sums to hide the add latency without running out of registers.
constexpr int64_t kLanes = 32;
// Elements per fast run. Each lane adds at most 128 squares in fp32 before the run is folded into
// fp64, which keeps the norm within 1e-6 relative of an fp64 reference: 9.5e-7 measured on
// constant-valued tensors (the worst case for running sums: every rounding error has one sign),
// about 3e-9 on random data.
constexpr int64_t kRunElements = 128 * kLanes;
// Bytes per chunk: the unit of parallel work and of partial results. Fixed by tensor sizes only.
constexpr int64_t kChunkBytes = 256 * 1024;
// Below this many bytes in total the scan runs on the calling thread.
constexpr int64_t kMinParallelBytes = 512 * 1024;

#define NANSCAN_INLINE inline __attribute__((always_inline))
#define NANSCAN_INLINE_LAMBDA __attribute__((always_inline))

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

// The checksum's SIMD lanes, written with GCC vector extensions rather than left to the
// auto-vectoriser: gcc 12 at -O3 miscompiled the same loop written over arrays (an array of salts
// stepped by a constant per lane gave wrong sums, for 1-byte elements in one form and every width in
// another; NOTES.md entry 20). Two vectors of 8 uint32 (AVX2 registers) per step: 0.13 ns per word
// in L1 on a Zen 3 core, where one vector (the multiplies' latency exposed) took 0.40 and four took
// 0.20.
using ChecksumWords = uint32_t __attribute__((vector_size(32)));
constexpr int64_t kWordLanes = 8;
constexpr int64_t kChecksumVectors = 2;
constexpr int64_t kChecksumStepWords = kWordLanes * kChecksumVectors;
constexpr int64_t kChecksumStepBytes = kChecksumStepWords * kReplicaWordBytes;
// A word is its 4 bytes in memory order, least significant first (scan_rules.h): a plain load here.
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "the checksum reads words as little-endian loads");

// The replica checksum (scan_rules.h) of `size` bytes whose first byte starts word `first_word` of the
// tensor. A pass of its own over a run, so that the plain scan's loop keeps its registers, made before
// the scan's pass on a dense tensor: its loads bring the run into L1 while the mix computes, and the
// scan then reads L1 (NOTES.md entry 24: fp32 1.16-1.19x -> 1.04-1.09x a plain scan). Byte-wise, so
// every dtype costs the same per byte. Each lane steps its salt by kChecksumStepWords * kSaltLow (an
// add, not a multiply per word), unless the run crosses a word index that is a multiple of 2^32 (a
// tensor over 16 GiB), where the salt's high part changes. With prefetch_next_run (a dense tensor,
// whose next run follows this one in memory), the pass also prefetches the next run, a line per 64
// bytes checksummed: the memory then keeps streaming while the mix computes, instead of waiting for
// the next run's first loads (NOTES.md entry 20).
NANSCAN_INLINE uint32_t checksum_run(const void* data, int64_t size, uint64_t first_word, bool prefetch_next_run) {
  if (size <= 0) return 0;
  const auto* bytes = static_cast<const unsigned char*>(data);
  const int64_t words = (size + kReplicaWordBytes - 1) / kReplicaWordBytes;
  uint32_t sum = 0;
  int64_t b = 0;
  if ((first_word >> 32) == ((first_word + static_cast<uint64_t>(words) - 1) >> 32)) {
    const uint32_t first = replica_salt(first_word);
    ChecksumWords lanes[kChecksumVectors] = {}, salt[kChecksumVectors];
    for (int64_t v = 0; v < kChecksumVectors; ++v) {
      for (int64_t l = 0; l < kWordLanes; ++l)
        salt[v][l] = first + static_cast<uint32_t>(v * kWordLanes + l) * kSaltLow;
    }
    // An address, not a pointer: past the tensor's end it points at nothing (a prefetch never faults).
    const uintptr_t next_run = reinterpret_cast<uintptr_t>(bytes + size);
    for (; b + kChecksumStepBytes <= size; b += kChecksumStepBytes) {
      if (prefetch_next_run) __builtin_prefetch(reinterpret_cast<const void*>(next_run + b));
      for (int64_t v = 0; v < kChecksumVectors; ++v) {
        ChecksumWords word;
        std::memcpy(&word, bytes + b + v * sizeof(ChecksumWords), sizeof(word));
        lanes[v] += replica_term(word, salt[v]);
        salt[v] += static_cast<uint32_t>(kChecksumStepWords) * kSaltLow;
      }
    }
    for (int64_t v = 0; v < kChecksumVectors; ++v) {
      for (int64_t l = 0; l < kWordLanes; ++l) sum += lanes[v][l];
    }
  }
  // The tail (its last word zero-padded at the tensor's end), and every word of a run that crosses a
  // word index multiple of 2^32, one by one.
  for (; b < size; b += kReplicaWordBytes) {
    const uint32_t word = replica_word_at([&](int64_t i) { return bytes[i]; }, b, size);
    sum += replica_term(word, replica_salt(first_word + static_cast<uint64_t>(b / kReplicaWordBytes)));
  }
  return sum;
}

// The checksum of elements [position, position + len) of a tensor, held at p. Runs start at chunk
// boundaries plus whole runs, so at a word boundary.
template <class Codec>
NANSCAN_INLINE uint32_t checksum_elements(const typename Codec::Raw* p, int64_t len, int64_t position,
                                          bool prefetch_next_run) {
  constexpr int64_t kSize = sizeof(typename Codec::Raw);
  static_assert((kRunElements * kSize) % kReplicaWordBytes == 0 && kChunkBytes % kReplicaWordBytes == 0,
                "runs and chunks must start at word boundaries");
  return checksum_run(p, len * kSize, static_cast<uint64_t>(position * kSize / kReplicaWordBytes), prefetch_next_run);
}

// Replaces each element by round(x * factor) in place, computing in Wide exactly as torch's
// _amp_foreach_non_finite_check_and_unscale_ does (a float factor, widened for fp64).
template <class Codec>
NANSCAN_INLINE void multiply_run(typename Codec::Raw* p, int64_t len, float factor) {
  if constexpr (HasEncode<Codec>::value) {
    const auto f = static_cast<typename Codec::Wide>(factor);
    for (int64_t i = 0; i < len; ++i) p[i] = Codec::encode(Codec::decode(p[i]) * f);
  }
}

// Scans [begin, end) of a dense tensor run by run; with a multiplier, each run is first rewritten
// in place and then scanned while it is still in L1, so the pair costs one read and one write.
template <class Codec, bool kHalfRange>
NANSCAN_INLINE void scan_contiguous(const void* data, int64_t begin, int64_t end, const float* multiply_by,
                                    bool checksum, TensorStats& s) {
  auto* p = static_cast<typename Codec::Raw*>(const_cast<void*>(data));
  RunScale<Codec> carried;
  for (int64_t i = begin; i < end; i += kRunElements) {
    const int64_t len = std::min(kRunElements, end - i);
    if (multiply_by != nullptr) multiply_run<Codec>(p + i, len, *multiply_by);
    // The checksum first: it streams the run in from memory, the scan then reads it from L1.
    if (checksum) s.checksum += checksum_elements<Codec>(p + i, len, i, true);
    scan_run<Codec, kHalfRange>(p + i, len, s, carried, i + len < end);
  }
}

// The position of an element of a tensor that is not dense in memory, stepped in logical (row-major)
// order from a logical index: the strided readers' multi-index, kept on the stack (kMaxDims).
struct LogicalWalk {
  const int64_t* sizes;
  int64_t ndim;
  int64_t index[kMaxDims];

  LogicalWalk(const TensorInfo& t, int64_t begin) : sizes(t.sizes), ndim(t.dim) {
    int64_t rest = begin;
    for (int64_t d = ndim - 1; d >= 0; --d) {
      index[d] = rest % sizes[d];
      rest /= sizes[d];
    }
  }

  // The element's offset, in elements, in a tensor of these sizes with `strides`.
  NANSCAN_INLINE int64_t offset(const int64_t* strides) const {
    int64_t offset = 0;
    for (int64_t d = 0; d < ndim; ++d) offset += index[d] * strides[d];
    return offset;
  }

  NANSCAN_INLINE void next() {
    for (int64_t d = ndim - 1; d >= 0; --d) {
      if (++index[d] < sizes[d]) break;
      index[d] = 0;
    }
  }
};

// Elements [begin, end) in logical (row-major) order of a tensor that is not dense in memory, gathered
// run by run into a stack buffer, so no allocation scales with the tensor.
template <class Codec, bool kHalfRange>
NANSCAN_INLINE void scan_strided(const TensorInfo& t, int64_t begin, int64_t end, bool checksum, TensorStats& s) {
  using Raw = typename Codec::Raw;
  LogicalWalk walk(t, begin);
  const auto* base = static_cast<const Raw*>(t.data);
  Raw buffer[kRunElements];
  RunScale<Codec> carried;
  for (int64_t i = begin; i < end;) {
    const int64_t len = std::min(kRunElements, end - i);
    for (int64_t k = 0; k < len; ++k, walk.next()) buffer[k] = base[walk.offset(t.strides)];
    scan_run<Codec, kHalfRange>(buffer, len, s, carried, false);
    if (checksum) s.checksum += checksum_elements<Codec>(buffer, len, i, false);
    i += len;
  }
}

struct Chunk {
  int64_t tensor;
  int64_t begin;  // element range, in memory order for dense tensors, logical order otherwise
  int64_t end;
};

// The tensor's elements as one contiguous memory span, when it is dense in any permutation of its
// dimensions (contiguous, transposed, channels-last, ...): order does not change the statistics.
const void* dense_span(const TensorInfo& t) { return t.dense ? t.data : nullptr; }

// The only function with hot loops; compiled for several x86 levels and picked at load time.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
__attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#endif
TensorStats scan_chunk(const TensorInfo& t, DType dtype, const void* dense, int64_t begin, int64_t end,
                       const float* multiply_by, bool half_range, bool checksum) {
  TensorStats s = empty_stats();
  switch (dtype) {
#define NANSCAN_SCAN(CODEC, HALF)                                              \
  if (dense) {                                                                 \
    scan_contiguous<CODEC, HALF>(dense, begin, end, multiply_by, checksum, s); \
  } else {                                                                     \
    scan_strided<CODEC, HALF>(t, begin, end, checksum, s);                     \
  }
#define NANSCAN_CASE(TAG, CODEC) \
  case DType::TAG:               \
    if (half_range) {            \
      NANSCAN_SCAN(CODEC, true)  \
    } else {                     \
      NANSCAN_SCAN(CODEC, false) \
    }                            \
    break;
    NANSCAN_CASE(Float32, Float32Codec)
    NANSCAN_CASE(Float64, Float64Codec)
    NANSCAN_CASE(Float16, Float16Codec)
    NANSCAN_CASE(BFloat16, BFloat16Codec)
    NANSCAN_CASE(Float8E4M3FN, Float8E4M3FNCodec)
    NANSCAN_CASE(Float8E5M2, Float8E5M2Codec)
#undef NANSCAN_CASE
#undef NANSCAN_SCAN
  }
  return s;
}

// ---- the difference scan (nanscan::scan_difference: update ratios) -------------------------------

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
// element by element, each by its own strides.
template <class Before, class After>
NANSCAN_INLINE void difference_strided(const TensorInfo& b, const TensorInfo& a, int64_t begin, int64_t end,
                                       TensorStats& diff, TensorStats& after) {
  const auto* pb = static_cast<const typename Before::Raw*>(b.data);
  const auto* pa = static_cast<const typename After::Raw*>(a.data);
  LogicalWalk walk(a, begin);
  typename Before::Raw diffs[kRunElements];
  typename After::Raw afters[kRunElements];
  RunScale<Before> carried_diff;
  RunScale<After> carried_after;
  for (int64_t i = begin; i < end; i += kRunElements) {
    const int64_t len = std::min(kRunElements, end - i);
    for (int64_t k = 0; k < len; ++k, walk.next()) {
      afters[k] = pa[walk.offset(a.strides)];
      diffs[k] = difference_of<Before, After>(pb[walk.offset(b.strides)], afters[k]);
    }
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

// Chunks of a list of tensors (or pairs): each of at most kChunkBytes, fixed by the sizes alone, and
// their starting bytes, by which the threads are balanced.
struct ChunkPlan {
  std::vector<Chunk> chunks;
  std::vector<int64_t> first_chunk;  // per tensor, and one past the last
  std::vector<int64_t> start_byte;
  int64_t total_bytes = 0;
};

ChunkPlan plan_chunks(const std::vector<int64_t>& numels, const std::vector<int64_t>& element_bytes) {
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

// Runs `work(chunk index)` for every chunk, in parallel: each task owns the chunks that start inside
// its byte range, so which thread computes a chunk never changes the chunk's result.
template <class Work>
void run_chunks(const ChunkPlan& plan, Work&& work) {
  if (plan.total_bytes == 0) return;
  torch::stable::parallel_for(0, plan.total_bytes, kMinParallelBytes, [&](int64_t byte_begin, int64_t byte_end) {
    auto c = std::lower_bound(plan.start_byte.begin(), plan.start_byte.end(), byte_begin) - plan.start_byte.begin();
    const int64_t num_chunks = static_cast<int64_t>(plan.chunks.size());
    for (; c < num_chunks && plan.start_byte[c] < byte_end; ++c) work(c);
  });
}

}  // namespace

void scan(const std::vector<TensorInfo>& tensors, const std::vector<DType>& dtypes, const ResultPointers& out,
          std::optional<float> multiply_dense_by) {
  // torch leaves the values untouched (no write) when the factor is exactly 1; so do we.
  const float* multiply_by =
      multiply_dense_by.has_value() && *multiply_dense_by != 1.0f ? &*multiply_dense_by : nullptr;
  const int64_t n = static_cast<int64_t>(tensors.size());
  std::vector<const void*> dense(n);
  std::vector<int64_t> numels(n), element_bytes(n);
  for (int64_t i = 0; i < n; ++i) {
    numels[i] = tensors[i].numel;
    element_bytes[i] = element_size(dtypes[i]);
    dense[i] = numels[i] > 0 ? dense_span(tensors[i]) : nullptr;
  }
  const ChunkPlan plan = plan_chunks(numels, element_bytes);
  std::vector<TensorStats> partial(plan.chunks.size(), empty_stats());
  run_chunks(plan, [&](int64_t c) {
    const Chunk& ch = plan.chunks[c];
    partial[c] = scan_chunk(tensors[ch.tensor], dtypes[ch.tensor], dense[ch.tensor], ch.begin, ch.end, multiply_by,
                            out.half_range, out.checksum);
  });

  TensorStats total = empty_stats();
  for (int64_t i = 0; i < n; ++i) {
    TensorStats s = empty_stats();
    for (int64_t c = plan.first_chunk[i]; c < plan.first_chunk[i + 1]; ++c) s = combine(s, partial[c]);
    write_tensor_result(out, i, s);
    total = combine(total, s);
  }
  write_totals(out, total);
}

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
