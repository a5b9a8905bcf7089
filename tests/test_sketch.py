"""``nanscan::sketch``, the update watch's CountSketch (csrc/common/sketch_rules.h, which defines it): the
kernel and the composite the other devices run against a plain-Python statement of the rule (its hash
in Python ints, checked against the header's own C++; each bucket summed exactly) on every dtype and the
sizes around the block and the bucket count; a large tensor, kernel against composite; NaN and Inf in
exactly the buckets that receive them; views read in logical order; linearity, which the update watch's
difference of two sketches rests on; the estimator's bias and spread over seeds, and the same check
failing for rules without signs or without offsets; bad input refused alike; the fake kernel under
torch.compile and FakeTensorMode; on a GPU, the CUDA kernel against the composite, which makes no sync."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from nanscan import composite
from nanscan._ops import sketch_op

from conftest import DEVICES, FLOAT_DTYPES, FP8_DTYPES, ROOT, build_and_run_cpp, needs_cuda, syncs_refused

ALL_DTYPES = FLOAT_DTYPES + FP8_DTYPES
Sketch = Callable[[list[torch.Tensor], int, int], tuple[torch.Tensor, torch.Tensor]]
# The op as the dispatcher runs it (the CPU kernel; on a GPU the CUDA one) and the composite, called directly.
OPS: dict[str, Sketch] = {"kernel": sketch_op, "composite": composite.sketch}

# ---- The rule in Python ints (csrc/common/sketch_rules.h) --------------------------------------------------

WORD = 0xFFFFFFFF
BLOCK = 64


def mix(x: int) -> int:
    """sketch_mix: MurmurHash3's 32-bit finalizer, modulo 2^32."""
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & WORD
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & WORD
    return x ^ (x >> 16)


def tensor_seed(seed: int, index: int) -> int:
    """sketch_tensor_seed: the seed of the list's tensor ``index``."""
    return mix(seed ^ mix((index + 0x9E3779B9) & WORD))


def block_draw(tseed: int, block: int, k: int) -> tuple[int, int]:
    """sketch_block: a block's offset in [0, k) and its 64 sign bits (bit p set: element p subtracted)."""
    key = mix((block >> 32) ^ mix((block & WORD) ^ tseed))
    signs = (mix(key ^ 0x68E31DA4) << 32) | mix(key ^ 0xB5297A4D)
    return mix(key ^ 0x1B56C4E9) & (k - 1), signs


def bucket_and_sign(k: int, seed: int, index: int, e: int) -> tuple[int, int]:
    """Where element ``e`` of the list's tensor ``index`` (of more than k elements) goes, and its sign."""
    offset, signs = block_draw(tensor_seed(seed, index), e // BLOCK, k)
    p = e % BLOCK
    return (offset + p) & (k - 1), -1 if (signs >> p) & 1 else 1


def float64_values(t: torch.Tensor) -> torch.Tensor:
    """A tensor's values in logical order, in float64 (every dtype widens exactly; float8 through float32)."""
    x = t.detach().cpu().reshape(-1)
    return (x.float() if x.dtype in FP8_DTYPES else x).double()


def exact_sum(terms: Sequence[float]) -> float:
    """The exactly rounded sum of float64 terms, with IEEE's NaN and Inf (math.fsum refuses inf - inf)."""
    special = [x for x in terms if not math.isfinite(x)]
    return sum(special) if special else math.fsum(terms)


def tolerance(terms: int, sumsq: float) -> float:
    """How far two float64 sums of the same ``terms`` values, in any two orders, may lie apart: each
    within gamma_(m-1) * sum|x| <= (m-1) * 2^-53 * sqrt(m * sum x^2) of the exact sum (Cauchy-Schwarz).
    Relative to the bucket's sum of squares, never to its value, which cancellation may bring near 0;
    and 0 for a bucket of one term, which must be that value exactly."""
    return max(terms - 1, 0) * math.sqrt(terms * sumsq) * 2.0**-52 if math.isfinite(sumsq) else math.inf


class Reference(NamedTuple):
    """One tensor's sketch by the rule, with how far a float64 sum of each bucket may lie from it."""

    buckets: list[float]
    tolerances: list[float]
    sumsq: float
    sumsq_tolerance: float


def python_reference(t: torch.Tensor, k: int, seed: int, index: int) -> Reference:
    """The rule element by element in Python: each bucket's terms summed exactly. For small tensors."""
    values = float64_values(t).tolist()
    squares = [v * v for v in values]
    sumsq = exact_sum(squares)
    sumsq_tolerance = tolerance(len(values), sumsq)
    if len(values) <= k:
        return Reference(values, [0.0] * len(values), sumsq, sumsq_tolerance)
    terms: list[list[float]] = [[] for _ in range(k)]
    tseed = tensor_seed(seed, index)
    draw = (0, 0)
    for e, v in enumerate(values):
        block, p = divmod(e, BLOCK)
        if p == 0:
            draw = block_draw(tseed, block, k)
        offset, signs = draw
        terms[(offset + p) & (k - 1)].append(-v if (signs >> p) & 1 else v)
    buckets = [exact_sum(bucket) for bucket in terms]
    tolerances = [tolerance(len(bucket), exact_sum([v * v for v in bucket])) for bucket in terms]
    return Reference(buckets, tolerances, sumsq, sumsq_tolerance)


def placement(n: int, k: int, tseed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every element's bucket (int64) and sign (float64) for a tensor of n > k elements: the blocks'
    draws in Python ints, spread to their elements with torch. For large tensors."""
    blocks = [block_draw(tseed, b, k) for b in range((n + BLOCK - 1) // BLOCK)]
    offsets = torch.tensor([offset for offset, _ in blocks], dtype=torch.int64)
    # The 64 sign bits as two 32-bit words (an int64 holds either), bit p of the signs at column p.
    words = torch.tensor([[signs & WORD, signs >> 32] for _, signs in blocks], dtype=torch.int64)
    bits = ((words[:, :, None] >> torch.arange(32)) & 1).reshape(-1, BLOCK)
    buckets = (offsets[:, None] + torch.arange(BLOCK)) & (k - 1)
    return buckets.reshape(-1)[:n], (1 - 2 * bits).reshape(-1)[:n].double()


def block_reference(t: torch.Tensor, k: int, seed: int, index: int, tseed: int | None = None) -> Reference:
    """The rule with the buckets summed by torch in float64 (within their tolerance of the exact sums,
    which the tolerances allow for by doubling). For tensors too large for python_reference."""
    x = float64_values(t)
    n = x.numel()
    sumsq = float((x * x).sum())
    if n <= k:
        return Reference(x.tolist(), [0.0] * n, sumsq, 2 * tolerance(n, sumsq))
    bucket, sign = placement(n, k, tensor_seed(seed, index) if tseed is None else tseed)
    sums = torch.zeros(k, dtype=torch.float64).index_add_(0, bucket, sign * x)
    counts = torch.bincount(bucket, minlength=k).tolist()
    squares = torch.zeros(k, dtype=torch.float64).index_add_(0, bucket, x * x).tolist()
    tolerances = [2 * tolerance(m, s) for m, s in zip(counts, squares, strict=True)]
    return Reference(sums.tolist(), tolerances, sumsq, 2 * tolerance(n, sumsq))


# ---- Comparisons ------------------------------------------------------------------------------------------


def mismatches(got: Sequence[float], want: Sequence[float], tolerances: Sequence[float]) -> list[str]:
    """The buckets where ``got`` is not ``want``: NaN exactly where it is NaN, an Inf exactly where it
    is that Inf, else within the bucket's tolerance."""
    bad = []
    for j, (g, w, tol) in enumerate(zip(got, want, tolerances, strict=True)):
        if math.isnan(w):
            ok = math.isnan(g)
        elif math.isinf(w):
            ok = g == w
        else:
            ok = abs(g - w) <= tol
        if not ok:
            bad.append(f"bucket {j}: got {g!r}, want {w!r} (tolerance {tol:.3g})")
    return bad


def describe(t: torch.Tensor) -> str:
    return f"{t.numel()} elements of {t.dtype}, shape {list(t.shape)}"


def assert_sketch(
    outputs: tuple[torch.Tensor, torch.Tensor],
    references: Sequence[Reference],
    tensors: Sequence[torch.Tensor],
    what: str,
) -> None:
    """A sketch op's outputs for ``tensors`` against their references, bucket by bucket, every tensor's
    mismatches reported."""
    sketches, sumsq = outputs
    assert sketches.dtype == sumsq.dtype == torch.float64, (sketches.dtype, sumsq.dtype)
    assert sketches.device == sumsq.device == tensors[0].device
    lengths = [len(r.buckets) for r in references]
    assert sketches.shape == (sum(lengths),) and sumsq.shape == (len(tensors),), (sketches.shape, sumsq.shape)
    got_sumsq = sumsq.tolist()
    failures = []
    for i, (part, ref, t) in enumerate(zip(sketches.cpu().split(lengths), references, tensors, strict=True)):
        bad = mismatches(part.tolist(), ref.buckets, ref.tolerances)
        bad += [f"sumsq: {s}" for s in mismatches([got_sumsq[i]], [ref.sumsq], [ref.sumsq_tolerance])]
        if bad:
            failures.append(f"tensors[{i}] ({describe(t)}): {len(bad)} wrong: " + "; ".join(bad[:6]))
    assert not failures, f"{what}:\n" + "\n".join(failures)


def test_the_python_hash_is_the_headers(tmp_path: Path) -> None:
    """The Python statement of the hash against sketch_rules.h itself, compiled: the tensor seeds, and
    blocks' draws, a block index past 2^32 among them (its high word is hashed too)."""
    source = tmp_path / "draws.cpp"
    cases = [(0, 0, 0, 64), (1, 3, 1, 1024), (WORD, 7, 12345, 4096), (0x9E3779B9, 2, (5 << 32) + 9, 256)]
    # One line per case: mix(seed), the tensor seed, the block's offset and its signs.
    lines = [f"  print({seed}u, {index}u, {block}ull, {k});" for seed, index, block, k in cases]
    source.write_text(
        '#include <cstdio>\n#include "common/sketch_rules.h"\n'
        "static void print(uint32_t seed, uint32_t index, uint64_t block, int64_t k) {\n"
        "  const uint32_t ts = nanscan::sketch_tensor_seed(seed, index);\n"
        "  const nanscan::SketchBlock b = nanscan::sketch_block(ts, block, k);\n"
        '  std::printf("%u %u %u %llu\\n", nanscan::sketch_mix(seed), ts, b.offset, (unsigned long long)b.signs);\n'
        "}\nint main() {\n" + "\n".join(lines) + "\n}\n"
    )
    flags = ["-std=c++17", "-O1", "-Wall", "-Werror", f"-I{ROOT / 'csrc'}"]
    out = build_and_run_cpp(tmp_path, [source], flags, 60, "a program that only prints")
    want = []
    for seed, index, block, k in cases:
        ts = tensor_seed(seed, index)
        offset, signs = block_draw(ts, block, k)
        want.append(f"{mix(seed)} {ts} {offset} {signs}")
    assert out.split("\n")[: len(cases)] == want
    assert mix(0) == 0 and mix(1) == 0x514E28B7  # murmur3's fmix32, as published


# ---- Against the reference -----------------------------------------------------------------------------


def small_list(dtype: torch.dtype, k: int, device: str) -> list[torch.Tensor]:
    """Every size around the block (64) and the bucket count: an empty tensor gives no bucket."""
    sizes = [0, 1, 63, 64, 65, k, k + 1, 2 * k + 63, 4099]
    shapes: list[tuple[int, ...]] = [(n,) for n in sizes]
    shapes[6] = (1, k + 1)  # a 2-D one
    # Values within every dtype's range (float8_e4m3fn's largest is 448).
    return [(torch.randn(shape, dtype=torch.float64) * 8).clamp(-400, 400).to(dtype).to(device) for shape in shapes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("k", [64, 1024])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
def test_every_dtype_and_size_matches_the_python_rule(dtype: torch.dtype, k: int, op: str, device: str) -> None:
    torch.manual_seed(k)
    tensors = small_list(dtype, k, device)
    for seed in (0, 1, 0x9E3779B9, WORD):
        references = [python_reference(t, k, seed, i) for i, t in enumerate(tensors)]
        assert_sketch(OPS[op](tensors, k, seed), references, tensors, f"{op}, seed {seed}")
    # The same tensors at other places in the list hash differently: each is sketched by its position.
    moved = tensors[::-1]
    references = [python_reference(t, k, 7, i) for i, t in enumerate(moved)]
    assert_sketch(OPS[op](moved, k, 7), references, moved, f"{op}, reversed list")


@pytest.mark.parametrize("device", DEVICES)
def test_a_large_tensor_kernel_and_composite_agree(device: str) -> None:
    """300,000-odd elements, every bucket thousands of terms deep: the kernel and the composite
    against the rule, and each other, to float64's summation order."""
    torch.manual_seed(1)
    tensors = [
        torch.randn(300_000, device=device),
        torch.randn(300_001, dtype=torch.float64, device=device) * 1e-3,
        torch.randn(547, 549, device=device).to(torch.bfloat16),
    ]
    for k in (64, 4096):
        references = [block_reference(t, k, 99, i) for i, t in enumerate(tensors)]
        kernel = sketch_op(tensors, k, 99)
        ours = composite.sketch(tensors, k, 99)
        assert_sketch(kernel, references, tensors, f"kernel, {k} buckets")
        assert_sketch(ours, references, tensors, f"composite, {k} buckets")
        # Each other: the composite's sums as the reference, within both tolerances.
        as_reference = [
            Reference(part.tolist(), ref.tolerances, s, ref.sumsq_tolerance)
            for part, ref, s in zip(
                ours[0].cpu().split([len(r.buckets) for r in references]), references, ours[1].tolist(), strict=True
            )
        ]
        assert_sketch(kernel, as_reference, tensors, f"kernel against composite, {k} buckets")


def test_the_composite_in_chunks_gives_the_same_sketch(monkeypatch: pytest.MonkeyPatch) -> None:
    """The composite reads a large tensor a chunk at a time; chunks of three blocks here, with a partial
    last block, give the rule's answer too."""
    monkeypatch.setattr(composite, "_SKETCH_CHUNK", 3 * BLOCK)
    torch.manual_seed(2)
    tensors = [torch.randn(5000), torch.randn(64 * 40, dtype=torch.float64)]
    references = [python_reference(t, 64, 5, i) for i, t in enumerate(tensors)]
    assert_sketch(composite.sketch(tensors, 64, 5), references, tensors, "composite in chunks")


def test_without_float64_the_composite_sums_in_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    """MPS has no float64: there the composite's buckets and sums of squares are float32, within
    float32's rounding of the rule's."""
    monkeypatch.setattr(composite, "wide_dtype", lambda device: torch.float32)
    torch.manual_seed(3)
    tensors = [torch.randn(5000), torch.randn(40).to(torch.bfloat16), torch.randn(3000).to(torch.float8_e5m2)]
    sketches, sumsq = composite.sketch(tensors, 64, 11)
    assert sketches.dtype == sumsq.dtype == torch.float32
    references = [python_reference(t, 64, 11, i) for i, t in enumerate(tensors)]
    got = sketches.double().split([len(r.buckets) for r in references])
    for i, (part, ref) in enumerate(zip(got, references, strict=True)):
        # float64's tolerances, scaled to float32's unit roundoff (and one rounding of each value).
        tolerances = [2**29 * tol + 2**-24 * abs(w) for tol, w in zip(ref.tolerances, ref.buckets, strict=True)]
        assert not mismatches(part.tolist(), ref.buckets, tolerances), f"tensors[{i}]"
        assert abs(float(sumsq[i]) - ref.sumsq) <= 2**-20 * ref.sumsq


# ---- NaN and Inf -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_nan_and_inf_reach_exactly_their_buckets(op: str, device: str) -> None:
    """A NaN makes its bucket NaN, an Inf its bucket that Inf (by its sign), +Inf and -Inf meeting in a
    bucket NaN, and two of one sign that Inf; the sum of squares NaN or inf; every other bucket is what it
    would be without them. The reference says which buckets those are."""
    k, seed = 64, 21
    torch.manual_seed(4)
    tensors = [torch.randn(5000), torch.randn(5000), torch.randn(5000), torch.randn(10)]
    planted: list[list[tuple[int, float]]] = [[(17, math.nan), (2000, math.inf), (4999, -math.inf)], [], [], []]
    # Two Infs in one bucket from different blocks: the first's signed term +Inf, the second's -Inf in
    # tensors[1] and +Inf in tensors[2] (a value times its sign: the value is the signed term times the sign).
    for index, second_term in ((1, -math.inf), (2, math.inf)):
        first, first_sign = bucket_and_sign(k, seed, index, 5)
        second = next(e for e in range(BLOCK, 5000) if bucket_and_sign(k, seed, index, e)[0] == first)
        planted[index] = [
            (5, first_sign * math.inf),
            (second, bucket_and_sign(k, seed, index, second)[1] * second_term),
        ]
    planted[3] = [(3, math.nan), (5, -math.inf)]  # buckets that are the values themselves
    clean = [t.clone() for t in tensors]
    for t, c, plants in zip(tensors, clean, planted, strict=True):
        for e, value in plants:
            t[e] = value
            c[e] = 0.0
    tensors = [t.to(device) for t in tensors]
    references = [python_reference(t, k, seed, i) for i, t in enumerate(tensors)]
    assert_sketch(OPS[op](tensors, k, seed), references, tensors, op)
    # The reference planted what the test meant: NaN buckets, Inf buckets, and the sums of squares.
    assert sum(map(math.isnan, references[1].buckets)) == 1 and math.isinf(references[1].sumsq)
    assert sum(map(math.isinf, references[2].buckets)) == 1 and math.isinf(references[2].sumsq)
    assert math.isnan(references[0].sumsq) and math.isnan(references[3].sumsq)
    # The buckets no NaN/Inf reaches are those of the tensor with zeros in their places.
    sketches = OPS[op](tensors, k, seed)[0].cpu().split([len(r.buckets) for r in references])
    clean_sketches = (
        OPS[op]([c.to(device) for c in clean], k, seed)[0].cpu().split([len(r.buckets) for r in references])
    )
    for i, (got, without, ref) in enumerate(zip(sketches, clean_sketches, references, strict=True)):
        reached = [j for j, w in enumerate(ref.buckets) if not math.isfinite(w)]
        assert len(reached) == len({bucket_of(k, seed, i, e, tensors[i]) for e, _ in planted[i]})
        finite = [j for j in range(len(ref.buckets)) if j not in reached]
        assert torch.isfinite(got[finite]).all(), f"tensors[{i}]"
        assert not mismatches(got[finite].tolist(), without[finite].tolist(), [2 * ref.tolerances[j] for j in finite])


def bucket_of(k: int, seed: int, index: int, e: int, t: torch.Tensor) -> int:
    """Element e's bucket: itself when the tensor has no more elements than k."""
    return e if t.numel() <= k else bucket_and_sign(k, seed, index, e)[0]


# ---- Layouts and linearity ---------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_views_are_sketched_in_logical_order(op: str, device: str) -> None:
    """A transposed view, a sliced one, channels_last, a broadcast and a permuted 3-D tensor give the
    sketch of their logical (row-major) order: that of .contiguous(), and the rule's."""
    torch.manual_seed(5)
    base = torch.randn(300, 257, device=device)
    views = [
        base.t(),
        base[:, ::3],
        base[7:200:2, 5:],
        torch.randn(4, 6, 33, 17, device=device).to(memory_format=torch.channels_last),
        torch.randn(1, 700, device=device, dtype=torch.float64).expand(5, 700),
        torch.randn(20, 30, 40, device=device).to(torch.bfloat16).permute(2, 0, 1),
        torch.randn(64, 64, device=device).t(),  # with 4096 buckets its values themselves, in logical order
        torch.tensor(3.0, device=device),  # zero-dimensional: one bucket
    ]
    assert not any(v.is_contiguous() for v in views[:7])
    for k in (64, 4096):
        references = [block_reference(v, k, 3, i) for i, v in enumerate(views)]
        assert_sketch(OPS[op](views, k, 3), references, views, f"{op}, views")
        dense = [v.contiguous() for v in views]
        assert_sketch(OPS[op](dense, k, 3), references, dense, f"{op}, contiguous copies")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("op", OPS)
def test_the_sketch_is_linear(op: str, device: str) -> None:
    """sketch(a) - sketch(b) is sketch(a - b), the difference taken in float64, to float64's rounding:
    the update watch's sketch of an update. Even an update of 1e-6 of the weights (a few float32 ulps)
    keeps its squared length to 1e-6, which float32 buckets would round away."""
    torch.manual_seed(6)
    k, seed = 256, 12
    for relative in (1e-2, 1e-6):
        a = [torch.randn(100_000, device=device), torch.randn(200, device=device), torch.randn(5, 9, device=device)]
        b = [(x.double() * (1 + relative * torch.randn_like(x, dtype=torch.float64))).float() for x in a]
        d = [x.double() - y.double() for x, y in zip(a, b, strict=True)]  # exact: float32 values, float64 difference
        sa, sb, sd = (OPS[op](tensors, k, seed)[0] for tensors in (a, b, d))
        ra, rb = ([block_reference(x, k, seed, i) for i, x in enumerate(ts)] for ts in (a, b))
        tolerances = [
            ta + tb for x, y in zip(ra, rb, strict=True) for ta, tb in zip(x.tolerances, y.tolerances, strict=True)
        ]
        sd_values = sd.tolist()
        # sketch(d)'s own rounding is at most d's share of a's and b's: within the same allowance.
        assert not mismatches((sa - sb).tolist(), sd_values, [2 * t for t in tolerances]), f"update {relative}"
        # The n <= k tensors' buckets are their values: their differences exact.
        assert torch.equal((sa - sb)[k:], sd[k:])
        estimate, exact = float(((sa - sb) ** 2).sum()), float((sd**2).sum())
        assert abs(estimate - exact) <= 1e-6 * exact, (relative, estimate, exact)


# ---- The estimator ------------------------------------------------------------------------------------------


def vectors() -> dict[str, torch.Tensor]:
    """Updates as training makes them: dense, a few whole rows, one column, one element, an embedding
    whose few looked-up rows moved, and a constant one (layer-norm weights), where signs matter most."""
    torch.manual_seed(7)
    rows = torch.zeros(512, 256)
    rows[[3, 100, 101, 400]] = torch.randn(4, 256)
    column = torch.zeros(256, 128)
    column[:, 7] = torch.randn(256)
    single = torch.zeros(10_000)
    single[4321] = 3.0
    embedding = torch.zeros(5000, 64)
    embedding[torch.randint(0, 5000, (40,))] = torch.randn(40, 64)
    return {
        "dense": torch.randn(20_000),
        "rows": rows,
        "column": column,
        "single": single,
        "embedding": embedding,
        "constant": torch.full((3000,), 0.5),
    }


SEEDS = range(200)


def check_estimator(estimates: Sequence[float], true: float, k: int, what: str) -> None:
    """The squared lengths of one vector's sketches over SEEDS: their spread at most 1.3 times the
    bound's standard deviation, sqrt(2/k) of the true squared norm (the sampling error of a standard
    deviation over 200 draws is about 5%), and their mean within 4 standard errors of the true squared
    norm (that bound over sqrt(len(SEEDS))). The spread first: a mean is only as good as its spread."""
    t = torch.tensor(estimates, dtype=torch.float64)
    bound = math.sqrt(2 / k) * true
    mean, spread = float(t.mean()), float(t.std())
    assert spread <= 1.3 * bound, f"{what}: spread {spread:.6g}, bound sqrt(2/k) * true = {bound:.6g}"
    assert abs(mean - true) <= 4 * bound / math.sqrt(len(estimates)) + 1e-12 * true, (
        f"{what}: mean {mean:.6g} of {len(estimates)} estimates, true {true:.6g}: biased"
    )


@pytest.mark.parametrize("k", [64, 1024])
def test_the_squared_length_estimates_the_squared_norm(k: int) -> None:
    for name, v in vectors().items():
        true = float((v.double() ** 2).sum())
        estimates = []
        for seed in SEEDS:
            sketches, sumsq = sketch_op([v], k, seed)
            assert sketches.shape == (k,)
            estimates.append(float((sketches**2).sum()))
        assert abs(float(sumsq[0]) - true) <= 1e-12 * true
        check_estimator(estimates, true, k, f"{name}, {k} buckets")


def python_estimates(v: torch.Tensor, k: int, signs: bool = True, offsets: bool = True) -> list[float]:
    """The squared lengths of v's sketches over SEEDS, by the rule in Python, or by a broken rule: no
    signs (every element added), or no offsets (element p of every block in bucket p)."""
    x = float64_values(v)
    estimates = []
    for seed in SEEDS:
        bucket, sign = placement(x.numel(), k, tensor_seed(seed, 0))
        if not offsets:
            bucket = torch.arange(x.numel()) % BLOCK
        buckets = torch.zeros(k, dtype=torch.float64).index_add_(0, bucket, sign * x if signs else x)
        estimates.append(float((buckets**2).sum()))
    return estimates


def test_the_estimator_check_fails_a_rule_without_signs_or_offsets() -> None:
    """The check above passes the rule (here in Python) and would fail it without its signs (a constant
    vector's elements then add up in every bucket: biased far up) or without its offsets (a column's
    elements, one per block at the same position, then all meet in one bucket: a spread of ~sqrt(2))."""
    k = 64
    every = vectors()
    for name in ("dense", "column", "constant"):
        true = float((every[name].double() ** 2).sum())
        check_estimator(python_estimates(every[name], k), true, k, name)
    constant, column = every["constant"], every["column"]
    with pytest.raises(AssertionError, match="biased"):
        check_estimator(python_estimates(constant, k, signs=False), float((constant**2).sum()), k, "no signs")
    with pytest.raises(AssertionError, match="spread"):
        check_estimator(
            python_estimates(column, k, offsets=False), float((column.double() ** 2).sum()), k, "no offsets"
        )


# ---- Bad input ----------------------------------------------------------------------------------------------

DTYPES_NAMED = "; supported: float32, float64, float16, bfloat16, float8_e4m3fn, float8_e5m2"
BAD: list[tuple[Callable[[], tuple[list[torch.Tensor], int, int]], str]] = [
    (lambda: ([], 64, 0), r"^nanscan\.sketch: expected at least one tensor$"),
    (lambda: ([torch.ones(3), torch.ones(3, dtype=torch.int32)], 64, 0), r"nanscan\.sketch: tensors\[1\] has dtype "),
    (lambda: ([torch.ones(3, dtype=torch.float8_e4m3fnuz)], 64, 0), r"nanscan\.sketch: tensors\[0\] has dtype "),
    (lambda: ([torch.ones(3, dtype=torch.complex64)], 64, 0), r"nanscan\.sketch: tensors\[0\] has dtype .*"),
    *[
        (
            lambda k=k: ([torch.ones(3)], k, 0),
            rf"^nanscan\.sketch: buckets must be a power of two in \[64, 4096\], got {k}$",
        )
        for k in (0, 32, 96, 100, 8192, -64, 2**40)
    ],
    *[
        (lambda s=s: ([torch.ones(3)], 64, s), rf"^nanscan\.sketch: seed must be in \[0, 2\^32\), got {s}$")
        for s in (-1, 2**32, 2**40, -(2**63))
    ],
]


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize(("arguments", "message"), BAD)
def test_bad_input_is_refused_alike_by_the_kernel_and_the_composite(
    arguments: Callable[[], tuple[list[torch.Tensor], int, int]], message: str, op: str
) -> None:
    tensors, buckets, seed = arguments()
    with pytest.raises(RuntimeError, match=message) as error:
        OPS[op](tensors, buckets, seed)
    if "dtype" in message:
        assert str(error.value).endswith(DTYPES_NAMED), str(error.value)


def test_sparse_and_mixed_devices_are_refused_by_name() -> None:
    """The dispatcher sends a sparse argument to the composite (no sparse kernel) and a meta one to the
    fake kernel: each refuses it with the kernel's words; the CPU kernel itself, reached directly,
    refuses both before reading anything."""
    cpu = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    sparse = [torch.ones(3), torch.ones(3).to_sparse()]
    meta = [torch.ones(3), torch.ones(3, device="meta")]
    layout = r"nanscan\.sketch: tensors\[1\] has layout .*; only dense \(strided\) tensors"
    device = r"nanscan\.sketch: tensors\[1\] is on meta but tensors\[0\] is on cpu"
    for call in (sketch_op, composite.sketch, lambda *a: sketch_op.redispatch(cpu, *a)):
        with pytest.raises(RuntimeError, match=layout):
            call(sparse, 64, 0)
        with pytest.raises(RuntimeError, match=device):
            call(meta, 64, 0)


@needs_cuda
@pytest.mark.cuda
def test_cuda_and_cpu_tensors_are_refused_together() -> None:
    for tensors in ([torch.ones(3, device="cuda"), torch.ones(3)], [torch.ones(3), torch.ones(3, device="cuda")]):
        with pytest.raises(RuntimeError, match=r"nanscan\.sketch: tensors\[1\] is on .* but tensors\[0\] is on"):
            sketch_op(tensors, 64, 0)


def test_outputs_are_not_differentiable() -> None:
    x = torch.randn(500, requires_grad=True)
    for out in sketch_op([x, x * 2], 64, 0):
        assert out.grad_fn is None and not out.requires_grad


# ---- The fake kernel ----------------------------------------------------------------------------------------


def test_fake_kernel_gives_the_shapes() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        tensors = [
            torch.empty(0),
            torch.empty(5, dtype=torch.bfloat16),
            torch.empty(8, 8, dtype=torch.float64),
            torch.empty(65),
            torch.empty(100, 100, dtype=torch.float8_e5m2),
        ]
        sketches, sumsq = sketch_op(tensors, 64, 3)
        assert sketches.shape == (0 + 5 + 64 + 64 + 64,) and sumsq.shape == (5,)
        assert sketches.dtype == sumsq.dtype == torch.float64
        with pytest.raises(RuntimeError, match=r"buckets must be a power of two in \[64, 4096\], got 65"):
            sketch_op(tensors, 65, 3)
        with pytest.raises(RuntimeError, match=r"seed must be in \[0, 2\^32\), got -1"):
            sketch_op(tensors, 64, -1)


def test_compiled_calls_give_eager_answers() -> None:
    """torch.compile with fullgraph=True traces the op through its fake kernel; the compiled function's
    outputs are eager's, with static shapes and with dynamic ones (numel symbolic: min(numel, k))."""

    def update_sketch(weights: torch.Tensor, before: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        sketches, sumsq = sketch_op([weights, weights.t(), before], 64, 5)
        return sketches * 2, sumsq.sqrt()

    torch.manual_seed(8)
    weights, before = torch.randn(30, 40), torch.randn(50)
    eager = update_sketch(weights, before)
    compiled = torch.compile(update_sketch, fullgraph=True, backend="aot_eager")
    for got, want in zip(compiled(weights, before), eager, strict=True):
        assert torch.equal(got, want)
    torch._dynamo.reset()
    dynamic = torch.compile(update_sketch, fullgraph=True, backend="eager", dynamic=True)
    for w, b in ((weights, before), (torch.randn(3, 5), torch.randn(70)), (torch.randn(20, 9), torch.randn(2))):
        for got, want in zip(dynamic(w, b), update_sketch(w, b), strict=True):
            assert got.shape == want.shape and torch.equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device: str) -> None:
    """torch's own checks of a custom op (schema, fake kernel, autograd registration, dispatch)."""
    torch.manual_seed(9)
    tensors = [torch.randn(1000, device=device), torch.randn(17, device=device, dtype=torch.float64)]
    torch.library.opcheck(sketch_op, (tensors, 64, 3))
    torch.library.opcheck(sketch_op, ([torch.randn(3, 70, device=device).to(torch.bfloat16)], 128, WORD))


# ---- CUDA ------------------------------------------------------------------------------------------------


@needs_cuda
@pytest.mark.cuda
def test_cuda_kernel_matches_the_composite_which_makes_no_sync() -> None:
    """On a GPU the CUDA kernel and the composite give the rule's sketch (the composite as MPS or XPU
    would run it, with no host sync)."""
    torch.manual_seed(10)
    tensors = [
        torch.randn(300_000, device="cuda"),
        torch.randn(4099, dtype=torch.float64, device="cuda"),
        torch.randn(200, 300, device="cuda").to(torch.float16).t(),
        torch.randn(70_000, device="cuda").to(torch.float8_e4m3fn),
        torch.randn(10, device="cuda"),
        torch.empty(0, device="cuda"),
    ]
    for k in (64, 1024, 4096):
        references = [block_reference(t, k, 77, i) for i, t in enumerate(tensors)]
        composite.sketch(tensors, k, 77)  # warm the caching allocator before refusing syncs
        with syncs_refused():
            ours = composite.sketch(tensors, k, 77)
        assert_sketch(ours, references, tensors, f"composite on CUDA, {k} buckets")
        assert_sketch(sketch_op(tensors, k, 77), references, tensors, f"CUDA kernel, {k} buckets")
