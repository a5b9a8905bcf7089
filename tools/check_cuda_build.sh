#!/usr/bin/env bash
# Compiles the torch-free CUDA sources with nvcc for sm_80 and sm_90, failing on any error or warning,
# holds the sm_90 kernels to their register and stack budget with no flush-to-zero in the PTX
# (tools/kernel_budget.py, which needs cuobjdump: pip install nvidia-cuda-cuobjdump), and checks the
# binding's syntax against torch's stable headers. No GPU needed: a developer's check in a minute or
# two, without a whole build. CI checks the same on the wheel it builds (NANSCAN_WERROR=1, and
# tests/test_build.py runs kernel_budget.py on the wheel's CUDA library): one CUDA compile, not two.
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
compile() {  # compile SRC ARCH: an object (SASS and PTX) and its ptxas report in $out; the exit status is nvcc's
  "$NVCC" -c "$1" -o "$out/$(basename "$1").sm_$2.o" -std=c++17 -O3 \
    -gencode "arch=compute_$2,code=[sm_$2,compute_$2]" --expt-relaxed-constexpr \
    -Werror all-warnings -Xcompiler -Wall,-Wextra,-Werror -Xptxas -v >"$out/$(basename "$1").sm_$2.log" 2>&1
}
for src in csrc/cuda/*.cu; do
  # The two architectures side by side (nvcc uses one core; CI has two), then their reports in order.
  pids=()
  for arch in 80 90; do
    compile "$src" "$arch" &
    pids+=("$!")
  done
  for i in 0 1; do
    arch=$([ "$i" = 0 ] && echo 80 || echo 90)
    log="$out/$(basename "$src").sm_$arch.log"
    if ! wait "${pids[$i]}"; then
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

# The sm_90 kernels' registers and stack, and the PTX, on the object just built (the budget and its
# reasons: tools/kernel_budget.py).
objects=("$out"/*.cu.sm_90.o)
if [ -f "${objects[0]}" ]; then
  python tools/kernel_budget.py "${objects[@]}" || status=1
fi

# The binding, against torch's stable headers as setup.py compiles it (the target version, USE_CUDA for
# the shim's CUDA calls): a CPU torch's headers declare them too, so no CUDA torch is needed.
includes=$(python -c "import sysconfig, torch.utils.cpp_extension as c; print(' '.join('-I' + p for p in c.include_paths() + [sysconfig.get_paths()['include']]))")
stable_flags=$(python -c "
import ast
tree = ast.parse(open('setup.py').read())
for node in tree.body:
    if isinstance(node, ast.Assign) and getattr(node.targets[0], 'id', '') == 'TORCH_TARGET_VERSION':
        print('-DTORCH_TARGET_VERSION=' + node.value.value)
")
# shellcheck disable=SC2086
if g++ -std=c++20 -fsyntax-only -Wall -Wextra -Wno-unused-parameter -Werror $includes $stable_flags -DUSE_CUDA \
    -DNANSCAN_CUDA_MODULE=_C_cuda_check -I"$CUDA_HOME/include" csrc/cuda_binding.cpp 2>"$out/binding.log"; then
  echo "check_cuda_build: ok csrc/cuda_binding.cpp (syntax and types against torch's stable headers)"
else
  echo "check_cuda_build: FAILED csrc/cuda_binding.cpp" >&2
  grep -v "^In file included" "$out/binding.log" | head -40 >&2
  status=1
fi
exit $status
