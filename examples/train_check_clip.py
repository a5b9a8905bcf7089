"""A plain PyTorch training loop with `nanscan.check` in place of `torch.nn.utils.clip_grad_norm_`.

One call scans every gradient (NaN/Inf counts, min/max, norms), clips to `max_norm` exactly as
`clip_grad_norm_` does, and with `on_nonfinite="skip"` makes the next `optimizer.step()` a no-op
when any gradient holds a NaN or an Inf. At `--fault-step` one Inf is planted in one layer's
gradient (what an overflow in a real run looks like), so the skip and the report are shown.
"""
# Run: python examples/train_check_clip.py

from __future__ import annotations

import argparse
import math

import torch

import nanscan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument(
        "--fault-step", type=int, default=None, help="step that gets an Inf gradient (default: half way; -1: none)"
    )
    args = parser.parse_args()
    fault_step = args.steps // 2 if args.fault_step is None else args.fault_step

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    hidden = torch.nn.Linear(128, 128)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 128),
        torch.nn.GELU(),
        hidden,
        torch.nn.GELU(),
        torch.nn.Linear(128, 1),
    ).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    teacher = torch.randn(32, 1, device=device) / 32**0.5  # the synthetic task: y = 3 sin(x @ teacher)

    for step in range(args.steps):
        x = torch.randn(64, 32, device=device)
        loss = torch.nn.functional.mse_loss(model(x), 3 * torch.sin(x @ teacher))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if step == fault_step and hidden.weight.grad is not None:
            hidden.weight.grad[0, 0] = math.inf  # a stand-in for an overflow in one layer's gradient

        # Replaces clip_grad_norm_(model.parameters(), 1.0): same clipping, plus the statistics and the
        # skip. Nothing here waits for the device; the report's values are read only when asked for.
        report = nanscan.check(model, max_norm=1.0, on_nonfinite="skip", optimizer=optimizer)
        optimizer.step()  # does nothing when the check found a NaN/Inf

        # Reading `finite` is one host sync. On a GPU, read it every N steps (or use a
        # nanscan.Recorder, examples/recorder_plot.py) rather than every step.
        if not report.finite:
            print(f"step {step}: non-finite gradients in {report.nonfinite}; optimizer step skipped")
            print(report)  # a table of the worst gradients
        elif step % 50 == 0 or step == args.steps - 1:
            print(f"step {step}: loss {loss.item():.4f}  grad norm {report.total_norm:.3f}  clipped {report.clipped}")

    guard = nanscan.SkipGuard.of(optimizer)
    print(f"done: {guard.total_skips} step(s) skipped out of {args.steps}")
    # The skipped step kept the Inf out of the weights.
    assert all(torch.isfinite(p).all() for p in model.parameters()), "a weight went non-finite"
    assert guard.total_skips == (1 if 0 <= fault_step < args.steps else 0)


if __name__ == "__main__":
    main()
