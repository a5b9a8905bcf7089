"""FSDP2 (``fully_shard``): the sharded parameters behind what a model holds while FSDP2 has them
unsharded, and the gradients FSDP2 has not reduced yet.

FSDP2's parameters are DTensors (nanscan.layouts.dtensor reduces them), but only while each module
holds its *sharded* parameters. Between an all-gather and the reshard that follows, FSDP2 registers
on the module a plain ``nn.Parameter`` of the whole (unsharded) tensor in the sharded one's place
(``FSDPParam._setattr_on_modules``). That lasts past the backward where resharding after backward is
off (``set_reshard_after_backward(False)``, ``reshard_after_forward=False`` roots until their
backward, and the group of a forward whose backward has not run): the model's parameters, as
``model.parameters()`` lists them, are then the unsharded copies. After a backward that reduced
them, those have no gradient (FSDP2 moved it into the sharded parameter's ``.grad``, reduce-scattered),
so a check of the model read nothing and said "finite". Here each unsharded parameter is read as the
sharded one it copies (``sharded_param``: the one the optimizer steps on, whose ``.grad`` FSDP2 wrote),
so the check is the model's, as it is once resharded.

Gradient accumulation without communication (``set_requires_gradient_sync(False)``; HSDP's
``set_requires_all_reduce(False)``) keeps each rank's own sums apart from the sharded ``.grad`` until
the backward that reduces them: on the unsharded parameter (a plain tensor of this rank's micro-batches
alone, which the model holds where it is not resharded after backward), in FSDP2's own accumulator,
or as HSDP's partial output of the reduce-scatter, not yet all-reduced over the replicas. A check then
would read one rank's gradient, or an earlier step's: refused, on every rank (FSDP2's flags are set
alike on every rank), as FSDP1's ``no_sync()`` and DDP's are.

Where FSDP2 is found: torch's registry of composable states (``torch.distributed._composable_state``,
which ``fully_shard`` fills), read only where FSDP2's module is imported and a state is registered,
and only for a list that holds a plain tensor (an unsharded copy, or its gradient) or no gradient at
all (what the sharded parameters hold during an accumulation after ``zero_grad()``). A training
step's usual list, sharded parameters with gradients, costs one look at the set of its entries' types
(25 ns a parameter, 84 for a list of (name, parameter) pairs, on 5,000 on this 2-core VM on a day a
DTensor's ``.grad`` read took 830 ns). So a list of sharded parameters whose
``.grad`` an earlier step left (no ``zero_grad()``) is read as it is during an accumulation. Where
the groups are read, their flags (sharded, reducing) come first, by C-level maps over a list of the
groups kept between calls; per parameter only for a group that is unsharded or accumulating.
What is read is FSDP2's private state (``_fsdp_param_groups``, ``_unsharded_param``,
``unsharded_accumulated_grad``, ``_partial_reduce_output``), read with defaults, so that a torch
whose FSDP2 lacks one of them reads as no group in that state, never as an error.
"""

from __future__ import annotations

import operator
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..fused import describe
from .dtensor import dtensor_class

_STATE_MODULE = "torch.distributed.fsdp._fully_shard._fsdp_state"
_REGISTRY_MODULE = "torch.distributed._composable_state"


# Every group's flags, by a C-level map over the groups kept between calls (made anew when the
# registry's entries change: fully_shard called, a module gone).
_REDUCE = operator.attrgetter("reduce_grads", "all_reduce_grads", "is_sharded")
_GRAD = operator.attrgetter("grad")


@dataclass
class _Kept:
    keys: tuple[Any, ...] = ()  # the registry's weak keys when the groups were listed (held: ids stay theirs)
    groups: list[weakref.ReferenceType[Any]] = field(default_factory=list)


_kept = _Kept()


def _registry() -> Any:
    """torch's registry of composable states (module -> weak reference to its state), or None."""
    return getattr(sys.modules.get(_REGISTRY_MODULE), "_module_state_mapping", None)


def _param_groups(state: Any) -> list[Any]:
    """A state's parameter groups: one list in recent torch, one optional group before."""
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [group] if group is not None else []


def _groups() -> list[Any]:
    """Every FSDP2 parameter group alive in this process, each once."""
    registry = _registry()
    state_class = getattr(sys.modules.get(_STATE_MODULE), "FSDPState", None)
    if not registry or state_class is None:
        return []
    keys = tuple(getattr(registry, "data", ()))
    if len(keys) == len(_kept.keys) and all(map(operator.is_, keys, _kept.keys)):
        return [group for group in (ref() for ref in _kept.groups) if group is not None]
    states: dict[int, Any] = {}
    for ref in list(registry.values()):
        state = ref()
        if isinstance(state, state_class):
            states.setdefault(id(state), state)
    groups = [g for state in states.values() for g in _param_groups(state) if hasattr(g, "fsdp_params")]
    _kept.keys, _kept.groups = keys, [weakref.ref(g) for g in groups]
    return groups


def _unusual(groups: list[Any]) -> list[tuple[Any, tuple[bool, bool, bool]]]:
    """The groups not in a training step's usual state (sharded, reducing, all-reducing), each with
    its flags ``(reduce_grads, all_reduce_grads, is_sharded)``."""
    try:
        flags = list(map(_REDUCE, groups))
    except AttributeError:  # a torch whose FSDP2 lacks one of the flags: each read with its default
        flags = [
            (getattr(g, "reduce_grads", True), getattr(g, "all_reduce_grads", True), getattr(g, "is_sharded", True))
            for g in groups
        ]
    return [(g, f) for g, f in zip(groups, flags, strict=True) if not all(f)]


def _holds_unreduced(group: Any, reduce: bool, all_reduce: bool) -> bool:
    """Whether a parameter group (whose flags are ``reduce``, ``all_reduce``) holds gradients FSDP2
    has not reduced into the sharded ``.grad``."""
    if not all_reduce and getattr(group, "_partial_reduce_output", None) is not None:
        return True  # HSDP: reduce-scattered, not yet all-reduced over the replicas
    if reduce:
        return False
    for fsdp_param in group.fsdp_params:
        if getattr(fsdp_param, "unsharded_accumulated_grad", None) is not None:
            return True
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None and unsharded.grad is not None:
            return True
    return False


@dataclass
class _Found:
    """What the process's FSDP2 groups hold now, by the ids of the objects a caller may pass."""

    # id of a parameter FSDP2 has put on a module in its sharded one's place -> the sharded one
    sharded_of: dict[int, Any] = field(default_factory=dict)
    # id of a parameter of a group that holds unreduced gradients (its sharded one, and what FSDP2 put
    # on the module in its place) -> how the refusal says what FSDP2 is doing
    unreduced_params: dict[int, str] = field(default_factory=dict)
    # the same for those parameters' gradients (the unsharded ones: each rank's own sums)
    unreduced_grads: dict[int, str] = field(default_factory=dict)


def _found() -> _Found:
    """What the groups outside the usual state hold (the module notes): none, in the usual step."""
    found = _Found()
    for group, (reduce, all_reduce, sharded) in _unusual(_groups()):
        unreduced = _holds_unreduced(group, reduce, all_reduce)
        if not unreduced and sharded:
            continue  # the usual state: the module holds its sharded parameters, their .grad reduced
        why = (
            "HSDP's all-reduce over the replicas is off (set_requires_all_reduce(False))"
            if reduce
            else "gradient synchronisation is off (set_requires_gradient_sync(False))"
        )
        for fsdp_param in group.fsdp_params:
            sharded_param = getattr(fsdp_param, "sharded_param", None)
            copies = [getattr(fsdp_param, "_unsharded_param", None)]
            copies.append(getattr(fsdp_param, "_sharded_post_forward_param", None))
            for copy in copies:
                if copy is not None and sharded_param is not None:
                    found.sharded_of[id(copy)] = sharded_param
            if not unreduced:
                continue
            for held in (*copies, sharded_param):
                if held is not None:
                    found.unreduced_params[id(held)] = why
                    if held.grad is not None:
                        found.unreduced_grads[id(held.grad)] = why
    return found


def possible() -> bool:
    """Whether some module of this process can be FSDP2's (its module imported, a state registered).
    Never inside torch.compile: the registry is a WeakKeyDictionary, which dynamo cannot test for
    truth (torch 2.11 breaks the graph there, and fullgraph=True fails), and what reads it is the
    layouts' refusals, which run outside compile as ``_refuse_unsynced_ddp`` does."""
    return _STATE_MODULE in sys.modules and not torch.compiler.is_compiling() and bool(_registry())


def _refuse(index: int, names: Sequence[str] | None, why: str) -> None:
    raise ValueError(
        f"nanscan: {describe(names, index)} belongs to an FSDP2 (fully_shard) module whose gradients are accumulating unreduced: "
        f"{why}. Until the backward that reduces them, each rank's sums of its own micro-batches are kept apart "
        "from the sharded .grad, which holds nothing or an earlier step's gradient, so a check now would read "
        "one rank's gradient, or an earlier step's, not the model's. Check after the backward that reduces them: "
        "the last micro-batch's, with synchronisation back on (model.set_requires_gradient_sync(True); for "
        "HSDP, set_requires_all_reduce(True))"
    )


def _all_dtensors(tensors: Sequence[Any]) -> bool:
    """Whether every entry is a DTensor (what FSDP2's sharded parameters and their gradients are): by
    the set of their types, C-level."""
    cls = dtensor_class()
    return cls is not None and all(issubclass(t, cls) for t in set(map(type, tensors)))


def sharded(
    params: Sequence[Any], names: Sequence[str] | None = None, unreduced_refused: bool = True
) -> list[Any] | None:
    """``params`` (a model's parameters, or a list of them) with every parameter that FSDP2 has put on
    a module in place of its sharded one replaced by the sharded one (see the module notes); None
    where none is. Where ``unreduced_refused`` (their gradients are to be read), refuses (ValueError,
    naming the entry after ``names``) a parameter of a group whose gradients are accumulating
    unreduced. Call only where ``possible()``.

    A training step's gradients, every entry a DTensor and some with a gradient, are taken as they
    are, without reading FSDP2's groups: so a list of sharded parameters whose ``.grad`` an earlier
    step left (no ``zero_grad()``) is not refused during an accumulation without synchronisation (with
    tensor parallel, unsharded copies are DTensors too: their gradients, each data-parallel rank's
    own, are refused where their mesh is found to hold only some of the ranks). Values
    (``unreduced_refused`` False: ``check_state``, the update watch) always read the groups, since an
    unsharded copy under tensor parallel is a DTensor too."""
    if not params or (
        unreduced_refused and _all_dtensors(params) and any(grad is not None for grad in map(_GRAD, params))
    ):
        return None
    found = _found()
    if unreduced_refused and found.unreduced_params:
        for i, p in enumerate(params):
            why = found.unreduced_params.get(id(p))
            if why is not None:
                _refuse(i, names, why)
    if not found.sharded_of:
        return None
    swapped = [found.sharded_of.get(id(p), p) for p in params]
    return swapped if any(map(operator.is_not, swapped, params)) else None


def refuse_unreduced(tensors: Sequence[Any], names: Sequence[str] | None = None, dtensors_too: bool = False) -> None:
    """Refuses (ValueError, naming the entry) a plain tensor that is a gradient FSDP2 has not reduced
    (see the module notes); a list of DTensors is taken as it is, unless ``dtensors_too`` (on a path
    that refuses it anyway: FSDP2 with tensor parallel holds its unsharded copies as DTensors over the
    tensor-parallel mesh, whose gradients are then each data-parallel rank's own). Call only where
    ``possible()``."""
    if not dtensors_too and _all_dtensors(tensors):
        return
    found = _found()
    if found.unreduced_grads:
        for i, t in enumerate(tensors):
            why = found.unreduced_grads.get(id(t))
            if why is not None:
                _refuse(i, names, why)
