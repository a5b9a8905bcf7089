// torch -> CUDA launcher glue, on PyTorch's stable ABI (torch_api.h; USE_CUDA, set by setup.py,
// declares the shim's CUDA calls): validation (shared with the CPU op), device guard, current
// stream, allocation through the caching allocator (except the cache of long lists' metadata: see
// OwnedDeviceBlob). Registers the CUDA kernels of the schemas in ops.cpp.
// One library per CUDA major, nanscan/_C_cuda<major> (setup.py builds it for each toolkit it is
// given, with or without a CUDA torch; nanscan/_ops.py loads the one of torch's CUDA).
#include <Python.h>
#include <cuda_runtime.h>
#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <mutex>
#include <vector>

#include "cuda/scan_cuda.h"
#include "cuda/sketch_cuda.h"
#include "ops.h"
#include "torch_api.h"

namespace nanscan {
namespace {

// A CUDA runtime error, with CUDA's name for it.
void check_cuda(cudaError_t err) {
  if (err == cudaSuccess) return;
  (void)cudaGetLastError();  // not left pending for the next call's check
  fail(concat("CUDA error: ", cudaGetErrorString(err)));
}

int current_device() {
  int device = 0;
  check_cuda(cudaGetDevice(&device));
  return device;
}

// The current stream of a device, as torch's CUDA code would enqueue on it.
cudaStream_t current_stream(int32_t device_index) {
  void* stream = nullptr;
  NANSCAN_SHIM(aoti_torch_get_current_cuda_stream(device_index, &stream));
  return static_cast<cudaStream_t>(stream);
}

// Makes the tensors' device current for the call, as c10's CUDAGuard does.
class CudaDeviceGuard {
 public:
  explicit CudaDeviceGuard(int32_t device_index) { NANSCAN_SHIM(aoti_torch_create_cuda_guard(device_index, &guard_)); }
  ~CudaDeviceGuard() { (void)aoti_torch_delete_cuda_guard(guard_); }
  CudaDeviceGuard(const CudaDeviceGuard&) = delete;
  CudaDeviceGuard& operator=(const CudaDeviceGuard&) = delete;

 private:
  CUDAGuardHandle guard_ = nullptr;
};

// Tensor arguments for the launcher. Dense tensors (any dimension order) are read in place; others
// are copied to contiguous memory first (kept alive in `copies` until the launch is enqueued; the
// caching allocator's stream semantics keep the memory valid until the kernel has read it).
std::vector<cuda::TensorArg> tensor_args(const TensorListArg& tensors, const std::vector<DType>& tags,
                                         std::vector<OwnedTensor>& copies) {
  std::vector<cuda::TensorArg> args(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInfo& t = tensors[i];
    const void* data = t.data;
    if (t.numel > 0 && !t.dense) {
      copies.push_back(contiguous(t.handle));
      data = copies.back().data();
    }
    args[i] = cuda::TensorArg{data, t.numel, tags[i]};
  }
  return args;
}

// The GPU architectures this build holds kernels for, for the error below and the module's
// cuda_archs: setup.py writes them into a header in the build tree (TORCH_CUDA_ARCH_LIST as it
// built); a build without it says so.
#if __has_include("nanscan_cuda_archs.h")
#include "nanscan_cuda_archs.h"
#else
#define NANSCAN_CUDA_ARCHS "unknown (a build outside setup.py)"
#endif

// A launch's error; a GPU this build holds no kernel for is named, with what the build holds and how
// to build for it, where CUDA alone says "no kernel image is available for execution on the device".
void check_launch(cudaError_t err) {
  if (err == cudaErrorNoKernelImageForDevice || err == cudaErrorInvalidDeviceFunction) {
    (void)cudaGetLastError();  // not left pending for the next launch's check
    const int device = current_device();
    cudaDeviceProp prop{};
    const bool known = cudaGetDeviceProperties(&prop, device) == cudaSuccess;
    fail(concat("nanscan: no CUDA kernel for this GPU: cuda:", device, " is ", known ? prop.name : "a GPU",
                " (compute capability ", prop.major, ".", prop.minor,
                "), and this build of nanscan holds kernels for TORCH_CUDA_ARCH_LIST=", NANSCAN_CUDA_ARCHS,
                " (an entry marked +PTX also runs on GPUs newer than it). Rebuild nanscan where it runs: pip install "
                "--no-build-isolation . builds for every architecture the installed torch supports, or set "
                "TORCH_CUDA_ARCH_LIST to include ",
                prop.major, ".", prop.minor));
  }
  check_cuda(err);
}

// Multiprocessor count of the current device, queried once per device (no CUDA call on later steps).
int sm_count() {
  static std::array<int, 64> cached{};  // racing writers store the same value
  const int device = current_device();
  const bool cacheable = device < static_cast<int>(cached.size());
  if (cacheable && cached[device] != 0) return cached[device];
  int count = 0;
  check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device));
  if (cacheable) cached[device] = count;
  return count;
}

bool is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  check_cuda(cudaStreamIsCapturing(stream, &status));
  return status != cudaStreamCaptureStatusNone;
}

// Whether the current device has CUDA's stream-ordered allocator (cudaMallocAsync), asked once per
// device. Every GPU that nanscan's kernels run on has it; a device without it gets no cache.
bool has_stream_ordered_allocator() {
  static std::array<int, 64> cached{};  // 0: not asked, 1: yes, 2: no; racing writers store the same value
  const int device = current_device();
  const bool cacheable = device < static_cast<int>(cached.size());
  if (cacheable && cached[device] != 0) return cached[device] == 1;
  int supported = 0;
  check_cuda(cudaDeviceGetAttribute(&supported, cudaDevAttrMemoryPoolsSupported, device));
  if (cacheable) cached[device] = supported != 0 ? 1 : 2;
  return supported != 0;
}

// A device copy of a list blob, kept across calls, in memory of its own: CUDA's stream-ordered
// allocator, not torch's caching allocator. torch can route a thread's allocations into a private
// pool (torch.compile(mode="reduce-overhead") while it warms up a CUDA graph tree,
// torch.cuda.use_mem_pool), whose blocks are checkpointed and handed out again by later replays or
// allocations: a copy kept there could be overwritten under the cache. Freed on its stream, on its
// device, after the kernels enqueued there that read it, when the last handle goes.
class OwnedDeviceBlob {
 public:
  // The blob's memory on the current device, or null when the allocator is out of memory: torch's
  // cache may hold what it needs, and the caller then uses a copy from torch's allocator instead.
  static std::shared_ptr<const OwnedDeviceBlob> allocate(size_t bytes, cudaStream_t stream) {
    void* ptr = nullptr;
    const cudaError_t err = cudaMallocAsync(&ptr, bytes, stream);
    if (err == cudaErrorMemoryAllocation) {
      (void)cudaGetLastError();  // not left pending for the next launch's check
      return nullptr;
    }
    check_cuda(err);
    return std::shared_ptr<const OwnedDeviceBlob>(new OwnedDeviceBlob(ptr, stream, current_device()));
  }

  // The cache evicts entries of any device, whatever the current one: the free is enqueued with the
  // blob's device current, so that it is ordered on that device's stream (the default stream's
  // handle is null, which CUDA reads as the current device's). Destructors must not throw.
  ~OwnedDeviceBlob() {
    int current = -1;
    const bool switched =
        cudaGetDevice(&current) == cudaSuccess && current != device_ && cudaSetDevice(device_) == cudaSuccess;
    (void)cudaFreeAsync(ptr_, stream_);
    if (switched) (void)cudaSetDevice(current);
    (void)cudaGetLastError();  // an error here is not left pending for the next launch's check
  }
  OwnedDeviceBlob(const OwnedDeviceBlob&) = delete;
  OwnedDeviceBlob& operator=(const OwnedDeviceBlob&) = delete;
  void* get() const { return ptr_; }

 private:
  OwnedDeviceBlob(void* ptr, cudaStream_t stream, int device) : ptr_(ptr), stream_(stream), device_(device) {}
  void* ptr_;
  cudaStream_t stream_;
  int device_;
};

// Device copies of list blobs that a kernel does not take in its parameters: lists too long for them,
// and every list of a kind without an inline kernel (cuda::has_inline_kernel). A training loop scans the same
// gradients on the same stream step after step, so from the second step on its blob is found here
// and a scan of 10,000 tensors is one launch with no upload. An entry serves only the stream it was
// uploaded on (so no cross-stream ordering is needed, and freeing it on eviction is stream-ordered);
// the least recently used of kMaxEntries is evicted.
class DeviceListCache {
 public:
  // The device copy of plan's blob for `stream`: found, or uploaded and kept; null when there is no
  // memory for a new copy outside torch's allocator. The handle keeps the copy alive until the
  // caller has enqueued its kernels, even if another thread evicts it.
  std::shared_ptr<const OwnedDeviceBlob> find_or_upload(const cuda::ListPlan& plan, int device, cudaStream_t stream) {
    const std::lock_guard<std::mutex> lock(mutex_);
    ++clock_;
    for (Entry& e : entries_) {
      if (e.device_index == device && e.stream == stream && e.blob.size() == plan.bytes() &&
          memcmp(e.blob.data(), plan.blob(), plan.bytes()) == 0) {
        e.last_use = clock_;
        return e.device;
      }
    }
    auto copy = OwnedDeviceBlob::allocate(plan.bytes(), stream);
    if (copy == nullptr) return nullptr;
    check_launch(cuda::upload_list(plan, copy->get(), stream));
    if (entries_.size() == kMaxEntries) {
      entries_.erase(std::min_element(entries_.begin(), entries_.end(),
                                      [](const Entry& a, const Entry& b) { return a.last_use < b.last_use; }));
    }
    entries_.push_back(
        Entry{device, stream, std::vector<unsigned char>(plan.blob(), plan.blob() + plan.bytes()), copy, clock_});
    return copy;
  }

 private:
  static constexpr size_t kMaxEntries = 8;
  struct Entry {
    int device_index;  // a stream handle alone does not name its device (the default stream is null on each)
    cudaStream_t stream;
    std::vector<unsigned char> blob;
    std::shared_ptr<const OwnedDeviceBlob> device;
    uint64_t last_use;
  };
  std::mutex mutex_;
  std::vector<Entry> entries_;
  uint64_t clock_ = 0;
};

// Never destroyed: its blocks would otherwise be freed after the CUDA context at process exit.
DeviceListCache& device_list_cache() {
  static auto* cache = new DeviceListCache();
  return *cache;
}

// Where the kernels read a plan from: the parameters (blob null), the cache, or a copy made for this
// call alone: while a CUDA graph is being captured, from the graph's memory pool, which the graph
// keeps for as long as it lives and whose upload every replay repeats (a cached copy could be evicted
// under a live graph); on a device without the stream-ordered allocator; and when that allocator is
// out of memory (torch's allocator can free its cache to make room).
struct DeviceList {
  const void* blob = nullptr;
  std::shared_ptr<const OwnedDeviceBlob> cached;
  OwnedTensor for_this_call;
};

// `in_parameters`: the kernel takes the list in its parameters (cuda::list_in_parameters for a scan,
// cuda::fits_in_parameters for a scale), so no copy is made.
DeviceList device_list(const cuda::ListPlan& plan, bool in_parameters, const TensorInfo& like, cudaStream_t stream) {
  DeviceList list;
  if (in_parameters) return list;
  if (!is_capturing(stream) && has_stream_ordered_allocator()) {
    list.cached = device_list_cache().find_or_upload(plan, like.device_index, stream);
    if (list.cached != nullptr) {
      list.blob = list.cached->get();
      return list;
    }
  }
  list.for_this_call =
      empty({static_cast<int64_t>(plan.bytes())}, dtype_codes().uint8, like.device_type, like.device_index);
  check_launch(cuda::upload_list(plan, list.for_this_call.data(), stream));
  list.blob = list.for_this_call.data();
  return list;
}

// The plan of a list; the blob buffer is reused from call to call on a thread.
const cuda::ListPlan& plan_of(const std::vector<cuda::TensorArg>& args) {
  thread_local cuda::ListPlan plan;
  NANSCAN_CHECK(plan.build(args.data(), static_cast<int64_t>(args.size())),
                "nanscan: the tensor list is too large for one scan (over 2^31 chunks of 32 KiB)");
  return plan;
}

// Multiplies dense tensors with the CUDA kernel (it exits at once when *coef is 1) and non-dense ones
// with ATen (rare for gradients).
void multiply_in_place(const TensorListArg& tensors, const std::vector<DType>& tags, const TensorInfo& coef,
                       DType coef_tag, cuda::CoefRounding rounding, cudaStream_t stream) {
  std::vector<cuda::TensorArg> dense;
  dense.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    const TensorInfo& t = tensors[i];
    if (t.numel == 0) continue;
    if (t.dense) {
      dense.push_back(cuda::TensorArg{t.data, t.numel, tags[i]});
      continue;
    }
    const NoGradGuard no_grad;
    torch::stable::Tensor target = stable(t.handle);
    if (rounding == cuda::CoefRounding::ToTensorDtype) {
      mul_(t.handle, torch::stable::to(stable(coef.handle), target.scalar_type()).get());
    } else if (tags[i] == DType::Float16 || tags[i] == DType::BFloat16) {
      // torch's unscale arithmetic for the rare strided gradient: the fp32 factor times the value in
      // float (double for fp64), rounded once. Not torch's own unscale op: its CUDA kernel has no bf16
      // (torch 2.11); and not a plain mul_, which would round a 0-dim CUDA factor to fp16/bf16 first.
      const torch::stable::Tensor wide = torch::stable::to(target, torch::headeronly::ScalarType::Float);
      mul_(wide.get(), coef.handle);
      torch::stable::copy_(target, wide);
    } else {
      mul_(t.handle, coef.handle);
    }
  }
  if (dense.empty()) return;
  const cuda::ListPlan& plan = plan_of(dense);
  const DeviceList list = device_list(plan, cuda::fits_in_parameters(plan), tensors[0], stream);
  // Whether the kernel writes is decided on the device (coef == 1 writes nothing); the host cannot
  // know without a sync, so nanscan/_ops.py counts every call as a write of every tensor.
  check_launch(cuda::scale(plan, list.blob, coef.data, coef_tag, rounding, sm_count(), stream));
}

// One scan launch on the tensors' device and current stream, its results to `out` (the options in
// `out`: fp16 range, checksum).
void launch_scan(const TensorListArg& tensors, const std::vector<DType>& tags, const ResultPointers& out,
                 const float* multiply_by) {
  std::vector<OwnedTensor> copies;
  copies.reserve(tensors.size());
  const cuda::ListPlan& plan = plan_of(tensor_args(tensors, tags, copies));
  const cuda::ScanKind kind = multiply_by != nullptr ? cuda::ScanKind::Unscale
                              : out.half_range       ? cuda::ScanKind::HalfRange
                              : out.checksum         ? cuda::ScanKind::Checksum
                                                     : cuda::ScanKind::Plain;
  const TensorInfo& like = tensors[0];
  const cudaStream_t stream = current_stream(like.device_index);
  const DeviceList list = device_list(plan, cuda::list_in_parameters(plan, kind), like, stream);
  const int num_sms = sm_count();
  const auto workspace_bytes = static_cast<int64_t>(cuda::scan_workspace_bytes(plan, kind, num_sms));
  const OwnedTensor workspace = empty({workspace_bytes}, dtype_codes().uint8, like.device_type, like.device_index);
  check_launch(cuda::scan(plan, list.blob, kind, out, workspace.data(), static_cast<size_t>(workspace_bytes), num_sms,
                          stream, multiply_by));
}

ScanOutputs scan_and_maybe_multiply(const TensorListArg& tensors, const std::vector<DType>& tags, ScanOptions options,
                                    const float* multiply_by) {
  ScanOutputs out = allocate_scan_outputs(tags, tensors[0], options);
  launch_scan(tensors, tags, result_pointers(out, static_cast<int64_t>(tensors.size()), options), multiply_by);
  return out;
}

// scan_into_(Tensor[] tensors, bool fp16_range, Tensor(a!) counts, Tensor(b!) stats, int column) -> ():
// one launch, its results into the caller's columns; only the workspace is allocated.
void scan_into_cuda(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const ScanIntoArgs args(stack, num_args, num_outputs);
  const CudaDeviceGuard guard(args.tensors[0].device_index);
  launch_scan(args.tensors, args.tags, args.out, nullptr);
}

// scan(Tensor[] tensors, bool fp16_range, bool checksum) -> 5 tensors
void scan_cuda(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const ScanArgs args(stack, num_args, num_outputs);
  const CudaDeviceGuard guard(args.tensors[0].device_index);
  return_outputs(stack, scan_and_maybe_multiply(args.tensors, args.tags, args.options, nullptr));
}

// scale_(Tensor(a!)[] tensors, Tensor coef) -> ()
void scale_cuda(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const ScaleArgs args(stack, num_args, num_outputs);
  if (args.tensors.empty()) return;
  const int32_t device = args.tensors[0].device_index;
  const CudaDeviceGuard guard(device);
  multiply_in_place(args.tensors, args.tags, args.coef, *dtype_tag(args.coef.dtype), cuda::CoefRounding::ToTensorDtype,
                    current_stream(device));
}

// unscale_scan_(Tensor(a!)[] tensors, Tensor inv_scale) -> 5 tensors. GradScaler's unscale fused
// with the scan: one read and one write of every gradient. A list with a non-dense tensor (the kernel
// reads those from a contiguous copy, which it must not write) takes two steps instead: the
// multiply, then the scan.
void unscale_scan_cuda(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const UnscaleScanArgs args(stack, num_args, num_outputs);
  const int32_t device = args.tensors[0].device_index;
  const CudaDeviceGuard guard(device);
  for (const TensorInfo& t : args.tensors.infos()) {
    if (t.numel > 0 && !t.dense) {
      multiply_in_place(args.tensors, args.tags, args.inv_scale, DType::Float32, cuda::CoefRounding::None,
                        current_stream(device));
      return_outputs(stack, scan_and_maybe_multiply(args.tensors, args.tags, ScanOptions{}, nullptr));
      return;
    }
  }
  // inv_scale is one float32 element (checked); a strided one-element tensor still points at it.
  const auto* factor = static_cast<const float*>(args.inv_scale.data);
  return_outputs(stack, scan_and_maybe_multiply(args.tensors, args.tags, ScanOptions{}, factor));
}

// scan_difference(Tensor[] before, Tensor[] after) -> 5 tensors, of 2N entries: the differences
// before[i] - after[i], then the afters (csrc/ops.cpp). One launch reads each pair once (the kernel's
// plan: the befores, then the afters). A pair not laid out alike in memory (a transposed copy, a
// strided view) is read from contiguous copies of both.
void scan_difference_cuda(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const DifferenceArgs call(stack, num_args, num_outputs);
  const TensorListArg& before = call.before;
  const TensorListArg& after = call.after;
  const DifferenceTags& tags = call.tags;
  const auto n = static_cast<int64_t>(before.size());
  const TensorInfo& like = after[0];
  const CudaDeviceGuard guard(like.device_index);
  std::vector<OwnedTensor> copies;
  std::vector<cuda::TensorArg> args(static_cast<size_t>(2 * n));
  for (int64_t i = 0; i < n; ++i) {
    const TensorInfo& b = before[i];
    const TensorInfo& a = after[i];
    const void* before_data = b.data;
    const void* after_data = a.data;
    if (a.numel > 0 && !same_dense_layout(b, a)) {
      copies.push_back(contiguous(b.handle));
      before_data = copies.back().data();
      copies.push_back(contiguous(a.handle));
      after_data = copies.back().data();
    }
    args[i] = cuda::TensorArg{before_data, b.numel, tags.before[i]};
    args[n + i] = cuda::TensorArg{after_data, a.numel, tags.after[i]};
  }
  const cuda::ListPlan& plan = plan_of(args);
  const cudaStream_t stream = current_stream(like.device_index);
  ScanOutputs out = allocate_scan_outputs(tags.all, like, ScanOptions{});
  const DeviceList list = device_list(plan, cuda::list_in_parameters(plan, cuda::ScanKind::Difference), like, stream);
  const int num_sms = sm_count();
  const auto workspace_bytes =
      static_cast<int64_t>(cuda::scan_workspace_bytes(plan, cuda::ScanKind::Difference, num_sms));
  const OwnedTensor workspace = empty({workspace_bytes}, dtype_codes().uint8, like.device_type, like.device_index);
  check_launch(cuda::scan(plan, list.blob, cuda::ScanKind::Difference, result_pointers(out, 2 * n, ScanOptions{}),
                          workspace.data(), static_cast<size_t>(workspace_bytes), num_sms, stream));
  return_outputs(stack, std::move(out));
}

// sketch(Tensor[] tensors, int buckets, int seed) -> (sketches, sumsq): the update sketch (cuda/sketch_cuda.h),
// its tensor table copied to the device by the upload kernel (no pinned buffer: capturable), in memory
// from torch's allocator kept until the launch is enqueued.
void sketch_cuda(StableIValue* stack, uint64_t num_args, uint64_t num_outputs) {
  const TensorListArg tensors(stack[0]);
  SketchCall call = prepare_sketch(tensors, stack, num_args, num_outputs);
  const TensorInfo& like = tensors[0];
  const CudaDeviceGuard guard(like.device_index);
  const auto n = static_cast<int64_t>(call.tensors.size());
  std::vector<cuda::TensorArg> args(call.tensors.size());
  for (size_t i = 0; i < call.tensors.size(); ++i) {
    args[i] = cuda::TensorArg{call.tensors[i].data, call.tensors[i].numel, call.tags[i]};
  }
  const cuda::SketchTable table = cuda::sketch_table(args.data(), n, call.buckets);
  const size_t table_bytes = table.tensors.size() * sizeof(cuda::SketchTensor);
  std::vector<unsigned char> staged((table_bytes + 15) / 16 * 16, 0);
  memcpy(staged.data(), table.tensors.data(), table_bytes);
  const cudaStream_t stream = current_stream(like.device_index);
  const OwnedTensor device_table =
      empty({static_cast<int64_t>(staged.size())}, dtype_codes().uint8, like.device_type, like.device_index);
  check_launch(cuda::upload_bytes(staged.data(), staged.size(), device_table.data(), stream));
  check_launch(cuda::sketch(table, static_cast<const cuda::SketchTensor*>(device_table.data()), call.buckets, call.seed,
                            static_cast<double*>(call.sketches.data()), static_cast<double*>(call.sumsq.data()),
                            sm_count(), stream));
  return_sketch(stack, std::move(call));
}

}  // namespace
}  // namespace nanscan

// The module nanscan/_ops.py imports (its name, e.g. _C_cuda13, is setup.py's NANSCAN_CUDA_MODULE):
// importing it runs the registration below. cuda_archs: the TORCH_CUDA_ARCH_LIST the kernels were
// compiled for (tests/test_build.py compares it with the fatbinary); cuda_major: the CUDA major of
// the toolkit, whose libcudart.so.<major> the library needs; cuda_version: the toolkit's version as
// CUDART_VERSION gives it (12040 for 12.4), which says the newest architecture its nvcc could target.
#ifndef NANSCAN_CUDA_MODULE
#error "setup.py names the module: NANSCAN_CUDA_MODULE=_C_cuda<major>"
#endif
#define NANSCAN_CONCAT_(a, b) a##b
#define NANSCAN_CONCAT(a, b) NANSCAN_CONCAT_(a, b)
#define NANSCAN_STRING_(a) #a
#define NANSCAN_STRING(a) NANSCAN_STRING_(a)

PyMODINIT_FUNC NANSCAN_CONCAT(PyInit_, NANSCAN_CUDA_MODULE)(void) {
  static PyModuleDef module_def = {PyModuleDef_HEAD_INIT,
                                   NANSCAN_STRING(NANSCAN_CUDA_MODULE),
                                   nullptr,
                                   -1,
                                   nullptr,
                                   nullptr,
                                   nullptr,
                                   nullptr,
                                   nullptr};
  PyObject* module = PyModule_Create(&module_def);
  if (module != nullptr && (PyModule_AddStringConstant(module, "cuda_archs", NANSCAN_CUDA_ARCHS) != 0 ||
                            PyModule_AddIntConstant(module, "cuda_major", CUDART_VERSION / 1000) != 0 ||
                            PyModule_AddIntConstant(module, "cuda_version", CUDART_VERSION) != 0)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}

STABLE_TORCH_LIBRARY_IMPL(nanscan, CUDA, m) {
  m.impl("scan", &nanscan::scan_cuda);
  m.impl("scan_into_", &nanscan::scan_into_cuda);
  m.impl("scale_", &nanscan::scale_cuda);
  m.impl("unscale_scan_", &nanscan::unscale_scan_cuda);
  m.impl("scan_difference", &nanscan::scan_difference_cuda);
  m.impl("sketch", &nanscan::sketch_cuda);
}
