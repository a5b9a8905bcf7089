"""The flight recorder: every step's gradient statistics kept, written to JSONL, and drawn.

`nanscan.check(..., recorder=recorder)` appends each step's per-parameter statistics (NaN/Inf
counts, min, max, norm) to a ring buffer on the device, with no host sync; the buffer is read once
every `every` steps (and right after a NaN/Inf step) and handed to the sinks, here a JSONL file.
A few steps before `--fault-step` a batch of outliers makes a gradient-norm spike; at
`--fault-step` a NaN reaches the loss. The recorder warns about both, and
`python -m nanscan plot run.jsonl -o run.png` (needs matplotlib) draws the run as a heatmap of
log10 gradient norm per parameter and step with the NaN marked, and the total norm below.
"""
# Run: python examples/recorder_plot.py
# Requires: matplotlib

from __future__ import annotations

import argparse
import math
import subprocess
import sys
from pathlib import Path

import torch

import nanscan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--fault-step", type=int, default=None, help="step whose loss goes NaN (default: 3/4 of the way)"
    )
    parser.add_argument("--out", type=Path, default=Path("nanscan-example"), help="where run.jsonl and run.png go")
    args = parser.parse_args()
    fault_step = args.steps * 3 // 4 if args.fault_step is None else args.fault_step

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1)
    ).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    teacher = torch.randn(32, 1, device=device) / 32**0.5

    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "run.jsonl"
    jsonl.unlink(missing_ok=True)  # JSONLSink appends: start this run's file afresh
    recorder = nanscan.Recorder([nanscan.sinks.JSONLSink(jsonl)], every=50)

    for step in range(args.steps):
        x = torch.randn(64, 32, device=device)
        y = torch.sin(x @ teacher)
        if step == fault_step - 3:
            y = y * 100  # a batch of outliers: a gradient-norm spike, warned about when read
        loss = torch.nn.functional.mse_loss(model(x), y)
        if step == fault_step:
            loss = loss * math.nan  # a stand-in for a NaN that reaches the loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        # The recorder replaces a per-step `.item()` log: nothing here waits for the device.
        nanscan.check(model, max_norm=1.0, on_nonfinite="skip", optimizer=optimizer, recorder=recorder)
        optimizer.step()

    recorder.close()  # the last records to the sinks (also done at exit, and on SIGTERM)
    print(recorder)  # steps, skips, the first non-finite step, the largest spike (each also warned about)
    first = recorder.first_nonfinite  # which parameters went bad, and what led up to it
    if first is not None:
        before = ", ".join(f"{v:.3g}" for v in first.total_norm_history[-6:])
        print(f"total gradient norm over the steps before step {first.step}: {before}")

    # Draw it: the same as running `python -m nanscan plot <out>/run.jsonl -o <out>/run.png` yourself.
    png = args.out / "run.png"
    subprocess.run([sys.executable, "-m", "nanscan", "plot", str(jsonl), "-o", str(png)], check=True)
    assert recorder.skipped == (1 if 0 <= fault_step < args.steps else 0)


if __name__ == "__main__":
    main()
