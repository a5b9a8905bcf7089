"""nanscan.amp.GradScaler: a drop-in for torch.amp.GradScaler (same trajectory, same skipped steps,
same parameters), with the fused unscale's statistics kept and reused while the gradients are unchanged."""

from __future__ import annotations

import math

import pytest
import torch

import nanscan
import nanscan.amp
from conftest import DEVICES


def model_and_optimizer(device: str, seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def train(scaler_cls: type, device: str, dtype: torch.dtype, steps: int, overflow_steps: set[int], clip: str | None):
    """Trains under autocast with a scaler; at `overflow_steps` a gradient is made Inf. Returns the
    scale after every step, which steps were skipped (scale backed off) and the final parameters."""
    model, opt = model_and_optimizer(device)
    scaler = scaler_cls(device, init_scale=2.0**12, growth_interval=3)
    gen = torch.Generator().manual_seed(1)
    scales, reports = [], []
    for step in range(steps):
        x = torch.randn(8, 16, generator=gen).to(device)
        y = torch.randn(8, 4, generator=gen).to(device)
        with torch.autocast(device, dtype=dtype):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        if step in overflow_steps:
            model[2].weight.grad[0, 0] = math.inf
        scaler.unscale_(opt)
        if clip == "nanscan":
            nanscan.clip_grad_norm_(model.parameters(), 0.5)
        elif clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        if isinstance(scaler, nanscan.amp.GradScaler):
            reports.append(scaler.skipped)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, reports, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_parity_with_torch_grad_scaler(device: str, dtype: torch.dtype) -> None:
    overflow = {2, 3, 9}
    ours = train(nanscan.amp.GradScaler, device, dtype, 14, overflow, clip="nanscan")
    theirs = train(torch.amp.GradScaler, device, dtype, 14, overflow, clip="torch")
    assert ours[0] == theirs[0], "scale trajectories differ"
    assert ours[1] == [s in overflow for s in range(14)], "skipped flags"
    for a, b in zip(ours[2], theirs[2]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
def test_unscale_bit_exact_and_report(device: str) -> None:
    model, opt = model_and_optimizer(device)
    scaler = nanscan.amp.GradScaler(device, init_scale=1024.0)
    scaler.scale(model(torch.randn(4, 16, device=device)).sum()).backward()
    model[0].bias.grad[3] = math.nan
    expected = [p.grad.clone() for p in model.parameters()]
    found = torch.zeros((), device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, found, torch.tensor(1 / 1024.0, device=device))
    scaler.unscale_(opt)
    for p, e in zip(model.parameters(), expected):
        assert torch.equal(p.grad.nan_to_num(), e.nan_to_num())
    report = scaler.last_report
    assert report is not None and not report.finite and report.nonfinite == ["group0.param1"]
    assert scaler.skipped
    want_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert math.isnan(report.total_norm) and math.isnan(want_norm)


def test_reuse_after_unscale_and_recompute_after_change(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = model_and_optimizer("cpu")
    scaler = nanscan.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(model(torch.randn(4, 16)).sum()).backward()
    scaler.unscale_(opt)
    calls = []
    real_scan = nanscan.scan.__globals__["scan_op"]
    monkeypatch.setitem(nanscan.scan.__globals__, "scan_op", lambda t, *a: calls.append(len(t)) or real_scan(t, *a))
    first = nanscan.check(model)
    assert calls == [], "the unscaled statistics were not reused"
    assert first.stats is scaler.last_report.stats
    with torch.no_grad():
        model[2].weight.grad.mul_(2.0)  # an in-place change bumps the version counter
    second = nanscan.check(model)
    assert calls == [4], "a modified gradient must be scanned again"
    assert second.total_norm > first.total_norm


def test_reuse_is_not_fooled_by_reallocated_gradients() -> None:
    model, opt = model_and_optimizer("cpu")
    scaler = nanscan.amp.GradScaler("cpu", init_scale=1.0)  # inv_scale 1: nothing written, versions unchanged
    scaler.scale(model(torch.randn(4, 16)).sum()).backward()
    scaler.unscale_(opt)
    before = scaler.last_report.total_norm
    opt.zero_grad(set_to_none=True)
    model(torch.randn(4, 16) * 100).sum().backward()  # new tensors, maybe at the same addresses
    after = nanscan.check(model).total_norm
    assert after == pytest.approx(torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item(), rel=1e-6)
    assert after != before


def test_scaler_rejects_fp16_grads_like_torch() -> None:
    model, opt = model_and_optimizer("cpu")
    model.half()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    scaler = nanscan.amp.GradScaler("cpu")
    scaler.scale(torch.ones(()))
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients"):
        scaler.unscale_(opt)


def advisor_for(grad_fn) -> nanscan.amp.Advice:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    advisor = nanscan.amp.Advisor()
    for step in range(3):
        for name, p in model.named_parameters():
            p.grad = grad_fn(name, p)
        advisor.observe(model)
    return advisor.advise()


def test_advisor_recommendations() -> None:
    normal = advisor_for(lambda n, p: torch.randn_like(p) * 1e-2)
    assert normal.recommendation == "keep", str(normal)
    overflowing = advisor_for(lambda n, p: torch.randn_like(p) * 1e6)
    assert overflowing.recommendation == "bf16", str(overflowing)
    one_module = advisor_for(lambda n, p: torch.randn_like(p) * (1e6 if n.startswith("3.") else 1e-2))
    assert one_module.recommendation == "fp32-modules" and one_module.fp32_modules == ["3"], str(one_module)
    tiny = advisor_for(lambda n, p: torch.randn_like(p) * 1e-9)
    assert tiny.recommendation == "loss-scale", str(tiny)
    scale = tiny.suggested_init_scale
    assert scale is not None and math.log2(scale).is_integer()
    peak = 4.5e-9  # randn * 1e-9 over ~13k values per step peaks near 4e-9
    assert 2**38 <= scale <= 2**44 and scale * peak < 65504, "a power of two that keeps the peak under fp16's limit"
    assert "flush them to zero" in str(tiny)


def test_advisor_observe_does_not_sync(monkeypatch: pytest.MonkeyPatch) -> None:
    model, _ = model_and_optimizer("cpu")
    model(torch.randn(2, 16)).sum().backward()
    advisor = nanscan.amp.Advisor()
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", lambda self: (_ for _ in ()).throw(AssertionError("host sync")))
        m.setattr(torch.Tensor, "tolist", lambda self: (_ for _ in ()).throw(AssertionError("host sync")))
        m.setattr(torch.Tensor, "__bool__", lambda self: (_ for _ in ()).throw(AssertionError("host sync")))
        for _ in range(3):
            advisor.observe(model)
    assert advisor.advise().recommendation == "keep"
    with pytest.raises(RuntimeError, match="observe\\(\\) at least once"):
        nanscan.amp.Advisor().advise()


def test_watch_names_parameters_in_reports() -> None:
    model, opt = model_and_optimizer("cpu")
    scaler = nanscan.amp.GradScaler("cpu", init_scale=2.0).watch(model)
    scaler.scale(model(torch.randn(2, 16)).sum()).backward()
    model[2].bias.grad[0] = math.inf
    scaler.unscale_(opt)
    assert scaler.last_report.nonfinite == ["2.bias"]


def test_kept_statistics_are_forgotten_after_the_step() -> None:
    model, opt = model_and_optimizer("cpu")
    scaler = nanscan.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(model(torch.randn(4, 16)).sum()).backward()
    scaler.unscale_(opt)
    assert nanscan.scan.__globals__["_reusable"] is not None
    scaler.step(opt)
    assert nanscan.scan.__globals__["_reusable"] is None
