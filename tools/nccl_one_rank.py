"""nanscan under a one-rank process group, beside the same model without one (issue 25, item 2).

On a single GPU a world-size-1 NCCL group still runs the collective path (``all_reduce`` on a CUDA
stream, ``async_op`` handles and their ``wait``) that multi-GPU training runs. For each stack (FSDP2,
DDP with ``nanscan.ddp.attach``, FSDP1 with and without ``use_orig_params``) a wrapped model and a
plain twin take the same steps; a NaN is planted in the same element of both at one step. Under
``torch.cuda.set_sync_debug_mode("error")`` (any host sync raises), nanscan's calls run:

- ``check(model, max_norm=1.0, recorder=...)``: statistics, clip and the recorder's append;
- the GradScaler's ``clip_grad_norm_`` (its fused unscale + scan + clip);
- ``verify_replicas`` and ``check(verify_replicas=True)``.

Torch's own steps (forward, backward, the optimizer step, the scaler's step and update: torch's
``GradScaler.step`` reads ``found_inf`` on the host) run outside the guard. The results are then
read (syncing) and compared with the twin's: total and per-parameter norms, min/max, the names of
the non-finite gradients, the clipped gradients, the recorded totals, the scaler's skips, scales and
weights. The first step of each stack runs unguarded: it allocates the recorder's buffers and
uploads the list's metadata, as a training job's first step does.

    python tools/nccl_one_rank.py                                 # NCCL on cuda:0 (the default)
    python tools/nccl_one_rank.py --backend gloo --device cpu     # the same checks on the CPU

Prints one line per stack and check, and exits 1 if any differs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import socket
import sys
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.distributed.fsdp import ShardingStrategy, fully_shard
from torch.distributed.fsdp.wrap import ModuleWrapPolicy
from torch.distributed.tensor import DTensor

import nanscan

DIMS = (64, 96, 96, 10)
STEPS = 5
NAN_STEP = 3
MAX_NORM = 1.0


@dataclass
class Outcome:
    """What one stack's checks found: a list of failures, empty when every comparison held."""

    stack: str
    failures: list[str] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)

    def expect(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)


def mlp(device: torch.device) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for i in range(len(DIMS) - 1):
        layers += [torch.nn.Linear(DIMS[i], DIMS[i + 1], device=device), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers[:-1])


@contextlib.contextmanager
def no_sync_allowed(device: torch.device) -> Iterator[None]:
    """Any host sync inside raises (CUDA only: a CPU tensor has nothing to wait for)."""
    if device.type != "cuda":
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# A stack: how to wrap the model, and where the element the NaN goes into lives in its gradients
# (the first Linear's weight[0, 0], in the plain twin: model[0].weight.grad[0, 0]).
Wrap = Callable[[torch.nn.Module, torch.device], torch.nn.Module]
Plant = Callable[[torch.nn.Module], torch.Tensor]


def wrap_fsdp2(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    mesh = init_device_mesh(device.type, (1,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


# DDP's NaN is made by a gradient hook, before the all-reduce, as a rank's own backward makes one:
# the hook nanscan attaches then names this rank (a NaN written after the all-reduce has no maker).
POISON = [False]


def poison(grad: torch.Tensor) -> torch.Tensor:
    if not POISON[0]:
        return grad
    grad = grad.clone()
    grad.view(-1)[:1].fill_(math.nan)
    return grad


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    model[0].weight.register_hook(poison)
    ids = [device.index or 0] if device.type == "cuda" else None
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=0.01)  # several buckets
    nanscan.ddp.attach(ddp)
    return ddp


def plant_nan(model: torch.nn.Module, step: int, backward: Callable[[], None]) -> None:
    """Runs ``backward``, with the NaN in the first Linear's weight[0, 0] at NAN_STEP."""
    ddp = isinstance(model, torch.nn.parallel.DistributedDataParallel)
    POISON[0] = ddp and step == NAN_STEP
    try:
        backward()
    finally:
        POISON[0] = False
    if step == NAN_STEP and not ddp:
        first_element(model).fill_(math.nan)


def wrap_fsdp1(use_orig_params: bool) -> Wrap:
    def wrap(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
        return FSDP(
            model,
            auto_wrap_policy=ModuleWrapPolicy({torch.nn.Linear}),
            sharding_strategy=ShardingStrategy.FULL_SHARD,
            use_orig_params=use_orig_params,
            device_id=device,
        )

    return wrap


def first_element(model: torch.nn.Module) -> torch.Tensor:
    """A one-element view of the gradient element the NaN goes into, whatever holds it."""
    if isinstance(model, FSDP):  # the first Linear's unit; its flat parameter begins with weight[0, 0]
        return FSDP.fsdp_modules(model)[1]._handle.flat_param.grad.view(-1)[:1]
    inner = model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model
    return local(inner[0].weight.grad).view(-1)[:1]


STACKS: dict[str, Wrap] = {
    "fsdp2": wrap_fsdp2,
    "ddp+attach": wrap_ddp,
    "fsdp1(use_orig_params=False)": wrap_fsdp1(False),
    "fsdp1(use_orig_params=True)": wrap_fsdp1(True),
}


def whole(model: torch.nn.Module, grads: bool) -> list[torch.Tensor]:
    """Copies of the model's whole gradients (or weights), parameter by parameter in the order the
    user wrote them: DTensors gathered; FSDP1's flat parameters cut up (one rank holds all of it)."""
    if not isinstance(model, FSDP):
        return [full(p.grad if grads else p).detach().clone() for p in model.parameters()]
    if model._use_orig_params:
        with FSDP.summon_full_params(model, with_grads=grads):
            return [(p.grad if grads else p).detach().clone() for p in model.parameters()]
    # use_orig_params=False: torch cannot summon the gradients; on one rank a unit's flat parameter
    # is its parameters end to end. The units (one per Linear, in model order) and each unit's
    # parameters come in the model's order (the wrapped modules no longer list them as parameters).
    pieces = []
    for unit in FSDP.fsdp_modules(model):
        if unit._handle is None:
            continue
        flat = unit._handle.flat_param
        values = (flat.grad if grads else flat).detach()
        pieces += [piece.clone() for piece in values[: sum(flat._numels)].split(list(flat._numels))]
    return pieces


def backward(model: torch.nn.Module, step: int, device: torch.device) -> None:
    model.zero_grad(set_to_none=False)
    torch.manual_seed(100 + step)
    x = torch.randn(16, DIMS[0], device=device)
    plant_nan(model, step, lambda: model(x).float().square().mean().backward())


def same(a: float, b: float, rtol: float = 1e-5) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == b or abs(a - b) <= rtol * max(abs(a), abs(b))


def check_and_record(stack: str, wrap: Wrap, device: torch.device) -> Outcome:
    """check(max_norm, recorder) and verify_replicas on the wrapped model, the same on the twin."""
    outcome = Outcome(stack)
    wrapped, twin = wrap(mlp(device), device), mlp(device)
    sinks: tuple[list[Any], list[Any]] = ([], [])
    recorders = [nanscan.Recorder([sink.append], every=2, warn=False) for sink in sinks]
    for step in range(STEPS):
        backward(wrapped, step, device)
        backward(twin, step, device)
        guard = no_sync_allowed(device) if step > 0 else contextlib.nullcontext()
        with guard:
            ours = nanscan.check(wrapped, max_norm=MAX_NORM, recorder=recorders[0])
            replicas = nanscan.verify_replicas(wrapped, gradients=True)
            checked = nanscan.check(wrapped, verify_replicas=True)
        theirs = nanscan.check(twin, max_norm=MAX_NORM, recorder=recorders[1])
        what = f"step {step}"
        outcome.expect(
            same(ours.total_norm, theirs.total_norm), f"{what}: total {ours.total_norm} != {theirs.total_norm}"
        )
        outcome.expect(ours.nonfinite == theirs.nonfinite, f"{what}: nonfinite {ours.nonfinite} != {theirs.nonfinite}")
        outcome.expect(ours.finite == (step != NAN_STEP), f"{what}: finite {ours.finite}")
        outcome.expect(
            ours.nonfinite_ranks == ({} if ours.finite else {n: [0] for n in ours.nonfinite}),
            f"{what}: nonfinite_ranks {ours.nonfinite_ranks}",
        )
        for (name, a), b in zip(
            ours.to_dict()["parameters"].items(), theirs.to_dict()["parameters"].values(), strict=True
        ):
            for key in ("norm", "min", "max", "nan_count", "inf_count"):
                outcome.expect(same(float(a[key]), float(b[key])), f"{what}: {name}.{key} {a[key]} != {b[key]}")
        if step != NAN_STEP:  # a NaN step's clip leaves NaN gradients on both: nothing to compare
            for g, h in zip(whole(wrapped, True), whole(twin, True), strict=True):
                outcome.expect(
                    torch.allclose(g.view(h.shape), h, rtol=1e-5, atol=1e-7), f"{what}: clipped gradients differ"
                )
        outcome.expect(replicas.consistent and checked.replicas_consistent, f"{what}: one rank's replicas differ")
        outcome.figures.setdefault("total_norm", []).append(ours.total_norm)
    for recorder in recorders:
        recorder.close()
    totals = [[r.total_norm for r in sink] for sink in sinks]
    outcome.expect(len(totals[0]) == STEPS and all(map(same, *totals)), f"recorded totals {totals[0]} != {totals[1]}")
    outcome.expect([r.finite for r in sinks[0]] == [s != NAN_STEP for s in range(STEPS)], "recorded finite flags")
    return outcome


def grad_scaler(stack: str, wrap: Wrap, device: torch.device) -> Outcome:
    """nanscan's GradScaler (clip_grad_norm_ through it) on the wrapped model and on the twin: the same
    skips, scales and weights; the NaN step skipped on both."""
    outcome = Outcome(stack)
    models = [wrap(mlp(device), device), mlp(device)]
    scalers = [nanscan.amp.GradScaler(device.type, init_scale=2.0**12).watch(m) for m in models]
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.05) for m in models]
    for step in range(STEPS):
        for i, (model, scaler, optimizer) in enumerate(zip(models, scalers, optimizers, strict=True)):
            optimizer.zero_grad(set_to_none=False)
            torch.manual_seed(100 + step)
            loss = model(torch.randn(16, DIMS[0], device=device)).float().square().mean()
            plant_nan(model, step, scaler.scale(loss).backward)
            guard = no_sync_allowed(device) if step > 0 and i == 0 else contextlib.nullcontext()
            with guard:
                scaler.clip_grad_norm_(optimizer, MAX_NORM)
            scaler.step(optimizer)
            scaler.update()
        what = f"step {step}"
        skipped = [s.skipped for s in scalers]
        scales = [s.get_scale() for s in scalers]
        outcome.expect(skipped == [step == NAN_STEP] * 2, f"{what}: skipped {skipped}")
        outcome.expect(scales[0] == scales[1], f"{what}: scales {scales}")
        for a, b in zip(*(whole(m, False) for m in models), strict=True):
            outcome.expect(torch.allclose(a.view(b.shape), b, rtol=1e-5, atol=1e-6), f"{what}: weights differ")
        outcome.figures.setdefault("scale", []).append(scales[0])
    return outcome


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="nccl", choices=["nccl", "gloo"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", help="write the outcomes here")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)
        torch.cuda.set_device(device)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port()))
    dist.init_process_group(args.backend, rank=0, world_size=1)
    print(
        f"torch {torch.__version__}, {args.backend} world size {dist.get_world_size()}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""),
        flush=True,
    )
    outcomes: list[Outcome] = []
    for stack, wrap in STACKS.items():
        for part, run in (("check+clip+recorder+replicas", check_and_record), ("GradScaler", grad_scaler)):
            label = f"{stack}: {part}"
            try:
                outcome = run(label, wrap, device)
            except Exception:
                outcome = Outcome(label, [traceback.format_exc()])
            outcomes.append(outcome)
            status = "ok" if not outcome.failures else "FAILED\n    " + "\n    ".join(outcome.failures[:8])
            print(f"{label}: {status}", flush=True)
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as f:
            json.dump([vars(o) for o in outcomes], f, indent=1)
    failed = sum(bool(o.failures) for o in outcomes)
    print(
        f"{len(outcomes) - failed} of {len(outcomes)} passed"
        + (" (no host sync inside nanscan's calls)" if device.type == "cuda" else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
