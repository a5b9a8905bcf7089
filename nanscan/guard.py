"""What ``check`` does when a gradient is not finite: ignore, warn, raise, or skip the optimizer step.

Skipping wraps the optimizer's ``step`` once (``SkipGuard``); each ``check(..., on_nonfinite="skip",
optimizer=opt)`` hands the guard the step's finite flag. Optimizers whose step takes a device-side
``found_inf`` (torch's fused Adam, AdamW and SGD, ``fused=True``) skip on the device with no host sync;
for the others the guard reads the flag, which is one sync per step. Counters of skipped steps are
device tensors, read only when asked for.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any

import torch

ON_NONFINITE = ("ignore", "warn", "raise", "skip")


class NonFiniteGradientError(RuntimeError):
    """Raised by ``check(..., on_nonfinite="raise")`` and by a guard past its consecutive-skip limit."""


class SkipGuard:
    """Skips ``optimizer.step()`` when the last check found a NaN/Inf, and counts what it skipped.

    Attributes:
        max_consecutive_skips: raise NonFiniteGradientError when more consecutive steps than this
            were skipped (None: never). Checked whenever the flag is read on the host.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, max_consecutive_skips: int | None = None) -> None:
        if max_consecutive_skips is not None and max_consecutive_skips < 0:
            raise ValueError(f"nanscan: max_consecutive_skips must be >= 0 or None, got {max_consecutive_skips}")
        self.optimizer = optimizer
        self.max_consecutive_skips = max_consecutive_skips
        self._finite: torch.Tensor | None = None
        self._total: torch.Tensor | None = None
        self._consecutive: torch.Tensor | None = None
        self._last_skipped: torch.Tensor | None = None
        self._device_side = bool(optimizer.defaults.get("fused")) and getattr(optimizer, "_step_supports_amp_scaling", False)
        original = optimizer.step

        @functools.wraps(original)
        def guarded_step(*args: Any, **kwargs: Any) -> Any:
            return self._step(original, *args, **kwargs)

        optimizer.step = guarded_step  # type: ignore[method-assign]

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer, max_consecutive_skips: int | None = None) -> SkipGuard:
        """The optimizer's guard, created (and its step wrapped) on first use."""
        guard = getattr(optimizer, "_nanscan_guard", None)
        if guard is None:
            guard = cls(optimizer, max_consecutive_skips)
            optimizer._nanscan_guard = guard  # type: ignore[attr-defined]
        elif max_consecutive_skips is not None:
            guard.max_consecutive_skips = max_consecutive_skips
        return guard

    def arm(self, finite: torch.Tensor) -> None:
        """Hands the guard this step's finite flag and updates the counters on the device."""
        self._finite = finite
        bad = (~finite).to(torch.int64)
        if self._total is None:
            self._total = torch.zeros((), dtype=torch.int64, device=finite.device)
            self._consecutive = torch.zeros((), dtype=torch.int64, device=finite.device)
        self._total = self._total + bad
        self._consecutive = (self._consecutive + bad) * bad
        self._last_skipped = bad.bool()

    def _step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        finite, self._finite = self._finite, None
        if finite is None:  # not armed by a check this step: an ordinary step
            return original(*args, **kwargs)
        if self._device_side:
            # A GradScaler may have set found_inf / grad_scale for this step already: combine with its
            # found_inf, keep its grad_scale, and put back whatever was there.
            missing = object()
            saved = {name: getattr(self.optimizer, name, missing) for name in ("found_inf", "grad_scale")}
            ours = (~finite).to(torch.float32)
            if saved["found_inf"] is not missing and saved["found_inf"] is not None:
                ours = torch.maximum(ours, saved["found_inf"].to(ours.device, torch.float32))
            self.optimizer.found_inf = ours  # type: ignore[attr-defined]
            if saved["grad_scale"] is missing:
                self.optimizer.grad_scale = None  # type: ignore[attr-defined]
            try:
                return original(*args, **kwargs)
            finally:
                for name, value in saved.items():
                    if value is missing:
                        delattr(self.optimizer, name)
                    else:
                        setattr(self.optimizer, name, value)
        if bool(finite):
            return original(*args, **kwargs)
        self._raise_past_limit()
        return None

    def _raise_past_limit(self) -> None:
        if self.max_consecutive_skips is not None and self.consecutive_skips > self.max_consecutive_skips:
            raise NonFiniteGradientError(
                f"nanscan: {self.consecutive_skips} consecutive optimizer steps skipped for non-finite gradients "
                f"(limit {self.max_consecutive_skips})"
            )

    @property
    def total_skips(self) -> int:
        """Steps skipped so far (reading it syncs)."""
        return 0 if self._total is None else int(self._total)

    @property
    def consecutive_skips(self) -> int:
        """Steps skipped in a row up to the last check (reading it syncs)."""
        return 0 if self._consecutive is None else int(self._consecutive)

    @property
    def last_skipped(self) -> bool:
        """Whether the last checked step was skipped; an LR scheduler can hold back on it (syncs)."""
        return self._last_skipped is not None and bool(self._last_skipped)


def act_on_nonfinite(report: Any, on_nonfinite: str, optimizer: torch.optim.Optimizer | None,
                     max_consecutive_skips: int | None) -> None:
    """Applies ``on_nonfinite`` to a fresh Report (see ``check``)."""
    if on_nonfinite == "ignore":
        return
    if on_nonfinite == "skip":
        if optimizer is None:
            raise ValueError("nanscan.check: on_nonfinite='skip' needs optimizer=<the optimizer whose step to skip>")
        guard = SkipGuard.of(optimizer, max_consecutive_skips)
        guard.arm(report.stats.finite)
        if not guard._device_side and guard.max_consecutive_skips is not None:
            guard._raise_past_limit()
        return
    if report.finite:  # warn and raise read the flag: one sync
        return
    message = f"nanscan: non-finite gradients in {', '.join(report.nonfinite)}\n{report.table()}"
    if on_nonfinite == "warn":
        warnings.warn(message, RuntimeWarning, stacklevel=3)
    else:
        raise NonFiniteGradientError(message)
