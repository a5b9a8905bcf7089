"""The scan launches that ncu should profile, between cudaProfilerStart/Stop (run it under ncu with
``--profile-from-start off``): one scan of 10,000 x 1K fp32 gradients, one of GPT-2-small's fp32
gradients, and one of the latter with the replica checksum. Warm-up calls come first, outside the
profiled range, so the metadata cache and the workspace are in their steady state.

    ncu --profile-from-start off --section SpeedOfLight --section LaunchStats --section Occupancy \\
        --section WarpStateStats python3 tools/ncu_scan.py
"""

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import nanscan  # noqa: E402


def main() -> None:
    shapes = json.loads((ROOT / "benchmarks" / "zoo.json").read_text())["gpt2-small"]
    torch.manual_seed(0)
    many_small = [torch.randn(1024, device="cuda") for _ in range(10_000)]
    gpt2 = [torch.randn(*shape, device="cuda") for shape in shapes]
    runs = [("10000x1K", many_small, False), ("gpt2-small", gpt2, False), ("gpt2-small checksum", gpt2, True)]
    for _ in range(3):
        for _, grads, checksum in runs:
            nanscan.scan(grads, checksum=checksum)
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    for name, grads, checksum in runs:
        torch.cuda.nvtx.range_push(name)
        nanscan.scan(grads, checksum=checksum)
        torch.cuda.nvtx.range_pop()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    print("profiled:", ", ".join(name for name, _, _ in runs))


if __name__ == "__main__":
    main()
