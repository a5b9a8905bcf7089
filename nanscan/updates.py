"""``watch_updates(optimizer)``: each parameter's update-to-weight ratio ``‖Δw‖ / ‖w‖``, on sampled
optimizer steps, on the device.

    updates = nanscan.watch_updates(optimizer, model, every=10)   # every 10th optimizer.step()
    ...
    print(updates.ratios())     # one sync: {"fc.weight": 1.1e-3, ...} of the last sampled step
    updates.remove()            # or use it as a context manager

Practitioners watch the ratio per layer (around 1e-3 in healthy training); it is reported to spike
before the loss does, and a learning rate too high shows there first. The ratio is exact: on a
sampled step the weights are copied just before ``optimizer.step()`` (a step pre-hook), and after
it (a step post-hook) one pass gives each difference's norm and each weight's norm; their quotient
stays on the device. On the CPU and on CUDA that pass is one op, ``nanscan::scan_difference``, which
reads each copy and its weight once and writes nothing (the differences live run by run in the CPU
kernel's stack buffer, in the CUDA kernel's registers); on other devices, and for parameters spread
over several devices, the copies become the differences in place (``_foreach_sub_``) and are scanned
with the weights. The difference of two fp32 values is
exact when they are within a factor of two of each other (Sterbenz), and otherwise off by at most
2^-24 of itself; 16-bit weights are kept in fp32, where their difference is exact. So the norms are
those of the true update to fp32's precision, whatever the weights' dtype (tested against float64
with SGD, Adam and fused AdamW). No host sync: the ratios are read to the host only when asked for
(``ratios()``).

Memory: one copy of every weight the optimizer holds, in fp32 for 16-bit weights (``nbytes``: the
weights' bytes, twice them for bf16/fp16 weights), allocated at the first sampled step and kept.
Traffic on a sampled step, in passes over the weights' bytes: the copy (a read and a write) and
the fused difference scan (two reads), four on the CPU and on CUDA; elsewhere the in-place
difference (two reads, a write) and the scan (two reads), seven (benchmarks/NOTES.md, entries 36,
38 and 39). Unsampled steps cost two Python hooks.

A parameter whose weights are all zero has an infinite ratio once it moves (NaN if it does not); a
NaN or an Inf in the weights or the update makes its ratio NaN or Inf. DTensor parameters (FSDP2,
tensor parallel) are reduced over their meshes by the scan, so every rank gets the whole model's
ratios. FSDP1's flat parameters (or, with ``use_orig_params=True``, the original parameters' local
parts) are copied as they are, and their differences cut back into the parameters the user wrote as
``check_state`` cuts optimizer state, then reduced over FSDP's groups: the names are the model's, in
its order, and every rank gets each whole parameter's ratio. A step that a GradScaler skips (``scaler.step`` found an Inf) never calls
``optimizer.step()``, so it is not a step here either.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch

from . import layouts
from ._ops import has_fused_difference, scan_difference_op
from .fused import ScanResult
from .layouts import fsdp1
from .layouts.dtensor import has_dtensor, to_local
from .parameters import named_parameters
from .scan import scan


def _copy_dtype(dtype: torch.dtype) -> torch.dtype:
    """What a weight is kept in before the step: its own dtype from fp32 up; fp32 below it, where the
    difference of two 16-bit values (a small weight that an update moves by more than half of it:
    Sterbenz's lemma no longer holds) would round to 8 or 11 bits, and in fp32 is exact but where
    their exponents are 16 or more apart."""
    return dtype if dtype in (torch.float32, torch.float64) else torch.float32


class UpdateWatch:
    """Step hooks on an optimizer that measure each parameter's update-to-weight ratio on every
    ``every``-th step; see the module notes. Made by :func:`watch_updates`."""

    def __init__(
        self, optimizer: torch.optim.Optimizer, model_or_params: torch.nn.Module | Iterable[Any] | None, every: int
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"nanscan.watch_updates: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"nanscan.watch_updates: every must be a positive int (1: every step), got {every!r}")
        self.optimizer = optimizer
        self.every = every
        held = [p for group in optimizer.param_groups for p in group["params"]]
        # FSDP1: the optimizer holds flat parameters (or the original parameters' parts); the copies'
        # differences are cut into the parameters the user wrote as check_state cuts optimizer state.
        self._fsdp1: tuple[fsdp1.ModelLayout, Any] | None = None
        if fsdp1.flattened(held):
            self._fsdp1 = layouts.fsdp1_parameters(model_or_params if model_or_params is not None else held)
            assert self._fsdp1 is not None
            self.names = list(layouts.of_fsdp1_state(self._fsdp1, {}, ()).names or ())
            self._held = len(held)
        else:
            named: dict[int, str] = {}
            if model_or_params is not None:
                names, params = named_parameters(model_or_params, "watch_updates")
                named = {id(p): n for n, p in zip(names, params, strict=True)}
            self.names = [
                named.get(id(p), f"group{g}.param{j}")
                for g, group in enumerate(optimizer.param_groups)
                for j, p in enumerate(group["params"])
            ]
            self._held = len(self.names)
        self._steps = 0  # optimizer steps begun since the watch was attached
        self._sampled = 0  # of which measured
        self._sampling = False
        self._copies: list[torch.Tensor] = []
        # What the copies were made for: each parameter's (shape, dtype, device), checked at each
        # sampled step, with what follows from it (the devices, whether DTensors are among them).
        self._signature: list[tuple[torch.Size, torch.dtype, torch.device]] | None = None
        self._devices: set[torch.device] = set()
        self._dtensors = False  # DTensors among the parameters: their local shards are copied
        # The last measured step's norms, on the device: ‖Δw‖ per parameter, then ‖w‖ (the scan's
        # output as it lies), and their quotient.
        self._norms: torch.Tensor | None = None
        self._ratio: torch.Tensor | None = None
        self._recent = 0  # steps measured since a recorder last took the norms (_take_recent)
        self._handles = [
            optimizer.register_step_pre_hook(self._before),
            optimizer.register_step_post_hook(self._after),
        ]

    # ----------------------------------------------------------------------------------- hooks

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def _before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._sampling = self._steps % self.every == 0
        self._steps += 1
        if not self._sampling:
            return
        params = self._params()
        if len(params) != self._held:
            raise ValueError(
                f"nanscan.watch_updates: the optimizer holds {len(params)} parameters, not the {self._held} "
                "it held when watched (add_param_group after watch_updates): watch it again"
            )
        # Compared one parameter at a time, each tuple freed at once: a new list of 10,000 tuples
        # at every sampled step survived the young generations and set off full collections (~20 ms).
        signature = self._signature
        if (
            signature is None
            or len(signature) != len(params)
            or any(s != (p.shape, p.dtype, p.device) for s, p in zip(signature, params, strict=True))
        ):
            self._signature = [(p.shape, p.dtype, p.device) for p in params]
            self._copies = [torch.empty_like(p, dtype=_copy_dtype(p.dtype)) for p in params]
            self._devices = {device for _, _, device in self._signature}
            self._dtensors = has_dtensor(params)
        with torch.no_grad():
            # The parameters as they are, not detached (a detach per tensor would be most of the host
            # work): under no_grad nothing here is recorded for autograd. A DTensor's local shard
            # (DTensor has no sharding rule for the foreach copy): the copy is a DTensor of the same
            # placements, so its shard lines up.
            torch._foreach_copy_(self._local(self._copies), self._local(params))

    def _local(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors' local shards where DTensors are among the parameters, else the tensors."""
        return to_local(tensors) if self._dtensors else tensors

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._sampling:
            return
        self._sampling = False
        params = self._params()
        n = len(self.names)
        # The CPU and CUDA have the fused difference scan (each pair read once, nothing written), for a
        # list on one device; elsewhere the copies become the differences in place, then are scanned
        # with the weights (module notes).
        fused = len(self._devices) == 1 and has_fused_difference(next(iter(self._devices)))
        with torch.no_grad():
            if not fused:
                torch._foreach_sub_(self._local(self._copies), self._local(params))  # before minus after: -Δw
            if self._fsdp1 is not None:
                # The weights, then each one's copy (or difference), cut and reduced over FSDP's groups.
                held = {p: {"update": c} for p, c in zip(params, self._copies, strict=True)}
                layout = layouts.of_fsdp1_state(self._fsdp1, held, ("update",))
                if fused:
                    # Flat: an original parameter's copy keeps its shape where FSDP hands it out whole
                    # (NO_SHARD), its part of the weights is a slice of the flat shard.
                    parts = [part.reshape(-1) for part in layout.parts]
                    # The op's order (differences, then weights) turned into the layout's.
                    counts, stats, *totals = scan_difference_op(parts[n:], parts[:n])
                    local = ScanResult.from_op(counts.roll(n, 1), stats.roll(n, 1), *totals)
                    norms = layouts.reduce_local(layout, local).norm
                else:
                    norms = layouts.scan(layout).norm
                result_norm = torch.cat([norms[n:], norms[:n]])
            elif fused:
                # DTensors (the copies are DTensors where the parameters are): their shards, then the
                # layout's reduction over their meshes; plain tensors: this process's answer.
                layout = layouts.of_tensors(self._copies + params)
                parts = layouts.local_parts(layout)
                local = ScanResult.from_op(*scan_difference_op(parts[: len(params)], parts[len(params) :]))
                result_norm = (layouts.reduce_local(layout, local) if layout.distributed else local).norm
            else:
                # The copies (DTensors where the parameters are) go to the scan whole: it reduces them.
                result_norm = scan(self._copies + params).norm
        self._norms = result_norm
        self._ratio = result_norm[:n] / result_norm[n:]
        self._sampled += 1
        self._recent += 1

    # ----------------------------------------------------------------------------------- results

    @property
    def steps(self) -> int:
        """Optimizer steps since the watch was attached."""
        return self._steps

    @property
    def sampled(self) -> int:
        """Of which measured (every ``every``-th, the first included)."""
        return self._sampled

    @property
    def ratio(self) -> torch.Tensor | None:
        """The last measured step's ratios, a device tensor in ``names``' order (no sync), or None
        before the first."""
        return self._ratio

    @property
    def nbytes(self) -> int:
        """Memory held for the copies of the weights (0 before the first sampled step)."""
        return sum(c.numel() * c.element_size() for c in self._copies)

    @property
    def update_norm(self) -> torch.Tensor | None:
        """The last measured step's ‖Δw‖ per parameter, a device tensor (no sync), or None."""
        return None if self._norms is None else self._norms[: len(self.names)]

    @property
    def weight_norm(self) -> torch.Tensor | None:
        """The last measured step's ‖w‖ per parameter (after the step), a device tensor, or None."""
        return None if self._norms is None else self._norms[len(self.names) :]

    def _take_recent(self) -> tuple[torch.Tensor, int] | None:
        """For a recorder's row: the last measured step's norms (‖Δw‖ then ‖w‖, float32 or float64
        [2 * parameters], on the parameters' device) and how many steps were measured since the last
        take; None when none was. No sync: the count is the host's own."""
        if self._recent == 0 or self._norms is None:
            return None
        steps, self._recent = self._recent, 0
        return self._norms, steps

    def ratios(self) -> dict[str, float]:
        """The last measured step's ratios by parameter name (one sync); empty before the first."""
        if self._ratio is None:
            return {}
        return dict(zip(self.names, self._ratio.tolist(), strict=True))

    def __str__(self) -> str:
        ratios = self.ratios()
        head = f"update ratios ‖Δw‖/‖w‖ of {len(self.names)} parameters, {self._sampled} sampled steps of {self._steps}"
        if not ratios:
            return head + " (none measured yet)"
        largest = sorted(ratios.items(), key=lambda item: -item[1] if item[1] == item[1] else float("-inf"))
        lines = [head + "; the largest of the last:"]
        lines += [f"  {name}: {value:.3g}" for name, value in largest[:10]]
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"UpdateWatch({len(self.names)} parameters, every={self.every}, {self._sampled} sampled steps)"

    # ----------------------------------------------------------------------------------- lifetime

    def remove(self) -> None:
        """Removes the hooks and frees the copies; the last ratios stay readable."""
        while self._handles:
            self._handles.pop().remove()
        self._copies = []
        self._signature = None
        self._sampling = False

    def __enter__(self) -> UpdateWatch:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.remove()


def watch_updates(
    optimizer: torch.optim.Optimizer,
    model_or_params: torch.nn.Module | Iterable[Any] | None = None,
    *,
    every: int = 1,
) -> UpdateWatch:
    """Measures each parameter's update-to-weight ratio ``‖Δw‖/‖w‖`` on every ``every``-th
    ``optimizer.step()``, exactly and without a host sync (module notes: memory and cost).

    Args:
        optimizer: any ``torch.optim`` optimizer (plain, foreach or fused), or one that steps the same
            way (``step`` hooks).
        model_or_params: the model (or ``(name, parameter)`` pairs) whose names the ratios take; without
            it, ``"group<i>.param<j>"``.
        every: measure every ``every``-th step (the first included).

    Returns:
        An ``UpdateWatch``: ``ratio`` (device tensor), ``ratios()`` (one sync), ``remove()``.
    """
    return UpdateWatch(optimizer, model_or_params, every)
