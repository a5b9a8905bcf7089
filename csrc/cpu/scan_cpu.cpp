// The CPU scan (nanscan::scan): each chunk of a tensor through the run kernels (runs.h), with the
// replica checksum and the in-place multiply of the unscale fused into the same pass.

#include "scan_cpu.h"

#include <cstring>
#include <optional>

#include "runs.h"

namespace nanscan::cpu {
namespace {

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
    // The lanes' first salts laid out as words, then copied into the vectors whole: a write of one
    // lane into a vector reads the rest of it, which GCC 12 takes for a read of an uninitialised one.
    uint32_t first_salts[kChecksumVectors * kWordLanes];
    for (int64_t i = 0; i < kChecksumVectors * kWordLanes; ++i)
      first_salts[i] = first + static_cast<uint32_t>(i) * kSaltLow;
    ChecksumWords lanes[kChecksumVectors] = {}, salt[kChecksumVectors];
    static_assert(sizeof(salt) == sizeof(first_salts));
    std::memcpy(salt, first_salts, sizeof(salt));
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

// Elements [begin, end) in logical (row-major) order of a tensor that is not dense in memory, gathered
// run by run into a stack buffer, a row at a time (RowWalk), so no allocation scales with the tensor.
template <class Codec, bool kHalfRange>
NANSCAN_INLINE void scan_strided(const TensorInfo& t, int64_t begin, int64_t end, bool checksum, TensorStats& s) {
  using Raw = typename Codec::Raw;
  RowWalk<1> walk({&t}, begin);
  const int64_t stride = walk.row_stride(0);
  const auto* base = static_cast<const Raw*>(t.data);
  Raw buffer[kRunElements];
  RunScale<Codec> carried;
  for (int64_t i = begin; i < end;) {
    const int64_t len = std::min(kRunElements, end - i);
    walk.walk(len, [&](int64_t k, const int64_t (&offset)[1], int64_t n)
                       NANSCAN_INLINE_LAMBDA { copy_row(buffer + k, base + offset[0], n, stride); });
    scan_run<Codec, kHalfRange>(buffer, len, s, carried, false);
    if (checksum) s.checksum += checksum_elements<Codec>(buffer, len, i, false);
    i += len;
  }
}

// The tensor's elements as one contiguous memory span, when it is dense in any permutation of its
// dimensions (contiguous, transposed, channels-last, ...): order does not change the statistics.
const void* dense_span(const TensorInfo& t) { return t.dense ? t.data : nullptr; }

// One chunk of one dtype and range mode: the hot loops, inlined into a function compiled for
// several x86 levels and picked at load time. One such function per case rather than one holding
// every case: GCC's RTL PRE and post-reload CSE grow faster than the function they optimise. The one
// function took 297 s to compile here, 83 s of it in PRE; split so, the file takes 93 s
// (benchmarks/NOTES.md entry 52).
template <class Codec, bool kHalfRange, bool kDense>
NANSCAN_X86_CLONES("arch=x86-64-v4", "arch=x86-64-v3", "default")
TensorStats scan_chunk_of(const TensorInfo& t, const void* dense, int64_t begin, int64_t end, const float* multiply_by,
                          bool checksum) {
  TensorStats s = empty_stats();
  if constexpr (kDense) {
    scan_contiguous<Codec, kHalfRange>(dense, begin, end, multiply_by, checksum, s);
  } else {
    scan_strided<Codec, kHalfRange>(t, begin, end, checksum, s);
  }
  return s;
}

template <class Codec, bool kHalfRange>
TensorStats scan_chunk_by_layout(const TensorInfo& t, const void* dense, int64_t begin, int64_t end,
                                 const float* multiply_by, bool checksum) {
  return dense ? scan_chunk_of<Codec, kHalfRange, true>(t, dense, begin, end, multiply_by, checksum)
               : scan_chunk_of<Codec, kHalfRange, false>(t, dense, begin, end, multiply_by, checksum);
}

TensorStats scan_chunk(const TensorInfo& t, DType dtype, const void* dense, int64_t begin, int64_t end,
                       const float* multiply_by, bool half_range, bool checksum) {
  switch (dtype) {
#define NANSCAN_CASE(TAG, CODEC)                                                                       \
  case DType::TAG:                                                                                     \
    return half_range ? scan_chunk_by_layout<CODEC, true>(t, dense, begin, end, multiply_by, checksum) \
                      : scan_chunk_by_layout<CODEC, false>(t, dense, begin, end, multiply_by, checksum);
    NANSCAN_CASE(Float32, Float32Codec)
    NANSCAN_CASE(Float64, Float64Codec)
    NANSCAN_CASE(Float16, Float16Codec)
    NANSCAN_CASE(BFloat16, BFloat16Codec)
    NANSCAN_CASE(Float8E4M3FN, Float8E4M3FNCodec)
    NANSCAN_CASE(Float8E5M2, Float8E5M2Codec)
#undef NANSCAN_CASE
  }
  return empty_stats();
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

}  // namespace nanscan::cpu
