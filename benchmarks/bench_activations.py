"""The cost of ``nanscan.watch_activations`` on a training step, beside Hugging Face's
``DebugUnderflowOverflow`` on the same model in the same run.

    python benchmarks/bench_activations.py                  # the decoder of bench_locate.py, CPU, ~1 min
    python benchmarks/bench_activations.py --quick          # smoke test (seconds)
    python benchmarks/bench_activations.py --model gpt2 --device cuda --autocast float16   # on a GPU
    python benchmarks/bench_activations.py ... --profile   # then where the watch's time goes, by op
    python benchmarks/bench_activations.py ... --per-call  # then the host time of one sampled module call

A step is ``zero_grad`` + forward + loss + backward, as in bench_locate.py (whose models these are:
``decoder``, GPT-2-shaped at a CPU-friendly size; ``gpt2``, GPT-2-small's size, for a GPU). Methods:

* ``plain``: the step alone;
* ``watch every=1``: the step with ``nanscan.watch_activations(model)`` attached (every forward scanned;
  the outputs batched into one op call at the forward's end where nothing changes them in place);
* ``watch every=1, at return``: the same with ``batch_bytes=0``: one op call as each module returns
  (the watch before batching: benchmarks/NOTES.md entry 60);
* ``watch every=16``: attached with ``every=16``;
* ``hf DebugUnderflowOverflow``: transformers' detector attached (its forward hooks check every
  module's outputs and weights with ``isinf``/``isnan`` and read the answers on the host).

The first three run on one model: a watch is attached before its block and removed after it, outside
the timed region. Copies of one model differed by up to 10% in step time on a CPU with no watch at
all (benchmarks/NOTES.md, entry 35), more than the watch's sampled cost. transformers' detector has no
way to be removed, so it runs on a copy of its own: its row carries that spread.

Method (DESIGN.md section 5): a round runs each method for a block of 16 steps (so every block of
``every=16`` holds exactly one scanned step), in rotating order; the figure is the median over rounds
of the block's time per step. On CUDA the block is timed between two ``torch.cuda.synchronize()``.
"Overhead" is the time added to the plain step, as a share of it. The watch's figures are read once
after the timing (one sync, not in the step).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import nanscan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_locate import DECODER_SIZES, QUICK_DECODER, OpRows, profiled_ops

from models import Decoder

BLOCK = 16  # steps per timed block: one scanned step of every=16 in each


def build(name: str, quick: bool, device: torch.device) -> tuple[torch.nn.Module, torch.Tensor, str]:
    vocab, d_model, heads, layers, context, batch = QUICK_DECODER if quick else DECODER_SIZES[name]
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(vocab, d_model, heads, layers, context)
        tokens = torch.randint(0, vocab, (batch, context + 1))
    return model, tokens, f"{name}: {layers} layers, d_model {d_model}, vocab {vocab}, {batch} x {context} tokens"


def step_fn(model: torch.nn.Module, tokens: torch.Tensor, autocast: torch.dtype | None) -> Callable[[], None]:
    device_type = tokens.device.type

    def step() -> None:
        model.zero_grad(set_to_none=False)
        with torch.autocast(device_type, dtype=autocast or torch.float32, enabled=autocast is not None):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()

    return step


def profile_split(
    model: torch.nn.Module, tokens: torch.Tensor, autocast: torch.dtype | None, device: torch.device
) -> None:
    """One block of the plain step and one with ``watch every=1`` under torch's profiler: each op's
    self host time and self device time per step, for the ops whose totals the watch changes most,
    and the count and device time of the watch's scans. Says whether the watch's cost on a GPU is
    host time (its hooks, its launches) or device time (its kernels), and which op holds it."""
    step = step_fn(model, tokens, autocast)
    totals: dict[str, OpRows] = {}
    walls: dict[str, float] = {}
    for name in ("plain", "watch every=1"):
        watch = nanscan.watch_activations(model) if name != "plain" else None
        walls[name], totals[name] = profiled_ops(step, BLOCK, device)
        if watch is not None:
            watch.remove()
    plain, watched = totals["plain"], totals["watch every=1"]

    def summed(rows: OpRows, column: int) -> float:
        return sum(row[column] for row in rows.values())

    print(
        f"\nprofile, ms per step (under the profiler: plain {walls['plain']:.2f}, watch every=1 "
        f"{walls['watch every=1']:.2f} wall): self host time {summed(plain, 1):.2f} -> {summed(watched, 1):.2f}, "
        f"self device time {summed(plain, 2):.2f} -> {summed(watched, 2):.2f}"
    )
    keys = set(plain) | set(watched)
    empty = (0, 0.0, 0.0)

    def added(key: str) -> float:
        before, after = plain.get(key, empty), watched.get(key, empty)
        return max(after[1] - before[1], after[2] - before[2])

    print(f"{'op (the 15 the watch adds most to)':<60}{'calls':>7}{'host ms':>9}{'device ms':>10}")
    for key in sorted(keys, key=added, reverse=True)[:15]:
        before, after = plain.get(key, empty), watched.get(key, empty)
        print(f"{key[:58]:<60}{after[0] - before[0]:>+7d}{after[1] - before[1]:>+9.3f}{after[2] - before[2]:>+10.3f}")


PER_CALL_MODULES = 100


class _Stack(torch.nn.Module):
    """A hundred ``Linear(4, 4)`` in a row: a forward whose compute is nil, so that its time is the
    module calls' host time (on a GPU the launches queue and the block ends with one sync)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(PER_CALL_MODULES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def times_in_rotation(blocks: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Each block's time in each of ``rounds`` rounds, as the block measures and returns it. A round
    runs every block once, in an order rotated by one from the round before (no block is always
    first, nor always after the same one); one more round first warms up, untimed."""
    names = list(blocks)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds + 1):
        start = r % len(names)
        for name in names[start:] + names[:start]:
            elapsed = blocks[name]()
            if r > 0:
                times[name].append(elapsed)
    return times


def timed(run: Callable[[], None], device: torch.device) -> Callable[[], float]:
    """``run`` as a block for ``times_in_rotation``: its wall time in seconds, synchronised with
    ``device`` before and after."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def block() -> float:
        sync()
        t0 = time.perf_counter()
        run()
        sync()
        return time.perf_counter() - t0

    return block


def per_call(device: torch.device, rounds: int) -> dict[str, float]:
    """The host time a sampled module call adds with ``watch every=1``, in us: a stack of
    PER_CALL_MODULES ``Linear(4, 4)`` under ``no_grad`` timed with the watch and without, on copies of
    one model, in rotating blocks of 50 forwards; medians over ``rounds``. ``watch``: batched (one op
    call a forward), ``watch at return``: ``batch_bytes=0`` (one a module call). What the watch's cost
    at every=1 comes to on a GPU whose step is host-bound (benchmarks/NOTES.md entries 51, 54, 60).
    Then the op's share of a call made at return, old and new (``op_call_times``)."""
    torch.manual_seed(0)
    with torch.device(device):
        models = {"plain": _Stack(), "watched": _Stack(), "watched at return": _Stack()}
        x = torch.randn(2, 4)
    for name in ("watched", "watched at return"):
        models[name].load_state_dict(models["plain"].state_dict())
    watches = [
        nanscan.watch_activations(models["watched"]),
        nanscan.watch_activations(models["watched at return"], batch_bytes=0),
    ]

    def forwards(model: _Stack) -> Callable[[], None]:
        def run() -> None:
            for _ in range(50):
                model(x)

        return run

    with torch.no_grad():
        seconds = times_in_rotation({name: timed(forwards(m), device) for name, m in models.items()}, rounds)
    for watch in watches:
        watch.remove()
    plain, watched, at_return = (
        statistics.median(seconds[name]) / 50 * 1e6 for name in ("plain", "watched", "watched at return")
    )
    added, added_at_return = ((t - plain) / PER_CALL_MODULES for t in (watched, at_return))
    print(
        f"\nhost time of a sampled module call ({PER_CALL_MODULES} Linear(4, 4) under no_grad, {rounds} rounds): "
        f"{added:.1f} us added by the watch, batched; {added_at_return:.1f} us scanned at return (batch_bytes=0) "
        f"(a plain forward {plain:.0f} us, {plain / PER_CALL_MODULES:.1f} us a module)"
    )
    return {"watch": added, "watch at return": added_at_return, **op_call_times(models["plain"], x, rounds)}


def op_call_times(model: _Stack, x: torch.Tensor, rounds: int) -> dict[str, float]:
    """The host time of the watch's op alone, each call between two module calls as in a forward: the
    scan op as the watch called it before scan_into_ (five outputs allocated a call) beside scan_into_
    into a pass buffer (nothing allocated: what the watch calls now), in us a call. Decides whether
    scan_into_ earns its place on a GPU host (benchmarks/NOTES.md entry 54; on the CPU it saved
    1-3 us of a 58-68 us call)."""
    from nanscan._ops import scan_into_

    device = x.device
    counts = torch.zeros(4, 4096, dtype=torch.int64, device=device)
    stats = torch.zeros(3, 4096, dtype=torch.float64, device=device)
    ops: dict[str, Callable[[torch.Tensor], object]] = {
        "none": lambda y: None,
        "scan": lambda y: torch.ops.nanscan.scan.default([y], True, False),
        "scan_into_": lambda y: scan_into_([y], True, counts, stats, 0),
    }

    def forwards_with(op: Callable[[torch.Tensor], object]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(10):
                y = x
                for layer in model.layers:
                    y = layer(y)
                    op(y)

        return run

    with torch.no_grad():
        seconds = times_in_rotation({name: timed(forwards_with(op), device) for name, op in ops.items()}, rounds)
    us = {name: statistics.median(t) / (10 * PER_CALL_MODULES) * 1e6 for name, t in seconds.items()}
    result = {name: us[name] - us["none"] for name in ("scan", "scan_into_")}
    print(
        f"the op alone, between two module calls: scan (five outputs) {result['scan']:.1f} us a call, "
        f"scan_into_ (into the pass buffer) {result['scan_into_']:.1f} us"
    )
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(DECODER_SIZES), default="decoder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", choices=["bfloat16", "float16"], default=None)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7, --quick 2)")
    parser.add_argument("--quick", action="store_true", help="the small decoder, 2 rounds: a smoke test")
    parser.add_argument("--no-hf", action="store_true", help="leave out transformers' DebugUnderflowOverflow")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="after the timings, one block of plain and of watch every=1 under torch's profiler: where the "
        "watch's added time goes (host and device time by op, the scans' count and device time)",
    )
    parser.add_argument(
        "--per-call",
        action="store_true",
        help="after the timings, the host time one sampled module call adds (100 Linear(4, 4), compute nil)",
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    rounds = args.rounds or (2 if args.quick else 7)
    autocast = getattr(torch, args.autocast) if args.autocast else None
    base, tokens, what = build(args.model, args.quick, device)

    # The watch a method attaches to the base model for its block (None: nothing attached).
    attach: dict[str, Callable[[], nanscan.ActivationWatch | None]] = {
        "plain": lambda: None,
        "watch every=1": lambda: nanscan.watch_activations(base),
        "watch every=1, at return": lambda: nanscan.watch_activations(base, batch_bytes=0),
        "watch every=16": lambda: nanscan.watch_activations(base, every=16),
    }
    copies: dict[str, torch.nn.Module] = dict.fromkeys(attach, base)
    last_watch: dict[str, nanscan.ActivationWatch] = {}
    hf_note = ""
    if not args.no_hf:
        try:
            from transformers.debug_utils import DebugUnderflowOverflow
        except ImportError:
            hf_note = "transformers not installed: DebugUnderflowOverflow left out"
        else:
            copies["hf DebugUnderflowOverflow"] = copy.deepcopy(base)
            DebugUnderflowOverflow(copies["hf DebugUnderflowOverflow"])
            attach["hf DebugUnderflowOverflow"] = lambda: None
    steps = {name: step_fn(model, tokens, autocast) for name, model in copies.items()}
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    print(f"nanscan {nanscan.__version__}, torch {torch.__version__}, {platform.processor() or platform.machine()}")
    print(f"{what}; {device}; autocast {args.autocast or 'off'}; {rounds} rounds of {BLOCK} steps per method")
    if hf_note:
        print(hf_note)
    names = list(steps)

    def block(name: str) -> float:
        """One block of ``name``'s steps, its watch attached first and removed after: ms per step."""
        watch = attach[name]()
        sync()
        t0 = time.perf_counter()
        for _ in range(BLOCK):
            steps[name]()
        sync()
        elapsed = (time.perf_counter() - t0) / BLOCK * 1e3
        if watch is not None:
            watch.remove()  # its figures stay readable
            last_watch[name] = watch
        return elapsed

    per_step = times_in_rotation({name: functools.partial(block, name) for name in names}, rounds)
    plain = statistics.median(per_step["plain"])
    rows = []
    print(f"\n{'method':<28}{'ms/step':>10}{'overhead':>10}")
    for name in names:
        ms = statistics.median(per_step[name])
        overhead = (ms - plain) / plain
        rows.append({"method": name, "ms_per_step": ms, "overhead": overhead, "rounds_ms": per_step[name]})
        print(f"{name:<28}{ms:>10.2f}{overhead:>+10.1%}")
    worst = last_watch["watch every=1"].worst()[:3]
    print(
        "\nthe watch's three smallest headrooms: "
        + ", ".join(f"{f.name or '(model)'} ({f.op}) {f.headroom:.3g}" for f in worst)
    )
    if args.profile:
        profile_split(base, tokens, autocast, device)
    per_call_us = per_call(device, 5 if args.quick else 31) if args.per_call else None  # us a call
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "torch": torch.__version__,
                    "device": str(device),
                    "model": what,
                    "autocast": args.autocast,
                    "rounds": rounds,
                    "block": BLOCK,
                    "rows": rows,
                    "per_call_us": per_call_us,
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
