"""A short workload that reaches every CUDA kernel path, for compute-sanitizer on a GPU machine
(tools/gpu_session.sh sanitize runs it, one sanitizer tool per command); it also checks each result
against the CPU backend, so a run that the sanitizer passes is also a correct one.

    compute-sanitizer --tool memcheck --kernel-name kns=nanscan python3 tools/sanitize_workload.py
    python3 tools/sanitize_workload.py --device cpu      # smoke test without a GPU (CI runs it)

Paths covered: lists in the small and the large parameter capacity and in device memory (uploaded,
then found in the cache), empty tensors, every dtype including fp8, tensors starting at every offset
within a 16-byte vector (the kernels' head path), the replica checksum, a tensor of over 1024
chunks (met by over 1024 warps' shares on a GPU's grid: both levels of the fold tree), NaN/Inf
planted, runs of small tensors (the small-tensor path), chunks of tiny, huge, all-NaN, all-Inf and
mixed NaN/Inf values (every re-read of scan_rules.h), the fp16-range scan, the fused unscale (and its two-step path for a strided gradient), and
the clip multiply with a coefficient of 1 (no write) and below 1, and the difference scan (the update
watch's kernel: every pair of formats it admits, in each list capacity, with tiny updates, NaN/Inf
and an all-NaN chunk), and the update sketch (every dtype, both of its kernel's shapes). With ``--part graph``: a CUDA graph
of a scan of a list in device memory, replayed (the blob's upload kernels run at every replay).

Built to keep the sanitizer's work on nanscan's kernels: every list is a set of views into one flat
buffer per dtype, made on the CPU and copied over in one transfer, and every comparison is of whole
buffers (one copy back per check), so the workload launches a few dozen torch kernels besides
nanscan's, not tens of thousands (each costs the sanitizer an interception even when filtered out).
Set PYTORCH_NO_CUDA_MEMORY_CACHING=1 for ``--part paths`` so that memcheck sees each allocation's
true bounds rather than the caching allocator's pooled blocks. The graph part needs the caching
allocator (torch's capture takes the graph's memory from the allocator's private pool, which the
setting bypasses), so it runs in a process of its own, and refuses to run without it.

    python3 tools/sanitize_workload.py --part graph     # the CUDA graph part alone
"""

from __future__ import annotations

import argparse
import math
import os
from dataclasses import dataclass

import torch

import nanscan
from nanscan._ops import scan_difference_op, sketch_op
from nanscan.fused import ScanResult

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


@dataclass
class Views:
    """Tensors that are views into one flat buffer per dtype, laid end to end (so most start off a
    16-byte boundary); comparing the buffers compares every tensor at once."""

    flats: dict[torch.dtype, torch.Tensor]
    layout: list[tuple[torch.dtype, int, int]]  # (dtype, offset, numel) of each tensor, in list order

    @classmethod
    def random(cls, sizes: list[int], dtypes: list[torch.dtype], gen: torch.Generator) -> Views:
        """Random values (fp8 within its range) on the CPU; ``sizes[i]`` elements of ``dtypes[i]``."""
        totals: dict[torch.dtype, int] = {}
        layout = []
        for n, dtype in zip(sizes, dtypes, strict=True):
            layout.append((dtype, totals.get(dtype, 0), n))
            totals[dtype] = totals.get(dtype, 0) + n
        flats = {
            dtype: torch.randn(total, generator=gen, dtype=torch.float64).clamp(-400, 400).to(dtype)
            for dtype, total in totals.items()
        }
        return cls(flats, layout)

    @property
    def tensors(self) -> list[torch.Tensor]:
        return [self.flats[dtype][offset : offset + n] for dtype, offset, n in self.layout]

    def plant(self, index: int, position: int, value: float) -> None:
        dtype, offset, n = self.layout[index]
        self.flats[dtype][offset + (position % n)] = value

    def to(self, device: str) -> Views:
        return Views({dtype: flat.to(device) for dtype, flat in self.flats.items()}, self.layout)

    def clone(self) -> Views:
        return Views({dtype: flat.clone() for dtype, flat in self.flats.items()}, self.layout)

    def values(self) -> torch.Tensor:
        """Every element, as float64 on the CPU, NaN/Inf made comparable (one copy back)."""
        return torch.cat([flat.double() for flat in self.flats.values()]).nan_to_num(1e300, 1e301, -1e301).cpu()


def packed(result: nanscan.ScanResult) -> tuple[torch.Tensor, torch.Tensor]:
    """(exact fields, norms) of a scan as two CPU tensors: one copy back instead of one per field."""
    exact = [result.nan_count, result.inf_count]
    if result.fp16_overflow is not None and result.fp16_underflow is not None:
        exact += [result.fp16_overflow, result.fp16_underflow]
    exact_rows = torch.cat([t.double() for t in exact] + [result.min, result.max, result.finite.double().reshape(1)])
    norms = torch.cat([result.norm, result.total_norm.reshape(1)])
    both = torch.cat([exact_rows, norms]).cpu()
    return both[: exact_rows.numel()], both[exact_rows.numel() :]


def same(got: nanscan.ScanResult, want: nanscan.ScanResult, what: str) -> None:
    """Counts, min, max and the finite flag equal, the norms within 1e-6 (one copy back of each)."""
    got_exact, got_norms = packed(got)
    want_exact, want_norms = packed(want)
    assert torch.equal(got_exact.nan_to_num(), want_exact.nan_to_num()), what
    torch.testing.assert_close(got_norms, want_norms, rtol=1e-6, atol=0, equal_nan=True)


def agree(views: Views, reference: Views, fp16_range: bool = False) -> None:
    """The scan of ``views`` (on the device) equals the CPU backend's scan of ``reference``."""
    same(
        nanscan.scan(views.tensors, fp16_range=fp16_range),
        nanscan.scan(reference.tensors, fp16_range=fp16_range),
        "counts, min, max or the finite flag differ",
    )


def with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters whose .grad are ``grads``: what the clip drop-ins take. Each parameter aliases its
    gradient's memory (nothing here reads or writes parameters): no allocation per parameter."""
    params = [torch.nn.Parameter(g) for g in grads]
    for p, g in zip(params, grads, strict=True):
        p.grad = g
    return params


# The difference scan's pairs (before, after): every format pair its kernel is built for.
DIFFERENCE_PAIRS = [(torch.float32, after) for after in [torch.float32, torch.float16, torch.bfloat16, *FP8]] + [
    (torch.float64, after) for after in [torch.float64, torch.float32, torch.float16, torch.bfloat16, *FP8]
]


def differences(gen: torch.Generator, device: str) -> None:
    """``scan_difference`` on the device against the CPU backend's, for lists of 40, 400 and 900 pairs
    (80, 800 and 1,800 tensors: the small and the large parameter capacity, and device memory), the
    pairs cycling through DIFFERENCE_PAIRS at sizes from 1 element to several chunks, each a view at its
    own offset. Weights ~1, updates of ~1e-3 of them, and in every list: a pair of weights of 1e-18
    (differences of ~1e-21, whose fp32 squares are subnormal: the scaled re-read), a NaN in a before and an Inf in an after
    (the checked re-reads), and a before whose second chunk is all NaN (told by the fast result)."""
    for count in (40, 400, 900):
        kinds = [DIFFERENCE_PAIRS[i % len(DIFFERENCE_PAIRS)] for i in range(count)]
        sizes = [1 + (i * 7919) % 30_000 for i in range(count)]
        sizes[5] = 3 * 8192 + 7  # three chunks of fp32 and more of fp64 (32 KiB of before's elements each)
        afters = Views.random(sizes, [after for _, after in kinds], gen)
        befores = Views.random(sizes, [before for before, _ in kinds], gen)  # its values set below
        for i, ((before_dtype, offset, n), (after_dtype, after_offset, _)) in enumerate(
            zip(befores.layout, afters.layout, strict=True)
        ):
            weight = afters.flats[after_dtype][after_offset : after_offset + n].double()
            if i == 2:  # weights of 1e-18: differences of ~1e-21, whose fp32 squares are subnormal
                weight = weight * 1e-18
                afters.flats[after_dtype][after_offset : after_offset + n] = weight.to(after_dtype)
            moved = weight * (1 + 1e-3 * torch.randn(n, generator=gen, dtype=torch.float64))
            befores.flats[before_dtype][offset : offset + n] = moved.to(before_dtype)
        befores.plant(3, 1, math.nan)
        afters.plant(4, -1, math.inf)
        dtype, offset, _ = befores.layout[5]
        chunk = 32 * 1024 // dtype.itemsize
        befores.flats[dtype][offset + chunk : offset + 2 * chunk] = math.nan
        got = ScanResult.from_op(*scan_difference_op(befores.to(device).tensors, afters.to(device).tensors))
        want = ScanResult.from_op(*scan_difference_op(befores.tensors, afters.tensors))
        # The planted values are there, so no path above goes untaken unseen (results: the differences
        # at t, the afters at count + t).
        assert int(want.nan_count[3]) == 1 and int(want.nan_count[5]) == chunk and int(want.inf_count[count + 4]) == 1
        assert 0 < float(want.norm[2]) < 1e-17, "the tiny pair's differences are not tiny"
        same(got, want, f"{count} pairs: the differences differ")


def sketches(gen: torch.Generator, device: str) -> None:
    """``sketch`` (the update watch's copy-free kernel) on the device against the CPU backend's: lists
    of every dtype and of sizes around the bucket count and the kernel's unit (16,384 elements), each a
    view at its own offset, with a NaN and an Inf planted, for 64, 1024 and 4096 buckets (both kernel
    shapes). The buckets' float64 sums differ only in order (atomics), so within 1e-9 of the largest."""
    sizes = [0, 1, 63, 64, 65, 1024, 1025, 4097, 16_384 + 3, 3 * 16_384 + 70, 100_000]
    dtypes = FLOATS + FP8
    views = Views.random(sizes * 2, [dtypes[i % len(dtypes)] for i in range(2 * len(sizes))], gen)
    views.plant(10, 5, math.nan)
    views.plant(20, -1, math.inf)
    on_device = views.to(device)
    for buckets in (64, 1024, 4096):
        got, got_sumsq = sketch_op(on_device.tensors, buckets, 3)
        want, want_sumsq = sketch_op(views.tensors, buckets, 3)
        for mine, theirs in ((got.cpu(), want), (got_sumsq.cpu(), want_sumsq)):
            assert torch.equal(mine.isnan(), theirs.isnan()), f"{buckets} buckets: NaN in other places"
            finite = theirs.isfinite()
            assert torch.equal(mine[~finite].nan_to_num(), theirs[~finite].nan_to_num()), f"{buckets}: Inf differ"
            scale = float(theirs[finite].abs().max())
            assert torch.allclose(mine[finite], theirs[finite], rtol=0, atol=1e-9 * scale), f"{buckets}: sums differ"


def graph_replay(gen: torch.Generator) -> None:
    """A captured scan of 3,000 tensors (device memory: their blob is copied for the graph, in several
    upload kernels of 32 KB slices, one of them partial), replayed three times; the last replay's
    results against the CPU backend's."""
    if os.environ.get("PYTORCH_NO_CUDA_MEMORY_CACHING") == "1":
        raise SystemExit("--part graph needs the caching allocator: unset PYTORCH_NO_CUDA_MEMORY_CACHING")
    views = Views.random([1 + i % 300 for i in range(3000)], [FLOATS[i % 4] for i in range(3000)], gen)
    views.plant(2500, 0, math.nan)
    views.plant(7, -1, -math.inf)
    tensors = views.to("cuda").tensors
    side = torch.cuda.Stream()  # warm-up off the capture stream, as torch.cuda.graph asks
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        nanscan.scan(tensors)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = nanscan.scan(tensors)
    for _ in range(3):
        graph.replay()
    same(captured, nanscan.scan(views.tensors), "the replay's counts, min or max differ")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--part", choices=["paths", "graph"], default="paths", help="the kernel paths, or the CUDA graph replay"
    )
    args = parser.parse_args()
    device = args.device
    gen = torch.Generator().manual_seed(0)
    if args.part == "graph":
        if device != "cuda":
            raise SystemExit("--part graph needs --device cuda")
        graph_replay(gen)
        torch.cuda.synchronize()
        print("sanitize_workload: the graph's replays agreed with the CPU")
        return
    dtypes = FLOATS + FP8

    # Small and large parameter capacity: 200 and 800 tensors of every dtype, starting at every offset.
    mixed = Views.random([(i * 7919) % 70_000 for i in range(200)], [dtypes[i % len(dtypes)] for i in range(200)], gen)
    mixed.plant(3, 0, math.nan)
    mixed.plant(10, -1, math.inf)
    agree(mixed.to(device), mixed)
    many = Views.random([(i * 7919) % 9_000 for i in range(800)], [dtypes[i % len(dtypes)] for i in range(800)], gen)
    agree(many.to(device), many)
    # Device memory: uploaded, then found in the cache; and the fp16-range scan.
    long_list = Views.random([1 + i % 300 for i in range(2000)], [FLOATS[i % 4] for i in range(2000)], gen)
    long_list.plant(1999, 0, -math.inf)
    long_on_device = long_list.to(device)
    agree(long_on_device, long_list)
    agree(long_on_device, long_list)
    agree(long_on_device, long_list, fp16_range=True)
    # The replica checksum (its element-wise head and tail words assembled by shuffles, every start
    # offset within a word), in both inline capacities and from device memory, against the CPU's.
    for views in (mixed, many, long_list):
        got = nanscan.scan(views.to(device).tensors, checksum=True).checksum
        want = nanscan.scan(views.tensors, checksum=True).checksum
        assert got is not None and want is not None and torch.equal(got.cpu(), want), "the checksums differ"
    # The small-tensor path: runs of tensors of one dtype up to 8 KiB (eight lanes a tensor, their
    # results through shared-memory slots), one of them tiny and one holding a NaN (the whole warp
    # re-scans those), in runs of 7 of a dtype.
    run_dtypes = [FLOATS[(i // 7) % 4] for i in range(600)]
    runs = Views.random([(i * 131) % (8192 // d.itemsize + 1) for i, d in enumerate(run_dtypes)], run_dtypes, gen)
    runs.plant(100, 3, math.nan)
    dtype, offset, n = runs.layout[201]
    runs.flats[dtype][offset : offset + n].mul_(1e-20)
    agree(runs.to(device), runs)
    # Both levels of the fold tree, beside an empty tensor.
    per_chunk = 32 * 1024 // 4
    big = Views.random([1025 * per_chunk + 3, 0, 5], [torch.float32, torch.float32, torch.bfloat16], gen)
    big.plant(0, per_chunk * 700, math.nan)
    agree(big.to(device), big)

    # The chunks the fast rule cannot take (scan_rules.h): tiny values (the scaled re-read of the sum),
    # values whose fp32 squares overflow (scaled down), a chunk all NaN and one all +Inf (told by the
    # fast result), one of mixed NaN and +-Inf (the checked re-read); each dtype, with the fp16 range.
    kinds = [FLOATS[i % 4] for i in range(12)]
    magnitudes = Views.random([4 * (32 * 1024 // d.itemsize) + 5 for d in kinds], kinds, gen)
    for dtype, flat in magnitudes.flats.items():
        flat.mul_(1e-20 if dtype in (torch.float32, torch.bfloat16) else 1e-7)
    for i, (dtype, offset, n) in enumerate(magnitudes.layout):
        chunk = 32 * 1024 // dtype.itemsize
        # The views start mid-buffer, so a kernel chunk (which starts at the view's start) is [k * chunk,
        # (k + 1) * chunk) of the view: chunk 0 stays tiny, 1 all NaN, 2 all +Inf, 3 mixed, the tail huge.
        values = magnitudes.flats[dtype][offset : offset + n]
        if i >= 4:
            values[chunk : 2 * chunk].fill_(math.nan)
            values[2 * chunk : 3 * chunk].fill_(math.inf)
            values[3 * chunk : 4 * chunk : 3] = -math.inf
            values[3 * chunk + 1 : 4 * chunk : 5] = math.nan
        if i >= 8 and dtype != torch.float16:
            values[4 * chunk :].fill_(1e25)
    agree(magnitudes.to(device), magnitudes)
    agree(magnitudes.to(device), magnitudes, fp16_range=True)

    # The fused unscale against torch's, bit for bit: views into flat buffers, and one strided gradient
    # (the two-step path: multiply, then scan).
    grads = Views.random(
        [1, 555, 65_537, 300_001, 7, 40_000], [torch.float32] * 4 + [torch.bfloat16, torch.float16], gen
    )
    grads.plant(2, 17, math.inf)
    grads.plant(3, 0, math.nan)  # view 3 starts 4 bytes past a 16-byte boundary: a NaN in its head,
    grads.plant(5, 40_000 - 1, math.inf)  # and an Inf in a tail: both chunks are re-read after their rewrite
    assert [t.data_ptr() % 16 for t in grads.tensors][3] != 0
    on_device = grads.to(device)
    expected = on_device.clone()
    found = torch.zeros((), device=device)
    inv_scale = torch.tensor(1 / 1024.0, device=device)
    for e in expected.tensors:  # torch's unscale formula (its CUDA kernel has no bf16 in torch 2.11)
        e.copy_(e.to(torch.promote_types(e.dtype, torch.float32)) * inv_scale)
    torch.ops.nanscan.unscale_scan_(on_device.tensors, inv_scale)
    assert torch.equal(on_device.values(), expected.values()), "the fused unscale differs from torch's"
    matrix = torch.randn(64, 96, generator=gen).to(device)
    strided, strided_expected = matrix[:, ::2], matrix.clone()[:, ::2]
    torch._amp_foreach_non_finite_check_and_unscale_([strided_expected], found, inv_scale)
    torch.ops.nanscan.unscale_scan_([strided, on_device.tensors[0]], inv_scale)
    assert torch.equal(strided, strided_expected), "the two-step unscale of a strided gradient differs from torch's"

    # The clip multiply: a coefficient of 1 writes nothing; below 1 it scales as torch's clip does.
    clip_me = Views.random([10, 100_000] + [1 + i % 300 for i in range(1600)], [torch.float32] * 1602, gen)
    clip_me.flats[torch.float32].mul_(10)
    on_device = clip_me.to(device)
    before = on_device.clone()
    nanscan.clip_grad_norm_(with_grads(on_device.tensors), 1e30)  # coefficient 1: nothing written
    assert torch.equal(on_device.values(), before.values()), "a clip by 1 wrote the gradients"
    total = nanscan.clip_grad_norm_(with_grads(on_device.tensors), 1.0)
    torch.nn.utils.clip_grad_norm_(with_grads(before.tensors), 1.0)
    assert float(total) > 10  # so the multiply really scaled
    torch.testing.assert_close(on_device.values(), before.values(), rtol=1e-6, atol=1e-7)

    differences(gen, device)
    sketches(gen, device)
    if device == "cuda":
        torch.cuda.synchronize()
    print("sanitize_workload: all paths ran and agreed with the CPU")


if __name__ == "__main__":
    main()
