// CPU checks of the CUDA backend's list arithmetic (csrc/cuda/list_plan.h), which CI cannot run on a
// GPU: chunk spans cover every element exactly once, empty tensors get one empty chunk, the 32-probe
// search finds the same tensor as the binary search, and the fold
// tree, driven by the same finish_chunk() as the kernel with a sequential stand-in for the warps'
// atomics, gives every tensor exactly one result, equal to the combine of its chunks, bit-identical
// whatever the order in which chunks arrive. Built and run by tests/test_list_plan.py.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <vector>

#include "../../csrc/common/scan_rules.h"
#include "../../csrc/cuda/list_plan.h"
#include "check.h"

using nanscan::DType;
using nanscan::TensorStats;
using namespace nanscan::cuda;

namespace {


// A list with sizes around chunk boundaries, empty tensors, and every dtype.
std::vector<TensorArg> random_list(std::mt19937_64& rng, int n, int64_t max_chunks_per_tensor) {
  const DType dtypes[] = {DType::Float32, DType::Float64, DType::Float16, DType::BFloat16, DType::Float8E4M3FN,
                          DType::Float8E5M2};
  std::vector<TensorArg> list;
  for (int i = 0; i < n; ++i) {
    const DType d = dtypes[rng() % 6];
    const int64_t per = chunk_elements(d);
    int64_t numel = 0;
    switch (rng() % 5) {
      case 0: numel = 0; break;
      case 1: numel = 1 + static_cast<int64_t>(rng() % 1000); break;
      case 2: numel = per * (1 + static_cast<int64_t>(rng() % 3)) + static_cast<int64_t>(rng() % 3) - 1; break;
      default: numel = static_cast<int64_t>(rng() % static_cast<uint64_t>(per * max_chunks_per_tensor)) + 1; break;
    }
    list.push_back(TensorArg{reinterpret_cast<const void*>(static_cast<uintptr_t>(0x10000 * (i + 1))), numel, d});
  }
  return list;
}

void check_spans(const std::vector<TensorArg>& list) {
  ListPlan plan;
  CHECK(plan.build(list.data(), static_cast<int64_t>(list.size())), "build failed");
  const ListView view = plan.view();
  CHECK(view.num_tensors == static_cast<int32_t>(list.size()), "num_tensors");
  CHECK(plan.bytes() == blob_bytes(view.num_tensors) && plan.bytes() % 16 == 0, "blob size");
  int64_t expected_chunks = 0;
  for (const TensorArg& t : list) expected_chunks += num_chunks(t.numel, t.dtype);
  CHECK(view.num_chunks() == expected_chunks && plan.num_chunks() == expected_chunks, "chunk count");
  std::vector<int64_t> covered(list.size(), 0);  // elements covered so far, in order
  std::vector<int32_t> visits(list.size(), 0);
  for (int32_t c = 0; c < view.num_chunks(); ++c) {
    const ChunkSpan s = view.span(c);
    // The kernel's 32-probe search for device-memory tables, its warp emulated lane by lane.
    const int32_t wide = view.find_tensor_wide([&](int32_t lo, int32_t step, int32_t hi) {
      int32_t count = 0;
      for (int32_t lane = 0; lane < kFoldFanIn; ++lane) {
        const int64_t probe = lo + static_cast<int64_t>(lane) * step;
        count += probe <= hi && view.chunk_begin[probe] <= c;
      }
      return count;
    });
    CHECK(wide == s.tensor, "chunk %d: 32-way search found tensor %d, binary search %d", c, wide, s.tensor);
    const TensorArg& t = list[s.tensor];
    CHECK(view.data[s.tensor] == t.data && view.numel[s.tensor] == t.numel && view.dtype_of(s.tensor) == t.dtype,
          "blob round trip for tensor %d", s.tensor);
    CHECK(s.begin == covered[s.tensor], "chunk %d of tensor %d starts at %lld, not %lld", c, s.tensor,
          static_cast<long long>(s.begin), static_cast<long long>(covered[s.tensor]));
    CHECK(s.end >= s.begin && s.end - s.begin <= chunk_elements(t.dtype) && s.end <= t.numel, "chunk %d bounds", c);
    CHECK(t.numel == 0 || s.end > s.begin, "chunk %d of a non-empty tensor is empty", c);
    covered[s.tensor] = s.end;
    ++visits[s.tensor];
  }
  for (size_t i = 0; i < list.size(); ++i) {
    CHECK(covered[i] == list[i].numel, "tensor %zu covered %lld of %lld", i, static_cast<long long>(covered[i]),
          static_cast<long long>(list[i].numel));
    CHECK(visits[i] >= 1, "tensor %zu never visited", i);
  }
}

// Sequential stand-in for the kernel's WarpSync: slots and counters in vectors, and a check that a
// fold reads only slots whose partials are complete.
struct SequentialSync {
  std::vector<TensorStats> partials;
  std::vector<bool> written;
  std::vector<uint32_t> counters;
  std::map<int32_t, TensorStats> results;
  int32_t result_writes = 0;

  explicit SequentialSync(int32_t chunks) : partials(chunks), written(chunks, false), counters(chunks + 1, 0) {}

  void write_result(int32_t t, const TensorStats& s) {
    ++result_writes;
    CHECK(results.count(t) == 0, "tensor %d written twice", t);
    results[t] = s;
  }
  bool arrive_last(int32_t slot, const TensorStats& s, int32_t counter, int32_t expected) {
    CHECK(slot >= 0 && slot < static_cast<int32_t>(partials.size()), "slot %d out of range", slot);
    CHECK(counter >= 0 && counter < static_cast<int32_t>(counters.size()), "counter %d out of range", counter);
    partials[slot] = s;
    written[slot] = true;
    const uint32_t before = counters[counter]++;
    CHECK(before < static_cast<uint32_t>(expected), "counter %d passed %d arrivals", counter, expected);
    return before == static_cast<uint32_t>(expected - 1);
  }
  // The kernel's order: lane k combines items k, k + 32, ..., then a butterfly; emulated exactly.
  TensorStats fold(int32_t first, int32_t count, int32_t stride) {
    TensorStats lanes[kFoldFanIn];
    for (int lane = 0; lane < kFoldFanIn; ++lane) {
      lanes[lane] = nanscan::empty_stats();
      for (int32_t k = lane; k < count; k += kFoldFanIn) {
        const int32_t slot = first + k * stride;
        CHECK(written[slot], "fold reads slot %d before it was written", slot);
        lanes[lane] = nanscan::combine(lanes[lane], partials[slot]);
      }
    }
    for (int offset = kFoldFanIn / 2; offset > 0; offset /= 2) {
      TensorStats next[kFoldFanIn];
      for (int lane = 0; lane < kFoldFanIn; ++lane) next[lane] = nanscan::combine(lanes[lane], lanes[lane ^ offset]);
      std::copy(next, next + kFoldFanIn, lanes);
    }
    return lanes[0];
  }
};

// A chunk's stand-in statistics: distinct, with a fractional sum so that a different combine order
// would change the bits.
TensorStats chunk_stats(int32_t c) {
  TensorStats s = nanscan::empty_stats();
  s.nan_count = 1;
  s.inf_count = c;
  s.min = c;
  s.max = c;
  s.sumsq = 1.0 / (3.0 + c);
  return s;
}

void check_fold_tree(const std::vector<TensorArg>& list, std::mt19937_64& rng) {
  ListPlan plan;
  CHECK(plan.build(list.data(), static_cast<int64_t>(list.size())), "build failed");
  const ListView view = plan.view();
  std::vector<int32_t> order(view.num_chunks());
  for (int32_t c = 0; c < view.num_chunks(); ++c) order[c] = c;
  std::map<int32_t, TensorStats> first_results;
  for (int round = 0; round < 3; ++round) {
    std::shuffle(order.begin(), order.end(), rng);
    SequentialSync sync(view.num_chunks());
    for (int32_t c : order) finish_chunk(view, view.find_tensor(c), c, chunk_stats(c), sync);
    CHECK(sync.result_writes == view.num_tensors, "%d results for %d tensors", sync.result_writes, view.num_tensors);
    for (int32_t t = 0; t < view.num_tensors; ++t) {
      const TensorStats& got = sync.results[t];
      const int32_t n = view.chunks_of(t), b = view.chunk_begin[t];
      CHECK(got.nan_count == n, "tensor %d folded %lld of its %d chunks", t, static_cast<long long>(got.nan_count), n);
      CHECK(got.min == b && got.max == b + n - 1, "tensor %d min/max %g %g", t, got.min, got.max);
      double sum = 0;
      for (int32_t c = b; c < b + n; ++c) sum += 1.0 / (3.0 + c);
      CHECK(std::abs(got.sumsq - sum) <= 1e-12 * sum, "tensor %d sum %.17g, want %.17g", t, got.sumsq, sum);
      if (round == 0) {
        first_results[t] = got;
      } else {
        CHECK(got.sumsq == first_results[t].sumsq, "tensor %d: result depends on arrival order", t);
      }
    }
  }
}

}  // namespace

int main() {
  std::mt19937_64 rng(20261122);
  for (int trial = 0; trial < 200; ++trial) {
    const auto list = random_list(rng, 1 + static_cast<int>(rng() % 300), trial % 10 == 0 ? 3000 : 40);
    check_spans(list);
    check_fold_tree(list, rng);
  }
  // Tensors of exactly 1, 32, 33, 1024 and 1025 chunks: the edges of the tree's two levels.
  for (int64_t chunks : {1, 2, 31, 32, 33, 64, 65, 1024, 1025, 5000}) {
    const std::vector<TensorArg> list{{nullptr, 0, DType::Float32},
                                      {nullptr, chunks * chunk_elements(DType::Float32), DType::Float32},
                                      {nullptr, 7, DType::BFloat16}};
    check_spans(list);
    check_fold_tree(list, rng);
  }
  // 10,000 tensors (three rounds of the 32-probe search), empty ones among them.
  std::vector<TensorArg> many = random_list(rng, 10'000, 2);
  check_spans(many);
  check_fold_tree(many, rng);
  // A tensor over 2^31 elements: spans are 64-bit.
  const std::vector<TensorArg> huge{{nullptr, (int64_t{1} << 31) + 1000, DType::Float8E4M3FN}};
  check_spans(huge);
  // The limit on chunks is reported, not overflowed.
  ListPlan plan;
  const std::vector<TensorArg> too_many{{nullptr, int64_t{1} << 62, DType::Float32}};
  CHECK(!plan.build(too_many.data(), 1), "a list of 2^47 chunks was accepted");
  CHECK(!plan.build(too_many.data(), 0), "an empty list was accepted");
  if (nanscan_test::failures == 0) std::printf("list_plan: all checks passed\n");
  return nanscan_test::failures == 0 ? 0 : 1;
}
