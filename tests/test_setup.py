"""setup.py's choice of backends: a CUDA build of torch gets the CUDA backend or a loud error, never a
silent CPU-only build (whose first CUDA call would fail far from the cause)."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import ROOT


def setup_functions() -> dict[str, Any]:
    """setup.py's imports, constants and functions, without its call to setup()."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    kept = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.Assign))]
    namespace: dict[str, Any] = {"__file__": str(ROOT / "setup.py")}
    exec(compile(ast.Module(body=kept, type_ignores=[]), "setup.py", "exec"), namespace)
    return namespace


@pytest.fixture
def cuda_torch(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """setup.py's functions, seeing a torch built with CUDA and no toolkit anywhere."""
    setup = setup_functions()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(setup["cpp_extension"], "CUDA_HOME", None)
    for name in ("CUDA_HOME", "CUDA_PATH", "NANSCAN_CPU_ONLY"):
        monkeypatch.delenv(name, raising=False)
    return setup


def test_cuda_torch_without_a_toolkit_fails_loudly(cuda_torch: dict[str, Any]) -> None:
    with pytest.raises(SystemExit, match=r"no CUDA toolkit was found.*Set CUDA_HOME.*NANSCAN_CPU_ONLY=1"):
        cuda_torch["cuda_build_reason"]()


def test_opt_out_builds_the_cpu_backend(cuda_torch: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NANSCAN_CPU_ONLY", "1")
    assert cuda_torch["cuda_build_reason"]() == (False, "NANSCAN_CPU_ONLY=1")


def fake_toolkit(root: Path) -> Path:
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "nvcc").write_text("#!/bin/sh\n")
    return root


def test_toolkit_from_the_environment_or_from_torch(
    cuda_torch: dict[str, Any], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # torch's own detection (nvcc on PATH, /usr/local/cuda) when no variable is set.
    found_by_torch = fake_toolkit(tmp_path / "found")
    monkeypatch.setattr(cuda_torch["cpp_extension"], "CUDA_HOME", str(found_by_torch))
    with_cuda, reason = cuda_torch["cuda_build_reason"]()
    assert with_cuda and str(found_by_torch) in reason
    # CUDA_HOME wins over it.
    explicit = fake_toolkit(tmp_path / "explicit")
    monkeypatch.setenv("CUDA_HOME", str(explicit))
    with_cuda, reason = cuda_torch["cuda_build_reason"]()
    assert with_cuda and str(explicit) in reason
    # A CUDA_HOME without bin/nvcc is no toolkit.
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(SystemExit, match="no CUDA toolkit was found"):
        cuda_torch["cuda_build_reason"]()


def test_cpu_torch_builds_the_cpu_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    setup = setup_functions()
    monkeypatch.setattr(torch.version, "cuda", None)
    with_cuda, reason = setup["cuda_build_reason"]()
    assert not with_cuda and "has no CUDA support" in reason


@pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("readelf") is None or shutil.which("nm") is None,
    reason="needs readelf and nm",
)
def test_library_links_the_shared_libstdcxx() -> None:
    """nanscan._C must use the libstdc++ that torch uses, not a private static copy: with two copies,
    formatting a number into an error message crashed the process (an H100 machine's image, where the
    link found only libstdc++.a). setup.py names the shared library; this checks the result."""
    import nanscan._C

    dynamic = subprocess.run(["readelf", "-dW", nanscan._C.__file__], capture_output=True, text=True, check=True)
    needed = [line.split("[")[-1].rstrip("]") for line in dynamic.stdout.splitlines() if "(NEEDED)" in line]
    assert any(name.startswith("libstdc++.so") for name in needed), f"libstdc++ not a dynamic dependency: {needed}"
    symbols = subprocess.run(
        ["nm", "-D", "--defined-only", "-C", nanscan._C.__file__], capture_output=True, text=True, check=True
    )
    assert "std::locale::classic()" not in symbols.stdout, "nanscan._C defines libstdc++'s own symbols"
