"""The cost of checking and clipping sharded gradients, FSDP2 (DTensor) and FSDP1 (flat parameters):
nanscan against torch and FSDP, 2 processes.

    python benchmarks/bench_distributed.py                    # launches 2 ranks itself (torchrun)
    torchrun --nproc_per_node 2 benchmarks/bench_distributed.py --tensors 100,1000,5000
    python benchmarks/bench_distributed.py --stacks fsdp1     # FSDP1's rows only
    python benchmarks/bench_distributed.py --quick            # a smoke run (seconds)

FSDP2 (``--stacks fsdp2``): a model of 16x16 Linear layers is sharded with ``fully_shard`` (gloo, on
the CPU), so every gradient is a DTensor with Shard(0) placement; one backward, then each method is
timed on the same gradients (nothing is clipped, max_norm 1e9, so every call sees the same values),
in interleaved rounds:

* ``torch``: ``torch.nn.utils.clip_grad_norm_(params, 1e9)`` and ``.full_tensor()`` of the norm it
  returns (a DTensor), which is how one gets the value.
* ``nanscan.clip``: ``nanscan.clip_grad_norm_(params, 1e9)``, and ``float()`` of its plain norm.
* ``nanscan.check``: ``nanscan.check(model, max_norm=1e9)`` and ``report.finite`` (global statistics
  of every parameter, read on the host). It names the gradients after the module tree, whose walk it
  keeps between calls and verifies each call (nanscan.walk).
* ``check(named)``: ``nanscan.check(named, max_norm=1e9)`` and ``report.finite``, where ``named`` is
  ``list(model.named_parameters())`` made once, as torch's and nanscan's clips get their parameter
  list made once: the same report without the module tree.
* ``named_params``: ``list(model.named_parameters())`` alone, no collective: torch's walk of the
  module tree, for scale (what ``check(model)`` paid each call before it kept the walk).

FSDP1 (``--stacks fsdp1``, ``use_orig_params`` False and True): the same parameters in blocks of five
16x16 Linear layers, each block an FSDP1 unit (FULL_SHARD, a transformer layer's size in parameters:
10), so 5,000 parameters are 500 units:

* ``FSDP``: FSDP's own ``model.clip_grad_norm_(1e9)`` and ``float()`` of its norm.
* ``nanscan.clip``: ``nanscan.clip_grad_norm_(model, 1e9)`` (a model, which nanscan's clip takes).
* ``clip(params)``: ``nanscan.clip_grad_norm_(params, 1e9)`` of the model's parameters, once seen.
* ``nanscan.check``: ``nanscan.check(model, max_norm=1e9)`` and ``report.finite``: every parameter's
  global statistics, under the names the user wrote.

Times are of the whole call on rank 0 (gloo collectives are synchronous on the CPU, so host time is
the time). Collectives per call are counted with the profiler (gloo's collective events). What this
cannot show: NCCL on GPUs, where nanscan's collectives are asynchronous on the stream and torch's
per-tensor DTensor dispatch is the same host work as here.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import nanscan


def model_of(tensors: int) -> torch.nn.Module:
    """Linear(16, 16) layers: two parameters (weight, bias) each."""
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(tensors // 2)])


def collectives(fn: Callable[[], object]) -> int:
    """Collective events (gloo's all-reduce, all-gather, ...) one call of ``fn`` records."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = ("all_reduce", "allreduce", "all_gather", "allgather", "reduce_scatter", "broadcast")
    return sum(1 for e in prof.events() if e.name.startswith("gloo:") and any(n in e.name for n in names))


def time_methods(methods: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Median milliseconds per call of each method, from interleaved rounds after a warm-up round."""
    for fn in methods.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            dist.barrier()
            start = time.perf_counter()
            methods[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return {name: statistics.median(t) for name, t in times.items()}


def measure(tensors: int, rounds: int) -> dict[str, Any]:
    from torch.distributed.fsdp import fully_shard

    model = model_of(tensors)
    fully_shard(model)
    model(torch.randn(4, 16)).square().mean().backward()
    params = list(model.parameters())
    named = list(model.named_parameters())
    methods: dict[str, Callable[[], object]] = {
        "torch": lambda: torch.nn.utils.clip_grad_norm_(params, 1e9).full_tensor(),
        "nanscan.clip": lambda: float(nanscan.clip_grad_norm_(params, 1e9)),
        "nanscan.check": lambda: nanscan.check(model, max_norm=1e9).finite,
        "check(named)": lambda: nanscan.check(named, max_norm=1e9).finite,
        "named_params": lambda: list(model.named_parameters()),
    }
    torch_norm = float(methods["torch"]())  # type: ignore[arg-type]
    ours = float(nanscan.clip_grad_norm_(params, 1e9))
    assert abs(ours - torch_norm) <= 1e-5 * torch_norm, f"norms differ: {ours} vs {torch_norm}"
    counts = {name: collectives(fn) for name, fn in methods.items()}
    medians = time_methods(methods, rounds)
    return {"stack": "FSDP2", "tensors": len(params), "median_ms": medians, "collectives": counts}


class Block(torch.nn.Module):
    """Five 16x16 Linear layers: one FSDP1 unit of ten parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(5)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def measure_fsdp1(tensors: int, rounds: int, use_orig_params: bool) -> dict[str, Any]:
    from torch.distributed.fsdp import FullyShardedDataParallel
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = FullyShardedDataParallel(
        torch.nn.Sequential(*[Block() for _ in range(max(1, tensors // 10))]),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        use_orig_params=use_orig_params,
        device_id=torch.device("cpu"),
    )
    model(torch.randn(4, 16)).square().mean().backward()
    params = list(model.parameters())
    methods: dict[str, Callable[[], object]] = {
        "FSDP": lambda: float(model.clip_grad_norm_(1e9)),
        "nanscan.clip": lambda: float(nanscan.clip_grad_norm_(model, 1e9)),
        "clip(params)": lambda: float(nanscan.clip_grad_norm_(params, 1e9)),
        "nanscan.check": lambda: nanscan.check(model, max_norm=1e9).finite,
    }
    theirs = float(methods["FSDP"]())  # type: ignore[arg-type]
    ours = float(methods["nanscan.clip"]())  # type: ignore[arg-type]
    assert abs(ours - theirs) <= 1e-5 * theirs, f"norms differ: {ours} vs {theirs}"
    report = nanscan.check(model)
    counts = {name: collectives(fn) for name, fn in methods.items()}
    medians = time_methods(methods, rounds)
    stack = f"FSDP1 use_orig_params={use_orig_params}"
    return {"stack": stack, "tensors": len(report.names), "median_ms": medians, "collectives": counts}


def report(rows: list[dict[str, Any]]) -> None:
    for stack in dict.fromkeys(row["stack"] for row in rows):
        base_name = "torch" if stack == "FSDP2" else "FSDP"
        print(
            f"\n{stack}: {'parameters':>10} {'method':<14} {'median ms':>10} {'us/param':>9} {'vs ' + base_name:>9}"
            f" {'collectives':>12}"
        )
        for row in (r for r in rows if r["stack"] == stack):
            n, base = row["tensors"], row["median_ms"][base_name]
            for name, ms in row["median_ms"].items():
                speed = f"{base / ms:.1f}x" if name != base_name else ""
                print(
                    f"{'':>{len(stack) + 1}} {n:>10} {name:<14} {ms:>10.2f} {ms * 1e3 / n:>9.2f} {speed:>9} "
                    f"{row['collectives'][name]:>12}"
                )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", default="100,1000,5000", help="parameter counts, comma-separated")
    parser.add_argument("--stacks", default="fsdp2,fsdp1", help="fsdp2, fsdp1 or both, comma-separated")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--quick", action="store_true", help="100 and 1,000 tensors, 3 rounds")
    parser.add_argument("--json", type=Path, help="write the results here (rank 0)")
    args = parser.parse_args()
    if "RANK" not in os.environ:  # not under torchrun: launch 2 ranks of this script
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", __file__, *sys.argv[1:]]
        return subprocess.call(command)
    counts = [100, 1000] if args.quick else [int(n) for n in args.tensors.split(",")]
    rounds = 3 if args.quick else args.rounds
    dist.init_process_group("gloo")
    stacks = args.stacks.split(",")
    rows = [measure(n, rounds) for n in counts] if "fsdp2" in stacks else []
    if "fsdp1" in stacks:
        rows += [measure_fsdp1(n, rounds, orig) for orig in (False, True) for n in counts]
    if dist.get_rank() == 0:
        print(
            f"nanscan {nanscan.__version__}, torch {torch.__version__}, gloo, {dist.get_world_size()} processes (CPU)"
        )
        report(rows)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(rows, indent=2))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
