"""Activations, locate and the DDP hook's attribution in real processes: run by tests/test_distributed.py.

The watch and the locator read DTensor module outputs and gradients by their local tensors (tensor
parallel with ``use_local_output=False``, FSDP2's sharded gradients); the DDP hook names a rank only
where it knows (an unused parameter, a backward pass it did not see, gradients accumulated over
several synced passes). As in the other case files, every case makes all its collectives before its
first assertion, so that a failing rank does not leave the others waiting.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from distributed_cases import case
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import nanscan
from nanscan.fused import Attribution
from nanscan.layouts.ddp import scanner_of


def tensor_parallel(local_output: bool = False) -> torch.nn.Sequential:
    """Linear(4, 8), Tanh, Linear(8, 4): column- then row-wise parallel, the same weights everywhere."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    styles = {"0": ColwiseParallel(use_local_output=local_output), "2": RowwiseParallel(use_local_output=local_output)}
    parallelize_module(model, mesh, styles)  # type: ignore[arg-type]
    return model


def every_rank(value: Any) -> list[Any]:
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered


@case
def watch_reads_dtensor_outputs(world: int) -> None:
    model = tensor_parallel()
    bad = world - 1
    if dist.get_rank() == bad:  # a NaN in this rank's shard of the column-parallel weight only
        with torch.no_grad():
            model[0].weight.to_local()[0, 0] = math.nan
    watch = nanscan.watch_activations(model)
    torch.manual_seed(1)
    out = model(torch.randn(3, 4))
    full_nan = int(out.full_tensor().isnan().sum())
    figures = {f.name: f for f in watch.figures()}  # collectives
    table = watch.table()
    watch.remove()
    # Shard(1): the ranks' local outputs are the whole output once; only the bad rank's holds NaN.
    first = figures["0"]
    assert (first.calls, first.elements, first.nan) == (world, 3 * 8, 3), first
    assert first.ranks == (bad,), first
    # Replicate: every rank holds the whole output (all NaN in the row the NaN weight feeds), each counted.
    last = figures["2"]
    assert full_nan == 3 * 4, full_nan
    assert (last.calls, last.elements, last.nan) == (world, world * 3 * 4, world * full_nan), last
    assert last.ranks == tuple(range(world)), last
    assert all(f.unread == 0 for f in figures.values())
    assert "module" in table.splitlines()[2], table


@case
def locate_reads_dtensor_outputs_and_gradients(world: int) -> None:
    bad = world - 1
    firsts: list[Any] = []
    for local_output in (False, True):
        model = tensor_parallel(local_output)
        if dist.get_rank() == bad:
            with torch.no_grad():
                model[0].weight.to_local()[0, 0] = math.nan
        torch.manual_seed(1)
        x = torch.randn(3, 4)
        with nanscan.locate(model) as trace:
            out = model(x)
            (out.full_tensor() if isinstance(out, torch.distributed.tensor.DTensor) else out).sum().backward()
        finite = every_rank(trace.finite)
        firsts.append([(f.module, f.kind) if f is not None else None for f in trace.first_by_rank()])
        assert finite == [False] * world, (local_output, finite)
        assert trace.unread == [], trace.unread
    for by_rank in firsts:
        # Each rank locates its own first event: the bad rank at the column-parallel layer that made
        # the NaN, the others at the row-parallel layer whose all-reduce brought it to them.
        want = [("2", "output")] * world
        want[bad] = ("0", "output")
        assert by_rank == want, by_rank


@case
def locate_reads_fsdp2_gradients(world: int) -> None:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    bad = world - 1
    torch.manual_seed(100 + dist.get_rank())
    x = torch.randn(3, 4)
    if dist.get_rank() == bad:
        x[0, 0] = math.nan  # only this rank's data: the others' activations stay finite
    with nanscan.locate(model) as trace:
        model(x).sum().backward()
    finite = every_rank(trace.finite)
    kinds = every_rank(trace.first.kind if trace.first is not None else None)
    grads_finite = every_rank(all(bool(p.grad.to_local().isfinite().all()) for p in model.parameters()))
    # The reduce-scatter brings the bad rank's NaN into every rank's gradient shards: every rank
    # whose shards hold one sees it (in a parameter gradient, where its activations were finite).
    assert finite == grads_finite, (finite, grads_finite)
    assert not finite[bad] and kinds[bad] == "output", kinds
    for rank in range(world):
        if rank != bad and not finite[rank]:
            assert kinds[rank] == "parameter-gradient", kinds
    assert not all(finite)


def ddp(module: torch.nn.Module, **kwargs: Any) -> torch.nn.parallel.DistributedDataParallel:
    model = torch.nn.parallel.DistributedDataParallel(module, **kwargs)
    nanscan.ddp.attach(model)
    return model


class _Unused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = torch.nn.Linear(4, 2)
        self.unused = torch.nn.Linear(4, 2)  # in a's bucket, never given a gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x)


@case
def ddp_hook_names_the_rank_beside_an_unused_parameter(world: int) -> None:
    model = ddp(_Unused(), find_unused_parameters=True)
    bad = world - 1
    found = []
    for _ in range(2):  # the second step: buckets rebuilt by DDP after the first
        model.zero_grad()
        torch.manual_seed(100 + dist.get_rank())
        x = torch.randn(3, 4)
        if dist.get_rank() == bad:
            x[0, 0] = math.nan
        model(x).sum().backward()
        found.append(nanscan.check(model).nonfinite_ranks)
    for ranks in found:
        assert ranks == {"a.weight": [bad]}, ranks


@case
def ddp_hook_names_no_rank_after_a_backward_it_did_not_see(world: int) -> None:
    model = ddp(torch.nn.Linear(4, 2))
    first_maker, second_maker = world - 1, 0
    torch.manual_seed(100 + dist.get_rank())
    x = torch.randn(3, 4)
    if dist.get_rank() == first_maker:
        x[0, 0] = math.nan
    model(x).sum().backward()
    synced = nanscan.check(model).nonfinite_ranks
    model.zero_grad()
    x = torch.randn(3, 4)
    if dist.get_rank() == second_maker:
        x[0, 0] = math.nan
    with model.no_sync():  # no all-reduce, no hook: the flags of the synced step are stale
        model(x).sum().backward()
    scanner = scanner_of(model)
    assert scanner is not None
    # The hook's own bookkeeping, asked directly (check may refuse a model whose gradients are unsynced).
    attribution = scanner.attribution((id(model.module.weight), id(model.module.bias)), torch.device("cpu"))
    rows = zip(
        attribution.count.tolist(), attribution.rank_sum.tolist(), attribution.rank_square_sum.tolist(), strict=True
    )
    ranks = [Attribution.ranks(*row, attribution.any_by_rank.tolist()) for row in rows]
    try:
        after = nanscan.check(model).nonfinite_ranks
    except (ValueError, RuntimeError):  # refused: a check inside no_sync() reads unsynced gradients
        after = None
    assert synced == {"weight": [first_maker]}, synced
    assert ranks == [[], []], f"stale flags reused: {ranks}"
    if after is not None:
        assert all(r == [] for r in after.values()), after


@case
def ddp_hook_names_the_maker_across_synced_passes(world: int) -> None:
    """Gradient accumulation over synced backward passes (no no_sync): the second pass's buckets
    hold the first pass's all-reduced sum. A NaN made in the first pass is the maker's alone; one made
    in the second, after a finite first, is named too."""
    bad = world - 1
    found = []
    for nan_pass in (0, 1):
        model = ddp(torch.nn.Linear(4, 2))
        torch.manual_seed(100 + dist.get_rank())
        for micro in range(2):
            x = torch.randn(3, 4)
            if micro == nan_pass and dist.get_rank() == bad:
                x[0, 0] = math.nan
            model(x).sum().backward()
        found.append(nanscan.check(model).nonfinite_ranks)
    for ranks in found:
        assert ranks == {"weight": [bad]}, (found, ranks)
