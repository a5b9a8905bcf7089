"""Parameter names as the user wrote them, and name sequences formed only when read.

Wrappers put themselves into every name below them: ``torch.compile`` holds the model as
``_orig_mod``, FSDP1 each unit as ``_fsdp_wrapped_module``, activation checkpointing each layer as
``_checkpoint_wrapped_module``, DDP (and DataParallel) the model as ``module``. A report that says
``_orig_mod.module.layers.3._fsdp_wrapped_module.mlp.fc.weight`` where the user wrote
``layers.3.mlp.fc.weight`` makes them translate; torch's distributed checkpoint helpers clean
names the same way (``torch.distributed.checkpoint.state_dict``). A component is dropped only where
the module above it is such a wrapper and the component is the attribute that wrapper holds its
module under: a user's own attribute named ``module`` elsewhere stays.

Wrappers are recognised by their class (and base classes) by module path and name, so none of their
packages is imported to recognise them, and a subclass (a framework's own DDP) is one too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, overload

import torch

# (defining module, class name) -> the attribute under which that wrapper holds the wrapped module.
_WRAPPERS: dict[tuple[str, str], str] = {
    ("torch._dynamo.eval_frame", "OptimizedModule"): "_orig_mod",
    ("torch.distributed.fsdp.fully_sharded_data_parallel", "FullyShardedDataParallel"): "_fsdp_wrapped_module",
    ("torch.distributed.algorithms._checkpoint.checkpoint_wrapper", "ActivationWrapper"): "_checkpoint_wrapped_module",
    ("torch.nn.parallel.distributed", "DistributedDataParallel"): "module",
    ("torch.nn.parallel.data_parallel", "DataParallel"): "module",
    ("deepspeed.runtime.engine", "DeepSpeedEngine"): "module",  # at ZeRO stages 0-2 (nanscan.layouts.refused)
}
_wrapped_attribute: dict[type, str | None] = {}


def wrapped_attribute(cls: type) -> str | None:
    """The attribute under which modules of class ``cls`` hold the module they wrap, if ``cls`` is a
    wrapper (see the module notes); None otherwise. Looked up once per class."""
    try:
        return _wrapped_attribute[cls]
    except KeyError:
        keys = [(c.__module__, c.__qualname__) for c in cls.__mro__]
        found = next((_WRAPPERS[key] for key in keys if key in _WRAPPERS), None)
        _wrapped_attribute[cls] = found
        return found


def clean_module_names(model: torch.nn.Module) -> dict[str, str] | None:
    """Each module's qualified name in ``model`` (as ``named_modules()`` gives it) mapped to the name
    the user wrote, without the wrappers' components; None when ``model`` holds no wrapper, so that
    the usual model pays one type lookup per module and no string work. Names of modules met twice
    are their first names, as ``named_parameters()`` gives them."""
    modules = list(model.named_modules())  # as named_parameters() names them: a shared module once
    if not any(wrapped_attribute(type(m)) is not None for _, m in modules):
        return None
    clean: dict[str, str] = {"": ""}
    # named_modules() yields a parent before its children: each child's clean name extends its parent's.
    for name, module in modules:
        attribute = wrapped_attribute(type(module))
        for child_name, child in module._modules.items():
            if child is None:
                continue
            full = f"{name}.{child_name}" if name else child_name
            parent = clean.get(name, name)
            if child_name == attribute:
                clean[full] = parent
            else:
                clean[full] = f"{parent}.{child_name}" if parent else child_name
    return clean


def clean_name(name: str, modules: dict[str, str]) -> str:
    """A parameter's (or buffer's) qualified name with its module's part cleaned (``modules`` from
    ``clean_module_names``)."""
    module, _, leaf = name.rpartition(".")
    prefix = modules.get(module, module)
    return f"{prefix}.{leaf}" if prefix else leaf


class LazyNames(Sequence[str]):
    """Parameter names formed when they are read: ``check`` and the scaler run every step, and a
    report's names are read only when it is shown (Report.names makes them a list then). Equal, like
    a list, to lists and to other LazyNames of the same strings, and so unhashable like one."""

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (list, LazyNames)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are unhashable

    def __repr__(self) -> str:
        return repr(list(self))

    def _name_at(self, position: int) -> str:
        """The name at ``position``, ``0 <= position < len(self)``: what each kind of names defines."""
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...
    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self._name_at(i) for i in range(len(self))[index]]
        return self._name_at(range(len(self))[index])


class PairNames(LazyNames):
    """The names of a list of ``(name, parameter)`` pairs, formed when read (a bare parameter among
    them is named by its position, ``"[i]"``)."""

    __slots__ = ("_items",)

    def __init__(self, items: Sequence[Any]) -> None:
        self._items = items

    def __len__(self) -> int:
        return len(self._items)

    def _name_at(self, position: int) -> str:
        item = self._items[position]
        return str(item[0]) if type(item) is tuple else f"[{position}]"


class PositionalNames(LazyNames):
    """The names ``"[i]"`` of the entries at ``positions`` of a parameter list (``check(params)``)."""

    __slots__ = ("_positions",)

    def __init__(self, positions: Sequence[int]) -> None:
        self._positions = positions

    def __len__(self) -> int:
        return len(self._positions)

    def _name_at(self, position: int) -> str:
        return f"[{self._positions[position]}]"

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PositionalNames):  # without forming the strings
            return list(self._positions) == list(other._positions)
        return super().__eq__(other)

    __hash__ = None  # a class that defines __eq__ must say so again

    def __reduce__(self) -> tuple[type[PositionalNames], tuple[Sequence[int]]]:
        return PositionalNames, (self._positions,)
