"""Gradient sharding that nanscan cannot reduce, refused before anything is read or written.

A wrapper that keeps each rank's gradients as a shard of its own (DeepSpeed's ZeRO, Megatron's
distributed optimizer) leaves in each process only that rank's part, often not in ``.grad`` at all.
Scanning what is there would give one rank's statistics, or none, under the model's name: the one
outcome nanscan must never produce. So each is recognised, without importing its package, by what
the objects a caller passes carry: the class of the model (by module path and name, a subclass too)
or a mark the engine sets on every parameter; and refused with an error that names it and says what
to do instead.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from dataclasses import dataclass

_ADVICE_PROCESS_GROUP = (
    "If each rank holds whole gradients of its own parameters, pass process_group= (the ranks that hold "
    "different ones); nanscan reduces plain gradients no other way"
)


@dataclass(frozen=True)
class _Engine:
    """A wrapper class nanscan refuses: the package that defines it, and what to do instead."""

    package: str  # the top-level package of its module path
    names: tuple[str, ...]  # class names (any class in the model's MRO)
    what: str
    instead: str


_ENGINES = (
    _Engine(
        "deepspeed",
        ("DeepSpeedEngine", "PipelineEngine", "DeepSpeedHybridEngine"),
        "a DeepSpeed engine, whose ZeRO stages partition the gradients over the ranks",
        "use the engine's own norm (engine.get_global_grad_norm(), gradient_clipping in its config)",
    ),
    _Engine(
        "megatron",
        ("DistributedDataParallel", "Float16Module"),
        "a Megatron model, whose gradients live in .main_grad buffers (sharded by its distributed optimizer)",
        "use Megatron's own norm (optimizer.get_grad_norm(), clip_grad in its config)",
    ),
    _Engine(
        "fairscale",
        ("FullyShardedDataParallel", "ShardedDataParallel"),
        "a fairscale sharded model, whose flat parameters nanscan cannot cut back into your parameters",
        "use its own model.clip_grad_norm_(), or torch's FSDP, which nanscan reduces",
    ),
)

# Marks an engine sets on every parameter it manages: (attribute, the packages that set it, what it
# means). Looked for only where one of the packages is imported: none can have set it otherwise.
_MARKS = (
    ("ds_id", ("deepspeed",), "a parameter partitioned by DeepSpeed ZeRO stage 3 (its .data is a placeholder)"),
    (
        "main_grad",
        ("megatron", "transformer_engine"),
        "a parameter whose gradient lives in .main_grad (Megatron, TransformerEngine)",
    ),
)

_refused_class: dict[type, tuple[_Engine, type] | None] = {}


def _engine_of(cls: type) -> tuple[_Engine, type] | None:
    """The refused engine ``cls`` is (or derives from), with the engine's own class; looked up once."""
    try:
        return _refused_class[cls]
    except KeyError:
        found = None
        for c in cls.__mro__:
            package = c.__module__.partition(".")[0]
            engine = next((e for e in _ENGINES if e.package == package and c.__name__ in e.names), None)
            if engine is not None:
                found = (engine, c)
                break
        _refused_class[cls] = found
        return found


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def check_module(model: object) -> None:
    """Raises for a model whose class is a wrapper nanscan refuses (see the module notes)."""
    found = _engine_of(type(model))
    if found is not None:
        engine, cls = found
        named = _qualified(cls) if cls is type(model) else f"{_qualified(type(model))} (a {_qualified(cls)})"
        raise ValueError(
            f"nanscan: {named} is {engine.what}: this rank holds only its part, so nanscan's statistics would "
            f"be one rank's, not the model's. Instead, {engine.instead}. {_ADVICE_PROCESS_GROUP}"
        )


def possible() -> bool:
    """Whether a refused engine's package is imported (only then can a parameter carry its mark)."""
    return any(package in sys.modules for _, packages, _ in _MARKS for package in packages)


def check_tensors(tensors: Sequence[object]) -> None:
    """Raises for an entry that carries a refused engine's mark (see the module notes). Costs nothing
    where no such engine was imported, and a C-level map per mark (45 ns a tensor) where one is."""
    for attribute, packages, what in _MARKS:
        if not any(package in sys.modules for package in packages):
            continue
        if not any(map(hasattr, tensors, itertools.repeat(attribute))):
            continue
        for i, t in enumerate(tensors):
            if getattr(t, attribute, None) is not None:
                raise ValueError(
                    f"nanscan: entry {i} is {what}: its .grad does not hold this rank's gradient, or holds only "
                    f"a shard of it, so nanscan would report one rank's part, or nothing. Use the engine's own "
                    f"norm. {_ADVICE_PROCESS_GROUP}"
                )
