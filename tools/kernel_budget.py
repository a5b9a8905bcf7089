"""The CUDA kernels' resource budget, checked on a built library or object: no GPU needed.

The H100 measurements rest on the kernels' occupancy (benchmarks/NOTES.md entries 25 and 40), and a
change of source or toolkit that moves ptxas past a budget changes it unseen. So, on sm_90:

- every scan kernel takes at most 80 registers (3 resident blocks of 256 threads per SM) and no stack
  (a spill needs one), but the checksum variants, which may keep up to 64 bytes;
- the difference kernel takes at most 128 registers (2 resident blocks) and no stack: its callee
  ``difference_run_any`` included, since an entry's stack is its whole call tree's;
- the update sketch's kernels take no stack; its four-warp shape (up to 1,024 buckets) at most 80
  registers, so that its shared memory (35 KB a block: six blocks an SM) stays what bounds its
  occupancy; its one-warp shape (4,096 buckets, 33 KB) at most 128, as six blocks of one warp are
  bound by shared memory at any register count;
- the PTX (the newest architecture's, embedded so that later GPUs still run) holds no ``.ftz``
  instruction: flush-to-zero would turn subnormal gradients into zeros in min/max and the norm.

The figures are ``cuobjdump -res-usage``'s and ``cuobjdump -ptx``'s (``pip install
nvidia-cuda-cuobjdump``, the "build-check" extra), read from what ships: tests/test_build.py runs
this on the wheel's CUDA library in CI, tools/check_cuda_build.sh on its own sm_90 object.

    python tools/kernel_budget.py nanscan/_C_cuda13.abi3.so
    python tools/kernel_budget.py scan_cuda.o sketch_cuda.o     # objects: the budget over them all
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

BUDGET_ARCH = "sm_90"
SCAN_REGISTERS = 80
SCAN_CHECKSUM_STACK = 64
DIFFERENCE_REGISTERS = 128
SKETCH_REGISTERS = 80
SKETCH_ONE_WARP_REGISTERS = 128
# The kernels held to a register budget and no stack at all, by a part of their mangled names (the
# sketch's by its two shapes: sketch_kernel<buckets, warps>).
_NO_STACK_BUDGETS = {
    "difference_kernel": DIFFERENCE_REGISTERS,
    "sketch_kernelILl1024ELi4E": SKETCH_REGISTERS,
    "sketch_kernelILl4096ELi1E": SKETCH_ONE_WARP_REGISTERS,
}

# " Function NAME:" then "  REG:80 STACK:0 SHARED:20552 LOCAL:0 ..." (cuobjdump 12 and 13).
_FUNCTION = re.compile(r"^\s*Function (\S+?):\s*\n\s*REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", re.MULTILINE)
# The scan kernel's template arguments: scan_kernel<half_range, multiply, checksum, capacity>.
_SCAN_FLAGS = re.compile(r"scan_kernelILb([01])ELb([01])ELb([01])E")


@dataclass(frozen=True)
class KernelResources:
    """One function's resources, as cuobjdump reports them (bytes, but registers)."""

    name: str
    registers: int
    stack: int
    shared: int
    local: int


def parse_resource_usage(listing: str) -> list[KernelResources]:
    """The functions of a ``cuobjdump -res-usage`` listing of one architecture."""
    return [
        KernelResources(name, int(registers), int(stack), int(shared), int(local))
        for name, registers, stack, shared, local in _FUNCTION.findall(listing)
    ]


def budget_violations(kernels: list[KernelResources]) -> list[str]:
    """What breaks the sm_90 budget (empty when all is well). A listing without a scan or a difference
    kernel breaks it too: a renamed kernel must not pass by going unchecked."""
    found = {"scan_kernel": 0, **dict.fromkeys(_NO_STACK_BUDGETS, 0)}
    bad = []
    for kernel in kernels:
        flags = _SCAN_FLAGS.search(kernel.name)
        if flags:
            found["scan_kernel"] += 1
            stack_allowed = SCAN_CHECKSUM_STACK if flags.group(3) == "1" else 0
            if kernel.registers > SCAN_REGISTERS or kernel.stack + kernel.local > stack_allowed:
                bad.append(
                    f"{kernel.name}: {kernel.registers} registers (at most {SCAN_REGISTERS}), "
                    f"{kernel.stack + kernel.local} bytes of stack (at most {stack_allowed})"
                )
        else:
            for name, registers in _NO_STACK_BUDGETS.items():
                if name in kernel.name:
                    found[name] += 1
                    if kernel.registers > registers or kernel.stack + kernel.local:
                        bad.append(
                            f"{kernel.name}: {kernel.registers} registers (at most {registers}), "
                            f"{kernel.stack + kernel.local} bytes of stack (none allowed)"
                        )
    bad += [
        f"no {name} in the listing (renamed? then update tools/kernel_budget.py)" for name, n in found.items() if not n
    ]
    return bad


def flush_to_zero_instructions(ptx: str) -> list[str]:
    """The PTX instructions that flush subnormals (``add.ftz.f32`` and the like)."""
    return [line.strip() for line in ptx.splitlines() if ".ftz" in line]


def find_cuobjdump() -> str | None:
    """cuobjdump on PATH, in the toolkit, or from NVIDIA's pip package (nvidia-cuda-cuobjdump)."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidates = [Path(home, "bin", "cuobjdump")]
    for site in map(Path, sys.path):
        candidates += sorted(site.glob("nvidia/cu*/bin/cuobjdump")) + sorted(
            site.glob("nvidia/cuda_cuobjdump/bin/cuobjdump")
        )
    return next((str(c) for c in candidates if c.is_file() and os.access(c, os.X_OK)), None)


def cuobjdump_output(tool: str, *arguments: str) -> str:
    """What cuobjdump prints for ``arguments``; its error, if it fails, in the exception."""
    done = subprocess.run([tool, *arguments], check=False, capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"{tool} {' '.join(arguments)} failed: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def check(binary: str, *more: str, tool: str, require_ptx: bool = True) -> tuple[list[KernelResources], list[str]]:
    """The budget architecture's kernels in ``binary`` and ``more`` (libraries, objects or cubins: the
    budget holds over them all, so objects compiled apart are checked together), and every problem
    found: the budget broken, a binary without a kernel of that architecture, a ``.ftz`` in the PTX,
    or no PTX where ``require_ptx`` (a build for named architectures only, without "+PTX", embeds none)."""
    kernels: list[KernelResources] = []
    problems: list[str] = []
    for path in (binary, *more):
        found = parse_resource_usage(cuobjdump_output(tool, "-res-usage", "-arch", BUDGET_ARCH, path))
        if not found:
            problems.append(f"no {BUDGET_ARCH} kernel in {path}")
        kernels += found
        ptx = cuobjdump_output(tool, "-ptx", path)
        if require_ptx and ".entry" not in ptx:
            problems.append(f"no PTX in {path}")
        flushing = flush_to_zero_instructions(ptx)
        if flushing:
            problems.append(f"the PTX flushes subnormals ({len(flushing)} .ftz instructions): {flushing[:3]}")
    if kernels:
        problems = budget_violations(kernels) + problems
    return kernels, problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("binaries", nargs="+", help="CUDA libraries, objects or cubins holding sm_90 code and PTX")
    parser.add_argument("--cuobjdump", help="the cuobjdump to use (default: found as tests/test_build.py finds it)")
    args = parser.parse_args()
    tool = args.cuobjdump or find_cuobjdump()
    if tool is None:
        print("kernel_budget: no cuobjdump: pip install nvidia-cuda-cuobjdump", file=sys.stderr)
        return 1
    kernels, problems = check(*args.binaries, tool=tool)
    scans = [k for k in kernels if _SCAN_FLAGS.search(k.name)]
    differences = [k for k in kernels if "difference_kernel" in k.name]
    sketches = [k for k in kernels if "sketch_kernel" in k.name]
    print(
        f"kernel_budget: {BUDGET_ARCH}: {len(scans)} scan kernels at {sorted({k.registers for k in scans})} registers, "
        f"stack {sorted({k.stack for k in scans})} B; {len(differences)} difference kernels at "
        f"{sorted({k.registers for k in differences})} registers, stack {sorted({k.stack for k in differences})} B; "
        f"{len(sketches)} sketch kernels at {sorted({k.registers for k in sketches})} registers, "
        f"stack {sorted({k.stack for k in sketches})} B"
    )
    for problem in problems:
        print(f"kernel_budget: FAILED: {problem}", file=sys.stderr)
    if not problems:
        print("kernel_budget: ok: within the budget, no flush-to-zero in the PTX")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
