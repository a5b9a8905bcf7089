"""``nanscan.scan``: the statistics of a list of tensors, wherever they live (nanscan.layouts)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from . import layouts
from .fused import SUPPORTED_DTYPES, ScanResult

__all__ = ["SUPPORTED_DTYPES", "ScanResult", "scan"]


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
            statistics of every rank's tensors (``result.names`` names them). See nanscan.layouts.

    Tensors on several devices are scanned once per device and the results gathered on the device of
    the first tensor (like ``torch.nn.utils.clip_grad_norm_`` does with its norms). An empty list
    gives empty statistics on the CPU with ``total_norm == 0`` and ``finite == True``. DTensors are
    scanned on each rank's local shard, and the statistics reduced over their mesh in two
    collectives, so every rank gets each tensor's global statistics, as plain tensors. Parameters
    that FSDP1 flattened are scanned (their values) by their original parameters' parts, reduced
    over FSDP's groups, and so are FSDP1's flat gradients (nanscan knows the FSDP1 models the process
    makes; a model it cannot know is refused). Other plain tensors are scanned as they are, but a
    DDP model's gradients inside ``no_sync()`` are refused.
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
    layout = layouts.of_tensors(tensors, names, process_group)
    return layouts.scan(layout, names, fp16_range, checksum, sparse=True)
