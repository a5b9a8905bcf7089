"""DTensor gradients (FSDP2, tensor parallel, HSDP, 2-d meshes): a layout per list of DTensors.

Each rank scans its local shards; each distinct mesh is one reduction group (nanscan.layouts.reduce),
a tensor counted on the rank at coordinate 0 of each of its Replicate (or Partial) mesh dims. Partial
placements are reduced first (redistributed to Replicate, one collective per such tensor; gradients
of FSDP2 and tensor parallel are Shard or Replicate, so this is rare). Plain tensors beside the
DTensors are this rank's own (not reduced: ``Plan.own``): the statistics refuse them without
``process_group`` (nanscan.layouts._dtensors), and ``verify_replicas`` compares them over the
default group.

Plans are made once per list layout and found again by the identity of the tensors' DTensorSpecs:
FSDP2 gives a parameter's gradient the same spec object every step, so finding the plan costs no
per-tensor work beyond ``id()`` (placements and meshes hash in Python, at a microsecond per tensor).
A plan holds its specs, so an id in a key cannot be another object's while the plan is cached.
"""

from __future__ import annotations

import functools
import operator
import sys
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from .reduce import Copies, Group, Plan, ReplicaLines, fingerprint

_LOCAL_TENSOR = operator.attrgetter("_local_tensor")  # a DTensor's local shard
_SPEC = operator.attrgetter("_spec")  # a DTensor's layout (mesh, placements, shape, dtype)
_PLANS = 8  # cached plans (one per distinct list layout)


def dtensor_class() -> type[torch.Tensor] | None:
    """torch's DTensor class if its module was imported (no DTensor can exist otherwise), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None) if module is not None else None
    return cls


def has_dtensor(tensors: Sequence[object]) -> bool:
    cls = dtensor_class()
    return cls is not None and any(isinstance(t, cls) for t in tensors)


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a DTensor, without a subclass check of plain tensors (the usual entry)."""
    if type(t) is torch.Tensor:
        return False
    cls = dtensor_class()
    return cls is not None and isinstance(t, cls)


def to_local(tensors: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The local part of each tensor: a DTensor's local shard (no copy), other tensors as they are.

    Read from the DTensor's ``_local_tensor`` attribute: what ``to_local()`` returns outside autograd,
    without its Python method call (a microsecond per tensor, most of a check's host time on a list
    of thousands of DTensors); by one C-level map while every entry is a DTensor (half the time)."""
    try:
        return list(map(_LOCAL_TENSOR, tensors))
    except AttributeError:  # plain tensors among them
        return [getattr(t, "_local_tensor", t) for t in tensors]


def mesh_group(mesh: Any) -> Any:
    """The process group spanning every rank of a mesh."""
    if mesh.ndim == 1:
        return mesh.get_group()
    if mesh.size() == dist.get_world_size():
        return None  # the default group
    return mesh._flatten().get_group()  # an N-d sub-mesh: torch makes (and caches) the flattened group


@dataclass
class DTensorPlan(Plan):
    """A Plan whose key is its DTensorSpecs, held so that their ids stay theirs."""

    specs: list[Any] | None = None
    # Whether the meshes together hold every rank of the default group: where not (pipeline stages
    # each sharded over their own ranks), the reduction is those ranks' own (layouts._dtensors).
    spans_world: bool = True


_plans: OrderedDict[tuple[int, ...], DTensorPlan] = OrderedDict()


def _mesh_lines(mesh: Any, dim: int) -> ReplicaLines:
    """The copies along ``dim`` of ``mesh``: every run of global ranks that differ only in that
    coordinate is a set of copies; the MAX goes over that dim's group, the SUM over the whole mesh."""
    lines = mesh.mesh.movedim(dim, -1).reshape(-1, mesh.size(dim)).tolist()
    return ReplicaLines(mesh.get_group(dim), mesh_group(mesh), lines)


def _plan(key: tuple[int, ...], specs: list[Any]) -> DTensorPlan:
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
        copies = any(p.is_replicate() or p.is_partial() for i in indices for p in specs[i].placements)
        groups.append(Group(indices, mesh_group(mesh), counted, fingerprint(description), copies))
    partial = [i for i, spec in enumerate(specs) if spec is not None and any(p.is_partial() for p in spec.placements)]
    own = [i for i, spec in enumerate(specs) if spec is None]
    metas = [spec.tensor_meta for spec in specs if spec is not None]
    # A spec holds its tensor's dtype, so a cached plan knows them (reading 1,000 shards' dtypes
    # costs 0.1 ms a call); a spec without tensor metadata leaves them to be read from the shards.
    known = None if any(meta is None for meta in metas) else frozenset(meta.dtype for meta in metas)
    known_indices = [i for i, spec in enumerate(specs) if spec is not None] if known is not None else []
    ranks = {rank for mesh in by_mesh for rank in mesh.mesh.flatten().tolist()}
    spans_world = len(ranks) >= dist.get_world_size()
    plan = DTensorPlan(
        groups, own, _copies(specs), known, known_indices, partial, specs=list(specs), spans_world=spans_world
    )
    _plans[key] = plan
    if len(_plans) > _PLANS:
        _plans.popitem(last=False)
    return plan


def _copies(specs: list[Any]) -> list[Copies]:
    """The tensors with copies, by (mesh, dim), in order of first appearance; plain tensors under one
    entry of their own (copies over the replica group of a plain model)."""
    by_key: dict[tuple[Any, int | None], list[int]] = {}
    for i, spec in enumerate(specs):
        if spec is None:
            by_key.setdefault((None, None), []).append(i)
            continue
        for d, p in enumerate(spec.placements):
            if p.is_replicate() or p.is_partial():  # Partial: the scan reads it reduced, a copy
                by_key.setdefault((spec.mesh, d), []).append(i)
    copies = []
    for (mesh, dim), indices in by_key.items():
        if mesh is None:
            copies.append(Copies(("plain",), None, indices))
        else:
            assert dim is not None
            copies.append(Copies((id(mesh), dim, mesh), functools.partial(_mesh_lines, mesh, dim), indices))
    return copies


def plan_of(tensors: Sequence[torch.Tensor]) -> DTensorPlan:
    """The (cached) plan of a list that holds DTensors: its mesh groups, Partial tensors, copies."""
    try:
        specs = list(map(_SPEC, tensors))  # C-level maps while every entry is a DTensor
    except AttributeError:
        specs = [getattr(t, "_spec", None) for t in tensors]  # plain tensors have no layout
    # The plan found last (a training loop checks one list step after step), if these are its spec
    # objects (FSDP2 and tensor parallel keep them from step to step): found by identity, at half
    # the cost of forming and hashing the key.
    last = next(reversed(_plans.values()), None)
    if (
        last is not None
        and last.specs is not None
        and len(last.specs) == len(specs)
        and all(map(operator.is_, specs, last.specs))
    ):
        return last
    key = tuple(map(id, specs))
    plan = _plans.get(key)
    if plan is None:
        plan = _plan(key, specs)
    else:
        _plans.move_to_end(key)  # the last one, for the next call
    return plan


def without_partial(tensors: list[torch.Tensor], shards: list[torch.Tensor], plan: Plan) -> list[torch.Tensor]:
    """What a scan reads of each tensor: a DTensor's local shard, a Partial DTensor's local part once
    reduced (one collective each: every rank of the mesh must call this), a plain tensor itself."""
    if not plan.partial:
        return shards
    parts = list(shards)  # the caller's list keeps the Partial parts (a clip scales those)
    for i in plan.partial:
        parts[i] = _reduced_partial(tensors[i])
    return parts


def _reduced_partial(t: Any) -> torch.Tensor:
    """The local part of a DTensor with Partial placements once they are reduced (one collective):
    afterwards the tensor is Replicate on those mesh dims, and counted once there like any replica."""
    from torch.distributed.tensor import Replicate

    placements = [Replicate() if p.is_partial() else p for p in t.placements]
    return cast(torch.Tensor, t.redistribute(t.device_mesh, placements).to_local())
