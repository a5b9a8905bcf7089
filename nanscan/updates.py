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

Without a copy (``sketch=k``): each weight is kept between the two hooks as a CountSketch
(``nanscan::sketch``, csrc/common/sketch_rules.h), a float64 vector of at most k buckets that is
linear in the weights, so the sketch after the step minus the sketch before it is the sketch of the
update, and its squared length estimates ‖Δw‖² without bias. Each block of 64 elements draws from a
hash an offset and 64 signs; its elements go, signed, to 64 consecutive buckets (mod k). Two elements
of different blocks share a bucket with probability 1/k, those of one block never, so the estimate's
variance is at most 2‖Δw‖⁴/k, whatever the update's shape (a few embedding rows, one column, dense):
‖Δw‖ is off by about 1/sqrt(2k) of itself (2.2% at k = 1024; tests/test_updates.py measures it on
sparse SGD and dense Adam steps), and a tensor of at most k elements is measured exactly (its sketch
is its values). ‖w‖ is exact (the same pass sums its squares in float64). Memory: 16 bytes a bucket,
``sum(min(numel, k))`` buckets (the sketches before the step and which weight each bucket belongs
to): 2.1 MB for GPT-2 small at k = 1024, where the exact ratio keeps 498 MB (llama-1b: 2.4 MB
against 6.0 GB). Traffic: two reads of the weights a sampled step, nothing of their size written. On
the CPU the sums are made in a fixed order, so an untouched weight reads exactly 0; on CUDA the units'
shares of a bucket are added by atomics in no fixed order, so it reads about 1e-16 (float64's
rounding of the weights' sketch, not a real update). Sharded weights (FSDP2, FSDP1) are sketched
per local part and the parts' squared norms summed over the layout's ranks as the exact ratio's are.
Every rank hashes alike, so that replicated weights give every rank the same estimate; the errors of
one parameter's parts may then be correlated, but the error of their sum stays within the bound of
one tensor's (it is at most the sum of the parts' deviations).

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

import math
from collections.abc import Iterable
from types import TracebackType
from typing import Any, NamedTuple

import torch

from . import layouts
from ._ops import has_fused_difference, scan_difference_op, sketch_op
from .composite import SKETCH_BUCKETS
from .fused import ScanResult, group_by_device, upload
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


def _check_sketch(sketch: object) -> int | None:
    if sketch is None:
        return None
    if isinstance(sketch, bool) or not isinstance(sketch, int) or sketch not in SKETCH_BUCKETS:
        raise ValueError(
            "nanscan.watch_updates: sketch must be None (the exact ratio, from a copy of the weights) or a "
            f"power of two from {SKETCH_BUCKETS[0]} to {SKETCH_BUCKETS[-1]} (buckets per weight tensor; the "
            f"ratio's relative error is about 1/sqrt(2 * sketch)), got {sketch!r}"
        )
    return sketch


class _Segments(NamedTuple):
    """A device's weights as the sketch's buckets see them."""

    indices: list[int]  # their places among all the weights
    ids: torch.Tensor  # int64 [buckets]: the weight each bucket belongs to
    where: torch.Tensor | None  # int64: their places among all the weights, when on several devices


class _Sketches:
    """The copy-free side of an update watch: each weight's CountSketch before the step, per device
    (module notes). ``measure`` turns the sketches after the step into each weight's ‖Δw‖² estimate and
    its ‖w‖²."""

    # One hash on every rank: replicated weights (DDP, a tensor-parallel norm) then give every rank the
    # same estimate. The errors of one parameter's shards may then be correlated, but the sum of their
    # estimates keeps the bound of one tensor's (module notes).
    SEED = 0

    def __init__(self, buckets: int) -> None:
        self.buckets = buckets
        self._before: dict[torch.device, torch.Tensor] = {}
        # Per device: its weights and which of them each bucket belongs to, made at the first measured
        # step after the weights' shapes, dtypes or devices changed (forget_shapes), then kept: a
        # sampled step of 10,000 weights spent a third of its host time remaking them.
        self._segments: dict[torch.device, _Segments] = {}

    def forget_shapes(self) -> None:
        """The weights changed shape, dtype or device: the segments are made again."""
        self._segments = {}

    def _segments_of(self, parts: list[torch.Tensor]) -> dict[torch.device, _Segments]:
        if not self._segments:
            groups = group_by_device(parts)
            first = parts[0].device
            for device, indices in groups.items():
                counts = [min(parts[i].numel(), self.buckets) for i in indices]
                # Made on the device from uploaded counts (no host sync: output_size is known here).
                ids = torch.repeat_interleave(
                    torch.arange(len(counts), device=device),
                    upload(counts, torch.int64, device),
                    output_size=sum(counts),
                )
                where = upload(indices, torch.int64, first) if len(groups) > 1 else None
                self._segments[device] = _Segments(indices, ids, where)
        return self._segments

    def take(self, parts: list[torch.Tensor]) -> None:
        """Sketches the weights before the step (one pass per device, nothing else kept)."""
        self._before = {
            device: sketch_op([parts[i] for i in segments.indices], self.buckets, self.SEED)[0]
            for device, segments in self._segments_of(parts).items()
        }

    def measure(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """float64 [len(parts)] each, on the first part's device: the estimated ‖Δw‖² of each part since
        ``take`` and its ‖w‖² now, with no host sync."""
        first = parts[0].device
        change = torch.empty(len(parts), dtype=torch.float64, device=first)
        squares = torch.empty(len(parts), dtype=torch.float64, device=first)
        for device, segments in self._segments_of(parts).items():
            after, sumsq = sketch_op([parts[i] for i in segments.indices], self.buckets, self.SEED)
            difference = after.sub_(self._before[device]).square_()
            per_part = torch.zeros(len(segments.indices), dtype=torch.float64, device=device)
            per_part.index_add_(0, segments.ids, difference)
            if segments.where is None:
                change, squares = per_part, sumsq
            else:  # weights on several devices: gathered on the first (device-to-device copies)
                change[segments.where] = per_part.to(first, non_blocking=True)
                squares[segments.where] = sumsq.to(first, non_blocking=True)
        self._before = {}
        return change, squares

    @property
    def nbytes(self) -> int:
        """Memory a measured step takes: the sketches before the step (float64) and which weight each
        bucket belongs to (int64), 16 bytes a bucket (0 before the first measured step)."""
        return sum(s.ids.numel() * (8 + s.ids.element_size()) for s in self._segments.values())


class UpdateWatch:
    """Step hooks on an optimizer that measure each parameter's update-to-weight ratio on every
    ``every``-th step; see the module notes. Made by :func:`watch_updates`."""

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model_or_params: torch.nn.Module | Iterable[Any] | None,
        every: int,
        sketch: int | None = None,
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"nanscan.watch_updates: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"nanscan.watch_updates: every must be a positive int (1: every step), got {every!r}")
        self.optimizer = optimizer
        self.every = every
        #: Buckets per weight tensor of the copy-free estimate, or None for the exact ratio.
        self.sketch = _check_sketch(sketch)
        self._sketches = _Sketches(self.sketch) if self.sketch is not None else None
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
            if self._sketches is None:
                self._copies = [torch.empty_like(p, dtype=_copy_dtype(p.dtype)) for p in params]
            else:
                self._sketches.forget_shapes()
            self._devices = {device for _, _, device in self._signature}
            self._dtensors = has_dtensor(params)
        if self._sketches is not None:
            self._sketches.take(self._sketched_parts(params)[0])
            return
        with torch.no_grad():
            # The parameters as they are, not detached (a detach per tensor would be most of the host
            # work): under no_grad nothing here is recorded for autograd. A DTensor's local shard
            # (DTensor has no sharding rule for the foreach copy): the copy is a DTensor of the same
            # placements, so its shard lines up.
            torch._foreach_copy_(self._local(self._copies), self._local(params))

    def _local(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors' local shards where DTensors are among the parameters, else the tensors."""
        return to_local(tensors) if self._dtensors else tensors

    def _sketched_parts(self, params: list[torch.Tensor]) -> tuple[list[torch.Tensor], layouts.Layout]:
        """What the sketches read on this rank, the weights' local parts, and the layout that reduces
        their norms: of the weights twice over (the updates' entries, then the weights'; FSDP1's the
        other way round, as its state layout orders them), so that one reduction serves both."""
        if self._fsdp1 is not None:
            layout = layouts.of_fsdp1_state(self._fsdp1, {p: {"update": p} for p in params}, ("update",))
            return layout.parts[: len(self.names)], layout
        layout = layouts.of_tensors(params + params)
        return layouts.local_parts(layout)[: len(params)], layout

    def _measure_sketched(self, params: list[torch.Tensor]) -> torch.Tensor:
        """‖Δw‖ (estimated) then ‖w‖ per parameter, reduced over the layout's ranks, from the sketches."""
        assert self._sketches is not None
        n = len(self.names)
        parts, layout = self._sketched_parts(params)
        change, squares = self._sketches.measure(parts)
        if not layout.distributed:
            return torch.cat([change, squares]).sqrt_()
        # The layout's entries: FSDP1's weights then updates, others' updates then weights.
        first, second = (squares, change) if self._fsdp1 is not None else (change, squares)
        norms = torch.cat([first, second]).sqrt_()
        zeros = torch.zeros(2 * n, dtype=torch.int64, device=norms.device)
        local = ScanResult(
            zeros,
            zeros,
            torch.full_like(norms, math.inf),
            torch.full_like(norms, -math.inf),
            norms,
            norms.square().sum().sqrt(),
            torch.ones((), dtype=torch.bool, device=norms.device),
        )
        reduced = layouts.reduce_local(layout, local).norm
        return torch.cat([reduced[n:], reduced[:n]]) if self._fsdp1 is not None else reduced

    def _after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if not self._sampling:
            return
        self._sampling = False
        params = self._params()
        n = len(self.names)
        if self._sketches is not None:
            self._record(self._measure_sketched(params))
            return
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
        self._record(result_norm)

    def _record(self, norms: torch.Tensor) -> None:
        """Keeps a measured step's norms (‖Δw‖ per parameter, then ‖w‖) and their quotients."""
        n = len(self.names)
        self._norms = norms
        self._ratio = norms[:n] / norms[n:]
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
        """Memory held for the copies of the weights, or with ``sketch``, what the sketches take (0
        before the first sampled step)."""
        if self._sketches is not None:
            return self._sketches.nbytes
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
        method = "" if self.sketch is None else f", sketch={self.sketch}"
        return f"UpdateWatch({len(self.names)} parameters, every={self.every}{method}, {self._sampled} sampled steps)"

    # ----------------------------------------------------------------------------------- lifetime

    def remove(self) -> None:
        """Removes the hooks and frees the copies (or sketches); the last ratios stay readable."""
        while self._handles:
            self._handles.pop().remove()
        self._copies = []
        if self.sketch is not None:
            self._sketches = _Sketches(self.sketch)
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
    sketch: int | None = None,
) -> UpdateWatch:
    """Measures each parameter's update-to-weight ratio ``‖Δw‖/‖w‖`` on every ``every``-th
    ``optimizer.step()``, exactly and without a host sync (module notes: memory and cost).

    Args:
        optimizer: any ``torch.optim`` optimizer (plain, foreach or fused), or one that steps the same
            way (``step`` hooks).
        model_or_params: the model (or ``(name, parameter)`` pairs) whose names the ratios take; without
            it, ``"group<i>.param<j>"``.
        every: measure every ``every``-th step (the first included).
        sketch: None for the exact ratio, from a copy of the weights; or a bucket count (a power of two
            from 64 to 4096) for an estimate that keeps no copy: each weight's CountSketch before and
            after the step, 16 bytes a bucket, at most ``sketch`` buckets a tensor. ‖Δw‖'s relative
            error is about ``1/sqrt(2 * sketch)`` (2.2% at 1024), whatever the update's shape; a
            tensor of at most ``sketch`` elements is measured exactly (module notes).

    Returns:
        An ``UpdateWatch``: ``ratio`` (device tensor), ``ratios()`` (one sync), ``remove()``.
    """
    return UpdateWatch(optimizer, model_or_params, every, sketch)
