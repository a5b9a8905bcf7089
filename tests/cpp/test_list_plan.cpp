// CPU checks of the CUDA backend's list arithmetic (csrc/cuda/list_plan.h), which CI cannot run on a
// GPU: the warps' shares cover every chunk of every tensor exactly once and in list order, every
// element exactly once, the (tensor, warp) slots t + w never collide, the 32-probe search finds the
// same tensor as the binary search, and the fold tree, driven by the same finish_share() as the kernel
// with a sequential stand-in for the warps' atomics, gives every tensor exactly one result, equal to
// the combine of its parts, bit-identical whatever the order in which the parts arrive. Built and run
// by tests/test_list_plan.py.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <random>
#include <set>
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
  const DType dtypes[] = {DType::Float32,  DType::Float64,      DType::Float16,
                          DType::BFloat16, DType::Float8E4M3FN, DType::Float8E5M2};
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

ListPlan plan_of(const std::vector<TensorArg>& list) {
  ListPlan plan;
  CHECK(plan.build(list.data(), static_cast<int64_t>(list.size())), "build failed");
  return plan;
}

// The kernel's 32-probe search for device-memory tables, its warp emulated lane by lane.
int32_t find_tensor_32_probes(const ListView& view, int64_t cost) {
  return view.find_tensor_wide([&](int32_t lo, int32_t step, int32_t hi) {
    int32_t count = 0;
    for (int32_t lane = 0; lane < kFoldFanIn; ++lane) {
      const int64_t probe = lo + static_cast<int64_t>(lane) * step;
      count += probe <= hi && view.cost_begin[probe] <= cost;
    }
    return count;
  });
}

// One warp's part of one tensor, as walk_share() hands it out.
struct Part {
  int32_t warp;
  int32_t tensor;
  ChunkRange chunks;
};

// Every warp's walk, in warp order, with the kernel's searches.
std::vector<Part> walk_all(const ListView& view, const Shares& shares) {
  std::vector<Part> parts;
  for (int32_t w = 0; w < shares.warps; ++w) {
    const int64_t begin = shares.begin(w);
    const int32_t first = view.find_tensor(begin);
    CHECK(find_tensor_32_probes(view, begin) == first, "warp %d: the 32-probe search and the binary search differ", w);
    CHECK(shares.owner(begin) == w && shares.owner(shares.begin(w + 1) - 1) == w,
          "warp %d: owner() disagrees with begin()", w);
    walk_share(view, shares, w, first, [&](int32_t t, ChunkRange c, int64_t) { parts.push_back(Part{w, t, c}); });
  }
  return parts;
}

// The small-tensor path's runs, found as the kernel finds them (sub_warp_run at each tensor a warp's
// walk reaches outside a run): at most kSubWarpTensors tensors, consecutive, of the first one's dtype
// (never float8), each fitting kSubWarpMaxBytes, each met by this warp alone (the run's warp writes
// their results) and visited by it with its one chunk; and maximal (the tensor after a short run
// breaks one of those rules). Returns how many tensors the runs of length >= 2 held.
int64_t check_sub_warp_runs(const std::vector<TensorArg>& list, int64_t warps) {
  const ListPlan plan = plan_of(list);
  const ListView view = plan.view();
  const Shares shares = Shares::of(plan.total_cost(), warps);
  int64_t in_runs = 0;
  for (int32_t w = 0; w < shares.warps; ++w) {
    int32_t left = 0;
    walk_share(view, shares, w, view.find_tensor(shares.begin(w)), [&](int32_t t, ChunkRange c, int64_t share_end) {
      CHECK(share_end == shares.begin(w + 1), "warp %d: the walk's share end", w);
      if (left > 0) {
        --left;
        return;
      }
      const int32_t run = view.sub_warp_run(t, share_end, kSubWarpTensors);
      CHECK(run >= 0 && run <= kSubWarpTensors, "run of %d", run);
      for (int32_t k = 0; k < run; ++k) {
        const int32_t u = t + k;
        const WarpRange met = shares.meeting(view, u);
        CHECK(met.first == w && met.last == w, "tensor %d of a run of warp %d is met by warps %d..%d", u, w, met.first,
              met.last);
        CHECK(view.dtype_of(u) == view.dtype_of(t) && fits_sub_warp(view.numel[u], view.dtype_of(u)) &&
                  element_size(view.dtype_of(u)) >= 2 && view.chunks_of(u) == 1,
              "tensor %d does not belong in a run", u);
      }
      if (run > 0) CHECK(c.begin == 0 && c.end == 1, "the run's first tensor %d is not whole in warp %d's share", t, w);
      const int32_t next = t + run;
      if (run < kSubWarpTensors && next < view.num_tensors && run > 0) {
        CHECK(view.cost_begin[next] >= share_end || view.dtype_of(next) != view.dtype_of(t) ||
                  !fits_sub_warp(view.numel[next], view.dtype_of(next)),
              "the run at tensor %d stops short at %d", t, next);
      }
      if (run >= 2) {
        left = run - 1;
        in_runs += run;
      }
    });
  }
  return in_runs;
}

void check_blob(const std::vector<TensorArg>& list, const ListPlan& plan) {
  const ListView view = plan.view();
  CHECK(view.num_tensors == static_cast<int32_t>(list.size()), "num_tensors");
  CHECK(plan.bytes() == blob_bytes(view.num_tensors) && plan.bytes() % 16 == 0, "blob size");
  int64_t chunks = 0, cost = 0;
  for (size_t i = 0; i < list.size(); ++i) {
    const TensorArg& t = list[i];
    CHECK(view.data[i] == t.data && view.numel[i] == t.numel && view.dtype_of(static_cast<int32_t>(i)) == t.dtype,
          "blob round trip for tensor %zu", i);
    CHECK(view.cost_begin[i] == cost, "tensor %zu: cost_begin %lld, want %lld", i, (long long)view.cost_begin[i],
          (long long)cost);
    chunks += num_chunks(t.numel, t.dtype);
    cost += tensor_cost(t.numel, t.dtype);
    CHECK(view.cost_begin[i + 1] > view.cost_begin[i], "tensor %zu costs nothing", i);
  }
  CHECK(plan.num_chunks() == chunks && plan.total_cost() == cost && view.total_cost() == cost, "chunk or cost totals");
}

// Shares of `warps` warps: every chunk scanned exactly once by the warp whose share holds its start,
// in list order across warps; every element once; each tensor met by exactly the warps finish_share()
// expects, each once; the slots t + w distinct and inside the workspace.
void check_shares(const std::vector<TensorArg>& list, int64_t warps) {
  const ListPlan plan = plan_of(list);
  const ListView view = plan.view();
  const Shares shares = Shares::of(plan.total_cost(), warps);
  CHECK(shares.warps >= 1 && shares.warps <= warps && shares.warps <= plan.total_cost(), "active warps %d",
        shares.warps);
  CHECK(shares.begin(0) == 0 && shares.begin(shares.warps) == plan.total_cost(), "shares do not tile the cost");
  const std::vector<Part> parts = walk_all(view, shares);
  std::vector<int64_t> next_chunk(list.size(), 0), next_element(list.size(), 0);
  std::vector<std::vector<int32_t>> met_by(list.size());
  std::set<int64_t> slots;
  int32_t last_tensor = 0;
  for (const Part& part : parts) {
    const int32_t t = part.tensor;
    CHECK(t >= last_tensor, "warp %d goes back to tensor %d", part.warp, t);
    last_tensor = t;
    CHECK(part.chunks.begin == next_chunk[t], "tensor %d: warp %d starts at chunk %lld, not %lld", t, part.warp,
          (long long)part.chunks.begin, (long long)next_chunk[t]);
    CHECK(part.chunks.end >= part.chunks.begin && part.chunks.end <= view.chunks_of(t), "tensor %d: chunk range", t);
    for (int64_t j = part.chunks.begin; j < part.chunks.end; ++j) {
      const int64_t start = view.cost_begin[t] + j * kFullChunkCost;
      CHECK(shares.begin(part.warp) <= start && start < shares.begin(part.warp + 1),
            "chunk %lld of tensor %d outside warp %d's share", (long long)j, t, part.warp);
    }
    next_chunk[t] = part.chunks.end;
    const ElementRange e = view.elements_of(t, part.chunks);
    CHECK(e.begin == next_element[t] && e.end >= e.begin, "tensor %d: warp %d's elements start at %lld, not %lld", t,
          part.warp, (long long)e.begin, (long long)next_element[t]);
    next_element[t] = e.end;
    met_by[t].push_back(part.warp);
    CHECK(slots.insert(static_cast<int64_t>(t) + part.warp).second, "slot %lld used twice", (long long)t + part.warp);
    CHECK(static_cast<int64_t>(t) + part.warp < shares.fold_slots(view.num_tensors), "slot past the workspace");
  }
  for (size_t i = 0; i < list.size(); ++i) {
    const auto t = static_cast<int32_t>(i);
    CHECK(next_chunk[i] == view.chunks_of(t), "tensor %zu: %lld of %lld chunks scanned", i, (long long)next_chunk[i],
          (long long)view.chunks_of(t));
    CHECK(next_element[i] == list[i].numel, "tensor %zu: %lld of %lld elements", i, (long long)next_element[i],
          (long long)list[i].numel);
    // The owners of its first and last chunk starts, and every warp between them.
    const int32_t first = shares.owner(view.cost_begin[t]);
    const int32_t last = shares.owner(view.cost_begin[t] + (view.chunks_of(t) - 1) * kFullChunkCost);
    const WarpRange met = shares.meeting(view, t);
    CHECK(met.first == first && met.last == last, "tensor %zu: meeting() gives warps %d..%d, not %d..%d", i, met.first,
          met.last, first, last);
    CHECK(view.chunks_of(t) > 1 || first == last, "tensor %zu of one chunk is met by %d warps", i, last - first + 1);
    CHECK(static_cast<int32_t>(met_by[i].size()) == last - first + 1, "tensor %zu: met by %zu warps, expected %d", i,
          met_by[i].size(), last - first + 1);
    for (size_t k = 0; k < met_by[i].size(); ++k) {
      CHECK(met_by[i][k] == first + static_cast<int32_t>(k), "tensor %zu: part %zu from warp %d", i, k, met_by[i][k]);
    }
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

  explicit SequentialSync(int64_t slots) : partials(slots), written(slots, false), counters(slots + 1, 0) {}

  void write_result(int32_t t, const TensorStats& s) {
    ++result_writes;
    CHECK(results.count(t) == 0, "tensor %d written twice", t);
    results[t] = s;
  }
  bool arrive_last(int64_t slot, const TensorStats& s, int64_t counter, int32_t expected) {
    CHECK(slot >= 0 && slot < static_cast<int64_t>(partials.size()), "slot %lld out of range", (long long)slot);
    CHECK(counter >= 0 && counter < static_cast<int64_t>(partials.size()), "counter %lld out of range",
          (long long)counter);
    partials[slot] = s;
    written[slot] = true;
    const uint32_t before = counters[counter]++;
    CHECK(before < static_cast<uint32_t>(expected), "counter %lld passed %d arrivals", (long long)counter, expected);
    return before == static_cast<uint32_t>(expected - 1);
  }
  // The kernel's order: lane k combines items k, k + 32, ..., then a butterfly; emulated exactly.
  TensorStats fold(int64_t first, int32_t count, int32_t stride) {
    TensorStats lanes[kFoldFanIn];
    for (int lane = 0; lane < kFoldFanIn; ++lane) {
      lanes[lane] = nanscan::empty_stats();
      for (int32_t k = lane; k < count; k += kFoldFanIn) {
        const int64_t slot = first + static_cast<int64_t>(k) * stride;
        CHECK(written[slot], "fold reads slot %lld before it was written", (long long)slot);
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

// A part's stand-in statistics: its chunk count as nan_count, its chunk range as min/max (empty parts
// leave them alone, as an empty scan does), and a fractional sum so that a different combine order
// would change the bits.
TensorStats part_stats(const Part& p) {
  TensorStats s = nanscan::empty_stats();
  s.nan_count = p.chunks.end - p.chunks.begin;
  if (s.nan_count > 0) {
    s.min = static_cast<double>(p.chunks.begin);
    s.max = static_cast<double>(p.chunks.end - 1);
  }
  s.sumsq = 1.0 / (3.0 + p.warp);
  return s;
}

void check_fold_tree(const std::vector<TensorArg>& list, int64_t warps, std::mt19937_64& rng) {
  const ListPlan plan = plan_of(list);
  const ListView view = plan.view();
  const Shares shares = Shares::of(plan.total_cost(), warps);
  std::vector<Part> parts = walk_all(view, shares);
  std::map<int32_t, TensorStats> first_results;
  for (int round = 0; round < 3; ++round) {
    std::shuffle(parts.begin(), parts.end(), rng);
    SequentialSync sync(shares.fold_slots(view.num_tensors));
    for (const Part& p : parts) finish_share(view, shares, p.tensor, p.warp, part_stats(p), sync);
    CHECK(sync.result_writes == view.num_tensors, "%d results for %d tensors", sync.result_writes, view.num_tensors);
    for (int32_t t = 0; t < view.num_tensors; ++t) {
      const TensorStats& got = sync.results[t];
      const int64_t n = view.chunks_of(t);
      CHECK(got.nan_count == n, "tensor %d folded %lld of its %lld chunks", t, (long long)got.nan_count, (long long)n);
      CHECK(got.min == 0 && got.max == static_cast<double>(n - 1), "tensor %d min/max %g %g", t, got.min, got.max);
      const WarpRange met = shares.meeting(view, t);
      double sum = 0;
      for (int32_t w = met.first; w <= met.last; ++w) sum += 1.0 / (3.0 + w);
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
  const int64_t warp_counts[] = {1, 2, 7, 64, 1000, 4224};
  for (int trial = 0; trial < 120; ++trial) {
    const auto list = random_list(rng, 1 + static_cast<int>(rng() % 300), trial % 10 == 0 ? 3000 : 40);
    check_blob(list, plan_of(list));
    const int64_t warps = warp_counts[trial % 6];
    check_shares(list, warps);
    check_fold_tree(list, warps, rng);
    check_sub_warp_runs(list, warps);
  }
  // Runs of one dtype: most tensors in runs, cut by the shares (many warps) or not (one).
  for (const int64_t warps : {1, 5, 300}) {
    std::vector<TensorArg> runs;
    for (int i = 0; i < 400; ++i) {
      const DType d = (i / 9) % 2 == 0 ? DType::BFloat16 : DType::Float32;
      runs.push_back(TensorArg{reinterpret_cast<const void*>(static_cast<uintptr_t>(0x10000 * (i + 1))),
                               static_cast<int64_t>(rng() % 2048), d});
    }
    const int64_t in_runs = check_sub_warp_runs(runs, warps);
    CHECK(in_runs >= (warps == 300 ? 150 : 300), "only %lld of 400 small tensors in runs with %lld warps",
          (long long)in_runs, (long long)warps);
  }
  // A tensor met by exactly n warps (n shares of one tensor's cost): the edges of the tree's two levels.
  for (int32_t n : {1, 2, 31, 32, 33, 64, 65, 1024, 1025, 4224}) {
    const std::vector<TensorArg> one{{nullptr, 5000 * chunk_elements(DType::Float32), DType::Float32}};
    check_shares(one, n);
    check_fold_tree(one, n, rng);
    const ListPlan plan = plan_of(one);
    const WarpRange met = Shares::of(plan.total_cost(), n).meeting(plan.view(), 0);
    CHECK(met.first == 0 && met.last == n - 1, "met by warps %d..%d, not 0..%d", met.first, met.last, n - 1);
  }
  // More warps than the list has cost: the spare warps get no share.
  const std::vector<TensorArg> tiny{{nullptr, 0, DType::Float32}, {nullptr, 1, DType::BFloat16}};
  const int64_t tiny_cost = plan_of(tiny).total_cost();
  CHECK(Shares::of(tiny_cost, 4224).warps == tiny_cost, "spare warps");
  check_shares(tiny, 4224);
  check_fold_tree(tiny, 4224, rng);
  // 10,000 tensors (three rounds of the 32-probe search), empty ones among them.
  const std::vector<TensorArg> many = random_list(rng, 10'000, 2);
  check_shares(many, 4224);
  check_fold_tree(many, 4224, rng);
  // A tensor over 2^31 elements: element ranges are 64-bit.
  const std::vector<TensorArg> huge{{nullptr, (int64_t{1} << 31) + 1000, DType::Float8E4M3FN}};
  check_shares(huge, 4224);
  // The limit on chunks is reported, not overflowed; the largest accepted list keeps cost * warps in 64 bits.
  ListPlan plan;
  const std::vector<TensorArg> too_many{{nullptr, int64_t{1} << 62, DType::Float32}};
  CHECK(!plan.build(too_many.data(), 1), "a list of 2^47 chunks was accepted");
  CHECK(!plan.build(too_many.data(), 0), "an empty list was accepted");
  const std::vector<TensorArg> largest{{nullptr, kMaxChunks * chunk_elements(DType::Float8E5M2), DType::Float8E5M2}};
  CHECK(plan.build(largest.data(), 1), "the largest list was refused");
  const Shares wide = Shares::of(plan.total_cost(), int64_t{1} << 30);
  CHECK(wide.warps == Shares::kMaxWarps, "%d shares: more than kMaxWarps", wide.warps);
  CHECK(wide.begin(wide.warps) == plan.total_cost() && wide.owner(plan.total_cost() - 1) == wide.warps - 1,
        "cost * warps overflowed");
  if (nanscan_test::failures == 0) std::printf("list_plan: all checks passed\n");
  return nanscan_test::failures == 0 ? 0 : 1;
}
