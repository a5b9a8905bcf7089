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
shards that nanscan does not yet cut back into parameters: refused with a clear error rather than
answered for one rank. Record states in a recorder of their own (``recorder=``): one recorder keeps
one list of names, and alternating with ``check``'s gradients would start a new buffer each time.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .layouts import fsdp1
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
    names, params = _named_parameters(model_or_params)
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


def _named_parameters(model_or_params: torch.nn.Module | Iterable[Any]) -> tuple[list[str], list[torch.Tensor]]:
    """The parameters and their names as the user wrote them; FSDP1's flat parameters refused."""
    names, params = named_parameters(model_or_params, "check_state")
    if fsdp1.flattened(params):
        raise ValueError(
            "nanscan.check_state: FSDP1 keeps flattened parameters and flat optimizer-state shards, which "
            "check_state does not yet cut back into parameters; reading them on one rank would describe one "
            "shard, not the model. FSDP2 (fully_shard) states are DTensors and are read whole."
        )
    return names, params


def _optimizer_state(optimizer: torch.optim.Optimizer, names: dict[int, str]) -> tuple[list[str], list[torch.Tensor]]:
    """Every floating tensor the optimizer keeps per parameter (not its scalar step counters), named
    after its parameter and key, in the optimizer's parameter order."""
    if not optimizer.state:
        raise ValueError(
            "nanscan.check_state: the optimizer has no state yet (it is made at the first optimizer.step()); "
            "check the parameters alone before that: nanscan.check_state(model)"
        )
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
                if key == "step" or not isinstance(value, torch.Tensor) or not value.is_floating_point():
                    continue
                state_names.append(f"{owner}:{key}")
                states.append(value)
    return state_names, states
