"""What ``check`` does when a gradient is not finite: ignore, warn, raise, or skip the optimizer step.

Skipping wraps the optimizer's ``step`` once (``SkipGuard``); each ``check(..., on_nonfinite="skip",
optimizer=opt)`` hands the guard the step's finite flag. Optimizers whose step takes a device-side
``found_inf`` (torch's fused Adam, AdamW and SGD, ``fused=True``) skip on the device with no host sync;
for the others the guard reads the flag, which is one sync per step. Counters of skipped steps are
device tensors, read only when asked for.

``max_consecutive_skips`` holds on both paths. Where the flag is read anyway, the limit is checked at
once. On the device-side path each step's counter is copied to the host asynchronously (8 bytes, no
sync) and read once the copy has landed, so the error comes at the check of the step that passed the
limit on a CPU, and at most two steps later on a GPU; the guard waits for a copy (a sync on an event,
not on the whole device) only when two are still in flight, i.e. when the host runs more than two
steps ahead of the GPU.

A step given a closure (``optimizer.step(closure)``, as PyTorch Lightning's automatic optimization
calls it, with backward and the ``check`` inside the closure) is decided after the closure: the guard
runs the closure itself, then looks at the flag that the closure's check handed it, and calls the
wrapped step without the closure; both a step and a skipped step return the closure's loss, as torch's
optimizers do. The exception is torch.optim.LBFGS (and its subclasses), which evaluates the closure
several times per step: its step is decided as before, on the flag of a check made before the step,
so with LBFGS call ``check`` between backward and ``step``, not inside the closure.

A check inside the closure of the very first step creates the guard while that step is already
running, too late to skip it. Create the guard before the first step (``SkipGuard.of(optimizer)``;
the Lightning and transformers integrations do); otherwise the guard drops the flag that step left
(a step post hook notices a step that did not pass through the guard), so that it cannot decide the
next step, and warns once.
"""

from __future__ import annotations

import functools
import types
import warnings
from collections import deque
from typing import Any

import torch

from .records import ranks_label

ON_NONFINITE = ("ignore", "warn", "raise", "skip")

# Host copies of the consecutive-skip counter still in flight before the guard waits for the oldest.
_MAX_COPIES_IN_FLIGHT = 2


class NonFiniteGradientError(RuntimeError):
    """Raised by ``check(..., on_nonfinite="raise")`` and by a guard past its consecutive-skip limit."""


def check_max_consecutive_skips(limit: int | None) -> None:
    """Raises ValueError for a negative limit."""
    if limit is not None and limit < 0:
        raise ValueError(f"nanscan: max_consecutive_skips must be >= 0 or None, got {limit}")


class SkipGuard:
    """Skips ``optimizer.step()`` when the last check found a NaN/Inf, and counts what it skipped.

    Attributes:
        max_consecutive_skips: raise NonFiniteGradientError when more consecutive steps than this
            were skipped (None: never). Checked at every check (``check_limit``); on the device-side
            path from asynchronous copies of the counter, so on a GPU up to two steps late.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, max_consecutive_skips: int | None = None) -> None:
        check_max_consecutive_skips(max_consecutive_skips)
        self.optimizer = optimizer
        self.max_consecutive_skips = max_consecutive_skips
        self._finite: torch.Tensor | None = None
        self._total: torch.Tensor | None = None
        self._consecutive: torch.Tensor | None = None
        self._last_skipped: torch.Tensor | None = None
        # (host copy of the consecutive-skip counter, event marking the copy done; None on a CPU)
        self._copies: deque[tuple[torch.Tensor, torch.cuda.Event | None]] = deque()
        self._device_side = bool(optimizer.defaults.get("fused")) and getattr(
            optimizer, "_step_supports_amp_scaling", False
        )
        self._in_step = False  # inside the wrapped step: a step that the guard decides
        self._stepped = False  # whether any step has passed through the guard yet
        self._held_back = False  # whether the guard's last step was held back on the host
        # LBFGS: as before (module notes). A wrapper that skips Optimizer.__init__ (accelerate's
        # AcceleratedOptimizer) has no hooks, and its step is no torch step that would call them.
        if not isinstance(optimizer, torch.optim.LBFGS) and hasattr(optimizer, "_optimizer_step_post_hooks"):
            optimizer.register_step_post_hook(self._after_any_step)
        original = optimizer.step

        # A bound method, like the step it replaces: an LR scheduler created after the guard rebinds
        # ``optimizer.step.__func__`` to count steps, which a plain function would not have.
        @functools.wraps(getattr(original, "__func__", original))
        def guarded_step(_optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> Any:
            return self._step(original, *args, **kwargs)

        optimizer.step = types.MethodType(guarded_step, optimizer)  # type: ignore[method-assign]

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
        if self._total is None or self._consecutive is None:
            total = consecutive = torch.zeros((), dtype=torch.int64, device=finite.device)
        else:
            total, consecutive = self._total, self._consecutive
        self._total = total + bad
        self._consecutive = (consecutive + bad) * bad
        self._last_skipped = bad.bool()
        if self._device_side and self.max_consecutive_skips is not None:
            self._copy_counter_to_host()

    def _copy_counter_to_host(self) -> None:
        counter = self._consecutive
        assert counter is not None
        if counter.device.type != "cuda":
            self._copies.append((counter, None))  # already on the host: readable at once
            return
        # A non-blocking copy into pinned memory (from torch's caching host allocator), ordered after
        # the counter's update on the current stream; the event says when it has landed.
        host = torch.empty((), dtype=counter.dtype, pin_memory=True)
        host.copy_(counter, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._copies.append((host, event))

    def check_limit(self) -> None:
        """Raises NonFiniteGradientError if more consecutive steps than ``max_consecutive_skips`` were
        skipped, judged from the counter copies that have reached the host (see the module notes)."""
        if not self._device_side:
            self._raise_past_limit()
            return
        while self._copies:
            copy, event = self._copies[0]
            if event is not None and not event.query():
                if len(self._copies) <= _MAX_COPIES_IN_FLIGHT:
                    return
                event.synchronize()
            self._copies.popleft()
            self._raise_past_limit(int(copy))

    def _step(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        self._in_step = self._stepped = True
        try:
            return self._closure_first(original, *args, **kwargs)
        finally:
            self._in_step = False

    def _closure_first(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        if self._finite is None and not isinstance(self.optimizer, torch.optim.LBFGS):
            closure, args, kwargs = _take_closure(args, kwargs)
            if closure is not None:
                # The check that decides this step runs inside the closure (backward is there), so the
                # closure must run before the decision. torch's optimizers call it under enable_grad;
                # so does the guard, for the same reason: step() may be entered under no_grad.
                with torch.enable_grad():
                    loss = closure()
                self._decide(original, *args, **kwargs)
                return loss
        return self._decide(original, *args, **kwargs)

    def _decide(self, original: Any, *args: Any, **kwargs: Any) -> Any:
        """Runs or skips the wrapped step on the flag the last check handed the guard."""
        finite, self._finite = self._finite, None
        self._held_back = False
        if finite is None:  # not armed by a check this step: an ordinary step
            return original(*args, **kwargs)
        if self._device_side:
            # A GradScaler may have set found_inf / grad_scale for this step already: combine with its
            # found_inf, keep its grad_scale, and put back whatever was there.
            missing = object()
            saved: dict[str, Any] = {
                name: getattr(self.optimizer, name, missing) for name in ("found_inf", "grad_scale")
            }
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
        self._held_back = True
        self._raise_past_limit()
        return None

    def _after_any_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        """Drops a flag armed during a step that did not pass through the guard (see the module
        notes): that step has been taken, and the flag must not decide the next one."""
        if self._in_step or self._finite is None:
            return
        self._finite = None
        if not self._stepped:
            self._stepped = True  # warn once
            warnings.warn(
                "nanscan: an optimizer step did not pass through the guard of check(..., on_nonfinite='skip'), "
                "so it could not be skipped: a check inside the closure of the first step creates the guard too "
                "late (call nanscan.SkipGuard.of(optimizer) before the first step), and a wrapper that saved "
                "optimizer.step before the guard existed calls the unguarded step",
                RuntimeWarning,
                stacklevel=3,  # the caller of optimizer.step, past torch's step wrapper
            )

    def _raise_past_limit(self, consecutive: int | None = None) -> None:
        if self.max_consecutive_skips is None:
            return
        if consecutive is None:
            consecutive = self.consecutive_skips
        if consecutive > self.max_consecutive_skips:
            self._copies.clear()
            raise NonFiniteGradientError(
                f"nanscan: {consecutive} consecutive optimizer steps skipped for non-finite gradients "
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
    def held_back(self) -> bool:
        """Whether the last step that passed through the guard was held back on the host, which the
        guard knows without a sync, having read the flag to decide it. A step skipped on the device (a
        fused optimizer's) is not held back: the host does not know of it without a sync
        (``last_skipped``)."""
        return self._held_back

    @property
    def last_skipped(self) -> bool:
        """Whether the last checked step was skipped; an LR scheduler can hold back on it (syncs)."""
        return self._last_skipped is not None and bool(self._last_skipped)


def _take_closure(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, tuple[Any, ...], dict[str, Any]]:
    """(closure or None, the remaining positional and keyword arguments) of an ``optimizer.step`` call:
    torch's optimizers take the closure as the first positional argument or as ``closure=`` (None, or
    anything not callable, is left where it is for the wrapped step)."""
    if callable(kwargs.get("closure")):
        kwargs = dict(kwargs)
        return kwargs.pop("closure"), args, kwargs
    if args and callable(args[0]):
        return args[0], args[1:], kwargs
    return None, args, kwargs


def act_on_nonfinite(
    report: Any, on_nonfinite: str, optimizer: torch.optim.Optimizer | None, max_consecutive_skips: int | None
) -> None:
    """Applies ``on_nonfinite`` to a fresh Report (see ``check``)."""
    if on_nonfinite == "ignore":
        return
    if on_nonfinite == "skip":
        assert optimizer is not None, "check() validates its arguments"
        guard = SkipGuard.of(optimizer, max_consecutive_skips)
        guard.arm(report.stats.finite)
        guard.check_limit()
        return
    if on_nonfinite == "raise":
        raise_on_nonfinite(report)
        return
    if report.finite:  # warn reads the flag: one sync
        return
    warnings.warn(nonfinite_message(report), RuntimeWarning, stacklevel=3)


def nonfinite_message(report: Any) -> str:
    """The parameters with NaN/Inf gradients, and the table of the worst ones. When the report carries
    a rank attribution (DTensors, ``process_group``, DDP with the hook), each name with the ranks whose
    local data held its NaN/Inf: ``0.weight (rank 3)``. Called after the sync that found the step
    non-finite; reading the ranks is part of the same host copy."""
    names = report.nonfinite
    if report.stats.ranks is not None:
        ranks = report.nonfinite_ranks
        names = [f"{name} ({ranks_label(ranks[name])})" if ranks.get(name) else name for name in names]
    return f"nanscan: non-finite gradients in {', '.join(names)}\n{report.table()}"


def raise_on_nonfinite(report: Any) -> None:
    """Raises NonFiniteGradientError naming the parameters if the Report is not finite (one sync)."""
    if not report.finite:
        raise NonFiniteGradientError(nonfinite_message(report))
