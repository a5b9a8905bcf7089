"""The reduction of per-tensor results across processes, shared by every layout that spreads
tensors over ranks (DTensor meshes, FSDP1 flat parameters, pipeline stages), in at most two
collectives per process group.

The kernel does not change: each rank scans its local data (a DTensor's local shard, its part of an
FSDP1 parameter, its own stage's gradients) in the same one fused pass. A layout says which of its
tensors are reduced over which group (a ``Plan``); everything after the local scan is here:

* Every statistic that sums (NaN and Inf counts, sums of squares, the attribution rows below) goes
  into one float64 buffer, reduced by one SUM all-reduce; every one that takes a maximum (max, -min,
  the layout fingerprint) into another, reduced by one MAX all-reduce. So two collectives per
  distinct process group (and two more across ``process_group``), with a payload of O(tensors +
  ranks), never O(tensors x ranks), both in flight at once, issued on the device's stream: no host
  sync (with NCCL; gloo on the CPU is synchronous by nature).
* The total norm alone (``clip_grad_norm_``, ``get_total_norm``: ``total_norm``) needs no per-tensor
  statistic on other ranks: each rank combines its counted local parts first, so a group costs one
  collective of one number (L2: a SUM of squares) or two (inf: a MAX of a NaN flag and a magnitude).
  On gloo (2 processes on a 2-core VM) a collective costs its latency, 0.15-0.3 ms, or in a large
  share of calls of three numbers or more a ~4 ms stall (a scheduler tick); its size barely matters.
* NaN and Inf reach the norms by IEEE arithmetic: a NaN or Inf norm squares to NaN or Inf and every
  SUM keeps it (NaN + Inf is NaN), so a reduced sum of squares is the square of torch's norm. Counts
  and flags, never norms, say whether a tensor is finite (a finite 1e20 gradient stays finite).
* Copies are counted once: a group's tensor is ``counted`` on one rank of each set of copies of its
  local part (a DTensor's replica at coordinate 0 of its Replicate dims, FSDP1's first replica under
  HSDP); the others add zeros to the counted rows, selected (``where``), not multiplied: a NaN square
  times 0 is NaN. The max and min are the same on every copy. The copies that are not counted send
  their NaN and Inf counts in the MAX too (only where the group has such copies), so that a copy
  that went bad on its own (after the all-reduce that made the copies equal) is never reported
  finite: a count is the counted copy's where the copies agree, and at least the bad copy's where
  they do not.
* Which rank held a NaN/Inf, per tensor, without a per-rank row per tensor: each rank adds, for each
  tensor whose local part is non-finite, 1, its rank and its rank squared (three SUM rows), and a 1 at
  its own position of a per-rank row of the length of the world. From the count n, the sum s1 and
  the sum of squares s2 the ranks are exact for one rank (s1) or two (the roots of a quadratic);
  for more, the n-subsets of the ranks flagged in the per-rank row whose sums match (searched on the
  host, on the rare path, while the search is small) are, in practice, one; otherwise their union,
  a superset (Attribution.ranks).
* Every rank must scan the same list for a group's reduction to mean anything: a fingerprint of the
  group's shapes and placements travels in the MAX buffer (as h and -h), and a Report refuses to
  read statistics whose ranks disagreed.
* With ``checksum=True`` the statistics are global as always, but the checksums are of this rank's
  local parts, unreduced: they are compared between the copies of a part (nanscan.replicas), which
  the plan lists too (``Plan.copies``).

With ``process_group``, each rank's list is its own (a pipeline stage's parameters): the lists of all
ranks are laid end to end (their names gathered once per distinct list, a host collective), each rank
fills its own segment and the union is reduced, so every rank gets every rank's statistics under
their names.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..fused import Attribution, ScanResult, upload
from .collectives import all_reduce

__all__ = ["Attribution"]  # where the reductions make it; defined beside the ScanResult that holds it

# SUM rows, per tensor: statistics that add up over parts, then the attribution rows.
_NAN, _INF, _SUMSQ, _BAD, _RANK_SUM, _RANK_SQUARE_SUM = range(6)
_COUNTED_ROWS = (_NAN, _INF, _SUMSQ)  # masked on extra copies; attribution rows are not
_FP16_OVERFLOW, _FP16_UNDERFLOW = 6, 7  # only with fp16_range


def fingerprint(layout: Sequence[Any]) -> float:
    """48 bits of a hash of a group's layout (its ``repr``): exact in float64, equal on ranks with
    equal layouts."""
    digest = hashlib.blake2b(repr(layout).encode(), digest_size=6).digest()
    return float(int.from_bytes(digest, "little"))


@dataclass
class Group:
    """Tensors of a list reduced together over one process group: a mesh's, FSDP1's, a stage's."""

    indices: list[int]
    group: Any  # a ProcessGroup, or None for the default (world) group
    counted: list[bool]  # per tensor: this rank adds its counts and squares (False on extra copies)
    fingerprint: float  # the same on every rank that scans the same layout
    # Whether some of the group's parts have copies on other ranks (the same on every rank: it sizes
    # the MAX buffer): their NaN/Inf counts travel in the MAX too (module notes).
    with_copies: bool = False
    # Made once, on the buffers' device (a host-to-device copy per call would be a sync point):
    device: torch.device | None = None  # where the tensors below are
    index: torch.Tensor | None = None  # the indices
    fingerprints: torch.Tensor | None = None  # [h, -h]
    counted_mask: torch.Tensor | None = None  # bool [N], ``counted``; None when every tensor counts
    row_masks: dict[int, torch.Tensor | None] = field(default_factory=dict)  # by row count: bool [R, N],
    # False on the counted rows of the tensors this rank does not count

    def _made_on(self, device: torch.device) -> None:
        if self.device != device:
            self.index = upload(self.indices, torch.int64, device)
            self.fingerprints = upload([self.fingerprint, -self.fingerprint], torch.float64, device)
            every = all(self.counted)
            self.counted_mask = None if every else upload(self.counted, torch.bool, device)
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


@dataclass(frozen=True)
class ReplicaLines:
    """Where the copies of some local parts sit: what nanscan.replicas compares them over.

    Attributes:
        replica_group: the MAX: the ranks whose copies this rank compares with its own (None: world).
        spread_group: the SUM: every rank that learns the outcome (None: world).
        lines: each set of ranks that hold copies of each other (global ranks); together they cover
            the spread group's ranks.
    """

    replica_group: Any
    spread_group: Any
    lines: list[list[int]]


@dataclass
class Copies:
    """The tensors of a list whose local parts have copies on other ranks, and where those sit.
    ``key`` identifies the placement of the copies (a mesh and dim, a process group), so that
    nanscan.replicas makes its bookkeeping once per placement; ``lines`` makes the ReplicaLines on
    first use (it may take a host collective, which every rank of the spread group makes together).
    ``lines`` None: the list's plain tensors, copies over whatever group holds the replicas of a
    plain model (DDP's, or the one the caller names: nanscan.replicas decides)."""

    key: tuple[Any, ...]
    lines: Callable[[], ReplicaLines] | None
    indices: list[int]  # positions in the list, ascending
    index: torch.Tensor | None = None  # the indices on the checksums' device, made on first use

    def index_on(self, device: torch.device) -> torch.Tensor:
        """The indices on ``device``, made once (a host-to-device copy per call would be a sync)."""
        if self.index is None or self.index.device != device:
            self.index = upload(self.indices, torch.int64, device)
        return self.index


@dataclass
class Plan:
    """How one list layout is reduced across ranks, made once per distinct layout by its layout."""

    groups: list[Group]
    own: list[int]  # indices of the tensors in no group: this rank's own, never reduced by a group
    # Per placement of copies (in order of first appearance, so that every rank, holding the same
    # list, compares them in the same order); a tensor with copies along two mesh dims is in two.
    copies: list[Copies]
    # The dtypes of the tensors the plan knows them of, or None; the others are read from the tensors.
    dtypes: frozenset[torch.dtype] | None
    known_dtypes: list[int] = field(default_factory=list)  # the indices whose dtypes ``dtypes`` holds
    partial: list[int] = field(default_factory=list)  # DTensors reduced before the scan (Partial placements)
    own_index: torch.Tensor | None = None  # ``own`` on the scan's device, made on first use

    def own_on(self, device: torch.device) -> torch.Tensor:
        if self.own_index is None or self.own_index.device != device:
            self.own_index = upload(self.own, torch.int64, device)
        return self.own_index


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "nanscan: this layout (DTensors, FSDP1, process_group) needs torch.distributed to be initialized"
        )


_empty_parts: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def empty_part(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-size tensor of this dtype and device, made once (a slice costs 3 us a call): the part of
    a parameter that has no element on this rank (FSDP1's shards, DeepSpeed ZeRO's pieces), which
    still takes its place in the scan and the reduction."""
    key = (dtype, device)
    empty = _empty_parts.get(key)
    if empty is None:
        empty = _empty_parts[key] = torch.empty(0, dtype=dtype, device=device)
    return empty


def group_device(group: Any) -> torch.device:
    """Where a group's collectives take their buffers: the current CUDA device for NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


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
        all_reduce(sums, dist.ReduceOp.SUM, group, async_op=True),
        all_reduce(maxes, dist.ReduceOp.MAX, group, async_op=True),
    ]
    for work in works:
        work.wait()


def _reduce_groups(
    plan: Plan, sums: torch.Tensor, maxes: torch.Tensor, any_by_rank: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Reduces each group's columns of ``sums``/``maxes``. Returns the reduced rows (views of the
    reduced buffers when one group holds every tensor, the usual case; else ``sums``/``maxes``,
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
        max_rows = 4 if g.with_copies else 2
        if g.with_copies:
            # The NaN and Inf counts of the parts this rank does not count, in the MAX: a copy that
            # differs from the counted one (corrupted after the all-reduce) still shows its NaN/Inf.
            counts = group_sums[_NAN : _INF + 1]
            uncounted = (
                torch.zeros_like(counts) if row_mask is None else torch.where(row_mask[_NAN : _INF + 1], 0.0, counts)
            )
            group_maxes = torch.cat([group_maxes, uncounted])
        if row_mask is not None:  # a select, not a product: a NaN or Inf square times 0 is NaN
            group_sums = torch.where(row_mask, group_sums, 0.0)
        flat_sums = torch.cat([group_sums.flatten(), any_by_rank])
        flat_maxes = torch.cat([group_maxes.flatten(), g.fingerprints_on(device)])
        _all_reduce(flat_sums, flat_maxes, g.group)
        reduced_sums, reduced_maxes = flat_sums[:-world].view(-1, n), flat_maxes[:-2].view(max_rows, n)
        if max_rows == 4:
            # Exact where the copies agree (the counted one holds as many); never 0 where one holds any.
            reduced_sums[_NAN : _INF + 1] = torch.maximum(reduced_sums[_NAN : _INF + 1], reduced_maxes[2:])
            reduced_maxes = reduced_maxes[:2]
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


_unions: dict[tuple[Any, ...], tuple[list[str], list[int]]] = {}


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


def reduce_scan(
    local: ScanResult,
    plan: Plan | None,
    process_group: Any,
    names: Sequence[str] | None,
) -> ScanResult:
    """The global statistics from this rank's scan of its local parts (``local``, in the list's
    order), reduced by ``plan`` (None: nothing but ``process_group``) and then laid end to end with
    the other ranks' lists over ``process_group`` (if given). Every rank of every group must call it."""
    rank = dist.get_rank()
    world = dist.get_world_size()
    n = len(local)
    device = local.norm.device
    sums, maxes, any_by_rank = _local_rows(local, rank, world)
    if plan is not None and plan.groups:
        sums, maxes, any_by_rank, consistent = _reduce_groups(plan, sums, maxes, any_by_rank)
    else:  # process_group alone: nothing reduced yet, so nothing to disagree on
        consistent = torch.ones((), dtype=torch.bool, device=device)
    result_names: tuple[str, ...] | None = None
    if process_group is not None:
        local_names = list(names) if names is not None else [f"[{i}]@rank{rank}" for i in range(n)]
        all_names, starts = _union(process_group, local_names)
        start, total = starts[dist.get_rank(process_group)], len(all_names)
        union_sums = torch.zeros((len(sums), total), dtype=torch.float64, device=device)
        union_maxes = torch.full((2, total), -math.inf, dtype=torch.float64, device=device)
        union_sums[:, start : start + n] = sums
        union_maxes[:, start : start + n] = maxes
        flat_sums = torch.cat([union_sums.flatten(), any_by_rank])
        _all_reduce(flat_sums, union_maxes, process_group)
        sums, maxes = flat_sums[:-world].view(-1, total), union_maxes
        any_by_rank = flat_sums[-world:].clamp(max=1.0)
        result_names = tuple(all_names)
    return _result(sums, maxes, any_by_rank, consistent, result_names, local.checksum)


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


# How each norm type's terms combine, over tensors and over ranks: (the collective, its identity).
def _combining(norm_type: float) -> tuple[Any, float]:
    if norm_type == math.inf:
        return dist.ReduceOp.MAX, 0.0
    if norm_type == -math.inf:
        return dist.ReduceOp.MIN, math.inf
    return dist.ReduceOp.SUM, 0.0


def reduce_norm_terms(terms: torch.Tensor, norm_type: float, plan: Plan | None, process_group: Any) -> torch.Tensor:
    """Combines per-tensor norm terms [R, N] (float64, this rank's local parts, see ``norm_terms``)
    into the global ones [R]: each group's counted terms combined on this rank, then one collective
    per group (of R numbers), this rank's own tensors added, and one more over ``process_group``."""
    op, identity = _combining(norm_type)
    device = terms.device
    groups = plan.groups if plan is not None else []
    whole = len(groups) == 1 and not (plan is not None and plan.own)  # the usual case: one group holds all
    partials = []
    for g in groups:
        group_terms = terms if whole else terms.index_select(1, g.index_on(device))
        counted = g.counted_on(device)
        if counted is not None:  # the identity of the combination: an extra copy adds nothing
            group_terms = torch.where(counted, group_terms, identity)
        partial = _combine(group_terms, op, identity)
        all_reduce(partial, op, g.group)
        partials.append(partial)
    if plan is None or plan.own:  # this rank's own tensors (with ``process_group``: its stage's)
        own = terms if plan is None or not groups else terms.index_select(1, plan.own_on(device))
        partials.append(_combine(own, op, identity))
    if not partials:  # nothing on this rank; it still takes part in process_group's collective
        combined = torch.full((len(terms),), identity, dtype=torch.float64, device=device)
    else:
        combined = partials[0] if len(partials) == 1 else _combine(torch.stack(partials, dim=1), op, identity)
    if process_group is not None:
        all_reduce(combined, op, process_group)
    return combined


def _combine(terms: torch.Tensor, op: Any, identity: float) -> torch.Tensor:
    """Terms [R, N] combined over the N tensors into [R], by the collective's operation."""
    if terms.shape[1] == 0:
        return torch.full((len(terms),), identity, dtype=torch.float64, device=terms.device)
    if op == dist.ReduceOp.MAX:
        return terms.amax(1)
    if op == dist.ReduceOp.MIN:
        return terms.amin(1)
    return terms.sum(1)


def scan_norm_terms(local: ScanResult, norm_type: float) -> torch.Tensor:
    """Per tensor, what this rank's part adds to the total L2 (``norm_type`` 2) or infinity norm, from
    its scan: [R, N] float64, every term >= 0.

    L2 (R = 1): the square of the part's norm. A NaN or Inf norm squares to NaN or Inf, and IEEE sums
    (gloo's and NCCL's too) keep them with torch's precedence: NaN + Inf is NaN. Inf (R = 2): a NaN
    flag and the largest magnitude (inf where the part holds an Inf; 0 where it has no finite value).
    The NaN has a row of its own because a MAX need not propagate it: gloo's keeps whichever operand
    comes first."""
    if norm_type == 2.0:
        return local.norm.square().unsqueeze(0)
    magnitude = torch.where(local.inf_count > 0, math.inf, torch.maximum(local.max, -local.min))
    return torch.stack([(local.nan_count > 0).double(), magnitude.clamp(min=0.0)])


def scan_norm_total(combined: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The total norm (float64 []) from combined ``scan_norm_terms``."""
    if norm_type == 2.0:
        return combined[0].sqrt()
    return torch.where(combined[0] > 0, math.nan, combined[1])


def torch_norm_terms(norms: torch.Tensor, norm_type: float) -> torch.Tensor:
    """Per tensor, what this rank's part adds to a total norm of another order, from torch's norms
    of the parts (float64 [N]): [1, N]. A p-norm's parts add as p-th powers (also for p < 0, where an
    empty part's norm is inf and adds 0), the 0-"norm" (a count) as itself, the infinity norms by
    their maximum and minimum."""
    if norm_type in (0.0, math.inf, -math.inf):
        return norms.unsqueeze(0)
    return norms.pow(norm_type).unsqueeze(0)


def torch_norm_total(combined: torch.Tensor, norm_type: float) -> torch.Tensor:
    """The total norm (float64 []) from combined ``torch_norm_terms``."""
    if norm_type in (0.0, math.inf, -math.inf):
        return combined[0]
    return combined[0].pow(1.0 / norm_type)
