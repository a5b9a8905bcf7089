#!/usr/bin/env bash
# One wheel, every torch (issue 34): installs a wheel built by tools/build_wheel.sh, as it is, into a
# fresh venv per torch release from PyPI (the CUDA builds pip gives by default; they run on a CPU),
# and runs the tests there on the wheel's libraries. Prints a table, one row a release.
#
#   bash tools/check_wheel.sh dist/nanscan-*.whl                   # 2.9.1 (below the floor) .. 2.15.0
#   bash tools/check_wheel.sh WHEEL --torch "2.10.0 2.15.0"        # these releases only
#   bash tools/check_wheel.sh WHEEL --all                          # the whole suite, not the subset
#
# Each release costs a venv of several GB (deleted after its row) and a few minutes. The tests are
# those that touch torch's behaviour (below; --all: every test), run from a copy of this checkout
# with the wheel's libraries in place of a build, so what is tested is the wheel's binary with the
# checkout's Python (the wheel's own, when the checkout is the commit it was built from). Where the
# wheel holds the CUDA library of the release's CUDA major, tests/test_build.py must find it loaded
# and registered (NANSCAN_REQUIRE_CUDA_BUILD=1); where it does not, CUDA calls must say so. A release
# below the floor (2.10) must refuse to import with a message that names it, not a linker error.
# The public index is read directly (PIP_CONFIG_FILE=/dev/null, the system's CA bundle, no
# PIP_FIND_LINKS): a site's pip configuration may cap torch's version or offer a local CPU build of the
# same version (2.13.0+cpu, which pip prefers). A release's test log is kept in the directory printed
# at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

wheel="${1:?usage: tools/check_wheel.sh WHEEL [--torch \"V1 V2 ...\"] [--all]}"
shift
releases="2.9.1 2.10.0 2.11.0 2.12.1 2.13.0 2.14.1 2.15.0"
tests=(tests/test_build.py tests/test_ops.py tests/test_scan.py tests/test_clip.py tests/test_amp.py
  tests/test_record_op.py tests/test_bad_input.py tests/test_checksum.py tests/test_report.py tests/test_locate.py
  tests/test_state.py tests/test_activations.py)
while [ $# -gt 0 ]; do
  case "$1" in
    --torch) releases="$2"; shift 2 ;;
    --all) tests=(tests); shift ;;
    *) echo "check_wheel.sh: unknown argument $1" >&2; exit 2 ;;
  esac
done
[ -f "$wheel" ] || { echo "check_wheel.sh: no wheel at $wheel" >&2; exit 1; }
wheel="$(cd "$(dirname "$wheel")" && pwd)/$(basename "$wheel")"
export PIP_CERT="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}"
# cuobjdump (the "build-check" extra), for tests/test_build.py's look at the fatbinary.
PY=${PYTHON:-python}
build_check=$("$PY" tools/extra.py build-check)
held=$(python -m zipfile -l "$wheel" | grep -oE '_C_cuda[0-9]+' | sort -u | tr '\n' ' ')
echo "check_wheel.sh: $(basename "$wheel"); CUDA libraries: ${held:-none}"

rows=()
status=0
logs=$(mktemp -d /tmp/check_wheel_logs.XXXXXX)
for release in $releases; do
  work=$(mktemp -d)
  start=$SECONDS
  echo "== torch $release"
  python -m venv "$work/venv"
  py="$work/venv/bin/python"
  # shellcheck disable=SC2086
  if ! PIP_CONFIG_FILE=/dev/null env -u PIP_FIND_LINKS "$py" -m pip install --quiet --disable-pip-version-check "torch==$release" numpy \
      pytest hypothesis $build_check >"$work/pip.log" 2>&1; then
    tail -5 "$work/pip.log"
    rows+=("| $release | | | could not install torch | ✗ |")
    status=1
    rm -rf "$work"
    continue
  fi
  "$py" -m pip install --quiet --disable-pip-version-check --no-deps "$wheel"
  cuda=$("$py" -c "import torch; print(torch.version.cuda or 'CPU')")
  mkdir "$work/tree"
  git ls-files -z | xargs -0 cp --parents -t "$work/tree"
  "$py" -m zipfile -e "$wheel" "$work/unpacked"
  cp "$work/unpacked"/nanscan/*.so "$work/tree/nanscan/"
  cd "$work/tree"
  below_floor=$("$py" -c "import re, torch; m = re.match(r'(\d+)\.(\d+)', torch.__version__); print(int((int(m[1]), int(m[2])) < (2, 10)))")
  if [ "$below_floor" = 1 ]; then
    # Below the floor: the import must refuse with its own message, not the dynamic linker's.
    if out=$("$py" -c "import nanscan" 2>&1); then
      result="imported (it must not)"; mark="✗"; status=1
    elif grep -q "nanscan needs torch 2.10 or newer" <<<"$out" && ! grep -q "undefined symbol" <<<"$out"; then
      result="refused: $(grep -o 'nanscan needs torch [^;]*' <<<"$out" | head -n 1)"; mark="✓"
    else
      result="failed otherwise: $(tail -n 1 <<<"$out")"; mark="✗"; status=1
    fi
    rows+=("| $release | $cuda | none | $result | $mark | $((SECONDS - start)) s |")
  else
    loaded=$("$py" -c "import nanscan, nanscan._ops as o; print(o.cuda_library.__name__.split('.')[-1] if o.cuda_library else 'CPU only')" 2>&1 | tail -n 1)
    major="${cuda%%.*}"
    required=0
    [[ " $held " == *" _C_cuda$major "* ]] && required=1
    if NANSCAN_REQUIRE_CUDA_BUILD=$required "$py" -m pytest -q -p no:cacheprovider "${tests[@]}" >"$work/pytest.log" 2>&1; then
      mark="✓"
    else
      mark="✗"; status=1
    fi
    result=$(grep -E "passed|failed|error" "$work/pytest.log" | tail -n 1 | sed 's/=//g; s/^ *//; s/ *$//')
    rows+=("| $release | $cuda | $loaded | $result | $mark | $((SECONDS - start)) s |")
    cp "$work/pytest.log" "$logs/torch-$release.log"
    [ "$mark" = "✓" ] || grep -E "^(FAILED|ERROR)" "$work/pytest.log" | head -20
  fi
  cd - >/dev/null
  rm -rf "$work"
  echo "${rows[-1]}"
done

echo
echo "| torch | CUDA | nanscan library loaded | tests ($([ "${tests[*]}" = tests ] && echo all || echo "${#tests[@]} files")) | | time |"
echo "| --- | --- | --- | --- | --- | --- |"
printf '%s\n' "${rows[@]}"
echo "check_wheel.sh: the test logs are in $logs"
exit $status
