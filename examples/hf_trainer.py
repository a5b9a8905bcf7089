"""Hugging Face `Trainer` with `NanscanTrainerCallback`: nanscan's check and clip on every step.

The callback replaces the Trainer's gradient clipping (`TrainingArguments(max_grad_norm=0)` turns
that off; the callback refuses to clip twice): before each optimizer step it runs `nanscan.check`,
clips to `max_norm`, and skips the step if a gradient holds a NaN/Inf. With a `nanscan.Recorder`,
the statistics reach the Trainer's logs (`nanscan/total_norm`, `nanscan/skipped`, ...) with no
per-step sync. The model is a tiny GPT-2 made from its config (nothing downloaded), trained on
synthetic sequences; at `--fault-step` another callback plants a NaN in one gradient.
"""
# Run: python examples/hf_trainer.py
# Requires: transformers, accelerate

from __future__ import annotations

import argparse
import math
import tempfile
from typing import Any

import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

import nanscan
from nanscan.integrations.transformers import NanscanTrainerCallback


class CountingTokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sequences that count from a random start by a stride of 1, 2 or 3 (mod the vocabulary): a
    pattern a tiny model learns in a few hundred steps."""

    def __init__(self, samples: int, length: int = 32, vocab: int = 128) -> None:
        g = torch.Generator().manual_seed(0)
        start = torch.randint(0, vocab, (samples, 1), generator=g)
        stride = torch.randint(1, 4, (samples, 1), generator=g)
        self.ids = (start + stride * torch.arange(length)) % vocab

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}  # the model shifts the labels itself


class PlantNaN(TrainerCallback):
    """A stand-in for a real fault: a NaN in one gradient at one step. Listed before nanscan's
    callback, so its hook runs first."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if state.global_step == self.step:
            kwargs["model"].transformer.h[1].mlp.c_fc.weight.grad[0, 0] = math.nan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--fault-step", type=int, default=None, help="step whose gradient gets a NaN (default: half way)"
    )
    args = parser.parse_args()
    fault_step = args.steps // 2 if args.fault_step is None else args.fault_step

    torch.manual_seed(0)
    config = GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config)
    recorder = nanscan.Recorder(every=10)  # no sinks of its own: the callback merges its records into the logs
    callbacks = [PlantNaN(fault_step), NanscanTrainerCallback(max_norm=1.0, recorder=recorder)]

    with tempfile.TemporaryDirectory() as output_dir:
        training_args = TrainingArguments(
            output_dir=output_dir,
            max_steps=args.steps,
            per_device_train_batch_size=8,
            learning_rate=3e-3,
            max_grad_norm=0,  # the Trainer's own clipping off: nanscan clips
            logging_steps=10,
            save_strategy="no",
            report_to="none",
            use_cpu=not torch.cuda.is_available(),
            disable_tqdm=True,
        )
        trainer = Trainer(
            model=model, args=training_args, train_dataset=CountingTokens(8 * args.steps), callbacks=callbacks
        )
        trainer.train()

    # The Trainer printed its logs, nanscan's metrics among them; they are in its log history too (and
    # go to report_to's integrations when the callback is listed first: see the callback's notes).
    for entry in trainer.state.log_history:
        if entry.get("nanscan/skipped", 0) > 0:
            print(f"the log at step {entry['step']} reports the skip (latest record: {entry['nanscan/step']:.0f})")
    print(recorder)
    assert recorder.skipped == (1 if 0 <= fault_step < args.steps else 0)


if __name__ == "__main__":
    main()
