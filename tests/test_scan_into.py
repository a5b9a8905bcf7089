"""``nanscan::scan_into_``, the scan that writes its per-tensor results into columns of buffers the
caller keeps (the activation watch's call per module): on real values (tiny, huge, NaN/Inf planted,
every dtype, strided views) each column it writes holds bit for bit what ``nanscan::scan`` returns for
that tensor, and no other column changes; the composite (every other device) writes the same; bad
input is refused before anything is written, with the kernels' and the composite's words alike; the
versions advance; torch.compile traces it; on a GPU it makes no sync and captures in a graph."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from nanscan import composite
from nanscan._ops import scan_into_, scan_into_op, scan_op

from conftest import DEVICES, FLOAT_DTYPES, FP8_DTYPES, needs_cuda, syncs_refused

OPS = [pytest.param(scan_into_op, id="kernel"), pytest.param(composite.scan_into_, id="composite")]
SENTINEL_COUNT, SENTINEL_STAT = -7, -3.25


def real_values(gen: torch.Generator, device: str) -> list[torch.Tensor]:
    """What training makes: ordinary, tiny (1e-10 to 1e-20), huge, fp16-overflowing, mostly-zero,
    all-Inf, empty and strided tensors of every dtype, with NaN/Inf planted in some."""
    tensors: list[torch.Tensor] = []
    for i, dtype in enumerate(FLOAT_DTYPES + FP8_DTYPES):
        base = torch.randn(37 + 11 * i, generator=gen, dtype=torch.float64)
        for scale in (1.0, 1e-10, 1e-20, 1e5):
            t = (base * scale).to(dtype)
            if scale == 1.0 and i % 2 == 0:
                t[3] = math.nan
                t[-1] = -math.inf
            tensors.append(t)
    sparse_rows = torch.zeros(64, 16)
    sparse_rows[5] = torch.randn(16, generator=gen)
    tensors += [
        sparse_rows,  # a mostly-zero embedding gradient
        torch.full((9,), math.inf, dtype=torch.float16),  # an overflow step
        torch.empty(0),
        torch.randn(8, 6, generator=gen).t(),  # transposed: dense, not contiguous
        torch.randn(10, 10, generator=gen)[::3, 1::2],  # strided
        torch.tensor(7e4),  # past fp16's 65504
    ]
    return [t.to(device) for t in tensors]


def buffers(rows: int, width: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    counts = torch.full((rows, width), SENTINEL_COUNT, dtype=torch.int64, device=device)
    stats = torch.full((3, width), SENTINEL_STAT, dtype=torch.float64, device=device)
    return counts, stats


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fp16_range", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_each_column_holds_the_scans_result_and_no_other_changes(device: str, fp16_range: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    tensors = real_values(gen, device)
    want_counts, want_stats, _, _, _ = scan_op(tensors, fp16_range, False)
    n, column, width = len(tensors), 3 + seed, len(tensors) + 9
    counts, stats = buffers(4 if fp16_range else 2, width, device)
    scan_into_(tensors, fp16_range, counts, stats, column)
    inside = slice(column, column + n)
    assert torch.equal(counts[:, inside], want_counts)
    # Bit for bit, NaN and -0.0 included.
    assert torch.equal(stats[:, inside].view(torch.int64), want_stats.view(torch.int64))
    outside = torch.ones(width, dtype=torch.bool, device=device)
    outside[inside] = False
    assert bool((counts[:, outside] == SENTINEL_COUNT).all()) and bool((stats[:, outside] == SENTINEL_STAT).all())


@pytest.mark.parametrize("fp16_range", [False, True])
def test_the_composite_writes_what_the_kernel_writes(fp16_range: bool) -> None:
    tensors = real_values(torch.Generator().manual_seed(2), "cpu")
    width = len(tensors) + 4
    by_kernel, by_composite = (
        buffers(4 if fp16_range else 2, width, "cpu"),
        buffers(4 if fp16_range else 2, width, "cpu"),
    )
    scan_into_op(tensors, fp16_range, *by_kernel, 2)
    composite.scan_into_(tensors, fp16_range, *by_composite, 2)
    assert torch.equal(by_kernel[0], by_composite[0])  # NaN, Inf (and the fp16-range pair), the sentinels
    assert torch.equal(by_kernel[1][:2], by_composite[1][:2])  # min, max: element values, exactly
    # The norms: the composite sums its runs of squares in another order (tests/test_composite.py).
    torch.testing.assert_close(by_kernel[1][2], by_composite[1][2], rtol=1e-6, atol=0.0, equal_nan=True)


def test_calls_fill_consecutive_columns_as_one_scan_would() -> None:
    """The watch's use: call after call at the next free column, then the whole run read at once."""
    tensors = real_values(torch.Generator().manual_seed(3), "cpu")
    counts, stats = buffers(4, len(tensors), "cpu")
    column = 0
    for size in (1, 5, 2, len(tensors) - 8):
        scan_into_(tensors[column : column + size], True, counts, stats, column)
        column += size
    want_counts, want_stats, _, _, _ = scan_op(tensors, True, False)
    assert torch.equal(counts, want_counts) and torch.equal(stats.view(torch.int64), want_stats.view(torch.int64))


@pytest.mark.parametrize("op", [pytest.param(scan_into_op, id="op"), pytest.param(scan_into_, id="wrapper")])
def test_versions_advance_as_for_an_in_place_aten_op(op: Callable[..., None]) -> None:
    counts, stats = buffers(2, 3, "cpu")
    before = (counts._version, stats._version)
    op([torch.ones(2)], False, counts, stats, 1)
    assert counts._version > before[0] and stats._version > before[1]


def test_an_inference_buffer_is_refused_outside_inference_mode() -> None:
    with torch.inference_mode():
        counts, stats = buffers(2, 3, "cpu")
    for op in (scan_into_op, scan_into_):
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
            op([torch.ones(2)], False, counts, stats, 0)
    with torch.inference_mode():  # inside it, the buffers take the write
        scan_into_([torch.ones(2)], False, counts, stats, 0)
    assert counts[:, 0].tolist() == [0, 0]


def test_outputs_requiring_grad_are_read_and_build_no_graph() -> None:
    weight = torch.ones(3, requires_grad=True)
    counts, stats = buffers(2, 1, "cpu")
    scan_into_([weight * 2], False, counts, stats, 0)
    assert stats[:, 0].tolist() == [2.0, 2.0, math.sqrt(12.0)] and not stats.requires_grad


def test_opcheck() -> None:
    tensors = real_values(torch.Generator().manual_seed(4), "cpu")[:6]
    counts, stats = buffers(4, 10, "cpu")
    torch.library.opcheck(scan_into_op, (tensors, True, counts, stats, 2))


def test_torch_compile_traces_it() -> None:
    tensors = real_values(torch.Generator().manual_seed(5), "cpu")[:5]

    def into(ts: list[torch.Tensor], counts: torch.Tensor, stats: torch.Tensor) -> None:
        scan_into_op(ts, True, counts, stats, 1)

    eager, compiled = buffers(4, 7, "cpu"), buffers(4, 7, "cpu")
    into(tensors, *eager)
    torch.compile(into, fullgraph=True, backend="aot_eager")(tensors, *compiled)
    assert torch.equal(eager[0], compiled[0]) and torch.equal(eager[1].view(torch.int64), compiled[1].view(torch.int64))


def good(**changes: Any) -> dict[str, Any]:
    """Good arguments (two tensors into columns 1 and 2 of buffers 4 wide), with ``changes``."""
    args: dict[str, Any] = {
        "tensors": [torch.ones(3), torch.ones(2, dtype=torch.float16)],
        "fp16_range": True,
        "counts": torch.zeros(4, 4, dtype=torch.int64),
        "stats": torch.zeros(3, 4, dtype=torch.float64),
        "column": 1,
    }
    args.update(changes)
    return args


BAD = [
    ({"column": 3}, r"the 2 tensors' columns \[3, 5\) do not lie within the 4 columns of counts and stats"),
    ({"column": -1}, r"the 2 tensors' columns \[-1, 1\) do not lie within the 4 columns"),
    ({"stats": torch.zeros(3, 5, dtype=torch.float64)}, r"counts has 4 columns but stats has 5"),
    ({"fp16_range": False}, r"counts must be 2-D \[2, width\], got shape \[4, 4\]"),
    ({"counts": torch.zeros(2, 4, dtype=torch.int64)}, r"counts must be 2-D \[4, width\] \(fp16_range adds two rows"),
    (
        {"counts": torch.zeros(4, 4, dtype=torch.int32)},
        r"counts has dtype (Int|torch.int32); expected (Long|torch.int64)",
    ),
    ({"stats": torch.zeros(3, 4)}, r"stats has dtype (Float|torch.float32); expected (Double|torch.float64)"),
    ({"stats": torch.zeros(4, 3, dtype=torch.float64).t()}, r"stats must be contiguous"),
    ({"stats": torch.zeros(12, dtype=torch.float64)}, r"stats must be 2-D \[3, width\], got shape \[12\]"),
    ({"counts": torch.zeros(4, 4, dtype=torch.int64, device="meta")}, r"counts is on meta but the tensors are on cpu"),
    ({"tensors": []}, r"expected at least one tensor"),
    ({"tensors": [torch.ones(2, dtype=torch.int32)]}, r"tensors\[0\] has dtype (Int|torch.int32)"),
    ({"tensors": [torch.ones(2), torch.ones(2, device="meta")]}, r"tensors\[1\] is on meta but tensors\[0\] is on cpu"),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("changes", "match"), BAD, ids=[m for _, m in BAD])
def test_bad_input_is_refused_and_nothing_is_written(
    op: Callable[..., None], changes: dict[str, Any], match: str
) -> None:
    args = good(**changes)
    before = [t.clone() for t in (args["counts"], args["stats"]) if t.device.type == "cpu"]
    with pytest.raises(RuntimeError, match=match):
        op(*args.values())
    after = [t for t in (args["counts"], args["stats"]) if t.device.type == "cpu"]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "a refused call wrote"


@needs_cuda
@pytest.mark.cuda
def test_cuda_no_sync_and_graph_capture() -> None:
    tensors = real_values(torch.Generator().manual_seed(6), "cuda")
    want_counts, want_stats, _, _, _ = scan_op(tensors, True, False)
    counts, stats = buffers(4, len(tensors) + 2, "cuda")
    scan_into_(tensors, True, counts, stats, 2)  # warm-up, outside the capture
    with syncs_refused():
        scan_into_(tensors, True, counts, stats, 1)
    assert torch.equal(counts[:, 1:-1], want_counts)
    counts.fill_(SENTINEL_COUNT)
    stats.fill_(SENTINEL_STAT)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        scan_into_(tensors, True, counts, stats, 2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(counts[:, 2:], want_counts)
    assert torch.equal(stats[:, 2:].view(torch.int64), want_stats.view(torch.int64))
    assert bool((counts[:, :2] == SENTINEL_COUNT).all())
