"""DDP: which rank made the NaN, and whether the replicas still agree.

DDP's all-reduce spreads one rank's NaN to every rank's gradient, so after `backward()` every rank
looks guilty. `nanscan.ddp.attach(model)` registers a comm hook that scans each bucket of a rank's
own gradients before the all-reduce (then runs DDP's usual all-reduce), so the check can name the
rank that made it: `report.nonfinite_ranks`. `verify_replicas=True` also proves, with two small
all-reduces, that every replica holds bit-identical gradients (silent data corruption shows up as
`report.divergent`), and `nanscan.verify_replicas(model)` does the same for the weights.
At `--fault-step` the last rank gets a corrupt sample (a NaN in its input).
GPUs: NCCL, one per process; else the CPU, gloo.
"""
# Run: torchrun --standalone --nproc-per-node 2 examples/ddp.py

from __future__ import annotations

import argparse
import math
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import nanscan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--fault-step", type=int, default=None, help="step whose batch is corrupt on the last rank (default: half way)"
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

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4)).to(device)
    model = DistributedDataParallel(net, device_ids=[device.index] if device.type == "cuda" else None)
    nanscan.ddp.attach(model)  # before the first backward; attach(model, hook=...) wraps another comm hook
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    teacher = torch.randn(32, 4, device=device) / 32**0.5  # the synthetic task: y = x @ teacher
    torch.manual_seed(1 + rank)  # each rank its own data

    bad_rank = world - 1
    for step in range(args.steps):
        x = torch.randn(64, 32, device=device)
        y = x @ teacher
        if step == fault_step and rank == bad_rank:
            x[7, 3] = math.nan  # a corrupt sample on one rank
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()

        report = nanscan.check(model, max_norm=1.0, on_nonfinite="skip", optimizer=optimizer, verify_replicas=True)
        optimizer.step()  # every rank holds the same all-reduced gradient: they all skip together
        if not report.finite:  # one sync
            if rank == 0:
                # Names as you wrote them, without DDP's "module.": {'0.weight': [1], ...}
                print(f"step {step}: NaN/Inf in {report.nonfinite}; made by ranks {report.nonfinite_ranks}")
            assert all(ranks == [bad_rank] for ranks in report.nonfinite_ranks.values())
        elif rank == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f} (rank 0)  grad norm {report.total_norm:.3f}")
        if not report.replicas_consistent:  # a replica's gradient differs after the all-reduce
            print(f"rank {rank}, step {step}: replicas disagree: {report.divergent}")

    weights = nanscan.verify_replicas(model)  # after the last step: do the replicas' weights still agree?
    skips = nanscan.SkipGuard.of(optimizer).total_skips
    if rank == 0:
        print(f"done on {world} ranks: {skips} step(s) skipped; weights identical on every rank: {weights.consistent}")
    assert weights.consistent and skips == (1 if 0 <= fault_step < args.steps else 0)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
