# The compiled library (csrc/ops.cpp). Importing it registers the torch.ops.nanscan operators.

with_cuda: int  # 1 when the CUDA backend was built, 0 for a CPU-only build
cuda_archs: str  # the TORCH_CUDA_ARCH_LIST its kernels were built for ("7.5;...;12.0+PTX"); "" without CUDA
