"""Host cost per tensor of nanscan's entry points against torch's, on lists of 1-element tensors so
that the work per element is nil and what is timed is Python, the dispatcher and validation.

    python benchmarks/bench_host.py                  # 10,000 parameters, CPU, 1 thread
    python benchmarks/bench_host.py --tensors 2000
    python benchmarks/bench_host.py --device cuda    # the host time of the same calls on a GPU

Each call is timed alone (best of --repeats, after warm-up): the host path has no memory traffic to
drift with, so the fastest call is the cleanest measure of it. On a GPU the device is synchronized
before each timed call and after it, outside the time: what is timed is the host's work up to the
return (launches queue; 10,000 one-element tensors are microseconds of GPU work against milliseconds
of host work, so the queue never fills and blocks a launch).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

import nanscan


def best_ns_per_tensor(call: Callable[[], object], tensors: int, repeats: int, sync: Callable[[], None]) -> float:
    for _ in range(3):
        call()
    best = float("inf")
    for _ in range(repeats):
        sync()
        start = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - start)
        sync()
    return best / tensors * 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tensors", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    params = [torch.nn.Parameter(torch.randn(1, device=device)) for _ in range(args.tensors)]
    for p in params:
        p.grad = torch.randn(1, device=device)
    grads = [p.grad for p in params]
    model = torch.nn.ParameterList(params)  # the same parameters as a module: names from named_parameters()
    optimizer = torch.optim.SGD(params, lr=0.1)
    one = torch.ones((), device=device)
    # Scale 1 and no growth, so that repeated calls leave the gradients as they are.
    ours = nanscan.amp.GradScaler(device.type, init_scale=1.0, growth_interval=10**9)
    theirs = torch.amp.GradScaler(device.type, init_scale=1.0, growth_interval=10**9)

    def ours_unscale_clip() -> None:
        ours.scale(one)
        ours.clip_grad_norm_(optimizer, 1e30)
        ours.update()

    def theirs_unscale_clip() -> None:
        theirs.scale(one)
        theirs.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(params, 1e30)
        theirs.update()

    rows = [
        ("torch.ops.nanscan.scan", lambda: torch.ops.nanscan.scan.default(grads)),
        ("nanscan.scan", lambda: nanscan.scan(grads)),
        # The writing op by 1, as a clip with nothing to clip makes it: through the dispatcher (its
        # Python ADInplaceOrView kernel), and as the wrappers call it, below that kernel off the CPU
        # (on the CPU the two rows are one path; NOTES.md entry 49).
        ("torch.ops.nanscan.scale_ (by 1)", lambda: torch.ops.nanscan.scale_.default(grads, one)),
        ("nanscan._ops.scale_ (by 1, the wrappers' path)", lambda: nanscan._ops.scale_(grads, one)),
        (
            "torch._foreach_norm + stack + norm",
            lambda: torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads))),
        ),
        ("nanscan.clip_grad_norm_", lambda: nanscan.clip_grad_norm_(params, 1e30)),
        ("torch clip_grad_norm_", lambda: torch.nn.utils.clip_grad_norm_(params, 1e30)),
        ("nanscan.check(params)", lambda: nanscan.check(params)),
        ("nanscan.check(params, max_norm)", lambda: nanscan.check(params, max_norm=1e30)),
        ("nanscan.check(model, max_norm)", lambda: nanscan.check(model, max_norm=1e30)),
        ("torch clip_grad_norm_(model.parameters())", lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e30)),
        ("model.named_parameters() alone", lambda: list(model.named_parameters())),
        ("nanscan.amp.GradScaler: scale, clip_grad_norm_, update", ours_unscale_clip),
        ("torch GradScaler: scale, unscale_, clip_grad_norm_, update", theirs_unscale_clip),
    ]
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"host ns per tensor, {args.tensors} one-element {where} tensors, torch {torch.__version__}, 1 thread")
    for name, call in rows:
        print(f"{name:<60}{best_ns_per_tensor(call, args.tensors, args.repeats, sync):>8.0f}")
    # check_state reads each parameter and Adam's two moments of it: a third of the parameters, so
    # that it scans as many tensors as the rows above (the op's cost a tensor grows with the list).
    third = params[: args.tensors // 3]
    adam = torch.optim.Adam(third)
    for p in third:
        adam.state[p] = {"step": torch.tensor(1.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
    third_model = model[: len(third)]  # a ParameterList of those parameters
    states = [t for p in third for t in (p, adam.state[p]["exp_avg"], adam.state[p]["exp_avg_sq"])]
    for name, call in [
        ("nanscan.scan of those tensors (params, exp_avg, exp_avg_sq)", lambda: nanscan.scan(states)),
        ("nanscan.check_state(params[:n/3], Adam)", lambda: nanscan.check_state(third, adam)),
        ("nanscan.check_state(model[:n/3], Adam)", lambda: nanscan.check_state(third_model, adam)),
    ]:
        print(f"{name:<60}{best_ns_per_tensor(call, len(states), args.repeats, sync):>8.0f}")


if __name__ == "__main__":
    main()
