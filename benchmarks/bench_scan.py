"""Times nanscan against its in-run ceiling and its peers, on the parameter shapes of real models.

    python benchmarks/bench_scan.py                      # full run: every zoo model, fp32 + bf16
    python benchmarks/bench_scan.py --quick              # smoke test (< 1 min on 2 CPU cores)
    python benchmarks/bench_scan.py --models gpt2-small --dtype bfloat16 --json benchmarks/out/x.json
    python benchmarks/bench_scan.py --models gpt2-small --magnitudes ordinary,1e-17,tiny,all_nan

Method (DESIGN.md section 5). For every case (a list of gradient shapes, a dtype and a magnitude) the
gradients are filled once and every method below is timed in the same run on those same tensors: warm-up calls, then the median of the timed calls (at least ``--repeats``, more
for fast methods until about ``--min-time`` seconds were timed, at most ``--max-repeats``). The timed
calls are interleaved: in rounds, each method's calls spread evenly over the rounds, so a slow spell
of the machine (a shared VM's memory bandwidth drifts by tens of percent) hits every method alike
instead of whichever method happened to run during it.

Magnitudes (``--magnitudes``), the values training makes, not only ``randn``:

* ``ordinary``: ``torch.randn`` (never zeros).
* ``1e-12``, ``1e-17``, ``tiny`` (1e-20): ``torch.randn`` times that: vanishing gradients, whose fp32
  squares round in the subnormal range or underflow (from about 1e-16 down).
* ``vanishing``: real vanishing gradients. For the ``deep_mlp_75x256`` case, the gradients of that
  MLP after one backward (benchmarks/models.py: 6e-6 in its last layer down to 5e-23 in its first);
  for any other model, ``torch.randn`` times, per tensor, the root mean square of the MLP's gradient
  at the same relative depth (the first tensor the MLP's first layer's, the last its last's).
* ``overflow``: an AMP overflow step: ``torch.randn`` with an Inf at one element in 1,000 (every
  4,096-element run of the CPU kernel holds some).
* ``all_nan``: every element NaN.

By default each case is timed at ordinary, tiny, vanishing and overflow (``--quick``: ordinary and
tiny); a scan at any magnitude should cost about what it costs on ordinary values.

* ``ceiling_sum``: ``torch.sum`` of one flat buffer of the same dtype and element count, i.e. one
  read of the gradient bytes. Every other time is also given as a ratio to it ("x ceiling").
* ``nanscan.scan``; ``torch.ops.nanscan.scan``, the registered op without the Python wrapper (its
  validation per tensor), to show the wrapper's share; ``nanscan.scan(checksum)``, the scan with the
  replica checksums (``verify_replicas``), against the plain scan; ``nanscan.check(params)``, the
  per-step call (the scan and the report, no clip); ``nanscan.clip`` and ``torch.clip``
  (``clip_grad_norm_``) with ``max_norm`` 1e30 (nothing is clipped) and 1e-3 (everything is).
* ``per_param_loop``: the diagnosis loop of DESIGN.md section 1 (isnan/isinf ``.any().item()``,
  ``min``/``max``/``norm`` ``.item()`` per gradient); ``foreach_norm+stack``: ``torch._foreach_norm``,
  ``torch.stack`` and ``torch.linalg.vector_norm`` of the stack.
* On CUDA only: ``torch.compile(stats)``, the same statistics as the scan written in torch and
  compiled (plain amin/amax rather than min/max of the finite values); not for lists of over
  ``COMPILE_MAX_TENSORS`` tensors, whose compile alone would outlast the run.
* On every device, for non-fp16 gradients: ``amp.unscale+clip`` (``GradScaler.unscale_`` then
  ``clip_grad_norm_``: 3 reads + 2 writes) against ``nanscan.amp.unscale+clip`` (the fused unscale +
  scan, then nanscan's clip reusing its statistics: 1 read + 1 write, 2 + 2 when clipping), each
  with nothing to clip and with everything clipped. GradScaler refuses to unscale fp16 gradients.

The flat buffer is filled first and the gradients are separately allocated copies of its slices, so
the ceiling reads the same values and a method that rewrites the gradients (the clipping cases,
``GradScaler.unscale_``) is undone by copying them back, after each call and outside the timed
region; the values never shrink towards denormals. Parameters are ``nn.Parameter`` views of the
gradient storage with ``.grad`` set to the gradient (no memory beyond the gradients and the buffer).

Caches: inputs smaller than the last-level cache would be timed warm. Each case is therefore built as
several identical-shaped copies (fresh random values each) whose total is at least four times the
last-level cache (L3 on the CPU, L2 on the GPU), and consecutive calls rotate through them, so every
timing is of a cold read from memory. Cases bigger than that (every zoo model) have one copy.
"many_small_2000x512" (2000 tensors of 512 elements, 4 MB in fp32) is the case this matters for.

Memory: a case needs its gradients twice (gradients + flat buffer) per copy plus per-tensor
temporaries of the loop; a case that does not fit in 85% of the available memory is skipped with a
note (in the table and the JSON) rather than crashing. Tensors are freed between cases.

Timing: host timers around each call; on CUDA with ``torch.cuda.synchronize()`` before and after, so a
time includes launch overhead and any host syncs the method makes, as a training step would see.
On CUDA, every method that makes no host sync is also timed split in two (``gpu_and_host_times``):
its GPU time (CUDA events, with the host's enqueueing hidden behind a sleep kernel) and its host time
per call and per tensor. "many_small_10000x1024" is the case for those: 10,000 tensors of 4 KB.
Ratios use medians; the table also gives the fastest call.

Stalls: on a small VM the second vCPU is at times descheduled by the host, and every parallel region
then waits for it (on the 2-core development VM: times snap to multiples of 8 ms). That inflates each
method by its number of parallel regions, per-tensor peers most. A probe, a 1 MB ``torch.sum``
(under 0.3 ms when healthy), is interleaved with the methods; when over a tenth of its calls take more
than 1 ms (a lone slow call is an interrupt, not a stall) the case is marked STALLED: rerun it (or try
``--threads 1``) before quoting it.
"""

from __future__ import annotations

import argparse
import functools
import gc
import itertools
import json
import math
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

import nanscan

sys.path.insert(0, str(Path(__file__).resolve().parent))
import models  # benchmarks/models.py, beside this file

# The parameter shapes of public models (facts about them, shipped with the benchmarks, so a fresh
# clone runs every benchmark as it is).
_REPO = Path(__file__).resolve().parents[1]
DEFAULT_ZOO = _REPO / "benchmarks" / "zoo.json"
MANY_SMALL = "many_small_2000x512"
TEN_THOUSAND = "many_small_10000x1024"
DEEP_MLP = "deep_mlp_75x256"
SYNTHETIC: dict[str, list[list[int]]] = {
    MANY_SMALL: [[512]] * 2000,
    TEN_THOUSAND: [[1024]] * 10_000,
    DEEP_MLP: models.deep_mlp_shapes(),
}
# What --magnitudes takes (see the module docstring): a scale for randn, or a fill of its own.
SCALED_MAGNITUDES = {"ordinary": 1.0, "1e-12": 1e-12, "1e-17": 1e-17, "tiny": 1e-20}
MAGNITUDES = (*SCALED_MAGNITUDES, "vanishing", "overflow", "all_nan")
DEFAULT_MAGNITUDES = ("ordinary", "tiny", "vanishing", "overflow")
QUICK_MAGNITUDES = ("ordinary", "tiny")
OVERFLOW_EVERY = 1000  # "overflow": an Inf at one element in this many
DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}
ZOO_DTYPES = ("float32", "bfloat16")
SYNTHETIC_DTYPES = ("float32",)
NO_CLIP = 1e30  # max_norm that never clips
CLIP = 1e-3  # max_norm that always clips
ROTATE_CACHES = 4  # rotated copies of a case together span at least this many last-level caches
MEMORY_FRACTION = 0.85
STALL_PROBE_MS = 1.0  # a probe call slower than this waited for a stalled vCPU (see the module docstring)
STALL_FRACTION = 0.1  # the share of slow probe calls that marks a case STALLED
PROBE = "stall_probe"
CEILING = "ceiling_sum"
SCAN = "nanscan.scan"


# ----------------------------------------------------------------------------------------- inputs


@dataclass
class Inputs:
    """One copy of a case's gradients, the flat buffer holding the same values, and their parameters."""

    flat: torch.Tensor
    grads: list[torch.Tensor]
    params: list[torch.nn.Parameter]
    sources: list[torch.Tensor]  # views of ``flat``, one per gradient: what ``restore`` copies back
    optimizer: torch.optim.Optimizer | None = None  # for GradScaler.unscale_
    scaler: torch.amp.GradScaler | None = None
    nanscan_scaler: nanscan.amp.GradScaler | None = None

    def restore(self) -> None:
        """Undoes a method that rewrote the gradients, and gives the GradScalers a fresh unscale_ state."""
        for grad, source in zip(self.grads, self.sources, strict=True):
            grad.copy_(source)
        if self.optimizer is not None:
            self.scaler = fresh_scaler(self.flat.device, torch.amp.GradScaler)
            self.nanscan_scaler = fresh_scaler(self.flat.device, nanscan.amp.GradScaler)


def fresh_scaler(device: torch.device, kind: type[torch.amp.GradScaler]) -> torch.amp.GradScaler:
    """A GradScaler whose scale is initialised (``unscale_`` needs a prior ``scale``) and not yet used."""
    scaler = kind(device.type, init_scale=2.0**16)
    scaler.scale(torch.ones((), device=device))
    return scaler


@functools.cache
def vanishing_profile() -> tuple[list[torch.Tensor], list[float]]:
    """The deep MLP's real gradients, and each one's root mean square (in parameter order)."""
    grads = models.deep_mlp_gradients()
    return grads, [float(g.double().square().mean().sqrt()) for g in grads]


def fill_values(shapes: Sequence[Sequence[int]], magnitude: str) -> torch.Tensor:
    """The flat float32 values of gradients of ``shapes`` at ``magnitude`` (module docstring), on the CPU."""
    numels = [math.prod(shape) for shape in shapes]
    if magnitude == "all_nan":
        return torch.full((sum(numels),), math.nan)
    if magnitude == "vanishing":
        grads, rms = vanishing_profile()
        if [list(s) for s in shapes] == [list(g.shape) for g in grads]:
            return torch.cat([g.reshape(-1) for g in grads])
        last = max(1, len(shapes) - 1)
        depth = [rms[round(i / last * (len(rms) - 1))] for i in range(len(shapes))]
        return torch.cat([torch.randn(n) * scale for n, scale in zip(numels, depth, strict=True)])
    values = torch.randn(sum(numels))
    if magnitude == "overflow":
        values[torch.randperm(values.numel())[: max(1, values.numel() // OVERFLOW_EVERY)]] = math.inf
        return values
    return values * SCALED_MAGNITUDES[magnitude]


def build_inputs(shapes: Sequence[Sequence[int]], dtype: torch.dtype, device: torch.device, magnitude: str) -> Inputs:
    """Gradients of ``shapes`` at ``magnitude``, each its own allocation, plus the flat buffer of their values."""
    numels = [math.prod(shape) for shape in shapes]
    flat = fill_values(shapes, magnitude).to(device=device, dtype=dtype)
    sources = [chunk.view(shape) for chunk, shape in zip(flat.split(numels), shapes, strict=True)]
    grads = [source.clone() for source in sources]
    params = [torch.nn.Parameter(grad, requires_grad=True) for grad in grads]  # shares the grad's storage
    for param, grad in zip(params, grads, strict=True):
        param.grad = grad
    inputs = Inputs(flat, grads, params, sources)
    if dtype != torch.float16:  # GradScaler refuses to unscale fp16 gradients
        inputs.optimizer = torch.optim.SGD(params, lr=0.0)
        inputs.restore()
    return inputs


# ---------------------------------------------------------------------------------------- methods


@dataclass(frozen=True)
class Method:
    """A timed call. ``counterpart``: the nanscan method a peer is compared with in "vs nanscan"."""

    name: str
    run: Callable[[Inputs], object]
    counterpart: str | None = None
    mutates: bool = False  # changes gradient values: restore the inputs after every call
    sync_free: bool = True  # makes no host sync: its GPU and host time can be told apart (CUDA)


def per_param_loop(grads: list[torch.Tensor]) -> list[tuple[bool, bool, float, float, float]]:
    """The usual diagnosis loop (DESIGN.md section 1): several kernels and host syncs per gradient."""
    return [
        (
            torch.isnan(g).any().item(),
            torch.isinf(g).any().item(),
            g.min().item(),
            g.max().item(),
            g.norm().item(),
        )
        for g in grads
    ]


def foreach_total_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The foreach peer: per-tensor norms in one foreach call, then the norm of their stack."""
    return torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))


def torch_stats(grads: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The scan's statistics written in torch (the body ``torch.compile`` gets as a peer)."""
    nans = torch.stack([torch.isnan(g).sum() for g in grads])
    infs = torch.stack([torch.isinf(g).sum() for g in grads])
    mins = torch.stack([g.amin() for g in grads])
    maxs = torch.stack([g.amax() for g in grads])
    norms = torch.stack([torch.linalg.vector_norm(g, dtype=torch.promote_types(g.dtype, torch.float32)) for g in grads])
    return nans, infs, mins, maxs, norms, torch.linalg.vector_norm(norms)


def torch_can_unscale(dtype: torch.dtype, device: torch.device) -> bool:
    """Whether torch's GradScaler can unscale gradients of ``dtype`` on ``device`` (its CUDA kernel has
    no bf16 in torch 2.11: then nanscan's AMP methods are timed without a torch peer)."""
    probe = torch.ones(1, dtype=dtype, device=device)
    try:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [probe], torch.zeros((), device=device), torch.ones((), device=device)
        )
    except (NotImplementedError, RuntimeError):
        return False
    return True


def amp_unscale_clip(max_norm: float) -> Callable[[Inputs], torch.Tensor]:
    """The AMP step's gradient handling: GradScaler.unscale_ (inf check + multiply), then torch's clip:
    3 reads + 2 writes of the gradients."""

    def run(inputs: Inputs) -> torch.Tensor:
        assert inputs.scaler is not None and inputs.optimizer is not None
        inputs.scaler.unscale_(inputs.optimizer)
        return torch.nn.utils.clip_grad_norm_(inputs.params, max_norm)

    return run


def nanscan_unscale_clip(max_norm: float) -> Callable[[Inputs], torch.Tensor]:
    """The same with nanscan.amp.GradScaler's one-call unscale + clip (the clip uses the statistics of
    the pass that unscaled): 1 read + 1 write without clipping, 2 + 2 with."""

    def run(inputs: Inputs) -> torch.Tensor:
        assert inputs.nanscan_scaler is not None and inputs.optimizer is not None
        return inputs.nanscan_scaler.clip_grad_norm_(inputs.optimizer, max_norm)

    return run


# torch.compile unrolls the stats function's loop over the list: past this many tensors, compiling
# takes longer than a benchmark run may (minutes for thousands of kernels), so that peer is left out.
COMPILE_MAX_TENSORS = 1000


def methods(device: torch.device, dtype: torch.dtype, num_tensors: int) -> list[Method]:
    """The methods timed on ``device`` for gradients of ``dtype``: the stall probe, the ceiling, the scan, ..."""
    torch_clip = torch.nn.utils.clip_grad_norm_
    probe_buffer = torch.ones(1 << 18, device=device)
    found = [
        Method(PROBE, lambda _: torch.sum(probe_buffer), sync_free=False),
        Method(CEILING, lambda x: torch.sum(x.flat)),
        Method(SCAN, lambda x: nanscan.scan(x.grads)),
        # The registered op alone, without the Python wrapper's checks: the wrapper's share of the time.
        Method("torch.ops.nanscan.scan", lambda x: torch.ops.nanscan.scan(x.grads)),
        # The replica checksum in the same pass (verify_replicas): its cost beside the plain scan's.
        Method("nanscan.scan(checksum)", lambda x: nanscan.scan(x.grads, checksum=True), SCAN),
        # The op in ATen ops (nanscan.composite): what MPS, XPU and every device without a kernel run.
        Method("composite", lambda x: nanscan.composite.scan(x.grads), SCAN),
        # The per-step call users make: the scan plus the report's rows (no clip asked).
        Method("nanscan.check(params)", lambda x: nanscan.check(x.params)),
        Method("nanscan.clip(no-clip)", lambda x: nanscan.clip_grad_norm_(x.params, NO_CLIP)),
        Method("nanscan.clip(clip)", lambda x: nanscan.clip_grad_norm_(x.params, CLIP), mutates=True),
        # torch multiplies by exactly 1.0 when nothing is clipped: it writes, but the values stay.
        Method("torch.clip(no-clip)", lambda x: torch_clip(x.params, NO_CLIP), "nanscan.clip(no-clip)"),
        Method("torch.clip(clip)", lambda x: torch_clip(x.params, CLIP), "nanscan.clip(clip)", mutates=True),
        Method("per_param_loop", lambda x: per_param_loop(x.grads), SCAN, sync_free=False),
        Method("foreach_norm+stack", lambda x: foreach_total_norm(x.grads), SCAN),
    ]
    if dtype != torch.float16:  # GradScaler refuses to unscale fp16 gradients
        torch_peer = torch_can_unscale(dtype, device)
        found.append(Method("nanscan.amp.unscale+clip(no-clip)", nanscan_unscale_clip(NO_CLIP), mutates=True))
        if torch_peer:
            found.append(
                Method(
                    "amp.unscale+clip(no-clip)",
                    amp_unscale_clip(NO_CLIP),
                    "nanscan.amp.unscale+clip(no-clip)",
                    mutates=True,
                )
            )
        found.append(Method("nanscan.amp.unscale+clip(clip)", nanscan_unscale_clip(CLIP), mutates=True))
        if torch_peer:
            found.append(
                Method("amp.unscale+clip(clip)", amp_unscale_clip(CLIP), "nanscan.amp.unscale+clip(clip)", mutates=True)
            )
    if device.type == "cuda" and num_tensors <= COMPILE_MAX_TENSORS:
        compiled = torch.compile(torch_stats)
        found.append(Method("torch.compile(stats)", lambda x: compiled(x.grads), SCAN))
    return found


def method_names(names: str | None) -> set[str] | None:
    """The methods ``--methods`` asks for, plus those every ratio needs: the stall probe, the ceiling
    and the scan (None: all)."""
    if not names:
        return None
    return {name.strip() for name in names.split(",") if name.strip()} | {PROBE, CEILING, SCAN}


def check_method_names(wanted: set[str] | None, device: torch.device, cases: Sequence[Case]) -> None:
    """Exits naming any ``--methods`` entry that no case would time (before any case is built): a
    name that exists for some cases only (torch.compile on short CUDA lists, the AMP peers) is fine."""
    if wanted is None:
        return
    known: set[str] = set()
    for dtype, count in {(case.dtype, len(case.shapes)) for case in cases}:
        known |= {method.name for method in methods(device, DTYPES[dtype], count)}
    unknown = wanted - known
    if unknown:
        sys.exit(f"bench_scan: unknown --methods {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")


def selected(found: list[Method], wanted: set[str] | None) -> list[Method]:
    """``found`` narrowed to ``wanted`` and the nanscan counterparts of the peers in it, which their
    "vs nanscan" column is taken against."""
    if wanted is None:
        return found
    keep = wanted | {method.counterpart for method in found if method.name in wanted and method.counterpart}
    return [method for method in found if method.name in keep]


# ----------------------------------------------------------------------------------------- timing


def synchronizer(device: torch.device) -> Callable[[], None]:
    """What makes a host timer honest on ``device``: a full synchronize on CUDA, nothing on the CPU."""
    return torch.cuda.synchronize if device.type == "cuda" else (lambda: None)


def time_methods(
    found: list[Method], copies: list[Inputs], args: argparse.Namespace, sync: Callable[[], None]
) -> dict[str, list[float]]:
    """Seconds per timed call of each method, rotating through ``copies``; warm-up calls are not returned.

    Each method gets ``args.repeats`` timed calls, raised to reach about ``args.min_time`` seconds in
    all (estimated from its last warm-up call) but never past ``args.max_repeats``. The timed calls run
    in rounds, each method's calls spread evenly over them, so drift in the machine hits all alike.
    """
    calls = itertools.count()

    def once(method: Method) -> float:
        inputs = copies[next(calls) % len(copies)]
        sync()
        start = time.perf_counter()
        method.run(inputs)
        sync()
        elapsed = time.perf_counter() - start
        if method.mutates:
            inputs.restore()
        return elapsed

    counts: dict[str, int] = {}
    for method in found:
        estimate = [once(method) for _ in range(args.warmup)][-1] if args.warmup else 0.0
        counts[method.name] = args.repeats
        if estimate > 0:
            counts[method.name] = max(args.repeats, min(args.max_repeats, math.ceil(args.min_time / estimate)))
        log(f"    warm-up {method.name:<24} {estimate * 1e3:10.3f} ms -> {counts[method.name]} timed calls")
    rounds = max(counts.values())
    times: dict[str, list[float]] = {method.name: [] for method in found}
    for r in range(rounds):
        for method in found:
            n = counts[method.name]
            if (r + 1) * n // rounds > r * n // rounds:  # true n times over the rounds, evenly spaced
                times[method.name].append(once(method))
    return times


def gpu_and_host_times(
    found: list[Method], inputs: Inputs, repeats: int
) -> dict[str, tuple[list[float], list[float], bool]]:
    """Per sync-free method: (GPU seconds, host seconds) of each of ``repeats`` calls, and whether the
    GPU ever caught up with the host.

    The GPU is first held busy by a sleep kernel longer than the call takes to enqueue, so the host
    issues the whole call before any of it runs: CUDA events recorded around the call then time only
    the GPU's work (kernels back to back, launch gaps included), and a host timer around the same call
    times only the host's work (the cost per call that a training loop's CPU pays).
    """
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize()
    cycles_per_second = 10_000_000 / (start.elapsed_time(end) / 1e3)
    results: dict[str, tuple[list[float], list[float], bool]] = {}
    for method in found:
        if not method.sync_free:
            continue
        gpu: list[float] = []
        host: list[float] = []
        overtaken = False
        wall = 0.01
        for i in range(repeats + 1):  # the first call sizes the sleep and is not kept
            sleep = max(0.002, 3 * wall)
            torch.cuda.synchronize()
            torch.cuda._sleep(int(sleep * cycles_per_second))
            start.record()
            t0 = time.perf_counter()
            method.run(inputs)
            t1 = time.perf_counter()
            end.record()
            torch.cuda.synchronize()
            if method.mutates:
                inputs.restore()
            wall = t1 - t0
            if i > 0:
                gpu.append(start.elapsed_time(end) / 1e3)
                host.append(wall)
                overtaken |= wall > sleep
        results[method.name] = (gpu, host, overtaken)
    return results


# ------------------------------------------------------------------------------------------ cases


@dataclass
class Case:
    """One model's gradient shapes in one dtype at one magnitude, and what was measured on it."""

    model: str
    dtype: str
    shapes: list[list[int]]
    magnitude: str = "ordinary"
    copies: int = 1
    skipped: str | None = None
    times: dict[str, list[float]] = field(default_factory=dict)
    counterparts: dict[str, str | None] = field(default_factory=dict)
    probe: list[float] = field(default_factory=list)  # stall probe times, interleaved with the methods
    split: dict[str, tuple[list[float], list[float], bool]] = field(default_factory=dict)  # CUDA: GPU/host

    @property
    def numel(self) -> int:
        return sum(math.prod(shape) for shape in self.shapes)

    @property
    def label(self) -> str:
        return f"{self.model} {self.dtype} {self.magnitude}"

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPES[self.dtype].itemsize

    @property
    def title(self) -> str:
        return (
            f"{self.model}  {self.dtype}  {self.magnitude}  {len(self.shapes)} tensors, {self.numel / 1e6:.1f}M elements, "
            f"{self.nbytes / 1e6:.1f} MB, {self.copies} rotated cop{'y' if self.copies == 1 else 'ies'}"
        )

    def median(self, method: str) -> float:
        return statistics.median(self.times[method])

    @property
    def slow_probes(self) -> int:
        return sum(t * 1e3 > STALL_PROBE_MS for t in self.probe)

    @property
    def stalled(self) -> bool:
        return self.slow_probes > STALL_FRACTION * len(self.probe)

    @property
    def probe_summary(self) -> str:
        return (
            f"stall probe: median {statistics.median(self.probe) * 1e3:.3f} ms, {self.slow_probes} of "
            f"{len(self.probe)} calls over {STALL_PROBE_MS:g} ms" + (" STALLED" if self.stalled else "")
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "model": self.model,
            "dtype": self.dtype,
            "magnitude": self.magnitude,
            "tensors": len(self.shapes),
            "numel": self.numel,
            "bytes": self.nbytes,
            "copies": self.copies,
        }
        if self.skipped:
            return out | {"skipped": self.skipped}
        out["stall_probe_ms"] = [t * 1e3 for t in self.probe]
        out["stalled"] = self.stalled
        out["methods"] = {}
        for name, times in self.times.items():
            median = self.median(name)
            counterpart = self.counterparts[name]
            out["methods"][name] = {
                "median_ms": median * 1e3,
                "min_ms": min(times) * 1e3,
                "times_ms": [t * 1e3 for t in times],
                "gb_per_s": self.nbytes / median / 1e9,
                "ratio_vs_ceiling": median / self.median(CEILING),
                "scan_speedup": median / self.median(SCAN),
                "counterpart": counterpart,
                "counterpart_speedup": median / self.median(counterpart) if counterpart else None,
            }
            if name in self.split:
                gpu, host, overtaken = self.split[name]
                out["methods"][name] |= {
                    "gpu_ms": statistics.median(gpu) * 1e3,
                    "host_ms": statistics.median(host) * 1e3,
                    "host_us_per_tensor": statistics.median(host) * 1e6 / len(self.shapes),
                    "gpu_time_includes_idle": overtaken,
                }
        return out


def last_level_cache_bytes(device: torch.device) -> int:
    """L2 size on a GPU, L3 (or the largest cache sysfs lists) on the CPU; 32 MiB when unknown."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).L2_cache_size
    sizes = []
    for path in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*/size"):
        text = path.read_text().strip()
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * scale)
    return max(sizes, default=32 << 20)


def available_memory(device: torch.device) -> int:
    """Bytes that can still be allocated on ``device`` (MemAvailable on the CPU)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return sys.maxsize


def needed_memory(case: Case) -> int:
    """Gradients and flat buffer per copy, plus the largest per-tensor temporaries of the loop."""
    largest = max(math.prod(shape) for shape in case.shapes)
    return case.copies * 2 * case.nbytes + largest * (1 + DTYPES[case.dtype].itemsize)


def check_agreement(inputs: Inputs) -> None:
    """Refuses to time a scan whose answer is wrong: a fast wrong answer is no result.

    The reference is taken from the flat buffer in chunks (bounding the temporaries): NaN and Inf
    counts, and the fp64 norm of the finite values (torch's own fp32 norm is no reference: on
    llama-1b's 1.5e9 elements it is about 1% low).
    """
    stats = nanscan.scan(inputs.grads)
    nans = infs = 0
    sumsq = 0.0
    for chunk in inputs.flat.split(1 << 24):
        wide = chunk.double()
        nans += int(torch.isnan(wide).sum())
        infs += int(torch.isinf(wide).sum())
        sumsq += torch.linalg.vector_norm(wide.nan_to_num(0.0, 0.0, 0.0), dtype=torch.float64).item() ** 2
    got_nans, got_infs = int(stats.nan_count.sum()), int(stats.inf_count.sum())
    finite = stats.finite.item()
    if (got_nans, got_infs) != (nans, infs) or finite != (nans == infs == 0):
        raise RuntimeError(f"nanscan.scan: {got_nans} NaN, {got_infs} Inf (finite={finite}); reference {nans}, {infs}")
    if nans == infs == 0 and not math.isclose(stats.total_norm.item(), math.sqrt(sumsq), rel_tol=1e-6):
        raise RuntimeError(f"nanscan.scan: total norm {stats.total_norm.item()}, fp64 reference {math.sqrt(sumsq)}")


def run_case(case: Case, device: torch.device, args: argparse.Namespace, progress: str) -> None:
    """Builds the case's inputs, times every method on them, and frees them."""
    case.copies = max(1, math.ceil(ROTATE_CACHES * last_level_cache_bytes(device) / case.nbytes))
    need, have = needed_memory(case), available_memory(device)
    if need > MEMORY_FRACTION * have:
        case.skipped = f"needs {need / 1e9:.1f} GB, {have / 1e9:.1f} GB available"
        log(f"{progress} {case.label}: skipped ({case.skipped})")
        return
    size = f"{case.copies} x {len(case.shapes)} tensors ({case.nbytes / 1e6:.1f} MB)"
    log(f"{progress} {case.label}: building {size}")
    copies = [build_inputs(case.shapes, DTYPES[case.dtype], device, case.magnitude) for _ in range(case.copies)]
    check_agreement(copies[0])
    sync = synchronizer(device)
    if device.type == "cuda":
        torch.compiler.reset()  # a fresh compile cache per case: no recompile limit, no stale graphs
    try:
        found = selected(methods(device, DTYPES[case.dtype], len(case.shapes)), method_names(args.methods))
        case.times = time_methods(found, copies, args, sync)
        case.probe = case.times.pop(PROBE)
        case.counterparts = {method.name: method.counterpart for method in found}
        if device.type == "cuda":
            case.split = gpu_and_host_times(found, copies[0], args.repeats)
        for name in case.times:
            log(f"    median  {name:<24} {case.median(name) * 1e3:10.3f} ms")
    finally:
        del copies
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()


def load_zoo(path: Path) -> dict[str, list[list[int]]]:
    """The zoo's ``{model: [shape, ...]}``, with an error that says what is missing or malformed."""
    if not path.is_file():
        sys.exit(
            f"bench_scan: zoo file not found at {path}; pass --zoo PATH (the repository ships benchmarks/zoo.json)"
        )
    zoo = json.loads(path.read_text())
    if not isinstance(zoo, dict) or not all(
        isinstance(shapes, list) and all(isinstance(s, list) and all(isinstance(d, int) for d in s) for s in shapes)
        for shapes in zoo.values()
    ):
        sys.exit(f"bench_scan: {path} is not a JSON object of model name -> list of shapes (lists of ints)")
    return zoo


def select_cases(args: argparse.Namespace, zoo: dict[str, list[list[int]]]) -> list[Case]:
    """The (model, dtype, magnitude) cases to run, in zoo order with the synthetic cases last."""
    shapes = zoo | SYNTHETIC
    if args.models:
        names = [name.strip() for name in args.models.split(",") if name.strip()]
    elif args.quick:
        names = [min(zoo, key=lambda m: sum(math.prod(s) for s in zoo[m])), MANY_SMALL]
    else:
        names = list(shapes)
    unknown = [name for name in names if name not in shapes]
    if unknown:
        sys.exit(f"bench_scan: unknown model(s) {', '.join(unknown)}; known: {', '.join(shapes)}")
    dtypes = [d.strip() for d in args.dtype.split(",")] if args.dtype else ["float32"] if args.quick else None
    for dtype in dtypes or []:
        if dtype not in DTYPES:
            sys.exit(f"bench_scan: unknown dtype {dtype}; known: {', '.join(DTYPES)}")
    magnitudes = [m.strip() for m in args.magnitudes.split(",")] if args.magnitudes else None
    for magnitude in magnitudes or []:
        if magnitude not in MAGNITUDES:
            sys.exit(f"bench_scan: unknown magnitude {magnitude}; known: {', '.join(MAGNITUDES)}")
    return [
        Case(name, dtype, shapes[name], magnitude)
        for name in names
        for dtype in dtypes or (SYNTHETIC_DTYPES if name in SYNTHETIC else ZOO_DTYPES)
        for magnitude in magnitudes or (QUICK_MAGNITUDES if args.quick else DEFAULT_MAGNITUDES)
    ]


# ---------------------------------------------------------------------------------------- reports


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """A plain-text table: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(cell)) for cell in column) for column in zip(headers, *rows, strict=True)]
    lines = []
    for row in [headers, ["-" * w for w in widths], *rows]:
        cells = [f"{row[0]:<{widths[0]}}"] + [f"{cell:>{w}}" for cell, w in zip(row[1:], widths[1:], strict=True)]
        lines.append("  ".join(cells))
    return "\n".join(lines)


def ratio(x: float | None) -> str:
    return "" if x is None or math.isnan(x) else f"{x:.2f}x"


def case_table(case: Case) -> str:
    """Per method: median and fastest time, bandwidth of the median, and the median over the ceiling's,
    over the scan's and over its nanscan counterpart's."""
    if case.skipped:
        return f"skipped: {case.skipped}"
    rows = []
    for method, entry in case.to_json()["methods"].items():
        row = [
            method,
            f"{entry['median_ms']:.3f}",
            f"{entry['min_ms']:.3f}",
            f"{entry['gb_per_s']:.1f}",
            ratio(entry["ratio_vs_ceiling"]),
            ratio(entry["scan_speedup"]),
            ratio(entry["counterpart_speedup"]),
        ]
        if case.split:
            gpu = (
                f"{entry['gpu_ms']:.4f}" + ("*" if entry["gpu_time_includes_idle"] else "") if "gpu_ms" in entry else ""
            )
            host = f"{entry['host_ms']:.4f}" if "host_ms" in entry else ""
            per_tensor = f"{entry['host_us_per_tensor'] * 1e3:.0f}" if "host_ms" in entry else ""
            row += [gpu, host, per_tensor]
        rows.append(row)
    headers = ["method", "median ms", "min ms", "GB/s", "x ceiling", "scan speedup", "vs nanscan"]
    if case.split:
        headers += ["GPU ms", "host ms", "host ns/tensor"]
    notes = (
        "\n(GPU/host: medians with the GPU held busy while the host enqueues; * the GPU caught up)"
        if case.split
        else ""
    )
    return format_table(headers, rows) + "\n" + case.probe_summary + notes


def median_or_nan(case: Case, method: str) -> float:
    """The case's median time of ``method``, NaN where ``--methods`` left it out."""
    return case.median(method) if method in case.times else math.nan


def summary_table(cases: Sequence[Case]) -> str:
    """One row per case: the scan against the ceiling, the loop and foreach; nanscan's clip against torch's."""
    rows = []
    for case in cases:
        if case.skipped:
            rows.append([case.label, "skipped", "", "", "", "", "", ""])
            continue
        m = functools.partial(median_or_nan, case)
        rows.append(
            [
                case.label,
                ratio(m(SCAN) / m(CEILING)),
                ratio(m("per_param_loop") / m(SCAN)),
                ratio(m("foreach_norm+stack") / m(SCAN)),
                ratio(m("torch.clip(no-clip)") / m("nanscan.clip(no-clip)")),
                ratio(m("torch.clip(clip)") / m("nanscan.clip(clip)")),
                f"{case.slow_probes}/{len(case.probe)}",
                "STALLED" if case.stalled else "",
            ]
        )
        if any(c.split for c in cases):
            scan = case.to_json()["methods"][SCAN]
            rows[-1] += (
                [f"{scan['gpu_ms'] * 1e3:.1f}", f"{scan['host_us_per_tensor'] * 1e3:.0f}"]
                if "gpu_ms" in scan
                else ["", ""]
            )
    headers = ["case", "scan/ceiling", "loop/scan", "foreach/scan", "torch/nanscan no-clip", "torch/nanscan clip"]
    headers += [f"probe >{STALL_PROBE_MS:g}ms", "stalled"]
    if any(c.split for c in cases):
        headers += ["scan GPU us", "scan host ns/tensor"]
    return format_table(headers, rows)


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine(device: torch.device) -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "nanscan": nanscan.__version__,
        "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "last_level_cache_bytes": last_level_cache_bytes(device),
        "loadavg_at_start": os.getloadavg()[0],  # other work on the machine skews every number
    }


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick", action="store_true", help="smoke test: smallest zoo model + many_small, float32, few repeats"
    )
    parser.add_argument("--json", type=Path, help="write every number and the machine description here")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument(
        "--dtype",
        help=f"comma-separated, of {', '.join(DTYPES)} (default: {','.join(ZOO_DTYPES)} for the zoo, "
        f"{','.join(SYNTHETIC_DTYPES)} for {MANY_SMALL}; --quick: float32)",
    )
    parser.add_argument("--models", help=f"comma-separated zoo names and/or {', '.join(SYNTHETIC)} (default: all)")
    parser.add_argument(
        "--magnitudes",
        help=f"comma-separated, of {', '.join(MAGNITUDES)} (default: {','.join(DEFAULT_MAGNITUDES)}; "
        f"--quick: {','.join(QUICK_MAGNITUDES)})",
    )
    parser.add_argument("--zoo", type=Path, default=DEFAULT_ZOO, help=f"parameter shapes (default: {DEFAULT_ZOO})")
    parser.add_argument(
        "--methods", help="comma-separated method names to time (default: all; the ceiling and the scan always)"
    )
    parser.add_argument("--threads", type=int, help="torch.set_num_threads before timing (default: torch's own choice)")
    parser.add_argument("--warmup", type=int, help="untimed calls per method (default 2, quick 1)")
    parser.add_argument("--repeats", type=int, help="least timed calls per method (default 9, quick 3)")
    parser.add_argument("--max-repeats", type=int, help="most timed calls per method (default 50, quick 10)")
    parser.add_argument(
        "--min-time", type=float, help="seconds of timed calls to aim for per method (default 1.0, quick 0.05)"
    )
    args = parser.parse_args(argv)
    defaults = {"warmup": (2, 1), "repeats": (9, 3), "max_repeats": (50, 10), "min_time": (1.0, 0.05)}
    for name, (full, quick) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_scan: --device cuda, but torch sees no CUDA device")
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    cases = select_cases(args, load_zoo(args.zoo))
    check_method_names(method_names(args.methods), device, cases)
    info = machine(device)
    print(
        f"nanscan {info['nanscan']}, torch {info['torch']}, {info['device']}, {info['cpu']}, "
        f"{info['threads']} threads, load {info['loadavg_at_start']:.2f}, {info['date']}"
    )
    for i, case in enumerate(cases, 1):
        run_case(case, device, args, f"[{i}/{len(cases)}]")
        print(f"\n== {case.title}\n{case_table(case)}", flush=True)
    print(
        "\n== summary: ratios of median times (scan/ceiling: 1x is one read of the bytes; the others: above 1x, "
        f"nanscan is faster)\n{summary_table(cases)}"
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        report = {"machine": info, "config": config, "cases": [case.to_json() for case in cases]}
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
