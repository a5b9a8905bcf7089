"""DeepSpeed ZeRO stages 1 and 2: each rank holds its partition of the averaged gradients.

After the ``engine.backward()`` that ends a gradient accumulation window, DeepSpeed's ZeRO optimizer
(stage 1 and 2, ``DeepSpeedZeroOptimizer``) holds this rank's partition of the flat, averaged
gradients, one tensor per parameter piece, and sets every parameter's ``.grad`` to None. Each
parameter it trains carries ``_hp_mapping``: None where none of the parameter's elements falls in
this rank's partition, else where its piece sits (``get_lp_grad_fragment``, the same lookup
``deepspeed.utils.safe_get_full_grad`` makes before its all-reduce). The pieces of the ranks are
disjoint and cover each parameter once, as FSDP1's shards do: each rank scans its pieces (an empty
one where it holds none) and the per-parameter results are reduced over DeepSpeed's data-parallel
group by the SUM and the MAX of nanscan.layouts.reduce, every piece counted (there are no copies).
A clip scales the pieces in place: they are what ``engine.step()`` flattens and steps on.

Read only where the pieces are the model's averaged gradient; refused otherwise, on every rank,
before anything is read (nanscan.layouts.refused keeps refusing the rest of DeepSpeed):

* outside the window between a boundary's ``engine.backward()`` and ``engine.step()`` (the pieces do
  not exist yet, or are gone);
* fp16: DeepSpeed's pieces are multiplied by its loss scale (its own overflow check reads them);
* CPU offload (ZeRO-Offload), and Muon (its pieces are momentum, not gradients): not tested;
* a data-parallel group smaller than the world (tensor or pipeline parallelism, MoE experts): the
  pieces are then only some ranks' parameters;
* parameters that require a gradient and that the ZeRO optimizer does not train (each rank's own
  ``.grad``), and ``process_group=``;
* DeepSpeed's BF16_Optimizer (stage 1 with bf16 and fp32 accumulation), whose buffers hold each
  rank's unreduced sums until the boundary, with nothing on a parameter to tell which: refused by
  its mark as before.

Nothing here imports DeepSpeed: a parameter's marks say everything (a mapping holds the dict of
pieces its optimizer fills at the boundary and empties at the step).
"""

from __future__ import annotations

import itertools
import sys
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .reduce import Group, Plan, empty_part, fingerprint, require_initialized

MARK = "_hp_mapping"  # DeepSpeed's mark on each parameter its ZeRO-1/2 or bf16 optimizer trains

_WINDOW = (
    "DeepSpeed holds a step's averaged gradients only between the engine.backward() that ends a gradient "
    "accumulation window (engine.is_gradient_accumulation_boundary()) and engine.step()"
)


def possible() -> bool:
    """Whether DeepSpeed is imported (only then can a parameter carry its mark)."""
    return "deepspeed" in sys.modules


def holds(params: Sequence[object]) -> bool:
    """Whether any of ``params`` is trained by DeepSpeed's ZeRO-1/2 (or bf16) optimizer: a C-level map,
    looked at only where DeepSpeed is imported."""
    return possible() and any(map(hasattr, params, itertools.repeat(MARK)))


@dataclass(frozen=True)
class Parts:
    """One call's view of a ZeRO-1/2 model's gradients: what ``Layout`` needs."""

    names: list[str]
    parts: list[torch.Tensor]  # this rank's piece of each parameter's averaged gradient (maybe empty)
    scaled: list[torch.Tensor]  # the pieces that hold elements: what a clip multiplies in place
    plan: Plan
    numels: list[int]  # each whole parameter's number of elements


def _refuse(what: str) -> ValueError:
    return ValueError(
        f"nanscan: {what}. Use the engine's own norm instead (engine.get_global_grad_norm() after engine.step(); "
        "gradient_clipping in its config; deepspeed.utils.safe_get_full_grad(p) for one parameter)"
    )


def _mappings(trained: Sequence[Any]) -> list[Any]:
    """The mappings of the parameters that have a piece on this rank; refused where they are
    BF16_Optimizer's, which links its parameters the same way (module notes)."""
    mappings = [p._hp_mapping for p in trained if p._hp_mapping is not None]
    # ZeRO-1/2 hands every mapping its offload dict ({} without offload); BF16_Optimizer hands None,
    # and keeps the accumulated gradient on the parameter (_hp_grad) once a backward has run.
    if any(m.offload_gradient_dict is None for m in mappings) or any(
        getattr(p, "_hp_grad", None) is not None for p in trained
    ):
        raise _refuse(
            "these parameters are trained by DeepSpeed's BF16_Optimizer (ZeRO stage 1 with bf16 and fp32 gradient "
            "accumulation), whose buffers hold each rank's own sums until the boundary: nothing on a parameter tells "
            "nanscan whether they are reduced yet"
        )
    return mappings


def _refuse_unreadable(
    names: Sequence[str], params: Sequence[Any], trained: list[Any], mappings: list[Any], process_group: Any
) -> None:
    """Raises where the pieces of ``trained`` (those of ``params`` the optimizer trains) are not the
    model's averaged gradient (module notes); the same outcome on every rank, decided by what every
    rank holds alike."""
    if process_group is not None:
        raise ValueError(
            "nanscan: process_group= with DeepSpeed ZeRO: its data-parallel group already spans every rank, whose "
            "pieces nanscan reduces; leave process_group out"
        )
    untrained = [name for name, p in zip(names, params, strict=True) if not hasattr(p, MARK) and p.requires_grad]
    if untrained:
        listed = ", ".join(untrained[:5]) + (f" and {len(untrained) - 5} more" if len(untrained) > 5 else "")
        raise ValueError(
            f"nanscan: {listed} require a gradient, but DeepSpeed's ZeRO optimizer does not train them (not in its "
            "parameter groups): DeepSpeed never reduces their gradients, so each rank's is its own. Give them to the "
            "optimizer, or freeze them (requires_grad=False)"
        )
    require_initialized()
    if any(m.use_offload for m in mappings):
        raise _refuse(
            "DeepSpeed ZeRO with CPU offload (ZeRO-Offload) keeps its pieces on the host; nanscan does not read them"
        )
    if any(p.dtype == torch.float16 for p in trained):
        raise _refuse(
            "DeepSpeed ZeRO in fp16: the pieces of the gradients it holds are multiplied by its loss scale, so their "
            "statistics are not the gradients' (its own overflow check reads them)"
        )
    if any(getattr(p, "use_muon", False) for p in trained):
        raise _refuse("DeepSpeed ZeRO with Muon: the pieces it holds are Muon's momentum, not gradients")
    world = dist.get_world_size()
    groups = {id(p._dp_group): p._dp_group for p in trained}
    for group in groups.values():
        if dist.get_world_size(group) != world:
            raise _refuse(
                f"DeepSpeed partitions these gradients over {dist.get_world_size(group)} of the {world} ranks "
                "(tensor or pipeline parallelism, or MoE experts), so the reduced pieces would be those ranks' "
                "parameters, not the model's"
            )
    # Set at a window's last backward, emptied by engine.step(): alike on every rank.
    if any(m.gradient_dict.get(m.param_group_index) is None for m in mappings):
        raise ValueError(
            f"nanscan: these DeepSpeed ZeRO gradients are not the model's now: {_WINDOW}. Check after that "
            "backward (not between the micro-batches of a window, and not after engine.step()). Accelerate runs "
            "engine.step() inside accelerator.backward(), which leaves no such window: under the Hugging Face Trainer, "
            "NanscanTrainerCallback checks inside DeepSpeed's step; in a loop of your own, use the engine's own norm "
            "(engine.get_global_grad_norm())"
        )


def parts(names: Sequence[str] | None, params: Sequence[Any], process_group: Any = None) -> Parts:
    """This rank's pieces of the averaged gradients of ``params`` (named ``names``, or by position
    where None; parameters with no mark and no need of a gradient left out), and their reduction
    plan. Raises where they are not the model's (module notes)."""
    if names is None:
        names = [f"[{i}]" for i in range(len(params))]  # by position, as any list of parameters
    # The parameters the optimizer trains (the others are frozen: refused below where they require a
    # gradient), with their names.
    marked = [(name, p) for name, p in zip(names, params, strict=True) if hasattr(p, MARK)]
    kept_names = [name for name, _ in marked]
    trained = [p for _, p in marked]
    mappings = _mappings(trained)
    _refuse_unreadable(names, params, trained, mappings, process_group)
    found: list[torch.Tensor | None] = []
    for name, p in marked:
        mapping = p._hp_mapping
        if mapping is None:
            found.append(None)  # made below, of the pieces' dtype
            continue
        piece = mapping.get_lp_grad_fragment(p._index_in_param_group)
        if piece.numel() != mapping.lp_fragment_address.numel:
            raise _refuse(
                f"DeepSpeed's piece of {name}'s gradient holds {piece.numel()} elements where its mapping says "
                f"{mapping.lp_fragment_address.numel}: a layout this version of nanscan does not know"
            )
        found.append(piece)
    # A parameter with no element here: an empty piece of the accumulation dtype (every piece's).
    dtype: torch.dtype = next((t.dtype for t in found if t is not None), trained[0].dtype if trained else torch.float32)
    pieces = [t if t is not None else empty_part(dtype, p.device) for t, p in zip(found, trained, strict=True)]
    made = _plan(kept_names, trained)
    return Parts(kept_names, pieces, [piece for piece in pieces if piece.numel() > 0], made.plan, made.numels)


@dataclass(frozen=True)
class _Made:
    plan: Plan
    numels: list[int]


# By the parameters' identities and names: a plan holds its index tensors on the device, made once
# (a host-to-device copy per call would be a sync point). Bounded: a model's lists are few.
_plans: dict[tuple[Any, ...], tuple[list[weakref.ReferenceType[Any]], _Made]] = {}


def _plan(names: list[str], trained: list[Any]) -> _Made:
    """The reduction plan of the trained parameters' pieces: one group per data-parallel group, every
    piece counted (the ranks' pieces are disjoint), fingerprinted by names and shapes."""
    key = (tuple(map(id, trained)), tuple(names))
    found = _plans.get(key)
    if found is not None and all(ref() is p for ref, p in zip(found[0], trained, strict=True)):
        return found[1]
    by_group: dict[int, tuple[Any, list[int]]] = {}
    for i, p in enumerate(trained):
        by_group.setdefault(id(p._dp_group), (p._dp_group, []))[1].append(i)
    groups = [
        Group(
            indices, group, [True] * len(indices), fingerprint([(names[i], tuple(trained[i].shape)) for i in indices])
        )
        for group, indices in by_group.values()
    ]
    made = _Made(Plan(groups, own=[], copies=[], dtypes=None), [p.numel() for p in trained])
    if len(_plans) >= 64:
        _plans.clear()
    # Weak references prove the ids in the key still the parameters' (an id is reused once its object
    # dies), without keeping a model alive.
    _plans[key] = ([weakref.ref(p) for p in trained], made)
    return made
