"""nanscan.composite, the ops in ATen ops that every device without a kernel runs (MPS, XPU, ...),
tested here on the CPU without that hardware: against the CPU kernel on planted and real values,
the same errors on bad input, the no-float64 path MPS takes, and nanscan's stacks (check with skip,
the drop-in clip, the GradScaler, the recorder, check_state, the update watch) run end to end with
the composites registered over the CPU kernels (conftest.composite_on_cpu), against the same runs on
the kernels. The property-based comparison is in tests/test_properties.py."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import nanscan
import nanscan.amp
from nanscan import composite
from nanscan._ops import scale_op, scan_op, unscale_scan_op
from nanscan.records import StepRecord

from conftest import (
    FLOAT_DTYPES,
    FP8_DTYPES,
    assert_matches_reference,
    composite_on_cpu,
    needs_cuda,
    plant,
    random_tensor,
    syncs_refused,
)


def real_values() -> list[torch.Tensor]:
    """What training makes: ordinary gradients, vanishing ones (1e-12 to 1e-20), a mostly-zero
    embedding, an overflow step full of Inf, huge finite values, every dtype, odd layouts."""
    torch.manual_seed(0)
    embedding = torch.zeros(5000, 64)
    embedding[torch.randint(0, 5000, (40,))] = torch.randn(40, 64)
    overflow = random_tensor(70_000, torch.float16) * 1e3
    plant(overflow, list(range(0, 70_000, 7)), math.inf)
    tensors = [random_tensor(100_001, dtype) for dtype in FLOAT_DTYPES + FP8_DTYPES]
    tensors += [
        random_tensor(50_000, torch.float32, scale=1e-12),
        random_tensor(50_000, torch.float32, scale=1e-20),
        random_tensor(3000, torch.bfloat16, scale=1e-20),
        embedding,
        overflow,
        torch.full((1000,), 1e20),
        random_tensor(200, torch.float64, scale=1e200),
        torch.randn(300, 257).t(),
        torch.randn(64, 64)[:, ::3],
        torch.randn(1, 8).expand(16, 8),
        torch.empty(0, 4),
    ]
    plant(tensors[0], [5, 99_999], math.nan)
    return tensors


@pytest.mark.parametrize("options", [(False, False), (True, False), (False, True)], ids=["plain", "fp16", "checksum"])
def test_the_composite_gives_the_kernels_answer_on_real_values(options: tuple[bool, bool]) -> None:
    tensors = real_values()
    kernel = scan_op(tensors, *options)
    ours = composite.scan(tensors, *options)
    assert torch.equal(ours[0], kernel[0])  # NaN, Inf (and the fp16-range pair, or the checksums)
    assert torch.equal(ours[1][:2], kernel[1][:2])  # min, max: element values, exactly
    torch.testing.assert_close(ours[1][2], kernel[1][2], rtol=1e-6, atol=0, equal_nan=True)  # norms
    torch.testing.assert_close(ours[2], kernel[2], rtol=1e-6, atol=0, equal_nan=True)
    assert bool(ours[3]) == bool(kernel[3]) is False
    assert ours[4].dtype == kernel[4].dtype
    assert_matches_reference(nanscan.ScanResult.from_op(*ours), tensors)


def test_without_float64_the_sum_is_float32s_within_its_bound(monkeypatch: pytest.MonkeyPatch) -> None:
    """MPS has no float64: the squares of the values over their largest magnitude are summed in
    float32. Counts, min and max stay exact; a norm is within n * 2^-24 of the truth (the bound the
    module notes state; torch's tree reductions do far better), tiny and huge values included."""
    monkeypatch.setattr(composite, "wide_dtype", lambda device: torch.float32)
    tensors = [t for t in real_values() if t.dtype != torch.float64]  # MPS holds no float64 tensor
    ours = composite.scan(tensors)
    kernel = scan_op(tensors)
    assert ours[1].dtype == torch.float32 and ours[2].dtype == torch.float32
    assert torch.equal(ours[0], kernel[0])
    assert torch.equal(ours[1][:2].double(), kernel[1][:2].float().double())
    for i, t in enumerate(tensors):
        want, got = kernel[1][2][i].item(), ours[1][2][i].item()
        bound = max(t.numel(), 1) * 2.0**-24
        assert (math.isnan(want) and math.isnan(got)) or got == want or abs(got - want) <= bound * want, (i, got, want)


def test_scale_and_unscale_multiply_as_the_kernels_do() -> None:
    tensors = [t for t in real_values() if t.dtype not in FP8_DTYPES and t.numel() and t.is_contiguous()]
    for factor in (0.5, 1.0, 1 / 3):
        ours, theirs = [t.clone() for t in tensors], [t.clone() for t in tensors]
        composite.scale_(ours, torch.tensor(factor))
        scale_op(theirs, torch.tensor(factor))
        assert all(torch.equal(a, b) or (a.isnan() == b.isnan()).all() for a, b in zip(ours, theirs, strict=True))
        ours, theirs = [t.clone() for t in tensors], [t.clone() for t in tensors]
        inv = torch.tensor(factor, dtype=torch.float32)
        got, want = composite.unscale_scan_(ours, inv), unscale_scan_op(theirs, inv)
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1][:2], want[1][:2])


BAD: list[tuple[str, Callable[[Callable[..., Any], Callable[..., Any], Callable[..., Any]], Any], str]] = [
    ("empty", lambda scan, scale, unscale: scan([]), "expected at least one tensor"),
    ("int", lambda scan, scale, unscale: scan([torch.ones(2), torch.ones(2, dtype=torch.int32)]), r"tensors\[1\]"),
    ("sparse", lambda scan, scale, unscale: scan([torch.ones(2, 2).to_sparse()]), r"tensors\[0\] has layout"),
    ("both options", lambda scan, scale, unscale: scan([torch.ones(2)], True, True), "separate scans"),
    ("coef shape", lambda scan, scale, unscale: scale([torch.ones(2)], torch.ones(2)), "coef must have one element"),
    (
        "fp8 scale",
        lambda scan, scale, unscale: scale([torch.ones(2).to(torch.float8_e5m2)], torch.ones(())),
        "float8",
    ),
    (
        "inv_scale dtype",
        lambda scan, scale, unscale: unscale([torch.ones(2)], torch.ones((), dtype=torch.float64)),
        "inv_scale must be a one-element float32 tensor",
    ),
    (
        "expanded write",
        lambda scan, scale, unscale: scale([torch.ones(1, 3).expand(2, 3)], torch.tensor(0.5)),
        "more than one element of the written-to tensor refers to a single memory location",
    ),
]


@pytest.mark.parametrize(("what", "call", "message"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_refused_alike(what: str, call: Callable[..., Any], message: str) -> None:
    for scan, scale, unscale in (
        (scan_op, scale_op, unscale_scan_op),
        (composite.scan, composite.scale_, composite.unscale_scan_),
    ):
        with pytest.raises(RuntimeError, match=message):
            call(scan, scale, unscale)


# ---------------------------------------------------------------- the stacks on the composite path


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def training(steps: int = 6) -> dict[str, Any]:
    """A small run through nanscan's stacks: check with skip and clip (a NaN at step 2), a GradScaler
    with an overflow (step 4), a recorder, check_state and the update watch. Returns what each said."""
    net = model()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-2)
    updates = nanscan.watch_updates(optimizer, net)
    records: list[StepRecord] = []
    recorder = nanscan.Recorder([records.append], every=2, updates=updates, warn=False)
    scaler = nanscan.amp.GradScaler("cpu", init_scale=2.0**10)
    said: dict[str, Any] = {"totals": [], "finite": [], "skipped": [], "scales": [], "states": []}
    for step in range(steps):
        optimizer.zero_grad()
        torch.manual_seed(step)
        loss = net(torch.randn(8, 16)).pow(2).mean()
        if step == 4:
            scaler.scale(loss).backward()
            net[2].bias.grad[0] = math.inf  # an overflow step: the scaler skips it
            scaler.step(optimizer)
            scaler.update()
            said["scales"].append(scaler.get_scale())
            continue
        loss.backward()
        if step == 2:
            net[0].weight.grad[0, 0] = math.nan
        report = nanscan.check(net, max_norm=0.5, on_nonfinite="skip", optimizer=optimizer, recorder=recorder)
        optimizer.step()
        said["totals"].append(report.total_norm)
        said["finite"].append(report.finite)
        said["states"].append(nanscan.check_state(net, optimizer).to_dict())
    recorder.close()
    said["skipped"] = nanscan.SkipGuard.of(optimizer).total_skips
    said["records"] = [r.to_json(with_updates=True) for r in records]
    said["ratios"] = updates.ratios()
    said["weights"] = [p.detach().clone() for p in net.parameters()]
    reference = [p.detach().clone() for p in model().parameters()]
    said["clipped"] = nanscan.clip_grad_norm_(reference, 1.0)  # no gradients: 0, as torch's
    return said


def test_the_stacks_run_on_the_composite_path_as_on_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    on_kernels = training()
    calls: dict[str, int] = {}
    for name in ("scan", "scan_difference", "scale_", "unscale_scan_"):
        original = getattr(composite, name)

        def counted(*args: Any, name: str = name, original: Callable[..., Any] = original) -> Any:
            calls[name] = calls.get(name, 0) + 1
            return original(*args)

        monkeypatch.setattr(composite, name, counted)
    with composite_on_cpu():
        on_composite = training()
    # Every op ran as its composite (scale_ where a clip scaled; the scaler's unscale; the ratios' pass).
    assert set(calls) == {"scan", "scan_difference", "scale_", "unscale_scan_"}, calls
    assert on_composite["finite"] == on_kernels["finite"] == [True, True, False, True, True]
    assert on_composite["skipped"] == on_kernels["skipped"] == 1
    assert on_composite["scales"] == on_kernels["scales"] == [2.0**9]  # the overflow halved the scale
    for got, want in zip(on_composite["totals"], on_kernels["totals"], strict=True):
        assert (math.isnan(got) and math.isnan(want)) or got == pytest.approx(want, rel=1e-6)
    for got, want in zip(on_composite["weights"], on_kernels["weights"], strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-7)
    assert [r["finite"] for r in on_composite["records"]] == [r["finite"] for r in on_kernels["records"]]
    assert [r["skipped"] for r in on_composite["records"]] == [r["skipped"] for r in on_kernels["records"]]
    assert list(on_composite["ratios"]) == list(on_kernels["ratios"])
    for name, ratio in on_kernels["ratios"].items():
        assert on_composite["ratios"][name] == pytest.approx(ratio, rel=1e-5)
    states = on_composite["states"][-1]["parameters"]
    assert "0.weight:exp_avg_sq" in states
    assert states["0.weight"]["norm"] == pytest.approx(on_kernels["states"][-1]["parameters"]["0.weight"]["norm"])


def test_the_drop_in_clip_on_the_composite_path_matches_torch() -> None:
    net, twin = model(), model()
    for m in (net, twin):
        torch.manual_seed(1)
        m(torch.randn(8, 16)).pow(2).sum().backward()
    with composite_on_cpu():
        ours = nanscan.clip_grad_norm_(net.parameters(), 0.1)
    theirs = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.1)
    torch.testing.assert_close(ours, theirs)
    for a, b in zip(net.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("device", ["xpu", "mps"])
def test_grad_scalers_for_other_devices_are_made_as_torchs_are(device: str) -> None:
    ours, theirs = nanscan.amp.GradScaler(device), torch.amp.GradScaler(device)
    assert ours.is_enabled() == theirs.is_enabled()
    assert ours.get_scale() == theirs.get_scale()
    assert ours._device == theirs._device == device


def test_the_composite_is_what_other_devices_dispatch_to() -> None:
    """Registered for CompositeExplicitAutograd: the key every backend without a kernel of its own
    (MPS, XPU, PrivateUse1) falls back to; the CPU and CUDA keep their kernels."""
    for op in ("scan", "scan_into_", "scan_difference", "scale_", "unscale_scan_"):
        table = torch._C._dispatch_dump(f"nanscan::{op}")
        assert "CompositeExplicitAutograd[alias]: registered at" in table and "nanscan/_ops.py" in table, table
        assert "CPU: registered at" in table


class RecordedLibrary:
    """Stands in for a torch.library.Library: records what would be registered."""

    def __init__(self) -> None:
        self.registered: list[tuple[str, Any, str]] = []

    def impl(self, name: str, implementation: Any, key: str) -> None:
        self.registered.append((name, implementation, key))


def test_a_rocm_torch_runs_the_composites_on_its_gpus_and_a_cuda_torch_is_told_to_install() -> None:
    """AMD GPUs are "cuda" devices of a ROCm torch, for which nanscan builds no library: the CUDA key
    gets the composites there; a CUDA torch without nanscan's CUDA library gets the stand-in that
    says how to install it (tests/test_ops.py runs it)."""
    from nanscan import _ops

    rocm, cuda = RecordedLibrary(), RecordedLibrary()
    _ops.register_cuda_key(rocm, "6.3.42131")  # type: ignore[arg-type]
    _ops.register_cuda_key(cuda, None)  # type: ignore[arg-type]
    assert rocm.registered == [(name, fn, "CUDA") for name, fn in _ops.COMPOSITES.items()]
    assert cuda.registered == [
        (name, _ops._built_without_cuda, "CUDA") for name in ("scan", "scan_into_", "sketch", "scale_", "unscale_scan_")
    ]


@needs_cuda
@pytest.mark.cuda
def test_cuda_composite_makes_no_sync_and_captures_in_a_graph() -> None:
    """On a GPU the composite runs as any device's would: no host sync, and capturable in a graph
    (the property XPU graphs and CUDA graphs need); its answer is the CUDA kernel's."""
    torch.manual_seed(0)
    tensors = [t.cuda() for t in real_values() if t.numel()]
    composite.scan(tensors)  # warm the caching allocator and the kernels before the checks
    torch.cuda.synchronize()
    with syncs_refused():
        ours = composite.scan(tensors, True, False)
    kernel = scan_op(tensors, True, False)
    assert torch.equal(ours[0], kernel[0]) and torch.equal(ours[1][:2], kernel[1][:2])
    torch.testing.assert_close(ours[1][2], kernel[1][2], rtol=1e-6, atol=0, equal_nan=True)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        composite.scan(tensors)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        captured = composite.scan(tensors)
    tensors[0].fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert captured[0][0, 0].item() == tensors[0].numel()


def test_a_privateuse1_device_runs_every_op_through_the_dispatchers_composite() -> None:
    """A device with no hardware behind it (torch's PrivateUse1 as a Python backend, "stand"): the
    dispatcher sends nanscan's ops to their composites, and each answers as the CPU kernel does
    (tests/stand_device.py; a process of its own, since renaming PrivateUse1 lasts a process)."""
    import subprocess
    import sys

    from conftest import ROOT

    done = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "stand_device.py")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "stand device: every op answered as the CPU kernel" in done.stdout
    for op in ("scan_difference", "record_", "unscale_scan_ (values)", "nanscan.scan", "scan_into_ fp16_range=True"):
        assert f"ok {op}" in done.stdout, done.stdout
