#!/usr/bin/env bash
# nanscan's one wheel (issue 34): tagged cp310-abi3 and manylinux_2_28 x86_64, for every torch from
# 2.10 on (the stable ABI, csrc/torch_api.h) and every CPython from 3.10 (the limited API). It holds
# the CPU library (nanscan/_C) and one CUDA library per CUDA major (nanscan/_C_cuda12, _C_cuda13),
# each linked to the libcudart.so.N that a torch of that major loads; nanscan loads the one of the
# running torch's CUDA (nanscan/_ops.py).
#
#   bash tools/build_wheel.sh                       # CUDA: the major of the first toolkit found (none: CPU only)
#   bash tools/build_wheel.sh --majors 12,13        # every major torch ships
#   bash tools/build_wheel.sh --majors 12,13 --install-toolkits   # missing toolkits: CUDA 13 from NVIDIA's pip
#                                                   # packages, CUDA 12 from Debian's (tools/cuda12_from_debian.sh)
#   bash tools/build_wheel.sh --out DIR             # where the wheel goes (default: dist/)
#   bash tools/build_wheel.sh --keep-build          # reuse build/'s objects where their compile is the same
#
# Run it in an environment with torch (any from 2.10, CPU or CUDA: the build reads only its headers)
# and the "test" extra's ninja. A CUDA major needs a toolkit of that major, found by
# tools/cuda_toolkit.py's search ($CUDA_HOME, nvcc on PATH, NVIDIA's pip packages, /usr/local/cuda);
# --install-toolkits pip-installs a missing one into this environment where NVIDIA's pip packages hold
# nvcc (CUDA 13 on); CUDA 12's hold ptxas alone, so a missing CUDA 12 toolkit is unpacked from Debian's
# packages (CUDA 12.4, unpacked, not installed: tools/cuda12_from_debian.sh) into ~/.cache/nanscan/cuda12-debian,
# kept for later builds, and named by $CUDA_PATH. The kernels are built for every
# architecture torch's builds of each major hold, from sm_75 on (setup.py; TORCH_CUDA_ARCH_LIST
# overrides). The wheel is then repaired with auditwheel (nothing grafted: torch's and CUDA's runtime
# libraries are the ones torch itself loads) and checked with abi3audit, both installed into a venv
# of their own at the versions of pyproject.toml's "wheel" extra.
set -euo pipefail
cd "$(dirname "$0")/.."

majors=""
out="dist"
install_toolkits=0
keep_build=0
while [ $# -gt 0 ]; do
  case "$1" in
    --majors) majors="$2"; shift 2 ;;
    --out) out="$2"; shift 2 ;;
    --install-toolkits) install_toolkits=1; shift ;;
    --keep-build) keep_build=1; shift ;;
    -h | --help) sed -n '2,25p' "$0"; exit 0 ;;
    *) echo "build_wheel.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
done

PY=${PYTHON:-python}
"$PY" -c "import torch" 2>/dev/null || { echo "build_wheel.sh: no torch in $("$PY" -c 'import sys; print(sys.prefix)')" >&2; exit 1; }
if [ -z "$majors" ]; then
  majors=$("$PY" tools/cuda_toolkit.py first-major)
  echo "build_wheel.sh: CUDA majors: ${majors:-none (no toolkit found: a CPU-only wheel)}"
fi
if [ "$install_toolkits" = 1 ] && [ -n "$majors" ]; then
  for major in ${majors//,/ }; do
    if ! NANSCAN_CUDA_MAJORS=$major "$PY" -c "
import os, sys
sys.path.insert(0, 'tools')
import cuda_toolkit
cuda_toolkit.find_toolkit('$major', os.environ, cuda_toolkit._site_dirs(), named_must_match=False)
" 2>/dev/null; then
      command=$("$PY" -c "import sys; sys.path.insert(0, 'tools'); import cuda_toolkit; print(cuda_toolkit.install_command('$major') or '')")
      if [ -z "$command" ] && [ "$major" = 12 ] && command -v apt-get >/dev/null && command -v dpkg >/dev/null; then
        debian="${XDG_CACHE_HOME:-$HOME/.cache}/nanscan/cuda12-debian"
        [ -x "$debian/bin/nvcc" ] || bash tools/cuda12_from_debian.sh "$debian"
        if [ -n "${CUDA_PATH:-}" ]; then
          echo "build_wheel.sh: CUDA 12 is at $debian, but \$CUDA_PATH is set ($CUDA_PATH): unset it, or set it to $debian" >&2
          exit 1
        fi
        export CUDA_PATH="$debian"  # searched after $CUDA_HOME, which may name the CUDA 13 toolkit
        echo "build_wheel.sh: CUDA 12: CUDA_PATH=$debian"
        continue
      fi
      if [ -z "$command" ]; then
        advice=$("$PY" -c "import sys; sys.path.insert(0, 'tools'); import cuda_toolkit; print(cuda_toolkit.install_advice('$major'))")
        echo "build_wheel.sh: no CUDA $major toolkit found, and pip cannot give one: $advice, then set CUDA_HOME or put its nvcc on PATH" >&2
        exit 1
      fi
      echo "build_wheel.sh: no CUDA $major toolkit; $command"
      eval "$PY -m $command --quiet --disable-pip-version-check"
    fi
  done
fi

tools_venv=$(mktemp -d)
raw=$(mktemp -d)
trap 'rm -rf "$tools_venv" "$raw"' EXIT
wheel_tools=$("$PY" tools/extra.py wheel)
"$PY" -m venv "$tools_venv"
# shellcheck disable=SC2086
"$tools_venv/bin/python" -m pip install --quiet --disable-pip-version-check $wheel_tools

# A clean build by default: no object of an earlier build is reused. --keep-build (CI: the editable
# install just built the CPU library with the same torch and flags) lets ninja judge which objects
# are current, by their compile commands and the times of the headers they read (setup.py keeps them
# in build/objects/).
[ "$keep_build" = 1 ] || rm -rf build
start=$SECONDS
NANSCAN_CUDA_MAJORS="$majors" "$PY" -m pip wheel --quiet --disable-pip-version-check --no-build-isolation --no-deps \
  -w "$raw" .
echo "build_wheel.sh: built in $((SECONDS - start)) s"
built=("$raw"/nanscan-*.whl)
mkdir -p "$out"
# Not grafted into the wheel: torch's libraries and CUDA's runtime, which the process has loaded
# before nanscan (import torch), by the same sonames.
PATH="$tools_venv/bin:$PATH" auditwheel repair --plat manylinux_2_28_x86_64 --strip \
  --exclude 'libtorch*.so' --exclude 'libc10*.so' --exclude 'libcudart.so.*' -w "$out" "${built[0]}"
wheel=$(ls -t "$out"/nanscan-*manylinux*.whl | head -n 1)
"$tools_venv/bin/abi3audit" --strict --summary "$wheel"
echo "build_wheel.sh: $wheel ($(du -h "$wheel" | cut -f1))"
"$PY" -m zipfile -l "$wheel" | grep -E '\.so' || true
