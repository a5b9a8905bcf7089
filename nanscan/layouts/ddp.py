"""DDP: which rank made a NaN, seen before the all-reduce spreads it to every rank.

After DistributedDataParallel's all-reduce, a NaN from one rank's gradient is in every rank's
gradient, and nothing says where it came from. ``attach(ddp_model)`` registers a DDP comm hook that
scans each bucket's flat local buffer before it is reduced (the per-parameter views into it, in the
one fused pass), keeps a flag per parameter on the device, and then hands the bucket to the hook
that reduces it (torch's default all-reduce, or the fp16/bf16 compression hooks, or your own).

``nanscan.check(ddp_model)`` (or ``nanscan.check(ddp_model.module)``: the module inside an attached
DDP model, which Lightning's callback holds, is checked as the model) then scans the reduced
gradients as usual (they are the same on every rank, so their statistics need no collective) and
reduces the flags in one small SUM all-reduce (eight rows per parameter and two per rank, made into
nanscan.fused.Attribution), so that ``Report.nonfinite_ranks`` names the rank(s) whose own gradients
held each NaN/Inf. That is the one collective a check adds per step; nothing syncs with the host.

Where no rank can be named, none is (an empty list: "rank unknown"), never a wrong one. The flags
are a state per parameter (BucketScanner), because a bucket does not always hold only this rank's
gradient: after a synced pass, a further synced pass without ``zero_grad()`` (gradient accumulation
without ``no_sync()``) scans buffers that hold the first pass's all-reduced sum, another rank's NaN
included. A parameter found non-finite then for the first time is UNKNOWN on that rank, unless some
rank found it finite in the same pass (no all-reduced NaN was there). A check after a backward pass
the hook did not see (inside ``no_sync()``) names no rank: the flags are of another step.

Costs: one more read of the gradients per step (the hook's scan, before each bucket's all-reduce is
launched); host work per bucket per step is O(1) Python (a bucket's views are made once, and again
only when DDP rebuilds its buckets, after the first iteration).

    model = DDP(net)
    nanscan.ddp.attach(model)                       # or attach(model, hook=fp16_compress_hook)
    ...
    loss.backward()
    report = nanscan.check(model)
    if not report.finite:
        print(report.nonfinite_ranks)                # {'fc.weight': [3]}
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .._ops import scan_op
from ..fused import ScanResult, upload
from . import live
from .collectives import all_reduce
from .reduce import Attribution

GradBucket = Any  # torch.distributed.GradBucket, which torch does not expose to type checkers
Hook = Callable[[Any, GradBucket], torch.futures.Future[torch.Tensor]]


# What a rank knows of each parameter's gradient, from its bucket scans (BucketScanner._state): int8.
FRESH = 0  # no synced pass since the gradient (re)started: the next scan says exactly whose it is
CLEAN = 1  # the latest scan found it finite
MADE = 2  # this rank's own gradient held a NaN/Inf before any all-reduced one did: this rank made it
UNKNOWN = 3  # found non-finite after an earlier synced pass: maybe the all-reduced NaN of another rank
# What an UNKNOWN adds to the count row (Attribution.UNKNOWN): read back as "rank unknown", never as a rank.
_UNKNOWN_WEIGHT = float(Attribution.UNKNOWN)


@dataclass
class _Bucket:
    """What a bucket's scan needs, made once per bucket layout."""

    key: tuple[int, int, int]  # (data pointer, size, dtype id) of the flat buffer it was made for
    views: list[torch.Tensor]  # one view of the flat buffer per parameter
    positions: torch.Tensor  # int64, on the buffer's device: each view's parameter in the scanner's state
    first: torch.nn.Parameter  # its first parameter: a gradient of None there means the gradients restarted


class BucketScanner:
    """The comm hook ``attach`` registers, and what it knows of each parameter (see the module notes).

    Per parameter, a state on the device (``FRESH``, ``CLEAN``, ``MADE``, ``UNKNOWN``), updated by each
    synced pass's bucket scans. A bucket scanned after an earlier synced pass, with the gradients not
    restarted since, holds that pass's all-reduced values: a NaN another rank made there is in every
    rank's buffer, so a parameter found non-finite then for the first time is ``UNKNOWN``, never
    this rank's. A check reads the states (``attribution``) only when the last backward pass was a
    synced one the hook saw; after one it did not see (inside ``no_sync()``, or a forward with grad
    whose backward has not run), no rank is named.
    """

    def __init__(self, hook: Hook | None, state: Any) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

        # No reference to the DDP model: DDP's reducer (C++) holds this hook, and a reference back
        # would make a cycle through C++ that Python's collector cannot see, keeping every attached
        # model (and the module inside, and nanscan's registry entry) alive for good.
        self.hook: Hook = hook if hook is not None else allreduce_hook
        self.state = state
        self._buckets: dict[int, _Bucket] = {}
        self._index: dict[int, int] = {}  # id of each parameter a bucket held -> its place in _state
        self._state: torch.Tensor | None = None  # int8 [parameters], on the buckets' device
        self._step_complete = True
        # Grad-enabled forwards of the model, and the one whose backward the hook saw last (a synced
        # pass): equal when the gradients a check reads are the ones the hook scanned.
        self._forwards = 0
        self._scanned_forward = -1
        # DDP inspects a hook's name and signature; this module's annotations are strings (postponed),
        # which DDP would take for wrong ones: present a plain (state, bucket) signature.
        self.__name__ = self.__qualname__ = "nanscan_bucket_scan_hook"
        self.__signature__ = inspect.Signature(
            [inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD) for name in ("state", "bucket")]
        )
        # For the parameter list check scans (by ids): their places in _state, on the device (-1: none).
        self._positions: tuple[tuple[int, ...], torch.Tensor] | None = None

    def before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """DDP's forward pre-hook: counts the forwards whose backward makes gradients, and sees where
        the gradients restarted (``zero_grad()`` sets them to None): every parameter FRESH again."""
        if not torch.is_grad_enabled():
            return
        self._forwards += 1
        if self._state is not None and self._buckets and all(b.first.grad is None for b in self._buckets.values()):
            self._state.fill_(FRESH)

    def __call__(self, state: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        if self._step_complete:  # the first bucket of a new synced backward pass
            self._step_complete = False
            self._scanned_forward = self._forwards
        entry = self._bucket(bucket)
        if entry.views:
            with torch.no_grad():
                counts = scan_op(entry.views)[0]
            self._update(entry.positions, (counts[0] + counts[1]) > 0)
        if bucket.is_last():
            self._step_complete = True
        return self.hook(self.state, bucket)

    def _update(self, positions: torch.Tensor, bad: torch.Tensor) -> None:
        """A scan's news for its parameters: non-finite after FRESH is this rank's own (MADE), and MADE
        stays MADE; non-finite after any other pass may be an all-reduced NaN (UNKNOWN); finite is
        CLEAN. On the device, no sync."""
        state = self._state
        assert state is not None
        old = state.index_select(0, positions)
        own = (old == FRESH) | (old == MADE)
        new = torch.where(bad, torch.where(own, MADE, UNKNOWN), CLEAN).to(torch.int8)
        state.index_copy_(0, positions, new)

    def _bucket(self, bucket: GradBucket) -> _Bucket:
        buffer = bucket.buffer()
        key = (buffer.data_ptr(), buffer.numel(), id(buffer.dtype))
        entry = self._buckets.get(bucket.index())
        if entry is None or entry.key != key:  # first use, or DDP rebuilt its buckets
            params = list(bucket.parameters())
            places = [self._index.setdefault(id(p), len(self._index)) for p in params]
            if self._state is None or self._state.numel() < len(self._index):
                grown = torch.full((len(self._index),), FRESH, dtype=torch.int8, device=buffer.device)
                if self._state is not None:
                    grown[: self._state.numel()] = self._state
                self._state = grown
            entry = _Bucket(key, list(bucket.gradients()), upload(places, torch.int64, buffer.device), params[0])
            self._buckets[bucket.index()] = entry
            self._positions = None  # the parameters' places in check's list are to be found again
        return entry

    def attribution(self, ids: tuple[int, ...], device: torch.device) -> Attribution:
        """Which ranks' own (unreduced) gradients held a NaN/Inf, per parameter (``ids``: the ``id`` of
        each one ``check`` scanned), reduced over DDP's process group in one SUM all-reduce.

        Each rank sends, per parameter, the rows of its MADE flag and of its UNKNOWN flag (1, its rank,
        its rank squared), a CLEAN flag, and a BLIND flag where it knows nothing (the gradients come
        from a backward pass the hook did not see, or a parameter it holds no state for). A rank whose
        latest scan found a parameter finite proves that no all-reduced NaN/Inf was in the buffers of
        that pass, so every rank that found it non-finite then made it: UNKNOWN counts as MADE where
        any rank is CLEAN. What stays unknown adds Attribution.UNKNOWN to the count, and no rank."""
        n, rank, world = len(ids), dist.get_rank(self.state), dist.get_world_size(self.state)
        state = self._state
        if state is None or self._scanned_forward != self._forwards:
            # No synced pass, or a backward since it that the hook did not see: nothing known.
            found = torch.full((n,), -1, dtype=torch.int8, device=device)
        else:
            if self._positions is None or self._positions[0] != ids:
                places = [self._index.get(pid, -1) for pid in ids]
                self._positions = (ids, upload(places, torch.int64, state.device))
            where = self._positions[1]
            found = torch.where(where >= 0, state.index_select(0, where.clamp(min=0)), -1).to(device, torch.int8)
        made, unknown = (found == MADE).double(), (found == UNKNOWN).double()
        clean, blind = (found == CLEAN).double(), (found < 0).double()
        by_rank = torch.zeros((2, world), dtype=torch.float64, device=device)
        if n:
            by_rank[0, rank], by_rank[1, rank] = made.amax(), unknown.amax()
        r = float(rank)
        rows = torch.cat(
            [made, made * r, made * r * r, unknown, unknown * r, unknown * r * r, clean, blind, by_rank[0], by_rank[1]]
        )
        all_reduce(rows, dist.ReduceOp.SUM, self.state)
        m, m_sum, m_square, u, u_sum, u_square, c, b = rows[: 8 * n].view(8, n)
        own = c > 0
        count = m + torch.where(own, u, u * _UNKNOWN_WEIGHT) + b * _UNKNOWN_WEIGHT
        rank_sum = m_sum + torch.where(own, u_sum, 0.0)
        rank_square_sum = m_square + torch.where(own, u_square, 0.0)
        any_by_rank = (rows[8 * n : 8 * n + world] + rows[8 * n + world :]).clamp(max=1.0)
        return Attribution(count, rank_sum, rank_square_sum, any_by_rank)

    def checked(self, ids: tuple[int, ...], stats: ScanResult) -> None:
        """After a check of the reduced gradients (of the parameters ``ids`` names): each parameter whose
        reduced gradient is finite is FRESH again (any NaN a later pass adds to it is a rank's own); the
        others keep their state."""
        state, positions = self._state, self._positions
        if state is None or positions is None or positions[0] != ids or not ids:
            return
        where = positions[1]
        finite = ((stats.nan_count + stats.inf_count) == 0).to(state.device) & (where >= 0)
        hits = torch.zeros(state.numel(), dtype=torch.int32, device=state.device)
        hits.index_add_(0, where.clamp(min=0), finite.to(torch.int32))
        state.masked_fill_(hits > 0, FRESH)


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
    scanner = BucketScanner(hook, state)
    ddp_model.register_comm_hook(state, scanner)
    ddp_model.register_forward_pre_hook(scanner.before_forward)
    ddp_model._nanscan_scanner = scanner  # type: ignore[assignment]
    _wrappers[ddp_model.module] = weakref.ref(ddp_model)
    live.note(ddp_model)
    return scanner


def scanner_of(model: object) -> BucketScanner | None:
    """The scanner ``attach`` left on a DDP model, if any."""
    scanner = getattr(model, "_nanscan_scanner", None)
    return scanner if isinstance(scanner, BucketScanner) else None


# The module inside each attached DDP model -> that model: a check of the module (what Lightning's
# callback holds) is a check of the DDP model, its no_sync() refusal included.
_wrappers: weakref.WeakKeyDictionary[torch.nn.Module, weakref.ref[torch.nn.parallel.DistributedDataParallel]] = (
    weakref.WeakKeyDictionary()
)


def wrapper_of(module: torch.nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The DDP model whose ``.module`` is ``module``, while it lives: an attached one, or, with several
    ranks, any this process made (nanscan.layouts.live)."""
    ref = _wrappers.get(module)
    wrapper = None if ref is None else ref()
    if wrapper is not None and wrapper.module is module:
        return wrapper
    if not _several_ranks():
        return None
    return next((model for model in live.ddp_models() if model.module is module), None)


# The ids of each DDP model's parameters, made once per model (a model's parameters do not change).
_parameter_ids: weakref.WeakKeyDictionary[torch.nn.parallel.DistributedDataParallel, frozenset[int]] = (
    weakref.WeakKeyDictionary()
)


def _several_ranks() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def unsynced_model_of(items: Sequence[Any]) -> tuple[torch.nn.parallel.DistributedDataParallel, str] | None:
    """The DDP model whose gradients are not yet synchronised (``unsynced``: inside ``no_sync()``,
    or after a forward inside it) that holds one of ``items`` (its parameters, ``(name, parameter)``
    pairs, or its gradients), with ``unsynced``'s reason, if any, in a world of several ranks: its
    gradients are each rank's own, so a check must refuse them. The models are every one this process
    made (nanscan.layouts.live); only those not synchronised cost more than a flag's read."""
    if not items or not _several_ranks():
        return None
    for model in live.ddp_models():
        why = unsynced(model)
        if why is None:
            continue
        ids = _parameter_ids.get(model)
        if ids is None:
            ids = _parameter_ids[model] = frozenset(map(id, model.parameters()))
        # Gradients are new tensors from step to step: their ids are taken at each check.
        ids = ids.union(id(p.grad) for p in model.parameters() if p.grad is not None)
        if not ids.isdisjoint(id(p[1] if type(p) is tuple else p) for p in items):
            return model, why
    return None


def unsynced(model: torch.nn.parallel.DistributedDataParallel) -> str | None:
    """Why ``model``'s gradients are each rank's own, or None when they are the model's (as far as
    nanscan can tell): ``"inside"`` no_sync() now, or ``"after"`` its last forward with grad enabled
    ran inside it and no forward outside it has run since (nanscan.layouts.live, module notes), in a
    world of several ranks (with one, that rank's gradients are the model's)."""
    if not model.require_backward_grad_sync:
        return "inside"
    if live.last_forward_unsynced(model) and _several_ranks():
        return "after"
    return None


def no_sync_error(what: str, why: str = "inside") -> ValueError:
    """The refusal of the gradients of a DDP model inside ``no_sync()`` (``why`` "inside") or
    accumulated inside it and not yet synchronised ("after", ``unsynced``); ``what`` names them."""
    if why == "after":
        return ValueError(
            f"nanscan: {what} past no_sync() with gradients not yet synchronised: its last forward ran inside "
            "no_sync() (gradient accumulation), so the backward after it left each rank its own gradients, and "
            "no forward outside no_sync() has run since. Their statistics would be one rank's, not the model's. "
            "Check them after the last micro-batch's forward and backward, both outside no_sync()"
        )
    return ValueError(
        f"nanscan: {what} inside no_sync() (gradient accumulation): its gradients are each rank's own "
        "until the backward that synchronises them, so their statistics would be one rank's, not the "
        "model's. Check them after the last micro-batch's backward, outside no_sync()"
    )


def with_attribution(stats: ScanResult, scanner: BucketScanner, params: list[torch.nn.Parameter]) -> ScanResult:
    """``stats`` of the reduced gradients, with the ranks whose own gradients held each NaN/Inf."""
    ids = tuple(map(id, params))  # once per check, for both
    result = dataclasses.replace(stats, ranks=scanner.attribution(ids, stats.norm.device))
    scanner.checked(ids, stats)
    return result
