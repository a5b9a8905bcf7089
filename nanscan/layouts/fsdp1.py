"""FSDP1 (``torch.distributed.fsdp.FullyShardedDataParallel``): its flat parameters cut back into the
parameters the user wrote, each reduced over FSDP's own process groups.

FSDP1 flattens each unit's parameters into one ``FlatParameter`` and keeps on each rank a shard of
it (``FULL_SHARD``, ``SHARD_GRAD_OP``; ``HYBRID_SHARD`` and ``_HYBRID_SHARD_ZERO2`` within a node's
group, replicated across nodes), or all of it (``NO_SHARD``, replicated everywhere). After backward
the flat parameter's ``.grad`` is this rank's shard of the reduced gradient. Its metadata
(``_shard_param_infos``: where each original parameter's elements sit in this rank's shard, if at
all) cuts the shard back into each parameter's local part, a 1-d view, empty where the parameter
has no element on this rank. With ``use_orig_params=True`` FSDP hands out those views itself, as
the original parameters' ``.grad``; they are read there (what the optimizer steps on), and the
rule of which parameters have a gradient is FSDP's own (the unit has one, the parameter requires
one and was not set to None; ``_use_sharded_grad_views``).

Every parameter is then a tensor of the list on every rank, whether or not its shard here is
empty, under the name the user wrote (``layers.3.mlp.fc.weight``: the module that owns it, named
in the model passed, without FSDP's ``_fsdp_wrapped_module.``; nanscan.names), in the model's own
order. Reduction (nanscan.layouts.reduce): a unit's parameters are reduced over its shard group
(sharded strategies), over the world counted on the first replica only (the hybrid ones: every
node's group holds a full copy), or over its group counted on its rank 0 (``NO_SHARD``). Parameters
of the model that no unit manages (ignored modules) are taken as FSDP's own ``clip_grad_norm_``
takes them: copies on every rank, reduced over the root's group and counted on its rank 0. Units
that share their groups (FSDP's auto-wrap gives every unit the root's) make one reduction group:
two collectives per check.

A unit that FSDP reduces over a group of one rank (``NO_SHARD`` there: FSDP1 clamps any strategy
over a one-rank shard group to it, so ``HYBRID_SHARD`` on a mesh whose shard dim has size 1 becomes
it) is reduced over that one rank, as FSDP reduces it: each rank's report of it is its own, as each
rank's gradients are; nanscan warns once per model, since the replicas are then never averaged.

Which units: every handle of the FSDP1 root the model belongs to (FSDP keeps them, from the first
forward, in the execution-order data it shares with every unit: ``_exec_order_data.all_handles``),
so a model passed from inside its root (the module Hugging Face's Trainer hands its callbacks, the
LightningModule under Lightning's FSDP strategy) still finds the units above it; only parameters
whose module lies in the model passed are reported.

What nanscan learns of a model's units it keeps (by weak reference) for each unit's parameters, so
that a later list of those parameters (``clip_grad_norm_(model.parameters())``, an optimizer's under
the GradScaler) is reduced too. Flattened parameters whose model nanscan has not seen are refused
(``refuse_unknown``): a rank's shard is not the model.
"""

from __future__ import annotations

import functools
import sys
import warnings
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..names import clean_module_names
from .reduce import Copies, Group, Plan, ReplicaLines, fingerprint

_FSDP1 = ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel")
_FLAT_PARAMETER_MODULE = "torch.distributed.fsdp._flat_param"
_FLATTENED = "_fsdp_flattened"  # FSDP's mark on flat parameters and the original parameters in them
_SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")
_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_is_fsdp1: dict[type, bool] = {}


def is_fsdp1_class(cls: type) -> bool:
    """Whether ``cls`` is FSDP1's wrapper (or a subclass), known without importing it."""
    known = _is_fsdp1.get(cls)
    if known is None:
        known = any((c.__module__, c.__qualname__) == _FSDP1 for c in cls.__mro__)
        _is_fsdp1[cls] = known
    return known


def holds_fsdp1(module_types: Iterable[type]) -> bool:
    """Whether a model whose modules have these types holds an FSDP1 unit."""
    return any(map(is_fsdp1_class, module_types))


def flattened(tensors: Sequence[object]) -> bool:
    """Whether any of ``tensors`` is a parameter FSDP1 flattened (a flat parameter, or an original
    parameter in one). Costs nothing where FSDP1 was never imported: none can exist then."""
    if _FLAT_PARAMETER_MODULE not in sys.modules:
        return False
    return any(getattr(t, _FLATTENED, False) for t in tensors)


@dataclass
class _Unit:
    """One FSDP1 unit (a FlatParamHandle): how its local flat tensor is cut into its parameters'
    parts, and how those are reduced."""

    handle_ref: weakref.ReferenceType[Any]  # no strong reference into the model (module notes)
    use_orig_params: bool
    sizes: list[int]  # split_with_sizes of the local flat tensor: every element once, in order
    pieces: list[int]  # per parameter of the unit: which piece of that split is its part
    group: Any  # the process group its parameters are reduced over (None: the default group)
    counted: bool  # whether this rank adds its parts' counts and squares (False on extra copies)
    strategy: str
    copies: tuple[tuple[Any, ...], Any] | None  # (key, lines maker) when its parts have copies

    @property
    def handle(self) -> Any:
        handle = self.handle_ref()
        if handle is None:
            raise RuntimeError("nanscan: an FSDP1 unit of this model no longer exists; check the model itself again")
        return handle

    @property
    def flat_param(self) -> Any:
        return self.handle.flat_param

    def local(self, source: str) -> torch.Tensor | None:
        """This rank's flat tensor: the gradient shard (``source="grad"``; None without one) or the
        parameter shard (``"data"``)."""
        flat = self.handle.flat_param
        local: torch.Tensor | None = flat.grad if source == "grad" else flat.detach()
        return local


@dataclass
class _Entry:
    """One parameter of the report: of a unit (its index there), or one no unit manages."""

    name: str
    unit: int | None
    index: int  # in the unit's parameters; for an unmanaged parameter, in ``ModelLayout.unmanaged_refs``


@dataclass
class ModelLayout:
    """An FSDP1 model's parameters as nanscan reports them, made once per model (``of_model``)."""

    units: list[_Unit]
    entries: list[_Entry]  # in the model's parameter order
    unmanaged_refs: list[weakref.ReferenceType[torch.nn.Parameter]]  # parameters that no unit manages
    root_group: Any  # the group unmanaged parameters are reduced over
    root_counted: bool
    # FSDP's execution-order data whose handles the layout was made from, and their ids, compared at
    # every call (None before the first forward: then the layout is made again at the next call).
    order_ref: weakref.ReferenceType[Any] | None
    handle_ids: tuple[int, ...]
    model_ref: weakref.ReferenceType[torch.nn.Module]  # to make the layout again (before the first forward)
    plans: dict[tuple[Any, ...], tuple[Plan, list[int]]] = field(default_factory=dict)

    def current(self) -> bool:
        """Whether FSDP still has the handles this layout was made from."""
        order = self.order_ref() if self.order_ref is not None else None
        handles = getattr(order, "all_handles", None)
        return handles is not None and len(handles) > 0 and tuple(map(id, handles)) == self.handle_ids

    def unmanaged(self, index: int) -> torch.nn.Parameter:
        p = self.unmanaged_refs[index]()
        if p is None:
            raise RuntimeError(
                "nanscan: a parameter of this FSDP1 model no longer exists; check the model itself again"
            )
        return p


@dataclass(frozen=True)
class Parts:
    """One call's view of an FSDP1 model (or of some of its parameters): what ``Layout`` needs."""

    names: list[str]
    parts: list[torch.Tensor]  # this rank's part of each parameter, in ``names`` order
    scaled: list[torch.Tensor]  # what a clip multiplies: flat gradient shards, and the other gradients
    plan: Plan
    numels: list[int]  # each whole parameter's number of elements


# A layout holds no strong reference into its model (weak ones to FSDP's handles and objects), so
# that these maps keep no model alive.
_models: weakref.WeakKeyDictionary[torch.nn.Module, ModelLayout] = weakref.WeakKeyDictionary()
# Each parameter of a model seen (a flat parameter, an original one, one no unit manages), by id, with
# a weak reference that proves the id still its, its model's layout and its entries' positions there:
# how a list of parameters is reduced (module notes). Tensors cannot be the keys of a weak dict (their
# == is elementwise); an entry leaves when its parameter dies.
_by_parameter: dict[int, tuple[weakref.ReferenceType[Any], ModelLayout, list[int]]] = {}


def _known(p: Any) -> tuple[ModelLayout, list[int]] | None:
    entry = _by_parameter.get(id(p))
    if entry is None or entry[0]() is not p:
        return None
    return entry[1], entry[2]


def _remember(p: Any, layout: ModelLayout, position: int) -> None:
    entry = _by_parameter.get(id(p))
    if entry is not None and entry[0]() is p and entry[1] is layout:
        entry[2].append(position)
        return
    key = id(p)

    def forget(ref: weakref.ReferenceType[Any]) -> None:
        current = _by_parameter.get(key)
        if current is not None and current[0] is ref:
            del _by_parameter[key]

    _by_parameter[key] = (weakref.ref(p, forget), layout, [position])


def _states(model: torch.nn.Module) -> list[Any]:
    return [m for m in model.modules() if is_fsdp1_class(type(m))]


def _handles(states: list[Any]) -> tuple[Any, list[Any]]:
    """(FSDP's execution-order data, every handle of the root the states belong to, in FSDP's order;
    module notes); before the first forward (None, only the states' own handles)."""
    for state in states:
        order = getattr(state, "_exec_order_data", None)
        handles = getattr(order, "all_handles", None)
        if handles:
            return order, list(handles)
    return None, [s._handle for s in states if getattr(s, "_handle", None) is not None]


def _strategy(handle: Any) -> str:
    return str(handle._sharding_strategy.name)


def _lines_of_group(group: Any) -> ReplicaLines:
    """Copies on every rank of ``group`` (None: the world)."""
    ranks = list(range(dist.get_world_size())) if group is None else dist.get_process_group_ranks(group)
    return ReplicaLines(group, group, [ranks])


def _copies_over(group: Any) -> tuple[tuple[Any, ...], Any]:
    return ("fsdp1", id(group), group), functools.partial(_lines_of_group, group)


def _hybrid_lines(inter: Any, mesh: Any) -> ReplicaLines:
    """The replicas of a hybrid strategy's shards: each node group's shard at the same position
    across the node groups (the inter-node group), from FSDP's device mesh when it has one (its dim 0
    is the replicate dim), else gathered once from every rank (a host collective)."""
    if mesh is not None:
        from .dtensor import mesh_group

        lines = mesh.mesh.movedim(0, -1).reshape(-1, mesh.size(0)).tolist()
        return ReplicaLines(inter, mesh_group(mesh), lines)
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, dist.get_process_group_ranks(inter))
    lines = sorted({tuple(line) for line in gathered})
    return ReplicaLines(inter, None, [list(line) for line in lines])


def _reduction(handle: Any, states_by_handle: dict[int, Any], any_state: Any) -> tuple[Any, bool, Any]:
    """(group, counted, copies) of a unit: see the module notes."""
    strategy = _strategy(handle)
    group = handle.process_group
    if strategy in _SHARDED:
        return group, True, None
    if strategy == "NO_SHARD":
        return group, dist.get_rank(group) == 0, _copies_over(group)
    if strategy not in _HYBRID:
        raise NotImplementedError(f"nanscan: FSDP1's sharding strategy {strategy} is not known to nanscan")
    state = states_by_handle.get(id(handle), any_state)
    inter = getattr(state, "_inter_node_pg", None)
    mesh = getattr(state, "_device_mesh", None)
    if inter is None:
        raise RuntimeError(f"nanscan: FSDP1 unit with {strategy} has no inter-node group to find its replicas")
    if mesh is not None:
        from .dtensor import mesh_group

        spread = mesh_group(mesh)
    elif dist.get_world_size(group) * dist.get_world_size(inter) == dist.get_world_size():
        spread = None
    else:
        raise RuntimeError(
            f"nanscan: FSDP1 with {strategy} over groups that do not span the world (shard group of "
            f"{dist.get_world_size(group)}, replicate group of {dist.get_world_size(inter)}, world of "
            f"{dist.get_world_size()}) and without a device mesh: pass FSDP a device_mesh"
        )
    counted = dist.get_rank(inter) == 0
    return spread, counted, (("fsdp1-hybrid", id(inter), inter), functools.partial(_hybrid_lines, inter, mesh))


def _split(handle: Any) -> tuple[list[int], list[int]]:
    """How to cut a unit's local flat tensor (see _Unit)."""
    flat = handle.flat_param
    infos = flat._shard_param_infos
    total = flat.numel()
    placed = sorted((info.offset_in_shard, info.numel_in_shard, i) for i, info in enumerate(infos) if info.in_shard)
    sizes: list[int] = []
    pieces = [-1] * len(infos)
    cursor = 0
    for offset, numel, i in placed:
        if offset > cursor:  # alignment padding between parameters
            sizes.append(offset - cursor)
        pieces[i] = len(sizes)
        sizes.append(numel)
        cursor = offset + numel
    if total > cursor:  # the shard's padding
        sizes.append(total - cursor)
    for i, piece in enumerate(pieces):
        if piece < 0:  # no element on this rank: an empty part
            pieces[i] = len(sizes)
            sizes.append(0)
    return sizes, pieces


def _make(model: torch.nn.Module, states: list[Any], order: Any, handles: list[Any]) -> ModelLayout:
    states_by_handle = {id(s._handle): s for s in states if getattr(s, "_handle", None) is not None}
    any_state = states[0]
    modules = list(model.named_modules())
    position = {id(m): i for i, (_, m) in enumerate(modules)}
    clean = clean_module_names(model) or {}
    module_name = {id(m): clean.get(name, name) for name, m in modules}
    units: list[_Unit] = []
    keyed: list[tuple[tuple[int, int], _Entry]] = []
    for handle in handles:
        group, counted, copies = _reduction(handle, states_by_handle, any_state)
        sizes, pieces = _split(handle)
        unit_index = len(units)
        units.append(
            _Unit(
                weakref.ref(handle),
                bool(handle._use_orig_params),
                sizes,
                pieces,
                group,
                counted,
                _strategy(handle),
                copies,
            )
        )
        for i, info in enumerate(handle.flat_param._param_infos):
            owner = module_name.get(id(info.module))
            if owner is None:
                continue  # a parameter of the root's, outside the model passed
            name = f"{owner}.{info.param_name}" if owner else info.param_name
            keyed.append(((position[id(info.module)], i), _Entry(name, unit_index, i)))
    unmanaged: list[torch.nn.Parameter] = []
    seen: set[int] = set()
    for m_index, (_, module) in enumerate(modules):
        for k, (key, p) in enumerate(module._parameters.items()):
            if p is None or id(p) in seen or getattr(p, _FLATTENED, False):
                continue
            seen.add(id(p))
            owner = module_name[id(module)]
            keyed.append(((m_index, k), _Entry(f"{owner}.{key}" if owner else key, None, len(unmanaged))))
            unmanaged.append(p)
    keyed.sort(key=lambda pair: pair[0])
    # Unmanaged parameters are copies on every rank the model spans: the first unit's reduction group
    # (FSDP's first handle is the root's, or the first of its units'; all share the root's groups).
    root_group = units[0].group if units else None
    root_counted = dist.get_rank(root_group) == 0
    entries = [e for _, e in keyed]
    _warn_if_alone(units)
    return ModelLayout(
        units,
        entries,
        [weakref.ref(p) for p in unmanaged],
        root_group,
        root_counted,
        weakref.ref(order) if order is not None else None,
        tuple(map(id, handles)),
        weakref.ref(model),
    )


def kept(model: torch.nn.Module) -> ModelLayout | None:
    """The kept layout of a model nanscan has seen hold FSDP1 units, if FSDP still has its handles."""
    cached = _models.get(model)
    return cached if cached is not None and cached.current() else None


def _warn_if_alone(units: list[_Unit]) -> None:
    """Warns of units that FSDP reduces over no other rank in a world of several: each rank's model
    is then its own, and so is each rank's report (module notes)."""
    world = dist.get_world_size()
    alone = [u for u in units if u.strategy == "NO_SHARD" and dist.get_world_size(u.handle.process_group) == 1]
    if world > 1 and alone:
        warnings.warn(
            f"nanscan: {len(alone)} of this FSDP1 model's {len(units)} units are NO_SHARD over a process group of "
            f"one rank in a world of {world}: FSDP never averages their gradients with other ranks', so each "
            "rank's are its own and so is each rank's report of them. FSDP1 turns a sharding strategy over a "
            "shard group of one rank into that (HYBRID_SHARD on a device mesh whose shard dim has size 1): "
            "was it meant?",
            RuntimeWarning,
            stacklevel=5,
        )


def of_model(model: torch.nn.Module) -> ModelLayout:
    """The layout of an FSDP1 model (one that holds an FSDP1 unit), kept between calls and checked
    against FSDP's handles at each call."""
    cached = _models.get(model)
    if cached is not None and cached.current():
        return cached
    states = _states(model)
    if not states:
        raise ValueError(f"nanscan: {type(model).__name__} holds no FSDP1 unit")
    order, handles = _handles(states)
    layout = _make(model, states, order, handles)
    _models[model] = layout
    for position, entry in enumerate(layout.entries):
        if entry.unit is None:
            keys = [layout.unmanaged(entry.index)]
        else:
            unit = layout.units[entry.unit]
            keys = [unit.flat_param]
            if unit.use_orig_params:
                keys.append(unit.flat_param._params[entry.index])
        for key in keys:
            _remember(key, layout, position)
    return layout


def parts(layout: ModelLayout, source: str = "grad", positions: Sequence[int] | None = None) -> Parts:
    """This call's parts of the model's parameters (``positions``: of some of its entries, in that
    order), their names, what a clip scales, and the reduction plan."""
    units = layout.units
    locals_: list[torch.Tensor | None] = [u.local(source) for u in units]
    cut: list[list[torch.Tensor] | None] = []
    present_by_unit: list[list[bool] | None] = []
    for unit, flat in zip(units, locals_, strict=True):
        if flat is None:
            cut.append(None)
            present_by_unit.append(None)
            continue
        pieces = list(flat.split(unit.sizes)) if len(unit.sizes) > 1 else [flat]
        mine = [pieces[p] for p in unit.pieces]
        if unit.use_orig_params and source == "grad":
            mask = unit.flat_param._is_grad_none_mask
            params = unit.flat_param._params
            wanted = [p.requires_grad and not none for p, none in zip(params, mask, strict=True)]
            grads = [p.grad for p in params]
            mine = [g if g is not None else empty for g, empty in zip(grads, mine, strict=True)]
            present_by_unit.append(wanted)
        else:
            present_by_unit.append([True] * len(mine))
        cut.append(mine)
    entries = layout.entries if positions is None else [layout.entries[p] for p in positions]
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    kept: list[int] = []
    for k, entry in enumerate(entries):
        if entry.unit is None:
            p = layout.unmanaged(entry.index)
            t = p.grad if source == "grad" else p.detach()
            if t is None:
                continue
        else:
            mine_or_none = cut[entry.unit]
            wanted_or_none = present_by_unit[entry.unit]
            if mine_or_none is None or wanted_or_none is None or not wanted_or_none[entry.index]:
                continue
            t = mine_or_none[entry.index]
        names.append(entry.name)
        tensors.append(t)
        kept.append(k)
    # What a clip scales: a flat gradient shard whole (use_orig_params=False: what the optimizer steps
    # on), else each kept parameter's gradient (the original parameters', an unmanaged one's).
    scaled: list[torch.Tensor] = []
    if source == "grad":
        kept_units = sorted({u for u in (entries[k].unit for k in kept) if u is not None})
        scaled = [flat for u in kept_units if not units[u].use_orig_params and (flat := locals_[u]) is not None]
        scaled += [tensors[i] for i, k in enumerate(kept) if _scaled_one_by_one(entries[k], units)]
    key = (source, None if positions is None else tuple(positions), tuple(kept))
    cached = layout.plans.get(key)
    if cached is None:
        cached = (_plan(layout, [entries[k] for k in kept]), kept)
        layout.plans[key] = cached
    numels = [
        layout.unmanaged(e.index).numel() if e.unit is None else int(units[e.unit].flat_param._numels[e.index])
        for e in (entries[k] for k in kept)
    ]
    return Parts(names, tensors, scaled, cached[0], numels)


def _scaled_one_by_one(entry: _Entry, units: list[_Unit]) -> bool:
    """Whether a clip scales the entry's gradient itself, rather than its unit's flat shard whole."""
    return entry.unit is None or units[entry.unit].use_orig_params


def _plan(layout: ModelLayout, entries: list[_Entry]) -> Plan:
    """The reduction plan of these entries (module notes): one group per process group."""
    by_group: dict[int, tuple[Any, list[int], list[bool], list[Any], list[bool]]] = {}
    copies: dict[tuple[Any, ...], tuple[Any, list[int]]] = {}
    for i, entry in enumerate(entries):
        copy: tuple[tuple[Any, ...], Any] | None
        if entry.unit is None:
            group, counted, copy = layout.root_group, layout.root_counted, _copies_over(layout.root_group)
            shape: Any = tuple(layout.unmanaged(entry.index).shape)
            strategy = "unmanaged"
        else:
            unit = layout.units[entry.unit]
            group, counted, copy = unit.group, unit.counted, unit.copies
            shape = tuple(unit.flat_param._shapes[entry.index])
            strategy = unit.strategy
        slot = by_group.setdefault(id(group), (group, [], [], [], []))
        slot[1].append(i)
        slot[2].append(counted)
        slot[3].append((entry.name, shape, strategy))
        slot[4].append(copy is not None)
        if copy is not None:
            copies.setdefault(copy[0], (copy[1], []))[1].append(i)
    groups = [
        Group(indices, group, counted, fingerprint(description), any(copied))
        for group, indices, counted, description, copied in by_group.values()
    ]
    return Plan(
        groups,
        own=[],
        copies=[Copies(key, lines, indices) for key, (lines, indices) in copies.items()],
        dtypes=None,
    )


def of_parameters(params: Sequence[Any]) -> tuple[ModelLayout, list[int]]:
    """The layout and entry positions of a list of flattened parameters whose model nanscan has seen
    (a flat parameter stands for all of its unit's parameters); refused otherwise (module notes)."""
    layout: ModelLayout | None = None
    positions: list[int] = []
    first = _known(params[0]) if params else None
    if first is not None and not first[0].current():
        # Made before FSDP's first forward, when the units it knew were only the model's own: again.
        model = first[0].model_ref()
        if model is not None:
            of_model(model)
    for i, p in enumerate(params):
        known = _known(p)
        if known is None:
            if getattr(p, _FLATTENED, False):
                refuse_unknown(i)
            raise ValueError(
                f"nanscan: entry {i} of the parameters belongs to no FSDP1 model nanscan knows, beside FSDP1 "
                "parameters: pass the FSDP model itself (nanscan.check(model), nanscan.clip_grad_norm_(model, "
                "max_norm))"
            )
        if layout is None:
            layout = known[0]
        elif known[0] is not layout:
            raise ValueError("nanscan: the parameters belong to two FSDP1 models; check each model on its own")
        positions += known[1]
    assert layout is not None
    if not layout.current():
        raise ValueError(
            "nanscan: FSDP1's units changed since nanscan last saw this model; pass the model itself again "
            "(nanscan.check(model), nanscan.clip_grad_norm_(model, max_norm))"
        )
    return layout, positions


def refuse_unknown(index: int) -> None:
    raise ValueError(
        f"nanscan: entry {index} is a parameter that FSDP1 (FullyShardedDataParallel) has flattened and sharded: "
        "this rank holds only its shard, so its statistics alone would be one rank's, not the model's. Pass the "
        "FSDP model itself (nanscan.check(model, max_norm=...), nanscan.clip_grad_norm_(model, max_norm), "
        "scaler.watch(model) for nanscan.amp.GradScaler); after that, lists of its parameters are reduced "
        "too. Or use FSDP's own model.clip_grad_norm_(max_norm)"
    )
