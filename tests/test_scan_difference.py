"""``nanscan::scan_difference``, the update watch's pass: the statistics of before - after (in before's
dtype, as torch's subtraction rounds it) and of after, against an fp64 reference of torch's own
difference, on fresh random data with NaN/Inf planted, weights' real values (updates of 1e-3 to
1e-20 of the weight), every dtype pair, sizes around the chunk and run boundaries, and layouts, on
the CPU kernel and (on a GPU) the CUDA kernel; the CPU kernel against the composite the other devices
run; bad input refused alike by both; on a GPU, one launch, no sync, and a CUDA graph's replays."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

from nanscan._ops import scan_difference_op
from nanscan.composite import scan_difference as _scan_difference_composite
from nanscan.fused import ScanResult

from conftest import DEVICES, FP8_DTYPES, assert_matches_reference, needs_cuda, plant, random_tensor, syncs_refused

# Sizes straddling the SIMD lanes (32), a run (4096) and a chunk (256 KiB over the pair's bytes).
SIZES = [1, 33, 4095, 4097, 21_846, 43_691, 131_073]
# (before, after): the copy's dtype and the weight's; after is never wider than before.
PAIRS = [
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float32, torch.float8_e4m3fn),
    (torch.float32, torch.float8_e5m2),
    (torch.float64, torch.float64),
    (torch.float64, torch.float32),
]


def pair(n: int, before_dtype: torch.dtype, after_dtype: torch.dtype, update: float) -> tuple[torch.Tensor, ...]:
    """Weights ``after`` and their copy from before a step that moved them by ~``update`` of themselves."""
    after = random_tensor(n, after_dtype)
    step = after.to(torch.float64) * (1 + update * torch.randn(n, dtype=torch.float64))
    return step.to(before_dtype), after


def check(before: list[torch.Tensor], after: list[torch.Tensor], rtol: float = 1e-6) -> ScanResult:
    """The op's result against the reference: torch's difference in before's dtype, then the afters."""
    result = ScanResult.from_op(*scan_difference_op(before, after))
    differences = [
        torch.sub(b, a.to(b.dtype) if a.dtype in FP8_DTYPES else a) for b, a in zip(before, after, strict=True)
    ]
    assert all(d.dtype == b.dtype for d, b in zip(differences, before, strict=True))
    assert_matches_reference(result, differences + after, rtol)
    return result


# PAIRS, and two more of the pairs the op admits: float64 copies of 16-bit and float8 weights.
ALL_PAIRS = [*PAIRS, (torch.float64, torch.bfloat16), (torch.float64, torch.float8_e5m2)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize(("before_dtype", "after_dtype"), ALL_PAIRS)
@pytest.mark.parametrize("n", SIZES)
def test_random_pairs_match_the_reference(
    before_dtype: torch.dtype, after_dtype: torch.dtype, n: int, device: str
) -> None:
    torch.manual_seed(n)
    before, after = pair(n, before_dtype, after_dtype, 1e-3)
    check([before.to(device)], [after.to(device)])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("update", [1e-3, 1e-8, 1e-12, 1e-20])
@pytest.mark.parametrize(
    ("before_dtype", "after_dtype"), [(torch.float32, torch.bfloat16), (torch.float64, torch.float64)]
)
def test_tiny_updates_keep_their_norm(
    before_dtype: torch.dtype, after_dtype: torch.dtype, update: float, device: str
) -> None:
    """Late in training an update is a vanishing share of its weight, and weights of 1e-20 exist: the
    differences' squares lie in fp32's subnormal range, where the kernel's scaled rule must take over."""
    torch.manual_seed(1)
    before, after = pair(70_000, before_dtype, after_dtype, 1e-3)
    tiny_before, tiny_after = (t * 1e-18 for t in pair(70_000, before_dtype, after_dtype, update))
    check(
        [before.to(device), tiny_before.to(device, before_dtype)],
        [after.to(device), tiny_after.to(device, after_dtype)],
    )


@pytest.mark.parametrize("device", DEVICES)
def test_nan_and_inf_in_either_tensor_are_counted_where_they_land(device: str) -> None:
    torch.manual_seed(2)
    n = 50_000
    befores, afters = [], []
    for where in ("before", "after", "both"):
        b, a = pair(n, torch.float32, torch.float32, 1e-3)
        if where in ("before", "both"):
            plant(b, [0, n // 2], math.nan)
            plant(b, [7], math.inf)
        if where in ("after", "both"):
            plant(a, [n - 1], math.inf)
            plant(a, [n - 2], -math.inf)
        befores.append(b)
        afters.append(a)
    # inf - inf: NaN, as torch's difference gives it; an overflow step's weights full of Inf
    full_inf = torch.full((n,), math.inf)
    befores.append(full_inf.clone())
    afters.append(full_inf.clone())
    result = check([b.to(device) for b in befores], [a.to(device) for a in afters])
    assert result.nan_count[3].item() == n and not bool(result.finite)


@pytest.mark.parametrize("device", DEVICES)
def test_layouts_pair_logical_elements(device: str) -> None:
    """Pairs dense in the same order are read by memory offset; others (a transposed copy of a
    contiguous weight, a strided view, a broadcast) element by element, in logical order (the CUDA
    kernel reads contiguous copies of such pairs)."""
    torch.manual_seed(3)
    weight = torch.randn(300, 257, device=device)
    copy = weight * (1 + 1e-3 * torch.randn_like(weight))
    cases = [
        (copy, weight),
        (copy.t().contiguous().t(), weight),  # same values, other memory order
        (copy.t(), weight.t()),  # both transposed alike: dense, same strides
        (copy[:, ::3], weight[:, ::3]),
        (copy[:1].expand(300, 257), weight),
        (copy.reshape(300, 257, 1)[:, :, 0], weight.t().contiguous().t()),
        (torch.empty(0, 5, device=device), torch.empty(0, 5, device=device)),
    ]
    check([b for b, _ in cases], [a for _, a in cases])


def test_the_composite_gives_the_kernels_answer() -> None:
    torch.manual_seed(4)
    befores, afters = [], []
    for before_dtype, after_dtype in PAIRS:
        b, a = pair(9_000, before_dtype, after_dtype, 1e-2)
        befores.append(b)
        afters.append(a)
    plant(befores[0], [5], math.nan)
    fused = scan_difference_op(befores, afters)
    composite = _scan_difference_composite(befores, afters)
    for got, want in zip(fused[:2], composite[:2], strict=True):
        assert got.shape == want.shape
    assert torch.equal(fused[0], composite[0])  # counts
    assert torch.equal(fused[1][:2], composite[1][:2])  # min, max
    torch.testing.assert_close(fused[1][2], composite[1][2], rtol=1e-6, atol=0, equal_nan=True)  # norms
    assert fused[4].dtype == composite[4].dtype == torch.float64


BAD: list[tuple[Callable[[], tuple[list[Any], list[Any]]], str]] = [
    (lambda: ([], []), "expected at least one tensor"),
    (lambda: ([torch.zeros(3)], [torch.zeros(3), torch.zeros(3)]), "before holds 1 tensors and after 2"),
    (lambda: ([torch.zeros(3)], [torch.zeros(4)]), r"before\[0\] has shape \[3\] but after\[0\] has shape \[4\]"),
    (lambda: ([torch.zeros(3, dtype=torch.bfloat16)], [torch.zeros(3)]), r"before\[0\] has dtype .*float32 or float64"),
    (
        lambda: ([torch.zeros(3)], [torch.zeros(3, dtype=torch.float64)]),
        r"after\[0\] is float64 but before\[0\] is float32",
    ),
]


@pytest.mark.parametrize(("arguments", "message"), BAD)
def test_bad_input_is_refused_alike_by_the_kernel_and_the_composite(
    arguments: Callable[[], tuple[list[Any], list[Any]]], message: str
) -> None:
    for op in (scan_difference_op, _scan_difference_composite):
        with pytest.raises(RuntimeError, match=message):
            op(*arguments())


def test_int_tensors_are_refused_by_name() -> None:
    with pytest.raises(RuntimeError, match=r"nanscan.scan_difference: after\[1\] has dtype"):
        scan_difference_op([torch.zeros(2), torch.zeros(2)], [torch.zeros(2), torch.zeros(2, dtype=torch.int32)])


def test_fake_kernel_gives_the_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        counts, stats, total, finite, cast = scan_difference_op(
            [torch.empty(3), torch.empty(2, 2, dtype=torch.float64)],
            [torch.empty(3, dtype=torch.bfloat16), torch.empty(2, 2, dtype=torch.float64)],
        )
    assert counts.shape == (2, 4) and stats.shape == (3, 4) and cast.dtype == torch.float64
    assert total.shape == finite.shape == () and finite.dtype == torch.bool


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    """torch's own checks of a custom op (schema, fake kernel, autograd registration, dispatch), on the
    CPU kernel and, on a GPU, the composite."""
    torch.manual_seed(5)
    b1, a1 = pair(1000, torch.float32, torch.bfloat16, 1e-3)
    b2, a2 = pair(17, torch.float64, torch.float64, 1e-3)
    before, after = [b1.to(device), b2.to(device)], [a1.to(device), a2.to(device)]
    torch.library.opcheck(scan_difference_op, (before, after))


@needs_cuda
@pytest.mark.cuda
def test_cuda_one_launch_no_sync_and_graph_replays() -> None:
    """On a GPU the pass is one kernel (after the workspace's memset), makes no host sync, and a
    captured graph's replays follow the weights' new values."""
    torch.manual_seed(6)
    pairs = [pair(n, b, a, 1e-3) for n, (b, a) in zip((5000, 70_000, 3, 40_000), ALL_PAIRS[:4], strict=True)]
    before = [b.cuda() for b, _ in pairs]
    after = [a.cuda() for _, a in pairs]
    scan_difference_op(before, after)  # warm-up: the occupancy query, the caching allocator, the list's device copy
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        with syncs_refused():
            scan_difference_op(before, after)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "nanscan" in e.name]
    assert len(kernels) == 1 and "difference_kernel" in kernels[0], kernels

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        scan_difference_op(before, after)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = scan_difference_op(before, after)
    for step in range(3):
        for b in before:
            b.mul_(1 + 1e-3 * (step + 1))
        graph.replay()
        eager = scan_difference_op(before, after)
        for got, want in zip(captured[:2], eager[:2], strict=True):
            assert torch.equal(got, want)
        assert torch.equal(captured[2], eager[2])  # bit-identical: the same grid, the same fold order
