#!/usr/bin/env bash
# Builds the stable-ABI prototype (stable_proto.cpp) and the same no-op list op on the old API
# (legacy_proto.cpp) into build/, against the installed torch, then checks the prototype's undefined
# symbols: none of c10::, at:: or torch::. Run from this folder: bash build.sh && python check.py && python bench.py
set -euo pipefail
cd "$(dirname "$0")"
mkdir -p build
T=$(python -c "import torch, os; print(os.path.dirname(torch.__file__))")
PYINC=$(python -c "import sysconfig; print(sysconfig.get_paths()['include'])")
common=(-std=c++17 -O2 -fPIC -shared -I"$T/include" -I"$PYINC" -L"$T/lib" -ltorch -ltorch_cpu -lc10 -Wl,-rpath,"$T/lib")
g++ stable_proto.cpp -o build/stable_proto.so -DTORCH_TARGET_VERSION=0x020a000000000000 -DPy_LIMITED_API=0x030A0000 "${common[@]}"
g++ legacy_proto.cpp -o build/legacy_proto.so -I"$T/include/torch/csrc/api/include" "${common[@]}"
if nm -D --undefined-only build/stable_proto.so | c++filt | grep -E "c10::|at::|torch::"; then
  echo "build.sh: the stable prototype imports C++ symbols of torch (above)" >&2
  exit 1
fi
echo "build.sh: ok, no c10::/at::/torch:: symbol imported by build/stable_proto.so"
