"""The CUDA kernels, executed without a GPU.

tests/cuda_emulator/include/cuda_runtime.h stands in for the CUDA runtime so that g++ compiles
csrc/cuda/scan_cuda.cu and sketch_cuda.cu unchanged and runs their kernels on CPU threads: a block's threads run
concurrently, a warp's lanes meet at every shuffle (a warp-divergent shuffle hangs, and the timeout
below reports it), atomics and fences are C++ atomics, and blocks run one at a time, in index order or
shuffled. tests/cuda_emulator/test_kernels.cpp and test_sketch_kernel.cpp check
every result against the exact rule in fp64 (see that file for the paths it covers). What this cannot
show: the device-only code under __CUDA_ARCH__ (the hardware fp16/fp8 decode, fmin/fmax), memory
ordering weaker than C++'s, blocks running at the same time, and speed; test_cuda.py covers those
on a GPU."""

from __future__ import annotations

from pathlib import Path

from conftest import ROOT, build_and_run_cpp

# g++ as strict as CI's build, with the stand-in runtime first on the include path.
FLAGS = [
    "-std=c++20",
    "-O2",
    "-pthread",
    "-Wall",
    "-Wextra",
    "-Werror",
    "-Wno-unused-parameter",
    "-Wno-unknown-pragmas",
    "-I",
    str(ROOT / "tests" / "cuda_emulator" / "include"),
]


def test_kernels_on_emulated_gpu(tmp_path: Path) -> None:
    sources = [ROOT / "csrc" / "cuda" / "scan_cuda.cu", ROOT / "tests" / "cuda_emulator" / "test_kernels.cpp"]
    hang = "a deadlock, e.g. a shuffle that not every lane of a warp reached"
    assert "all checks passed" in build_and_run_cpp(tmp_path, sources, FLAGS, 600, hang)


def test_sketch_kernel_on_emulated_gpu(tmp_path: Path) -> None:
    """csrc/cuda/sketch_cuda.cu, the update sketch, against common/sketch_rules.h element by element
    (tests/cuda_emulator/test_sketch_kernel.cpp)."""
    sources = [ROOT / "csrc" / "cuda" / "sketch_cuda.cu", ROOT / "tests" / "cuda_emulator" / "test_sketch_kernel.cpp"]
    hang = "a deadlock: a __syncwarp or shuffle that not every lane of a warp reached"
    assert "all checks passed" in build_and_run_cpp(tmp_path, sources, FLAGS, 300, hang)
