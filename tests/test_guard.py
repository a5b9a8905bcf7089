"""check(..., on_nonfinite=...): ignore, warn, raise, skip (with counters and a consecutive limit)."""

from __future__ import annotations

import math

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
        else:
            nanscan.check(model, on_nonfinite="skip", optimizer=opt)
            opt.step()
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
    backward(model, False)
    before = params(model)
    opt.step()  # no check this step: runs normally
    assert any(not torch.equal(a, b) for a, b in zip(before, params(model), strict=True))


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
