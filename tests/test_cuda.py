"""CUDA-only behaviour: CPU parity, lists longer than the kernel parameters hold (device copies of
their metadata, cached per stream), the fold tree's edges, > 2^31 elements, determinism, CUDA graphs,
no host syncs, torch.compile with CUDA graphs. Every test here is skipped without a GPU; the
device-generic tests in the other files also run on CUDA, and tests/test_list_plan.py checks the
kernel's index arithmetic on the CPU."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import TypeVar

import pytest
import torch

import nanscan

from conftest import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    assert_matches_reference,
    needs_cuda,
    random_tensor,
    syncs_refused,
)

pytestmark = [pytest.mark.cuda, needs_cuda]

T = TypeVar("T")


def cuda_and_cpu_agree(tensors: list[torch.Tensor]) -> None:
    gpu = nanscan.scan(tensors)
    cpu = nanscan.scan([t.cpu() for t in tensors])
    for name in ("nan_count", "inf_count", "min", "max"):
        assert torch.equal(getattr(gpu, name).cpu(), getattr(cpu, name)), name
    torch.testing.assert_close(gpu.norm.cpu(), cpu.norm, rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(gpu.total_norm.cpu(), cpu.total_norm, rtol=1e-6, atol=0, equal_nan=True)
    assert bool(gpu.finite) == bool(cpu.finite)


def nanscan_kernels_launched(fn: Callable[[], object]) -> list[str]:
    """Names of the nanscan CUDA kernels ``fn`` launches, in order (from the profiler)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and "nanscan" in e.name]


def test_cpu_parity_mixed_list() -> None:
    gen = torch.Generator().manual_seed(3)
    dtypes = FLOAT_DTYPES + FP8_DTYPES
    tensors = []
    for i in range(400):
        n = int(torch.randint(0, 200_000, (1,), generator=gen))
        t = random_tensor(n, dtypes[i % len(dtypes)], "cuda")
        if n and i % 7 == 0:
            t.view(-1)[int(torch.randint(0, n, (1,), generator=gen))] = math.nan
        tensors.append(t)
    tensors.append(torch.randn(64, 48, device="cuda")[:, ::3])  # not dense: copied, then scanned
    cuda_and_cpu_agree(tensors)


# torch.ops.nanscan lists longer than this read their metadata from device memory.
PARAMETER_CAPACITY = 256  # csrc/cuda/scan_cuda.cu: kInlineTensors


def test_list_longer_than_the_parameters() -> None:
    tensors = [random_tensor(1 + (i * 37) % 3000, torch.float32, "cuda") for i in range(5000)]
    tensors[4321].view(-1)[0] = math.inf
    tensors[PARAMETER_CAPACITY].view(-1)[-1] = math.nan
    assert_matches_reference(nanscan.scan(tensors), tensors)
    cuda_and_cpu_agree(tensors)
    # The second call finds the list's device copy in the cache: new values, same metadata.
    for t in tensors:
        t.normal_()
    tensors[17].view(-1)[0] = -math.inf
    assert_matches_reference(nanscan.scan(tensors), tensors)


def test_device_list_cache_eviction_and_streams() -> None:
    lists = [[random_tensor(100 + k, torch.float32, "cuda") for _ in range(PARAMETER_CAPACITY + 1)] for k in range(10)]
    for tensors in lists + lists[:2]:  # more lists than the cache holds, then the evicted ones again
        assert_matches_reference(nanscan.scan(tensors), tensors)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        result = nanscan.scan(lists[0])  # the same list on another stream gets its own copy
    torch.cuda.current_stream().wait_stream(side)
    assert_matches_reference(result, lists[0])


def test_a_short_lists_checksums_read_its_device_copy_and_find_it_again() -> None:
    """The checksum scan has no kernel that takes the list in its parameters (cuda::has_inline_kernel):
    a list of a model's length is uploaded once, then found in the cache; the plain scan of the same
    list uploads nothing. Both give the CPU's results."""
    tensors = [random_tensor(100 + i, torch.float32, "cuda") for i in range(37)]
    tensors[5].view(-1)[3] = math.nan
    first: list[nanscan.ScanResult] = []
    kernels = nanscan_kernels_launched(lambda: first.append(nanscan.scan(tensors, checksum=True)))
    assert any("upload_kernel" in k for k in kernels), f"no device copy made: {kernels}"
    again: list[nanscan.ScanResult] = []
    kernels = nanscan_kernels_launched(lambda: again.append(nanscan.scan(tensors, checksum=True)))
    assert not any("upload_kernel" in k for k in kernels), f"not found in the cache: {kernels}"
    cpu = nanscan.scan([t.cpu() for t in tensors], checksum=True)
    for result in (first[0], again[0]):
        assert torch.equal(result.checksum.cpu(), cpu.checksum)
        assert torch.equal(result.nan_count.cpu(), cpu.nan_count)
    kernels = nanscan_kernels_launched(lambda: nanscan.scan(tensors))
    assert not any("upload_kernel" in k for k in kernels), f"the plain scan made a device copy: {kernels}"


def with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters whose .grad are ``grads`` (the drop-ins clip parameters' gradients)."""
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return params


def test_long_list_clip_and_unscale() -> None:
    grads = [random_tensor(257, torch.float32, "cuda", scale=10.0) for _ in range(3000)]
    expected = [g.clone() for g in grads]
    want = torch.nn.utils.clip_grad_norm_(with_grads(expected), 1.0)
    got = nanscan.clip_grad_norm_(with_grads(grads), 1.0)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert float(want) > 10  # so the gradients were scaled down
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-7)
    found = torch.zeros((), device="cuda")
    inv_scale = torch.tensor(1 / 64.0, device="cuda")
    torch._amp_foreach_non_finite_check_and_unscale_(expected, found, inv_scale)
    torch.ops.nanscan.unscale_scan_(grads, inv_scale)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, rtol=1e-6, atol=1e-9)


@pytest.mark.parametrize("chunks", [1, 2, 32, 33, 1024, 1025, 1057])
def test_fold_tree_edges(chunks: int) -> None:
    """A tensor of `chunks` 32 KiB chunks, with values at its first and last chunk. The grid has
    about a warp per chunk of this list, so the tensor is met by about `chunks` warps: one (a direct
    write) up to over 1,024 (both levels of the fold: groups of 32 partials, then the groups) where
    the GPU holds over ~265 blocks at once (an H100: 396)."""
    per_chunk = 32 * 1024 // 4
    t = random_tensor(chunks * per_chunk, torch.float32, "cuda")
    t[0] = -1e30  # its square overflows fp32: that chunk takes the exact path
    t[-1] = 1e30
    one_more = random_tensor(chunks * per_chunk + 1, torch.float32, "cuda")
    tensors = [torch.empty(0, device="cuda"), t, one_more, random_tensor(5, torch.bfloat16, "cuda")]
    assert_matches_reference(nanscan.scan(tensors), tensors)
    t[per_chunk * (chunks - 1)] = math.nan
    assert_matches_reference(nanscan.scan(tensors), tensors)


def gpt2_small_shapes() -> list[tuple[int, ...]]:
    d, layer = (
        768,
        [
            (768,),
            (768,),
            (768, 2304),
            (2304,),
            (768, 768),
            (768,),
            (768,),
            (768,),
            (768, 3072),
            (3072,),
            (3072, 768),
            (768,),
        ],
    )
    return [(50257, d), (1024, d)] + layer * 12 + [(d,), (d,)]


def test_extra_memory_under_1mb_for_gpt2_small() -> None:
    grads = [torch.randn(shape, device="cuda") for shape in gpt2_small_shapes()]
    assert len(grads) == 148
    extra = extra_memory_of_scan(grads)
    assert extra < 1 << 20, f"{extra} bytes"  # outputs + workspace (0.23 MB on an H100 by the layout's arithmetic)


def extra_memory_of_scan(grads: list[torch.Tensor]) -> int:
    """Device bytes a scan allocates beyond its inputs (outputs and workspace), at its peak."""
    nanscan.scan(grads)  # warm-up: the caching allocator's own first-use blocks are not the scan's
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    nanscan.scan(grads)
    return torch.cuda.max_memory_allocated() - before


def test_extra_memory_does_not_grow_with_gradient_bytes() -> None:
    """O(tensors + grid): the same 148 tensors at 1x and 4x their GPT-2-small sizes (bf16, 0.25 and
    1 GB) need the same scratch, to the caching allocator's rounding."""
    small = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for shape in gpt2_small_shapes()]
    large = [
        torch.randn((4 * shape[0], *shape[1:]), device="cuda", dtype=torch.bfloat16) for shape in gpt2_small_shapes()
    ]
    extra_small, extra_large = extra_memory_of_scan(small), extra_memory_of_scan(large)
    assert extra_large <= extra_small + 4096, (extra_small, extra_large)


def test_results_are_bit_identical_across_runs() -> None:
    tensors = [random_tensor(n, torch.float32, "cuda") for n in (3, 1 << 20, 70_001, 5 << 20)]
    first = nanscan.scan(tensors)
    for _ in range(5):
        again = nanscan.scan(tensors)
        assert torch.equal(again.norm, first.norm) and torch.equal(again.total_norm, first.total_norm)


def test_empty_tensors_between_others() -> None:
    tensors = []
    for i in range(300):
        tensors.append(torch.empty(0, device="cuda", dtype=FLOAT_DTYPES[i % len(FLOAT_DTYPES)]))
        tensors.append(random_tensor(1 + i, torch.float16, "cuda"))
    assert_matches_reference(nanscan.scan(tensors), tensors)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + FP8_DTYPES)
def test_views_at_every_offset_within_a_vector(dtype: torch.dtype) -> None:
    """Views into a flat buffer (DDP buckets, packed gradients) start anywhere: the kernel peels the
    elements before the first 16-byte boundary, then loads vectors. Every start offset, sizes around
    the vector and the chunk, NaN/Inf in the head, the body and the tail."""
    per_vector = 16 // torch.tensor([], dtype=dtype).element_size()
    per_chunk = 32 * 1024 // torch.tensor([], dtype=dtype).element_size()
    flat = random_tensor(per_vector * (per_chunk + 2) * 3, dtype, "cuda")
    views, offset = [], 0
    for k in range(per_vector):
        for n in (1, per_vector - 1, per_vector + 1, 1000, per_chunk + 3):
            start = -(-offset // per_vector) * per_vector + k  # the next vector boundary, then k elements on
            views.append(flat[start : start + n])
            offset = start + n
    bad = math.nan if dtype == torch.float8_e4m3fn else math.inf
    for i, v in enumerate(views):
        if v.numel() > 2 and i % 4 < 3:
            v[[0, v.numel() // 2, v.numel() - 1][i % 4]] = bad if i % 2 else math.nan
    assert any(v.data_ptr() % 16 for v in views) and any(v.data_ptr() % 16 == 0 for v in views)
    cuda_and_cpu_agree(views)
    assert_matches_reference(nanscan.scan(views), views)


def test_scale_of_unaligned_views() -> None:
    base = torch.randn(100_003, device="cuda")
    views = [
        base[1:],  # 4 bytes past a 16-byte boundary
        torch.randn(100_003, device="cuda", dtype=torch.bfloat16)[5:],
        torch.randn(33, device="cuda", dtype=torch.float16)[3:],
    ]
    expected = [v.clone() * 0.5 for v in views]
    torch.ops.nanscan.scale_(views, torch.tensor(0.5, device="cuda"))
    for v, e in zip(views, expected, strict=True):
        assert torch.equal(v, e)


def test_eager_unscale_does_not_stand_in_for_a_captured_scan() -> None:
    model = make_model()
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    grads = [p.grad for p in model.parameters()]
    scaler = nanscan.amp.GradScaler("cuda")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    scaler.scale(torch.ones((), device="cuda"))
    scaler.unscale_(optimizer)  # eager: its statistics must not stand in for the captured scan
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        nanscan.scan([g.clone() for g in grads])  # warm-up of the plain scan, outside the capture
        with torch.cuda.graph(graph, stream=stream):
            captured = nanscan.scan(grads)  # must be a captured scan, not the eager result
    torch.cuda.current_stream().wait_stream(stream)
    grads[0].view(-1)[0] = math.nan
    graph.replay()
    assert captured.nan_count[0].item() == 1


def test_metadata_cache_holds_no_block_of_a_private_pool() -> None:
    """A long list's metadata, kept across calls, must not live in a pool that torch may checkpoint and
    hand out again (torch.compile's CUDA graph trees while warming up, torch.cuda.use_mem_pool)."""
    tensors = [random_tensor(64, torch.float32, "cuda") for _ in range(PARAMETER_CAPACITY + 11)]
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        first = nanscan.scan(tensors)  # a new list: its metadata is uploaded and cached here
        total = first.total_norm.item()
    del first  # the pool's only other blocks: the scan's outputs and workspace
    torch.cuda.synchronize()
    held = [b for segment in pool.snapshot() for b in segment["blocks"] if b["state"] == "active_allocated"]
    assert held == [], f"{len(held)} block(s) of the private pool still held after the scan"
    results: list[nanscan.ScanResult] = []
    kernels = nanscan_kernels_launched(lambda: results.append(nanscan.scan(tensors)))
    assert not any("upload_kernel" in k for k in kernels), f"not found in the cache: {kernels}"
    assert results[0].total_norm.item() == total
    assert_matches_reference(results[0], tensors)


def test_cuda_graph_of_a_long_list() -> None:
    tensors = [random_tensor(64, torch.float32, "cuda") for _ in range(PARAMETER_CAPACITY + 500)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        nanscan.scan(tensors)  # warm-up: puts the list in the eager cache, which the graph must not use
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = nanscan.scan(tensors)
    others = [[random_tensor(64, torch.float32, "cuda") for _ in range(PARAMETER_CAPACITY + 1)] for _ in range(9)]
    for tensors_ in others:
        nanscan.scan(tensors_)  # evicts the cached copy of the captured list
    for i in range(10):
        for t in tensors:
            t.normal_()
        if i % 3 == 1:
            tensors[-1][7] = math.nan
        graph.replay()
        assert_matches_reference(captured, tensors)


def test_many_tiny_tensors() -> None:
    tensors = [random_tensor(1024, torch.float32, "cuda") for _ in range(10_000)]
    assert_matches_reference(nanscan.scan(tensors), tensors)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_runs_of_small_tensors_at_every_magnitude(dtype: torch.dtype) -> None:
    """The small-tensor path (runs of up to four tensors of at most 8 KiB, eight lanes each): runs
    of every length, cut by another dtype, a larger tensor and float8; unaligned views; ordinary,
    tiny (the whole warp re-scans those), overflowing-square and mixed NaN/Inf tensors; against the
    fp64 reference, on several list lengths so that warps' shares cut the runs."""
    gen = torch.Generator().manual_seed(25)
    max_numel = 8192 // torch.empty((), dtype=dtype).element_size()
    magnitudes = [1.0, 1.0, 1.0, 1e-20, 1e-40, 3e37]
    tensors: list[torch.Tensor] = []
    for i in range(3000):
        pick = int(torch.randint(0, 12, (1,), generator=gen))
        if pick == 0:
            tensors.append(random_tensor(max_numel + 100, dtype, "cuda"))
            continue
        if pick == 1:
            other = torch.float8_e4m3fn if i % 2 else (torch.float32 if dtype != torch.float32 else torch.float16)
            tensors.append(random_tensor(300, other, "cuda"))
            continue
        n = [0, max_numel, 7, int(torch.randint(1, max_numel + 1, (1,), generator=gen))][pick % 4]
        offset = int(torch.randint(0, 4, (1,), generator=gen)) if pick % 3 == 0 else 0
        magnitude = magnitudes[int(torch.randint(0, len(magnitudes), (1,), generator=gen))]
        t = (torch.randn(n + offset, generator=gen, dtype=torch.float64) * magnitude).to(dtype).cuda()[offset:]
        if n and pick == 5:
            t[int(torch.randint(0, n, (1,), generator=gen))] = math.nan
        if n and pick == 6:
            t[int(torch.randint(0, n, (1,), generator=gen))] = -math.inf
        tensors.append(t)
    for length in (40, 700, 3000):  # parameter blobs, small and large, and a device blob
        assert_matches_reference(nanscan.scan(tensors[:length]), tensors[:length])


def test_more_than_2_31_elements() -> None:
    n = 2**31 + 1000
    free, _ = torch.cuda.mem_get_info()
    if free < 3 * n:
        pytest.skip("needs ~7 GB of free GPU memory")
    t = torch.empty(n, dtype=torch.uint8, device="cuda").random_(0, 0x7F).view(torch.float8_e4m3fn)  # no NaN codes
    t[-1:].view(torch.uint8).fill_(0x7F)  # a NaN in the very last element
    t[2**31 + 7 : 2**31 + 8].view(torch.uint8).fill_(0xFE)  # -448, the minimum, past 2^31
    r = nanscan.scan([t])
    assert r.nan_count.item() == 1 and r.min.item() == -448.0
    sumsq = 0.0
    for start in range(0, n - 1, 2**28):  # reference in pieces: fp64 of 2^31 elements would need 17 GB
        piece = t[start : min(start + 2**28, n - 1)].float().double()
        sumsq += float(piece.square().sum())
    finite_norm = nanscan.scan([t[:-1]]).norm.item()
    assert finite_norm == pytest.approx(math.sqrt(sumsq), rel=1e-6)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64)).cuda()


def warmed_up_and_captured(step: Callable[[], T]) -> tuple[torch.cuda.CUDAGraph, T]:
    """``step`` run three times on a side stream (torch's recipe before a capture), then captured:
    the graph, and what the captured call returned (its tensors refreshed by each replay)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        result = step()
    return graph, result


def test_cuda_graph_capture_and_replays() -> None:
    model = make_model()
    static_x = torch.randn(32, 64, device="cuda")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step() -> nanscan.Report:
        for p in model.parameters():
            p.grad.zero_()
        model(static_x).square().mean().backward()
        return nanscan.check(model, max_norm=0.5)

    graph, report = warmed_up_and_captured(step)
    for i in range(100):
        static_x.copy_(torch.randn(32, 64, device="cuda") * (1 + i % 5))
        if i % 10 == 3:
            static_x[0, 0] = math.nan
        graph.replay()
        grads_after = [p.grad.clone() for p in model.parameters()]
        # Recompute eagerly from the same input to know what the replay should have produced.
        twin = make_model()
        twin.load_state_dict(model.state_dict())
        twin(static_x).square().mean().backward()
        want = torch.nn.utils.get_total_norm([p.grad for p in twin.parameters()])
        got = report.total_norm_tensor  # the captured output tensor, refreshed by each replay
        if i % 10 == 3:
            assert not bool(report.stats.finite) and math.isnan(got.item())
        else:
            assert bool(report.stats.finite)
            torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=0)
            torch.nn.utils.clip_grad_norm_(list(twin.parameters()), 0.5)
            for a, b in zip(grads_after, twin.parameters(), strict=True):
                torch.testing.assert_close(a, b.grad, rtol=1e-5, atol=1e-7)


def test_no_host_sync() -> None:
    model = make_model()
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    grads = [p.grad for p in model.parameters()]
    long_list = [random_tensor(33, torch.float32, "cuda") for _ in range(PARAMETER_CAPACITY + 100)]
    nanscan.scan(long_list)  # the first call uploads its metadata; later ones find it cached
    torch.cuda.synchronize()
    with syncs_refused():
        nanscan.scan(grads)
        nanscan.scan(long_list)
        nanscan.scan(long_list[1:])  # a new list: an upload, still without a sync
        nanscan.clip_grad_norm_(model.parameters(), 1.0)
        nanscan.clip_grad_norm_(model.parameters(), 1e-3)
        report = nanscan.check(model, max_norm=1.0)
    assert report.finite  # reading a value syncs, outside the guarded region


def test_amp_clip_and_fused_skip_limit_do_not_sync() -> None:
    """The scaler's one-call unscale + clip, and the consecutive-skip limit on a fused optimizer (its
    counter reaches the host by asynchronous copies), run without a host sync; the limit still holds."""
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = nanscan.amp.GradScaler("cuda", init_scale=1024.0)
    x = torch.randn(8, 64, device="cuda")
    scaler.scale(model(x).sum()).backward()
    torch.cuda.synchronize()
    with syncs_refused():
        scaler.clip_grad_norm_(optimizer, 1.0)
        scaler.step(optimizer)
        scaler.update()
        raised_at = None
        for step in range(12):
            model.zero_grad()
            model(x).sum().backward()
            model[0].weight.grad[0, 0].fill_(math.nan)  # (an indexed assignment copies from the host: a sync)
            try:
                nanscan.check(model, on_nonfinite="skip", optimizer=optimizer, max_consecutive_skips=3)
            except nanscan.NonFiniteGradientError:
                raised_at = step
                break
            optimizer.step()
    assert raised_at is not None and 3 <= raised_at <= 5, f"limit 3: raised at step {raised_at}"


def test_torch_compile_reduce_overhead() -> None:
    def health(grads: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        r = nanscan.scan(grads)
        return r.total_norm, r.finite

    compiled = torch.compile(health, mode="reduce-overhead", fullgraph=True)
    grads = [torch.randn(1000, device="cuda"), torch.randn(33, 7, device="cuda", dtype=torch.bfloat16)]
    for i in range(5):
        for g in grads:
            g.normal_()
        if i == 3:
            grads[1][2, 2] = math.inf
        got_norm, got_finite = compiled(grads)
        want_norm, want_finite = health(grads)
        torch.testing.assert_close(got_norm.clone(), want_norm)
        assert bool(got_finite) == bool(want_finite) == (i != 3)


def test_scale_skips_write_when_coefficient_is_one() -> None:
    t = torch.randn(1 << 20, device="cuda")
    before = t.clone()
    torch.ops.nanscan.scale_([t], torch.tensor(1.0, device="cuda"))
    assert torch.equal(t, before)
    torch.ops.nanscan.scale_([t], torch.tensor(0.25, device="cuda"))
    assert torch.equal(t, before * 0.25)


def test_scale_rejects_fp8() -> None:
    t = torch.zeros(4, device="cuda").to(torch.float8_e4m3fn)
    with pytest.raises(RuntimeError, match="float8"):
        torch.ops.nanscan.scale_([t], torch.tensor(0.5, device="cuda"))


@pytest.mark.parametrize("layout", ["dense", "strided"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_fused_unscale_matches_torch_bit_for_bit(dtype: torch.dtype, layout: str) -> None:
    """Dense gradients take the fused path (one scan kernel that multiplies); a list with a truly
    strided gradient (`[:, ::2]`, not non-overlapping-and-dense) takes the two-step path: the multiply,
    then a plain scan. Both must give torch's unscale bit for bit."""
    grads = [random_tensor(n, dtype, "cuda", scale=1000.0) for n in (1, 555, 65537, 300_001)]
    grads[2].view(-1)[17] = math.nan  # forces the exact re-read of that chunk, after the rewrite
    # A transposed matrix is non-overlapping and dense: the fused path reads it in place.
    grads.append(torch.randn(40, 30, device="cuda").to(dtype).t())
    # A view one element past a 16-byte boundary, an Inf in its head (rewritten one element per lane),
    # so its chunk is re-read after the rewrite: each lane must see its own writes.
    grads.append(random_tensor(70_001, dtype, "cuda", scale=1000.0)[1:])
    grads[-1][1] = math.inf
    if layout == "strided":
        grads.append(torch.randn(40, 60, device="cuda").to(dtype)[:, ::2])
    expected = [g.clone() for g in grads]
    found = torch.zeros((), device="cuda")
    inv_scale = torch.tensor(1 / 1024.0, device="cuda")
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(expected, found, inv_scale)
    except NotImplementedError:
        # torch's CUDA unscale has no bf16 kernel (torch 2.11): its formula for the others, in float
        # (the opmath type) and rounded once, which nanscan's unscale must give bit for bit.
        expected = [(g.float() * inv_scale).to(dtype) for g in grads]
        found.fill_(1.0)
    outputs: list[tuple[torch.Tensor, ...]] = []
    kernels = nanscan_kernels_launched(lambda: outputs.append(torch.ops.nanscan.unscale_scan_(grads, inv_scale)))
    counts, _, _, finite, _ = outputs[0]  # the fifth: the total norm in torch's dtype
    if layout == "dense":
        assert len(kernels) == 1 and "scan_kernel<false, true" in kernels[0], kernels
    else:
        assert any("scale_kernel" in k for k in kernels) and any("scan_kernel<false, false" in k for k in kernels), (
            kernels
        )
    for g, e in zip(grads, expected, strict=True):
        assert torch.equal(g.nan_to_num(), e.nan_to_num())
    assert bool(found) and not bool(finite) and counts[0].tolist() == [0, 0, 1] + [0] * (len(grads) - 3)
    assert counts[1].tolist()[5] == 1, "the Inf in the misaligned view's head"
    cuda_and_cpu_agree([g for i, g in enumerate(grads) if i != 2])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn])
def test_norm_accuracy_on_constant_tensors(dtype: torch.dtype) -> None:
    """Constant values are the worst case for running sums of squares; a lane folds its fp32 sum into
    fp64 every group of at most 65 squares, which keeps the norm within 5e-7 (the emulator: 2e-7)."""
    gen = torch.Generator().manual_seed(3)
    for _ in range(10):
        value = 0.5 + torch.rand((), generator=gen).item()
        t = torch.full((3 * 32 * 1024 + 17,), value, device="cuda").to(dtype)
        want = math.sqrt(t.numel()) * abs(t[0].double().item())
        got = nanscan.scan([t]).norm.item()
        assert abs(got - want) / want <= 5e-7, f"{dtype} value {value}: {got} vs {want}"


def test_recorder_appends_and_reads_without_a_sync() -> None:
    """Appends, and the reads every few steps (an asynchronous copy to pinned memory and an event),
    never wait for the GPU; what reaches the sink matches each step's report."""
    model = make_model()
    sink: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder([sink.append], every=5, capacity=40, spike_window=8, warn=False)
    x = torch.randn(8, 64, device="cuda")
    model(x).sum().backward()
    nanscan.check(model, recorder=recorder)  # the first append allocates the buffer
    torch.cuda.synchronize()
    totals = []
    with syncs_refused():
        for step in range(12):
            model.zero_grad()
            model(x * (step + 1)).sum().backward()
            if step == 7:
                model[0].weight.grad[0, 0].fill_(math.nan)
            totals.append(nanscan.check(model, max_norm=1.0, recorder=recorder).total_norm_tensor)
    recorder.close()
    assert [r.step for r in sink] == list(range(13))
    for record, total in zip(sink[1:], totals, strict=True):
        want = total.item()
        assert record.total_norm == want or (math.isnan(want) and math.isnan(record.total_norm))
    assert [r.finite for r in sink[1:]] == [step != 7 for step in range(12)]


def test_recorder_reads_a_nonfinite_step_out_soon_without_a_sync() -> None:
    """flush_on_nonfinite on a GPU: a NaN step (every=100, so no periodic read) reaches the sink a
    few appends later, through the count's asynchronous copy and an asynchronous read: no sync."""
    model = make_model()
    sink: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder([sink.append], every=100, warn=False)
    x = torch.randn(8, 64, device="cuda")
    model(x).sum().backward()
    nanscan.check(model, recorder=recorder)  # the first append allocates the buffers
    torch.cuda.synchronize()
    with syncs_refused():
        for step in range(40):
            model.zero_grad()
            model(x).sum().backward()
            if step == 3:
                model[0].weight.grad[0, 0].fill_(math.nan)
            nanscan.check(model, recorder=recorder)
            if step >= 8 and len(sink) >= 5:
                break
            time.sleep(0.005)  # a training step's time: the copies land
    assert [r.step for r in sink][:5] == list(range(5)) and not sink[4].finite
    recorder.close()
    assert [r.finite for r in sink] == [step != 4 for step in range(len(sink))]


def test_recorder_inside_a_captured_graph() -> None:
    """The append is captured with the check; each replay advances the device counter, and a flush
    after the replays reads every one of them."""
    model = make_model()
    static_x = torch.randn(32, 64, device="cuda")
    sink: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder([sink.append], every=10, capacity=64, spike_window=8, warn=False)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)

    def step() -> None:
        for p in model.parameters():
            p.grad.zero_()
        model(static_x).square().mean().backward()
        nanscan.check(model, max_norm=0.5, recorder=recorder)

    graph, _ = warmed_up_and_captured(step)
    for i in range(30):
        static_x.copy_(torch.randn(32, 64, device="cuda"))
        if i % 10 == 4:
            static_x[0, 0] = math.nan
        graph.replay()
    recorder.flush()
    assert [r.step for r in sink] == list(range(33))
    assert [r.finite for r in sink[3:]] == [i % 10 != 4 for i in range(30)]
    assert all(r.max_norm == 0.5 for r in sink)
