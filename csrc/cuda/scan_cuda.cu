// CUDA backend: the fused scan, the clip multiply and the update watch's difference scan over a whole
// tensor list, each in one launch.
//
// Work is cut into chunks of at most kChunkBytes of one tensor (list_plan.h); a warp scans a chunk
// with 16-byte loads (kUnroll in flight per lane) into a FastRun per lane, reduces across the warp in
// a fixed butterfly order and applies the shared exactness rule (re-reading the chunk with the checked
// rule if needed: scan_rules.h). Each warp of a persistent grid owns one contiguous share of the list, balanced by
// cost (bytes plus a fixed cost per chunk; see Shares), so 10,000 tiny tensors are a few tensors per
// warp, not 10,000 blocks, and a share of a large tensor is one run of memory.
//
// Finishing is spread over the grid instead of left to one last block: a warp whose share holds a
// whole tensor writes that tensor's result at once; a tensor met by several shares is folded by the
// warp whose partial arrives last, through a two-level tree of 32-way folds (FoldTree), while other
// warps go on scanning. A partial is per (tensor, warp), so the workspace grows with tensors + grid,
// not with bytes. The totals are combined in a fixed order (per warp in list order, per block in warp
// order, then the blocks in block order by the last block to finish), so results are bit-identical
// from run to run on a device. Nothing is allocated, nothing syncs with the host, and the only state
// (arrival counters) is zeroed by a memset in the same call, which a CUDA graph replays.
//
// The list's metadata travels in the kernel parameters when it fits (up to 256 tensors, 6.4 KB);
// longer lists are read from a device copy of the same blob (upload_list; the binding keeps such
// copies across calls).
#include "scan_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <memory>

// A kernel launch. tests/cuda_emulator defines it (in its stand-in cuda_runtime.h) to run the same
// kernel on CPU threads, a warp's lanes in lockstep at every shuffle, so CI executes this file.
#ifndef NANSCAN_LAUNCH
#define NANSCAN_LAUNCH(kernel, grid, block, stream, ...) kernel<<<(grid), (block), 0, (stream)>>>(__VA_ARGS__)
#endif
// Observes each run the small-tensor path scans (its length); the emulator counts them, so that its
// tests know the path ran.
#ifndef NANSCAN_ON_SUB_WARP_RUN
#define NANSCAN_ON_SUB_WARP_RUN(count) ((void)(count))
#endif

namespace nanscan::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int kUnroll = 4;
static_assert(kFoldFanIn == kWarpSize, "a fold reads one partial per lane");

// Kernel parameters may take 32764 bytes (CUDA 12.1+, sm_70+). A list of up to 256 tensors travels
// inline in them; a longer one is read from a device copy (capacity 0 stands for that), found in the
// binding's cache from the second call on. There was a second inline capacity, 1,300 tensors in a
// 32 KB block, until entry 58 of benchmarks/NOTES.md: on an H100 a launch with that block cost ~2.4 us
// more GPU time than the cached device copy it stood in for (entry 28), and each capacity is another
// instance of every kernel, a third of the CUDA library's compile.
constexpr size_t kParameterBytes = 32764;
constexpr int32_t kInlineTensors = 256;
constexpr int32_t kDeviceList = 0;

// The list as a kernel receives it: the blob inline, or a pointer to its device copy.
// The total cost travels beside the blob (which holds it too) to spare every warp a load.
template <int32_t kCapacity>
struct ListArgs {
  int32_t num_tensors;
  int64_t total_cost;
  alignas(16) unsigned char blob[blob_bytes(kCapacity)];
  __device__ ListView view() const { return ListView::over(blob, num_tensors); }
};

template <>
struct ListArgs<kDeviceList> {
  int32_t num_tensors;
  int64_t total_cost;
  const unsigned char* blob;
  __device__ ListView view() const { return ListView::over(blob, num_tensors); }
};

template <int32_t kCapacity>
void fill_list_args(ListArgs<kCapacity>& args, const ListPlan& plan, const void* device_blob) {
  args.num_tensors = plan.num_tensors();
  args.total_cost = plan.total_cost();
  if constexpr (kCapacity == kDeviceList) {
    args.blob = static_cast<const unsigned char*>(device_blob);
  } else {
    memcpy(args.blob, plan.blob(), plan.bytes());
  }
}

struct Workspace {
  TensorStats* partials;      // [Shares::fold_slots]: fold-tree slots (see FoldTree)
  TensorStats* block_totals;  // [grid]: each block's total, in block order
  unsigned int* counters;     // [fold_slots + 1]: fold-tree arrivals, then the blocks' ticket
};

template <int32_t kCapacity>
struct ScanParams {
  ListArgs<kCapacity> list;
  const float* multiply_by;  // device scalar, or null: see scan_chunk's kMultiply
  Workspace ws;
  ResultPointers out;
};

template <int32_t kCapacity>
struct ScaleParams {
  ListArgs<kCapacity> list;
  const void* coef;
  DType coef_dtype;
  CoefRounding rounding;
};

static_assert(sizeof(ScanParams<kInlineTensors>) <= kParameterBytes, "scan parameters exceed 32764 bytes");
static_assert(sizeof(ScaleParams<kInlineTensors>) <= kParameterBytes, "scale parameters exceed 32764 bytes");

template <class T>
__device__ T shfl_xor(T v, int offset) {
  return __shfl_xor_sync(0xffffffffu, v, offset);
}

// The warp's combine of TensorStats; a butterfly, so every lane ends with the same, fixed-order result.
__device__ TensorStats warp_combine(TensorStats s) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    TensorStats other;
    other.nan_count = shfl_xor(static_cast<long long>(s.nan_count), offset);
    other.inf_count = shfl_xor(static_cast<long long>(s.inf_count), offset);
    other.min = shfl_xor(s.min, offset);
    other.max = shfl_xor(s.max, offset);
    other.sumsq = shfl_xor(s.sumsq, offset);
    other.half_overflow = shfl_xor(static_cast<long long>(s.half_overflow), offset);
    other.half_underflow = shfl_xor(static_cast<long long>(s.half_underflow), offset);
    other.checksum = shfl_xor(s.checksum, offset);
    s = combine(s, other);
  }
  return s;
}

// A fast result (min, max, sum of squares) merged over each aligned group of kLanes lanes by a
// butterfly, so that every lane of a group ends with the same, fixed-order result. min and max pass
// over a NaN as accumulate_fast's do.
template <int kLanes, class MinMax>
__device__ __forceinline__ void merge_fast_results(MinMax& min, MinMax& max, double& sumsq) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset /= 2) {
    const MinMax other_min = shfl_xor(min, offset), other_max = shfl_xor(max, offset);
    min = other_min < min ? other_min : min;
    max = other_max > max ? other_max : max;
    sumsq += shfl_xor(sumsq, offset);
  }
}

// How for_each_lane_element reaches memory.
enum class Access {
  ReadOnly,  // fn(raw) observes each element, loaded through the read-only cache
  Reread,    // the same with plain loads: for elements this thread wrote earlier in the kernel, which
             // the read-only path does not promise to see
  Rewrite,   // fn(raw) returns the element's new value, stored back with the vector it came in
};

// How a lane's walk cuts [p, p + n): the elements before the first 16-byte boundary (a tensor that
// starts mid-vector: a view into a flat gradient buffer, the weight after a (3,) bias), the 16-byte
// vectors, and the tail after them. Storage that is not even element-aligned (torch never makes it)
// has no vector part: all of it is the tail.
template <class Raw>
struct LaneSpans {
  static constexpr int kPerVector = 16 / sizeof(Raw);
  int64_t head;         // elements before the first vector (< kPerVector)
  int64_t num_vectors;  // 16-byte vectors after the head

  __device__ static LaneSpans of(const Raw* p, int64_t n) {
    const unsigned misalignment = static_cast<unsigned>(reinterpret_cast<uintptr_t>(p) % 16);
    const int64_t to_boundary = static_cast<int64_t>((16 - misalignment) % 16 / sizeof(Raw));
    const bool element_aligned = misalignment % sizeof(Raw) == 0;
    const int64_t head = !element_aligned ? 0 : (to_boundary < n ? to_boundary : n);
    return LaneSpans{head, element_aligned ? (n - head) / kPerVector : 0};
  }
  __device__ int64_t tail_begin() const { return head + num_vectors * kPerVector; }
};

// Visits every element of [p, p + n) that this lane owns: the head one element per lane, then the
// 16-byte vectors (kUnroll of them issued before any is used), then the tail one element per lane.
// Which lane owns an element depends only on p and n, so a lane that re-reads a range sees its own
// writes. after_group() runs after each group of kUnroll vectors a lane visits and after the tail
// (the head's element, at most one per lane, goes with the first group): the scan folds its fp32 sums
// of squares into fp64 there. on_vector(v, first) sees each vector whole, as it ends up in memory, with
// the index of its first element (the checksum's words).
struct NoGroupHook {
  __device__ void operator()() const {}
};
struct NoVectorHook {
  __device__ void operator()(const uint4&, int64_t) const {}
};

// kLanes lanes share the range (the whole warp, or a group of the small-tensor path), `lane` counted
// within them.
template <Access kAccess, int kVectorsInFlight = kUnroll, int kLanes = kWarpSize, class Raw, class Fn,
          class AfterGroup = NoGroupHook, class OnVector = NoVectorHook>
__device__ __forceinline__ void for_each_lane_element(Raw* p, int64_t n, int lane, Fn&& fn,
                                                      AfterGroup&& after_group = AfterGroup{},
                                                      OnVector&& on_vector = OnVector{}) {
  constexpr int kPerVector = LaneSpans<Raw>::kPerVector;
  static_assert(kPerVector <= kLanes, "the head must be one element per lane");
  auto visit = [&](int64_t index) {
    if constexpr (kAccess == Access::Rewrite) {
      p[index] = fn(p[index]);
    } else {
      fn(p[index]);
    }
  };
  const LaneSpans<Raw> spans = LaneSpans<Raw>::of(p, n);
  const int64_t head = spans.head, num_vectors = spans.num_vectors;
  if (lane < head) visit(lane);  // the head: fewer than kPerVector (<= kLanes) elements, one step
  uint4* vectors = reinterpret_cast<uint4*>(p + head);
  for (int64_t i = lane; i < num_vectors; i += kLanes * kVectorsInFlight) {
    uint4 v[kVectorsInFlight];
#pragma unroll
    for (int k = 0; k < kVectorsInFlight; ++k) {
      if (i + k * kLanes < num_vectors) {
        v[k] = kAccess == Access::ReadOnly ? __ldg(vectors + i + k * kLanes) : vectors[i + k * kLanes];
      }
    }
#pragma unroll
    for (int k = 0; k < kVectorsInFlight; ++k) {
      if (i + k * kLanes < num_vectors) {
        Raw r[kPerVector];
        memcpy(r, &v[k], sizeof r);
#pragma unroll
        for (int j = 0; j < kPerVector; ++j) {
          if constexpr (kAccess == Access::Rewrite) {
            r[j] = fn(r[j]);
          } else {
            fn(r[j]);
          }
        }
        if constexpr (kAccess == Access::Rewrite) {
          memcpy(&v[k], r, sizeof r);
          vectors[i + k * kLanes] = v[k];
        }
        on_vector(v[k], head + (i + k * kLanes) * kPerVector);
      }
    }
    after_group();
  }
  for (int64_t e = spans.tail_begin() + lane; e < n; e += kLanes) visit(e);
  after_group();
}

// The replica checksum (scan_rules.h) of elements [begin, end) of a tensor, held at p = data + begin;
// begin is a chunk boundary, so a word boundary. When p is 4-byte aligned, each 16-byte vector of the
// scan's walk holds 4 whole words, summed from the registers it loaded (vector_words), and the head
// and the tail (under 16 elements each, starting at word boundaries) are read element by element
// (element_words). When p is not aligned (a 16-bit or 8-bit view at an odd offset in a flat buffer),
// element_words reads the whole range: correct, not tuned. element_words assembles a word from its
// lanes' elements by shuffles. With the head and tail words computed after the walk (in any form
// tried: byte loads, shuffles, inline or not), ptxas gives the checksum kernel 128 registers on sm_90
// where the other kernels keep 80: 2 resident blocks per SM instead of 3, which a GPU session has to
// measure (NOTES.md entry 24).
template <class Raw>
__device__ __forceinline__ bool words_in_vectors(const Raw* p) {
  return reinterpret_cast<uintptr_t>(p) % kReplicaWordBytes == 0;
}

template <class Raw>
__device__ __forceinline__ uint32_t word_term(uint32_t word, int64_t begin, int64_t byte_offset) {
  const uint64_t first_word = static_cast<uint64_t>(begin) * sizeof(Raw) / kReplicaWordBytes;
  return replica_term(word, replica_salt(first_word + static_cast<uint64_t>(byte_offset / kReplicaWordBytes)));
}

template <class Raw>
__device__ __forceinline__ uint32_t vector_words(const Raw* p, int64_t begin, const uint4& v, int64_t first) {
  if (!words_in_vectors(p)) return 0;
  const int64_t offset = first * static_cast<int64_t>(sizeof(Raw));
  return word_term<Raw>(v.x, begin, offset) + word_term<Raw>(v.y, begin, offset + 4) +
         word_term<Raw>(v.z, begin, offset + 8) + word_term<Raw>(v.w, begin, offset + 12);
}

// The words of elements [from, to), from at a word boundary, 32 elements per step of the warp (whole
// words: 32 is a multiple of the elements per word); elements at or past `to` read as zero, which
// pads the tensor's last word. Every lane runs every step (the shuffles).
template <class Raw>
__device__ uint32_t element_words(const Raw* p, int64_t begin, int64_t from, int64_t to, int lane) {
  constexpr int kPerWord = sizeof(Raw) >= kReplicaWordBytes ? 1 : kReplicaWordBytes / sizeof(Raw);
  constexpr int kBits = 8 * sizeof(Raw);
  uint32_t sum = 0;
#pragma unroll 1
  for (int64_t e0 = from; e0 < to; e0 += kWarpSize) {
    const int64_t e = e0 + lane;
    const Raw r = e < to ? __ldg(p + e) : Raw(0);
    const int64_t offset = e * static_cast<int64_t>(sizeof(Raw));
    if constexpr (sizeof(Raw) == 8) {
      if (e < to)
        sum += word_term<Raw>(static_cast<uint32_t>(r), begin, offset) +
               word_term<Raw>(static_cast<uint32_t>(r >> 32), begin, offset + 4);
    } else {
      uint32_t word = static_cast<uint32_t>(r);
#pragma unroll
      for (int j = 1; j < kPerWord; ++j) {
        word |= __shfl_down_sync(0xffffffffu, static_cast<uint32_t>(r), j) << (kBits * j);
      }
      if (e < to && lane % kPerWord == 0) sum += word_term<Raw>(word, begin, offset);
    }
  }
  return sum;
}

// A lane's walk over elements [0, n) of p for a re-read (from L1/L2: the chunk's first pass just read
// it): after a rewrite (`rewritten`), with plain loads, since the read-only path does not promise to
// see this kernel's writes.
template <class Raw, class Fn, class AfterGroup>
__device__ __forceinline__ void reread_lane_elements(Raw* p, int64_t n, int lane, bool rewritten, Fn&& fn,
                                                     AfterGroup&& after_group) {
  if (rewritten) {
    for_each_lane_element<Access::Reread, 1>(p, n, lane, fn, after_group);
  } else {
    for_each_lane_element<Access::ReadOnly, 1>(p, n, lane, fn, after_group);
  }
}

// A chunk's second read goes through `reread(fn, after_group)`, which walks the chunk's values (a
// dense range: reread_lane_elements; a pair's differences: for_each_lane_pair) as the first
// read did, calling fn on each value and after_group after each group of at most 65 per lane.

// The sum of squares of a chunk's values, all finite, through the scaled rule (scan_rules.h) with
// `scale`; undone to the values' own scale, valid in every lane.
template <class Codec, class Reread>
__device__ double scaled_chunk_sumsq(Reread&& reread, const RunScale<Codec>& scale) {
  using Wide = typename Codec::Wide;
  Wide sumsq = Wide(0);
  double lane_sumsq = 0.0;
  reread([&](typename Codec::Raw r) { accumulate_scaled<Codec>(sumsq, r, scale); },
         [&] {  // as the fast pass folds: at most 65 fp32 squares per lane
           lane_sumsq += static_cast<double>(sumsq);
           sumsq = Wide(0);
         });
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) lane_sumsq += shfl_xor(lane_sumsq, offset);
  return scale.undo(lane_sumsq);
}

// One warp reads a chunk's values again with the checked rule (scan_rules.h): NaN/Inf counts, min/max
// of the finite values and their fp16-range counts, no sum of squares; valid in every lane.
template <class Codec, bool kHalfRange, class Reread>
__device__ TensorStats checked_chunk(Reread&& reread) {
  using Raw = typename Codec::Raw;
  using Wide = typename Codec::Wide;
  FastRun<Codec> run = empty_run<Codec>();
  int nonfinite = 0, nan = 0, over = 0, under = 0;  // a lane's: at most 1,024 elements (see scan_chunk)
  reread(
      [&](Raw r) {
        const Wide v = accumulate_checked<Codec>(run.min, run.max, nonfinite, nan, r);
        if constexpr (kHalfRange) count_half_range(over, under, v);
      },
      NoGroupHook{});
  TensorStats s = empty_stats();
  checked_counts(s, nonfinite, nan);
  s.min = static_cast<double>(run.min);
  s.max = static_cast<double>(run.max);
  s.half_overflow = over;
  s.half_underflow = under;
  return warp_combine(s);
}

// A chunk of n values after its fast read (scan_rules.h): each lane's fast run and fp64 sum of
// squares, fp16-range counts and (warp-wide) checksum. Merged over the warp, then taken, told, or
// settled by a second read through `reread` (above). Valid in every lane.
template <class Codec, bool kHalfRange, class Reread>
__device__ __forceinline__ TensorStats settle_chunk(const FastRun<Codec>& run, double lane_sumsq, int over, int under,
                                                    uint32_t checksum, int64_t n, Reread&& reread) {
  double run_min = static_cast<double>(run.min), run_max = static_cast<double>(run.max);
  double run_sumsq = lane_sumsq;
  merge_fast_results<kWarpSize>(run_min, run_max, run_sumsq);
  TensorStats s = empty_stats();
  const bool exact = run_is_exact<Codec>(run_min, run_max, run_sumsq);
  bool finite = exact || fast_run_was_finite(run_sumsq);
  if (!exact && (finite || squares_may_have_overflowed<Codec>(run_min, run_max, false))) {
    // Tiny values, or squares that may have overflowed: the sum alone is redone, scaled
    // (scan_rules.h), from L1/L2; finite, it proves every element was.
    run_sumsq = scaled_chunk_sumsq<Codec>(reread, scale_for_run<Codec>(run_min, run_max));
    finite = fast_run_was_finite(run_sumsq);
  }
  if (finite) {
    s.checksum = checksum;
    if constexpr (kHalfRange) {
#pragma unroll
      for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
        over += shfl_xor(over, offset);
        under += shfl_xor(under, offset);
      }
      s.half_overflow = over;
      s.half_underflow = under;
    }
    merge_run(s, run_min, run_max, run_sumsq);
    return s;
  }
  // A NaN or an Inf (or fp64 squares that overflowed): told by the fast result (a chunk all NaN, or
  // all one Inf), or classified by re-reading what the first pass left (the products, when it
  // rewrote).
  if (!uniform_nonfinite_run(run_min, run_max, run_sumsq, n, s)) {
    s = checked_chunk<Codec, kHalfRange>(reread);
    if (all_finite(s)) s.sumsq = run_sumsq;  // fp64 only: +Inf, as torch's (squares_may_have_overflowed)
  }
  s.checksum = checksum;
  return s;
}

// One warp scans elements [begin, end) of a tensor; the result is valid in every lane. With
// kMultiply (GradScaler's unscale), each element is first replaced by round(x * factor), torch's
// arithmetic, in the same pass; a factor of exactly 1 writes nothing, as in torch. With kChecksum,
// the replica checksum of the elements too (scan_rules.h; positions begin, begin + 1, ...).
template <class Codec, bool kHalfRange, bool kMultiply, bool kChecksum>
__device__ TensorStats scan_chunk(const void* data, int64_t begin, int64_t end, int lane, float factor) {
  // element_words re-reads elements that, in a rewrite, other lanes may be writing; no caller asks
  // for a checksum of an unscale.
  static_assert(!(kMultiply && kChecksum), "no checksum of a rewrite");
  using Raw = typename Codec::Raw;
  using Wide = typename Codec::Wide;
  Raw* p = static_cast<Raw*>(const_cast<void*>(data)) + begin;
  const int64_t n = end - begin;

  FastRun<Codec> run = empty_run<Codec>();
  // A lane sees at most 1,024 elements of a chunk (32 KiB of fp8): int counts, which took the kernels
  // with the fp16-range option from 80 registers and a spill to 80 without one.
  static_assert(kChunkBytes / kWarpSize <= 1024, "a lane's counts must fit an int");
  int over = 0, under = 0;
  auto observe = [&](Raw r) {
    accumulate_fast<Codec>(run.min, run.max, run.sumsq, r);
    if constexpr (kHalfRange) count_half_range(over, under, Codec::decode(r));
  };
  // A lane's fp32 sum of squares covers one group (at most 64 elements, 65 with a head element)
  // before it is folded into fp64, as the CPU's runs of 128 are: a chunk's 256 to 1,024 squares per
  // lane summed in fp32 alone were off by up to ~8e-6 relative on constant-valued tensors.
  double lane_sumsq = 0.0;
  auto fold_group = [&] {
    lane_sumsq += static_cast<double>(run.sumsq);
    run.sumsq = Wide(0);
  };
  bool rewritten = false;
  if constexpr (kMultiply && HasEncode<Codec>::value) {
    if (factor != 1.0f) {
      const Wide f = static_cast<Wide>(factor);
      for_each_lane_element<Access::Rewrite>(
          p, n, lane,
          [&](Raw r) {
            const Raw product = Codec::encode(Codec::decode(r) * f);
            observe(product);
            return product;
          },
          fold_group);
      rewritten = true;
    }
  }
  // The checksum is of the bits, whichever rule the statistics take below.
  uint32_t checksum = 0;
  if constexpr (kChecksum) {
    for_each_lane_element<Access::ReadOnly>(p, n, lane, observe, fold_group, [&](const uint4& v, int64_t first) {
      checksum += vector_words(p, begin, v, first);
    });
    if (words_in_vectors(p)) {
      // The head ends, and the tail begins, at a 16-byte boundary, so at a word boundary.
      const LaneSpans<Raw> spans = LaneSpans<Raw>::of(p, n);
      checksum += element_words(p, begin, 0, spans.head, lane) + element_words(p, begin, spans.tail_begin(), n, lane);
    } else {
      checksum += element_words(p, begin, 0, n, lane);
    }
#pragma unroll
    for (int offset = kWarpSize / 2; offset > 0; offset /= 2) checksum += shfl_xor(checksum, offset);
  } else if (!rewritten) {
    for_each_lane_element<Access::ReadOnly>(p, n, lane, observe, fold_group);
  }

  return settle_chunk<Codec, kHalfRange>(run, lane_sumsq, over, under, checksum, n, [&](auto&& fn, auto&& after_group) {
    reread_lane_elements(p, n, lane, rewritten, fn, after_group);
  });
}

// One warp scans elements [begin, end) of a tensor a chunk at a time (each chunk is one exactness
// decision, so a NaN re-reads 32 KiB, not the run), combining the chunks' results in order into
// *part, which lane 0 writes (shared memory: no registers held across the loop).
template <class Codec, bool kHalfRange, bool kMultiply, bool kChecksum>
__device__ void scan_run(const void* data, int64_t begin, int64_t end, int lane, float factor, TensorStats* part) {
  constexpr int64_t kPerChunk = kChunkBytes / sizeof(typename Codec::Raw);
  for (int64_t b = begin; b < end; b += kPerChunk) {
    const int64_t chunk_end = b + kPerChunk < end ? b + kPerChunk : end;
    const TensorStats s = scan_chunk<Codec, kHalfRange, kMultiply, kChecksum>(data, b, chunk_end, lane, factor);
    if (lane == 0) *part = combine(*part, s);
  }
}

template <bool kHalfRange, bool kMultiply, bool kChecksum>
__device__ void scan_run_any(DType dtype, const void* data, ElementRange e, int lane, float factor, TensorStats* part) {
  switch (dtype) {
#define NANSCAN_RUN(TAG, CODEC) \
  case DType::TAG: return scan_run<CODEC, kHalfRange, kMultiply, kChecksum>(data, e.begin, e.end, lane, factor, part);
    NANSCAN_RUN(Float32, Float32Codec)
    NANSCAN_RUN(Float64, Float64Codec)
    NANSCAN_RUN(Float16, Float16Codec)
    NANSCAN_RUN(BFloat16, BFloat16Codec)
    NANSCAN_RUN(Float8E4M3FN, Float8E4M3FNCodec)
    NANSCAN_RUN(Float8E5M2, Float8E5M2Codec)
#undef NANSCAN_RUN
  }
}

// The difference scan (nanscan::scan_difference, the update watch's pass): pairs (before, after) of
// one shape, before float32 or float64 and after of a format no wider. Per chunk of before's elements,
// one walk reads both tensors once and feeds two fast runs, of the differences before - after
// (difference_of, scan_rules.h) and of after itself; each is then settled as a scan's chunk is, the
// differences' second read taking them from the pair again, after's from after alone. Nothing is
// written but the results. The two formats' 16-byte vectors do not line up, so the walk loads one
// element of each per lane and step (a warp's loads still cover consecutive addresses), with
// kPairsInFlight steps issued before any is used.
constexpr int kPairsInFlight = 8;

// Visits elements [0, n) of a pair, lane, lane + 32, ...: fn(before_raw, after_raw), and
// after_group() after each group of kPairsInFlight per lane (the fast rule's fold: at most 65).
template <class Before, class After, class Fn, class AfterGroup>
__device__ __forceinline__ void for_each_lane_pair(const typename Before::Raw* b, const typename After::Raw* a,
                                                   int64_t n, int lane, Fn&& fn, AfterGroup&& after_group) {
#pragma unroll 1
  for (int64_t i = lane; i < n; i += int64_t{kWarpSize} * kPairsInFlight) {
    // Zero where past the end, not left unset: an unset element is the previous step's value to
    // ptxas, which then kept all 16 across steps and spilled them inside the loop.
    typename Before::Raw rb[kPairsInFlight];
    typename After::Raw ra[kPairsInFlight];
#pragma unroll
    for (int k = 0; k < kPairsInFlight; ++k) {
      const int64_t e = i + int64_t{k} * kWarpSize;
      const bool in_range = e < n;
      rb[k] = in_range ? __ldg(b + e) : typename Before::Raw(0);
      ra[k] = in_range ? __ldg(a + e) : typename After::Raw(0);
    }
#pragma unroll
    for (int k = 0; k < kPairsInFlight; ++k) {
      if (i + int64_t{k} * kWarpSize < n) fn(rb[k], ra[k]);
    }
    after_group();
  }
}

// One warp's statistics of elements [begin, end) of a pair, the differences' and after's, combined
// into *diff_part and *after_part (shared memory), which lane 0 writes: each as soon as it is
// settled, so that the first is not held in registers while the second is.
template <class Before, class After>
__device__ void difference_chunk(const void* before, const void* after, int64_t begin, int64_t end, int lane,
                                 TensorStats* diff_part, TensorStats* after_part) {
  using RawB = typename Before::Raw;
  using RawA = typename After::Raw;
  const RawB* b = static_cast<const RawB*>(before) + begin;
  RawA* a = static_cast<RawA*>(const_cast<void*>(after)) + begin;  // read only
  const int64_t n = end - begin;
  FastRun<Before> diff = empty_run<Before>();
  FastRun<After> kept = empty_run<After>();
  double diff_sumsq = 0.0, kept_sumsq = 0.0;
  for_each_lane_pair<Before, After>(
      b, a, n, lane,
      [&](RawB rb, RawA ra) {
        accumulate_fast<Before>(diff.min, diff.max, diff.sumsq, difference_of<Before, After>(rb, ra));
        accumulate_fast<After>(kept.min, kept.max, kept.sumsq, ra);
      },
      [&] {
        diff_sumsq += static_cast<double>(diff.sumsq);
        diff.sumsq = typename Before::Wide(0);
        kept_sumsq += static_cast<double>(kept.sumsq);
        kept.sumsq = typename After::Wide(0);
      });
  const TensorStats d = settle_chunk<Before, false>(diff, diff_sumsq, 0, 0, 0u, n, [&](auto&& fn, auto&& after_group) {
    for_each_lane_pair<Before, After>(
        b, a, n, lane, [&](RawB rb, RawA ra) { fn(difference_of<Before, After>(rb, ra)); }, after_group);
  });
  if (lane == 0) *diff_part = combine(*diff_part, d);
  const TensorStats k = settle_chunk<After, false>(kept, kept_sumsq, 0, 0, 0u, n, [&](auto&& fn, auto&& after_group) {
    reread_lane_elements(a, n, lane, false, fn, after_group);
  });
  if (lane == 0) *after_part = combine(*after_part, k);
}

// A pair's elements [begin, end), a chunk of before's at a time (the list plan's chunks), combined in
// order into *diff_part and *after_part.
template <class Before, class After>
__device__ void difference_run(const void* before, const void* after, ElementRange e, int lane, TensorStats* diff_part,
                               TensorStats* after_part) {
  constexpr int64_t kPerChunk = kChunkBytes / sizeof(typename Before::Raw);
  for (int64_t b = e.begin; b < e.end; b += kPerChunk) {
    const int64_t chunk_end = b + kPerChunk < e.end ? b + kPerChunk : e.end;
    difference_chunk<Before, After>(before, after, b, chunk_end, lane, diff_part, after_part);
  }
}

__device__ void difference_run_any(DType before_dtype, DType after_dtype, const void* before, const void* after,
                                   ElementRange e, int lane, TensorStats* diff_part, TensorStats* after_part) {
#define NANSCAN_PAIR(BEFORE, AFTER) return difference_run<BEFORE, AFTER>(before, after, e, lane, diff_part, after_part);
#define NANSCAN_AFTER(BEFORE)                                            \
  switch (after_dtype) {                                                 \
    case DType::Float32: NANSCAN_PAIR(BEFORE, Float32Codec)              \
    case DType::Float16: NANSCAN_PAIR(BEFORE, Float16Codec)              \
    case DType::BFloat16: NANSCAN_PAIR(BEFORE, BFloat16Codec)            \
    case DType::Float8E4M3FN: NANSCAN_PAIR(BEFORE, Float8E4M3FNCodec)    \
    case DType::Float8E5M2: NANSCAN_PAIR(BEFORE, Float8E5M2Codec)        \
    case DType::Float64: break; /* only after a float64 before: below */ \
  }
  if (before_dtype == DType::Float64) {
    if (after_dtype == DType::Float64) NANSCAN_PAIR(Float64Codec, Float64Codec)
    NANSCAN_AFTER(Float64Codec)
  } else {  // float32 (the op admits float32 and float64 befores), never with a float64 after (refused)
    NANSCAN_AFTER(Float32Codec)
  }
#undef NANSCAN_AFTER
#undef NANSCAN_PAIR
}

// The small-tensor path. A warp's share of 10,000 tensors of 4 KB was a chain of ~960 instructions
// per tensor (benchmarks/NOTES.md, entry 28), most of them paid per tensor whatever its size: five
// butterfly rounds of min, max and sum, the exactness test, the result. A run of small tensors of
// one dtype (ListView::sub_warp_run) is scanned kSubWarpTensors at a time instead, kSubWarpLanes
// lanes each: three rounds, the per-tensor work done by the groups side by side, and the warp's
// loads spread over four tensors. Every lane runs every step (a group past the run scans nothing),
// so the shuffles are warp-wide. A tensor whose fast result the exactness rule does not take (tiny
// values, a NaN/Inf) is left to the whole warp, which scans it as any other tensor: settling it here
// (scan_chunk's scaled and checked re-reads inlined a second time) took ptxas from 80 registers to
// 128 on sm_90, whatever else was tried.
constexpr int kSubWarpLanes = kWarpSize / kSubWarpTensors;
static_assert(kSubWarpLanes * kSubWarpTensors == kWarpSize, "groups tile the warp");
// The shortest run worth it: a run of one leaves 3/4 of the warp idle through a 4x longer element
// loop. NANSCAN_SUB_WARP_MIN_RUN (a build flag) moves it, for a GPU session to measure; above
// kSubWarpTensors it turns the path off.
#ifdef NANSCAN_SUB_WARP_MIN_RUN
constexpr int32_t kSubWarpMinRun = NANSCAN_SUB_WARP_MIN_RUN;
#else
constexpr int32_t kSubWarpMinRun = 2;
#endif

// Scans tensors [first, first + count) of one codec with the fast rule. Writes the result of each
// tensor the exactness rule takes, leaves its statistics in slots[k] (shared memory) for the warp's
// total, and returns them as a mask (bit k: tensor first + k); the whole warp scans the others.
template <class Codec>
__device__ unsigned scan_sub_warp_run(const ListView& list, int32_t first, int32_t count, int lane,
                                      const ResultPointers& out, TensorStats* slots) {
  using Raw = typename Codec::Raw;
  using Wide = typename Codec::Wide;
  const int group = lane / kSubWarpLanes, group_lane = lane % kSubWarpLanes;
  const bool active = group < count;
  const int32_t t = first + (active ? group : 0);
  Raw* p = static_cast<Raw*>(const_cast<void*>(list.data[t]));  // read only (Access::ReadOnly)
  const int64_t n = active ? list.numel[t] : 0;

  FastRun<Codec> run = empty_run<Codec>();
  double lane_sumsq = 0.0;  // folded per group of loads, as scan_chunk's lanes fold
  for_each_lane_element<Access::ReadOnly, kUnroll, kSubWarpLanes>(
      p, n, group_lane, [&](Raw r) { accumulate_fast<Codec>(run.min, run.max, run.sumsq, r); },
      [&] {
        lane_sumsq += static_cast<double>(run.sumsq);
        run.sumsq = Wide(0);
      });
  // Within the group: min and max in the values' own format (exact), the sum in fp64.
  Wide group_min = run.min, group_max = run.max;
  merge_fast_results<kSubWarpLanes>(group_min, group_max, lane_sumsq);
  const double run_min = static_cast<double>(group_min), run_max = static_cast<double>(group_max);
  const bool exact = run_is_exact<Codec>(run_min, run_max, lane_sumsq);
  if (active && exact && group_lane == 0) {
    TensorStats s = empty_stats();
    merge_run(s, run_min, run_max, lane_sumsq);
    slots[group] = s;
    write_tensor_result(out, t, s);
  }
  NANSCAN_ON_SUB_WARP_RUN(lane == 0 ? count : 0);
  const unsigned leaders = __ballot_sync(0xffffffffu, active && exact && group_lane == 0);
  unsigned settled = 0;
#pragma unroll
  for (int g = 0; g < kSubWarpTensors; ++g) settled |= ((leaders >> (g * kSubWarpLanes)) & 1u) << g;
  return settled;
}

[[maybe_unused]] __device__ unsigned scan_sub_warp_run_any(const ListView& list, int32_t first, int32_t count, int lane,
                                                           const ResultPointers& out, TensorStats* slots) {
  switch (list.dtype_of(first)) {
#define NANSCAN_SUB_WARP(TAG, CODEC) \
  case DType::TAG: return scan_sub_warp_run<CODEC>(list, first, count, lane, out, slots);
    NANSCAN_SUB_WARP(Float32, Float32Codec)
    NANSCAN_SUB_WARP(Float64, Float64Codec)
    NANSCAN_SUB_WARP(Float16, Float16Codec)
    NANSCAN_SUB_WARP(BFloat16, BFloat16Codec)
#undef NANSCAN_SUB_WARP
    default: break;  // float8 is never in a run (fits_sub_warp)
  }
  return 0;  // unreachable; were it reached, the whole warp would scan the run
}

// Reads what other warps of this launch wrote: through L2, never a possibly stale L1 line.
__device__ TensorStats load_coherent(const TensorStats* p) {
  TensorStats s;
  s.nan_count = __ldcg(reinterpret_cast<const long long*>(&p->nan_count));
  s.inf_count = __ldcg(reinterpret_cast<const long long*>(&p->inf_count));
  s.half_overflow = __ldcg(reinterpret_cast<const long long*>(&p->half_overflow));
  s.half_underflow = __ldcg(reinterpret_cast<const long long*>(&p->half_underflow));
  s.checksum = __ldcg(&p->checksum);
  s.min = __ldcg(&p->min);
  s.max = __ldcg(&p->max);
  s.sumsq = __ldcg(&p->sumsq);
  return s;
}

// The tensor whose cost range holds `cost`. A table in the kernel parameters is searched one
// warp-uniform probe at a time (constant-cache broadcasts); one in device memory 32 probes at a time,
// a lane each. Once per warp and launch: the warp then walks its share in list order.
template <int32_t kCapacity>
__device__ int32_t find_tensor(const ListView& list, int64_t cost, int lane) {
  if constexpr (kCapacity == kDeviceList) {
    return list.find_tensor_wide([&](int32_t lo, int32_t step, int32_t hi) {
      const int32_t probe = lo + lane * step;
      const bool at_or_below = probe <= hi && list.cost_begin[probe] <= cost;
      return __popc(__ballot_sync(0xffffffffu, at_or_below));
    });
  } else {
    return list.find_tensor(cost);
  }
}

// The launch's shares: one per warp of the grid (fewer for a list cheaper than the grid).
template <int32_t kCapacity>
__device__ Shares grid_shares(const ListArgs<kCapacity>& args) {
  return Shares::of(args.total_cost, static_cast<int64_t>(gridDim.x) * kWarps);
}

// Calls visit(t, chunks, share_end) for each tensor that warp w meets (list_plan.h's Shares and walk_share);
// warps beyond the shares have none.
template <int32_t kCapacity, class Visit>
__device__ void walk_warp_share(const ListView& list, const Shares& shares, int32_t w, int lane, Visit&& visit) {
  if (w >= shares.warps) return;
  walk_share(list, shares, w, find_tensor<kCapacity>(list, shares.begin(w), lane), visit);
}

// finish_share's synchronisation (list_plan.h) for one warp: partial slots and arrival counters in
// the workspace, results straight to the outputs. Every lane calls every method; lane 0 writes.
struct WarpSync {
  const Workspace& ws;
  const ResultPointers& out;
  int lane;
  int64_t first_result = 0;  // where tensor 0's result goes in `out` (the difference scan's afters: N)

  __device__ void write_result(int32_t t, const TensorStats& s) const {
    if (lane == 0) write_tensor_result(out, first_result + t, s);
  }

  // True, in every lane, for the warp whose arrival is the `expected`-th: that warp then reads every
  // partial of the set.
  __device__ bool arrive_last(int64_t slot, const TensorStats& partial, int64_t counter, int32_t expected) const {
    bool last = false;
    if (lane == 0) {
      ws.partials[slot] = partial;
      __threadfence();  // the partial is visible device-wide before the arrival is counted
      last = atomicAdd(ws.counters + counter, 1u) == static_cast<unsigned int>(expected - 1);
    }
    last = __shfl_sync(0xffffffffu, last, 0);
    if (last) {
      __threadfence();  // and the other warps' partials are read after their arrivals
      __syncwarp();     // (every lane's reads, not only lane 0's: the shuffle alone does not order memory)
    }
    return last;
  }

  // Lane k takes items k, k + 32, ... in turn, then the warp butterfly: a fixed order. The result is
  // valid in every lane.
  __device__ TensorStats fold(int64_t first, int32_t count, int32_t stride) const {
    TensorStats s = empty_stats();
#pragma unroll 4
    for (int32_t k = lane; k < count; k += kWarpSize) {
      s = combine(s, load_coherent(ws.partials + first + static_cast<int64_t>(k) * stride));
    }
    return warp_combine(s);
  }
};

// Last block: the totals, from the blocks' totals in block order (each thread a fixed contiguous
// range, then a fixed shared-memory tree).
__device__ void write_totals_of_blocks(const TensorStats* block_totals, int32_t blocks, const ResultPointers& out) {
  __shared__ TensorStats partial[kThreads];
  const int32_t per_thread = (blocks + kThreads - 1) / kThreads;
  const int32_t begin = threadIdx.x * per_thread, end = begin + per_thread < blocks ? begin + per_thread : blocks;
  TensorStats mine = empty_stats();
  for (int32_t b = begin; b < end; ++b) mine = combine(mine, load_coherent(block_totals + b));
  partial[threadIdx.x] = mine;
  __syncthreads();
  for (unsigned int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] = combine(partial[threadIdx.x], partial[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) write_totals(out, partial[0]);
}

// The end of a scan kernel's block, once every warp's total is in warp_totals: the block's total is
// left in the workspace, the block takes a ticket at `ticket`, and the last block to take one writes
// the totals, from every block's, in block order.
__device__ __forceinline__ void finish_block(const TensorStats* warp_totals, const Workspace& ws, unsigned int* ticket,
                                             const ResultPointers& out) {
  __syncthreads();
  // Last-block-done: the block's total is visible device-wide before the block takes its ticket.
  __shared__ bool is_last_block;
  if (threadIdx.x == 0) {
    TensorStats block_total = empty_stats();
    for (int k = 0; k < kWarps; ++k) block_total = combine(block_total, warp_totals[k]);
    ws.block_totals[blockIdx.x] = block_total;
    __threadfence();
    is_last_block = atomicAdd(ticket, 1u) == gridDim.x - 1;
    __threadfence();  // the other blocks' totals are read after this block's ticket
  }
  __syncthreads();
  if (!is_last_block) return;
  __threadfence();
  write_totals_of_blocks(ws.block_totals, static_cast<int32_t>(gridDim.x), out);
}

// One instantiation per option, so the plain scan carries no register cost of the options.
// Resident blocks per SM asked of ptxas, per kernel (benchmarks/NOTES.md, entries 24 and 25). The
// checksum kernel asks for 3: left alone, ptxas gives it 128 registers (2 blocks of 256 threads), and
// on an H100 the bound's 80 registers with 16-48 bytes of spill ran up to 5% faster (llama-1b fp32:
// 1.06x a plain scan's GPU time -> 1.02x; no case slower). The others ask for none (0): they sit at
// 79-80 registers with no spill, and a minimum of 1 is not "none" (it took them to 128).
// NANSCAN_SCAN_MIN_BLOCKS (a build flag, e.g. NVCC_APPEND_FLAGS=-DNANSCAN_SCAN_MIN_BLOCKS=4)
// overrides it for every scan kernel, for `tools/gpu_session.sh scan-variants` to measure: 4 (64
// registers) was 3-18% slower on every case measured on an H100 (NOTES.md, entry 28).
// Measured on sm_90 only, so only sm_90 takes the bound: on sm_80 it would spill 64-100 bytes,
// unmeasured on an A100, and newer archs are unmeasured too (the launch bound is a device-code
// attribute: the host pass's value is never used; grid sizes come from the occupancy query of the
// compiled kernel).
#if defined(NANSCAN_SCAN_MIN_BLOCKS)
template <bool kChecksum>
constexpr int kScanMinBlocks = NANSCAN_SCAN_MIN_BLOCKS;
#elif defined(__CUDA_ARCH__) && __CUDA_ARCH__ != 900
template <bool kChecksum>
constexpr int kScanMinBlocks = 0;
#else
template <bool kChecksum>
constexpr int kScanMinBlocks = kChecksum ? 3 : 0;
#endif

template <bool kHalfRange, bool kMultiply, bool kChecksum, int32_t kCapacity>
__global__ void __launch_bounds__(kThreads, kScanMinBlocks<kChecksum>)
    scan_kernel(const __grid_constant__ ScanParams<kCapacity> p) {
  const ListView list = p.list.view();
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int32_t w = static_cast<int32_t>(blockIdx.x) * kWarps + warp;
  const Shares shares = grid_shares(p.list);
  const float factor = kMultiply ? __ldg(p.multiply_by) : 1.0f;
  // Each warp's running total over its share and its partial of the current tensor, kept in shared
  // memory (written by lane 0) to spare registers across the chunk loop.
  __shared__ TensorStats warp_totals[kWarps], warp_parts[kWarps];
  if (lane == 0) warp_totals[warp] = empty_stats();
  // The small-tensor path: in the plain scan only, so far. An unscale rewrites; the checksum kernel's
  // registers are at their bound; the fp16-range kernels with it took 105 registers on sm_90 (80
  // with a launch bound of 3 blocks, but then 16 bytes of spill with the list in device memory), a
  // trade no GPU run has measured. A run of k tensors fills the last k slots, so that the
  // visits that follow find their tensor's slot from the count of the run's tensors not yet visited.
  // That count and the mask of the tensors the run settled stay in shared memory: registers held
  // across the walk took ptxas past 80 registers on sm_90.
  constexpr bool kSubWarp = !kHalfRange && !kMultiply && !kChecksum && kSubWarpMinRun <= kSubWarpTensors;
  __shared__ TensorStats sub_warp_slots[kSubWarp ? kWarps : 1][kSubWarpTensors];
  __shared__ int32_t sub_warp_left[kSubWarp ? kWarps : 1];
  __shared__ unsigned sub_warp_settled[kSubWarp ? kWarps : 1];
  if constexpr (kSubWarp) {
    if (lane == 0) sub_warp_left[warp] = 0, sub_warp_settled[warp] = 0;
    __syncwarp();
  }
  walk_warp_share<kCapacity>(list, shares, w, lane, [&](int32_t t, ChunkRange chunks, int64_t share_end) {
    if constexpr (kSubWarp) {
      int32_t left = sub_warp_left[warp];
      unsigned settled = sub_warp_settled[warp];
      if (left == 0) {
        const int32_t run = list.sub_warp_run(t, share_end, kSubWarpTensors);
        if (run >= kSubWarpMinRun) {
          settled = scan_sub_warp_run_any(list, t, run, lane, p.out, sub_warp_slots[warp] + (kSubWarpTensors - run));
          left = run;
        }
      }
      if (left > 0) {
        __syncwarp();  // every lane has read the state before lane 0 moves it to the next tensor
        if (lane == 0) {
          sub_warp_left[warp] = left - 1;
          sub_warp_settled[warp] = settled >> 1;
          // In list order, so that the warp's total combines as without the path.
          if (settled & 1u) {
            warp_totals[warp] = combine(warp_totals[warp], sub_warp_slots[warp][kSubWarpTensors - left]);
          }
        }
        __syncwarp();
        if (settled & 1u) return;
      }
    }
    if (lane == 0) warp_parts[warp] = empty_stats();
    scan_run_any<kHalfRange, kMultiply, kChecksum>(list.dtype_of(t), list.data[t], list.elements_of(t, chunks), lane,
                                                   factor, &warp_parts[warp]);
    __syncwarp();  // lane 0's partial, to every lane
    const TensorStats part = warp_parts[warp];
    __syncwarp();  // read by all before lane 0 starts the next tensor's
    if (lane == 0) warp_totals[warp] = combine(warp_totals[warp], part);
    WarpSync sync{p.ws, p.out, lane};
    finish_share(list, shares, t, w, part, sync);
  });
  finish_block(warp_totals, p.ws, p.ws.counters + shares.fold_slots(p.list.num_tensors), p.out);
}

// The difference scan's kernel (see difference_chunk). The plan lists the N befores, then the N
// afters; the warps' shares cover the befores' cost alone, and a warp that meets before t reads after
// t beside it. Each pair leaves two results, the differences' at t and after's at N + t, through two
// fold trees of the same shape (the afters' in the second half of the workspace's slots).
//
// ptxas gives it 119-126 registers (sm_80, sm_90, sm_120) and no spill, in it or in
// difference_run_any, which it keeps as a function of its own: 2 blocks of 8 warps per SM. The bound
// of 2 holds it there (tools/kernel_budget.py fails past 128 registers or on any stack); 3 blocks
// (80 registers) spill ~400 bytes. Unmeasured on a GPU: a session is to time 2 against 3
// (NANSCAN_DIFFERENCE_MIN_BLOCKS, a build flag; benchmarks/NOTES.md entries 39 and 40).
#ifdef NANSCAN_DIFFERENCE_MIN_BLOCKS
constexpr int kDifferenceMinBlocks = NANSCAN_DIFFERENCE_MIN_BLOCKS;
#else
constexpr int kDifferenceMinBlocks = 2;
#endif

template <int32_t kCapacity>
__global__ void __launch_bounds__(kThreads, kDifferenceMinBlocks)
    difference_kernel(const __grid_constant__ ScanParams<kCapacity> p) {
  const ListView list = p.list.view();
  const ListView befores = befores_of(list);
  const int32_t num_pairs = befores.num_tensors;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int32_t w = static_cast<int32_t>(blockIdx.x) * kWarps + warp;
  const Shares shares = Shares::of(befores.total_cost(), static_cast<int64_t>(gridDim.x) * kWarps);
  const int64_t fold_slots = shares.fold_slots(num_pairs);
  const Workspace after_ws{p.ws.partials + fold_slots, p.ws.block_totals, p.ws.counters + fold_slots};
  __shared__ TensorStats warp_totals[kWarps], diff_parts[kWarps], after_parts[kWarps];
  if (lane == 0) warp_totals[warp] = empty_stats();
  walk_warp_share<kCapacity>(befores, shares, w, lane, [&](int32_t t, ChunkRange chunks, int64_t) {
    if (lane == 0) diff_parts[warp] = empty_stats(), after_parts[warp] = empty_stats();
    difference_run_any(befores.dtype_of(t), list.dtype_of(num_pairs + t), list.data[t], list.data[num_pairs + t],
                       befores.elements_of(t, chunks), lane, &diff_parts[warp], &after_parts[warp]);
    __syncwarp();  // lane 0's partials, to every lane
    const TensorStats diff = diff_parts[warp];
    if (lane == 0) warp_totals[warp] = combine(warp_totals[warp], diff);
    WarpSync diff_sync{p.ws, p.out, lane};
    finish_share(befores, shares, t, w, diff, diff_sync);
    const TensorStats after = after_parts[warp];
    __syncwarp();  // both read by all before lane 0 starts the next pair's
    if (lane == 0) warp_totals[warp] = combine(warp_totals[warp], after);
    WarpSync after_sync{after_ws, p.out, lane, num_pairs};
    finish_share(befores, shares, t, w, after, after_sync);
  });
  finish_block(warp_totals, p.ws, p.ws.counters + 2 * fold_slots, p.out);
}

__device__ double load_scalar(const void* p, DType dtype) {
  switch (dtype) {
    case DType::Float32: return Float32Codec::decode(*static_cast<const uint32_t*>(p));
    case DType::Float64: return Float64Codec::decode(*static_cast<const uint64_t*>(p));
    case DType::Float16: return Float16Codec::decode(*static_cast<const uint16_t*>(p));
    case DType::BFloat16: return BFloat16Codec::decode(*static_cast<const uint16_t*>(p));
    case DType::Float8E4M3FN: return Float8E4M3FNCodec::decode(*static_cast<const uint8_t*>(p));
    case DType::Float8E5M2: return Float8E5M2Codec::decode(*static_cast<const uint8_t*>(p));
  }
  return 1.0;
}

// The product is formed in Wide and rounded once; see CoefRounding for the coefficient.
template <class Codec>
__device__ void scale_chunk(void* data, int64_t begin, int64_t end, double coef, CoefRounding rounding, int lane) {
  using Raw = typename Codec::Raw;
  using Wide = typename Codec::Wide;
  const Wide c = rounding == CoefRounding::ToTensorDtype ? Codec::decode(Codec::encode(static_cast<Wide>(coef)))
                                                         : static_cast<Wide>(static_cast<float>(coef));
  for_each_lane_element<Access::Rewrite>(static_cast<Raw*>(data) + begin, end - begin, lane,
                                         [c](Raw r) { return Codec::encode(Codec::decode(r) * c); });
}

template <int32_t kCapacity>
__global__ void __launch_bounds__(kThreads) scale_kernel(const __grid_constant__ ScaleParams<kCapacity> p) {
  const double coef = load_scalar(p.coef, p.coef_dtype);
  if (coef == 1.0) return;  // nothing to clip: no gradient byte is written
  const ListView list = p.list.view();
  const int lane = threadIdx.x % kWarpSize;
  const int32_t w = static_cast<int32_t>(blockIdx.x) * kWarps + threadIdx.x / kWarpSize;
  walk_warp_share<kCapacity>(list, grid_shares(p.list), w, lane, [&](int32_t t, ChunkRange chunks, int64_t) {
    // The whole run of chunks at once: scale has no per-chunk result to form.
    const ElementRange e = list.elements_of(t, chunks);
    if (e.begin == e.end) return;
    void* data = const_cast<void*>(list.data[t]);
    switch (list.dtype_of(t)) {
      case DType::Float32: scale_chunk<Float32Codec>(data, e.begin, e.end, coef, p.rounding, lane); break;
      case DType::Float64: scale_chunk<Float64Codec>(data, e.begin, e.end, coef, p.rounding, lane); break;
      case DType::Float16: scale_chunk<Float16Codec>(data, e.begin, e.end, coef, p.rounding, lane); break;
      case DType::BFloat16: scale_chunk<BFloat16Codec>(data, e.begin, e.end, coef, p.rounding, lane); break;
      default: break;  // rejected on the host
    }
  });
}

// A blob slice in the parameters of upload_kernel; the whole struct stays under kParameterBytes.
constexpr size_t kUploadBytes = 32 * 1024 - 64;
struct UploadParams {
  uint4* dst;
  uint32_t vectors;
  alignas(16) unsigned char bytes[kUploadBytes];
};
static_assert(sizeof(UploadParams) <= kParameterBytes && kUploadBytes % 16 == 0, "upload slice too large");

// One 16-byte vector per thread, over as many small blocks as the slice needs. The slice is read
// from the parameters, through the constant cache, which serves a warp one address at a time: one
// block looping over a 32 KB slice read it in 2,044 steps on one multiprocessor, ~10 us on an H100,
// and a graph replay of a 10,000-tensor scan spent 76 us in its 8 uploads against the scan's 28
// (benchmarks/NOTES.md, entry 28). Spread over 32 blocks of 64 threads, each multiprocessor serves
// 64 of those steps.
constexpr int kUploadThreads = 64;

__global__ void __launch_bounds__(kUploadThreads) upload_kernel(const __grid_constant__ UploadParams p) {
  const uint4* src = reinterpret_cast<const uint4*>(p.bytes);
  const uint32_t i = blockIdx.x * kUploadThreads + threadIdx.x;
  if (i < p.vectors) p.dst[i] = src[i];
}

// Resident blocks per multiprocessor of a kernel (its register use decides), asked once per kernel
// and device. The answer is cached even when the query fails (as 1), so that a scan's workspace is
// sized and its kernel launched with the same grid.
template <auto Kernel>
int resident_blocks_per_sm() {
  static std::array<int, 64> cached{};  // racing writers store the same value
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return 1;
  }
  if (device < static_cast<int>(cached.size()) && cached[device] != 0) return cached[device];
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, kThreads, 0) != cudaSuccess || n < 1) {
    (void)cudaGetLastError();  // not left pending for the launch's own error check
    n = 1;
  }
  if (device < static_cast<int>(cached.size())) cached[device] = n;
  return n;
}

// A persistent grid: one wave of resident blocks, fewer when the list has fewer chunks than that
// wave has warps.
int grid_for(int64_t chunks, int num_sms, int blocks_per_sm) {
  const int64_t wanted = (chunks + kWarps - 1) / kWarps;
  return static_cast<int>(
      std::max<int64_t>(1, std::min<int64_t>(wanted, static_cast<int64_t>(num_sms) * blocks_per_sm)));
}

// The kernels of one capacity, and how many blocks of each fit on a multiprocessor. The inline
// capacity has no kernel for the kinds that always read a device copy (has_inline_kernel): none is
// compiled, and asking for one gives null (which scan() refuses; with_capacity never asks).
template <int32_t kCapacity>
struct Kernels {
  using Kernel = void (*)(ScanParams<kCapacity>);

  template <bool kHalfRange, bool kMultiply, bool kChecksum>
  static constexpr auto scan = scan_kernel<kHalfRange, kMultiply, kChecksum, kCapacity>;

  static Kernel scan_for(ScanKind kind) {
    switch (kind) {
      case ScanKind::Plain: return scan<false, false, false>;
      case ScanKind::HalfRange: return scan<true, false, false>;
      case ScanKind::Unscale: return scan<false, true, false>;
      case ScanKind::Checksum:
        if constexpr (kCapacity == kDeviceList) {
          return scan<false, false, true>;
        } else {
          return nullptr;
        }
      case ScanKind::Difference:
        if constexpr (kCapacity == kDeviceList) {
          return difference_kernel<kCapacity>;
        } else {
          return nullptr;
        }
    }
    return nullptr;
  }

  static int scan_blocks_per_sm(ScanKind kind) {
    switch (kind) {
      case ScanKind::Plain: return resident_blocks_per_sm<scan<false, false, false>>();
      case ScanKind::HalfRange: return resident_blocks_per_sm<scan<true, false, false>>();
      case ScanKind::Unscale: return resident_blocks_per_sm<scan<false, true, false>>();
      case ScanKind::Checksum:
        if constexpr (kCapacity == kDeviceList) {
          return resident_blocks_per_sm<scan<false, false, true>>();
        } else {
          return 1;
        }
      case ScanKind::Difference:
        if constexpr (kCapacity == kDeviceList) {
          return resident_blocks_per_sm<difference_kernel<kCapacity>>();
        } else {
          return 1;
        }
    }
    return 1;
  }
};

// Calls fn with the ListArgs capacity a list travels in (a std::integral_constant): inline when
// `in_parameters` (list_in_parameters for a scan, fits_in_parameters for a scale), else its device copy.
template <class Fn>
auto with_capacity(bool in_parameters, Fn&& fn) {
  if (!in_parameters) return fn(std::integral_constant<int32_t, kDeviceList>{});
  return fn(std::integral_constant<int32_t, kInlineTensors>{});
}

size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

// Host staging for a kernel's parameters (up to 32 KB), made once per thread: parameters are copied
// at launch, so the buffer is free again as soon as the launch call returns.
template <class Params>
Params& parameter_buffer() {
  thread_local std::unique_ptr<Params> buffer(new Params());
  return *buffer;
}

// The fold-tree slots a scan's kernel uses (as difference_kernel and scan_kernel cut the list).
size_t fold_slots_of(const ListPlan& plan, ScanKind kind, int grid) {
  const int64_t warps = int64_t{grid} * kWarps;
  if (kind == ScanKind::Difference) {  // two trees over the befores' shares
    const ListView befores = befores_of(plan.view());
    return 2 * static_cast<size_t>(Shares::of(befores.total_cost(), warps).fold_slots(befores.num_tensors));
  }
  return static_cast<size_t>(Shares::of(plan.total_cost(), warps).fold_slots(plan.num_tensors()));
}

// Where each part of a scan's workspace starts, for a grid of `grid` blocks: O(tensors + grid).
struct WorkspaceLayout {
  int grid;
  size_t slots;  // fold-tree slots, and as many arrival counters (then the blocks' ticket)
  size_t partial_bytes, block_total_bytes, counter_bytes;

  WorkspaceLayout(const ListPlan& plan, ScanKind kind, int grid_)
      : grid(grid_),
        slots(fold_slots_of(plan, kind, grid_)),
        partial_bytes(align_up(slots * sizeof(TensorStats))),
        block_total_bytes(align_up(static_cast<size_t>(grid_) * sizeof(TensorStats))),
        counter_bytes(align_up((slots + 1) * sizeof(unsigned int))) {}

  size_t bytes() const { return partial_bytes + block_total_bytes + counter_bytes; }

  Workspace at(void* base) const {
    char* p = static_cast<char*>(base);
    return Workspace{reinterpret_cast<TensorStats*>(p), reinterpret_cast<TensorStats*>(p + partial_bytes),
                     reinterpret_cast<unsigned int*>(p + partial_bytes + block_total_bytes)};
  }
};

// The grid of a scan: the same for a plan, kind and device on every call, which is what keeps the
// totals' combine order (and so their bits) fixed.
int scan_grid(const ListPlan& plan, ScanKind kind, int num_sms) {
  return with_capacity(list_in_parameters(plan, kind), [&](auto capacity) {
    return grid_for(plan.num_chunks(), num_sms, Kernels<decltype(capacity)::value>::scan_blocks_per_sm(kind));
  });
}

}  // namespace

int32_t max_tensors_in_parameters() { return kInlineTensors; }

cudaError_t upload_list(const ListPlan& plan, void* device_blob, cudaStream_t stream) {
  return upload_bytes(plan.blob(), plan.bytes(), device_blob, stream);  // a blob is a multiple of 16 bytes
}

cudaError_t upload_bytes(const void* source, size_t size, void* device, cudaStream_t stream) {
  if (reinterpret_cast<uintptr_t>(device) % 16 != 0 || size % 16 != 0) return cudaErrorInvalidValue;
  UploadParams& params = parameter_buffer<UploadParams>();
  for (size_t offset = 0; offset < size; offset += kUploadBytes) {
    const size_t bytes = std::min(kUploadBytes, size - offset);
    params.dst = reinterpret_cast<uint4*>(static_cast<char*>(device) + offset);
    params.vectors = static_cast<uint32_t>(bytes / 16);
    memcpy(params.bytes, static_cast<const unsigned char*>(source) + offset, bytes);
    const int blocks = static_cast<int>((params.vectors + kUploadThreads - 1) / kUploadThreads);
    NANSCAN_LAUNCH(upload_kernel, blocks, kUploadThreads, stream, params);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

size_t scan_workspace_bytes(const ListPlan& plan, ScanKind kind, int num_sms) {
  return WorkspaceLayout(plan, kind, scan_grid(plan, kind, num_sms)).bytes();
}

namespace {
// A device copy is given exactly when the list does not travel in the kernel parameters.
bool blob_matches_placement(bool in_parameters, const void* device_blob) {
  return in_parameters == (device_blob == nullptr);
}

// A difference scan's plan: N befores (float32 or float64) then N afters of the same sizes, each no
// wider than its before (the kernel has no other pairs; the op checks this with its own words).
bool valid_pairs(const ListPlan& plan) {
  const ListView list = plan.view();
  if (list.num_tensors % 2 != 0) return false;
  const int32_t n = list.num_tensors / 2;
  for (int32_t t = 0; t < n; ++t) {
    const DType before = list.dtype_of(t), after = list.dtype_of(n + t);
    if (!keeps_differences(before) || !no_wider_than(after, before) || list.numel[t] != list.numel[n + t]) {
      return false;
    }
  }
  return true;
}
}  // namespace

cudaError_t scan(const ListPlan& plan, const void* device_blob, ScanKind kind, const ResultPointers& out,
                 void* workspace, size_t workspace_bytes, int num_sms, cudaStream_t stream, const float* multiply_by) {
  if (plan.num_tensors() <= 0 || out.num_tensors != plan.num_tensors()) return cudaErrorInvalidValue;
  if (out.row_stride < out.num_tensors) return cudaErrorInvalidValue;
  if ((kind == ScanKind::Unscale) != (multiply_by != nullptr)) return cudaErrorInvalidValue;
  if ((kind == ScanKind::HalfRange) != out.half_range) return cudaErrorInvalidValue;
  if ((kind == ScanKind::Checksum) != out.checksum) return cudaErrorInvalidValue;
  if (kind == ScanKind::Difference && !valid_pairs(plan)) return cudaErrorInvalidValue;
  if (!blob_matches_placement(list_in_parameters(plan, kind), device_blob)) return cudaErrorInvalidValue;
  const WorkspaceLayout layout(plan, kind, scan_grid(plan, kind, num_sms));
  // Every slot, counter and block total is indexed by the grid: refuse rather than overrun a
  // workspace sized for another.
  if (layout.bytes() > workspace_bytes) return cudaErrorInvalidValue;
  const Workspace ws = layout.at(workspace);
  cudaError_t err = cudaMemsetAsync(ws.counters, 0, layout.counter_bytes, stream);
  if (err != cudaSuccess) return err;
  return with_capacity(list_in_parameters(plan, kind), [&](auto capacity) {
    constexpr int32_t kCapacity = decltype(capacity)::value;
    const auto kernel = Kernels<kCapacity>::scan_for(kind);
    if (kernel == nullptr) return cudaErrorInvalidDeviceFunction;
    ScanParams<kCapacity>& params = parameter_buffer<ScanParams<kCapacity>>();
    fill_list_args(params.list, plan, device_blob);
    params.multiply_by = multiply_by;
    params.ws = ws;
    params.out = out;
    NANSCAN_LAUNCH(kernel, layout.grid, kThreads, stream, params);
    return cudaGetLastError();
  });
}

cudaError_t scale(const ListPlan& plan, const void* device_blob, const void* coef, DType coef_dtype,
                  CoefRounding rounding, int num_sms, cudaStream_t stream) {
  const ListView list = plan.view();
  for (int32_t i = 0; i < list.num_tensors; ++i) {
    const DType d = list.dtype_of(i);
    if (d == DType::Float8E4M3FN || d == DType::Float8E5M2) return cudaErrorInvalidValue;
  }
  if (!blob_matches_placement(fits_in_parameters(plan), device_blob)) return cudaErrorInvalidValue;
  return with_capacity(fits_in_parameters(plan), [&](auto capacity) {
    constexpr int32_t kCapacity = decltype(capacity)::value;
    ScaleParams<kCapacity>& params = parameter_buffer<ScaleParams<kCapacity>>();
    fill_list_args(params.list, plan, device_blob);
    params.coef = coef;
    params.coef_dtype = coef_dtype;
    params.rounding = rounding;
    const int grid = grid_for(plan.num_chunks(), num_sms, resident_blocks_per_sm<scale_kernel<kCapacity>>());
    NANSCAN_LAUNCH(scale_kernel<kCapacity>, grid, kThreads, stream, params);
    return cudaGetLastError();
  });
}

}  // namespace nanscan::cuda
