"""The cost of ``nanscan.watch_activations`` on a training step, beside Hugging Face's
``DebugUnderflowOverflow`` on the same model in the same run.

    python benchmarks/bench_activations.py                  # the decoder of bench_locate.py, CPU, ~1 min
    python benchmarks/bench_activations.py --quick          # smoke test (seconds)
    python benchmarks/bench_activations.py --model gpt2 --device cuda --autocast float16   # on a GPU

A step is ``zero_grad`` + forward + loss + backward, as in bench_locate.py (whose models these are:
``decoder``, GPT-2-shaped at a CPU-friendly size; ``gpt2``, GPT-2-small's size, for a GPU). Methods:

* ``plain``: the step alone;
* ``watch every=1``: the step with ``nanscan.watch_activations(model)`` attached (every forward scanned);
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
from bench_locate import DECODER_SIZES, QUICK_DECODER

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


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(DECODER_SIZES), default="decoder")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--autocast", choices=["bfloat16", "float16"], default=None)
    parser.add_argument("--rounds", type=int, default=None, help="timed rounds (default 7, --quick 2)")
    parser.add_argument("--quick", action="store_true", help="the small decoder, 2 rounds: a smoke test")
    parser.add_argument("--no-hf", action="store_true", help="leave out transformers' DebugUnderflowOverflow")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    rounds = args.rounds or (2 if args.quick else 7)
    autocast = getattr(torch, args.autocast) if args.autocast else None
    base, tokens, what = build(args.model, args.quick, device)

    # The watch a method attaches to the base model for its block (None: nothing attached).
    attach: dict[str, Callable[[], nanscan.ActivationWatch | None]] = {
        "plain": lambda: None,
        "watch every=1": lambda: nanscan.watch_activations(base),
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

    for name in names:  # warm-up: one block each
        block(name)
    per_step: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            per_step[name].append(block(name))
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
                },
                indent=1,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
