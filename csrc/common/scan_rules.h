// The semantics of a scan, written once for every backend.
//
// A scan reduces a tensor to TensorStats: NaN count, Inf count, min and max over the finite elements,
// and the sum of squares of the finite elements. Backends only choose the loop structure (SIMD lanes
// on the CPU, threads and blocks on the GPU); every decision about a value is made by a function here.
//
// Three rules accumulate elements, and a backend uses them as this file prescribes:
//
//  * accumulate_exact(): the definition. Classifies each element by its bits, fp64, correct for
//    every input; one element at a time. The tests' reference (and the CUDA emulator's); no backend
//    runs it on a hot path.
//  * accumulate_fast(): for a run of elements processed in SIMD lanes / per thread: no
//    classification at all, squares summed in the format's Wide type (fp32 for all but fp64). When
//    the run ends, run_is_exact() says whether the fast result equals the definition's (to the
//    contract: bit-exact counts and min/max, the norm within 1e-6 relative). When it does not, the
//    fast result may still tell the run's statistics (uniform_nonfinite_run(): every element NaN, or
//    every one the same Inf); otherwise the backend reads the run again (from L1: it was just
//    read), in the same lanes, with one of:
//  * accumulate_scaled(), when the fast sum was finite (so every element was, and the fast min/max
//    stand) but too small to be exact: vanishing gradients, |g| below ~1e-16, whose fp32 squares
//    round in the subnormal range or underflow. Only the sum of squares is redone, of the values
//    times an exact power of two (RunScale) that makes them ordinary, and scaled back in fp64. A
//    backend may also apply that scale in the fast rule to the runs that follow (the CPU does: the
//    runs of a tensor of tiny values then take one read each).
//    The same scaled re-read comes first for a run whose float squares may have overflowed the sum
//    (squares_may_have_overflowed()): if its scaled sum is finite, so was every element.
//  * accumulate_checked(), when the fast sum was NaN or Inf (and no scaled sum was finite): each
//    element classified by its bits (branch-free, so it vectorises like the fast rule), NaN/Inf
//    counted, min/max of the finite values. No sum of squares: a tensor holding a NaN or an Inf has
//    a NaN or Inf norm, whatever its finite values add up to (l2_norm), so a run with one leaves
//    TensorStats::sumsq as it was.
//
// Why the fast rule needs no per-element test: a NaN or Inf element makes its square NaN or +Inf, and
// a sum of non-negative terms that meets a NaN or +Inf stays NaN or +Inf. So "the run's sum of
// squares is finite" implies "every element was finite". The converse does not hold (finite values
// above 1.8e19 overflow an fp32 square), which only sends such runs to the checked rule; the finite
// flag and the counts always come from bit tests (accumulate_checked(), accumulate_exact()), never
// from a sum.
//
// Why the runs a backend reads again cost little: the second read is of a run the first just brought
// into L1 (CPU: 16 KiB runs) or L1/L2 (GPU: 32 KiB chunks), in vector lanes. The fp64
// element-by-element re-read these runs once took made tiny values cost 10-19x ordinary ones
// (benchmarks/NOTES.md entry 31).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "dtypes.h"
#include "murmur.h"

namespace nanscan {

struct TensorStats {
  int64_t nan_count;
  int64_t inf_count;
  double min;  // over finite elements; +inf when there are none
  double max;  // over finite elements; -inf when there are none
  // Over the finite elements; where an element is NaN or Inf, what it holds does not matter (the norm
  // is then NaN or Inf), and the backends leave out the runs that hold one.
  double sumsq;
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

// murmur3's finalizer (murmur.h), of a word or of a SIMD vector of words.
template <class Word>
NANSCAN_HD Word replica_mix(Word x) {
  return murmur_finalizer(x);
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

// Counts a finite value that fp16 cannot hold. Callers pass finite values, or NaN, which counts as
// neither (the checked rule's stand-in for a NaN or an Inf); the fast rule's counts are discarded
// with the rest of a run that held a NaN/Inf.
template <class Wide, class Count>
NANSCAN_HD void count_half_range(Count& overflow, Count& underflow, Wide v) {
  const Wide a = v < Wide(0) ? -v : v;
  overflow += a > Wide(kHalfMax) ? 1 : 0;
  underflow += (a < Wide(kHalfSmallestSubnormal) && a > Wide(0)) ? 1 : 0;
}

// Magnitudes at or above kFirstNonFinite are NaN or Inf; a bit test, so no compiler flag removes it.
// Compared as signed integers (a magnitude's top bit is clear, so the order is the same): x86 before
// AVX-512 has no unsigned vector compare, and gcc spent two more instructions a test emulating one.
template <class Codec>
NANSCAN_HD bool is_nonfinite_magnitude(typename Codec::Raw mag) {
  using Signed = std::make_signed_t<typename Codec::Raw>;
  return static_cast<Signed>(mag) >= static_cast<Signed>(Codec::kFirstNonFinite);
}

template <class Codec>
NANSCAN_HD bool is_nan_magnitude(typename Codec::Raw mag) {
  using Signed = std::make_signed_t<typename Codec::Raw>;
  const Signed m = static_cast<Signed>(mag), first = static_cast<Signed>(Codec::kFirstNonFinite);
  return Codec::kHasInf ? m > first : m >= first;
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

// The exact power of two 2^k by which the scaled rule multiplies each value of a run before squaring
// it, and its undoing, 2^-2k, applied to the run's fp64 sum of squares.
//
// Proof that a scaled run meets the contract. Scaling applies to float sums (fp32 and bf16 values;
// fp16 and fp8 values are never tiny or huge enough, and an fp64 sum is torch's own) of runs whose
// elements are all finite and whose fast sum was under 2^-100 (tiny values: the largest magnitude M
// is below 2^-50) or overflowed (M at least 2^56; or any M, with a carried scale too large for the
// run: see squares_may_have_overflowed()). k is min(-e, 126), where M = f * 2^e with f in
// [0.5, 1): M * 2^k is in [0.5, 1), or, for a run of fp32 subnormals only (M below 2^-126), in
// [2^-23, 2^-1). (2^k, down to 2^-128, is a float: a subnormal one below 2^-126.)
//  * Scaling up (k > 0) is exact: a float times a power of two is exact unless the result overflows
//    or falls below the normal range, and here every |v| * 2^k is below 1 and at or above |v| (a
//    subnormal v gains exponent, and its significand fits any exponent above it).
//  * Scaling down (k < 0) rounds only an element that becomes subnormal, by at most 2^-150: its
//    square changes by under 2^-149, against a sum of at least 0.25 (M's own scaled square).
//  * The scaled sum is at least (M * 2^k)^2 >= 2^-46 and below 2^14: run_is_exact()'s bound on
//    subnormal rounding holds for it as for any sum above 2^-100, and the lanes' sums (at most 128
//    squares below 1 between fp64 folds) cannot overflow.
//  * Every other rounding is the fast rule's: the same float operations on values of the same
//    significands, so the same relative errors (the contract's 1e-6 norm bound is the fast rule's).
//  * Undoing: the fp64 sum, in [2^-46, 2^14), times 2^-2k (k in [-128, 126]) lies in
//    [2^-298, 2^270], inside fp64's normal range: the multiplication is exact.
// The same holds for any k > 0 with which a scaled sum is finite and at least 2^-100 (the fast rule
// with a carried scale, below): a scaled value that overflowed would have made the sum +Inf.
template <class Codec>
struct RunScale {
  using Wide = typename Codec::Wide;
  Wide factor = Wide(1);  // 2^k
  int exponent = 0;       // k; 0: no scale

  NANSCAN_HD Wide apply(Wide v) const { return v * factor; }
  NANSCAN_HD double undo(double scaled_sumsq) const { return ldexp(scaled_sumsq, -2 * exponent); }
};

// The scale of a rule that squares the values themselves: no instruction at all.
struct Unscaled {
  template <class Wide>
  NANSCAN_HD Wide apply(Wide v) const {
    return v;
  }
  NANSCAN_HD double undo(double sumsq) const { return sumsq; }
};

// The scale for a run of finite values in [run_min, run_max], not all zero: see RunScale.
// (Never needed for fp64, whose sums are exact whenever finite and torch's when not: 2^0.)
template <class Codec>
NANSCAN_HD RunScale<Codec> scale_for_run(double run_min, double run_max) {
  using Wide = typename Codec::Wide;
  if (sizeof(Wide) == sizeof(double)) return RunScale<Codec>{};
  constexpr int kLargestShift = 126;
  const double largest = -run_min > run_max ? -run_min : run_max;
  int e = 0;
  frexp(largest, &e);  // largest = f * 2^e, f in [0.5, 1)
  RunScale<Codec> scale;
  scale.exponent = -e < kLargestShift ? -e : kLargestShift;
  scale.factor = static_cast<Wide>(ldexp(1.0, scale.exponent));
  return scale;
}

// Branch-free (selects, not jumps) so that compilers vectorise it across lanes. With a NaN or Inf in
// the run the sum of squares is NaN or +Inf and run_is_exact() rejects the run; min/max then tell
// only what uniform_nonfinite_run() reads from them: the selects pass over a NaN (a comparison with
// NaN is false), and an Inf moves one of them (+Inf the max, -Inf the min).
// On the GPU, fmin/fmax on floats are one instruction (FMNMX) against a compare and a select. They
// return the same value here: `min` is never NaN (it starts at +inf and only ever takes a v below
// it), fmin(NaN, min) is min like the select, fmin(-Inf, min) is -Inf; only the sign of a zero
// minimum can differ, which no statistic tells apart (-0.0 == 0.0).
// With a scale (the CPU's runs after a run of tiny values: see RunScale), the sum is of the scaled
// values' squares, and exact when run_is_exact() says so of it (RunScale's proof, for k > 0 only:
// a scaled value that overflows makes the sum +Inf, and a sum of at least 2^-100 bounds the
// subnormal rounding as for unscaled values).
template <class Codec, class Scale = Unscaled>
NANSCAN_HD void accumulate_fast(typename Codec::Wide& min, typename Codec::Wide& max, typename Codec::Wide& sumsq,
                                typename Codec::Raw raw, const Scale& scale = Scale{}) {
  const typename Codec::Wide v = Codec::decode(raw);
#if defined(__CUDA_ARCH__)
  min = fmin(v, min);
  max = fmax(v, max);
#else
  min = v < min ? v : min;
  max = v > max ? v : max;
#endif
  const typename Codec::Wide scaled = scale.apply(v);
  sumsq += scaled * scaled;
}

// Below this, an fp32 sum of squares may hold squares that rounded in the subnormal range; above it,
// their total absolute error (<= run length * 2^-149, with runs of at most 2^14 elements) is under
// 2^-35 of the sum.
constexpr double kSmallestExactFloatSumsq = 7.888609052210118e-31;  // 2^-100

// Whether every finite element of a run was zero (or there was none): its sum of squares is then 0,
// exactly, whatever the sum's format. min/max over the run's finite elements (+inf/-inf if none).
NANSCAN_HD bool finite_values_all_zero(double run_min, double run_max) { return !(run_min < 0.0 || run_max > 0.0); }

// Whether a run's fast result (lanes already merged: min, max, and the fp64 sum of the lanes' Wide
// sums of squares) equals the exact rule's. Not when the sum is NaN or Inf (a NaN/Inf element, or an
// fp32 square that overflowed), nor when an fp32 sum is so small that squares may have lost bits to
// subnormal rounding, unless every element was zero. fp64 squares are what torch computes, overflow
// and underflow included, so for fp64 only NaN/Inf elements force the checked rule.
template <class Codec>
NANSCAN_HD bool run_is_exact(double run_min, double run_max, double run_sumsq) {
  if (!(run_sumsq < INFINITY)) return false;  // NaN or +Inf
  if (sizeof(typename Codec::Wide) == sizeof(double)) return true;
  return run_sumsq >= kSmallestExactFloatSumsq || finite_values_all_zero(run_min, run_max);
}

// Whether the fast rule's sum of a run is finite, which proves every element was (above). Then its
// min/max (and fp16-range counts) are the run's, and only a sum too small to be exact needs redoing,
// scaled.
NANSCAN_HD bool fast_run_was_finite(double run_sumsq) { return run_sumsq < INFINITY; }

// A run the fast rule cannot take whose statistics its fast result already tells, with no second
// read: every element NaN, or every element +Inf, or every element -Inf (an overflow step is full of
// such runs). Adds the run's counts to `s` and says so. The fast rule's min/max pass over a NaN and
// an Inf moves only one of them (see accumulate_fast): a min still at +inf means every element is
// NaN or +Inf, a max still at -inf NaN or -Inf, both NaN alone; a sum of squares of +Inf, not NaN,
// means no NaN.
NANSCAN_HD bool uniform_nonfinite_run(double run_min, double run_max, double run_sumsq, int64_t len, TensorStats& s) {
  const bool no_low = run_min == INFINITY, no_high = run_max == -INFINITY;
  if (no_low && no_high) {
    s.nan_count += len;
    return true;
  }
  if ((no_low || no_high) && run_sumsq == INFINITY) {
    s.inf_count += len;
    return true;
  }
  return false;
}

// One element of a run of finite values, its square scaled (see the file comment and RunScale).
template <class Codec>
NANSCAN_HD void accumulate_scaled(typename Codec::Wide& sumsq, typename Codec::Raw raw, const RunScale<Codec>& scale) {
  const typename Codec::Wide scaled = scale.apply(Codec::decode(raw));
  sumsq += scaled * scaled;
}

// One element of the difference before - after (nanscan::scan_difference, the update watch's pass), in
// before's format: computed in before's Wide (after's dtype is never wider: the op refuses that),
// where every after format decodes exactly, and rounded once, as torch's before - after rounds it.
template <class Before, class After>
NANSCAN_HD typename Before::Raw difference_of(typename Before::Raw before, typename After::Raw after) {
  return Before::encode(Before::decode(before) - static_cast<typename Before::Wide>(After::decode(after)));
}

// One element through the checked rule: counts a non-finite element, and a NaN, by its bits (the Infs
// are the difference: checked_counts()), and takes a finite value into min/max. Branch-free: bit
// arithmetic, no && (gcc turned a short-circuit into per-element branches), and a non-finite value
// turned into NaN, which the min/max selects pass over, by a multiply-add (v * 0 is 0 for a finite
// v, NaN for an Inf) where a select took gcc three instructions. Returns the value, NaN when it is
// not finite, for the fp16-range counts (count_half_range counts no NaN).
template <class Codec, class Count>
NANSCAN_HD typename Codec::Wide accumulate_checked(typename Codec::Wide& min, typename Codec::Wide& max,
                                                   Count& nonfinite_count, Count& nan_count, typename Codec::Raw raw) {
  using Wide = typename Codec::Wide;
  const typename Codec::Raw mag = raw & Codec::kMagnitudeMask;
  nonfinite_count += static_cast<Count>(is_nonfinite_magnitude<Codec>(mag));
  nan_count += static_cast<Count>(is_nan_magnitude<Codec>(mag));
  const Wide decoded = Codec::decode(raw);
  const Wide comparable = decoded * Wide(0) + decoded;
  min = comparable < min ? comparable : min;
  max = comparable > max ? comparable : max;
  return comparable;
}

// After a fast run whose sum was NaN or +Inf, and that uniform_nonfinite_run() could not tell: whether
// its elements may all be finite, their float squares having overflowed the sum. The backend then
// redoes the sum scaled (scale_for_run() of the fast min/max) before anything else: a scaled sum of
// finite values is below 2^14 (RunScale), so a finite one proves every element finite, as the fast
// rule's does, and is the run's, with the fast min/max and fp16-range counts; a NaN one sends the
// run to the checked rule. Reading the scaled sum first, not after the checked rule found the run
// finite, keeps the checked rule's results out of the registers of the second read (on sm_90 that
// order took the scan kernels from 80 registers to 128).
// Only float sums: fp64 squares overflow as torch's do, so an fp64 run that the checked rule finds
// finite keeps its +Inf sum, as torch's norm is +Inf. Only when the fast min/max are finite (an Inf
// element makes one of them infinite; with none finite the run holds no finite value), and either
// the largest magnitude is at least 2^56 (below it, the squares of a run of at most 2^14 elements
// sum below 2^126 and cannot overflow) or the fast rule applied a carried scale, which may be too
// large for this run (see accumulate_fast). Otherwise the sum met a NaN or an Inf: the checked rule
// counts them.
template <class Codec>
NANSCAN_HD bool squares_may_have_overflowed(double run_min, double run_max, bool carried_scale) {
  constexpr double kSmallestOverflowingMagnitude = 72057594037927936.0;  // 2^56
  if (sizeof(typename Codec::Wide) == sizeof(double)) return false;
  if (!(run_min > -INFINITY && run_max < INFINITY && run_min <= run_max)) return false;
  const double largest = -run_min > run_max ? -run_min : run_max;
  return carried_scale || largest >= kSmallestOverflowingMagnitude;
}

// A checked pass's counts into TensorStats: the NaNs, and the rest of the non-finite elements.
template <class Count>
NANSCAN_HD void checked_counts(TensorStats& s, Count nonfinite_count, Count nan_count) {
  s.nan_count += nan_count;
  s.inf_count += nonfinite_count - nan_count;
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
// fp16 overflow and fp16 underflow counts); stats: float64 [3, N] (min, max, norm). Row r of
// either starts row_stride elements after row r - 1: N for a scan's own outputs, the width of the
// buffer for scan_into_, whose N columns lie inside a wider one (counts and stats then point at
// its first column). total_norm null: no totals are written (scan_into_ has none).
struct ResultPointers {
  int64_t* counts;
  double* stats;
  double* total_norm;  // 0-dim, or null
  bool* finite;        // 0-dim
  int64_t num_tensors;
  int64_t row_stride;  // >= num_tensors
  bool half_range;
  bool checksum;  // counts has one more row, after the fp16 ones: the checksums (0 to 2^32 - 1)
  // 0-dim: the total norm again, in the dtype torch's get_total_norm returns for these tensors
  // (norm_dtype_of, ops.h), so that the Python layer need not read every tensor's dtype to cast it.
  void* total_norm_cast;
  DType total_norm_cast_dtype;  // Float32, Float64, Float16 or BFloat16
};

NANSCAN_HD void write_tensor_result(const ResultPointers& out, int64_t i, const TensorStats& s) {
  const int64_t n = out.row_stride;
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
  if (out.total_norm == nullptr) return;
  const double norm = l2_norm(total);
  *out.total_norm = norm;
  store_norm_as(out.total_norm_cast, out.total_norm_cast_dtype, norm);
  *out.finite = all_finite(total);
}

}  // namespace nanscan
