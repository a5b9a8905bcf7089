"""What a Recorder adds to each step's check, on the gradients of real models (benchmarks/zoo.json).

    python benchmarks/bench_recorder.py                          # every zoo model but llama-1b, CPU
    python benchmarks/bench_recorder.py --models gpt2-small --device cuda
    python benchmarks/bench_recorder.py --quick                  # smoke test (CI)
    python benchmarks/bench_recorder.py --sink lists             # a sink that reads every list
    python benchmarks/bench_recorder.py --append --models resnet50  # the recorder's own work, thread time
    python benchmarks/bench_recorder.py --append --updates       # ... with an update watch measuring every step

Per model: ``check(model, max_norm=...)`` alone, and with ``recorder=`` (a Recorder that reads its
buffer every ``--every`` steps, into a sink, so the read and the records' making on the host are
timed but no file writing is), in alternating rounds of ``--every`` steps, so each recorded round
holds exactly one read of the buffer. ``--sink drop`` (default) drops each record: what the recorder
itself costs, and what a sink that reads a step's totals adds to it (a record's per-parameter lists
are made only when read). ``--sink lists`` reads every per-parameter list of every record: the
Python numbers a sink that writes them (JSONL, CSV, TensorBoard) pays for before its own writing.
Each round is a pair of one plain and one recorded run, in alternating order. The times are the
medians over rounds of the time per step; the overhead is the median over rounds of each pair's
ratio, with its quartiles (the spread a shared machine gives one run). The issue's target: at most
5% over a plain check on the CPU zoo lists, and zero syncs.

``--append`` times the recorder's own work instead, in ``time.thread_time`` (the calling thread's
CPU time, which other jobs on a shared machine do not inflate as they do wall time; on a GPU, host
time): each of ``--rounds`` x ``--every`` appends, first back to back (warm caches), then each right
after a plain check (which has just streamed the gradients through the caches, as in training). The
medians are an append alone; the means add the median refresh (every ``spike_window // 4`` records)
and the read (every ``--every``): the recorder's cost per step. With ``--updates`` the recorder has
an update watch (``Recorder(updates=nanscan.watch_updates(...))``) whose optimizer (SGD, learning
rate 0) steps before every append, untimed: every record takes a measured step's norms, and every
read works out their spike ratios, the most an update watch adds (``every=1``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

import nanscan
from nanscan.records import PER_PARAMETER, StepRecord

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_scan import DEFAULT_ZOO, load_zoo  # a sibling script, not a package


def model_of(shapes: list[list[int]], device: str) -> torch.nn.ParameterList:
    """A module holding parameters of the zoo's shapes, each with a random fp32 gradient."""
    gen = torch.Generator().manual_seed(0)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter(torch.empty(shape, device=device))
        p.grad = torch.randn(shape, generator=gen).to(device)
        params.append(p)
    return torch.nn.ParameterList(params)


def read_lists(record: StepRecord) -> None:
    """Reads every per-parameter list of a record (each made a Python list on first reading)."""
    for key in PER_PARAMETER:
        getattr(record, key)


SINKS: dict[str, Callable[[StepRecord], None]] = {"drop": lambda record: None, "lists": read_lists}


def round_seconds(step: Callable[[], object], steps: int, device: str) -> float:
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def append_costs(
    model: torch.nn.Module, every: int, appends: int, updates: bool = False
) -> tuple[list[float], list[float]]:
    """Thread time per append in us: ``appends`` back to back, then ``appends`` each right after a check
    (with ``updates``, each after an untimed optimizer step that the recorder's update watch measures)."""
    step: Callable[[], object] = lambda: None  # noqa: E731
    watch = None
    if updates:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        watch = nanscan.watch_updates(optimizer, model)
        step = optimizer.step
    recorder = nanscan.Recorder([SINKS["drop"]], every=every, warn=False, updates=watch)
    report = nanscan.check(model, max_norm=1e30)
    step()
    recorder.append(report)  # allocates the buffer
    warm, after_check = [], []
    for _ in range(appends):
        step()
        start = time.thread_time_ns()
        recorder.append(report)
        warm.append((time.thread_time_ns() - start) / 1e3)
    for _ in range(appends):
        report = nanscan.check(model, max_norm=1e30)
        step()
        start = time.thread_time_ns()
        recorder.append(report)
        after_check.append((time.thread_time_ns() - start) / 1e3)
    recorder.close()
    return warm, after_check


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", help="comma-separated zoo names (default: all but llama-1b)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--every", type=int, default=20, help="steps between two reads of the buffer")
    parser.add_argument("--rounds", type=int, default=7, help="rounds per method and model")
    parser.add_argument("--zoo", type=Path, default=DEFAULT_ZOO)
    parser.add_argument("--quick", action="store_true", help="smoke test: the smallest model, 2 rounds")
    parser.add_argument(
        "--sink", choices=sorted(SINKS), default="drop", help="what the sink reads of each record (module notes)"
    )
    parser.add_argument("--append", action="store_true", help="time the append alone, in thread time (module notes)")
    parser.add_argument("--updates", action="store_true", help="with --append: an update watch measuring every step")
    args = parser.parse_args()
    zoo = load_zoo(args.zoo)
    if args.quick:
        names = [min(zoo, key=lambda m: sum(math.prod(shape) for shape in zoo[m]))]
        args.rounds = 2
    elif args.models:
        names = args.models.split(",")
    else:
        names = [m for m in zoo if m != "llama-1b"]
    unknown = [m for m in names if m not in zoo]
    if unknown:
        sys.exit(f"bench_recorder: unknown model(s) {', '.join(unknown)}; the zoo has {', '.join(zoo)}")
    print(
        f"nanscan {nanscan.__version__}, torch {torch.__version__}, {args.device}, threads {torch.get_num_threads()}, "
        f"sink {args.sink}"
    )
    if args.append:
        watched = ", an update watch measuring every step" if args.updates else ""
        print(
            f"thread time per append, us; {args.rounds * args.every} appends each way, a read every {args.every}{watched}"
        )
        print(f"{'model':<12} {'params':>6} {'warm median':>12} {'mean':>7} {'after check median':>19} {'mean':>7}")
        for name in names:
            warm, after_check = append_costs(
                model_of(zoo[name], args.device), args.every, args.rounds * args.every, args.updates
            )
            print(
                f"{name:<12} {len(zoo[name]):>6} {statistics.median(warm):>12.1f} {statistics.mean(warm):>7.1f} "
                f"{statistics.median(after_check):>19.1f} {statistics.mean(after_check):>7.1f}",
                flush=True,
            )
        return
    print(
        f"{'model':<12} {'params':>6} {'MB':>7} {'check ms':>9} {'+recorder ms':>13} {'overhead':>9} "
        f"{'quartiles %':>12} {'buffer KB':>10}"
    )
    for name in names:
        print(
            f"  ({name}: building gradients, then {args.rounds} rounds of {args.every} steps each way)", file=sys.stderr
        )
        model = model_of(zoo[name], args.device)
        megabytes = sum(p.numel() for p in model.parameters()) * 4 / 1e6
        recorder = nanscan.Recorder([SINKS[args.sink]], every=args.every, warn=False)

        def plain(model: torch.nn.Module = model) -> object:
            return nanscan.check(model, max_norm=1e30)

        def recorded(model: torch.nn.Module = model, recorder: nanscan.Recorder = recorder) -> object:
            return nanscan.check(model, max_norm=1e30, recorder=recorder)

        round_seconds(plain, 2, args.device)
        round_seconds(recorded, args.every, args.device)  # allocates the buffer; its first read
        plain_times, recorded_times = [], []
        for r in range(args.rounds):
            # Each round is a pair, in alternating order (plain first, then recorded first), so neither
            # method always follows the other; the overhead is the median of the pairs' ratios, which
            # a slow spell of the shared machine shifts for both halves of a pair alike.
            first, second = (plain, recorded) if r % 2 == 0 else (recorded, plain)
            times = {id(first): round_seconds(first, args.every, args.device)}
            times[id(second)] = round_seconds(second, args.every, args.device)
            plain_times.append(times[id(plain)])
            recorded_times.append(times[id(recorded)])
        base, with_recorder = statistics.median(plain_times), statistics.median(recorded_times)
        ratios = sorted(rec / pl - 1 for rec, pl in zip(recorded_times, plain_times, strict=True))
        low, high = ratios[len(ratios) // 4], ratios[(3 * len(ratios)) // 4]
        print(
            f"{name:<12} {len(zoo[name]):>6} {megabytes:>7.0f} {base * 1e3:>9.3f} {with_recorder * 1e3:>13.3f} "
            f"{statistics.median(ratios) * 100:>8.1f}% {low * 100:>5.1f}..{high * 100:<5.1f} {recorder.nbytes / 1e3:>10.0f}",
            flush=True,
        )
        recorder.close()
        del model


if __name__ == "__main__":
    main()
