"""The CUDA backend's list arithmetic, checked on the CPU.

csrc/cuda/list_plan.h holds the metadata blob, the warps' shares of a list and the fold tree that the
CUDA kernel runs; it compiles with a plain C++ compiler, so tests/cpp/test_list_plan.cpp drives it
here, with no GPU, through the same walk_share() and finish_share() the kernel calls (see that file
for what it checks)."""

from __future__ import annotations

from pathlib import Path

from conftest import ROOT, build_and_run_cpp


def test_list_plan_arithmetic(tmp_path: Path) -> None:
    flags = ["-std=c++17", "-O1", "-Wall", "-Wextra", "-Werror"]
    out = build_and_run_cpp(
        tmp_path, [ROOT / "tests" / "cpp" / "test_list_plan.cpp"], flags, 120, "an endless search loop"
    )
    assert "all checks passed" in out
