"""Training-step overhead of nanscan.check against clip_grad_norm_ and against no clipping at all.

A GPT-2-small-sized decoder (12 layers, d_model 768, 12 heads, vocabulary 50257, tied embedding),
bf16 autocast on CUDA, AdamW. Three loops on the same model and data, each timed with CUDA events
(median of --steps steps after --warmup):

  none     forward, backward, optimizer.step()
  torch    ... + torch.nn.utils.clip_grad_norm_(params, 1.0)
  nanscan  ... + nanscan.check(model, max_norm=1.0)

On CUDA the nanscan loop also runs one step under torch.cuda.set_sync_debug_mode("error") to prove the
check adds no host sync. `--tiny` shrinks the model so the script can run on a CPU as a smoke test.

    python benchmarks/bench_train_step.py                 # CUDA, GPT-2-small size
    python benchmarks/bench_train_step.py --tiny --device cpu --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import nanscan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import Decoder


def time_steps(step: Callable[[], None], device: torch.device, steps: int, warmup: int) -> float:
    """Median milliseconds per call of ``step``."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--tiny", action="store_true", help="a 2-layer, d_model 64 model (smoke test)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.tiny:
        vocab, d_model, heads, layers, args.context = 1000, 64, 4, 2, min(args.context, 64)
    else:
        vocab, d_model, heads, layers = 50257, 768, 12, 12
    torch.manual_seed(0)
    model = Decoder(vocab, d_model, heads, layers, args.context).to(device)
    params = list(model.parameters())
    optimizer = torch.optim.AdamW(params, lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, vocab, (args.batch, args.context + 1), device=device)
    autocast_dtype = torch.bfloat16

    def forward_backward() -> None:
        with torch.autocast(device.type, dtype=autocast_dtype):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=False)
        loss.backward()

    def step_none() -> None:
        forward_backward()
        optimizer.step()

    def step_torch() -> None:
        forward_backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()

    def step_nanscan() -> None:
        forward_backward()
        nanscan.check(model, max_norm=1.0)
        optimizer.step()

    n_params = sum(p.numel() for p in params)
    print(
        f"model: {n_params / 1e6:.1f}M parameters, batch {args.batch} x {args.context} tokens, {device}",
        file=sys.stderr,
    )
    results = {}
    for name, step in (("none", step_none), ("torch", step_torch), ("nanscan", step_nanscan)):
        print(f"timing {name} ...", file=sys.stderr, flush=True)
        results[name] = time_steps(step, device, args.steps, args.warmup)

    syncs_checked = False
    if device.type == "cuda":
        forward_backward()
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            nanscan.check(model, max_norm=1.0)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        syncs_checked = True

    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    # The budget for the check: one read of the gradients, timed as torch.sum of a buffer that size.
    flat = torch.ones(grad_bytes // 4, device=device)
    one_read_ms = time_steps(lambda buffer=flat: torch.sum(buffer), device, args.steps, args.warmup)
    del flat
    print(f"\n{'loop':<10}{'ms/step':>10}{'vs none':>10}")
    for name, ms in results.items():
        print(f"{name:<10}{ms:>10.3f}{(ms / results['none'] - 1) * 100:>9.2f}%")
    added = results["nanscan"] - results["none"]
    print(
        f"\nnanscan vs torch clip: {results['nanscan'] / results['torch']:.3f}x step time; check adds "
        f"{added:.3f} ms per step against one read of the gradients ({grad_bytes / 1e6:.0f} MB) taking "
        f"{one_read_ms:.3f} ms; host syncs in check: {'0 (verified)' if syncs_checked else 'not checked on CPU'}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(
            json.dumps(
                {
                    "ms_per_step": results,
                    "one_read_ms": one_read_ms,
                    "params": n_params,
                    "batch": args.batch,
                    "context": args.context,
                    "device": str(device),
                    "grad_bytes": grad_bytes,
                },
                indent=2,
            )
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
