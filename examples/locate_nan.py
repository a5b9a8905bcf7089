"""Which module made the first NaN: `nanscan.locate`.

The model normalises its input with a hand-written layer norm that has no epsilon: fine on real
rows, but a padding row of zeros makes (x - mean) / std = 0 / 0 = NaN. Training runs with
`nanscan.check(..., on_nonfinite="skip")`, which keeps the NaN out of the weights; when a step goes
bad, the batch is replayed under `with nanscan.locate(model) as trace:`, which hooks every module
(forward and backward, and each parameter's gradient) and names the first one whose output went
non-finite. The hooks cost a little, which is why they are attached only for the replay.
"""
# Run: python examples/locate_nan.py

from __future__ import annotations

import argparse

import torch

import nanscan


class NoEpsLayerNorm(torch.nn.Module):
    """A layer norm as often written by hand: no epsilon under the square root (the bug)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mean = x.mean(-1, keepdim=True)
        std = (x - mean).square().mean(-1, keepdim=True).sqrt()
        return (x - mean) / std


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument(
        "--fault-step", type=int, default=None, help="step whose batch holds a zero row (default: half way)"
    )
    args = parser.parse_args()
    fault_step = args.steps // 2 if args.fault_step is None else args.fault_step

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        NoEpsLayerNorm(),
        torch.nn.Linear(16, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    ).to(device)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)  # a batch can be made again from its step: replayable
        x = torch.randn(32, 16, generator=g)
        if step == fault_step:
            x[5] = 0.0  # a padding row slipped into the data
        return x.to(device), x.sum(-1, keepdim=True).to(device)

    for step in range(args.steps):
        x, y = batch(step)
        loss = torch.nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        report = nanscan.check(model, max_norm=1.0, on_nonfinite="skip", optimizer=optimizer)
        optimizer.step()  # skipped on a NaN step
        if report.finite:
            continue
        print(f"step {step}: loss {loss.item()}, NaN gradients in {report.nonfinite}; replaying under locate")
        optimizer.zero_grad(set_to_none=True)  # else the replay's gradients add up onto this step's NaNs
        with nanscan.locate(model) as trace:
            x, y = batch(step)
            torch.nn.functional.mse_loss(model(x), y).backward()
        optimizer.zero_grad(set_to_none=True)  # the replay's gradients are for diagnosis only
        print(trace)  # the first non-finite event, and where its inputs were still finite
        first, origin = trace.first, trace.origin
        assert first is not None and origin is not None
        print(f"\ntrace.first:  {first.phase} {first.kind} of module {first.module!r} ({first.op})")
        print(f"trace.origin: {origin.where}, inputs finite: {origin.inputs_finite}, outputs finite: {origin.finite}")
        assert origin.module == "0", "the NaN is made by the hand-written norm, module '0'"
        break
    else:
        print(f"{args.steps} steps, no NaN (the zero row comes at step {fault_step})")
    assert all(torch.isfinite(p).all() for p in model.parameters())


if __name__ == "__main__":
    main()
