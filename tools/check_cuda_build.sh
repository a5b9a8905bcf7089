#!/usr/bin/env bash
# Compiles the torch-free CUDA sources with nvcc for sm_80 and sm_90 and fails on any error or warning.
# Runs without a GPU (CI has none); prints the per-kernel resource usage for the record.
set -euo pipefail
cd "$(dirname "$0")/.."
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
NVCC="$CUDA_HOME/bin/nvcc"
if [ ! -x "$NVCC" ]; then
  echo "check_cuda_build: no nvcc at $NVCC (set CUDA_HOME)" >&2
  exit 1
fi
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
status=0
for src in csrc/cuda/*.cu; do
  for arch in 80 90; do
    log="$out/$(basename "$src").sm_$arch.log"
    if ! "$NVCC" -c "$src" -o "$out/$(basename "$src").sm_$arch.o" -std=c++17 -O3 \
        -gencode "arch=compute_$arch,code=sm_$arch" --expt-relaxed-constexpr \
        -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror -Xptxas -v >"$log" 2>&1; then
      echo "check_cuda_build: FAILED $src for sm_$arch" >&2
      cat "$log" >&2
      status=1
      continue
    fi
    regs=$(grep -Eo "Used [0-9]+ registers" "$log" | tr '\n' ' ')
    spills=$(grep -Eo "[0-9]+ bytes spill stores" "$log" | sort -u | tr '\n' ' ')
    echo "check_cuda_build: ok $src sm_$arch (${regs:-no kernels}; ${spills:-no spill report})"
  done
done
exit $status
