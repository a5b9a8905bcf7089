"""An Accelerate script for tests/test_launchers.py: a user's own loop, nanscan's check in it, under torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/launched_accelerate.py OUTDIR

``Accelerator(cpu=True, gradient_accumulation_steps=2)`` joins torchrun's two ranks in a gloo group
and wraps the model in DistributedDataParallel (checked here: the run must not pass as two single
processes). Each optimizer step accumulates two micro-batches: the first backward runs inside DDP's
``no_sync()``, where each rank's gradients are its own, so a check there must be refused (it would
give one rank's answer as the model's), whether it is handed the model, its parameters or the module
inside it; the second synchronises them, and there the loop checks, clips and skips as
``nanscan.check(model, max_norm, on_nonfinite="skip", optimizer=...)`` does. On
rank ``NAN_RANK`` the loss of one micro-batch of optimizer step ``NAN_STEP`` is NaN; DDP's all-reduce
spreads it, so both ranks must skip that step and end with the same weights.

The Recorder writes OUTDIR/run.jsonl (one path for every rank, as a user writes it) and
OUTDIR/run-{rank}.jsonl (one file per rank), and a sink of this script keeps each record's step,
total norm and skip. At the end each rank writes what it saw to OUTDIR/rank{R}.json, with the keys
tests/launched_transformers.py writes, and the refusals its checks inside ``no_sync()`` met.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
from accelerate import Accelerator
from launched_common import checksum, leave

import nanscan
import nanscan.sinks
from nanscan.records import StepRecord

STEPS = 6  # optimizer steps
ACCUMULATE = 2
NAN_STEP = 3
NAN_RANK = 1
BATCH = 4


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUMULATE)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    world = accelerator.num_processes
    x, y = torch.randn(STEPS * ACCUMULATE * BATCH * world, 8), torch.randn(STEPS * ACCUMULATE * BATCH * world, 1)
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=BATCH)
    model, optimizer, data = accelerator.prepare(model, optimizer, data)
    assert dist.is_initialized() and dist.get_world_size() == 2, "two ranks, not two single processes"
    assert isinstance(model, torch.nn.parallel.DistributedDataParallel), type(model).__name__

    seen: list[tuple[int, str, bool]] = []  # (step, total_norm as float.hex, skipped): exact, NaN included

    def keep(record: StepRecord) -> None:
        seen.append((record.step, float(record.total_norm).hex(), record.skipped))

    refusals: list[str] = []
    planted, first_input = False, ""
    sinks = [nanscan.sinks.JSONLSink(out / "run.jsonl"), nanscan.sinks.JSONLSink(out / "run-{rank}.jsonl"), keep]
    recorder = nanscan.Recorder(sinks, every=4, warn=False)
    with recorder:
        for i, (inputs, targets) in enumerate(data):
            first_input = first_input or float(inputs.double().sum()).hex()  # the ranks' data differ
            with accelerator.accumulate(model):
                loss = torch.nn.functional.mse_loss(model(inputs), targets)
                if i // ACCUMULATE == NAN_STEP and i % ACCUMULATE == 0 and dist.get_rank() == NAN_RANK:
                    loss, planted = loss * math.nan, True
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    nanscan.check(model, max_norm=1.0, on_nonfinite="skip", optimizer=optimizer, recorder=recorder)
                else:  # inside no_sync: each rank's own gradients, never presented as the model's,
                    # however they are passed: the model, its parameters (as a user hands torch's
                    # clip_grad_norm_ them), the module inside it
                    passed = (model, model.parameters(), accelerator.unwrap_model(model))
                    refusals += [refusal(lambda each=each: nanscan.check(each)) for each in passed]
                optimizer.step()
                optimizer.zero_grad()
    result = {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "wrapper": type(model).__name__,
        "skips": nanscan.SkipGuard.of(optimizer).total_skips,  # the guard on the optimizer the loop steps
        "recorder_skipped": recorder.skipped,
        "weights_finite": all(bool(p.isfinite().all()) for p in model.parameters()),
        "weights": checksum(model.module),
        "planted": planted,
        "first_input": first_input,
        "records": seen,
        "refusals": refusals,
    }
    (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(result))
    leave(recorder)


def refusal(call: Callable[[], object]) -> str:
    """The message of the ValueError ``call`` raises; '' when it raises none."""
    try:
        call()
    except ValueError as refused:
        return str(refused)
    return ""


if __name__ == "__main__":
    main()
