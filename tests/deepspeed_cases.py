"""DeepSpeed in real processes (2 gloo ranks on the CPU): run by tests/test_deepspeed.py.

``python tests/deepspeed_cases.py RANK WORLD PORT OUTDIR``. Each rank makes a DeepSpeed engine per
configuration, runs backwards on inputs of its own, and writes what nanscan did with it, as JSON.

* ZeRO stages 1, 2 and 3 (fp32, and bf16 through the ZeRO optimizer): each rank holds its partition
  of the averaged gradients (``.grad`` None; under stage 3 the parameters are partitioned too).
  nanscan reads the pieces (nanscan.layouts.zero): every entry point that reads gradients (check of
  the engine, of its module, of a list of parameters or of pairs; clip_grad_norm_; the Advisor) must
  give every parameter's statistics as ``deepspeed.utils.safe_get_full_grad`` assembles them, and
  as an independent reference (a plain copy of the model run on every rank's inputs) has them; a
  NaN and an Inf planted on one rank, before DeepSpeed's reduction, named on both; a clip that the
  step then applies; the window (between a boundary's backward and the step) kept: refused between
  micro-batches and after a step.
* DeepSpeed's BF16_Optimizer: refused by every entry point, before anything is read.
* Stage 0 keeps DDP's layout (whole, all-reduced gradients): read as a DDP model is.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

READ = [
    ("stage 1 fp32", 1, "fp32", 1),
    ("stage 2 fp32", 2, "fp32", 1),
    ("stage 2 bf16", 2, "bf16", 1),
    ("stage 2 fp32, 2 micro-batches", 2, "fp32", 2),
    ("stage 1 fp32, 2 micro-batches", 1, "fp32", 2),
    ("stage 3 fp32", 3, "fp32", 1),
    ("stage 3 bf16", 3, "bf16", 1),
    ("stage 3 fp32, 2 micro-batches", 3, "fp32", 2),
]
REFUSED = [("stage 1 bf16, fp32 accumulation", 1, "bf16 fp32-accum")]
LR = (0.1, 0.05)  # the two parameter groups' learning rates


def attempt(call: Any) -> str:
    """'' if ``call`` ran, else its error's type and message."""
    try:
        call()
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return ""


def make_model() -> torch.nn.Sequential:
    """Odd sizes, so that the partitions cut parameters; a frozen bias, which nothing trains."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 13), torch.nn.ReLU(), torch.nn.Linear(13, 5), torch.nn.Linear(5, 3))
    model[3].bias.requires_grad_(False)
    return model


def inputs(rank: int, micro: int, dtype: torch.dtype) -> torch.Tensor:
    generator = torch.Generator().manual_seed(100 + 10 * rank + micro)
    return torch.randn(3, 7, generator=generator).to(dtype)


def engine_of(stage: int, precision: str, accumulation: int) -> Any:
    import deepspeed

    model = make_model()
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 3,
        "gradient_accumulation_steps": accumulation,
        "optimizer": {"type": "SGD", "params": {"lr": LR[0]}},
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
    }
    if precision.startswith("bf16"):
        config["bf16"] = {"enabled": True}
    if precision == "bf16 fp32-accum":
        config["data_types"] = {"grad_accum_dtype": "fp32"}
    trained = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": trained[:2]}, {"params": trained[2:], "lr": LR[1]}]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=groups, config=config)
    return engine


def backward(engine: Any, rank: int, micro: int, dtype: torch.dtype, plant: bool = False) -> None:
    if plant and rank == 1:
        # Before DeepSpeed's reduction: this rank's own gradient of 2.weight gets a NaN and an Inf,
        # which the average carries to whichever rank's partition holds those elements.
        def spoil(grad: torch.Tensor) -> torch.Tensor:
            grad = grad.clone()
            grad[1, 3] = float("nan")
            grad[4, 0] = float("inf")
            return grad

        handle = engine.module[2].weight.register_hook(spoil)
    out = engine(inputs(rank, micro, dtype))
    engine.backward(out.float().square().mean())
    if plant and rank == 1:
        handle.remove()


def reference(world: int, accumulation: int) -> dict[str, torch.Tensor]:
    """The averaged gradient DeepSpeed should hold, from a plain fp64 copy of the model run on every
    rank's inputs (DeepSpeed averages over the ranks and the micro-batches)."""
    model = make_model().double()
    for rank in range(world):
        for micro in range(accumulation):
            model(inputs(rank, micro, torch.float64)).square().mean().backward()
    scale = 1.0 / (world * accumulation)
    return {name: p.grad * scale for name, p in model.named_parameters() if p.grad is not None}


def statistics(report: Any) -> dict[str, Any]:
    """A report's figures, as plain lists in its names' order."""
    d = report.to_dict()
    by_name = d["parameters"]
    return {
        "names": list(report.names),
        "norms": [by_name[n]["norm"] for n in report.names],
        "min": [by_name[n]["min"] for n in report.names],
        "max": [by_name[n]["max"] for n in report.names],
        "nan": [by_name[n]["nan_count"] for n in report.names],
        "inf": [by_name[n]["inf_count"] for n in report.names],
        "total_norm": d["total_norm"],
        "finite": d["finite"],
        "nonfinite_ranks": d["nonfinite_ranks"],
    }


def full_statistics(engine: Any) -> dict[str, Any]:
    """Every trained parameter's statistics from DeepSpeed's own assembly of its gradient (one
    all-reduce per parameter), in fp64."""
    from deepspeed.utils import safe_get_full_grad

    out: dict[str, Any] = {"names": [], "norms": [], "min": [], "max": [], "nan": [], "inf": []}
    for name, p in engine.module.named_parameters():
        if not p.requires_grad:
            continue
        g = safe_get_full_grad(p).double()
        finite = g[g.isfinite()]
        out["names"].append(name)
        out["norms"].append(float(g.norm()))
        out["min"].append(float(finite.min()) if finite.numel() else float("inf"))
        out["max"].append(float(finite.max()) if finite.numel() else float("-inf"))
        out["nan"].append(int(g.isnan().sum()))
        out["inf"].append(int(g.isinf().sum()))
    return out


def weights(engine: Any) -> dict[str, torch.Tensor]:
    """The model's whole weights, in fp64 (ZeRO-3's parameters gathered for the copy: each rank holds a
    partition of each, its .data a placeholder)."""
    import deepspeed

    named = list(engine.module.named_parameters())
    partitioned = hasattr(named[0][1], "ds_id")
    with deepspeed.zero.GatheredParameters([p for _, p in named], enabled=partitioned):
        return {name: p.detach().clone().double() for name, p in named}


def read(rank: int, world: int, stage: int, precision: str, accumulation: int) -> dict[str, Any]:
    import nanscan

    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    engine = engine_of(stage, precision, accumulation)
    entry: dict[str, Any] = {}
    for micro in range(accumulation):
        backward(engine, rank, micro, dtype)
        if micro < accumulation - 1:  # between the micro-batches of a window: not the model's yet
            entry["between micro-batches"] = attempt(lambda: nanscan.check(engine))
            engine.step()  # DeepSpeed counts micro-batches at its step (which applies nothing mid-window)
    params = list(engine.module.parameters())
    report = nanscan.check(engine)
    entry["check(engine)"] = statistics(report)
    entry["check(engine.module)"] = statistics(nanscan.check(engine.module))
    entry["check(params)"] = statistics(nanscan.check(params))
    entry["check(named)"] = statistics(nanscan.check(list(engine.module.named_parameters())))
    advisor = nanscan.amp.Advisor()
    entry["Advisor.observe"] = attempt(lambda: advisor.observe(engine.module))
    entry["full"] = full_statistics(engine)
    ref = reference(world, accumulation)
    entry["reference"] = {name: [float(g.norm()), float(g.min()), float(g.max())] for name, g in ref.items()}
    # Refused still: what reads values or compares copies, and the GradScaler (DeepSpeed scales its own).
    entry["scan(params)"] = attempt(lambda: nanscan.scan(params))
    entry["verify_replicas"] = attempt(lambda: nanscan.verify_replicas(engine.module, gradients=True))
    entry["process_group="] = attempt(lambda: nanscan.check(engine, process_group=torch.distributed.group.WORLD))
    if precision == "fp32":
        # A clip to a quarter of the norm, then DeepSpeed's step: the step applies the clipped pieces.
        before = weights(engine)
        max_norm = report.total_norm / 4
        clipped = nanscan.clip_grad_norm_(params, max_norm)
        entry["clip total"] = float(clipped)
        engine.step()
        coefficient = max_norm / (float(clipped) + 1e-6)
        errors = []
        for i, (name, after) in enumerate(weights(engine).items()):
            if name not in ref:
                errors.append(float((after - before[name]).abs().max()))  # frozen: unchanged
                continue
            lr = LR[0] if i < 2 else LR[1]
            want = before[name] - lr * coefficient * ref[name]
            errors.append(float((after - want).abs().max() / want.abs().max()))
        entry["step error"] = max(errors)
        entry["after step"] = attempt(lambda: nanscan.check(engine))
    # A NaN and an Inf planted on rank 1 before the reduction: the next window's gradients.
    if precision == "fp32" and accumulation == 1:
        backward(engine, rank, 0, dtype, plant=True)
        planted = nanscan.check(engine.module)
        entry["planted"] = statistics(planted)
    return entry


def refused(rank: int, stage: int, precision: str) -> dict[str, Any]:
    import nanscan

    dtype = torch.bfloat16 if precision.startswith("bf16") else torch.float32
    engine = engine_of(stage, precision, 1)
    backward(engine, rank, 0, dtype)
    params = list(engine.module.parameters())
    return {
        "check(engine)": attempt(lambda: nanscan.check(engine, max_norm=1e9)),
        "check(engine.module)": attempt(lambda: nanscan.check(engine.module)),
        "clip(engine.module.parameters())": attempt(lambda: nanscan.clip_grad_norm_(params, 1e9)),
        "scan(params)": attempt(lambda: nanscan.scan(params)),
    }


def stage0(rank: int, world: int) -> dict[str, Any]:
    import deepspeed
    import torch.distributed as dist

    import nanscan

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 0},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    torch.manual_seed(100 + rank)
    engine.backward(engine(torch.randn(2, 8)).square().mean())
    params = list(engine.module.parameters())
    report = nanscan.check(engine)
    local = torch.cat([p.grad.reshape(-1) for p in params])  # DeepSpeed all-reduced it: the mean
    gathered = [torch.empty_like(local) for _ in range(world)]
    dist.all_gather(gathered, local)
    return {
        "names": list(report.names),
        "total_norm": float(report.total_norm),
        "norm_of_every_rank": [float(g.norm()) for g in gathered],
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

    deepspeed.init_distributed(dist_backend="gloo")
    results: dict[str, Any] = {"stage 0 fp32": stage0(rank, world)}
    for configuration, stage, precision, accumulation in READ:
        results[configuration] = read(rank, world, stage, precision, accumulation)
    for configuration, stage, precision in REFUSED:
        results[configuration] = refused(rank, stage, precision)
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    dist.destroy_process_group()


if __name__ == "__main__":
    rank, world, port, out = sys.argv[1:]
    run(int(rank), int(world), int(port), Path(out))
