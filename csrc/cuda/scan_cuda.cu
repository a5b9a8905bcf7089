// CUDA backend: the fused scan and the clip multiply over a whole tensor list.
//
// Work is cut into chunks of kChunkBytes of one tensor; one warp scans one chunk with 16-byte loads
// (kUnroll in flight per lane) into a FastRun per lane, reduces across the warp in a fixed butterfly
// order and applies the shared exactness rule (re-reading the chunk with the exact rule if needed).
// Chunks are dealt to a persistent grid, so 10,000 tiny tensors are 10,000 warp-sized jobs, not
// 10,000 blocks. The last block to finish (threadfence + ticket) folds multi-chunk tensors and, in
// the last launch, writes every per-tensor result and the totals: one launch per kMaxTensorsPerLaunch
// tensors, no host sync, nothing allocated, deterministic (every combine has a fixed order).
#include "scan_cuda.h"

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <array>
#include <memory>
#include <type_traits>

namespace nanscan::cuda {
namespace {

constexpr int kWarpSize = 32;
constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
constexpr int64_t kChunkBytes = 32 * 1024;
constexpr int kUnroll = 4;
// Tensor metadata travels by value in the kernel parameters (up to 32764 bytes since CUDA 12.1 on
// sm_70+); this many tensors fit with the header.
constexpr int kMaxTensorsPerLaunch = 1536;

struct TensorTable {
  int32_t num_tensors;
  int32_t num_chunks;
  const void* data[kMaxTensorsPerLaunch];
  int64_t numel[kMaxTensorsPerLaunch];
  int32_t chunk_begin[kMaxTensorsPerLaunch + 1];  // chunk index of each tensor's first chunk, in this launch
  uint8_t dtype[kMaxTensorsPerLaunch];  // DType, one byte each to fit the parameter space

  __host__ __device__ DType dtype_of(int i) const { return static_cast<DType>(dtype[i]); }
};

struct ScanLaunch {
  TensorTable table;
  const float* multiply_by;  // device scalar, or null: see scan_chunk's kMultiply
  int32_t first_tensor;  // global index of this launch's tensor 0
  int32_t first_chunk;   // global index of this launch's chunk 0 in the workspace
  int32_t total_tensors;
  bool is_last_launch;
};


struct ScaleLaunch {
  TensorTable table;
  const void* coef;
  DType coef_dtype;
  CoefRounding rounding;
};


struct Workspace {
  TensorStats* chunk_partials;  // [total chunks]
  TensorStats* tensor_stats;    // [total tensors]
  unsigned int* tickets;        // [launches]
};

static_assert(sizeof(ScanLaunch) + sizeof(Workspace) + sizeof(ResultPointers) <= 32764,
              "scan_kernel's parameters exceed the 32764 bytes CUDA 12.1+ allows");
static_assert(sizeof(ScaleLaunch) <= 32764, "scale_kernel's parameters exceed the 32764 bytes CUDA 12.1+ allows");

__host__ __device__ inline int64_t chunk_elements(DType d) { return kChunkBytes / element_size(d); }

__host__ __device__ inline int64_t num_chunks(int64_t numel, DType d) {
  const int64_t per = chunk_elements(d);
  return (numel + per - 1) / per;
}

// Index of the tensor that owns chunk c (the last tensor whose first chunk is <= c). Warp-uniform.
__device__ int find_tensor(const TensorTable& table, int32_t c) {
  int lo = 0, hi = table.num_tensors - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (table.chunk_begin[mid] <= c) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return lo;
}

// Chunk c of a launch: its tensor and element range.
struct ChunkSpan {
  int tensor;
  int64_t begin;
  int64_t end;
};

__device__ ChunkSpan chunk_span(const TensorTable& table, int32_t c) {
  const int t = find_tensor(table, c);
  const int64_t per = chunk_elements(table.dtype_of(t));
  const int64_t begin = static_cast<int64_t>(c - table.chunk_begin[t]) * per;
  return ChunkSpan{t, begin, begin + per < table.numel[t] ? begin + per : table.numel[t]};
}

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
    s = combine(s, other);
  }
  return s;
}

// Visits every element of [p, p + n) that this lane owns: 16-byte loads when p is 16-byte aligned
// (kUnroll of them issued before any is used), then the tail one element per lane.
// Without kRewrite, fn(raw) observes each element, loaded through the read-only cache. With kRewrite,
// fn(raw) returns the element's new value, stored back with the vector it came in; loads are then
// plain, so that a later pass of the same thread over the same elements sees what it wrote (the
// read-only path does not promise that).
template <bool kRewrite, class Raw, class Fn>
__device__ __forceinline__ void for_each_lane_element(Raw* p, int64_t n, int lane, Fn&& fn) {
  constexpr int kPerVector = 16 / sizeof(Raw);
  const int64_t num_vectors = (reinterpret_cast<uintptr_t>(p) % 16 == 0) ? n / kPerVector : 0;
  uint4* vectors = reinterpret_cast<uint4*>(p);
  for (int64_t i = lane; i < num_vectors; i += kWarpSize * kUnroll) {
    uint4 v[kUnroll];
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (i + k * kWarpSize < num_vectors) {
        v[k] = kRewrite ? vectors[i + k * kWarpSize] : __ldg(vectors + i + k * kWarpSize);
      }
    }
#pragma unroll
    for (int k = 0; k < kUnroll; ++k) {
      if (i + k * kWarpSize < num_vectors) {
        Raw r[kPerVector];
        memcpy(r, &v[k], sizeof r);
#pragma unroll
        for (int j = 0; j < kPerVector; ++j) {
          if constexpr (kRewrite) {
            r[j] = fn(r[j]);
          } else {
            fn(r[j]);
          }
        }
        if constexpr (kRewrite) {
          memcpy(&v[k], r, sizeof r);
          vectors[i + k * kWarpSize] = v[k];
        }
      }
    }
  }
  for (int64_t e = num_vectors * kPerVector + lane; e < n; e += kWarpSize) {
    if constexpr (kRewrite) {
      p[e] = fn(p[e]);
    } else {
      fn(p[e]);
    }
  }
}

// One warp scans elements [begin, end) of a tensor; the result is valid in every lane. With
// kMultiply (GradScaler's unscale), each element is first replaced by round(x * factor), torch's
// arithmetic, in the same pass; a factor of exactly 1 writes nothing, as in torch.
template <class Codec, bool kHalfRange, bool kMultiply>
__device__ TensorStats scan_chunk(const void* data, int64_t begin, int64_t end, int lane, float factor) {
  using Raw = typename Codec::Raw;
  using Wide = typename Codec::Wide;
  Raw* p = static_cast<Raw*>(const_cast<void*>(data)) + begin;
  const int64_t n = end - begin;

  FastRun<Codec> run = empty_run<Codec>();
  long long over = 0, under = 0;
  auto observe = [&](Raw r) {
    accumulate_fast<Codec>(run.min, run.max, run.sumsq, r);
    if constexpr (kHalfRange) count_half_range(over, under, Codec::decode(r));
  };
  bool rewritten = false;
  if constexpr (kMultiply && HasEncode<Codec>::value) {
    if (factor != 1.0f) {
      const Wide f = static_cast<Wide>(factor);
      for_each_lane_element<true>(p, n, lane, [&](Raw r) {
        const Raw product = Codec::encode(Codec::decode(r) * f);
        observe(product);
        return product;
      });
      rewritten = true;
    }
  }
  if (!rewritten) for_each_lane_element<false>(p, n, lane, observe);

  double run_min = static_cast<double>(run.min), run_max = static_cast<double>(run.max);
  double run_sumsq = static_cast<double>(run.sumsq);
#pragma unroll
  for (int offset = kWarpSize / 2; offset > 0; offset /= 2) {
    const double other_min = shfl_xor(run_min, offset), other_max = shfl_xor(run_max, offset);
    run_min = other_min < run_min ? other_min : run_min;
    run_max = other_max > run_max ? other_max : run_max;
    run_sumsq += shfl_xor(run_sumsq, offset);
  }
  TensorStats s = empty_stats();
  if (run_is_exact<Codec>(run_min, run_max, run_sumsq)) {
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
  // The exact rule re-reads what the first pass left (the products, when it rewrote): with plain
  // loads after a rewrite, through the read-only cache otherwise.
  auto exact = [&](Raw r) { accumulate_exact<Codec>(s, r, kHalfRange); };
  if (rewritten) {
    for_each_lane_element<true>(p, n, lane, [&](Raw r) {
      exact(r);
      return r;
    });
  } else {
    for_each_lane_element<false>(p, n, lane, exact);
  }
  return warp_combine(s);
}

template <bool kHalfRange, bool kMultiply>
__device__ TensorStats scan_chunk_any(DType dtype, const void* data, int64_t begin, int64_t end, int lane, float factor) {
  switch (dtype) {
    case DType::Float32: return scan_chunk<Float32Codec, kHalfRange, kMultiply>(data, begin, end, lane, factor);
    case DType::Float64: return scan_chunk<Float64Codec, kHalfRange, kMultiply>(data, begin, end, lane, factor);
    case DType::Float16: return scan_chunk<Float16Codec, kHalfRange, kMultiply>(data, begin, end, lane, factor);
    case DType::BFloat16: return scan_chunk<BFloat16Codec, kHalfRange, kMultiply>(data, begin, end, lane, factor);
    case DType::Float8E4M3FN:
      return scan_chunk<Float8E4M3FNCodec, kHalfRange, kMultiply>(data, begin, end, lane, factor);
    case DType::Float8E5M2: return scan_chunk<Float8E5M2Codec, kHalfRange, kMultiply>(data, begin, end, lane, factor);
  }
  return empty_stats();
}

// Reads what other blocks of this launch wrote: through L2, never a possibly stale L1 line.
__device__ TensorStats load_coherent(const TensorStats* p) {
  TensorStats s;
  s.nan_count = __ldcg(reinterpret_cast<const long long*>(&p->nan_count));
  s.inf_count = __ldcg(reinterpret_cast<const long long*>(&p->inf_count));
  s.half_overflow = __ldcg(reinterpret_cast<const long long*>(&p->half_overflow));
  s.half_underflow = __ldcg(reinterpret_cast<const long long*>(&p->half_underflow));
  s.min = __ldcg(&p->min);
  s.max = __ldcg(&p->max);
  s.sumsq = __ldcg(&p->sumsq);
  return s;
}

// Last block of a launch: fold the chunk partials of this launch's tensors that have != 1 chunk
// (tensors with one chunk were written directly; empty ones get empty stats). A warp takes 32 tensors
// at a time and visits only those that need folding; lanes stride over the chunks.
__device__ void fold_multi_chunk_tensors(const ScanLaunch& launch, const Workspace& ws) {
  const TensorTable& table = launch.table;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  for (int base = warp * kWarpSize; base < table.num_tensors; base += kThreads) {
    const int mine = base + lane;
    const bool needs_fold = mine < table.num_tensors && table.chunk_begin[mine + 1] - table.chunk_begin[mine] != 1;
    unsigned int pending = __ballot_sync(0xffffffffu, needs_fold);
    while (pending) {
      const int t = base + __ffs(pending) - 1;
      pending &= pending - 1;
      TensorStats s = empty_stats();
      for (int32_t c = table.chunk_begin[t] + lane; c < table.chunk_begin[t + 1]; c += kWarpSize) {
        s = combine(s, load_coherent(ws.chunk_partials + launch.first_chunk + c));
      }
      s = warp_combine(s);
      if (lane == 0) ws.tensor_stats[launch.first_tensor + t] = s;
    }
  }
}

// Last block of the last launch: per-tensor outputs and the totals. Each thread combines a fixed
// contiguous range of tensors, then a fixed shared-memory tree combines the threads.
__device__ void write_outputs(const ScanLaunch& launch, const Workspace& ws, const ResultPointers& out) {
  __shared__ TensorStats partial[kThreads];
  const int64_t n = launch.total_tensors;
  const int64_t per_thread = (n + kThreads - 1) / kThreads;
  const int64_t begin = threadIdx.x * per_thread, end = begin + per_thread < n ? begin + per_thread : n;
  TensorStats mine = empty_stats();
  for (int64_t t = begin; t < end; ++t) {
    const TensorStats s = load_coherent(ws.tensor_stats + t);
    write_tensor_result(out, t, s);
    mine = combine(mine, s);
  }
  partial[threadIdx.x] = mine;
  __syncthreads();
  for (int stride = kThreads / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) partial[threadIdx.x] = combine(partial[threadIdx.x], partial[threadIdx.x + stride]);
    __syncthreads();
  }
  if (threadIdx.x == 0) write_totals(out, partial[0]);
}

// One instantiation per option, so the plain scan carries no register cost of the options.
template <bool kHalfRange, bool kMultiply>
__global__ void __launch_bounds__(kThreads) scan_kernel(const __grid_constant__ ScanLaunch launch, Workspace ws,
                                                        ResultPointers out) {
  const TensorTable& table = launch.table;
  const int lane = threadIdx.x % kWarpSize;
  const float factor = kMultiply ? __ldg(launch.multiply_by) : 1.0f;
  for (int32_t c = blockIdx.x * kWarps + threadIdx.x / kWarpSize; c < table.num_chunks; c += gridDim.x * kWarps) {
    const ChunkSpan span = chunk_span(table, c);
    const int t = span.tensor;
    const TensorStats s =
        scan_chunk_any<kHalfRange, kMultiply>(table.dtype_of(t), table.data[t], span.begin, span.end, lane, factor);
    if (lane == 0) {
      const bool only_chunk = table.chunk_begin[t + 1] - table.chunk_begin[t] == 1;
      if (only_chunk) {
        ws.tensor_stats[launch.first_tensor + t] = s;
      } else {
        ws.chunk_partials[launch.first_chunk + c] = s;
      }
    }
  }

  // Last-block-done: make this block's writes visible device-wide, then take a ticket.
  __shared__ bool is_last_block;
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) {
    const unsigned int ticket = atomicAdd(ws.tickets, 1u);
    is_last_block = ticket == gridDim.x - 1;
  }
  __syncthreads();
  if (!is_last_block) return;
  __threadfence();
  fold_multi_chunk_tensors(launch, ws);
  __syncthreads();
  if (launch.is_last_launch) write_outputs(launch, ws, out);
  if (threadIdx.x == 0) *ws.tickets = 0;  // self-reset: a graph replay starts from zero even without the memset
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
  Raw* p = static_cast<Raw*>(data) + begin;
  const Wide c = rounding == CoefRounding::ToTensorDtype ? Codec::decode(Codec::encode(static_cast<Wide>(coef)))
                                                         : static_cast<Wide>(static_cast<float>(coef));
  for (int64_t e = lane; e < end - begin; e += kWarpSize) p[e] = Codec::encode(Codec::decode(p[e]) * c);
}

__global__ void __launch_bounds__(kThreads) scale_kernel(const __grid_constant__ ScaleLaunch launch) {
  const double coef = load_scalar(launch.coef, launch.coef_dtype);
  if (coef == 1.0) return;  // nothing to clip: no gradient byte is written
  const TensorTable& table = launch.table;
  const int lane = threadIdx.x % kWarpSize;
  for (int32_t c = blockIdx.x * kWarps + threadIdx.x / kWarpSize; c < table.num_chunks; c += gridDim.x * kWarps) {
    const ChunkSpan span = chunk_span(table, c);
    const int t = span.tensor;
    const int64_t begin = span.begin, end = span.end;
    void* data = const_cast<void*>(table.data[t]);
    switch (table.dtype_of(t)) {
      case DType::Float32: scale_chunk<Float32Codec>(data, begin, end, coef, launch.rounding, lane); break;
      case DType::Float64: scale_chunk<Float64Codec>(data, begin, end, coef, launch.rounding, lane); break;
      case DType::Float16: scale_chunk<Float16Codec>(data, begin, end, coef, launch.rounding, lane); break;
      case DType::BFloat16: scale_chunk<BFloat16Codec>(data, begin, end, coef, launch.rounding, lane); break;
      default: break;  // rejected on the host
    }
  }
}

// Fills `table` with tensors [first, first + count) and returns the number of chunks.
int32_t fill_table(TensorTable& table, const TensorArg* tensors, int64_t first, int64_t count) {
  table.num_tensors = static_cast<int32_t>(count);
  int32_t chunks = 0;
  for (int64_t i = 0; i < count; ++i) {
    const TensorArg& t = tensors[first + i];
    table.data[i] = t.data;
    table.numel[i] = t.numel;
    table.dtype[i] = static_cast<uint8_t>(t.dtype);
    table.chunk_begin[i] = chunks;
    chunks += static_cast<int32_t>(num_chunks(t.numel, t.dtype));
  }
  table.chunk_begin[count] = chunks;
  table.num_chunks = chunks;
  return chunks;
}

int64_t num_launches(int64_t num_tensors) { return (num_tensors + kMaxTensorsPerLaunch - 1) / kMaxTensorsPerLaunch; }

// Resident blocks per multiprocessor of a kernel (its register use decides), asked once per kernel
// and device.
template <auto Kernel>
int resident_blocks_per_sm() {
  static std::array<int, 64> cached{};  // racing writers store the same value
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 1;
  if (device < static_cast<int>(cached.size()) && cached[device] != 0) return cached[device];
  int n = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, Kernel, kThreads, 0) != cudaSuccess || n < 1) n = 1;
  if (device < static_cast<int>(cached.size())) cached[device] = n;
  return n;
}

// A persistent grid: one wave of resident blocks, fewer when there are not enough chunks to share.
int grid_for(int32_t chunks, int num_sms, int blocks_per_sm) {
  const int64_t wanted = (static_cast<int64_t>(chunks) + kWarps - 1) / kWarps;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(wanted, static_cast<int64_t>(num_sms) * blocks_per_sm)));
}

size_t align_up(size_t bytes) { return (bytes + 255) / 256 * 256; }

template <bool kHalfRange, bool kMultiply>
void launch_scan(int32_t chunks, int num_sms, cudaStream_t stream, const ScanLaunch& launch, const Workspace& ws,
                 const ResultPointers& out) {
  const int grid = grid_for(chunks, num_sms, resident_blocks_per_sm<scan_kernel<kHalfRange, kMultiply>>());
  scan_kernel<kHalfRange, kMultiply><<<grid, kThreads, 0, stream>>>(launch, ws, out);
}

}  // namespace

size_t scan_workspace_bytes(const TensorArg* tensors, int64_t num_tensors) {
  int64_t chunks = 0;
  for (int64_t i = 0; i < num_tensors; ++i) chunks += num_chunks(tensors[i].numel, tensors[i].dtype);
  return align_up(chunks * sizeof(TensorStats)) + align_up(num_tensors * sizeof(TensorStats)) +
         align_up(num_launches(num_tensors) * sizeof(unsigned int));
}

cudaError_t scan(const TensorArg* tensors, int64_t num_tensors, const ResultPointers& out, void* workspace, int num_sms,
                 cudaStream_t stream, const float* multiply_by) {
  if (multiply_by != nullptr && out.half_range) return cudaErrorInvalidValue;
  if (num_tensors <= 0) return cudaErrorInvalidValue;
  int64_t total_chunks = 0;
  for (int64_t i = 0; i < num_tensors; ++i) total_chunks += num_chunks(tensors[i].numel, tensors[i].dtype);
  if (total_chunks > INT32_MAX) return cudaErrorInvalidValue;
  char* base = static_cast<char*>(workspace);
  Workspace ws;
  ws.chunk_partials = reinterpret_cast<TensorStats*>(base);
  ws.tensor_stats = reinterpret_cast<TensorStats*>(base + align_up(total_chunks * sizeof(TensorStats)));
  ws.tickets = reinterpret_cast<unsigned int*>(base + align_up(total_chunks * sizeof(TensorStats)) +
                                               align_up(num_tensors * sizeof(TensorStats)));
  const int64_t launches = num_launches(num_tensors);
  cudaError_t err = cudaMemsetAsync(ws.tickets, 0, launches * sizeof(unsigned int), stream);
  if (err != cudaSuccess) return err;

  // Parameters are copied at launch, so one host buffer serves every launch of the call.
  auto launch = std::make_unique<ScanLaunch>();
  int32_t first_chunk = 0;
  for (int64_t l = 0; l < launches; ++l) {
    const int64_t first = l * kMaxTensorsPerLaunch;
    const int64_t count = std::min<int64_t>(kMaxTensorsPerLaunch, num_tensors - first);
    const int32_t chunks = fill_table(launch->table, tensors, first, count);
    launch->first_tensor = static_cast<int32_t>(first);
    launch->first_chunk = first_chunk;
    launch->total_tensors = static_cast<int32_t>(num_tensors);
    launch->is_last_launch = l == launches - 1;
    Workspace launch_ws = ws;
    launch_ws.tickets = ws.tickets + l;
    launch->multiply_by = multiply_by;
    if (multiply_by != nullptr) {
      launch_scan<false, true>(chunks, num_sms, stream, *launch, launch_ws, out);
    } else if (out.half_range) {
      launch_scan<true, false>(chunks, num_sms, stream, *launch, launch_ws, out);
    } else {
      launch_scan<false, false>(chunks, num_sms, stream, *launch, launch_ws, out);
    }
    err = cudaGetLastError();
    if (err != cudaSuccess) return err;
    first_chunk += chunks;
  }
  return cudaSuccess;
}

cudaError_t scale(const TensorArg* tensors, int64_t num_tensors, const void* coef, DType coef_dtype,
                  CoefRounding rounding, int num_sms, cudaStream_t stream) {
  for (int64_t i = 0; i < num_tensors; ++i) {
    if (tensors[i].dtype == DType::Float8E4M3FN || tensors[i].dtype == DType::Float8E5M2) return cudaErrorInvalidValue;
  }
  auto launch = std::make_unique<ScaleLaunch>();
  launch->coef = coef;
  launch->coef_dtype = coef_dtype;
  launch->rounding = rounding;
  for (int64_t first = 0; first < num_tensors; first += kMaxTensorsPerLaunch) {
    const int64_t count = std::min<int64_t>(kMaxTensorsPerLaunch, num_tensors - first);
    const int32_t chunks = fill_table(launch->table, tensors, first, count);
    if (chunks == 0) continue;
    scale_kernel<<<grid_for(chunks, num_sms, resident_blocks_per_sm<scale_kernel>()), kThreads, 0, stream>>>(*launch);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

}  // namespace nanscan::cuda
