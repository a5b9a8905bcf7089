"""Build nanscan's compiled libraries: nanscan._C (the ops and their CPU kernels) and one
nanscan._C_cuda<major> per CUDA toolkit (the CUDA kernels), all on PyTorch's stable ABI, so that
one build loads into every torch from 2.10 on and every CPython from 3.10 (abi3).

Install with `pip install --no-build-isolation -e .`: the build reads the headers of the torch installed
in this environment, which pip's default isolated build cannot see; there, the build stops at once
and says so (pyproject.toml does not ask for torch in the build environment: it would be another one).
A CUDA library is built for the installed torch's CUDA major when torch was built with CUDA, or for
each major of NANSCAN_CUDA_MAJORS (e.g. "12,13": a wheel's build, which needs toolkits, not a CUDA
torch); whether a GPU is visible is irrelevant (build machines often have none). The toolkit is found by tools/cuda_toolkit.py:
$CUDA_HOME or $CUDA_PATH, nvcc on PATH (resolved to its real toolkit), NVIDIA's pip packages in this
environment, /usr/local/cuda; its CUDA major must be torch's. A CUDA torch with no toolkit found is
an error that names the pip command installing one, not a silent CPU-only build: NANSCAN_CPU_ONLY=1
builds the CPU backend on purpose. Without TORCH_CUDA_ARCH_LIST, the kernels are built for every GPU
architecture the installed torch was built for, from sm_75 on, with PTX for the newest.
"""

import glob
import os
import site
import subprocess
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
    # The checksum's SIMD vectors (csrc/cpu/scan_cpu.cpp) pass only between always-inline functions, so
    # no ABI carries them: GCC's note that 32-byte vector arguments changed ABI in GCC 4.6 does not
    # apply. A flag, not a pragma: GCC reports it at scan_rules.h's replica_term, where a pragma of
    # scan_cpu.cpp did not reach it.
    "-Wno-psabi",
    *STABLE_ABI_FLAGS,
]
# --threads=0: nvcc compiles the architectures of a default build (six and PTX) side by side, one
# thread per CPU, rather than one after another: the .cu file is the build's long pole.
NVCC_FLAGS = ["-O3", "--expt-relaxed-constexpr", "-Xcompiler=-fno-math-errno", "--threads=0", *STABLE_ABI_FLAGS]
# NANSCAN_WERROR=1 (CI's wheel build): any warning of gcc, nvcc's front end or ptxas fails the build.
# CI's one CUDA compile is that build, so it checks the sources as strictly as a compile of its own
# would. Never the default: a newer compiler's new warning must not break a user's install.
if os.environ.get("NANSCAN_WERROR") == "1":
    CXX_FLAGS.append("-Werror")
    NVCC_FLAGS += ["-Werror", "all-warnings", "-Xcompiler=-Wall,-Wextra,-Werror"]
# libstdc++ by its soname, ahead of the -lstdc++ the compiler driver appends: where that finds only the
# static archive (a toolchain without the libstdc++.so link, or -static-libstdc++ in LDFLAGS), nanscan
# would carry a private copy of libstdc++ beside the shared one torch uses, and the two copies' locale
# facets mix: formatting a number into an error message then crashed the process (seen on an H100
# machine's image, benchmarks/NOTES.md entry 17). tests/test_setup.py checks the built library.
LINK_FLAGS = ["-l:libstdc++.so.6"] if sys.platform.startswith("linux") else []


def log(message: str) -> None:
    print(f"nanscan setup: {message}", file=sys.stderr)


def site_dirs() -> list:
    """The active environment's site-packages directories, where NVIDIA's pip toolkit would be."""
    dirs = [sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages()]
    if site.ENABLE_USER_SITE:
        dirs.append(site.getusersitepackages())
    return [Path(d) for d in dict.fromkeys(dirs)]


def cuda_toolkits_for_build() -> tuple[list, str]:
    """The toolkits to build CUDA libraries with (one library per CUDA major), and why.

    NANSCAN_CUDA_MAJORS="12,13" builds one for each major, from the toolkits the search finds, with
    or without a CUDA torch (a wheel's build: tools/build_wheel.sh). Else a CUDA torch gets the library
    of its own CUDA major, and raises SystemExit when no toolkit of that major is found: a CPU-only build
    there would fail only later, at the first CUDA call."""
    if os.environ.get("NANSCAN_CPU_ONLY") == "1":
        return [], "NANSCAN_CPU_ONLY=1"
    majors = os.environ.get("NANSCAN_CUDA_MAJORS", "").replace(" ", "")
    try:
        if majors:
            toolkits = [
                cuda_toolkit.find_toolkit(major, os.environ, site_dirs(), named_must_match=False)
                for major in dict.fromkeys(majors.split(","))
            ]
            return toolkits, f"NANSCAN_CUDA_MAJORS={majors}"
        if torch.version.cuda is None:
            return [], f"torch {torch.__version__} has no CUDA support and NANSCAN_CUDA_MAJORS is unset"
        toolkit = cuda_toolkit.find_toolkit(torch.version.cuda, os.environ, site_dirs())
    except cuda_toolkit.ToolkitNotFound as error:
        raise SystemExit(f"nanscan setup: {error}") from None
    return [toolkit], f"torch has CUDA {torch.version.cuda}"


def cudart_link_dir(toolkit) -> list:
    """A directory holding ``libcudart.so`` for ``-lcudart``, where the toolkit ships only
    ``libcudart.so.N`` (NVIDIA's pip runtime): a link to it in the build tree. The library then needs
    ``libcudart.so.N``, the one torch itself loads."""
    if toolkit.cudart is None:
        return []
    directory = os.path.join(ROOT, "build", f"cudart-link-{toolkit.version[0]}")
    os.makedirs(directory, exist_ok=True)
    link = os.path.join(directory, "libcudart.so")
    if os.path.islink(link) or os.path.exists(link):
        os.remove(link)
    os.symlink(toolkit.cudart, link)
    return [directory]


# The calls of torch's CUDA library (libtorch_cuda.so) that cuda_binding.cpp makes: the stable shim's
# current stream and device guard.
TORCH_CUDA_CALLS = (
    "aoti_torch_get_current_cuda_stream",
    "aoti_torch_create_cuda_guard",
    "aoti_torch_delete_cuda_guard",
)


def torch_cuda_stub_dir() -> list:
    """Where a CPU torch has no libtorch_cuda.so / libc10_cuda.so to link a CUDA library against,
    stand-ins with the same sonames, built here: the library records those names (DT_NEEDED) and, on a
    CUDA torch, the dynamic linker binds them to torch's real libraries, already loaded by
    ``import torch``. The stand-ins are never shipped (tools/build_wheel.sh excludes torch's libraries
    from the wheel) nor loaded."""
    torch_lib = Path(torch.__file__).parent / "lib"
    if (torch_lib / "libtorch_cuda.so").exists():
        return []
    directory = Path(ROOT, "build", "torch-cuda-stubs")
    directory.mkdir(parents=True, exist_ok=True)
    # libtorch_cuda.so's stand-in defines the calls (so that the link records it as needed); torch's
    # build helpers also link libc10_cuda.so, whose stand-in holds nothing (and is dropped where the
    # linker keeps only the libraries it needs).
    contents = {
        "libtorch_cuda.so": "".join(f"int {name}(void) {{ return 1; }}\n" for name in TORCH_CUDA_CALLS),
        "libc10_cuda.so": "",
    }
    compiler = os.environ.get("CC", "cc")
    for name, text in contents.items():
        source = directory / f"{name}.c"
        source.write_text(text or "/* nothing: only the soname matters */\n")
        subprocess.run(
            [compiler, "-shared", "-fPIC", f"-Wl,-soname,{name}", "-o", str(directory / name), str(source)], check=True
        )
    return [str(directory)]


def write_arch_header(arch_list: str, major: int) -> str:
    """A header in the build tree naming the architectures built for, which the CUDA library's error
    for a GPU without a kernel quotes; returns its directory."""
    directory = os.path.join(ROOT, "build", f"generated-cuda{major}")
    os.makedirs(directory, exist_ok=True)
    quoted = arch_list.replace("\\", "").replace('"', "")
    header = Path(directory, "nanscan_cuda_archs.h")
    text = f'// Written by setup.py.\n#pragma once\n#define NANSCAN_CUDA_ARCHS "{quoted}"\n'
    # Rewritten only when it changes: a new time would make ninja recompile what includes it at every
    # build (build/objects/ is kept between builds).
    if not header.exists() or header.read_text() != text:
        header.write_text(text)
    return directory


def arch_list_for(toolkit, asked: str | None) -> str:
    """TORCH_CUDA_ARCH_LIST for one toolkit's library: as asked, else every architecture torch's builds
    of that CUDA major hold (the installed torch's own list where it is of that major), from sm_75 on,
    that this nvcc can target, with PTX for the newest. Left to torch, it would probe the local GPU (none
    on most build machines) and build for that one only."""
    if asked:
        return asked
    major = toolkit.version[0]
    if torch.version.cuda is not None and int(torch.version.cuda.split(".")[0]) == major:
        torch_flags = torch._C._cuda_getArchFlags()
    else:
        torch_flags = cuda_toolkit.TORCH_ARCH_FLAGS.get(
            major, cuda_toolkit.TORCH_ARCH_FLAGS[max(cuda_toolkit.TORCH_ARCH_FLAGS)]
        )
    try:
        return cuda_toolkit.arch_list(torch_flags, cuda_toolkit.nvcc_gpu_archs(toolkit))
    except cuda_toolkit.ToolkitNotFound as error:
        raise SystemExit(f"nanscan setup: {error}") from None


# Sources of every library: the stable-ABI door and the shared argument checks.
COMMON_SOURCES = [os.path.join(CSRC, "torch_api.cpp"), os.path.join(CSRC, "op_args.cpp")]


def cpu_extension():
    """nanscan._C: the schemas, the CPU kernels, the composite record_."""
    sources = [*COMMON_SOURCES, os.path.join(CSRC, "ops.cpp"), *sorted(glob.glob(os.path.join(CSRC, "cpu", "*.cpp")))]
    return CppExtension(
        "nanscan._C",
        sources,
        py_limited_api=True,
        extra_compile_args={"cxx": CXX_FLAGS},
        extra_link_args=LINK_FLAGS,
    )


def cuda_extension(toolkit, asked_archs: str | None):
    """nanscan._C_cuda<major>: the CUDA kernels of one toolkit, linked to its libcudart.so.<major>."""
    major = toolkit.version[0]
    module = f"_C_cuda{major}"
    # torch's build helpers read the toolkit from this module attribute and the variable, here (the
    # include and library paths) and again when the extension compiles (NanscanBuildExtension).
    cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"] = str(toolkit.home)
    archs = arch_list_for(toolkit, asked_archs)
    sources = [
        *COMMON_SOURCES,
        os.path.join(CSRC, "cuda_binding.cpp"),
        *sorted(glob.glob(os.path.join(CSRC, "cuda", "*.cu"))),
    ]
    extension = CUDAExtension(
        f"nanscan.{module}",
        sources,
        py_limited_api=True,
        # USE_CUDA declares the stable shim's CUDA calls (the current stream, the device guard).
        define_macros=[("NANSCAN_CUDA_MODULE", module), ("USE_CUDA", "1")],
        include_dirs=[write_arch_header(archs, major), *(str(d) for d in toolkit.include_dirs)],
        library_dirs=[str(d) for d in toolkit.library_dirs] + cudart_link_dir(toolkit) + torch_cuda_stub_dir(),
        extra_compile_args={"cxx": CXX_FLAGS, "nvcc": NVCC_FLAGS},
        extra_link_args=LINK_FLAGS,
    )
    extension.nanscan_toolkit = toolkit
    extension.nanscan_archs = archs
    log(
        f"{module}: CUDA {toolkit.version[0]}.{toolkit.version[1]} at {toolkit.home} ({toolkit.found_by}); arch list {archs}"
    )
    return extension


class NanscanBuildExtension(BuildExtension):
    """torch's BuildExtension, with one toolkit per CUDA library: torch reads CUDA_HOME and
    TORCH_CUDA_ARCH_LIST when each extension compiles, and each library gets a build directory of its
    own (the libraries share sources, compiled with different flags)."""

    def build_extensions(self) -> None:
        # torch checks nvcc against torch's CUDA once, with the CUDA_HOME current here: the toolkit of
        # torch's major, when one is built.
        cuda = [ext for ext in self.extensions if hasattr(ext, "nanscan_toolkit")]
        if torch.version.cuda is not None:
            major = int(torch.version.cuda.split(".")[0])
            cuda.sort(key=lambda ext: ext.nanscan_toolkit.version[0] != major)
        if cuda:
            self._use_toolkit(cuda[0])
        super().build_extensions()

    def build_extension(self, ext) -> None:
        if hasattr(ext, "nanscan_toolkit"):
            self._use_toolkit(ext)
        base = self.build_temp
        # Each library's objects in a directory of the source tree, kept from one build to the next,
        # where setuptools gives an editable install a new temporary one each time. ninja recompiles
        # what changed, judged by each object's compile command and the times of every header it
        # read: a rebuild after an edit compiles the edited file, and a wheel built after an editable
        # install with the same flags (CI's) compiles only its CUDA library.
        # tools/build_wheel.sh starts from an empty build/ unless told to keep it.
        self.build_temp = os.path.join(ROOT, "build", "objects", ext.name)
        try:
            super().build_extension(ext)
        finally:
            self.build_temp = base

    @staticmethod
    def _use_toolkit(ext) -> None:
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"] = str(ext.nanscan_toolkit.home)
        os.environ["TORCH_CUDA_ARCH_LIST"] = ext.nanscan_archs


def extensions():
    asked_archs = os.environ.get("TORCH_CUDA_ARCH_LIST")
    toolkits, reason = cuda_toolkits_for_build()
    built = [cpu_extension()]
    if not toolkits:
        log(f"building the CPU library only ({reason})")
    else:
        log(f"building the CPU library and CUDA {', '.join(str(t.version[0]) for t in toolkits)} ({reason})")
        built += [cuda_extension(toolkit, asked_archs) for toolkit in toolkits]
    return built


setup(
    ext_modules=extensions(),
    cmdclass={"build_ext": NanscanBuildExtension.with_options(use_ninja=True)},
    # One wheel for every CPython from 3.10 (the limited API above): tagged cp310-abi3.
    options={"bdist_wheel": {"py_limited_api": "cp310"}},
)
