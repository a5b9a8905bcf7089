#!/usr/bin/env bash
# Everything that needs a GPU, in stages that each fit one device command (10 minutes). Logs and
# JSON go to OUTDIR (default $OUT when set, else benchmarks/out/gpu); copy the figures into
# benchmarks/RESULTS.md with the device, the date and the command.
# The benchmarks read the zoo from ../shared/zoo.json, which does not travel to a GPU machine: copy it
# into the checkout first (`mkdir -p shared && cp ../shared/zoo.json shared/`; shared/ is ignored by
# git and travels with the working tree).
#
#   tools/gpu_session.sh build       # build the extension for this GPU (sm_90 by default)
#   tools/gpu_session.sh test        # build, then the whole test suite (CUDA tests included)
#   tools/gpu_session.sh sanitize    # build, then compute-sanitizer memcheck/racecheck/synccheck/initcheck
#   tools/gpu_session.sh bench       # build, then bench_scan (zoo + 10,000 x 1K) and bench_train_step
#   tools/gpu_session.sh all         # test, sanitize, bench: longer than one 10-minute command
set -euo pipefail
cd "$(dirname "$0")/.."
stage="${1:?usage: tools/gpu_session.sh build|test|sanitize|bench|all [OUTDIR]}"
out="${2:-${OUT:-benchmarks/out/gpu}}"
mkdir -p "$out"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
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
  "$PY" -m pytest -q tests 2>&1 | tee "$out/pytest.log" | tail -15
}

sanitize() {
  echo "== compute-sanitizer"
  local status=0 sanitizer
  sanitizer="$(command -v compute-sanitizer || echo "$CUDA_HOME/bin/compute-sanitizer")"
  for tool in memcheck racecheck synccheck initcheck; do
    if PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool "$tool" --error-exitcode 17 \
        "$PY" tools/sanitize_workload.py >"$out/sanitize_$tool.log" 2>&1; then
      echo "$tool: clean ($(grep -c . "$out/sanitize_$tool.log") log lines)"
    else
      echo "$tool: FAILED, see $out/sanitize_$tool.log"; tail -30 "$out/sanitize_$tool.log"; status=1
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

case "$stage" in
  build) build ;;
  test) build; tests ;;
  sanitize) build; sanitize ;;
  bench) build; bench ;;
  all) build; tests || true; sanitize || true; bench ;;  # one failing stage does not hide the others' results
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
