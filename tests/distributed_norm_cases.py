"""The total norm across processes (clip_grad_norm_, get_total_norm): run by tests/test_distributed.py.

``clip_grad_norm_`` and ``get_total_norm`` reduce no per-tensor statistic: each rank sums its counted
local parts into one number per mesh (L2), or a NaN flag and a magnitude (inf), and reduces that in
one collective per mesh. These cases hold that path to torch's norm of the whole tensors: every
placement, replicas counted once, several meshes, NaN/Inf propagation, ``process_group``.

Importing tests/distributed_cases.py registers its cases first; these follow, in the same order on
every rank (collectives must match), and the file runs them all: ``python
tests/distributed_norm_cases.py RANK WORLD INIT OUTDIR [CASE ...]``. As there, a case makes all its
collectives before its first assertion, so that a failing rank does not leave the others waiting.
"""

from __future__ import annotations

import math
import sys
from typing import Any

import distributed_fsdp1_cases  # noqa: F401  (registers the FSDP1 cases, after distributed_cases')
import distributed_watch_cases  # noqa: F401  (activations, locate and the DDP hook's attribution)
import torch
import torch.distributed as dist
from distributed_cases import CASES, assert_close, case, counted_all_reduces, run
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

import nanscan

NORM_TYPES = (2.0, math.inf)


def on_every_rank(value: torch.Tensor) -> list[bytes]:
    """The bits of a scalar on every rank (a host collective): equal bits mean the same value."""
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value.detach().double().reshape(()).numpy().tobytes())
    return gathered


def full_norm(full: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The reference: the norm of the whole tensors viewed as one vector, in float64."""
    return torch.linalg.vector_norm(torch.cat([f.reshape(-1).double() for f in full]), norm_type)


def with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    return params


def total_norms_and_collectives(tensors: list[torch.Tensor]) -> tuple[dict[float, torch.Tensor], dict[float, int]]:
    """``get_total_norm`` of ``tensors`` for each norm type, and the all-reduces each one issued."""
    got, calls = {}, {}
    for norm_type in NORM_TYPES:
        with counted_all_reduces() as counted:
            got[norm_type] = nanscan.get_total_norm(tensors, norm_type)
        calls[norm_type] = counted[0]
    return got, calls


def placements_of_every_kind(mesh: DeviceMesh) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(whole tensors, the same as DTensors): uneven Shard(0) and Shard(1), Replicate (counted once),
    Partial (reduced first), and last a one-row Shard(0), whose shard is empty past rank 0 (torch's
    inf norm refuses an empty shard: compare with torch without it)."""
    world = mesh.size()
    torch.manual_seed(5)  # the same whole tensors on every rank
    full = [torch.randn(7, 5), torch.randn(5, 10), torch.randn(11) * 3, torch.randn(2, 3), torch.randn(1, 4)]
    dtensors = [
        distribute_tensor(full[0], mesh, [Shard(0)]),
        distribute_tensor(full[1], mesh, [Shard(1)]),
        distribute_tensor(full[2], mesh, [Replicate()]),
        DTensor.from_local(full[3] / world, mesh, [Partial()]),  # the sum of the ranks' parts: full[3]
        distribute_tensor(full[4], mesh, [Shard(0)]),
    ]
    return full, dtensors


@case
def total_norm_of_every_placement_matches_torch(world: int) -> None:
    mesh = init_device_mesh("cpu", (world,))
    full, dtensors = placements_of_every_kind(mesh)
    got, theirs, calls, bits = {}, {}, {}, {}
    for norm_type in NORM_TYPES:
        with counted_all_reduces() as counted:
            got[norm_type] = nanscan.get_total_norm(dtensors, norm_type)
        calls[norm_type] = counted[0]
        theirs[norm_type] = (
            nanscan.get_total_norm(dtensors[:-1], norm_type),
            torch.nn.utils.get_total_norm(dtensors[:-1], norm_type).full_tensor(),
        )
        bits[norm_type] = on_every_rank(got[norm_type])
    # Clipped by the inf norm: the same gradients as torch's clip of twins (L2: compare_with_torch).
    ours, twins = with_grads(dtensors[:-1]), with_grads(dtensors[:-1])
    clip_total = nanscan.clip_grad_norm_(ours, 0.5, math.inf)
    torch.nn.utils.clip_grad_norm_(twins, 0.5, math.inf)
    clipped = [(p.grad.full_tensor(), q.grad.full_tensor()) for p, q in zip(ours, twins, strict=True)]
    for norm_type in NORM_TYPES:
        total = got[norm_type]
        assert type(total) is torch.Tensor and total.dtype == torch.float32, (type(total), total.dtype)
        assert calls[norm_type] == 1, f"{calls[norm_type]} all-reduces for the {norm_type} norm of one mesh"
        assert len(set(bits[norm_type])) == 1, f"the {norm_type} norm differs between ranks"
        assert_close(total, full_norm(full, norm_type), f"{norm_type} norm", 1e-6)
        assert_close(*theirs[norm_type], f"{norm_type} norm against torch's", 1e-6)
    assert_close(clip_total, full_norm(full[:-1], math.inf), "clip's inf norm")
    coef = min(1.0, 0.5 / (float(full_norm(full[:-1], math.inf)) + 1e-6))  # torch's clip coefficient
    for i, (a, b) in enumerate(clipped):
        assert_close(a, full[i].double() * coef, f"gradient {i} clipped by the inf norm (fp64 reference)", 1e-6)
        # torch 2.11's clip_grad_norm_ leaves a Partial gradient unscaled (seen on the GPU machine;
        # 2.13 scales it): there the reference above is the peer, not torch.
        if dtensors[i].placements != (Partial(),):
            assert_close(a, b, f"gradient {i} clipped by the inf norm, against torch's", 1e-6)


@case
def nonfinite_total_norms_propagate_as_in_torch(world: int) -> None:
    """NaN on the last rank's shard, Inf on the first's, or both: every rank gets torch's value of the
    whole tensor (NaN wins), whatever gloo's MAX does with a NaN operand."""
    mesh = init_device_mesh("cpu", (world,))
    rank, last = dist.get_rank(), world - 1
    norms, refusals = [], []
    for plant in ("nan", "inf", "both"):
        full = torch.ones(world * 3, 4)
        if plant in ("inf", "both"):
            full[1, 2] = -math.inf  # on rank 0's shard
        if plant in ("nan", "both"):
            full[last * 3 + 2, 0] = math.nan  # on the last rank's shard
        grad = distribute_tensor(torch.ones(world * 3, 4), mesh, [Shard(0)])
        grad.to_local().copy_(full[rank * 3 : rank * 3 + 3])
        for norm_type in NORM_TYPES:
            total = nanscan.get_total_norm([grad], norm_type)
            norms.append((plant, norm_type, total, full_norm([full], norm_type), on_every_rank(total)))
        # error_if_nonfinite raises on every rank, before any gradient is written.
        params = with_grads([grad])
        try:
            nanscan.clip_grad_norm_(params, 1e-3, error_if_nonfinite=True)
        except RuntimeError:
            raised = True
        else:
            raised = False
        refusals.append(
            (plant, raised, torch.equal(params[0].grad.to_local().nan_to_num(), grad.to_local().nan_to_num()))
        )
    for plant, norm_type, got, want, bits in norms:
        assert len(set(bits)) == 1, f"{plant}: the {norm_type} norm differs between ranks"
        assert_close(got, want, f"{plant}: {norm_type} norm")
        assert math.isnan(got) == math.isnan(want) and math.isinf(got) == math.isinf(want), (plant, got, want)
    for plant, raised, untouched in refusals:
        assert raised, f"{plant}: clip_grad_norm_(error_if_nonfinite=True) did not raise"
        assert untouched, f"{plant}: a gradient was written before the error"


@case
def replicated_mesh_dim_counted_once_in_the_total(world: int) -> None:
    if world != 4:
        return
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(6)
    full = [torch.randn(6, 5), torch.randn(9), torch.randn(3, 3)]
    dtensors = [
        distribute_tensor(full[0], mesh, [Replicate(), Shard(0)]),  # HSDP
        distribute_tensor(full[1], mesh, [Replicate(), Replicate()]),  # a copy on every rank
        distribute_tensor(full[2], mesh, [Shard(1), Replicate()]),
    ]
    got, calls = total_norms_and_collectives(dtensors)
    for norm_type in NORM_TYPES:
        assert calls[norm_type] == 1, f"{calls[norm_type]} all-reduces for a 2-d mesh"
        assert_close(got[norm_type], full_norm(full, norm_type), f"{norm_type} norm", 1e-6)


@case
def total_norm_over_two_meshes_and_a_plain_tensor(world: int) -> None:
    """One collective per mesh; a plain tensor beside DTensors is this rank's own: refused, unless
    process_group says whose it is."""
    if world != 4:
        return
    whole = init_device_mesh("cpu", (world,))
    pairs = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))["tp"]  # ranks {0, 1} and {2, 3}
    torch.manual_seed(7)
    a, b, plain = torch.randn(8, 3), torch.randn(4, 6), torch.randn(5)
    tensors = [distribute_tensor(a, whole, [Shard(0)]), distribute_tensor(b, pairs, [Shard(1)])]
    got, calls = total_norms_and_collectives(tensors)
    for norm_type in NORM_TYPES:
        assert calls[norm_type] == 2, f"{calls[norm_type]} all-reduces for two meshes"
        assert_close(got[norm_type], full_norm([a, b], norm_type), f"{norm_type} norm", 1e-6)
    try:
        nanscan.get_total_norm([*tensors, plain])
    except ValueError as error:
        assert "plain tensors beside DTensors" in str(error), error
    else:
        raise AssertionError("a plain tensor beside DTensors was added as this rank's own")


@case
def inf_norm_across_pipeline_stages(world: int) -> None:
    """Each rank holds its own tensors (rank 0 none); the inf norm is the largest over every rank's,
    and a NaN on one stage is NaN on all of them. (Run on 2 ranks or more.)"""
    rank = dist.get_rank()
    grads = [torch.full((rank + 2,), -float(rank + 1)), torch.full((3,), 0.5)] if rank else []
    with counted_all_reduces() as counted:
        clean = nanscan.get_total_norm(grads, math.inf, process_group=dist.group.WORLD)
    if rank == world - 1 and grads:
        grads[1][2] = math.nan
    poisoned = nanscan.get_total_norm(grads, math.inf, process_group=dist.group.WORLD)
    assert counted[0] == 1, f"{counted[0]} all-reduces across the stages"
    assert_close(clean, float(world), "inf norm over the stages")  # rank world - 1's -world
    assert math.isnan(poisoned), poisoned


if __name__ == "__main__":  # python tests/distributed_norm_cases.py RANK WORLD INIT OUTDIR [CASE ...]
    rank, world, init, out, *names = sys.argv[1:]
    run(int(rank), int(world), init, names or list(CASES), out)
