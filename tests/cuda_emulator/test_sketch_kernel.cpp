// Runs the CUDA update sketch (csrc/cuda/sketch_cuda.cu) on CPU threads (include/cuda_runtime.h) and
// checks every bucket and sum of squares against common/sketch_rules.h applied element by element,
// each bucket's terms summed exactly (long double, then compared within float64's reordering bound):
// every dtype, tensors of at most k elements (their values), across the block and the unit, both
// kernel shapes (k up to 1024, and 4096), grids with fewer warps than units, NaN and Inf planted, and
// the grid's blocks run in a shuffled order. Built and run by tests/test_cuda_emulated.py.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

#include "../../csrc/cuda/sketch_cuda.h"
#include "../cpp/check.h"

using namespace nanscan;
using namespace nanscan::cuda;

namespace {

struct HostTensor {
  DType dtype;
  int64_t numel;
  std::vector<unsigned char> bytes;
};

template <class Codec>
double value_at(const HostTensor& t, int64_t e) {
  typename Codec::Raw raw;
  memcpy(&raw, t.bytes.data() + e * sizeof raw, sizeof raw);
  return static_cast<double>(Codec::decode(raw));
}

double value_at(const HostTensor& t, int64_t e) {
  switch (t.dtype) {
    case DType::Float32: return value_at<Float32Codec>(t, e);
    case DType::Float64: return value_at<Float64Codec>(t, e);
    case DType::Float16: return value_at<Float16Codec>(t, e);
    case DType::BFloat16: return value_at<BFloat16Codec>(t, e);
    case DType::Float8E4M3FN: return value_at<Float8E4M3FNCodec>(t, e);
    case DType::Float8E5M2: return value_at<Float8E5M2Codec>(t, e);
  }
  return 0.0;
}

// Random values of each dtype: normal ones for float32/float64 (with a NaN and an Inf planted when
// asked), random finite bit patterns for the narrow formats (the top exponent bit cleared).
HostTensor make_tensor(std::mt19937_64& rng, DType dtype, int64_t numel, bool plant) {
  HostTensor t{dtype, numel, std::vector<unsigned char>(static_cast<size_t>(numel * element_size(dtype)))};
  std::normal_distribution<double> normal(0.0, 1.0);
  for (int64_t e = 0; e < numel; ++e) {
    unsigned char* at = t.bytes.data() + e * element_size(dtype);
    if (dtype == DType::Float32) {
      const auto v = static_cast<float>(normal(rng));
      memcpy(at, &v, 4);
    } else if (dtype == DType::Float64) {
      const double v = normal(rng);
      memcpy(at, &v, 8);
    } else {
      for (int b = 0; b < element_size(dtype); ++b) at[b] = static_cast<unsigned char>(rng());
      at[element_size(dtype) - 1] &= 0x77;  // sign and the top exponent bit cleared: finite
    }
  }
  if (plant && dtype == DType::Float32 && numel > 10) {
    const float nan = NAN, inf = INFINITY;
    memcpy(t.bytes.data() + 4 * (numel / 3), &nan, 4);
    memcpy(t.bytes.data() + 4 * (numel - 2), &inf, 4);
  }
  return t;
}

struct Reference {
  std::vector<long double> sums;     // per bucket, exactly enough for float64 terms of one order of magnitude
  std::vector<long double> squares;  // per bucket: the sum of its terms' squares (the reorder bound's scale)
  std::vector<int64_t> terms;
  std::vector<bool> nan, pos_inf, neg_inf;
};

Reference reference_of(const HostTensor& t, int64_t k, uint32_t seed, uint32_t index) {
  const int64_t buckets = sketch_buckets_of(t.numel, k);
  Reference r{std::vector<long double>(buckets), std::vector<long double>(buckets), std::vector<int64_t>(buckets),
              std::vector<bool>(buckets),        std::vector<bool>(buckets),        std::vector<bool>(buckets)};
  const uint32_t tensor_seed = sketch_tensor_seed(seed, index);
  for (int64_t e = 0; e < t.numel; ++e) {
    double v = value_at(t, e);
    int64_t bucket = e;
    if (t.numel > k) {
      const SketchBlock block = sketch_block(tensor_seed, static_cast<uint64_t>(e / kSketchBlock), k);
      bucket = (block.offset + e % kSketchBlock) & (k - 1);
      v *= sketch_sign(block.signs, e % kSketchBlock);
    }
    if (std::isnan(v)) {
      r.nan[bucket] = true;
    } else if (std::isinf(v)) {
      (v > 0 ? r.pos_inf : r.neg_inf)[bucket] = true;
    } else {
      r.sums[bucket] += v;
      r.squares[bucket] += static_cast<long double>(v) * v;
      ++r.terms[bucket];
    }
  }
  return r;
}

void expect_matches(const char* what, const std::vector<HostTensor>& list, int64_t k, uint32_t seed, int num_sms) {
  std::vector<TensorArg> args;
  for (const HostTensor& t : list) args.push_back(TensorArg{t.bytes.data(), t.numel, t.dtype});
  const SketchTable table = sketch_table(args.data(), static_cast<int64_t>(args.size()), k);
  std::vector<double> sketches(static_cast<size_t>(table.buckets) + 1, -7.0);  // one guard past the end
  std::vector<double> sumsq(list.size() + 1, -7.0);
  CHECK(sketch(table, table.tensors.data(), k, seed, sketches.data(), sumsq.data(), num_sms, nullptr) == cudaSuccess,
        "%s: launch", what);
  CHECK(sketches.back() == -7.0 && sumsq.back() == -7.0, "%s: written past the outputs", what);
  for (size_t i = 0; i < list.size(); ++i) {
    const Reference r = reference_of(list[i], k, seed, static_cast<uint32_t>(i));
    const double* got = sketches.data() + table.tensors[i].out_offset;
    long double squares = 0;
    bool nan = false, inf = false;
    for (size_t b = 0; b < r.sums.size(); ++b) {
      const char* bad = nullptr;
      if (r.nan[b] || (r.pos_inf[b] && r.neg_inf[b])) {
        bad = std::isnan(got[b]) ? nullptr : "NaN expected";
      } else if (r.pos_inf[b] || r.neg_inf[b]) {
        bad = got[b] == (r.pos_inf[b] ? INFINITY : -INFINITY) ? nullptr : "Inf expected";
      } else {
        // Two float64 sums of the same m terms in any order lie within 2 (m - 1) 2^-53 sqrt(m sum x^2)
        // of each other; a bucket of one term is that term exactly.
        const auto m = static_cast<double>(r.terms[b]);
        const double bound = 2.0 * (m > 1 ? m - 1 : 0) * 0x1p-53 * std::sqrt(m * static_cast<double>(r.squares[b]));
        bad = std::fabs(got[b] - static_cast<double>(r.sums[b])) <= bound ? nullptr : "sum differs";
      }
      CHECK(bad == nullptr, "%s: tensor %zu (dtype %d, %lld elements), bucket %zu: %s: %.17g, want %.17Lg", what, i,
            static_cast<int>(list[i].dtype), static_cast<long long>(list[i].numel), b, bad, got[b], r.sums[b]);
    }
    for (int64_t e = 0; e < list[i].numel; ++e) {
      const double v = value_at(list[i], e);
      nan |= std::isnan(v);
      inf |= std::isinf(v);
      squares += static_cast<long double>(v) * v;
    }
    if (nan) {
      CHECK(std::isnan(sumsq[i]), "%s: tensor %zu: sum of squares %g, want NaN", what, i, sumsq[i]);
    } else if (inf) {
      CHECK(sumsq[i] == INFINITY, "%s: tensor %zu: sum of squares %g, want Inf", what, i, sumsq[i]);
    } else {
      CHECK(std::fabs(sumsq[i] - static_cast<double>(squares)) <= 1e-12 * static_cast<double>(squares),
            "%s: tensor %zu: sum of squares %.17g, want %.17Lg", what, i, sumsq[i], squares);
    }
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(2026);
  const DType dtypes[] = {DType::Float32,  DType::Float64,      DType::Float16,
                          DType::BFloat16, DType::Float8E4M3FN, DType::Float8E5M2};
  for (int64_t k : {64, 1024, 4096}) {
    // Around the bucket count, the block and the unit; every dtype.
    std::vector<HostTensor> list;
    for (int64_t numel : {int64_t{0}, int64_t{1}, int64_t{63}, int64_t{64}, int64_t{65}, k, k + 1,
                          kSketchUnitElements + 3, 3 * kSketchUnitElements + 70}) {
      for (DType d : dtypes) list.push_back(make_tensor(rng, d, numel, false));
    }
    list.push_back(make_tensor(rng, DType::Float32, 2 * kSketchUnitElements + 5, true));  // NaN and Inf
    list.push_back(make_tensor(rng, DType::Float32, 40, true));
    char what[64];
    std::snprintf(what, sizeof what, "k=%lld, 2 SMs", static_cast<long long>(k));
    expect_matches(what, list, k, 7, 2);
    std::snprintf(what, sizeof what, "k=%lld, 1 SM, shuffled blocks", static_cast<long long>(k));
    cuda_emulator::block_order_seed = 99;
    expect_matches(what, list, k, 0xffffffffu, 1);
    cuda_emulator::block_order_seed = 0;
  }
  // Refused: a bucket count the rule does not take, an empty list.
  std::vector<HostTensor> one{make_tensor(rng, DType::Float32, 100, false)};
  const TensorArg arg{one[0].bytes.data(), 100, DType::Float32};
  const SketchTable table = sketch_table(&arg, 1, 96);
  std::vector<double> out(200), sq(1);
  CHECK(sketch(table, table.tensors.data(), 96, 0, out.data(), sq.data(), 1, nullptr) == cudaErrorInvalidValue,
        "96 buckets accepted");
  if (nanscan_test::failures == 0) std::printf("emulated sketch kernel: all checks passed\n");
  return nanscan_test::failures == 0 ? 0 : 1;
}
