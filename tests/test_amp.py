"""nanscan.amp.GradScaler: a drop-in for torch.amp.GradScaler (same trajectory, same skipped steps,
same parameters, fused and plain optimizers); statistics reused only inside one call, so a write
through ``.data`` between unscale_ and a check is always seen; the Advisor."""

from __future__ import annotations

import math
import sys

import pytest
import torch

import nanscan
import nanscan.amp

from conftest import DEVICES


def model_and_optimizer(
    device: str, seed: int = 0, fused: bool = False
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)
    if fused:
        return model, torch.optim.AdamW(model.parameters(), lr=0.01, fused=True)
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


# How a training loop under test clips after backward: not at all; torch's unscale_ + clip_grad_norm_;
# nanscan's unscale_ + clip_grad_norm_ (two calls: the clip scans again); the scaler's one-call
# clip_grad_norm_ (the clip uses the unscale's own scan).
CLIPS = ["none", "torch", "nanscan", "scaler"]


def train(
    scaler_cls: type,
    device: str,
    dtype: torch.dtype,
    steps: int,
    overflow_steps: set[int],
    clip: str,
    fused: bool = False,
    data_writes: dict[int, float] | None = None,
) -> tuple[list[float], list[bool], list[torch.Tensor]]:
    """Trains under autocast with a scaler; at `overflow_steps` a gradient is made Inf before the
    unscale; at the steps of `data_writes` a gradient element is overwritten through ``.data`` after
    the unscale (bypassing version counters). Returns the scale after every step, which steps nanscan's
    scaler reported skipped, and the final parameters."""
    model, opt = model_and_optimizer(device, fused=fused)
    scaler = scaler_cls(device, init_scale=2.0**12, growth_interval=3)
    gen = torch.Generator().manual_seed(1)
    data_writes = data_writes or {}
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
        if clip == "scaler":
            if step in data_writes:  # before the one call, so it is part of what the call scans
                model[0].weight.grad.data[1, 1] = data_writes[step] * scaler.get_scale()
            scaler.clip_grad_norm_(opt, 0.5)
        elif clip != "none":
            scaler.unscale_(opt)
            if step in data_writes:
                model[0].weight.grad.data[1, 1] = data_writes[step]
            clip_fn = nanscan.clip_grad_norm_ if clip == "nanscan" else torch.nn.utils.clip_grad_norm_
            clip_fn(model.parameters(), 0.5)
        if isinstance(scaler, nanscan.amp.GradScaler) and clip != "none":
            reports.append(scaler.skipped)
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return scales, reports, [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("clip", ["none", "nanscan", "scaler"])
@pytest.mark.parametrize("fused", [False, True], ids=["sgd", "adamw-fused"])
def test_parity_with_torch_grad_scaler(device: str, dtype: torch.dtype, clip: str, fused: bool) -> None:
    overflow = {2, 3, 9}
    writes = {5: 40.0, 11: -7.5}  # large enough to change the clip coefficient
    torch_clip = "none" if clip == "none" else "torch"
    ours = train(nanscan.amp.GradScaler, device, dtype, 14, overflow, clip, fused, writes)
    theirs = train(torch.amp.GradScaler, device, dtype, 14, overflow, torch_clip, fused, writes)
    assert ours[0] == theirs[0], "scale trajectories differ"
    if clip != "none":
        assert ours[1] == [s in overflow for s in range(14)], "skipped flags"
    for a, b in zip(ours[2], theirs[2], strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_data_write_after_unscale_is_seen_by_every_later_call() -> None:
    """The reproduction of the stale-statistics defect: a NaN written through .data (or numpy) after
    unscale_ bumps no version counter; scan, check and clip_grad_norm_ must all still see it."""
    for write in ("data", "numpy"):
        model, opt = model_and_optimizer("cpu")
        scaler = nanscan.amp.GradScaler("cpu", init_scale=16.0)
        scaler.scale(model(torch.randn(4, 16)).sum()).backward()
        scaler.unscale_(opt)
        assert scaler.last_report is not None and scaler.last_report.finite
        if write == "data":
            model[0].weight.grad.data[0, 0] = math.nan
        else:
            model[0].weight.grad.numpy()[0, 0] = math.nan
        grads = [p.grad for p in model.parameters()]
        assert nanscan.scan(grads).nan_count.tolist() == [1, 0, 0, 0], write
        report = nanscan.check(model)
        assert not report.finite and report.nonfinite == ["0.weight"], write
        assert math.isnan(nanscan.clip_grad_norm_(model.parameters(), 1.0).item()), write


def count_calls(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts calls of the scan op (a read of the gradients) and of the fused unscale op."""
    calls = {"scan": 0, "unscale_scan_": 0}
    # Every scan reads through nanscan.fused (the local fused scan), whatever the layout.
    for module, name in ((sys.modules["nanscan.fused"], "scan_op"), (nanscan.amp, "unscale_scan_")):
        real = getattr(module, name)
        key = "unscale_scan_" if name == "unscale_scan_" else "scan"

        def counting(*args: object, _real: object = real, _key: str = key) -> object:
            calls[_key] += 1
            return _real(*args)  # type: ignore[operator]

        monkeypatch.setattr(module, name, counting)
    return calls


@pytest.mark.parametrize("max_norm", [1e6, 1e-3], ids=["no-clip", "clip"])
def test_scaler_clip_grad_norm_is_one_pass_and_matches_torch(max_norm: float, monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = model_and_optimizer("cpu")
    ref_model, ref_opt = model_and_optimizer("cpu")
    x = torch.randn(4, 16)
    scaler = nanscan.amp.GradScaler("cpu", init_scale=1024.0).watch(model)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(model(x).sum()).backward()
    ref_scaler.scale(ref_model(x).sum()).backward()
    calls = count_calls(monkeypatch)
    versions = [p.grad._version for p in model.parameters()]
    total = scaler.clip_grad_norm_(opt, max_norm)
    assert calls == {"scan": 0, "unscale_scan_": 1}, "unscale, check and clip must be one read"
    ref_scaler.unscale_(ref_opt)
    ref_total = torch.nn.utils.clip_grad_norm_(ref_model.parameters(), max_norm)
    torch.testing.assert_close(total, ref_total)
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)
    written = [p.grad._version - v for p, v in zip(model.parameters(), versions, strict=True)]
    assert written == [2 if max_norm < 1 else 1] * 4, "the unscale writes once; the clip only when it clips"
    report = scaler.last_report
    assert report is not None and report.finite and report.max_norm == max_norm
    assert report.clipped == (max_norm < 1) and report.total_norm == pytest.approx(ref_total.item(), rel=1e-6)
    assert report.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    with pytest.raises(RuntimeError, match=r"unscale_\(\) has already been called"):
        scaler.unscale_(opt)  # torch's own rule: one unscale per step


def test_scaler_clip_after_unscale_scans_again(monkeypatch: pytest.MonkeyPatch) -> None:
    model, opt = model_and_optimizer("cpu")
    scaler = nanscan.amp.GradScaler("cpu", init_scale=256.0)
    scaler.scale(model(torch.randn(4, 16)).sum()).backward()
    scaler.unscale_(opt)
    model[2].bias.grad.data[0] = math.inf
    calls = count_calls(monkeypatch)
    total = scaler.clip_grad_norm_(opt, 1.0)
    assert calls == {"scan": 1, "unscale_scan_": 0}, "already unscaled: one fresh scan, no second unscale"
    assert math.isinf(total.item()) and scaler.last_report is not None
    assert scaler.last_report.nonfinite == ["group0.param3"]


def test_disabled_scaler_clip_grad_norm_clips() -> None:
    model, opt = model_and_optimizer("cpu")
    ref_model, _ = model_and_optimizer("cpu")
    scaler = nanscan.amp.GradScaler("cpu", enabled=False)
    x = torch.randn(4, 16)
    scaler.scale(model(x).sum()).backward()
    ref_model(x).sum().backward()
    total = scaler.clip_grad_norm_(opt, 1e-2)
    torch.testing.assert_close(total, torch.nn.utils.clip_grad_norm_(ref_model.parameters(), 1e-2))
    for p, q in zip(model.parameters(), ref_model.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad)


def test_report_of_fused_optimizer_describes_unscaled_gradients() -> None:
    """With fused=True torch's scaler never unscales: the scan sees scaled gradients, the report must not."""
    scale = 65536.0
    model, opt = model_and_optimizer("cpu", fused=True)
    scaler = nanscan.amp.GradScaler("cpu", init_scale=scale)
    scaler.scale(model(torch.randn(4, 16)).sum()).backward()
    unscaled = [p.grad.detach().double() / scale for p in model.parameters()]
    scaler.step(opt)  # scans the still-scaled gradients, the fused AdamW unscales inside its step
    scaler.update()
    report = scaler.last_report
    assert report is not None and report.finite
    want_total = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in unscaled])).item()
    assert report.total_norm == pytest.approx(want_total, rel=1e-6)
    values = report.to_dict()["parameters"]
    for (name, stats), g in zip(values.items(), unscaled, strict=True):
        assert stats["min"] == g.min().item() and stats["max"] == g.max().item(), name
        assert stats["norm"] == pytest.approx(torch.linalg.vector_norm(g).item(), rel=1e-6), name


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
    for p, e in zip(model.parameters(), expected, strict=True):
        assert torch.equal(p.grad.nan_to_num(), e.nan_to_num())
    report = scaler.last_report
    assert report is not None and not report.finite and report.nonfinite == ["group0.param1"]
    assert scaler.skipped
    want_norm = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    assert math.isnan(report.total_norm) and math.isnan(want_norm)


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
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.Linear(64, 4)
    )
    advisor = nanscan.amp.Advisor()
    for _ in range(3):
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


def test_advisor_names_parameters_with_nonfinite_gradients() -> None:
    """Observed NaN/Inf gradients change the advice, whatever fp16's range would say of the rest."""

    def grads(name: str, p: torch.Tensor) -> torch.Tensor:
        g = torch.randn_like(p) * 1e-2
        if name == "2.weight":
            g.view(-1)[5] = math.inf
        return g

    advice = advisor_for(grads)
    assert advice.recommendation == "nonfinite", str(advice)
    assert advice.nonfinite == ["2.weight"]
    text = str(advice)
    assert "3 of 3 observed step(s) had NaN/Inf gradients" in text and "2.weight (Inf in 3 step(s))" in text
    assert "the range evidence alone would say 'keep'" in text and "nanscan.locate" in text

    calls = 0

    def one_nan_step(name: str, p: torch.Tensor) -> torch.Tensor:
        nonlocal calls
        calls += 1
        g = torch.randn_like(p) * 1e-2
        if name == "0.bias" and calls <= 6:  # in the first step only (6 parameters per step)
            g[0] = math.nan
        return g

    advice = advisor_for(one_nan_step)
    assert advice.recommendation == "nonfinite" and advice.nonfinite == ["0.bias"], str(advice)
    assert "1 of 3 observed step(s)" in str(advice) and "0.bias (NaN in 1 step(s))" in str(advice)


def test_sparse_gradient_takes_torchs_unscale_and_each_gradient_is_unscaled_once() -> None:
    """A sparse gradient is refused by the fused op before it writes anything; the whole list then goes
    through torch's unscale, so no gradient is divided twice."""

    def unscaled(scaler_type: type[torch.amp.GradScaler]) -> list[torch.Tensor]:
        dense = torch.nn.Parameter(torch.zeros(3))
        dense.grad = torch.tensor([4.0, 8.0, -12.0])
        sparse = torch.nn.Parameter(torch.zeros(5, 2))
        sparse.grad = torch.sparse_coo_tensor([[1, 3]], torch.tensor([[4.0, 4.0], [8.0, 8.0]]), (5, 2))
        optimizer = torch.optim.SGD([dense, sparse], lr=0.1)
        scaler = scaler_type("cpu", init_scale=4.0)
        scaler.scale(torch.ones(()))
        scaler.unscale_(optimizer)
        return [dense.grad, sparse.grad.to_dense()]

    ours, theirs = unscaled(nanscan.amp.GradScaler), unscaled(torch.amp.GradScaler)
    assert torch.equal(ours[0], torch.tensor([1.0, 2.0, -3.0]))
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b)


def test_report_names_skip_parameters_without_a_gradient() -> None:
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(4)]
    params[0].grad = torch.ones(2)
    params[2].grad = torch.tensor([1.0, math.nan])
    params[3].grad = torch.ones(2)
    optimizer = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
    scaler = nanscan.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(torch.ones(()))
    scaler.unscale_(optimizer)
    report = scaler.last_report
    assert report is not None and report.names == ["group0.param0", "group1.param0", "group1.param1"]
    assert report.nonfinite == ["group1.param0"]
