"""A transformers script for tests/test_launchers.py: NanscanTrainerCallback under torchrun.

    python -m torch.distributed.run --standalone --nproc_per_node 2 tests/launched_transformers.py OUTDIR [zero2|zero3]

It trains a tiny GPT-2 with ``TrainingArguments(use_cpu=True)``, as a user's script would; under
torchrun the Trainer joins the launcher's two ranks in a gloo group and wraps the model in
DistributedDataParallel (checked here: the run must not pass as two single processes). On rank
``NAN_RANK`` a forward hook multiplies one MLP's output by NaN at step ``NAN_STEP``; DDP's all-reduce
in the backward spreads the NaN to the other rank's gradients, so both ranks must skip that step, and
end with the same weights. Under DDP the callback attaches nanscan's DDP hook (``attach_ddp=True``),
so its records name rank ``NAN_RANK`` alone. With ``zero2`` (``zero3``) the Trainer runs DeepSpeed ZeRO stage 2 (3)
instead of DDP (``TrainingArguments(deepspeed=...)``): DeepSpeed's average carries the NaN into the
partitions, and the callback checks inside DeepSpeed's step (nanscan.integrations.transformers).
Under ZeRO-3 the weights compared at the end are gathered (each rank holds a partition of each).

The callback's Recorder writes the records to OUTDIR/run.jsonl (one path for every rank, as a user
writes it) and OUTDIR/run-{rank}.jsonl (one file per rank), and to a sink of this script that keeps
each record's step, total norm and skip. At the end each rank writes what it saw to
OUTDIR/rank{R}.json: the test compares the ranks' files and reads the records files.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from launched_common import Tokens, checksum, leave
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import nanscan
import nanscan.sinks
from nanscan.integrations.transformers import NanscanTrainerCallback
from nanscan.records import StepRecord

STEPS = 6
NAN_STEP = 3
NAN_RANK = 1
WORLD = 2
BATCH = 2


class Plant(TrainerCallback):
    """Arms the NaN for the forward of step ``NAN_STEP`` on rank ``NAN_RANK`` only."""

    def __init__(self) -> None:
        self.on = False
        self.first_input = ""  # this rank's first MLP input, summed (float.hex): the ranks' data differ
        self.planted = False  # whether this rank made the NaN

    def hook(self, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> torch.Tensor:
        self.first_input = self.first_input or float(inputs[0].detach().double().sum()).hex()
        if not self.on:
            return output
        self.planted = True
        return output * math.nan

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.on = state.global_step == NAN_STEP and dist.get_rank() == NAN_RANK


def gathered(model: torch.nn.Module, partitioned: bool) -> Any:
    """The whole weights while inside (ZeRO-3 partitions each parameter; a placeholder otherwise)."""
    if not partitioned:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(model.parameters()))


def main() -> None:
    out = Path(sys.argv[1])
    stage = {"zero2": 2, "zero3": 3}[sys.argv[2]] if sys.argv[2:] else None
    zero = stage is not None
    if zero:
        os.environ["DS_ACCELERATOR"] = "cpu"
    seen: list[tuple[int, str, bool]] = []  # (step, total_norm as float.hex, skipped): exact, NaN included

    ranks: dict[int, dict[str, list[int]]] = {}  # per non-finite record: the ranks named per parameter

    def keep(record: StepRecord) -> None:
        seen.append((record.step, float(record.total_norm).hex(), record.skipped))
        if not record.finite:
            ranks[record.step] = dict(record.nonfinite_ranks or {})

    recorder = nanscan.Recorder(
        every=4,  # one read in the middle, the rest at the end of the training
        sinks=[nanscan.sinks.JSONLSink(out / "run.jsonl"), nanscan.sinks.JSONLSink(out / "run-{rank}.jsonl"), keep],
    )
    plant = Plant()
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=32))
    mlp = model.transformer.h[1].mlp
    assert isinstance(mlp, torch.nn.Module)
    mlp.register_forward_hook(plant.hook)
    args = TrainingArguments(
        output_dir=str(out),
        max_steps=STEPS,
        per_device_train_batch_size=BATCH,
        learning_rate=0.05,
        lr_scheduler_type="constant",
        optim="sgd",
        max_grad_norm=0.0,  # the callback clips
        report_to=[],
        save_strategy="no",
        logging_steps=1,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
        deepspeed=(
            {
                "train_micro_batch_size_per_gpu": "auto",
                "train_batch_size": "auto",
                "gradient_accumulation_steps": "auto",
                "gradient_clipping": "auto",
                "optimizer": {"type": "SGD", "params": {"lr": "auto"}},
                "zero_optimization": {"stage": stage},
                "zero_allow_untested_optimizer": True,
            }
            if zero
            else None
        ),
    )
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=Tokens(STEPS * WORLD * BATCH),  # STEPS batches a rank: DistributedSampler halves it
        callbacks=[plant, NanscanTrainerCallback(max_norm=0.5, recorder=recorder, attach_ddp=not zero)],
    )
    trainer.train()
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # the torch optimizer under accelerate's
    if zero:
        optimizer = optimizer.optimizer  # the one DeepSpeed's ZeRO optimizer steps on its fp32 partition
    assert isinstance(optimizer, torch.optim.Optimizer)
    rank = dist.get_rank()  # (no flush here: the callback's on_train_end flushed the recorder)
    with gathered(model, stage == 3):
        weights, weights_finite = checksum(model), all(bool(torch.isfinite(p).all()) for p in model.parameters())
    result = {
        "rank": rank,
        "world": dist.get_world_size(),
        "wrapper": type(trainer.model_wrapped).__name__,
        "skips": nanscan.SkipGuard.of(optimizer).total_skips,
        "recorder_skipped": recorder.skipped,
        "weights": weights,
        "weights_finite": weights_finite,
        "first_input": plant.first_input,
        "planted": plant.planted,
        "records": seen,
        **({} if zero else {"nonfinite_ranks": ranks}),
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    leave(recorder)


if __name__ == "__main__":
    main()
