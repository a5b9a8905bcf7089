"""Build nanscan's compiled library, nanscan._C, against the torch that is already installed.

Install with `pip install --no-build-isolation -e .`: an isolated build would fetch another torch.
The CUDA backend is built when the installed torch was built with CUDA; whether a GPU is visible is
irrelevant (build machines often have none). The toolkit is $CUDA_HOME or $CUDA_PATH, else the one
torch finds (nvcc on PATH, /usr/local/cuda). A CUDA torch with no toolkit found is an error, not a
silent CPU-only build: set CUDA_HOME, or NANSCAN_CPU_ONLY=1 to build the CPU backend on purpose.
"""

import glob
import os
import sys

import torch
from setuptools import setup
from torch.utils import cpp_extension
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")

# No flag that lets the compiler assume finite math may reach this code (never -ffast-math / -Ofast /
# -ffinite-math-only). -fno-trapping-math only lets it compute both sides of a select, which the
# branch-free fp16/fp8 decoders need to vectorise; NaN/Inf classification is done on bits regardless.
# -fopenmp: at::parallel_for runs on OpenMP in torch's CPU builds and is serial without it.
CXX_FLAGS = ["-O3", "-fno-math-errno", "-fno-trapping-math", "-fopenmp", "-Wall", "-Wextra", "-Wno-unused-parameter"]
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-Xcompiler=-fno-math-errno"]
# libstdc++ by its soname, ahead of the -lstdc++ the compiler driver appends: where that finds only the
# static archive (a toolchain without the libstdc++.so link, or -static-libstdc++ in LDFLAGS), nanscan
# would carry a private copy of libstdc++ beside the shared one torch uses, and the two copies' locale
# facets mix: formatting a number into an error message then crashed the process (seen on an H100
# machine's image, benchmarks/NOTES.md entry 17). tests/test_setup.py checks the built library.
LINK_FLAGS = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []


def log(message: str) -> None:
    print(f"nanscan setup: {message}", file=sys.stderr)


def cuda_build_reason() -> tuple[bool, str]:
    """Whether to build the CUDA backend, and why, from the installed torch and the toolkit found.

    Raises SystemExit when torch has CUDA but no toolkit is found: a CPU-only build there would fail
    only later, at the first CUDA call."""
    if os.environ.get("NANSCAN_CPU_ONLY") == "1":
        return False, "NANSCAN_CPU_ONLY=1"
    if torch.version.cuda is None:
        return False, f"torch {torch.__version__} has no CUDA support"
    cuda_home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or cpp_extension.CUDA_HOME
    if not cuda_home or not os.path.exists(os.path.join(cuda_home, "bin", "nvcc")):
        raise SystemExit(
            f"nanscan setup: torch {torch.__version__} has CUDA {torch.version.cuda}, but no CUDA toolkit was "
            f"found (looked at $CUDA_HOME, $CUDA_PATH, nvcc on PATH and /usr/local/cuda; got {cuda_home!r}). "
            "Set CUDA_HOME to the toolkit (the directory holding bin/nvcc), or set NANSCAN_CPU_ONLY=1 to "
            "build the CPU backend only."
        )
    return True, f"torch has CUDA {torch.version.cuda}, toolkit at {cuda_home}"


def extension():
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
    with_cuda, reason = cuda_build_reason()
    if not with_cuda:
        sources = [s for s in sources if not s.endswith("cuda_binding.cpp")]
        log(f"building CPU backend only ({reason})")
        log(f"sources: {', '.join(sources)}")
        return CppExtension("nanscan._C", sources, extra_compile_args={"cxx": CXX_FLAGS}, extra_link_args=LINK_FLAGS)

    # Without an explicit list, torch probes the local GPU, which fails on a build machine without one.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0")
    sources += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    log(f"building CPU + CUDA backends ({reason}; arch list {os.environ['TORCH_CUDA_ARCH_LIST']})")
    log(f"sources: {', '.join(sources)}")
    return CUDAExtension(
        "nanscan._C",
        sources,
        define_macros=[("NANSCAN_WITH_CUDA", "1")],
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
        extra_link_args=LINK_FLAGS,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
