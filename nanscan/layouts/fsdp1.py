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
of the model that no unit manages (ignored modules) are never reduced by FSDP: each rank's gradient
of them is its own, so where they require a gradient the gradients' calls refuse them (decided by
``requires_grad``, alike on every rank); their values (``check_state``) are taken as copies on
every rank, reduced over the root's group and counted on its rank 0. Gradients FSDP has not reduced
(a backward under ``no_sync()``) are refused (``_unsynced``). Units
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
the GradScaler) is reduced too, and so is a list of its flat gradients (``of_gradients``). The models
it learns of are those passed to it and every root the process made (nanscan.layouts.live, once FSDP
has run the root's first forward), so a list of parameters or gradients is reduced without the model
ever being passed. Flattened parameters whose model nanscan does not know (one copied without its
constructor) are refused (``refuse_unknown``): a rank's shard is not the model.
"""

from __future__ import annotations

import functools
import itertools
import operator
import sys
import warnings
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..names import clean_module_names
from .reduce import Copies, Group, Plan, ReplicaLines, empty_part, fingerprint

_FSDP1 = ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel")
_FLAT_PARAMETER_MODULE = "torch.distributed.fsdp._flat_param"
FLATTENED = "_fsdp_flattened"  # FSDP's mark on flat parameters and the original parameters in them
_SHARDED = ("FULL_SHARD", "SHARD_GRAD_OP")
_HYBRID = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
_REQUIRES_GRAD = operator.attrgetter("requires_grad")
_GRAD = operator.attrgetter("grad")
# Weakly: every module class made meets it (nanscan.layouts.live), and torch.fx makes one per GraphModule.
_is_fsdp1: weakref.WeakKeyDictionary[type, bool] = weakref.WeakKeyDictionary()


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


def possible() -> bool:
    """Whether FSDP1 can have flattened a parameter in this process: only once its module is imported
    and a process group is up (FSDP1 needs one). Where not, a list costs no look at its entries."""
    return _FLAT_PARAMETER_MODULE in sys.modules and dist.is_available() and dist.is_initialized()


def flattened(tensors: Sequence[object]) -> bool:
    """Whether any of ``tensors`` is a parameter FSDP1 flattened (a flat parameter, or an original
    parameter in one): 45 ns a tensor by a C-level map, where ``possible()``, else nothing."""
    return possible() and any(map(hasattr, tensors, itertools.repeat(FLATTENED)))


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
    numel: int  # of the local flat shard (``sizes`` add up to it): what a reduced gradient holds
    # use_orig_params: the original parameters and FSDP's list of which have no gradient (lists it
    # keeps for the unit's life; parameters hold no reference to their model).
    params: tuple[torch.nn.Parameter, ...] = ()
    grad_none_mask: list[bool] | None = None

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
    selections: dict[tuple[Any, ...], _Selection] = field(default_factory=dict)  # by parts()' key

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
    # The table itself, not the module's name for it: a parameter collected at interpreter exit calls
    # this after the module's globals are cleared ("Exception ignored in: forget" otherwise).
    table = _by_parameter

    def forget(ref: weakref.ReferenceType[Any]) -> None:
        current = table.get(key)
        if current is not None and current[0] is ref:
            del table[key]

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
                sum(sizes),
                tuple(handle.flat_param._params) if handle._use_orig_params else (),
                handle.flat_param._is_grad_none_mask if handle._use_orig_params else None,
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
            if p is None or id(p) in seen or getattr(p, FLATTENED, False):
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


@dataclass
class _Selection:
    """What one call's parts are, for one set of parameters present (``parts``): made once per
    (source, positions, which units and parameters have a gradient), so that a call only cuts the
    shards and lays the pieces out."""

    where: list[tuple[int, int]]  # per part: (unit, index in it), or (-1, index of an unmanaged one)
    names: list[str]
    numels: list[int]
    plan: Plan
    flat_scaled: list[int]  # units whose flat shard a clip scales whole
    one_by_one: list[int]  # parts a clip scales themselves
    # The plan of what a clip scales (flat_scaled's shards, then one_by_one's parts): a total norm
    # needs no per-parameter part, and cutting the shards is most of a call's host time.
    whole_plan: Plan
    entries: list[_Entry]  # the entries present, one per part


def _locals(layout: ModelLayout, source: str) -> list[torch.Tensor | None]:
    """This rank's flat tensor of each unit: its gradient shard (None where the unit has none) or its
    parameter shard. Gradients that FSDP has not reduced yet are refused (``_require_synced``)."""
    if source == "grad":
        flats = [u.flat_param for u in layout.units]
        grads: list[torch.Tensor | None] = list(map(_GRAD, flats))
        if any(map(_unsynced, flats, grads, layout.units)):
            _refuse_unsynced(layout)
        return grads
    return [u.flat_param.detach() for u in layout.units]


def _unsynced(flat: Any, grad: torch.Tensor | None, unit: _Unit) -> bool:
    """Whether a unit's gradient is one FSDP has not reduced: accumulated under ``no_sync()``. FSDP
    marks a flat parameter ``_post_backward_called`` in its post-backward hook and clears the mark
    only at the end of a backward that synchronised (``_finalize_params``), so the mark outlives a
    backward run under ``no_sync()``, on every rank alike; the gradient of a sharded strategy is then
    the unsharded one, of another size than the shard the unit is cut by."""
    if grad is None:
        return False
    return bool(getattr(flat, "_post_backward_called", False)) or grad.numel() != unit.numel


def _refuse_unsynced(layout: ModelLayout) -> None:
    raise ValueError(
        "nanscan: this FSDP1 model's gradients are not reduced across its ranks: its last backward ran inside "
        "model.no_sync() (gradient accumulation), which leaves each rank its own unreduced (and, for a sharded "
        "strategy, unsharded) gradient, not the model's. Call nanscan after the backward that synchronises "
        "(the first one outside no_sync(), before the optimizer step), as FSDP's own clip_grad_norm_ is meant to be"
    )


def _wanted(layout: ModelLayout, source: str) -> tuple[tuple[tuple[bool, ...], ...], ...]:
    """What decides which original parameters of ``use_orig_params`` units have a gradient, by FSDP's
    rule (module notes: each one's ``requires_grad`` and FSDP's ``_is_grad_none_mask``), read by
    C-level maps; part of the selection's key."""
    if source != "grad":
        return ()
    rules = tuple(
        (tuple(map(_REQUIRES_GRAD, unit.params)), tuple(unit.grad_none_mask or ()))
        for unit in layout.units
        if unit.use_orig_params
    )
    if not layout.unmanaged_refs:
        return rules
    # The parameters no unit manages: whether each requires a gradient (refused: _select) and has one.
    unmanaged = [layout.unmanaged(i) for i in range(len(layout.unmanaged_refs))]
    return (*rules, (tuple(map(_REQUIRES_GRAD, unmanaged)), tuple(p.grad is None for p in unmanaged)))


def _selected(
    layout: ModelLayout, source: str, positions: Sequence[int] | None
) -> tuple[_Selection, list[torch.Tensor | None]]:
    """This call's selection (made once per key), and the units' flat tensors it was keyed by."""
    locals_ = _locals(layout, source)
    wanted = _wanted(layout, source)
    key = (source, None if positions is None else tuple(positions), tuple(t is None for t in locals_), wanted)
    selection = layout.selections.get(key)
    if selection is None:
        selection = _select(layout, source, positions, locals_, wanted)
        layout.selections[key] = selection
    return selection, locals_


def parts(layout: ModelLayout, source: str = "grad", positions: Sequence[int] | None = None) -> Parts:
    """This call's parts of the model's parameters (``positions``: of some of its entries, in that
    order), their names, what a clip scales, and the reduction plan."""
    selection, locals_ = _selected(layout, source, positions)
    # Cut each unit's shard into its parameters' parts (a parameter with no element here: an empty one).
    cut: list[list[torch.Tensor] | None] = []
    for unit, local in zip(layout.units, locals_, strict=True):
        if local is None:
            cut.append(None)
            continue
        pieces = local.split_with_sizes(unit.sizes) if len(unit.sizes) > 1 else [local]
        mine = [pieces[i] for i in unit.pieces]
        if unit.use_orig_params and source == "grad":  # the views FSDP hands out: what the optimizer uses
            mine = [g if g is not None else piece for g, piece in zip(map(_GRAD, unit.params), mine, strict=True)]
        cut.append(mine)
    unmanaged = layout.unmanaged
    tensors = [_unmanaged_tensor(unmanaged(i), source) if u < 0 else cut[u][i] for u, i in selection.where]  # type: ignore[index]
    scaled = [locals_[u] for u in selection.flat_scaled] + [tensors[i] for i in selection.one_by_one]
    return Parts(selection.names, tensors, scaled, selection.plan, selection.numels)


def whole_parts(layout: ModelLayout, source: str = "grad", positions: Sequence[int] | None = None) -> Parts:
    """What ``parts`` gives, for a total norm only: the units' flat shards whole (their padding is
    zeros) and, where FSDP hands those out, each original parameter's gradient, in the plan of whole
    units; no names. Cutting the shards into parts is most of a check's host time (a view costs 1.3
    us), so a clip does without it."""
    selection, locals_ = _selected(layout, source, positions)
    tensors: list[torch.Tensor] = [locals_[u] for u in selection.flat_scaled]  # type: ignore[misc]
    where = [selection.where[i] for i in selection.one_by_one]
    # The original parameters' gradients, read unit by unit; none on this rank: a zero-size tensor.
    grads = {u: list(map(_GRAD, layout.units[u].params)) for u in {u for u, _ in where if u >= 0}}
    for u, i in where:
        if u < 0:
            tensors.append(_unmanaged_tensor(layout.unmanaged(i), source))
            continue
        grad = grads[u][i]
        tensors.append(grad if grad is not None else empty_part(locals_[u].dtype, locals_[u].device))  # type: ignore[union-attr]
    return Parts([], tensors, tensors, selection.whole_plan, [])


def state_parts(
    layout: ModelLayout,
    optimizer_state: Mapping[Any, Mapping[str, Any]],
    keys: Sequence[str],
    positions: Sequence[int] | None = None,
) -> Parts:
    """Every parameter's values (``positions``: of some of the model's entries), then each one's
    optimizer state of each of ``keys`` (``fc.weight:exp_avg``, ``fc.weight:exp_avg_sq``, ...): this
    rank's part of each, cut from the flat shards as the values are, and the plan that reduces each
    state tensor as its parameter's values are reduced (``check_state``).

    An optimizer of a ``use_orig_params=False`` model keeps a flat tensor per unit (the shape of the
    unit's local flat shard, padding included), cut here by the unit's split; one of a
    ``use_orig_params=True`` model keeps one per original parameter (the shape of its part here).
    Where the optimizer keeps none (no element of the parameter on this rank, say), the part is
    empty. A state tensor of another size (a factored second moment) is not elementwise and cannot be
    cut: refused, by name."""
    values = parts(layout, "data", positions)
    selection, _ = _selected(layout, "data", positions)
    units = layout.units
    cut: dict[tuple[int, str], list[torch.Tensor] | None] = {}  # (unit, key) -> its parameters' parts

    def of_unit(u: int, key: str) -> list[torch.Tensor] | None:
        if (u, key) not in cut:
            unit = units[u]
            flat = unit.flat_param
            kept = _state_tensor(optimizer_state, flat, key, flat.numel(), f"unit {u}'s flat parameter")
            if kept is None:
                cut[(u, key)] = None
            else:
                flat_kept = kept.reshape(-1)
                pieces = flat_kept.split_with_sizes(unit.sizes) if len(unit.sizes) > 1 else [flat_kept]
                cut[(u, key)] = [pieces[i] for i in unit.pieces]
        return cut[(u, key)]

    tensors = list(values.parts)
    names = list(values.names)
    numels = list(values.numels)
    for (u, i), value, name, numel in zip(selection.where, values.parts, values.names, values.numels, strict=True):
        for key in keys:
            part: torch.Tensor | None
            if u < 0:
                p = layout.unmanaged(i)
                part = _state_tensor(optimizer_state, p, key, p.numel(), name)
            elif units[u].use_orig_params:
                p = units[u].params[i]
                part = _state_tensor(optimizer_state, p, key, value.numel(), name)
            else:
                unit_parts = of_unit(u, key)
                part = None if unit_parts is None else unit_parts[i]
            tensors.append(part if part is not None else empty_part(value.dtype, value.device))
            names.append(f"{name}:{key}")
            numels.append(numel)
    # Each state tensor is reduced as its parameter's part is (the same group, counted on the same
    # ranks): the parameter's entry once more per key.
    entries = selection.entries + [e for e in selection.entries for _ in keys]
    return Parts(names, tensors, [], _plan(layout, entries), numels)


def _state_tensor(
    optimizer_state: Mapping[Any, Mapping[str, Any]], owner: Any, key: str, numel: int, what: str
) -> torch.Tensor | None:
    """The optimizer's state ``key`` of ``owner`` (a flat or original parameter), if it keeps one,
    checked to be elementwise (``numel`` elements: the owner's on this rank)."""
    kept: torch.Tensor | None = optimizer_state.get(owner, {}).get(key)
    if kept is None:
        return None
    if kept.numel() != numel:
        raise ValueError(
            f"nanscan.check_state: the optimizer's state {key!r} of {what} holds {kept.numel()} elements where "
            f"this rank's part of the parameter holds {numel}: not kept element by element (a factored moment?), "
            "so it cannot be cut into FSDP1's parameters; check the weights alone (optimizer=None)"
        )
    return kept


def _unmanaged_tensor(p: torch.nn.Parameter, source: str) -> torch.Tensor:
    t = p.grad if source == "grad" else p.detach()
    assert t is not None, "a selection keeps the unmanaged parameters that have a gradient"
    return t


def _select(
    layout: ModelLayout,
    source: str,
    positions: Sequence[int] | None,
    locals_: list[torch.Tensor | None],
    wanted: tuple[tuple[tuple[bool, ...], ...], ...],
) -> _Selection:
    """The selection of the entries present in this call (see parts)."""
    units = layout.units
    orig_units = [u for u, unit in enumerate(units) if unit.use_orig_params]
    wanted_by_unit = {
        u: [requires and not none for requires, none in zip(*rule, strict=True)]
        for u, rule in zip(orig_units, wanted, strict=False)
    }
    entries = layout.entries if positions is None else [layout.entries[p] for p in positions]
    kept: list[_Entry] = []
    for entry in entries:
        if entry.unit is None:
            if source == "grad" and layout.unmanaged(entry.index).requires_grad:
                _refuse_unmanaged(layout, entries)
            if source == "grad" and layout.unmanaged(entry.index).grad is None:
                continue
        else:
            flags = wanted_by_unit.get(entry.unit)
            if locals_[entry.unit] is None or (flags is not None and not flags[entry.index]):
                continue
        kept.append(entry)
    where = [(e.unit if e.unit is not None else -1, e.index) for e in kept]
    numels = [
        layout.unmanaged(e.index).numel() if e.unit is None else int(units[e.unit].flat_param._numels[e.index])
        for e in kept
    ]
    # What stands for each kept parameter in a clip (and in a total norm): its unit's shard whole, but
    # where FSDP hands out the original parameters' gradients (use_orig_params), which are what the
    # optimizer steps on; a parameter no unit manages, itself.
    one_by_one = [
        i for i, e in enumerate(kept) if e.unit is None or (units[e.unit].use_orig_params and source == "grad")
    ]
    by_itself = set(one_by_one)
    flat_scaled = sorted({e.unit for i, e in enumerate(kept) if e.unit is not None and i not in by_itself})
    # A unit's shard stands for its parameters in the plan of whole units: the first entry of each.
    first_of_unit: dict[int, _Entry] = {}
    for e in kept:
        if e.unit in flat_scaled:
            first_of_unit.setdefault(e.unit, e)
    whole = [first_of_unit[u] for u in flat_scaled] + [kept[i] for i in one_by_one]
    plan = _plan(layout, kept)
    return _Selection(where, [e.name for e in kept], numels, plan, flat_scaled, one_by_one, _plan(layout, whole), kept)


def _refuse_unmanaged(layout: ModelLayout, entries: list[_Entry]) -> None:
    """Refuses the gradients of parameters no unit manages that require one (module notes): decided
    by ``requires_grad``, alike on every rank, never by whether a rank holds a gradient."""
    names = [e.name for e in entries if e.unit is None and layout.unmanaged(e.index).requires_grad]
    raise ValueError(
        f"nanscan: {', '.join(names)} belong to no FSDP1 unit (ignored_modules, or modules outside the FSDP root) "
        "and require a gradient: FSDP never reduces those gradients, so each rank's is its own (with each rank "
        "on its own data, they differ), and nanscan cannot report them as the model's. Check the parameters FSDP "
        "manages by a list of them (nanscan.check([...]): this call has shown nanscan the model), and each such "
        "module on each rank as that rank's own (nanscan.check(module)); or freeze them (requires_grad=False)"
    )


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
            if getattr(p, FLATTENED, False):
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


def of_gradients(tensors: Sequence[Any]) -> tuple[ModelLayout, list[int]] | None:
    """Where ``tensors`` are the gradients of parameters of an FSDP1 model nanscan has seen (the usual
    ``[p.grad for p in model.parameters() if p.grad is not None]`` given to ``get_total_norm`` or
    ``scan``): that model's layout and the entries meant, as for a list of those parameters
    (``of_parameters``); None where none of them is. A flat gradient (``use_orig_params=False``) stands
    for its unit's parameters, as its flat parameter does. The gradients FSDP hands out as the original
    parameters' (``use_orig_params=True``: views into the flat gradient) are refused: each rank holds
    a gradient only for the parameters with an element in its shard, so such a list differs from rank
    to rank and says nothing of which parameters were meant. A gradient carries no mark of FSDP's: it
    is recognised by the models nanscan knows (module notes)."""
    if not _models or not tensors:
        return None
    owners: dict[int, Any] = {}  # id of a gradient -> its parameter (flat, or one no unit manages)
    views: dict[int, str] = {}  # id of a flat gradient, or of an original parameter's -> its name
    for layout in list(_models.values()):
        if not layout.current():
            continue
        for unit in layout.units:
            handle = unit.handle_ref()
            if handle is None or handle.flat_param.grad is None:
                continue
            flat = handle.flat_param
            owners[id(flat.grad)] = flat
            if unit.use_orig_params:
                for p in unit.params:
                    if p.grad is not None:
                        views[id(p.grad)] = "the gradient FSDP1 hands out as an original parameter's"
        for ref in layout.unmanaged_refs:
            unmanaged = ref()
            if unmanaged is not None and unmanaged.grad is not None:
                owners[id(unmanaged.grad)] = unmanaged
    if not owners and not views:
        return None
    ids = list(map(id, tensors))
    bases = [id(t._base) if isinstance(t, torch.Tensor) and t._base is not None else 0 for t in tensors]
    for i, (key, base) in enumerate(zip(ids, bases, strict=True)):
        seen = views.get(key) or views.get(base) or ("a view of FSDP1's flat gradient" if base in owners else None)
        if seen is not None:
            raise ValueError(
                f"nanscan: entry {i} is {seen}, a part of this rank's shard of an FSDP1 model's gradient: with "
                "use_orig_params=True each rank holds the gradients of only the parameters with an element in its "
                "shard, so a list of them differs from rank to rank and cannot say which parameters are meant. Pass the FSDP model (nanscan.check(model), "
                "nanscan.clip_grad_norm_(model, max_norm): its total norm) or its parameters "
                "(nanscan.clip_grad_norm_(model.parameters(), max_norm)), whose gradients are reduced over FSDP's "
                "groups"
            )
    params = [owners.get(key) for key in ids]
    if all(p is None for p in params):
        return None
    missing = next((i for i, p in enumerate(params) if p is None), None)
    if missing is not None:
        raise ValueError(
            f"nanscan: entry {missing} of the gradients is not one of the FSDP1 model's that the others are: "
            "pass that model's gradients alone, or the model itself (nanscan.check(model))"
        )
    return of_parameters(params)


def refuse_unknown(index: int) -> None:
    raise ValueError(
        f"nanscan: entry {index} is a parameter that FSDP1 (FullyShardedDataParallel) has flattened and sharded: "
        "this rank holds only its shard, so its statistics alone would be one rank's, not the model's. Pass the "
        "FSDP model itself (nanscan.check(model, max_norm=...), nanscan.clip_grad_norm_(model, max_norm), "
        "scaler.watch(model) for nanscan.amp.GradScaler); after that, lists of its parameters are reduced "
        "too. Or use FSDP's own model.clip_grad_norm_(max_norm)"
    )
