// Stand-in for <cuda_runtime.h> that lets g++ compile csrc/cuda/*.cu and run their kernels on the CPU
// (tests/cuda_emulator/test_kernels.cpp, test_sketch_kernel.cpp). A launch runs the grid's blocks one
// after another, in index order or, when block_order_seed is set, in a shuffled order (a GPU promises
// none).
//
// A block's threads are fibers on one OS thread, switched at every barrier: a warp's lanes
// meet at a barrier in every shuffle, ballot and __syncwarp; __syncthreads is a block-wide one. A
// fiber runs until it waits at a barrier, and the one that opens it goes on at once. The scheduler
// then resumes those whose barrier has opened, in an order drawn afresh for each pass (seeded: every
// run the same), so a read of another thread's shared-memory write that no barrier orders finds the
// write missing in some block, and lanes that read shared state at different moments diverge into a
// deadlock. Where no fiber can go on (a warp-divergent shuffle, a __syncthreads some threads skip),
// the program stops and says which barrier. This is deterministic where OS threads (this emulator's
// first design: 256 threads a block on two cores, 3.5 minutes of futex waits for test_kernels against
// under one now) met in one order almost always, and a hang could only time out. What fibers cannot
// show: two threads' plain read-modify-writes racing with no barrier between them (each runs whole
// between switches), and a missing fence (memory is the one thread's).
//
// On x86-64 a switch is a few instructions of our own (switch_stacks, below): glibc's swapcontext also
// saves and restores the signal mask, a system call each time, and test_kernels' 10^7 switches spent
// 28 of its 60 s in the kernel. Elsewhere, or with -DCUDA_EMULATOR_UCONTEXT (tests/test_cuda_emulated.py
// builds its probes so, to keep this path compiling and right), the switches are ucontext's.
//
// Atomics and fences are C++ atomics. __shared__ variables become function statics, which is sound
// because blocks never overlap. __CUDA_ARCH__ stays undefined, so the decode is the CPU's (same
// values).
#pragma once

#include <sys/mman.h>

#if !defined(__x86_64__) && !defined(CUDA_EMULATOR_UCONTEXT)
#define CUDA_EMULATOR_UCONTEXT 1
#endif
#ifdef CUDA_EMULATOR_UCONTEXT
#include <ucontext.h>
#endif

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>
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
constexpr cudaError_t cudaErrorInvalidDeviceFunction = 98;

struct alignas(16) uint4 {  // aligned as CUDA's, so a misaligned vector access is UB here too
  unsigned int x, y, z, w;
};
struct dim3 {
  unsigned int x = 0, y = 0, z = 0;
};

namespace cuda_emulator {

// A barrier of `expected` fibers: the last to arrive opens it (a new phase) and goes on; the others
// wait in the scheduler until their phase has passed.
struct Barrier {
  explicit Barrier(int expected, const char* what) : expected(expected), what(what) {}
  int expected;
  int arrived = 0;
  uint64_t phase = 0;
  const char* what;
};

struct Warp {
  Barrier barrier{32, "a warp's shuffle, ballot or __syncwarp"};
  uint64_t slots[32] = {};
};

struct Block {
  explicit Block(int threads) : barrier(threads, "__syncthreads") {
    warps.reserve(threads / 32);
    for (int w = 0; w < threads / 32; ++w) warps.emplace_back();
  }
  Barrier barrier;
  std::vector<Warp> warps;
};

// Where a suspended fiber, or the scheduler, goes on from: its saved stack pointer (the registers it
// must keep are on its stack), or its ucontext.
struct Context {
#ifdef CUDA_EMULATOR_UCONTEXT
  ucontext_t context;
#else
  void* stack_pointer = nullptr;
#endif
};

struct Fiber {
  Context context;
  char* stack = nullptr;
  bool done = false;
  const Barrier* waiting = nullptr;  // and the phase it waits to see pass
  uint64_t waiting_phase = 0;
};

// Each fiber's stack, with an inaccessible page below it so that an overflow faults instead of
// writing over its neighbour. Mapped once and kept for every later launch.
constexpr size_t kStackBytes = 256 * 1024;
constexpr size_t kGuardBytes = 4096;
inline char* stack(int index) {
  static std::vector<char*> stacks;
  while (static_cast<int>(stacks.size()) <= index) {
    void* mapped = mmap(nullptr, kStackBytes + kGuardBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (mapped == MAP_FAILED || mprotect(mapped, kGuardBytes, PROT_NONE) != 0) {
      std::fprintf(stderr, "cuda_emulator: cannot map a fiber stack\n");
      std::abort();
    }
    stacks.push_back(static_cast<char*>(mapped) + kGuardBytes);
  }
  return stacks[index];
}

// Tensors scanned by the small-tensor path (scan_cuda.cu's NANSCAN_ON_SUB_WARP_RUN), over all launches.
inline std::atomic<uint64_t> sub_warp_tensors{0};

// What the occupancy query answers; tests raise it to get grids of hundreds of blocks.
inline int blocks_per_sm = 1;
// Nonzero: launches run their blocks in an order shuffled with this seed.
inline unsigned block_order_seed = 0;

// The running fiber's view of the launch (set by the scheduler before each resume).
inline Block* block = nullptr;
inline Fiber* current = nullptr;
inline int lane = 0;
inline dim3 thread_idx, block_idx, grid_dim, block_dim;
inline Context scheduler;
inline const std::function<void()>* body = nullptr;  // the kernel with its arguments

#ifndef CUDA_EMULATOR_UCONTEXT
// switch_stacks(save, load): pushes the registers the SysV ABI has a callee keep (rbx, rbp, r12-r15,
// and the SSE and x87 control words), stores the stack pointer in *save, takes `load` as the stack
// pointer and pops the same from it; `ret` then goes on where that context last called
// switch_stacks. Weak, as this header is compiled into several objects of one program.
extern "C" void cuda_emulator_switch_stacks(void** save, void* load);
asm(R"(
    .text
    .weak cuda_emulator_switch_stacks
    .type cuda_emulator_switch_stacks, @function
cuda_emulator_switch_stacks:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size cuda_emulator_switch_stacks, .-cuda_emulator_switch_stacks
)");
#endif

inline void switch_context(Context& from, Context& to) {
#ifdef CUDA_EMULATOR_UCONTEXT
  swapcontext(&from.context, &to.context);
#else
  cuda_emulator_switch_stacks(&from.stack_pointer, to.stack_pointer);
#endif
}

inline Warp& warp() { return block->warps[thread_idx.x / 32]; }

inline void arrive_and_wait(Barrier& barrier) {
  const uint64_t phase = barrier.phase;
  if (++barrier.arrived == barrier.expected) {
    barrier.arrived = 0;
    ++barrier.phase;
    return;
  }
  current->waiting = &barrier;
  current->waiting_phase = phase;
  switch_context(current->context, scheduler);
}

// Every lane posts a value, then reads the one `pick(lane)` names.
template <class T, class Pick>
T exchange(T value, Pick pick) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  Warp& w = warp();
  uint64_t bits = 0;
  memcpy(&bits, &value, sizeof(T));
  w.slots[lane] = bits;
  arrive_and_wait(w.barrier);
  const uint64_t got = w.slots[pick(lane) & 31];
  arrive_and_wait(w.barrier);
  T out;
  memcpy(&out, &got, sizeof(T));
  return out;
}

// A fiber's first frame: the kernel, then back to the scheduler for good (it never resumes a done
// fiber, so this never returns: there is no frame to return to).
[[noreturn]] inline void fiber_main() {
  (*body)();
  current->done = true;
  switch_context(current->context, scheduler);
  std::abort();
}

// A fiber about to run fiber_main on `stack` from its first switch.
inline void start_context(Context& context, char* stack) {
#ifdef CUDA_EMULATOR_UCONTEXT
  getcontext(&context.context);
  context.context.uc_stack.ss_sp = stack;
  context.context.uc_stack.ss_size = kStackBytes;
  context.context.uc_link = nullptr;
  makecontext(&context.context, fiber_main, 0);
#else
  // The stack as switch_stacks leaves a suspended one, from its 16-byte aligned top down: a zero return
  // address where fiber_main's caller would be (so that fiber_main starts with the stack aligned as a
  // called function's), fiber_main's address for `ret`, six zeroed registers, and this thread's SSE
  // and x87 control words.
  auto* top = reinterpret_cast<uint64_t*>((reinterpret_cast<uintptr_t>(stack) + kStackBytes) & ~uintptr_t{15});
  uint64_t* sp = top - 9;
  std::memset(sp, 0, 9 * sizeof(uint64_t));
  uint32_t mxcsr;
  uint16_t x87;
  asm volatile("stmxcsr %0" : "=m"(mxcsr));
  asm volatile("fnstcw %0" : "=m"(x87));
  std::memcpy(sp, &mxcsr, sizeof(mxcsr));
  std::memcpy(reinterpret_cast<char*>(sp) + 4, &x87, sizeof(x87));
  sp[7] = reinterpret_cast<uint64_t>(&fiber_main);
  context.stack_pointer = sp;
#endif
}

// Runs one block: every thread from its start to its end, switching at barriers.
inline void run_block(Block& blk, std::vector<Fiber>& fibers, unsigned b) {
  const int threads = static_cast<int>(fibers.size());
  block = &blk;
  block_idx = dim3{b, 0, 0};
  for (int t = 0; t < threads; ++t) {
    Fiber& fiber = fibers[t];
    fiber = Fiber{};
    fiber.stack = stack(t);
    start_context(fiber.context, fiber.stack);
  }
  // Each pass resumes the threads in a fresh order, drawn from a seed of the block's: the same in every
  // run, and different between passes, so that which thread opens each barrier (and goes on first)
  // varies.
  std::vector<int> order(threads);
  std::iota(order.begin(), order.end(), 0);
  std::minstd_rand draw(1 + b);
  for (int finished = 0; finished < threads;) {
    bool progressed = false;
    std::shuffle(order.begin(), order.end(), draw);
    for (const int t : order) {
      Fiber& fiber = fibers[t];
      if (fiber.done || (fiber.waiting != nullptr && fiber.waiting->phase == fiber.waiting_phase)) continue;
      fiber.waiting = nullptr;
      current = &fiber;
      lane = t % 32;
      thread_idx = dim3{static_cast<unsigned>(t), 0, 0};
      switch_context(scheduler, fiber.context);
      progressed = true;
      if (fiber.done) ++finished;
    }
    if (!progressed && finished < threads) {
      for (int t = 0; t < threads; ++t) {
        if (!fibers[t].done) {
          std::fprintf(stderr,
                       "cuda_emulator: deadlock in block %u: thread %d waits at %s that not every thread it "
                       "waits for reaches (%d of %d threads have returned)\n",
                       b, t, fibers[t].waiting->what, finished, threads);
          break;
        }
      }
      std::abort();
    }
  }
}

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), int grid, int threads, Args&... args) {
  std::vector<int> order(grid);
  std::iota(order.begin(), order.end(), 0);
  if (block_order_seed != 0) std::shuffle(order.begin(), order.end(), std::mt19937(block_order_seed));
  const std::function<void()> run = [&] { kernel(args...); };
  body = &run;
  grid_dim = dim3{static_cast<unsigned>(grid), 1, 1};
  block_dim = dim3{static_cast<unsigned>(threads), 1, 1};
  std::vector<Fiber> fibers(threads);
  for (int b : order) {
    Block blk(threads);
    run_block(blk, fibers, static_cast<unsigned>(b));
  }
  block = nullptr;
  current = nullptr;
  body = nullptr;
}

}  // namespace cuda_emulator

#define threadIdx (cuda_emulator::thread_idx)
#define blockIdx (cuda_emulator::block_idx)
#define gridDim (cuda_emulator::grid_dim)
#define blockDim (cuda_emulator::block_dim)

#define NANSCAN_LAUNCH(kernel, grid, block, stream, ...) cuda_emulator::launch(kernel, (grid), (block), __VA_ARGS__)
#define NANSCAN_ON_SUB_WARP_RUN(count) (cuda_emulator::sub_warp_tensors += static_cast<uint64_t>(count))

inline void __syncthreads() { cuda_emulator::arrive_and_wait(cuda_emulator::block->barrier); }
inline void __syncwarp(unsigned = 0xffffffffu) { cuda_emulator::arrive_and_wait(cuda_emulator::warp().barrier); }
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
  cuda_emulator::arrive_and_wait(w.barrier);
  unsigned mask = 0;
  for (int i = 0; i < 32; ++i) mask |= static_cast<unsigned>(w.slots[i] != 0) << i;
  cuda_emulator::arrive_and_wait(w.barrier);
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
