"""DeepSpeed ZeRO stages 1, 2 and 3: each rank holds its partition of the averaged gradients.

After the ``engine.backward()`` that ends a gradient accumulation window, DeepSpeed's ZeRO optimizer
holds this rank's partition of the averaged gradients and sets every parameter's ``.grad`` to None.

* Stages 1 and 2 (``DeepSpeedZeroOptimizer``) partition the flat gradients of each parameter group,
  so a rank holds a piece of some parameters and none of others. Each parameter it trains carries
  ``_hp_mapping``: None where none of the parameter's elements falls in this rank's partition, else
  where its piece sits (``get_lp_grad_fragment``, the same lookup ``deepspeed.utils.safe_get_full_grad``
  makes before its all-reduce).
* Stage 3 (``DeepSpeedZeroOptimizer_Stage3``) partitions every parameter itself: each carries ``ds_id``
  and ``_z3_optimizer``, and rank ``r`` of its group holds elements ``[r * n, (r + 1) * n)`` of its
  flattened gradient (``n = partition_numel()``; the last rank's tail is padding, not read), in the
  optimizer's table of partitions by ``ds_id`` (what ``safe_get_full_grad`` all-gathers; read here
  from the table itself, since DeepSpeed's accessor waits on the host for the reduction stream, which
  the backward's end has already waited for).

Either way the pieces of the ranks are disjoint and cover each parameter once, as FSDP1's shards do:
each rank scans its pieces (an empty one where it holds none) and the per-parameter results are
reduced over DeepSpeed's data-parallel group by the SUM and the MAX of nanscan.layouts.reduce, every
piece counted (there are no copies). A clip scales the pieces in place: they are what
``engine.step()`` flattens and steps on.

Read only where the pieces are the model's averaged gradient; refused otherwise, on every rank,
before anything is read (nanscan.layouts.refused keeps refusing the rest of DeepSpeed):

* outside the window between a boundary's ``engine.backward()`` and ``engine.step()`` (the pieces do
  not exist yet, hold a window's partial sums, or are gone);
* fp16: DeepSpeed's pieces are multiplied by its loss scale (its own overflow check reads them);
* CPU or NVMe offload (ZeRO-Offload, ZeRO-Infinity), ZenFlow, stage 3's hierarchical partitioning
  (hpZ), and Muon (its pieces are momentum, not gradients): not tested;
* a data-parallel group smaller than the world (tensor or pipeline parallelism, MoE experts, MiCS):
  the pieces are then only some ranks' parameters, or copies;
* parameters that require a gradient and that the ZeRO optimizer does not train (each rank's own
  ``.grad``), and ``process_group=``;
* DeepSpeed's BF16_Optimizer (stage 1 with bf16 and fp32 accumulation), whose buffers hold each
  rank's unreduced sums until the boundary, with nothing on a parameter to tell which: refused by
  its mark as before.

Nothing here imports DeepSpeed: a parameter's marks say everything (a mapping holds the dict of
pieces its optimizer fills at the boundary and empties at the step; stage 3's optimizer holds its
table of partitions and the list of them that its step reads, set by a backward, emptied by a step).
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
MARK_STAGE3 = "ds_id"  # DeepSpeed's mark on each parameter ZeRO-3 partitions
MARKS = frozenset((MARK, MARK_STAGE3))
# Stage 3's table of this rank's gradient partitions, by ds_id (a private, name-mangled attribute:
# checked against each parameter's partition size before it is read).
_STAGE3_PARTITIONS = "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"

_WINDOW = (
    "DeepSpeed holds a step's averaged gradients only between the engine.backward() that ends a gradient "
    "accumulation window (engine.is_gradient_accumulation_boundary()) and engine.step()"
)


def possible() -> bool:
    """Whether DeepSpeed is imported (only then can a parameter carry its mark)."""
    return "deepspeed" in sys.modules


def holds(params: Sequence[object]) -> bool:
    """Whether any of ``params`` is trained by DeepSpeed's ZeRO-1/2 (or bf16) optimizer, or partitioned
    by ZeRO-3: C-level maps, looked at only where DeepSpeed is imported."""
    return possible() and (
        any(map(hasattr, params, itertools.repeat(MARK))) or any(map(hasattr, params, itertools.repeat(MARK_STAGE3)))
    )


@dataclass(frozen=True)
class Parts:
    """One call's view of a ZeRO model's gradients: what ``Layout`` needs."""

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
    names: Sequence[str], params: Sequence[Any], mark: str, trained: list[Any], process_group: Any
) -> None:
    """Raises where the pieces of ``trained`` (those of ``params`` that carry ``mark`` and require a
    gradient) cannot be the model's averaged gradient, whatever the stage (module notes); the same
    outcome on every rank, decided by what every rank holds alike."""
    if process_group is not None:
        raise ValueError(
            "nanscan: process_group= with DeepSpeed ZeRO: its data-parallel group already spans every rank, whose "
            "pieces nanscan reduces; leave process_group out"
        )
    _refuse_untrained(
        [name for name, p in zip(names, params, strict=True) if not hasattr(p, mark) and p.requires_grad],
        "DeepSpeed never reduces their gradients, so each rank's is its own",
    )
    require_initialized()
    if any(p.dtype == torch.float16 for p in trained):
        raise _refuse(
            "DeepSpeed ZeRO in fp16: the pieces of the gradients it holds are multiplied by its loss scale, so their "
            "statistics are not the gradients' (its own overflow check reads them)"
        )
    if any(getattr(p, "use_muon", False) for p in trained):
        raise _refuse("DeepSpeed ZeRO with Muon: the pieces it holds are Muon's momentum, not gradients")


def _refuse_untrained(untrained: list[str], why: str) -> None:
    """Raises, naming them, where some parameters require a gradient the ZeRO optimizer does not train."""
    if untrained:
        listed = ", ".join(untrained[:5]) + (f" and {len(untrained) - 5} more" if len(untrained) > 5 else "")
        raise ValueError(
            f"nanscan: {listed} require a gradient, but DeepSpeed's ZeRO optimizer does not train them (not in its "
            f"parameter groups): {why}. Give them to the optimizer, or freeze them (requires_grad=False)"
        )


def _refuse_partial_groups(groups: list[Any]) -> None:
    """Raises where a parameter is partitioned over fewer ranks than the world (module notes)."""
    world = dist.get_world_size()
    for group in {id(g): g for g in groups}.values():
        if dist.get_world_size(group) != world:
            raise _refuse(
                f"DeepSpeed partitions these gradients over {dist.get_world_size(group)} of the {world} ranks "
                "(tensor or pipeline parallelism, MoE experts, or MiCS), so the reduced pieces would be those ranks' "
                "parameters, not the model's"
            )


def _refuse_outside_the_window() -> ValueError:
    return ValueError(
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
    if any(map(hasattr, params, itertools.repeat(MARK_STAGE3))):
        return _stage3_parts(names, params, process_group)
    # The parameters the optimizer trains (the others are frozen: refused below where they require a
    # gradient), with their names.
    marked = [(name, p) for name, p in zip(names, params, strict=True) if hasattr(p, MARK)]
    kept_names = [name for name, _ in marked]
    trained = [p for _, p in marked]
    mappings = _mappings(trained)
    _refuse_unreadable(names, params, MARK, trained, process_group)
    groups = [p._dp_group for p in trained]
    _refuse_partial_groups(groups)
    if any(m.use_offload for m in mappings):
        raise _refuse(
            "DeepSpeed ZeRO with CPU offload (ZeRO-Offload) keeps its pieces on the host; nanscan does not read them"
        )
    # Set at a window's last backward, emptied by engine.step(): alike on every rank.
    if any(m.gradient_dict.get(m.param_group_index) is None for m in mappings):
        raise _refuse_outside_the_window()
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
    made = _plan(kept_names, trained, groups, [tuple(p.shape) for p in trained])
    return Parts(kept_names, pieces, [piece for piece in pieces if piece.numel() > 0], made.plan, made.numels)


def _stage3_parts(names: Sequence[str], params: Sequence[Any], process_group: Any) -> Parts:
    """``parts`` under ZeRO-3: each trained parameter's partition, from its optimizer's table, less
    the padding that ends the last rank's (module notes)."""
    # A ZeRO-3 parameter's .data is a placeholder between forwards: its shape and size are ds_shape
    # and ds_numel; a frozen one (requires_grad False) has no partition, and is left out.
    marked = [(name, p) for name, p in zip(names, params, strict=True) if hasattr(p, MARK_STAGE3) and p.requires_grad]
    kept_names = [name for name, _ in marked]
    trained = [p for _, p in marked]
    _refuse_unreadable(names, params, MARK_STAGE3, trained, process_group)
    groups = [p.ds_process_group for p in trained]
    _refuse_partial_groups(groups)
    optimizers = {id(o): o for o in (getattr(p, "_z3_optimizer", None) for p in trained)}
    if None in optimizers.values() or len(optimizers) > 1:
        raise _refuse(
            "these parameters are partitioned by DeepSpeed ZeRO-3 without one ZeRO-3 optimizer that trains them all "
            "(zero.Init alone, or several engines): no gradient partition of theirs is known"
        )
    optimizer = next(iter(optimizers.values()), None)
    if optimizer is None:  # nothing trained: an empty layout, as of a model without gradients
        made = _plan([], [], [], [])
        return Parts([], [], [], made.plan, made.numels)
    held = {q.ds_id for group in optimizer.fp16_groups for q in group}  # the parameters its step trains
    _refuse_untrained(
        [name for name, p in marked if p.ds_id not in held], "no partition of theirs is the model's gradient"
    )
    if any(getattr(optimizer, flag, False) for flag in ("offload_optimizer", "offload_param", "zenflow")):
        raise _refuse(
            "DeepSpeed ZeRO-3 with offload (ZeRO-Offload, ZeRO-Infinity) or ZenFlow keeps its partitions on the host "
            "or swaps them; nanscan does not read them"
        )
    if getattr(optimizer, "zero_hpz_partition_size", 1) > 1:
        raise _refuse("DeepSpeed ZeRO-3 with hierarchical partitioning (zero_hpz_partition_size > 1): not read")
    table = vars(optimizer).get(_STAGE3_PARTITIONS)
    if not isinstance(table, dict):
        raise _refuse("this DeepSpeed ZeRO-3 optimizer keeps no table of gradient partitions that nanscan knows")
    # The engine marks the boundary before a window's last backward, whose end sets the list of
    # partitions the step reads (every backward sets it; the step empties it): alike on every rank.
    reads = optimizer.averaged_gradients
    if not (optimizer.is_gradient_accumulation_boundary() and reads and all(v is not None for v in reads.values())):
        raise _refuse_outside_the_window()
    rank_in = {id(g): dist.get_rank(g) for g in groups}
    pieces = []
    for name, p, group in zip(kept_names, trained, groups, strict=True):
        partition = table.get(p.ds_id)
        size = p.partition_numel()
        if partition is None or partition.numel() != size:
            raise _refuse(
                f"DeepSpeed's partition of {name}'s gradient holds "
                f"{'no' if partition is None else partition.numel()} elements where the parameter says {size}: a "
                "layout this version of nanscan does not know"
            )
        start = rank_in[id(group)] * size
        pieces.append(partition[: max(0, min(size, p.ds_numel - start))])  # the last rank's padding left out
    made = _plan(kept_names, trained, groups, [tuple(p.ds_shape) for p in trained], [p.ds_numel for p in trained])
    return Parts(kept_names, pieces, [piece for piece in pieces if piece.numel() > 0], made.plan, made.numels)


@dataclass(frozen=True)
class _Made:
    plan: Plan
    numels: list[int]


# By the parameters' identities and names: a plan holds its index tensors on the device, made once
# (a host-to-device copy per call would be a sync point). Bounded: a model's lists are few.
_plans: dict[tuple[Any, ...], tuple[list[weakref.ReferenceType[Any]], _Made]] = {}


def _plan(
    names: list[str],
    trained: list[Any],
    groups: list[Any],
    shapes: list[tuple[int, ...]],
    numels: list[int] | None = None,
) -> _Made:
    """The reduction plan of the trained parameters' pieces, partitioned over ``groups`` (one per
    parameter): one group per data-parallel group, every piece counted (the ranks' pieces are
    disjoint), fingerprinted by names and ``shapes`` (the whole parameters'); ``numels``: the whole
    parameters' sizes, where not their own (ZeRO-3's placeholders)."""
    key = (tuple(map(id, trained)), tuple(names))
    found = _plans.get(key)
    if found is not None and all(ref() is p for ref, p in zip(found[0], trained, strict=True)):
        return found[1]
    by_group: dict[int, tuple[Any, list[int]]] = {}
    for i, group in enumerate(groups):
        by_group.setdefault(id(group), (group, []))[1].append(i)
    plan_groups = [
        Group(indices, group, [True] * len(indices), fingerprint([(names[i], shapes[i]) for i in indices]))
        for group, indices in by_group.values()
    ]
    made = _Made(
        Plan(plan_groups, own=[], copies=[], dtypes=None),
        numels if numels is not None else [p.numel() for p in trained],
    )
    if len(_plans) >= 64:
        _plans.clear()
    # Weak references prove the ids in the key still the parameters' (an id is reused once its object
    # dies), without keeping a model alive.
    _plans[key] = ([weakref.ref(p) for p in trained], made)
    return made
