"""fp16 mixed precision with `nanscan.amp.GradScaler`, and the Advisor's verdict on fp16.

`nanscan.amp.GradScaler` is a drop-in for `torch.amp.GradScaler`: same scale schedule and skipped
steps, but its unscale is fused with nanscan's scan, so `scaler.clip_grad_norm_(optimizer, 1.0)`
unscales and clips in one pass and `scaler.last_report` names the parameters that overflowed. The
initial loss scale here is deliberately too large, so the first steps overflow and are skipped.
`nanscan.amp.Advisor` watches the gradients of the steps that were not skipped (and, with
`nanscan.watch_activations`, every module's outputs) and says at the end whether fp16 holds them.

On a GPU this is `torch.autocast("cuda", dtype=torch.float16)`. On the CPU, torch's autocast also
takes float16 (matmuls and linears run in fp16, which is slow there but shows the same overflows).
"""
# Run: python examples/amp_fp16.py

from __future__ import annotations

import argparse

import torch

import nanscan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--init-scale", type=float, default=2.0**22, help="the loss scale to start from (too large)")
    args = parser.parse_args()

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256), torch.nn.GELU(), torch.nn.Linear(256, 8)
    ).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # watch(model): the reports name parameters as you wrote them ("2.weight"), not "group0.param2".
    scaler = nanscan.amp.GradScaler(device.type, init_scale=args.init_scale).watch(model)
    # Scans every module's outputs on every 4th forward, on the device: no host sync until read.
    activations = nanscan.watch_activations(model, every=4)
    advisor = nanscan.amp.Advisor(activations=activations)
    teacher = torch.randn(64, 8, device=device) / 8

    skipped = 0
    for step in range(args.steps):
        x = torch.randn(128, 64, device=device)
        with torch.autocast(device.type, dtype=torch.float16):
            out = model(x)
        loss = torch.nn.functional.mse_loss(out.float(), x @ teacher)  # the loss in fp32
        optimizer.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        # Replaces scaler.unscale_(optimizer) + torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).
        scaler.clip_grad_norm_(optimizer, 1.0)
        if scaler.skipped:  # one sync; scaler.step below skips this step, as torch's scaler would
            skipped += 1
            report = scaler.last_report  # always of the unscaled gradients
            bad = report.nonfinite if report is not None else []
            print(f"step {step}: loss scale {scaler.get_scale():.3g} overflowed in {bad}; step skipped")
        else:
            advisor.observe(model)  # only the steps the scaler did not skip: their gradients are real
            report = scaler.last_report
            if (step % 25 == 0 or step == args.steps - 1) and report is not None:
                print(
                    f"step {step}: loss {loss.item():.4f}  grad norm {report.total_norm:.3g}  clipped {report.clipped}"
                )
        scaler.step(optimizer)
        scaler.update()

    print(f"\n{skipped} of {args.steps} steps skipped; the scale settled at {scaler.get_scale():.3g}")
    print(activations.table(limit=5))  # per module: largest |activation|, headroom to fp16's 65504
    print(advisor.advise())  # here: the overflows came from the scale, not from the model
    activations.remove()


if __name__ == "__main__":
    main()
