"""The fused scan: per-tensor NaN/Inf counts, finite min/max and L2 norms, plus totals, in one pass."""

from __future__ import annotations

import dataclasses
import operator
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ._ops import norm_dtype, scan_op

if TYPE_CHECKING:
    from . import distributed
    from .distributed import Attribution

SUPPORTED_DTYPES = frozenset(
    {torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2}
)
MAX_DIMS = 64  # the kernels' limit (kMaxDims in csrc/cpu/scan_cpu.h), which is also torch's


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
            (nanscan.distributed.Attribution). None for a single process.
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
        """The result of the op's outputs (nanscan._ops: scan and unscale_scan_), in their order."""
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


def scan(
    tensors: torch.Tensor | Iterable[torch.Tensor],
    names: Sequence[str] | None = None,
    *,
    fp16_range: bool = False,
    checksum: bool = False,
    process_group: Any = None,
) -> ScanResult:
    """Scans every tensor in one fused pass per device; returns device tensors without a host sync.

    Args:
        tensors: a tensor or an iterable of tensors (typically gradients); any mix of float32, float64,
            float16, bfloat16 and float8 dtypes, any shapes and strides, on one or several devices;
            DTensors (FSDP2, tensor parallel) of any placements.
        names: optional names of the tensors, one per tensor (else ValueError), used in error messages.
        fp16_range: also count, in the same pass, the finite values an fp16 could not hold
            (``fp16_overflow``, ``fp16_underflow``): the evidence ``nanscan.amp.Advisor`` works from.
        checksum: also compute, in the same pass, each tensor's replica checksum (``checksum``), to
            compare replicas across processes (nanscan.replicas); of a DTensor's local part only. Not
            together with ``fp16_range`` (one pass computes one or the other) or ``process_group``.
        process_group: ranks that each hold different tensors (pipeline stages): every rank gets the
            statistics of every rank's tensors (``result.names`` names them). See nanscan.distributed.

    Tensors on several devices are scanned once per device and the results gathered on the device of
    the first tensor (like ``torch.nn.utils.clip_grad_norm_`` does with its norms). An empty list
    gives empty statistics on the CPU with ``total_norm == 0`` and ``finite == True``. DTensors are
    scanned on each rank's local shard, and the statistics reduced over their mesh in two
    collectives, so every rank gets each tensor's global statistics, as plain tensors.
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    if names is not None and len(names) != len(tensors):
        raise ValueError(f"nanscan.scan: got {len(names)} names for {len(tensors)} tensors; give one name per tensor")
    if checksum and fp16_range:
        raise ValueError(
            "nanscan.scan: checksum=True is for plain tensors and DTensors, without fp16_range (the op "
            "computes one or the other in a pass; scan twice for both)"
        )
    if checksum and process_group is not None:
        raise ValueError(
            "nanscan.scan: checksum=True compares replicas of the same tensors; process_group is for ranks "
            "that hold different ones (pipeline stages). Scan without process_group to compare replicas"
        )
    return routed_scan(tensors, names, fp16_range, checksum, process_group)


def routed_scan(
    tensors: list[torch.Tensor],
    names: Sequence[str] | None,
    fp16_range: bool,
    checksum: bool,
    process_group: Any,
    view: distributed.LocalView | None = None,
) -> ScanResult:
    """``scan`` once its arguments are checked: plain tensors in this process, DTensors and
    ``process_group`` through nanscan.distributed. ``view``: ``distributed.local_view(tensors)``, when
    the caller has made it (``check`` shares it with the clip)."""
    if view is not None or process_group is not None or (tensors and _is_dtensor(tensors[0])):
        from . import distributed

        if view is None:
            view = distributed.local_view(tensors)
        return distributed.scan(view, names, fp16_range, process_group, checksum)
    try:
        return scan_local(tensors, names, fp16_range, checksum)
    except (RuntimeError, TypeError):
        # A DTensor has no kernel of its own (its dispatch refuses the op): it is scanned by its
        # shards. None can exist before torch.distributed.tensor is loaded.
        if "torch.distributed.tensor" in sys.modules:
            from . import distributed

            if distributed.has_dtensor(tensors):
                return distributed.scan(distributed.local_view(tensors), names, fp16_range, checksum=checksum)
        raise


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


def _is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor: such a list is routed before the op is tried, since DTensor's
    dispatch spends ~0.3 ms per tensor (fake-tensor propagation) before it refuses an unknown op.
    None can exist before torch.distributed.tensor is loaded."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and type(t) is not torch.Tensor and isinstance(t, module.DTensor)


def scan_local(
    tensors: list[torch.Tensor], names: Sequence[str] | None, fp16_range: bool, checksum: bool = False
) -> ScanResult:
    """``scan`` of plain tensors in this process: one fused pass per device, nothing reduced.
    ``checksum`` adds each tensor's replica checksum (ScanResult.checksum) to the same pass."""
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
        validate(tensors, names)
        groups = group_by_device(tensors)
        if len(groups) > 1:
            return _gather_devices(tensors, groups, fp16_range, checksum)
        raise
    if outputs[0].is_meta:
        validate(tensors, names)
    return ScanResult.from_op(*outputs)


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
        index = torch.tensor(indices, device=first)
        counts[:, index] = c.to(first)
        stats[:, index] = s.to(first)
        # NaN and Inf propagate through the square exactly as the norm rule requires.
        sumsq = sumsq + total.to(first).square()
        finite = finite & fin.to(first)
    total_norm = sumsq.sqrt()
    return ScanResult.from_op(counts, stats, total_norm, finite, total_norm.to(norm_dtype(dtypes)))
