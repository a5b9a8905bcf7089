"""The DDP and FSDP1 models this process has made, whether or not a check was handed them.

What a user passes instead of the model carries no mark of it: a DDP model's parameters, the module
inside it and its gradients; an FSDP1 model's gradients (plain tensors, new each step). Yet inside
DDP's ``no_sync()`` those gradients are each rank's own, and an FSDP1 rank's gradients are its shard:
checked as they are, the answer would be one rank's, presented as the model's. So nanscan knows the
models the process makes, and a check that meets their parameters or gradients refuses or reduces
them as it would the model (nanscan.layouts: ``_refuse_unsynced_ddp``, ``_see_fsdp1_models``).

How it knows them:

* from nanscan's import on, one global module-registration hook
  (``torch.nn.modules.module.register_module_module_registration_hook``): DDP's and FSDP1's
  constructors set the module they wrap as an attribute, which calls it with the wrapper. It runs
  when a module is assigned to another (model construction), never per step: about 0.3 us a
  submodule;
* the models made before that (nanscan imported after the model was built), by one look through
  the process's live objects (``gc.get_objects``: 0.12-0.2 s with transformers imported, 355,000
  objects), the first time a check in a world of several ranks (DDP) or with FSDP1 in use needs
  them, and never again.

A model copied without its constructor (``copy.deepcopy``, unpickled) is not known this way; passed
itself to a check, it is handled as any model is. Weak references only: knowing a model keeps it
no longer alive.

What a DDP model's gradients are depends on its last forward, not only on the moment of the check:
DDP decides at a forward (``_post_forward``: ``prepare_for_backward`` only outside ``no_sync()``)
whether that forward's backward all-reduces. Gradients accumulated by backwards inside ``no_sync()``
and checked after leaving it, before a backward that synchronises them, are each rank's own though
``require_backward_grad_sync`` is True again. So each known DDP model carries a forward pre-hook that
notes, for its forwards with grad enabled, whether they ran inside ``no_sync()``
(``last_forward_unsynced``): one dictionary write a step. A model known only from the look through
the live objects is noted from then on (a forward before it is not seen).
"""

from __future__ import annotations

import gc
import weakref
from typing import Any, cast

import torch

from . import fsdp1

_DDP = torch.nn.parallel.DistributedDataParallel

_ddp_models: weakref.WeakSet[torch.nn.parallel.DistributedDataParallel] = weakref.WeakSet()
# FSDP1 units whose layout nanscan has not made: roots, and units FSDP has not yet decided are not
# roots (it decides at the first forward: ``_is_root``).
_fsdp1_undecided: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()
_looked: list[bool] = []  # [True] once the look is made
# Per DDP model: whether its last forward with grad enabled ran inside no_sync() (module notes).
_forward_unsynced: weakref.WeakKeyDictionary[torch.nn.parallel.DistributedDataParallel, bool] = (
    weakref.WeakKeyDictionary()
)


def note(module: torch.nn.Module) -> None:
    """Knows ``module`` from now on, if it is a DDP model or an FSDP1 unit."""
    cls = type(module)
    if issubclass(cls, _DDP):
        model = cast(torch.nn.parallel.DistributedDataParallel, module)
        if model not in _ddp_models:
            _ddp_models.add(model)
            model.register_forward_pre_hook(_ddp_forward)
    elif fsdp1.is_fsdp1_class(cls):
        _fsdp1_undecided.add(module)


def _ddp_forward(model: torch.nn.Module, args: Any) -> None:
    """A DDP model's forward pre-hook: notes whether a forward with grad enabled runs inside
    ``no_sync()``, as DDP decides at this forward whether its backward synchronises. Traced by
    torch.compile, it notes nothing (the compiled graph would not run it): a compiled DDP model is
    judged by its flag at the check, as before this note existed."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled():
        return
    _forward_unsynced[cast(torch.nn.parallel.DistributedDataParallel, model)] = not model.require_backward_grad_sync


def last_forward_unsynced(model: torch.nn.parallel.DistributedDataParallel) -> bool:
    """Whether ``model``'s last forward with grad enabled, as its pre-hook saw it, ran inside
    ``no_sync()``: its backward accumulated each rank's own gradients. False when none was seen, and
    for a DDP that decides at the backward (its Python reducer, under compiled autograd)."""
    return _forward_unsynced.get(model, False) and not getattr(model, "_use_python_reducer", False)


def _registered(parent: torch.nn.Module, name: str, child: Any) -> None:
    """The module-registration hook (module notes): ``parent`` is given a submodule, ``child``."""
    note(parent)


_hook = torch.nn.modules.module.register_module_module_registration_hook(_registered)


def _look_once() -> None:
    """Notes the models made before nanscan's import (module notes): once per process."""
    if _looked:
        return
    _looked.append(True)
    # type(), not isinstance(): some objects' __class__ is a property (a deprecation warning, a proxy).
    for o in gc.get_objects():
        cls = type(o)
        if issubclass(cls, torch.nn.Module):
            note(o)


def ddp_models() -> list[torch.nn.parallel.DistributedDataParallel]:
    """Every DDP model alive in this process."""
    _look_once()
    return list(_ddp_models)


def unseen_fsdp1_roots() -> list[torch.nn.Module]:
    """The FSDP1 roots (units FSDP has run a forward of as the root) not yet ``seen``."""
    _look_once()
    roots = []
    for unit in list(_fsdp1_undecided):
        is_root = getattr(unit, "_is_root", None)
        if is_root:
            roots.append(unit)
        elif is_root is not None:
            _fsdp1_undecided.discard(unit)  # a unit inside a root: its root stands for it
    return roots


def seen(root: torch.nn.Module) -> None:
    """``root``'s layout is made (nanscan.layouts.fsdp1): ``unseen_fsdp1_roots`` leaves it out from now on."""
    _fsdp1_undecided.discard(root)
