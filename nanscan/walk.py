"""``model.named_parameters()`` for a check every step, at a third of its cost once the tree is known.

``check(model)`` names every gradient after ``named_parameters()``, and that walk (a generator per
module, a prefix string per parameter, memo sets) cost 1.0-1.3 us per parameter on the CPU this was
measured on: more than the rest of a check. Between two steps a model's tree almost never changes,
so the walk's result is kept per model, with what it depended on, and a later call only verifies
that, with C-level maps over the modules' dicts (no Python code per parameter): 0.35 us per
parameter on 5,000 parameters in 2,500 modules (benchmarks/NOTES.md entry 27).

What ``named_parameters()`` yields is decided by, per module in its walk's order: its type (a
subclass may override the walk), and the contents of its ``_parameters`` and ``_modules`` dicts:
their lengths (where one module's entries end and the next one's begin), their keys in order, and
which objects they hold (None entries are skipped, an object met twice is yielded once, and a child
module's place decides the order of the walk). A call whose modules' types and dicts' lengths, keys
and held objects' identities all equal the kept ones gets the kept names and the parameters now in
the dicts, which is what a new walk would yield; anything else walks anew. Identities are compared
as ``id()``s, and the kept record holds no object of the model (weak references to its modules
only), so it never keeps a model alive. An id is unique among live objects: the objects compared are
all alive now, and if one took a dead object's id at the same place, the yield is still the same
(same key, same position, same identity relations), and the parameter handed out is the live one (a
dead module is seen: its weak reference reads None). Mutating a dict in place (FSDP2 swaps its
sharded and unsharded parameters by ``module._parameters[name] = p``) is seen like any other change.

Only where the walk is ``nn.Module``'s own: the model's type keeps ``named_parameters``,
``named_modules`` and ``_named_members``, and every module below it ``named_modules`` (the only one
of the three that the root's walk calls on its children; activation checkpointing's wrapper
overrides ``named_parameters`` alone, and is cached). A model with any other type (an FSDP1 root,
some wrappers) is walked every call.

Names are as the user wrote them (nanscan.names): the wrappers' components (``_orig_mod.``,
``_fsdp_wrapped_module.``, ``_checkpoint_wrapped_module.``, DDP's ``module.``) are dropped, once,
when the walk is made.
"""

from __future__ import annotations

import itertools
import operator
import weakref
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from .names import clean_module_names, clean_name

_PARAMETERS = operator.attrgetter("_parameters")
_MODULES = operator.attrgetter("_modules")
_WALK_METHODS = ("named_parameters", "named_modules", "_named_members")
_BASE = {name: getattr(torch.nn.Module, name) for name in _WALK_METHODS}
_standard_root: dict[type, bool] = {}


def _walks_as_module(cls: type) -> bool:
    """Whether ``cls`` keeps nn.Module's walk as a model's root (looked up once per type)."""
    standard = _standard_root.get(cls)
    if standard is None:
        standard = all(getattr(cls, name, None) is base for name, base in _BASE.items())
        _standard_root[cls] = standard
    return standard


def _walks_as_child(cls: type) -> bool:
    """Whether ``cls`` keeps the one method of nn.Module's walk that a root calls on its children."""
    return getattr(cls, "named_modules", None) is _BASE["named_modules"]


class Walk(NamedTuple):
    """What ``walk`` gives: the parameters, named as the user wrote them, and what a caller may need
    to know of the model's layout: the types of its modules (an FSDP1 unit among them) and the
    attributes set on its parameters (the marks an engine leaves on the parameters it manages)."""

    names: list[str]
    parameters: list[torch.nn.Parameter]
    module_types: frozenset[type]
    parameter_attributes: frozenset[str]


# The parameter attributes a traced walk looks for (an engine's marks: nanscan.layouts registers
# them), since it cannot list a parameter's attributes (``vars``) as the eager walk does.
TRACED_MARKS: tuple[str, ...] = ()


def _walk(model: torch.nn.Module, traced: bool = False) -> Walk:
    """torch's own walk, with clean names, the module types and the parameter attributes. ``traced``
    (inside torch.compile): of the attributes, only the marks in ``TRACED_MARKS``, by ``hasattr``.
    Either way the layout is told what the model holds: a function that runs eagerly after a graph
    break still has its callees traced (this walk among them), and a walk that told it nothing would
    make it take an FSDP1 model for a single process's."""
    named = list(model.named_parameters())
    names = [name for name, _ in named]
    clean = clean_module_names(model)
    if clean is not None:
        names = [clean_name(name, clean) for name in names]
    params = [p for _, p in named]
    module_types = frozenset(type(m) for m in model.modules())
    if traced:
        marks = frozenset(mark for mark in TRACED_MARKS if any(hasattr(p, mark) for p in params))
        return Walk(names, params, module_types, marks)
    attributes = frozenset(itertools.chain.from_iterable(map(vars, params)))
    return Walk(names, params, module_types, attributes)


def _flat_values(dicts: list[dict[str, Any]]) -> list[Any]:
    """Every dict's values, in order, laid end to end."""
    return list(itertools.chain.from_iterable(map(dict.values, dicts)))


def _flat_ids(dicts: list[dict[str, object]]) -> tuple[int, ...]:
    return tuple(map(id, _flat_values(dicts)))


def _flat_keys(dicts: list[dict[str, object]]) -> tuple[str, ...]:
    return tuple(itertools.chain.from_iterable(dicts))


@dataclass(frozen=True)
class _Tree:
    """A walk's result and what it depended on (ids, keys, lengths, types; no object of the model)."""

    modules: tuple[weakref.ReferenceType[torch.nn.Module], ...]  # in named_modules() order, root first
    types: tuple[type, ...]
    parameter_lengths: tuple[int, ...]
    module_lengths: tuple[int, ...]
    parameter_keys: tuple[str, ...]  # every module's _parameters keys, in order, laid end to end
    module_keys: tuple[str, ...]
    parameter_ids: tuple[int, ...]  # ids of the objects those keys held
    module_ids: tuple[int, ...]
    selected: tuple[int, ...]  # positions in the flat _parameters values that the walk yields
    names: tuple[str, ...]
    module_types: frozenset[type]
    parameter_attributes: frozenset[str]

    @staticmethod
    def of(model: torch.nn.Module) -> tuple[_Tree | None, Walk]:
        """Walks ``model``: the record (None if some type overrides the walk), and the walk."""
        walked = _walk(model)
        names, params = walked.names, walked.parameters
        modules = [m for _, m in model.named_modules()]
        if not _walks_as_module(type(model)) or not all(map(_walks_as_child, map(type, modules))):
            return None, walked
        pdicts = list(map(_PARAMETERS, modules))
        mdicts = list(map(_MODULES, modules))
        flat = _flat_values(pdicts)
        position: dict[int, int] = {}
        for i, value in enumerate(flat):
            position.setdefault(id(value), i)  # the walk yields an object where it first meets it
        tree = _Tree(
            tuple(map(weakref.ref, modules)),
            tuple(map(type, modules)),
            tuple(map(len, pdicts)),
            tuple(map(len, mdicts)),
            _flat_keys(pdicts),
            _flat_keys(mdicts),
            tuple(map(id, flat)),
            _flat_ids(mdicts),
            tuple(position[id(p)] for p in params),
            tuple(names),
            walked.module_types,
            walked.parameter_attributes,
        )
        return tree, walked

    def parameters_if_unchanged(self) -> list[torch.nn.Parameter] | None:
        """The parameters a walk would yield now, if the tree is as it was; else None."""
        modules = [ref() for ref in self.modules]
        if tuple(map(type, modules)) != self.types:  # a module that died reads as None: NoneType
            return None
        pdicts = list(map(_PARAMETERS, modules))
        mdicts = list(map(_MODULES, modules))
        if (
            tuple(map(len, pdicts)) != self.parameter_lengths
            or tuple(map(len, mdicts)) != self.module_lengths
            or _flat_keys(pdicts) != self.parameter_keys
            or _flat_keys(mdicts) != self.module_keys
            or _flat_ids(mdicts) != self.module_ids
        ):
            return None
        flat = _flat_values(pdicts)
        if tuple(map(id, flat)) != self.parameter_ids:
            return None
        return [flat[i] for i in self.selected]


_trees: weakref.WeakKeyDictionary[torch.nn.Module, _Tree] = weakref.WeakKeyDictionary()


def walk(model: torch.nn.Module) -> Walk:
    """``list(model.named_parameters())`` as (clean names, parameters), with the modules' types: the
    same lists, from the kept walk when the model's tree is unchanged since the last call (see the
    module notes)."""
    if torch.compiler.is_compiling():
        return _walk(model, traced=True)
    tree = _trees.get(model)  # an unhashable module raises TypeError here, as in torch's own walk
    if tree is not None:
        params = tree.parameters_if_unchanged()
        if params is not None:
            return Walk(list(tree.names), params, tree.module_types, tree.parameter_attributes)
    tree, walked = _Tree.of(model)
    if tree is not None:
        _trees[model] = tree
    else:
        _trees.pop(model, None)
    return walked


def named_parameters(model: torch.nn.Module) -> tuple[list[str], list[torch.nn.Parameter]]:
    """``walk(model)``'s names and parameters."""
    walked = walk(model)
    return walked.names, walked.parameters
