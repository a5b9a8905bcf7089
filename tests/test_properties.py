"""Property-based tests (hypothesis): nanscan against independent references, on inputs it draws itself.

What the suite checks:

* ``nanscan.scan`` on random lists (0-8 tensors) of float32/float64/float16/bfloat16/float8_e4m3fn/
  float8_e5m2 tensors of random shapes (empty and 0-dim included), layouts (contiguous, misaligned
  storage offsets, transposed, stepped slices, padded rows, stride-0 expands) and sizes (small ones,
  and ones straddling the CPU kernel's 32-lane groups, 4096-element fast runs and 256 KiB chunks),
  with values at ordinary, wide, subnormal, vanishing (1e-12 to 1e-20) and huge magnitudes or a third
  of them NaN/Inf (an overflow step; FILLS), and NaN/Inf, subnormals, signed zeros and extreme finite
  values planted as raw bit patterns (every NaN encoding a format has: quiet and signalling, random
  payloads, either sign) at the first/last element and at those boundaries. Against a plain-torch float64 reference it must give
  exact NaN/Inf counts, exact finite min/max, the exact finite flag, norms within 1e-6 relative, and
  the fp16-range counts; it must not write its inputs, and must be bit-identical run to run and for
  1 and 2 threads.
* ``nanscan.clip_grad_norm_`` against ``torch.nn.utils.clip_grad_norm_`` on copies of the same
  parameters (grads of mixed dtypes, some None, some non-contiguous; NaN/Inf/huge values planted
  sometimes; many norm types, max_norm values and error_if_nonfinite): the same exceptions, the
  total norm against a float64 reference (torch's own value where nanscan delegates to torch), the
  result dtype, the clipped gradients against torch's clipping arithmetic, gradients untouched
  (bits and version counter) when nothing is clipped or when it raises, and no write outside a
  strided gradient's elements.

Profiles (registered in tests/conftest.py): "ci" is the default: derandomized, so every run checks
the same inputs (100 scan lists, 33 large lists for the thread test, 200 clip cases; 10-25 s on 2
shared cores). For a thorough search with fresh random inputs (20x as many; about 2 minutes) run

    python -m pytest -q tests/test_properties.py --hypothesis-profile=long

and add --hypothesis-show-statistics to see how the cases spread over layouts and code paths.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

import nanscan
from nanscan import composite

T = TypeVar("T")

SCAN_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2]
CLIP_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

# The CPU kernel's structure (csrc/cpu/runs.h): sizes and positions around these are where an
# off-by-one in the lane tail, the run loop or the chunk split would show.
LANES = 32
RUN = 128 * LANES
CHUNK_BYTES = 256 * 1024

# Elements one example may allocate in all (storage, not view), so the CI profile stays fast.
SCAN_BUDGET = 700_000
THREADS_BUDGET = 1_700_000
CLIP_BUDGET = 200_000
# Below this many bytes in a list the CPU kernel runs on the calling thread (kMinParallelBytes).
MIN_PARALLEL_BYTES = 512 * 1024

# (exponent bits, mantissa bits) of the IEEE-like formats; e4m3fn is special-cased (no Inf, one NaN).
FORMAT_BITS = {
    torch.float64: (11, 52),
    torch.float32: (8, 23),
    torch.float16: (5, 10),
    torch.bfloat16: (8, 7),
    torch.float8_e5m2: (5, 2),
    torch.float8_e4m3fn: (4, 3),
}
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

# A "huge" finite value per dtype: for fp32/bf16 one whose fp32 square overflows (the case where
# torch's fp32 norm says inf and nanscan's is finite), for fp64 one whose square is still finite.
HUGE = {
    torch.float64: (1e150, 3e153),
    torch.float32: (1.9e19, 1e20, 3e37),
    torch.bfloat16: (1.9e19, 1e20, 3e37),
    torch.float16: (4e4, 6e4),
    torch.float8_e5m2: (3e4, 5e4),
    torch.float8_e4m3fn: (300.0, 448.0),
}

# Values at the thresholds of scan(..., fp16_range=True): fp16's largest finite value and the next
# fp32 above it, fp16's smallest subnormal 2^-24, and values just below it.
FP16_EDGES = (65504.0, 65504.00390625, 2.0**-24, 2.0**-24 * (1 - 2.0**-24), 2.0**-25)

# How a tensor's values are drawn (fill_values): "vanishing" is what a deep network's gradients look
# like (1e-12 to 1e-20: fp32 squares round in the subnormal range or underflow, the CPU and CUDA
# kernels' scaled re-read), "nonfinite" an overflow step (a third of the elements NaN or Inf, the
# finite ones at every magnitude down to 1e-20: the unscaled checked re-read, then the scaled one).
FILLS = ["normal", "wide", "tiny", "vanishing", "huge", "zeros", "nonfinite"]

PLANT_KINDS = ["qnan", "snan", "inf", "subnormal", "zero", "max", "huge", "min_normal", "fp16_edge"]


def chunk_elements(dtype: torch.dtype) -> int:
    return CHUNK_BYTES // dtype.itemsize


# ----------------------------------------------------------------------------------------------
# Specifications: what hypothesis draws. Small, printable records, so a shrunk failure reads as the
# input that caused it; the tensors are built from them deterministically (values from a seed).


@dataclass(frozen=True)
class Plant:
    """A raw bit pattern written at one element: ``anchor`` + ``delta`` in the order the kernel reads
    (memory order for dense layouts, logical order otherwise), taken modulo the element count."""

    anchor: str  # "first" | "last" | "lane" | "run" | "chunk" | "chunk2" | "index"
    delta: int
    kind: str  # one of PLANT_KINDS
    negative: bool
    payload: int


@dataclass(frozen=True)
class TensorSpec:
    dtype: torch.dtype
    shape: tuple[int, ...]
    layout: str  # one of LAYOUTS
    offset: int  # storage offset of the first element: a misaligned start when not 0
    step: int  # the stride of "strided", the row padding of "padded"
    fill: str  # one of FILLS
    plants: tuple[Plant, ...]
    seed: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


# contiguous: base[k:k+n].view(shape); strided: every step-th element; transposed: all dims reversed
# (dense, read in memory order); padded: rows padded by `step` elements (not dense); expanded:
# stride 0 over the first dim; windows: 2-D rows that overlap (stride (cols // 2, 1)). The last two
# are legal read-only inputs, never a gradient anyone can scale.
WRITABLE_LAYOUTS = ["contiguous", "strided", "transposed", "padded"]
LAYOUTS = [*WRITABLE_LAYOUTS, "expanded", "windows"]


def window_stride(shape: tuple[int, ...]) -> int:
    return max(1, shape[1] // 2)


def storage_elements(spec: TensorSpec) -> int:
    """Elements of the base buffer the view of ``spec`` lives in."""
    n, shape, off = spec.numel, spec.shape, spec.offset
    if spec.layout == "strided":
        return off + max(0, (n - 1) * spec.step + 1)
    if spec.layout == "padded":
        return off + math.prod(shape[:-1]) * (shape[-1] + spec.step)
    if spec.layout == "expanded":
        return off + math.prod(shape[1:])
    if spec.layout == "windows":
        return off + ((shape[0] - 1) * window_stride(shape) + shape[1] if n else 0)
    return off + n


def small_divisors(n: int) -> list[int]:
    return [d for d in (1, 2, 3, 4, 5, 7, 8, 16, 32, 64, 128) if n % d == 0]


@st.composite
def sizes(draw: st.DrawFn, dtype: torch.dtype, budget: int, big: bool) -> int:
    """Element counts: small ones, or ones straddling a lane group, a fast run or a chunk (as the
    budget allows; a padded or strided layout may need up to 3x the elements in storage). ``big``:
    more than two chunks (over 512 KiB), so the kernel's parallel split takes part."""
    chunk = chunk_elements(dtype)
    if big:
        return draw(st.sampled_from([2 * chunk + 1, 3 * chunk - 1, 3 * chunk, 3 * chunk + 1]))
    near_lanes = [b + d for b in (LANES, 2 * LANES, RUN, 2 * RUN) for d in (-1, 0, 1)]
    near_chunks = [b + d for b in (chunk, 2 * chunk) for d in (-1, 0, 1)]
    fits = [s for s in near_lanes + near_chunks if 3 * s + 8 <= budget]
    small = st.integers(0, max(0, min(300, (budget - 8) // 3)))
    return draw(st.one_of(small, st.sampled_from(fits)) if fits else small)


@st.composite
def shapes(draw: st.DrawFn, n: int) -> tuple[int, ...]:
    """A shape of ``n`` elements: empty ones with a zero anywhere, 0-dim, 1- to 4-D (size-1 dims too)."""
    if n == 0:
        k = draw(st.integers(1, 5))
        return draw(st.sampled_from([(0,), (0, k), (k, 0), (2, 0, k)]))
    kinds = ["flat", "matrix", "cube", "unit"] + (["scalar"] if n == 1 else [])
    kind = draw(st.sampled_from(kinds))
    if kind == "scalar":
        return ()
    if kind == "flat":
        return (n,)
    rows = draw(st.sampled_from(small_divisors(n)))
    if kind == "matrix":
        return (rows, n // rows)
    if kind == "unit":
        return (1, rows, 1, n // rows)
    mid = draw(st.sampled_from(small_divisors(n // rows)))
    return (rows, mid, n // rows // mid)


@st.composite
def plants(draw: st.DrawFn, kinds: list[str]) -> Plant:
    anchor = draw(st.sampled_from(["first", "last", "lane", "run", "chunk", "chunk2", "index"]))
    if anchor == "index":
        delta = draw(st.integers(0, 10**6))
    elif anchor in ("first", "last"):
        delta = 0
    else:
        delta = draw(st.sampled_from([-1, 0, 1]))
    return Plant(anchor, delta, draw(st.sampled_from(kinds)), draw(st.booleans()), draw(st.integers(0, 2**62)))


@st.composite
def tensor_specs(
    draw: st.DrawFn,
    dtypes: list[torch.dtype],
    budget: int,
    *,
    big: bool = False,
    layouts: list[str] = LAYOUTS,
    plant_kinds: list[str] = PLANT_KINDS,
    max_plants: int = 4,
) -> TensorSpec:
    dtype = draw(st.sampled_from(dtypes))
    n = draw(sizes(dtype, budget, big))
    shape = draw(shapes(n))
    fitting = [
        layout
        for layout in layouts
        if layout in ("contiguous", "strided")
        or (layout in ("transposed", "padded") and len(shape) >= 2)
        or (layout == "expanded" and len(shape) >= 1)
        or (layout == "windows" and len(shape) == 2)
    ]
    layout = draw(st.sampled_from(fitting))
    step = draw(st.integers(2, 3)) if layout in ("strided", "padded") else 1
    offset = draw(st.integers(0, 3))  # base[k:]: the first element not aligned to a vector
    fill = draw(st.sampled_from(FILLS))
    count = draw(st.integers(0, max_plants)) if n else 0
    planted = tuple(draw(plants(plant_kinds)) for _ in range(count))
    return TensorSpec(dtype, shape, layout, offset, step, fill, planted, draw(st.integers(0, 2**31 - 1)))


@st.composite
def scan_lists(draw: st.DrawFn, max_tensors: int = 8, *, big: bool = False) -> list[TensorSpec]:
    """Lists of tensor specs; with ``big``, the first tensor is over 512 KiB."""
    count = draw(st.integers(1 if big else 0, max_tensors))
    specs: list[TensorSpec] = []
    left = THREADS_BUDGET if big else SCAN_BUDGET
    for _ in range(count):
        spec = draw(tensor_specs(SCAN_DTYPES, left, big=big and not specs))
        specs.append(spec)
        left = max(16, left - storage_elements(spec))
    return specs


# ----------------------------------------------------------------------------------------------
# Building tensors from specs.


def bit_pattern(dtype: torch.dtype, plant: Plant) -> int:
    """The raw bits of ``plant.kind`` in ``dtype`` (unsigned)."""
    exp_bits, man_bits = FORMAT_BITS[dtype]
    width = 1 + exp_bits + man_bits
    exp_mask = ((1 << exp_bits) - 1) << man_bits
    man_mask = (1 << man_bits) - 1
    quiet = 1 << (man_bits - 1)
    kind, payload = plant.kind, plant.payload
    if dtype == torch.float8_e4m3fn:
        # Only S.1111.111 is NaN and there is no Inf: the codes other formats read as Inf or NaN
        # (exponent all ones) are finite here, 256..448, and must be counted as finite values.
        bits = {"qnan": 0x7F, "snan": 0x78 | payload % 7, "inf": 0x78, "max": 0x7E}.get(kind)
    else:
        bits = {
            "qnan": exp_mask | quiet | (payload & (quiet - 1)),
            "snan": exp_mask | max(1, payload & (quiet - 1)),  # quiet bit clear, payload non-zero
            "inf": exp_mask,
            "max": exp_mask - 1,
        }.get(kind)
    if bits is None:
        if kind == "subnormal":
            bits = max(1, payload & man_mask)
        elif kind == "zero":
            bits = 0
        elif kind == "min_normal":
            bits = 1 << man_bits
        else:  # "huge" or "fp16_edge": a value, rounded to dtype (no wider than its largest finite)
            options = HUGE[dtype] if kind == "huge" else FP16_EDGES
            value = min(options[payload % len(options)], torch.finfo(dtype).max)
            rounded = torch.tensor(value, dtype=torch.float64).to(dtype)
            bits = int(rounded.view(INT_VIEW[dtype.itemsize]).item()) & ((1 << width) - 1)
    return bits | (1 << (width - 1) if plant.negative else 0)


def write_bits(base: torch.Tensor, index: int, bits: int) -> None:
    """Stores raw ``bits`` at element ``index`` of the contiguous 1-D ``base``, through an integer view."""
    width = 8 * base.element_size()
    ints = base.view(INT_VIEW[base.element_size()])
    if ints.dtype != torch.uint8 and bits >= 1 << (width - 1):
        bits -= 1 << width  # the signed integer with the same bits
    ints[index] = bits


def is_dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers one contiguous memory span exactly once (in some order of its dims):
    then the kernel reads it in memory order, otherwise in logical order."""
    expected = 1
    for stride, size in sorted((st_, sz) for sz, st_ in zip(t.shape, t.stride(), strict=True) if sz != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def storage_index(view: torch.Tensor, position: int) -> int:
    """The base-buffer index of the ``position``-th element the kernel reads."""
    if is_dense(view):
        return view.storage_offset() + position
    index, rest = view.storage_offset(), position
    for size, stride in reversed(list(zip(view.shape, view.stride(), strict=True))):
        index += (rest % size) * stride
        rest //= size
    return index


def plant_position(plant: Plant, n: int, dtype: torch.dtype) -> int:
    chunk = chunk_elements(dtype)
    anchor = {"first": 0, "last": n - 1, "lane": LANES, "run": RUN, "chunk": chunk, "chunk2": 2 * chunk, "index": 0}
    return (anchor[plant.anchor] + plant.delta) % n


def fill_values(spec: TensorSpec, count: int) -> torch.Tensor:
    """``count`` random values of ``spec.dtype`` (as float64), from the spec's seed: finite unless the
    fill is "nonfinite"."""
    gen = torch.Generator().manual_seed(spec.seed)
    x = torch.randn(count, dtype=torch.float64, generator=gen)
    finfo = torch.finfo(spec.dtype)
    if spec.fill == "wide":  # magnitudes over many binades: stresses accumulation order
        span = math.log10(finfo.max) * 0.9
        x = x * torch.pow(10.0, (torch.rand(count, dtype=torch.float64, generator=gen) * 2 - 1) * span)
    elif spec.fill == "tiny":  # subnormals and the smallest normals: fp32 squares underflow
        x = x * finfo.tiny * 4
    elif spec.fill in ("vanishing", "nonfinite"):
        lowest = 12 if spec.fill == "vanishing" else 0
        x = x * torch.pow(10.0, -lowest - (20 - lowest) * torch.rand(count, dtype=torch.float64, generator=gen))
    elif spec.fill == "huge":
        x = x * HUGE[spec.dtype][0]
    elif spec.fill == "zeros":
        x = torch.zeros_like(x)
    x = x.clamp(-finfo.max, finfo.max)
    if spec.fill == "nonfinite":
        kind = torch.randint(0, 6, (count,), generator=gen)
        x = torch.where(kind == 0, math.nan, torch.where(kind == 1, math.inf, torch.where(kind == 2, -math.inf, x)))
    return x


def materialize(spec: TensorSpec) -> tuple[torch.Tensor, torch.Tensor]:
    """(base buffer, the view of it that ``spec`` describes), with the plants written as raw bits."""
    base = fill_values(spec, storage_elements(spec)).to(spec.dtype)
    n, off, shape = spec.numel, spec.offset, spec.shape
    if spec.layout == "contiguous":
        view = base[off : off + n].view(shape)
    elif spec.layout == "transposed":
        view = base[off : off + n].view(shape[::-1]).permute(*reversed(range(len(shape))))
    elif spec.layout == "strided":
        view = base[off : off + max(0, (n - 1) * spec.step + 1) : spec.step].view(shape)
    elif spec.layout == "padded":
        padded = base[off:].view(*shape[:-1], shape[-1] + spec.step)
        view = padded[..., : shape[-1]]
    elif spec.layout == "expanded":
        view = base[off:].view(1, *shape[1:]).expand(shape)
    else:  # windows
        view = base.as_strided(shape, (window_stride(shape), 1), off)
    assert tuple(view.shape) == shape
    for plant in spec.plants:
        write_bits(base, storage_index(view, plant_position(plant, n, spec.dtype)), bit_pattern(spec.dtype, plant))
    return base, view


# ----------------------------------------------------------------------------------------------
# The independent reference: plain torch in float64, element values only (no nanscan, no kernel
# structure).


@dataclass(frozen=True)
class Reference:
    nan_count: int
    inf_count: int
    min: float
    max: float
    sumsq: float  # of the finite elements
    absmax: float  # of the finite elements (0 when none)
    fp16_overflow: int
    fp16_underflow: int

    @property
    def norm(self) -> float:
        return math.nan if self.nan_count else math.inf if self.inf_count else math.sqrt(self.sumsq)


def reference(t: torch.Tensor) -> Reference:
    x = (t.float() if t.dtype in FP8 else t).double().reshape(-1)
    finite = x[torch.isfinite(x)]
    a = finite.abs()
    return Reference(
        nan_count=int(torch.isnan(x).sum()),
        inf_count=int(torch.isinf(x).sum()),
        min=float(finite.min()) if finite.numel() else math.inf,
        max=float(finite.max()) if finite.numel() else -math.inf,
        sumsq=float((finite * finite).sum()),
        absmax=float(a.max()) if a.numel() else 0.0,
        fp16_overflow=int((a > 65504.0).sum()),
        fp16_underflow=int(((a < 2.0**-24) & (a > 0)).sum()),
    )


def total_l2(refs: Iterable[Reference]) -> float:
    refs = list(refs)
    if any(r.nan_count for r in refs):
        return math.nan
    if any(r.inf_count for r in refs):
        return math.inf
    return math.sqrt(math.fsum(r.sumsq for r in refs))


def norm_close(got: float, want: float, rtol: float, atol: float = 0.0) -> bool:
    """NaN iff NaN, the same infinity, or within rtol (plus atol for subnormal results)."""
    if math.isnan(want) or math.isnan(got):
        return math.isnan(want) and math.isnan(got)
    if math.isinf(want) or math.isinf(got):
        return got == want
    return abs(got - want) <= rtol * abs(want) + atol


# ----------------------------------------------------------------------------------------------
# Small helpers.


def raw_bits(t: torch.Tensor) -> torch.Tensor:
    """An integer copy of the bits of ``t`` (NaN payloads and signed zeros included)."""
    return t.detach().contiguous().view(INT_VIEW[t.element_size()]).clone()


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_bits(a), raw_bits(b))


def result_fields(result: nanscan.ScanResult) -> dict[str, torch.Tensor]:
    names = ["nan_count", "inf_count", "min", "max", "norm", "total_norm", "finite", "fp16_overflow", "fp16_underflow"]
    return {k: getattr(result, k) for k in names if getattr(result, k) is not None}


def assert_bit_identical(a: nanscan.ScanResult, b: nanscan.ScanResult, what: str) -> None:
    fa, fb = result_fields(a), result_fields(b)
    assert fa.keys() == fb.keys(), what
    for k in fa:
        assert bits_equal(fa[k], fb[k]), f"{what}: {k} differs: {fa[k].tolist()} vs {fb[k].tolist()}"


def outcome(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """(result, None) or (None, the exception): lets a test compare how two implementations fail."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the empty-generator warning is tested in test_clip.py
            return fn(), None
    except Exception as e:
        return None, e


# ----------------------------------------------------------------------------------------------
# nanscan.scan


def check_scan_against_reference(tensors: list[torch.Tensor], result: nanscan.ScanResult) -> None:
    refs = [reference(t) for t in tensors]
    assert len(result) == len(tensors)
    got = {k: v.tolist() for k, v in result_fields(result).items()}
    for i, (t, ref) in enumerate(zip(tensors, refs, strict=True)):
        what = f"tensor {i} ({t.dtype}, shape {tuple(t.shape)}, stride {t.stride()})"
        assert got["nan_count"][i] == ref.nan_count, f"{what}: nan_count {got['nan_count'][i]} != {ref.nan_count}"
        assert got["inf_count"][i] == ref.inf_count, f"{what}: inf_count {got['inf_count'][i]} != {ref.inf_count}"
        # Min/max are exact: they are element values, representable in float64.
        assert got["min"][i] == ref.min, f"{what}: min {got['min'][i]!r} != {ref.min!r}"
        assert got["max"][i] == ref.max, f"{what}: max {got['max'][i]!r} != {ref.max!r}"
        assert norm_close(got["norm"][i], ref.norm, 1e-6), f"{what}: norm {got['norm'][i]!r} != {ref.norm!r}"
        if "fp16_overflow" in got:
            assert got["fp16_overflow"][i] == ref.fp16_overflow, f"{what}: fp16_overflow"
            assert got["fp16_underflow"][i] == ref.fp16_underflow, f"{what}: fp16_underflow"
    want_total = total_l2(refs)
    assert norm_close(got["total_norm"], want_total, 1e-6), f"total_norm {got['total_norm']!r} != {want_total!r}"
    assert got["finite"] == all(r.nan_count == 0 and r.inf_count == 0 for r in refs), "finite flag"


@given(specs=scan_lists(), fp16_range=st.booleans())
# Always-run cases: a NaN/Inf exactly at the fp8 and fp16 chunk boundaries, fp16's smallest
# subnormal (2^-24: not an fp16 underflow), a multi-chunk fp32 tensor read through a stepped view
# with a signalling NaN at its last element.
@example(
    specs=[
        TensorSpec(
            torch.float8_e5m2,
            (262145,),
            "contiguous",
            1,
            1,
            "wide",
            (Plant("chunk", 0, "snan", True, 0), Plant("chunk", -1, "inf", False, 0)),
            7,
        ),
        TensorSpec(
            torch.float8_e4m3fn,
            (262144,),
            "contiguous",
            0,
            1,
            "normal",
            (Plant("chunk", -1, "qnan", True, 0), Plant("first", 0, "inf", False, 0)),
            8,
        ),
    ],
    fp16_range=False,
)
@example(
    specs=[
        TensorSpec(
            torch.float16,
            (131073,),
            "contiguous",
            3,
            1,
            "normal",
            (
                Plant("chunk", 0, "qnan", False, 5),
                Plant("last", 0, "max", True, 0),
                Plant("first", 0, "subnormal", False, 1),
            ),
            1,
        ),
        TensorSpec(torch.float32, (65537,), "strided", 1, 3, "huge", (Plant("last", 0, "snan", True, 12345),), 2),
        TensorSpec(torch.bfloat16, (1,), "contiguous", 1, 1, "normal", (Plant("first", 0, "subnormal", True, 3),), 3),
        TensorSpec(torch.float64, (0, 3), "expanded", 2, 1, "zeros", (), 4),
    ],
    fp16_range=True,
)
def test_scan_matches_fp64_reference(specs: list[TensorSpec], fp16_range: bool) -> None:
    built = [materialize(s) for s in specs]
    tensors = [view for _, view in built]
    before = [raw_bits(base) for base, _ in built]
    # Shown by --hypothesis-show-statistics: whether chunk boundaries and layouts get exercised.
    spans_chunks = any(t.numel() > chunk_elements(t.dtype) for t in tensors)
    event("a tensor spans chunks" if spans_chunks else "no multi-chunk tensor")
    for spec in specs:
        event(f"layout={spec.layout}")
    result = nanscan.scan(tensors, fp16_range=fp16_range)
    check_scan_against_reference(tensors, result)
    for (base, _), bits in zip(built, before, strict=True):
        assert torch.equal(raw_bits(base), bits), "scan wrote to its input"
    assert_bit_identical(result, nanscan.scan(tensors, fp16_range=fp16_range), "a second scan of the same list")
    if fp16_range:  # the extra counts come from the same pass and change none of the other statistics
        plain = result_fields(nanscan.scan(tensors))
        for k, v in plain.items():
            assert bits_equal(v, result_fields(result)[k]), f"fp16_range=True changed {k}"


@given(specs=scan_lists(), options=st.sampled_from(["plain", "fp16_range", "checksum"]))
def test_the_composite_matches_the_fp64_reference_and_the_kernel(specs: list[TensorSpec], options: str) -> None:
    """nanscan.composite (what MPS, XPU and every device without a kernel runs) on the same drawn
    lists: the fp64 reference's statistics, and the CPU kernel's counts, extrema (by value),
    checksums and total-norm dtype exactly."""
    tensors = [view for _, view in (materialize(s) for s in specs)]
    if not tensors:  # the op refuses an empty list (nanscan.scan answers it without the op)
        return
    fp16_range, checksum = options == "fp16_range", options == "checksum"
    ours = composite.scan(tensors, fp16_range, checksum)
    kernel = torch.ops.nanscan.scan.default(tensors, fp16_range, checksum)
    check_scan_against_reference(tensors, nanscan.ScanResult.from_op(*ours))
    assert torch.equal(ours[0], kernel[0]), f"counts {ours[0].tolist()} != {kernel[0].tolist()}"
    # By value: the sign of a zero extremum (-0 or +0, both present) follows neither's definition.
    assert torch.equal(ours[1][:2], kernel[1][:2]), f"min/max {ours[1][:2].tolist()} != {kernel[1][:2].tolist()}"
    assert bool(ours[3]) == bool(kernel[3]) and ours[4].dtype == kernel[4].dtype


# A third of the profile's examples: each one is large (the first tensor is over 512 KiB).
@settings(max_examples=max(1, settings.default.max_examples // 3))
@given(specs=scan_lists(max_tensors=3, big=True))
def test_scan_is_deterministic_across_threads(specs: list[TensorSpec]) -> None:
    # The list holds more than the kernel's parallel threshold, so with 2 threads the chunks are
    # split between threads, with 1 they are not; the results must not tell the difference.
    tensors = [materialize(s)[1] for s in specs]
    assert sum(t.numel() * t.element_size() for t in tensors) > MIN_PARALLEL_BYTES
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        two = nanscan.scan(tensors)
        torch.set_num_threads(1)
        one = nanscan.scan(tensors)
    finally:
        torch.set_num_threads(threads)
    assert_bit_identical(two, one, "1 thread vs 2 threads")
    check_scan_against_reference(tensors, two)


# ----------------------------------------------------------------------------------------------
# nanscan.clip_grad_norm_


@dataclass(frozen=True)
class ClipCase:
    grads: tuple[TensorSpec | None, ...]  # None: a parameter without a gradient
    max_norm: float
    norm_type: float | str
    error_if_nonfinite: bool
    foreach: bool | None
    container: str  # how the parameters are passed: "list" | "tuple" | "generator" | "tensor"


# An int and a string too: torch takes any float() of them.
NORM_TYPES: list[float | str] = [2.0, 2, math.inf, "inf", -math.inf, 1.0, 0.5, 3.0, 0.0]
# 0 zeroes every gradient; 5e-324 and 1e-30 underflow the coefficient; 1e30/1e300/inf never clip.
MAX_NORMS = [0.0, 5e-324, 1e-30, 1e-6, 0.5, 1, 3.0, 100.0, 1e30, 1e300, math.inf]


@st.composite
def clip_cases(draw: st.DrawFn) -> ClipCase:
    count = draw(st.integers(0, 6))
    grads: list[TensorSpec | None] = []
    left = CLIP_BUDGET
    nonfinite = draw(st.booleans())  # half the cases are all-finite, so clipping itself gets tested
    kinds = PLANT_KINDS if nonfinite else ["subnormal", "zero", "max", "huge", "min_normal"]
    # Rarely, an expanded gradient (stride 0): no one can scale it, and nanscan must refuse before
    # writing anything (torch raises too, after scaling the gradients before that one). Not
    # "windows": ATen's overlap check cannot tell partial overlaps, so torch and nanscan both
    # multiply shared elements twice there; no gradient is laid out like that.
    layouts = [*WRITABLE_LAYOUTS, "expanded"] if draw(st.integers(0, 9)) == 0 else WRITABLE_LAYOUTS
    for _ in range(count):
        if draw(st.integers(0, 4)) == 0:
            grads.append(None)
            continue
        spec = draw(tensor_specs(CLIP_DTYPES, left, layouts=layouts, plant_kinds=kinds, max_plants=2))
        grads.append(spec)
        left = max(16, left - storage_elements(spec))
    container = draw(st.sampled_from(["list", "tuple", "generator"] + (["tensor"] if count == 1 else [])))
    return ClipCase(
        tuple(grads),
        draw(st.sampled_from(MAX_NORMS)),
        draw(st.sampled_from(NORM_TYPES)),
        draw(st.booleans()),
        draw(st.sampled_from([None, False, True])),
        container,
    )


def make_parameters(case: ClipCase) -> tuple[list[torch.nn.Parameter], list[torch.Tensor | None]]:
    """Parameters whose gradients are the spec's views, and each gradient's base buffer."""
    params: list[torch.nn.Parameter] = []
    bases: list[torch.Tensor | None] = []
    for spec in case.grads:
        if spec is None:
            params.append(torch.nn.Parameter(torch.zeros(2)))
            bases.append(None)
            continue
        base, view = materialize(spec)
        p = torch.nn.Parameter(torch.zeros(view.shape, dtype=view.dtype))
        p.grad = view
        params.append(p)
        bases.append(base)
    return params, bases


def passed_as(params: list[torch.nn.Parameter], container: str) -> Any:
    if container == "tensor":
        return params[0]
    if container == "tuple":
        return tuple(params)
    if container == "generator":
        return (p for p in params)
    return list(params)


def reference_norm(grads: list[torch.Tensor], norm_type: float) -> float:
    """The total L2 or infinity norm in float64, torch semantics (NaN if any NaN, else inf if any Inf)."""
    refs = [reference(g) for g in grads]
    if norm_type == 2.0:
        return total_l2(refs)
    if any(r.nan_count for r in refs):
        return math.nan
    return math.inf if any(r.inf_count for r in refs) else max((r.absmax for r in refs), default=0.0)


def storage_indices(view: torch.Tensor, storage_size: int) -> torch.Tensor:
    """The storage element each element of ``view`` reads, flattened."""
    return torch.arange(storage_size).as_strided(view.shape, view.stride(), view.storage_offset()).reshape(-1)


def overlaps_itself(view: torch.Tensor, base: torch.Tensor) -> bool:
    """Whether elements of ``view`` share memory (for the layouts drawn here: an expanded view)."""
    return view.numel() > 1 and storage_indices(view, base.numel()).unique().numel() < view.numel()


# Twice the profile's examples: a clip case is cheap (small gradients), and its space is wide.
@settings(max_examples=2 * settings.default.max_examples)
@given(case=clip_cases())
@example(  # fp32 gradients whose squares overflow fp32: torch's norm is inf, nanscan's the finite truth
    case=ClipCase(
        (
            TensorSpec(torch.float32, (40,), "contiguous", 0, 1, "huge", (), 3),
            None,
            TensorSpec(torch.bfloat16, (2, 3), "transposed", 1, 1, "normal", (), 4),
        ),
        1.0,
        2.0,
        True,
        None,
        "list",
    )
)
@example(  # an expanded gradient after a plain one: nanscan refuses before scaling either
    case=ClipCase(
        (
            TensorSpec(torch.float32, (5,), "contiguous", 0, 1, "normal", (), 1),
            TensorSpec(torch.float16, (3, 4), "expanded", 1, 1, "normal", (), 2),
        ),
        1e-3,
        2.0,
        False,
        None,
        "list",
    )
)
def test_clip_grad_norm_matches_torch(case: ClipCase) -> None:
    # Three identical, independent sets (same values, same layouts: the specs are deterministic).
    ours, bases = make_parameters(case)
    theirs, original = make_parameters(case)[0], make_parameters(case)[0]
    grads = [p.grad for p in ours if p.grad is not None]
    original_grads = [p.grad for p in original if p.grad is not None]
    before = [(raw_bits(g), g._version) for g in grads]
    # The storage around strided gradients (their gaps and the misaligned start) must stay as it was.
    outside = []
    for base, p in zip(bases, ours, strict=True):
        if base is not None:
            mask = torch.ones(base.numel(), dtype=torch.bool)
            mask[storage_indices(p.grad, base.numel())] = False
            outside.append((base, mask, raw_bits(base)))
    norm_type = float(case.norm_type)
    args = (case.max_norm, case.norm_type, case.error_if_nonfinite, case.foreach)

    # torch's norm alone (no error, no clipping), then torch's and nanscan's clip_grad_norm_, each on
    # its own copy of the gradients.
    plain, plain_error = outcome(
        lambda: torch.nn.utils.get_total_norm(original_grads, case.norm_type, False, case.foreach)
    )
    want, want_error = outcome(lambda: torch.nn.utils.clip_grad_norm_(passed_as(theirs, case.container), *args))
    got, got_error = outcome(lambda: nanscan.clip_grad_norm_(passed_as(ours, case.container), *args))

    # The norm nanscan must return: the fp64 reference rounded once to the result dtype for the
    # norms the fused scan computes (L2; inf when no gradient is empty), torch's own value otherwise.
    scanned = (
        plain is not None
        and bool(grads)
        and (norm_type == 2.0 or (norm_type == math.inf and all(g.numel() for g in grads)))
    )
    truth = reference_norm(original_grads, norm_type) if scanned else None
    if plain is None:
        expected_norm = None
    elif truth is None:
        expected_norm = plain.item()
    else:
        expected_norm = float(torch.tensor(truth, dtype=torch.float64).to(plain.dtype))
    # The documented difference (docs/semantics.md, "Drop-ins"): torch's L2 norm overflows (fp32 squares of
    # |g| > 1.8e19, or a low-precision per-tensor norm rounded to inf) where the true norm, in the
    # result dtype, is finite; nanscan then returns the true norm and does not raise.
    torch_overflows = scanned and norm_type == 2.0 and math.isfinite(expected_norm) and plain.item() == math.inf

    if plain_error is not None:  # errors whatever the values (an inf norm of an empty gradient)
        expected_error: type | None = type(plain_error)
    elif case.error_if_nonfinite and not math.isfinite(expected_norm):
        expected_error = RuntimeError
    elif any(overlaps_itself(p.grad, b) for p, b in zip(ours, bases, strict=True) if b is not None):
        expected_error = RuntimeError  # an expanded gradient cannot be scaled, even by 1
    else:
        expected_error = None
    assert type(got_error) is (expected_error or type(None)), (
        f"expected {expected_error}; nanscan: {got!r} / {got_error!r}"
    )
    if not torch_overflows:
        assert type(want_error) is type(got_error), f"torch: {want_error!r}, nanscan: {got_error!r}"
    # Shown by --hypothesis-show-statistics: how the drawn cases spread over the paths below.
    event(
        f"norm_type={case.norm_type!r}: "
        + ("raised" if got_error else "torch overflows" if torch_overflows else "returned")
    )

    if got_error is not None:  # raised: nothing written, not even a no-op write
        for g, (bits, version) in zip(grads, before, strict=True):
            assert torch.equal(raw_bits(g), bits) and g._version == version, "nanscan raised after writing gradients"
        return

    assert got is not None and plain is not None
    assert got.dtype == plain.dtype and got.shape == plain.shape, (
        f"{got.dtype}{tuple(got.shape)} vs torch's {plain.dtype}"
    )
    if truth is None:  # delegated to torch: bit for bit
        assert bits_equal(got, plain), f"norm {got!r} != torch's {plain!r}"
    elif norm_type == math.inf:  # a max of |elements|: exact
        assert norm_close(got.item(), expected_norm, 0.0), f"inf norm {got.item()!r} != {expected_norm!r}"
    else:
        # Within 1e-6 before the one rounding to the result dtype (torch's fp32 norm is not: it can
        # be ~6e-6 off, and its bf16/fp16 norms are rounded per tensor first).
        finfo = torch.finfo(got.dtype)
        ok = norm_close(got.item(), expected_norm, 0.0) or norm_close(
            got.item(), truth, 1e-6 + finfo.eps, finfo.tiny * finfo.eps
        )
        assert ok, f"L2 norm {got.item()!r} != {truth!r} ({got.dtype})"

    # The clipping: torch's own arithmetic (clip_grads_with_norm_) applied with nanscan's norm.
    expected = make_parameters(case)[0]
    torch.nn.utils.clip_grads_with_norm_(expected, case.max_norm, got, case.foreach)
    for p, e in zip(ours, expected, strict=True):
        assert (p.grad is None) == (e.grad is None)
        if p.grad is not None:
            torch.testing.assert_close(
                p.grad, e.grad, rtol=0, atol=0, equal_nan=True, msg=lambda m: f"clipped gradient: {m}"
            )
    coef = torch.clamp(case.max_norm / (got + 1e-6), max=1.0).item()
    event("no clip" if coef == 1.0 else "clipped")
    if coef == 1.0:  # nothing to clip: bit-identical (NaN payloads too) and not written at all
        for g, (bits, version) in zip(grads, before, strict=True):
            assert torch.equal(raw_bits(g), bits), "a no-clip call changed a gradient's bits"
            assert g._version == version, "a no-clip call wrote a gradient"
    for base, mask, bits in outside:
        assert torch.equal(raw_bits(base)[mask], bits[mask]), "clipping wrote outside a strided gradient"

    # Against torch's clipped gradients: exactly when the norms agree bit for bit, else within the
    # norms' difference plus, on each side, the roundings of the coefficient (in the result dtype,
    # then to the gradient's) and of the product.
    if want is None or torch_overflows:
        return
    torch_grads = [p.grad for p in theirs if p.grad is not None]
    if bits_equal(got, want):
        for a, b in zip(grads, torch_grads, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
    elif math.isfinite(got.item()) and math.isfinite(want.item()):
        spread = abs(got.item() - want.item()) / max(abs(got.item()), torch.finfo(got.dtype).tiny)
        for a, b in zip(grads, torch_grads, strict=True):
            f = torch.finfo(a.dtype)
            rtol = spread + 2 * (torch.finfo(got.dtype).eps + f.eps)
            torch.testing.assert_close(a, b, rtol=rtol, atol=2 * f.tiny * f.eps, equal_nan=True)
