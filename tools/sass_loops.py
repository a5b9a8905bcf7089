"""The loops of one kernel's SASS, with their global loads and local-memory traffic.

ptxas's `-v` report gives a kernel's spill in bytes, not where it lies: 80 bytes spilled on a
re-read taken once per NaN cost nothing, 32 bytes inside the walk every element takes can halve the
kernel's speed. This lists each loop (a backward branch and its target) of one kernel in a
`cuobjdump -sass` listing, with its instruction count and its LDG, STL and LDL counts, so that the
hot walks (the loops with the most global loads) can be checked for local-memory traffic without a
GPU.

    nvcc -cubin -o /tmp/scan.cubin csrc/cuda/scan_cuda.cu -std=c++17 -O3 -arch=sm_90 --expt-relaxed-constexpr
    cuobjdump -sass /tmp/scan.cubin > /tmp/scan.sass   # pip install nvidia-cuda-cuobjdump
    python tools/sass_loops.py /tmp/scan.sass difference_kernelILi256 --min-loads 16

Loops nest, so an outer loop's counts include its inner loops'.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_PREDICATE = re.compile(r"@!?U?P[0-9T]+\s+")


def opcode(instruction: str) -> str:
    """The opcode without its predicate and modifiers: ``@!P0 LDG.E.CONSTANT R90, ...`` is ``LDG``
    (and LDGSTS, an asynchronous copy to shared memory, is not)."""
    return _PREDICATE.sub("", instruction, count=1).split(" ", 1)[0].split(".", 1)[0]


def count(instructions: list[str], name: str) -> int:
    """How many of ``instructions`` have the opcode ``name``."""
    return sum(opcode(t) == name for t in instructions)


_BRANCH_TARGET = re.compile(r"\bBRA\b.*?0x([0-9a-f]+)")


@dataclass(frozen=True)
class Loop:
    """One backward branch's range of instructions and what they hold."""

    begin: int
    end: int
    instructions: int
    global_loads: int
    local_stores: int
    local_loads: int

    def __str__(self) -> str:
        return (
            f"loop {self.begin:#x}-{self.end:#x}: {self.instructions} instructions, {self.global_loads} LDG,"
            f" {self.local_stores} STL, {self.local_loads} LDL"
        )


def kernel_instructions(listing: str, kernel: str) -> list[tuple[int, str]]:
    """(address, instruction) of the first function in `listing` whose name contains `kernel`."""
    functions = listing.split("Function : ")[1:]
    for function in functions:
        name = function.split("\n", 1)[0]
        if kernel in name:
            return [(int(m.group(1), 16), m.group(2)) for m in map(_INSTRUCTION.match, function.splitlines()) if m]
    raise SystemExit(f"sass_loops: no function whose name contains {kernel!r}")


def loops_of(instructions: list[tuple[int, str]]) -> list[Loop]:
    """Every backward branch's loop, in the listing's order."""
    index_of = {address: i for i, (address, _) in enumerate(instructions)}
    loops = []
    for i, (address, text) in enumerate(instructions):
        branch = _BRANCH_TARGET.search(text)
        if not branch:
            continue
        target = int(branch.group(1), 16)
        if target >= address or target not in index_of:
            continue
        body = [t for _, t in instructions[index_of[target] : i + 1]]
        loops.append(
            Loop(
                begin=target,
                end=address,
                instructions=len(body),
                global_loads=count(body, "LDG"),
                local_stores=count(body, "STL"),
                local_loads=count(body, "LDL"),
            )
        )
    return loops


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("listing", help="a `cuobjdump -sass` listing")
    parser.add_argument("kernel", help="a part of the kernel's mangled name")
    parser.add_argument("--min-loads", type=int, default=1, help="list only loops with at least this many LDG")
    parser.add_argument("--fail-on-local", action="store_true", help="exit 1 if a listed loop has an STL or LDL")
    args = parser.parse_args(argv)
    with open(args.listing) as f:
        instructions = kernel_instructions(f.read(), args.kernel)
    texts = [t for _, t in instructions]
    total_stores, total_loads = count(texts, "STL"), count(texts, "LDL")
    print(f"{len(instructions)} instructions, {total_stores} STL, {total_loads} LDL in all")
    listed = [loop for loop in loops_of(instructions) if loop.global_loads >= args.min_loads]
    for loop in listed:
        print(loop)
    if args.fail_on_local and any(loop.local_stores or loop.local_loads for loop in listed):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
