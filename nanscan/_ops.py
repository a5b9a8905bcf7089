"""Loads the compiled ops and gives each its fake (shape-only) implementation for torch.compile.

The ops themselves are declared once, in csrc/ops.cpp:

* ``nanscan::scan(Tensor[] tensors, bool fp16_range=False, bool checksum=False) -> (counts, stats,
  total_norm, finite)``: counts int64 [2, N] (NaN, Inf; with fp16_range also fp16 overflow and
  underflow: [4, N]; with checksum the replica checksums, in [0, 2^32): [3, N]), stats float64 [3, N] (min,
  max, L2 norm), total_norm float64 [], finite bool []. All outputs live on the tensors' device.
* ``nanscan::scale_(Tensor(a!)[] tensors, Tensor coef) -> ()``: multiplies in place unless coef == 1.
* ``nanscan::unscale_scan_(Tensor(a!)[] tensors, Tensor inv_scale) -> (counts, stats, total_norm, finite)``:
  GradScaler's unscale (x <- x * inv_scale, torch's arithmetic) fused with the scan of the result.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

from . import _C  # noqa: F401  (loading the library registers the ops)

scan_op = torch.ops.nanscan.scan.default
scale_op = torch.ops.nanscan.scale_.default
unscale_scan_op = torch.ops.nanscan.unscale_scan_.default

_Fake = TypeVar("_Fake", bound=Callable[..., Any])


def register_fake(op: str) -> Callable[[_Fake], _Fake]:
    """``torch.library.register_fake``, typed: torch leaves it unannotated, which would make every
    fake kernel below untyped in the eyes of a type checker."""
    return cast(Callable[[_Fake], _Fake], torch.library.register_fake(op))


@register_fake("nanscan::scan")
def _scan_fake(
    tensors: list[torch.Tensor], fp16_range: bool = False, checksum: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(not (fp16_range and checksum), lambda: "nanscan.scan: fp16_range and checksum are separate scans")
    return _scan_outputs(tensors, 4 if fp16_range else 3 if checksum else 2)


@register_fake("nanscan::unscale_scan_")
def _unscale_scan_fake(
    tensors: list[torch.Tensor], inv_scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return _scan_outputs(tensors)


def _scan_outputs(
    tensors: list[torch.Tensor], count_rows: int = 2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(len(tensors) > 0, lambda: "nanscan.scan: expected at least one tensor")
    n = len(tensors)
    device = tensors[0].device
    for i, t in enumerate(tensors):  # the real kernels refuse mixed devices; so must the fake one
        torch._check(
            t.device == device,
            lambda i=i, t=t: f"nanscan.scan: tensors[{i}] is on {t.device} but tensors[0] is on {device}",
        )
    return (
        torch.empty((count_rows, n), dtype=torch.int64, device=device),
        torch.empty((3, n), dtype=torch.float64, device=device),
        torch.empty((), dtype=torch.float64, device=device),
        torch.empty((), dtype=torch.bool, device=device),
    )


@register_fake("nanscan::scale_")
def _scale_fake(tensors: list[torch.Tensor], coef: torch.Tensor) -> None:
    return None
