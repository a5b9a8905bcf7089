"""``Report``: the health of one step's gradients, as ``check`` and the GradScaler return it."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, TypedDict

import torch
import torch.distributed as dist

from .fused import ScanResult
from .layouts.reduce import Attribution
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
        subject: what was scanned: ``"gradients"``, or ``"state"`` (``check_state``: the weights' and
            the optimizer state's values), as a recorder's records say.
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
        *,
        subject: str = "gradients",
    ) -> None:
        self._names = stats.names if stats.names is not None else names
        self.subject = subject
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
        """The report's names as it holds them, a sequence formed lazily (``check(params)``, the
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
