"""Where the CUDA toolkit is, and which GPUs to build for: setup.py's search, kept apart so that the
tests can run it on directories laid out like each case (tests/test_setup.py).

The search, in this order; the first toolkit whose CUDA major is torch's wins:

1. ``$CUDA_HOME``, then ``$CUDA_PATH`` (a directory holding ``bin/nvcc``). One set to a toolkit of
   another CUDA major is an error: it was asked for by name.
2. ``nvcc`` on ``PATH``, resolved to its real toolkit by asking nvcc itself (``nvcc --dryrun`` prints
   ``#$ TOP=<toolkit>/bin/..``), as CMake does: a wrapper script (``exec /usr/local/cuda-13.0/bin/nvcc
   "$@"``) sits in a directory that is no toolkit, where torch's own guess (the parent of ``bin``)
   finds no headers.
3. NVIDIA's pip toolkit in the active environment: ``nvidia/cu13`` (CUDA 13 and later: one
   directory, ``include/cccl`` for CCCL), or CUDA 12's per-component directories
   (``nvidia/cuda_nvcc``, ``nvidia/cuda_runtime``, ``nvidia/cuda_cccl``, whose include
   directories the compilers are given). Their runtime ships only ``libcudart.so.N``, no
   ``libcudart.so`` for ``-lcudart`` to find: setup.py links it through a directory of its own.
4. ``/usr/local/cuda``.

None found: ``ToolkitNotFound``, whose message names what was looked at and the one pip command
that installs the matching toolkit (with it, the build needs no system toolkit at all).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_HOME = Path("/usr/local/cuda")
OLDEST_ARCH = (7, 5)  # torch's CUDA 12 and 13 builds start at sm_75 (Turing: T4, the RTX 20 series)


class ToolkitNotFound(Exception):
    """No CUDA toolkit of torch's CUDA major was found; the message says where it looked and what to
    install."""


@dataclass(frozen=True)
class Toolkit:
    """A CUDA toolkit, as torch's build helpers need it.

    Attributes:
        home: what ``CUDA_HOME`` must be for torch.utils.cpp_extension: ``bin/nvcc`` below it.
        version: the CUDA version nvcc reports, (major, minor).
        found_by: how the search found it, for the build log.
        include_dirs: header directories beyond ``home/include`` (CUDA 12's pip components, CCCL).
        library_dirs: library directories beyond ``home/lib64`` (pip's ``lib``).
        cudart: the runtime's versioned library, where no ``libcudart.so`` link sits beside it.
    """

    home: Path
    version: tuple[int, int]
    found_by: str
    include_dirs: tuple[Path, ...] = field(default=())
    library_dirs: tuple[Path, ...] = field(default=())
    cudart: Path | None = None


# The GPU architectures torch's own CUDA builds hold, per CUDA major (``torch._C._cuda_getArchFlags()``
# of torch 2.14.1+cu130, and of the cu128/cu129 builds), for a library built without a CUDA torch of
# that major (a wheel's CUDA 12 library, built beside a CUDA 13 or a CPU torch).
TORCH_ARCH_FLAGS = {
    12: "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120",
    13: "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120",
}


def find_toolkit(
    torch_cuda: str,
    environ: Mapping[str, str],
    site_dirs: Sequence[Path],
    default_home: Path = DEFAULT_HOME,
    named_must_match: bool = True,
) -> Toolkit:
    """The toolkit for a torch built with CUDA ``torch_cuda`` (``torch.version.cuda``, or a major
    alone: "12"), by the search in the module notes. ``site_dirs``: the active environment's
    site-packages directories. ``named_must_match``: a ``$CUDA_HOME`` of another CUDA major is an error
    (a build for torch's CUDA); else it is passed over (a build of several majors, each searched)."""
    major = int(torch_cuda.split(".")[0])
    looked: list[str] = []
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        value = environ.get(variable)
        if not value:
            continue
        toolkit = _toolkit_at(Path(value), f"${variable}")
        if toolkit is None:
            raise ToolkitNotFound(
                f"${variable}={value} holds no bin/nvcc: point it at a CUDA {major} toolkit, or unset it "
                "to let the build search"
            )
        if toolkit.version[0] != major and not named_must_match:
            looked.append(f"{value} (${variable}: CUDA {_dotted(toolkit.version)})")
            continue
        if toolkit.version[0] != major:
            raise ToolkitNotFound(
                f"${variable}={value} is CUDA {_dotted(toolkit.version)}, but torch was built with CUDA {torch_cuda}: "
                f"point it at a CUDA {major} toolkit, or {install_advice(torch_cuda)}"
            )
        return toolkit
    for toolkit in _candidates(environ, site_dirs, default_home, looked):
        if toolkit.version[0] == major:
            return toolkit
        looked.append(f"{toolkit.home} (CUDA {_dotted(toolkit.version)}, {toolkit.found_by}: not torch's CUDA {major})")
    searched = "; ".join(looked) if looked else "nothing"
    raise ToolkitNotFound(
        f"torch was built with CUDA {torch_cuda} and no CUDA {major} toolkit was found (looked at $CUDA_HOME, "
        f"$CUDA_PATH, nvcc on PATH, NVIDIA's pip packages and {default_home}; found: {searched}). "
        f"{install_advice(torch_cuda)[0].upper()}{install_advice(torch_cuda)[1:]}; or set CUDA_HOME to a toolkit; or set "
        "NANSCAN_CPU_ONLY=1 to build the CPU backend only"
    )


def first_toolkit(
    environ: Mapping[str, str], site_dirs: Sequence[Path], default_home: Path = DEFAULT_HOME
) -> Toolkit | None:
    """The first toolkit the search finds, of any CUDA major (a wheel's build on a CPU torch, where no
    torch says which major to look for); None when there is none."""
    for variable in ("CUDA_HOME", "CUDA_PATH"):
        value = environ.get(variable)
        toolkit = _toolkit_at(Path(value), f"${variable}") if value else None
        if toolkit is not None:
            return toolkit
    return next(iter(_candidates(environ, site_dirs, default_home, [])), None)


def install_command(torch_cuda: str) -> str | None:
    """The pip command that installs NVIDIA's toolkit packages of torch's CUDA version (or major), from
    CUDA 13 on; None before: CUDA 12's pip packages hold no nvcc (``nvidia-cuda-nvcc-cu12`` ships
    ptxas, NVVM and headers alone: 12.4.131, 12.6.85, 12.8.93 and 12.9.86 looked at, 2026-11-26)."""
    parts = torch_cuda.split(".")
    major = parts[0]
    if int(major) < 13:
        return None
    pin = f"=={major}.{parts[1]}.*" if len(parts) > 1 else f"=={major}.*"
    packages = ["nvidia-cuda-nvcc", "nvidia-cuda-cccl", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-runtime"]
    return "pip install " + " ".join(f'"{name}{pin}"' for name in packages)


def install_advice(torch_cuda: str) -> str:
    """How to get a toolkit of this CUDA version: NVIDIA's pip packages where they hold nvcc."""
    command = install_command(torch_cuda)
    if command is not None:
        return f"install one into this environment: {command}"
    major = torch_cuda.split(".")[0]
    advice = (
        f"install a CUDA {major} toolkit (NVIDIA's installer, or your distribution's package: NVIDIA's CUDA {major} "
        "pip packages hold no nvcc)"
    )
    if major == "12":  # Debian's CUDA 12.4, unpacked into a directory, not installed
        advice += "; on Debian or Ubuntu, `bash tools/cuda12_from_debian.sh DIR` unpacks one into DIR for CUDA_HOME"
    return advice


def _candidates(
    environ: Mapping[str, str], site_dirs: Sequence[Path], default_home: Path, looked: list[str]
) -> Iterable[Toolkit]:
    nvcc = shutil.which("nvcc", path=environ.get("PATH", ""))
    if nvcc is not None:
        home = _home_of_nvcc(Path(nvcc))
        toolkit = _toolkit_at(home, f"nvcc on PATH ({nvcc})") if home is not None else None
        if toolkit is not None:
            yield toolkit
        else:
            looked.append(f"{nvcc} (nvcc on PATH: its toolkit not found)")
    for site in site_dirs:
        yield from _pip_toolkits(site / "nvidia")
    toolkit = _toolkit_at(default_home, str(default_home))
    if toolkit is not None:
        yield toolkit


def _home_of_nvcc(nvcc: Path) -> Path | None:
    """The toolkit an nvcc belongs to, as nvcc itself says (``--dryrun`` needs no input file to exist);
    else the directory above the ``bin`` that its resolved path sits in."""
    try:
        dryrun = subprocess.run(
            [str(nvcc), "--dryrun", "nanscan_probe.cu"], capture_output=True, text=True, timeout=60, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    for line in (dryrun.stdout + dryrun.stderr).splitlines():
        match = re.match(r"#\$ TOP=(.+)$", line.strip())
        if match:
            return Path(os.path.normpath(match.group(1).strip().strip('"')))
    resolved = nvcc.resolve()
    return resolved.parent.parent if resolved.parent.name == "bin" else None


def _toolkit_at(home: Path, found_by: str, **extra: object) -> Toolkit | None:
    """The toolkit whose nvcc is ``home/bin/nvcc``, with the version it reports; None if there is none."""
    nvcc = home / "bin" / "nvcc"
    if not (nvcc.is_file() and os.access(nvcc, os.X_OK)):
        return None
    version = _nvcc_version(nvcc)
    if version is None:
        return None
    return Toolkit(home=home, version=version, found_by=found_by, **extra)  # type: ignore[arg-type]


def _nvcc_version(nvcc: Path) -> tuple[int, int] | None:
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"release (\d+)\.(\d+)", out.stdout)
    return (int(match.group(1)), int(match.group(2))) if match else None


def _pip_toolkits(nvidia: Path) -> Iterable[Toolkit]:
    """NVIDIA's pip toolkits under one site-packages' ``nvidia`` directory: ``cuN`` homes (CUDA 13 on),
    newest first, then CUDA 12's components."""
    if not nvidia.is_dir():
        return
    homes = sorted(
        (p for p in nvidia.glob("cu[0-9]*") if p.name[2:].isdigit()), key=lambda p: int(p.name[2:]), reverse=True
    )
    for home in homes:
        lib = home / "lib"
        toolkit = _toolkit_at(
            home,
            f"NVIDIA's pip packages ({home})",
            include_dirs=tuple(p for p in [home / "include" / "cccl"] if p.is_dir()),
            library_dirs=(lib,),
            cudart=_versioned_cudart(lib),
        )
        if toolkit is not None:
            yield toolkit
    runtime, cccl = nvidia / "cuda_runtime", nvidia / "cuda_cccl"
    toolkit = _toolkit_at(
        nvidia / "cuda_nvcc",
        f"NVIDIA's pip packages ({nvidia}/cuda_nvcc, cuda_runtime, cuda_cccl)",
        include_dirs=tuple(p for p in (runtime / "include", cccl / "include") if p.is_dir()),
        library_dirs=(runtime / "lib",),
        cudart=_versioned_cudart(runtime / "lib"),
    )
    if toolkit is not None:
        yield toolkit


def _versioned_cudart(lib: Path) -> Path | None:
    """``libcudart.so.N`` in ``lib`` when there is no ``libcudart.so`` beside it (pip's runtime)."""
    if (lib / "libcudart.so").exists():
        return None
    versioned = sorted(lib.glob("libcudart.so.[0-9]*"), key=lambda p: len(p.name))
    return versioned[0] if versioned else None


def arch_list(torch_arch_flags: str, nvcc_archs: Iterable[str]) -> str:
    """``TORCH_CUDA_ARCH_LIST`` for a build: every architecture the torch it builds against was built
    for (``torch._C._cuda_getArchFlags()``, e.g. ``"sm_75 sm_80 sm_86 sm_90 sm_100 sm_120"``), from
    sm_75 on, that this nvcc can target (``nvcc --list-gpu-arch``: ``compute_75`` ...), with PTX for
    the newest, so GPUs newer than the build still run (their driver compiles the PTX)."""
    wanted = {_arch(flag) for flag in torch_arch_flags.split() if flag.startswith(("sm_", "compute_"))}
    supported = {_arch(name) for name in nvcc_archs if name.startswith(("sm_", "compute_"))}
    archs = sorted(a for a in wanted & supported if a >= OLDEST_ARCH)
    if not archs:
        raise ToolkitNotFound(
            f"no GPU architecture both torch ({torch_arch_flags!r}) and nvcc ({' '.join(sorted(nvcc_archs))}) know, "
            "from sm_75 on: set TORCH_CUDA_ARCH_LIST"
        )
    names = [f"{major}.{minor}" for major, minor in archs]
    names[-1] += "+PTX"
    return ";".join(names)


def _arch(flag: str) -> tuple[int, int]:
    """``sm_90`` / ``compute_90a`` / ``sm_100`` -> (9, 0) / (9, 0) / (10, 0)."""
    digits = re.match(r"(?:sm|compute)_(\d+)", flag)
    assert digits is not None, flag
    number = digits.group(1)
    return int(number[:-1]), int(number[-1])


def nvcc_gpu_archs(toolkit: Toolkit) -> list[str]:
    """The architectures this toolkit's nvcc can compile for (``nvcc --list-gpu-arch``)."""
    out = subprocess.run(
        [str(toolkit.home / "bin" / "nvcc"), "--list-gpu-arch"], capture_output=True, text=True, timeout=60, check=False
    )
    return out.stdout.split()


def _dotted(version: tuple[int, int]) -> str:
    return f"{version[0]}.{version[1]}"


def _site_dirs() -> list[Path]:
    import site
    import sysconfig

    paths = sysconfig.get_paths()
    return [Path(d) for d in dict.fromkeys([paths["purelib"], paths["platlib"], *site.getsitepackages()])]


if __name__ == "__main__":
    # tools/build_wheel.sh asks which CUDA major to build when it is not told: that of the first
    # toolkit found here (nothing printed when there is none).
    import sys

    if sys.argv[1:] != ["first-major"]:
        sys.exit("usage: python tools/cuda_toolkit.py first-major")
    found = first_toolkit(os.environ, _site_dirs())
    if found is not None:
        print(found.version[0])
