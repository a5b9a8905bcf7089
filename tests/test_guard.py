"""check(..., on_nonfinite=...): ignore, warn, raise, skip (with counters and a consecutive limit)."""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch

import nanscan
from nanscan.guard import NonFiniteGradientError, SkipGuard


def setup(fused: bool = False) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = (
        torch.optim.AdamW(model.parameters(), lr=0.1, fused=True)
        if fused
        else torch.optim.SGD(model.parameters(), lr=0.1)
    )
    return model, opt


def backward(model: torch.nn.Module, poison: bool) -> None:
    model.zero_grad()
    model(torch.randn(4, 6)).sum().backward()
    if poison:
        model[2].weight.grad[1, 1] = math.nan


def params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def test_unknown_mode_and_missing_optimizer() -> None:
    model, _ = setup()
    backward(model, False)
    with pytest.raises(ValueError, match="on_nonfinite must be one of 'ignore', 'warn', 'raise', 'skip'"):
        nanscan.check(model, on_nonfinite="skipp")
    with pytest.raises(ValueError, match="needs optimizer="):
        nanscan.check(model, on_nonfinite="skip")


def test_raise_and_warn_name_the_parameters() -> None:
    model, _ = setup()
    backward(model, False)
    nanscan.check(model, on_nonfinite="raise")  # finite: no error
    backward(model, True)
    with pytest.raises(NonFiniteGradientError, match=r"non-finite gradients in 2\.weight"):
        nanscan.check(model, on_nonfinite="raise")
    with pytest.warns(RuntimeWarning, match=r"non-finite gradients in 2\.weight"):
        nanscan.check(model, on_nonfinite="warn")
    nanscan.check(model, on_nonfinite="ignore")


@pytest.mark.parametrize("fused", [False, True])
def test_skip_and_counters(fused: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = setup(fused)
    pattern = [False, True, True, False, True]
    for poison in pattern:
        backward(model, poison)
        before = params(model)
        if fused:  # the device-side path must not read the flag on the host
            with monkeypatch.context() as m:
                m.setattr(torch.Tensor, "__bool__", lambda self: (_ for _ in ()).throw(AssertionError("host sync")))
                m.setattr(torch.Tensor, "item", lambda self: (_ for _ in ()).throw(AssertionError("host sync")))
                nanscan.check(model, on_nonfinite="skip", optimizer=opt)
                opt.step()
                assert not SkipGuard.of(opt).held_back  # skipped on the device: the host cannot know
        else:
            nanscan.check(model, on_nonfinite="skip", optimizer=opt)
            opt.step()
            assert SkipGuard.of(opt).held_back == poison  # known on the host, where it was decided
        after = params(model)
        changed = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert changed == (not poison), f"poison={poison}: parameters {'changed' if changed else 'unchanged'}"
        assert all(torch.isfinite(p).all() for p in after)
    guard = SkipGuard.of(opt)
    assert guard.total_skips == 3 and guard.consecutive_skips == 1 and guard.last_skipped
    if fused:
        assert opt.state[next(iter(model.parameters()))]["step"].item() == 2  # skipped steps not counted


def test_consecutive_limit_raises() -> None:
    model, opt = setup()
    for i in range(3):
        backward(model, True)
        if i < 2:
            nanscan.check(model, on_nonfinite="skip", optimizer=opt, max_consecutive_skips=2)
            opt.step()
    with pytest.raises(NonFiniteGradientError, match="3 consecutive optimizer steps skipped"):
        nanscan.check(model, on_nonfinite="skip", optimizer=opt, max_consecutive_skips=2)


def test_unarmed_step_is_an_ordinary_step() -> None:
    model, opt = setup()
    backward(model, False)
    nanscan.check(model, on_nonfinite="skip", optimizer=opt)
    opt.step()
    backward(model, True)
    nanscan.check(model, on_nonfinite="skip", optimizer=opt)
    opt.step()
    assert SkipGuard.of(opt).held_back
    backward(model, False)
    before = params(model)
    opt.step()  # no check this step: runs normally
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model), strict=True))
    assert not SkipGuard.of(opt).held_back


@pytest.mark.parametrize("scaler_cls", [torch.amp.GradScaler, nanscan.amp.GradScaler])
@pytest.mark.parametrize("poison", [False, True])
def test_skip_guard_composes_with_grad_scaler(scaler_cls: type, poison: bool) -> None:
    """GradScaler hands fused optimizers their own found_inf/grad_scale; the guard must keep both."""
    model, opt = setup(fused=True)
    scaler = scaler_cls("cpu", init_scale=1024.0)
    model.zero_grad()
    scaler.scale(model(torch.randn(4, 6)).sum()).backward()
    if poison:
        model[2].weight.grad[0, 0] = math.nan
    before = params(model)
    nanscan.check(model, on_nonfinite="skip", optimizer=opt)  # scaled gradients, no unscale_: grad_scale is used
    scaler.step(opt)
    scaler.update()
    after = params(model)
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True)) == (not poison)
    assert all(torch.isfinite(p).all() for p in after)
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    # With grad_scale kept, AdamW's first step moves each weight by about lr (0.1); with the scale
    # lost it would still be ~lr, so check the momentum instead: it must hold unscaled gradients.
    if not poison:
        state = opt.state[next(iter(model.parameters()))]
        assert state["exp_avg"].abs().max().item() < 10.0, "the fused step saw still-scaled gradients"


@pytest.mark.parametrize("fused", [False, True])
def test_consecutive_limit_holds_on_every_path(fused: bool) -> None:
    """max_consecutive_skips with a fused optimizer: skipping stays on the device, the limit still holds
    (on a CPU at the very check that passes it; see guard.py for the GPU's lag of at most two steps)."""
    model, opt = setup(fused)
    raised_at = None
    for step in range(10):
        backward(model, True)
        try:
            nanscan.check(model, on_nonfinite="skip", optimizer=opt, max_consecutive_skips=3)
        except NonFiniteGradientError as e:
            raised_at = step
            assert "4 consecutive optimizer steps skipped" in str(e) and "limit 3" in str(e)
            break
        opt.step()
    assert raised_at == 3, f"the limit of 3 was not enforced (raised at step {raised_at})"


def test_consecutive_limit_resets_after_a_finite_step() -> None:
    model, opt = setup(fused=True)
    for poison in [True, True, False, True, True, False, True, True]:
        backward(model, poison)
        nanscan.check(model, on_nonfinite="skip", optimizer=opt, max_consecutive_skips=2)
        opt.step()
    assert SkipGuard.of(opt).total_skips == 6


def closure_for(model: torch.nn.Module, opt: torch.optim.Optimizer, poison: bool) -> Any:
    """A training closure (backward and the check inside it), as Lightning's automatic optimization
    hands ``optimizer.step``. Returns the closure and the list its losses are appended to."""
    losses: list[torch.Tensor] = []
    x = torch.randn(4, 6)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        if poison:
            model[2].weight.grad[1, 1] = math.nan
        nanscan.check(model, max_norm=1.0, on_nonfinite="skip", optimizer=opt)
        losses.append(loss)
        return loss

    return closure, losses


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("as_keyword", [False, True])
def test_closure_step_is_decided_after_the_closure(
    fused: bool, as_keyword: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check runs inside the closure, so inside step(): the guard runs the closure first, then
    decides on the flag that check handed it; both outcomes return the closure's loss."""
    model, opt = setup(fused)
    SkipGuard.of(opt)  # before the first step, as the module notes ask
    pattern = [True, False, True, True, False]  # a NaN at the very first step too
    for poison in pattern:
        closure, losses = closure_for(model, opt, poison)
        before = params(model)
        with torch.no_grad(), monkeypatch.context() as m:  # the guard must enable grad for the closure
            if fused:  # the device-side path must not read the flag on the host
                m.setattr(torch.Tensor, "__bool__", lambda self: (_ for _ in ()).throw(AssertionError("host sync")))
                m.setattr(torch.Tensor, "item", lambda self: (_ for _ in ()).throw(AssertionError("host sync")))
            result = opt.step(closure=closure) if as_keyword else opt.step(closure)
        after = params(model)
        assert len(losses) == 1, "the closure must run exactly once"
        assert result is losses[0], "step must return the closure's loss, skipped or not"
        changed = any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))
        assert changed == (not poison), f"poison={poison}: parameters {'changed' if changed else 'unchanged'}"
        assert all(torch.isfinite(p).all() for p in after)
    guard = SkipGuard.of(opt)
    assert guard.total_skips == 3 and guard.consecutive_skips == 0 and not guard.last_skipped
    if fused:
        assert opt.state[next(iter(model.parameters()))]["step"].item() == 2


def test_closure_step_clips_before_the_update() -> None:
    """The clip made inside the closure is what the step applies: SGD moves by lr times the clipped
    gradient, whose norm is at most max_norm."""
    model, opt = setup()
    SkipGuard.of(opt)
    closure, _ = closure_for(model, opt, poison=False)
    before = params(model)
    opt.step(closure)
    moved = torch.cat([(b - a).reshape(-1) for a, b in zip(params(model), before, strict=True)])
    clipped = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    assert clipped.norm().item() == pytest.approx(1.0, rel=1e-5)  # this model's gradient norm is > 1
    torch.testing.assert_close(moved, 0.1 * clipped)


def test_first_closure_step_without_a_guard_warns_and_leaves_no_stale_flag() -> None:
    """Without SkipGuard.of before the first step, that step starts unguarded; the flag its closure
    armed must not decide the second step (here a NaN one, which must still be skipped)."""
    model, opt = setup()
    closure, _ = closure_for(model, opt, poison=False)
    with pytest.warns(RuntimeWarning, match=r"could not be skipped.*call nanscan\.SkipGuard\.of"):
        opt.step(closure)
    for poison in [True, False]:
        closure, _ = closure_for(model, opt, poison)
        before = params(model)
        opt.step(closure)
        changed = any(not torch.equal(a, b) for a, b in zip(before, params(model), strict=True))
        assert changed == (not poison)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_closure_without_a_check_is_an_ordinary_step() -> None:
    model, opt = setup()
    SkipGuard.of(opt)
    x = torch.randn(4, 6)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = model(x).sum()
        loss.backward()
        return loss

    before = params(model)
    assert opt.step(closure) is not None
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model), strict=True))


def lbfgs_run(guarded: bool, check_in_closure: bool) -> tuple[list[torch.Tensor], int]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    if guarded:
        SkipGuard.of(opt)
    x = torch.randn(4, 6)
    calls = 0

    def closure() -> torch.Tensor:
        nonlocal calls
        calls += 1
        opt.zero_grad()
        loss = model(x).pow(2).sum()
        loss.backward()
        if check_in_closure:
            nanscan.check(model, on_nonfinite="skip", optimizer=opt)
        return loss

    opt.step(closure)
    return params(model), calls


def test_lbfgs_keeps_calling_its_own_closure() -> None:
    """LBFGS evaluates the closure several times per step: the guard leaves its step as it was (it
    does not run the closure first); a check made before the step still skips it."""
    reference, reference_calls = lbfgs_run(guarded=False, check_in_closure=False)
    result, calls = lbfgs_run(guarded=True, check_in_closure=False)
    assert calls == reference_calls > 1
    assert all(torch.equal(a, b) for a, b in zip(reference, result, strict=True))

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = torch.optim.LBFGS(model.parameters(), max_iter=4)
    backward(model, poison=True)
    nanscan.check(model, on_nonfinite="skip", optimizer=opt)  # armed before the step
    before = params(model)
    assert opt.step(lambda: model(torch.randn(4, 6)).sum()) is None
    assert all(torch.equal(a, b) for a, b in zip(before, params(model), strict=True))


def test_lr_scheduler_created_after_the_guard() -> None:
    """torch's LR schedulers rebind optimizer.step.__func__ to count steps: the guard's step is a
    bound method, so a scheduler made after the first check works and sees the steps."""
    model, opt = setup()
    backward(model, False)
    nanscan.check(model, on_nonfinite="skip", optimizer=opt)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "lr_scheduler.step() before optimizer.step()" warning
        scheduler.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05)


class Wrapper(torch.optim.Optimizer):
    """An optimizer wrapper that skips Optimizer.__init__, like accelerate's AcceleratedOptimizer."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer
        self.defaults = optimizer.defaults
        self.param_groups = optimizer.param_groups
        self.state = optimizer.state

    def step(self, closure: Any = None) -> Any:
        return self.optimizer.step(closure)


@pytest.mark.parametrize("poison", [False, True])
def test_guard_on_a_wrapper_that_skips_optimizer_init(poison: bool) -> None:
    model, inner = setup()
    opt = Wrapper(inner)
    backward(model, poison)
    before = params(model)
    nanscan.check(model, on_nonfinite="skip", optimizer=opt)
    opt.step()
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model), strict=True)) == (not poison)
