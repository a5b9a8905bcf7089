"""The cost of ``nanscan.check_state`` with Adam's state, against one ``torch.sum`` over the same bytes.

    python benchmarks/bench_state.py                      # the zoo lists but llama-1b, CPU (~1 min)
    python benchmarks/bench_state.py --quick              # smoke test
    python benchmarks/bench_state.py --device cuda --models gpt2-small,llama-1b   # on a GPU
    python benchmarks/bench_state.py --updates            # watch_updates' sampled step instead
    python benchmarks/bench_state.py ... --profile        # then where one check_state call's time goes, by op

For each zoo list (benchmarks/zoo.json: real models' parameter shapes), fp32 parameters and the two
Adam moments of each (``exp_avg``, ``exp_avg_sq``; an optimizer.state built as torch.optim.Adam
keeps it), so 3x the parameters' bytes are read. Timed in rotating rounds (DESIGN.md section 5),
medians:

* ``ceiling``: ``torch.sum`` of one flat fp32 buffer of the same element count: one read of the bytes;
* ``check_state``: ``nanscan.check_state(params, optimizer)`` plus reading ``report.finite`` (the one
  sync a caller makes);
* ``per-tensor isfinite loop``: what a hand-written check does (``torch.isfinite(t).all()`` per tensor,
  summed on the device, read once).

On CUDA, also the GPU and the host time of one check_state call apart (bench_scan.py's method: the
GPU held busy while the host enqueues the call, CUDA events around it), since a list of many small
states can be host-bound where its bytes take less time than its calls (``check_state GPU ms``,
``host ms``).

The target (issue 30): check_state at most 1.15x the ceiling.

``--profile`` then runs check_state's timed method (the call, ``report.finite``, a sync) under torch's
profiler for each list and prints the ops that hold its time, host and device apart: on an H200,
GPT-2-small's call took 1.08 ms against 0.33 ms of host time and 0.36 ms of GPU time, the rest
unexplained (benchmarks/RESULTS.md, 2026-11-29).

``--updates`` measures ``nanscan.watch_updates``' sampled step instead, over fp32 weights of the zoo
list's shapes (their bytes W): its two hooks (the copy before ``optimizer.step()``, the pass after
it), against ``read`` (``torch.sum`` of W bytes), ``copy`` (``torch._foreach_copy_`` of the weights:
2W) and ``unfused`` (the pass the watch makes where no fused kernel exists: the copy, the in-place
difference, the scan of differences and weights: 7W). The target (issue 30): at most one copy plus
one read of the weights, ``copy + read``. ``sketch`` is the copy-free watch's sampled step
(``watch_updates(sketch=1024)``: a CountSketch of the weights before the step and after it, 2W read,
nothing of the weights' size written).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import nanscan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_locate import profiled_ops, time_methods
from bench_scan import SYNTHETIC, Method, gpu_and_host_times

ZOO = Path(__file__).resolve().parent / "zoo.json"


def adam_state(shapes: list[list[int]], device: torch.device) -> tuple[list[torch.nn.Parameter], torch.optim.Adam]:
    """Parameters of these shapes and an Adam whose state holds both moments for each (as after a step),
    with values of the magnitudes a moment has (exp_avg ~ gradients, exp_avg_sq their squares)."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, device=device) * 0.02) for shape in shapes]
    optimizer = torch.optim.Adam(params, lr=1e-3)
    for p in params:
        g = torch.randn_like(p) * 1e-3
        optimizer.state[p] = {
            "step": torch.tensor(1.0),
            "exp_avg": g * 0.1,
            "exp_avg_sq": g * g * 1e-3,
        }
    return params, optimizer


def measure(name: str, shapes: list[list[int]], device: torch.device, rounds: int) -> dict[str, object]:
    """One zoo list's row: the medians of the three methods, and check_state over the ceiling."""
    params, optimizer = adam_state(shapes, device)
    tensors = [t for p in params for t in (p.detach(), optimizer.state[p]["exp_avg"], optimizer.state[p]["exp_avg_sq"])]
    flat = torch.randn(sum(t.numel() for t in tensors), device=device)

    def loop() -> bool:
        bad = torch.zeros((), device=device)
        for t in tensors:
            bad += (~torch.isfinite(t)).any()
        return not bool(bad)

    times = time_methods(
        {"ceiling": flat.sum, "check_state": lambda: nanscan.check_state(params, optimizer).finite, "loop": loop},
        rounds,
        warmup=1,
        device=device,
    )
    figures = {method: statistics.median(ms) for method, ms in times.items()}
    if device.type == "cuda":
        # No inputs to rotate or restore: check_state reads its own tensors and writes nothing.
        method = Method("check_state", lambda _: nanscan.check_state(params, optimizer))
        split = gpu_and_host_times([method], None, rounds)
        gpu, host, _ = split["check_state"]
        figures["gpu_ms"] = statistics.median(gpu) * 1e3
        figures["host_ms"] = statistics.median(host) * 1e3
    mb = flat.numel() * 4 / 1e6
    return {
        "model": name,
        "tensors": len(tensors),
        "mb": mb,
        **figures,
        "ratio": figures["check_state"] / figures["ceiling"],
    }


PROFILE_CALLS = 10
PROFILE_OPS = 12  # printed, the longest first


def profile_check_state(name: str, shapes: list[list[int]], device: torch.device) -> None:
    """check_state's timed method under torch's profiler: the wall time per call, the self host and
    self device time summed over ops, and the ops that hold the most of either."""
    params, optimizer = adam_state(shapes, device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed_call() -> None:  # as measure() times it: the call, the one read a caller makes, a sync
        _ = nanscan.check_state(params, optimizer).finite
        sync()

    wall_ms, rows = profiled_ops(timed_call, PROFILE_CALLS, device)
    host_ms, device_ms = sum(r[1] for r in rows.values()), sum(r[2] for r in rows.values())
    print(
        f"\n{name}: check_state under the profiler, ms per call: wall {wall_ms:.3f}, self host time {host_ms:.3f}, "
        f"self device time {device_ms:.3f}"
    )
    print(f"{'op (the most time, host or device)':<60}{'calls':>7}{'host ms':>9}{'device ms':>10}")
    for key, (calls, host, dev) in sorted(rows.items(), key=lambda kv: -max(kv[1][1], kv[1][2]))[:PROFILE_OPS]:
        print(f"{key[:58]:<60}{calls:>7d}{host:>9.3f}{dev:>10.3f}")


def measure_updates(name: str, shapes: list[list[int]], device: torch.device, rounds: int) -> dict[str, object]:
    """One zoo list's row of --updates: the medians of the watch's sampled step and its yardsticks."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, device=device) * 0.02) for shape in shapes]
    optimizer = torch.optim.SGD(params, lr=0.0)
    watch = nanscan.watch_updates(optimizer, params)
    sketched = nanscan.watch_updates(optimizer, params, sketch=1024)
    copies = [torch.empty_like(p) for p in params]
    flat = torch.randn(sum(p.numel() for p in params), device=device)
    detached = [p.detach() for p in params]

    def sampled_step() -> object:  # the two hooks around a step, as optimizer.step() calls them
        watch._before(optimizer, (), {})
        watch._after(optimizer, (), {})
        return watch.ratio

    def sketched_step() -> object:
        sketched._before(optimizer, (), {})
        sketched._after(optimizer, (), {})
        return sketched.ratio

    def unfused() -> object:
        torch._foreach_copy_(copies, detached)
        torch._foreach_sub_(copies, detached)
        return nanscan.scan(copies + detached).norm

    times = time_methods(
        {
            "read": flat.sum,
            "copy": lambda: torch._foreach_copy_(copies, detached),
            "watch": sampled_step,
            "sketch": sketched_step,
            "unfused": unfused,
        },
        rounds,
        warmup=1,
        device=device,
    )
    figures = {method: statistics.median(ms) for method, ms in times.items()}
    watch.remove()
    sketch_mb = sketched.nbytes / 1e6
    sketched.remove()
    return {"model": name, "tensors": len(params), "mb": flat.numel() * 4 / 1e6, "sketch mb": sketch_mb, **figures}


def main_updates(models: list[str], zoo: dict[str, list[list[int]]], device: torch.device, rounds: int) -> list[dict]:
    print(
        f"{'model':<22}{'tensors':>8}{'MB W':>7}{'read ms':>9}{'copy ms':>9}{'watch ms':>10}{'x read':>8}"
        f"{'target x':>9}{'unfused ms':>11}{'x read':>8}{'sketch ms':>10}{'x read':>8}{'MB kept':>8}"
    )
    rows = []
    for name in models:
        row = measure_updates(name, zoo[name], device, rounds)
        rows.append(row)
        read = row["read"]
        print(
            f"{name:<22}{row['tensors']:>8}{row['mb']:>7.0f}{read:>9.2f}{row['copy']:>9.2f}{row['watch']:>10.2f}"
            f"{row['watch'] / read:>7.2f}x{(row['copy'] + read) / read:>8.2f}x{row['unfused']:>11.2f}"
            f"{row['unfused'] / read:>7.2f}x{row['sketch']:>10.2f}{row['sketch'] / read:>7.2f}x{row['sketch mb']:>8.1f}"
        )
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--models",
        help="comma-separated zoo names, or bench_scan's synthetic lists (many_small_10000x1024: 10,000 tensors "
        "of 4 KB; default: the zoo's all but llama-1b; --quick: resnet50)",
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 15, --quick 3)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--updates", action="store_true", help="watch_updates' sampled step (module notes)")
    parser.add_argument(
        "--profile", action="store_true", help="then each list's check_state call under torch's profiler, by op"
    )
    args = parser.parse_args()
    real = json.loads(ZOO.read_text())
    models = (
        args.models.split(",")
        if args.models
        else (["resnet50"] if args.quick else [m for m in real if m != "llama-1b"])
    )
    zoo = {**real, **SYNTHETIC}
    unknown = [m for m in models if m not in zoo]
    if unknown:
        parser.error(f"unknown model(s) {', '.join(unknown)}; known: {', '.join(zoo)}")
    rounds = args.rounds or (3 if args.quick else 15)
    device = torch.device(args.device)
    print(f"nanscan {nanscan.__version__}, torch {torch.__version__}, {device}, {torch.get_num_threads()} threads")
    if args.updates:
        rows = main_updates(models, zoo, device, rounds)
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps({"torch": torch.__version__, "device": str(device), "rows": rows}))
        return 0
    split = device.type == "cuda"
    print(
        f"{'model':<22}{'tensors':>8}{'MB read':>9}{'ceiling ms':>12}{'check_state ms':>16}{'x ceiling':>10}{'loop ms':>10}"
        + (f"{'GPU ms':>9}{'host ms':>9}" if split else "")
    )
    rows = []
    for name in models:
        row = measure(name, zoo[name], device, rounds)
        rows.append(row)
        print(
            f"{name:<22}{row['tensors']:>8}{row['mb']:>9.0f}{row['ceiling']:>12.2f}{row['check_state']:>16.2f}"
            f"{row['ratio']:>9.2f}x{row['loop']:>10.2f}"
            + (f"{row['gpu_ms']:>9.2f}{row['host_ms']:>9.2f}" if split else "")
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"torch": torch.__version__, "device": str(device), "rows": rows}, indent=1))
    if args.profile:
        for name in models:
            profile_check_state(name, zoo[name], device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
