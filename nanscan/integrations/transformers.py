"""Hugging Face transformers: ``NanscanTrainerCallback`` checks, clips and guards every optimizer step
of a ``Trainer`` in one pass.

Where the hook runs (transformers/trainer.py, the training loop's sync step): the Trainer clips
(``args.max_grad_norm > 0``), computes its own gradient norm for its logs (unscaling a GradScaler's
gradients on the way, in ``accelerator.clip_grad_norm_``), then calls ``on_pre_optimizer_step``,
then ``self.optimizer.step()``. In that hook the callback calls ``nanscan.check`` on the model, which
clips like ``torch.nn.utils.clip_grad_norm_`` and, with ``on_nonfinite="skip"``, skips the step whose
gradients hold a NaN or an Inf (with no host sync for fused optimizers such as
``optim="adamw_torch_fused"``).

Turn the Trainer's clipping off, ``TrainingArguments(max_grad_norm=0)`` (0 disables it; None is not
accepted by this Trainer): with ``max_norm`` set, a Trainer that clips too is refused at
``on_train_begin``, since the gradients would be clipped twice. The Trainer still computes its own
gradient norm for its ``grad_norm`` log (``clip_grad_norm_`` with an infinite threshold: one more
pass over the gradients, which a callback cannot turn off).

The optimizer the Trainer steps is accelerate's ``AcceleratedOptimizer``, which calls the torch
optimizer's ``step``; nanscan guards that inner optimizer, so fused optimizers keep the device-side
skip. Under fp16 mixed precision accelerate swaps the inner ``step`` for its own wrapper around the
step it saw at ``prepare``; the callback points that wrapper at the guarded step, so a step the
GradScaler lets through is still decided by the check. The Trainer steps its LR scheduler unless
accelerate's ``optimizer_step_was_skipped`` says the step was skipped, which only knows the
GradScaler's skips: after a step the guard held back on the host, the callback sets the flag it reads
(``AcceleratedOptimizer._is_overflow``), so the schedule holds still as on a GradScaler's skip. A
fused optimizer's skip happens on the device, unknown to the host without a sync: there the schedule
advances, as it does on a GradScaler's device-side skip of a fused optimizer.

Which rank made a NaN, under DDP (the Trainer under torchrun): DDP's all-reduce spreads a NaN from
one rank to every rank before the check, so each rank names itself. With ``attach_ddp=True`` the
callback attaches nanscan's DDP comm hook (``nanscan.ddp.attach``) at ``on_train_begin``, before the
first backward, to the DDP model around the module the Trainer hands it (found among the process's
DDP models, nanscan.layouts.ddp), and the records name the rank whose own gradients held the NaN. It
costs one more read of the gradients per step and one small all-reduce per check. DDP takes one comm
hook: one set through accelerate is refused. Elsewhere (one process, DeepSpeed) it does nothing.

With a ``nanscan.Recorder``, the records that have reached the host (once per
``Recorder(every=...)`` steps, and at the last step, so that the last records reach the last logs)
are merged into the Trainer's next log: ``nanscan/total_norm``,
``nanscan/clip_coef`` and ``nanscan/loss_scale`` of the latest record (with ``nanscan/step``, its
record index), ``nanscan/skipped`` (steps skipped among those records) and
``nanscan/nonfinite_params`` (the most parameters with a NaN/Inf gradient in one of them), and in a
distributed run whose checks name ranks (DTensors: FSDP2, tensor parallel; DDP with
``nanscan.ddp.attach``) ``nanscan/nonfinite_rank/<rank>`` for each rank whose local data held a NaN/Inf
in one of them (the most parameters, in one). They go
into ``state.log_history`` and to the callbacks after this one; reporting integrations
(``report_to``) come before user callbacks, so they see them only if the callback is moved first
(``trainer.callback_handler.callbacks.insert(0, trainer.pop_callback(NanscanTrainerCallback))``).
Without a recorder the callback logs nothing.

Under DeepSpeed ZeRO stages 1, 2 and 3 (``TrainingArguments(deepspeed=...)``) accelerate runs
``engine.step()`` inside ``accelerator.backward()``, and the averaged gradients exist only inside
that step (nanscan.layouts.zero): no callback hook sees them. So the callback runs its check first
in the ZeRO optimizer's step (its ``step`` wrapped at ``on_train_begin``, put back at
``on_train_end``), where it clips the pieces DeepSpeed is about to apply, and ``"skip"`` holds back
the torch optimizer DeepSpeed steps on its fp32 partition: a skipped step changes no weight (the
LR scheduler still advances), on every rank alike. fp16, offload and the rest DeepSpeed keeps
otherwise are refused at the first check; ``check_state_every`` is refused under ZeRO.

The training state: with ``check_state_every=N``, after every N-th step of the optimizer (a step the
callback skipped on the host is not one; a fused optimizer's, skipped on the device, is), ``nanscan.check_state`` of the model and the optimizer's state
(nanscan.integrations._logging). With a ``state_recorder`` (a recorder of its own) the latest state
record read is merged into the next log as ``nanscan/state/total_norm``,
``nanscan/state/nonfinite_tensors`` (the most in one record since the log before) and
``nanscan/state/step`` (the Trainer's step the check followed, from 0), with no sync;
without one, each state check reads its finite flag (one sync per N steps) and warns with the names
of the tensors that went bad.
"""

from __future__ import annotations

import importlib
import importlib.util
import warnings
from typing import TYPE_CHECKING, Any

import torch

from ..guard import SkipGuard
from ._logging import CheckingCallback, attach_ddp_hook, check_attach_ddp, record_metrics, worth_logging

if TYPE_CHECKING:
    from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

    from ..recorder import Recorder
    from ..records import StepRecord

if importlib.util.find_spec("transformers") is None:
    raise ImportError(
        "nanscan.integrations.transformers needs Hugging Face transformers: pip install transformers "
        "(or pip install nanscan[transformers])"
    )
if not TYPE_CHECKING:
    TrainerCallback = importlib.import_module("transformers").TrainerCallback


class NanscanTrainerCallback(TrainerCallback, CheckingCallback):
    """Runs ``nanscan.check`` before every optimizer step of a ``transformers.Trainer``.

    Args:
        max_norm: clip the gradients to this total norm (as ``torch.nn.utils.clip_grad_norm_``); set
            ``TrainingArguments(max_grad_norm=0)``. None: no clipping (the check still scans).
        norm_type: the order of the norm (as ``clip_grad_norm_``).
        on_nonfinite: ``"skip"`` (default): skip the optimizer step whose gradients hold a NaN/Inf;
            or ``"raise"``, ``"warn"``, ``"ignore"``, as ``nanscan.check``.
        max_consecutive_skips: raise NonFiniteGradientError after more consecutive skipped steps.
        recorder: a ``nanscan.Recorder`` that records every check; its records are merged into the
            Trainer's logs (module notes).
        log_every_n_steps: merge only records whose step is a multiple of this (and every skipped or
            non-finite one) into the logs; None: all of them.
        check_state_every: check the weights and the optimizer state after every this many optimizer
            steps (module notes); None: never.
        state_recorder: a ``nanscan.Recorder`` (not ``recorder``) for the state checks' reports;
            without one a state check warns on a NaN/Inf (one sync).
        attach_ddp: under DDP (the Trainer under torchrun), attach nanscan's DDP comm hook, so that
            the checks name the rank that made a NaN (module notes); elsewhere nothing.

    Example:
        >>> args = TrainingArguments(..., max_grad_norm=0)  # nanscan clips instead
        >>> trainer = Trainer(model, args, callbacks=[NanscanTrainerCallback(max_norm=1.0)])
    """

    def __init__(
        self,
        max_norm: float | None = None,
        norm_type: float = 2.0,
        on_nonfinite: str = "skip",
        max_consecutive_skips: int | None = None,
        recorder: Recorder | None = None,
        log_every_n_steps: int | None = None,
        check_state_every: int | None = None,
        state_recorder: Recorder | None = None,
        attach_ddp: bool = False,
    ) -> None:
        check_attach_ddp("NanscanTrainerCallback", attach_ddp)
        self.attach_ddp = attach_ddp
        self._set_check(
            "NanscanTrainerCallback",
            max_norm,
            norm_type,
            on_nonfinite,
            max_consecutive_skips,
            recorder,
            log_every_n_steps,
        )
        self._set_state_check("NanscanTrainerCallback", check_state_every, state_recorder)
        if state_recorder is not None and state_recorder is recorder:
            raise ValueError(
                "nanscan.NanscanTrainerCallback: give the state checks a recorder of their own (state_recorder "
                "is recorder): one recorder keeps one list of names"
            )
        self._pending: list[StepRecord] = []  # records read from the recorder, not yet logged
        self._pending_state: list[StepRecord] = []  # and from the state recorder
        self._trainer_state: TrainerState | None = None  # the Trainer's, while training
        # DeepSpeed's ZeRO optimizer whose step is wrapped, and the step set on it before (None: its class's).
        self._zero_step: tuple[Any, Any] | None = None
        if recorder is not None:
            recorder.add_sink(self._receive)
        if state_recorder is not None:
            state_recorder.add_sink(self._pending_state.append)

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Refuses a Trainer that clips too; wraps the optimizer's step before the first one; with
        ``attach_ddp``, attaches the DDP hook before the first backward."""
        if self.max_norm is not None and args.max_grad_norm is not None and args.max_grad_norm > 0:
            raise ValueError(
                f"nanscan.NanscanTrainerCallback(max_norm={self.max_norm}) clips the gradients, and so does the "
                f"Trainer (TrainingArguments(max_grad_norm={args.max_grad_norm})): clipping twice. Set "
                "TrainingArguments(max_grad_norm=0)"
            )
        optimizer = kwargs.get("optimizer")
        model = kwargs.get("model")
        self._trainer_state = state
        zero = _zero_optimizer(optimizer)
        if zero is not None and model is not None:
            self._check_inside_zero_step(zero, model)
            return
        if self.attach_ddp and model is not None:
            # The Trainer hands its callbacks the module inside DDP, which nanscan finds the model of.
            attach_ddp_hook(
                "NanscanTrainerCallback", model, "accelerate's DistributedDataParallelKwargs(comm_hook=...)"
            )
        if self.on_nonfinite == "skip" and optimizer is not None:
            _guard(optimizer, self.max_consecutive_skips)
        if optimizer is not None and model is not None:
            self._watch_steps(_inner(optimizer), lambda: model, self._global_step)

    def on_pre_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Checks (and clips) the gradients and arms the skip of the step that follows."""
        model, optimizer = kwargs["model"], kwargs["optimizer"]
        zero = _zero_optimizer(optimizer)
        if zero is not None:  # checked inside DeepSpeed's step, which accelerate ran in the backward
            self._trainer_state = state
            if self._zero_step is None:  # on_train_begin had no optimizer: from the next step on
                self._check_inside_zero_step(zero, model)
                warnings.warn(
                    "nanscan.NanscanTrainerCallback: DeepSpeed's optimizer was not known before this step, whose "
                    "gradients went unchecked; the steps after it are checked",
                    stacklevel=2,
                )
            return
        inner = _guard(optimizer, self.max_consecutive_skips) if self.on_nonfinite == "skip" else None
        self._trainer_state = state
        self._watch_steps(_inner(optimizer), lambda: model, self._global_step)  # on_train_begin had none
        self._run_check(model, inner)

    def on_optimizer_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """After a step the guard held back on the host, tells accelerate that it was skipped, so that
        the Trainer leaves its LR scheduler where it is (module notes)."""
        optimizer = kwargs.get("optimizer")
        if optimizer is None or not hasattr(optimizer, "_is_overflow") or _zero_optimizer(optimizer) is not None:
            return  # not accelerate's AcceleratedOptimizer (DeepSpeed's wrapper answers from its engine)
        guard = getattr(_inner(optimizer), "_nanscan_guard", None)
        if guard is not None and guard.held_back:
            optimizer._is_overflow = True
        elif getattr(optimizer, "scaler", None) is None:
            optimizer._is_overflow = False  # accelerate sets it at every step only with a GradScaler

    def on_log(
        self,
        args: TrainingArguments,
        state: TrainerState,
        control: TrainerControl,
        logs: dict[str, float] | None = None,
        **kwargs: Any,
    ) -> None:
        """Merges the records read since the last log into this one (module notes)."""
        records = [r for r in self._pending if worth_logging(r, self.log_every_n_steps)]
        states = self._pending_state[:]
        self._pending.clear()
        self._pending_state.clear()
        if logs is None or not (records or states):
            return
        metrics: dict[str, float] = {}
        if records:
            latest = records[-1]
            # The latest record's totals, with what the records since the last log add up to.
            metrics = record_metrics(latest) | {
                "nanscan/step": float(latest.step),
                "nanscan/skipped": float(sum(r.skipped for r in records)),
                "nanscan/nonfinite_params": float(max(len(r.nonfinite) for r in records)),
            }
            metrics.update(self._metrics(records))  # which ranks held a NaN/Inf, in a distributed run
        if states:
            metrics |= record_metrics(states[-1]) | {
                "nanscan/state/nonfinite_tensors": float(max(len(r.nonfinite) for r in states)),
                "nanscan/state/step": float(self._state_step(states[-1])),
            }
        logs.update(metrics)
        # The Trainer appended a copy of ``logs`` to the history before calling on_log.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        """At the last step, reads the recorders out (one sync, once), so that their last records
        reach the Trainer's last logs (this step's, and the summary the Trainer logs after the loop)
        rather than only the sinks at ``on_train_end``, after every log was written."""
        if control.should_training_stop:  # set by the Trainer's flow callback at max_steps, or an early stop
            self._flush_recorders()

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """Hands the recorder's last records to its sinks."""
        self._flush_recorders()
        self._unwatch_steps()
        if self._zero_step is not None:
            zero, original = self._zero_step
            if original is None:
                del zero.step  # the class's step again
            else:
                zero.step = original  # a step set on the optimizer itself, before ours
            self._zero_step = None

    def _check_inside_zero_step(self, zero: Any, model: Any) -> None:
        """Under DeepSpeed ZeRO (module notes): the check runs first in the ZeRO optimizer's step,
        the one moment its averaged gradients exist, and a skip holds back the torch optimizer that
        DeepSpeed steps on its fp32 partition, so that a skipped step changes no weight."""
        if self.check_state_every is not None:
            raise ValueError(
                "nanscan.NanscanTrainerCallback: check_state_every under DeepSpeed ZeRO: its optimizer state and "
                "master weights are partitioned over the ranks, which nanscan.check_state does not read"
            )
        inner = zero.optimizer
        guarded = None
        if self.on_nonfinite == "skip":
            if not isinstance(inner, torch.optim.Optimizer):
                raise TypeError(
                    f"nanscan.NanscanTrainerCallback: on_nonfinite='skip' under DeepSpeed ZeRO guards the torch optimizer "
                    f"it steps, and this one is a {type(inner).__name__}; use on_nonfinite='raise' or 'warn'"
                )
            SkipGuard.of(inner, self.max_consecutive_skips)
            guarded = inner
        original = zero.step

        def step(*args: Any, **kwargs: Any) -> Any:
            self._run_check(model, guarded)
            return original(*args, **kwargs)

        self._zero_step = (zero, vars(zero).get("step"))
        zero.step = step

    def _flush_recorders(self) -> None:
        for recorder in (self.recorder, self.state_recorder):
            if recorder is not None:
                recorder.flush()

    def _global_step(self) -> int:
        """The Trainer's step (0-based) during an optimizer step: ``global_step`` is advanced after it."""
        return 0 if self._trainer_state is None else self._trainer_state.global_step

    def _receive(self, record: StepRecord) -> None:
        """The recorder's sink: keeps a record for the next log."""
        self._pending.append(record)


def _zero_optimizer(optimizer: Any) -> Any:
    """DeepSpeed's ZeRO optimizer (any stage) under accelerate's ``DeepSpeedOptimizerWrapper``, or None."""
    zero = getattr(optimizer, "optimizer", None)
    if zero is not None and type(zero).__module__.startswith("deepspeed.") and hasattr(zero, "averaged_gradients"):
        return zero
    return None


def _inner(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under accelerate's wrapper: the one whose ``step`` does the update."""
    inner = optimizer
    # accelerate's AcceleratedOptimizer is itself a torch.optim.Optimizer, holding the real one.
    while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(f"nanscan.NanscanTrainerCallback: expected a torch optimizer, got {type(optimizer).__name__}")
    return inner


def _guard(optimizer: Any, max_consecutive_skips: int | None) -> torch.optim.Optimizer:
    """Guards the torch optimizer under accelerate's wrapper (the one whose ``step`` does the update,
    and whose flags a fused step reads), and returns it."""
    inner = _inner(optimizer)
    fresh = getattr(inner, "_nanscan_guard", None) is None
    SkipGuard.of(inner, max_consecutive_skips)
    if fresh and inner is not optimizer and hasattr(optimizer, "_optimizer_original_step_method"):
        # Under fp16 accelerate's step swaps in a wrapper of the inner step it saved at prepare, and
        # then puts that saved step back: both must be the guarded step, or the guard is bypassed.
        patch_optimizer_step = importlib.import_module("accelerate.optimizer").patch_optimizer_step
        optimizer._optimizer_original_step_method = inner.step
        optimizer._optimizer_patched_step_method = patch_optimizer_step(optimizer, inner.step)
    return inner
