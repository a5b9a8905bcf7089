"""Build nanscan's compiled library, nanscan._C, against the torch that is already installed.

Install with `pip install --no-build-isolation -e .`: the build compiles against the torch installed
in this environment, which pip's default isolated build cannot see; there, the build stops at once
and says so (pyproject.toml does not ask for torch in the build environment: it would be another one).
The CUDA backend is built when the installed torch was built with CUDA; whether a GPU is visible is
irrelevant (build machines often have none). The toolkit is found by tools/cuda_toolkit.py:
$CUDA_HOME or $CUDA_PATH, nvcc on PATH (resolved to its real toolkit), NVIDIA's pip packages in this
environment, /usr/local/cuda; its CUDA major must be torch's. A CUDA torch with no toolkit found is
an error that names the pip command installing one, not a silent CPU-only build: NANSCAN_CPU_ONLY=1
builds the CPU backend on purpose. Without TORCH_CUDA_ARCH_LIST, the kernels are built for every GPU
architecture the installed torch was built for, from sm_75 on, with PTX for the newest.
"""

import glob
import os
import site
import sys
import sysconfig
from pathlib import Path

from setuptools import setup

try:
    import torch
except ImportError:
    raise SystemExit(
        "nanscan setup: no torch in the build environment. nanscan compiles against the torch installed where "
        "it will run, which an isolated build (pip's default) cannot see: install torch, then run pip with "
        "--no-build-isolation (pip install --no-build-isolation .)"
    ) from None
from torch.utils import cpp_extension
from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join("csrc")
sys.path.insert(0, os.path.join(ROOT, "tools"))
import cuda_toolkit  # noqa: E402  (tools/, beside this file: the search is tested on its own)

# The stable ABI (csrc/torch_api.h): TORCH_TARGET_VERSION makes torch's headers expose only what
# torch 2.10 already had (and refuse to compile any ATen/c10 header), so the library loads into every
# torch from 2.10 on; tests/test_build.py checks that it imports no C++ symbol of torch. Python's
# limited API (BuildExtension adds -DPy_LIMITED_API for py_limited_api=True) makes it one build for
# every CPython from 3.10 (the wheel's abi3 tag). Symbols are hidden: nothing of nanscan's own C++ is
# exported beside PyInit__C (so no weak copy of a torch header's inline function is either).
TORCH_TARGET_VERSION = "0x020a000000000000"  # 2.10.0
STABLE_ABI_FLAGS = [f"-DTORCH_TARGET_VERSION={TORCH_TARGET_VERSION}"]
# No flag that lets the compiler assume finite math may reach this code (never -ffast-math / -Ofast /
# -ffinite-math-only). -fno-trapping-math only lets it compute both sides of a select, which the
# branch-free fp16/fp8 decoders need to vectorise; NaN/Inf classification is done on bits regardless.
# No -fopenmp: the CPU scan's threads are torch's own (torch::stable::parallel_for runs in libtorch).
CXX_FLAGS = [
    "-O3",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-fvisibility=hidden",
    "-fvisibility-inlines-hidden",
    "-Wall",
    "-Wextra",
    "-Wno-unused-parameter",
    *STABLE_ABI_FLAGS,
]
# --threads=0: nvcc compiles the architectures of a default build (six and PTX) side by side, one
# thread per CPU, rather than one after another: the .cu file is the build's long pole.
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-Xcompiler=-fno-math-errno", "--threads=0", *STABLE_ABI_FLAGS]
# libstdc++ by its soname, ahead of the -lstdc++ the compiler driver appends: where that finds only the
# static archive (a toolchain without the libstdc++.so link, or -static-libstdc++ in LDFLAGS), nanscan
# would carry a private copy of libstdc++ beside the shared one torch uses, and the two copies' locale
# facets mix: formatting a number into an error message then crashed the process (seen on an H100
# machine's image, benchmarks/NOTES.md entry 17). tests/test_setup.py checks the built library.
# -ldl: dlsym, which looks up torch's newer error-message call at run time (csrc/torch_api.cpp).
LINK_FLAGS = ["-l:libstdc++.so.6", "-ldl"] if sys.platform.startswith("linux") else []


def log(message: str) -> None:
    print(f"nanscan setup: {message}", file=sys.stderr)


def site_dirs() -> list:
    """The active environment's site-packages directories, where NVIDIA's pip toolkit would be."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [Path(d) for d in dict.fromkeys(dirs)]


def cuda_toolkit_for_build():
    """The toolkit to build the CUDA backend with, or None for a CPU-only build, and why.

    Raises SystemExit when torch has CUDA but no toolkit of its CUDA major is found: a CPU-only build
    there would fail only later, at the first CUDA call."""
    if os.environ.get("NANSCAN_CPU_ONLY") == "1":
        return None, "NANSCAN_CPU_ONLY=1"
    if torch.version.cuda is None:
        return None, f"torch {torch.__version__} has no CUDA support"
    try:
        toolkit = cuda_toolkit.find_toolkit(torch.version.cuda, os.environ, site_dirs())
    except cuda_toolkit.ToolkitNotFound as error:
        raise SystemExit(f"nanscan setup: {error}") from None
    return toolkit, (
        f"torch has CUDA {torch.version.cuda}, toolkit CUDA {toolkit.version[0]}.{toolkit.version[1]} at "
        f"{toolkit.home} ({toolkit.found_by})"
    )


def cudart_link_dir(toolkit) -> list:
    """A directory holding ``libcudart.so`` for ``-lcudart``, where the toolkit ships only
    ``libcudart.so.N`` (NVIDIA's pip runtime): a link to it in the build tree. The library then needs
    ``libcudart.so.N``, the one torch itself loads."""
    if toolkit.cudart is None:
        return []
    directory = os.path.join(ROOT, "build", "cudart-link")
    os.makedirs(directory, exist_ok=True)
    link = os.path.join(directory, "libcudart.so")
    if os.path.islink(link) or os.path.exists(link):
        os.remove(link)
    os.symlink(toolkit.cudart, link)
    return [directory]


def write_arch_header(arch_list: str) -> str:
    """A header in the build tree naming the architectures built for, which the CUDA binding's error for
    a GPU without a kernel quotes; returns its directory."""
    directory = os.path.join(ROOT, "build", "generated")
    os.makedirs(directory, exist_ok=True)
    quoted = arch_list.replace("\\", "").replace('"', "")
    with open(os.path.join(directory, "nanscan_cuda_archs.h"), "w") as header:
        header.write(f'// Written by setup.py.\n#pragma once\n#define NANSCAN_CUDA_ARCHS "{quoted}"\n')
    return directory


def extension():
    sources = sorted(glob.glob(os.path.join(CSRC, "*.cpp")) + glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))
    toolkit, reason = cuda_toolkit_for_build()
    if toolkit is None:
        sources = [s for s in sources if not s.endswith("cuda_binding.cpp")]
        log(f"building CPU backend only ({reason})")
        log(f"sources: {', '.join(sources)}")
        return CppExtension(
            "nanscan._C",
            sources,
            py_limited_api=True,
            extra_compile_args={"cxx": CXX_FLAGS},
            extra_link_args=LINK_FLAGS,
        )

    # torch's build helpers read the toolkit from this module attribute and the variable.
    cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"] = str(toolkit.home)
    if "TORCH_CUDA_ARCH_LIST" not in os.environ:
        # Left unset, torch would probe the local GPU (none on most build machines) and build for it only.
        os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_toolkit.arch_list(
            torch._C._cuda_getArchFlags(), cuda_toolkit.nvcc_gpu_archs(toolkit)
        )
    sources += sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu")))
    arch_header_dir = write_arch_header(os.environ["TORCH_CUDA_ARCH_LIST"])
    log(f"building CPU + CUDA backends ({reason}; arch list {os.environ['TORCH_CUDA_ARCH_LIST']})")
    log(f"sources: {', '.join(sources)}")
    return CUDAExtension(
        "nanscan._C",
        sources,
        py_limited_api=True,
        # USE_CUDA declares the stable shim's CUDA calls (the current stream, the device guard).
        define_macros=[("NANSCAN_WITH_CUDA", "1"), ("USE_CUDA", "1")],
        include_dirs=[arch_header_dir, *(str(d) for d in toolkit.include_dirs)],
        library_dirs=[str(d) for d in toolkit.library_dirs] + cudart_link_dir(toolkit),
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
        extra_link_args=LINK_FLAGS,
    )


setup(
    ext_modules=[extension()],
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
    # One wheel for every CPython from 3.10 (the limited API above): tagged cp310-abi3.
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
