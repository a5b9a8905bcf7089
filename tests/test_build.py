"""What a build of nanscan holds, checked on the library itself (issue 34): no C++ symbol of torch
imported (the stable ABI: one build for every torch from 2.10 on); on a CUDA torch, the real
CUDA kernels registered for the CUDA dispatch key, one libcudart in the process, and a kernel image
for every architecture of the build (cuobjdump, from NVIDIA's pip package or a toolkit).

A CPU-only build skips these, except where ``NANSCAN_REQUIRE_CUDA_BUILD=1`` says a CUDA build was
asked for (CI's build in the newest torch's venv): there a build that fell back to the CPU alone
fails, rather than pass by skipping.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from nanscan import _C, _ops

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))
# The kernels' resource budget; setup.py's floor, and its parse of an architecture flag ("sm_90" -> (9, 0)).
import kernel_budget
from cuda_toolkit import OLDEST_ARCH, _arch

REQUIRED = os.environ.get("NANSCAN_REQUIRE_CUDA_BUILD") == "1"
# The first toolkit whose nvcc targets an architecture, for those newer than CUDA 12.0 (NVIDIA's
# release notes): Blackwell's came with CUDA 12.8 (sm_100, sm_120) and 12.9 (sm_103, sm_121).
FIRST_TOOLKIT = {(10, 0): (12, 8), (12, 0): (12, 8), (10, 3): (12, 9), (12, 1): (12, 9), (11, 0): (13, 0)}

needs_cuda_build = pytest.mark.skipif(
    _ops.cuda_library is None and not REQUIRED,
    reason="no CUDA library of torch's CUDA in this install (NANSCAN_REQUIRE_CUDA_BUILD unset)",
)


def cuda_library() -> ModuleType:
    """The CUDA library nanscan loaded for this torch's CUDA; a failure where a CUDA build is required."""
    assert _ops.cuda_library is not None, (
        f"NANSCAN_REQUIRE_CUDA_BUILD=1, but no CUDA library of torch's CUDA {torch.version.cuda} was loaded; "
        f"the install holds {_ops.cuda_libraries_held()}"
    )
    return _ops.cuda_library


def undefined_symbols(library: str) -> list[str]:
    """The dynamic symbols a shared library imports, demangled (binutils' nm and c++filt)."""
    listed = subprocess.run(["nm", "-D", "--undefined-only", library], capture_output=True, text=True, check=True)
    names = [line.split()[-1] for line in listed.stdout.splitlines() if line.strip()]
    return subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout.split(
        "\n"
    )


@pytest.mark.skipif(shutil.which("nm") is None or shutil.which("c++filt") is None, reason="no binutils (nm, c++filt)")
def test_the_library_imports_no_cpp_symbol_of_torch() -> None:
    """Built on torch's stable ABI (csrc/torch_api.h), the library calls torch only through its C
    functions (aoti_torch_*, torch_*), whose signatures torch keeps from 2.10 on: a C++ symbol of
    c10, ATen or torch would tie it to the release it was built against."""
    for library in libraries():
        imported = undefined_symbols(library)
        tied = [name for name in imported if re.search(r"\b(c10|at|torch|caffe2)::", name)]
        assert not tied, f"{library} imports {len(tied)} C++ symbols of torch: {tied[:10]}"
        assert any(name.startswith("aoti_torch_") for name in imported), f"{library}: no shim call where expected"


def libraries() -> list[str]:
    """Every compiled library of this install: _C and the CUDA ones."""
    return [_C.__file__, *(str(p) for p in sorted(Path(_C.__file__).parent.glob("_C_cuda*.so")))]


@pytest.mark.skipif(shutil.which("readelf") is None, reason="no binutils (readelf)")
def test_a_cuda_library_needs_torchs_cuda_library_and_one_cudart() -> None:
    """The CUDA calls of torch's stable shim (the current stream, the device guard) live in
    libtorch_cuda.so: the library must name it, whether it was linked against torch's or against the
    stand-in a CPU torch's build makes (setup.py), and its own CUDA major's libcudart.so.N."""
    for library in libraries()[1:]:
        dynamic = subprocess.run(["readelf", "-d", library], capture_output=True, text=True, check=True).stdout
        needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", dynamic)
        major = re.search(r"_C_cuda(\d+)\.", Path(library).name)
        assert major is not None, library
        assert "libtorch_cuda.so" in needed, (library, needed)
        assert [n for n in needed if n.startswith("libcudart")] == [f"libcudart.so.{major.group(1)}"], (library, needed)


def test_the_libraries_are_built_for_pythons_limited_api() -> None:
    """One build for every CPython from 3.10 (the wheel's abi3 tag): the files say so."""
    for library in libraries():
        assert Path(library).name.endswith(".abi3.so"), library


def built_archs() -> tuple[set[str], set[str]]:
    """(the SASS architectures, the PTX ones) the CUDA library says it holds, from its ``cuda_archs``."""
    sass, ptx = set(), set()
    for entry in filter(None, cuda_library().cuda_archs.split(";")):
        number = entry.removesuffix("+PTX").replace(".", "")
        sass.add(f"sm_{number}")
        if entry.endswith("+PTX"):
            ptx.add(f"sm_{number}")
    return sass, ptx


@needs_cuda_build
def test_a_cuda_build_registers_its_kernels_for_the_cuda_key() -> None:
    library = cuda_library()
    assert library.cuda_major == int(torch.version.cuda.split(".")[0]), (library.cuda_major, torch.version.cuda)
    assert library.cuda_version // 1000 == library.cuda_major, library.cuda_version  # CUDART_VERSION: 12040
    for op in ("scan", "scale_", "unscale_scan_", "scan_difference"):
        dump = torch._C._dispatch_dump(f"nanscan::{op}")
        cuda = [line for line in dump.splitlines() if line.startswith("CUDA:")]
        # The real kernels are registered by cuda_binding.cpp; the stand-ins of an install without
        # them (which say "holds no CUDA library") by nanscan/_ops.py.
        assert len(cuda) == 1 and "cuda_binding.cpp" in cuda[0], dump


@needs_cuda_build
def test_one_libcudart_is_mapped() -> None:
    """nanscan links the libcudart.so.N torch loads (the same soname), not a second runtime."""
    assert torch.version.cuda is not None, "a CUDA build of nanscan on a CPU torch"
    script = (
        "import re, torch, nanscan\n"
        "nanscan.scan([torch.ones(2)])\n"
        "paths = {line.split()[-1] for line in open('/proc/self/maps') if re.search(r'libcudart[^/]*\\.so', line)}\n"
        "print('\\n'.join(sorted(paths)))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    mapped = done.stdout.split()
    real = {os.path.realpath(path) for path in mapped}
    assert len(real) == 1, f"libcudart mapped from {len(real)} files: {sorted(real)}"
    major = torch.version.cuda.split(".")[0]
    assert re.search(rf"libcudart\.so\.{major}(\.|$)", Path(mapped[0]).name), mapped


def cuobjdump() -> str:
    """cuobjdump (tools/kernel_budget.py's search); a failure where a CUDA build is required, else a skip."""
    tool = kernel_budget.find_cuobjdump()
    if tool is None:
        if REQUIRED:
            pytest.fail("no cuobjdump: pip install nvidia-cuda-cuobjdump (the 'build-check' extra)")
        pytest.skip("no cuobjdump (pip install nvidia-cuda-cuobjdump)")
    return tool


@needs_cuda_build
def test_the_fatbinary_holds_every_architecture_of_the_build() -> None:
    tool = cuobjdump()
    library = cuda_library().__file__

    def listed(kind: str) -> set[str]:
        out = subprocess.run([tool, f"--list-{kind}", library], capture_output=True, text=True, timeout=120, check=True)
        return set(re.findall(r"\.(sm_\d+a?)\.(?:cubin|ptx)", out.stdout))

    sass, ptx = built_archs()
    archs = cuda_library().cuda_archs
    assert sass, f"cuda_archs is {archs!r}"
    assert listed("elf") == sass, (listed("elf"), archs)
    assert listed("ptx") == ptx, (listed("ptx"), archs)
    # PTX for the newest architecture: GPUs newer than the build still run (their driver compiles it).
    newest = max(sass, key=lambda a: int(re.sub(r"\D", "", a)))
    assert ptx == {newest}, (ptx, newest)


@needs_cuda_build
def test_the_kernels_keep_their_sm90_register_and_stack_budget() -> None:
    """tools/kernel_budget.py on the library that ships (CI's one CUDA compile is the wheel's build):
    the scan and difference kernels' registers and stack within the budget the H100 figures rest on,
    and no flush-to-zero in the PTX."""
    tool = cuobjdump()
    sass, ptx = built_archs()
    if kernel_budget.BUDGET_ARCH not in sass:
        pytest.skip(f"no {kernel_budget.BUDGET_ARCH} code in this build ({cuda_library().cuda_archs})")
    _, problems = kernel_budget.check(cuda_library().__file__, tool=tool, require_ptx=bool(ptx))
    assert not problems, "\n".join(problems)


@pytest.mark.skipif(
    not REQUIRED, reason="the default architectures are CI's CUDA build's (NANSCAN_REQUIRE_CUDA_BUILD=1)"
)
def test_a_default_build_covers_every_architecture_torch_was_built_for() -> None:
    """Built without TORCH_CUDA_ARCH_LIST (as CI builds): SASS for every architecture of the torch it
    was built against, from sm_75 on, that the toolkit's nvcc could target; an architecture newer
    than the toolkit (sm_100 and sm_120 for CUDA 12.4) runs the PTX of the newest one, which must then
    be there and older (a driver compiles PTX for a newer GPU, never an older one)."""
    library = cuda_library()
    toolkit = divmod(library.cuda_version // 10, 100)  # CUDART_VERSION: 12040 -> (12, 4)
    wanted = {
        arch
        for flag in torch._C._cuda_getArchFlags().split()
        if flag.startswith("sm_") and (arch := _arch(flag)) >= OLDEST_ARCH
    }
    sass, ptx = ({_arch(a) for a in archs} for archs in built_archs())
    targetable = {arch for arch in wanted if FIRST_TOOLKIT.get(arch, (0, 0)) <= toolkit}
    assert targetable <= sass, f"torch {torch.__version__} holds {sorted(wanted)}; the build {library.cuda_archs!r}"
    for arch in wanted - targetable:
        assert ptx and max(ptx) <= arch, (
            f"{arch}: newer than CUDA {toolkit}, and no PTX for it in {library.cuda_archs!r}"
        )


def test_the_cuda_libraries_held_are_the_ones_on_disk() -> None:
    on_disk = sorted(p.name.split(".")[0] for p in Path(_C.__file__).parent.glob("_C_cuda*.so"))
    assert _ops.cuda_libraries_held() == on_disk
    if _ops.cuda_library is not None:
        assert _ops.cuda_library.__name__ == f"nanscan._C_cuda{torch.version.cuda.split('.')[0]}"


def test_a_torch_below_the_floor_is_refused_by_name_before_the_library_loads() -> None:
    """On a torch older than 2.10 the library would fail to load with the dynamic linker's "undefined
    symbol"; nanscan refuses first, naming the torch it found and what to do."""
    script = "import torch; torch.__version__ = '2.9.1+cu128'\ntry:\n    import nanscan\nexcept ImportError as e:\n"
    script += "    print(e)\nelse:\n    print('imported')\n"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, check=True)
    assert "nanscan needs torch 2.10 or newer" in done.stdout and "this is torch 2.9.1+cu128" in done.stdout, done
    assert "undefined symbol" not in done.stdout + done.stderr
