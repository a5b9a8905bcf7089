"""Mixed-precision integration: a GradScaler whose unscale_ is nanscan's fused pass.

``nanscan.amp.GradScaler`` is a drop-in subclass of ``torch.amp.GradScaler``: same constructor,
methods, scale trajectory and skipped steps. Its ``unscale_`` multiplies every gradient by the
inverse scale in place (torch's arithmetic, bit for bit) and, in the same pass, computes nanscan's
statistics of the unscaled gradients; ``found_inf`` comes from them. The statistics are kept: a
``nanscan.check(..., max_norm=...)`` or ``nanscan.clip_grad_norm_`` on the same, unmodified gradients
right after reuses them instead of reading the gradients again (tensor version counters tell when a
gradient was modified in between).

Gradient traffic of unscale + check + clip, with nothing to clip: one read and one write (torch:
three reads and two writes). Both backends fuse the multiply into the scan (the CUDA one is not yet
verified on a GPU).

Two deliberate differences from torch's GradScaler, both rare: ``found_inf`` is decided on the
unscaled values, so when the scale has fallen below 1 and the unscale itself overflows a finite
gradient, the step is skipped (torch would step with an Inf gradient). And the kept statistics are
offered for reuse only until the scaler's ``step``/``update``; a write through ``.grad.data`` (which
bypasses the version counter) between ``unscale_`` and the next check is not noticed.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ._ops import unscale_scan_op
from .report import Report, named_gradients
from .scan import ScanResult, forget_reusable, remember_for_reuse, scan


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with a fused unscale + scan. Constructor and methods as torch's.

    Attributes:
        last_report: the Report of the gradients as the last ``unscale_`` left them (names from
            ``watch(model)``, else the parameters' positions in the optimizer, ``"group0.param3"``);
            None before the first one.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_report: Report | None = None
        self._last_found_inf: list[torch.Tensor] = []
        self._names: dict[int, str] = {}

    def watch(self, model: torch.nn.Module) -> GradScaler:
        """Names the reports' parameters after ``model.named_parameters()`` instead of their position in
        the optimizer (``"group0.param3"``). Returns the scaler."""
        self._names.update({id(p): name for name, p in model.named_parameters()})
        return self

    def step(self, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> float | None:
        forget_reusable()  # the kept statistics describe this step only
        return super().step(optimizer, *args, **kwargs)

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        forget_reusable()
        super().update(new_scale)

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
                names.append(self._names.get(id(param), f"group{g}.param{i}"))
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


FP16_MAX = 65504.0


@dataclass
class Advice:
    """The Advisor's answer.

    Attributes:
        recommendation: ``"keep"`` (fp16 holds these gradients), ``"loss-scale"`` (change the scaler's
            settings: ``suggested_init_scale``), ``"bf16"`` (fp16's range does not fit; bf16 has fp32's
            range) or ``"fp32-modules"`` (a few modules overflow fp16: keep ``fp32_modules`` in fp32,
            what a hand-written ``force_fp32`` does).
        reasons: the evidence, one sentence each.
    """

    recommendation: str
    reasons: list[str]
    fp32_modules: list[str] = field(default_factory=list)
    suggested_init_scale: float | None = None

    def __str__(self) -> str:
        return f"nanscan AMP advice: {self.recommendation}\n" + "\n".join(f"  - {r}" for r in self.reasons)


class Advisor:
    """Watches gradients over steps and says whether fp16 (with a loss scale) can hold them.

    ``observe(model)`` runs the fused scan with the fp16-range counts (one pass, no sync) and adds its
    counts to device-side totals; ``advise()`` reads them once. Observe unscaled gradients: those of
    bf16/fp32 training, or after ``scaler.unscale_``.
    """

    def __init__(self, underflow_threshold: float = 1e-3, module_share_threshold: float = 0.25) -> None:
        self.underflow_threshold = underflow_threshold
        self.module_share_threshold = module_share_threshold
        self.names: Sequence[str] | None = None
        self.numels: list[int] = []
        self.steps = 0
        self._overflow: torch.Tensor | None = None
        self._underflow: torch.Tensor | None = None
        self._max_abs: torch.Tensor | None = None
        self._nonfinite_steps: torch.Tensor | None = None

    def observe(self, model_or_params: torch.nn.Module | Any) -> ScanResult:
        """Scans the current gradients once and accumulates the fp16 evidence; returns the scan."""
        names, grads = named_gradients(model_or_params)
        if self.names is None:
            self.names, self.numels = names, [g.numel() for g in grads]
        elif names != self.names:
            raise ValueError("nanscan.amp.Advisor: the set of parameters with gradients changed between observe() calls")
        with torch.no_grad():
            r = scan(grads, names, fp16_range=True)
            finite_abs = torch.maximum(r.min.abs(), r.max.abs()).nan_to_num(0.0, 0.0, 0.0)
            # Tensors with no finite value have min=+inf/max=-inf: nan_to_num turned those into 0.
            assert r.fp16_overflow is not None and r.fp16_underflow is not None
            if self._overflow is None:
                self._overflow, self._underflow = r.fp16_overflow.clone(), r.fp16_underflow.clone()
                self._max_abs, self._nonfinite_steps = finite_abs, (~r.finite).to(torch.int64)
            else:
                self._overflow += r.fp16_overflow
                self._underflow += r.fp16_underflow
                self._max_abs = torch.maximum(self._max_abs, finite_abs)
                self._nonfinite_steps = self._nonfinite_steps + (~r.finite).to(torch.int64)
        self.steps += 1
        return r

    def advise(self) -> Advice:
        """The recommendation and its reasons, from everything observed so far (one sync)."""
        if self.names is None or self._overflow is None:
            raise RuntimeError("nanscan.amp.Advisor: call observe() at least once before advise()")
        overflow = self._overflow.tolist()
        underflow = self._underflow.tolist()
        max_abs = self._max_abs.tolist()
        nonfinite_steps = int(self._nonfinite_steps)
        elements = sum(self.numels) * self.steps
        peak = max(max_abs) if max_abs else 0.0
        headroom = FP16_MAX / peak if peak > 0 else math.inf
        reasons = [
            f"{self.steps} step(s) observed over {len(self.names)} gradients; largest |g| {peak:.4g} is "
            f"{peak / FP16_MAX:.3g}x fp16's limit of 65504"
        ]
        if nonfinite_steps:
            reasons.append(f"{nonfinite_steps} observed step(s) already had NaN/Inf gradients")
        total_overflow, total_underflow = sum(overflow), sum(underflow)
        if total_overflow:
            modules = module_shares(self.names, self.numels, overflow)
            share = sum(self.numels[i] for i, n in enumerate(overflow) if n) / max(1, sum(self.numels))
            reasons.append(
                f"{total_overflow} gradient values ({total_overflow / elements:.2e} of all) exceed 65504 and would be "
                f"Inf in fp16, in {', '.join(modules)} ({share:.0%} of the parameters)"
            )
            if share <= self.module_share_threshold:
                return Advice("fp32-modules", reasons + ["the overflow is confined to these modules: run them in fp32"], modules)
            return Advice("bf16", reasons + ["the overflow is widespread: bf16 has fp32's range and needs no loss scale"])
        flushed = total_underflow / max(1, elements)
        if flushed > self.underflow_threshold:
            reasons.append(f"{flushed:.2%} of gradient values are non-zero but below 2^-24: fp16 would flush them to zero")
            if headroom >= 4:
                scale = 2.0 ** math.floor(math.log2(headroom / 2))
                reasons.append(f"a loss scale up to {scale:g} keeps the largest value under 65504 with a 2x margin")
                return Advice("loss-scale", reasons, suggested_init_scale=scale)
            reasons.append("there is no headroom to scale them up without overflowing: fp16's range is too narrow")
            return Advice("bf16", reasons)
        reasons.append(f"only {flushed:.2e} of values underflow fp16 and none overflow it: the setup holds")
        return Advice("keep", reasons)


def module_shares(names: Sequence[str], numels: list[int], counts: list[int]) -> list[str]:
    """Module names (parameter name minus its last component) that have a non-zero count, in order."""
    modules: list[str] = []
    for name, count in zip(names, counts):
        module = name.rsplit(".", 1)[0] if "." in name else name
        if count and module not in modules:
            modules.append(module)
    return modules
