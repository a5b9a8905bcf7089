"""PyTorch Lightning: ``NanscanCallback`` checks, clips and guards every optimizer step in one pass.

The callback takes the place of Lightning's gradient clipping (``Trainer(gradient_clip_val=...)``):
in ``on_before_optimizer_step`` it calls ``nanscan.check`` on the parameters of the optimizer being
stepped, which clips them like ``torch.nn.utils.clip_grad_norm_`` and, with
``on_nonfinite="skip"``, skips that optimizer step when a gradient holds a NaN or an Inf (with no
host sync for fused optimizers).

Where the hook runs (lightning/pytorch/plugins/precision/precision.py, ``Precision._after_closure``
and ``_wrap_closure``): after the training closure (forward, backward) and, with ``16-mixed``, after
the GradScaler's ``unscale_`` (plugins/precision/amp.py ``MixedPrecision.optimizer_step``), before
Lightning's own clipping (``configure_gradient_clipping``) and before the step. In automatic
optimization the closure, and so this hook, runs inside ``optimizer.step(closure=...)``; nanscan's
SkipGuard runs such a closure first and decides the step after it (nanscan.guard). The callback
wraps every optimizer's step at ``on_train_start``, before the first step. Under the FSDP strategy
(FSDP1) the LightningModule lies inside FSDP's root, which holds some of its parameters: the callback
shows nanscan the root (``trainer.strategy.model``) and checks the optimizer's parameters, reduced
over the ranks that shard them (nanscan.layouts.fsdp1).

Which rank made a NaN, under Lightning's DDP (``strategy="ddp"``, ``"ddp_spawn"``): DDP's all-reduce
spreads a NaN from one rank to every rank before the check, so each rank names itself
(``nanscan.layouts.ddp``). With ``attach_ddp=True`` the callback attaches nanscan's DDP comm hook
(``nanscan.ddp.attach``) to the Trainer's DDP model at ``on_train_start``, before the first backward,
and the records name the rank whose own gradients held the NaN. It costs one more read of the
gradients per step (the hook's scan of each bucket) and one small all-reduce per check. DDP takes one
comm hook: with ``DDPStrategy(ddp_comm_hook=...)`` it is refused. Under other strategies it does
nothing. The rank is named where the optimizer holds every trainable parameter of the module (the
callback then checks the module; a check of some of its parameters names no rank).

Clipping twice is refused: a Trainer with ``gradient_clip_val`` and a callback with ``max_norm``
raise ValueError at setup. A LightningModule that clips in its own ``configure_gradient_clipping``
cannot be seen from here; it would clip after nanscan. With ``16-mixed`` and a fused optimizer,
Lightning does not unscale before the hook (the optimizer unscales inside its step), so the
gradients the hook sees are still scaled: ``max_norm`` is refused there, as Lightning refuses its
own clipping; skipping works.

Logging: nothing is logged per step through ``LightningModule.log`` (it would copy a device value to
the host every step). Give the callback a ``nanscan.Recorder``: the records reach the host once per
``Recorder(every=...)`` steps, and the callback forwards each one's totals to every logger of the
Trainer (``logger.log_metrics``, at ``step=record.step``) as ``nanscan/total_norm``,
``nanscan/skipped``, ``nanscan/nonfinite_params`` (how many parameters hold a NaN/Inf gradient),
``nanscan/clip_coef`` (when clipped) and ``nanscan/loss_scale`` (when a GradScaler recorded it),
and at a non-finite step of a distributed run whose checks name ranks (DTensors: FSDP2, tensor
parallel; FSDP1; DDP with ``nanscan.ddp.attach``) ``nanscan/nonfinite_rank/<rank>`` for each rank whose
local data held a NaN/Inf (how many parameters); ``log_every_n_steps`` thins them, never dropping a
skipped or non-finite step. Without a recorder the callback logs nothing. LR schedulers step on
skipped steps too, as they do on a step that Lightning's GradScaler skips.

The training state: with ``check_state_every=N``, after every N-th step of each optimizer (a step
the callback skipped on the host is not one; a fused optimizer's, skipped on the device, is),
``nanscan.check_state`` of the parameters it holds and its
state (nanscan.integrations._logging). Give it a ``state_recorder`` (a recorder of its own: one
recorder keeps one list of names) and the state records reach the loggers too, as
``nanscan/state/total_norm`` and ``nanscan/state/nonfinite_tensors`` at the step the check followed
(the state recorder's records are counted to find it: record nothing else there), with no sync; without one,
each state check reads its finite flag (one sync per N steps) and warns with the names of the
tensors that went bad. Under the FSDP strategy (FSDP1) the flat optimizer state is cut back into
the parameters and reduced, as the gradients are.

Works with either package: the callback derives from ``lightning.pytorch.Callback`` when
``lightning`` is installed, else from ``pytorch_lightning.Callback``; a ``pytorch_lightning.Trainer``
also takes the former (in a list: ``callbacks=[NanscanCallback(...)]``) when both are installed.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

import torch

from .. import layouts
from ..guard import SkipGuard
from ..layouts import fsdp1
from ._logging import CheckingCallback, attach_ddp_hook, check_attach_ddp, record_metrics, worth_logging

if TYPE_CHECKING:
    from lightning.pytorch import Callback, LightningModule, Trainer

    from ..recorder import Recorder
    from ..records import StepRecord


def _lightning() -> ModuleType:
    """``lightning.pytorch``, or ``pytorch_lightning`` where only the older package is installed."""
    if importlib.util.find_spec("lightning") is not None:
        return importlib.import_module("lightning.pytorch")
    if importlib.util.find_spec("pytorch_lightning") is not None:
        return importlib.import_module("pytorch_lightning")
    raise ImportError(
        "nanscan.integrations.lightning needs PyTorch Lightning: pip install lightning (or pip install nanscan[lightning])"
    )


if not TYPE_CHECKING:
    Callback = _lightning().Callback


class NanscanCallback(Callback, CheckingCallback):
    """Runs ``nanscan.check`` before every optimizer step, in place of Lightning's gradient clipping.

    Args:
        max_norm: clip the gradients of each stepped optimizer's parameters to this total norm (as
            ``torch.nn.utils.clip_grad_norm_``); None: no clipping (the check still scans). Leave
            the Trainer's ``gradient_clip_val`` unset.
        norm_type: the order of the norm (as ``clip_grad_norm_``).
        on_nonfinite: ``"skip"`` (default): skip the optimizer step whose gradients hold a NaN/Inf;
            or ``"raise"``, ``"warn"``, ``"ignore"``, as ``nanscan.check``.
        max_consecutive_skips: raise NonFiniteGradientError after more consecutive skipped steps.
        recorder: a ``nanscan.Recorder`` that records every check; its records are also forwarded
            to the Trainer's loggers (module notes).
        log_every_n_steps: forward a record to the loggers when its step is a multiple of this, and
            always when it was skipped or not finite; None: the Trainer's ``log_every_n_steps``.
        check_state_every: check the weights and the optimizer state after every this many optimizer
            steps (module notes); None: never.
        state_recorder: a ``nanscan.Recorder`` (not ``recorder``) for the state checks' reports;
            without one a state check warns on a NaN/Inf (one sync).
        attach_ddp: under Lightning's DDP, attach nanscan's DDP comm hook, so that the checks name
            the rank that made a NaN (module notes); elsewhere nothing.

    Example:
        >>> trainer = Trainer(callbacks=[NanscanCallback(max_norm=1.0)])  # no gradient_clip_val
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
        super().__init__()
        check_attach_ddp("NanscanCallback", attach_ddp)
        self.attach_ddp = attach_ddp
        self._set_check(
            "NanscanCallback", max_norm, norm_type, on_nonfinite, max_consecutive_skips, recorder, log_every_n_steps
        )
        self._set_state_check("NanscanCallback", check_state_every, state_recorder)
        if state_recorder is not None and state_recorder is recorder:
            raise ValueError(
                "nanscan.NanscanCallback: give the state checks a recorder of their own (state_recorder is "
                "recorder): one recorder keeps one list of names"
            )
        self._trainer: Trainer | None = None  # set while fitting: where the recorder's records go
        # Per optimizer (by id): what to check, the LightningModule itself when the optimizer holds all
        # of its trainable parameters (check's fast path), else that optimizer's (name, parameter) pairs.
        self._targets: dict[int, tuple[torch.optim.Optimizer, Any]] = {}
        if recorder is not None:
            recorder.add_sink(self._log_record)
        if state_recorder is not None:
            state_recorder.add_sink(self._log_record)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Refuses a Trainer that clips too, before any step."""
        if stage == "fit" and self.max_norm is not None and (trainer.gradient_clip_val or 0) > 0:
            raise ValueError(
                f"nanscan.NanscanCallback(max_norm={self.max_norm}) clips the gradients, and so does "
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}): clipping twice. Leave gradient_clip_val "
                "unset (the callback replaces Lightning's clipping)"
            )
        self._trainer = trainer
        self._targets = {}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Wraps each optimizer's step before the first one: the first check runs inside that step's
        closure, too late to wrap it then (nanscan.guard); with ``attach_ddp``, attaches the DDP hook
        before the first backward."""
        if self.attach_ddp:
            attach_ddp_hook("NanscanCallback", trainer.strategy.model, "DDPStrategy(ddp_comm_hook=...)")
        for optimizer in trainer.optimizers:
            torch_optimizer = _torch_optimizer(optimizer)
            if self.on_nonfinite == "skip":
                SkipGuard.of(torch_optimizer, self.max_consecutive_skips)
            # Inside the step the Trainer's global_step is still the step's own index (it counts
            # the steps completed), as the gradient records' indices are.
            self._watch_steps(
                torch_optimizer,
                functools.partial(self._target, pl_module, torch_optimizer),
                lambda: trainer.global_step,
            )

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        """Checks (and clips) the gradients of ``optimizer``'s parameters, and arms the skip."""
        optimizer = _torch_optimizer(optimizer)
        if self.max_norm is not None and _still_scaled(trainer, optimizer):
            raise ValueError(
                f"nanscan.NanscanCallback: {type(optimizer).__qualname__} unscales its gradients inside its step "
                "(a fused optimizer under precision='16-mixed'), so they are still scaled here and cannot be "
                "clipped; use max_norm=None (skipping still works) or a non-fused optimizer"
            )
        self._run_check(self._target(pl_module, optimizer), optimizer if self.on_nonfinite == "skip" else None)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Hands the recorder's last records to its sinks (the loggers among them)."""
        for recorder in (self.recorder, self.state_recorder):
            if recorder is not None:
                recorder.flush()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit":
            self._unwatch_steps()
            self._trainer = None
            self._targets = {}

    def _target(self, pl_module: LightningModule, optimizer: torch.optim.Optimizer) -> Any:
        cached = self._targets.get(id(optimizer))
        if cached is not None and cached[0] is optimizer:
            return cached[1]
        params = [p for group in optimizer.param_groups for p in group["params"]]
        root = self._trainer.strategy.model if self._trainer is not None else None
        if fsdp1.flattened(params) and root is not None:
            # Lightning's FSDP strategy (FSDP1): the LightningModule lies inside FSDP's root, which holds
            # some of its parameters. nanscan learns the root (the strategy's wrapped model), and then
            # checks the optimizer's own parameters, reduced over the ranks that shard them.
            layouts.learn(root)
            self._targets[id(optimizer)] = (optimizer, params)
            return params
        owned = {id(p) for p in params}
        named = list(pl_module.named_parameters())
        trainable = {id(p) for _, p in named if p.requires_grad}
        # A parameter the optimizer does not hold is no business of its step (Lightning clips
        # ``main_params(optimizer)`` too); a frozen one has no gradient and is not scanned anyway.
        target: Any = pl_module if trainable <= owned else [(n, p) for n, p in named if id(p) in owned]
        self._targets[id(optimizer)] = (optimizer, target)
        return target

    def _log_record(self, record: StepRecord) -> None:
        """The recorder's sink: one record's totals to the Trainer's loggers."""
        trainer = self._trainer
        if trainer is None or not trainer.loggers:
            return
        # (the Trainer sets log_every_n_steps in its logger connector, not in its annotations)
        every = self.log_every_n_steps or getattr(trainer, "log_every_n_steps", 0) or 1
        if not worth_logging(record, every):
            return
        if record.subject == "state":
            step, metrics = self._state_step(record), record_metrics(record)
        else:
            step, metrics = record.step, record_metrics(record) | self._metrics([record])
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=step)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer under Lightning's ``LightningOptimizer`` wrapper (itself an instance of
    the optimizer's class, by a dynamic subclass: the guard must wrap the inner one, whose ``step``
    the precision plugin calls)."""
    for namespace in ("lightning.pytorch", "pytorch_lightning"):  # a Trainer of either, both installed
        module = sys.modules.get(namespace + ".core.optimizer")
        if module is not None and isinstance(optimizer, module.LightningOptimizer):
            optimizer = optimizer.optimizer
            break
    if type(optimizer).__module__.startswith("deepspeed."):
        # Lightning's DeepSpeedStrategy: it runs on CUDA alone, so the callback has never run under it.
        raise ValueError(
            f"nanscan.NanscanCallback: Lightning's DeepSpeed strategy hands the callback DeepSpeed's "
            f"{type(optimizer).__name__}, not a torch optimizer; the callback does not run under that strategy. "
            "Check in a DeepSpeed loop of your own, between engine.backward() and engine.step() "
            "(nanscan.check(engine): examples/deepspeed_zero.py), or under the Hugging Face Trainer "
            "(NanscanTrainerCallback)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"nanscan.NanscanCallback: expected a torch optimizer, got {type(optimizer).__name__}")
    return optimizer


def _still_scaled(trainer: Trainer, optimizer: torch.optim.Optimizer) -> bool:
    """Whether the gradients at ``on_before_optimizer_step`` are still multiplied by a GradScaler's
    scale: Lightning skips ``unscale_`` for optimizers that unscale in their step (fused ones)."""
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return scaler is not None and bool(getattr(optimizer, "_step_supports_amp_scaling", False))
