"""nanscan.check_state: the weights and every floating tensor of the optimizer's state in one fused
scan, named ``param`` and ``param:key``, held against the fp64 reference."""

from __future__ import annotations

import copy
import math
import random
import weakref
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


def expected_state(
    pairs: list[tuple[str, torch.nn.Parameter]], optimizer: torch.optim.Optimizer
) -> tuple[list[str], list[torch.Tensor]]:
    """check_state's names and tensors for these named parameters, found from scratch by the rule
    (every floating tensor but a step counter), independently of the plan nanscan keeps between calls."""
    names = {id(p): name for name, p in pairs}
    found_names = list(names.values())
    tensors = [p.detach() for _, p in pairs]
    for g, group in enumerate(optimizer.param_groups):
        for j, p in enumerate(group["params"]):
            for key, value in optimizer.state.get(p, {}).items():
                if key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point():
                    found_names.append(f"{names.get(id(p), f'group{g}.param{j}')}:{key}")
                    tensors.append(value)
    return found_names, tensors


def test_the_kept_list_of_states_follows_every_change() -> None:
    """check_state keeps its list of states per optimizer between calls (nanscan.state's notes): after
    each of a seeded run of changes to the optimizer and its state, every call's report matches the
    list found from scratch, names and values; and the list keeps no replaced state alive."""
    model, optimizer = model_after_steps(OPTIMIZERS["adam"][0])
    rng = random.Random(0)
    extra = torch.nn.Parameter(torch.randn(3))

    named = list(model.named_parameters())
    # What check_state is given, the same for runs of changes (the plan is kept between its calls)
    # and then another: other names, fewer parameters, the same names for other parameters.
    givens: list[tuple[object, list[tuple[str, torch.nn.Parameter]]]] = [
        (model, named),
        ([(f"renamed.{name}", p) for name, p in named],) * 2,
        ([(f"renamed.{name}", p) for name, p in named[1:]],) * 2,
        ([(name, p) for (name, _), (_, p) in zip(named, reversed(named), strict=True)],) * 2,
    ]
    given = givens[0]

    def checked_as_found() -> None:
        report = nanscan.check_state(given[0], optimizer)  # type: ignore[arg-type]
        names, tensors = expected_state(given[1], optimizer)
        assert report.names == names
        assert_matches_reference(report.stats, tensors)

    def some_state() -> dict[str, object]:
        return optimizer.state[rng.choice([p for p in model.parameters() if optimizer.state.get(p)])]

    def replace_a_tensor() -> None:  # as transformers' Adafactor makes its RMS anew each step
        kept = some_state()
        kept["exp_avg"] = torch.randn_like(kept["exp_avg"]) * rng.choice([1.0, math.nan])  # type: ignore[arg-type]

    def to_an_integer_tensor_and_back() -> None:
        kept = some_state()
        kept["exp_avg_sq"] = kept["exp_avg_sq"].to(torch.int64)  # type: ignore[union-attr]
        checked_as_found()
        kept["exp_avg_sq"] = kept["exp_avg_sq"].to(torch.float32)  # type: ignore[union-attr]

    def add_a_key() -> None:
        some_state()[f"extra{rng.randrange(3)}"] = torch.full((2,), rng.choice([1.0, math.inf]))

    def remove_a_key() -> None:
        kept = some_state()
        optional = [key for key in kept if key.startswith("extra") or key == "buffer"]
        if optional:
            del kept[rng.choice(optional)]

    def none_becomes_a_tensor() -> None:  # SGD keeps a None momentum buffer until its first momentum
        kept = some_state()
        kept["buffer"] = None
        checked_as_found()
        kept["buffer"] = torch.tensor([rng.choice([2.0, math.nan])])

    def swap_a_key() -> None:  # same number of keys, one of them new
        kept = some_state()
        kept.setdefault("extra0", torch.ones(1))
        checked_as_found()
        old = rng.choice([key for key in kept if key.startswith("extra")])
        kept[f"extra{rng.randrange(3, 99)}"] = kept.pop(old)

    def new_state_dict_same_keys() -> None:
        p = rng.choice(list(model.parameters()))
        optimizer.state[p] = {k: v.clone() if k != "step" else v for k, v in optimizer.state[p].items()}
        optimizer.state[p]["exp_avg"].view(-1)[0] = rng.choice([0.5, -math.inf])

    def add_a_group() -> None:
        if len(optimizer.param_groups) == 1:
            optimizer.add_param_group({"params": [extra]})
            optimizer.state[extra] = {"step": torch.tensor(1.0), "exp_avg": torch.ones(3)}

    def reorder_a_group() -> None:  # the same keys everywhere, the parameters in another order
        optimizer.param_groups[0]["params"].reverse()

    def load_a_state_dict() -> None:  # a checkpoint's: new tensors (the same ones' would be kept as they are)
        optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))

    changes = [
        reorder_a_group,  # first, while every parameter's state has the same keys
        replace_a_tensor,
        to_an_integer_tensor_and_back,
        add_a_key,
        remove_a_key,
        none_becomes_a_tensor,
        swap_a_key,
        new_state_dict_same_keys,
        add_a_group,
        load_a_state_dict,
    ]
    checked_as_found()  # a plan for the first change to make stale
    for step in range(120):
        change = changes[step] if step < len(changes) else rng.choice(changes)
        change()
        checked_as_found()
        if step % 8 == 7:
            given = givens[(step // 8) % len(givens)]
            checked_as_found()
    # Nothing replaced is kept alive by nanscan: the states of a state_dict loaded over them are freed.
    old = weakref.ref(optimizer.state[model[0].weight]["exp_avg"])
    optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))
    assert old() is None


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
