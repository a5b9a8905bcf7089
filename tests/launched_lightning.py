"""A Lightning script for tests/test_launchers.py: NanscanCallback under Lightning's own DDP launcher.

    python tests/launched_lightning.py OUTDIR STRATEGY [attach]    # STRATEGY: ddp (or ddp_spawn)

It fits a tiny model with ``Trainer(accelerator="cpu", devices=2, strategy=STRATEGY)``, as a user's
script would: with ``ddp`` Lightning's subprocess launcher runs this same command again for rank 1
(the test starts only rank 0), and the two ranks form a gloo group. Rank ``NAN_RANK`` multiplies its
loss by NaN at step ``NAN_STEP``; DDP's all-reduce in the backward spreads the NaN to the other rank's
gradients, so both ranks must skip that step, and end with the same weights. With ``attach`` the
callback attaches nanscan's DDP hook (``attach_ddp=True``), and its records name rank ``NAN_RANK``.

The callback's Recorder writes the records to OUTDIR/run.jsonl (one path for every rank, as a user
writes it) and OUTDIR/run-{rank}.jsonl (one file per rank), and to a sink of this script that keeps
each record's step, total norm and skip. At the end each rank writes what it saw to
OUTDIR/rank{R}.json (``RankResult``): the test compares the ranks' files and reads the records files.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from launched_common import checksum
from lightning.pytorch import Callback, LightningModule, Trainer

import nanscan
import nanscan.sinks
from nanscan.integrations.lightning import NanscanCallback
from nanscan.records import StepRecord

STEPS = 6
NAN_STEP = 3
NAN_RANK = 1
WORLD = 2
BATCH = 4


class Tiny(LightningModule):
    """Two Linear layers; on rank ``NAN_RANK`` the loss is multiplied by NaN at ``NAN_STEP``."""

    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
        self.first_input = ""  # this rank's first batch, summed (float.hex): the ranks' data differ
        self.planted = False  # whether this rank made the NaN

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.first_input = self.first_input or float(x.double().sum()).hex()
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        if self.global_step == NAN_STEP and self.global_rank == NAN_RANK:
            loss = loss * math.nan
            self.planted = True
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def loader() -> torch.utils.data.DataLoader[Any]:
    """``STEPS`` batches for each rank (Lightning's DistributedSampler gives each rank its own half)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(STEPS * WORLD * BATCH, 8, generator=g)
    y = 10 * torch.randn(STEPS * WORLD * BATCH, 1, generator=g)  # large targets: norms above max_norm
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)


class Keep:
    """A sink that keeps each record's (step, total norm as ``float.hex``, skipped): exact, NaN included.
    A class, not a closure: ddp_spawn pickles the callbacks into its processes."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str, bool]] = []
        self.ranks: dict[int, dict[str, list[int]]] = {}  # per non-finite step, the ranks named

    def __call__(self, record: StepRecord) -> None:
        self.seen.append((record.step, float(record.total_norm).hex(), record.skipped))
        if not record.finite:
            self.ranks[record.step] = dict(record.nonfinite_ranks or {})


class Report(Callback):
    """Writes OUTDIR/rank{R}.json at the end of the fit, on every rank (under ddp_spawn only the spawned
    processes train, so this cannot wait for ``trainer.fit`` to return)."""

    def __init__(self, out: Path, keep: Keep, nanscan_callback: NanscanCallback) -> None:
        self.out, self.keep, self.nanscan_callback = out, keep, nanscan_callback

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # No flush here: the NanscanCallback, before this callback in the Trainer's list, flushed its
        # recorder in its own on_train_end; the records kept are what that flush handed to the sinks.
        recorder = self.nanscan_callback.recorder
        assert recorder is not None
        result = {
            "rank": trainer.global_rank,
            "world": dist.get_world_size() if dist.is_initialized() else 1,
            "wrapper": type(trainer.strategy.model).__name__,
            "skips": nanscan.SkipGuard.of(trainer.optimizers[0]).total_skips,
            "recorder_skipped": recorder.skipped,
            "weights": checksum(pl_module),
            "weights_finite": all(bool(torch.isfinite(p).all()) for p in pl_module.parameters()),
            "first_input": getattr(pl_module, "first_input", ""),
            "planted": getattr(pl_module, "planted", False),
            "records": self.keep.seen,
            "nonfinite_ranks": self.keep.ranks,
        }
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(result))


def main() -> None:
    out, strategy, attach = Path(sys.argv[1]), sys.argv[2], sys.argv[3:] == ["attach"]
    torch.manual_seed(0)
    keep = Keep()
    recorder = nanscan.Recorder(
        every=4,  # one read in the middle, the rest at the end of the fit
        sinks=[nanscan.sinks.JSONLSink(out / "run.jsonl"), nanscan.sinks.JSONLSink(out / "run-{rank}.jsonl"), keep],
    )
    callback = NanscanCallback(max_norm=1.0, recorder=recorder, attach_ddp=attach)
    trainer = Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=[callback, Report(out, keep, callback)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(Tiny(), loader())


if __name__ == "__main__":  # ddp_spawn's processes import this file
    main()
