"""``python -m nanscan demo``: train a small model with ``nanscan.check`` every step, inject a fault,
show that nanscan names it, and measure what the check costs beside the usual alternatives."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from .check import check
from .recorder import Recorder
from .sinks import JSONLSink


class TeacherStudentTask:
    """Regression onto a fixed random teacher network: learnable, deterministic, no data download."""

    def __init__(self, width: int, device: torch.device, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.width = width
        self.device = device
        self.teacher = torch.randn(width, 8, generator=gen).to(device) / width**0.5
        self.gen = gen

    def batch(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(size, self.width, generator=self.gen).to(self.device)
        return x, torch.tanh(x @ self.teacher)


def make_model(width: int, depth: int, device: torch.device) -> torch.nn.Sequential:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
    layers.append(torch.nn.Linear(width, 8))
    return torch.nn.Sequential(*layers).to(device)


def per_parameter_loop(model: torch.nn.Module) -> list[tuple[str, bool, bool, float, float, float]]:
    """The diagnosis loop nanscan replaces: five ops and five host syncs per parameter."""
    out = []
    for name, p in model.named_parameters():
        g = p.grad
        if g is None:
            continue
        out.append(
            (
                name,
                bool(torch.isnan(g).any().item()),
                bool(torch.isinf(g).any().item()),
                float(g.min().item()),
                float(g.max().item()),
                float(g.norm().item()),
            )
        )
    return out


def median_ms(fn: Callable[[], object], device: torch.device, repeats: int = 30) -> float:
    """Median wall time of ``fn`` in milliseconds, synchronising the device around each call."""
    times = []
    for i in range(repeats + 3):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        if hasattr(result, "finite"):
            _ = result.finite  # a Report is only done once someone reads it
        if i >= 3:
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def run_demo(
    steps: int = 300,
    fault_step: int = 200,
    width: int = 384,
    depth: int = 4,
    device_name: str = "auto",
    out_dir: str = "nanscan-demo",
) -> int:
    """Trains, injects an Inf into one layer's gradient at ``fault_step`` (-1: none), reports, records
    every step (``out_dir``/run.jsonl, begun afresh, drawn to run.png), times. Returns 0 on success."""
    device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device_name == "auto" else device_name)
    problem = _training_options_problem(steps, fault_step, width, depth, _ARGUMENT_NAMES)
    if problem is not None:
        raise ValueError(f"nanscan demo: {problem}")
    model = make_model(width, depth, device)
    task = TeacherStudentTask(width, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    n_params = sum(p.numel() for p in model.parameters())
    print(
        f"nanscan demo: {depth + 1}-layer MLP ({n_params / 1e6:.2f}M parameters) on {device}, {steps} steps, "
        f"nanscan.check(model, max_norm=1.0) every step"
    )

    # The fault: at one step, layer 4's weight gradient overflows (as an fp16 accumulation past 65504
    # would): every non-zero element becomes +-Inf. Nothing else in the model is touched.
    faulty = model[4].weight
    assert isinstance(faulty, torch.Tensor)
    fault_name = "4.weight"
    current = {"step": -1}
    faulty.register_hook(lambda g: g * 1e39 if current["step"] == fault_step else g)
    if fault_step >= 0:
        print(f"  a fault will be injected at step {fault_step}: {fault_name}'s gradient overflows to Inf")
    else:
        print("  no fault will be injected")

    out = Path(out_dir)
    # A fresh record: JSONLSink appends, and a second demo in the same place would add its steps to
    # the first one's (the plot would draw both runs).
    (out / "run.jsonl").unlink(missing_ok=True)
    recorder = Recorder([JSONLSink(out / "run.jsonl")], every=50, warn=False)
    found: list[tuple[int, list[str]]] = []
    skipped = 0
    started = time.perf_counter()
    for step in range(steps):
        current["step"] = step
        x, y = task.batch(256)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        report = check(model, max_norm=1.0, on_nonfinite="skip", optimizer=optimizer, recorder=recorder)
        optimizer.step()  # skipped by nanscan when the check found a NaN/Inf
        if not report.finite:
            found.append((step, report.nonfinite))
            skipped += 1
            print(f"  step {step}: non-finite gradients in {', '.join(report.nonfinite)}; optimizer step skipped")
            print("    " + report.table(limit=3).replace("\n", "\n    "))
            continue
        if step % 50 == 0 or step == steps - 1:
            print(
                f"  step {step:4d}  loss {loss.item():.5f}  grad norm {report.total_norm:.4f}  "
                f"({time.perf_counter() - started:.1f}s)",
                flush=True,
            )

    injected = fault_step >= 0
    ok = found == [(fault_step, [fault_name])] if injected else not found
    verdict = "the injected fault, named exactly" if injected else "none, as none was injected"
    print(
        f"nanscan found {len(found)} bad step(s), {skipped} optimizer step(s) skipped: "
        + (verdict if ok else f"UNEXPECTED: {found}")
    )
    recorder.close()
    print(f"\n{recorder}\n  every step's statistics: {out / 'run.jsonl'}")
    try:
        from .plot import plot_run

        print(f"  drawn: {plot_run(out / 'run.jsonl', out / 'run.png', title='nanscan demo')}")
    except ImportError as error:  # matplotlib is optional
        print(f"  (not drawn: {error})")

    print("\nper-step cost on this model's gradients (median of 30, ms):")
    params = list(model.parameters())
    rows = [
        ("nanscan.check(model)", median_ms(lambda: check(model), device)),
        ("nanscan.check(model, max_norm=...), no clip", median_ms(lambda: check(model, max_norm=1e9), device)),
        ("per-parameter isnan/isinf/min/max/norm loop", median_ms(lambda: per_parameter_loop(model), device)),
        (
            "torch clip_grad_norm_(max_norm=...), no clip",
            median_ms(lambda: torch.nn.utils.clip_grad_norm_(params, 1e9), device),
        ),
    ]
    base = rows[0][1]
    for name, ms in rows:
        print(f"  {name:<46} {ms:8.3f} ms  {ms / base:6.1f}x")
    return 0 if ok else 1


def scenario_fp16_overflow(device: torch.device) -> bool:
    """fp16 training with a loss scale that is too large at first: GradScaler skips steps, nanscan's
    scaler says which parameters overflowed, and the Advisor explains what fp16 can hold, from the
    gradients of the steps that were not skipped and every module's activations."""
    from .activations import watch_activations
    from .amp import Advisor, GradScaler

    print("\n[fp16 overflow with GradScaler] init_scale 2^27: the first steps overflow fp16 and are skipped")
    model = make_model(64, 2, device)
    task = TeacherStudentTask(64, device, seed=1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = GradScaler(device.type, init_scale=2.0**27).watch(model)
    activations = watch_activations(model)
    advisor = Advisor(activations=activations)
    skipped = []
    for step in range(12):
        x, y = task.batch(32)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = torch.nn.functional.mse_loss(model(x).float(), y)
        optimizer.zero_grad()
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        if scaler.skipped:
            report = scaler.last_report
            bad = report.nonfinite if report is not None else []
            skipped.append(step)
            print(
                f"  step {step}: scale {scaler.get_scale():.3g} overflowed in {len(bad)} gradients "
                f"({', '.join(bad[:3])}{', ...' if len(bad) > 3 else ''}); step skipped"
            )
        else:
            advisor.observe(model)
        scaler.step(optimizer)
        scaler.update()
    print(f"  scale settled at {scaler.get_scale():.3g} after {len(skipped)} skipped steps")
    advice = advisor.advise()
    activations.remove()
    print("  " + str(advice).replace("\n", "\n  "))
    # The skips came from the scale, not from the model: the activations fit fp16.
    return len(skipped) > 0 and advice.recommendation in ("keep", "loss-scale")


class LogFeatures(torch.nn.Module):
    """log of a feature that should be positive; a dead input makes it log(0) = -inf."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.log(x)


def scenario_log_zero(device: torch.device) -> bool:
    """A log(0) in one layer: the loss is NaN, and nanscan.locate names the layer that made it."""
    from .locate import locate

    print("\n[log(0) in one layer] a dead unit (softplus output 0) reaches torch.log inside `1.2`")
    torch.manual_seed(0)
    before_softplus = torch.nn.Linear(16, 16)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 16),
        torch.nn.Sequential(before_softplus, torch.nn.Softplus(), LogFeatures(), torch.nn.Linear(16, 1)),
    ).to(device)
    x = torch.randn(8, 16, device=device)
    with torch.no_grad():
        before_softplus.weight[3].fill_(-1e4)  # one unit's pre-activation is hugely negative: softplus gives 0
    with locate(model) as trace:
        loss = model(x).square().mean()
        loss.backward()
    print(f"  loss = {loss.item()}; nanscan.locate says:")
    print("  " + str(trace).replace("\n", "\n  "))
    first = trace.first
    return first is not None and first.module == "1.2" and first.phase == "forward"


def scenario_eval_fp16(device: torch.device) -> bool:
    """Fine in fp32 training, NaN at fp16 evaluation: a sum of squares that overflows fp16's 65504.
    locate names the module; the activation watch and the Advisor say what to do about it."""
    from .activations import watch_activations
    from .amp import Advisor
    from .locate import locate

    print("\n[NaN only at fp16 evaluation] energies x^2 / sum(x^2): x^2 exceeds 65504 in fp16, inf / inf = NaN")

    class Energy(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            e = x * x
            return e / e.sum(-1, keepdim=True)

    torch.manual_seed(0)
    projection = torch.nn.Linear(32, 256)
    model = torch.nn.Sequential(projection, Energy(), torch.nn.Linear(256, 4)).to(device)
    with torch.no_grad():
        projection.weight.mul_(1000.0)
    x = torch.randn(4, 32, device=device)
    print(f"  fp32 evaluation finite: {bool(torch.isfinite(model(x)).all())}")
    dtype = torch.float16
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype), locate(model) as trace:
        out = model(x.to(dtype))
    print(f"  fp16 evaluation finite: {bool(torch.isfinite(out).all())}; nanscan.locate says:")
    print("  " + str(trace).replace("\n", "\n  "))
    with torch.no_grad(), torch.autocast(device.type, dtype=dtype), watch_activations(model) as activations:
        model(x.to(dtype))
    advice = Advisor(activations=activations).advise()
    print("  nanscan.watch_activations and the Advisor say:")
    print("  " + str(activations.table(limit=4)).replace("\n", "\n  "))
    print("  " + str(advice).replace("\n", "\n  "))
    first = trace.first
    return first is not None and first.module == "1" and advice.fp32_modules == ["1"]


SCENARIOS = {"fp16-overflow": scenario_fp16_overflow, "log-zero": scenario_log_zero, "eval-fp16": scenario_eval_fp16}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m nanscan demo", description=__doc__)
    parser.add_argument("--steps", type=int, default=300, help="training steps (default 300)")
    parser.add_argument(
        "--fault-step",
        type=int,
        help="step at which to inject the fault (-1: none; default: two thirds into the run, 200 of 300)",
    )
    parser.add_argument("--width", type=int, default=384, help="the MLP's width (default 384)")
    parser.add_argument("--depth", type=int, default=4, help="hidden layers, at least 2 (default 4)")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N, or auto (default: cuda if available)")
    parser.add_argument(
        "--out",
        default="nanscan-demo",
        help="the folder for the training run's record (run.jsonl, begun afresh) and plot (run.png)",
    )
    parser.add_argument(
        "--scenario",
        choices=["train", *SCENARIOS, "all"],
        default="all",
        help="train: the training run with an injected Inf; the others: AMP and localisation cases",
    )
    args = parser.parse_args(argv)
    device = _check_options(parser, args)
    status = 0
    if args.scenario in ("train", "all"):
        status |= run_demo(args.steps, args.fault_step, args.width, args.depth, str(device), args.out)
    for name, scenario in SCENARIOS.items():
        if args.scenario in (name, "all"):
            ok = scenario(device)
            print(f"  -> {'named the cause' if ok else 'UNEXPECTED result'}")
            status |= 0 if ok else 1
    return status


# How run_demo's arguments are spelled in a message: as its parameters, or as the command's options.
_ARGUMENT_NAMES = {"steps": "steps", "fault_step": "fault_step", "width": "width", "depth": "depth"}
_OPTION_NAMES = {"steps": "--steps", "fault_step": "--fault-step", "width": "--width", "depth": "--depth"}


def _training_options_problem(
    steps: int, fault_step: int, width: int, depth: int, spelled: dict[str, str]
) -> str | None:
    """What is wrong with the training scenario's options (None: nothing), named as ``spelled`` says:
    the one rule for run_demo's arguments and the command's options."""
    if depth < 2:
        return f"{spelled['depth']} must be at least 2 (the fault goes into the third linear layer), got {depth}"
    if width < 1:
        return f"{spelled['width']} must be positive, got {width}"
    if not -1 <= fault_step < steps:
        return (
            f"{spelled['fault_step']} {fault_step} is not a step of the run: give -1 (no fault) or 0 to "
            f"{steps - 1} ({spelled['steps']} {steps})"
        )
    return None


def _check_options(parser: argparse.ArgumentParser, args: argparse.Namespace) -> torch.device:
    """Every option checked before anything runs (``parser.error``: usage and a line, exit 2); the
    device to run on."""
    if args.steps <= 0:
        parser.error(f"--steps must be positive, got {args.steps}")
    if args.scenario in ("train", "all"):
        if args.fault_step is None:
            args.fault_step = args.steps * 2 // 3
        problem = _training_options_problem(args.steps, args.fault_step, args.width, args.depth, _OPTION_NAMES)
        if problem is not None:
            parser.error(problem)
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        try:
            device = torch.device(args.device)
        except RuntimeError:
            parser.error(f"--device {args.device!r} is not a device torch knows: give cpu, cuda, cuda:N or auto")
        try:
            torch.empty(1, device=device)
        except (RuntimeError, AssertionError) as error:
            reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            parser.error(f"--device {args.device}: this torch cannot use it ({reason})")
    if args.scenario in ("train", "all"):
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
            with open(out / "run.jsonl", "a"):
                pass
        except OSError as error:
            parser.error(f"--out {args.out}: cannot write there ({error.strerror or error})")
    return device


if __name__ == "__main__":
    sys.exit(main())
