"""``check_state(model, optimizer)``: the health of the weights and the optimizer's state in one pass.

    report = nanscan.check_state(model, optimizer)   # one fused scan per device, no host sync
    if not report.finite:
        print(report.nonfinite)                      # ["fc.weight:exp_avg_sq"]

Gradients are not the only place a run goes bad: a single bf16 Inf can corrupt Adam's second moment
for good while the gradients are finite again the step after, and weights go NaN after a step whose
gradients were finite (a learning rate too high, fp16 epsilon in Adam). ``check_state`` scans every
parameter's values and, with an optimizer, every floating tensor it keeps per parameter
(``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq``, ``momentum_buffer``, whatever the optimizer
keeps; its scalar ``step`` counters excluded) in the fused scan ``check`` uses, and returns the same
``Report``, named ``fc.weight`` and ``fc.weight:exp_avg_sq``.

Where the tensors live follows the gradients' rules (nanscan.layouts): DTensors (FSDP2, tensor
parallel; their optimizer states are DTensors too) are reduced over their meshes, so every rank gets
the whole model's statistics; plain tensors are one process's (a single process, or DDP's replicas,
which hold the same values). FSDP1 flattens parameters and keeps its optimizer states as flat
shards (``use_orig_params=False``) or as the original parameters' local parts (``True``): both are
cut back into parameters as FSDP1's gradients are, and reduced over FSDP's groups
(nanscan.layouts.fsdp1.state_parts), so every rank gets the whole model's figures under the names
the user wrote. So that every rank reduces the same list, the ranks agree on the optimizer's state
keys once, at an optimizer's first check_state (one host collective: a rank that holds no element
of a parameter may keep no state for it). Record states in a recorder of their own (``recorder=``): one recorder keeps
one list of names, and alternating with ``check``'s gradients would start a new buffer each time.

The list of states to scan is built once per optimizer, tensor by tensor (the rule and the names:
~0.5 us a state on a 2-core VM, more than the scan's own host work), and kept as a plan. Each call
compares with C-level passes what the plan was built from (the optimizer's parameters, each one's
state keys, the parameters and names given, the scanned tensors themselves) and rebuilds it where
anything differs: a state replaced by a tensor is asked the rule again alone, and a state left out
for its value (a None momentum buffer) is looked at each call. The plan holds the states weakly,
so a state replaced (``load_state_dict``) is freed as it would be without nanscan.
"""

from __future__ import annotations

import itertools
import operator
import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from . import layouts, walk
from .layouts import refused
from .parameters import named_parameters
from .recorder import Recorder
from .report import Report
from .scan import scan


def check_state(
    model_or_params: torch.nn.Module | Iterable[Any],
    optimizer: torch.optim.Optimizer | None = None,
    *,
    recorder: Recorder | None = None,
) -> Report:
    """Scans every parameter's values and every floating tensor of ``optimizer.state`` in one fused
    pass per device; returns a ``Report`` without a host sync.

    Args:
        model_or_params: an ``nn.Module``, an iterable of parameters, or of ``(name, parameter)``
            pairs (as ``check`` takes them).
        optimizer: the optimizer whose state to scan with the parameters (any ``torch.optim``
            optimizer, plain, foreach or fused, or one that keeps its state the same way); its state
            of a parameter is named ``"<parameter name>:<key>"``, and a parameter it holds that is not
            among ``model_or_params`` ``"group<i>.param<j>"``. It must have stepped once (no state
            before that).
        recorder: a ``nanscan.Recorder`` that keeps this report (one kept for states alone).

    Returns:
        A ``Report`` over the parameters (their values, not their gradients) and then the states, in
        the optimizer's parameter order.
    """
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"nanscan.check_state: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if recorder is not None and not isinstance(recorder, Recorder):
        raise TypeError(f"nanscan.check_state: recorder must be a nanscan.Recorder, got {type(recorder).__name__}")
    walked = None
    if isinstance(model_or_params, torch.nn.Module):
        refused.check_module(model_or_params)  # before anything is read
        walked = walk.walk(model_or_params)  # once for the two looks below (~30 us for 150 parameters)
    found = layouts.fsdp1_parameters(model_or_params, walked)
    if found is not None:
        # The ranks agree on the keys first (a rank whose shard holds no element of the optimizer's
        # parameters may keep no state at all): whether there is any state is decided from that, alike
        # on every rank.
        keys = () if optimizer is None else _agreed_state_keys(optimizer)
        layout = layouts.of_fsdp1_state(found, {} if optimizer is None else optimizer.state, keys)
        with torch.no_grad():
            result = layouts.scan(layout)
        names = list(result.names or ())
    else:
        names, params = named_parameters(model_or_params, "check_state", walked)
        # As they are, not detached (a detach per tensor is most of the host work here): the op reads
        # values and is not differentiable (its outputs never require grad), like check's gradients.
        tensors: list[torch.Tensor] = list(params)
        if optimizer is not None:
            state_names, states = _optimizer_state(optimizer, names, params)
            names = names + state_names
            tensors += states
        with torch.no_grad():
            result = scan(tensors, names)
    report = Report(names, result, result.total_norm, 2.0, subject="state")
    if recorder is not None:
        recorder.append(report)
    return report


def _require_state(optimizer: torch.optim.Optimizer, has_state: bool | None = None) -> None:
    """Refuses an optimizer without state: this rank's, or ``has_state`` where the ranks have agreed
    on it (whether any rank keeps state: alike on every rank)."""
    if not (bool(optimizer.state) if has_state is None else has_state):
        where = "" if has_state is None else " on any rank"
        raise ValueError(
            f"nanscan.check_state: the optimizer has no state yet{where} (it is made at the first "
            "optimizer.step()); check the parameters alone before that: nanscan.check_state(model)"
        )


# Per optimizer of an FSDP1 model in a world of several ranks: the state keys every rank reads,
# agreed at its first check_state (module notes).
_agreed_keys: weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[str, ...]] = weakref.WeakKeyDictionary()


def _is_scanned_state(key: str, value: object) -> bool:
    """The one rule for which optimizer state is scanned: every floating tensor kept per parameter
    but the scalar step counter."""
    return key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point()


def _agreed_state_keys(optimizer: torch.optim.Optimizer) -> tuple[str, ...]:
    """The keys of the optimizer's per-parameter state tensors (not its scalars, such as ``step``)
    that every rank scans, so that every rank reduces the same list: this rank's own in a single
    process; in a world of several, the union of every rank's, gathered once per optimizer (a host
    collective, at the first check_state), since a rank that holds no element of some parameter may
    keep no state for it. A key that appears on a rank later is not scanned, and said so. Only
    states with elements are cut into FSDP1's parameter parts: a scalar (0-dim) one is not sharded."""
    local = tuple(
        sorted(
            {
                key
                for kept in optimizer.state.values()
                for key, value in kept.items()
                if _is_scanned_state(key, value) and value.dim() > 0
            }
        )
    )
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        _require_state(optimizer)
        return local
    agreed = _agreed_keys.get(optimizer)
    if agreed is None:
        # Each rank's keys and whether it keeps any state: an optimizer with no state on any rank is
        # refused on every rank, and not kept, so that the ranks agree again after its first step.
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, (local, bool(optimizer.state)))
        _require_state(optimizer, has_state=any(kept for _, kept in gathered))
        agreed = tuple(sorted(set().union(*(keys for keys, _ in gathered))))
        _agreed_keys[optimizer] = agreed
    late = sorted(set(local) - set(agreed))
    if late:
        warnings.warn(
            f"nanscan.check_state: the optimizer's state {', '.join(map(repr, late))} appeared after its first "
            "check_state, which agreed with the other ranks on the keys to scan: not scanned (check the state of "
            "a new optimizer to include it)",
            RuntimeWarning,
            stacklevel=3,
        )
    return agreed


class _StatePlan:
    """Which of an optimizer's state tensors ``check_state`` scans, in order, and their names: kept per
    optimizer between calls so that the list is not rebuilt tensor by tensor each time (module notes).

    It holds no tensor (the states weakly, so a replaced state is freed as it would be without
    nanscan), only what its list was built from: the optimizer's parameters and each one's state
    keys, the parameters and names ``check_state`` was given, and the scanned states themselves. A
    call compares those with C-level passes over its lists; any difference rebuilds it."""

    __slots__ = (
        "given_ids",
        "given_names",
        "keys",
        "names",
        "owners",
        "param_ids",
        "refs",
        "scanned_keys",
        "unscanned",
    )

    def __init__(
        self, param_ids: list[int], keys: list[tuple[Any, ...]], given_ids: list[int], given_names: list[str]
    ) -> None:
        self.param_ids = param_ids  # the optimizer's parameters, in param_groups order
        self.keys = keys  # each one's state keys, scanned or not (() where it keeps no state)
        self.given_ids = given_ids  # the parameters check_state was given, whose names name the states
        self.given_names = given_names
        self.owners: list[int] = []  # per scanned state: its parameter's position in param_ids
        self.scanned_keys: list[Any] = []  # per scanned state: its key
        self.refs: list[weakref.ReferenceType[torch.Tensor]] = []  # per scanned state: the tensor, weakly
        self.names: list[str] = []  # per scanned state: "<parameter name>:<key>"
        # The states the rule leaves out but for their value (not "step": a None momentum buffer, an
        # integer): looked at again each call, since a value can become a floating tensor.
        self.unscanned: list[tuple[int, Any]] = []


# Per optimizer: its last check_state's plan (module notes).
_plans: weakref.WeakKeyDictionary[torch.optim.Optimizer, _StatePlan] = weakref.WeakKeyDictionary()
_NO_STATE: dict[str, Any] = {}


def _optimizer_state(
    optimizer: torch.optim.Optimizer, names: list[str], params: list[torch.Tensor]
) -> tuple[list[str], list[torch.Tensor]]:
    """Every floating tensor the optimizer keeps per parameter (not its scalar step counters), named
    after its parameter (its name among ``names``, the names of ``params``) and key, in the
    optimizer's parameter order: the last call's plan where nothing it was built from has changed."""
    _require_state(optimizer)
    param_ids = list(map(id, itertools.chain.from_iterable(map(operator.itemgetter("params"), optimizer.param_groups))))
    # Looked up by id: a tensor's own __hash__ is a Python function, the most of a lookup by tensor.
    by_id = dict(zip(map(id, optimizer.state), optimizer.state.values(), strict=True))
    kept = list(map(by_id.get, param_ids, itertools.repeat(_NO_STATE)))
    keys = list(map(tuple, kept))
    given_ids = list(map(id, params))
    plan = _plans.get(optimizer)
    if (
        plan is not None
        and plan.param_ids == param_ids
        and plan.keys == keys
        and plan.given_ids == given_ids
        and plan.given_names == names
    ):
        states = _states_if_the_rule_holds(plan, kept)
        if states is not None:
            return plan.names, states
    plan = _build_plan(optimizer, kept, _StatePlan(param_ids, keys, given_ids, list(names)))
    _plans[optimizer] = plan
    return plan.names, [ref() for ref in plan.refs]  # type: ignore[misc]  # alive: kept holds them


def _states_if_the_rule_holds(plan: _StatePlan, kept: list[Any]) -> list[torch.Tensor] | None:
    """The plan's states as they are now (each parameter's state in ``kept``), or None where a value
    changed whether the rule scans it: the plan is to be built anew."""
    states: list[torch.Tensor] = list(map(operator.getitem, map(kept.__getitem__, plan.owners), plan.scanned_keys))
    # A dead reference reads None, as a state set to None does: the second pass tells them apart.
    if not all(map(operator.is_, states, map(weakref.ref.__call__, plan.refs))) or any(
        map(operator.is_, states, itertools.repeat(None))
    ):
        # A state replaced by a new value (transformers' Adafactor makes its RMS anew each step):
        # the rule is asked again of the new values alone.
        for i, (value, ref) in enumerate(zip(states, plan.refs, strict=True)):
            if value is None or value is not ref():
                if not _is_scanned_state(plan.scanned_keys[i], value):
                    return None
                plan.refs[i] = weakref.ref(value)
    if any(_is_scanned_state(key, kept[position][key]) for position, key in plan.unscanned):
        return None
    return states


def _build_plan(optimizer: torch.optim.Optimizer, kept: list[Any], plan: _StatePlan) -> _StatePlan:
    """Fills ``plan`` from each parameter's state (``kept``, in param_groups order), tensor by tensor."""
    name_of = {id_: name for name, id_ in zip(plan.given_names, plan.given_ids, strict=True)}
    position = 0
    for g, group in enumerate(optimizer.param_groups):
        for j in range(len(group["params"])):
            owner = name_of.get(plan.param_ids[position], f"group{g}.param{j}")
            for key, value in kept[position].items():
                if _is_scanned_state(key, value):
                    plan.owners.append(position)
                    plan.scanned_keys.append(key)
                    plan.refs.append(weakref.ref(value))
                    plan.names.append(f"{owner}:{key}")
                elif key != "step":
                    plan.unscanned.append((position, key))
            position += 1
    return plan
