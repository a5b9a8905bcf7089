"""Where a CUDA scan reads its list's metadata from, and what each place costs (issue 9, item 5;
benchmarks/NOTES.md entries 28, 58 and 59).

    python benchmarks/bench_list_layout.py              # CUDA only; ~30 s on an H100

A list's metadata (pointers, sizes, dtypes, the cost table) travels in the kernel's parameters when
it fits, up to 256 tensors. A longer list is read from a device copy, uploaded at its first call and
then found in the binding's cache (8 lists per stream) on every later call. Inside a CUDA graph the
copy is made for the graph and its upload (one small kernel per 32 KB slice of the blob) is part of
every replay. Two questions:

* **The parameters against the device copy.** 1K-element fp32 tensors at 256 tensors (the
  parameters) and at 257 and 1,300 (a device copy), in GPU time per tensor (CUDA events around a
  burst of calls, median of bursts) and in host time per tensor (the burst's wall time, no sync
  inside it). Each device-copy length twice: one list called again and again (its copy found in the
  cache), and nine lists in turn, so that every call misses the cache (allocates, uploads and evicts):
  a loop whose gradients move between steps. Until entry 58 a 32 KB parameter block carried lists of
  257 to 1,300 tensors at any address; the misses are what the device copy costs where that block did
  not depend on the cache.
* **The replica checksums at a model's length.** The checksum scan has no kernel that takes the list
  in its parameters (entry 59): every list, however short, is read from a device copy. 148 tensors
  (GPT-2-small's parameter count), cached and with a miss a call, beside the plain scan of the same
  lists in the parameters. The checksum kernel does more work per element, so the two differ by more
  than the metadata; the cached and missing rows isolate the copy's cost.
* **Graph replays of a long list.** 10,000 x 1K fp32: one replay of a captured scan against the
  same scan run eagerly (its blob found in the cache), both in GPU time. The difference is what the
  replay's upload kernels cost; torch's profiler names the kernels of one replay where it can see
  inside the graph.

Each list is fresh ``torch.randn`` data, 4 KB per tensor, so a list of 1,301 tensors is 5 MB: in L2
after the first call, as it would not be for a model's gradients. The question is the metadata's
cost, which L2 residency isolates; bench_scan.py measures the cold read.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import nanscan  # noqa: E402, F401 (registers torch.ops.nanscan)

# The longest list the kernels' parameters carry (csrc/cuda/scan_cuda.cu: kInlineTensors); a longer
# one is read from a device copy.
INLINE_TENSORS = 256
# More lists than the binding's cache keeps per stream (csrc/cuda_binding.cpp: DeviceListCache), so
# that calling them in turn misses it every time.
CACHE_MISSING_LISTS = 9


def burst_times(call, calls: int, bursts: int) -> tuple[float, float]:
    """Median GPU ms and median host ms per call of ``call``, over ``bursts`` bursts of ``calls``."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        call()
    burst_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    gpu, host = [], []
    for _ in range(bursts):
        # A spin kernel ahead of the burst, longer than the host takes to launch it (at up to 3 GHz,
        # twice over), so the GPU never waits for a launch: its time is the kernels' own, not the
        # host's pace.
        torch.cuda._sleep(int(burst_s * 6e9))
        start.record()
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        host.append((time.perf_counter() - t0) * 1e3 / calls)
        end.record()
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / calls)
    return statistics.median(gpu), statistics.median(host)


# GPT-2-small's parameter count (zoo.json): the checksum rows' list length.
MODEL_TENSORS = 148


def inline_capacity(calls: int, bursts: int) -> list[dict]:
    rows = []
    cases = [(INLINE_TENSORS, 1, False, "parameters"), (INLINE_TENSORS + 1, 1, False, "device copy (cached)")]
    cases += [(INLINE_TENSORS + 1, CACHE_MISSING_LISTS, False, "device copy (a miss a call)")]
    cases += [
        (1300, 1, False, "device copy (cached)"),
        (1300, CACHE_MISSING_LISTS, False, "device copy (a miss a call)"),
    ]
    cases += [(MODEL_TENSORS, 1, False, "parameters"), (MODEL_TENSORS, 1, True, "device copy (cached)")]
    cases += [(MODEL_TENSORS, CACHE_MISSING_LISTS, True, "device copy (a miss a call)")]
    for count, num_lists, checksum, metadata in cases:
        lists = itertools.cycle([[torch.randn(1024, device="cuda") for _ in range(count)] for _ in range(num_lists)])
        gpu_ms, host_ms = burst_times(
            lambda lists=lists, checksum=checksum: torch.ops.nanscan.scan(next(lists), False, checksum), calls, bursts
        )
        rows.append(
            {
                "tensors": count,
                "scan": "checksum" if checksum else "plain",
                "lists_in_turn": num_lists,
                "metadata": metadata,
                "gpu_us": gpu_ms * 1e3,
                "gpu_ns_per_tensor": gpu_ms * 1e6 / count,
                "host_us": host_ms * 1e3,
                "host_ns_per_tensor": host_ms * 1e6 / count,
            }
        )
        r = rows[-1]
        print(
            f"{count:>6}  {r['scan']:<8} {r['metadata']:<28} GPU {r['gpu_us']:8.2f} us ({r['gpu_ns_per_tensor']:6.2f} ns/tensor)"
            f"  host {r['host_us']:8.2f} us ({r['host_ns_per_tensor']:6.1f} ns/tensor)",
            flush=True,
        )
    return rows


def replay_kernels(graph: torch.cuda.CUDAGraph) -> dict[str, tuple[int, float]]:
    """Kernel name -> (count, total us) over one replay, as torch's profiler sees it (empty when it
    sees no kernels inside a graph)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    found: dict[str, tuple[int, float]] = {}
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = event.name.split("(")[0].split("<")[0].replace("void ", "").strip()
        count, total = found.get(name, (0, 0.0))
        found[name] = (count + 1, total + event.device_time_total)
    return found


def graph_replay(tensors: int, calls: int, bursts: int) -> dict:
    grads = [torch.randn(1024, device="cuda") for _ in range(tensors)]
    eager_ms, eager_host_ms = burst_times(lambda: torch.ops.nanscan.scan(grads), calls, bursts)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            torch.ops.nanscan.scan(grads)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = torch.ops.nanscan.scan(grads)
    replay_ms, replay_host_ms = burst_times(graph.replay, calls, bursts)
    torch.cuda.synchronize()
    eager = torch.ops.nanscan.scan(grads)
    # The replay's per-tensor counts and statistics against the eager call's, bit for bit.
    same = bool(torch.equal(captured[0], eager[0]) and torch.equal(captured[1], eager[1]))
    try:
        kernels = replay_kernels(graph)
    except Exception as error:  # the profiler is an aid to the reading, not the measurement
        kernels = {}
        print(f"(profiler unavailable: {error})")
    row = {
        "tensors": tensors,
        "eager_gpu_us": eager_ms * 1e3,
        "replay_gpu_us": replay_ms * 1e3,
        "upload_us": (replay_ms - eager_ms) * 1e3,
        "eager_host_us": eager_host_ms * 1e3,
        "replay_host_us": replay_host_ms * 1e3,
        "replay_matches_eager": same,
        "replay_kernels": {name: {"count": c, "us": us} for name, (c, us) in kernels.items()},
    }
    print(
        f"{tensors} x 1K fp32: eager GPU {row['eager_gpu_us']:.2f} us, graph replay GPU {row['replay_gpu_us']:.2f} us"
        f" (+{row['upload_us']:.2f} us); host per call {row['eager_host_us']:.1f} us eager,"
        f" {row['replay_host_us']:.1f} us replay; replay == eager: {same}"
    )
    for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1]):
        print(f"    {name:<40} x{count:<3} {us:8.2f} us")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=50, help="calls per timed burst")
    parser.add_argument("--bursts", type=int, default=15)
    parser.add_argument("--tensors", type=int, default=10_000, help="list length of the graph-replay case")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_list_layout.py measures the CUDA kernels' metadata paths: it needs a GPU")
    torch.manual_seed(0)
    print(f"nanscan, torch {torch.__version__}, {torch.cuda.get_device_name()}, {time.strftime('%Y-%m-%dT%H:%M:%S')}")
    print("== the parameters against the device copy: 1K fp32 tensors per list")
    layout = inline_capacity(args.calls, args.bursts)
    print("== a graph replay of a long list")
    replay = graph_replay(args.tensors, args.calls, args.bursts)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"inline_capacity": layout, "graph_replay": replay}, indent=2))


if __name__ == "__main__":
    main()
