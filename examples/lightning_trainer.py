"""PyTorch Lightning with `NanscanCallback`: nanscan's check and clip before every optimizer step.

The callback replaces Lightning's gradient clipping (leave `gradient_clip_val` unset; the callback
refuses to clip twice): inside each optimizer step it runs `nanscan.check`, clips to `max_norm`, and
skips the step if a gradient holds a NaN/Inf. With a `nanscan.Recorder` its statistics reach the
Trainer's loggers (`nanscan/total_norm`, `nanscan/skipped`, ...) without a per-step sync; here a
CSVLogger in a temporary directory, read back at the end. At `--fault-step` the loss is NaN.
(The file is not called lightning.py: a script of that name would shadow the lightning package.)
"""
# Run: python examples/lightning_trainer.py
# Requires: lightning

from __future__ import annotations

import argparse
import csv
import math
import tempfile
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.loggers import CSVLogger

import nanscan
from nanscan.integrations.lightning import NanscanCallback


class Regressor(LightningModule):
    def __init__(self, fault_step: int) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
        self.fault_step = fault_step

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step == self.fault_step:
            loss = loss * math.nan  # a stand-in for a NaN that reaches the loss
        self.log("loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fault-step", type=int, default=None, help="step whose loss is NaN (default: half way)")
    args = parser.parse_args()
    fault_step = args.steps // 2 if args.fault_step is None else args.fault_step

    torch.manual_seed(0)
    x = torch.randn(32 * args.steps, 16)
    y = 3 * torch.tanh(x[:, :1] - x[:, 1:2])  # large targets: early gradient norms above max_norm
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=32, shuffle=True)
    model = Regressor(fault_step)
    recorder = nanscan.Recorder(every=10)  # its records go to the Trainer's loggers through the callback

    with tempfile.TemporaryDirectory() as log_dir:
        logger = CSVLogger(log_dir, name="run")
        trainer = Trainer(
            max_steps=args.steps,
            accelerator="auto",
            devices=1,
            logger=logger,
            log_every_n_steps=min(10, args.steps),
            callbacks=[NanscanCallback(max_norm=1.0, recorder=recorder)],
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, data)
        # What the logger received: the callback logs each forwarded record at its own step, beside
        # the module's own `self.log`s (rows of the CSV that hold one or the other).
        rows: dict[str, dict[str, str]] = {}
        with open(Path(logger.log_dir) / "metrics.csv") as f:
            for row in csv.DictReader(f):
                rows.setdefault(row["step"], {}).update({k: v for k, v in row.items() if v})
        shown = ("loss", "nanscan/total_norm", "nanscan/clip_coef", "nanscan/skipped")
        for step, row in rows.items():
            print(f"step {step:>4}: " + ", ".join(f"{key} {float(row[key]):.4g}" for key in shown if key in row))

    print(recorder)
    skips = nanscan.SkipGuard.of(trainer.optimizers[0]).total_skips
    print(f"{skips} step(s) skipped")
    assert skips == (1 if 0 <= fault_step < args.steps else 0)


if __name__ == "__main__":
    main()
