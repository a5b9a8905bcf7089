"""tools/sass_loops.py reads loops and their local-memory traffic out of a cuobjdump listing.

The listing here is shaped as `cuobjdump -sass` prints one (sm_90, CUDA 13): the tool is how a
session without a GPU sees whether a kernel's spill lies in its hot walk (benchmarks/NOTES.md,
entry 40).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import sass_loops

LISTING = """
\t\tFunction : _ZN7nanscan4cuda12other_kernelEv
        /*0000*/                   LDG.E R2, desc[UR4][R2.64] ;            /* 0x0000000402027981 */
        /*0010*/                   BRA 0x0 ;                               /* 0xfffffffc00007947 */
\t\tFunction : _ZN7nanscan4cuda17difference_kernelILi256EEEvv
        /*0000*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0010*/                   LDL R90, [R1+0x6c] ;                    /* 0x00006c00015a7983 */
        /*0020*/              @!P0 LDG.E.CONSTANT R90, desc[UR8][R58.64] ; /* 0x000000083a5a0981 */
        /*0030*/              @!P0 LDG.E.CONSTANT R89, desc[UR8][R56.64] ; /* 0x0000000838590981 */
        /*0040*/              @!P0 STL [R1+0x6c], R90 ;                    /* 0x00006c5a01000387 */
        /*0050*/              @!P1 BRA 0x10 ;                              /* 0xfffffffc00007947 */
        /*0060*/                   LDG.E.CONSTANT R4, desc[UR8][R6.64] ;   /* 0x0000000806047981 */
        /*0070*/              @!P2 BRA 0x60 ;                              /* 0xfffffffc00007947 */
        /*0080*/              @!P3 BRA 0x0 ;                               /* 0xfffffffc00007947 */
        /*0090*/                   BRA 0xa0 ;                              /* 0x0000000000007947 */
        /*00a0*/                   EXIT ;                                  /* 0x000000000000794d */
"""


def test_loops_are_found_with_their_loads_and_local_traffic() -> None:
    loops = sass_loops.loops_of(sass_loops.kernel_instructions(LISTING, "difference_kernelILi256"))
    # The forward branch at 0x90 is no loop; the outer loop holds both inner ones.
    assert [(loop.begin, loop.end) for loop in loops] == [(0x10, 0x50), (0x60, 0x70), (0x0, 0x80)]
    spilling, clean, outer = loops
    assert (spilling.instructions, spilling.global_loads, spilling.local_stores, spilling.local_loads) == (5, 2, 1, 1)
    assert (clean.global_loads, clean.local_stores, clean.local_loads) == (1, 0, 0)
    assert (outer.instructions, outer.global_loads, outer.local_stores, outer.local_loads) == (9, 3, 1, 1)


def test_the_named_kernel_is_read_not_the_first(tmp_path: Path) -> None:
    instructions = sass_loops.kernel_instructions(LISTING, "other_kernel")
    assert [address for address, _ in instructions] == [0x0, 0x10]


def test_fail_on_local_fails_only_where_a_listed_loop_touches_local_memory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    listing = tmp_path / "kernel.sass"
    listing.write_text(LISTING)
    assert sass_loops.main([str(listing), "difference_kernel", "--fail-on-local"]) == 1
    out = capsys.readouterr().out
    assert "1 STL, 1 LDL in all" in out and "loop 0x10-0x50: 5 instructions, 2 LDG, 1 STL, 1 LDL" in out
    # Only loops with at least one load are listed, and the one with one load is clean.
    assert sass_loops.main([str(listing), "difference_kernel", "--min-loads", "1", "--fail-on-local"]) == 1
    assert sass_loops.main([str(listing), "other_kernel", "--fail-on-local"]) == 0


def test_opcodes_are_read_past_predicates_and_modifiers() -> None:
    assert sass_loops.opcode("@!P0 LDG.E.CONSTANT R90, desc[UR8][R58.64]") == "LDG"
    assert sass_loops.opcode("@P1 STL [R1+0x6c], R90") == "STL"
    assert sass_loops.opcode("LDGSTS.E.BYPASS.128 [R3], desc[UR4][R4.64]") == "LDGSTS"
    assert sass_loops.opcode("LDGDEPBAR") == "LDGDEPBAR"
    assert sass_loops.count(["LDGSTS.E [R3], desc[UR4][R4.64]", "@!UPT LDG.E R2, desc[UR4][R2.64]"], "LDG") == 1


def test_a_kernel_not_in_the_listing_is_named_in_the_error() -> None:
    with pytest.raises(SystemExit, match="no function whose name contains 'scan_kernel'"):
        sass_loops.kernel_instructions(LISTING, "scan_kernel")
