"""A training job with a flight recorder that ends the way jobs end, run as a real process by
tests/test_recorder_end_of_job.py: ``python tests/recorder_job.py OUT_DIR --steps N [options]``.

It trains a small MLP for ``--steps`` steps, recording each into ``OUT_DIR/run.jsonl`` (and, with
``--recorders 2``, a second recorder into ``OUT_DIR/second.jsonl``), prints ``ready`` and then
waits to be signalled (``--then wait``), trains on without end (``--then train``, for a kill at any
moment), or closes its recorders and exits 0 (``--then close``). Options set the rest of the scene:
a handler of the job's own installed before the recorders, a fork, a SIGTERM sent by a sink in the
middle of a read, records of many parameters (``--scalars``: lines of megabytes)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import torch

import nanscan
from nanscan.records import StepRecord
from nanscan.sinks import JSONLSink


class SignalAtRecord:
    """A sink that sends this process ``signum`` when it is handed its ``at``-th record: a signal
    that lands in the middle of a read (after the JSONL sink before it took that record)."""

    def __init__(self, signum: int, at: int) -> None:
        self.signum, self.at, self.seen = signum, at, 0

    def __call__(self, record: StepRecord) -> None:
        self.seen += 1
        if self.seen == self.at:
            os.kill(os.getpid(), self.signum)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--every", type=int, default=100)
    parser.add_argument("--width", type=int, default=8, help="layers of the MLP (2 parameters each)")
    parser.add_argument(
        "--scalars", type=int, default=0, help="in place of the MLP, this many one-element parameters: large records"
    )
    parser.add_argument("--recorders", type=int, default=1, choices=(0, 1, 2))
    parser.add_argument("--user-handler", choices=("none", "exit", "continue"), default="none")
    parser.add_argument("--signal-at-record", type=int, default=0, help="a sink sends SIGTERM at this record")
    parser.add_argument("--fork", action="store_true", help="fork a child that is sent SIGTERM")
    parser.add_argument(
        "--lightning",
        type=int,
        default=0,
        help="train with a Lightning Trainer instead (its handler composed over nanscan's), which sends "
        "itself SIGTERM at this batch",
    )
    parser.add_argument("--then", choices=("wait", "train", "close"), default="wait")
    args = parser.parse_args()

    signalled = []
    if args.user_handler != "none":

        def handler(signum: int, frame: object) -> None:
            # os.write, not print: the signal may land inside the main thread's print (of "ready"),
            # and a print inside it would be a reentrant call on stdout's buffer (a RuntimeError).
            os.write(1, f"user handler {signum}\n".encode())
            if args.user_handler == "exit":
                sys.exit(7)
            signalled.append(signum)

        signal.signal(signal.SIGTERM, handler)

    torch.manual_seed(0)
    layers = [torch.nn.Linear(16, 16) for _ in range(args.width)]
    model = torch.nn.Sequential(*layers)
    # Large records (a JSONL line of ~120 bytes a parameter): one-element parameters whose gradients
    # are views of one buffer, refilled each step.
    flat = torch.zeros(args.scalars)
    scalars = [(f"p{i}", torch.zeros(1, requires_grad=True)) for i in range(args.scalars)]
    for i, (_, p) in enumerate(scalars):
        p.grad = flat[i : i + 1]
    recorders = []
    for k in range(args.recorders):
        sinks: list[object] = [JSONLSink(args.out / ("run.jsonl" if k == 0 else "second.jsonl"))]
        if k == 0 and args.signal_at_record:
            sinks.append(SignalAtRecord(signal.SIGTERM, args.signal_at_record))
        recorders.append(nanscan.Recorder(sinks, every=args.every, warn=False))  # type: ignore[arg-type]

    def train(step: int) -> None:
        if scalars:
            flat.normal_()
            for recorder in recorders:
                nanscan.check(scalars, recorder=recorder)
            return
        model(torch.randn(4, 16)).square().sum().backward()
        for recorder in recorders:
            nanscan.check(model, max_norm=1.0, recorder=recorder)
        model.zero_grad()

    if args.lightning:
        return lightning_fit(recorders[0] if recorders else None, args.steps, args.lightning)
    for step in range(args.steps):
        train(step)
    if args.fork:
        child = os.fork()
        if child == 0:  # the child's copies of the recorders are the parent's: SIGTERM reads out nothing
            os.kill(os.getpid(), signal.SIGTERM)
            os._exit(3)  # not reached: the default ends it by the signal
        _, status = os.waitpid(child, 0)
        print(f"child ended by signal {os.WTERMSIG(status)}" if os.WIFSIGNALED(status) else "child exited", flush=True)
    print("ready", flush=True)

    def close() -> int:
        for recorder in recorders:
            recorder.close()
        print(f"closed after {f'signal {signalled[0]}' if signalled else 'no signal'}", flush=True)
        return 0

    if args.then == "close" or signalled:  # signalled already: the signal came with "ready"
        return close()
    if args.then == "train":
        step = args.steps
        while True:
            train(step)
            step += 1
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)
        if signalled:  # a handler that lets the job go on: it closes its recorders and ends
            return close()
    return 4  # never signalled


def lightning_fit(recorder: nanscan.Recorder | None, steps: int, signal_at: int) -> int:
    """A Lightning fit of ``steps`` batches, with nanscan's callback recording into ``recorder`` (none:
    the same fit without nanscan); at batch ``signal_at`` the job sends itself SIGTERM, which
    Lightning turns into a graceful stop at the next batch."""
    from lightning.pytorch import Callback, LightningModule, Trainer

    from nanscan.integrations.lightning import NanscanCallback

    class Tiny(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

        def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    class SigtermAt(Callback):
        def on_train_batch_end(self, trainer: Trainer, module: LightningModule, *args: object) -> None:
            if trainer.global_step == signal_at:
                os.kill(os.getpid(), signal.SIGTERM)

    data = torch.utils.data.TensorDataset(torch.randn(4 * steps, 8), torch.randn(4 * steps, 1))
    callbacks: list[Callback] = [SigtermAt()]
    if recorder is not None:
        callbacks.insert(0, NanscanCallback(max_norm=1.0, recorder=recorder))
    trainer = Trainer(
        max_steps=steps,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=4))
    print(f"fit returned at step {trainer.global_step}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
