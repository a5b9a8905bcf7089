"""nanscan.walk: the module walk kept between checks must always give what ``named_parameters()``
gives now, whatever changed in the tree since the last call; a stale name or parameter would hide a
gradient from the check."""

from __future__ import annotations

import gc
import random
import weakref
from collections.abc import Callable, Iterator

import pytest
import torch
from torch import nn

import nanscan
from nanscan import walk


def assert_walk_is_fresh(model: nn.Module) -> None:
    """The kept walk's names and parameters (the very objects) equal a new walk's, on two calls."""
    for _ in range(2):  # the first call may walk anew; the second is served from the record
        names, params = walk.named_parameters(model)
        want = list(model.named_parameters())
        assert names == [name for name, _ in want]
        assert len(params) == len(want) and all(p is q for p, (_, q) in zip(params, want, strict=True))


def tree() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), nn.Linear(4, 2))
    assert_walk_is_fresh(model)
    return model


def modules_of(model: nn.Module) -> list[nn.Module]:
    return [m for _, m in model.named_modules()]


# Each changes the tree as a user (or a wrapper) might; named_parameters() must see every one.
def replace_parameter(model: nn.Module, rng: random.Random) -> None:
    m = rng.choice([m for m in modules_of(model) if m._parameters])
    key = rng.choice(list(m._parameters))
    setattr(m, key, nn.Parameter(torch.zeros(2)))


def swap_in_place(model: nn.Module, rng: random.Random) -> None:
    """As FSDP2 swaps sharded and unsharded parameters: the dict's value, no __setattr__."""
    m = rng.choice([m for m in modules_of(model) if m._parameters])
    key = rng.choice(list(m._parameters))
    m._parameters[key] = nn.Parameter(torch.ones(3))


def add_parameter(model: nn.Module, rng: random.Random) -> None:
    m = rng.choice(modules_of(model))
    m.register_parameter(f"extra{rng.randrange(1000)}", nn.Parameter(torch.zeros(1)))


def delete_entry(model: nn.Module, rng: random.Random, dict_name: str) -> None:
    """Deletes a random entry of some module's ``_parameters`` or ``_modules``, if any has one."""
    dicts = [d for d in (getattr(m, dict_name) for m in modules_of(model)) if d]
    if dicts:
        d = rng.choice(dicts)
        del d[rng.choice(list(d))]


def delete_parameter(model: nn.Module, rng: random.Random) -> None:
    delete_entry(model, rng, "_parameters")


def none_parameter(model: nn.Module, rng: random.Random) -> None:
    m = rng.choice([m for m in modules_of(model) if m._parameters])
    m._parameters[rng.choice(list(m._parameters))] = None


def share_parameter(model: nn.Module, rng: random.Random) -> None:
    """One parameter in two places: the walk yields it once, where it first meets it."""
    params = list(model.parameters())
    if params:
        rng.choice(modules_of(model)).register_parameter(f"shared{rng.randrange(1000)}", rng.choice(params))


def move_parameter(model: nn.Module, rng: random.Random) -> None:
    """A parameter moved to another module under the same key: same objects, other names."""
    owners = [m for m in modules_of(model) if m._parameters]
    source, target = rng.choice(owners), rng.choice(modules_of(model))
    key = rng.choice(list(source._parameters))
    target._parameters[key] = source._parameters.pop(key)


def reorder_keys(model: nn.Module, rng: random.Random) -> None:
    m = rng.choice([m for m in modules_of(model) if len(m._parameters) > 1] or modules_of(model))
    if m._parameters:
        key = next(iter(m._parameters))
        m._parameters[key] = m._parameters.pop(key)  # the first key, now last


def add_module(model: nn.Module, rng: random.Random) -> None:
    rng.choice(modules_of(model)).add_module(f"sub{rng.randrange(1000)}", nn.Linear(2, 2))


def replace_module(model: nn.Module, rng: random.Random) -> None:
    m = rng.choice([m for m in modules_of(model) if m._modules])
    key = rng.choice(list(m._modules))
    m._modules[key] = nn.Linear(2, 3)


def delete_module(model: nn.Module, rng: random.Random) -> None:
    delete_entry(model, rng, "_modules")


def share_module(model: nn.Module, rng: random.Random) -> None:
    """A module in two places: walked once."""
    rng.choice(modules_of(model)).add_module(
        f"again{rng.randrange(1000)}", rng.choice(modules_of(model)[1:] or [nn.ReLU()])
    )


def rename_parameter(model: nn.Module, rng: random.Random) -> None:
    """The same object under another key, in the same place: only the keys tell."""
    m = rng.choice([m for m in modules_of(model) if m._parameters])
    old = rng.choice(list(m._parameters))
    m._parameters = {(f"renamed{rng.randrange(1000)}" if k == old else k): v for k, v in m._parameters.items()}


def rename_module(model: nn.Module, rng: random.Random) -> None:
    m = rng.choice([m for m in modules_of(model) if m._modules])
    old = rng.choice(list(m._modules))
    m._modules = {(f"renamed{rng.randrange(1000)}" if k == old else k): v for k, v in m._modules.items()}


_kept_alive: list[nn.Module] = []


def replace_module_kept_alive(model: nn.Module, rng: random.Random) -> None:
    """The module replaced lives on elsewhere: its record still reads as alive, and its own dicts are
    unchanged; only the parent's held objects tell."""
    m = rng.choice([m for m in modules_of(model) if m._modules])
    key = rng.choice(list(m._modules))
    _kept_alive.append(m._modules[key])  # type: ignore[arg-type]
    m._modules[key] = nn.Linear(2, 3)


def replace_parameter_dict(model: nn.Module, rng: random.Random) -> None:
    m = rng.choice(modules_of(model))
    m._parameters = dict(m._parameters)  # an equal copy: another dict object


def none_module(model: nn.Module, rng: random.Random) -> None:
    m = rng.choice([m for m in modules_of(model) if m._modules] or modules_of(model))
    if m._modules:
        m._modules[rng.choice(list(m._modules))] = None


MUTATIONS: list[Callable[[nn.Module, random.Random], None]] = [
    replace_parameter,
    swap_in_place,
    add_parameter,
    delete_parameter,
    none_parameter,
    share_parameter,
    move_parameter,
    reorder_keys,
    add_module,
    replace_module,
    delete_module,
    share_module,
    replace_parameter_dict,
    none_module,
    rename_parameter,
    rename_module,
    replace_module_kept_alive,
]


@pytest.mark.parametrize("mutation", MUTATIONS, ids=[m.__name__ for m in MUTATIONS])
def test_each_change_is_seen(mutation: Callable[[nn.Module, random.Random], None]) -> None:
    for seed in range(8):
        model = tree()
        mutation(model, random.Random(seed))
        assert_walk_is_fresh(model)


def test_random_sequences_of_changes() -> None:
    rng = random.Random(1)
    for _ in range(40):
        model = tree()
        for _ in range(rng.randrange(1, 6)):
            rng.choice(MUTATIONS)(model, rng)
            if rng.random() < 0.5:  # sometimes a check between two changes, sometimes several at once
                assert_walk_is_fresh(model)
        assert_walk_is_fresh(model)


def test_a_child_moved_across_the_boundary_of_two_modules() -> None:
    """a.0 -> b.0: every module's keys and held objects, laid end to end, are as before; only where
    one module's entries end and the next one's begin tells."""
    model = nn.Sequential()
    model.add_module("a", nn.Sequential(nn.Linear(2, 2)))
    model.add_module("b", nn.Sequential())
    assert_walk_is_fresh(model)
    model.b.add_module("0", model.a._modules.pop("0"))
    assert_walk_is_fresh(model)
    assert walk.named_parameters(model)[0] == ["b.0.weight", "b.0.bias"]


def test_check_names_a_parameter_swapped_in_after_a_check() -> None:
    """End to end: a NaN in a parameter put in place since the last check is named."""
    model = tree()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    assert nanscan.check(model).finite
    bad = nn.Parameter(torch.zeros(2))
    bad.grad = torch.tensor([1.0, float("nan")])
    model[2][1]._parameters["weight"] = bad  # no __setattr__: a dict write, as FSDP2 makes
    assert nanscan.check(model).nonfinite == ["2.1.weight"]


def test_the_record_keeps_no_model_alive() -> None:
    model = tree()
    walk.named_parameters(model)
    alive = weakref.ref(model)
    del model
    gc.collect()
    assert alive() is None


class _OwnWalk(nn.Module):
    """A module that overrides the walk (as FSDP1 strips its wrapper's prefix)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = nn.Linear(2, 2)

    def named_parameters(self, *args: object, **kwargs: object) -> Iterator[tuple[str, nn.Parameter]]:  # type: ignore[override]
        for name, p in super().named_parameters(*args, **kwargs):  # type: ignore[arg-type]
            yield name.replace("inner.", ""), p


def test_a_module_that_overrides_the_walk_is_walked_every_call() -> None:
    model = nn.Sequential(_OwnWalk())
    assert_walk_is_fresh(model)
    own = _OwnWalk()
    assert walk.named_parameters(own)[0] == ["weight", "bias"] and own not in walk._trees
    model[0].__class__ = type("Renamed", (_OwnWalk,), {})  # a type change after the record is seen
    assert_walk_is_fresh(model)


class _Unhashable(nn.Module):
    def __eq__(self, other: object) -> bool:
        return other is self

    __hash__ = None  # type: ignore[assignment]


def test_an_unhashable_module_raises_as_torch_walk_does() -> None:
    with pytest.raises(TypeError, match="unhashable"):
        list(_Unhashable().named_parameters())
    with pytest.raises(TypeError, match="unhashable"):
        walk.named_parameters(_Unhashable())
