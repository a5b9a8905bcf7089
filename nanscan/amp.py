"""Mixed-precision integration: a GradScaler whose unscale_ is nanscan's fused pass.

``nanscan.amp.GradScaler`` is a drop-in subclass of ``torch.amp.GradScaler``: same constructor,
methods, scale trajectory and skipped steps. Its ``unscale_`` multiplies every gradient by the
inverse scale in place (torch's arithmetic, bit for bit) and, in the same pass, computes nanscan's
statistics of the unscaled gradients (``last_report``); ``found_inf`` comes from them.

``scaler.clip_grad_norm_(optimizer, max_norm)`` is ``unscale_`` and ``clip_grad_norm_`` in one call:
the clip uses the statistics of the pass that unscaled the gradients, so unscale + check + clip cost
one read and one write of every gradient when nothing needs clipping (torch: three reads and two
writes). Statistics are never kept from one call to the next: between two calls nothing can prove
the gradients unchanged (a write through ``.grad.data`` or numpy bumps no version counter), so a
separate ``nanscan.clip_grad_norm_`` or ``nanscan.check`` after ``unscale_`` reads the gradients
again (two reads and one write in all).

With an optimizer that unscales inside its own step (``fused=True``), torch's scaler does not unscale
the gradients; it scans them as they are, still scaled. ``last_report`` then holds that scan's
statistics divided by the scale, so it describes unscaled gradients on every path.

One deliberate difference from torch's GradScaler, rare: ``found_inf`` is decided on the unscaled
values, so when the scale has fallen below 1 and the unscale itself overflows a finite gradient, the
step is skipped (torch would step with an Inf gradient).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.amp.grad_scaler import OptState

from . import layouts, walk
from ._ops import scale_, unscale_scan_
from .activations import ActivationWatch, ModuleActivations
from .clip import (
    as_max_norm,
    as_norm_type,
    clip_grad_norm_,
    clip_grads_with_norm_,
    raise_if_nonfinite,
    total_norm_of,
)
from .fused import ScanResult, empty_result
from .layouts.reduce import group_device
from .names import LazyNames
from .recorder import Recorder
from .report import Report

_SCANNED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class GradScaler(torch.amp.GradScaler):
    """``torch.amp.GradScaler`` with a fused unscale + scan. Constructor and methods as torch's.

    Attributes:
        last_report: the Report of the gradients as the last unscale left them, always of unscaled
            values (names from ``watch(model)``, else the parameters' positions in the optimizer,
            ``"group0.param3"``); after ``clip_grad_norm_`` it also holds the clip coefficient. None
            before the first unscale, and after one that took torch's own path (sparse gradients,
            or gradients on several devices).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.last_report: Report | None = None
        self._last_found_inf: list[torch.Tensor] = []
        self._names: dict[int, str] = {}
        # Set only while torch's step scans still-scaled gradients for a fused optimizer.
        self._scanning_scaled: torch.Tensor | None = None
        # Set only inside clip_grad_norm_, between its unscale and its clip: the layout the unscale
        # scanned (its names and gradients), and their statistics. Never outlives the call, so never
        # describes stale values.
        self._scanned: tuple[layouts.Layout, ScanResult] | None = None
        self._keep_scan = False
        self._recorder: Recorder | None = None

    def watch(self, model: torch.nn.Module) -> GradScaler:
        """Names the reports' parameters after ``model.named_parameters()`` (as the user wrote them:
        nanscan.names) instead of their position in the optimizer (``"group0.param3"``); and, for a
        model whose gradients are sharded (FSDP1), lets the scaler reduce its optimizer's gradients
        over the model's ranks. Returns the scaler."""
        layouts.learn(model)
        walked = walk.walk(model)
        # A new dict, not an update: names formed before (OptimizerNames compares dicts by identity)
        # stay as they were.
        self._names = self._names | dict(zip(map(id, walked.parameters), walked.names, strict=True))
        return self

    def record(self, recorder: Recorder | None) -> GradScaler:
        """Appends each unscale's report to ``recorder`` (nanscan.Recorder), with the loss scale and
        whether the step is skipped; ``clip_grad_norm_`` appends once, with its clip coefficient. No
        sync. Record each step in one place: not here and in ``check(..., recorder=...)`` too. Steps
        that take torch's own path (sparse gradients, several devices) have no report to record.
        ``None`` stops recording. Returns the scaler."""
        self._recorder = recorder
        return self

    def _record(self, report: Report) -> None:
        if self._recorder is None:
            return
        found = self._last_found_inf
        device = report.stats.norm.device
        # The step is skipped when any device found an Inf/NaN (a float32 flag per device).
        skipped: torch.Tensor | bool = (
            False if not found else found[0] if len(found) == 1 else torch.stack([f.to(device) for f in found]).amax()
        )
        self._recorder.append(report, skipped=skipped, loss_scale=self._scale)

    @property
    def skipped(self) -> bool:
        """Whether the last unscaled step had a NaN/Inf, i.e. whether ``step`` skipped (or will skip)
        the optimizer step. Reading it syncs; nothing before it does."""
        return any(bool(f.item()) for f in self._last_found_inf)

    def clip_grad_norm_(
        self,
        optimizer: torch.optim.Optimizer,
        max_norm: float,
        norm_type: float = 2.0,
        error_if_nonfinite: bool = False,
    ) -> torch.Tensor:
        """``unscale_(optimizer)`` and ``clip_grad_norm_`` of the optimizer's gradients, in one pass.

        Replaces ``scaler.unscale_(opt); torch.nn.utils.clip_grad_norm_(params, max_norm)``: the
        unscale scans the gradients as it writes them, and the clip uses those statistics, so with
        nothing to clip the gradients are read once and written once. Returns the total norm of the
        unscaled gradients (as ``clip_grad_norm_`` does); ``last_report`` names the bad parameters
        and holds the clip coefficient. If ``unscale_`` was already called for this optimizer this
        step, the gradients are scanned again (nothing proves them unchanged since).

        Non-finite gradients are clipped as torch clips them (by a NaN coefficient); ``step`` skips
        the optimizer step either way. Syncs nothing unless ``error_if_nonfinite`` is set.
        """
        max_norm = as_max_norm(max_norm)
        norm_type = as_norm_type(norm_type)
        scanned = None
        # A disabled scaler has no per-optimizer state: it never unscales, so this call records.
        ready = self._enabled and self._per_optimizer_states[id(optimizer)]["stage"] is OptState.READY
        scanned_by_unscale = not self._enabled or ready
        if ready:
            self._keep_scan = True
            try:
                self.unscale_(optimizer)
                scanned, self._scanned = self._scanned, None
            finally:
                self._keep_scan = False
        if scanned is None:  # already unscaled, or a scaler that is disabled: scan now
            layout = self._optimizer_layout(optimizer, allow_fp16=True)
            if layout is None:  # sparse or exotic gradients: nanscan's clip, which defers to torch
                self.last_report = None
                params = [p for group in optimizer.param_groups for p in group["params"]]
                return clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite)
            with torch.no_grad():
                scanned = (layout, layouts.scan(layout))
        layout, stats = scanned
        assert layout.names is not None
        with torch.no_grad():
            total = total_norm_of(layout, stats, norm_type)
            if error_if_nonfinite:
                raise_if_nonfinite(total, norm_type)
            coef = (
                clip_grads_with_norm_(layout.scaled, max_norm, total) if layout.scaled or layout.distributed else None
            )
        self.last_report = Report(layout.names, stats, total, norm_type, max_norm, coef)
        if scanned_by_unscale:  # else unscale_ ran earlier this step and recorded it: once per step
            self._record(self.last_report)
        return total

    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # torch's step for optimizers that unscale inside their own step (fused=True): it scans the
        # gradients as they are, still multiplied by the scale (inv_scale 1). The report divides.
        self._scanning_scaled = self._scale
        try:
            return super()._check_inf_per_device(optimizer)
        finally:
            self._scanning_scaled = None

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool,
    ) -> dict[torch.device, torch.Tensor]:
        layout = self._optimizer_layout(optimizer, allow_fp16)
        if layout is not None and layout.distributed:
            return self._unscale_distributed(layout, inv_scale)
        report_parts = self._unscale_scan(layout.parts, inv_scale) if layout is not None else None
        if layout is None or report_parts is None:
            # Sparse (coalesced by torch) or exotic gradients: torch's own path, without a report.
            self.last_report = None
            self._last_found_inf = []
            result = super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)
            self._last_found_inf = list(result.values())
            return result
        found_per_device: dict[torch.device, torch.Tensor] = {}
        for outputs in report_parts:
            # torch's found_inf is a float32 scalar per device: 1.0 when anything was not finite.
            found_per_device[outputs[3].device] = (~outputs[3]).to(torch.float32)
        self._last_found_inf = list(found_per_device.values())
        if len(report_parts) == 1:  # one device: the outputs describe the whole list, in its order
            self._report(layout, ScanResult.from_op(*report_parts[0]))
        else:
            self.last_report = None  # several devices: found_inf is exact, the per-device stats are not merged
        return found_per_device

    def _report(self, layout: layouts.Layout, stats: ScanResult) -> None:
        """``last_report`` of an unscale's statistics (of unscaled values), recorded or kept for the clip."""
        assert layout.names is not None
        if self._scanning_scaled is not None:
            stats = stats.scaled(self._scanning_scaled.double().reciprocal())
        self.last_report = Report(layout.names, stats, stats.total_norm, 2.0)
        if self._keep_scan:
            self._scanned = (layout, stats)  # clip_grad_norm_ records, with its coefficient
        else:
            self._record(self.last_report)

    def _unscale_distributed(self, layout: layouts.Layout, inv_scale: torch.Tensor) -> dict[torch.device, torch.Tensor]:
        """The unscale of gradients sharded over ranks (FSDP1, DTensors; ``watch(model)`` first for
        FSDP1): this rank's parts unscaled and scanned in the fused pass, the statistics reduced over
        the model's ranks, and ``found_inf`` from the global flag, so that every rank skips the step
        together, as torch's ShardedGradScaler makes them."""
        with torch.no_grad():
            plan = layout.plan
            if plan is not None and plan.partial:  # a Partial DTensor's stats need its parts reduced first
                if layout.scaled:
                    scale_(layout.scaled, inv_scale.to(layout.scaled[0].device))
                stats = layouts.scan(layout)
            else:
                parts = layout.parts
                local = (
                    ScanResult.from_op(*unscale_scan_(parts, inv_scale.to(parts[0].device)))
                    if parts
                    else empty_result(False, group_device(layout.process_group))
                )
                stats = layouts.reduce_local(layout, local)
        found = (~stats.finite).to(torch.float32)
        self._last_found_inf = [found]
        self._report(layout, stats)
        return {found.device: found}

    @staticmethod
    def _unscale_scan(grads: list[torch.Tensor], inv_scale: torch.Tensor) -> list[tuple[torch.Tensor, ...]] | None:
        """The fused unscale + scan, one call per device: the op's outputs per device (one entry when
        every gradient is on one device), or None when a gradient is sparse (torch's own unscale
        handles those)."""
        with torch.no_grad():
            try:
                # One call for the usual list, all on one device and dense: the op validates every entry
                # (its device and layout too) before it writes any, so a refused list is as it was.
                return [unscale_scan_(grads, inv_scale.to(grads[0].device))]
            except (RuntimeError, TypeError):
                if any(g.is_sparse for g in grads):
                    return None
                by_device: dict[torch.device, list[int]] = defaultdict(list)
                for index, grad in enumerate(grads):
                    by_device[grad.device].append(index)
                if len(by_device) == 1:
                    raise
                return [
                    unscale_scan_([grads[i] for i in indices], inv_scale.to(device))
                    for device, indices in by_device.items()
                ]

    def _optimizer_layout(self, optimizer: torch.optim.Optimizer, allow_fp16: bool) -> layouts.Layout | None:
        """The layout of the optimizer's parameters' gradients (those that have one, in torch's order
        and with torch's errors), named after ``watch`` or their place in the optimizer; None when
        one of them needs torch's own unscale.

        Runs every step over every parameter, so it is comprehensions (each ``.grad`` read once) and
        the names are formed only when a report is read (``OptimizerNames``)."""
        groups = [group["params"] for group in optimizer.param_groups]
        params = all_params = [p for group_params in groups for p in group_params]
        try:
            all_grads = [p.grad for p in params]
        except AttributeError:
            bad = next(p for p in params if not isinstance(p, torch.Tensor))
            raise AssertionError(f"expected param to be torch.Tensor, got {type(bad).__name__}") from None
        grads = [g for g in all_grads if g is not None]
        if len(grads) < len(params):
            params = [p for p, g in zip(params, all_grads, strict=True) if g is not None]
        dtypes = {g.dtype for g in grads}
        if not allow_fp16 and torch.float16 in dtypes:
            raise ValueError("Attempting to unscale FP16 gradients.")
        if not dtypes.issubset(_SCANNED_DTYPES):
            return None
        # Made even where this rank holds no gradient: an FSDP1 rank whose shard holds none of these
        # parameters' elements still joins the reduction that gives every rank the same found_inf
        # (as torch's ShardedGradScaler all-reduces it), or the others wait for it.
        layout = layouts.of_parameter_list(all_params, grads, deepspeed=False)
        if layout.cut:  # named after the parameters FSDP1 flattened
            return layout
        if not grads:
            return None
        names = OptimizerNames(params, all_params, [len(group_params) for group_params in groups], self._names)
        # A sparse gradient is found by the op's validation, before it writes (_unscale_grads_).
        return dataclasses.replace(layout, names=names)


class OptimizerNames(LazyNames):
    """The names of an optimizer's parameters that have a gradient: the name ``watch`` gave a parameter,
    else its place in the optimizer, ``"group0.param3"``. Holds what the scaler already had (the flat
    parameter list and the group sizes), so a step pays nothing for names that are never read."""

    __slots__ = ("_all_params", "_group_sizes", "_known", "_names", "_params")

    def __init__(self, params: list[Any], all_params: list[Any], group_sizes: list[int], known: dict[int, str]) -> None:
        self._params = params
        self._all_params = all_params
        self._group_sizes = group_sizes
        self._known = known
        self._names: list[str] | None = None

    def _resolved(self) -> list[str]:
        if self._names is None:
            places: dict[int, str] = {}
            start = 0
            for g, size in enumerate(self._group_sizes):
                for i, p in enumerate(self._all_params[start : start + size]):
                    places[id(p)] = f"group{g}.param{i}"
                start += size
            self._names = [self._known.get(id(p)) or places[id(p)] for p in self._params]
        return self._names

    def __len__(self) -> int:
        return len(self._params)

    def _name_at(self, position: int) -> str:
        return self._resolved()[position]

    def __eq__(self, other: object) -> bool:
        # A recorder compares each step's names with the last step's: the same parameters (by
        # identity, C-level loops) in the same groups, named by the same watch() dict, are the same
        # names, found without forming a string.
        if isinstance(other, OptimizerNames) and self._known is other._known:
            return (
                self._group_sizes == other._group_sizes
                and _identical(self._params, other._params)
                and _identical(self._all_params, other._all_params)
            )
        return super().__eq__(other)

    __hash__ = None  # a class that defines __eq__ must say so again


def _identical(a: list[Any], b: list[Any]) -> bool:
    return a is b or (len(a) == len(b) and all(map(operator.is_, a, b)))


FP16_MAX = 65504.0


@dataclass
class Advice:
    """The Advisor's answer.

    Attributes:
        recommendation: ``"nonfinite"`` (some observed gradients already held NaN/Inf: ``nonfinite``
            names them; no precision setting is advice enough until that is fixed), ``"keep"`` (fp16
            holds these gradients), ``"loss-scale"`` (change the scaler's settings:
            ``suggested_init_scale``), ``"bf16"`` (fp16's range does not fit; bf16 has fp32's range) or
            ``"fp32-modules"`` (a few modules overflow fp16: keep ``fp32_modules`` in fp32, what a
            hand-written ``force_fp32`` does); with an activation watch, also ``"incomplete"`` (all
            that was read fits, but some modules' outputs could not be read:
            ``ModuleActivations.unread``, so nothing says they fit).
        reasons: the evidence, one sentence each.
        nonfinite: the parameters whose gradient held a NaN or an Inf in an observed step, in order.
        activation_headroom: with an activation watch, the smallest headroom (65504 over the largest
            ``|activation|``) of the modules whose outputs stayed finite; None without a watch.
    """

    recommendation: str
    reasons: list[str]
    fp32_modules: list[str] = field(default_factory=list)
    suggested_init_scale: float | None = None
    nonfinite: list[str] = field(default_factory=list)
    activation_headroom: float | None = None

    def __str__(self) -> str:
        return f"nanscan AMP advice: {self.recommendation}\n" + "\n".join(f"  - {r}" for r in self.reasons)


_NAMED_AT_MOST = 8  # parameters named in a reason sentence; the rest are counted
# Activation islands this many or more, and over module_share_threshold of the modules watched, make
# the advice bf16: one or two modules of a small model are islands to keep in fp32, not a spread.
_SPREAD_AT_LEAST = 3


@dataclass(frozen=True)
class _Evidence:
    """What the Advisor has seen, as device tensors (per parameter unless said otherwise)."""

    overflow: torch.Tensor  # finite values above fp16's 65504
    underflow: torch.Tensor  # non-zero values below 2^-24
    max_abs: torch.Tensor  # largest finite magnitude
    nan_steps: torch.Tensor  # steps whose gradient held a NaN
    inf_steps: torch.Tensor  # steps whose gradient held an Inf
    nonfinite_steps: torch.Tensor  # scalar: steps with a NaN/Inf anywhere

    @classmethod
    def of(cls, r: ScanResult) -> _Evidence:
        """One step's evidence, from a scan with the fp16-range counts."""
        assert r.fp16_overflow is not None and r.fp16_underflow is not None, "scan(..., fp16_range=True)"
        # Tensors with no finite value have min=+inf/max=-inf: nan_to_num turns those into 0.
        finite_abs = torch.maximum(r.min.abs(), r.max.abs()).nan_to_num(0.0, 0.0, 0.0)
        return cls(
            r.fp16_overflow,
            r.fp16_underflow,
            finite_abs,
            (r.nan_count > 0).to(torch.int64),
            (r.inf_count > 0).to(torch.int64),
            (~r.finite).to(torch.int64),
        )

    def plus(self, step: _Evidence) -> _Evidence:
        return _Evidence(
            self.overflow + step.overflow,
            self.underflow + step.underflow,
            torch.maximum(self.max_abs, step.max_abs),
            self.nan_steps + step.nan_steps,
            self.inf_steps + step.inf_steps,
            self.nonfinite_steps + step.nonfinite_steps,
        )


class Advisor:
    """Watches gradients over steps, and optionally activations, and says whether fp16 (with a loss
    scale) can hold them.

    ``observe(model)`` runs the fused scan with the fp16-range counts (one pass, no sync) and adds its
    counts to device-side totals; ``advise()`` reads them once. Observe unscaled gradients: those of
    bf16/fp32 training, or after ``scaler.unscale_`` on steps the scaler did not skip. Any observed
    NaN/Inf gradient makes the advice ``"nonfinite"``, naming the parameters.

    With ``activations`` (a :func:`nanscan.watch_activations` watch on the model), the advice also
    rests on each module's forward outputs, where fp16 overflow usually begins:

    * a module whose outputs went NaN/Inf first while running in fp16, or whose finite outputs come
      within ``activation_margin`` (2x) of 65504, is an fp32 island (``"fp32-modules"``: run it with
      autocast disabled, what a hand-written ``force_fp32`` does), with its amax and headroom;
    * when such modules are more than ``module_share_threshold`` of the modules watched (and three
      or more), ``"bf16"``;
    * when more than ``underflow_threshold`` of the activation values would flush to zero in fp16
      (a loss scale acts on gradients only), ``"bf16"``;
    * non-finite activations in a run without fp16 are no precision matter: ``"nonfinite"``;
    * ``"keep"`` only when both the activations and the gradients fit, with the headroom stated.

    The activation evidence decides before the gradients' (a NaN activation makes NaN gradients; its
    module is the cause); either alone is enough: an evaluation-only run observes no gradient.
    """

    def __init__(
        self,
        underflow_threshold: float = 1e-3,
        module_share_threshold: float = 0.25,
        activations: ActivationWatch | None = None,
        activation_margin: float = 2.0,
    ) -> None:
        if activations is not None and not isinstance(activations, ActivationWatch):
            raise TypeError(
                "nanscan.amp.Advisor: activations must be a nanscan.watch_activations(model) watch, got "
                f"{type(activations).__name__}"
            )
        self.underflow_threshold = underflow_threshold
        self.module_share_threshold = module_share_threshold
        self.activations = activations
        self.activation_margin = activation_margin
        self.names: Sequence[str] | None = None
        self.numels: list[int] = []
        self.steps = 0
        self._evidence: _Evidence | None = None

    def observe(self, model_or_params: torch.nn.Module | Any) -> ScanResult:
        """Scans the current gradients once and accumulates the fp16 evidence; returns the scan."""
        layout = (
            layouts.of_module(model_or_params)
            if isinstance(model_or_params, torch.nn.Module)
            else layouts.of_parameters(model_or_params)
        )
        names = layout.names
        assert names is not None
        if self.names is None:
            self.names, self.numels = names, layouts.numels(layout)
        elif names != self.names:
            raise ValueError(
                "nanscan.amp.Advisor: the set of parameters with gradients changed between observe() calls"
            )
        with torch.no_grad():
            r = layouts.scan(layout, fp16_range=True, sparse=True)
            step = _Evidence.of(r)
            self._evidence = step if self._evidence is None else self._evidence.plus(step)
        self.steps += 1
        return r

    def advise(self) -> Advice:
        """The recommendation and its reasons, from everything observed so far (one sync per
        device, and one for the activation watch)."""
        if (self.names is None or self._evidence is None) and self.activations is None:
            raise RuntimeError("nanscan.amp.Advisor: call observe() at least once before advise()")
        gradients = self._gradient_advice() if self._evidence is not None else None
        if self.activations is None:
            assert gradients is not None
            return gradients
        return self._with_activations(gradients, self.activations)

    def _gradient_advice(self) -> Advice:
        names, evidence = self.names, self._evidence
        assert names is not None and evidence is not None
        advice = self._range_advice(names, evidence)
        nan_steps, inf_steps = evidence.nan_steps.tolist(), evidence.inf_steps.tolist()
        bad = [i for i, (n, f) in enumerate(zip(nan_steps, inf_steps, strict=True)) if n or f]
        if not bad:
            return advice
        nonfinite = [names[i] for i in bad]

        def describe(i: int) -> str:
            kinds = [f"NaN in {nan_steps[i]}"] * bool(nan_steps[i]) + [f"Inf in {inf_steps[i]}"] * bool(inf_steps[i])
            return f"{names[i]} ({' and '.join(kinds)} step(s))"

        named = ", ".join(describe(i) for i in bad[:_NAMED_AT_MOST])
        more = f" and {len(bad) - _NAMED_AT_MOST} more" if len(bad) > _NAMED_AT_MOST else ""
        reasons = [
            advice.reasons[0],
            f"{int(evidence.nonfinite_steps)} of {self.steps} observed step(s) had NaN/Inf gradients, in "
            f"{len(bad)} parameter(s): {named}{more}",
            "no precision setting is advice enough until they are fixed: nanscan.locate(model) names the "
            "module that makes them; under a GradScaler, observe only the steps it did not skip "
            "(scaler.skipped), since its first steps overflow by design",
            f"for the finite values, the range evidence alone would say '{advice.recommendation}'",
            *advice.reasons[1:],
        ]
        return Advice("nonfinite", reasons, advice.fp32_modules, advice.suggested_init_scale, nonfinite)

    def _with_activations(self, gradients: Advice | None, watch: ActivationWatch) -> Advice:
        """The gradient advice (None: no gradient observed) with the activation evidence; see the
        class docstring for the order in which the evidence decides."""
        read = watch._read()  # one sync
        figures = [f for f in read.figures if f.calls > 0]
        grad_reasons = [f"gradients: {r}" for r in gradients.reasons] if gradients is not None else []
        if not figures:
            if gradients is None:
                raise RuntimeError(
                    "nanscan.amp.Advisor: nothing observed yet: run a forward pass of the watched model, or "
                    "observe() gradients, before advise()"
                )
            reasons = ["activations: no forward pass of the watched model was scanned yet", *grad_reasons]
            return dataclasses.replace(gradients, reasons=reasons)
        finite = [f for f in figures if f.finite]
        headroom = min((f.headroom for f in finite), default=math.inf)

        def cite(f: ModuleActivations) -> str:
            room = "inf" if math.isinf(f.headroom) else f"{f.headroom:.3g}"
            ranks = f", rank(s) {', '.join(map(str, f.ranks))}" if f.ranks else ""
            return f"{f.name or '(model)'} ({f.op}: amax {f.amax:.4g}, headroom {room}{ranks})"

        reasons = [
            f"activations: {len(figures)} modules watched over {read.passes} forward pass(es); the smallest "
            f"headroom of the finite ones is {'inf' if math.isinf(headroom) else f'{headroom:.3g}'} (65504 / amax)"
        ]
        maker = read.figures[read.first_slot] if read.first_slot is not None else None
        if maker is not None and maker.fp16_calls == 0:
            reasons.append(
                f"activations: {maker.name or '(model)'} ({maker.op}) output NaN/Inf first, in a run without fp16: "
                "no precision matter; nanscan.locate(model) shows which of its inputs or ops made it"
            )
            return self._decided("nonfinite", reasons, grad_reasons, gradients, headroom)
        near = [f for f in finite if f.headroom < self.activation_margin]
        islands = ([maker] if maker is not None else []) + near
        if maker is not None:
            where = f" on rank(s) {', '.join(map(str, maker.ranks))}" if maker.ranks else ""
            reasons.append(
                f"activations: {maker.name or '(model)'} ({maker.op}) was the first module whose fp16 outputs held "
                f"NaN/Inf ({maker.nan} NaN, {maker.inf} Inf{where}): fp16's range was exceeded inside it"
            )
        if near:
            listed = ", ".join(cite(f) for f in near[:_NAMED_AT_MOST])
            more = f" and {len(near) - _NAMED_AT_MOST} more" if len(near) > _NAMED_AT_MOST else ""
            over = sum(f.overflow for f in near)
            reasons.append(
                f"activations: {len(near)} module(s) overflow fp16 or come within {self.activation_margin:g}x of "
                f"65504 ({over} values above it): {listed}{more}"
            )
        if islands:
            if len(islands) >= _SPREAD_AT_LEAST and len(islands) / len(figures) > self.module_share_threshold:
                reasons.append(
                    f"activations: the overflow is spread over {len(islands)} of {len(figures)} modules: bf16 has "
                    "fp32's range"
                )
                return self._decided("bf16", reasons, grad_reasons, gradients, headroom)
            modules = [f.name for f in islands]
            reasons.append(
                "activations: keep these modules in fp32 (autocast disabled inside them, what force_fp32 does): "
                + ", ".join(m or "(model)" for m in modules)
            )
            if gradients is not None and gradients.recommendation == "fp32-modules":
                modules += [m for m in gradients.fp32_modules if m not in modules]
            return self._decided("fp32-modules", reasons, grad_reasons, gradients, headroom, modules)
        elements = sum(f.elements for f in figures)
        flushed = sum(f.underflow for f in figures) / max(1, elements)
        if gradients is not None and gradients.recommendation != "keep":
            return self._decided(gradients.recommendation, reasons, grad_reasons, gradients, headroom)
        if flushed > self.underflow_threshold:
            worst = sorted(figures, key=lambda f: -f.underflow / max(1, f.elements))[:3]
            reasons.append(
                f"activations: {flushed:.2%} of activation values are non-zero but below 2^-24 and would be zeros in "
                f"fp16, most in {', '.join(f.name or '(model)' for f in worst)}; a loss scale acts on gradients only"
            )
            return self._decided("bf16", reasons, grad_reasons, gradients, headroom)
        unread = [f for f in read.figures if f.unread > 0]
        if unread:
            listed = ", ".join(f"{f.name or '(model)'} ({f.unread})" for f in unread[:_NAMED_AT_MOST])
            more = f" and {len(unread) - _NAMED_AT_MOST} more" if len(unread) > _NAMED_AT_MOST else ""
            reasons.append(
                f"activations: {len(unread)} module(s) output tensors the watch could not read (tensor subclasses, "
                f"sparse or meta tensors): {listed}{more}; nothing says those fit fp16, so 'keep' is not advised"
            )
            return self._decided("incomplete", reasons, grad_reasons, gradients, headroom)
        reasons.append(
            f"activations fit fp16 with a headroom of {'inf' if math.isinf(headroom) else f'{headroom:.3g}'}x and "
            f"{flushed:.2e} of values underflowing"
            + ("" if gradients is not None else "; no gradient was observed (observe() them too in training)")
        )
        return self._decided("keep", reasons, grad_reasons, gradients, headroom)

    @staticmethod
    def _decided(
        recommendation: str,
        reasons: list[str],
        grad_reasons: list[str],
        gradients: Advice | None,
        headroom: float,
        modules: list[str] | None = None,
    ) -> Advice:
        return Advice(
            recommendation,
            reasons + grad_reasons,
            modules if modules is not None else (gradients.fp32_modules if gradients is not None else []),
            gradients.suggested_init_scale if gradients is not None else None,
            gradients.nonfinite if gradients is not None else [],
            headroom,
        )

    def _range_advice(self, names: Sequence[str], evidence: _Evidence) -> Advice:
        """The advice that fp16's range alone gives, from the finite values observed."""
        overflow = evidence.overflow.tolist()
        underflow = evidence.underflow.tolist()
        max_abs = evidence.max_abs.tolist()
        elements = sum(self.numels) * self.steps
        peak = max(max_abs) if max_abs else 0.0
        headroom = FP16_MAX / peak if peak > 0 else math.inf
        reasons = [
            f"{self.steps} step(s) observed over {len(names)} gradients; largest finite |g| {peak:.4g} is "
            f"{peak / FP16_MAX:.3g}x fp16's limit of 65504"
        ]
        total_overflow, total_underflow = sum(overflow), sum(underflow)
        if total_overflow:
            modules = module_shares(names, self.numels, overflow)
            share = sum(self.numels[i] for i, n in enumerate(overflow) if n) / max(1, sum(self.numels))
            reasons.append(
                f"{total_overflow} gradient values ({total_overflow / elements:.2e} of all) exceed 65504 and would be "
                f"Inf in fp16, in {', '.join(modules)} ({share:.0%} of the parameters)"
            )
            if share <= self.module_share_threshold:
                return Advice(
                    "fp32-modules", [*reasons, "the overflow is confined to these modules: run them in fp32"], modules
                )
            return Advice(
                "bf16", [*reasons, "the overflow is widespread: bf16 has fp32's range and needs no loss scale"]
            )
        flushed = total_underflow / max(1, elements)
        if flushed > self.underflow_threshold:
            reasons.append(
                f"{flushed:.2%} of gradient values are non-zero but below 2^-24: fp16 would flush them to zero"
            )
            if headroom >= 4:
                scale = 2.0 ** math.floor(math.log2(headroom / 2))
                reasons.append(f"a loss scale up to {scale:g} keeps the largest value under 65504 with a 2x margin")
                return Advice("loss-scale", reasons, suggested_init_scale=scale)
            reasons.append("there is no headroom to scale them up without overflowing: fp16's range is too narrow")
            return Advice("bf16", reasons)
        reasons.append(
            f"only {flushed:.2e} of values underflow fp16 and none overflow it: fp16's range holds these gradients"
        )
        return Advice("keep", reasons)


def module_shares(names: Sequence[str], numels: list[int], counts: list[int]) -> list[str]:
    """Module names (parameter name minus its last component) that have a non-zero count, in order."""
    modules: list[str] = []
    for name, count in zip(names, counts, strict=True):
        module = name.rsplit(".", 1)[0] if "." in name else name
        if count and module not in modules:
            modules.append(module)
    return modules
