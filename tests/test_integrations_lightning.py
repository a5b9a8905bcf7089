"""nanscan.integrations.lightning: a real Lightning Trainer with NanscanCallback clips every step and
skips the one whose gradients are NaN."""

from __future__ import annotations

import csv
import math
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger

import nanscan
from nanscan.integrations._logging import rank_metrics
from nanscan.integrations.lightning import NanscanCallback

from conftest import CALLBACK_BAD_SETTINGS

NAN_STEP = 3
STEPS = 8
LR = 0.1


class Tiny(LightningModule):
    """Two Linear layers on random data; the loss is multiplied by NaN at ``NAN_STEP``."""

    def __init__(self, fused: bool) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.fused = fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step == NAN_STEP:
            loss = loss * math.nan
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.fused:
            return torch.optim.AdamW(self.parameters(), lr=LR, fused=True)
        return torch.optim.SGD(self.parameters(), lr=LR)


def loader() -> torch.utils.data.DataLoader[Any]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * 4, 8, generator=g)
    y = 10 * torch.randn(STEPS * 4, 1, generator=g)  # large targets: gradient norms well above 1
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=4)


class Gradients(Callback):
    """Copies the gradients in on_before_optimizer_step (before or after nanscan's, by list order)."""

    def __init__(self) -> None:
        self.seen: list[list[torch.Tensor]] = []

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer: Any) -> None:
        self.seen.append([p.grad.detach().clone() for p in pl_module.parameters()])


class Parameters(Callback):
    """The parameters before and after each training batch (the step happens in between)."""

    def __init__(self) -> None:
        self.before: list[list[torch.Tensor]] = []
        self.after: list[list[torch.Tensor]] = []

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        self.before.append([p.detach().clone() for p in pl_module.parameters()])

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self.after.append([p.detach().clone() for p in pl_module.parameters()])


def trainer(callbacks: list[Callback], logger: Any = False, **kwargs: Any) -> Trainer:
    return Trainer(
        max_steps=STEPS,
        accelerator="cpu",
        logger=logger,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **kwargs,
    )


@pytest.mark.parametrize("fused", [False, True])
def test_callback_clips_and_skips_the_nan_step(fused: bool) -> None:
    torch.manual_seed(0)
    model = Tiny(fused)
    raw, clipped, params = Gradients(), Gradients(), Parameters()
    trainer([raw, NanscanCallback(max_norm=1.0), clipped, params]).fit(model, loader())

    assert len(raw.seen) == len(clipped.seen) == len(params.before) == STEPS
    optimizer = model.trainer.optimizers[0]
    assert nanscan.SkipGuard.of(optimizer).total_skips == 1
    for step in range(STEPS):
        before, after = params.before[step], params.after[step]
        if step == NAN_STEP:
            assert all(torch.isnan(g).all() for g in raw.seen[step])
            assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "the NaN step was taken"
            continue
        assert all(torch.isfinite(p).all() for p in after)
        # Clipped exactly as torch's clip_grad_norm_ clips the same gradients (and the norms were > 1).
        reference = [torch.nn.Parameter(torch.empty_like(g)) for g in raw.seen[step]]
        for p, g in zip(reference, raw.seen[step], strict=True):
            p.grad = g.clone()
        norm = torch.nn.utils.clip_grad_norm_(reference, max_norm=1.0)
        assert norm > 1.5, "this test's gradients must need clipping"
        for p, c in zip(reference, clipped.seen[step], strict=True):
            torch.testing.assert_close(c, p.grad)
        assert not any(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "a finite step was skipped"
        if not fused:  # SGD: the update is exactly lr times the clipped gradient
            for a, b, c in zip(before, after, clipped.seen[step], strict=True):
                torch.testing.assert_close(a - b, LR * c)
    if fused:  # the skipped step did not advance AdamW's step count (device-side skip)
        assert optimizer.state[next(iter(model.parameters()))]["step"].item() == STEPS - 1


def test_gradient_clip_val_with_the_callback_is_refused() -> None:
    with pytest.raises(ValueError, match=r"clipping twice.*Leave gradient_clip_val"):
        trainer([NanscanCallback(max_norm=1.0)], gradient_clip_val=0.5).fit(Tiny(False), loader())


@pytest.mark.parametrize(("settings", "message"), CALLBACK_BAD_SETTINGS)
def test_bad_settings_are_refused_when_the_callback_is_made(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        NanscanCallback(**settings)


@pytest.mark.parametrize("every", [1.5, "10", True])
def test_a_log_every_n_steps_that_is_not_an_int_is_refused(every: Any) -> None:
    with pytest.raises(ValueError, match=r"log_every_n_steps must be >= 1 \(an int\) or None, got "):
        NanscanCallback(log_every_n_steps=every)


@pytest.mark.parametrize("argument", ["recorder", "state_recorder"])
def test_a_sink_or_a_path_given_as_a_recorder_is_refused_clearly(argument: str, tmp_path: Path) -> None:
    sink = nanscan.sinks.JSONLSink(tmp_path / "run.jsonl")
    for wrong in (sink, "run.jsonl"):
        with pytest.raises(TypeError, match=rf"{argument} must be a nanscan\.Recorder, got \w+ \(a sink or a path"):
            NanscanCallback(**{argument: wrong}, check_state_every=1)
    sink.close()


def test_recorder_gets_one_record_per_step_and_feeds_the_loggers(tmp_path: Path) -> None:
    torch.manual_seed(0)
    records: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder(sinks=[records.append], every=3, warn=False)
    logger = CSVLogger(tmp_path, name="run", version=0)
    callback = NanscanCallback(max_norm=1.0, recorder=recorder, log_every_n_steps=2)
    trainer([callback], logger=logger).fit(Tiny(False), loader())

    assert [r.step for r in records] == list(range(STEPS))  # the last ones flushed at on_train_end
    for r in records:
        bad = r.step == NAN_STEP
        assert r.skipped == bad and r.finite == (not bad)
        assert (len(r.nonfinite) == len(r.names)) if bad else not r.nonfinite
        if not bad:
            assert r.clip_coef is not None and r.clip_coef < 1 and r.max_norm == 1.0

    with open(Path(logger.log_dir) / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("nanscan/total_norm")]
    logged = {int(row["step"]): row for row in rows}
    assert sorted(logged) == [0, 2, NAN_STEP, 4, 6]  # every 2nd step, and the skipped one
    assert float(logged[NAN_STEP]["nanscan/skipped"]) == 1.0
    assert math.isnan(float(logged[NAN_STEP]["nanscan/total_norm"]))
    assert float(logged[NAN_STEP]["nanscan/nonfinite_params"]) == 4.0
    assert float(logged[2]["nanscan/skipped"]) == 0.0 and float(logged[2]["nanscan/clip_coef"]) < 1
    # A single process's records name rank 0 for the NaN; no news, so no rank is logged.
    assert records[NAN_STEP].nonfinite_ranks == {name: [0] for name in records[NAN_STEP].names}
    assert not any(key.startswith("nanscan/nonfinite_rank") for key in rows[0]), list(rows[0])


def test_an_fsdp2_run_logs_the_ranks_that_held_the_nan(tmp_path: Path, world_of_one: None) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Tiny(False)
    fully_shard(model.net, mesh=init_device_mesh("cpu", (1,)))
    records: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder(sinks=[records.append], every=3, warn=False)
    logger = CSVLogger(tmp_path, name="run", version=0)
    trainer([NanscanCallback(max_norm=1.0, recorder=recorder)], logger=logger, log_every_n_steps=1).fit(model, loader())

    assert records[NAN_STEP].nonfinite_ranks == {name: [0] for name in records[NAN_STEP].names}
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        logged = {int(row["step"]): row for row in csv.DictReader(f) if row.get("nanscan/total_norm")}
    assert sorted(logged) == list(range(STEPS))
    # All four parameters' shards (the one rank's) held the NaN; finite steps leave the column empty.
    assert float(logged[NAN_STEP]["nanscan/nonfinite_rank/0"]) == 4.0
    assert all(row["nanscan/nonfinite_rank/0"] == "" for step, row in logged.items() if step != NAN_STEP)


@pytest.mark.parametrize("use_orig_params", [False, True])
def test_under_lightnings_fsdp1_strategy_the_optimizers_parameters_are_checked_whole(
    world_of_one: None, use_orig_params: bool
) -> None:
    """Lightning's FSDP strategy wraps the LightningModule in FSDP1's root (it refuses a CPU, so the
    wrap is made here as the strategy makes it, and the Trainer's strategy is stood in for): the
    callback checks the optimizer's parameters, reduced through the root it shows nanscan, by the
    names the user wrote."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    module = Tiny(False)
    with pytest.warns(UserWarning, match="switching to use `NO_SHARD`"):
        root = FullyShardedDataParallel(module, use_orig_params=use_orig_params, device_id=torch.device("cpu"))
    optimizer = torch.optim.SGD(root.parameters(), lr=LR)
    x, y = next(iter(loader()))
    torch.nn.functional.mse_loss(root(x), y).backward()
    callback = NanscanCallback(max_norm=1.0)
    callback._trainer = SimpleNamespace(strategy=SimpleNamespace(model=root))  # type: ignore[assignment]
    target = callback._target(module, optimizer)
    report = nanscan.check(target)
    assert report.names == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"], report.names
    assert report.total_norm == pytest.approx(nanscan.check(root).total_norm)


class CorruptMoment(Callback):
    """After the optimizer step of batch ``at``: an Inf in ``net.0.weight``'s ``exp_avg_sq``, as one bf16
    overflow leaves Adam's second moment (the gradients are finite again the step after)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.at:
            trainer.optimizers[0].state[pl_module.net[0].weight]["exp_avg_sq"][0, 0] = math.inf


def test_state_checks_every_n_steps_reach_the_loggers_and_name_the_bad_moment(tmp_path: Path) -> None:
    torch.manual_seed(0)
    states: list[nanscan.records.StepRecord] = []
    state_recorder = nanscan.Recorder(sinks=[states.append], every=2, warn=False)
    logger = CSVLogger(tmp_path, name="run", version=0)
    callback = NanscanCallback(check_state_every=2, state_recorder=state_recorder)
    trainer([callback, CorruptMoment(4)], logger=logger, log_every_n_steps=1).fit(Tiny(True), loader())

    # Fused AdamW: the NaN step is skipped on the device, its step still called: 8 steps, 4 checks.
    assert [r.subject for r in states] == ["state"] * 4
    assert states[0].names[:4] == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert "net.0.weight:exp_avg_sq" in states[0].names and not any(n.endswith(":step") for n in states[0].names)
    assert [r.nonfinite for r in states] == [[], [], ["net.0.weight:exp_avg_sq"], ["net.0.weight:exp_avg_sq"]]
    with open(Path(logger.log_dir) / "metrics.csv") as f:
        logged = {int(row["step"]): row for row in csv.DictReader(f) if row.get("nanscan/state/total_norm")}
    assert sorted(logged) == [1, 3, 5, 7]  # beside the gradients of the step each check followed
    assert [float(logged[s]["nanscan/state/nonfinite_tensors"]) for s in (1, 3, 5, 7)] == [0, 0, 1, 1]
    assert float(logged[1]["nanscan/state/total_norm"]) == pytest.approx(states[0].total_norm, rel=1e-6)


def test_state_checks_without_a_recorder_warn_and_a_stateless_optimizer_has_its_weights_checked() -> None:
    torch.manual_seed(0)
    with pytest.warns(
        RuntimeWarning,
        match=r"NanscanCallback: after optimizer step 6, NaN/Inf in the weights or the optimizer state: "
        r"net\.0\.weight:exp_avg_sq$",
    ):
        trainer([NanscanCallback(check_state_every=3), CorruptMoment(4)]).fit(Tiny(True), loader())

    states: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder(sinks=[states.append], every=10, warn=False)
    trainer([NanscanCallback(check_state_every=1, state_recorder=recorder)]).fit(Tiny(False), loader())
    # SGD keeps no state: the weights alone, after each of the 7 steps taken (the NaN one held back).
    assert len(states) == STEPS - 1 and all(r.names == states[0].names for r in states)
    assert states[0].names == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]


def test_bad_state_settings_are_refused() -> None:
    recorder = nanscan.Recorder(every=1)
    with pytest.raises(ValueError, match="check_state_every must be a positive int or None, got 0"):
        NanscanCallback(check_state_every=0)
    with pytest.raises(ValueError, match="a state_recorder records the state checks: set check_state_every too"):
        NanscanCallback(state_recorder=recorder)
    with pytest.raises(ValueError, match="a recorder of their own"):
        NanscanCallback(recorder=recorder, check_state_every=1, state_recorder=recorder)
    with pytest.raises(TypeError, match=r"state_recorder must be a nanscan\.Recorder"):
        NanscanCallback(check_state_every=1, state_recorder=[])  # type: ignore[arg-type]
    recorder.close()


def test_state_checks_under_lightnings_fsdp1_strategy_read_the_flat_state_whole(world_of_one: None) -> None:
    """As the gradient check: the optimizer holds FSDP1's flat parameters, and the state check cuts
    their values and Adam moments back into the parameters the user wrote (the strategy stood in for,
    as in the gradient test above)."""
    from types import SimpleNamespace

    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    module = Tiny(False)
    with pytest.warns(UserWarning, match="switching to use `NO_SHARD`"):
        root = FullyShardedDataParallel(module, device_id=torch.device("cpu"))
    optimizer = torch.optim.Adam(root.parameters(), lr=LR)
    states: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder(sinks=[states.append], every=1, warn=False)
    callback = NanscanCallback(check_state_every=1, state_recorder=recorder)
    callback._trainer = SimpleNamespace(strategy=SimpleNamespace(model=root), loggers=[])  # type: ignore[assignment]
    callback._watch_steps(optimizer, lambda: callback._target(module, optimizer), lambda: 0)
    x, y = next(iter(loader()))
    torch.nn.functional.mse_loss(root(x), y).backward()
    optimizer.step()
    recorder.close()
    params = ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert list(states[0].names) == params + [f"{p}:{key}" for p in params for key in ("exp_avg", "exp_avg_sq")]
    assert states[0].finite
    assert states[0].norm[0] == pytest.approx(module.net[0].weight.detach().norm().item(), rel=1e-6)


def test_rank_metrics_count_each_ranks_parameters_in_its_worst_record() -> None:
    base = nanscan.records.StepRecord(
        step=0,
        names=["a", "b"],
        nan_count=[1, 1],
        inf_count=[0, 0],
        min=[0.0, 0.0],
        max=[0.0, 0.0],
        norm=[math.nan, math.nan],
        spike_ratio=[math.nan, math.nan],
        total_norm=math.nan,
        finite=False,
        clip_coef=None,
        max_norm=None,
        skipped=True,
        loss_scale=None,
        spike_factor=10.0,
        nonfinite_ranks={"a": [1, 3], "b": [3]},
    )
    later = replace(base, step=1, nan_count=[1, 0], nonfinite_ranks={"a": [1, 12]})
    finite = replace(base, step=2, nan_count=[0, 0], finite=True, skipped=False, nonfinite_ranks={})
    assert rank_metrics([base]) == {"nanscan/nonfinite_rank/1": 1.0, "nanscan/nonfinite_rank/3": 2.0}
    assert rank_metrics([base, later, finite]) == {
        "nanscan/nonfinite_rank/1": 1.0,
        "nanscan/nonfinite_rank/3": 2.0,
        "nanscan/nonfinite_rank/12": 1.0,
    }
    assert rank_metrics([finite]) == {}


def test_deepspeeds_optimizer_is_refused_by_name() -> None:
    """Lightning's DeepSpeed strategy (CUDA only, never run here) hands the callback DeepSpeed's ZeRO
    optimizer: refused before any step, saying where nanscan reads ZeRO instead."""
    from nanscan.integrations.lightning import _torch_optimizer

    zero = type("DeepSpeedZeroOptimizer", (), {"__module__": "deepspeed.runtime.zero.stage_1_and_2"})()
    with pytest.raises(ValueError, match="DeepSpeed strategy hands the callback DeepSpeed's DeepSpeedZeroOptimizer"):
        _torch_optimizer(zero)
    with pytest.raises(TypeError, match="expected a torch optimizer, got object"):
        _torch_optimizer(object())


def test_importing_nanscan_imports_no_framework() -> None:
    code = "import sys, nanscan; assert not {'lightning', 'pytorch_lightning', 'transformers'} & set(sys.modules)"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_pytorch_lightning_namespace() -> None:
    """The older package name: its Trainer and LightningModule, the same callback."""
    pl = pytest.importorskip("pytorch_lightning")

    class Old(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Linear(8, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            loss = torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])
            return loss * math.nan if self.global_step == 1 else loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=LR)

    class Steps(pl.Callback):  # type: ignore[misc]
        def __init__(self) -> None:
            self.weights: list[torch.Tensor] = []

        def on_train_batch_end(self, *args: Any) -> None:
            self.weights.append(args[1].net.weight.detach().clone())

    model, steps = Old(), Steps()
    pl.Trainer(
        max_steps=3,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[NanscanCallback(max_norm=1.0), steps],
    ).fit(model, loader())
    assert len(steps.weights) == 3
    assert torch.equal(steps.weights[0], steps.weights[1]), "the NaN step was taken"
    assert not torch.equal(steps.weights[1], steps.weights[2])
    assert torch.isfinite(steps.weights[2]).all()


def test_attach_ddp_must_be_a_bool() -> None:
    with pytest.raises(TypeError, match=r"attach_ddp must be True or False, got 'yes'"):
        NanscanCallback(attach_ddp="yes")  # type: ignore[arg-type]


def test_attach_ddp_refuses_a_ddp_model_with_a_comm_hook_and_leaves_other_models(world_of_one: None) -> None:
    """DDP takes one comm hook: one set by ``DDPStrategy(ddp_comm_hook=...)`` is refused by name; a
    model that is not DDP (a single device) is left alone; a model attached already is not attached
    again (a second fit)."""
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from nanscan.integrations._logging import attach_ddp_hook
    from nanscan.layouts import ddp

    def _attach_ddp(model: torch.nn.Module) -> None:  # as the callback calls it
        attach_ddp_hook("NanscanCallback", model, "DDPStrategy(ddp_comm_hook=...)")

    hooked = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    hooked.register_comm_hook(None, allreduce_hook)
    with pytest.raises(ValueError, match=r"has a comm hook already \(DDPStrategy\(ddp_comm_hook=\.\.\.\)\)"):
        _attach_ddp(hooked)
    plain = torch.nn.Linear(4, 2)
    _attach_ddp(plain)
    assert ddp.wrapper_of(plain) is None
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    _attach_ddp(model)
    scanner = ddp.scanner_of(model)
    _attach_ddp(model)
    assert scanner is not None and ddp.scanner_of(model) is scanner and ddp.wrapper_of(model.module) is model


def test_the_module_inside_an_attached_ddp_model_is_checked_as_the_ddp_model(world_of_one: None) -> None:
    """What the callback holds is the module inside DDP: once the hook is attached, a check of that
    module is the DDP model's (its report carries the rank attribution), and inside ``no_sync()`` it
    is refused as the DDP model's is."""
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
    nanscan.ddp.attach(model)
    model(torch.randn(3, 4)).sum().backward()
    report = nanscan.check(model.module)
    assert report.finite and report.nonfinite_ranks == {} and report.names == ["weight", "bias"]
    assert report._values()["attribution"] is not None, "the DDP hook's attribution, as check(model) has it"
    with model.no_sync():
        model(torch.randn(3, 4)).sum().backward()
        with pytest.raises(ValueError, match=r"inside no_sync\(\)"):
            nanscan.check(model.module)


def test_an_attached_ddp_model_is_freed_with_its_module(world_of_one: None) -> None:
    """The hook holds no reference back to the DDP model (DDP's reducer, in C++, holds the hook: a
    cycle through it would never be collected), so a model attached per fit is freed after it, and
    the registry forgets it."""
    import gc
    import weakref

    from nanscan.layouts import ddp

    module = torch.nn.Linear(4, 2)
    model = torch.nn.parallel.DistributedDataParallel(module)
    nanscan.ddp.attach(model)
    model(torch.randn(3, 4)).sum().backward()
    nanscan.check(model.module)
    gone = weakref.ref(model)
    del model
    gc.collect()
    assert gone() is None and ddp.wrapper_of(module) is None
    other = torch.nn.parallel.DistributedDataParallel(module)  # the module in a new, plain DDP model
    with other.no_sync():
        other(torch.randn(3, 4)).sum().backward()
        report = nanscan.check(module)  # not taken for the freed model's check (nor refused as inside it)
    assert report._values()["attribution"] is None
