"""The cost of checking DeepSpeed ZeRO gradients (nanscan.layouts.zero) against DeepSpeed's own ways
of reading them, 2 processes on the CPU (gloo).

    python benchmarks/bench_zero.py                        # gpt2-small's shapes, ZeRO-2, 2 ranks
    python benchmarks/bench_zero.py --model bert-base --stage 1 --rounds 11
    python benchmarks/bench_zero.py --stage 3              # ZeRO-3: every parameter partitioned
    python benchmarks/bench_zero.py --quick                # a smoke run (seconds)

A DeepSpeed engine trains the model's parameter shapes (benchmarks/zoo.json), fp32, SGD. One forward
and backward of a loss linear in every parameter (each rank its own coefficients, ~1e-3)
leaves DeepSpeed's partitions of the averaged gradients in place; then each method is timed on them
in interleaved rounds (medians of rank 0's times; gloo's collectives are synchronous, so host time
is the time):

* ``DeepSpeed norm``: the total norm DeepSpeed computes inside ``engine.step()`` (per-piece norms,
  one all-reduce), and ``float()`` of it: the peer for the total alone. Stages 1-2:
  ``engine.optimizer.scaled_global_norm()``; stage 3: ``combine_grad_norm_groups`` of
  ``engine.optimizer._get_norm_groups()``, as its step does.
* ``nanscan.clip``: ``nanscan.clip_grad_norm_(params, 1e9)`` and ``float()`` of its norm.
* ``nanscan.check``: ``nanscan.check(engine)`` and ``report.finite``: every parameter's NaN/Inf
  counts, min, max and norm, global, on every rank.
* ``torch foreach_norm``: ``torch._foreach_norm`` of this rank's pieces (stage 3: its partitions,
  padding and all) and one all-reduce of their squares: a hand-written per-parameter norm (no counts, no min/max), for scale.
* ``safe_get_full_grad``: the documented way to read one parameter's gradient under ZeRO (an
  all-reduce of the whole parameter each), for every parameter, then its norm: one round only.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def timed(call: Callable[[], Any]) -> float:
    start = time.perf_counter()
    call()
    return (time.perf_counter() - start) * 1e3


class Weights(torch.nn.Module):
    """Parameters of the given shapes; the forward is a loss linear in each (its coefficients given)."""

    def __init__(self, shapes: list[list[int]]) -> None:
        super().__init__()
        self.weights = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(*shape) * 0.02) for shape in shapes])

    def forward(self, coefficients: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack([(p * c).sum() for p, c in zip(self.weights, coefficients, strict=True)]).sum()


def run_rank(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import safe_get_full_grad

    import nanscan

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    shapes = json.loads((ROOT / "benchmarks" / "zoo.json").read_text())[args.model]
    if args.quick:
        shapes = [[min(d, 64) for d in shape] for shape in shapes[:20]]
    torch.manual_seed(0)
    model = Weights(shapes)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": args.stage},
        "zero_allow_untested_optimizer": True,
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    params = list(engine.module.parameters())
    generator = torch.Generator().manual_seed(100 + rank)
    coefficients = [torch.randn(*shape, generator=generator) * 1e-3 for shape in shapes]
    engine.backward(engine(coefficients))  # a forward: ZeRO-3 gathers its partitioned weights for it
    zero = engine.optimizer
    if args.stage == 3:
        from deepspeed.runtime.utils import combine_grad_norm_groups

        table = vars(zero)["_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"]
        pieces = [table[p.ds_id] for p in params]

        def global_norm() -> torch.Tensor:
            return combine_grad_norm_groups(zero._get_norm_groups())
    else:
        pieces = [
            p._hp_mapping.get_lp_grad_fragment(p._index_in_param_group) for p in params if p._hp_mapping is not None
        ]
        global_norm = zero.scaled_global_norm

    def deepspeed_norm() -> None:
        float(global_norm())

    def nanscan_clip() -> None:
        float(nanscan.clip_grad_norm_(params, 1e9))

    def nanscan_check() -> None:
        _ = nanscan.check(engine).finite

    def foreach_norm() -> None:
        squares = torch.stack(torch._foreach_norm(pieces)).double().square().sum()
        dist.all_reduce(squares)
        float(squares)

    methods = {
        "DeepSpeed norm": deepspeed_norm,
        "nanscan.clip": nanscan_clip,
        "nanscan.check": nanscan_check,
        "torch foreach_norm": foreach_norm,
    }
    for call in methods.values():  # warm-up: plans made, buffers allocated
        call()
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, call in methods.items():
            dist.barrier()
            times[name].append(timed(call))
    dist.barrier()
    full = timed(lambda: [float(safe_get_full_grad(p).norm()) for p in params])
    # nanscan's figures are DeepSpeed's: the total and one parameter's norm, against its own answers.
    report = nanscan.check(engine)
    agree_total = abs(report.total_norm - float(global_norm())) / report.total_norm
    if rank == 0:
        numel = sum(getattr(p, "ds_numel", p.numel()) for p in params)
        print(
            f"{args.model}: {len(params)} parameters, {numel / 1e6:.1f} M elements, ZeRO-{args.stage}, "
            f"{world} gloo ranks; {args.rounds} rounds, median ms of rank 0 (vs DeepSpeed's norm)"
        )
        base = statistics.median(times["DeepSpeed norm"])
        for name, samples in times.items():
            median = statistics.median(samples)
            print(f"  {name:20s} {median:9.2f} ms  ({median / base:.2f}x)")
        print(f"  {'safe_get_full_grad':20s} {full:9.2f} ms  ({full / base:.2f}x), every parameter, once")
        print(f"  total norm: nanscan and DeepSpeed agree within {agree_total:.1e} (relative)")
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="gpt2-small", help="a model of benchmarks/zoo.json")
    parser.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    parser.add_argument("--rounds", type=int, default=11)
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="small shapes, 3 rounds")
    parser.add_argument("--rank", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.rounds = 3
    if args.rank is not None:
        run_rank(args.rank, args.world, args.port, args)
        return
    port = free_port()
    passed = sys.argv[1:]
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, *passed, "--rank", str(rank), "--port", str(port)],
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=None if rank == 0 else subprocess.DEVNULL,
            stderr=subprocess.STDOUT if rank == 0 else subprocess.DEVNULL,
        )
        for rank in range(args.world)
    ]
    codes = [proc.wait() for proc in procs]
    if any(codes):
        raise SystemExit(f"bench_zero: a rank failed (exit codes {codes})")


if __name__ == "__main__":
    main()
