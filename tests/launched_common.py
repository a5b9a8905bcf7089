"""What the scripts that tests/test_launchers.py launches share (imported from the tests folder, the
folder of the script a launcher runs), and the Trainer's data with tests/test_integrations_transformers.py."""

from __future__ import annotations

import hashlib
import os
import sys

import torch

import nanscan


class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """``samples`` random sequences of 16 tokens below 64 (a tiny GPT-2's vocabulary), the same each
    run, each its own labels (the model shifts them itself)."""

    def __init__(self, samples: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 64, (samples, 16), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def checksum(module: torch.nn.Module) -> str:
    """The SHA-256 of every parameter's bytes, in order: equal exactly when the weights are."""
    digest = hashlib.sha256()
    for p in module.parameters():
        digest.update(p.detach().cpu().contiguous().numpy().tobytes())
    return digest.hexdigest()


def leave(recorder: nanscan.Recorder) -> None:
    """Ends a torchrun rank once its results are written: the recorder closed (what it holds on
    disk), then out without the interpreter's end. torch's gloo can abort a process there when the
    process group is left to it, as the Trainer leaves it: a worker thread destroys the last
    collective's Python-owned tensors while the interpreter finalizes (pytorch/pytorch#190489; here
    in 3 of 20 runs of the Trainer without nanscan's callback, and destroy_process_group() hung in 2
    of 6). So a launched test fails only for nanscan's reasons."""
    recorder.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
