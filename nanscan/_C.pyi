# The compiled library (csrc/ops.cpp). Importing it registers the torch.ops.nanscan operators.

with_cuda: int  # 1 when the CUDA backend was built, 0 for a CPU-only build
