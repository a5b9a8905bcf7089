"""The CUDA kernels, executed without a GPU.

tests/cuda_emulator/include/cuda_runtime.h stands in for the CUDA runtime so that g++ compiles
csrc/cuda/scan_cuda.cu and sketch_cuda.cu unchanged and runs their kernels on the CPU: a block's
threads are fibers switched at every barrier, a warp's lanes meet at every shuffle (a warp-divergent
shuffle stops the program, naming the barrier), atomics and fences are C++ atomics, and blocks run one
at a time, in index order or shuffled. tests/cuda_emulator/test_kernels.cpp and test_sketch_kernel.cpp
check every result against the exact rule in fp64 (see that file for the paths it covers). What this
cannot show: the device-only code under __CUDA_ARCH__ (the hardware fp16/fp8 decode, fmin/fmax),
memory ordering weaker than C++'s, blocks running at the same time, plain read-modify-writes of two
threads racing between barriers, and speed; test_cuda.py covers those on a GPU."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from conftest import ROOT, build_and_run_cpp, build_cpp

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
    hang = "an endless loop (a deadlock at a barrier stops the program with a message)"
    assert "all checks passed" in build_and_run_cpp(tmp_path, sources, FLAGS, 300, hang)


def test_sketch_kernel_on_emulated_gpu(tmp_path: Path) -> None:
    """csrc/cuda/sketch_cuda.cu, the update sketch, against common/sketch_rules.h element by element
    (tests/cuda_emulator/test_sketch_kernel.cpp)."""
    sources = [ROOT / "csrc" / "cuda" / "sketch_cuda.cu", ROOT / "tests" / "cuda_emulator" / "test_sketch_kernel.cpp"]
    hang = "an endless loop (a deadlock at a barrier stops the program with a message)"
    assert "all checks passed" in build_and_run_cpp(tmp_path, sources, FLAGS, 300, hang)


# The emulator's own promises, on kernels small enough to read: a barrier not every thread reaches
# stops the program and names it, and a read that no barrier orders after another warp's write finds
# the write missing in one of the two scheduling orders (so the suites above would catch either bug).
EMULATOR_PROBES = r"""
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "cuda_runtime.h"

__global__ void divergent_shuffle(int* out) {
  if (threadIdx.x % 32 == 5) return;  // lane 5 leaves before the shuffle its warp meets at
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 1);
}

__global__ void skipped_syncthreads(int* out) {
  if (threadIdx.x < 32) __syncthreads();  // the second warp never arrives
  out[threadIdx.x] = 1;
}

// Thread 40 (the second warp) writes, thread 0 (the first) reads: ordered by __syncthreads or not.
template <bool kOrdered>
__global__ void read_after_write(int* out) {
  __shared__ int value;
  if (threadIdx.x == 0) value = -1;
  __syncthreads();
  if (threadIdx.x == 40) value = static_cast<int>(blockIdx.x);
  if (kOrdered) __syncthreads();
  if (threadIdx.x == 0) out[blockIdx.x] = value;
}

int main(int argc, char** argv) {
  int out[64] = {};
  int* p = out;
  if (std::strcmp(argv[1], "shuffle") == 0) NANSCAN_LAUNCH(divergent_shuffle, 1, 64, nullptr, p);
  if (std::strcmp(argv[1], "syncthreads") == 0) NANSCAN_LAUNCH(skipped_syncthreads, 1, 64, nullptr, p);
  if (std::strcmp(argv[1], "race") == 0) {
    for (const char* kind : {"unordered", "ordered"}) {
      if (std::strcmp(kind, "unordered") == 0) NANSCAN_LAUNCH(read_after_write<false>, 8, 64, nullptr, p);
      else NANSCAN_LAUNCH(read_after_write<true>, 8, 64, nullptr, p);
      std::printf("%s", kind);
      for (int b = 0; b < 8; ++b) std::printf(" %d", out[b]);
      std::printf("\n");
    }
  }
  std::printf("finished\n");
  return 0;
}
"""


@pytest.fixture(scope="module", params=["own switch", "ucontext"])
def emulator_probes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The probes built with each of the emulator's fiber switches: its own on x86-64, and ucontext's,
    which other machines use (built here so that it stays compiling and keeps the same promises)."""
    directory = tmp_path_factory.mktemp("probes")
    source = directory / "probes.cpp"
    source.write_text(EMULATOR_PROBES)
    switch = ["-DCUDA_EMULATOR_UCONTEXT"] if request.param == "ucontext" else []
    return build_cpp(directory, [source], FLAGS + switch)


@pytest.mark.parametrize(
    ("probe", "barrier"),
    [("shuffle", "a warp's shuffle, ballot or __syncwarp"), ("syncthreads", "__syncthreads")],
)
def test_a_barrier_some_threads_never_reach_stops_the_program_and_is_named(
    emulator_probes: Path, probe: str, barrier: str
) -> None:
    run = subprocess.run([str(emulator_probes), probe], capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode != 0 and "finished" not in run.stdout
    assert f"cuda_emulator: deadlock in block 0: thread 0 waits at {barrier}" in run.stderr, run.stderr


def test_a_read_no_barrier_orders_misses_the_write_in_some_block(emulator_probes: Path) -> None:
    run = subprocess.run([str(emulator_probes), "race"], capture_output=True, text=True, timeout=60, check=True)
    lines = run.stdout.splitlines()
    assert lines[0].startswith("unordered ") and lines[1].startswith("ordered ") and lines[2] == "finished"
    unordered, ordered = ([int(v) for v in line.split()[1:]] for line in lines[:2])
    # Without the barrier, whether the read comes first depends on the order the scheduler drew for the
    # block: over 8 blocks, both happen. With it, every block reads what its thread 40 wrote.
    assert -1 in unordered and any(v == b for b, v in enumerate(unordered)), unordered
    assert ordered == list(range(8)), ordered
