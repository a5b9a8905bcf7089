#!/usr/bin/env bash
# Everything that needs a GPU, in stages that each fit one device command (10 minutes). Logs and
# JSON go to $OUT when set (the device tool's folder), else benchmarks/out/gpu; copy the figures into
# benchmarks/RESULTS.md with the device, the date and the command.
# The benchmarks read the model shapes from benchmarks/zoo.json, which travels with the checkout.
#
#   tools/gpu_session.sh build             # build the extension for this GPU (sm_90 by default)
#   tools/gpu_session.sh test              # build, then the whole test suite (CUDA tests included)
#   tools/gpu_session.sh sanitize TOOL...  # build, then compute-sanitizer with each TOOL (memcheck,
#                                          # racecheck, synccheck, initcheck; default all four)
#   tools/gpu_session.sh bench             # build, then bench_scan (zoo + 10,000 x 1K) and bench_train_step
#   tools/gpu_session.sh scan-bounds       # bench_scan's plain and checksum rows with the scan kernels
#                                          # built as they are and with 3 resident blocks per SM asked of
#                                          # ptxas (NOTES.md entry 24), then the default build again
#   tools/gpu_session.sh all               # test, sanitize, bench: longer than one 10-minute command
#
# memcheck, racecheck and synccheck instrument nanscan's kernels only (the sanitizer's kernel-name
# filter: "nanscan" is in their names); initcheck instruments every kernel, since it would take a
# filtered-out kernel's writes (torch's clamp of the clip coefficient, a .contiguous() copy) for
# uninitialized memory. The workload launches ~400 torch kernels besides nanscan's (benchmarks/
# NOTES.md, entry 15), so one tool per command ends well inside 10 minutes: `sanitize memcheck`,
# then `sanitize racecheck`, ... The sanitizer needs a Firecracker machine (nvidia-h100-x1 so far):
# on gVisor it refuses the device (the device tool's KINDS.md).
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:?usage: tools/gpu_session.sh build|test|sanitize [TOOL...]|bench|scan-bounds|all}"
shift
out="${OUT:-benchmarks/out/gpu}"
mkdir -p "$out"
# No CUDA_HOME default: setup.py finds the toolkit as torch does (nvcc on PATH, /usr/local/cuda).
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"

build() {
  echo "== build ($(date -u +%FT%TZ))"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  "$PY" -m pip install --no-build-isolation --no-deps -q -e . >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; return 1; }
  tail -3 "$out/build.log"
  "$PY" -c "import nanscan, torch; r = nanscan.scan([torch.ones(3, device='cuda')]); print('built: norm', r.total_norm.item())"
}

tests() {
  echo "== tests"
  # The device image has pytest-xdist: 8 workers ran the whole suite in about 4 minutes on the H100
  # machine (16 cores). test_cuda.py goes first, alone, so its timings are not shared with others.
  "$PY" -m pytest -q -rfE tests/test_cuda.py 2>&1 | tee "$out/pytest_cuda.log" | tail -8
  local parallel=()
  "$PY" -c "import xdist" 2>/dev/null && parallel=(-n 8)
  "$PY" -m pytest -q -rfE "${parallel[@]}" tests 2>&1 | tee "$out/pytest.log" | tail -15
}

sanitize() {
  echo "== compute-sanitizer"
  local status=0 sanitizer help filter t start
  local tools=("$@")
  [ ${#tools[@]} -gt 0 ] || tools=(memcheck racecheck synccheck initcheck)
  sanitizer="$(command -v compute-sanitizer || echo "${CUDA_HOME:-/usr/local/cuda}/bin/compute-sanitizer")"
  [ -x "$sanitizer" ] || { echo "no compute-sanitizer on PATH or in \$CUDA_HOME/bin" >&2; return 1; }
  # The filter option's name changed over releases: --filter, --kernel-regex (2021.2), --kernel-name
  # (2023.3). Read the help once (a pipe into grep -q could kill it early under pipefail).
  help="$("$sanitizer" --help 2>&1 || true)"
  case "$help" in
    *"--kernel-name "*) filter=(--kernel-name kns=nanscan) ;;
    *"--kernel-regex "*) filter=(--kernel-regex kns=nanscan) ;;
    *) filter=(--filter kns=nanscan) ;;
  esac
  echo "$("$sanitizer" --version 2>&1 | tail -1); filter for memcheck/racecheck/synccheck: ${filter[*]}"
  for t in "${tools[@]}"; do
    local options=("${filter[@]}")
    [ "$t" != initcheck ] || options=()
    start=$SECONDS
    if PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool "$t" "${options[@]}" --error-exitcode 17 \
        "$PY" tools/sanitize_workload.py >"$out/sanitize_$t.log" 2>&1; then
      echo "$t: clean in $((SECONDS - start)) s ($(grep -c . "$out/sanitize_$t.log") log lines)"
    else
      echo "$t: FAILED after $((SECONDS - start)) s, see $out/sanitize_$t.log"; tail -30 "$out/sanitize_$t.log"; status=1
    fi
  done
  return $status
}

bench() {
  echo "== benchmarks"
  "$PY" benchmarks/bench_scan.py --device cuda --models gpt2-small,llama-1b,many_small_10000x1024,many_small_2000x512 \
      --json "$out/bench_scan_cuda.json" 2>"$out/bench_scan_cuda.err" | tee "$out/bench_scan_cuda.txt" | tail -12
  "$PY" benchmarks/bench_train_step.py --json "$out/train_step.json" 2>"$out/train_step.err" | tee "$out/train_step.txt"
}

# The flag reaches nvcc through NVCC_APPEND_FLAGS, which the build's dependency tracking does not see:
# each variant is a clean build.
scan_bounds() {
  for blocks in 0 3; do
    echo "== scan kernels, NANSCAN_SCAN_MIN_BLOCKS=$blocks"
    rm -rf build nanscan/_C*.so
    NVCC_APPEND_FLAGS="-DNANSCAN_SCAN_MIN_BLOCKS=$blocks" build
    "$PY" benchmarks/bench_scan.py --device cuda --models gpt2-small,llama-1b,many_small_10000x1024 \
        --dtype float32,bfloat16 --json "$out/scan_bounds_$blocks.json" 2>"$out/scan_bounds_$blocks.err" |
      tee "$out/scan_bounds_$blocks.txt" | grep -E "^== |^ceiling_sum|^nanscan.scan"
  done
  echo "== the default build again, for what follows"
  rm -rf build nanscan/_C*.so
  build
}

case "$stage" in
  build) build ;;
  scan-bounds) scan_bounds ;;
  test) build; tests ;;
  sanitize) build; sanitize "$@" ;;
  bench) build; bench ;;
  all) build; tests || true; sanitize || true; bench ;;  # one failing stage does not hide the others' results
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
