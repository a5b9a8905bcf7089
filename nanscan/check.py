"""``check(model)``: scan every gradient of a model, optionally clip, and report by parameter name."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from . import layouts
from .clip import as_max_norm, as_norm_type, clip_grads_with_norm_, total_norm_of
from .guard import ON_NONFINITE, act_on_nonfinite, check_max_consecutive_skips, raise_on_nonfinite
from .recorder import Recorder
from .replicas import compare_layout
from .report import Report


def check(
    model_or_params: torch.nn.Module | Iterable[Any],
    *,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    on_nonfinite: str = "ignore",
    optimizer: torch.optim.Optimizer | None = None,
    max_consecutive_skips: int | None = None,
    process_group: Any = None,
    verify_replicas: bool = False,
    recorder: Recorder | None = None,
) -> Report:
    """Scans every gradient in one fused pass and returns a Report, without a host sync.

    Args:
        model_or_params: an ``nn.Module``, an iterable of parameters, or of ``(name, parameter)`` pairs.
        max_norm: when given, clips the gradients exactly like ``nanscan.clip_grad_norm_`` (and so
            ``torch.nn.utils.clip_grad_norm_``) with this threshold, reusing the scan's norm.
        norm_type: the order of ``Report.total_norm`` and of the clipping. 2 and inf come from the
            fused scan; other orders cost torch's own norm computation on top.
        on_nonfinite: what to do when a gradient has a NaN/Inf. ``"ignore"`` (default);
            ``"warn"`` or ``"raise"`` (NonFiniteGradientError naming the parameters), both of which
            read the finite flag (one sync); ``"skip"``: the next ``optimizer.step()`` does nothing
            (see SkipGuard: no sync with a fused optimizer, one otherwise).
        optimizer: the optimizer whose step ``"skip"`` guards.
        max_consecutive_skips: with ``"skip"``, raise NonFiniteGradientError after more consecutive
            skipped steps than this.
        process_group: ranks that each hold different parameters (pipeline stages): the report covers
            every rank's parameters (``names`` in rank order), and the clip uses the norm over all of
            them. DTensor gradients (FSDP2, tensor parallel) need no argument: their statistics are
            reduced over their meshes. Every rank of the group (or mesh) must call ``check``.
        verify_replicas: data parallelism (DDP, HSDP, replicas of a plain model, tensor-parallel
            Replicate gradients): also prove that every rank holds bit-identical copies of its
            gradients, from a checksum computed in the same scan and two small all-reduces per set of
            replicas (plain tensors: a DDP model's group, else the default group; DTensors: each mesh
            dim along which they are replicated); see ``Report.replicas_consistent`` and
            ``Report.divergent``, and nanscan.replicas.
        recorder: a ``nanscan.Recorder`` that keeps this step's statistics (appended on the device, no
            sync), with whether ``"skip"`` skipped the step; appended before ``"raise"`` raises.

    Example:
        >>> report = nanscan.check(model, max_norm=1.0)
        >>> if not report.finite:
        ...     print(report.nonfinite)
    """
    if on_nonfinite not in ON_NONFINITE:
        raise ValueError(
            f"nanscan.check: on_nonfinite must be one of {', '.join(map(repr, ON_NONFINITE))}, got {on_nonfinite!r}"
        )
    # Every argument is checked before any gradient is read or written.
    if on_nonfinite == "skip":
        if optimizer is None:
            raise ValueError("nanscan.check: on_nonfinite='skip' needs optimizer=<the optimizer whose step to skip>")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"nanscan.check: optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    check_max_consecutive_skips(max_consecutive_skips)
    norm_type = as_norm_type(norm_type)
    if max_norm is not None:
        max_norm = as_max_norm(max_norm)
    if verify_replicas and process_group is not None:
        raise ValueError(
            "nanscan.check: verify_replicas compares replicas of the same parameters; process_group is for ranks "
            "that hold different ones (pipeline stages). Use nanscan.replicas.verify_replicas(..., process_group=...) "
            "for the replicas' own group"
        )
    layout = (
        layouts.of_module(model_or_params, process_group)
        if isinstance(model_or_params, torch.nn.Module)
        else layouts.of_parameters(model_or_params, process_group)
    )
    names = layout.names
    assert names is not None
    grads = layout.tensors
    with torch.no_grad():
        stats = layouts.scan(layout, checksum=verify_replicas, sparse=True)
        replicas = None
        if verify_replicas:
            assert stats.checksum is not None
            # The gradients themselves, not only their checksums: the layout says which ranks hold
            # copies of each local part (a DDP model's group, HSDP's replicate dim, FSDP1's replicas).
            replicas = compare_layout(layout, stats.checksum)
        total = total_norm_of(layout, stats, norm_type)
        # (Across processes the flag and the total are global, so every rank takes the same branch.)
        clips = max_norm is not None and (len(grads) > 0 or layout.distributed)
        if on_nonfinite == "raise" and clips and not bool(stats.finite):
            # Before the clip, as torch's error_if_nonfinite: a NaN coefficient would rewrite every
            # gradient, and the error is there to stop the step with the gradients as they came.
            early = Report(names, stats, total, norm_type)
            if recorder is not None:
                recorder.append(early)
            raise_on_nonfinite(early)
        coef = clip_grads_with_norm_(layout.scaled, max_norm, total) if clips and max_norm is not None else None
    report = Report(names, stats, total, norm_type, max_norm, coef, replicas)
    if recorder is None:
        act_on_nonfinite(report, on_nonfinite, optimizer, max_consecutive_skips)
    elif on_nonfinite == "skip":
        # The skip is armed before the append, which may read the records out (a NaN step on the CPU)
        # and so raise (a warning turned into an error): a step that raises is still never applied. The
        # record is appended even when too many consecutive skips raise.
        try:
            act_on_nonfinite(report, on_nonfinite, optimizer, max_consecutive_skips)
        finally:
            recorder.append(report, skipped=~stats.finite)
    else:
        recorder.append(report)  # before "raise" raises and "warn" warns
        act_on_nonfinite(report, on_nonfinite, optimizer, max_consecutive_skips)
    return report
