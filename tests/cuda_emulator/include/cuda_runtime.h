// Stand-in for <cuda_runtime.h> that lets g++ compile csrc/cuda/*.cu and run their kernels on CPU
// threads (tests/cuda_emulator/test_kernels.cpp, test_sketch_kernel.cpp). A launch runs the grid's
// blocks one after another, in index order or, when block_order_seed is set, in a shuffled order (a
// GPU promises none); a block's threads run concurrently, one std::thread each. A warp's lanes meet
// at a barrier in every shuffle, ballot and __syncwarp, so a warp-divergent shuffle deadlocks here as
// it would misbehave on a GPU (the test runner's timeout reports it); __syncthreads is a block-wide
// barrier; atomics and fences are C++ atomics. __shared__ variables become function statics, which is
// sound because blocks never overlap. __CUDA_ARCH__ stays undefined, so the decode is the CPU's (same
// values).
#pragma once

#include <algorithm>
#include <atomic>
#include <barrier>
#include <cstdint>
#include <cstring>
#include <memory>
#include <numeric>
#include <random>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __grid_constant__
#define __shared__ static
#define __launch_bounds__(...)

using cudaError_t = int;
using cudaStream_t = void*;
constexpr cudaError_t cudaSuccess = 0;
constexpr cudaError_t cudaErrorInvalidValue = 1;

struct alignas(16) uint4 {  // aligned as CUDA's, so a misaligned vector access is UB here too
  unsigned int x, y, z, w;
};
struct dim3 {
  unsigned int x = 0, y = 0, z = 0;
};

namespace cuda_emulator {

struct Warp {
  explicit Warp() : barrier(32) {}
  std::barrier<> barrier;
  uint64_t slots[32] = {};
};

struct Block {
  explicit Block(int threads) : barrier(threads), warps(threads / 32) {
    for (auto& w : warps) w = std::make_unique<Warp>();
  }
  std::barrier<> barrier;
  std::vector<std::unique_ptr<Warp>> warps;
};

// Tensors scanned by the small-tensor path (scan_cuda.cu's NANSCAN_ON_SUB_WARP_RUN), over all launches.
inline std::atomic<uint64_t> sub_warp_tensors{0};

// What the occupancy query answers; tests raise it to get grids of hundreds of blocks.
inline int blocks_per_sm = 1;
// Nonzero: launches run their blocks in an order shuffled with this seed.
inline unsigned block_order_seed = 0;

inline thread_local Block* block = nullptr;
inline thread_local int lane = 0;
inline thread_local dim3 thread_idx, block_idx, grid_dim, block_dim;
inline Warp& warp() { return *block->warps[thread_idx.x / 32]; }

// Every lane posts a value, then reads the one `pick(lane)` names.
template <class T, class Pick>
T exchange(T value, Pick pick) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  Warp& w = warp();
  uint64_t bits = 0;
  memcpy(&bits, &value, sizeof(T));
  w.slots[lane] = bits;
  w.barrier.arrive_and_wait();
  const uint64_t got = w.slots[pick(lane) & 31];
  w.barrier.arrive_and_wait();
  T out;
  memcpy(&out, &got, sizeof(T));
  return out;
}

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), int grid, int threads, Args&... args) {
  std::vector<int> order(grid);
  std::iota(order.begin(), order.end(), 0);
  if (block_order_seed != 0) std::shuffle(order.begin(), order.end(), std::mt19937(block_order_seed));
  for (int b : order) {
    Block blk(threads);
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int t = 0; t < threads; ++t) {
      pool.emplace_back([&, t] {
        block = &blk;
        lane = t % 32;
        thread_idx = dim3{static_cast<unsigned>(t), 0, 0};
        block_idx = dim3{static_cast<unsigned>(b), 0, 0};
        grid_dim = dim3{static_cast<unsigned>(grid), 1, 1};
        block_dim = dim3{static_cast<unsigned>(threads), 1, 1};
        kernel(args...);
      });
    }
    for (auto& th : pool) th.join();
  }
}

}  // namespace cuda_emulator

#define threadIdx (cuda_emulator::thread_idx)
#define blockIdx (cuda_emulator::block_idx)
#define gridDim (cuda_emulator::grid_dim)
#define blockDim (cuda_emulator::block_dim)

#define NANSCAN_LAUNCH(kernel, grid, block, stream, ...) cuda_emulator::launch(kernel, (grid), (block), __VA_ARGS__)
#define NANSCAN_ON_SUB_WARP_RUN(count) (cuda_emulator::sub_warp_tensors += static_cast<uint64_t>(count))

inline void __syncthreads() { cuda_emulator::block->barrier.arrive_and_wait(); }
inline void __syncwarp(unsigned = 0xffffffffu) { cuda_emulator::warp().barrier.arrive_and_wait(); }
inline void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }

template <class T>
T __shfl_xor_sync(unsigned, T value, int offset) {
  return cuda_emulator::exchange(value, [offset](int lane) { return lane ^ offset; });
}
template <class T>
T __shfl_down_sync(unsigned, T value, unsigned delta) {  // lanes past the last read their own value
  return cuda_emulator::exchange(
      value, [delta](int lane) { return lane + static_cast<int>(delta) < 32 ? lane + static_cast<int>(delta) : lane; });
}
template <class T>
T __shfl_sync(unsigned, T value, int source) {
  return cuda_emulator::exchange(value, [source](int) { return source; });
}
inline unsigned __ballot_sync(unsigned, bool predicate) {
  cuda_emulator::Warp& w = cuda_emulator::warp();
  w.slots[cuda_emulator::lane] = predicate ? 1 : 0;
  w.barrier.arrive_and_wait();
  unsigned mask = 0;
  for (int i = 0; i < 32; ++i) mask |= static_cast<unsigned>(w.slots[i] != 0) << i;
  w.barrier.arrive_and_wait();
  return mask;
}
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(unsigned x) { return __builtin_ffs(static_cast<int>(x)); }

template <class T>
T __ldg(const T* p) {
  return *p;
}
template <class T>
T __ldcg(const T* p) {
  return std::atomic_ref<T>(*const_cast<T*>(p)).load(std::memory_order_relaxed);
}
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline double atomicAdd(double* p, double v) { return std::atomic_ref<double>(*p).fetch_add(v); }

inline cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t) {
  memset(p, value, bytes);
  return cudaSuccess;
}
inline cudaError_t cudaGetLastError() { return cudaSuccess; }
inline cudaError_t cudaGetDevice(int* device) {
  *device = 0;
  return cudaSuccess;
}
// cuda_emulator::blocks_per_sm blocks per multiprocessor; with the multiprocessor count the tests
// pass, that sets the grid. (The launcher caches the answer per kernel, so set it before the first
// launch of a kernel.)
template <class Kernel>
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int* blocks, Kernel, int, size_t) {
  *blocks = cuda_emulator::blocks_per_sm;
  return cudaSuccess;
}
