"""``check(model)``: scan every gradient of a model, optionally clip, and report by parameter name."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, TypedDict, overload

import torch
import torch.distributed as dist

from . import ddp, distributed, walk
from .clip import (
    as_max_norm,
    as_norm_type,
    clip_grads_with_norm_,
    total_norm_of,
)
from .distributed import Attribution
from .guard import ON_NONFINITE, act_on_nonfinite, check_max_consecutive_skips, raise_on_nonfinite
from .scan import ScanResult, gradients_of, routed_scan

if TYPE_CHECKING:  # nanscan.replicas and nanscan.recorder import this module
    from .recorder import Recorder
    from .replicas import ReplicaCheck


class HostScalars(TypedDict):
    """A Report's totals as Python values: what every step reads."""

    total_norm: float
    finite: bool
    clip_coef: float | None


class HostValues(TypedDict):
    """A Report's per-tensor statistics as Python values: what a look at the gradients reads."""

    nan_count: list[int]
    inf_count: list[int]
    min: list[float]
    max: list[float]
    norm: list[float]
    # Per tensor, the attribution sums (count, rank sum, rank square sum) and the per-rank row, for
    # nonfinite_ranks; None for a single process.
    attribution: tuple[list[float], list[float], list[float], list[float]] | None


class Report:
    """The health of one step's gradients. Holds device tensors; reading a Python value syncs: the
    totals (``finite``, ``total_norm``, ``clip_coef``) in one small copy, and the first per-parameter
    value (``nonfinite``, ``table()``, ...) in one more, of everything, so that a step that only asks
    ``finite`` does not copy and convert thousands of per-parameter rows.

    Attributes:
        names: parameter names, one per scanned gradient (parameters without a gradient are skipped);
            a list, formed on first reading when the names are positions (``check(params)``). With
            ``process_group``, every rank's parameters, in rank order.
        stats: the ScanResult, per tensor in ``names`` order.
        norm_type: the norm type of ``total_norm`` (and of the clipping, when ``max_norm`` was given).
        max_norm: the clipping threshold, or None when ``check`` did not clip.
        clip_coef_tensor: the device tensor the gradients were multiplied by (1 means untouched), or None.
    """

    def __init__(
        self,
        names: Sequence[str],
        stats: ScanResult,
        total_norm: torch.Tensor,
        norm_type: float,
        max_norm: float | None = None,
        clip_coef: torch.Tensor | None = None,
        replicas: ReplicaCheck | None = None,
    ) -> None:
        self._names = stats.names if stats.names is not None else names
        self.replicas = replicas
        self.stats = stats
        self.total_norm_tensor = total_norm
        self.norm_type = norm_type
        self.max_norm = max_norm
        self.clip_coef_tensor = clip_coef
        self._scalars: HostScalars | None = None
        self._host: HostValues | None = None

    @property
    def names(self) -> list[str]:
        if not isinstance(self._names, list):
            self._names = list(self._names)
        return self._names

    @property
    def name_sequence(self) -> Sequence[str]:
        """The names as the report holds them: a sequence formed lazily (``check(params)``, the
        scaler) is not made a list, so a caller that only compares layouts stays cheap."""
        return self._names

    def _totals(self) -> HostScalars:
        """Copies the totals to the host in one small transfer (one sync), once."""
        if self._scalars is None:
            s = self.stats
            scalars = [self.total_norm_tensor.double().reshape(1), s.finite.double().reshape(1)]
            if s.consistent is not None:
                scalars.append(s.consistent.double().reshape(1))
            if self.clip_coef_tensor is not None:
                scalars.append(self.clip_coef_tensor.double().reshape(1))
            values = torch.cat(scalars).cpu().tolist()
            if s.consistent is not None and not values.pop(2):
                raise RuntimeError(
                    "nanscan: the ranks scanned different lists (shapes or placements differ between "
                    "ranks of one mesh), so the reduced statistics mean nothing: every rank must check "
                    "the same parameters in the same order"
                )
            self._scalars = {
                "total_norm": values[0],
                "finite": bool(values[1]),
                "clip_coef": values[2] if len(values) > 2 else None,
            }
        return self._scalars

    def _values(self) -> HostValues:
        """Copies every per-tensor statistic to the host in one transfer (one sync), once."""
        if self._host is None:
            self._totals()  # the consistency check, and the totals beside them
            s = self.stats
            rows = [s.nan_count.double(), s.inf_count.double(), s.min, s.max, s.norm]
            if s.ranks is not None:
                rows += s.ranks.rows()
            packed = torch.cat(rows).cpu()
            n = len(self._names)
            table = packed[: 5 * n].view(5, n).tolist()
            attribution = None
            if s.ranks is not None:
                rest = packed[5 * n :].tolist()
                attribution = (rest[:n], rest[n : 2 * n], rest[2 * n : 3 * n], rest[3 * n :])
            self._host = {
                "nan_count": [int(v) for v in table[0]],
                "inf_count": [int(v) for v in table[1]],
                "min": table[2],
                "max": table[3],
                "norm": table[4],
                "attribution": attribution,
            }
        return self._host

    @property
    def finite(self) -> bool:
        """True when no gradient holds a NaN or an Inf."""
        return self._totals()["finite"]

    @property
    def total_norm(self) -> float:
        """The total gradient norm of order ``norm_type`` (before clipping)."""
        return self._totals()["total_norm"]

    @property
    def clip_coef(self) -> float | None:
        """The factor the gradients were scaled by (1.0 when nothing was clipped), None without max_norm."""
        return self._totals()["clip_coef"]

    @property
    def clipped(self) -> bool:
        """Whether the gradients were rewritten by clipping."""
        coef = self.clip_coef
        return coef is not None and coef != 1.0

    @property
    def nonfinite(self) -> list[str]:
        """Names of the parameters whose gradient has a NaN or an Inf, in parameter order."""
        v = self._values()
        return [name for name, nan, inf in zip(self.names, v["nan_count"], v["inf_count"], strict=True) if nan or inf]

    @property
    def replicas_consistent(self) -> bool:
        """Whether every data-parallel replica holds every gradient bit for bit (one sync). Only for
        ``check(..., verify_replicas=True)``."""
        return self._replica_check().consistent

    @property
    def divergent(self) -> dict[str, list[int]]:
        """Each gradient whose replicas differ, with the ranks outside the majority (both sides with
        two replicas); empty when consistent. Only for ``check(..., verify_replicas=True)``."""
        return self._replica_check().divergent

    def _replica_check(self) -> ReplicaCheck:
        if self.replicas is None:
            raise ValueError("nanscan.Report: replicas were not compared; call check(..., verify_replicas=True)")
        return self.replicas

    @property
    def nonfinite_ranks(self) -> dict[str, list[int]]:
        """For each parameter in ``nonfinite``, the ranks whose local data (a DTensor's shard, a
        pipeline stage's gradient) held its NaN/Inf; the same on every rank. A single process is rank
        0 (or its rank in an initialized process group). Exact for one or two ranks, for all of them,
        and when the ranks with any NaN/Inf are exactly the ones; otherwise those ranks (a superset)."""
        v = self._values()
        if v["attribution"] is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            return {name: [rank] for name in self.nonfinite}
        count, rank_sum, rank_square_sum, any_by_rank = v["attribution"]
        return {
            self.names[i]: Attribution.ranks(count[i], rank_sum[i], rank_square_sum[i], any_by_rank)
            for i, (nan, inf) in enumerate(zip(v["nan_count"], v["inf_count"], strict=True))
            if nan or inf
        }

    def to_dict(self) -> dict[str, Any]:
        """Plain Python values: totals, and per-parameter statistics keyed by name."""
        v, totals = self._values(), self._totals()
        return {
            "finite": totals["finite"],
            "total_norm": totals["total_norm"],
            "norm_type": self.norm_type,
            "max_norm": self.max_norm,
            "clip_coef": totals["clip_coef"],
            "nonfinite": self.nonfinite,
            "nonfinite_ranks": self.nonfinite_ranks,
            "parameters": {
                name: {key: v[key][i] for key in ("nan_count", "inf_count", "min", "max", "norm")}
                for i, name in enumerate(self.names)
            },
        }

    def table(self, limit: int = 10) -> str:
        """The worst ``limit`` gradients: non-finite ones first (most NaN/Inf first), then largest norm."""
        v = self._values()
        order = sorted(
            range(len(self.names)),
            key=lambda i: (-(v["nan_count"][i] + v["inf_count"][i]), -_sortable(v["norm"][i])),
        )[:limit]
        width = max([len("parameter")] + [len(self.names[i]) for i in order])
        lines = [f"{'parameter':<{width}}  {'nan':>8} {'inf':>8} {'min':>11} {'max':>11} {'norm':>11}"]
        lines += [
            f"{self.names[i]:<{width}}  {v['nan_count'][i]:>8} {v['inf_count'][i]:>8} "
            f"{v['min'][i]:>11.4g} {v['max'][i]:>11.4g} {v['norm'][i]:>11.4g}"
            for i in order
        ]
        return "\n".join(lines)

    def __str__(self) -> str:
        v = self._totals()
        status = "finite" if v["finite"] else f"NON-FINITE in {len(self.nonfinite)} of {len(self.names)} gradients"
        head = f"nanscan report: {status}; total norm ({_norm_name(self.norm_type)}) {v['total_norm']:.6g}"
        if v["clip_coef"] is not None:
            head += f"; max_norm {self.max_norm:g}, clip coefficient {v['clip_coef']:.6g}"
        return head + "\n" + self.table() if self.names else head

    def __repr__(self) -> str:
        synced = (
            "synced" if self._host is not None else "totals synced" if self._scalars is not None else "not yet synced"
        )
        return f"<nanscan.Report of {len(self.names)} gradients, {synced}>"


def _sortable(x: float) -> float:
    return math.inf if math.isnan(x) else x


def _norm_name(norm_type: float) -> str:
    return "L2" if norm_type == 2.0 else f"L{norm_type:g}"


class LazyNames(Sequence[str]):
    """Parameter names formed when they are read: ``check`` and the scaler run every step, and a
    report's names are read only when it is shown (Report.names makes them a list then). Equal, like
    a list, to lists and to other LazyNames of the same strings, and so unhashable like one."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, LazyNames)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return repr(list(self))


class PositionalNames(LazyNames):
    """The names ``"[i]"`` of the entries at ``positions`` of a parameter list (``check(params)``)."""

    __slots__ = ("_positions",)

    def __init__(self, positions: Sequence[int]) -> None:
        self._positions = positions

    def __len__(self) -> int:
        return len(self._positions)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [f"[{i}]" for i in self._positions[index]]
        return f"[{self._positions[index]}]"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PositionalNames):  # without forming the strings
            return list(self._positions) == list(other._positions)
        return super().__eq__(other)

    __hash__ = None  # a class that defines __eq__ must say so again

    def __reduce__(self) -> tuple[type[PositionalNames], tuple[Sequence[int]]]:
        return PositionalNames, (self._positions,)


def named_gradients(model_or_params: torch.nn.Module | Iterable[Any]) -> tuple[Sequence[str], list[torch.Tensor]]:
    """(names, gradients) of the parameters that have a gradient.

    Accepts an ``nn.Module`` (names from ``named_parameters()``, whose walk is kept between calls:
    nanscan.walk), an iterable of parameters (named by position, ``"[3]"``) or an iterable of
    ``(name, parameter)`` pairs.
    """
    # Plain comprehensions, each .grad read once: an assignment expression inside one would make a
    # closure cell, which torch.compile(fullgraph=True) cannot trace.
    if isinstance(model_or_params, torch.nn.Module):
        # Parameters are tensors: no entry can need naming in an error.
        module_names, params = walk.named_parameters(model_or_params)  # the module walk, kept between calls
        all_grads = gradients_of(params)
        grads = [g for g in all_grads if g is not None]
        if len(grads) == len(module_names):
            return module_names, grads
        return [name for name, g in zip(module_names, all_grads, strict=True) if g is not None], grads
    if isinstance(model_or_params, torch.Tensor):
        pairs: Iterable[Any] = [("[0]", model_or_params)]
    else:
        items = model_or_params if isinstance(model_or_params, (list, tuple)) else list(model_or_params)
        try:
            # The common case, a list of parameters: comprehensions, names left to PositionalNames.
            all_grads = gradients_of(items)
        except AttributeError:
            pass  # (name, parameter) pairs, or an entry that is no tensor: named one by one below
        else:
            grads = [g for g in all_grads if g is not None]
            if len(grads) == len(items):
                return PositionalNames(range(len(items))), grads
            return PositionalNames([i for i, g in enumerate(all_grads) if g is not None]), grads
        if set(map(type, items)) == {tuple} and set(map(len, items)) == {2}:
            # A list of (name, parameter) pairs made once (list(model.named_parameters())): names
            # without the module tree. C-level maps and comprehensions, no per-pair Python branch.
            try:
                all_grads = gradients_of([p for _, p in items])
            except AttributeError:
                pass  # an entry that is no tensor: named one by one below
            else:
                grads = [g for g in all_grads if g is not None]
                if len(grads) == len(items):
                    return [str(name) for name, _ in items], grads
                return [str(name) for (name, _), g in zip(items, all_grads, strict=True) if g is not None], grads
        pairs = (
            item if isinstance(item, tuple) and len(item) == 2 else (f"[{i}]", item) for i, item in enumerate(items)
        )
    names: list[str] = []
    grads = []
    for name, p in pairs:
        try:
            grad = p.grad  # one attribute read: cheaper than an isinstance test against torch.Tensor
        except AttributeError:
            raise TypeError(f"nanscan.check: parameter {name!r} is a {type(p).__name__}, not a torch.Tensor") from None
        if grad is not None:
            names.append(str(name))
            grads.append(grad)
    return names, grads


def check(
    model_or_params: torch.nn.Module | Iterable[Any],
    *,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    on_nonfinite: str = "ignore",
    optimizer: torch.optim.Optimizer | None = None,
    max_consecutive_skips: int | None = None,
    process_group: Any = None,
    verify_replicas: bool = False,
    recorder: Recorder | None = None,
) -> Report:
    """Scans every gradient in one fused pass and returns a Report, without a host sync.

    Args:
        model_or_params: an ``nn.Module``, an iterable of parameters, or of ``(name, parameter)`` pairs.
        max_norm: when given, clips the gradients exactly like ``nanscan.clip_grad_norm_`` (and so
            ``torch.nn.utils.clip_grad_norm_``) with this threshold, reusing the scan's norm.
        norm_type: the order of ``Report.total_norm`` and of the clipping. 2 and inf come from the
            fused scan; other orders cost torch's own norm computation on top.
        on_nonfinite: what to do when a gradient has a NaN/Inf. ``"ignore"`` (default);
            ``"warn"`` or ``"raise"`` (NonFiniteGradientError naming the parameters), both of which
            read the finite flag (one sync); ``"skip"``: the next ``optimizer.step()`` does nothing
            (see SkipGuard: no sync with a fused optimizer, one otherwise).
        optimizer: the optimizer whose step ``"skip"`` guards.
        max_consecutive_skips: with ``"skip"``, raise NonFiniteGradientError after more consecutive
            skipped steps than this.
        process_group: ranks that each hold different parameters (pipeline stages): the report covers
            every rank's parameters (``names`` in rank order), and the clip uses the norm over all of
            them. DTensor gradients (FSDP2, tensor parallel) need no argument: their statistics are
            reduced over their meshes. Every rank of the group (or mesh) must call ``check``.
        verify_replicas: data parallelism (DDP, HSDP, replicas of a plain model, tensor-parallel
            Replicate gradients): also prove that every rank holds bit-identical copies of its
            gradients, from a checksum computed in the same scan and two small all-reduces per set of
            replicas (plain tensors: a DDP model's group, else the default group; DTensors: each mesh
            dim along which they are replicated); see ``Report.replicas_consistent`` and
            ``Report.divergent``, and nanscan.replicas.
        recorder: a ``nanscan.Recorder`` that keeps this step's statistics (appended on the device, no
            sync), with whether ``"skip"`` skipped the step; appended before ``"raise"`` raises.

    Example:
        >>> report = nanscan.check(model, max_norm=1.0)
        >>> if not report.finite:
        ...     print(report.nonfinite)
    """
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(
            f"nanscan.check: on_nonfinite must be one of {', '.join(map(repr, ON_NONFINITE))}, got {on_nonfinite!r}"
        )
    # Every argument is checked before any gradient is read or written.
    if on_nonfinite == "skip":
        if optimizer is None:
            raise ValueError("nanscan.check: on_nonfinite='skip' needs optimizer=<the optimizer whose step to skip>")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"nanscan.check: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_max_consecutive_skips(max_consecutive_skips)
    norm_type = as_norm_type(norm_type)
    if max_norm is not None:
        max_norm = as_max_norm(max_norm)
    if verify_replicas and process_group is not None:
        raise ValueError(
            "nanscan.check: verify_replicas compares replicas of the same parameters; process_group is for ranks "
            "that hold different ones (pipeline stages). Use nanscan.replicas.verify_replicas(..., process_group=...) "
            "for the replicas' own group"
        )
    names, grads = named_gradients(model_or_params)
    # DTensors (and process_group): their plan and local shards, made once for the scan, the norm's
    # dtype and the clip.
    view = distributed.local_view_if_distributed(grads, process_group)
    with torch.no_grad():
        stats = routed_scan(grads, names, False, verify_replicas, process_group, view)
        replicas = None
        if verify_replicas:
            from . import replicas as replicas_module

            assert stats.checksum is not None
            # The gradients themselves, not only their checksums: a DTensor's placements say which
            # ranks hold copies of its local part (HSDP's replicate dim, a tensor-parallel bias).
            replicas = replicas_module.compare_tensors(
                names, grads, stats.checksum, replicas_module.replica_group(model_or_params, None)
            )
        scanner = ddp.scanner_of(model_or_params)
        if scanner is not None:  # DDP with nanscan's hook: which ranks' own gradients held a NaN/Inf
            params = [p for p in walk.named_parameters(model_or_params)[1] if p.grad is not None]  # type: ignore[arg-type]
            stats = ddp.with_attribution(stats, scanner, params)
        total = total_norm_of(grads, stats, norm_type, process_group, view.dtypes() if view is not None else None)
        # (Across processes the flag and the total are global, so every rank takes the same branch.)
        clips = max_norm is not None and (len(grads) > 0 or process_group is not None)
        if on_nonfinite == "raise" and clips and not bool(stats.finite):
            # Before the clip, as torch's error_if_nonfinite: a NaN coefficient would rewrite every
            # gradient, and the error is there to stop the step with the gradients as they came.
            early = Report(names, stats, total, norm_type)
            if recorder is not None:
                recorder.append(early)
            raise_on_nonfinite(early)
        scaled = view.shards if view is not None else grads
        coef = clip_grads_with_norm_(scaled, max_norm, total) if clips and max_norm is not None else None
    report = Report(names, stats, total, norm_type, max_norm, coef, replicas)
    if recorder is not None:
        recorder.append(report, skipped=~stats.finite if on_nonfinite == "skip" else False)
    act_on_nonfinite(report, on_nonfinite, optimizer, max_consecutive_skips)
    return report
