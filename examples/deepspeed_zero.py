"""DeepSpeed ZeRO (stage 2, or `--stage 1` or `3`): check, clip and skip between `engine.backward()`
and `engine.step()`.

ZeRO leaves each rank only its partition of the averaged gradients (every `.grad` is None; stage 3
partitions the weights too). `nanscan.check(engine)` reads every rank's pieces, one fused pass each,
and reduces them over DeepSpeed's data-parallel group: every rank gets every parameter's NaN/Inf
counts, min, max and norm, under the names you wrote. `max_norm` clips the pieces that `engine.step()` then applies; with
`on_nonfinite="skip"`, guarding the torch optimizer DeepSpeed steps on its fp32 partition
(`engine.optimizer.optimizer`), a step whose gradients hold a NaN changes no weight on any rank.
At `--fault-step` the last rank gets a corrupt sample (a NaN in its input).
GPUs: NCCL, one per process; else the CPU, gloo.
"""
# Run: torchrun --standalone --nproc-per-node 2 examples/deepspeed_zero.py
# Requires: deepspeed

from __future__ import annotations

import argparse
import math
import os

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2, help="ZeRO stage (default 2)")
    parser.add_argument(
        "--fault-step", type=int, default=None, help="step whose batch is corrupt on the last rank (default: half way)"
    )
    args = parser.parse_args()
    fault_step = args.steps // 2 if args.fault_step is None else args.fault_step

    # NCCL needs a GPU of its own per process; with fewer GPUs than processes, DeepSpeed's CPU accelerator.
    on_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])
    if not on_gpus:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # read when deepspeed is imported
    import deepspeed  # type: ignore[import-untyped]  # (it ships no type information)
    import torch.distributed as dist

    import nanscan

    deepspeed.init_distributed(dist_backend="nccl" if on_gpus else "gloo", verbose=False)
    rank, world = dist.get_rank(), dist.get_world_size()

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 4))
    config = {
        "train_micro_batch_size_per_gpu": 64,
        "optimizer": {"type": "SGD", "params": {"lr": 0.05}},
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    device = engine.device
    teacher = torch.randn(32, 4, device=device) / 32**0.5  # the synthetic task: y = x @ teacher
    torch.manual_seed(1 + rank)  # each rank its own data
    inner = engine.optimizer.optimizer  # the torch optimizer DeepSpeed steps on this rank's fp32 partition

    bad_rank = world - 1
    for step in range(args.steps):
        x = torch.randn(64, 32, device=device)
        y = x @ teacher
        if step == fault_step and rank == bad_rank:
            x[7, 3] = math.nan  # a corrupt sample on one rank
        loss = torch.nn.functional.mse_loss(engine(x), y)
        engine.backward(loss)

        # Between the two: DeepSpeed holds this step's averaged gradients only now.
        report = nanscan.check(engine, max_norm=1.0, on_nonfinite="skip", optimizer=inner)
        engine.step()  # the ranks share one finite flag: they all skip together
        if not report.finite:  # one sync
            if rank == 0:
                # Names as you wrote them, and the ranks whose partitions held the NaN after DeepSpeed's average.
                print(
                    f"step {step}: NaN/Inf in {report.nonfinite}; in the partitions of ranks {report.nonfinite_ranks}"
                )
        elif rank == 0 and (step % 25 == 0 or step == args.steps - 1):
            print(f"step {step}: loss {loss.item():.4f} (rank 0)  grad norm {report.total_norm:.3f}")

    skips = nanscan.SkipGuard.of(inner).total_skips
    # Every rank's copy of the whole weights (ZeRO-3 holds a partition of each: gathered for the copy).
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=args.stage == 3):
        weights = torch.cat([p.detach().reshape(-1) for p in engine.module.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(world)]
    dist.all_gather(gathered, weights)  # they must agree
    if rank == 0:
        finite = bool(weights.isfinite().all())
        print(f"done on {world} ranks, ZeRO-{args.stage}: {skips} step(s) skipped; weights finite: {finite}")
    assert skips == (1 if 0 <= fault_step < args.steps else 0) and bool(weights.isfinite().all())
    assert all(torch.equal(weights, other) for other in gathered)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
