"""FSDP2 (`fully_shard`): one check over every rank's shards, and which rank's shard held the NaN.

Under FSDP2 every gradient is a DTensor, each rank holding one shard. `nanscan.check(model,
max_norm=1.0)` scans each rank's shards in one pass, then reduces with two small all-reduces, so
every rank gets the global statistics, the same clip as `clip_grad_norm_`, and the same skip
decision. At `--fault-step` one rank plants a NaN in its own shard of one gradient;
`report.nonfinite_ranks` names that rank, on every rank.
GPUs: NCCL, one per process; else the CPU, gloo.
"""
# Run: torchrun --standalone --nproc-per-node 2 examples/fsdp2.py

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor

import nanscan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--fault-step", type=int, default=None, help="step whose gradient shard gets a NaN (default: half way)"
    )
    args = parser.parse_args()
    fault_step = args.steps // 2 if args.fault_step is None else args.fault_step

    # NCCL needs a GPU of its own per process; with fewer GPUs than processes, run on the CPU (gloo).
    if torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"]):
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))

    torch.manual_seed(0)  # the same initial weights on every rank before sharding
    hidden = torch.nn.Linear(128, 128)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128), torch.nn.GELU(), hidden, torch.nn.GELU(), torch.nn.Linear(128, 4)
    ).to(device)
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)  # one unit per layer: its weights are gathered only while used
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # steps each rank's shards
    teacher = torch.randn(32, 4, device=device)
    torch.manual_seed(1 + rank)  # each rank its own data

    bad_rank = world - 1
    for step in range(args.steps):
        x = torch.randn(64, 32, device=device)
        loss = torch.nn.functional.mse_loss(model(x), torch.tanh(x @ teacher))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # FSDP2 reduce-scatters: each rank keeps its shard of each gradient
        if step == fault_step and rank == bad_rank:
            grad = hidden.weight.grad
            assert isinstance(grad, DTensor)  # under FSDP2 every gradient is a DTensor
            grad.to_local()[0, 0] = math.nan  # this rank's rows of the 128 x 128 gradient

        report = nanscan.check(model, max_norm=1.0, on_nonfinite="skip", optimizer=optimizer)
        optimizer.step()  # skipped on every rank together: the finite flag is global
        if not report.finite:  # one sync; the same answer on every rank
            if rank == 0:
                print(f"step {step}: NaN/Inf in {report.nonfinite}; held by ranks {report.nonfinite_ranks}")
                print(report)
            assert report.nonfinite_ranks == {"2.weight": [bad_rank]}
        elif rank == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f} (rank 0)  global grad norm {report.total_norm:.3f}")

    skips = nanscan.SkipGuard.of(optimizer).total_skips
    if rank == 0:
        print(f"done on {world} ranks ({device.type}): {skips} step(s) skipped")
    assert skips == (1 if 0 <= fault_step < args.steps else 0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
