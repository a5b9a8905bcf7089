"""Gradients spread over processes: DTensor shards (FSDP2, tensor parallel, HSDP) and hand-made
sharding (pipeline stages, ``process_group=``), reduced in at most two collectives per mesh.

The kernel does not change: each rank scans its local data (a DTensor's local shard, its own
parameters' gradients) in the same one fused pass. What differs from a single process is the
reduction of the per-tensor results, all of it here:

* Every statistic that sums (NaN and Inf counts, sums of squares, the attribution rows below) goes
  into one float64 buffer, reduced by one SUM all-reduce; every one that takes a maximum (max, -min,
  the layout fingerprint) into another, reduced by one MAX all-reduce. So two collectives per
  distinct device mesh (and two more across ``process_group``), with a payload of O(tensors + ranks),
  never O(tensors x ranks), both in flight at once, issued on the device's stream: no host sync (with
  NCCL; gloo on the CPU is synchronous by nature).
* The total norm alone (``clip_grad_norm_``, ``get_total_norm``: ``total_norm``) needs no per-tensor
  statistic on other ranks: each rank combines its counted local parts first, so a mesh costs one
  collective of one number (L2: a SUM of squares) or two (inf: a MAX of a NaN flag and a magnitude).
  On gloo (2 processes on a 2-core VM) a collective costs its latency, 0.15-0.3 ms, or in a large
  share of calls of three numbers or more a ~4 ms stall (a scheduler tick); its size barely matters.
* NaN and Inf reach the norms by IEEE arithmetic: a NaN or Inf norm squares to NaN or Inf and every
  SUM keeps it (NaN + Inf is NaN), so a reduced sum of squares is the square of torch's norm. Counts
  and flags, never norms, say whether a tensor is finite (a finite 1e20 gradient stays finite).
* Replicated mesh dims are counted once: only the replica at coordinate 0 of each of a tensor's
  Replicate dims adds its counts and squares (the max and min are the same on every replica); the
  others add zeros, selected (``where``), not multiplied: a NaN square times 0 is NaN.
* Partial placements are reduced first (redistributed to Replicate, one collective per such tensor;
  gradients of FSDP2 and tensor parallel are Shard or Replicate, so this is rare).
* Which rank held a NaN/Inf, per tensor, without a per-rank row per tensor: each rank adds, for each
  tensor whose local part is non-finite, 1, its rank and its rank squared (three SUM rows), and a 1 at
  its own position of a per-rank row of the length of the world. From the count n, the sum s1 and
  the sum of squares s2 the ranks are exact for one rank (s1) or two (the roots of a quadratic);
  for more, the n-subsets of the ranks flagged in the per-rank row whose sums match (searched on the
  host, on the rare path, while the search is small) are, in practice, one; otherwise their union,
  a superset (Attribution.ranks).
* Every rank must scan the same list for a mesh's reduction to mean anything: a fingerprint of the
  group's shapes and placements travels in the MAX buffer (as h and -h), and a Report refuses to
  read statistics whose ranks disagreed.
* With ``checksum=True`` the statistics are global as always, but the checksums are of this rank's
  local parts, unreduced: they are compared between the replicas of a part (nanscan.replicas), which
  the plan lists too (``_Plan.replicated``: the tensors that have copies along each mesh dim).

With ``process_group``, each rank's list is its own (a pipeline stage's parameters): the lists of all
ranks are laid end to end (their names gathered once per distinct list, a host collective), each rank
fills its own segment and the union is reduced, so every rank gets every rank's statistics under
their names.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import operator
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.distributed as dist

from .scan import ScanResult, empty_result, scan_local

_LOCAL_TENSOR = operator.attrgetter("_local_tensor")  # a DTensor's local shard
_SPEC = operator.attrgetter("_spec")  # a DTensor's layout (mesh, placements, shape, dtype)

# SUM rows, per tensor: statistics that add up over shards, then the attribution rows.
_NAN, _INF, _SUMSQ, _BAD, _RANK_SUM, _RANK_SQUARE_SUM = range(6)
_COUNTED_ROWS = (_NAN, _INF, _SUMSQ)  # masked on replicas; attribution rows are not
_FP16_OVERFLOW, _FP16_UNDERFLOW = 6, 7  # only with fp16_range
_PLANS = 8  # cached reduction plans (one per distinct list layout)
_SUBSETS_SEARCHED = 200_000  # rank subsets tried when attributing a NaN held by three ranks or more


def dtensor_class() -> type[torch.Tensor] | None:
    """torch's DTensor class if its module was imported (no DTensor can exist otherwise), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls


def has_dtensor(tensors: Sequence[object]) -> bool:
    cls = dtensor_class()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def to_local(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The local part of each tensor: a DTensor's local shard (no copy), other tensors as they are.

    Read from the DTensor's ``_local_tensor`` attribute: what ``to_local()`` returns outside autograd,
    without its Python method call (a microsecond per tensor, most of a check's host time on a list
    of thousands of DTensors); by one C-level map while every entry is a DTensor (half the time)."""
    try:
        return list(map(_LOCAL_TENSOR, tensors))
    except AttributeError:  # plain tensors among them
        return [getattr(t, "_local_tensor", t) for t in tensors]


@dataclass(frozen=True)
class Attribution:
    """Which ranks' local data held a NaN/Inf, per tensor (device tensors, reduced over the ranks).

    Attributes:
        count: float64 [N], how many ranks' local part of the tensor held a NaN/Inf.
        rank_sum: float64 [N], the sum of those ranks.
        rank_square_sum: float64 [N], the sum of their squares.
        any_by_rank: float64 [world], 1 for every rank whose local data held any NaN/Inf.
    """

    count: torch.Tensor
    rank_sum: torch.Tensor
    rank_square_sum: torch.Tensor
    any_by_rank: torch.Tensor

    def rows(self) -> list[torch.Tensor]:
        """The device tensors a Report copies to the host (with the rest, in one transfer)."""
        return [self.count, self.rank_sum, self.rank_square_sum, self.any_by_rank]

    @staticmethod
    def ranks(count: float, rank_sum: float, rank_square_sum: float, any_by_rank: Sequence[float]) -> list[int]:
        """The ranks of one tensor, from its host values (see the module notes on when exact)."""
        n = round(count)
        if n <= 0:
            return []
        if n == 1:
            return [round(rank_sum)]
        if n == 2:  # r1 + r2 = s1, r1^2 + r2^2 = s2: the roots of r^2 - s1 r + (s1^2 - s2) / 2
            spread = math.sqrt(max(0.0, 2 * rank_square_sum - rank_sum * rank_sum))
            return sorted({round((rank_sum - spread) / 2), round((rank_sum + spread) / 2)})
        candidates = [r for r, flagged in enumerate(any_by_rank) if flagged > 0]
        if n >= len(candidates):
            return candidates
        # The n-subsets of the ranks with any NaN/Inf whose sum and sum of squares match: one, in
        # practice; their union otherwise. Only while the search is small (this runs on a rare path).
        if math.comb(len(candidates), n) > _SUBSETS_SEARCHED:
            return candidates
        s1, s2 = round(rank_sum), round(rank_square_sum)
        matches = [c for c in itertools.combinations(candidates, n) if sum(c) == s1 and sum(r * r for r in c) == s2]
        return sorted({r for c in matches for r in c}) if matches else candidates


@dataclass
class _Group:
    """Tensors reduced together over one process group: a mesh's, or ``process_group``'s."""

    indices: list[int]
    group: Any  # a ProcessGroup, or None for the default (world) group
    counted: list[bool]  # per tensor: this rank adds its counts and squares (False on extra replicas)
    fingerprint: float  # the same on every rank that scans the same layout
    # Made once, on the buffers' device (a host-to-device copy per call would be a sync point):
    device: torch.device | None = None  # where the tensors below are
    index: torch.Tensor | None = None  # the indices
    fingerprints: torch.Tensor | None = None  # [h, -h]
    counted_mask: torch.Tensor | None = None  # bool [N], ``counted``; None when every tensor counts
    row_masks: dict[int, torch.Tensor | None] = field(default_factory=dict)  # by row count: bool [R, N],
    # False on the counted rows of the tensors this rank does not count

    def _made_on(self, device: torch.device) -> None:
        if self.device != device:
            self.index = torch.tensor(self.indices, device=device)
            self.fingerprints = torch.tensor([self.fingerprint, -self.fingerprint], dtype=torch.float64, device=device)
            every = all(self.counted)
            self.counted_mask = None if every else torch.tensor(self.counted, dtype=torch.bool, device=device)
            self.row_masks = {}
            self.device = device

    def index_on(self, device: torch.device) -> torch.Tensor:
        self._made_on(device)
        assert self.index is not None
        return self.index

    def fingerprints_on(self, device: torch.device) -> torch.Tensor:
        self._made_on(device)
        assert self.fingerprints is not None
        return self.fingerprints

    def counted_on(self, device: torch.device) -> torch.Tensor | None:
        """The counted flags (bool [N]), or None when this rank counts every tensor of the group."""
        self._made_on(device)
        return self.counted_mask

    def row_mask_on(self, device: torch.device, rows: int) -> torch.Tensor | None:
        """Which of the SUM rows [rows, N] this rank adds (bool), or None when it adds all of them."""
        counted = self.counted_on(device)
        if counted is None:
            return None
        if rows not in self.row_masks:
            mask = torch.ones((rows, len(self.indices)), dtype=torch.bool, device=device)
            for row in (*_COUNTED_ROWS, _FP16_OVERFLOW, _FP16_UNDERFLOW):
                if row < rows:
                    mask[row] = counted
            self.row_masks[rows] = mask
        return self.row_masks[rows]


@dataclass
class Replicated:
    """The tensors of a list whose local parts are copies of each other along one mesh dim (its
    placement is Replicate, or Partial, reduced to Replicate before the scan), or, with ``mesh``
    None, the list's plain tensors (copies over whatever group holds the replicas: DDP's)."""

    mesh: Any  # a DeviceMesh, or None for the plain tensors
    dim: int | None  # the mesh dim along which the copies lie; None for the plain tensors
    indices: list[int]  # positions in the list, ascending
    index: torch.Tensor | None = None  # the indices on the checksums' device, made on first use

    def index_on(self, device: torch.device) -> torch.Tensor:
        """The indices on ``device``, made once (a host-to-device copy per call would be a sync)."""
        if self.index is None or self.index.device != device:
            self.index = torch.tensor(self.indices, dtype=torch.int64, device=device)
        return self.index


@dataclass
class _Plan:
    """How one list layout is reduced: its mesh groups, made once per distinct layout."""

    groups: list[_Group]
    plain: list[int]  # indices of the plain tensors (in no group: this rank's own, never reduced)
    partial: list[int]  # indices of DTensors with a Partial placement (reduced before the scan)
    specs: list[Any]  # the DTensorSpecs of the layout, held so that their ids stay theirs
    # Per (mesh, mesh dim) with copies, in order of first appearance (so every rank, holding the same
    # list, compares them in the same order); the plain tensors under (None, None). A tensor
    # replicated along two dims is in two; one sharded along every dim of its mesh in none.
    replicated: list[Replicated]
    # The dtypes of the DTensor entries, from their specs (a spec holds its tensor's dtype, so a
    # cached plan knows them: reading 1,000 shards' dtypes costs 0.1 ms a call); None if a spec
    # lacks its tensor metadata, and then they are read from the shards.
    dtensor_dtypes: frozenset[torch.dtype] | None
    plain_index: torch.Tensor | None = None  # ``plain`` on the scan's device, made on first use

    def plain_on(self, device: torch.device) -> torch.Tensor:
        if self.plain_index is None or self.plain_index.device != device:
            self.plain_index = torch.tensor(self.plain, dtype=torch.int64, device=device)
        return self.plain_index


# Plans by the ids of the tensors' DTensorSpecs (None for plain tensors). FSDP2 gives a parameter's
# gradient the same spec object every step, so the key is found with no per-tensor work beyond id():
# placements and meshes hash in Python, at a microsecond per tensor. A plan holds its specs, so an id
# in a key cannot be another object's while the plan is cached.
_plans: OrderedDict[tuple[int, ...], _Plan] = OrderedDict()
_unions: dict[tuple[Any, ...], tuple[list[str], list[int]]] = {}


def mesh_group(mesh: Any) -> Any:
    """The process group spanning every rank of a mesh."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return None  # the default group
    return mesh._flatten().get_group()  # an N-d sub-mesh: torch makes (and caches) the flattened group


def _fingerprint(layout: Sequence[Any]) -> float:
    """48 bits of a hash of a group's layout: exact in float64, equal on ranks with equal layouts."""
    digest = hashlib.blake2b(repr(layout).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "little"))


def _plan(key: tuple[int, ...], specs: list[Any]) -> _Plan:
    """The reduction plan of a list of DTensorSpecs (None for plain tensors), cached under ``key``."""
    by_mesh: dict[Any, list[int]] = {}
    for i, spec in enumerate(specs):
        if spec is not None:
            by_mesh.setdefault(spec.mesh, []).append(i)
    groups = []
    for mesh, indices in by_mesh.items():
        coordinate = mesh.get_coordinate()
        counted = [
            all(coordinate[d] == 0 for d, p in enumerate(specs[i].placements) if p.is_replicate() or p.is_partial())
            for i in indices
        ]
        description = [(specs[i].placements, specs[i].shape) for i in indices]
        groups.append(_Group(indices, mesh_group(mesh), counted, _fingerprint(description)))
    partial = [i for i, spec in enumerate(specs) if spec is not None and any(p.is_partial() for p in spec.placements)]
    plain = [i for i, spec in enumerate(specs) if spec is None]
    metas = [spec.tensor_meta for spec in specs if spec is not None]
    dtypes = None if any(meta is None for meta in metas) else frozenset(meta.dtype for meta in metas)
    plan = _Plan(groups, plain, partial, list(specs), _replicated(specs), dtypes)
    _plans[key] = plan
    if len(_plans) > _PLANS:
        _plans.popitem(last=False)
    return plan


def _replicated(specs: list[Any]) -> list[Replicated]:
    """The tensors with copies, by (mesh, dim), in order of first appearance (see _Plan.replicated)."""
    by_key: dict[tuple[Any, int | None], list[int]] = {}
    for i, spec in enumerate(specs):
        if spec is None:
            by_key.setdefault((None, None), []).append(i)
            continue
        for d, p in enumerate(spec.placements):
            if p.is_replicate() or p.is_partial():  # Partial: the scan reads it reduced, a copy
                by_key.setdefault((spec.mesh, d), []).append(i)
    return [Replicated(mesh, dim, indices) for (mesh, dim), indices in by_key.items()]


def plan_of(tensors: Sequence[torch.Tensor]) -> _Plan:
    """The (cached) plan of a list that holds DTensors: its mesh groups, Partial tensors, replicas."""
    try:
        specs = list(map(_SPEC, tensors))  # C-level maps while every entry is a DTensor
    except AttributeError:
        specs = [getattr(t, "_spec", None) for t in tensors]  # plain tensors have no layout
    # The plan found last (a training loop checks one list step after step), if these are its spec
    # objects (FSDP2 and tensor parallel keep them from step to step): found by identity, at half
    # the cost of forming and hashing the key.
    last = next(reversed(_plans.values()), None)
    if last is not None and len(last.specs) == len(specs) and all(map(operator.is_, specs, last.specs)):
        return last
    key = tuple(map(id, specs))
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(key, specs)
    else:
        _plans.move_to_end(key)  # the last one, for the next call
    return plan


@dataclass(frozen=True)
class LocalView:
    """A list that holds DTensors (or is reduced over ``process_group``) as this rank holds it, made
    once per call: the scan, the norm's dtype and the clip share it instead of each reading every
    entry again (each such pass costs 0.03-0.1 us per tensor)."""

    tensors: list[torch.Tensor]  # as given
    plan: _Plan
    shards: list[torch.Tensor]  # ``to_local(tensors)``: each DTensor's local shard, what a clip scales

    def dtypes(self) -> set[torch.dtype]:
        """The dtypes of the tensors: the DTensors' from the plan, the plain tensors' read."""
        known = self.plan.dtensor_dtypes
        if known is None:
            return {t.dtype for t in self.shards}
        return set(known).union([self.shards[i].dtype for i in self.plan.plain])


def local_view(tensors: list[torch.Tensor]) -> LocalView:
    """The list's plan and local shards (see LocalView)."""
    return LocalView(tensors, plan_of(tensors), to_local(tensors))


def local_view_if_distributed(tensors: list[torch.Tensor], process_group: Any) -> LocalView | None:
    """``local_view(tensors)`` when the list takes the distributed path (``process_group``, or a
    DTensor first: lists are routed by their first entry, as nanscan.scan routes them), else None."""
    if process_group is not None or has_dtensor(tensors[:1]):
        return local_view(tensors)
    return None


def local_parts(view: LocalView) -> list[torch.Tensor]:
    """What a distributed scan reads of each tensor: a DTensor's local shard, a Partial DTensor's
    local part once reduced (one collective each: every rank of the mesh must call this), a plain
    tensor itself."""
    if not view.plan.partial:
        return view.shards
    locals_ = list(view.shards)  # the view's own list keeps the Partial parts (a clip scales those)
    for i in view.plan.partial:
        locals_[i] = _without_partial(view.tensors[i])
    return locals_


def _without_partial(t: Any) -> torch.Tensor:
    """The local part of a DTensor with Partial placements once they are reduced (one collective):
    afterwards the tensor is Replicate on those mesh dims, and counted once there like any replica."""
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if p.is_partial() else p for p in t.placements]
    return cast(torch.Tensor, t.redistribute(t.device_mesh, placements).to_local())


def _local_rows(local: ScanResult, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """This rank's SUM rows [R, N], MAX rows [2, N] and per-rank row [world] of its local scan
    (float64, on its device)."""
    bad = (local.nan_count + local.inf_count) > 0
    flags = bad.double()
    rows = [
        local.nan_count,
        local.inf_count,
        # A NaN or Inf norm squares to NaN or Inf, and sums keep them with torch's precedence (NaN +
        # Inf is NaN): the reduced row is the square of torch's norm, non-finite ones included.
        local.norm.square(),
        flags,
        flags * rank,
        flags * (rank * rank),
    ]
    if local.fp16_overflow is not None and local.fp16_underflow is not None:
        rows += [local.fp16_overflow, local.fp16_underflow]
    # This rank's position in the per-rank row: 1 if any of its local parts held a NaN/Inf.
    any_by_rank = _unit_row(rank, world, local.norm.device) * bad.any()
    return torch.stack(rows).double(), torch.stack([local.max, -local.min]), any_by_rank


_unit_rows: dict[tuple[int, int, torch.device], torch.Tensor] = {}


def _unit_row(rank: int, world: int, device: torch.device) -> torch.Tensor:
    """float64 [world], 1 at ``rank``, 0 elsewhere: made once per device (a host copy per call would sync)."""
    key = (rank, world, device)
    row = _unit_rows.get(key)
    if row is None:
        row = torch.zeros(world, dtype=torch.float64, device=device)
        row[rank] = 1.0
        _unit_rows[key] = row
    return row


def _all_reduce(sums: torch.Tensor, maxes: torch.Tensor, group: Any) -> None:
    """The SUM and the MAX in flight together. NCCL queues both on its stream, and ``wait()`` makes
    the current stream wait for them: no host sync. Gloo runs them side by side on its worker threads,
    and ``wait()`` blocks until both are done, which the CPU tensors need anyway."""
    works = [
        dist.all_reduce(sums, op=dist.ReduceOp.SUM, group=group, async_op=True),
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX, group=group, async_op=True),
    ]
    for work in works:
        work.wait()


def _reduce_groups(
    plan: _Plan, sums: torch.Tensor, maxes: torch.Tensor, any_by_rank: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduces each mesh group's columns of ``sums``/``maxes``. Returns the reduced rows (views of the
    reduced buffers when one mesh holds every tensor, the usual case; else ``sums``/``maxes``,
    updated in place), the per-rank row, reduced, and whether every group's ranks scanned the same
    layout (all on the device)."""
    assert plan.groups
    world = any_by_rank.numel()
    device = sums.device
    reduced_any: torch.Tensor | None = None
    consistent: torch.Tensor | None = None
    for g in plan.groups:
        n = len(g.indices)
        whole = n == sums.shape[1]
        group_sums = sums if whole else sums.index_select(1, g.index_on(device))
        group_maxes = maxes if whole else maxes.index_select(1, g.index_on(device))
        row_mask = g.row_mask_on(device, len(sums))
        if row_mask is not None:  # a select, not a product: a NaN or Inf square times 0 is NaN
            group_sums = torch.where(row_mask, group_sums, 0.0)
        flat_sums = torch.cat([group_sums.flatten(), any_by_rank])
        flat_maxes = torch.cat([group_maxes.flatten(), g.fingerprints_on(device)])
        _all_reduce(flat_sums, flat_maxes, g.group)
        reduced_sums, reduced_maxes = flat_sums[:-world].view(-1, n), flat_maxes[:-2].view(2, n)
        if whole:
            sums, maxes = reduced_sums, reduced_maxes
        else:
            sums.index_copy_(1, g.index_on(device), reduced_sums)
            maxes.index_copy_(1, g.index_on(device), reduced_maxes)
        # Every group's sum holds this rank's own row: their maximum is the union over the groups.
        group_any = flat_sums[-world:].clamp(max=1.0)
        reduced_any = group_any if reduced_any is None else torch.maximum(reduced_any, group_any)
        agree = flat_maxes[-2] == -flat_maxes[-1]  # max(h) == min(h)
        consistent = agree if consistent is None else consistent & agree
    assert reduced_any is not None and consistent is not None
    return sums, maxes, reduced_any, consistent


def _union(group: Any, names: Sequence[str]) -> tuple[list[str], list[int]]:
    """The names of every rank's tensors, in rank order, and where each rank's segment starts.

    Gathered once per (group, local names): a host collective, made at the first call with a new list.
    Every rank of the group must make its first call with a given list together (as every call's
    all-reduces require anyway)."""
    key = (group, tuple(names))
    union = _unions.get(key)
    if union is None:
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, list(names), group=group)
        starts: list[int] = []
        all_names: list[str] = []
        for rank_names in gathered:
            starts.append(len(all_names))
            all_names.extend(rank_names)
        union = (all_names, starts)
        _unions[key] = union
    return union


def global_norm(total: torch.Tensor, norm_type: float, process_group: Any = None) -> torch.Tensor:
    """A norm torch computed on this rank's tensors, made global and plain: a DTensor's full value;
    with ``process_group``, combined over the group's ranks (one collective): the p-norms by their
    p-th powers, the infinity norms by max/min, the 0-"norm" (a count) by a sum."""
    cls = dtensor_class()
    if cls is not None and isinstance(total, cls):
        total = total.full_tensor()  # type: ignore[attr-defined]
    if process_group is None:
        return total
    value = total.double().to(_group_device(process_group))
    if norm_type == math.inf:
        op = dist.ReduceOp.MAX
    elif norm_type == -math.inf:
        op = dist.ReduceOp.MIN
    else:
        op = dist.ReduceOp.SUM
        if norm_type != 0:
            value = value.pow(norm_type)
    dist.all_reduce(value, op=op, group=process_group)
    if norm_type not in (0, math.inf, -math.inf):
        value = value.pow(1.0 / norm_type)
    return value.to(total.dtype)


def _group_device(group: Any) -> torch.device:
    """Where a group's collectives take their buffers: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def scan(
    view: LocalView,
    names: Sequence[str] | None,
    fp16_range: bool,
    process_group: Any = None,
    checksum: bool = False,
) -> ScanResult:
    """``nanscan.scan`` of a list that holds DTensors or is reduced over ``process_group`` (``view``,
    from ``local_view``): every rank gets the global statistics of every tensor (see the module notes).
    ``checksum`` adds the replica checksum of each tensor's local part on this rank, not reduced
    (nanscan.scan refuses it with ``process_group``, whose ranks hold different tensors, and with
    ``fp16_range``)."""
    _require_initialized()
    tensors, plan = view.tensors, view.plan
    locals_ = local_parts(view)
    rank = dist.get_rank()
    world = dist.get_world_size()
    # A rank with nothing to scan still takes part in the group's collectives, on the group's device.
    local = (
        scan_local(locals_, names, fp16_range, checksum)
        if locals_
        else empty_result(fp16_range, _group_device(process_group), checksum=checksum)
    )
    device = local.norm.device
    sums, maxes, any_by_rank = _local_rows(local, rank, world)
    if plan.groups:
        sums, maxes, any_by_rank, consistent = _reduce_groups(plan, sums, maxes, any_by_rank)
    else:  # process_group alone: nothing reduced yet, so nothing to disagree on
        consistent = torch.ones((), dtype=torch.bool, device=device)
    result_names: tuple[str, ...] | None = None
    if process_group is not None:
        local_names = list(names) if names is not None else [f"[{i}]@rank{rank}" for i in range(len(tensors))]
        all_names, starts = _union(process_group, local_names)
        start, n = starts[dist.get_rank(process_group)], len(all_names)
        union_sums = torch.zeros((len(sums), n), dtype=torch.float64, device=device)
        union_maxes = torch.full((2, n), -math.inf, dtype=torch.float64, device=device)
        union_sums[:, start : start + len(tensors)] = sums
        union_maxes[:, start : start + len(tensors)] = maxes
        flat_sums = torch.cat([union_sums.flatten(), any_by_rank])
        _all_reduce(flat_sums, union_maxes, process_group)
        sums, maxes = flat_sums[:-world].view(-1, n), union_maxes
        any_by_rank = flat_sums[-world:].clamp(max=1.0)
        result_names = tuple(all_names)
    return _result(sums, maxes, any_by_rank, consistent, result_names, local.checksum)


def total_norm(view: LocalView, norm_type: float, process_group: Any = None) -> torch.Tensor:
    """The total L2 (``norm_type`` 2) or infinity norm, float64, of a list that holds DTensors or is
    reduced over ``process_group`` (``view``, from ``local_view``): a plain tensor, the same on every rank.
    What ``clip_grad_norm_`` and ``get_total_norm`` need, and nothing more.

    No per-tensor statistic leaves the rank: each rank combines the terms of its local parts into one
    partial per mesh (the counted parts only: a Replicate dim's extra copies add nothing, as in
    ``scan``), so a mesh costs one collective of one number (L2: a SUM of squares) or two (inf: a MAX
    of a NaN flag and a magnitude), and ``process_group`` one more. Results are ``scan``'s totals,
    summed in another order (within fp64 rounding): NaN if any counted element is NaN, else inf if
    any is inf, as torch's norm."""
    _require_initialized()
    plan = view.plan
    locals_ = local_parts(view)
    local = scan_local(locals_, None, False) if locals_ else empty_result(False, _group_device(process_group))
    l2 = norm_type == 2.0
    op = dist.ReduceOp.SUM if l2 else dist.ReduceOp.MAX
    terms = _norm_terms(local, l2)
    device = terms.device
    whole = len(plan.groups) == 1 and not plan.plain  # the usual case: one mesh holds every tensor
    partials = []
    for g in plan.groups:
        group_terms = terms if whole else terms.index_select(1, g.index_on(device))
        counted = g.counted_on(device)
        if counted is not None:  # 0 is neutral for the sum and the max: every term is >= 0
            group_terms = torch.where(counted, group_terms, 0.0)
        partial = _combine(group_terms, l2)
        dist.all_reduce(partial, op=op, group=g.group)
        partials.append(partial)
    if plan.plain:  # this rank's own tensors (with ``process_group``: its stage's), not reduced here
        partials.append(_combine(terms.index_select(1, plan.plain_on(device)) if plan.groups else terms, l2))
    if not partials:  # nothing to scan on this rank; it still takes part in process_group's collective
        combined = terms.new_zeros(len(terms))
    else:
        combined = partials[0] if len(partials) == 1 else _combine(torch.stack(partials, dim=1), l2)
    if process_group is not None:
        dist.all_reduce(combined, op=op, group=process_group)
    if l2:
        return combined[0].sqrt()
    return torch.where(combined[0] > 0, math.nan, combined[1])


def _norm_terms(local: ScanResult, l2: bool) -> torch.Tensor:
    """Per tensor, what this rank's part adds to the total norm, [R, N] float64, every term >= 0.

    L2 (R = 1): the square of the part's norm. A NaN or Inf norm squares to NaN or Inf, and IEEE sums
    (gloo's and NCCL's too) keep them with torch's precedence: NaN + Inf is NaN. Inf (R = 2): a NaN
    flag and the largest magnitude (inf where the part holds an Inf; 0 where it has no finite value).
    The NaN has a row of its own because a MAX need not propagate it: gloo's keeps whichever operand
    comes first."""
    if l2:
        return local.norm.square().unsqueeze(0)
    magnitude = torch.where(local.inf_count > 0, math.inf, torch.maximum(local.max, -local.min))
    return torch.stack([(local.nan_count > 0).double(), magnitude.clamp(min=0.0)])


def _combine(terms: torch.Tensor, l2: bool) -> torch.Tensor:
    """Terms [R, N] combined over the N tensors into [R]: summed (L2) or their maximum (inf)."""
    if terms.shape[1] == 0:
        return terms.new_zeros(len(terms))
    return terms.sum(1) if l2 else terms.amax(1)


def _require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("nanscan: DTensors and process_group need torch.distributed to be initialized")


def _result(
    sums: torch.Tensor,
    maxes: torch.Tensor,
    any_by_rank: torch.Tensor,
    consistent: torch.Tensor,
    names: tuple[str, ...] | None,
    checksum: torch.Tensor | None = None,
) -> ScanResult:
    """The global ScanResult from the reduced rows; ``checksum``, this rank's local one, as it is."""
    nan, inf, sumsq = sums[_NAN], sums[_INF], sums[_SUMSQ]
    totals = sums[: _SUMSQ + 1].sum(1)  # NaN count, Inf count, sum of squares (NaN/Inf kept) of all
    extra: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None)
    if len(sums) > _FP16_OVERFLOW:
        extra = (sums[_FP16_OVERFLOW].to(torch.int64), sums[_FP16_UNDERFLOW].to(torch.int64))
    return ScanResult(
        nan.to(torch.int64),
        inf.to(torch.int64),
        -maxes[1],
        maxes[0],
        sumsq.sqrt(),
        totals[_SUMSQ].sqrt(),
        # From the counts, never from the norm: a finite gradient of 1e20 everywhere is finite.
        totals[: _INF + 1].sum() == 0,
        *extra,
        names=names,
        ranks=Attribution(sums[_BAD], sums[_RANK_SUM], sums[_RANK_SQUARE_SUM], any_by_rank),
        consistent=consistent,
        checksum=checksum,
    )
