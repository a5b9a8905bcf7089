"""A short workload that reaches every CUDA kernel path, for compute-sanitizer (memcheck, racecheck,
synccheck, initcheck: tools/gpu_session.sh sanitize runs them all) on a GPU machine; it also checks
each result against the CPU backend, so a run that the sanitizer passes is also a correct one.

    compute-sanitizer --tool memcheck python3 tools/sanitize_workload.py
    python3 tools/sanitize_workload.py --device cpu      # smoke test without a GPU

Paths covered: lists in the small and the large parameter capacity and in device memory (uploaded,
then found in the cache), empty tensors, every dtype including fp8, a tensor of over 1024 chunks (met
by over 1024 warps' shares on a GPU's grid: both levels of the fold tree), NaN/Inf planted, the fp16-range scan, the fused unscale, and the clip
multiply with a coefficient of 1 (no write) and below 1. Set PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that
memcheck sees each allocation's true bounds rather than the caching allocator's pooled blocks.
"""

from __future__ import annotations

import argparse
import math

import torch

import nanscan

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def tensor(n: int, dtype: torch.dtype, device: str, gen: torch.Generator) -> torch.Tensor:
    x = torch.randn(n, generator=gen, dtype=torch.float64).clamp(-400, 400).to(dtype)
    return x.to(device)


def with_grads(grads: list[torch.Tensor]) -> list[torch.nn.Parameter]:
    """Parameters whose .grad are ``grads``: what the clip drop-ins take."""
    params = [torch.nn.Parameter(torch.empty_like(g)) for g in grads]
    for p, g in zip(params, grads):
        p.grad = g
    return params


def agree(tensors: list[torch.Tensor], fp16_range: bool = False) -> None:
    got = nanscan.scan(tensors, fp16_range=fp16_range)
    want = nanscan.scan([t.cpu() for t in tensors], fp16_range=fp16_range)
    fields = ["nan_count", "inf_count", "min", "max"] + (["fp16_overflow", "fp16_underflow"] if fp16_range else [])
    for name in fields:
        assert torch.equal(getattr(got, name).cpu(), getattr(want, name)), name
    torch.testing.assert_close(got.norm.cpu(), want.norm, rtol=1e-6, atol=0, equal_nan=True)
    torch.testing.assert_close(got.total_norm.cpu(), want.total_norm, rtol=1e-6, atol=0, equal_nan=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda")
    device = parser.parse_args().device
    gen = torch.Generator().manual_seed(0)
    dtypes = FLOATS + FP8

    mixed = [tensor((i * 7919) % 70_000, dtypes[i % len(dtypes)], device, gen) for i in range(200)]
    mixed[3].view(-1)[0] = math.nan
    mixed[10].view(-1)[-1] = math.inf
    agree(mixed)  # small parameter capacity
    agree(mixed * 4)  # large parameter capacity (800 tensors)
    long_list = [tensor(1 + i % 300, dtypes[i % 4], device, gen) for i in range(2000)]
    long_list[1999].view(-1)[0] = -math.inf
    agree(long_list)  # device memory: uploaded
    agree(long_list)  # device memory: from the cache
    agree(long_list, fp16_range=True)
    per_chunk = 32 * 1024 // 4
    big = tensor(1025 * per_chunk + 3, torch.float32, device, gen)
    big[per_chunk * 700] = math.nan
    agree([big, torch.empty(0, device=device), tensor(5, torch.bfloat16, device, gen)])

    grads = [tensor(n, torch.float32, device, gen) * 1000 for n in (1, 555, 65_537, 300_001)] + long_list[:4]
    expected = [g.clone() for g in grads]
    found = torch.zeros((), device=device)
    inv_scale = torch.tensor(1 / 1024.0, device=device)
    torch._amp_foreach_non_finite_check_and_unscale_(expected, found, inv_scale)
    torch.ops.nanscan.unscale_scan_(grads, inv_scale)
    for g, e in zip(grads, expected):
        assert torch.equal(g.nan_to_num(), e.nan_to_num())

    clip_me = [tensor(n, torch.float32, device, gen) for n in (10, 100_000)] + [t.float() * 10 for t in long_list[:1600]]
    before = [t.clone() for t in clip_me]
    nanscan.clip_grad_norm_(with_grads(clip_me), 1e30)  # coefficient 1: nothing written
    assert all(torch.equal(a, b) for a, b in zip(clip_me, before))
    total = nanscan.clip_grad_norm_(with_grads(clip_me), 1.0)
    torch.nn.utils.clip_grad_norm_(with_grads(before), 1.0)
    assert float(total) > 10  # so the multiply really scaled
    for a, b in zip(clip_me, before):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if device == "cuda":
        torch.cuda.synchronize()
    print("sanitize_workload: all paths ran and agreed with the CPU")


if __name__ == "__main__":
    main()
