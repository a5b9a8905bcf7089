"""The ops in ATen ops: what every device without a kernel of its own runs (MPS, XPU, an out-of-tree
accelerator), with the kernels' semantics (csrc/common/scan_rules.h) and their outputs.

nanscan's fused kernels are CPU and CUDA code. On any other device the dispatcher sends ``scan``,
``scan_into_``, ``scale_``, ``unscale_scan_``, ``scan_difference`` and ``sketch`` here (nanscan._ops registers these
functions for the CompositeExplicitAutograd key; ``record_`` has its own composite in C++). A few ATen
kernels per tensor instead of one pass over the list: slower than a fused kernel (docs/devices.md gives
the measured factor), never a different answer:

* NaN and Inf are counted by classifying each element (``isnan``, and ``x - x``, which is NaN for a
  NaN and both Infs and 0 for every finite x), never inferred from a sum: a tensor of ``1e20`` is
  finite and its norm ``1e21``.
* min and max are of the finite values (``+inf``/``-inf`` when there are none): every NaN/Inf is
  replaced by the tensor's first finite element, then one ``aminmax``; where a NaN sits changes
  nothing.
* The norm is the kernels' (and torch's: NaN if any NaN, else inf if any Inf). Each tensor's finite
  values are divided by a power of two near their largest magnitude, their squares summed in float32
  over runs of 4096 and the runs combined in float64, as the kernels do, then the root multiplied
  back: so tiny gradients (1e-20: squares below float32's range) and huge ones (1e20: squares past
  it) keep their norm. float64 values have their squares summed in float64, so a tensor whose squares
  overflow float64 gets inf, as from the kernels and torch. On a device without float64 (MPS) the
  runs are combined in float32: relative error at most about (runs + 4096) * 2^-24 (torch's own
  reductions sum in a tree, far better in practice), and the statistics and totals are float32.
* The fp16-range counts, the replica checksum and the total norm's dtype follow the same rules as the
  kernels (``count_half_range``, ``replica_term``, ``norm_dtype_of``).
* The sketch follows csrc/common/sketch_rules.h: each block of 64 elements hashed (in int64
  arithmetic, as the replica checksum) to an offset and 64 signs, its signed values added to their
  buckets by ``index_add_`` in float64, so that it equals the kernels' up to the order of each
  bucket's float64 sum. On a device without float64 (MPS) the buckets and sums of squares are float32.

No host sync: every value stays on the device, and the shapes decide every branch (an empty tensor
is known from its shape). So a captured graph holds these ops like any others.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import TypeVar

import torch

from .dtypes import FLOAT8_DTYPES, norm_dtype

_FLOAT8 = FLOAT8_DTYPES
_HALF_MAX = 65504.0
_HALF_SMALLEST_SUBNORMAL = 2.0**-24
# The replica checksum's constants (csrc/common/scan_rules.h).
_SALT_LOW = 0x9E3779B9
_SALT_HIGH = 0x85EBCA77
_MIX_1 = 0x85EBCA6B
_MIX_2 = 0xC2B2AE35
_WORD = 0xFFFFFFFF

ScanOutputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


@functools.lru_cache(maxsize=16)
def wide_dtype(device: torch.device) -> torch.dtype:
    """What the squares are summed in: float64, or float32 on a device that has no float64 (MPS)."""
    return torch.float32 if device.type == "mps" else torch.float64


def _values(t: torch.Tensor) -> torch.Tensor:
    """A tensor's elements, flat, as float32 or float64 values (16-bit and float8 ones widen exactly)."""
    flat = t.reshape(-1)
    return flat if flat.dtype in (torch.float32, torch.float64) else flat.float()


def scan(tensors: Sequence[torch.Tensor], fp16_range: bool = False, checksum: bool = False) -> ScanOutputs:
    """``nanscan::scan`` in ATen ops (module notes): counts int64 [2 (or 4, or 3), N], stats float64
    [3, N] (min, max, norm), total_norm, finite, total_norm_cast, on the tensors' device."""
    _check_list(tensors, "nanscan.scan")
    torch._check(
        not (fp16_range and checksum), lambda: "nanscan.scan: fp16_range and checksum are separate scans; ask for one"
    )
    device = tensors[0].device
    wide = wide_dtype(device)
    rows: list[list[torch.Tensor]] = []  # per tensor: nan, inf, [overflow, underflow | checksum]
    stats: list[torch.Tensor] = []  # per tensor: [min, max, norm of the finite values], in wide
    with torch.no_grad():
        for t in tensors:
            tensor_counts, tensor_figures = _tensor(t, wide, fp16_range, checksum)
            rows.append(tensor_counts)
            stats.append(tensor_figures)
        counts = torch.stack([torch.stack(column) for column in zip(*rows, strict=True)])
        figures = torch.stack(stats, dim=1)  # [3, N]: min, max, and the norm of the finite values
        nan, inf = counts[0] > 0, counts[1] > 0
        finite_norm = figures[2]
        norm = torch.where(nan, math.nan, torch.where(inf, math.inf, finite_norm))
        total_norm = torch.where(nan.any(), math.nan, torch.where(inf.any(), math.inf, _combined(finite_norm, wide)))
        finite = ~(nan.any() | inf.any())
        cast = total_norm.to(norm_dtype(t.dtype for t in tensors))
    return counts, torch.stack([figures[0], figures[1], norm]), total_norm, finite, cast


def _combined(norms: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """The norm of the tensors together from theirs. In float64 from the squares, as the kernels
    combine them (a total whose square overflows float64 is inf there too); in float32 (no float64)
    over the largest norm, so that no square leaves float32's range before the root."""
    if wide == torch.float64:
        return (norms * norms).sum().sqrt()
    largest = norms.amax()
    scale = torch.where(largest > 0, largest, 1.0)
    return ((norms / scale) ** 2).sum().sqrt() * scale


_RUN = 4096
"""Squares summed in float32 per run of this many, then the runs combined in float64: the kernels' runs."""


def _norm(values: torch.Tensor, largest: torch.Tensor, wide: torch.dtype) -> torch.Tensor:
    """The L2 norm of finite ``values`` (float32 or float64) whose largest magnitude is ``largest``
    (of the same dtype): the values over a power of two near it (an exact division where exp2 is
    exact, as it is for integers on every backend we know of; within one rounding otherwise), their
    squares summed (in float32 runs combined in ``wide`` for float32 values; in float64 for float64
    ones), the root, the power of two multiplied back. Tiny and huge values keep their norm; a float64
    tensor whose squares overflow float64 gets inf, as from the kernels and torch."""
    # largest = m * 2^e with m in [0.5, 1): the values over 2^(e-1) lie within [-2, 2], and 2^(e-1)
    # is finite for every finite largest (where 2^e would not be for float32's largest values).
    _, exponent = torch.frexp(largest)
    scale = torch.exp2((exponent - 1).to(values.dtype))
    scaled = values / scale
    squares = scaled * scaled
    if values.dtype == torch.float64:
        return torch.where(largest.isinf(), math.inf, (squares.sum() * scale * scale).sqrt())
    whole = squares.numel() - squares.numel() % _RUN
    runs = torch.cat([squares[:whole].view(-1, _RUN).sum(dim=1), squares[whole:].sum().reshape(1)])
    norm = runs.to(wide).sum().sqrt() * scale.to(wide)
    return torch.where(largest.isinf(), math.inf, norm)


def _tensor(
    t: torch.Tensor, wide: torch.dtype, fp16_range: bool, checksum: bool
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """One tensor's counts (NaN, Inf, then the fp16-range pair or the checksum) and the min, max and
    norm of its finite values, in ``wide``."""
    device = t.device
    if t.numel() == 0:
        zero = torch.zeros((), dtype=torch.int64, device=device)
        counts = [zero, zero] + ([zero, zero] if fp16_range else [zero] if checksum else [])
        # Fills, not torch.tensor([...], device=...): a copy from pageable host memory would sync.
        extremes = [torch.full((1,), value, dtype=wide, device=device) for value in (math.inf, -math.inf, 0.0)]
        return counts, torch.cat(extremes)
    x = _values(t)
    nonfinite = (x - x).isnan()  # x - x: 0 for a finite x, NaN for a NaN and for either Inf
    nan = torch.count_nonzero(x.isnan())
    bad = torch.count_nonzero(nonfinite)
    counts = [nan, bad - nan]
    # Every NaN/Inf is stood in for by the tensor's first finite element: one pass then gives the finite
    # extrema, and a sum of squares that only matters when there is no NaN/Inf (else the norm is NaN
    # or inf by the counts).
    # index_select with a device index, not x[index]: indexing by a 0-dim tensor may read it on the host.
    fill = x.index_select(0, torch.argmin(nonfinite.view(torch.uint8)).reshape(1)).reshape(())
    masked = torch.where(nonfinite, fill, x)
    low, high = torch.aminmax(masked)
    none_finite = bad == x.numel()
    low = torch.where(none_finite, math.inf, low)
    high = torch.where(none_finite, -math.inf, high)
    norm = _norm(masked, torch.maximum(low.abs(), high.abs()), wide)
    if fp16_range:
        magnitude = x.abs()  # NaN compares false, and Inf is kept out by < inf
        counts.append(torch.count_nonzero((magnitude > _HALF_MAX) & (magnitude < math.inf)))
        counts.append(torch.count_nonzero((magnitude < _HALF_SMALLEST_SUBNORMAL) & (magnitude > 0)))
    elif checksum:
        counts.append(replica_checksum(t))
    return counts, torch.stack([low.to(wide), high.to(wide), norm])


def replica_checksum(t: torch.Tensor) -> torch.Tensor:
    """The replica checksum of scan_rules.h, int64 [] in [0, 2^32): the tensor's bytes in checksum
    order (memory order for a tensor dense in some order of its dimensions, else row-major) cut into
    little-endian 32-bit words, the last zero-padded; word q adds murmur3's finalizer of word ^
    salt(q), modulo 2^32. In int64 arithmetic, whose products wrap modulo 2^64 and so keep the low 32
    bits that uint32 arithmetic keeps."""
    data = _checksum_order(t).view(torch.uint8)
    padding = (-data.numel()) % 4
    if padding:
        data = torch.cat([data, torch.zeros(padding, dtype=torch.uint8, device=data.device)])
    b = data.view(-1, 4).to(torch.int64)
    words = b[:, 0] | (b[:, 1] << 8) | (b[:, 2] << 16) | (b[:, 3] << 24)
    q = torch.arange(words.numel(), dtype=torch.int64, device=words.device)
    salt = ((q & _WORD) * _SALT_LOW + (q >> 32) * _SALT_HIGH) & _WORD
    return _mix(words ^ salt).sum() & _WORD


def _checksum_order(t: torch.Tensor) -> torch.Tensor:
    """The tensor as a contiguous 1-D tensor in checksum order (no copy for a dense one)."""
    if t.dim() > 1 and not t.is_contiguous():
        strides = t.stride()
        order = sorted(range(t.dim()), key=lambda d: -strides[d])
        permuted = t.permute(order)
        if permuted.is_contiguous():  # dense in memory: its memory order
            return _unit_stride(permuted.reshape(-1))
    return _unit_stride(t.contiguous().reshape(-1))


def _unit_stride(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` with stride 1, which a byte view needs: torch counts a one-element tensor of any stride
    as contiguous and leaves it so."""
    if flat.numel() <= 1 and flat.stride(0) != 1:
        return torch.empty_like(flat, memory_format=torch.contiguous_format).copy_(flat)
    return flat


def scale_(tensors: Sequence[torch.Tensor], coef: torch.Tensor) -> None:
    """``nanscan::scale_`` in ATen ops: every tensor multiplied in place by ``coef`` (torch's multiply).
    A factor of 1 is multiplied too (x * 1 == x for every value): skipping it would need its value on
    the host, a sync."""
    _check_writable_list(tensors, "nanscan.scale_")
    torch._check(coef.numel() == 1, lambda: f"nanscan.scale_: coef must have one element, got shape {list(coef.shape)}")
    if not tensors:
        return
    torch._check(
        coef.device == tensors[0].device,
        lambda: f"nanscan.scale_: coef is on {coef.device} but the tensors are on {tensors[0].device}",
    )
    with torch.no_grad():
        torch._foreach_mul_(list(tensors), coef.reshape(()))


def unscale_scan_(tensors: Sequence[torch.Tensor], inv_scale: torch.Tensor) -> ScanOutputs:
    """``nanscan::unscale_scan_`` in ATen ops: each tensor multiplied by ``inv_scale`` in place (the
    GradScaler's unscale, torch's arithmetic), then scanned."""
    _check_writable_list(tensors, "nanscan.unscale_scan_")
    torch._check(len(tensors) > 0, lambda: "nanscan.unscale_scan_: expected at least one tensor")
    torch._check(
        inv_scale.numel() == 1 and inv_scale.dtype == torch.float32,
        lambda: (
            "nanscan.unscale_scan_: inv_scale must be a one-element float32 tensor (as GradScaler makes it), "
            f"got {inv_scale.dtype} of shape {list(inv_scale.shape)}"
        ),
    )
    torch._check(
        inv_scale.device == tensors[0].device,
        lambda: f"nanscan.unscale_scan_: inv_scale is on {inv_scale.device} but the tensors are on {tensors[0].device}",
    )
    with torch.no_grad():
        torch._foreach_mul_(list(tensors), inv_scale.reshape(()))
    return scan(tensors)


_SCAN_INTO = "nanscan.scan_into_"


def check_scan_into_buffers(
    tensors: Sequence[torch.Tensor], fp16_range: bool, counts: torch.Tensor, stats: torch.Tensor, column: int
) -> None:
    """scan_into_'s buffers, as the kernels check them (csrc/op_args.cpp, ScanIntoArgs), for the fake
    kernel and the composite: counts int64 [2 (4 with fp16_range), W], stats [3, W] (float64, or the
    device's wide dtype where it has no float64), both contiguous on the tensors' device, and the
    tensors' columns within the W."""
    _check_list(tensors, _SCAN_INTO)
    device = tensors[0].device
    for name, buffer, dtypes, rows in (
        ("counts", counts, (torch.int64,), 4 if fp16_range else 2),
        ("stats", stats, (torch.float64, wide_dtype(device)), 3),
    ):
        torch._check(
            buffer.layout == torch.strided,
            lambda name=name, buffer=buffer: (
                f"{_SCAN_INTO}: {name} has layout {buffer.layout}; expected a dense (strided) tensor"
            ),
        )
        torch._check(
            buffer.dtype in dtypes,
            lambda name=name, buffer=buffer, dtypes=dtypes: (
                f"{_SCAN_INTO}: {name} has dtype {buffer.dtype}; expected {dtypes[0]}"
            ),
        )
        torch._check(
            buffer.dim() == 2 and buffer.shape[0] == rows,
            lambda name=name, buffer=buffer, rows=rows: (
                f"{_SCAN_INTO}: {name} must be 2-D [{rows}, width]"
                f"{' (fp16_range adds two rows of counts)' if rows == 4 else ''}, got shape {list(buffer.shape)}"
            ),
        )
        torch._check(
            buffer.is_contiguous(),
            lambda name=name: f"{_SCAN_INTO}: {name} must be contiguous (its columns are written in place)",
        )
        torch._check(
            buffer.device == device,
            lambda name=name, buffer=buffer: (
                f"{_SCAN_INTO}: {name} is on {buffer.device} but the tensors are on {device}"
            ),
        )
    width, n = counts.shape[1], len(tensors)
    torch._check(
        stats.shape[1] == width,
        lambda: (
            f"{_SCAN_INTO}: counts has {width} columns but stats has {stats.shape[1]}; a tensor's results go in "
            "the same column of both"
        ),
    )
    torch._check(
        0 <= column <= width - n,
        lambda: (
            f"{_SCAN_INTO}: the {n} tensors' columns [{column}, {column + n}) do not lie within the {width} "
            "columns of counts and stats"
        ),
    )


def scan_into_(
    tensors: Sequence[torch.Tensor], fp16_range: bool, counts: torch.Tensor, stats: torch.Tensor, column: int
) -> None:
    """``nanscan::scan_into_`` in ATen ops: the scan's counts and statistics, copied into columns
    ``[column, column + N)`` of the buffers."""
    check_scan_into_buffers(tensors, fp16_range, counts, stats, column)
    with torch.no_grad():
        scanned_counts, scanned_stats, _, _, _ = scan(tensors, fp16_range)
        end = column + len(tensors)
        counts[:, column:end].copy_(scanned_counts)
        stats[:, column:end].copy_(scanned_stats)


_DIFFERENCE = "nanscan.scan_difference"


def check_difference_pairs(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> None:
    """scan_difference's pairs, as the kernel checks them (csrc/op_args.cpp, check_difference_pairs),
    for the fake kernel and the composite."""
    torch._check(len(before) > 0, lambda: f"{_DIFFERENCE}: expected at least one tensor")
    torch._check(
        len(before) == len(after),
        lambda: f"{_DIFFERENCE}: before holds {len(before)} tensors and after {len(after)}; one before per after",
    )
    for i, (b, a) in enumerate(zip(before, after, strict=True)):
        torch._check(
            b.dtype in (torch.float32, torch.float64),
            lambda i=i, b=b: (
                f"{_DIFFERENCE}: before[{i}] has dtype {b.dtype}; the differences are kept in float32 or float64"
            ),
        )
        torch._check(
            b.dtype == torch.float64 or a.dtype != torch.float64,
            lambda i=i: (
                f"{_DIFFERENCE}: after[{i}] is float64 but before[{i}] is float32: keep a float64 tensor's "
                "copy in float64"
            ),
        )
        torch._check(
            b.shape == a.shape,
            lambda i=i, b=b, a=a: (
                f"{_DIFFERENCE}: before[{i}] has shape {list(b.shape)} but after[{i}] has shape {list(a.shape)}"
            ),
        )


def scan_difference(before: Sequence[torch.Tensor], after: Sequence[torch.Tensor]) -> ScanOutputs:
    """``nanscan::scan_difference`` in ATen ops: the differences by torch's own subtraction (in
    before's dtype: after's is no wider), then one scan of them and the afters. It allocates the
    differences, which the CPU kernel never writes."""
    check_difference_pairs(before, after)
    with torch.no_grad():
        # torch promotes nothing with float8; its values convert to before's dtype exactly.
        subtrahends = [a.to(b.dtype) if a.dtype in _FLOAT8 else a for b, a in zip(before, after, strict=True)]
        differences = torch._foreach_sub(list(before), subtrahends)
        outputs: ScanOutputs = torch.ops.nanscan.scan.default(list(differences) + list(after))
    return outputs


_SKETCH = "nanscan.sketch"
# csrc/common/sketch_rules.h's constants: the block, the bucket counts the op takes, and the hash's salts.
_SKETCH_BLOCK = 64
SKETCH_BUCKETS = tuple(2**e for e in range(6, 13))
"""The bucket counts the op takes: the powers of two from 64 (a block's elements never share one) to
4096 (a CUDA warp's buckets fit its shared memory)."""
_MIN_SKETCH_BUCKETS, _MAX_SKETCH_BUCKETS = SKETCH_BUCKETS[0], SKETCH_BUCKETS[-1]
_TENSOR_SALT = 0x9E3779B9
_SIGNS_HIGH_SALT = 0x68E31DA4
_SIGNS_LOW_SALT = 0xB5297A4D
_OFFSET_SALT = 0x1B56C4E9
_SKETCH_CHUNK = 1 << 22
"""Elements of a tensor sketched per pass: its values in float64 and their signs are made a chunk at a
time, so that the transient memory is a few times 32 MiB, not a few times the tensor's size."""

_Word = TypeVar("_Word", int, torch.Tensor)


def _mix(x: _Word) -> _Word:
    """MurmurHash3's 32-bit finalizer (csrc/common/murmur.h: the replica checksum's and the sketch's)
    of a Python int or an int64 tensor of values in [0, 2^32): the products wrap modulo 2^64 (int64)
    or grow (int), and the mask keeps the low 32 bits, which are uint32 arithmetic's."""
    x = x ^ (x >> 16)
    x = (x * _MIX_1) & _WORD
    x = x ^ (x >> 13)
    x = (x * _MIX_2) & _WORD
    return x ^ (x >> 16)


def check_sketch_arguments(tensors: Sequence[torch.Tensor], buckets: int, seed: int) -> None:
    """sketch's arguments, as the kernels check them, with their words: for the fake kernel and the
    composite."""
    _check_list(tensors, _SKETCH)
    torch._check(
        _MIN_SKETCH_BUCKETS <= buckets <= _MAX_SKETCH_BUCKETS and buckets & (buckets - 1) == 0,
        lambda: (
            f"{_SKETCH}: buckets must be a power of two in [{_MIN_SKETCH_BUCKETS}, {_MAX_SKETCH_BUCKETS}], "
            f"got {buckets}"
        ),
    )
    torch._check(0 <= seed <= _WORD, lambda: f"{_SKETCH}: seed must be in [0, 2^32), got {seed}")


def sketch(tensors: Sequence[torch.Tensor], buckets: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``nanscan::sketch`` in ATen ops (csrc/common/sketch_rules.h): every tensor's CountSketch of
    ``buckets`` buckets (its values themselves when it has no more elements than that), concatenated
    in list order, and every tensor's sum of squares, [N]. Float64, equal to the kernels' up to the
    order of each float64 sum; on a device without float64 (MPS) both are float32, so a bucket then
    carries float32's rounding (about 2^-24 of the values it sums) and a sketch of weights no longer
    keeps an update far smaller than them. On the tensors' device, with no host sync."""
    check_sketch_arguments(tensors, buckets, seed)
    wide = wide_dtype(tensors[0].device)
    parts: list[torch.Tensor] = []
    sums: list[torch.Tensor] = []
    with torch.no_grad():
        for index, t in enumerate(tensors):
            tensor_seed = _mix(seed ^ _mix((index + _TENSOR_SALT) & _WORD))  # sketch_tensor_seed
            part, sumsq = _sketch_tensor(t, buckets, tensor_seed, wide)
            parts.append(part)
            sums.append(sumsq)
        return torch.cat(parts), torch.stack(sums)


def _sketch_tensor(t: torch.Tensor, k: int, tensor_seed: int, wide: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One tensor's buckets (min(numel, k) of them) and its sum of squares, in ``wide``."""
    x = t.reshape(-1)  # logical (row-major) order; a copy only of a tensor that is not contiguous
    n = x.numel()
    device = x.device
    if n <= k:
        values = x.to(wide)
        return values, (values * values).sum()
    # Block b's element p goes to bucket (offset_b + p) mod k. The blocks' signed rows are added at
    # row offset_b of a [k, 64] table by one index_add_ (an index per block, not one per element),
    # and bucket j then sums table[(j - p) mod k, p] over the 64 positions p: the same terms as one
    # add per element, in another float64 order.
    table = torch.zeros(k, _SKETCH_BLOCK, dtype=wide, device=device)
    sumsq = torch.zeros((), dtype=wide, device=device)
    lanes = torch.arange(32, dtype=torch.int64, device=device)
    for start in range(0, n, _SKETCH_CHUNK):
        values = x[start : start + _SKETCH_CHUNK].to(wide)  # float16, bfloat16 and float8 widen exactly
        sumsq = sumsq + (values * values).sum()
        tail = -values.numel() % _SKETCH_BLOCK
        if tail:  # the last block's missing elements as zeros, which add nothing to their buckets
            values = torch.nn.functional.pad(values, (0, tail))
        first = start // _SKETCH_BLOCK
        blocks = torch.arange(first, first + values.numel() // _SKETCH_BLOCK, dtype=torch.int64, device=device)
        key = _mix((blocks >> 32) ^ _mix((blocks & _WORD) ^ tensor_seed))  # sketch_block
        offsets = _mix(key ^ _OFFSET_SALT) & (k - 1)
        low, high = _mix(key ^ _SIGNS_LOW_SALT), _mix(key ^ _SIGNS_HIGH_SALT)
        # [blocks, 64]: bit p of the block's 64 sign bits, low word first; set: the element is subtracted.
        bits = torch.cat([(low[:, None] >> lanes) & 1, (high[:, None] >> lanes) & 1], dim=1)
        # A product, never in place: values may be the caller's own float64 tensor.
        table.index_add_(0, offsets, values.view(-1, _SKETCH_BLOCK) * (1 - 2 * bits))
    positions = torch.arange(_SKETCH_BLOCK, dtype=torch.int64, device=device)
    rows = (torch.arange(k, dtype=torch.int64, device=device)[:, None] - positions) & (k - 1)
    return table.gather(0, rows).sum(dim=1), sumsq


def _check_list(tensors: Sequence[torch.Tensor], op: str) -> None:
    """What the kernels check of a list, with their words: at least one tensor, each strided, on the
    first one's device, of a supported dtype."""
    torch._check(len(tensors) > 0, lambda: f"{op}: expected at least one tensor")
    device = tensors[0].device
    for i, t in enumerate(tensors):
        torch._check(
            t.layout == torch.strided,
            lambda i=i, t=t: f"{op}: tensors[{i}] has layout {t.layout}; only dense (strided) tensors can be scanned",
        )
        torch._check(
            t.device == device,
            lambda i=i, t=t: (
                f"{op}: tensors[{i}] is on {t.device} but tensors[0] is on {device}; call once per "
                "device (nanscan.scan groups by device for you)"
            ),
        )
        torch._check(
            t.dtype.is_floating_point and t.dtype not in (torch.float8_e4m3fnuz, torch.float8_e5m2fnuz),
            lambda i=i, t=t: (
                f"{op}: tensors[{i}] has dtype {t.dtype}; supported: float32, float64, float16, "
                "bfloat16, float8_e4m3fn, float8_e5m2"
            ),
        )


def _check_writable_list(tensors: Sequence[torch.Tensor], op: str) -> None:
    if not tensors:
        return
    _check_list(tensors, op)
    for i, t in enumerate(tensors):
        torch._check(
            t.dtype not in _FLOAT8,
            lambda i=i: f"{op}: tensors[{i}] is float8; torch cannot multiply float8 tensors either",
        )
