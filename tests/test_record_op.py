"""``nanscan::record_``, the recorder's append as one op: the CPU kernel writes byte for byte what the
composite implementation (the ATen ops every other device runs, ``nanscan::_record_composite_``)
writes, on random mixed-dtype sources with NaN/Inf, in every slot and across the wraparound; bad
input is refused with a message naming it, and nothing is written; the op passes opcheck."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import nanscan
import nanscan.recorder
from nanscan.layouts.reduce import Attribution

from conftest import needs_cuda

record = torch.ops.nanscan.record_.default
composite = torch.ops.nanscan._record_composite_.default
OPS = [pytest.param(record, id="cpu_kernel"), pytest.param(composite, id="composite")]

SOURCE_DTYPES = [
    torch.bool,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.float32,
    torch.float64,
]

# int64 values whose float32 is not the float32 of their float64 (a conversion through float64 rounds
# twice): 2^62 + 2^38 + 1 lies just above the midpoint of two float32 values, and float64 drops the +1.
DOUBLE_ROUNDING = [2**62 + 2**38 + 1, -(2**62 + 2**38 + 1), 2**53 + 2**29 + 1]


def special_floats(dtype: torch.dtype) -> list[float]:
    """Values a cast must keep exactly: NaN, +-Inf, -0, the extremes, and (for float64) values past
    float32's range and below its smallest subnormal."""
    info = torch.finfo(dtype)
    values = [math.nan, math.inf, -math.inf, -0.0, 0.0, info.max, -info.max, info.tiny, info.smallest_normal / 4]
    if dtype == torch.float64:
        values += [1e39, -1e39, 1e-46, 3.4028235677973366e38, 1.401298464324817e-45 / 2]
    return values


def random_source(gen: torch.Generator, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """Random values of ``dtype`` and ``shape``, floats with specials planted and NaNs with random payloads."""
    n = math.prod(shape)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool()
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        values = torch.randint(info.min, info.max, (n,), generator=gen, dtype=torch.int64)
        if dtype == torch.int64 and n:
            extremes = torch.tensor([info.min, info.max, *DOUBLE_ROUNDING])
            picks = torch.randint(0, n, (min(n, len(extremes)),), generator=gen)
            values[picks] = extremes[: len(picks)]
        return values.to(dtype).reshape(shape)
    values = (
        torch.randn(n, generator=gen, dtype=torch.float64) * 10.0 ** torch.randint(-40, 40, (n,), generator=gen)
    ).to(dtype)
    if n:
        specials = torch.tensor(special_floats(dtype), dtype=dtype)
        picks = torch.randint(0, n, (n // 2 + 1,), generator=gen)
        values[picks] = specials[torch.randint(0, len(specials), (len(picks),), generator=gen)]
        # One NaN with a random payload (quiet or signalling): its bits after a cast must agree too.
        as_int, mantissa = (torch.int64, 52) if dtype == torch.float64 else (torch.int32, 23)
        exponent = ((1 << (torch.finfo(dtype).bits - 1 - mantissa)) - 1) << mantissa
        values.view(as_int)[picks[0]] = exponent | int(torch.randint(1, 2**mantissa, (1,), generator=gen))
    return values.reshape(shape)


def strided(t: torch.Tensor, gen: torch.Generator, kind: int) -> torch.Tensor:
    """``t``'s values as a plain tensor (kind 0), a transposed view (1) or every other element of a
    larger tensor (2): the op must read each as copy_ reads it."""
    if kind == 1 and t.dim() == 2:
        return t.t().contiguous().t()
    if kind == 2 and t.numel() > 1:
        wide = torch.empty(t.numel() * 2, dtype=t.dtype)
        wide[::2] = t.reshape(-1)
        return wide[::2].reshape(t.shape)
    return t


Layout = list[tuple[torch.dtype, tuple[int, ...], int]]


def random_layout(gen: torch.Generator, dtypes: list[torch.dtype]) -> Layout:
    """Per source its dtype, a shape (0-dim, empty, 1-D, 2-D) and how it is strided (see strided)."""
    shapes: list[tuple[int, ...]] = [(), (1,), (0,), (7,), (3, 5), (2, 1), (33,)]
    pick = lambda k: int(torch.randint(0, k, (1,), generator=gen))  # noqa: E731
    return [(dtype, shapes[pick(len(shapes))], pick(3)) for dtype in dtypes]


def random_sources(gen: torch.Generator, layout: Layout) -> list[torch.Tensor]:
    return [strided(random_source(gen, dtype, shape), gen, kind) for dtype, shape, kind in layout]


def fresh(capacity: int, length: int, dtype: torch.dtype, transposed: bool) -> torch.Tensor:
    """[capacity, length] rows full of a NaN pattern (never a value a record writes by chance), plain
    or as a transposed view (a column-major buffer: the row's elements a stride apart)."""
    if transposed:
        return torch.full((length, capacity), math.nan, dtype=dtype).t()
    return torch.full((capacity, length), math.nan, dtype=dtype)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal to the bit (NaN payloads and -0 included)."""
    bits = {torch.float32: torch.int32, torch.float64: torch.int64}[a.dtype]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))


@pytest.mark.parametrize("seed", range(16))
def test_cpu_kernel_writes_the_composites_bytes_in_every_slot(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    capacity = int(torch.randint(1, 6, (1,), generator=gen))
    row_dtype = [torch.float32, torch.float64][seed % 2]
    transposed = seed % 3 == 1
    with_attribution = seed % 8 >= 4
    # Counters that start at 0, mid-ring, negative (torch.remainder's sign) and next to 2^63 (the add wraps).
    start = [0, capacity - 1, -7, 2**63 - 3][seed % 4]
    mix = [SOURCE_DTYPES[int(i)] for i in torch.randint(0, len(SOURCE_DTYPES), (9,), generator=gen)]
    layout = random_layout(gen, SOURCE_DTYPES + mix)  # every dtype in every call, and a random mix beside them
    extra_layout = random_layout(gen, mix[:4]) if with_attribution else []
    length = sum(math.prod(shape) for _, shape, _ in layout)
    extra_length = sum(math.prod(shape) for _, shape, _ in extra_layout)
    buffers = {
        op: (
            torch.tensor([start]),
            fresh(capacity, length, row_dtype, transposed),
            fresh(capacity, extra_length, torch.float64, not transposed) if with_attribution else None,
        )
        for op in (record, composite)
    }
    for step in range(2 * capacity + 1):  # every slot, then round again (the wraparound overwrites)
        sources, extra = random_sources(gen, layout), random_sources(gen, extra_layout)
        for op, (counter, rows, attribution) in buffers.items():
            op(rows, counter, sources, attribution, extra)
        (c1, r1, a1), (c2, r2, a2) = buffers[record], buffers[composite]
        assert torch.equal(c1, c2), f"step {step}: counters {c1} and {c2}"
        assert same_bytes(r1, r2), f"step {step}: rows differ\n{r1}\n{r2}"
        if a1 is not None and a2 is not None:
            assert same_bytes(a1, a2), f"step {step}: attribution rows differ"
    assert not buffers[record][1].isnan().all(dim=1).any(), "every slot was written"


@pytest.mark.cuda
@needs_cuda
def test_on_cuda_the_composite_writes_the_cpu_kernels_values() -> None:
    gen = torch.Generator().manual_seed(0)
    layout = random_layout(gen, SOURCE_DTYPES * 2)
    length = sum(math.prod(shape) for _, shape, _ in layout)
    rows, counter = fresh(4, length, torch.float32, False), torch.tensor([2])
    rows_cuda, counter_cuda = rows.cuda(), counter.cuda()
    for _ in range(6):  # every slot, and round again
        sources = random_sources(gen, layout)
        record(rows, counter, sources, None, [])
        record(rows_cuda, counter_cuda, [s.cuda() for s in sources], None, [])
    # Values, not bytes: a GPU's float64-to-float32 conversion gives every NaN the same bits.
    torch.testing.assert_close(rows_cuda.cpu(), rows, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(counter_cuda.cpu(), counter)


def test_the_row_written_is_counter_mod_capacity_and_holds_the_values_cast() -> None:
    rows = torch.full((3, 6), math.nan)
    counter = torch.tensor([7])  # 7 % 3 = 1
    sources = [torch.tensor([2**24 + 1, 5]), torch.tensor(-0.5, dtype=torch.float64), torch.tensor([True, False])]
    sources.append(torch.tensor([1e39], dtype=torch.float64))
    record(rows, counter, sources, None, [])
    assert int(counter) == 8
    assert rows[1].tolist() == [2.0**24, 5.0, -0.5, 1.0, 0.0, math.inf]  # 2^24 + 1 rounds to even
    assert rows[[0, 2]].isnan().all(), "only the counter's row is written"


@pytest.mark.parametrize("op", OPS)
def test_versions_advance_as_for_an_in_place_aten_op(op: Callable[..., None]) -> None:
    rows, counter, attribution = (
        torch.zeros(2, 3),
        torch.zeros(1, dtype=torch.int64),
        torch.zeros(2, 1, dtype=torch.float64),
    )
    before = (rows._version, counter._version, attribution._version)
    op(rows, counter, [torch.ones(3)], attribution, [torch.ones(1)])
    after = (rows._version, counter._version, attribution._version)
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_opcheck() -> None:
    gen = torch.Generator().manual_seed(0)
    sources = [
        torch.randn(4, generator=gen),
        torch.tensor([3, 0]),
        torch.tensor(True),
        torch.randn(2, dtype=torch.float64),
    ]
    rows = torch.zeros(5, 9)
    torch.library.opcheck(record, (rows, torch.tensor([6]), sources, None, []))
    attribution = torch.zeros(5, 4, dtype=torch.float64)
    torch.library.opcheck(
        record, (rows, torch.tensor([2]), sources, attribution, [torch.randn(4, dtype=torch.float64)])
    )


def test_a_source_that_requires_grad_is_recorded_and_builds_no_graph() -> None:
    rows, counter = torch.zeros(2, 3), torch.zeros(1, dtype=torch.int64)
    weight = torch.ones(3, requires_grad=True)
    record(rows, counter, [weight * 2], None, [])
    assert rows[0].tolist() == [2.0, 2.0, 2.0] and not rows.requires_grad


def args_of(**changes: Any) -> tuple[Any, ...]:
    """Good arguments (rows [4, 5], a counter, sources of 5 values, attribution [4, 2] and its 2 values),
    with ``changes`` applied."""
    args = {
        "rows": torch.zeros(4, 5),
        "counter": torch.tensor([1]),
        "sources": [torch.ones(3, dtype=torch.int64), torch.ones(2, dtype=torch.float64)],
        "attribution": torch.zeros(4, 2, dtype=torch.float64),
        "attribution_sources": [torch.ones(2)],
    }
    args.update(changes)
    return tuple(args.values())


BAD = [
    ({"sources": [torch.ones(4)]}, r"sources hold 4 values but a row of rows holds 5"),
    ({"sources": [torch.ones(6)]}, r"sources hold 6 values but a row of rows holds 5"),
    ({"sources": []}, r"sources hold 0 values but a row of rows holds 5"),
    ({"attribution_sources": [torch.ones(3)]}, r"attribution_sources hold 3 values but a row of attribution holds 2"),
    ({"attribution": None}, r"attribution_sources given but attribution is None"),
    ({"attribution": torch.zeros(3, 2, dtype=torch.float64)}, r"attribution has 3 rows but rows has 4"),
    ({"rows": torch.zeros(4, 5, dtype=torch.int32)}, r"rows has dtype Int; supported: float32, float64"),
    ({"rows": torch.zeros(20)}, r"rows must be 2-D \[capacity, row length\], got shape \[20\]"),
    ({"rows": torch.zeros(0, 5)}, r"rows has no row to write \(capacity 0\)"),
    ({"rows": torch.zeros(1, 5).expand(4, 5)}, r"unsupported operation: .*single memory location"),
    ({"counter": torch.tensor([1.0])}, r"counter must be a one-element int64 tensor, got Float"),
    ({"counter": torch.tensor([1, 2])}, r"counter must be a one-element int64 tensor, got Long of shape \[2\]"),
    ({"counter": torch.tensor([1], device="meta")}, r"counter is on meta but rows are on cpu"),
    ({"sources": [torch.ones(3, dtype=torch.complex64), torch.ones(2)]}, r"sources\[0\] has dtype ComplexFloat"),
    # torch's copy_ gives a float16 NaN different bits by position (cpu/record_cpu.cpp): refused.
    ({"sources": [torch.ones(3, dtype=torch.float16), torch.ones(2)]}, r"sources\[0\] has dtype Half; supported: bool"),
    ({"sources": [torch.ones(3), torch.ones(2, device="meta")]}, r"sources\[1\] is on meta but rows are on cpu"),
    ({"sources": [torch.ones(3).to_sparse(), torch.ones(2)]}, r"sources\[0\] has layout Sparse"),
    (
        {"attribution_sources": [torch.ones(2, dtype=torch.complex128)]},
        r"attribution_sources\[0\] has dtype ComplexDouble",
    ),
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("changes", "match"), BAD, ids=[m for _, m in BAD])
def test_bad_input_is_refused_and_nothing_is_written(
    op: Callable[..., None], changes: dict[str, Any], match: str
) -> None:
    args = args_of(**changes)
    before = [a.clone() if isinstance(a, torch.Tensor) and a.device.type == "cpu" else a for a in args[:2]]
    with pytest.raises(RuntimeError, match=match):
        op(*args)
    for name, old, new in zip(("rows", "counter"), before, args[:2], strict=True):
        if isinstance(new, torch.Tensor) and new.device.type == "cpu":
            assert torch.equal(old, new), f"{name} was written by a refused call"


@pytest.mark.parametrize("op", OPS)
def test_an_inference_tensor_is_refused_outside_inference_mode(op: Callable[..., None]) -> None:
    with torch.inference_mode():
        rows = torch.zeros(2, 1)
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor outside InferenceMode"):
        op(rows, torch.tensor([0]), [torch.ones(1)], None, [])


def recorded_storage(monkeypatch: pytest.MonkeyPatch, op: Callable[..., None], world: int | None) -> torch.Tensor:
    """A recorder's whole device buffer after 9 checks (a NaN planted at one; past its capacity of 6)
    with ``op`` as its append, and with a rank attribution when ``world`` is given."""
    monkeypatch.setattr(nanscan.recorder, "record_op", op)
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    recorder = nanscan.Recorder(every=6, capacity=6, spike_window=4, spike_min_history=1, warn=False)
    for step in range(9):
        m(torch.randn(3, 4)).square().sum().backward()
        if step == 5:
            m[0].weight.grad[0, 0] = math.nan
        report = nanscan.check(m)
        if world is not None:
            n = len(report.names)
            ranks = Attribution(
                count=torch.rand(n, dtype=torch.float64),
                rank_sum=torch.rand(n, dtype=torch.float64) * 1e9,
                rank_square_sum=torch.rand(n, dtype=torch.float64) * 1e17,
                any_by_rank=torch.rand(world, dtype=torch.float64),
            )
            stats = dataclasses.replace(report.stats, ranks=ranks)
            report = nanscan.Report(report.names, stats, report.total_norm_tensor, report.norm_type)
        recorder.append(report, skipped=torch.tensor(step % 2 == 0), loss_scale=2.0**step)
        m.zero_grad()
    assert recorder._ring is not None
    storage = recorder._ring.storage.clone()
    recorder.close()
    return storage


@pytest.mark.parametrize("world", [None, 3])
def test_a_recorder_buffer_is_the_same_by_the_kernel_and_by_the_composite(
    monkeypatch: pytest.MonkeyPatch, world: int | None
) -> None:
    by_kernel = recorded_storage(monkeypatch, record, world)
    by_composite = recorded_storage(monkeypatch, composite, world)
    assert torch.equal(by_kernel, by_composite)
