"""Layouts: where the tensors a caller passes live, and how their per-tensor results are reduced.

Every entry point (``scan``, ``check``, ``clip_grad_norm_``, ``get_total_norm``, the GradScaler, the
Advisor, ``verify_replicas``) asks this module for the ``Layout`` of what it was given and never
branches on the kind of model itself. A layout answers three questions:

1. which local tensors to scan (``Layout.parts``), in one fused call per device;
2. their global names, as the user wrote them (``Layout.names``);
3. how to reduce the per-tensor results and the clip's total norm (``Layout.plan``, and
   ``process_group`` for pipeline stages; nanscan.layouts.reduce), and what a clip scales.

The layouts, one module each:

* a single process (single.py): a module's parameters after its kept walk, a list of parameters,
  a list of ``(name, parameter)`` pairs; DDP, whose all-reduce leaves every rank the same gradients,
  is one too, with its hook's rank attribution where attached (ddp.py);
* DTensors (dtensor.py): FSDP2, tensor parallel, HSDP, any placement on any mesh; FSDP2's unsharded
  parameters read as their shards, and its unreduced gradient accumulation refused (fsdp2.py);
* FSDP1 flat parameters (fsdp1.py), every sharding strategy;
* DeepSpeed ZeRO stages 1, 2 and 3 (zero.py): each rank's partition of the averaged gradients;
* ``process_group``: ranks that each hold different tensors (pipeline stages), on top of any other;
* refused (refused.py): gradient sharding nanscan cannot reduce (DeepSpeed's pipelines, Megatron's
  distributed optimizer, ...) is refused with an error that names the wrapper, before anything is
  read: a rank-local answer presented as the model's is the one outcome that must never happen.
"""

from __future__ import annotations

import dataclasses
import math
import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .. import walk
from ..fused import ScanResult, empty_result, gradients_of, scan_local, upload
from ..names import PairNames
from . import ddp, dtensor, fsdp1, fsdp2, live, refused, single, zero
from .reduce import (
    Plan,
    group_device,
    reduce_norm_terms,
    reduce_scan,
    require_initialized,
    scan_norm_terms,
    scan_norm_total,
    torch_norm_terms,
    torch_norm_total,
)


@dataclass(frozen=True)
class Layout:
    """What one call works on (see the module notes). Made per call, from cached parts.

    Attributes:
        names: one per tensor; None where the caller names them (``nanscan.scan(tensors, names)``).
        tensors: the tensors described, as the caller holds them (gradients, DTensors).
        parts: this rank's part of each (a DTensor's local shard, an FSDP1 parameter's part of the
            shard): what the fused scan reads.
        scaled: what a clip multiplies in place (local shards, FSDP1's flat gradients).
        plan: how the parts' results are reduced across ranks; None in a single process.
        process_group: pipeline stages: every rank's list is laid end to end over this group.
        replica_group: the ranks that hold copies of the plain tensors (a DDP model's group).
        scanner: a DDP model's bucket scanner (``nanscan.ddp.attach``), for the rank attribution.
        parameters: the parameters whose gradients ``tensors`` are, where the scanner needs them.
        cut: the tensors are parts of parameters cut from FSDP1's flat parameters, named by ``names``:
            not the caller's list (its flat parameters), and possibly empty on this rank.
        numels: the number of elements of each whole parameter, where ``tensors`` are parts of them.
    """

    names: Sequence[str] | None
    tensors: list[torch.Tensor]
    parts: list[torch.Tensor]
    scaled: list[torch.Tensor]
    plan: Plan | None = None
    process_group: Any = None
    replica_group: Any = None
    scanner: ddp.BucketScanner | None = None
    parameters: list[Any] | None = None
    cut: bool = False
    numels: Sequence[int] | None = None

    @property
    def distributed(self) -> bool:
        """Whether results are reduced across ranks."""
        return self.plan is not None or self.process_group is not None

    def dtypes(self) -> set[torch.dtype]:
        """The tensors' dtypes: those the plan knows (a DTensor's spec holds its dtype: reading 1,000
        shards' dtypes costs 0.1 ms a call), the others read."""
        plan = self.plan
        if plan is None or plan.dtypes is None:
            return {t.dtype for t in self.parts}
        return set(plan.dtypes).union([self.parts[i].dtype for i in plan.own])


def _plain(names: Sequence[str] | None, tensors: list[torch.Tensor], **extra: Any) -> Layout:
    return Layout(names, tensors, tensors, tensors, **extra)


def _dtensors(
    names: Sequence[str] | None, tensors: list[torch.Tensor], process_group: Any, compared: bool = False
) -> Layout:
    """A list that holds DTensors, reduced over their meshes (and ``process_group``). Without
    ``process_group``, a list whose reduction would be some ranks' own is refused (``compared``:
    ``verify_replicas``, which compares plain tensors over the default group, takes it)."""
    shards = dtensor.to_local(tensors)
    plan = dtensor.plan_of(tensors)
    if process_group is None and not compared:
        _require_model_wide(plan, names, tensors)
    return Layout(names, tensors, shards, shards, plan, process_group)


def _require_model_wide(plan: dtensor.DTensorPlan, names: Sequence[str] | None, tensors: Sequence[Any]) -> None:
    """Refuses a list of DTensors whose statistics would not be the model's: plain tensors beside them
    (FSDP2 leaves the gradients of parameters outside every ``fully_shard`` unreduced, each rank's
    own), or meshes that hold only some of the ranks (pipeline stages, each sharded over its own)."""
    if plan.own and dist.get_world_size() > 1:
        listed = ", ".join(names[i] if names is not None else f"[{i}]" for i in plan.own[:5])
        more = f" and {len(plan.own) - 5} more" if len(plan.own) > 5 else ""
        raise ValueError(
            f"nanscan: {listed}{more}: plain tensors beside DTensors. Each rank's plain tensor is its own "
            "(FSDP2 does not reduce the gradient of a parameter outside every fully_shard: shard the root "
            "too, fully_shard(model)), so their statistics would be one rank's, not the model's; torch's "
            "clip_grad_norm_ refuses such a list too. Make them DTensors, or pass process_group= (the "
            "ranks that each hold different tensors)"
        )
    if not plan.spans_world:
        if fsdp2.possible():
            # FSDP2 + tensor parallel accumulating unreduced: the module holds its unsharded copies,
            # DTensors over the tensor-parallel mesh alone. Said as such, not as pipeline stages.
            fsdp2.refuse_unreduced(tensors, names, dtensors_too=True)
        raise ValueError(
            f"nanscan: these DTensors' meshes hold only some of the {dist.get_world_size()} ranks (pipeline "
            "stages, each sharded over its own ranks?), so their statistics would be those ranks' own, not "
            "the model's. Pass process_group= (the ranks that hold the other stages: the pipeline's group)"
        )


def _routed(
    names: Sequence[str] | None, tensors: list[torch.Tensor], process_group: Any, compared: bool = False, **extra: Any
) -> Layout:
    """DTensors (lists are routed by their first entry) over their meshes, other tensors as they are;
    either over ``process_group`` too, if given (``compared``: see ``_dtensors``)."""
    if tensors and dtensor.is_dtensor(tensors[0]):
        return dataclasses.replace(_dtensors(names, tensors, process_group, compared), **extra)
    return _plain(names, tensors, process_group=process_group, **extra)


_SECOND = operator.itemgetter(1)  # a (name, parameter) pair's parameter

walk.TRACED_MARKS = (fsdp1.FLATTENED, *(attribute for attribute, _, _ in refused.MARKS))


def _refuse_what_compile_cannot_reduce(params: Sequence[Any], module_types: Iterable[type] = ()) -> None:
    """Inside ``torch.compile`` no layout is built from what nanscan keeps of a model (FSDP1's units
    and groups) and no engine's marks are looked up by their imports, so a model holding FSDP1 units,
    its flattened parameters and a refused engine's parameters would be scanned as this rank's own:
    they are refused, by types and attributes alone (traceable). With ``fullgraph=True`` the error
    stops the compile; without, torch.compile runs the caller eagerly, which reduces them."""
    if any(map(fsdp1.is_fsdp1_class, module_types)) or any(hasattr(p, fsdp1.FLATTENED) for p in params):
        raise ValueError(
            "nanscan: FSDP1's flattened parameters inside torch.compile: nanscan reduces them only outside "
            "the compiled region (inside, each rank's answer would be its own shard's). Call check / "
            "clip_grad_norm_ outside torch.compile, as FSDP1's own clip_grad_norm_ is called"
        )
    for attribute, _, what in refused.MARKS:
        if any(hasattr(p, attribute) for p in params):
            raise ValueError(
                f"nanscan: a parameter is {what}, inside torch.compile: what this rank holds is not the "
                "model's gradient. Use the engine's own norm"
            )


def _fsdp1(
    model_layout: fsdp1.ModelLayout,
    positions: Sequence[int] | None,
    source: str,
    process_group: Any,
    per_tensor: bool = True,
) -> Layout:
    parts = (fsdp1.parts if per_tensor else fsdp1.whole_parts)(model_layout, source, positions)
    return Layout(
        parts.names, parts.parts, parts.parts, parts.scaled, parts.plan, process_group, cut=True, numels=parts.numels
    )


def _zero(names: Sequence[str] | None, params: Sequence[Any], process_group: Any) -> Layout:
    """DeepSpeed ZeRO's pieces of the gradients of ``params`` (nanscan.layouts.zero)."""
    found = zero.parts(names, params, process_group)
    return Layout(found.names, found.parts, found.parts, found.scaled, found.plan, cut=True, numels=found.numels)


def of_tensors(
    tensors: list[torch.Tensor],
    names: Sequence[str] | None = None,
    process_group: Any = None,
    per_tensor: bool = True,
    compared: bool = False,
) -> Layout:
    """The layout of a list of tensors scanned as they are (``nanscan.scan``, ``get_total_norm``):
    DTensors reduced over their meshes, FSDP1's flattened parameters and gradients over FSDP's groups
    (of a model this process made: nanscan.layouts.live), others this rank's own unless
    ``process_group``; a DDP model's gradients inside ``no_sync()`` refused.
    ``compared``: for ``verify_replicas`` (see ``_dtensors``)."""
    # Parameters (not the usual gradients, plain tensors) may carry an engine's marks.
    if tensors and type(tensors[0]) is not torch.Tensor and _marks_possible() and not dtensor.is_dtensor(tensors[0]):
        refused.check_tensors(tensors)
        if fsdp1.flattened(tensors):
            model_layout, positions = _fsdp1_of_parameters(tensors)
            return _fsdp1(model_layout, positions, "data", process_group, per_tensor)
    elif (fsdp1_gradients := _fsdp1_of_gradients(tensors)) is not None:  # gradients of an FSDP1 model
        return _fsdp1(*fsdp1_gradients, "grad", process_group, per_tensor)
    _refuse_unsynced_ddp(tensors, "these gradients' DDP model is")
    if fsdp2.possible():
        fsdp2.refuse_unreduced(tensors, names)
    return _routed(names, tensors, process_group, compared)


def _marks_possible() -> bool:
    """Whether some parameter can carry an engine's marks (FSDP1's, a refused engine's) in this
    process: where not, no list's entries are looked at (each look costs 45 ns a tensor)."""
    return fsdp1.possible() or refused.possible()


def of_parameters(
    params_or_pairs: torch.Tensor | Iterable[Any], process_group: Any = None, compared: bool = False
) -> Layout:
    """The layout of the gradients of a list of parameters, or of ``(name, parameter)`` pairs
    (``check(params)``, ``clip_grad_norm_``): the parameters without a gradient left out.
    ``compared``: for ``verify_replicas`` (see ``_dtensors``)."""
    items: Sequence[Any]
    if isinstance(params_or_pairs, torch.Tensor):
        items = [params_or_pairs]
    else:
        items = params_or_pairs if isinstance(params_or_pairs, (list, tuple)) else list(params_or_pairs)
    if torch.compiler.is_compiling():
        _refuse_what_compile_cannot_reduce([item[1] if type(item) is tuple else item for item in items])
    elif items and _marks_possible() and not dtensor.is_dtensor(items[0]):
        params = [item[1] if type(item) is tuple else item for item in items]
        if not compared and zero.holds(params):
            pairs = type(items[0]) is tuple
            return _zero([str(item[0]) for item in items] if pairs else None, params, process_group)
        refused.check_tensors(params)
        if fsdp1.flattened(params):
            model_layout, positions = _fsdp1_of_parameters(params)
            return _fsdp1(model_layout, positions, "grad", process_group)
    _refuse_unsynced_ddp(items, "these parameters' DDP model is")
    items = _fsdp2_sharded_items(items)
    names, grads, _ = single.listed_gradients(items)
    return _routed(names, grads, process_group, compared)


def of_parameter_list(
    params: list[Any],
    grads: list[torch.Tensor],
    process_group: Any = None,
    per_tensor: bool = True,
    deepspeed: bool = True,
) -> Layout:
    """The layout of ``grads``, the gradients of ``params`` (a list of parameters whose entries the
    caller has checked: ``clip_grad_norm_``), those without a gradient left out. ``deepspeed``: where
    False, DeepSpeed ZeRO's pieces are refused (the GradScaler: DeepSpeed scales its own loss)."""
    if torch.compiler.is_compiling():
        _refuse_what_compile_cannot_reduce(params)
    elif params and _marks_possible() and not dtensor.is_dtensor(params[0]):
        if deepspeed and zero.holds(params):
            return _zero(None, params, process_group)
        refused.check_tensors(params)
        if fsdp1.flattened(params):
            model_layout, positions = _fsdp1_of_parameters(params)
            return _fsdp1(model_layout, positions, "grad", process_group, per_tensor)
    _refuse_unsynced_ddp(params, "these parameters' DDP model is")
    sharded = fsdp2_sharded(params)
    if sharded is not params:
        grads = [g for g in gradients_of(sharded) if g is not None]
    return _routed(None, grads, process_group)


def of_module(
    model: torch.nn.Module,
    process_group: Any = None,
    source: str = "grad",
    per_tensor: bool = True,
    compared: bool = False,
) -> Layout:
    """The layout of a model's gradients (``source="grad"``, parameters without one left out) or of
    its parameters' values (``"data"``): FSDP1 units cut back into their parameters, DTensors reduced
    over their meshes, a DDP model with its replicas' group and hook (see the module notes).
    ``compared``: for ``verify_replicas`` (see ``_dtensors``)."""
    if torch.compiler.is_compiling():
        walked = walk.walk(model)
        _refuse_what_compile_cannot_reduce(walked.parameters, walked.module_types)
        _refuse_ddp_gradients_that_are_not_the_models(model, process_group, source)
        names, tensors, _ = single.module_gradients(walked.names, walked.parameters)
        return _plain(names, tensors)
    refused.check_module(model)
    cached = fsdp1.kept(model)
    if cached is not None:
        return _fsdp1(cached, None, source, process_group, per_tensor)
    walked = walk.walk(model)
    if fsdp1.holds_fsdp1(walked.module_types):
        return _fsdp1(fsdp1.of_model(model), None, source, process_group, per_tensor)
    # The marks engines leave on their parameters (the walk collects the attributes set on them once):
    # a refused engine's, or FSDP1's on the parameters of a model inside an FSDP1 unit (its root's,
    # which holds them: a root nanscan knows reduces them, else they are refused).
    if walked.parameter_attributes:
        if source == "grad" and not compared and not walked.parameter_attributes.isdisjoint(zero.MARKS):
            return _zero(walked.names, walked.parameters, process_group)
        refused.check_tensors(walked.parameters)
        if fsdp1.FLATTENED in walked.parameter_attributes:
            model_layout, positions = _fsdp1_of_parameters(walked.parameters)
            return _fsdp1(model_layout, positions, source, process_group, per_tensor)
    walked_params = fsdp2_sharded(walked.parameters, walked.names, unreduced_refused=source == "grad")
    if source == "grad":
        names, tensors, params = single.module_gradients(walked.names, walked_params)
    else:
        names, params = walked.names, walked_params
        tensors = [p.detach() for p in params]
    # A DDP model, or the module inside one (the module the frameworks' callbacks hold): attached, or
    # one this process made (ddp.wrapper_of).
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        ddp_model: torch.nn.parallel.DistributedDataParallel | None = model
        live.note(model)  # one made without its constructor (copied) is known from here on
    else:
        ddp_model = ddp.wrapper_of(model)
    if ddp_model is not None:
        what = "this DDP model is" if ddp_model is model else "the DDP model around this module is"
        _refuse_ddp_gradients_that_are_not_the_models(ddp_model, process_group, source, what)
    replica_group = None if ddp_model is None else ddp_model.process_group
    scanner = ddp.scanner_of(ddp_model) if source == "grad" else None
    if scanner is not None:
        return _plain(names, tensors, replica_group=replica_group, scanner=scanner, parameters=params)
    return _routed(names, tensors, process_group, compared, replica_group=replica_group)


def _refuse_ddp_gradients_that_are_not_the_models(
    model: torch.nn.Module, process_group: Any, source: str, what: str = "this DDP model is"
) -> None:
    """A DDP model's gradients are the model's once DDP has all-reduced them. Refused: inside
    ``no_sync()`` (gradient accumulation: each rank's gradients are its own until the backward that
    synchronises them), and with a ``process_group`` that shares ranks with DDP's own group (their
    copies would be counted once per rank). ``what`` names the model in the refusal."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return
    why = ddp.unsynced(model) if source == "grad" else None
    if why is not None:
        raise ddp.no_sync_error(what, why)
    if process_group is not None and not torch.compiler.is_compiling():
        shared = set(dist.get_process_group_ranks(process_group)) & set(
            dist.get_process_group_ranks(model.process_group)
        )
        if len(shared) > 1:
            raise ValueError(
                f"nanscan: process_group= shares ranks {sorted(shared)} with this DDP model's own group: DDP "
                "leaves each of them the same gradients, which the group would count once per rank. Leave "
                "process_group out for a DDP model (or pass only the ranks that hold other pipeline stages)"
            )


def _refuse_unsynced_ddp(items: Sequence[Any], what: str) -> None:
    """Refuses the gradients of a DDP model inside ``no_sync()`` reached through its parameters or its
    gradients rather than the model: they carry no mark of it, so the model is found among those the
    process made (nanscan.layouts.ddp.unsynced_model_of). ``what`` names the model in the refusal.
    Not inside torch.compile, whose trace reads no Python-side registry of models."""
    if torch.compiler.is_compiling():
        return
    if items and not dtensor.is_dtensor(items[0]):
        found = ddp.unsynced_model_of(items)
        if found is not None:
            raise ddp.no_sync_error(what, found[1])


def fsdp2_sharded(params: list[Any], names: Sequence[str] | None = None, unreduced_refused: bool = True) -> list[Any]:
    """``params`` with each parameter FSDP2 holds unsharded read as its sharded one (nanscan.layouts.fsdp2;
    the same list where none is); where ``unreduced_refused``, a parameter whose gradients FSDP2 is
    accumulating unreduced is refused. Not inside torch.compile, as ``_refuse_unsynced_ddp``."""
    if not params or not fsdp2.possible():
        return params
    sharded = fsdp2.sharded(params, names, unreduced_refused)
    return params if sharded is None else sharded


def _fsdp2_sharded_items(items: Sequence[Any]) -> Sequence[Any]:
    """``fsdp2_sharded`` of a list of parameters or of ``(name, parameter)`` pairs, names kept. The
    usual list costs C-level maps only: the names are formed for a refusal alone."""
    if not items or not fsdp2.possible():
        return items
    if type(items[0]) is not tuple:
        sharded = fsdp2.sharded(items)
        return items if sharded is None else sharded
    if set(map(type, items)) != {tuple}:  # pairs beside bare parameters: each entry looked at
        params = [item[1] if type(item) is tuple else item for item in items]
    else:
        params = list(map(_SECOND, items))
    sharded = fsdp2.sharded(params, PairNames(items))
    if sharded is None:
        return items
    return [(item[0], p) if type(item) is tuple else p for item, p in zip(items, sharded, strict=True)]


def _see_fsdp1_models() -> None:
    """Makes the layout of every FSDP1 model the process made and nanscan has not seen (a root FSDP
    has run a forward of: nanscan.layouts.live), so that their parameters and gradients, passed
    without the model, are reduced as the model's: a gradient carries no mark of its model, and one
    rank's shard checked as it is would be presented as the model's. Not inside torch.compile, as
    ``_refuse_unsynced_ddp``."""
    if fsdp1.possible() and not torch.compiler.is_compiling():
        for root in live.unseen_fsdp1_roots():
            fsdp1.of_model(root)  # a refusal here comes again at the next call: the root stays unseen
            live.seen(root)


def _fsdp1_of_parameters(params: Sequence[Any]) -> tuple[fsdp1.ModelLayout, list[int]]:
    """``fsdp1.of_parameters``, the process's FSDP1 models seen first."""
    _see_fsdp1_models()
    return fsdp1.of_parameters(params)


def _fsdp1_of_gradients(tensors: Sequence[Any]) -> tuple[fsdp1.ModelLayout, list[int]] | None:
    """``fsdp1.of_gradients``, the process's FSDP1 models seen first (not for DTensors: FSDP1 makes none)."""
    if tensors and not dtensor.is_dtensor(tensors[0]):
        _see_fsdp1_models()
    return fsdp1.of_gradients(tensors)


def fsdp1_parameters(
    model_or_params: torch.nn.Module | Iterable[Any], walked: walk.Walk | None = None
) -> tuple[fsdp1.ModelLayout, Any] | None:
    """Where a model (or a list of parameters, or of ``(name, parameter)`` pairs) is FSDP1's: its
    layout and the entries meant (None: all), as ``check_state`` reads their values and optimizer
    state; None for any other. Refused engines are refused, and flattened parameters of a model
    nanscan cannot know too. ``walked``: the model's walk where the caller has made it this call."""
    if isinstance(model_or_params, torch.nn.Module):
        refused.check_module(model_or_params)
        cached = fsdp1.kept(model_or_params)
        if cached is not None:
            return cached, None
        walked = walked if walked is not None else walk.walk(model_or_params)
        if fsdp1.holds_fsdp1(walked.module_types):
            return fsdp1.of_model(model_or_params), None
        if fsdp1.FLATTENED not in walked.parameter_attributes:
            return None
        params: list[Any] = list(walked.parameters)
    else:
        items = [model_or_params] if isinstance(model_or_params, torch.Tensor) else list(model_or_params)
        params = [item[1] if type(item) is tuple else item for item in items]
        if not (params and _marks_possible() and fsdp1.flattened(params)):
            return None
    return _fsdp1_of_parameters(params)


def of_fsdp1_state(found: tuple[fsdp1.ModelLayout, Any], optimizer_state: Any, keys: Sequence[str]) -> Layout:
    """The layout of an FSDP1 model's values and optimizer state (``fsdp1_parameters``' answer, the
    optimizer's ``state`` and the state keys every rank reads): nanscan.layouts.fsdp1.state_parts."""
    model_layout, positions = found
    parts = fsdp1.state_parts(model_layout, optimizer_state, keys, positions)
    return Layout(parts.names, parts.parts, parts.parts, [], parts.plan, cut=True, numels=parts.numels)


def local_parts(layout: Layout) -> list[torch.Tensor]:
    """What a scan of the layout reads on this rank: its parts, a Partial DTensor's once reduced (one
    collective each: every rank of its mesh must call this)."""
    plan = layout.plan
    return dtensor.without_partial(layout.tensors, layout.parts, plan) if plan is not None else layout.parts


def scan(
    layout: Layout,
    names: Sequence[str] | None = None,
    fp16_range: bool = False,
    checksum: bool = False,
    sparse: bool = False,
) -> ScanResult:
    """The statistics of the layout's tensors: one fused pass per device over this rank's parts, then
    the layout's reduction (none in a single process). ``names`` name entries in error messages
    (default: the layout's). ``sparse``: sparse COO tensors scanned exactly (fused.scan_sparse), not
    refused (the drop-ins leave them to torch's own code)."""
    names = layout.names if names is None else names
    if not layout.distributed:
        try:
            local = scan_local(layout.parts, names, fp16_range, checksum, sparse)
        except (RuntimeError, TypeError):
            # A DTensor has no kernel of its own (its dispatch refuses the op): a list that holds one
            # past its first entry is scanned by its shards.
            if dtensor.has_dtensor(layout.tensors):
                return scan(_dtensors(names, layout.tensors, None), names, fp16_range, checksum)
            raise
        if layout.scanner is not None:  # DDP with nanscan's hook: which ranks' own gradients held a NaN/Inf
            assert layout.parameters is not None
            local = ddp.with_attribution(local, layout.scanner, layout.parameters)
        return local
    require_initialized()
    parts = local_parts(layout)
    # A rank with nothing to scan still takes part in the group's collectives, on the group's device.
    local = (
        scan_local(parts, names, fp16_range, checksum)
        if parts
        else empty_result(fp16_range, group_device(layout.process_group), checksum=checksum)
    )
    return reduce_local(layout, local, names)


def reduce_local(layout: Layout, local: ScanResult, names: Sequence[str] | None = None) -> ScanResult:
    """The global statistics of a distributed layout from this rank's scan of its parts (``local``):
    the layout's reduction. Every rank of every group must call it."""
    result = reduce_scan(local, layout.plan, layout.process_group, layout.names if names is None else names)
    if layout.cut and result.names is None:  # it describes the parameters, not the caller's list
        result = dataclasses.replace(result, names=tuple(layout.names or ()))
    return result


def numels(layout: Layout) -> list[int]:
    """The number of elements of each of the layout's tensors, whole (not this rank's part)."""
    return list(layout.numels) if layout.numels is not None else [t.numel() for t in layout.tensors]


def learn(model: torch.nn.Module) -> None:
    """Makes nanscan know a model's layout before its first check: refused wrappers are refused now,
    and FSDP1's flattened parameters become known (lists of them are then reduced: fsdp1.py)."""
    refused.check_module(model)
    if fsdp1.holds_fsdp1(walk.walk(model).module_types):
        fsdp1.of_model(model)


def total_norm(layout: Layout, norm_type: float) -> torch.Tensor:
    """The total norm of a distributed layout's tensors (float64 [], the same on every rank): what
    ``clip_grad_norm_`` and ``get_total_norm`` need, and nothing more. No per-tensor statistic leaves
    the rank: each rank combines the terms of its counted parts into one partial per group, so a
    group costs one collective of one number (L2: a SUM of squares), or two (inf: a MAX of a NaN
    flag and a magnitude), and ``process_group`` one more. The L2 and infinity norms come from the
    fused scan; other orders from torch's norm of each part (the parts' p-th powers add up)."""
    require_initialized()
    plan = layout.plan
    parts = local_parts(layout)
    if norm_type in (2.0, math.inf):
        local = scan_local(parts, None, False) if parts else empty_result(False, group_device(layout.process_group))
        terms = scan_norm_terms(local, norm_type)
        return scan_norm_total(reduce_norm_terms(terms, norm_type, plan, layout.process_group), norm_type)
    device = parts[0].device if parts else group_device(layout.process_group)
    norms = torch.full((len(parts),), _identity(norm_type), dtype=torch.float64, device=device)
    # torch's norm of each non-empty part (its inf norms refuse an empty one, which adds nothing).
    filled = [i for i, t in enumerate(parts) if t.numel() > 0]
    if filled:
        values = [torch.linalg.vector_norm(parts[i], norm_type, dtype=torch.float64) for i in filled]
        norms[upload(filled, torch.int64, device)] = torch.stack(values).to(device)
    terms = torch_norm_terms(norms, norm_type)
    return torch_norm_total(reduce_norm_terms(terms, norm_type, plan, layout.process_group), norm_type)


def _identity(norm_type: float) -> float:
    """The norm of a part with no element, as far as the total goes: one that adds nothing (0 to a
    sum of p-th powers or a maximum; +inf for a negative order, whose p-th power is 0, and for the
    minimum of the -inf norm)."""
    return math.inf if norm_type < 0 else 0.0


def global_norm(total: torch.Tensor, norm_type: float, process_group: Any = None) -> torch.Tensor:
    """A norm torch computed on this rank's tensors, made global and plain: a DTensor's full value;
    with ``process_group``, combined over the group's ranks (one collective): the p-norms by their
    p-th powers, the infinity norms by max/min, the 0-"norm" (a count) by a sum."""
    if dtensor.is_dtensor(total):
        total = total.full_tensor()  # type: ignore[attr-defined]
    if process_group is None:
        return total
    value = total.double().to(group_device(process_group))
    combined = torch_norm_total(
        reduce_norm_terms(torch_norm_terms(value.reshape(1), norm_type), norm_type, None, process_group), norm_type
    )
    return combined.to(total.dtype)
