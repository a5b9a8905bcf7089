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
compile() {  # compile SRC ARCH: an object and its ptxas report in $out; the exit status is nvcc's
  "$NVCC" -c "$1" -o "$out/$(basename "$1").sm_$2.o" -std=c++17 -O3 \
    -gencode "arch=compute_$2,code=sm_$2" --expt-relaxed-constexpr \
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

# The sm_90 resources the H100 measurements rest on (benchmarks/NOTES.md entry 25): every scan kernel
# at most 80 registers (3 resident blocks of 256 threads per SM), no spill in the kernels without
# the checksum, and at most 64 bytes in the checksum ones (16-48 when measured). A change that
# pushes ptxas past that changes occupancy unseen: it fails here, and wants a GPU measurement
# before it lands. (`-Xptxas -v` prints, per kernel: the entry, its stack and
# spill line, its register line.) The difference kernel (entry 40) takes at most 128 registers (2
# resident blocks) with no spill, in it or in difference_run_any, the function ptxas keeps apart
# (its "Function properties" line, which follows the kernel's in the report).
if ! python - "$out/scan_cuda.cu.sm_90.log" <<'PY'
import re, sys
kernels, differences = [], []
for block in open(sys.argv[1]).read().split("Compiling entry function '")[1:]:
    name = block.split("'", 1)[0]
    spill, regs = re.search(r"(\d+) bytes spill stores", block), re.search(r"Used (\d+) registers", block)
    if "scan_kernel" in name and spill and regs:
        kernels.append((name, spill.group(1), regs.group(1)))
    if "difference_kernel" in name and regs:
        frames = [int(b) for b in re.findall(r"(\d+) bytes stack frame", block)]
        spills = [int(b) for b in re.findall(r"(\d+) bytes spill stores", block)]
        differences.append((name, max(frames + spills, default=0), regs.group(1)))
bad = []
for name, local_bytes, regs in differences:
    if int(regs) > 128 or local_bytes:
        bad.append(f"{name}: {regs} registers, {local_bytes} bytes of stack or spill")
# difference_run_any's own lines, wherever ptxas prints them: present, and no stack or spill.
callee = re.findall(
    r"Function properties for \S*difference_run_any\S*\s+(\d+) bytes stack frame, (\d+) bytes spill stores",
    open(sys.argv[1]).read(),
)
if not callee:
    bad.append("no ptxas report of difference_run_any (inlined or renamed? then update this check)")
bad += [f"difference_run_any: {frame} bytes stack frame, {spill} bytes spilled" for frame, spill in callee if int(frame) or int(spill)]
for name, spill, regs in kernels:
    checksum = re.search(r"scan_kernelIL(b[01])EL(b[01])EL(b[01])E", name).group(3) == "b1"
    if int(regs) > 80 or int(spill) > (64 if checksum else 0):
        bad.append(f"{name}: {regs} registers, {spill} bytes spilled")
if not kernels or not differences or bad:
    print("\n".join(bad) or "no scan or difference kernel in the ptxas report", file=sys.stderr)
    sys.exit(1)
print(f"check_cuda_build: ok sm_90 scan kernels: {len(kernels)} at <= 80 registers, spill only in the checksum's;"
      f" difference kernels: {len(differences)} at <= 128 registers, no spill")
PY
then
  echo "check_cuda_build: FAILED: sm_90 scan or difference kernel resources moved (see above)" >&2
  status=1
fi

# Flush-to-zero would turn subnormal gradients into zeros in min/max and the norm (-use_fast_math or
# -ftz=true do that); the PTX must have no .ftz instruction.
if "$NVCC" -ptx csrc/cuda/scan_cuda.cu -o "$out/scan_cuda.ptx" -std=c++17 -O3 -arch=compute_90 \
    --expt-relaxed-constexpr -Werror all-warnings >"$out/ptx.log" 2>&1; then
  if grep -q "\.ftz" "$out/scan_cuda.ptx"; then
    echo "check_cuda_build: FAILED: the PTX flushes subnormals (.ftz):" >&2
    grep -m5 "\.ftz" "$out/scan_cuda.ptx" >&2
    status=1
  else
    echo "check_cuda_build: ok no flush-to-zero in the PTX"
  fi
else
  echo "check_cuda_build: FAILED to make PTX" >&2
  cat "$out/ptx.log" >&2
  status=1
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
