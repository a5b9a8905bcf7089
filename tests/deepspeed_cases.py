"""DeepSpeed in real processes (2 gloo ranks on the CPU): run by tests/test_deepspeed.py.

``python tests/deepspeed_cases.py RANK WORLD PORT OUTDIR``. Each rank makes a DeepSpeed engine per
configuration (ZeRO stages 0-3, and stage 1 with bf16 and fp32 gradient accumulation, DeepSpeed's
BF16_Optimizer), runs one backward on inputs of its own, and writes what nanscan did with it, as
JSON. ZeRO 1-3 and the bf16 optimizer keep the gradients partitioned (``.grad`` None, or the rank's
unreduced one): every entry point must refuse them, the engine or its module, before reading
anything. Stage 0 keeps DDP's layout (whole, all-reduced gradients): nanscan reads it as it reads a
DDP model, and its total norm equals the norm of the mean of the ranks' gradients.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

CONFIGURATIONS = [(0, "fp32"), (1, "fp32"), (2, "fp32"), (3, "fp32"), (1, "bf16")]


def attempt(call: Any) -> str:
    """'' if ``call`` ran, else its error's type and message."""
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return ""


def outcomes(engine: Any, params: list[torch.nn.Parameter]) -> dict[str, Any]:
    """What each entry point does with an engine after its backward ('' where it ran)."""
    import nanscan

    return {
        "check(engine)": attempt(lambda: nanscan.check(engine, max_norm=1e9)),
        "check(engine.module)": attempt(lambda: nanscan.check(engine.module)),
        "clip(engine.module.parameters())": attempt(lambda: nanscan.clip_grad_norm_(params, 1e9)),
        "scan(params)": attempt(lambda: nanscan.scan(params)),
    }


def run(rank: int, world: int, port: int, out: Path) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world),
        DS_ACCELERATOR="cpu",
    )
    import deepspeed
    import torch.distributed as dist

    import nanscan

    deepspeed.init_distributed(dist_backend="gloo")
    results: dict[str, Any] = {}
    for stage, dtype in CONFIGURATIONS:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
        config: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage},
            "zero_allow_untested_optimizer": True,
        }
        if dtype == "bf16":
            config |= {"bf16": {"enabled": True}, "data_types": {"grad_accum_dtype": "fp32"}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        torch.manual_seed(100 + rank)  # each rank its own inputs: its own gradients before any reduction
        x = torch.randn(2, 8, dtype=torch.bfloat16 if dtype == "bf16" else torch.float32)
        engine.backward(engine(x).float().square().mean())
        params = list(engine.module.parameters())
        entry = outcomes(engine, params)
        if stage == 0 and dtype == "fp32":
            report = nanscan.check(engine)
            local = torch.cat([p.grad.reshape(-1) for p in params])  # DeepSpeed all-reduced it: the mean
            gathered = [torch.empty_like(local) for _ in range(world)]
            dist.all_gather(gathered, local)
            entry["names"] = report.names
            entry["total_norm"] = report.total_norm
            entry["norm_of_every_rank"] = [float(g.norm()) for g in gathered]
        results[f"stage {stage} {dtype}"] = entry
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, port, out = sys.argv[1:]
    run(int(rank), int(world), int(port), Path(out))
