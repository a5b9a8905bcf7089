"""check(model) and Report: names, lazy sync, clipping parity, accepted inputs."""

from __future__ import annotations

import json
import math
import pickle

import pytest
import torch

import nanscan
from nanscan.layouts.single import listed_gradients

from conftest import DEVICES


def tiny_model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.ReLU(),
        torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh()),
        torch.nn.Linear(16, 1),
    ).to(device)
    model(torch.randn(32, 8, device=device)).pow(2).mean().backward()
    return model


@pytest.mark.parametrize("device", DEVICES)
def test_finite_model(device: str) -> None:
    model = tiny_model(device)
    report = nanscan.check(model)
    assert report.finite and report.nonfinite == []
    assert report.names == [n for n, _ in model.named_parameters()]
    want = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()])
    assert report.total_norm == pytest.approx(want.item(), rel=1e-6)
    assert report.clip_coef is None and not report.clipped


@pytest.mark.parametrize("device", DEVICES)
def test_names_the_bad_parameters(device: str) -> None:
    model = tiny_model(device)
    model[2][0].weight.grad[1, 2] = math.nan
    model[3].bias.grad[0] = -math.inf
    report = nanscan.check(model)
    assert not report.finite
    assert report.nonfinite == ["2.0.weight", "3.bias"]
    d = report.to_dict()
    assert d["parameters"]["2.0.weight"]["nan_count"] == 1 and d["parameters"]["3.bias"]["inf_count"] == 1
    assert math.isnan(d["total_norm"])
    text = str(report)
    assert "NON-FINITE in 2 of 6" in text
    lines = text.splitlines()
    assert lines[2].startswith("2.0.weight") and lines[3].startswith("3.bias"), "worst first"


def test_building_a_report_does_not_sync_and_reading_copies_once_per_stage() -> None:
    """Building syncs nothing; the totals come in one small copy; the per-parameter rows in one more,
    once, however many values are read."""
    model = tiny_model()
    report = nanscan.check(model)
    assert report._scalars is None and report._host is None and "not yet synced" in repr(report)
    copies = []
    real_cpu = torch.Tensor.cpu

    def counting_cpu(self: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        copies.append(self.numel())
        return real_cpu(self, *args, **kwargs)

    torch.Tensor.cpu = counting_cpu  # type: ignore[method-assign]
    try:
        _ = report.finite, report.total_norm, report.clip_coef
        assert len(copies) == 1 and copies[0] <= 3 and report._host is None, "the totals alone, in one copy"
        _ = report.nonfinite, report.to_dict(), str(report), report.table()
        assert len(copies) == 2, f"{len(copies)} copies"
    finally:
        torch.Tensor.cpu = real_cpu  # type: ignore[method-assign]
    assert "synced" in repr(report)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm_type", [2.0, math.inf, 1.0])
def test_check_with_max_norm_clips_like_torch(device: str, norm_type: float) -> None:
    model = tiny_model(device)
    twin = tiny_model(device)
    report = nanscan.check(model, max_norm=0.05, norm_type=norm_type)
    total = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05, norm_type)
    assert report.total_norm == pytest.approx(total.item(), rel=1e-6)
    assert report.clipped and report.clip_coef < 1
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=2e-6, atol=1e-30)


def test_check_without_need_to_clip_does_not_write() -> None:
    model = tiny_model()
    versions = [p.grad._version for p in model.parameters()]
    report = nanscan.check(model, max_norm=1e9)
    assert report.clip_coef == 1.0 and not report.clipped
    assert versions == [p.grad._version for p in model.parameters()]


def test_accepts_params_pairs_and_skips_missing_grads() -> None:
    model = tiny_model()
    model[0].bias.grad = None
    by_params = nanscan.check(model.parameters())
    assert by_params.names == ["[0]", "[2]", "[3]", "[4]", "[5]"]
    pairs = nanscan.check(list(model.named_parameters()))
    assert pairs.names == ["0.weight", "2.0.weight", "2.0.bias", "3.weight", "3.bias"]
    assert by_params.total_norm == pairs.total_norm
    single = nanscan.check(model[0].weight)
    assert single.names == ["[0]"]


def test_positional_names_read_like_a_list_of_strings() -> None:
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(4)]
    for i in (0, 1, 3):
        params[i].grad = torch.full((2,), float(i))
    params[3].grad[1] = math.nan
    names, _, _ = listed_gradients(params)  # lazy: formed on reading
    assert names == ["[0]", "[1]", "[3]"] and names == ["[0]", "[1]", "[3]"] and names != ["[0]"]
    assert (
        len(names) == 3 and names[-1] == "[3]" and names[1:] == ["[1]", "[3]"] and names[::-1] == ["[3]", "[1]", "[0]"]
    )
    assert (
        "[3]" in names and names.index("[3]") == 2 and names != "[0][1][3]" and repr(names) == "['[0]', '[1]', '[3]']"
    )
    report = nanscan.check(params)
    assert report.names == names and report.nonfinite == ["[3]"] and "[3]" in report.table()
    assert nanscan.check(iter(params)).names == names  # a one-shot iterator: read once
    mixed = nanscan.check([params[0], ("head", params[3])])  # pairs and parameters together
    assert mixed.names == ["[0]", "head"]


@pytest.mark.parametrize("device", DEVICES)
def test_check_and_clip_trace_with_fullgraph(device: str) -> None:
    """check (by parameters, with a gap, and by module) and clip_grad_norm_ stay traceable whole, as
    torch's clip_grad_norm_ is; the traced calls give the eager results."""
    model = tiny_model(device)
    params = list(model.parameters())
    params[1].grad = None  # a gap: positions, not a range
    calls = {
        "check(params)": (lambda ps: nanscan.check(ps, max_norm=1e9).total_norm_tensor, params),
        "check(model)": (lambda m: nanscan.check(m, max_norm=1e9).total_norm_tensor, model),
        "clip_grad_norm_": (lambda ps: nanscan.clip_grad_norm_(ps, 1e9), params),
    }
    for name, (call, arg) in calls.items():
        torch._dynamo.reset()
        traced = torch.compile(call, fullgraph=True)(arg)
        torch.testing.assert_close(traced, call(arg), rtol=0, atol=0, msg=name)


def test_report_names_are_a_list() -> None:
    """Positional names are formed lazily, but a report hands out a plain list (JSON, +, pickle)."""
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(3)]
    for p in params[1:]:
        p.grad = torch.ones(2)
    report = nanscan.check(params)
    assert type(report.names) is list and report.names == ["[1]", "[2]"]
    assert json.loads(json.dumps(report.names)) == ["[1]", "[2]"] and [*report.names, "x"] == ["[1]", "[2]", "x"]
    names, _, _ = listed_gradients(params)
    assert names == ["[1]", "[2]"] and names != ("[1]", "[2]")  # equal like a list: to lists only
    assert pickle.loads(pickle.dumps(names, protocol=0)) == names


def test_model_without_gradients() -> None:
    model = torch.nn.Linear(3, 3)
    report = nanscan.check(model, max_norm=1.0)
    assert report.finite and report.total_norm == 0.0 and report.names == [] and report.clip_coef is None
    assert "finite" in str(report)


def test_shared_parameters_counted_once() -> None:
    lin = torch.nn.Linear(4, 4)
    model = torch.nn.Sequential(lin, torch.nn.ReLU(), lin)
    model(torch.randn(2, 4)).sum().backward()
    assert nanscan.check(model).names == ["0.weight", "0.bias"]


def test_bad_inputs_are_named() -> None:
    p = torch.nn.Parameter(torch.ones(2))
    p.grad = torch.ones(2)
    with pytest.raises(TypeError, match="'b' is a int"):
        nanscan.check([("a", p), ("b", 3)])
    with pytest.raises(ValueError, match="non-negative"):
        nanscan.check([p], max_norm=-1.0)
    with pytest.raises(ValueError, match="norm_type must be a real number"):
        nanscan.check([p], norm_type="fro")
    q = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    q.grad = torch.ones(2, dtype=torch.float64).to_sparse()
    assert nanscan.check([("dense", p), ("sparse", q)]).names == ["dense", "sparse"]  # read exactly
    with pytest.raises(TypeError, match=r"'sparse' \(entry 1\) is a torch.sparse_coo tensor"):
        nanscan.check([("dense", p), ("sparse", q)], verify_replicas=True)  # no exact checksum of sparse


def test_nonfinite_ranks_of_a_single_process() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1))
    model(torch.randn(2, 3)).sum().backward()
    model[1].bias.grad[0] = math.inf
    report = nanscan.check(model)
    assert report.nonfinite_ranks == {"1.bias": [0]}  # rank 0: no process group in this test
    assert report.to_dict()["nonfinite_ranks"] == {"1.bias": [0]}


def test_process_group_needs_torch_distributed() -> None:
    with pytest.raises(RuntimeError, match=r"torch\.distributed to be initialized"):
        nanscan.scan([torch.ones(2)], process_group=object())
