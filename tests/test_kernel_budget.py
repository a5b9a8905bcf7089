"""tools/kernel_budget.py reads the kernels' registers and stack out of a ``cuobjdump -res-usage``
listing, and holds them to the sm_90 budget the H100 figures rest on (benchmarks/NOTES.md entries 25
and 40). The listings here are shaped as cuobjdump 13 prints them; tests/test_build.py runs the
check itself on a built CUDA library.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import kernel_budget

PREFIX = "_ZN7nanscan4cuda45_GLOBAL__N__7d99fa43_12_scan_cuda_cu_54cd549e"


def listing(*functions: tuple[str, int, int]) -> str:
    """A ``-res-usage`` listing of (mangled name suffix, registers, stack) functions."""
    lines = ["", "Resource usage:", " Common:", "  GLOBAL:0"]
    for name, registers, stack in functions:
        lines += [
            f" Function {PREFIX}{name}:",
            f"  REG:{registers} STACK:{stack} SHARED:18440 LOCAL:0 CONSTANT[2]:12 CONSTANT[0]:7056 TEXTURE:0 "
            "SURFACE:0 SAMPLER:0",
        ]
    return "\n".join(lines) + "\n"


SCAN = "11scan_kernelILb0ELb0ELb0ELi256EEEvNS1_10ScanParamsIXT2_EEE"
SCAN_CHECKSUM = "11scan_kernelILb0ELb0ELb1ELi0EEEvNS1_10ScanParamsIXT2_EEE"
DIFFERENCE = "17difference_kernelILi0EEEvNS1_10ScanParamsIXT_EEE"
SCALE = "12scale_kernelILi256EEEvNS1_11ScaleParamsIXT_EEE"
SKETCH = "13sketch_kernelILl1024ELi4EEEvNS1_12SketchParamsE"
SKETCH_ONE_WARP = "13sketch_kernelILl4096ELi1EEEvNS1_12SketchParamsE"


def test_every_function_is_read_with_its_registers_and_stack() -> None:
    kernels = kernel_budget.parse_resource_usage(listing((SCAN, 80, 0), (SCALE, 78, 0), (DIFFERENCE, 126, 0)))
    assert [(k.name, k.registers, k.stack, k.shared, k.local) for k in kernels] == [
        (PREFIX + SCAN, 80, 0, 18440, 0),
        (PREFIX + SCALE, 78, 0, 18440, 0),
        (PREFIX + DIFFERENCE, 126, 0, 18440, 0),
    ]


def test_kernels_within_the_budget_pass() -> None:
    # The checksum variants may keep a small stack (16-48 bytes measured); the other kernels none.
    kernels = kernel_budget.parse_resource_usage(
        listing(
            (SCAN, 80, 0),
            (SCAN_CHECKSUM, 80, 16),
            (DIFFERENCE, 128, 0),
            (SKETCH, 80, 0),
            (SKETCH_ONE_WARP, 128, 0),
            (SCALE, 200, 500),
        )
    )
    assert kernel_budget.budget_violations(kernels) == []


def test_registers_or_stack_past_the_budget_are_named() -> None:
    cases = {
        (SCAN, 81, 0): "81 registers (at most 80)",
        (SCAN, 80, 8): "8 bytes of stack (at most 0)",
        (SCAN_CHECKSUM, 80, 72): "72 bytes of stack (at most 64)",
        (DIFFERENCE, 129, 0): "129 registers (at most 128)",
        # entry 39's kernel: its callee's 776-byte frame counted in the entry's stack
        (DIFFERENCE, 128, 776): "776 bytes of stack (none allowed)",
        (SKETCH, 81, 0): "81 registers (at most 80)",
        (SKETCH, 60, 16): "16 bytes of stack (none allowed)",
        (SKETCH_ONE_WARP, 129, 0): "129 registers (at most 128)",
        (SKETCH_ONE_WARP, 92, 8): "8 bytes of stack (none allowed)",
    }
    for function, expected in cases.items():
        others = [(SCAN_CHECKSUM, 80, 0)] if function[0] != SCAN_CHECKSUM else [(SCAN, 80, 0)]
        if function[0] != DIFFERENCE:
            others.append((DIFFERENCE, 120, 0))
        if function[0] != SKETCH:
            others.append((SKETCH, 60, 0))
        if function[0] != SKETCH_ONE_WARP:
            others.append((SKETCH_ONE_WARP, 92, 0))
        problems = kernel_budget.budget_violations(kernel_budget.parse_resource_usage(listing(function, *others)))
        assert len(problems) == 1 and expected in problems[0] and function[0] in problems[0], (function, problems)


def test_a_listing_without_the_budgeted_kernels_fails() -> None:
    """A renamed kernel must not pass by going unchecked."""
    problems = kernel_budget.budget_violations(kernel_budget.parse_resource_usage(listing((SCALE, 40, 0))))
    assert problems == [
        "no scan_kernel in the listing (renamed? then update tools/kernel_budget.py)",
        "no difference_kernel in the listing (renamed? then update tools/kernel_budget.py)",
        "no sketch_kernelILl1024ELi4E in the listing (renamed? then update tools/kernel_budget.py)",
        "no sketch_kernelILl4096ELi1E in the listing (renamed? then update tools/kernel_budget.py)",
    ]


def test_flush_to_zero_instructions_are_found_in_the_ptx() -> None:
    ptx = "\n".join(
        [
            ".visible .entry _Z6kernelv(",
            "\tadd.f32 \t%f3, %f1, %f2;",
            "\t@%p1 max.ftz.f32 \t%f4, %f3, %f2;",
            "\tcvt.rn.f32.f16 \t%f5, %rs1;",
        ]
    )
    assert kernel_budget.flush_to_zero_instructions(ptx) == ["@%p1 max.ftz.f32 \t%f4, %f3, %f2;"]
    assert kernel_budget.flush_to_zero_instructions(ptx.replace(".ftz", "")) == []
