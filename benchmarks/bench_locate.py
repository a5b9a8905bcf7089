"""The cost of ``nanscan.locate`` on a training step, against ``torch.autograd.detect_anomaly``.

    python benchmarks/bench_locate.py                       # both models, fp32, ~20 s on 2 CPU cores
    python benchmarks/bench_locate.py --quick               # smoke test (a few seconds)
    python benchmarks/bench_locate.py --model decoder --autocast --json benchmarks/out/locate.json
    python benchmarks/bench_locate.py --device cuda --model decoder --autocast   # on a GPU

A step is ``zero_grad`` + forward + loss + backward (no optimizer step, so every step computes the
same thing). Three ways to run it, timed in the same run on the same model and data:

* ``plain``: the step alone.
* ``locate``: the step inside ``with nanscan.locate(model) as trace:``, plus reading ``trace.finite``
  after the block (the one host sync and the search for the first non-finite event), so the time is
  the whole cost of getting the answer.
* ``detect_anomaly``: the step inside ``torch.autograd.detect_anomaly(check_nan=True)``, torch's own
  tool for the same question (it records a Python stack trace for every forward op and checks every
  backward op's outputs for NaN).

Models: ``decoder``, a GPT-2-shaped causal decoder built from torch's layers (embedding, pre-norm
``TransformerEncoderLayer`` x layers, final LayerNorm, tied output projection; the shape of
``bench_train_step.py`` at a CPU-friendly size); ``gpt2``, the same decoder at GPT-2-small's size
(12 layers, d_model 768, vocabulary 50257, 4 x 1024 tokens: for a GPU, where the small decoder's
step is host-bound); and ``mlp``, Linear+GELU pairs. The MLP is the
hard case for ``locate``: one op per module, so the per-module cost (hooks and one scan per call and
phase) meets the per-op cost of ``detect_anomaly`` almost one to one. A transformer runs several ops
per module call (attention alone is about twenty).

Method (DESIGN.md section 5): warm-up steps, then rounds in which every method runs once, in rotating
order, so a slow spell of the (shared) machine hits all methods alike; medians of the rounds. On
CUDA each call is timed by the host clock between two ``torch.cuda.synchronize()``, so a time is what
a training step sees: the GPU's work and every host sync the method makes (detect_anomaly's checks of
backward outputs sync once per op).
Ratios: "x plain" is the step time over the plain step; "overhead" is the time added to the plain
step; the summary gives detect_anomaly's overhead over locate's (the headline) and its step time
over locate's step time.

Before timing, a fault is planted in the model (a NaN in one weight of the last block) and both tools
are asked where it is, to show what each answers: locate names the module whose forward output went
NaN; detect_anomaly, which checks backward ops only, raises at the first backward op that returns a
NaN (the loss's, as everything after the fault is NaN already).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import nanscan
from nanscan.locate import locate

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import Decoder

METHODS = ("plain", "locate", "detect_anomaly")
# (vocabulary, d_model, heads, layers, context, batch) of the decoders; --quick shrinks both to one.
DECODER_SIZES = {"decoder": (2048, 256, 4, 4, 128, 4), "gpt2": (50257, 768, 12, 12, 1024, 4)}
QUICK_DECODER = (512, 64, 4, 2, 32, 4)
Loss = Callable[[], torch.Tensor]  # one step's forward and loss


def mlp(width: int, depth: int) -> torch.nn.Module:
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(width, 1))


def build(name: str, quick: bool, device: torch.device) -> tuple[torch.nn.Module, Loss, str, str]:
    """(model, loss function of one step, description, name of the module the fault is planted in)."""
    torch.manual_seed(0)
    with torch.device(device):
        return _build(name, quick)


def _build(name: str, quick: bool) -> tuple[torch.nn.Module, Loss, str, str]:
    if name in DECODER_SIZES:
        vocab, d_model, heads, layers, context, batch = QUICK_DECODER if quick else DECODER_SIZES[name]
        model = Decoder(vocab, d_model, heads, layers, context)
        tokens = torch.randint(0, vocab, (batch, context + 1))

        def loss() -> torch.Tensor:
            logits = model(tokens[:, :-1])
            return torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())

        what = f"decoder: {layers} layers, d_model {d_model}, {heads} heads, vocab {vocab}, {batch} x {context} tokens"
        return model, loss, what, f"blocks.layers.{layers - 1}.linear2"
    width, depth, batch = (128, 3, 16) if quick else (512, 6, 64)
    model = mlp(width, depth)
    x = torch.randn(batch, width)

    def loss() -> torch.Tensor:
        return model(x).square().mean()

    return model, loss, f"mlp: {depth} x (Linear {width} + GELU) + Linear, batch {batch}", f"{2 * depth - 2}"


def run_step(model: torch.nn.Module, loss: Loss, autocast: bool) -> None:
    model.zero_grad(set_to_none=False)
    device_type = next(model.parameters()).device.type
    with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast):
        value = loss()
    value.backward()


def methods(model: torch.nn.Module, loss: Loss, autocast: bool) -> dict[str, Callable[[], object]]:
    def plain() -> None:
        run_step(model, loss, autocast)

    def with_locate() -> bool:
        with locate(model) as trace:
            run_step(model, loss, autocast)
        return trace.finite  # the answer: one sync and the search, counted in the time

    def with_anomaly() -> None:
        with torch.autograd.detect_anomaly(check_nan=True):
            run_step(model, loss, autocast)

    return {"plain": plain, "locate": with_locate, "detect_anomaly": with_anomaly}


def plant_and_ask(model: torch.nn.Module, loss: Loss, autocast: bool, target: str) -> dict[str, str]:
    """Plants a NaN in one weight of ``target`` and asks both tools where it is; restores the weight."""
    weight = dict(model.named_modules())[target].weight
    saved = weight.detach().clone()
    answers: dict[str, str] = {}
    try:
        with torch.no_grad():
            weight[0, 0] = math.nan
        with locate(model) as trace:
            run_step(model, loss, autocast)
        first = trace.first
        answers["locate"] = f"{first.phase} {first.kind} of {first.module!r} ({first.op})" if first else "nothing found"
        try:
            with torch.autograd.detect_anomaly(check_nan=True):
                run_step(model, loss, autocast)
            answers["detect_anomaly"] = "nothing found"
        except RuntimeError as error:
            answers["detect_anomaly"] = str(error).splitlines()[0]
    finally:
        with torch.no_grad():
            weight.copy_(saved)
        model.zero_grad(set_to_none=True)
    return answers


def time_methods(
    fns: dict[str, Callable[[], object]], rounds: int, warmup: int, device: torch.device
) -> dict[str, list[float]]:
    """Milliseconds per call of each method, from interleaved rounds (rotating order)."""
    names = list(fns)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        for name in names:
            fns[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            sync()
            t0 = time.perf_counter()
            fns[name]()
            sync()
            times[name].append((time.perf_counter() - t0) * 1e3)
    return times


# Per op, as the profiler keys it: (calls, self host ms, self device ms), each per call of the run.
OpRows = dict[str, tuple[int, float, float]]


def profiled_ops(run: Callable[[], object], calls: int, device: torch.device) -> tuple[float, OpRows]:
    """``calls`` calls of ``run`` under torch's profiler (host activity, and the device's on CUDA),
    after one call outside it: the wall ms per call under the profiler, and each op's rows."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    run()
    sync()
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        for _ in range(calls):
            run()
        sync()
        wall_ms = (time.perf_counter() - t0) / calls * 1e3
    rows = {
        event.key: (
            event.count // calls,
            event.self_cpu_time_total / calls / 1e3,
            getattr(event, "self_device_time_total", getattr(event, "self_cuda_time_total", 0.0)) / calls / 1e3,
        )
        for event in prof.key_averages()
    }
    return wall_ms, rows


def events_per_step(model: torch.nn.Module, loss: Loss, autocast: bool) -> int:
    with locate(model) as trace:
        run_step(model, loss, autocast)
    return trace.events


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model", choices=["decoder", "gpt2", "mlp", "all"], default="all", help="all: decoder and mlp"
    )
    parser.add_argument("--autocast", action="store_true", help="run the forward under bf16 autocast")
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 20, --quick 4)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="small models, few rounds: a smoke test")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    rounds = args.rounds or (4 if args.quick else 20)
    warnings.filterwarnings("ignore", message="Anomaly Detection has been enabled")
    warnings.filterwarnings("ignore", message="Error detected in")
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(
        f"nanscan {nanscan.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}, "
        f"{torch.get_num_threads()} threads, load {load:.2f}, device {device}"
        f"{' (' + torch.cuda.get_device_name(device) + ')' if device.type == 'cuda' else ''}, "
        f"{datetime.now(timezone.utc).isoformat(timespec='seconds')}"
    )
    results: dict[str, object] = {
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "device": str(device),
        "load": load,
        "autocast": args.autocast,
        "rounds": rounds,
        "cases": {},
    }
    for name in ("decoder", "mlp") if args.model == "all" else (args.model,):
        model, loss, what, target = build(name, args.quick, device)
        answers = plant_and_ask(model, loss, args.autocast, target)
        events = events_per_step(model, loss, args.autocast)
        times = time_methods(methods(model, loss, args.autocast), rounds, args.warmup, device)
        median = {m: statistics.median(times[m]) for m in METHODS}
        overhead = {m: median[m] - median["plain"] for m in METHODS}
        precision = "bf16 autocast" if args.autocast else "fp32"
        print(f"\n== {what}, {precision}; locate: {events} events per step")
        print(f"planted NaN in {target!r}.weight: locate -> {answers['locate']}")
        print(f"{'':31}detect_anomaly -> {answers['detect_anomaly']}")
        print(f"{'method':<16}{'median ms':>10}{'min ms':>9}{'x plain':>9}{'overhead ms':>13}")
        for m in METHODS:
            ratio = median[m] / median["plain"]
            print(f"{m:<16}{median[m]:>10.2f}{min(times[m]):>9.2f}{ratio:>8.2f}x{overhead[m]:>13.2f}")
        overhead_ratio = overhead["detect_anomaly"] / overhead["locate"] if overhead["locate"] > 0 else math.inf
        step_ratio = median["detect_anomaly"] / median["locate"]
        per_event_us = overhead["locate"] / events * 1e3 if events else math.nan
        print(
            f"detect_anomaly / locate: {overhead_ratio:.1f}x the overhead, {step_ratio:.2f}x the step time; "
            f"locate costs {per_event_us:.1f} us per event"
        )
        results["cases"][name] = {  # type: ignore[index]
            "model": what,
            "precision": precision,
            "events_per_step": events,
            "fault_target": target,
            "answers": answers,
            "median_ms": median,
            "min_ms": {m: min(times[m]) for m in METHODS},
            "overhead_ms": overhead,
            "anomaly_over_locate_overhead": overhead_ratio,
            "anomaly_over_locate_step": step_ratio,
            "locate_us_per_event": per_event_us,
            "times_ms": times,
        }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
