"""The fused scan of this process's tensors: per-tensor NaN/Inf counts, finite min/max and L2 norms,
plus totals, in one pass per device, with nothing reduced across processes.

Where the tensors come from and how results are reduced across ranks is the layouts' business
(nanscan.layouts); ``nanscan.scan`` is the entry point that puts the two together."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from ._ops import scan_op
from .dtypes import norm_dtype

SUPPORTED_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
)
MAX_DIMS = 64  # the kernels' limit (kMaxDims in csrc/cpu/scan_cpu.h), which is also torch's


def capturing(device: torch.device) -> bool:
    """Whether work queued for ``device`` now is being captured in a CUDA graph (its current stream's)."""
    if device.type != "cuda":
        return False
    with torch.cuda.device(device):
        return torch.cuda.is_current_stream_capturing()


# The host sources of the uploads captured in a CUDA graph: each replay copies from them again, so
# they live as long as the process (a few bytes per value, once per capture).
_CAPTURED_UPLOAD_SOURCES: list[torch.Tensor] = []


def upload(values: Sequence[Any], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a tensor on ``device``, with no host sync: ``torch.tensor(values, device=cuda)``
    copies from pageable memory, which waits for the GPU (``set_sync_debug_mode("error")`` raises);
    from pinned memory the copy is queued on the stream. torch's pinned allocator keeps the block
    until that copy has run, so the host tensor may go out of scope at once.

    Inside a CUDA graph capture the copy is recorded, not run: every replay reads the pinned source
    again, so it is kept for good, never handed back to the allocator for reuse. (torch refuses a
    captured copy from pageable memory, since nothing would keep that alive.)"""
    if device.type != "cuda":
        return torch.tensor(values, dtype=dtype, device=device)
    source = torch.tensor(values, dtype=dtype, pin_memory=True)
    if capturing(device):
        _CAPTURED_UPLOAD_SOURCES.append(source)
    return source.to(device, non_blocking=True)


def scannable(t: object) -> bool:
    """A dense floating tensor nanscan can scan; tensor subclasses (DTensor, fakes) are left alone."""
    return (
        (type(t) is torch.Tensor or type(t) is torch.nn.Parameter)
        and t.dtype in SUPPORTED_DTYPES
        and t.layout == torch.strided
        and not t.is_meta
    )


@functools.cache
def _wrapper_types() -> tuple[type | None, type | None]:
    """DTensor and functional collectives' AsyncCollectiveTensor (None where torch.distributed is not
    built in). Imported on the first tensor subclass met, never for plain tensors."""
    try:
        from torch.distributed._functional_collectives import AsyncCollectiveTensor
        from torch.distributed.tensor import DTensor
    except ImportError:
        return None, None
    return DTensor, AsyncCollectiveTensor


def local_values(t: torch.Tensor) -> torch.Tensor | None:
    """The plain tensor that holds the values of ``t`` this process can read, or None where nanscan
    cannot read them: ``t`` itself when it is a plain scannable tensor; a DTensor's local tensor
    (this rank's shard, its copy of a replicated tensor, its term of a Partial one), once any
    collective that makes it has completed; a tensor subclass that overrides no dispatch (its memory
    holds its values) seen as a plain tensor of the same memory. Any other subclass (a quantized or
    lazy wrapper), and a sparse, nested or meta tensor, or one of a dtype nanscan does not scan: None."""
    kind = type(t)
    if kind is torch.Tensor or kind is torch.nn.Parameter:
        return t if scannable(t) else None
    dtensor, async_collective = _wrapper_types()
    if dtensor is not None and isinstance(t, dtensor):
        return local_values(t._local_tensor)  # type: ignore[attr-defined]
    if async_collective is not None and isinstance(t, async_collective):
        return local_values(t.trigger_wait())  # type: ignore[attr-defined]
    if getattr(kind, "__torch_dispatch__", None) is torch._C._disabled_torch_dispatch_impl:
        with torch._C.DisableTorchFunctionSubclass():
            plain = t.as_subclass(torch.Tensor)
        return plain if scannable(plain) else None
    return None


def floating_tensors(obj: object, out: list[torch.Tensor], unread: list[torch.Tensor] | None = None) -> None:
    """Appends the values of the floating tensors in ``obj`` (nested tuples, lists, dict values) that
    nanscan can read (``local_values``: a DTensor's local tensor), each object once; the floating
    tensors it cannot read go to ``unread`` (when given), so that a caller can say what it did not see."""
    if isinstance(obj, torch.Tensor):
        local = local_values(obj)
        if local is None:
            if unread is not None and obj.dtype.is_floating_point:
                unread.append(obj)
            return
        if not out or not any(local is seen for seen in out):  # a lone tensor: no duplicate to look for
            out.append(local)
    elif isinstance(obj, (tuple, list)):
        for item in obj:
            floating_tensors(item, out, unread)
    elif isinstance(obj, dict):
        for item in obj.values():
            floating_tensors(item, out, unread)


def describe_unread(t: torch.Tensor) -> str:
    """How a message names a tensor nanscan could not read: its type, and its layout or device where
    those are the reason."""
    kind = type(t)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        return kind.__name__
    if t.layout != torch.strided or t.is_nested:
        return f"{t.layout} tensor"
    if t.is_meta:
        return "meta tensor"
    return f"{t.dtype} tensor"


_SUBSETS_SEARCHED = 200_000  # rank subsets tried when attributing a NaN held by three ranks or more


@dataclass(frozen=True)
class Attribution:
    """Which ranks' local data held a NaN/Inf, per tensor (device tensors, reduced over the ranks).

    Attributes:
        count: float64 [N], how many ranks' local part of the tensor held a NaN/Inf.
        rank_sum: float64 [N], the sum of those ranks.
        rank_square_sum: float64 [N], the sum of their squares.
        any_by_rank: float64 [world], 1 for every rank whose local data held any NaN/Inf.

    A rank that cannot tell whether its local data made a tensor's NaN/Inf (the DDP hook after a
    pass that may have brought another rank's, nanscan.layouts.ddp) adds ``UNKNOWN`` to its count and
    nothing else: ``ranks`` then names the ranks that did say, or none ("rank unknown").
    """

    UNKNOWN: ClassVar[int] = 1 << 20  # above any count of ranks; exact in float64 up to 2^32 ranks

    count: torch.Tensor
    rank_sum: torch.Tensor
    rank_square_sum: torch.Tensor
    any_by_rank: torch.Tensor

    def rows(self) -> list[torch.Tensor]:
        """The device tensors a Report copies to the host (with the rest, in one transfer)."""
        return [self.count, self.rank_sum, self.rank_square_sum, self.any_by_rank]

    @staticmethod
    def ranks(count: float, rank_sum: float, rank_square_sum: float, any_by_rank: Sequence[float]) -> list[int]:
        """The ranks of one tensor, from its host values (see the module notes on when exact); empty
        when no rank is known to have held it (see UNKNOWN)."""
        n = round(count) % Attribution.UNKNOWN
        if n <= 0:
            return []
        if n == 1:
            return [round(rank_sum)]
        if n == 2:  # r1 + r2 = s1, r1^2 + r2^2 = s2: the roots of r^2 - s1 r + (s1^2 - s2) / 2
            spread = math.sqrt(max(0.0, 2 * rank_square_sum - rank_sum * rank_sum))
            return sorted({round((rank_sum - spread) / 2), round((rank_sum + spread) / 2)})
        candidates = [r for r, flagged in enumerate(any_by_rank) if flagged > 0]
        if n >= len(candidates):
            return candidates
        # The n-subsets of the ranks with any NaN/Inf whose sum and sum of squares match: one, in
        # practice; their union otherwise. Only while the search is small (this runs on a rare path).
        if math.comb(len(candidates), n) > _SUBSETS_SEARCHED:
            return candidates
        s1, s2 = round(rank_sum), round(rank_square_sum)
        matches = [c for c in itertools.combinations(candidates, n) if sum(c) == s1 and sum(r * r for r in c) == s2]
        return sorted({r for c in matches for r in c}) if matches else candidates


@dataclass(frozen=True)
class ScanResult:
    """Statistics of a list of tensors. Every field is a tensor on the scanned device; none was synced.

    Attributes:
        nan_count: int64 [N], NaN elements per tensor.
        inf_count: int64 [N], +-Inf elements per tensor.
        min: float64 [N], smallest finite element (+inf when a tensor has no finite element).
        max: float64 [N], largest finite element (-inf when a tensor has no finite element).
        norm: float64 [N], L2 norm with torch semantics (NaN if any NaN, else inf if any Inf). Squares
            are summed in at least fp32 and combined in fp64, so bf16/fp16 tensors get an accurate norm.
        total_norm: float64 [], L2 norm of all tensors as one vector.
        finite: bool [], True when no tensor has a NaN or Inf. Decided by classifying elements, so a
            huge but finite gradient (1e20 everywhere) is finite even though its fp32 square is not.
        fp16_overflow: int64 [N], finite elements above fp16's 65504 (only with ``fp16_range=True``).
        fp16_underflow: int64 [N], non-zero elements below fp16's smallest subnormal 2^-24, which fp16
            would flush to zero (only with ``fp16_range=True``).
        names: the names of the tensors described, when they are not the caller's list: with
            ``process_group``, every rank's tensors, in rank order. None otherwise.
        ranks: for a distributed scan, which ranks' local data held each tensor's NaN/Inf
            (Attribution, made by nanscan.layouts.reduce). None for a single process.
        consistent: for a distributed scan, bool []: every rank of every reduction scanned the same
            layout (shapes and placements); statistics of ranks that did not are meaningless.
        checksum: int64 [N], each tensor's replica checksum (only with ``checksum=True``): a hash of
            its bits and their positions, equal on two processes exactly when (but for a 2^-32 chance
            of a collision) their tensors are bit-identical. For a DTensor, unlike the statistics
            beside it, the checksum of this rank's local part (its shard; a Partial tensor's value
            once reduced), not reduced over the mesh: it is compared with the same part's copies on
            other ranks, where it has some (nanscan.replicas).
        total_norm_cast: ``total_norm`` in the dtype torch's total norm of these tensors has (their
            dtypes promoted; float8 as float32), as ``.to()`` rounds it; computed by the op, so that
            nothing reads every tensor's dtype to find it. None where no op made this result (a
            distributed scan: the caller knows the dtypes from its plan).
    """

    nan_count: torch.Tensor
    inf_count: torch.Tensor
    min: torch.Tensor
    max: torch.Tensor
    norm: torch.Tensor
    total_norm: torch.Tensor
    finite: torch.Tensor
    fp16_overflow: torch.Tensor | None = None
    fp16_underflow: torch.Tensor | None = None
    names: tuple[str, ...] | None = None
    ranks: Attribution | None = None
    consistent: torch.Tensor | None = None
    checksum: torch.Tensor | None = None
    total_norm_cast: torch.Tensor | None = None

    @classmethod
    def from_op(
        cls,
        counts: torch.Tensor,
        stats: torch.Tensor,
        total_norm: torch.Tensor,
        finite: torch.Tensor,
        total_norm_cast: torch.Tensor,
    ) -> ScanResult:
        """The result of the op's outputs (nanscan._ops: ``scan`` and ``unscale_scan_``), in their order."""
        half = counts.shape[0] == 4
        return cls(
            counts[0],
            counts[1],
            stats[0],
            stats[1],
            stats[2],
            total_norm,
            finite,
            fp16_overflow=counts[2] if half else None,
            fp16_underflow=counts[3] if half else None,
            checksum=counts[2] if counts.shape[0] == 3 else None,
            total_norm_cast=total_norm_cast,
        )

    def __len__(self) -> int:
        return self.norm.shape[0]

    def scaled(self, factor: torch.Tensor) -> ScanResult:
        """The statistics of these tensors multiplied by a positive ``factor`` (a device scalar): min,
        max and the norms scale, the counts do not. Exact for a power of two, as loss scales are."""
        factor = factor.to(self.norm.device, torch.float64)
        total_norm = self.total_norm * factor
        cast = self.total_norm_cast
        return dataclasses.replace(
            self,
            min=self.min * factor,
            max=self.max * factor,
            norm=self.norm * factor,
            total_norm=total_norm,
            total_norm_cast=total_norm.to(cast.dtype) if cast is not None else None,
        )


def describe(names: Sequence[str] | None, index: int) -> str:
    """How an error message names entry ``index``: its parameter name when known, else its position."""
    if names is not None:
        return f"{names[index]!r} (entry {index})"
    return f"entry {index}"


def validate(tensors: Sequence[object], names: Sequence[str] | None = None) -> None:
    """Raises a TypeError/ValueError naming the first entry nanscan cannot scan."""
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"nanscan: {describe(names, i)} is a {type(t).__name__}, not a torch.Tensor")
        if t.is_nested:
            raise TypeError(
                f"nanscan: {describe(names, i)} is a nested tensor; only dense tensors can be scanned "
                "(scan its components, .unbind())"
            )
        if t.layout != torch.strided:
            raise TypeError(
                f"nanscan: {describe(names, i)} is a {t.layout} tensor; only dense tensors can be scanned "
                "(call .to_dense() first)"
            )
        if t.dtype not in SUPPORTED_DTYPES:
            kind = "complex" if t.is_complex() else "integer/bool" if not t.is_floating_point() else "unsupported"
            raise TypeError(
                f"nanscan: {describe(names, i)} has {kind} dtype {t.dtype}; supported: float32, float64, "
                "float16, bfloat16, float8_e4m3fn, float8_e5m2"
            )
        if t.is_meta:
            raise ValueError(f"nanscan: {describe(names, i)} is a meta tensor; it has no values to scan")
        if t.dim() > MAX_DIMS:
            raise RuntimeError(
                f"nanscan: {describe(names, i)} has {t.dim()} dimensions; at most {MAX_DIMS} are supported"
            )


_GRAD = operator.attrgetter("grad")
_PLAIN_PARAMETER_TYPES = (torch.nn.Parameter, torch.Tensor)


def gradients_of(parameters: Sequence[Any]) -> list[torch.Tensor | None]:
    """``[p.grad for p in parameters]``, at half the cost for DTensor parameters (FSDP2, tensor parallel).

    DTensor disables ``__torch_function__``, yet the ``.grad`` getter of every Tensor subclass looks
    it up on each read: 0.12 us of the 0.26 us a DTensor's read costs on the CPU this was measured on,
    a tenth of a checked step's host time per parameter. With subclass dispatch switched off the getter
    skips the lookup. Only where that changes nothing: when the type of every entry disables
    ``__torch_function__`` (a subclass with its own still sees each read; torch function modes are
    untouched). Raises AttributeError, as the comprehension does, for an entry that is no tensor."""
    if parameters and type(parameters[0]) not in _PLAIN_PARAMETER_TYPES and not torch.compiler.is_compiling():
        types = set(map(type, parameters))
        if all(getattr(t, "__torch_function__", None) is torch._C._disabled_torch_function_impl for t in types):
            with torch._C.DisableTorchFunctionSubclass():
                return list(map(_GRAD, parameters))
    return [p.grad for p in parameters]


def group_by_device(tensors: Sequence[torch.Tensor]) -> dict[torch.device, list[int]]:
    """Indices of the tensors on each device, devices in order of first appearance."""
    groups: dict[torch.device, list[int]] = {}
    for i, t in enumerate(tensors):
        groups.setdefault(t.device, []).append(i)
    return groups


def count_rows(fp16_range: bool, checksum: bool) -> int:
    """Rows of the op's counts output: NaN and Inf, then the fp16-range pair or the checksum."""
    return 4 if fp16_range else 3 if checksum else 2


def empty_result(fp16_range: bool, device: torch.device | None = None, *, checksum: bool = False) -> ScanResult:
    """The statistics of an empty list: no tensors, total norm 0, finite (on the CPU by default)."""
    return ScanResult.from_op(
        torch.zeros((count_rows(fp16_range, checksum), 0), dtype=torch.int64, device=device),
        torch.zeros((3, 0), dtype=torch.float64, device=device),
        torch.zeros((), dtype=torch.float64, device=device),
        torch.ones((), dtype=torch.bool, device=device),
        torch.zeros((), dtype=torch.float64, device=device),  # torch's total norm of no tensors: float64 0
    )


def scan_local(
    tensors: list[torch.Tensor],
    names: Sequence[str] | None,
    fp16_range: bool,
    checksum: bool = False,
    sparse: bool = False,
) -> ScanResult:
    """``scan`` of plain tensors in this process: one fused pass per device, nothing reduced.
    ``checksum`` adds each tensor's replica checksum (ScanResult.checksum) to the same pass.
    ``sparse``: sparse COO tensors (``nn.Embedding(sparse=True)``'s gradients) are scanned exactly,
    as their dense values would be (``scan_sparse``); else refused like any non-dense tensor (the
    drop-ins leave them to torch's own code)."""
    if not tensors:
        return empty_result(fp16_range, checksum=checksum)
    if torch.compiler.is_compiling():
        validate(tensors, names)  # traced once, costs nothing at run time
        return ScanResult.from_op(*scan_op(tensors, fp16_range, checksum))
    # The op validates every entry in C++; Python walks the list only when something is wrong, to
    # name the entry (or to split a list that spans devices). That keeps the host cost per tensor low.
    try:
        outputs = scan_op(tensors, fp16_range, checksum)
    except (RuntimeError, TypeError):
        if (
            sparse
            and not checksum
            and any(t.layout == torch.sparse_coo for t in tensors if isinstance(t, torch.Tensor))
        ):
            return scan_sparse(tensors, names, fp16_range)
        validate(tensors, names)
        groups = group_by_device(tensors)
        if len(groups) > 1:
            return _gather_devices(tensors, groups, fp16_range, checksum)
        raise
    if outputs[0].is_meta:
        validate(tensors, names)
    return ScanResult.from_op(*outputs)


def scan_sparse(tensors: list[torch.Tensor], names: Sequence[str] | None, fp16_range: bool) -> ScanResult:
    """The statistics of a list with sparse COO tensors, exactly those of their dense values: a COO
    tensor is scanned by its coalesced values (duplicates summed, as ``to_dense()`` sums them, so a
    NaN or an opposite pair of Infs makes the element NaN as it would there), which are its only
    elements that are not zero: its counts and norm are theirs; its min and max take in 0 where some
    elements are not stored. No dense copy is made."""
    values = [t.coalesce().values() if t.layout == torch.sparse_coo else t for t in tensors]
    result = scan_local(values, names, fp16_range)
    implicit = [t.layout == torch.sparse_coo and v.numel() < t.numel() for t, v in zip(tensors, values, strict=True)]
    if not any(implicit):
        return result
    zeros = upload(implicit, torch.bool, result.min.device)
    return dataclasses.replace(
        result,
        min=torch.where(zeros, result.min.clamp(max=0.0), result.min),
        max=torch.where(zeros, result.max.clamp(min=0.0), result.max),
    )


def _gather_devices(
    tensors: list[torch.Tensor], groups: dict[torch.device, list[int]], fp16_range: bool, checksum: bool
) -> ScanResult:
    first = tensors[0].device
    n = len(tensors)
    counts = torch.empty((count_rows(fp16_range, checksum), n), dtype=torch.int64, device=first)
    stats = torch.empty((3, n), dtype=torch.float64, device=first)
    sumsq = torch.zeros((), dtype=torch.float64, device=first)
    finite = torch.ones((), dtype=torch.bool, device=first)
    dtypes = []
    for indices in groups.values():
        c, s, total, fin, cast = scan_op([tensors[i] for i in indices], fp16_range, checksum)
        dtypes.append(cast.dtype)
        index = upload(indices, torch.int64, first)
        counts[:, index] = c.to(first)
        stats[:, index] = s.to(first)
        # NaN and Inf propagate through the square exactly as the norm rule requires.
        sumsq = sumsq + total.to(first).square()
        finite = finite & fin.to(first)
    total_norm = sumsq.sqrt()
    return ScanResult.from_op(counts, stats, total_norm, finite, total_norm.to(norm_dtype(dtypes)))
