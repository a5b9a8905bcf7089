"""What both framework callbacks share: the check they run before each optimizer step, the state
check they run after every N-th (``check_state_every``), and what they log of a recorder's records,
and which records they log.

The state check: after every ``check_state_every``-th step of an optimizer, ``nanscan.check_state``
of the parameters the optimizer holds and its state (Adam's moments, momentum buffers). With a
``state_recorder`` its reports are recorded there (no sync; the records reach the loggers as the
gradient records do, under ``nanscan/state/``); without one, the callback reads each report's
finite flag (one sync every ``check_state_every`` steps) and warns, naming the tensors that went
bad (``fc.weight:exp_avg_sq``): a single Inf can corrupt Adam's second moment for good while the
gradients are finite again the step after, which no gradient check sees.

Which ranks held a NaN/Inf is logged only when the checks' reports carry a rank attribution
(DTensors, DDP with ``nanscan.ddp.attach``): a record names rank 0 for a single process's NaN too
(``StepRecord.nonfinite_ranks``), which is no news, and a rank's own rank for a check that reduced
nothing across ranks (plain DDP, where the all-reduce has spread the NaN to every rank already),
which would blame the wrong rank. Whether a report carries one is a host attribute, read after each
check without a sync; the ranks themselves come with the records, which reach the host anyway."""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..check import check
from ..clip import as_max_norm, as_norm_type
from ..guard import ON_NONFINITE, check_max_consecutive_skips
from ..layouts import ddp
from ..recorder import Recorder
from ..records import StepRecord
from ..state import check_state


class CheckingCallback:
    """The settings of the check a framework callback runs, and the run itself (a mixin: the
    callbacks derive from their framework's own callback class too).

    The settings are validated when the callback is made, as ``check`` would validate them, so a
    typo fails at construction rather than at the first optimizer step of a long run."""

    max_norm: float | None
    norm_type: float
    on_nonfinite: str
    max_consecutive_skips: int | None
    recorder: Recorder | None
    log_every_n_steps: int | None
    attributed: bool
    """Whether a check's report has carried a rank attribution: the records' ranks are then worth
    logging (module notes)."""

    def _set_check(
        self,
        owner: str,
        max_norm: float | None,
        norm_type: float,
        on_nonfinite: str,
        max_consecutive_skips: int | None,
        recorder: Recorder | None,
        log_every_n_steps: int | None,
    ) -> None:
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(
                f"nanscan.{owner}: on_nonfinite must be one of {', '.join(map(repr, ON_NONFINITE))}, got "
                f"{on_nonfinite!r}"
            )
        check_max_consecutive_skips(max_consecutive_skips)
        check_log_every(owner, log_every_n_steps)
        check_recorder(owner, "recorder", recorder)
        self.max_norm = None if max_norm is None else as_max_norm(max_norm)
        self.norm_type = as_norm_type(norm_type)
        self.on_nonfinite = on_nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self.recorder = recorder
        self.log_every_n_steps = log_every_n_steps
        self.attributed = False

    def _run_check(self, target: Any, optimizer: torch.optim.Optimizer | None) -> None:
        """``check`` of ``target`` with these settings; ``optimizer`` is the one whose step a
        ``"skip"`` guards (None otherwise)."""
        report = check(
            target,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            on_nonfinite=self.on_nonfinite,
            optimizer=optimizer,
            max_consecutive_skips=self.max_consecutive_skips,
            recorder=self.recorder,
        )
        # One setup, one answer, for the whole run (the distribution of a model does not change between
        # steps): kept once seen, so that the records read later, once per N steps, are logged with it.
        self.attributed = self.attributed or report.stats.ranks is not None

    def _metrics(self, records: Sequence[StepRecord]) -> dict[str, float]:
        """``rank_metrics`` of ``records`` when the checks carry a rank attribution, else nothing."""
        return rank_metrics(records) if self.attributed else {}

    # ------------------------------------------------------------------------------ the state check

    check_state_every: int | None
    state_recorder: Recorder | None

    def _set_state_check(self, owner: str, every: int | None, recorder: Recorder | None) -> None:
        if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
            raise ValueError(f"nanscan.{owner}: check_state_every must be a positive int or None, got {every!r}")
        check_recorder(owner, "state_recorder", recorder)
        if recorder is not None and every is None:
            raise ValueError(f"nanscan.{owner}: a state_recorder records the state checks: set check_state_every too")
        self._owner = owner
        self.check_state_every = every
        self.state_recorder = recorder
        self._optimizer_steps: dict[int, int] = {}  # optimizer steps seen, by id(optimizer)
        # Per state check in order (the state recorder's record index), the framework's step it
        # followed (0-based): where its record is logged, beside that step's gradients.
        self._state_checked_after: list[int] = []
        self._step_hooks: dict[int, Any] = {}  # the post-step hook's handle, by id(optimizer)

    def _watch_steps(
        self, optimizer: torch.optim.Optimizer, target: Callable[[], Any], framework_step: Callable[[], int]
    ) -> None:
        """Hooks ``optimizer``'s step (once): after each call of it, ``_after_optimizer_step`` of
        ``target()``, what the gradient check scans, at the framework's step ``framework_step()``. A
        step the skip guard held back is not called (a fused optimizer's is, and skips on the device:
        it counts)."""
        if self.check_state_every is None or id(optimizer) in self._step_hooks:
            return
        self._step_hooks[id(optimizer)] = optimizer.register_step_post_hook(
            lambda stepped, args, kwargs: self._after_optimizer_step(target(), stepped, framework_step())
        )

    def _state_step(self, record: StepRecord) -> int:
        """The framework's step (0-based) a state record's check followed."""
        after = self._state_checked_after
        return after[record.step] if 0 <= record.step < len(after) else record.step

    def _unwatch_steps(self) -> None:
        for handle in self._step_hooks.values():
            handle.remove()
        self._step_hooks.clear()

    def _after_optimizer_step(self, target: Any, optimizer: torch.optim.Optimizer, framework_step: int) -> None:
        """Counts ``optimizer``'s steps; after every ``check_state_every``-th, checks the state of
        ``target`` (what the gradient check scans) and of ``optimizer`` (module notes), and notes the
        framework's step it followed."""
        every = self.check_state_every
        if every is None:
            return
        steps = self._optimizer_steps.get(id(optimizer), 0) + 1
        self._optimizer_steps[id(optimizer)] = steps
        if steps % every:
            return
        # Before the check: its append may read the record out to the sinks at once.
        self._state_checked_after.append(framework_step)
        # An optimizer that keeps no state (SGD without momentum) has its weights checked alone.
        report = check_state(target, optimizer if optimizer.state else None, recorder=self.state_recorder)
        if self.state_recorder is None and not report.finite:  # one sync, every `every` steps
            bad = report.nonfinite
            shown = ", ".join(bad[:5]) + (f" (+{len(bad) - 5} more)" if len(bad) > 5 else "")
            warnings.warn(
                f"nanscan.{self._owner}: after optimizer step {steps}, NaN/Inf in the weights or the optimizer "
                f"state: {shown}",
                RuntimeWarning,
                stacklevel=2,
            )


def check_attach_ddp(owner: str, attach_ddp: object) -> None:
    if not isinstance(attach_ddp, bool):
        raise TypeError(f"nanscan.{owner}: attach_ddp must be True or False, got {attach_ddp!r}")


def attach_ddp_hook(owner: str, model: Any, how_hooks_are_set: str) -> None:
    """Attaches nanscan's DDP comm hook (``nanscan.ddp.attach``) to the framework's DDP model, given
    the DDP model or the module inside it (found among the process's DDP models), once: a second fit,
    or a ``ddp_spawn`` process, finds it attached. Anything not under DDP is left alone. DDP takes one
    comm hook: where the framework set one (``how_hooks_are_set`` says how), the error says so."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = ddp.wrapper_of(model) if isinstance(model, torch.nn.Module) else None
    if model is None or ddp.scanner_of(model) is not None:
        return
    try:
        ddp.attach(model)
    except RuntimeError as error:
        if "only be called once" not in str(error):
            raise
        raise ValueError(
            f"nanscan.{owner}(attach_ddp=True): the Trainer's DDP model has a comm hook already "
            f"({how_hooks_are_set}), and DDP takes one. Drop one of the two, or attach nanscan's in front of "
            "yours by hand: nanscan.ddp.attach(ddp_model, hook=your_hook)"
        ) from error


def check_log_every(owner: str, log_every_n_steps: int | None) -> None:
    if log_every_n_steps is None:
        return
    if isinstance(log_every_n_steps, bool) or not isinstance(log_every_n_steps, int) or log_every_n_steps < 1:
        raise ValueError(f"nanscan.{owner}: log_every_n_steps must be >= 1 (an int) or None, got {log_every_n_steps!r}")


def check_recorder(owner: str, argument: str, recorder: object) -> None:
    """A clear TypeError for anything but a ``nanscan.Recorder`` (or None) given as ``argument``."""
    if recorder is None or isinstance(recorder, Recorder):
        return
    hint = ""
    if callable(recorder) or isinstance(recorder, (str, os.PathLike)):
        hint = f" (a sink or a path is not a recorder: {argument}=nanscan.Recorder([nanscan.sinks.JSONLSink('run.jsonl')]))"
    raise TypeError(f"nanscan.{owner}: {argument} must be a nanscan.Recorder, got {type(recorder).__name__}{hint}")


def worth_logging(record: StepRecord, every: int | None) -> bool:
    """Every ``every``-th record (all of them for None), and every skipped or non-finite one."""
    return every is None or record.step % every == 0 or record.skipped or not record.finite


def record_metrics(record: StepRecord) -> dict[str, float]:
    """One record's totals under the ``nanscan/`` keys the callbacks' docs list; a state check's
    (``check_state``) under ``nanscan/state/``: its total norm and its non-finite tensors."""
    if record.subject == "state":
        return {
            "nanscan/state/total_norm": record.total_norm,
            "nanscan/state/nonfinite_tensors": float(len(record.nonfinite)),
        }
    metrics = {
        "nanscan/total_norm": record.total_norm,
        "nanscan/skipped": float(record.skipped),
        "nanscan/nonfinite_params": float(len(record.nonfinite)),
    }
    if record.clip_coef is not None:
        metrics["nanscan/clip_coef"] = record.clip_coef
    if record.loss_scale is not None:
        metrics["nanscan/loss_scale"] = record.loss_scale
    return metrics


def parameters_by_rank(nonfinite_ranks: dict[str, list[int]] | None) -> dict[int, int]:
    """For each rank named in a record's ``nonfinite_ranks``, how many parameters it is named for."""
    counts: dict[int, int] = {}
    for ranks in (nonfinite_ranks or {}).values():
        for rank in ranks:
            counts[rank] = counts.get(rank, 0) + 1
    return dict(sorted(counts.items()))


def rank_metrics(records: Sequence[StepRecord]) -> dict[str, float]:
    """``nanscan/nonfinite_rank/<rank>``: for each rank whose local data held a NaN/Inf in one of
    ``records``, the most parameters it held them in, in one record (as ``nanscan/nonfinite_params``
    counts them): a key per rank that went bad, at the steps it did, not one per rank of the world.
    Empty for finite records, without reading any per-parameter list."""
    metrics: dict[str, float] = {}
    for record in records:
        if record.finite:
            continue
        for rank, count in parameters_by_rank(record.nonfinite_ranks).items():
            key = f"nanscan/nonfinite_rank/{rank}"
            metrics[key] = max(metrics.get(key, 0.0), float(count))
    return metrics
