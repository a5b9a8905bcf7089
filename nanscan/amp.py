"""Mixed-precision integration: a GradScaler whose unscale_ is nanscan's fused pass.

``nanscan.amp.GradScaler`` is a drop-in subclass of ``torch.amp.GradScaler``: same constructor,
methods, scale trajectory and skipped steps. Its ``unscale_`` multiplies every gradient by the
inverse scale in place (torch's arithmetic, bit for bit) and, in the same pass, computes nanscan's
statistics of the unscaled gradients; ``found_inf`` comes from them. The statistics are kept: a
``nanscan.check(..., max_norm=...)`` or ``nanscan.clip_grad_norm_`` on the same, unmodified gradients
right after reuses them instead of reading the gradients again (tensor version counters tell when a
gradient was modified in between).

Gradient traffic of unscale + check + clip, with nothing to clip: one read and one write on the CPU
backend (torch: three reads and two writes). The CUDA backend still runs the multiply and the scan as
two launches (two reads and one write).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from ._ops import unscale_scan_op
from .report import Report
from .scan import ScanResult, remember_for_reuse


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with a fused unscale + scan. Constructor and methods as torch's.

    Attributes:
        last_report: the Report of the gradients as the last ``unscale_`` left them (names are the
            parameters' positions in the optimizer, ``"group0.param3"``); None before the first one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_report: Report | None = None
        self._last_found_inf: list[torch.Tensor] = []

    @property
    def skipped(self) -> bool:
        """Whether the last unscaled step had a NaN/Inf, i.e. whether ``step`` skipped (or will skip)
        the optimizer step. Reading it syncs; nothing before it does."""
        return any(bool(f.item()) for f in self._last_found_inf)

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        names: list[str] = []
        grads: list[torch.Tensor] = []
        for g, group in enumerate(optimizer.param_groups):
            for i, param in enumerate(group["params"]):
                if not isinstance(param, torch.Tensor):
                    raise AssertionError(f"expected param to be torch.Tensor, got {type(param).__name__}")
                if param.grad is None:
                    continue
                if (not allow_fp16) and param.grad.dtype == torch.float16:
                    raise ValueError("Attempting to unscale FP16 gradients.")
                if param.grad.is_sparse or param.grad.dtype not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
                    # Sparse (coalesced by torch) or exotic gradients: torch's own path, without a report.
                    self.last_report = None
                    self._last_found_inf = []
                    result = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
                    self._last_found_inf = list(result.values())
                    return result
                names.append(f"group{g}.param{i}")
                grads.append(param.grad)

        by_device: dict[torch.device, list[int]] = defaultdict(list)
        for index, grad in enumerate(grads):
            by_device[grad.device].append(index)
        found_per_device: dict[torch.device, torch.Tensor] = {}
        report_parts: list[tuple[list[int], tuple[torch.Tensor, ...]]] = []
        with torch.no_grad():
            for device, indices in by_device.items():
                outputs = unscale_scan_op([grads[i] for i in indices], inv_scale.to(device))
                # torch's found_inf is a float32 scalar per device: 1.0 when anything was not finite.
                found_per_device[device] = (~outputs[3]).to(torch.float32)
                report_parts.append((indices, outputs))
        self._last_found_inf = list(found_per_device.values())
        if len(report_parts) == 1 and report_parts[0][0] == list(range(len(grads))):
            stats = ScanResult.from_op(*report_parts[0][1])
            self.last_report = Report(names, stats, stats.total_norm, 2.0)
            remember_for_reuse(grads, stats)
        else:
            self.last_report = None  # several devices: found_inf is exact, the per-device stats are not merged
        return found_per_device
