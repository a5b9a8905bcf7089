"""Cases run by tests/test_distributed.py in real processes (torch.distributed with gloo, on the CPU).

Each case is a function of the world size, run on every rank; every rank runs every case in the same
order (collectives must match). A case raises AssertionError on a rank where something is wrong; its
assertions come after its collectives, so that a failing rank does not leave the others waiting.
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import math
import os
import sys
import traceback
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import nanscan

CASES: dict[str, Callable[[int], None]] = {}
SHARED: dict[str, Path] = {}
"""``SHARED["out"]``: a directory every rank of the launch sees (its output directory; set by ``run``)."""


def case(fn: Callable[[int], None]) -> Callable[[int], None]:
    CASES[fn.__name__] = fn
    return fn


@contextlib.contextmanager
def counted_all_reduces() -> Iterator[list[int]]:
    """Counts the all-reduces issued inside the block (nanscan calls torch.distributed.all_reduce)."""
    calls = [0]
    real = dist.all_reduce

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    dist.all_reduce = counting  # type: ignore[assignment]
    try:
        yield calls
    finally:
        dist.all_reduce = real


def mlp(dims: list[int], dtype: torch.dtype = torch.float32, seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    layers: list[torch.nn.Module] = []
    for a, b in itertools.pairwise(dims):
        layers += [torch.nn.Linear(a, b, dtype=dtype), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


def backward(model: torch.nn.Module, dim: int, seed: int = 1, dtype: torch.dtype = torch.float32) -> None:
    """The same loss on every rank (same seed): data parallel ranks then hold equal gradients."""
    torch.manual_seed(seed)
    model(torch.randn(8, dim, dtype=dtype)).float().square().mean().backward()


def full_grads(model: torch.nn.Module) -> list[torch.Tensor]:
    """Copies of the whole gradients (a Replicate DTensor's full_tensor() is its local tensor itself)."""
    return [(p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).clone() for p in model.parameters()]


def assert_close(got: Any, want: Any, what: str, rtol: float = 1e-5) -> None:
    got_t, want_t = torch.as_tensor(got).double(), torch.as_tensor(want).double()
    assert torch.allclose(got_t, want_t, rtol=rtol, atol=1e-7, equal_nan=True), f"{what}: {got_t} != {want_t}"


def fsdp(model: torch.nn.Module, mesh: DeviceMesh) -> torch.nn.Module:
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def compare_with_torch(
    make: Callable[[], torch.nn.Module], dim: int, max_norm: float, name: str, rtol: float = 1e-5
) -> None:
    """nanscan's clip and torch's on twin models: equal global norms and clipped gradients (within
    ``rtol``: torch rounds a bf16 gradient's norm to bf16 before combining), a plain total on every
    rank, and per-parameter statistics equal to those of the full (gathered) gradients."""
    ours, theirs = make(), make()
    backward(ours, dim)
    backward(theirs, dim)
    report = nanscan.check(ours)
    full = full_grads(ours)
    got = nanscan.clip_grad_norm_(ours.parameters(), max_norm)
    want = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    want = want.full_tensor() if isinstance(want, DTensor) else want
    assert type(got) is torch.Tensor, f"{name}: the total norm is a {type(got).__name__}, not a plain tensor"
    assert_close(got, want, f"{name}: total norm", rtol)
    for a, b in zip(full_grads(ours), full_grads(theirs), strict=True):
        assert_close(a, b, f"{name}: clipped gradient", max(rtol, 1e-5 if a.dtype == torch.float32 else 1e-2))
    values = report.to_dict()["parameters"]
    assert report.finite and report.nonfinite == [] and report.nonfinite_ranks == {}
    for (pname, stats), g in zip(values.items(), full, strict=True):
        assert_close(stats["norm"], g.double().norm(), f"{name}: norm of {pname}", 1e-6)
        assert stats["max"] == g.double().max().item(), f"{name}: max of {pname}"
        assert stats["min"] == g.double().min().item(), f"{name}: min of {pname}"


# ----------------------------------------------------------------------------------------- FSDP2


@case
def fsdp_matches_torch(world: int) -> None:
    # Linear(16, 3): 3 rows over the ranks, uneven; with 4 ranks the last one's shard is empty.
    mesh = init_device_mesh("cpu", (world,))
    compare_with_torch(lambda: fsdp(mlp([16, 24, 3]), mesh), 16, 0.05, "fsdp")
    compare_with_torch(lambda: fsdp(mlp([16, 24, 3]), mesh), 16, 1e6, "fsdp, no clip")


@case
def fsdp_mixed_dtypes(world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))

    def make() -> torch.nn.Module:
        model = mlp([16, 24, 8])
        model[2].to(torch.bfloat16)  # a bf16 layer among fp32 ones
        model.insert(2, Cast(torch.bfloat16))
        model.append(Cast(torch.float32))
        return fsdp(model, mesh)

    compare_with_torch(make, 16, 0.05, "fsdp, mixed dtypes", rtol=1e-3)


class Cast(torch.nn.Module):
    """A dtype cast as a module: a layer of another dtype among a model's."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.dtype)


@case
def fsdp_nan_in_one_rank_shard_is_named_everywhere(world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model = fsdp(mlp([16, 24, 6]), mesh)
    backward(model, 16)
    bad = 1 % world
    if dist.get_rank() == bad:
        model[2].weight.grad.to_local()[0, 1] = math.nan
    with counted_all_reduces() as calls:
        report = nanscan.check(model)
        report.finite  # noqa: B018  (reading it must not add a collective)
    assert calls[0] == 2, f"{calls[0]} all-reduces for one check on one mesh"
    assert not report.finite and report.nonfinite == ["2.weight"], report.nonfinite
    assert report.nonfinite_ranks == {"2.weight": [bad]}, report.nonfinite_ranks
    assert math.isnan(report.total_norm)
    # on_nonfinite="raise" (and "warn") name the rank too, on every rank.
    try:
        nanscan.check(model, on_nonfinite="raise")
    except nanscan.NonFiniteGradientError as error:
        assert f"non-finite gradients in 2.weight (rank {bad})" in str(error), str(error)
    else:
        raise AssertionError("on_nonfinite='raise' did not raise")


@case
def fsdp_grad_scaler_overflow_on_one_rank_skips_on_every_rank(world: int) -> None:
    """nanscan's GradScaler with FSDP2's DTensor gradients: an Inf in one rank's shard only, and every
    rank skips and lowers the scale together, its report naming the rank."""
    mesh = init_device_mesh("cpu", (world,))
    model = fsdp(mlp([16, 24, 6]), mesh)
    scaler = nanscan.amp.GradScaler("cpu", init_scale=2.0**8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().full_tensor().clone() for p in model.parameters()]
    torch.manual_seed(1)
    scaler.scale(model(torch.randn(8, 16)).square().mean()).backward()
    bad = world - 1
    if dist.get_rank() == bad:
        model[0].weight.grad.to_local()[0, 0] = math.inf
    scaler.step(opt)
    scaler.update()
    after = [p.detach().full_tensor().clone() for p in model.parameters()]
    skipped, scale = scaler.skipped, scaler.get_scale()
    ranks = scaler.last_report.nonfinite_ranks if scaler.last_report is not None else None
    assert skipped and scale == 2.0**7, (skipped, scale)
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True)), "a skipped step changed weights"
    assert ranks == {"group0.param0": [bad]}, ranks


@case
def nan_on_several_ranks(world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model = fsdp(mlp([16, 24, 6]), mesh)
    backward(model, 16)
    holders = [0, world - 1] if world > 1 else [0]
    if dist.get_rank() in holders:
        model[0].weight.grad.to_local()[0, 0] = math.inf
    every = list(range(world))
    model[2].bias.grad.to_local().fill_(math.nan) if model[2].bias.grad.to_local().numel() else None
    bias_holders = [r for r in every if _local_rows(6, world, r) > 0]
    report = nanscan.check(model)
    assert report.nonfinite == ["0.weight", "2.bias"], report.nonfinite
    assert report.nonfinite_ranks == {"0.weight": holders, "2.bias": bias_holders}, report.nonfinite_ranks


@case
def fsdp_parameters_held_unsharded_are_read_as_their_shards(world: int) -> None:
    """Without resharding after backward, FSDP2 leaves each module holding plain, unsharded copies of
    its parameters, without a gradient: the reduced gradient is in the sharded parameter's .grad (the
    one the optimizer holds). A check of the model, of its parameters, a clip and check_state read the
    sharded parameters there: the same figures as a twin that reshards, a NaN named with its rank."""
    mesh = init_device_mesh("cpu", (world,))
    model, twin = fsdp(mlp([16, 24, 6]), mesh), fsdp(mlp([16, 24, 6]), mesh)
    sharded = list(model.parameters())  # what an optimizer made now holds
    model.set_reshard_after_backward(False)
    backward(model, 16)
    backward(twin, 16)
    held = list(model.parameters())
    assert not any(isinstance(p, DTensor) for p in held), "FSDP2 resharded after backward: nothing to test"
    assert all(p.grad is None for p in held), [type(p.grad) for p in held]
    report, want = nanscan.check(model), nanscan.check(twin)
    assert report.names == want.names and len(report.names) == 4, (report.names, want.names)
    assert_close(report.total_norm, want.total_norm, "total norm")
    assert_close(
        report.to_dict()["parameters"]["0.weight"]["norm"], want.to_dict()["parameters"]["0.weight"]["norm"], "norm"
    )
    assert_close(nanscan.check(held).total_norm, want.total_norm, "check(parameters)")
    pairs = nanscan.check(model.named_parameters())
    assert list(pairs.names) == list(want.names), pairs.names
    assert_close(pairs.total_norm, want.total_norm, "check(named_parameters())")
    assert_close(nanscan.check_state(model).total_norm, nanscan.check_state(twin).total_norm, "check_state")
    got = nanscan.clip_grad_norm_(model.parameters(), 0.05)
    expected = torch.nn.utils.clip_grad_norm_(twin.parameters(), 0.05)
    assert_close(got, expected.full_tensor() if isinstance(expected, DTensor) else expected, "clip's total norm")
    for a, b in zip([p.grad.full_tensor() for p in sharded], full_grads(twin), strict=True):
        assert_close(a, b, "clipped gradient")
    bad = world - 1
    if dist.get_rank() == bad:
        sharded[0].grad.to_local()[0, 0] = math.nan
    report = nanscan.check(model)
    assert report.nonfinite == ["0.weight"] and report.nonfinite_ranks == {"0.weight": [bad]}, report.nonfinite_ranks


@case
def fsdp_gradients_accumulating_unreduced_are_refused_on_every_rank(world: int) -> None:
    """Inside set_requires_gradient_sync(False) (and HSDP's set_requires_all_reduce(False)) each rank's
    own sums are kept apart from the sharded .grad, resharded after backward or not: the model, its
    parameters, its gradients, a clip and the GradScaler are refused on every rank, nothing written;
    check_state (values) is not. Once a backward reduces them, the check is the twin's. With tensor
    parallel (4 ranks, 2x2), the unsharded copies are DTensors over the tensor-parallel mesh alone."""
    meshes = [("fsdp", init_device_mesh("cpu", (world,)))]
    if world == 4:
        meshes.append(("hsdp", hsdp_mesh()))
        meshes.append(("fsdp+tp", init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))))
    for (kind, mesh), reshard in itertools.product(meshes, (True, False)):
        _accumulate_unreduced_then_reduce(world, kind, mesh, reshard)


def _accumulate_unreduced_then_reduce(world: int, kind: str, mesh: DeviceMesh, reshard: bool) -> None:
    """Two micro-batches, the first unreduced (every call refused after it), the second reducing."""
    if kind == "fsdp+tp":
        tp = parallelize_module(mlp([16, 24, 6]), mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        model, replicas = fsdp(tp, mesh["dp"]), 2  # the two ranks of a tensor-parallel pair share data
    else:
        model, replicas = fsdp(mlp([16, 24, 6]), mesh), 1
    twin = mlp([16, 24, 6])
    sharded = list(model.parameters())
    optimizer = torch.optim.SGD(sharded, lr=0.1)
    scaler = nanscan.amp.GradScaler("cpu", init_scale=2.0)
    model.set_reshard_after_backward(reshard)
    for step in range(2):
        last = step == 1
        if kind == "hsdp":
            model.set_requires_all_reduce(last)
        else:
            model.set_requires_gradient_sync(last)
        torch.manual_seed(50 + 10 * step + dist.get_rank() // replicas)  # every data-parallel rank its own data
        x = torch.randn(8, 16)
        scaler.scale(model(x).square().mean()).backward()
        everyone = [torch.zeros_like(x) for _ in range(world)]
        dist.all_gather(everyone, x)
        # FSDP2 averages over the data-parallel ranks: the mean over their data; times the loss scale.
        twin(torch.cat(everyone[::replicas])).square().mean().mul(2.0).backward()
        if not last:  # between the two micro-batches
            _refused_while_unreduced(kind, reshard, model, sharded, optimizer, scaler)
    report = nanscan.check(model)
    assert report.finite and len(report.names) == 4, (kind, reshard, report.names)
    # The twin's gradients: both micro-batches of every rank, scaled as the GradScaler scaled the loss.
    want = torch.nn.utils.get_total_norm([p.grad for p in twin.parameters()])
    assert_close(report.total_norm, want, f"{kind}, resharded after backward: {reshard}")


def _refused_while_unreduced(
    kind: str,
    reshard: bool,
    model: torch.nn.Module,
    sharded: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scaler: nanscan.amp.GradScaler,
) -> None:
    """Every call that reads the gradients is refused, naming FSDP2's flag; none is written;
    check_state (values) is not refused."""
    flag = "set_requires_all_reduce(False)" if kind == "hsdp" else "set_requires_gradient_sync(False)"
    held = list(model.parameters())
    listed = [p.grad for p in held if p.grad is not None]
    before = [None if p.grad is None else p.grad.to_local().clone() for p in sharded]
    calls = {
        "check(model)": lambda: nanscan.check(model, max_norm=1e-3),
        "check(parameters)": lambda: nanscan.check(held),
        "check(named_parameters())": lambda: nanscan.check(model.named_parameters()),
        "clip_grad_norm_(parameters())": lambda: nanscan.clip_grad_norm_(model.parameters(), 1e-3),
        "clip_grad_norm_(the optimizer's)": lambda: nanscan.clip_grad_norm_(sharded, 1e-3),
        "GradScaler.unscale_": lambda: scaler.unscale_(optimizer),
    }
    if listed:  # the plain sums a module holds where it is not resharded after backward
        calls["get_total_norm(gradients)"] = lambda: nanscan.get_total_norm(listed)
    assert reshard or listed or kind == "hsdp", "FSDP2 left no unsharded gradient on the module"
    for what, call in calls.items():
        message = _value_error(call)
        assert flag in message and "accumulating unreduced" in message, (kind, reshard, what, message)
        assert "named" not in what or "'0.weight' (entry 0)" in message, (what, message)
    after = [None if p.grad is None else p.grad.to_local() for p in sharded]
    for a, b in zip(before, after, strict=True):
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), "a gradient was written"
    assert nanscan.check_state(model).finite, "check_state reads values: not refused"


def _local_rows(rows: int, world: int, rank: int) -> int:
    """Rows of a Shard(0) tensor on ``rank`` (torch's split: ceil-sized chunks, the last ones short)."""
    chunk = -(-rows // world)
    return max(0, min(chunk, rows - rank * chunk))


# -------------------------------------------------------------------------------- tensor parallel


@case
def tensor_parallel_matches_torch(world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))

    def make() -> torch.nn.Module:
        model = mlp([16, 32, 16])
        return parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})

    compare_with_torch(make, 16, 0.05, "tensor parallel")
    model = make()
    backward(model, 16)
    placements = {n: p.grad.placements for n, p in model.named_parameters()}
    assert placements["2.bias"] == (Replicate(),), placements  # a replicated gradient, counted once
    with counted_all_reduces() as calls:
        nanscan.clip_grad_norm_(model.parameters(), 1.0)
    assert calls[0] == 1, f"{calls[0]} all-reduces (a clip reduces one sum of squares per mesh)"


@case
def fsdp_and_tensor_parallel_on_a_2d_mesh(world: int) -> None:
    if world != 4:
        return
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def make() -> torch.nn.Module:
        model = mlp([16, 32, 16])
        parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        return fsdp(model, mesh["dp"])

    compare_with_torch(make, 16, 0.05, "fsdp + tp")
    model = make()
    backward(model, 16)
    with counted_all_reduces() as calls:
        report = nanscan.check(model)
        report.finite  # noqa: B018
    assert calls[0] == 2, f"{calls[0]} all-reduces for a 2-d mesh"


@case
def hsdp_replicated_dim_counted_once(world: int) -> None:
    if world != 4:
        return
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    compare_with_torch(lambda: fsdp(mlp([16, 24, 6]), mesh), 16, 0.05, "hsdp")


@case
def a_copy_that_goes_bad_alone_is_never_reported_finite(world: int) -> None:
    """Replicated parts are counted once (on the first copy), but a NaN in another copy only (written
    after the reduction that made the copies equal) still makes every rank's report non-finite and
    names that rank: the counts travel in the MAX too."""
    mesh = init_device_mesh("cpu", (world,))
    bad = world - 1
    torch.manual_seed(4)
    grads = [
        distribute_tensor(torch.randn(6, 3), mesh, [Replicate()]),
        distribute_tensor(torch.randn(8), mesh, [Shard(0)]),
    ]
    clean = nanscan.scan(grads)
    clean_counts = clean.nan_count.tolist()
    if dist.get_rank() == bad:
        grads[0].to_local()[2, 1] = math.nan
    with counted_all_reduces() as calls:
        report = nanscan.scan(grads)
        finite, counts = bool(report.finite), report.nan_count.tolist()
    assert calls[0] == 2, f"{calls[0]} all-reduces"
    assert clean_counts == [0, 0] and bool(clean.finite)
    assert not finite, "a NaN in one copy only was reported finite"
    assert counts == [1, 0], counts
    assert report.ranks is not None and round(float(report.ranks.count[0])) == 1


# ------------------------------------------------------------------------------ placements, layout


@case
def any_placement_on_a_list_of_dtensors(world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(3)
    full = [torch.randn(7, 5), torch.randn(5, 9), torch.randn(11), torch.randn(2, 3)]
    full[1][4, 8] = math.inf
    tensors = [
        distribute_tensor(full[0], mesh, [Shard(0)]),
        distribute_tensor(full[1], mesh, [Shard(1)]),
        distribute_tensor(full[2], mesh, [Replicate()]),
        # A Partial tensor: its value is the sum of the ranks' local parts (here 1/world each).
        DTensor.from_local(full[3] / world, mesh, [Partial()]),
    ]
    # A plain tensor beside them is each rank's own: refused (process_group= says whose it is).
    assert "plain tensors beside DTensors" in _value_error(lambda: nanscan.scan([*tensors, torch.ones(4)]))
    result = nanscan.scan(tensors)
    want = nanscan.scan(full)
    for field in ("nan_count", "inf_count", "min", "max"):
        assert torch.equal(getattr(result, field), getattr(want, field)), field
    assert_close(result.norm, want.norm, "norms")
    assert_close(result.total_norm, want.total_norm, "total")
    assert not bool(result.finite)


@case
def ranks_that_scan_different_lists_are_refused(world: int) -> None:
    if world < 2:
        return
    mesh = init_device_mesh("cpu", (world,))
    shape = (8, 4) if dist.get_rank() == 0 else (4, 8)  # same element count, different layouts
    grads = [distribute_tensor(torch.ones(shape), mesh, [Shard(0)])]
    report = nanscan.check([("g", _with_grad(g)) for g in grads])
    try:
        report.finite  # noqa: B018
    except RuntimeError as e:
        assert "scanned different lists" in str(e), e
    else:
        raise AssertionError("a check of different lists on different ranks was not refused")


def _with_grad(grad: torch.Tensor) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros_like(grad))
    p.grad = grad
    return p


# -------------------------------------------------------------------- pipeline: process_group


@case
def pipeline_stages_with_process_group(world: int) -> None:
    rank = dist.get_rank()
    # Stage `rank` owns its own layers (different sizes on each rank), named as in the whole model.
    torch.manual_seed(10 + rank)
    stage = torch.nn.Linear(8 + rank, 4 + 2 * rank)
    names = [f"stage{rank}.{n}" for n, _ in stage.named_parameters()]
    stage(torch.randn(3, 8 + rank)).square().sum().backward()
    if rank == world - 1:
        stage.bias.grad[0] = math.nan
    grads = [p.grad for p in stage.parameters()]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, [g.clone() for g in grads])
    with counted_all_reduces() as calls:
        report = nanscan.check(list(zip(names, stage.parameters(), strict=True)), process_group=dist.group.WORLD)
        report.finite  # noqa: B018
    assert calls[0] == 2, f"{calls[0]} all-reduces across the stages"
    want_names = [f"stage{r}.{n}" for r in range(world) for n in ("weight", "bias")]
    assert report.names == want_names, report.names
    assert report.nonfinite == [f"stage{world - 1}.bias"], report.nonfinite
    assert report.nonfinite_ranks == {f"stage{world - 1}.bias": [world - 1]}, report.nonfinite_ranks
    flat = [g for rank_grads in everyone for g in rank_grads]
    values = report.to_dict()["parameters"]
    for pname, g in zip(want_names, flat, strict=True):
        assert_close(values[pname]["norm"], g.double().norm(), f"norm of {pname}")
    # Without the NaN: the total over every stage, and every stage clipped by it.
    if rank == world - 1:
        stage.bias.grad[0] = 0.0
    flat[-1][0] = 0.0  # the gathered copy, on every rank
    total = nanscan.clip_grad_norm_(stage.parameters(), 0.1, process_group=dist.group.WORLD)
    want_total = torch.cat([g.reshape(-1) for g in flat]).double().norm()
    assert_close(total, want_total, "total norm over the stages")
    coef = 0.1 / (want_total + 1e-6)
    for g, before in zip(stage.parameters(), everyone[rank], strict=True):
        assert_close(g.grad, before.double() * coef, "clipped stage gradient", rtol=1e-4)
    # Other norm types take torch's norm of each stage, combined over the group: one more collective.
    one = nanscan.get_total_norm(grads, 1.0, process_group=dist.group.WORLD)
    assert_close(one, torch.cat([g.reshape(-1) for g in flat]).double().abs().sum() * coef, "1-norm", rtol=1e-4)


@case
def a_rank_with_nothing_to_scan_still_takes_part(world: int) -> None:
    rank = dist.get_rank()
    grads = [torch.full((3,), float(rank + 1))] if rank != 0 else []
    total = nanscan.get_total_norm(grads, process_group=dist.group.WORLD)
    want = math.sqrt(sum(3 * (r + 1) ** 2 for r in range(1, world)))
    assert_close(total, want, "total norm with an empty rank")


# ------------------------------------------------------------------------------------------- DDP


def ddp_model(hook: Any = None, attach: bool = True) -> torch.nn.parallel.DistributedDataParallel:
    model = torch.nn.parallel.DistributedDataParallel(mlp([12, 20, 20, 4]), bucket_cap_mb=0.001)  # several buckets
    if attach:
        nanscan.ddp.attach(model, hook=hook)
    return model


@case
def ddp_hook_names_the_rank_that_made_the_nan(world: int) -> None:
    bad = world - 1
    model = ddp_model()
    culprit = model.module[2].weight
    if dist.get_rank() == bad:  # this rank's own gradient of 2.weight goes NaN, before the all-reduce
        culprit.register_hook(lambda g: g * math.nan)
    for _ in range(2):  # the second step: buckets rebuilt by DDP after the first
        model.zero_grad()
        backward(model, 12)
        with counted_all_reduces() as calls:
            report = nanscan.check(model)
            report.nonfinite_ranks  # noqa: B018
        assert calls[0] == 1, f"{calls[0]} all-reduces: one for the attribution"
        # Named as the user wrote them: without DDP's "module." (nanscan.names).
        assert report.nonfinite == ["2.weight"], report.nonfinite  # every rank holds it now
        assert report.nonfinite_ranks == {"2.weight": [bad]}, report.nonfinite_ranks
    # Without the hook the reduced gradient holds the NaN on every rank, and nothing says who made it.
    plain = ddp_model(attach=False)
    if dist.get_rank() == bad:
        plain.module[2].weight.register_hook(lambda g: g * math.nan)
    backward(plain, 12)
    assert nanscan.check(plain).nonfinite_ranks == {"2.weight": [dist.get_rank()]}


@case
def ddp_hook_changes_no_gradient(world: int) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    for hook in (None, fp16_compress_hook):
        ours, theirs = ddp_model(hook), ddp_model(attach=False)
        if hook is not None:
            theirs.register_comm_hook(dist.group.WORLD, hook)
        torch.manual_seed(100 + dist.get_rank())  # different data per rank, as in training
        x = torch.randn(8, 12)
        ours(x).square().mean().backward()
        theirs(x).square().mean().backward()
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad), f"the hook changed a gradient (inner hook {hook})"
        report = nanscan.check(ours)
        assert report.finite and report.nonfinite_ranks == {}


@case
def ddp_nan_on_two_ranks_in_two_parameters(world: int) -> None:
    model = ddp_model()
    rank = dist.get_rank()
    if rank in (0, world - 1):
        model.module[0].bias.register_hook(lambda g: g * math.nan)
    if rank == world // 2:
        model.module[4].weight.register_hook(lambda g: g * math.inf)
    backward(model, 12)
    report = nanscan.check(model)
    want = {"0.bias": sorted({0, world - 1}), "4.weight": [world // 2]}
    assert report.nonfinite_ranks == want, report.nonfinite_ranks


# ------------------------------------------------------------------------------------ the runner


def run(rank: int, world: int, init: str, cases: list[str], out: str) -> None:
    """One process: joins the group, runs every case in order, writes '<case>\\t<error or empty>'."""
    SHARED["out"] = Path(out)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world, timeout=timedelta(seconds=60))
    with Path(out, f"rank{rank}.tsv").open("w") as results:  # a line per case, as it ends
        for name in cases:
            print(f"rank {rank}: {name}", file=sys.stderr, flush=True)
            try:
                CASES[name](world)
                error = ""
            except Exception:
                error = traceback.format_exc().replace("\n", "\\n")
            results.write(f"{name}\t{error}\n")
            results.flush()
            dist.barrier()
    dist.destroy_process_group()


def flip_one_bit(t: torch.Tensor, index: int = 3) -> None:
    """Silent data corruption: one bit of one element, a value that stays finite and plausible."""
    t.view(-1).view(torch.int32)[index] ^= 1 << 4


@case
def ddp_bit_flip_after_all_reduce_is_named(world: int) -> None:
    model = ddp_model(attach=False)
    backward(model, 12)
    with counted_all_reduces() as calls:
        clean = nanscan.check(model, max_norm=1.0, verify_replicas=True)
        consistent = clean.replicas_consistent
    assert calls[0] == 2, f"{calls[0]} all-reduces: MAX of the checksums, SUM of the rank masks"
    assert consistent and clean.divergent == {}
    bad = world - 1
    if dist.get_rank() == bad:  # after the all-reduce: only this replica's copy changes
        flip_one_bit(model.module[2].weight.grad)
    report = nanscan.check(model, verify_replicas=True)
    assert report.finite, "a flipped mantissa bit is no NaN: only the replica check sees it"
    assert not report.replicas_consistent
    # Two replicas have no majority: both are named. Four name the one that differs.
    want = [0, 1] if world == 2 else [bad]
    assert report.divergent == {"2.weight": want}, report.divergent


@case
def weights_that_drift_after_the_step_are_named(world: int) -> None:
    model = ddp_model(attach=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backward(model, 12)
    optimizer.step()
    clean = nanscan.verify_replicas(model)
    if dist.get_rank() == 0:
        flip_one_bit(model.module[0].bias.data, index=1)
        flip_one_bit(model.module[4].weight.data, index=7)
    drifted = nanscan.verify_replicas(model)
    grads = nanscan.verify_replicas(model, gradients=True)
    assert clean.consistent and clean.divergent == {}
    assert grads.consistent, "the gradients still agree: only the weights drifted"
    want = [0, 1] if world == 2 else [0]
    assert drifted.divergent == {"0.bias": want, "4.weight": want}, drifted.divergent


@case
def replica_checks_of_shards_and_what_they_refuse(world: int) -> None:
    # A DTensor sharded along every dim of its mesh (FSDP2 on a 1-d mesh) has no copies: nothing to
    # compare, no collective, consistent even when its shards differ (as shards do).
    mesh = init_device_mesh("cpu", (world,))
    sharded = distribute_tensor(torch.randn(world * 2, 3), mesh, [Shard(0)])
    flip_one_bit(sharded.to_local(), index=dist.get_rank())
    with counted_all_reduces() as calls:
        shards = nanscan.verify_replicas([("sharded", sharded)])
        consistent = shards.consistent
    errors = [
        _value_error(
            lambda: nanscan.check(
                [torch.nn.Parameter(torch.ones(2))], verify_replicas=True, process_group=dist.group.WORLD
            )
        ),
        _value_error(lambda: nanscan.scan([sharded], checksum=True, process_group=dist.group.WORLD)),
        _value_error(lambda: nanscan.scan([sharded], checksum=True, fp16_range=True)),
    ]
    assert calls[0] == 0, f"{calls[0]} all-reduces to compare a tensor that has no replicas"
    assert consistent and shards.divergent == {}, shards.divergent
    assert "pipeline stages" in errors[0], errors[0]  # check(verify_replicas=True, process_group=...)
    assert "pipeline stages" in errors[1], errors[1]  # scan(checksum=True, process_group=...)
    assert "fp16_range" in errors[2], errors[2]


@case
def gradients_that_are_not_the_models_are_refused(world: int) -> None:
    """Gradients that are each rank's own are refused on every rank, before anything is written: a DDP
    model inside no_sync() (gradient accumulation), a DDP model with a process_group sharing its
    ranks, and FSDP2 on submodules only (the root's own parameters keep unreduced gradients), by
    check, clip and the GradScaler."""
    rank = dist.get_rank()
    model = ddp_model()
    torch.manual_seed(20 + rank)  # every rank its own data: its own gradients until DDP reduces them
    x = torch.randn(8, 12)
    with model.no_sync():
        model(x).square().sum().backward()
        before = [p.grad.clone() for p in model.parameters()]
        for call in (lambda: nanscan.check(model, max_norm=1e-3), lambda: nanscan.clip_grad_norm_(model, 1e-3)):
            assert "no_sync()" in _value_error(call), _value_error(call)
        assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True))
    model(x).square().sum().backward()  # the synchronising backward: now the model's gradients
    report = nanscan.check(model)
    assert report.finite and report.total_norm > 0
    message = _value_error(lambda: nanscan.check(model, process_group=dist.group.WORLD))
    assert "shares ranks" in message, message
    assert nanscan.check(list(model.parameters())).total_norm == report.total_norm

    mesh = init_device_mesh("cpu", (world,))
    sharded = mlp([16, 24, 6])
    fully_shard(sharded[0], mesh=mesh)  # the root and its last layer left plain: their gradients unreduced
    torch.manual_seed(30 + rank)
    scaler = nanscan.amp.GradScaler("cpu", init_scale=2.0)
    scaler.scale(sharded(torch.randn(8, 16)).square().mean()).backward()
    grads = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad).clone() for p in sharded.parameters()]
    optimizer = torch.optim.SGD(sharded.parameters(), lr=0.1)
    calls = {
        "check": lambda: nanscan.check(sharded, max_norm=1e-3),
        "clip": lambda: nanscan.clip_grad_norm_(sharded.parameters(), 1e-3),
        "get_total_norm": lambda: nanscan.get_total_norm([p.grad for p in sharded.parameters()]),
        "unscale_": lambda: scaler.unscale_(optimizer),
    }
    for what, call in calls.items():
        assert "plain tensors beside DTensors" in _value_error(call), (what, _value_error(call))
    after = [(p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad) for p in sharded.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(after, grads, strict=True)), "a refused call wrote a gradient"


@case
def ddp_gradients_inside_no_sync_are_refused_however_they_are_passed(world: int) -> None:
    """A DDP model's parameters, the module inside it and its gradients carry no mark of the model nor
    of no_sync(): passed instead of the model, inside no_sync(), each is refused as the model is, by
    check, clip, get_total_norm and the GradScaler, on every rank, before anything is written. The
    model is one nanscan was never handed (not attached): found among the process's live objects."""
    rank = dist.get_rank()
    model = ddp_model(attach=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = nanscan.amp.GradScaler("cpu", init_scale=2.0)
    torch.manual_seed(40 + rank)  # every rank its own data
    x = torch.randn(8, 12)
    with model.no_sync():
        scaler.scale(model(x).square().sum()).backward()
        before = [p.grad.clone() for p in model.parameters()]
        calls = {
            "check(list of parameters)": (lambda: nanscan.check(list(model.parameters())), "parameters'"),
            "check(named_parameters())": (lambda: nanscan.check(model.named_parameters()), "parameters'"),
            "check(a parameter)": (lambda: nanscan.check(next(model.parameters())), "parameters'"),
            "clip_grad_norm_(parameters())": (
                lambda: nanscan.clip_grad_norm_(model.parameters(), 1e-3),
                "parameters'",
            ),
            "check(model.module)": (lambda: nanscan.check(model.module, max_norm=1e-3), "around this module"),
            "get_total_norm(gradients)": (
                lambda: nanscan.get_total_norm([p.grad for p in model.parameters()]),
                "gradients'",
            ),
            "GradScaler.unscale_": (lambda: scaler.unscale_(optimizer), "parameters'"),
        }
        for what, (call, subject) in calls.items():
            message = _value_error(call)
            assert "inside no_sync()" in message and subject in message, (what, message)
        assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before, strict=True)), (
            "a grad was written"
        )
    model(x).square().sum().backward()  # synchronised: every way of passing them is accepted, and agrees
    total = nanscan.check(model).total_norm
    params = list(model.parameters())
    with looks_through_live_objects() as looks:
        assert nanscan.check(params).total_norm == total
        assert nanscan.check(model.module).total_norm == total
        assert nanscan.get_total_norm([p.grad for p in params]) == total
    assert looks == [], f"{len(looks)} looks for DDP models by lists and modules already looked for"


@case
def ddp_gradients_are_refused_inside_no_sync_when_they_are_all_nanscan_is_handed(world: int) -> None:
    """The usual decomposed clip, ``get_total_norm([p.grad ...])`` and torch's own
    ``clip_grads_with_norm_``, as the first and only thing nanscan is handed of a DDP model made
    after nanscan's import (so after its one look through the live objects): its gradients carry no
    mark of the model, which nanscan knows from its construction (nanscan.layouts.live). Inside
    no_sync() refused on every rank; after the synchronising backward, the model's norm."""
    rank = dist.get_rank()
    with looks_through_live_objects() as looks:
        nanscan.get_total_norm([torch.ones(2)])  # any first check that may look, done before the model exists
        model = torch.nn.parallel.DistributedDataParallel(mlp([12, 9, 4], seed=71))
        torch.manual_seed(70 + rank)  # every rank its own data
        x = torch.randn(8, 12)
        with model.no_sync():
            model(x).square().sum().backward()
            message = _value_error(lambda: nanscan.get_total_norm([p.grad for p in model.parameters()]))
        model(x).square().sum().backward()
        total = nanscan.get_total_norm([p.grad for p in model.parameters()])
    assert "inside no_sync()" in message and "gradients' DDP model" in message, message
    assert len(looks) <= 1, f"{len(looks)} looks through the live objects: one per process at most"
    want = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in model.parameters()]))
    assert_close(total, want.item(), "the synchronised gradients' norm", 1e-6)


@case
def ddp_gradients_accumulated_in_no_sync_and_checked_after_it_are_refused(world: int) -> None:
    """DDP decides at a forward whether its backward all-reduces. Gradients accumulated inside
    no_sync() and checked once it is left, before the micro-batch that synchronises them, are each
    rank's own though the model's flag says "sync" again: refused on every rank, however they are
    passed, before anything is written; so is a backward outside no_sync() whose forward ran inside
    it (DDP does not synchronise that one either). An evaluation forward (no grad) in between changes
    nothing; the next micro-batch's forward and backward outside no_sync() make them the model's."""
    rank = dist.get_rank()
    model = ddp_model(attach=False)
    torch.manual_seed(50 + rank)  # every rank its own data
    x = torch.randn(8, 12)
    params = list(model.parameters())

    def refusals() -> dict[str, str]:
        calls = {
            "check(model)": lambda: nanscan.check(model, max_norm=1e-3),
            "clip_grad_norm_(parameters)": lambda: nanscan.clip_grad_norm_(params, 1e-3),
            "check(model.module)": lambda: nanscan.check(model.module),
            "get_total_norm(gradients)": lambda: nanscan.get_total_norm([p.grad for p in params]),
        }
        return {what: _value_error(call) for what, call in calls.items()}

    def ranks_differ() -> bool:
        """Whether the ranks' gradients differ (each its own), gathered for the test's own sake."""
        flat = torch.cat([p.grad.flatten() for p in params])
        gathered = [torch.empty_like(flat) for _ in range(world)]
        dist.all_gather(gathered, flat)
        return any(not torch.equal(gathered[0], g) for g in gathered[1:])

    for how in ("forward and backward inside", "forward inside, backward outside"):
        model.zero_grad()
        with model.no_sync():
            loss = model(x).square().sum()
            if how.endswith("inside"):
                loss.backward()
        if not how.endswith("inside"):
            loss.backward()
        assert ranks_differ(), f"{how}: DDP synchronised the gradients (the test's premise is wrong)"
        before = [p.grad.clone() for p in params]
        for what, message in refusals().items():
            assert "not yet synchronised" in message, (how, what, message)
        with torch.no_grad():
            model(x)  # an evaluation forward: its backward would not exist, and DDP prepares none
        for what, message in refusals().items():
            assert "not yet synchronised" in message, (how, "after an evaluation forward", what, message)
        assert all(torch.equal(p.grad, b) for p, b in zip(params, before, strict=True)), "a refused call wrote"
    model(x).square().sum().backward()  # the synchronising micro-batch: now the model's gradients
    assert not ranks_differ(), "DDP did not synchronise the last micro-batch"
    total = nanscan.check(model).total_norm
    assert nanscan.get_total_norm([p.grad for p in params]) == total
    want = torch.linalg.vector_norm(torch.stack([p.grad.double().norm() for p in params]))
    assert_close(total, want.item(), "the synchronised gradients' norm", 1e-6)


@contextlib.contextmanager
def looks_through_live_objects() -> Iterator[list[None]]:
    """Counts the looks through the process's live objects (``gc.get_objects``) made inside."""
    looks: list[None] = []
    real = gc.get_objects

    def counted(*args: Any, **kwargs: Any) -> list[Any]:
        looks.append(None)
        return real(*args, **kwargs)

    gc.get_objects = counted
    try:
        yield looks
    finally:
        gc.get_objects = real


@case
def pipeline_stages_sharded_by_fsdp2_need_the_pipeline_group(world: int) -> None:
    """Each pipeline stage sharded over its own ranks (FSDP2 on a sub-mesh): without process_group
    the statistics would be the stage's, so they are refused; with the pipeline's group, every rank
    gets the whole model's."""
    if world != 4:
        return
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    stage = mesh["pp"].get_local_rank()
    stage_model = fsdp(mlp([8, 6 + 2 * stage, 3], seed=stage), mesh["dp"])
    backward(stage_model, 8)
    wholes = [p.grad.full_tensor().double() for p in stage_model.parameters()]
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, wholes)
    want_total = torch.cat([g.reshape(-1) for g in everyone[0] + everyone[2]]).norm()  # a rank of each stage
    assert "only some of the 4 ranks" in _value_error(lambda: nanscan.check(stage_model))
    assert "only some of the 4 ranks" in _value_error(lambda: nanscan.clip_grad_norm_(stage_model.parameters(), 1.0))
    pp = mesh["pp"].get_group()
    assert_close(
        nanscan.get_total_norm([p.grad for p in stage_model.parameters()], process_group=pp), want_total, "total"
    )
    if stage == 1 and mesh["dp"].get_local_rank() == 0:
        stage_model[2].bias.grad.to_local()[0] = math.nan
    report = nanscan.check(stage_model, process_group=pp)
    assert report.names == ["0.weight", "0.bias", "2.weight", "2.bias"] * 2, report.names  # the stages end to end
    assert not report.finite and report.nonfinite == ["2.bias"], report.nonfinite


@case
def fsdp1_inside_torch_compile_is_the_models_or_refused(world: int) -> None:
    """Inside torch.compile nanscan builds no FSDP1 layout: the trace refuses an FSDP1 model or its
    flattened parameters (nanscan.layouts._refuse_what_compile_cannot_reduce). With fullgraph=True that
    stops the compile; without, torch.compile runs the call eagerly, and its traced callees (the walk)
    still tell it the model is FSDP1's: every rank gets the model's norm, never its shard's. Run on
    2 ranks only: the trace's refusal is each rank's own, and its compiles took 15 s of the 4-rank
    launch on two cores."""
    if world != 2:
        return
    from torch.distributed.fsdp import FullyShardedDataParallel

    model = FullyShardedDataParallel(mlp([12, 20, 4]), use_orig_params=True, device_id=torch.device("cpu"))
    backward(model, 12)
    want = model.clip_grad_norm_(1e9)
    calls = {
        "check(model)": lambda m: nanscan.check(m, max_norm=1e9).total_norm_tensor,
        "clip(params)": lambda m: nanscan.clip_grad_norm_(m.parameters(), 1e9),
    }
    for what, call in calls.items():
        torch._dynamo.reset()
        assert_close(torch.compile(call, backend="eager")(model), want, f"compiled {what}")
        torch._dynamo.reset()
        try:
            torch.compile(call, backend="eager", fullgraph=True)(model)
        except Exception as error:  # dynamo's Unsupported, caused by nanscan's refusal
            chain = f"{error} {error.__cause__} {error.__context__}"
            assert "FSDP1" in chain or "Observed exception" in chain, (what, chain[:500])
        else:
            raise AssertionError(f"{what} traced whole with fullgraph=True: a rank-local answer")


def _value_error(call: Callable[[], object]) -> str:
    """The message of the ValueError ``call`` raises; '' when it raises none."""
    try:
        call()
    except ValueError as error:
        return str(error)
    return ""


@case
def dtensor_checksums_are_of_the_local_part(world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(4)
    full = torch.randn(world * 3, 5)
    dtensors = [distribute_tensor(full, mesh, [Shard(0)]), distribute_tensor(full, mesh, [Replicate()])]
    result = nanscan.scan(dtensors, checksum=True)
    want = nanscan.scan([t.to_local() for t in dtensors], checksum=True)
    assert result.checksum is not None and want.checksum is not None
    assert torch.equal(result.checksum, want.checksum), "a DTensor's checksum is its local part's"
    assert_close(result.norm, full.double().norm().expand(2), "the statistics stay global")
    # A plain tensor beside them, first (the op's refusal, then the DTensor route) or last: refused.
    for tensors in ([*dtensors, full], [full, *dtensors]):
        assert "plain tensors beside DTensors" in _value_error(lambda tensors=tensors: nanscan.scan(tensors))


@case
def every_placement_compared_with_its_copies(world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(5)
    full = [torch.randn(world * 2, 3), torch.randn(7), torch.randn(2, 3), torch.randn(6)]
    names = ["sharded", "replicated", "partial", "plain"]
    tensors = [
        distribute_tensor(full[0], mesh, [Shard(0)]),  # no copies: not compared
        distribute_tensor(full[1], mesh, [Replicate()]),  # compared along the mesh
        DTensor.from_local(full[2] / world, mesh, [Partial()]),  # compared once reduced, with the above
        full[3],  # a plain tensor beside them: compared over the default group
    ]
    with counted_all_reduces() as calls:
        clean = nanscan.verify_replicas(list(zip(names, tensors, strict=True)))
        consistent = clean.consistent
    rank, bad = dist.get_rank(), world - 1
    if rank == bad:
        flip_one_bit(tensors[1].to_local(), index=2)
    if rank == 0:
        flip_one_bit(tensors[3], index=5)
    flip_one_bit(tensors[0].to_local(), index=rank)  # shards differ anyway
    drifted = nanscan.verify_replicas(list(zip(names, tensors, strict=True)))
    # The Partial tensor's reduction is DTensor's own collective, not counted here.
    assert calls[0] == 4, f"{calls[0]} all-reduces: two for the mesh's Replicate set, two for the plain set"
    assert consistent and clean.divergent == {}, clean.divergent
    assert not drifted.consistent
    pair = [0, 1] if world == 2 else None
    want = {"replicated": pair or [bad], "plain": pair or [0]}
    assert drifted.divergent == want, drifted.divergent


def hsdp_mesh() -> DeviceMesh:
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


@case
def hsdp_bit_flip_in_one_replica_is_named(world: int) -> None:
    if world != 4:
        return
    mesh = hsdp_mesh()  # ranks [[0, 1], [2, 3]]: 0 and 2 hold copies, 1 and 3 hold copies
    # Linear(24, 1): its weight's single row and its bias are sharded over 2 ranks, so one of the
    # two holds empty shards (uneven shards; an empty local part has a checksum too).
    model = fsdp(mlp([16, 24, 1]), mesh)
    backward(model, 16)
    placements = {n: p.grad.placements for n, p in model.named_parameters()}
    with counted_all_reduces() as calls:
        clean = nanscan.check(model, verify_replicas=True)
        consistent = clean.replicas_consistent
    bad = 3
    if dist.get_rank() == bad:  # after HSDP's all-reduce: only this replica's shard changes
        flip_one_bit(model[0].weight.grad.to_local())
    report = nanscan.check(model, verify_replicas=True)
    assert placements["0.weight"] == (Replicate(), Shard(0)), placements
    assert calls[0] == 4, f"{calls[0]} all-reduces: two for the statistics, two for the replicate dim"
    assert consistent and clean.divergent == {}, clean.divergent
    assert report.finite, "a flipped mantissa bit is no NaN: only the replica check sees it"
    # On every rank, 0 and 2 too: two replicas have no majority, both are named.
    assert not report.replicas_consistent
    assert report.divergent == {"0.weight": [1, 3]}, report.divergent


@case
def hsdp_weights_that_drift_after_the_step_are_named(world: int) -> None:
    if world != 4:
        return
    model = fsdp(mlp([16, 24, 1]), hsdp_mesh())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    backward(model, 16)
    optimizer.step()
    with counted_all_reduces() as calls:
        clean = nanscan.verify_replicas(model)
        consistent = clean.consistent
    if dist.get_rank() == 0:
        with torch.no_grad():
            flip_one_bit(model[0].bias.to_local(), index=1)
    drifted = nanscan.verify_replicas(model)
    grads = nanscan.verify_replicas(model, gradients=True)
    assert calls[0] == 2, f"{calls[0]} all-reduces: no statistics, two for the replicate dim"
    assert consistent and clean.divergent == {}, clean.divergent
    assert grads.consistent, "the gradients still agree: only the weights drifted"
    assert drifted.divergent == {"0.bias": [0, 2]}, drifted.divergent


@case
def tensor_parallel_replicated_gradient_is_compared(world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model = parallelize_module(mlp([16, 32, 16]), mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    backward(model, 16)
    with counted_all_reduces() as calls:
        clean = nanscan.check(model, verify_replicas=True)
        consistent = clean.replicas_consistent
    rank, bad = dist.get_rank(), world - 1
    if rank == bad:
        flip_one_bit(model[2].bias.grad.to_local())  # Replicate: every rank holds a copy
    flip_one_bit(model[0].weight.grad.to_local(), index=rank)  # Shard: no copies, not compared
    report = nanscan.check(model, verify_replicas=True)
    with counted_all_reduces() as alone:
        grads = nanscan.verify_replicas(model, gradients=True)
        grads.divergent  # noqa: B018
    assert calls[0] == 4, f"{calls[0]} all-reduces: two for the statistics, two for 2.bias's copies"
    assert alone[0] == 2, f"{alone[0]} all-reduces for verify_replicas alone"
    assert consistent and clean.divergent == {}, clean.divergent
    # Two replicas have no majority: both are named. Four name the one that differs.
    want = {"2.bias": [0, 1] if world == 2 else [bad]}
    assert not report.replicas_consistent and report.divergent == want, report.divergent
    assert grads.divergent == want, grads.divergent


@case
def fsdp_and_tensor_parallel_replicas_along_the_tp_dim(world: int) -> None:
    if world != 4:
        return
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))  # tp pairs: 0 and 1, 2 and 3
    model = mlp([16, 32, 16])
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fsdp(model, mesh["dp"])
    backward(model, 16)
    placements = {n: p.grad.placements for n, p in model.named_parameters()}
    with counted_all_reduces() as calls:
        clean = nanscan.check(model, verify_replicas=True)
        consistent = clean.replicas_consistent
    if dist.get_rank() == 2:
        flip_one_bit(model[2].bias.grad.to_local())
    report = nanscan.check(model, verify_replicas=True)
    assert placements["2.bias"][1] == Replicate(), placements
    assert calls[0] == 4, f"{calls[0]} all-reduces: two for the statistics, two for the tp dim"
    assert consistent and clean.divergent == {}, clean.divergent
    assert report.divergent == {"2.bias": [2, 3]}, report.divergent


# ------------------------------------------------------------------ activations across ranks


class _Scale(torch.nn.Module):
    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


@case
def activation_watch_reduced_over_ranks_names_the_rank_that_overflowed(world: int) -> None:
    """Each rank watches its own batch; the figures every rank reads are every rank's: counts and calls
    summed, amax the largest, and the rank whose activations overflowed named. DDP and FSDP2 alike."""
    rank, bad = dist.get_rank(), world - 1
    results = {}
    for stack in ("ddp", "fsdp2"):
        torch.manual_seed(0)
        inner = torch.nn.Sequential(torch.nn.Linear(4, 6), _Scale(1.0), torch.nn.Linear(6, 3))
        if stack == "ddp":
            model: torch.nn.Module = torch.nn.parallel.DistributedDataParallel(inner)
        else:
            model = fsdp(inner, init_device_mesh("cpu", (world,)))
        watch = nanscan.watch_activations(model)
        torch.manual_seed(10 + rank)
        x = torch.rand(2, 4) + 1.0
        if rank == bad:
            inner[1].factor = 1e6  # only this rank's activations pass fp16's 65504
        model(x).sum().backward()
        # A recorder keeps the step's figures reduced the same way (two all-reduces in its append).
        recorder = nanscan.Recorder(every=1, warn=False, activations=watch)
        nanscan.check(model, recorder=recorder)
        recorder.close()
        recorded = recorder.records[0].activations
        figures = {f.name: f for f in watch.figures()}
        advice = nanscan.amp.Advisor(activations=watch).advise()
        results[stack] = (figures, advice, watch.table())
        watch.remove()
        assert recorded is not None, stack
        scaled_row, first_row = recorded.modules.index("1"), recorded.modules.index("0")
        assert recorded.overflow[scaled_row] == 2 * 6 and recorded.amax[scaled_row] > 1e6, (stack, recorded)
        assert recorded.overflow[first_row] == 0 and recorded.nonfinite == [], (stack, recorded)
    for stack, (figures, advice, table) in results.items():
        scaled = figures["1"]
        assert scaled.calls == world and figures["0"].calls == world, (stack, scaled)
        assert scaled.overflow == 2 * 6 and scaled.ranks == (bad,), (stack, scaled)
        assert figures["0"].ranks == () and figures["0"].overflow == 0, (stack, figures["0"])
        assert scaled.amax > 1e6 and scaled.headroom < 1, (stack, scaled)
        assert advice.recommendation == "fp32-modules" and "1" in advice.fp32_modules, (stack, advice)
        assert f"rank(s) {bad}" in str(advice), (stack, str(advice))
        assert f"ranks {bad}" in table, (stack, table)


@case
def activation_watches_of_different_models_are_refused(world: int) -> None:
    width = 2 + dist.get_rank()  # rank r watches r + 2 modules: the reduction cannot line them up
    model = torch.nn.Sequential(*[torch.nn.Identity() for _ in range(width)])
    watch = nanscan.watch_activations(model)
    model(torch.ones(2))
    try:
        watch.figures()
        error = ""
    except ValueError as raised:
        error = str(raised)
    assert "the ranks watch different models" in error, error


# ------------------------------------------------------------------ the training state


@case
def check_state_of_fsdp2_names_a_nan_in_one_ranks_moment(world: int) -> None:
    """FSDP2's parameters and Adam's moments are DTensors: check_state reduces them over the mesh, so
    a NaN in one rank's shard of exp_avg_sq is named on every rank, with that rank."""
    mesh = init_device_mesh("cpu", (world,))
    model = fsdp(mlp([16, 24, 6]), mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    backward(model, 16)
    optimizer.step()
    clean = nanscan.check_state(model, optimizer)
    clean_finite, clean_names = clean.finite, clean.names
    bad = 1 % world  # Linear(24, 6)'s 6 rows: every rank but the last of 4 holds some
    moment = optimizer.state[model[2].weight]["exp_avg_sq"]
    assert isinstance(moment, DTensor)
    if dist.get_rank() == bad:
        moment.to_local().view(-1)[0] = math.nan
    report = nanscan.check_state(model, optimizer)
    whole = moment.full_tensor()  # the global statistics, against the gathered moment
    norms = report.to_dict()["parameters"]
    assert clean_finite and clean_names[:4] == ["0.weight", "0.bias", "2.weight", "2.bias"], clean_names
    assert "2.weight:exp_avg_sq" in clean_names and not any(n.endswith(":step") for n in clean_names)
    assert report.nonfinite == ["2.weight:exp_avg_sq"], report.nonfinite
    assert report.nonfinite_ranks == {"2.weight:exp_avg_sq": [bad]}, report.nonfinite_ranks
    finite_part = whole.double()[~whole.isnan()]
    assert norms["2.weight:exp_avg_sq"]["max"] == finite_part.max().item()
    assert_close(norms["0.weight"]["norm"], model[0].weight.full_tensor().double().norm(), "weight norm", 1e-6)


@case
def update_ratios_of_fsdp2_are_the_whole_parameters(world: int) -> None:
    """FSDP2's parameters are DTensors: the update watch's copies and differences are DTensors too,
    and its scan reduces them over the mesh, so every rank gets each whole parameter's ratio."""
    mesh = init_device_mesh("cpu", (world,))
    model = fsdp(mlp([16, 24, 6]), mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    updates = nanscan.watch_updates(optimizer, model)
    # The copy-free watch: every rank's shard is at most 384 / world elements, under 512 buckets, so
    # its sketch is its values and the reduced ratio is exact: the shards' squares summed over the mesh.
    sketched = nanscan.watch_updates(optimizer, model, sketch=512)
    backward(model, 16)
    before = [p.full_tensor().double() for p in model.parameters()]
    optimizer.step()
    after = [p.full_tensor().double() for p in model.parameters()]
    ratios = updates.ratios()
    assert list(ratios) == ["0.weight", "0.bias", "2.weight", "2.bias"], ratios
    assert list(sketched.ratios()) == list(ratios)
    for (name, got), sketch, b, a in zip(ratios.items(), sketched.ratios().values(), before, after, strict=True):
        assert_close(got, ((a - b).norm() / a.norm()).item(), f"{name} ratio", 1e-6)
        assert_close(sketch, ((a - b).norm() / a.norm()).item(), f"{name} ratio from the sketches", 1e-6)
    sketched.remove()
    # A recorder with the watch keeps the same whole-parameter figures on every rank, with no
    # collective of its own (the watch's scan reduced them).
    records: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder([records.append], every=1, warn=False, updates=updates)
    backward(model, 16)
    nanscan.check(model, recorder=recorder)
    recorder.close()
    recorded = records[0].updates
    assert recorded is not None and recorded.steps == 1 and list(recorded.names) == list(ratios), recorded
    for name, got, want in zip(recorded.names, recorded.ratio, ratios.values(), strict=True):
        assert_close(got, want, f"{name} recorded ratio", 1e-6)  # float32 norms in the record
    updates.remove()


@case
def sketched_update_ratios_of_fsdp2_hashed_shards(world: int) -> None:
    """The copy-free watch where every rank's shard is larger than its buckets (hashed, not its own
    sketch): 12 layers of 64 x 64 weights, k = 64, against the exact watch on the same steps. The
    shards' estimates are summed over the mesh, so the whole parameter's ‖Δw‖ keeps one tensor's
    error bound (1/sqrt(2k) = 8.8%) and ‖w‖ is exact; a reduction that dropped or doubled a rank's
    share would put ‖Δw‖ ~30% off on 2 ranks and more on 4, and fail the spread asked for here."""
    mesh = init_device_mesh("cpu", (world,))
    model = fsdp(mlp([64] * 13), mesh)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    exact = nanscan.watch_updates(optimizer, model)
    sketched = nanscan.watch_updates(optimizer, model, sketch=64)
    errors = []
    for seed in range(3):
        optimizer.zero_grad()
        backward(model, 64, seed=seed)
        optimizer.step()
        assert list(sketched.ratios()) == list(exact.ratios())
        # The norms, not only their quotient: a shard's ratio is close to the whole parameter's, so a
        # ratio alone would not show a reduction that was skipped.
        assert sketched.weight_norm is not None and exact.weight_norm is not None
        assert torch.allclose(sketched.weight_norm, exact.weight_norm.double(), rtol=1e-6)
        got, want = sketched.update_norm.tolist(), exact.update_norm.tolist()  # type: ignore[union-attr]
        errors += [g / w - 1 for name, g, w in zip(sketched.names, got, want, strict=True) if name.endswith("weight")]
    standard = 1 / math.sqrt(2 * 64)
    spread = math.sqrt(sum(e * e for e in errors) / len(errors))
    assert len(errors) == 36 and spread < 1.5 * standard and max(map(abs, errors)) < 4 * standard, (spread, errors)
    exact.remove()
    sketched.remove()


# ---------------------------------------------------------------------- the recorder's ranks


def recorded(
    steps: int, backward_step: Callable[[int], None], check: Callable[[nanscan.Recorder], nanscan.Report]
) -> tuple[list[nanscan.records.StepRecord], list[nanscan.Report], nanscan.Recorder, list[int]]:
    """For each step, ``backward_step(step)`` then ``check(recorder)``, with a Recorder read every 2
    steps; returns its records, the reports, the recorder (closed) and the all-reduces of each check."""
    records: list[nanscan.records.StepRecord] = []
    recorder = nanscan.Recorder([records.append], every=2, warn=False)
    reports, calls = [], []
    for step in range(steps):
        backward_step(step)
        with counted_all_reduces() as counted:
            reports.append(check(recorder))
        calls.append(counted[0])
    recorder.close()
    return records, reports, recorder, calls


@case
def recorder_names_the_rank_of_a_nan_in_an_fsdp_shard(world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    model = fsdp(mlp([16, 24, 6]), mesh)
    bad = 1 % world  # Linear(24, 6)'s 6 rows: every rank but the last of 4 holds some

    def backward_step(step: int) -> None:
        model.zero_grad()
        backward(model, 16, seed=1 + step)
        if step == 1 and dist.get_rank() == bad:
            model[2].weight.grad.to_local()[0, 1] = math.nan

    records, reports, recorder, calls = recorded(3, backward_step, lambda r: nanscan.check(model, recorder=r))
    assert calls == [2, 2, 2], f"{calls}: the recorder added a collective"
    assert [r.step for r in records] == [0, 1, 2]
    assert [r.nonfinite_ranks for r in records] == [{}, {"2.weight": [bad]}, {}], [r.nonfinite_ranks for r in records]
    assert records[1].nonfinite_ranks == reports[1].nonfinite_ranks
    assert recorder.first_nonfinite is not None and recorder.first_nonfinite.ranks == {"2.weight": [bad]}
    assert f"2.weight (rank {bad})" in str(recorder), str(recorder)
    # The global statistics: the norms of the whole gradients, as the report has them.
    want_norms = [values["norm"] for values in reports[0].to_dict()["parameters"].values()]
    assert_close(records[0].norm, want_norms, "recorded global norms (float32)", rtol=1e-6)


@case
def recorder_names_the_ddp_rank_that_made_the_nan(world: int) -> None:
    bad = world - 1
    model = ddp_model()
    poison = [False]  # this rank's own gradient of 2.weight goes NaN at one step, before the all-reduce
    if dist.get_rank() == bad:
        model.module[2].weight.register_hook(lambda g: g * math.nan if poison[0] else g)

    def backward_step(step: int) -> None:
        model.zero_grad()
        poison[0] = step == 2
        backward(model, 12, seed=1 + step)

    records, reports, _, calls = recorded(4, backward_step, lambda r: nanscan.check(model, recorder=r))
    assert calls == [1] * 4, f"{calls}: one all-reduce per check, for the attribution; none for the recorder"
    want: list[dict[str, list[int]]] = [{}, {}, {"2.weight": [bad]}, {}]
    assert [r.nonfinite_ranks for r in records] == want, [r.nonfinite_ranks for r in records]
    assert [r.nonfinite_ranks for r in records] == [report.nonfinite_ranks for report in reports]


@case
def recorder_names_the_pipeline_stages_of_a_nan(world: int) -> None:
    rank = dist.get_rank()
    torch.manual_seed(10 + rank)
    stage = torch.nn.Linear(8 + rank, 4 + 2 * rank)  # stage `rank`: its own parameters, its own sizes
    params = [(f"stage{rank}.{n}", p) for n, p in stage.named_parameters()]

    def backward_step(step: int) -> None:
        stage.zero_grad()
        stage(torch.randn(3, 8 + rank)).square().sum().backward()
        if step == 1 and rank in (0, world - 1):
            stage.bias.grad[0] = math.inf

    def check(recorder: nanscan.Recorder) -> nanscan.Report:
        return nanscan.check(params, process_group=dist.group.WORLD, recorder=recorder)

    records, reports, _, calls = recorded(3, backward_step, check)
    assert calls == [2, 2, 2], f"{calls}: the recorder added a collective"
    assert list(records[1].names) == [f"stage{r}.{n}" for r in range(world) for n in ("weight", "bias")]
    want = {f"stage{r}.bias": [r] for r in sorted({0, world - 1})}
    assert [r.nonfinite_ranks for r in records] == [{}, want, {}], [r.nonfinite_ranks for r in records]
    assert records[1].nonfinite_ranks == reports[1].nonfinite_ranks


@case
def file_sinks_write_the_run_once_or_once_per_rank(world: int) -> None:
    """Every rank makes the same sinks, as a script run on every rank does: a path without ``{rank}``
    is written by rank 0 alone (each step once, not once per rank interleaved), one with it by every
    rank into its own file. (TensorBoardSink takes the same rule, nanscan.sinks.ranked_path: see
    tests/test_tensorboard.py; this case runs where TensorBoard is not installed too.)"""
    from nanscan.records import read_jsonl
    from nanscan.sinks import CSVSink, JSONLSink

    rank, bad, folder = dist.get_rank(), world - 1, SHARED["out"] / "sinks"
    model = ddp_model(attach=False)  # plain DDP: every rank's records hold the same all-reduced figures
    poison = [False]
    if rank == bad:
        model.module[2].weight.register_hook(lambda g: g * math.nan if poison[0] else g)
    shared, own = JSONLSink(folder / "run.jsonl"), JSONLSink(folder / "run-{rank}.jsonl")
    table = CSVSink(folder / "run.csv")
    with nanscan.Recorder([shared, own, table], every=2, warn=False) as recorder:
        for step in range(5):
            model.zero_grad()
            poison[0] = step == 3
            backward(model, 12, seed=1 + step)
            nanscan.check(model, recorder=recorder)
    dist.barrier()  # every rank's files closed
    assert (shared.path is None) == (rank != 0), f"rank {rank} of {world}: {shared.path}"
    assert own.path == folder / f"run-{rank}.jsonl", own.path
    for path in [folder / "run.jsonl", *(folder / f"run-{r}.jsonl" for r in range(world))]:
        got = read_jsonl(path)
        assert [r.step for r in got] == list(range(5)), f"{path.name}: steps {[r.step for r in got]}"
        assert [r.finite for r in got] == [True, True, True, False, True], path.name
    rows = (folder / "run.csv").read_text().splitlines()
    assert rows[0].startswith("step,parameter") and len(rows) == 1 + 5 * 6, f"{len(rows)} lines: one header, 5 x 6 rows"
    dist.barrier()  # read everywhere before the next case


if __name__ == "__main__":  # python tests/distributed_cases.py RANK WORLD INIT OUTDIR [CASE ...]
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    rank, world, init, out, *names = sys.argv[1:]
    run(int(rank), int(world), init, names or list(CASES), out)
