"""The fused scan against an fp64 reference: dtypes, sizes around chunk boundaries, planted NaN/Inf,
layouts, edge shapes, determinism."""

from __future__ import annotations

import math

import pytest
import torch

import nanscan

from conftest import DEVICES, FLOAT_DTYPES, FP8_DTYPES, assert_matches_reference, plant, random_tensor, reference_stats

# Sizes straddling the SIMD lane width (32), the fast-run length (4096), the CPU chunk (256 KiB: 65536
# fp32 / 131072 half elements) and the sizes DESIGN.md names.
SIZES = [1, 31, 33, 555, 4095, 4097, 65535, 65536, 65537, 2048 * 32 + 1, 131073, 300_001]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + FP8_DTYPES)
@pytest.mark.parametrize("n", SIZES)
def test_random_matches_reference(device: str, dtype: torch.dtype, n: int) -> None:
    t = random_tensor(n, dtype, device)
    assert_matches_reference(nanscan.scan([t]), [t], rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES + FP8_DTYPES)
@pytest.mark.parametrize("where", ["first", "middle", "last", "all"])
@pytest.mark.parametrize("n", [1, 555, 65537, 300_001])
def test_planted_nan_inf(device: str, dtype: torch.dtype, where: str, n: int) -> None:
    positions = {"first": [0], "middle": [n // 2], "last": [n - 1], "all": list(range(n))[: min(n, 40)]}[where]
    has_inf = dtype != torch.float8_e4m3fn  # e4m3fn has no Inf: +-inf converts to NaN
    nan_t = plant(random_tensor(n, dtype, device), positions, math.nan)
    inf_t = plant(random_tensor(n, dtype, device), positions, math.inf)
    both = plant(plant(random_tensor(n, dtype, device), positions, -math.inf), positions[:1], math.nan)
    clean = random_tensor(n, dtype, device)
    tensors = [clean, nan_t, inf_t, both]
    result = nanscan.scan(tensors)
    assert_matches_reference(result, tensors)
    assert not bool(result.finite)
    assert result.nan_count[1].item() == len(positions)
    if has_inf:
        assert result.inf_count[2].item() == len(positions)
        assert math.isinf(result.norm[2].item())


@pytest.mark.parametrize("device", DEVICES)
def test_minmax_independent_of_nan_position(device: str) -> None:
    base = torch.arange(1, 10_001, dtype=torch.float32, device=device)
    expected = (1.0, 10_000.0)
    for pos in [0, 1, 31, 32, 4095, 4096, 9_999]:
        t = base.clone()
        t[pos] = math.nan
        r = nanscan.scan([t])
        lo = 2.0 if pos == 0 else 1.0
        hi = 9_999.0 if pos == 9_999 else 10_000.0
        assert (r.min.item(), r.max.item()) == (lo, hi), f"NaN at {pos}"
    r = nanscan.scan([base])
    assert (r.min.item(), r.max.item()) == expected


@pytest.mark.parametrize("device", DEVICES)
def test_long_mixed_dtype_list(device: str) -> None:
    gen = torch.Generator().manual_seed(0)
    dtypes = FLOAT_DTYPES + FP8_DTYPES
    tensors = []
    for i in range(3000):
        n = int(torch.randint(0, 700, (1,), generator=gen))
        t = random_tensor(n, dtypes[i % len(dtypes)], device)
        if n and i % 97 == 0:
            t.view(-1)[n // 3] = math.nan
        if n and i % 89 == 0 and t.dtype != torch.float8_e4m3fn:
            t.view(-1)[-1] = -math.inf
        tensors.append(t)
    assert_matches_reference(nanscan.scan(tensors), tensors)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_views(device: str) -> None:
    base = random_tensor(64 * 96 * 3, torch.float32, device).view(64, 96, 3)
    base[5, 7, 1] = math.nan
    base[60, 90, 2] = math.inf
    views = [
        base.transpose(0, 1),  # dense, permuted
        base.permute(2, 0, 1),  # dense, permuted
        base[:, ::3, :],  # strided, skips the NaN row? no: step 3 keeps index 90
        base[1::2, 5:70, 1],  # strided, 2-D
        base[:, :, 0].t(),  # strided transpose
        base[3:4].expand(5, 96, 3),  # stride 0: overlapping, every element counted as it is seen
        base.view(-1)[1::7],
        base.to(torch.bfloat16).transpose(1, 2)[:, 1:, ::2],
    ]
    assert_matches_reference(nanscan.scan(views), views)


def test_views_that_are_not_dense_scan_as_their_logical_copies() -> None:
    """A view that is not dense is read in logical order, a row of its merged innermost dimensions at a
    time (RowWalk): every output, norm bits and checksum included, equals its contiguous copy's, which
    is read in the same order. The views cover merged dimensions, size-1 dimensions, stride 0, rows
    that cross runs and chunks (the walk resumes mid-row), and rows of a single element."""
    torch.manual_seed(3)
    qkv = torch.randn(4, 300, 3 * 96)
    qkv[1, 7, 5] = math.nan
    qkv[3, 299, 95] = -math.inf
    wide = torch.randn(2, 1, 70000, 5)  # rows of 4 cut at odd places by 4096-element runs and chunks
    views = [
        qkv.chunk(3, dim=-1)[0],  # rows of 96
        qkv.chunk(3, dim=-1)[1].view(4, 300, 8, 12).transpose(1, 2),  # split heads: rows of 12
        qkv[:, :, :96].unsqueeze(2).expand(4, 300, 3, 96),  # stride 0 on a middle dimension
        qkv[:, 1:, :].reshape(4, 299, 3, 96)[:, :, 1:2, :],  # a size-1 dimension between merged ones
        qkv.permute(2, 0, 1)[::5],  # rows of one element (inner stride 288)
        wide[:, :, :, 1:],
        wide.to(torch.bfloat16)[..., :3].transpose(0, 2),
        qkv.to(torch.float16)[..., 1::2],
    ]
    for view in views:
        assert not view.is_contiguous()
        got = nanscan.scan([view], checksum=True)
        want = nanscan.scan([view.contiguous()], checksum=True)
        for field in ("nan_count", "inf_count", "min", "max", "norm", "total_norm", "checksum"):
            torch.testing.assert_close(
                getattr(got, field), getattr(want, field), rtol=0, atol=0, equal_nan=True, msg=f"{view.shape} {field}"
            )


def test_update_ratio_pairs_that_are_not_dense_match_their_copies() -> None:
    """The difference scan walks a pair of different layouts by rows of both (RowWalk<2>): the same
    bits as the pair's contiguous copies."""
    torch.manual_seed(4)
    before = torch.randn(300, 2, 257)
    after = before + 1e-3 * torch.randn(300, 2, 257)
    pairs = [
        (before[:, 0, :], after.transpose(0, 2).contiguous().transpose(0, 2)[:, 1, :]),
        (before.transpose(0, 1)[:, ::3], after.transpose(0, 1)[:, ::3]),
    ]
    for b, a in pairs:
        assert not (b.is_contiguous() and a.is_contiguous())
        got = torch.ops.nanscan.scan_difference([b], [a])
        want = torch.ops.nanscan.scan_difference([b.contiguous()], [a.contiguous()])
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_zero_dim_and_empty_list(device: str) -> None:
    tensors = [
        torch.empty(0, device=device),
        torch.tensor(3.0, device=device),
        torch.tensor(math.nan, device=device),
        torch.empty(0, 5, device=device, dtype=torch.bfloat16),
    ]
    r = nanscan.scan(tensors)
    assert_matches_reference(r, tensors)
    assert r.min[0].item() == math.inf and r.max[0].item() == -math.inf and r.norm[0].item() == 0.0
    empty = nanscan.scan([])
    assert len(empty) == 0 and empty.total_norm.item() == 0.0 and bool(empty.finite)
    single = nanscan.scan(torch.ones(4, device=device))
    assert single.total_norm.item() == 2.0


@pytest.mark.parametrize("device", DEVICES)
def test_huge_and_tiny_finite_values(device: str) -> None:
    huge = torch.full((100,), 1e20, device=device)  # squares overflow fp32, values are finite
    r = nanscan.scan([huge])
    assert bool(r.finite)
    # 1e20 rounds to 1.00000002e20; the sum is redone scaled in fp32 lanes: the contract's 1e-6.
    assert r.norm.item() == pytest.approx(float(huge[0]) * 10, rel=1e-6)
    assert r.inf_count.item() == 0
    tiny = torch.full((5000,), 1e-25, device=device)  # squares fall below fp32's normal range
    r = nanscan.scan([tiny])
    assert r.norm.item() == pytest.approx(math.sqrt(5000) * 1e-25, rel=1e-6)
    big_bf16 = torch.full((10_000,), 1e30, device=device, dtype=torch.bfloat16)
    r = nanscan.scan([big_bf16])
    assert r.norm.item() == pytest.approx(float(big_bf16[0]) * 100, rel=1e-6)
    fp64 = torch.full((4,), 1e200, device=device, dtype=torch.float64)  # fp64 squares overflow: torch says inf
    assert nanscan.scan([fp64]).norm.item() == torch.linalg.vector_norm(fp64).item() == math.inf
    assert bool(nanscan.scan([fp64]).finite)


# The CPU kernel's fast runs are 4096 elements: a run's magnitude changes at these boundaries.
RUN = 4096


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_magnitude_changes_from_run_to_run(device: str, dtype: torch.dtype) -> None:
    """Vanishing gradients take a scaled sum, which the CPU carries to the tensor's next run: a run
    of tiny values followed by ordinary ones (the carried scale overflows their squares), by huge
    ones, by a NaN, and by tiny ones again, in every order, is scanned as the fp64 reference says."""
    torch.manual_seed(3)
    scales = [1e-20, 1.0, 1e-17, 1e-30, 1e25, 1e-20, 1e-12, 1e-38, 1e-44, 1e-20]
    blocks = [torch.randn(RUN) * s for s in scales]
    blocks[6][100] = math.nan  # a NaN among tiny values: the checked re-read, then tiny runs again
    blocks[4][7] = math.nan  # among huge values: the scaled re-read (its sum NaN), then the checked one
    tensor = torch.cat([*blocks, torch.randn(777) * 1e-19]).to(dtype).to(device)
    tensors = [tensor, tensor.flip(0), tensor[RUN // 2 :], torch.cat([tensor] * 20)]  # the last spans chunks
    without_nan = [t.nan_to_num(0.0) for t in tensors]
    for ts in (tensors, without_nan):
        assert_matches_reference(nanscan.scan(ts), ts, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_nonfinite_runs_told_by_the_fast_result(device: str) -> None:
    """A run all NaN, all +Inf or all -Inf is counted from the first pass; one of mixed NaN/+-Inf, or of
    one sign's Inf beside finite values, is classified by its bits: the counts and the finite min/max
    either way."""
    filled = [math.nan, math.inf, -math.inf]
    tensors = [torch.full((3 * RUN + 5,), v, device=device) for v in filled]
    mixed = torch.randn(3 * RUN, device=device)
    mixed[::3] = math.inf
    mixed[1::7] = -math.inf
    mixed[2::11] = math.nan
    inf_and_tiny = torch.randn(2 * RUN, device=device) * 1e-20
    inf_and_tiny[::2] = math.inf  # the min is still moved by finite values, the max by +Inf
    only_inf = torch.where(torch.rand(RUN, device=device) < 0.5, math.inf, -math.inf)
    tensors += [mixed, inf_and_tiny, only_inf]
    result = nanscan.scan(tensors)
    assert_matches_reference(result, tensors)
    assert result.nan_count.tolist() == [3 * RUN + 5, 0, 0, len(range(2, 3 * RUN, 11)), 0, 0]
    assert result.inf_count[:3].tolist() == [0, 3 * RUN + 5, 3 * RUN + 5]
    assert result.inf_count[5].item() == RUN


def test_large_fp32_norm_accuracy() -> None:
    """DESIGN.md: the norm of a 1e8-element fp32 list matches fp64 to 1e-6 relative."""
    torch.manual_seed(1)
    parts = [torch.rand(25_000_000) + 0.5 for _ in range(4)]  # all positive: no cancellation to hide errors
    ref = math.sqrt(sum(float(p.double().square().sum()) for p in parts))
    got = nanscan.scan(parts).total_norm.item()
    assert abs(got - ref) <= 1e-6 * ref


def test_fp32_norm_accuracy_where_values_are_ordered_against_it() -> None:
    """docs/semantics.md's worst case: a lane's first square large, its next 127 each under half an
    ulp of it, so the lane's fp32 sum drops them all. The documented bound (127 x 2^-25, 3.8e-6)
    holds, and the error is no worse than torch's fp32 norm of the same tensor."""
    x = torch.full((256, 128, 32), math.sqrt(0.99 * 2.0**-24))  # run, a lane's step, lane
    x[:, 0, :] = 1.0  # the first element of every lane of every 4096-element run
    x = x.reshape(-1)
    truth = x.double().norm().item()
    error = abs(nanscan.scan([x]).norm.item() - truth) / truth
    assert 1e-6 < error <= 127 * 2.0**-25, error  # the case is real: past the constant-tensor 1e-6
    assert error <= abs(torch.linalg.vector_norm(x).item() - truth) / truth * 1.01


def test_deterministic_across_runs_and_threads() -> None:
    torch.manual_seed(2)
    tensors = [torch.randn(n) for n in (3_000_000, 65537, 17, 1_000_001)] + [torch.randn(512) for _ in range(500)]
    tensors += [t.bfloat16() for t in tensors[:4]]
    previous = torch.get_num_threads()
    try:
        results = []
        for threads in (1, 2, 1, 2):
            torch.set_num_threads(threads)
            r = nanscan.scan(tensors)
            results.append(torch.cat([r.norm, r.min, r.max, r.total_norm.view(1)]))
    finally:
        torch.set_num_threads(previous)
    for r in results[1:]:
        assert torch.equal(r.view(torch.int64), results[0].view(torch.int64)), "results differ bit-wise"


@pytest.mark.parametrize("device", DEVICES)
def test_outputs_stay_on_device_with_documented_dtypes(device: str) -> None:
    r = nanscan.scan([torch.ones(3, device=device, dtype=torch.bfloat16)])
    for name in ("nan_count", "inf_count"):
        assert getattr(r, name).dtype == torch.int64 and getattr(r, name).device.type == device
    for name in ("min", "max", "norm", "total_norm"):
        assert getattr(r, name).dtype == torch.float64
    assert r.finite.dtype == torch.bool and r.finite.shape == ()


def test_reference_helper_can_fail() -> None:
    """Guards the guard: the reference comparison rejects a wrong result."""
    t = torch.tensor([1.0, 2.0])
    r = nanscan.scan([t])
    wrong = type(r)(r.nan_count, r.inf_count, r.min, r.max, r.norm * 1.01, r.total_norm, r.finite)
    with pytest.raises(AssertionError):
        assert_matches_reference(wrong, [t])
    assert reference_stats(t)["norm"] == math.sqrt(5)


def test_sparse_coo_is_scanned_exactly_as_its_dense_values() -> None:
    """A sparse COO tensor (nn.Embedding(sparse=True)'s gradient) gives the statistics of its dense
    values, no dense copy made: duplicates summed (a NaN, or +Inf and -Inf at one element, make it
    NaN as to_dense() does), min and max taking in the elements not stored (0), a tensor with every
    element stored not, hybrid tensors (dense trailing dims), fp16-range counts."""
    inf, nan = math.inf, math.nan
    cases = {
        "duplicates": torch.sparse_coo_tensor([[0, 2, 2, 5]], [1.5, 2.0, 3.0, -0.5], (7,)),
        "positive values and unstored zeros": torch.sparse_coo_tensor([[1, 3]], [2.0, 4.0], (6,)),
        "a NaN and opposite Infs": torch.sparse_coo_tensor([[0, 1, 1, 4]], [nan, inf, -inf, 7.0], (5,)),
        "every element stored": torch.sparse_coo_tensor([[0, 1, 2]], [3.0, -1.0, 2.0], (3,)),
        "hybrid": torch.sparse_coo_tensor([[0, 3]], [[1.0, -2.0], [70000.0, 1e-9]], (4, 2)),
        "empty": torch.sparse_coo_tensor(torch.zeros((1, 0), dtype=torch.int64), torch.zeros(0), (4,)),
        "bf16, 2-d": torch.randn(5, 6).masked_fill(torch.rand(5, 6) < 0.7, 0).to(torch.bfloat16).to_sparse(),
    }
    dense = torch.randn(4)
    for what, t in cases.items():
        for fp16_range in (False, True):
            got = nanscan.scan([dense, t], fp16_range=fp16_range)
            want = nanscan.scan([dense, t.to_dense()], fp16_range=fp16_range)
            for field in ("nan_count", "inf_count", "min", "max", "fp16_overflow", "fp16_underflow"):
                a, b = getattr(got, field), getattr(want, field)
                assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), f"{what}: {field} {a} != {b}"
            torch.testing.assert_close(got.norm, want.norm, rtol=1e-12, atol=0, equal_nan=True, msg=what)
            assert bool(got.finite) == bool(want.finite), what
            torch.testing.assert_close(got.total_norm, want.total_norm, rtol=1e-12, atol=0, equal_nan=True)
    report = nanscan.check([torch.nn.Parameter(torch.zeros(7))], max_norm=1.0)  # no gradient: nothing
    assert report.names == []
    embedding = torch.nn.Embedding(10, 3, sparse=True)
    embedding(torch.tensor([1, 2, 2])).sum().backward()
    before = embedding.weight.grad.to_dense().clone()
    report = nanscan.check(embedding, max_norm=0.5)
    assert report.names == ["weight"] and report.total_norm == pytest.approx(before.norm().item(), rel=1e-6)
    torch.testing.assert_close(embedding.weight.grad.to_dense(), before * report.clip_coef)
    with pytest.raises(TypeError, match="sparse_coo"):  # a checksum is of dense bits: no exact sparse one
        nanscan.scan([cases["duplicates"]], checksum=True)
