"""DDP: which rank made a NaN, seen before the all-reduce spreads it to every rank.

After DistributedDataParallel's all-reduce, a NaN from one rank's gradient is in every rank's
gradient, and nothing says where it came from. ``attach(ddp_model)`` registers a DDP comm hook that
scans each bucket's flat local buffer before it is reduced (the per-parameter views into it, in the
one fused pass), keeps a flag per parameter on the device, and then hands the bucket to the hook
that reduces it (torch's default all-reduce, or the fp16/bf16 compression hooks, or your own).

``nanscan.check(ddp_model)`` then scans the reduced gradients as usual (they are the same on every
rank, so their statistics need no collective) and reduces the flags in one small SUM all-reduce
(three rows per parameter and one per rank: nanscan.distributed.Attribution), so that
``Report.nonfinite_ranks`` names the rank(s) whose own gradients held each NaN/Inf. That is the one
collective a check adds per step; nothing syncs with the host.

Costs: one more read of the gradients per step (the hook's scan, before each bucket's all-reduce is
launched); host work per bucket per step is O(1) Python (a bucket's views are made once, and again
only when DDP rebuilds its buckets, after the first iteration).

    model = DDP(net)
    nanscan.ddp.attach(model)                       # or attach(model, hook=fp16_compress_hook)
    ...
    loss.backward()
    report = nanscan.check(model)
    if not report.finite:
        print(report.nonfinite_ranks)                # {'module.fc.weight': [3]}
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._ops import scan_op
from ..fused import ScanResult, upload
from .collectives import all_reduce
from .reduce import Attribution

GradBucket = Any  # torch.distributed.GradBucket, which torch does not expose to type checkers
Hook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


@dataclass
class _Bucket:
    """What a bucket's scan needs, made once per bucket layout."""

    key: tuple[int, int, int]  # (data pointer, size, dtype id) of the flat buffer it was made for
    views: list[torch.Tensor]  # one view of the flat buffer per parameter
    params: list[int]  # ids of the bucket's parameters, in the views' order


class BucketScanner:
    """The comm hook ``attach`` registers, and the flags it keeps (see the module notes)."""

    def __init__(self, module: torch.nn.Module, hook: Hook | None, state: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        self.module = module
        self.hook: Hook = hook if hook is not None else allreduce_hook
        self.state = state
        self._buckets: dict[int, _Bucket] = {}
        self._flags: dict[int, torch.Tensor] = {}  # per bucket index: bool [params], local NaN/Inf
        self._step_complete = True
        # DDP inspects a hook's name and signature; this module's annotations are strings (postponed),
        # which DDP would take for wrong ones: present a plain (state, bucket) signature.
        self.__name__ = self.__qualname__ = "nanscan_bucket_scan_hook"
        self.__signature__ = inspect.Signature(
            [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ("state", "bucket")]
        )
        # For the parameter list check scans (by ids): each bucket's positions in it, on the device.
        self._positions: tuple[tuple[int, ...], dict[int, torch.Tensor | None]] | None = None

    def __call__(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self._step_complete:  # the first bucket of a new backward pass: forget the last one's flags
            self._flags.clear()
            self._step_complete = False
        entry = self._bucket(bucket)
        if entry.views:
            with torch.no_grad():
                counts = scan_op(entry.views)[0]
            self._flags[bucket.index()] = (counts[0] + counts[1]) > 0
        if bucket.is_last():
            self._step_complete = True
        return self.hook(self.state, bucket)

    def _bucket(self, bucket: GradBucket) -> _Bucket:
        buffer = bucket.buffer()
        key = (buffer.data_ptr(), buffer.numel(), id(buffer.dtype))
        entry = self._buckets.get(bucket.index())
        if entry is None or entry.key != key:  # first use, or DDP rebuilt its buckets
            entry = _Bucket(key, list(bucket.gradients()), [id(p) for p in bucket.parameters()])
            self._buckets[bucket.index()] = entry
            self._positions = None  # the buckets' places in check's list are to be found again
        return entry

    def attribution(self, params: list[torch.nn.Parameter], device: torch.device) -> Attribution:
        """Which ranks' own (unreduced) gradients held a NaN/Inf, per parameter of ``params`` (the
        ones ``check`` scanned), reduced over DDP's process group in one SUM all-reduce."""
        ids = tuple(id(p) for p in params)
        if self._positions is None or self._positions[0] != ids:
            self._positions = (ids, {})
        places = self._positions[1]
        n, rank, world = len(params), dist.get_rank(self.state), dist.get_world_size(self.state)
        bad = torch.zeros(n, dtype=torch.float64, device=device)
        for index, flags in self._flags.items():
            if index not in places:
                position = {pid: i for i, pid in enumerate(ids)}
                found = [position.get(pid) for pid in self._buckets[index].params]
                # A bucket with a parameter check did not scan (no gradient now) is left out.
                places[index] = None if None in found else upload(found, torch.int64, device)
            where = places[index]
            if where is not None:
                bad.index_copy_(0, where, flags.to(device, torch.float64))
        any_by_rank = torch.zeros(world, dtype=torch.float64, device=device)
        any_by_rank[rank] = bad.amax() if n else 0.0
        rows = torch.cat([bad, bad * rank, bad * (rank * rank), any_by_rank])
        all_reduce(rows, dist.ReduceOp.SUM, self.state)
        return Attribution(rows[:n], rows[n : 2 * n], rows[2 * n : 3 * n], rows[3 * n :].clamp(max=1.0))


def attach(ddp_model: torch.nn.Module, hook: Hook | None = None, state: Any = None) -> BucketScanner:
    """Registers nanscan's bucket scan as ``ddp_model``'s comm hook, in front of ``hook``.

    Args:
        ddp_model: a ``DistributedDataParallel`` model, before its first forward (DDP takes one comm
            hook, registered before training starts).
        hook: the hook that reduces each bucket after the scan: torch's ``allreduce_hook`` by
            default; e.g. ``fp16_compress_hook`` or ``bf16_compress_hook`` from
            ``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``, or your own.
        state: ``hook``'s state; by default DDP's process group, which the default hooks take.

    Returns:
        The scanner, also kept on the model, where ``nanscan.check(ddp_model)`` finds it.
    """
    if not isinstance(ddp_model, torch.nn.parallel.DistributedDataParallel):
        raise TypeError(f"nanscan.ddp.attach: expected a DistributedDataParallel model, got {type(ddp_model).__name__}")
    if state is None:
        state = ddp_model.process_group
    scanner = BucketScanner(ddp_model, hook, state)
    ddp_model.register_comm_hook(state, scanner)
    ddp_model._nanscan_scanner = scanner  # type: ignore[assignment]
    return scanner


def scanner_of(model: object) -> BucketScanner | None:
    """The scanner ``attach`` left on a DDP model, if any."""
    scanner = getattr(model, "_nanscan_scanner", None)
    return scanner if isinstance(scanner, BucketScanner) else None


def with_attribution(stats: ScanResult, scanner: BucketScanner, params: list[torch.nn.Parameter]) -> ScanResult:
    """``stats`` of the reduced gradients, with the ranks whose own gradients held each NaN/Inf."""
    return dataclasses.replace(stats, ranks=scanner.attribution(params, stats.norm.device))
