"""nanscan.check_state: the weights and every floating tensor of the optimizer's state in one fused
scan, named ``param`` and ``param:key``, held against the fp64 reference."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

import nanscan

from conftest import assert_matches_reference, needs_cuda, syncs_refused

Make = Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS: dict[str, tuple[Make, tuple[str, ...]]] = {
    "adam": (lambda p: torch.optim.Adam(p, lr=1e-2), ("exp_avg", "exp_avg_sq")),
    "adamw-amsgrad-foreach": (
        lambda p: torch.optim.AdamW(p, lr=1e-2, amsgrad=True, foreach=True),
        ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"),
    ),
    "adamw-fused": (lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True), ("exp_avg", "exp_avg_sq")),
    "sgd-momentum": (lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9), ("momentum_buffer",)),
    "rmsprop-centered": (
        lambda p: torch.optim.RMSprop(p, lr=1e-3, centered=True, momentum=0.5),
        ("square_avg", "momentum_buffer", "grad_avg"),
    ),
}


def model_after_steps(
    make: Make, steps: int = 2, dtype: torch.dtype = torch.float32
) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)).to(dtype)
    optimizer = make(list(model.parameters()))
    for _ in range(steps):
        optimizer.zero_grad()
        model(torch.randn(4, 6, dtype=dtype)).square().mean().backward()
        optimizer.step()
    return model, optimizer


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
def test_every_state_tensor_is_scanned_and_named(kind: str) -> None:
    make, keys = OPTIMIZERS[kind]
    model, optimizer = model_after_steps(make)
    report = nanscan.check_state(model, optimizer)
    params = ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert report.names == params + [f"{p}:{k}" for p in params for k in keys]
    tensors = [p.detach() for p in model.parameters()] + [
        optimizer.state[p][k] for p in model.parameters() for k in keys
    ]
    assert_matches_reference(report.stats, tensors)
    assert report.finite


@pytest.mark.parametrize("kind", list(OPTIMIZERS))
@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_a_nan_or_inf_in_each_kind_of_state_is_named(kind: str, value: float) -> None:
    make, keys = OPTIMIZERS[kind]
    for key in keys:
        model, optimizer = model_after_steps(make)
        optimizer.state[model[2].weight][key].view(-1)[3] = value
        report = nanscan.check_state(model, optimizer)
        assert report.nonfinite == [f"2.weight:{key}"], (key, report.nonfinite)


def test_weights_that_go_nan_after_a_step_with_finite_gradients() -> None:
    """Adam with eps=0 on a parameter whose gradient is exactly zero: 0 / (sqrt(0) + 0) is NaN."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3, eps=0.0)
    model(torch.zeros(4, 3)).sum().backward()  # weight's gradient is zero, bias's is not
    gradients = nanscan.check(model)
    optimizer.step()
    after = nanscan.check_state(model, optimizer)
    assert gradients.finite, "the gradients were finite"
    assert after.nonfinite == ["weight"], after.nonfinite


def test_parameters_alone_and_named_pairs() -> None:
    model, optimizer = model_after_steps(OPTIMIZERS["sgd-momentum"][0])
    alone = nanscan.check_state(model)
    assert alone.names == ["0.weight", "0.bias", "2.weight", "2.bias"]
    pairs = [("first", model[0].weight), ("last", model[2].bias)]
    named = nanscan.check_state(pairs, optimizer)
    # The optimizer's other parameters are named by their place in it.
    assert named.names[:2] == ["first", "last"]
    assert "first:momentum_buffer" in named.names and "group0.param1:momentum_buffer" in named.names
    positional = nanscan.check_state(list(model.parameters()))
    assert positional.names == ["param0", "param1", "param2", "param3"]


def test_mixed_dtypes_and_the_step_counters_left_out() -> None:
    model, optimizer = model_after_steps(OPTIMIZERS["adam"][0], dtype=torch.bfloat16)
    report = nanscan.check_state(model, optimizer)
    assert not any(name.endswith(":step") for name in report.names)
    tensors = [p.detach() for p in model.parameters()] + [
        optimizer.state[p][k] for p in model.parameters() for k in ("exp_avg", "exp_avg_sq")
    ]
    assert_matches_reference(report.stats, tensors)


def test_the_recorder_keeps_state_reports() -> None:
    model, optimizer = model_after_steps(OPTIMIZERS["adam"][0])
    records: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder([records.append], every=1, warn=False)
    optimizer.state[model[0].bias]["exp_avg"][0] = math.nan
    nanscan.check_state(model, optimizer, recorder=recorder)
    recorder.close()
    assert len(records) == 1 and not records[0].finite and records[0].nonfinite == ["0.bias:exp_avg"]


def test_bad_input() -> None:
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match=r"no state yet .* first optimizer\.step\(\)"):
        nanscan.check_state(model, torch.optim.Adam(model.parameters()))
    with pytest.raises(TypeError, match=r"optimizer must be a torch\.optim\.Optimizer, got Linear"):
        nanscan.check_state(model, model)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="entry 1 is a str, not a tensor"):
        nanscan.check_state([model.weight, "bias"])  # type: ignore[list-item]
    with pytest.raises(TypeError, match=r"recorder must be a nanscan\.Recorder"):
        nanscan.check_state(model, recorder=[])  # type: ignore[arg-type]


@pytest.mark.cuda
@needs_cuda
def test_cuda_state_check_without_a_sync() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 32).cuda()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    model(torch.randn(8, 64, device="cuda")).sum().backward()
    optimizer.step()
    nanscan.check_state(model, optimizer)  # the first list uploads nothing it will not reuse
    torch.cuda.synchronize()
    with syncs_refused():
        report = nanscan.check_state(model, optimizer)
    assert report.finite and len(report.names) == 6


def test_a_frameworks_optimizer_hugging_faces_adafactor() -> None:
    """transformers' Adafactor keeps factored moments (exp_avg_sq_row/col) and the weight's RMS (a
    0-dim tensor) per parameter, and an integer step: every floating tensor is scanned, whatever its
    key; the step is not."""
    optimization = pytest.importorskip("transformers.optimization")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    optimizer = optimization.Adafactor(model.parameters(), lr=1e-3, relative_step=False, scale_parameter=False)
    model(torch.randn(4, 6)).square().mean().backward()
    optimizer.step()
    optimizer.state[model[0].weight]["exp_avg_sq_row"][1] = math.inf
    report = nanscan.check_state(model, optimizer)
    assert "0.weight:exp_avg_sq_col" in report.names and "0.bias:exp_avg_sq" in report.names, report.names
    assert "0.weight:RMS" in report.names and not any(name.endswith(":step") for name in report.names)
    assert report.nonfinite == ["0.weight:exp_avg_sq_row"], report.nonfinite
