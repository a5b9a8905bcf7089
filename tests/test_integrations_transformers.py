"""nanscan.integrations.transformers: a real transformers Trainer on a tiny GPT-2 with
NanscanTrainerCallback clips every step and skips the one whose gradients are NaN."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytest.importorskip("transformers")

from launched_common import Tokens
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

import nanscan
from nanscan.integrations.transformers import NanscanTrainerCallback

from conftest import CALLBACK_BAD_SETTINGS

NAN_STEP = 2
STEPS = 6
LR = 0.05
MAX_NORM = 0.5


def tiny_gpt2() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32))


def arguments(tmp_path: Path, optim: str = "sgd", max_grad_norm: float = 0.0) -> TrainingArguments:
    return TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=STEPS,
        per_device_train_batch_size=2,
        learning_rate=LR,
        lr_scheduler_type="constant",
        optim=optim,
        max_grad_norm=max_grad_norm,
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )


class Poison(TrainerCallback):
    """Before nanscan's hook (list order): a NaN in one gradient at NAN_STEP."""

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == NAN_STEP:
            kwargs["model"].transformer.h[1].mlp.c_fc.weight.grad[0, 0] = math.nan


class Snapshot(TrainerCallback):
    """Copies the gradients in on_pre_optimizer_step, and (``params``) the parameters before and after
    each step."""

    def __init__(self, params: bool = False) -> None:
        self.grads: list[list[torch.Tensor]] = []
        self.before: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []
        self.params = params

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        model = kwargs["model"]
        self.grads.append([p.grad.detach().clone() for p in model.parameters()])
        if self.params:
            self.before.append([p.detach().clone() for p in model.parameters()])

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.params:
            self.after.append([p.detach().clone() for p in kwargs["model"].parameters()])


@pytest.mark.parametrize("optim", ["sgd", "adamw_torch_fused"])
def test_callback_clips_and_skips_the_nan_step(tmp_path: Path, optim: str) -> None:
    model = tiny_gpt2()
    raw, clipped = Snapshot(), Snapshot(params=True)
    callbacks = [Poison(), raw, NanscanTrainerCallback(max_norm=MAX_NORM), clipped]
    trainer = Trainer(
        model=model, args=arguments(tmp_path, optim), train_dataset=Tokens(STEPS * 2), callbacks=callbacks
    )
    trainer.train()

    assert len(raw.grads) == len(clipped.after) == STEPS
    inner = trainer.optimizer.optimizer  # accelerate's AcceleratedOptimizer wraps the torch one
    assert isinstance(inner, torch.optim.SGD if optim == "sgd" else torch.optim.AdamW)
    assert nanscan.SkipGuard.of(inner).total_skips == 1
    for step in range(STEPS):
        before, after = clipped.before[step], clipped.after[step]
        if step == NAN_STEP:
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "the NaN step was taken"
            continue
        assert all(torch.isfinite(p).all() for p in after)
        reference = [torch.nn.Parameter(torch.empty_like(g)) for g in raw.grads[step]]
        for p, g in zip(reference, raw.grads[step], strict=True):
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(reference, max_norm=MAX_NORM)
        assert norm > 2 * MAX_NORM, "this test's gradients must need clipping"
        for p, c in zip(reference, clipped.grads[step], strict=True):
            torch.testing.assert_close(c, p.grad)
        assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)), "a finite step was skipped"
        if optim == "sgd":  # the update is exactly lr times the clipped gradient
            for a, b, c in zip(before, after, clipped.grads[step], strict=True):
                torch.testing.assert_close(a - b, LR * c)
    if optim != "sgd":  # skipped on the device: the fused step did not count it
        assert inner.state[next(iter(model.parameters()))]["step"].item() == STEPS - 1
    # The LR schedule holds still on a step held back on the host, as on a GradScaler's skip; a fused
    # optimizer's skip is on the device, unknown to the host, and the schedule advances (as it does on
    # the GradScaler's device-side skip).
    assert trainer.lr_scheduler.last_epoch == (STEPS - 1 if optim == "sgd" else STEPS)


def test_trainer_clipping_with_the_callback_is_refused(tmp_path: Path) -> None:
    callbacks = [NanscanTrainerCallback(max_norm=MAX_NORM)]
    trainer = Trainer(
        model=tiny_gpt2(),
        args=arguments(tmp_path, max_grad_norm=1.0),
        train_dataset=Tokens(STEPS * 2),
        callbacks=callbacks,
    )
    with pytest.raises(ValueError, match=r"clipping twice.*max_grad_norm=0"):
        trainer.train()


@pytest.mark.parametrize(("settings", "message"), CALLBACK_BAD_SETTINGS)
def test_bad_settings_are_refused_when_the_callback_is_made(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NanscanTrainerCallback(**settings)


def test_attach_ddp_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"NanscanTrainerCallback: attach_ddp must be True or False, got 1"):
        NanscanTrainerCallback(attach_ddp=1)  # type: ignore[arg-type]


@pytest.mark.parametrize("every", [1.5, "10", True])
def test_a_log_every_n_steps_that_is_not_an_int_is_refused(every: Any) -> None:
    with pytest.raises(ValueError, match=r"log_every_n_steps must be >= 1 \(an int\) or None, got "):
        NanscanTrainerCallback(log_every_n_steps=every)


@pytest.mark.parametrize("argument", ["recorder", "state_recorder"])
def test_a_sink_or_a_path_given_as_a_recorder_is_refused_clearly(argument: str, tmp_path: Path) -> None:
    sink = nanscan.sinks.JSONLSink(tmp_path / "run.jsonl")
    for wrong in (sink, "run.jsonl"):
        with pytest.raises(TypeError, match=rf"{argument} must be a nanscan\.Recorder, got \w+ \(a sink or a path"):
            NanscanTrainerCallback(**{argument: wrong}, check_state_every=1)
    sink.close()


def test_recorder_gets_one_record_per_step_and_feeds_the_logs(tmp_path: Path) -> None:
    records: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder(sinks=[records.append], every=1, warn=False)
    callback = NanscanTrainerCallback(max_norm=MAX_NORM, recorder=recorder)
    trainer = Trainer(
        model=tiny_gpt2(), args=arguments(tmp_path), train_dataset=Tokens(STEPS * 2), callbacks=[Poison(), callback]
    )
    trainer.train()

    assert [r.step for r in records] == list(range(STEPS))
    for r in records:
        bad = r.step == NAN_STEP
        assert r.skipped == bad and r.finite == (not bad)
        assert r.nonfinite == (["transformer.h.1.mlp.c_fc.weight"] if bad else [])
        if not bad:
            assert r.clip_coef is not None and r.clip_coef < 1
    logged = [entry for entry in trainer.state.log_history if "nanscan/total_norm" in entry]
    assert [int(e["nanscan/step"]) for e in logged] == list(range(STEPS))
    assert [e["step"] for e in logged] == list(range(1, STEPS + 1))  # global_step after each step
    assert [e["nanscan/skipped"] for e in logged] == [float(i == NAN_STEP) for i in range(STEPS)]
    assert math.isnan(logged[NAN_STEP]["nanscan/total_norm"]) and logged[NAN_STEP]["nanscan/nonfinite_params"] == 1
    assert all(e["nanscan/clip_coef"] < 1 for i, e in enumerate(logged) if i != NAN_STEP)
    # A single process's records name rank 0 for the NaN; no news, so no rank is logged.
    assert records[NAN_STEP].nonfinite_ranks == {"transformer.h.1.mlp.c_fc.weight": [0]}
    assert not any(key.startswith("nanscan/nonfinite_rank") for e in logged for key in e)


def test_the_last_records_reach_the_last_logs(tmp_path: Path) -> None:
    """A recorder read every 4 steps of 6: the records of the last two reach the host only when
    training ends; they are read out at the last step, so the Trainer's last log carries them."""
    recorder = nanscan.Recorder(every=4, warn=False)
    callback = NanscanTrainerCallback(max_norm=MAX_NORM, recorder=recorder)
    trainer = Trainer(
        model=tiny_gpt2(), args=arguments(tmp_path), train_dataset=Tokens(STEPS * 2), callbacks=[callback]
    )
    trainer.train()

    logged = [entry for entry in trainer.state.log_history if "nanscan/total_norm" in entry]
    assert [int(e["nanscan/step"]) for e in logged] == [3, STEPS - 1]
    assert logged[-1]["step"] == STEPS


def test_an_fsdp2_run_logs_the_ranks_that_held_the_nan(tmp_path: Path, world_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = tiny_gpt2()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    records: list[nanscan.records.StepRecord] = []
    # Read every 2 steps, at once after the NaN step (flush_on_nonfinite) and at the last step: logs
    # after records 1, 2 (the NaN step's own), 4 and 5.
    recorder = nanscan.Recorder(sinks=[records.append], every=2, warn=False)
    callback = NanscanTrainerCallback(max_norm=MAX_NORM, recorder=recorder)
    trainer = Trainer(
        model=model, args=arguments(tmp_path), train_dataset=Tokens(STEPS * 2), callbacks=[Poison(), callback]
    )
    trainer.train()

    assert records[NAN_STEP].nonfinite_ranks == {"transformer.h.1.mlp.c_fc.weight": [0]}
    logged = [entry for entry in trainer.state.log_history if "nanscan/total_norm" in entry]
    assert [int(e["nanscan/step"]) for e in logged] == [1, 2, 4, 5]
    # The one rank's shard held the NaN, in one parameter; the logs of finite records name no rank.
    ranks = [{k: v for k, v in e.items() if k.startswith("nanscan/nonfinite_rank")} for e in logged]
    assert ranks == [{}, {"nanscan/nonfinite_rank/0": 1.0}, {}, {}]
    assert logged[1]["nanscan/skipped"] == 1.0


class CorruptMoment(TrainerCallback):
    """After the optimizer step of Trainer step ``at``: an Inf in one parameter's ``exp_avg_sq``."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.at:
            inner = kwargs["optimizer"]
            while isinstance(getattr(inner, "optimizer", None), torch.optim.Optimizer):
                inner = inner.optimizer
            inner.state[kwargs["model"].transformer.h[0].mlp.c_fc.weight]["exp_avg_sq"][0, 0] = math.inf


def test_state_checks_every_n_steps_are_merged_into_the_logs(tmp_path: Path) -> None:
    states: list[nanscan.records.StepRecord] = []
    state_recorder = nanscan.Recorder(sinks=[states.append], every=1, warn=False)
    callback = NanscanTrainerCallback(check_state_every=2, state_recorder=state_recorder)
    trainer = Trainer(
        model=tiny_gpt2(),
        args=arguments(tmp_path, optim="adamw_torch"),
        train_dataset=Tokens(STEPS * 2),
        callbacks=[Poison(), callback, CorruptMoment(3)],
    )
    trainer.train()

    # The NaN step (2) is held back on the host: steps 0, 1, 3, 4, 5 are taken, checked after 1 and 4.
    bad = "transformer.h.0.mlp.c_fc.weight:exp_avg_sq"
    assert [(r.subject, r.nonfinite) for r in states] == [("state", []), ("state", [bad])]
    assert bad in states[0].names
    logged = [entry for entry in trainer.state.log_history if "nanscan/state/total_norm" in entry]
    assert [(e["nanscan/state/step"], e["nanscan/state/nonfinite_tensors"]) for e in logged] == [(1.0, 0.0), (4.0, 1.0)]
    assert logged[0]["nanscan/state/total_norm"] == pytest.approx(states[0].total_norm, rel=1e-6)


def test_state_checks_without_a_recorder_warn(tmp_path: Path) -> None:
    callback = NanscanTrainerCallback(check_state_every=4)
    trainer = Trainer(
        model=tiny_gpt2(),
        args=arguments(tmp_path, optim="adamw_torch"),
        train_dataset=Tokens(STEPS * 2),
        callbacks=[callback, CorruptMoment(1)],
    )
    with pytest.warns(RuntimeWarning, match=r"after optimizer step 4, NaN/Inf in the weights or the optimizer state"):
        trainer.train()


def test_fp16_scaler_path_keeps_the_guard() -> None:
    """Under fp16 accelerate's step swaps the inner step for a wrapper of the step it saved at
    prepare (and restores that after): the callback must point both at the guarded step, or a step the
    GradScaler lets through would bypass the guard. Driven by hand as the Trainer drives it (fp16 AMP
    needs a GPU in the Trainer): unscale (the Trainer's grad-norm), the hook, ``optimizer.step()``."""
    import warnings

    from accelerate import Accelerator
    from accelerate.optimizer import AcceleratedOptimizer

    Accelerator(cpu=True)  # the state AcceleratedOptimizer reads
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    optimizer = AcceleratedOptimizer(inner, device_placement=False, scaler=scaler)
    callback = NanscanTrainerCallback(max_norm=1.0)
    args = SimpleNamespace(max_grad_norm=0.0)
    callback.on_train_begin(args, None, None, optimizer=optimizer)  # type: ignore[arg-type]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the guard warns about a step that bypassed it
        for poison in [False, True, False, False]:
            model.zero_grad()
            scaler.scale(model(torch.randn(4, 6)).sum()).backward()
            scaler.unscale_(inner)
            if poison:  # after the scaler's own look: only nanscan sees it, so only the guard can skip
                model[2].weight.grad[0, 0] = math.nan
            before = [p.detach().clone() for p in model.parameters()]
            callback.on_pre_optimizer_step(args, None, None, model=model, optimizer=optimizer)  # type: ignore[arg-type]
            optimizer.step()
            changed = any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
            assert changed == (not poison)
    assert nanscan.SkipGuard.of(inner).total_skips == 1


class StandInZeroOptimizer:
    """What the callback reads of DeepSpeed's ZeRO-1/2 optimizer (the real one runs under the Trainer in
    tests/test_launchers.py): its module path, its pieces' dict, the torch optimizer it steps."""

    __module__ = "deepspeed.runtime.zero.stage_1_and_2"

    def __init__(self, inner: Any) -> None:
        self.averaged_gradients: dict[int, Any] = {}
        self.optimizer = inner
        self.steps = 0

    def step(self, closure: Any = None) -> None:
        self.steps += 1


def test_under_deepspeed_zero_the_check_runs_inside_its_step_and_leaves_with_the_training() -> None:
    """Accelerate's DeepSpeedOptimizerWrapper holds the ZeRO optimizer: the callback wraps its step at
    on_train_begin (the check first, then DeepSpeed's own step), leaves the hook before the optimizer
    step alone, and puts DeepSpeed's step back at on_train_end."""
    model = torch.nn.Linear(3, 2)
    zero = StandInZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    wrapper = SimpleNamespace(optimizer=zero)
    callback = NanscanTrainerCallback(max_norm=1.0, on_nonfinite="raise")
    args = SimpleNamespace(max_grad_norm=0.0)
    checked: list[Any] = []
    callback._run_check = lambda target, optimizer: checked.append((target, optimizer))  # type: ignore[method-assign]
    callback.on_train_begin(args, None, None, model=model, optimizer=wrapper)  # type: ignore[arg-type]
    zero.step()
    assert checked == [(model, None)] and zero.steps == 1  # checked, then DeepSpeed's step ran
    callback.on_pre_optimizer_step(args, None, None, model=model, optimizer=wrapper)  # type: ignore[arg-type]
    assert len(checked) == 1  # the gradients are gone by then: nothing checked twice
    callback.on_train_end(args, None, None)  # type: ignore[arg-type]
    assert "step" not in vars(zero)  # the class's step again
    zero.step()
    assert len(checked) == 1 and zero.steps == 2


def test_under_deepspeed_zero_what_the_callback_cannot_do_is_refused_at_the_start() -> None:
    model = torch.nn.Linear(3, 2)
    args = SimpleNamespace(max_grad_norm=0.0)
    with pytest.raises(ValueError, match="check_state_every under DeepSpeed ZeRO"):
        wrapper = SimpleNamespace(optimizer=StandInZeroOptimizer(torch.optim.SGD(model.parameters(), lr=0.1)))
        NanscanTrainerCallback(check_state_every=2).on_train_begin(args, None, None, model=model, optimizer=wrapper)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="on_nonfinite='skip' under DeepSpeed ZeRO guards the torch optimizer"):
        wrapper = SimpleNamespace(optimizer=StandInZeroOptimizer(object()))
        NanscanTrainerCallback().on_train_begin(args, None, None, model=model, optimizer=wrapper)  # type: ignore[arg-type]
