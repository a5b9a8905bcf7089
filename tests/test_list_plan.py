"""The CUDA backend's list arithmetic, checked on the CPU.

csrc/cuda/list_plan.h holds the chunk spans and the fold tree that the CUDA kernel runs; it compiles
with a plain C++ compiler, so tests/cpp/test_list_plan.cpp drives it here, with no GPU, through the
same finish_chunk() the kernel calls (see that file for what it checks)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_list_plan_arithmetic(tmp_path: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        pytest.skip("no C++ compiler on PATH")
    binary = tmp_path / "test_list_plan"
    build = subprocess.run(
        [compiler, "-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror", "-o", str(binary),
         str(ROOT / "tests" / "cpp" / "test_list_plan.cpp")],
        capture_output=True, text=True,
    )
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-4000:]
    assert "all checks passed" in run.stdout
