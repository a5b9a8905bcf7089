"""Replica consistency: do data-parallel replicas hold bit-identical tensors?

After DDP's all-reduce every rank must hold the same gradients, bit for bit, and after the step the
same weights. A flipped bit in one GPU's memory or a miscomputed kernel (silent data corruption)
breaks that without any NaN. nanscan checks it every step, on the device and without a host sync:

1. The scan that computes the statistics also computes each tensor's replica checksum
   (``scan(..., checksum=True)``; the definition is in csrc/common/scan_rules.h).
2. One all-reduce (MAX) of ``[checksum, ~checksum]`` per tensor, 16 bytes per tensor, over the ranks
   that hold the copies, gives each of them the largest and the smallest checksum: the replicas agree
   exactly where the two are equal.
3. One all-reduce (SUM) of per-rank bits, 16 bytes per tensor and per 62 ranks, says which ranks
   differ from the largest and which from the smallest; the ranks outside the majority are the
   divergent ones. With two replicas, or any tie, no majority exists and both sides are named.

Which ranks hold copies of what:

* Plain tensors (DDP): every rank of the replicas' group (DDP's, else the default group) holds all.
* DTensors: a rank's local part has copies along each mesh dim whose placement is Replicate (HSDP's
  replicate dim, a tensor-parallel bias), or Partial (the scan reads it reduced, so replicated). A
  tensor is compared along each such dim: the MAX over that dim's group (the ranks that differ only
  in that coordinate), the SUM over the whole mesh, so that every rank of the mesh learns about every
  set of copies and gets the same answer (a rank that acted on a different answer would leave the
  others waiting in the next collective). A DTensor sharded along every dim of its mesh (FSDP2 on a
  1-d mesh) has no copies: it is not compared, and consistent by definition.
* FSDP1: under ``NO_SHARD`` every rank of a unit's group holds all of it; under the hybrid strategies
  each node group's shard has copies at the same position of the other node groups (the MAX over the
  inter-node group, the SUM over the world); the fully sharded strategies have no copies.

Where the copies lie is the layout's to say (``Plan.copies``, nanscan.layouts); the tensors of a list
are grouped by where their copies lie, the plain ones in a group of their own, in order of first
appearance; every rank holds the same list, so every rank issues the same collectives in the same
order: two per group, none for a group without tensors. A tensor replicated along two dims of its
mesh is compared along both, and the ranks named for it are those named along either dim.

The SUM is issued unconditionally: deciding on the host whether it is needed would be a sync. Its
result is read only when ``consistent`` or ``divergent`` is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import layouts
from .fused import scan_local
from .layouts.collectives import all_reduce
from .layouts.reduce import Copies, ReplicaLines

RANKS_PER_WORD = 62  # bits per int64 word of a rank mask: sums of distinct powers below 2^62 are exact


@dataclass(frozen=True)
class _Layout:
    """Where the copies compared by one pair of all-reduces sit. A rank's *position* is its rank in
    ``spread_group``: its bit in the rank masks."""

    replica_group: Any  # the MAX: the ranks whose copies this rank compares with its own (None: world)
    spread_group: Any  # the SUM: every rank that learns the outcome (None: world)
    position: int  # this rank's
    ranks: list[int]  # the global rank at each position
    line_of: list[int]  # at each position, which set of copies it belongs to
    line_sizes: list[int]  # the number of copies in each set


@dataclass(frozen=True)
class _Part:
    """The outcome of one pair of all-reduces, over some of the list's tensors."""

    indices: list[int] | None  # which of the check's tensors (positions in its names); None: all
    masks: torch.Tensor  # int64 [2, words, n]: positions that differ from their set's largest / smallest
    layout: _Layout


class ReplicaCheck:
    """The outcome of comparing tensors across the replicas that hold them.

    Attributes:
        names: the tensors checked, one name each (those without replicas among them: consistent).
        consistent_tensor: bool [] on the tensors' device: every replica holds every tensor bit for bit
            (but for a 2^-32 chance per changed tensor of a checksum collision). No sync to get it.
    """

    def __init__(self, names: Sequence[str], parts: list[_Part], device: torch.device) -> None:
        self.names = names
        self._parts = parts
        consistent = torch.ones((), dtype=torch.bool, device=device)
        for part in parts:
            # A set of copies that disagrees has a member off its largest checksum: a bit set.
            consistent = consistent & (part.masks[0] == 0).all()
        self.consistent_tensor = consistent
        self._divergent: dict[str, list[int]] | None = None

    @property
    def consistent(self) -> bool:
        """Whether every replica holds every tensor bit for bit (one sync)."""
        return bool(self.consistent_tensor)

    @property
    def divergent(self) -> dict[str, list[int]]:
        """Each tensor whose replicas differ, with the (global) ranks outside the majority of its set of
        copies; both sides where there is no majority (two replicas). Empty when consistent. The same
        on every rank of the replicas' group (of the mesh, for DTensors). One sync, on first reading."""
        if self._divergent is None:
            self._divergent = self._decode()
        return self._divergent

    def _decode(self) -> dict[str, list[int]]:
        found: dict[int, set[int]] = {}  # by position in the list, so the dict follows its order
        for part in self._parts:
            layout = part.layout
            masks = part.masks.cpu().tolist()
            for j in range(part.masks.shape[2]):
                off_high = self._ranks_in([words[j] for words in masks[0]])
                if not off_high:
                    continue  # every set of copies of this tensor agrees
                off_low = self._ranks_in([words[j] for words in masks[1]])
                for line in sorted({layout.line_of[p] for p in off_high}):
                    line_high = {p for p in off_high if layout.line_of[p] == line}
                    line_low = {p for p in off_low if layout.line_of[p] == line}
                    on_high, on_low = layout.line_sizes[line] - len(line_high), layout.line_sizes[line] - len(line_low)
                    if on_high > on_low:
                        named = line_high
                    elif on_low > on_high:
                        named = line_low
                    else:
                        named = line_high | line_low
                    index = j if part.indices is None else part.indices[j]
                    found.setdefault(index, set()).update(layout.ranks[p] for p in named)
        return {self.names[i]: sorted(found[i]) for i in sorted(found)}

    @staticmethod
    def _ranks_in(words: list[int]) -> set[int]:
        return {w * RANKS_PER_WORD + b for w, word in enumerate(words) for b in range(RANKS_PER_WORD) if word >> b & 1}

    def __repr__(self) -> str:
        compared = len({i for part in self._parts for i in (part.indices or range(len(self.names)))})
        ranks = len({r for part in self._parts for r in part.layout.ranks})
        return (
            f"<nanscan.ReplicaCheck of {len(self.names)} tensors, {compared} with replicas, "
            f"in {len(self._parts)} groups over {ranks} ranks>"
        )


# Layouts by where their copies lie (``Copies.key``, which holds the mesh or group it names, so that an
# id in a key cannot be another object's); meshes and groups live as long as the training.
_layouts: dict[tuple[Any, ...], _Layout] = {}


def _layout_of(copies: Copies | None, plain_group: Any) -> _Layout:
    """The layout of a set of copies; ``copies`` None (or without ``lines``): plain tensors held by
    every rank of ``plain_group`` (None: the default group). Made once per placement."""
    import torch.distributed as dist

    if copies is None or copies.lines is None:
        owner = dist.group.WORLD if plain_group is None else plain_group  # a new object when the world is re-made
        key: tuple[Any, ...] = ("plain", id(owner), owner)
        lines: ReplicaLines | None = None
    else:
        key, lines = copies.key, None
    cached = _layouts.get(key)
    if cached is not None:
        return cached
    if copies is None or copies.lines is None:
        lines = ReplicaLines(plain_group, plain_group, [dist.get_process_group_ranks(owner)])
    else:
        lines = copies.lines()
    ranks = dist.get_process_group_ranks(dist.group.WORLD if lines.spread_group is None else lines.spread_group)
    position_of = {rank: p for p, rank in enumerate(ranks)}
    line_of = [0] * len(ranks)
    for i, line in enumerate(lines.lines):
        for rank in line:
            line_of[position_of[rank]] = i
    layout = _Layout(
        lines.replica_group,
        lines.spread_group,
        position_of[dist.get_rank()],
        ranks,
        line_of,
        [len(line) for line in lines.lines],
    )
    _layouts[key] = layout
    return layout


def _compare_part(checksums: torch.Tensor, indices: list[int] | None, layout: _Layout) -> _Part:
    """The two all-reduces of one set of tensors (see the module notes); no host sync."""
    import torch.distributed as dist

    n = checksums.shape[0]
    checksum_range = torch.cat([checksums, ~checksums]).view(2, n)
    all_reduce(checksum_range, dist.ReduceOp.MAX, layout.replica_group)
    words = -(-len(layout.ranks) // RANKS_PER_WORD)
    word, bit = divmod(layout.position, RANKS_PER_WORD)
    masks = torch.zeros((2, words, n), dtype=torch.int64, device=checksums.device)
    masks[0, word] = (checksums != checksum_range[0]).to(torch.int64) << bit
    masks[1, word] = (checksums != ~checksum_range[1]).to(torch.int64) << bit
    all_reduce(masks, dist.ReduceOp.SUM, layout.spread_group)
    return _Part(indices, masks, layout)


def compare(names: Sequence[str], checksums: torch.Tensor, process_group: Any = None) -> ReplicaCheck:
    """Compares each rank's ``checksums`` of plain tensors (int64 [N], from ``scan(..., checksum=True)``)
    across the group, in two all-reduces (none for an empty list) and with no host sync. Every rank
    of the group must call it, with the same number of tensors."""
    parts = [_compare_part(checksums, None, _layout_of(None, process_group))] if len(names) else []
    return ReplicaCheck(names, parts, checksums.device)


def compare_layout(layout: layouts.Layout, checksums: torch.Tensor, process_group: Any = None) -> ReplicaCheck:
    """Compares the ``checksums`` of the layout's tensors (int64 [N], of each rank's local part, from
    a scan with ``checksum=True``) with those of their copies on other ranks, wherever the layout
    says they lie; plain tensors over ``process_group``, else the layout's replica group (a DDP
    model's), else the default group. Two all-reduces per placement of copies; no host sync. Every
    rank that holds a part of the tensors must call it, with the same list."""
    names = layout.names if layout.names is not None else [f"[{i}]" for i in range(len(layout.tensors))]
    plain_group = process_group if process_group is not None else layout.replica_group
    if layout.plan is None:
        return compare(names, checksums, plain_group)
    parts = []
    for copies in layout.plan.copies:
        replica_layout = _layout_of(copies, plain_group)
        if len(copies.indices) == len(layout.tensors):  # every tensor is in this set: no copy of the checksums
            parts.append(_compare_part(checksums, None, replica_layout))
        else:
            subset = checksums.index_select(0, copies.index_on(checksums.device))
            parts.append(_compare_part(subset, copies.indices, replica_layout))
    return ReplicaCheck(names, parts, checksums.device)


def verify_replicas(
    model_or_params: torch.nn.Module | Iterable[Any],
    process_group: Any = None,
    *,
    gradients: bool = False,
) -> ReplicaCheck:
    """Whether every rank holds bit-identical copies of the parameters (after ``optimizer.step()``:
    weights that drift), or of their gradients with ``gradients=True``. One fused scan of this rank's
    data computes the checksums; two all-reduces per set of replicas compare them; nothing syncs until
    ``consistent`` or ``divergent`` is read. ``check(..., verify_replicas=True)`` does the same for
    gradients within the check's own scan.

    Args:
        model_or_params: an ``nn.Module`` (a DDP, FSDP2 or tensor-parallel model too), an iterable of
            parameters, or of ``(name, parameter)`` pairs; every rank must pass the same tensors.
        process_group: the group whose ranks hold copies of the plain tensors; default: a DDP
            model's, else the default group. DTensors are compared along their own meshes.
        gradients: compare the ``.grad`` of each parameter instead of the parameter.

    What is compared: a plain tensor, whole, across the group; a DTensor's local shard with the
    shards that are its copies, along each mesh dim whose placement is Replicate (HSDP's replicate
    dim, a tensor-parallel bias) or Partial (compared once reduced: one collective per such tensor).
    A DTensor sharded along every dim (FSDP2 on a 1-d mesh) has no copies: it is not compared.
    """
    if isinstance(model_or_params, torch.nn.Module):
        layout = layouts.of_module(model_or_params, source="grad" if gradients else "data", compared=True)
    elif gradients:
        layout = layouts.of_parameters(model_or_params, compared=True)
    else:
        items = [model_or_params] if isinstance(model_or_params, torch.Tensor) else list(model_or_params)
        named: list[tuple[Any, Any]] = [
            item if isinstance(item, tuple) and len(item) == 2 else (f"[{i}]", item) for i, item in enumerate(items)
        ]
        tensors = [t.detach() for _, t in named]
        layout = layouts.of_tensors(tensors, [str(name) for name, _ in named], compared=True)
    with torch.no_grad():
        # Only the checksums are needed, and they are of local data: the local parts are scanned
        # alone, without the statistics' collectives a distributed scan would add.
        parts = layouts.local_parts(layout)
        result = scan_local(parts, layout.names, False, checksum=True)
    assert result.checksum is not None
    return compare_layout(layout, result.checksum, process_group)
