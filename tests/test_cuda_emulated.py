"""The CUDA kernels, executed without a GPU.

tests/cuda_emulator/include/cuda_runtime.h stands in for the CUDA runtime so that g++ compiles
csrc/cuda/scan_cuda.cu unchanged and runs its kernels on CPU threads: a block's threads run
concurrently, a warp's lanes meet at every shuffle (a warp-divergent shuffle hangs, and the timeout
below reports it), atomics and fences are C++ atomics. tests/cuda_emulator/test_kernels.cpp checks
every result against the exact rule in fp64 (see that file for the paths it covers). What this cannot
show: the device-only code under __CUDA_ARCH__ (the hardware fp16/fp8 decode, fmin/fmax), memory
ordering weaker than C++'s, and speed; test_cuda.py covers those on a GPU."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_kernels_on_emulated_gpu(tmp_path: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    binary = tmp_path / "test_kernels"
    build = subprocess.run(
        [compiler, "-std=c++20", "-O2", "-pthread", "-Wall", "-Wextra", "-Werror", "-Wno-unused-parameter",
         "-Wno-unknown-pragmas", "-I", str(ROOT / "tests" / "cuda_emulator" / "include"),
         "-x", "c++", str(ROOT / "csrc" / "cuda" / "scan_cuda.cu"),
         "-x", "c++", str(ROOT / "tests" / "cuda_emulator" / "test_kernels.cpp"), "-o", str(binary)],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr[-6000:]
    try:
        run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        pytest.fail("the emulated kernels did not finish: a deadlock, e.g. a shuffle that not every lane reached")
    assert run.returncode == 0, run.stderr[-6000:]
    assert "all checks passed" in run.stdout
