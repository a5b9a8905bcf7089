// Runs the CUDA kernels of csrc/cuda/scan_cuda.cu on CPU threads (see include/cuda_runtime.h) and
// checks every result against the exact rule applied element by element in fp64. CI has no GPU; this
// executes the kernels' own code: the warps' shares, 16-byte vector loads and tails, the fast rule
// with its checked re-read (unscaled, and scaled for tiny values), warp reductions, the fold tree,
// the last-block totals, the three list placements (small and large parameter blobs, a device blob
// written by the upload kernel), the fp16-range counts, the fused unscale, the clip multiply and the
// difference scan of pairs; and that the bits do not depend on the order in which blocks run. Built
// and run by tests/test_cuda_emulated.py.
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <random>
#include <utility>
#include <vector>

#include "../../csrc/cuda/scan_cuda.h"
#include "../cpp/check.h"

using namespace nanscan;
using namespace nanscan::cuda;

namespace {

// Storage 16-byte aligned like a CUDA allocation, of exactly the bytes asked for (rounded up to 16),
// so that the sanitizers this test can be built with see an overrun.
struct AlignedBytes {
  explicit AlignedBytes(size_t bytes = 0)
      : size((bytes + 15) / 16 * 16), p(size ? static_cast<unsigned char*>(std::aligned_alloc(16, size)) : nullptr) {}
  AlignedBytes(const AlignedBytes& o) : AlignedBytes(o.size) {
    if (size) memcpy(p, o.p, size);
  }
  AlignedBytes& operator=(const AlignedBytes&) = delete;
  ~AlignedBytes() { std::free(p); }
  size_t size;
  unsigned char* p;
};

// One tensor's storage: raw bytes, 16-byte aligned unless an offset is asked for.
struct HostTensor {
  DType dtype;
  int64_t numel;
  AlignedBytes storage;
  size_t offset = 0;  // bytes, to test unaligned starts

  unsigned char* data() { return storage.p + offset; }
  const unsigned char* data() const { return storage.p + offset; }
};

template <class Codec>
typename Codec::Raw raw_at(const HostTensor& t, int64_t i) {
  typename Codec::Raw r;
  memcpy(&r, t.data() + i * sizeof r, sizeof r);
  return r;
}

// Calls fn(Codec{}) with the codec of a dtype.
template <class Fn>
auto with_codec(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::Float32: return fn(Float32Codec{});
    case DType::Float64: return fn(Float64Codec{});
    case DType::Float16: return fn(Float16Codec{});
    case DType::BFloat16: return fn(BFloat16Codec{});
    case DType::Float8E4M3FN: return fn(Float8E4M3FNCodec{});
    case DType::Float8E5M2: break;
  }
  return fn(Float8E5M2Codec{});
}

// Stores v, rounded to t's format as torch rounds it, at element i (formats with an encoder: not float8).
void store(HostTensor& t, int64_t i, double v) {
  with_codec(t.dtype, [&](auto codec) {
    using Codec = decltype(codec);
    if constexpr (HasEncode<Codec>::value) {
      const typename Codec::Raw r = Codec::encode(static_cast<typename Codec::Wide>(v));
      memcpy(t.data() + i * sizeof r, &r, sizeof r);
    }
  });
}

// Random finite values of each format (normal, subnormal and huge ones), then NaN/Inf where asked.
HostTensor make_tensor(std::mt19937_64& rng, DType dtype, int64_t numel, size_t offset) {
  HostTensor t{dtype, numel, AlignedBytes(offset + static_cast<size_t>(numel) * element_size(dtype)), offset};
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t i = 0; i < numel; ++i) {
    const double v = normal(rng) * ((rng() % 97 == 0) ? 1e-6 : 1.0);
    if (dtype == DType::Float8E4M3FN || dtype == DType::Float8E5M2) {
      // Random bits, the NaN (and e5m2's Inf) codes moved to a neighbouring finite code.
      uint8_t r = static_cast<uint8_t>(rng() % 256);
      if (dtype == DType::Float8E4M3FN && (r & 0x7f) == 0x7f) r ^= 1;
      if (dtype == DType::Float8E5M2 && (r & 0x7c) == 0x7c) r ^= 0x04;
      t.data()[i] = r;
    } else {
      store(t, i, v);
    }
  }
  return t;
}

void plant(HostTensor& t, int64_t i, bool nan) {
  unsigned char* p = t.data() + i * element_size(t.dtype);
  switch (t.dtype) {
    case DType::Float32: {
      const uint32_t r = nan ? 0x7fc00000u : 0xff800000u;
      memcpy(p, &r, 4);
      break;
    }
    case DType::Float64: {
      const uint64_t r = nan ? 0x7ff8000000000000ull : 0x7ff0000000000000ull;
      memcpy(p, &r, 8);
      break;
    }
    case DType::Float16: {
      const uint16_t r = nan ? 0x7e00 : 0x7c00;
      memcpy(p, &r, 2);
      break;
    }
    case DType::BFloat16: {
      const uint16_t r = nan ? 0x7fc0 : 0xff80;
      memcpy(p, &r, 2);
      break;
    }
    case DType::Float8E4M3FN: *p = 0xff; break;  // NaN: e4m3fn has no Inf
    case DType::Float8E5M2: *p = nan ? 0x7f : 0xfc; break;
  }
}

TensorStats reference(const HostTensor& t, bool half_range) {
  return with_codec(t.dtype, [&](auto codec) {
    using Codec = decltype(codec);
    TensorStats s = empty_stats();
    for (int64_t i = 0; i < t.numel; ++i) accumulate_exact<Codec>(s, raw_at<Codec>(t, i), half_range);
    return s;
  });
}

// The replica checksum by its definition (scan_rules.h): the tensor's bytes as 32-bit little-endian
// words, the last one zero-padded, word q mixed with salt(q), summed modulo 2^32.
uint32_t reference_checksum(const HostTensor& t) {
  const int64_t size = t.numel * static_cast<int64_t>(element_size(t.dtype));
  uint32_t sum = 0;
  for (int64_t q = 0; q * 4 < size; ++q) {
    uint32_t word = 0;
    for (int64_t b = 0; b < 4; ++b) {
      if (q * 4 + b < size) word |= static_cast<uint32_t>(t.data()[q * 4 + b]) << (8 * b);
    }
    sum += replica_mix(word ^ replica_salt(static_cast<uint64_t>(q)));
  }
  return sum;
}

// A copy of a list with every NaN/Inf replaced by zero, so that its total norm is finite and shows a
// change of combine order in its last bits.
std::vector<HostTensor> without_nonfinite(const std::vector<HostTensor>& list) {
  std::vector<HostTensor> finite = list;
  for (HostTensor& t : finite) {
    with_codec(t.dtype, [&](auto codec) {
      using Codec = decltype(codec);
      using Raw = typename Codec::Raw;
      for (int64_t i = 0; i < t.numel; ++i) {
        if (is_nonfinite_magnitude<Codec>(static_cast<Raw>(raw_at<Codec>(t, i) & Codec::kMagnitudeMask))) {
          memset(t.data() + i * sizeof(Raw), 0, sizeof(Raw));
        }
      }
    });
  }
  return finite;
}

bool close(double got, double want, double rtol) {
  if (std::isnan(want)) return std::isnan(got);
  if (std::isinf(want)) return got == want;
  return std::fabs(got - want) <= rtol * std::fabs(want);
}

// Allocations the kernels treat as device memory: host memory, 256-byte aligned and rounded like the
// caching allocator's, with nothing to spare beyond that.
struct Buffer {
  explicit Buffer(size_t bytes) : bytes_((bytes + 255) / 256 * 256), p(std::aligned_alloc(256, bytes_ ? bytes_ : 256)) {
    memset(p, 0xAB, bytes_);  // garbage, as fresh allocator memory would be
  }
  ~Buffer() { std::free(p); }
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;
  size_t bytes_;
  void* p;
};

// A list as the binding hands it to the launcher for a scan of `kind`: its plan, plus the device
// copy of the plan's blob (written by the upload kernel) when the kernel does not take the list in its
// parameters (a scale places a list as a plain scan does: in them when it fits).
struct LaunchableList {
  explicit LaunchableList(const std::vector<HostTensor>& tensors, ScanKind kind = ScanKind::Plain) {
    std::vector<TensorArg> args;
    for (const HostTensor& t : tensors) args.push_back(TensorArg{t.data(), t.numel, t.dtype});
    CHECK(plan.build(args.data(), static_cast<int64_t>(args.size())), "plan");
    if (!list_in_parameters(plan, kind)) {
      device_blob = std::make_unique<Buffer>(plan.bytes());
      CHECK(upload_list(plan, device_blob->p, nullptr) == cudaSuccess, "upload");
      CHECK(memcmp(device_blob->p, plan.blob(), plan.bytes()) == 0, "the upload kernel copied the blob wrongly");
    }
  }
  const void* blob() const { return device_blob ? device_blob->p : nullptr; }

  ListPlan plan;
  std::unique_ptr<Buffer> device_blob;
};

struct ScanOutput {
  std::vector<int64_t> counts;
  std::vector<double> stats;
  double total_norm = -1;
  bool finite = false;
  // The total norm in a torch dtype, as the op asks for it (tests/test_ops.py compares the CPU
  // backend's with torch's .to(); here, that the kernel writes it, in the dtype asked for).
  DType cast_dtype = DType::Float32;
  uint64_t total_norm_cast = ~0ull;  // storage for any cast dtype; all ones until written
};

// What the cast output must hold: total_norm as store_norm_as rounds it (its values against torch's
// .to() are tests/test_ops.py's), in the low bytes of the storage.
bool cast_matches(const ScanOutput& out) {
  uint64_t want = ~0ull;
  store_norm_as(&want, out.cast_dtype, out.total_norm);
  return want == out.total_norm_cast;
}

// The launcher's own sequence, as the binding drives it: plan, device blob when needed, workspace.
ScanOutput run_scan(const std::vector<HostTensor>& tensors, ScanKind kind, int num_sms,
                    const float* multiply_by = nullptr) {
  const LaunchableList list(tensors, kind);
  const ListPlan& plan = list.plan;
  Buffer workspace(scan_workspace_bytes(plan, kind, num_sms));
  const int64_t n = static_cast<int64_t>(tensors.size());
  const bool half_range = kind == ScanKind::HalfRange;
  const bool checksum = kind == ScanKind::Checksum;
  ScanOutput out;
  out.counts.assign((half_range ? 4 : checksum ? 3 : 2) * n, -1);
  out.stats.assign(3 * n, -7.0);
  // Each kind writes the cast in another dtype, so that every case of store_norm_as runs in the kernel.
  out.cast_dtype = half_range    ? DType::BFloat16
                   : checksum    ? DType::Float16
                   : multiply_by ? DType::Float64
                                 : DType::Float32;
  ResultPointers ptrs{out.counts.data(), out.stats.data(), &out.total_norm,      &out.finite,   n, n,
                      half_range,        checksum,         &out.total_norm_cast, out.cast_dtype};
  const cudaError_t err =
      scan(plan, list.blob(), kind, ptrs, workspace.p, workspace.bytes_, num_sms, nullptr, multiply_by);
  CHECK(err == cudaSuccess, "scan returned %d", err);
  return out;
}

void expect_matches(const char* what, const std::vector<HostTensor>& tensors, const ScanOutput& out, bool half_range,
                    bool checksum = false) {
  const int64_t n = static_cast<int64_t>(tensors.size());
  TensorStats total = empty_stats();
  for (int64_t i = 0; i < n; ++i) {
    const TensorStats want = reference(tensors[i], half_range);
    total = combine(total, want);
    CHECK(out.counts[i] == want.nan_count, "%s: tensor %lld nan %lld, want %lld", what, (long long)i,
          (long long)out.counts[i], (long long)want.nan_count);
    CHECK(out.counts[n + i] == want.inf_count, "%s: tensor %lld inf %lld, want %lld", what, (long long)i,
          (long long)out.counts[n + i], (long long)want.inf_count);
    if (half_range) {
      CHECK(out.counts[2 * n + i] == want.half_overflow, "%s: tensor %lld fp16 overflow", what, (long long)i);
      CHECK(out.counts[3 * n + i] == want.half_underflow, "%s: tensor %lld fp16 underflow", what, (long long)i);
    }
    if (checksum) {
      CHECK(out.counts[2 * n + i] == static_cast<int64_t>(reference_checksum(tensors[i])), "%s: tensor %lld checksum",
            what, (long long)i);
    }
    CHECK(out.stats[i] == want.min, "%s: tensor %lld min %g, want %g", what, (long long)i, out.stats[i], want.min);
    CHECK(out.stats[n + i] == want.max, "%s: tensor %lld max %g, want %g", what, (long long)i, out.stats[n + i],
          want.max);
    CHECK(close(out.stats[2 * n + i], l2_norm(want), 1e-6), "%s: tensor %lld norm %.17g, want %.17g", what,
          (long long)i, out.stats[2 * n + i], l2_norm(want));
  }
  CHECK(close(out.total_norm, l2_norm(total), 1e-6), "%s: total norm %.17g, want %.17g", what, out.total_norm,
        l2_norm(total));
  CHECK(out.finite == all_finite(total), "%s: finite flag", what);
  CHECK(cast_matches(out), "%s: total norm cast to dtype %d: bits %llx", what, static_cast<int>(out.cast_dtype),
        (unsigned long long)out.total_norm_cast);
}

std::vector<HostTensor> random_list(std::mt19937_64& rng, int n, int64_t max_numel, bool with_fp8) {
  const DType all[] = {DType::Float32,  DType::Float64,      DType::Float16,
                       DType::BFloat16, DType::Float8E4M3FN, DType::Float8E5M2};
  std::vector<HostTensor> list;
  for (int i = 0; i < n; ++i) {
    const DType d = all[rng() % (with_fp8 ? 6 : 4)];
    const int64_t numel = (rng() % 7 == 0) ? 0 : static_cast<int64_t>(rng() % static_cast<uint64_t>(max_numel)) + 1;
    const size_t offset = (rng() % 5 == 0) ? element_size(d) * (1 + rng() % 3) : 0;  // some unaligned starts
    list.push_back(make_tensor(rng, d, numel, offset));
    if (numel > 0 && rng() % 4 == 0)
      plant(list.back(), static_cast<int64_t>(rng() % static_cast<uint64_t>(numel)), rng() % 2 == 0);
  }
  return list;
}

// A scan's outputs for a launch that may be refused: every one a sentinel until a launch writes it.
struct SentinelOutputs {
  SentinelOutputs(int64_t n, bool half_range, bool checksum)
      : counts(4 * n, -1), stats(3 * n, -7.0), ptrs{counts.data(), stats.data(), &total_norm,      &finite,       n, n,
                                                    half_range,    checksum,     &total_norm_cast, DType::Float32} {}
  SentinelOutputs(const SentinelOutputs&) = delete;  // ptrs points into this object
  bool untouched() const { return counts[0] == -1 && total_norm == -1 && total_norm_cast == -1; }

  std::vector<int64_t> counts;
  std::vector<double> stats;
  double total_norm = -1;
  bool finite = false;
  float total_norm_cast = -1;
  const ResultPointers ptrs;
};

// A workspace smaller than the launch's layout is refused before anything is written.
void check_workspace_guard(std::mt19937_64& rng) {
  const std::vector<HostTensor> tensors = random_list(rng, 20, 5000, false);
  const LaunchableList list(tensors);
  const size_t needed = scan_workspace_bytes(list.plan, ScanKind::Plain, 2);
  Buffer workspace(needed);
  SentinelOutputs out(static_cast<int64_t>(tensors.size()), false, false);
  CHECK(scan(list.plan, list.blob(), ScanKind::Plain, out.ptrs, workspace.p, needed - 1, 2, nullptr) ==
            cudaErrorInvalidValue,
        "a workspace one byte short was accepted");
  CHECK(out.untouched(), "a refused scan wrote its outputs");
  CHECK(scan(list.plan, list.blob(), ScanKind::Plain, out.ptrs, workspace.p, needed, 2, nullptr) == cudaSuccess,
        "scan");
  const float want_cast = static_cast<float>(out.total_norm);  // compared as bits: the list may hold a NaN
  CHECK(out.total_norm != -1 && memcmp(&out.total_norm_cast, &want_cast, sizeof want_cast) == 0,
        "the scan wrote no total");
}

// A short list travels in the parameters for the kinds with an inline kernel and as a device copy
// for the others (has_inline_kernel); a launch given the other placement is refused, not run.
void check_placement_guard(std::mt19937_64& rng) {
  const std::vector<HostTensor> tensors = random_list(rng, 12, 3000, false);
  const int64_t n = static_cast<int64_t>(tensors.size());
  for (const ScanKind kind : {ScanKind::Plain, ScanKind::HalfRange, ScanKind::Checksum}) {
    const bool checksum = kind == ScanKind::Checksum;
    const LaunchableList right(tensors, kind);
    CHECK((right.blob() == nullptr) == !checksum, "kind %d: a list of %lld %s a device copy", static_cast<int>(kind),
          (long long)n, checksum ? "lacks" : "has");
    // The other placement: a copy where none belongs, or none where one does.
    const LaunchableList wrong(tensors, checksum ? ScanKind::Plain : ScanKind::Checksum);
    Buffer workspace(scan_workspace_bytes(right.plan, kind, 2));
    SentinelOutputs out(n, kind == ScanKind::HalfRange, checksum);
    CHECK(scan(wrong.plan, wrong.blob(), kind, out.ptrs, workspace.p, workspace.bytes_, 2, nullptr) ==
              cudaErrorInvalidValue,
          "kind %d: a launch with the other placement was accepted", static_cast<int>(kind));
    CHECK(out.untouched(), "kind %d: a refused scan wrote its outputs", static_cast<int>(kind));
  }
}

// scan_into_'s launch: the results in columns [column, column + n) of buffers `width` wide, and no
// totals (total_norm null). Every result equals the plain scan's; no other column, and neither total,
// is written. Both the parameter-list and the device-list capacities, fp16 range on and off.
void check_scan_into_columns(std::mt19937_64& rng) {
  for (const int count : {7, 1700}) {
    for (const bool half_range : {false, true}) {
      const std::vector<HostTensor> tensors = random_list(rng, count, 600, true);
      const ScanKind kind = half_range ? ScanKind::HalfRange : ScanKind::Plain;
      const ScanOutput want = run_scan(tensors, kind, 3);
      const LaunchableList list(tensors);
      Buffer workspace(scan_workspace_bytes(list.plan, kind, 3));
      const int64_t n = count, rows = half_range ? 4 : 2, column = 5, width = n + 11;
      std::vector<int64_t> counts(rows * width, -1);
      std::vector<double> stats(3 * width, -7.0);
      bool finite = false;
      float total_norm_cast = -1;
      const ResultPointers ptrs{
          counts.data() + column, stats.data() + column, nullptr, &finite, n, width, half_range, false,
          &total_norm_cast,       DType::Float32};
      CHECK(scan(list.plan, list.blob(), kind, ptrs, workspace.p, workspace.bytes_, 3, nullptr) == cudaSuccess,
            "scan into columns");
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < width; ++c) {
          const bool inside = c >= column && c < column + n;
          const int64_t got = counts[r * width + c];
          CHECK(inside ? got == want.counts[r * n + c - column] : got == -1,
                "scan into columns (%lld tensors): counts row %lld column %lld is %lld", (long long)n, (long long)r,
                (long long)c, (long long)got);
        }
      }
      for (int64_t r = 0; r < 3; ++r) {
        for (int64_t c = 0; c < width; ++c) {
          const bool inside = c >= column && c < column + n;
          const double got = stats[r * width + c];
          const double expected = inside ? want.stats[r * n + c - column] : -7.0;
          CHECK(memcmp(&got, &expected, sizeof got) == 0,
                "scan into columns (%lld tensors): stats row %lld column %lld", (long long)n, (long long)r,
                (long long)c);
        }
      }
      CHECK(!finite && total_norm_cast == -1, "scan into columns wrote totals it was not given");
    }
  }
}

// How many warps' shares meet tensor t, for a grid of num_sms blocks (one per multiprocessor while
// the emulator answers 1 to the occupancy query) when the list has chunks for that many blocks of 8
// warps.
int32_t warps_meeting(const std::vector<HostTensor>& tensors, int32_t t, int num_sms) {
  const LaunchableList list(tensors);
  CHECK((list.plan.num_chunks() + 7) / 8 >= num_sms, "too few chunks for the grid: it would be smaller");
  const WarpRange met = Shares::of(list.plan.total_cost(), 8 * num_sms).meeting(list.plan.view(), t);
  return met.last - met.first + 1;
}

// Scans a list (its NaN/Inf zeroed, so that the total is a finite sum whose bits show its combine
// order) with the blocks in index order and in a shuffled order: every fold has a fixed order, so
// not a bit may change.
void check_block_order_does_not_matter(const char* what, const std::vector<HostTensor>& list, int num_sms) {
  const std::vector<HostTensor> finite = without_nonfinite(list);
  const ScanOutput in_order = run_scan(finite, ScanKind::Plain, num_sms);
  cuda_emulator::block_order_seed = 1 + static_cast<unsigned>(list.size());
  const ScanOutput shuffled = run_scan(finite, ScanKind::Plain, num_sms);
  cuda_emulator::block_order_seed = 0;
  CHECK(std::isfinite(in_order.total_norm), "%s: the total of the finite copy is %g", what, in_order.total_norm);
  CHECK(memcmp(in_order.stats.data(), shuffled.stats.data(), in_order.stats.size() * sizeof(double)) == 0 &&
            memcmp(&in_order.total_norm, &shuffled.total_norm, sizeof(double)) == 0,
        "%s: a run with the blocks in another order differs in its bits", what);
}

void check_scan(const char* what, const std::vector<HostTensor>& list, int num_sms) {
  expect_matches(what, list, run_scan(list, ScanKind::Plain, num_sms), false);
  check_block_order_does_not_matter(what, list, num_sms);
  expect_matches(what, list, run_scan(list, ScanKind::HalfRange, num_sms), true);
  expect_matches(what, list, run_scan(list, ScanKind::Checksum, num_sms), false, true);
}

// GradScaler's unscale fused with the scan: each element becomes encode(decode(x) * f), as torch does.
template <class Codec>
void unscale_reference(HostTensor& t, float factor) {
  using Raw = typename Codec::Raw;
  for (int64_t i = 0; i < t.numel; ++i) {
    const Raw r = Codec::encode(Codec::decode(raw_at<Codec>(t, i)) * static_cast<typename Codec::Wide>(factor));
    memcpy(t.data() + i * sizeof(Raw), &r, sizeof(Raw));
  }
}

void check_unscale(std::mt19937_64& rng, int num_sms) {
  std::vector<HostTensor> list;
  const DType dtypes[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};
  for (int i = 0; i < 40; ++i) {
    // Starts at every element offset within a 16-byte vector: the rewrite covers the head too.
    const DType d = dtypes[i % 4];
    list.push_back(make_tensor(rng, d, static_cast<int64_t>(rng() % 30000), (i / 4 % 8) * element_size(d)));
  }
  list.push_back(make_tensor(rng, DType::Float32, 9 * 8192 + 3, 0));
  plant(list.back(), 8192 * 4 + 1, true);  // a chunk re-read exactly after its rewrite
  // NaN/Inf in the head (before the first 16-byte boundary) and the tail of misaligned tensors: the
  // re-read after the rewrite must visit, lane by lane, exactly the elements each lane wrote.
  for (int i = 0; i < 40; ++i) {
    HostTensor& t = list[static_cast<size_t>(i)];
    if (t.offset % 16 != 0 && t.numel > 2) plant(t, (i % 2 == 0) ? 0 : t.numel - 1, i % 4 < 2);
  }
  std::vector<HostTensor> expected = list;
  const float factor = 1.0f / 1024.0f;
  for (HostTensor& t : expected) {
    switch (t.dtype) {
      case DType::Float32: unscale_reference<Float32Codec>(t, factor); break;
      case DType::Float64: unscale_reference<Float64Codec>(t, factor); break;
      case DType::Float16: unscale_reference<Float16Codec>(t, factor); break;
      case DType::BFloat16: unscale_reference<BFloat16Codec>(t, factor); break;
      default: break;
    }
  }
  const ScanOutput out = run_scan(list, ScanKind::Unscale, num_sms, &factor);
  for (size_t i = 0; i < list.size(); ++i) {
    CHECK(memcmp(list[i].data(), expected[i].data(), list[i].numel * element_size(list[i].dtype)) == 0,
          "unscale: tensor %zu differs from encode(decode(x) * f)", i);
  }
  expect_matches("unscale", expected, out, false);
}

void check_scale(std::mt19937_64& rng, int num_sms, int count) {
  std::vector<HostTensor> list;
  const DType dtypes[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};
  for (int i = 0; i < count; ++i) {
    list.push_back(make_tensor(rng, dtypes[i % 4], 1 + static_cast<int64_t>(rng() % 20000),
                               (i / 4 % 8) * element_size(dtypes[i % 4])));
  }
  const LaunchableList launchable(list);
  const std::vector<HostTensor> before = list;
  const float one = 1.0f;
  CHECK(scale(launchable.plan, launchable.blob(), &one, DType::Float32, CoefRounding::ToTensorDtype, num_sms,
              nullptr) == cudaSuccess,
        "scale");
  for (size_t i = 0; i < list.size(); ++i) {
    CHECK(memcmp(list[i].data(), before[i].data(), list[i].numel * element_size(list[i].dtype)) == 0,
          "scale by 1 wrote tensor %zu", i);
  }
  const float coef = 0.3f;
  CHECK(scale(launchable.plan, launchable.blob(), &coef, DType::Float32, CoefRounding::ToTensorDtype, num_sms,
              nullptr) == cudaSuccess,
        "scale");
  for (size_t i = 0; i < list.size(); ++i) {
    HostTensor want = before[i];
    // tensor.mul_(coef_tensor): the coefficient is first cast to the tensor's dtype.
    switch (want.dtype) {
      case DType::Float32: unscale_reference<Float32Codec>(want, coef); break;
      case DType::Float64: {
        for (int64_t k = 0; k < want.numel; ++k) {
          const uint64_t r =
              Float64Codec::encode(Float64Codec::decode(raw_at<Float64Codec>(want, k)) * static_cast<double>(coef));
          memcpy(want.data() + k * 8, &r, 8);
        }
        break;
      }
      case DType::Float16:
        unscale_reference<Float16Codec>(want, Float16Codec::decode(Float16Codec::encode(coef)));
        break;
      case DType::BFloat16:
        unscale_reference<BFloat16Codec>(want, BFloat16Codec::decode(BFloat16Codec::encode(coef)));
        break;
      default: break;
    }
    CHECK(memcmp(list[i].data(), want.data(), want.numel * element_size(want.dtype)) == 0, "scale by %g: tensor %zu",
          coef, i);
  }
}

// Every dtype starting at every element offset within a 16-byte vector, at sizes around the vector
// and the chunk: the head before the first boundary (one element per lane), the 16-byte body and the
// tail must visit each element exactly once. NaN/Inf planted in the head, the body and the tail.
void check_misaligned_starts(std::mt19937_64& rng) {
  const DType all[] = {DType::Float32,  DType::Float64,      DType::Float16,
                       DType::BFloat16, DType::Float8E4M3FN, DType::Float8E5M2};
  std::vector<HostTensor> list;
  for (const DType d : all) {
    const int64_t per_vector = 16 / element_size(d), per_chunk = kChunkBytes / element_size(d);
    for (int64_t k = 0; k < per_vector; ++k) {
      for (const int64_t numel : {int64_t{1}, per_vector - 1, per_vector + 1, int64_t{1000}, per_chunk + 3}) {
        list.push_back(make_tensor(rng, d, numel, static_cast<size_t>(k) * element_size(d)));
        const int64_t where = (k + numel) % 4;  // 3: none planted
        if (where < 3 && numel > 2)
          plant(list.back(), where == 0 ? 0 : where == 1 ? numel / 2 : numel - 1, (k % 2) == 0);
      }
    }
  }
  check_scan("misaligned starts", list, 3);
}

// Constant-valued tensors are the worst case for running sums of squares (every rounding error has the
// same sign). A lane folds its fp32 sum into fp64 after every group of at most 65 elements, so the
// norm stays within 5e-7 of the fp64 truth for every dtype (fp32 sums of a chunk's 256 to 1,024
// squares per lane alone were off by up to 8e-6). Returns the worst relative error seen.
double check_accuracy_on_constant_tensors(std::mt19937_64& rng) {
  const DType dtypes[] = {DType::Float32, DType::Float16, DType::BFloat16, DType::Float8E4M3FN, DType::Float8E5M2};
  std::uniform_real_distribution<double> value(0.5, 1.5);
  double worst = 0.0;
  for (const DType d : dtypes) {
    std::vector<HostTensor> list;
    for (int i = 0; i < 12; ++i) {
      HostTensor t = make_tensor(rng, d, 3 * kChunkBytes / element_size(d) + 17, 0);
      const double v = value(rng);
      for (int64_t k = 0; k < t.numel; ++k) {
        switch (d) {
          case DType::Float8E4M3FN: t.data()[k] = static_cast<uint8_t>(0x30 + i); break;    // 0.5 .. 1.375
          case DType::Float8E5M2: t.data()[k] = static_cast<uint8_t>(0x38 + i % 8); break;  // 0.5 .. 1.75
          default: store(t, k, v);
        }
      }
      list.push_back(std::move(t));
    }
    const ScanOutput out = run_scan(list, ScanKind::Plain, 3);
    for (size_t i = 0; i < list.size(); ++i) {
      const double want = l2_norm(reference(list[i], false));
      const double error = std::fabs(out.stats[2 * list.size() + i] - want) / want;
      worst = error > worst ? error : worst;
      CHECK(error <= 5e-7, "constant tensor %zu of dtype %d: norm off by %.3g relative", i, static_cast<int>(d), error);
    }
  }
  return worst;
}

// Vanishing gradients and overflow steps, the values whose chunks the fast rule cannot take: every
// dtype at magnitudes whose fp32 squares round in the subnormal range or underflow (1e-17 to fp32's
// subnormals), and at 1e25 and 3e37 (squares overflow fp32; the scaled sum is read before the checked
// rule); each tensor clean, with one NaN, a third NaN/Inf, or every element NaN or Inf, over several
// chunks and a ragged tail. Then constant tiny tensors (the
// worst case for running sums) through the scaled re-read: the norm as accurate as at ordinary
// magnitudes.
void check_magnitudes(std::mt19937_64& rng) {
  const DType dtypes[] = {DType::Float32, DType::BFloat16,     DType::Float16,
                          DType::Float64, DType::Float8E4M3FN, DType::Float8E5M2};
  const double magnitudes[] = {1e-12, 1e-17, 1e-20, 1e-30, 1e-40, 1e-44, 1e25, 3e37};
  std::normal_distribution<double> normal(0.0, 1.0);
  for (const DType d : dtypes) {
    std::vector<HostTensor> list;
    const int64_t per_chunk = kChunkBytes / element_size(d);
    for (const double magnitude : magnitudes) {
      for (int variant = 0; variant < 4; ++variant) {
        HostTensor t = make_tensor(rng, d, 2 * per_chunk + 37, (variant % 2) * element_size(d));
        for (int64_t k = 0; k < t.numel; ++k) {
          if (d == DType::Float8E4M3FN || d == DType::Float8E5M2) {
            t.data()[k] = static_cast<uint8_t>((rng() % 8) | (rng() % 2 ? 0x80 : 0));  // zero and subnormals
          } else {
            store(t, k, normal(rng) * magnitude);
          }
        }
        if (variant == 1) plant(t, per_chunk + 5, true);
        for (int64_t k = 0; k < t.numel && variant >= 2; ++k) {
          if (variant == 3 || rng() % 3 == 0) plant(t, k, rng() % 2 == 0);
        }
        list.push_back(std::move(t));
      }
    }
    check_scan("magnitudes", list, 3);
  }
  for (const DType d : {DType::Float32, DType::BFloat16}) {
    std::vector<HostTensor> list;
    for (const double v : {3e-20, 7.7e-38, 2e-39}) {
      HostTensor t = make_tensor(rng, d, 3 * kChunkBytes / element_size(d) + 17, 0);
      for (int64_t k = 0; k < t.numel; ++k) store(t, k, v);
      list.push_back(std::move(t));
    }
    const ScanOutput out = run_scan(list, ScanKind::Plain, 3);
    for (size_t i = 0; i < list.size(); ++i) {
      const double want = l2_norm(reference(list[i], false));
      const double error = std::fabs(out.stats[2 * list.size() + i] - want) / want;
      CHECK(error <= 5e-7, "constant tiny tensor %zu of dtype %d: norm off by %.3g relative", i, static_cast<int>(d),
            error);
    }
  }
}

// The small-tensor path (scan_cuda.cu): runs of up to four tensors of one dtype and at most 8 KiB,
// scanned eight lanes a tensor. Runs of every length, cut by a dtype change, a larger tensor, a
// float8 tensor and the shares' ends (several grid sizes); sizes from empty to the bound and one
// element past it; unaligned starts; NaN/Inf planted; tiny values (the scaled re-read), squares
// that overflow fp32, all-NaN and all-Inf tensors (the whole warp settles those). Each case says
// how many tensors took the path, so a change that bypasses it fails here.
void check_sub_warp_runs(std::mt19937_64& rng) {
  const DType dtypes[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16};
  const double magnitudes[] = {1.0, 1.0, 1.0, 1e-20, 1e-40, 3e37};
  std::normal_distribution<double> normal(0.0, 1.0);
  for (const DType d : dtypes) {
    const int64_t max_numel = kSubWarpMaxBytes / element_size(d);
    std::vector<HostTensor> list;
    for (int i = 0; i < 180; ++i) {
      if (rng() % 9 == 0) {  // a run breaker: another dtype, a larger tensor, or float8
        const int kind = static_cast<int>(rng() % 3);
        const DType other = kind == 0 ? dtypes[(static_cast<int>(d) + 1) % 4] : kind == 1 ? d : DType::Float8E4M3FN;
        list.push_back(
            make_tensor(rng, other, kind == 1 ? max_numel + 1 + static_cast<int64_t>(rng() % 3000) : 300, 0));
        continue;
      }
      const int64_t pick = static_cast<int64_t>(rng() % 10);
      const int64_t numel = pick == 0   ? 0
                            : pick == 1 ? max_numel
                            : pick == 2 ? static_cast<int64_t>(rng() % 20) + 1
                                        : static_cast<int64_t>(rng() % static_cast<uint64_t>(max_numel)) + 1;
      const size_t offset = rng() % 4 == 0 ? element_size(d) * (1 + rng() % 3) : 0;
      HostTensor t = make_tensor(rng, d, numel, offset);
      const double magnitude = magnitudes[rng() % 6];
      for (int64_t k = 0; k < numel && magnitude != 1.0; ++k) store(t, k, normal(rng) * magnitude);
      const int planted = static_cast<int>(rng() % 8);
      if (numel > 0 && planted == 0) plant(t, static_cast<int64_t>(rng() % static_cast<uint64_t>(numel)), true);
      if (numel > 0 && planted == 1) plant(t, static_cast<int64_t>(rng() % static_cast<uint64_t>(numel)), false);
      for (int64_t k = 0; k < numel && planted == 2; ++k) plant(t, k, true);   // all NaN
      for (int64_t k = 0; k < numel && planted == 3; ++k) plant(t, k, false);  // all one Inf
      list.push_back(std::move(t));
    }
    for (const int num_sms : {1, 3, 7}) {
      const uint64_t before = cuda_emulator::sub_warp_tensors.load();
      check_scan("small-tensor runs", list, num_sms);
      const uint64_t taken = cuda_emulator::sub_warp_tensors.load() - before;
      // check_scan runs the plain and fp16-range scans (and the order check) over the list: at least
      // half of its tensors in runs each time.
      CHECK(taken >= list.size(), "small-tensor runs of dtype %d on %d SMs: only %llu tensors took the path",
            static_cast<int>(d), num_sms, static_cast<unsigned long long>(taken));
    }
  }
}

// The difference scan (nanscan::scan_difference, the update watch's pass): the plan lists N befores,
// then N afters; the 2N results are the differences before - after (difference_of: rounded once in
// before's format), then the afters. Every pair of formats the op admits; the two tensors at
// independent offsets (their vectors do not line up, and the walk must not assume they do); sizes
// around the chunk; updates of 1e-3 of weights of 1 and of 1e-18 (the differences, ~1e-21, take the
// scaled re-read); NaN/Inf planted in either tensor (the differences' checked re-read); lists in all
// three blob placements, with the blocks in index order and shuffled (the same bits).
template <class Before>
HostTensor difference_of_pair(const HostTensor& before, const HostTensor& after) {
  HostTensor d{before.dtype, before.numel,
               AlignedBytes(static_cast<size_t>(before.numel) * sizeof(typename Before::Raw))};
  with_codec(after.dtype, [&](auto after_codec) {
    using After = decltype(after_codec);
    for (int64_t i = 0; i < before.numel; ++i) {
      const typename Before::Raw r = difference_of<Before, After>(raw_at<Before>(before, i), raw_at<After>(after, i));
      memcpy(d.data() + i * sizeof r, &r, sizeof r);
    }
  });
  return d;
}

// A weight of `before_dtype` and its value after a step, in `after_dtype`: after = before * (1 - u),
// u ~ 1e-3 * N(0, 1), rounded to after's format (float8: random codes, as make_tensor gives).
std::pair<HostTensor, HostTensor> make_update_pair(std::mt19937_64& rng, DType before_dtype, DType after_dtype,
                                                   int64_t numel, double magnitude) {
  const size_t before_offset = rng() % 3 == 0 ? element_size(before_dtype) * (1 + rng() % 3) : 0;
  const size_t after_offset = rng() % 3 == 0 ? element_size(after_dtype) * (1 + rng() % 7) : 0;
  HostTensor before = make_tensor(rng, before_dtype, numel, before_offset);
  HostTensor after = make_tensor(rng, after_dtype, numel, after_offset);
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t i = 0; i < numel; ++i) {
    const double w = normal(rng) * magnitude;
    store(before, i, w);
    if (after_dtype != DType::Float8E4M3FN && after_dtype != DType::Float8E5M2) {
      store(after, i, w * (1.0 - 1e-3 * normal(rng)));
    }
  }
  return {std::move(before), std::move(after)};
}

void expect_difference_matches(const char* what, const std::vector<HostTensor>& befores,
                               const std::vector<HostTensor>& afters, int num_sms) {
  std::vector<HostTensor> pairs_list, want;
  for (size_t i = 0; i < befores.size(); ++i) {
    want.push_back(befores[i].dtype == DType::Float64 ? difference_of_pair<Float64Codec>(befores[i], afters[i])
                                                      : difference_of_pair<Float32Codec>(befores[i], afters[i]));
  }
  for (const HostTensor& t : befores) pairs_list.push_back(t);
  for (const HostTensor& t : afters) {
    pairs_list.push_back(t);
    want.push_back(t);
  }
  const ScanOutput out = run_scan(pairs_list, ScanKind::Difference, num_sms);
  expect_matches(what, want, out, false);
  cuda_emulator::block_order_seed = 7 + static_cast<unsigned>(befores.size());
  const ScanOutput shuffled = run_scan(pairs_list, ScanKind::Difference, num_sms);
  cuda_emulator::block_order_seed = 0;
  CHECK(memcmp(out.stats.data(), shuffled.stats.data(), out.stats.size() * sizeof(double)) == 0 &&
            out.counts == shuffled.counts && memcmp(&out.total_norm, &shuffled.total_norm, sizeof(double)) == 0,
        "%s: a run with the blocks in another order differs in its bits", what);
}

void check_difference(std::mt19937_64& rng) {
  const std::pair<DType, DType> admitted[] = {
      {DType::Float32, DType::Float32},      {DType::Float32, DType::Float16},    {DType::Float32, DType::BFloat16},
      {DType::Float32, DType::Float8E4M3FN}, {DType::Float32, DType::Float8E5M2}, {DType::Float64, DType::Float64},
      {DType::Float64, DType::Float32},      {DType::Float64, DType::Float16},    {DType::Float64, DType::BFloat16},
      {DType::Float64, DType::Float8E4M3FN}, {DType::Float64, DType::Float8E5M2}};
  for (const auto& [before_dtype, after_dtype] : admitted) {
    for (double magnitude : {1.0, 1e-18}) {
      std::vector<HostTensor> befores, afters;
      for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{37}, int64_t{4095}, int64_t{8193}, int64_t{20000}}) {
        auto [b, a] = make_update_pair(rng, before_dtype, after_dtype, numel, magnitude);
        if (numel > 0 && rng() % 2 == 0) plant(rng() % 2 ? b : a, static_cast<int64_t>(rng() % numel), rng() % 2 == 0);
        befores.push_back(std::move(b));
        afters.push_back(std::move(a));
      }
      char what[96];
      std::snprintf(what, sizeof what, "difference %d-%d at %g", static_cast<int>(before_dtype),
                    static_cast<int>(after_dtype), magnitude);
      expect_difference_matches(what, befores, afters, 3);
    }
  }
  // Mixed pairs, always read from a device blob (the difference scan has no inline kernel): one upload
  // (240 tensors), and a blob over 32 KB (1,400 tensors: two uploads).
  for (int pairs : {120, 700}) {
    std::vector<HostTensor> befores, afters;
    for (int i = 0; i < pairs; ++i) {
      const auto& [before_dtype, after_dtype] = admitted[rng() % 11];
      auto [b, a] =
          make_update_pair(rng, before_dtype, after_dtype, static_cast<int64_t>(rng() % 3000), rng() % 4 ? 1.0 : 1e-18);
      if (b.numel > 0 && rng() % 5 == 0)
        plant(rng() % 2 ? b : a, static_cast<int64_t>(rng() % b.numel), rng() % 2 == 0);
      befores.push_back(std::move(b));
      afters.push_back(std::move(a));
    }
    expect_difference_matches(pairs == 120 ? "difference, one upload" : "difference, two uploads", befores, afters, 4);
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(1122);
  // First, while no kernel's occupancy is cached yet: a grid of 400 blocks over a device-memory list
  // (the last block then folds more than one block total per thread, as on an H100: 396 at 3 per SM).
  cuda_emulator::blocks_per_sm = 200;
  const std::vector<HostTensor> wide = random_list(rng, 3300, 1000, false);
  expect_matches("400-block grid", wide, run_scan(wide, ScanKind::Plain, 2), false);
  check_block_order_does_not_matter("400-block grid", wide, 2);
  cuda_emulator::blocks_per_sm = 1;
  // Parameter blob (<= 256 tensors; the checksum scan, which has no inline kernel, reads a device copy
  // of any list), two and five "multiprocessors"; 256 exactly, the longest it holds.
  check_scan("small list", random_list(rng, 60, 20000, true), 2);
  check_scan("small list, 5 SMs", random_list(rng, 200, 5000, true), 5);
  check_scan("full parameter blob", random_list(rng, 256, 3000, true), 3);
  // Device blob (over 256 tensors), written by the upload kernel: one past the parameters, and a list
  // whose blob takes more than one upload (32 KB each).
  check_scan("device list, 257 tensors", random_list(rng, 257, 3000, true), 3);
  check_scan("device list", random_list(rng, 1700, 400, true), 4);
  // Fold tree: a tensor met by a few warps (one group), by over 32 (two levels), and by over 1024 (over
  // 32 groups): a grid of one block per "multiprocessor", about a chunk per warp.
  for (int64_t chunks : {3, 40, 1100}) {
    std::vector<HostTensor> list;
    list.push_back(make_tensor(rng, DType::Float8E4M3FN, 0, 0));
    list.push_back(make_tensor(rng, DType::Float8E4M3FN, chunks * 32768 - 5, 0));
    plant(list.back(), (chunks - 1) * 32768 + 3, true);
    list.push_back(make_tensor(rng, DType::Float32, 2 * 8192 + 1, 0));
    const int num_sms = static_cast<int>(chunks / 8 + 1);
    const int32_t met_by = warps_meeting(list, 1, num_sms);
    CHECK(met_by >= (chunks > 1024 ? 1025 : chunks > 32 ? 33 : 2), "the fold-tree case meets only %d warps", met_by);
    check_scan("fold tree", list, num_sms);
  }
  check_misaligned_starts(rng);
  check_magnitudes(rng);
  check_sub_warp_runs(rng);
  const double worst = check_accuracy_on_constant_tensors(rng);
  check_workspace_guard(rng);
  check_placement_guard(rng);
  check_scan_into_columns(rng);
  check_unscale(rng, 3);
  check_scale(rng, 3, 50);
  check_scale(rng, 2, 1600);  // device blob
  check_difference(rng);
  if (nanscan_test::failures == 0) {
    std::printf("emulated kernels: all checks passed (worst norm error on constant tensors: %.3g)\n", worst);
  }
  return nanscan_test::failures == 0 ? 0 : 1;
}
