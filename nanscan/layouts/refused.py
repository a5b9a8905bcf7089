"""Gradient sharding that nanscan cannot reduce, refused before anything is read or written.

A wrapper that keeps each rank's gradients as a shard of its own (DeepSpeed's pipelines, Megatron's
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

from .zero import MARK as ZERO_MARK
from .zero import MARK_STAGE3 as ZERO3_MARK

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
        ("DeepSpeedEngine", "PipelineEngine", "DeepSpeedHybridEngine", "DualPipeVEngine"),
        "a DeepSpeed engine nanscan does not read: a pipeline, which gives each rank its own stage, or the hybrid "
        "engine (after engine.backward() a parameter's .grad is None, or this rank's unreduced one)",
        "use the engine's own norm (engine.get_global_grad_norm() after engine.step(); gradient_clipping in "
        "its config; deepspeed.utils.safe_get_full_grad(p) for one parameter)",
    ),
    _Engine(
        "megatron",
        (
            "DistributedDataParallel",
            "_BaseDataParallel",
            "FullyShardedDataParallelV1",
            "FullyShardedDataParallelV2",
            "TorchFullyShardedDataParallel",
            "Float16Module",
        ),
        "a Megatron model, whose gradients live in .main_grad buffers (.grad is None), reduce-scattered to a "
        "slice per rank by its distributed optimizer",
        "use Megatron's own norm (optimizer.get_grad_norm(), or the grad_norm optimizer.step() returns; "
        "DistributedDataParallelConfig(check_for_nan_in_grad=True) for NaNs)",
    ),
    _Engine(
        "fairscale",
        ("FullyShardedDataParallel", "ShardedDataParallel"),
        "a fairscale sharded model, whose gradients are flat shards (FSDP) or reduced to one owner rank "
        "(ShardedDataParallel)",
        "use its own clip (model.clip_grad_norm_(), OSS.clip_grad_norm()), or torch's FSDP, which nanscan reduces",
    ),
    _Engine(
        "colossalai",
        ("ModelWrapper", "GeminiDDP"),
        "a ColossalAI model (ZeRO, Gemini, hybrid parallel), whose gradients live in its optimizer's stores",
        "use its optimizer's own norm (optimizer.get_grad_norm())",
    ),
    _Engine(
        "torchrec",
        ("DistributedModelParallel", "DMPCollection", "ShardedModule"),
        "a TorchRec model, whose embedding tables are sharded over the ranks (and fused with their optimizer)",
        "check its dense part alone (a module of it that holds no sharded table), or use TorchRec's own tools",
    ),
)

# Marks an engine sets on every parameter it manages: (attribute, the packages that set it, what it
# means). Looked for only where one of the packages is imported: none can have set it otherwise.
MARKS = (
    (
        ZERO3_MARK,  # read where ZeRO-3's gradients are (nanscan.layouts.zero), refused elsewhere
        ("deepspeed",),
        "a parameter partitioned by DeepSpeed ZeRO stage 3, whose .data is a placeholder and whose gradient lives "
        "in its optimizer's partitions (nanscan reads ZeRO's gradients in check and clip_grad_norm_ alone: "
        "nanscan.layouts.zero)",
    ),
    (
        ZERO_MARK,  # read where ZeRO-1/2's gradients are (nanscan.layouts.zero), refused elsewhere
        ("deepspeed",),
        "a parameter of DeepSpeed's ZeRO-1/2 or bf16 optimizer, which partitions its gradients and optimizer state "
        "over the ranks (nanscan reads ZeRO's gradients in check and clip_grad_norm_ alone: "
        "nanscan.layouts.zero)",
    ),
    (
        "main_grad",
        ("megatron", "transformer_engine"),
        "a parameter whose gradient lives in .main_grad (Megatron, TransformerEngine)",
    ),
    ("_is_sharded", ("fairscale",), "a fairscale flat parameter, sharded over the ranks"),
    ("_gemini_reduced", ("colossalai",), "a ColossalAI Gemini parameter, whose gradient lives in its chunks"),
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


def _deepspeed_read_by_parameters(model: object, cls: type) -> bool:
    """Whether what a DeepSpeed engine holds is decided by its parameters: ZeRO stage 0 (DDP's layout:
    every rank holds its gradients whole and all-reduced, in ``.grad``; nanscan reads its ``.module``
    as a DDP model's) or 1-3 (the parameters' marks lead to the pieces: nanscan.layouts.zero), and no
    pipeline. Its optimizers' marks on the parameters then decide (``MARKS``)."""
    if cls.__name__ != "DeepSpeedEngine":
        return False  # a pipeline (each rank its own stage) or another engine
    try:
        return bool(model.zero_optimization_stage() in (0, 1, 2, 3))  # type: ignore[attr-defined]
    except Exception:
        return False


def check_module(model: object) -> None:
    """Raises for a model whose class is a wrapper nanscan refuses (see the module notes)."""
    found = _engine_of(type(model))
    if found is not None:
        engine, cls = found
        if engine.package == "deepspeed" and _deepspeed_read_by_parameters(model, cls):
            return
        named = _qualified(cls) if cls is type(model) else f"{_qualified(type(model))} (a {_qualified(cls)})"
        raise ValueError(
            f"nanscan: {named} is {engine.what}: this rank holds only its part, so nanscan's statistics would "
            f"be one rank's, not the model's. Instead, {engine.instead}. {_ADVICE_PROCESS_GROUP}"
        )


def possible() -> bool:
    """Whether a refused engine's package is imported (only then can a parameter carry its mark)."""
    return any(package in sys.modules for _, packages, _ in MARKS for package in packages)


def check_tensors(tensors: Sequence[object]) -> None:
    """Raises for an entry that carries a refused engine's mark (see the module notes). Costs nothing
    where no such engine was imported, and a C-level map per mark (45 ns a tensor) where one is."""
    for attribute, packages, what in MARKS:
        if not any(package in sys.modules for package in packages):
            continue
        if not any(map(hasattr, tensors, itertools.repeat(attribute))):
            continue
        for i, t in enumerate(tensors):
            if hasattr(t, attribute):  # set at all: DeepSpeed's _hp_mapping is None on ranks without a fragment
                raise ValueError(
                    f"nanscan: entry {i} is {what}: what this rank holds is not the model's gradient, so "
                    f"nanscan would report one rank's part, or nothing. Use the engine's own norm. "
                    f"{_ADVICE_PROCESS_GROUP}"
                )
