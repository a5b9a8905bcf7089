// The semantics of a scan, written once for every backend.
//
// A scan reduces a tensor to TensorStats: NaN count, Inf count, min and max over the finite elements,
// and the sum of squares of the finite elements. Backends only choose the loop structure (SIMD lanes
// on the CPU, threads and blocks on the GPU); every decision about a value is made by a function here.
//
// Two rules exist for accumulating elements, and a backend must use them as this file prescribes:
//
//  * accumulate_exact(): the definition. Classifies each element by its bits, fp64, correct for
//    every input.
//  * accumulate_fast():  for a run of elements processed in SIMD lanes / per thread: no
//    classification at all, squares summed in the format's Wide type (fp32 for all but fp64). When
//    the run ends, run_is_exact() says whether the fast result equals what accumulate_exact() would
//    have produced; when it does not, the backend re-reads the run with accumulate_exact().
//
// Why the fast rule needs no per-element test: a NaN or Inf element makes its square NaN or +Inf, and
// a sum of non-negative terms that meets a NaN or +Inf stays NaN or +Inf. So "the run's sum of
// squares is finite" implies "every element was finite". The converse does not hold (finite values
// above 1.8e19 overflow an fp32 square), which only sends such runs down the exact path; the finite
// flag and the counts always come from accumulate_exact()'s bit tests, never from a sum.
#pragma once

#include <cmath>
#include <cstdint>

#include "dtypes.h"

namespace nanscan {

struct TensorStats {
  int64_t nan_count;
  int64_t inf_count;
  double min;    // over finite elements; +inf when there are none
  double max;    // over finite elements; -inf when there are none
  double sumsq;  // over finite elements
  // Only when the fp16-range option is on (zero otherwise): finite elements an fp16 cannot hold,
  // because they overflow it or because fp16 would flush them to zero (see count_half_range).
  int64_t half_overflow;
  int64_t half_underflow;
  // Only when the checksum option is on (zero otherwise): the replica checksum (below).
  uint32_t checksum;
};

NANSCAN_HD TensorStats empty_stats() { return TensorStats{0, 0, INFINITY, -INFINITY, 0.0, 0, 0, 0}; }

// The replica checksum: an order-sensitive hash of a tensor's bits, so that replicas whose values
// must be bit-identical (DDP gradients after the all-reduce, Replicate placements, parameters after
// the step) can be compared with one small collective. The tensor's elements, in checksum order
// (memory order from the lowest address for a tensor dense in some permutation of its dimensions,
// logical row-major order otherwise), are read as one string of bytes and cut into 32-bit
// little-endian words, the last one zero-padded: an fp32 element is one word, two 16-bit or four
// 8-bit elements share one, an fp64 element is two. Word q adds, modulo 2^32, murmur3's finalizer of
// (word ^ salt(q)), a bijection of the word for a given q: a change within one word (of one element
// or of several) always changes the sum, and changes of several words cancel with probability about
// 2^-32 (a sum modulo 2^64 of the same 32-bit terms would be no stronger, and costs twice the SIMD
// lanes). The mix costs the same per word whatever the dtype, so a bf16 or fp8 tensor costs what an
// fp32 tensor of the same bytes costs (a mix per element made bf16 1.8x slower: benchmarks/NOTES.md
// entries 20 and 24). Combining partial sums is addition, so the result does not depend on how the
// work was split, as long as every part starts at a word boundary: the backends' chunks are whole
// multiples of 4 bytes.
constexpr int64_t kReplicaWordBytes = 4;
constexpr uint32_t kSaltLow = 0x9E3779B9u;   // per unit of the word index's low 32 bits
constexpr uint32_t kSaltHigh = 0x85EBCA77u;  // per unit of its high 32 bits

NANSCAN_HD uint32_t replica_salt(uint64_t word_index) {
  return static_cast<uint32_t>(word_index) * kSaltLow + static_cast<uint32_t>(word_index >> 32) * kSaltHigh;
}

// murmur3's finalizer. A template so that the CPU applies this one definition to SIMD vectors of
// words too (GCC vector extensions), where Word is a vector of uint32 and the operators act per lane.
template <class Word>
NANSCAN_HD Word replica_mix(Word x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// One word's term of the checksum (or a SIMD vector of words' terms, with their salts).
template <class Word>
NANSCAN_HD Word replica_term(Word word, Word salt) {
  return replica_mix(word ^ salt);
}

// The word that starts at byte `offset` of `size` bytes, byte b read by load_byte(b); bytes at or past
// `size` (the tensor's end) are zero: the last word of a tensor whose size is not a multiple of 4.
template <class LoadByte>
NANSCAN_HD uint32_t replica_word_at(LoadByte&& load_byte, int64_t offset, int64_t size) {
  uint32_t word = 0;
  for (int64_t b = 0; b < kReplicaWordBytes && offset + b < size; ++b) {
    word |= static_cast<uint32_t>(load_byte(offset + b)) << (8 * b);
  }
  return word;
}

// fp16's limits: the largest finite value, and the smallest subnormal (values below it, other than
// zero, are lost when stored as fp16).
constexpr float kHalfMax = 65504.0f;
constexpr float kHalfSmallestSubnormal = 5.9604644775390625e-8f;  // 2^-24

// Counts a finite value that fp16 cannot hold. Callers pass finite values only (the fast rule's
// counts are discarded with the rest of a run that held a NaN/Inf).
template <class Wide, class Count>
NANSCAN_HD void count_half_range(Count& overflow, Count& underflow, Wide v) {
  const Wide a = v < Wide(0) ? -v : v;
  overflow += a > Wide(kHalfMax) ? 1 : 0;
  underflow += (a < Wide(kHalfSmallestSubnormal) && a > Wide(0)) ? 1 : 0;
}

// Magnitudes at or above kFirstNonFinite are NaN or Inf; a bit test, so no compiler flag removes it.
template <class Codec>
NANSCAN_HD bool is_nonfinite_magnitude(typename Codec::Raw mag) {
  return mag >= Codec::kFirstNonFinite;
}

template <class Codec>
NANSCAN_HD bool is_nan_magnitude(typename Codec::Raw mag) {
  return Codec::kHasInf ? mag > Codec::kFirstNonFinite : mag >= Codec::kFirstNonFinite;
}

// The definition of one element's contribution. Min/max use a strict comparison on finite values
// only, so the result never depends on where a NaN sits (unlike fminf or vminps with a NaN operand).
template <class Codec>
NANSCAN_HD void accumulate_exact(TensorStats& s, typename Codec::Raw raw, bool half_range) {
  const typename Codec::Raw mag = raw & Codec::kMagnitudeMask;
  if (is_nonfinite_magnitude<Codec>(mag)) {
    if (is_nan_magnitude<Codec>(mag)) {
      ++s.nan_count;
    } else {
      ++s.inf_count;
    }
    return;
  }
  const double v = static_cast<double>(Codec::decode(raw));
  s.min = v < s.min ? v : s.min;
  s.max = v > s.max ? v : s.max;
  s.sumsq += v * v;
  if (half_range) count_half_range(s.half_overflow, s.half_underflow, v);
}

// One lane's (or thread's) state over a run of elements; see the file comment.
template <class Codec>
struct FastRun {
  using Wide = typename Codec::Wide;
  Wide min;
  Wide max;
  Wide sumsq;
};

template <class Codec>
NANSCAN_HD FastRun<Codec> empty_run() {
  using Wide = typename Codec::Wide;
  return FastRun<Codec>{static_cast<Wide>(INFINITY), static_cast<Wide>(-INFINITY), Wide(0)};
}

// Branch-free (selects, not jumps) so that compilers vectorise it across lanes. With a NaN or Inf in
// the run, min/max here are meaningless; the sum of squares then is NaN or +Inf and run_is_exact()
// rejects the run.
// On the GPU, fmin/fmax on floats are one instruction (FMNMX) against a compare and a select. They
// return the same value here: `min` is never NaN (it starts at +inf and only ever takes a v below
// it), fmin(NaN, min) is min like the select, and the runs where a NaN could matter are discarded
// anyway; only the sign of a zero minimum can differ, which no statistic tells apart (-0.0 == 0.0).
template <class Codec>
NANSCAN_HD void accumulate_fast(typename Codec::Wide& min, typename Codec::Wide& max, typename Codec::Wide& sumsq,
                                typename Codec::Raw raw) {
  const typename Codec::Wide v = Codec::decode(raw);
#if defined(__CUDA_ARCH__)
  min = fmin(v, min);
  max = fmax(v, max);
#else
  min = v < min ? v : min;
  max = v > max ? v : max;
#endif
  sumsq += v * v;
}

// Below this, an fp32 sum of squares may hold squares that rounded in the subnormal range; above it,
// their total absolute error (<= run length * 2^-149) is under 2^-37 of the sum.
constexpr double kSmallestExactFloatSumsq = 7.888609052210118e-31;  // 2^-100

// Whether a run's fast result (lanes already merged: min, max, and the fp64 sum of the lanes' Wide
// sums of squares) equals the exact rule's. Not when the sum is NaN or Inf (a NaN/Inf element, or an
// fp32 square that overflowed), nor when an fp32 sum is so small that squares may have lost bits to
// subnormal rounding, unless every element was zero. fp64 squares are what torch computes, overflow
// and underflow included, so for fp64 only NaN/Inf elements force the exact path.
template <class Codec>
NANSCAN_HD bool run_is_exact(double run_min, double run_max, double run_sumsq) {
  if (!(run_sumsq < INFINITY)) return false;  // NaN or +Inf
  if (sizeof(typename Codec::Wide) == sizeof(double)) return true;
  return run_sumsq >= kSmallestExactFloatSumsq || (run_min == 0.0 && run_max == 0.0);
}

// Fold an exact run (already merged across lanes) into tensor statistics.
NANSCAN_HD void merge_run(TensorStats& s, double run_min, double run_max, double run_sumsq) {
  s.min = run_min < s.min ? run_min : s.min;
  s.max = run_max > s.max ? run_max : s.max;
  s.sumsq += run_sumsq;
}

// Combine two partial results. Callers combine in a fixed order (chunk order within a tensor, tensor
// order for totals), which is what makes results bit-identical across runs and thread counts.
NANSCAN_HD TensorStats combine(const TensorStats& a, const TensorStats& b) {
  return TensorStats{a.nan_count + b.nan_count,           a.inf_count + b.inf_count, b.min < a.min ? b.min : a.min,
                     b.max > a.max ? b.max : a.max,       a.sumsq + b.sumsq,         a.half_overflow + b.half_overflow,
                     a.half_underflow + b.half_underflow, a.checksum + b.checksum};
}

// The L2 norm with torch semantics: NaN if any element is NaN, else Inf if any is Inf. Finite values
// whose squares overflow fp64 give Inf exactly as torch's fp64 norm does.
NANSCAN_HD double l2_norm(const TensorStats& s) {
  if (s.nan_count > 0) return NAN;
  if (s.inf_count > 0) return INFINITY;
  return sqrt(s.sumsq);
}

NANSCAN_HD bool all_finite(const TensorStats& s) { return s.nan_count == 0 && s.inf_count == 0; }

// Where a scan's results go; the op layer allocates these, every backend fills them the same way.
// counts: int64 [2, N] (NaN counts, then Inf counts), or [4, N] with the fp16-range option (then
// fp16 overflow and fp16 underflow counts); stats: float64 [3, N] (min, max, norm).
struct ResultPointers {
  int64_t* counts;
  double* stats;
  double* total_norm;  // 0-dim
  bool* finite;        // 0-dim
  int64_t num_tensors;
  bool half_range;
  bool checksum;  // counts has one more row, after the fp16 ones: the checksums (0 to 2^32 - 1)
  // 0-dim: the total norm again, in the dtype torch's get_total_norm returns for these tensors
  // (norm_dtype_of, ops.h), so that the Python layer need not read every tensor's dtype to cast it.
  void* total_norm_cast;
  DType total_norm_cast_dtype;  // Float32, Float64, Float16 or BFloat16
};

NANSCAN_HD void write_tensor_result(const ResultPointers& out, int64_t i, const TensorStats& s) {
  const int64_t n = out.num_tensors;
  out.counts[i] = s.nan_count;
  out.counts[n + i] = s.inf_count;
  if (out.half_range) {
    out.counts[2 * n + i] = s.half_overflow;
    out.counts[3 * n + i] = s.half_underflow;
  }
  if (out.checksum) out.counts[(out.half_range ? 4 : 2) * n + i] = static_cast<int64_t>(s.checksum);
  out.stats[i] = s.min;
  out.stats[n + i] = s.max;
  out.stats[2 * n + i] = l2_norm(s);
}

// A float64 norm stored as torch's `.to(dtype)` rounds it: to fp32 once; to fp16 and bf16 through
// fp32, as c10's Half and BFloat16 convert a double (they take a float), which rounds twice.
NANSCAN_HD void store_norm_as(void* p, DType dtype, double norm) {
  switch (dtype) {
    case DType::Float64: *static_cast<double*>(p) = norm; break;
    case DType::Float32: *static_cast<float*>(p) = static_cast<float>(norm); break;
    case DType::Float16: *static_cast<uint16_t*>(p) = Float16Codec::encode(static_cast<float>(norm)); break;
    case DType::BFloat16: *static_cast<uint16_t*>(p) = BFloat16Codec::encode(static_cast<float>(norm)); break;
    default: break;  // float8: a norm never has it (norm_dtype_of counts float8 as float32)
  }
}

// The totals: a combine of every element's contribution in an order fixed per backend and input.
NANSCAN_HD void write_totals(const ResultPointers& out, const TensorStats& total) {
  const double norm = l2_norm(total);
  *out.total_norm = norm;
  store_norm_as(out.total_norm_cast, out.total_norm_cast_dtype, norm);
  *out.finite = all_finite(total);
}

}  // namespace nanscan
