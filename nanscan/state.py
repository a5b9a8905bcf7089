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
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

from . import layouts
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
    found = layouts.fsdp1_parameters(model_or_params)
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
        names, params = named_parameters(model_or_params, "check_state")
        # As they are, not detached (a detach per tensor is most of the host work here): the op reads
        # values and is not differentiable (its outputs never require grad), like check's gradients.
        tensors: list[torch.Tensor] = list(params)
        if optimizer is not None:
            state_names, states = _optimizer_state(optimizer, {id(p): n for n, p in zip(names, params, strict=True)})
            names += state_names
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


def _optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[list[str], list[torch.Tensor]]:
    """Every floating tensor the optimizer keeps per parameter (not its scalar step counters), named
    after its parameter and key, in the optimizer's parameter order."""
    _require_state(optimizer)
    state_names: list[str] = []
    states: list[torch.Tensor] = []
    # Looked up by id: a tensor's own __hash__ is a Python function, most of this loop's time when
    # optimizer.state (keyed by the parameters) is asked once per parameter.
    by_id = {id(p): kept for p, kept in optimizer.state.items()}
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            kept = by_id.get(id(p))
            if not kept:
                continue
            owner = names.get(id(p), f"group{g}.param{j}")
            for key, value in kept.items():
                if not _is_scanned_state(key, value):
                    continue
                state_names.append(f"{owner}:{key}")
                states.append(value)
    return state_names, states
