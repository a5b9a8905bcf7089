"""nanscan.watch_updates: each parameter's update-to-weight ratio on sampled optimizer steps, against
a float64 reference of the same step."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch

import nanscan

from conftest import needs_cuda, syncs_refused

Optimizers = Callable[[Any], torch.optim.Optimizer]

OPTIMIZERS: dict[str, Optimizers] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False),
    "adam-foreach": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=True),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
}


def mlp(dtype: torch.dtype = torch.float32, device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(dtype).to(device)


def step_with_reference(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> list[float]:
    """One training step; returns ‖w_after - w_before‖ / ‖w_after‖ per parameter, in float64."""
    torch.manual_seed(seed)
    optimizer.zero_grad()
    model(torch.randn(5, 8, dtype=next(model.parameters()).dtype, device=next(model.parameters()).device)).pow(
        2
    ).sum().backward()
    before = [p.detach().double().clone() for p in model.parameters()]
    optimizer.step()
    return [
        ((p.detach().double() - b).norm() / p.detach().double().norm()).item()
        for p, b in zip(model.parameters(), before, strict=True)
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_ratios_match_the_float64_reference(name: str, dtype: torch.dtype) -> None:
    if name == "adamw-fused" and dtype == torch.bfloat16:
        pytest.skip("torch's fused AdamW on the CPU takes fp32 parameters here")
    model = mlp(dtype)
    optimizer = OPTIMIZERS[name](model.parameters())
    with nanscan.watch_updates(optimizer, model) as updates:
        for seed in range(3):
            want = step_with_reference(model, optimizer, seed)
            got = updates.ratios()
            assert list(got) == ["0.weight", "0.bias", "2.weight", "2.bias"]
            for (param, value), reference in zip(got.items(), want, strict=True):
                # The difference is exact (Sterbenz); the norms are summed in fp64 from fp32 squares.
                assert value == pytest.approx(reference, rel=1e-6), (name, seed, param)
            assert all(0 < v < math.inf for v in got.values())


def test_only_every_nth_step_is_measured() -> None:
    model = mlp()
    optimizer = OPTIMIZERS["adam"](model.parameters())
    updates = nanscan.watch_updates(optimizer, model, every=3)
    measured = {}
    for seed in range(7):
        want = step_with_reference(model, optimizer, seed)
        if seed % 3 == 0:
            measured[seed] = want
        last = max(measured)
        assert list(updates.ratios().values()) == pytest.approx(measured[last], rel=1e-6), seed
    assert (updates.steps, updates.sampled) == (7, 3)
    updates.remove()


def test_memory_is_one_copy_of_the_weights_and_remove_leaves_no_hook() -> None:
    model = mlp()
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    updates = nanscan.watch_updates(optimizer)
    assert updates.nbytes == 0 and updates.ratios() == {} and "none measured yet" in str(updates)
    step_with_reference(model, optimizer, 0)
    assert updates.nbytes == sum(p.numel() * p.element_size() for p in model.parameters())
    bf16 = mlp(torch.bfloat16)
    bf16_optimizer = OPTIMIZERS["sgd"](bf16.parameters())
    with nanscan.watch_updates(bf16_optimizer) as kept_in_fp32:
        step_with_reference(bf16, bf16_optimizer, 0)
        assert kept_in_fp32.nbytes == 2 * sum(p.numel() * p.element_size() for p in bf16.parameters())
    assert list(updates.ratios()) == ["group0.param0", "group0.param1", "group0.param2", "group0.param3"]
    updates.remove()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert updates.nbytes == 0 and len(updates.ratios()) == 4  # the last ratios stay readable


def test_weights_that_change_dtype_or_shape_between_steps_get_new_copies() -> None:
    """model.double() and a parameter given new data of another shape keep the same Parameter objects:
    the copies follow them, and the ratios stay those of the float64 reference."""
    model = mlp()
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    updates = nanscan.watch_updates(optimizer, model)
    step_with_reference(model, optimizer, 0)
    fp32_bytes = updates.nbytes
    model.double()
    optimizer.state.clear()  # momentum buffers of the old dtype
    want = step_with_reference(model, optimizer, 1)
    assert updates.nbytes == 2 * fp32_bytes
    assert list(updates.ratios().values()) == pytest.approx(want, rel=1e-12)
    with torch.no_grad():
        model[2].bias.data = torch.randn(6, dtype=torch.float64)
        model[2].weight.data = torch.randn(6, 32, dtype=torch.float64)
    optimizer.state.clear()
    want = step_with_reference(model, optimizer, 2)
    assert list(updates.ratios().values()) == pytest.approx(want, rel=1e-12)
    updates.remove()


def test_nan_weights_and_zero_weights() -> None:
    model = mlp()
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    updates = nanscan.watch_updates(optimizer, model)
    with torch.no_grad():
        model[0].bias.zero_()
    step_with_reference(model, optimizer, 0)
    # A weight of zeros that moved: ‖Δw‖ / ‖w‖ of the weights after the step, finite again.
    assert math.isfinite(updates.ratios()["0.bias"])
    with torch.no_grad():
        model[2].bias.zero_()
        model[2].bias.grad = None  # it will not move: 0 / 0
        model[0].weight[0, 0] = math.nan
    optimizer.step()
    ratios = updates.ratios()
    assert math.isnan(ratios["0.weight"]) and math.isnan(ratios["2.bias"]), ratios
    assert math.isfinite(ratios["2.weight"])


def test_a_step_the_grad_scaler_skips_is_not_a_step() -> None:
    model = mlp()
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    updates = nanscan.watch_updates(optimizer, model)
    scaler.scale(model(torch.randn(2, 8)).sum()).backward()
    model[0].weight.grad[0, 0] = math.inf
    scaler.step(optimizer)  # found an Inf: optimizer.step() is not called
    assert updates.steps == 0 and updates.ratios() == {}


def test_bad_input_is_refused() -> None:
    model = mlp()
    with pytest.raises(TypeError, match=r"expected a torch\.optim\.Optimizer"):
        nanscan.watch_updates(model)  # type: ignore[arg-type]
    for every in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="every must be a positive int"):
            nanscan.watch_updates(OPTIMIZERS["sgd"](model.parameters()), every=every)  # type: ignore[arg-type]
    optimizer = OPTIMIZERS["sgd"](list(model[0].parameters()))
    updates = nanscan.watch_updates(optimizer, model)
    optimizer.add_param_group({"params": list(model[2].parameters())})
    with pytest.raises(ValueError, match="add_param_group after watch_updates"):
        step_with_reference(model, optimizer, 0)
    updates.remove()


# ---------------------------------------------------------------------- the copy-free estimate


class Decoder(torch.nn.Module):
    """What training updates look like: an embedding whose rows move only where a token was seen
    (sparse under plain SGD), a low-rank output gradient, dense Adam steps, and small tensors."""

    def __init__(self, vocab: int = 3000, width: int = 48) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(vocab, width)
        self.mix = torch.nn.Linear(width, 4 * width)
        self.norm = torch.nn.LayerNorm(4 * width)
        self.head = torch.nn.Linear(4 * width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.nn.functional.gelu(self.mix(self.embed(tokens)))))


SKETCH_OPTIMIZERS: dict[str, Optimizers] = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.5),  # no momentum: only the seen embedding rows move
    "adam": lambda p: torch.optim.Adam(p, lr=1e-3, foreach=False),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-3, fused=True),
}


@pytest.mark.parametrize("name", list(SKETCH_OPTIMIZERS))
def test_sketched_ratios_estimate_the_exact_ones_on_real_updates(name: str) -> None:
    """Beside the exact watch on the same steps: tensors of at most ``sketch`` elements are exact, the
    others within the estimate's error (relative standard error 1/sqrt(2 * 256) = 4.4%), whatever the
    update's shape: 8 of 3000 embedding rows, a low-rank head, dense Adam steps."""
    buckets = 256
    model = Decoder()
    optimizer = SKETCH_OPTIMIZERS[name](model.parameters())
    exact = nanscan.watch_updates(optimizer, model)
    sketched = nanscan.watch_updates(optimizer, model, sketch=buckets)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    errors = []
    for seed in range(6):
        torch.manual_seed(seed)
        tokens = torch.randint(0, 3000, (8,))
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(tokens), tokens.roll(1)).backward()
        optimizer.step()
        want, got = exact.ratios(), sketched.ratios()
        assert list(got) == list(want)
        for param, value in got.items():
            if sizes[param] <= buckets:
                assert value == pytest.approx(want[param], rel=1e-6), (seed, param)  # the scan: fp32 squares
            else:
                errors.append(value / want[param] - 1)
    standard = 1 / math.sqrt(2 * buckets)
    spread = math.sqrt(sum(e * e for e in errors) / len(errors))
    assert len(errors) == 6 * 4 and max(map(abs, errors)) < 4 * standard, errors
    assert spread < 1.5 * standard, (spread, standard)
    assert sketched.nbytes == 16 * sum(min(n, buckets) for n in sizes.values())
    exact.remove()
    sketched.remove()


def test_sketched_ratios_follow_bf16_weights_nan_and_sampling() -> None:
    model = mlp(torch.bfloat16)
    optimizer = OPTIMIZERS["sgd"](model.parameters())
    exact = nanscan.watch_updates(optimizer, model, every=2)
    sketched = nanscan.watch_updates(optimizer, model, every=2, sketch=64)
    for seed in range(3):
        step_with_reference(model, optimizer, seed)
    assert (sketched.steps, sketched.sampled) == (3, 2)
    sizes = {n: p.numel() for n, p in model.named_parameters()}
    for param, value in sketched.ratios().items():
        tolerance = 1e-6 if sizes[param] <= 64 else 4 / math.sqrt(2 * 64)
        assert value == pytest.approx(exact.ratios()[param], rel=tolerance), param
    with torch.no_grad():
        model[0].weight[0, 0] = math.nan
    optimizer.step()  # the fourth step (the last gradients again): not sampled
    optimizer.step()
    ratios = sketched.ratios()
    assert math.isnan(ratios["0.weight"]) and math.isfinite(ratios["2.weight"]), ratios
    assert repr(sketched) == "UpdateWatch(4 parameters, every=2, sketch=64, 3 sampled steps)"
    sketched.remove()
    assert sketched.nbytes == 0 and math.isnan(sketched.ratios()["0.weight"])
    exact.remove()
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks


def test_sketched_ratios_reach_the_recorder() -> None:
    model = mlp()
    optimizer = OPTIMIZERS["adam"](model.parameters())
    sketched = nanscan.watch_updates(optimizer, model, sketch=64)
    records: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder([records.append], every=1, warn=False, updates=sketched)
    for seed in range(2):
        step_with_reference(model, optimizer, seed)
        nanscan.check(model, recorder=recorder)
    recorder.close()
    recorded = records[-1].updates
    assert recorded is not None and list(recorded.names) == list(sketched.ratios())
    assert list(recorded.ratio) == pytest.approx(list(sketched.ratios().values()), rel=1e-6)


def test_bad_sketch_sizes_are_refused() -> None:
    optimizer = OPTIMIZERS["sgd"](mlp().parameters())
    for sketch in (0, 32, 100, 8192, True, 1024.0, "1024"):
        with pytest.raises(ValueError, match=r"sketch must be None .* or a power of two from 64 to 4096"):
            nanscan.watch_updates(optimizer, sketch=sketch)  # type: ignore[arg-type]


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("sketch", [None, 1024])
def test_cuda_ratios_without_a_sync(sketch: int | None) -> None:
    model = mlp(device="cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    updates = nanscan.watch_updates(optimizer, model, every=2, sketch=sketch)
    step_with_reference(model, optimizer, 0)  # allocates the copies
    torch.cuda.synchronize()
    x = torch.randn(5, 8, device="cuda")
    with syncs_refused():
        for _ in range(4):
            optimizer.zero_grad()
            model(x).pow(2).sum().backward()
            optimizer.step()
    assert updates.sampled == 3 and updates.ratio is not None and updates.ratio.device.type == "cuda"
    assert all(0 < v < 1 for v in updates.ratios().values())
