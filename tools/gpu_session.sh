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
#   tools/gpu_session.sh bench [ARGS...]   # build, then bench_scan (ARGS: its options; default
#                                          # gpt2-small and 10,000 x 1K fp32), bench_train_step
#                                          # (batch 64), bench_list_layout and bench_locate
#                                          # (decoder and gpt2, bf16 autocast)
#   tools/gpu_session.sh magnitudes        # build, then bench_scan at tiny, vanishing, overflow-step
#                                          # and all-NaN values beside ordinary ones (issue 27)
#   tools/gpu_session.sh scan-variants [NAME=VALUE...]  # bench_scan's scan and checksum rows and an
#                                          # ncu profile, for the kernels as built and for each -DNAME=VALUE
#                                          # build (default: NANSCAN_SCAN_MIN_BLOCKS=0 and =4),
#                                          # then the default build back in place (~6 minutes)
#   tools/gpu_session.sh ncu-source        # a -lineinfo build (the same machine code), then ncu's
#                                          # source counters and instruction mix of tools/ncu_scan.py's
#                                          # launches: where the 10,000 x 1K scan's 963 instructions per
#                                          # tensor go (NOTES.md entry 28); the report file to $out (~2 min)
#   tools/gpu_session.sh no-kernel         # a copy built for sm_80 only (no PTX), in a temporary
#                                          # folder: its first scan on this sm_90 GPU must fail naming
#                                          # the GPU and the architectures held (issue 34, ~2 minutes)
#   tools/gpu_session.sh nccl              # build, then tools/nccl_one_rank.py: check, clip, the
#                                          # GradScaler, the recorder and verify_replicas under a
#                                          # one-rank NCCL group, FSDP2, DDP + attach and FSDP1, no sync
#   tools/gpu_session.sh host              # build, then bench_host.py on the GPU: host ns per tensor of
#                                          # check(params), the clips and the scalers, 10,000 tensors
#   tools/gpu_session.sh lend              # a lend's first command, most needed first, each stage
#                                          # bounded in time: build, the CUDA tests, then the whole
#                                          # suite with sanitize beside it (~7 minutes); the timings
#                                          # are the next command's (`capabilities`, ~4 minutes)
#   tools/gpu_session.sh ab NAME=VALUE [ROWS]  # the default build and a -DNAME=VALUE one side by
#                                          # side, then the rows of each: ROWS scan (bench_scan's, the
#                                          # default) or updates (bench_state --updates: the update
#                                          # watch's difference kernel, e.g. with
#                                          # NANSCAN_DIFFERENCE_MIN_BLOCKS=3) (~5 minutes)
#   tools/gpu_session.sh subwarp           # the small-tensor path: build (and one without it beside),
#                                          # test_cuda.py, memcheck and racecheck, the scan rows of both
#   tools/gpu_session.sh capabilities      # build, then bench_activations (GPT-2 size, fp16 autocast,
#                                          # with its --profile split), bench_state on the GPU
#                                          # (check_state, and the update watch's sampled step:
#                                          # --updates), bench_host and bench_list_layout (~3.5 minutes)
#   tools/gpu_session.sh wheel WHEEL       # the wheel as it ships (tools/build_wheel.sh, carried in:
#                                          # dist/ is git-ignored): its libraries in a copy of the
#                                          # checkout, no build; --version, test_build.py with a CUDA
#                                          # library required, test_cuda.py (~2 minutes; issue 34)
#   NANSCAN_PREBUILT=1 tools/gpu_session.sh STAGE   # any stage, with the library already built
#   tools/gpu_session.sh prebuild          # HERE, without a GPU: the libraries for the device (sm_90,
#                                          # CUDA 13), built in place to be carried (~4 minutes on 2 cores)
#
# Each device command may land on a bare machine, whose build is ~100 s. Not to pay it at all: run
# `prebuild` here first, name nanscan/_C.abi3.so and nanscan/_C_cuda13.abi3.so in the device tool's
# `carry` (they are git-ignored, so they do not travel otherwise), and run every stage with
# NANSCAN_PREBUILT=1 (if they fail to run there, the device builds its own). Or pay it once: end the
# first command with `tar czf $OUT/libs.tgz nanscan/_C*.so`, untar that here and carry the two files;
# later commands then run with NANSCAN_PREBUILT=1. A bare machine has no editable install either:
# scripts run from the checkout find nanscan with `PYTHONPATH=$PWD`.
#   tools/gpu_session.sh all               # test, sanitize, bench: longer than one 10-minute command
#
# A 15-minute lend (device time counts from the machine's start, ~1-2 minutes, to its return):
#   here, first:  PYTHON=python tools/gpu_session.sh prebuild      (no device time)
#   device:       NANSCAN_PREBUILT=1 tools/gpu_session.sh lend     (~7-8 min: the CUDA tests, then
#                 the suite with the sanitizer beside it)
#   device, at once on the warm machine (it goes back after 30 s idle):
#                 NANSCAN_PREBUILT=1 tools/gpu_session.sh capabilities   (~3.5 min)
#
# memcheck, racecheck and synccheck instrument nanscan's kernels only (the sanitizer's kernel-name
# filter: "nanscan" is in their names); initcheck instruments every kernel, since it would take a
# filtered-out kernel's writes (torch's clamp of the clip coefficient, a .contiguous() copy) for
# uninitialized memory. The workload launches ~400 torch kernels besides nanscan's (benchmarks/
# NOTES.md, entry 15); each tool took 10-14 s on the H100 machine with the graph part (2026-11-23),
# all four ~50 s. The
# sanitizer needs a Firecracker machine (nvidia-h100-x1 so far):
# on gVisor it refuses the device (the device tool's KINDS.md).
set -euo pipefail
self="$(cd "$(dirname "$0")" && pwd)/$(basename "$0")"
cd "$(dirname "$0")/.."
# The scripts run from the checkout (the sanitizer's workload, tools/nccl_one_rank.py, the
# benchmarks) import its nanscan: with NANSCAN_PREBUILT=1 nothing is installed on a bare machine, and
# on 2026-11-28 each sanitizer tool stopped at "No module named 'nanscan'".
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
stage="${1:?usage: tools/gpu_session.sh build|prebuild|test|suite|sanitize [TOOL...]|bench|magnitudes [MODELS [METHODS]]|nccl|host|no-kernel|lend|subwarp|capabilities|wheel WHEEL|ab NAME=VALUE [scan|updates]|scan-variants [NAME=VALUE...]|ncu-source|all}"
shift
out="${OUT:-benchmarks/out/gpu}"
mkdir -p "$out"
# No CUDA_HOME default: setup.py finds the toolkit as torch does (nvcc on PATH, /usr/local/cuda).
# 9.0 with its PTX: shaped as a default build is (its newest architecture carries PTX), which
# tests/test_build.py holds every CUDA build to; without it that test failed on the H200 (2026-11-29).
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-9.0+PTX}"
export PYTHONUNBUFFERED=1
PY="${PYTHON:-python3}"
# The lists the kernels are measured on, whatever the stage: 10,000 tensors of 4 KB (the small-tensor
# path), GPT-2 small and llama-1b; one list, so that an A/B's rows and the capabilities' compare.
MEASURED_MODELS=many_small_10000x1024,gpt2-small,llama-1b

build() {
  # NANSCAN_PREBUILT=1: libraries built earlier (by a device command, or here by `prebuild`) and
  # carried in are used as they are, once a scan on the GPU shows they load and run; if not, the
  # device builds its own, after saying why.
  if [ "${NANSCAN_PREBUILT:-0}" = 1 ]; then
    if "$PY" -c "import nanscan, torch; nanscan.scan([torch.ones(3, device='cuda')]); print('prebuilt:', nanscan._C.__file__, nanscan._ops.cuda_library.__file__, nanscan._ops.cuda_library.cuda_archs)"; then
      return
    fi
    echo "build: the carried libraries did not run here (above); building them on the device"
    rm -f nanscan/_C*.so
  fi
  echo "== build ($(date -u +%FT%TZ))"
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
  "$PY" -m pip install --no-build-isolation --no-deps -q -e . >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; return 1; }
  tail -3 "$out/build.log"
  "$PY" -c "import nanscan, torch; r = nanscan.scan([torch.ones(3, device='cuda')]); print('built: norm', r.total_norm.item())"
}

# On the machine without a GPU, before the first device command: the libraries a lend then carries
# instead of building them on the device (~100-120 s of device time saved). The stable ABI makes one
# build load into every torch from 2.10 (the device's 2.11 included), CPU torch or CUDA; the CUDA
# library is for sm_90 and the CUDA major of the device's torch (13 unless NANSCAN_CUDA_MAJORS says),
# with this machine's toolkit. Then, in the device tool's call: carry nanscan/_C.abi3.so and
# nanscan/_C_cuda13.abi3.so, and run the stage with NANSCAN_PREBUILT=1.
prebuild() {
  echo "== prebuild for the device: sm_90, CUDA ${NANSCAN_CUDA_MAJORS:-13} ($(date -u +%FT%TZ))"
  rm -f nanscan/_C*.so
  NANSCAN_CUDA_MAJORS="${NANSCAN_CUDA_MAJORS:-13}" "$PY" setup.py build_ext --inplace >"$out/prebuild.log" 2>&1 ||
    { tail -40 "$out/prebuild.log"; return 1; }
  "$PY" -c "import nanscan._ops as o; print('prebuilt here, to carry:', ' '.join('nanscan/' + n + '.abi3.so' for n in ['_C', *o.cuda_libraries_held()]))"
  ls -la nanscan/_C*.so
}

tests() {
  echo "== tests"
  # test_cuda.py first, alone, so its timings are not shared with others. Then the whole suite on 14
  # workers (the H100 machine has 16 cores): 1,017 tests in ~250 s there on 2026-11-22. The emulator
  # test is left to CI: it runs the CUDA kernels' source on the CPU, a thread per lane, and under 14
  # workers it outlasted its limit; it says nothing about the GPU.
  "$PY" -m pytest -q -rfE tests/test_cuda.py 2>&1 | tee "$out/pytest_cuda.log" | tail -8 || true  # then the rest
  local parallel=()
  "$PY" -c "import xdist" 2>/dev/null && parallel=(-n 14)
  "$PY" -m pytest -q -rfE "${parallel[@]}" --durations=20 tests --deselect tests/test_cuda_emulated.py 2>&1 |
    tee "$out/pytest.log" | tail -15
}

suite() {
  echo "== the whole suite but test_cuda.py"
  local parallel=()
  "$PY" -c "import xdist" 2>/dev/null && parallel=(-n "${SUITE_WORKERS:-14}")
  "$PY" -m pytest -q -rfE "${parallel[@]}" --durations=20 tests --deselect tests/test_cuda_emulated.py \
      --deselect tests/test_cuda.py 2>&1 | tee "$out/pytest.log" | tail -15
}

nccl() {
  echo "== one-rank NCCL"
  "$PY" tools/nccl_one_rank.py --json "$out/nccl.json" 2>"$out/nccl.err" | tee "$out/nccl.txt"
}

host() {
  echo "== host time per tensor"
  "$PY" benchmarks/bench_host.py --device cuda 2>&1 | tee "$out/host_cuda.txt"
}

# The wheel's own binaries on this GPU: a copy of the checkout with the wheel's libraries in place of
# a build (as tools/check_wheel.sh tests each torch release on the CPU), so what runs is the file
# that ships. The device's torch loads the library of its CUDA major; the other is not exercised.
wheel_suite() {
  local wheel="${1:?usage: tools/gpu_session.sh wheel WHEEL}" copy
  [ -f "$wheel" ] || { echo "wheel: no file $wheel (carry it: dist/ is git-ignored)" >&2; return 1; }
  wheel="$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")"
  copy="$(mktemp -d)"
  copy_checkout "$copy"
  "$PY" -m zipfile -e "$wheel" "$copy/.wheel"
  cp "$copy/.wheel"/nanscan/*.so "$copy/nanscan/"
  rm -rf "$copy/.wheel"
  echo "== the wheel $(basename "$wheel") ($(date -u +%FT%TZ))"
  local status=0
  (cd "$copy" && "$PY" -m nanscan --version &&
    NANSCAN_REQUIRE_CUDA_BUILD=1 "$PY" -m pytest -q -rfE -p no:cacheprovider tests/test_build.py tests/test_cuda.py) 2>&1 |
    tee "$out/wheel.log" | tail -12 || status=1
  rm -rf "$copy"
  return "$status"
}

# The checkout as it is (the device machine's copy has no .git), without what a build left, into $1.
copy_checkout() {
  tar --exclude=./.git --exclude=./.mypy_cache --exclude=./build --exclude='./nanscan/_C*.so' --exclude=./benchmarks/out -cf - . |
    tar -xf - -C "$1"
}

# A copy of the checkout built for sm_80 alone, in folder $1 (no GPU needed: it can build while
# another stage runs).
no_kernel_build() {
  copy_checkout "$1"
  (cd "$1" && TORCH_CUDA_ARCH_LIST=8.0 "$PY" setup.py build_ext --inplace >"$out/no_kernel_build.log" 2>&1) ||
    { tail -30 "$out/no_kernel_build.log"; return 1; }
}

# A copy of the checkout in $1 built with -D$2 (NAME=VALUE), for `ab` to measure beside the default.
variant_build() {
  copy_checkout "$1"
  (cd "$1" && NVCC_APPEND_FLAGS="-D$2" "$PY" setup.py build_ext --inplace >"$out/variant_build.log" 2>&1) ||
    { tail -30 "$out/variant_build.log"; return 1; }
}

# The rows of folder $1 (a checkout with its own build), to $out/ab_$2.txt: with $3 = scan (the
# default), bench_scan's ceiling and scan rows; with updates, bench_state --updates' rows (the update
# watch's sampled step against a read, a copy and the unfused 7W pass). Run from inside the folder
# with PYTHONPATH on it: the copy's nanscan, not the editable install.
ab_rows() {
  local rows=(benchmarks/bench_scan.py --device cuda --dtype float32,bfloat16
    --models "$MEASURED_MODELS" --magnitudes ordinary,tiny --methods nanscan.scan
    --max-repeats 30 --min-time 0.2)
  local shown="^ab: |^== |^ceiling_sum|^nanscan.scan"
  if [ "${3:-scan}" = updates ]; then
    rows=(benchmarks/bench_state.py --device cuda --updates --models "$MEASURED_MODELS")
    shown="^ab: |^model |^[a-z]"
  fi
  (cd "$1" && PYTHONPATH="$PWD" "$PY" -c "import nanscan; print('ab: $2 imports', nanscan._C.__file__)" &&
    PYTHONPATH="$PWD" "$PY" "${rows[@]}" --json "$out/ab_$2.json" 2>>"$out/ab.err") |
    tee "$out/ab_$2.txt" | grep -E "$shown" || echo "ab: no rows for $2 (see $out/ab.err)"
}

# The default build (in place) against a -DNAME=VALUE build of a copy, built side by side, then the
# rows ($2: scan or updates, see ab_rows) of each: what a kernel flag changes, measured in one session
# on one GPU. The default build stays for what follows.
ab() {
  local variant="${1:?usage: ab NAME=VALUE [scan|updates]}" rows="${2:-scan}" copy
  case "$rows" in scan | updates) ;; *) echo "ab: ROWS is scan or updates, not $rows" >&2; return 1 ;; esac
  copy="$(mktemp -d)"
  variant_build "$copy" "$variant" &
  local background=$!
  build || return 1
  wait "$background" || return 1
  ab_rows . default "$rows"
  ab_rows "$copy" "$variant" "$rows"
  rm -rf "$copy"
}

no_kernel() {
  echo "== a build without a kernel for this GPU"
  local copy="${1:-}"
  if [ -z "$copy" ]; then
    copy="$(mktemp -d)"
    no_kernel_build "$copy" || return 1
  fi
  # From inside the copy: `python -` puts the working folder first on sys.path, ahead of PYTHONPATH,
  # and the checkout's own (sm_90) build would be imported instead.
  (cd "$copy" && "$PY" - <<'PY') 2>&1 | tee "$out/no_kernel.log"
import torch, nanscan
print("no-kernel: imported", nanscan.__file__)
try:
    nanscan.scan([torch.ones(3, device="cuda")])
except RuntimeError as error:
    message = str(error)
    assert "no CUDA kernel for this GPU" in message and "TORCH_CUDA_ARCH_LIST=8.0" in message, message
    print("no-kernel: ok:", message.splitlines()[0][:400])
else:
    raise SystemExit("no-kernel: FAILED: a build for sm_80 only ran on this GPU")
PY
  rm -rf "$copy"
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
    # The kernel paths without the caching allocator (true allocation bounds), then the graph replay
    # with it (a capture needs it): two processes, one log.
    if PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$sanitizer" --tool "$t" "${options[@]}" --error-exitcode 17 \
        "$PY" tools/sanitize_workload.py --part paths >"$out/sanitize_$t.log" 2>&1 &&
      "$sanitizer" --tool "$t" "${options[@]}" --error-exitcode 17 \
        "$PY" tools/sanitize_workload.py --part graph >>"$out/sanitize_$t.log" 2>&1; then
      echo "$t: clean in $((SECONDS - start)) s ($(grep -c . "$out/sanitize_$t.log") log lines)"
    else
      echo "$t: FAILED after $((SECONDS - start)) s, see $out/sanitize_$t.log"; tail -30 "$out/sanitize_$t.log"; status=1
    fi
  done
  return $status
}

# bench_scan with every peer (per-parameter loop, torch.compile) takes ~3 minutes per zoo case and
# dtype on the H100 machine: pass fewer (e.g. `bench --models gpt2-small --dtype bfloat16`) or
# `--methods` to fit a 10-minute command. The arguments go to bench_scan.
bench() {
  echo "== benchmarks"
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(--models gpt2-small,many_small_10000x1024 --dtype float32 --magnitudes ordinary)
  "$PY" benchmarks/bench_scan.py --device cuda --max-repeats 20 --min-time 0.2 "${args[@]}" \
      --json "$out/bench_scan_cuda.json" 2>"$out/bench_scan_cuda.err" | tee "$out/bench_scan_cuda.txt" | tail -12
  # Batch 64: the largest of 32, 48, 64 and 96 that fit GPT-2-small's step on an H100's 80 GB.
  "$PY" benchmarks/bench_train_step.py --batch 64 --json "$out/train_step.json" 2>"$out/train_step.err" |
    tee "$out/train_step.txt"
  "$PY" benchmarks/bench_list_layout.py --json "$out/list_layout.json" 2>&1 | tee "$out/list_layout.txt"
  local model
  for model in decoder gpt2; do  # the small decoder (host-bound on a GPU) and GPT-2-small's size
    "$PY" benchmarks/bench_locate.py --device cuda --model "$model" --autocast --rounds 15 \
        --json "$out/locate_cuda_$model.json" 2>&1 | tee "$out/locate_cuda_$model.txt" | tail -9
  done
}

# The scan at the magnitudes training makes (issue 27): GPT-2-small's shapes and the deep MLP's real
# gradients, fp32 and bf16, at ordinary, tiny (1e-20), vanishing and overflow-step values and all
# NaN, with torch's clip beside nanscan's (~4 minutes on the H100 machine).
magnitudes() {
  echo "== magnitudes"
  local models="${1:-gpt2-small,deep_mlp_75x256}"
  local methods="${2:-nanscan.scan,nanscan.clip(no-clip),torch.clip(no-clip),nanscan.clip(clip),torch.clip(clip)}"
  "$PY" benchmarks/bench_scan.py --device cuda --models "$models" --dtype float32,bfloat16 \
      --magnitudes ordinary,1e-17,tiny,vanishing,overflow,all_nan --max-repeats 20 --min-time 0.2 \
      --methods "$methods" \
      --json "$out/magnitudes_cuda.json" 2>"$out/magnitudes_cuda.err" | tee "$out/magnitudes_cuda.txt" | tail -40
}

# The small-tensor path (issue 25, item 3; NOTES.md entry 34): the build with it and one without it
# (NANSCAN_SUB_WARP_MIN_RUN=5) side by side, test_cuda.py, memcheck and racecheck (its shared-memory
# slots), then the scan rows of both builds; the library stays built, and a copy of it goes to
# $out/libs.tgz for a later command to carry (~6 minutes on the H100 machine).
subwarp() {
  local copy
  copy="$(mktemp -d)"
  variant_build "$copy" NANSCAN_SUB_WARP_MIN_RUN=5 >"$out/variant_bg.log" 2>&1 &
  local background=$!
  build || return 1
  tar czf "$out/libs.tgz" nanscan/_C*.so
  export NANSCAN_PREBUILT=1
  timeout 100 "$PY" -m pytest -q -rfE tests/test_cuda.py 2>&1 | tee "$out/pytest_cuda.log" | tail -8 || true
  timeout 60 "$self" sanitize memcheck racecheck || echo "sanitize: exit $?"
  wait "$background" || { echo "variant build failed:"; cat "$out/variant_bg.log"; return 1; }
  timeout 150 bash -c "$(declare -f ab_rows); out='$out' PY='$PY' ab_rows . default" || echo "ab default: exit $?"
  timeout 150 bash -c "$(declare -f ab_rows); out='$out' PY='$PY' ab_rows '$copy' no_sub_warp" ||
    echo "ab variant: exit $?"
  rm -rf "$copy"
}

# What the open issues added, on the GPU: the update watch's sampled step, the activation watch on
# GPT-2-small's size under fp16 autocast, and check_state (~3 minutes).
capabilities() {
  echo "== the update watch, activations, check_state, host time"
  # First measured on the H200 on 2026-11-28 (RESULTS.md): the update watch's difference kernel
  # and sketch, the activation watch (now with its profile split), check_state. Each bounded; the
  # four took ~130 s there.
  timeout 90 "$PY" benchmarks/bench_state.py --device cuda --updates --models "$MEASURED_MODELS" \
      --json "$out/updates_cuda.json" 2>&1 | tee "$out/updates_cuda.txt" | tail -6 || echo "updates: exit $?"
  # every=1 batched (one op call a forward, NOTES.md entry 60) beside every=1 at return (batch_bytes=0:
  # one a module call, +19.7% on the H200 on 2026-11-29); --profile: where every=1's time goes, host or
  # device, and which op; --per-call: the host time of one sampled module call, batched and at return,
  # and of the op alone (scan beside scan_into_: 64.2 against 42.9 us on the H200).
  timeout 170 "$PY" benchmarks/bench_activations.py --device cuda --model gpt2 --autocast float16 --profile --per-call \
      --json "$out/activations_cuda.json" 2>&1 | tee "$out/activations_cuda.txt" | tail -32 || echo "activations: exit $?"
  # --profile: where GPT-2-small's 1.08 ms a call goes beyond its 0.33 ms of host and 0.36 ms of GPU
  # time (H200, 2026-11-29), by op.
  timeout 100 "$PY" benchmarks/bench_state.py --device cuda --models gpt2-small,llama-1b --profile \
      --json "$out/state_cuda.json" 2>&1 | tee "$out/state_cuda.txt" | tail -40 || echo "state: exit $?"
  # The host floor again, after the writing ops' change (NOTES.md entry 49; ~20 s).
  timeout 45 "$PY" benchmarks/bench_host.py --device cuda 2>&1 | tee "$out/host_cuda.txt" || echo "host: exit $?"
  # Lists past 256 tensors read the device copy since NOTES.md entry 58 (the 32 KB parameter block
  # gone): the cached copy and a miss every call against the parameters, the trade it predicts (~30 s).
  timeout 75 "$PY" benchmarks/bench_list_layout.py --json "$out/list_layout.json" 2>&1 | tee "$out/list_layout.txt" ||
    echo "list layout: exit $?"
}

# One lend's first command: the stages in the order of their need, each bounded (seconds), so that a
# slow one leaves time to the next; the built library stays for the next command on the same warm
# machine, and a copy goes to $out/libs.tgz for one on a fresh machine (a bare machine's build took
# over 120 s on 2026-11-26). First the CUDA tests of what no GPU has run yet, alone (the library
# since the stable-ABI port, the difference kernel, the update watch, check_state, the activation
# watch); then the whole suite (which runs tools/nccl_one_rank.py under a one-rank NCCL group too)
# on 14 workers while compute-sanitizer's four tools run beside it: neither is a timing, and
# together they take the suite's ~5-7 minutes instead of ~8. The timings are the next command's
# (`NANSCAN_PREBUILT=1 tools/gpu_session.sh capabilities`, ~4 minutes), on a quiet machine.
lend() {
  build || return 1
  tar czf "$out/libs.tgz" nanscan/_C*.so
  export NANSCAN_PREBUILT=1
  timeout 110 "$PY" -m pytest -q -rfE tests/test_cuda.py tests/test_scan_difference.py tests/test_updates.py \
    tests/test_sketch.py tests/test_state.py tests/test_activations.py -k cuda 2>&1 |
    tee "$out/pytest_cuda.log" | tail -8 || true
  SUITE_WORKERS=14 timeout 450 "$self" suite >"$out/suite_stage.log" 2>&1 &
  local suite_pid=$!
  timeout 200 "$self" sanitize || echo "sanitize: exit $?"
  wait "$suite_pid" || echo "suite: exit $?"
  cat "$out/suite_stage.log"
}

# Nsight Compute's command line: on PATH, in the toolkit, or where its installer puts it (empty if none).
find_ncu() {
  command -v ncu || ls "${CUDA_HOME:-/usr/local/cuda}"/bin/ncu /usr/local/cuda/nsight-compute-*/ncu \
    /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true
}

# The scan kernels as built against builds with other -D flags (each VARIANT is one NAME=VALUE; the
# default pair: NANSCAN_SCAN_MIN_BLOCKS=0, no launch bound on any scan kernel, and =4, every scan
# kernel held to 64 registers: the launch bounds to settle again on a GPU other than the H100, where
# they were measured; NOTES.md entries 25 and 28). The flag
# reaches nvcc through NVCC_APPEND_FLAGS, which the build's dependency tracking does not see: each
# variant is a clean build (~100 s on the H100 machine's 16 cores). For each: bench_scan's ceiling,
# scan and checksum rows (--methods, ~30 s) and an ncu profile of tools/ncu_scan.py's launches
# (~15 s). Two files per variant in $out, and bench_scan's progress and errors in variants.err.
scan_variants() {
  local variants=("$@") ncu NANSCAN_PREBUILT=0  # every variant is built here, whatever the caller set
  [ ${#variants[@]} -gt 0 ] || variants=(NANSCAN_SCAN_MIN_BLOCKS=0 NANSCAN_SCAN_MIN_BLOCKS=4)
  ncu="$(find_ncu)"
  rm -rf /tmp/nanscan_default
  for variant in default "${variants[@]}"; do
    echo "== scan kernels: $variant"
    rm -rf build nanscan/_C*.so
    if [ "$variant" = default ]; then
      build || return 1
      mkdir -p /tmp/nanscan_default && cp nanscan/_C*.so /tmp/nanscan_default/
    else
      NVCC_APPEND_FLAGS="-D$variant" build || return 1
    fi
    # Each build's CUDA library kept, for a later command to carry the one the measurements favour.
    cp nanscan/_C_cuda*.so "/tmp/nanscan_${variant}_C_cuda.so"
    "$PY" benchmarks/bench_scan.py --device cuda --models gpt2-small,llama-1b,many_small_10000x1024 \
        --dtype float32,bfloat16 --methods "nanscan.scan(checksum)" --max-repeats 20 --min-time 0.2 \
        2>>"$out/variants.err" | tee "$out/variant_$variant.txt" | grep -E "^== |^ceiling_sum|^nanscan.scan" ||
      echo "bench_scan printed no rows for $variant: see $out/variants.err"
    if [ -n "$ncu" ]; then
      "$ncu" --profile-from-start off --clock-control none --section SpeedOfLight --section LaunchStats \
          --section Occupancy --section SchedulerStats --section WarpStateStats "$PY" tools/ncu_scan.py \
          >"$out/ncu_$variant.txt" 2>&1 || echo "ncu failed: see $out/ncu_$variant.txt"
      grep -E "scan_kernel|Duration|DRAM Throughput|Issued Warp|Registers Per" "$out/ncu_$variant.txt" | cut -c1-100 ||
        true
    fi
  done
  echo "== the default build back in place, for what follows"
  rm -rf build nanscan/_C*.so
  cp /tmp/nanscan_default/*.so nanscan/
  NANSCAN_PREBUILT=1 build
}

# Which source lines the scan kernels' instructions and stalls come from. -lineinfo adds the line
# table only (no change to the machine code), so the library built here stays for what follows.
# The report (ncu_source.ncu-rep) opens in Nsight Compute's source view; the text holds the
# sections' tables, the top stall locations among them.
ncu_source() {
  local ncu NANSCAN_PREBUILT=0
  ncu="$(find_ncu)"
  [ -n "$ncu" ] || { echo "no ncu on PATH or in the usual places" >&2; return 1; }
  rm -rf build nanscan/_C*.so
  NVCC_APPEND_FLAGS="-lineinfo" build || return 1
  "$ncu" --profile-from-start off --clock-control none --import-source yes --section SourceCounters \
      --section InstructionStats --section WarpStateStats --section LaunchStats -o "$out/ncu_source" -f \
      "$PY" tools/ncu_scan.py >"$out/ncu_source.log" 2>&1 || { tail -20 "$out/ncu_source.log"; return 1; }
  "$ncu" -i "$out/ncu_source.ncu-rep" --print-details all >"$out/ncu_source.txt" 2>&1 || true
  grep -E "scan_kernel|Executed Instructions|Warp Cycles Per Issued|stall|Stall" "$out/ncu_source.txt" |
    cut -c1-140 | head -40 || true
}

case "$stage" in
  build) build ;;
  ncu-source) ncu_source ;;
  scan-variants) scan_variants "$@" ;;
  test) build; tests ;;
  sanitize) build; sanitize "$@" ;;
  bench) build; bench "$@" ;;
  magnitudes) build; magnitudes "$@" ;;
  no-kernel) no_kernel ;;
  nccl) build; nccl ;;
  host) build; host ;;
  suite) build; suite ;;
  lend) lend ;;
  prebuild) prebuild ;;
  subwarp) subwarp ;;
  capabilities) build; capabilities ;;
  wheel) wheel_suite "$@" ;;
  ab) ab "$@" ;;
  all) build; tests || true; sanitize || true; bench ;;  # one failing stage does not hide the others' results
  *) echo "unknown stage $stage" >&2; exit 2 ;;
esac
