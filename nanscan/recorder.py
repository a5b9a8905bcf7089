"""``nanscan.Recorder``: every step's gradient health kept on the device, read once per N steps.

``check`` already computes each parameter's NaN and Inf counts, min, max and norm every step. A
recorder keeps them: each recorded check (``check(..., recorder=r)``) or GradScaler unscale
(``scaler.record(r)``) appends one row to a ring buffer on the gradients' device, with a
device-side step counter, so the append is a few small kernels: no host sync, and replayable inside
a captured CUDA graph. Every ``every`` records, and at ``flush()``/``close()`` (at interpreter exit
and on leaving a ``with`` block by an exception too), the whole buffer goes to the host in one copy
(asynchronous on a GPU: a pinned buffer and an event, read at a later append once it has landed)
and each new record goes to the sinks (nanscan.sinks) as a ``StepRecord`` (nanscan.records).

A record is one float32 row: per parameter the NaN count, Inf count, min, max, norm and the running
median its spike ratio is taken against (counts above 2^24 are rounded), then the step's total norm,
finite flag, clip coefficient, max_norm, whether the step was skipped and the loss scale (float32:
seven digits, plenty for a history). A report with a rank attribution (DTensors, ``process_group``,
DDP with ``nanscan.ddp.attach``: ``Report.nonfinite_ranks``) adds a float64 row per record: per
parameter the count, sum and sum of squares of the ranks whose local data held a NaN/Inf, then the
per-rank flags (``world`` values): exact (integers below 2^53), so the records name the ranks
``Report.nonfinite_ranks`` names, where float32 would round the sums of squares of a large world.
Memory: ``capacity * (24 * parameters + 24) + 8`` bytes on the device (``Recorder.nbytes``;
GPT-2-small's 148 parameters at capacity 100: 358 KB), plus ``capacity * 8 * (3 * parameters +
world)`` with a rank attribution (GPT-2-small on 64 ranks, capacity 100: 406 KB more), plus
``capacity * 16 * modules`` with an activation watch (``activations=``: per watched module the
amax and the NaN, Inf and overflow counts of the forwards sampled since the record before, NaN
when none was; GPT-2-small's ~160 modules at capacity 100: 256 KB), plus ``capacity * (8 *
parameters + 4)`` with an update watch (``updates=``: per parameter the optimizer holds, ‖Δw‖ and ‖w‖
of the last step measured since the record before; GPT-2-small at capacity 100: 119 KB), the same
again in pinned host memory on a GPU, and the last ``history`` records on the host.

The append is device-only and one op, ``nanscan::record_`` (nanscan._ops): the record's statistics
go, cast to each row's dtype, into the ring at the slot of the device counter, which it advances;
on the CPU one C++ kernel, on a GPU the few ATen kernels of its composite (a copy into staging rows,
one ``index_copy_`` per row, the counter's ``add_``). The read turns a block of records into ``StepRecord``
objects whose per-step values are Python values and whose per-parameter lists are made on first
reading (most sinks read a few totals; 6 x N Python numbers per record were most of a read's cost).

Spikes: the median of each parameter's norms in the ``spike_window`` records before (slots with no
record ignored; refreshed every ``spike_window // 4`` records, and at every replay of a captured
graph) is computed on the device and stored beside the norm; the read divides the two, for a whole
block at once, into the spike ratio, and a ratio at or above ``spike_factor`` is a spike, warned
about when its records are read, often steps before a NaN arrives. The first non-finite step is kept
(``first_nonfinite``): which parameters went bad, on which ranks, and their norms over the
``history`` records before it.

Append and flush on one CUDA stream (the copy is a snapshot in that stream's order). A change of
parameter list (a parameter that gains or loses its gradient, one scaler recording two optimizers,
reports that gain or lose a rank attribution) reads the old buffer out (a sync) and starts a new
one with no spike history: record one list.

Under CUDA graph capture the append is captured like any other kernel; replays advance the device
counter without Python, so the recorder cannot count them: call ``flush()`` at least every
``capacity`` replays (a record overwritten before it was read is counted in ``lost`` and warned
about, never silently dropped).

How the records survive the end of a job. Records reach the sinks at a read: every ``every``
records, at ``flush()`` and ``close()``, at interpreter exit, on leaving a ``with`` block by an
exception (Ctrl-C's KeyboardInterrupt included), and on SIGTERM, the signal a scheduler's time limit
or preemption, Kubernetes and torchrun send. While a recorder is open, nanscan's SIGTERM handler
(installed from the main thread only, where Python runs signal handlers) reads out every open
recorder of the process once, then does what the handler it replaced would have done: calls it (a
user's, Lightning's), or, where that was the default, terminates the process by the same signal, so
the exit status is unchanged. A SIGTERM that was ignored stays ignored (nothing is installed), as
does one whose handler was installed outside Python (which Python could not call back). A SIGTERM
that lands in the middle of a recorder's own append or read is acted on as soon as that returns.
Closing the last open recorder puts the previous handler back. Forked processes (DataLoader
workers) inherit the handler but read out nothing: their copies of the buffers are not theirs.

What no handler can save: on SIGKILL (a scheduler's kill after its grace period, the OOM killer),
an abort (NCCL's watchdog ends the process from C++, where no Python runs) or a CUDA error that
poisons the context (the copy off the device fails), the records since the last read are lost: at
most ``capacity``, usually ``every``. ``flush_on_nonfinite`` (on by default) narrows that for the
step that matters: a step whose gradients held a NaN or an Inf has the buffer read out, so the
first bad step and the history before it are on disk at once on the CPU (at that step's append),
and on a GPU as soon as the process lives a few more steps (the host learns of the step through
an asynchronous copy of a count, and the read is asynchronous: no sync). A line cut by a kill is
dropped with a warning when the file is read (``nanscan.records.iter_jsonl``) or appended to
(nanscan.sinks).
"""

from __future__ import annotations

import atexit
import functools
import math
import os
import signal
import struct
import sys
import threading
import warnings
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from types import FrameType, TracebackType
from typing import Any, TypeVar, cast

import numpy as np
import torch
import torch.distributed as dist

from ._ops import RECORD_SOURCE_DTYPES, record_op
from .activations import ActivationWatch
from .layouts.reduce import Attribution
from .records import ActivationRecord, StepRecord, UpdateRecord, spike_mask
from .report import Report
from .sinks import Sink, note_rank
from .updates import UpdateWatch

# A record's per-parameter rows, then its per-step columns, in its float32 row of the ring buffer.
# The running median is stored, not the spike ratio: the ratio is one division per block at the read
# (norm / median, as the device would have computed it), not one more op per append.
_PARAM_ROWS = ("nan_count", "inf_count", "min", "max", "norm", "median")
_NORM_ROW = _PARAM_ROWS.index("norm")
_MEDIAN_ROW = _PARAM_ROWS.index("median")
_STEP_COLUMNS = ("total_norm", "finite", "clip_coef", "max_norm", "skipped", "loss_scale")
# Per watched module, after the step columns of a recorder with an activation watch: the figures of
# the forwards sampled since the record before (NaN when none was).
_ACTIVATION_ROWS = ("amax", "nan_count", "inf_count", "overflow")
# With an update watch, after those: the optimizer steps the watch measured since the record before
# (NaN when none), then per watched parameter ‖Δw‖ and ‖w‖ of the last of them.
_UPDATE_ROWS = ("update_norm", "weight_norm")
# Per parameter, in the float64 attribution row: nanscan.layouts.reduce.Attribution's rows, then its
# per-rank row (``world`` values).
_ATTRIBUTION_ROWS = ("count", "rank_sum", "rank_square_sum")


_Method = TypeVar("_Method", bound=Callable[..., Any])


def _guarded(method: _Method) -> _Method:
    """Marks a Recorder method during which a SIGTERM handler must not read the recorder out: the
    call holds the recorder's lock and marks it busy in this thread, and a SIGTERM that landed
    meanwhile (its handler runs between two bytecodes, perhaps this method's) is acted on when the
    outermost such call returns (``_SigtermReadOut``)."""

    @functools.wraps(method)
    def guarded(self: Recorder, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            outermost = self._busy_in is None
            if outermost:
                self._busy_in = threading.get_ident()
            try:
                return method(self, *args, **kwargs)
            finally:
                if outermost:
                    self._busy_in = None
                    if _sigterm.deferred is not None:
                        _sigterm.read_out_and_chain(*_sigterm.deferred)

    return cast(_Method, guarded)


@dataclass(frozen=True)
class FirstNonfinite:
    """The first recorded step whose gradients held a NaN or an Inf.

    Attributes:
        step: its record index.
        parameters: the parameters that went bad.
        norm_history: per such parameter, its norms over the recorded steps before (oldest first,
            up to the recorder's ``history``), so a climb to overflow shows.
        total_norm_history: the total norms over the same steps.
        steps: the record indices of those steps.
        ranks: per such parameter, the ranks whose local data held its NaN/Inf
            (``StepRecord.nonfinite_ranks``).
        subject: ``"gradients"``, or ``"state"`` for a recorder of ``check_state`` reports.
        attributed: whether ``ranks`` come from a rank attribution (DTensors, ``process_group``, DDP
            with ``nanscan.ddp.attach``); otherwise they are the recording process's own rank (0 in a
            single process), which ``summary()`` and ``str()`` leave out.
    """

    step: int
    parameters: list[str]
    norm_history: dict[str, list[float]]
    total_norm_history: list[float]
    steps: list[int]
    ranks: dict[str, list[int]]
    subject: str = "gradients"
    attributed: bool = True

    def summary(self) -> str:
        """Up to three of the parameters, each with its ranks where the step's report carried a rank
        attribution (``2.weight (rank 1), ...``); a single process's names alone (its rank 0 is no news)."""
        if not self.attributed:
            shown = ", ".join(self.parameters[:3])
        else:
            shown = ", ".join(f"{name} ({_ranks_text(self.ranks.get(name))})" for name in self.parameters[:3])
        return shown + (f" (+{len(self.parameters) - 3} more)" if len(self.parameters) > 3 else "")

    def __str__(self) -> str:
        what = "gradients" if self.subject == "gradients" else "weights/optimizer state"
        lines = [f"first non-finite {what} at step {self.step}: {self.summary()}"]
        for name in self.parameters[:3]:
            norms = " ".join(f"{v:.3g}" for v in self.norm_history[name][-8:])
            lines.append(f"  {name}: norms before: {norms or '(no history)'}")
        return "\n".join(lines)


class _NonfiniteSteps:
    """The count of non-finite steps appended on one GPU, on the device and in pinned host memory
    (``Recorder.flush_on_nonfinite``): per append two small kernels and a 4-byte asynchronous copy,
    in stream order after the append."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_device = torch.zeros((), dtype=torch.int32, device=device)
        self.nonfinite = torch.zeros((), dtype=torch.bool, device=device)
        self.on_host = torch.zeros((), dtype=torch.int32, pin_memory=True)
        self.seen = 0  # the largest count the host has read

    def count(self, finite: torch.Tensor) -> bool:
        """Adds this step's flag; whether the host now reads a count above the one it last read."""
        landed = int(self.on_host)  # pinned memory: a host read, whatever copy has landed
        torch.logical_not(finite, out=self.nonfinite)
        self.on_device.add_(self.nonfinite)
        self.on_host.copy_(self.on_device, non_blocking=True)
        if landed > self.seen:
            self.seen = landed
            return True
        return False


class _Ring:
    """The device buffers of one layout (a list of parameter names on one device, and the world size
    of its rank attribution, if any): one byte buffer holding the counter, the attribution rows
    (float64, only for reports that carry one) and one float32 row per record (the per-parameter
    rows, then the per-step columns), so an append is one copy into each row and a read is one copy
    of the whole buffer."""

    def __init__(
        self,
        names: Sequence[str],
        device: torch.device,
        capacity: int,
        first_step: int,
        spike_window: int,
        world: int | None,
        modules: Sequence[str] | None = None,
        updated: Sequence[str] | None = None,
        subject: str = "gradients",
    ) -> None:
        self.names = names
        self.device = device
        self.capacity = capacity
        self.world = world
        self.modules = modules
        self.updated = updated
        self.subject = subject
        n = len(names)
        self.step_columns_end = len(_PARAM_ROWS) * n + len(_STEP_COLUMNS)
        self.activations_end = self.step_columns_end + (0 if modules is None else len(_ACTIVATION_ROWS) * len(modules))
        update_columns = 0 if updated is None else 1 + len(_UPDATE_ROWS) * len(updated)
        self.row_length = self.activations_end + update_columns
        # Float64, as the reduction computes them: the rank sums are integers up to world^3, exact
        # in float64 (to 2^53) where a float32 row would round them (above 2^24) and so name the
        # wrong ranks; copied as they are, they give Attribution.ranks the Report's very inputs.
        self.attribution_length = 0 if world is None else len(_ATTRIBUTION_ROWS) * n + world
        self.nbytes = 8 + capacity * (8 * self.attribution_length + 4 * self.row_length)
        self.storage = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        self.counter, self.attribution, self.rows = self.views(self.storage)
        self.counter.fill_(first_step)
        self.rows.fill_(math.nan)  # the spike window ignores slots never written
        self.norms = self.rows[:, _NORM_ROW * n : (_NORM_ROW + 1) * n]  # [capacity, n], a view
        self.first_step = first_step  # the record index of the layout's first record
        self.decoded = first_step  # records before this one have gone to the sinks
        self.back = torch.arange(1, spike_window + 1, device=device)
        self.median = torch.full((n,), math.nan, dtype=torch.float32, device=device)
        self.since_median = spike_window  # refreshed at the first append
        self.nan = torch.full((1,), math.nan, dtype=torch.float32, device=device)
        # A record's activation columns when no forward was sampled since the record before.
        self.no_activations = (
            None
            if modules is None
            else torch.full((len(_ACTIVATION_ROWS) * len(modules),), math.nan, dtype=torch.float32, device=device)
        )
        # A record's update columns when no optimizer step was measured since the record before.
        self.no_updates = (
            None if updated is None else torch.full((update_columns,), math.nan, dtype=torch.float32, device=device)
        )
        self._constants: dict[tuple[float | None, ...], torch.Tensor] = {}

    def constant(self, *values: float | None) -> torch.Tensor:
        """A float32 [len(values)] device tensor holding ``values`` (NaN for None), made once."""
        tensor = self._constants.get(values)
        if tensor is None:
            # A fill per value, not torch.tensor(list): on a GPU that is a copy from pageable host
            # memory, a sync (and not capturable); a fill takes its value as a kernel argument.
            tensor = torch.empty(len(values), dtype=torch.float32, device=self.device)
            for i, value in enumerate(values):
                tensor[i].fill_(math.nan if value is None else float(value))
            # Kept (a captured graph may read it) up to 64 keys; a max_norm that changes every step
            # gets a fresh tensor each time instead of an unbounded cache.
            if len(self._constants) < 64:
                self._constants[values] = tensor
        return tensor

    def views(self, storage: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """(counter int64 [1], attribution float64 [capacity, attribution_length] or None, rows float32
        [capacity, row_length]) of a byte buffer laid out as ``storage`` (the device's, or its host
        copy). The float64 part comes first, at byte 8, where it is aligned."""
        end = 8 + self.capacity * self.attribution_length * 8
        attribution = (
            None
            if self.world is None
            else storage[8:end].view(torch.float64).view(self.capacity, self.attribution_length)
        )
        rows = storage[end:].view(torch.float32).view(self.capacity, self.row_length)
        return storage[:8].view(torch.int64), attribution, rows


class Recorder:
    """Keeps every recorded step's gradient statistics on the device; hands them to sinks once per
    ``every`` records. See the module notes.

    Args:
        sinks: callables taking a ``StepRecord`` (nanscan.sinks: JSONL, CSV; TensorBoard in
            nanscan.integrations.tensorboard; any function for W&B, MLflow, ...), in a list, or one on
            its own. Every sink gets every record: one that raises is warned about (naming it and
            the step) and counted in ``sink_failures``, never raised into the training loop.
        every: records between two reads of the buffer.
        capacity: records the device buffer holds (default: ``every``, at least ``spike_window + 1``).
        spike_factor: a norm at or above this many times its running median is a spike.
        spike_window: records the running median looks back over.
        spike_min_history: records needed before a median counts (fewer: no spike is reported).
        history: records kept on the host, for ``records`` and for the history of the first
            non-finite step.
        warn: warn (RuntimeWarning) about spikes and the first non-finite step when they are read.
        flush_on_nonfinite: read the buffer out after a step whose gradients held a NaN or an Inf
            (on the CPU at that step's append; on a GPU a few appends later, seen through a 4-byte
            asynchronous copy and read asynchronously: no sync), so that a job killed soon after
            still has it on disk (module notes).
        activations: a ``nanscan.watch_activations`` watch whose figures each record also keeps: per
            module, the largest ``|activation|``, the NaN and Inf counts and the values over fp16's
            65504, of the forwards it sampled since the record before (``StepRecord.activations``;
            None for a record with no sampled forward). Under torch.distributed every rank's,
            reduced (two all-reduces on the appends that follow a sampled forward; every rank must
            run as many forwards). Not inside a captured CUDA graph. One recorder per watch: an
            append takes the figures it records.
        updates: a ``nanscan.watch_updates(optimizer, model)`` watch whose update ratios each record
            also keeps: per parameter ‖Δw‖ and ‖w‖ of the last optimizer step it measured since the
            record before (``StepRecord.updates``; None for a record after no measured step). Their
            quotient, the ratio, is tested for spikes against its median over the ``spike_window``
            measured steps before, as gradient norms are (``update_spikes``). Already reduced over
            ranks by the watch's scan: no collective. Not inside a captured CUDA graph. One recorder
            per watch.

    Attributes:
        records: the last ``history`` records read.
        first_nonfinite: the first non-finite step read (``FirstNonfinite``), or None.
        spikes: the latest 1000 norm spikes read, ``(step, parameter, ratio)``; ``spike_count`` and
            ``largest_spike`` cover every one (``update_spikes``, ``update_spike_count`` and
            ``largest_update_spike`` the same for an update watch's ratios).
        read, skipped, lost, sink_failures: records handed to the sinks, skipped steps among them,
            records overwritten before they were read, and sink calls that raised.

    While a recorder is open, a SIGTERM reads out its records before the process ends as it would
    have without nanscan (module notes: what survives which end of a job).

    Example:
        >>> recorder = nanscan.Recorder([nanscan.sinks.JSONLSink("run.jsonl")], every=100)
        >>> for batch in data:
        ...     loss(model, batch).backward()
        ...     nanscan.check(model, max_norm=1.0, recorder=recorder)
        ...     optimizer.step(); optimizer.zero_grad()
        >>> recorder.close()
        >>> print(recorder)
    """

    def __init__(
        self,
        sinks: Iterable[Sink] | Sink = (),
        *,
        every: int = 100,
        capacity: int | None = None,
        spike_factor: float = 10.0,
        spike_window: int = 32,
        spike_min_history: int = 8,
        history: int = 64,
        warn: bool = True,
        flush_on_nonfinite: bool = True,
        activations: ActivationWatch | None = None,
        updates: UpdateWatch | None = None,
    ) -> None:
        if activations is not None and not isinstance(activations, ActivationWatch):
            raise TypeError(
                "nanscan.Recorder: activations must be a nanscan.watch_activations(model) watch, got "
                f"{type(activations).__name__}"
            )
        if updates is not None and not isinstance(updates, UpdateWatch):
            raise TypeError(
                "nanscan.Recorder: updates must be a nanscan.watch_updates(optimizer, model) watch, got "
                f"{type(updates).__name__}"
            )
        for name, value in (("every", every), ("spike_window", spike_window), ("history", history)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"nanscan.Recorder: {name} must be a positive int, got {value!r}")
        if capacity is None:
            capacity = max(every, spike_window + 1)
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= spike_window:
            raise ValueError(
                f"nanscan.Recorder: capacity must be an int above spike_window ({spike_window}), got {capacity!r}"
            )
        if every > capacity:
            raise ValueError(f"nanscan.Recorder: every ({every}) must be at most capacity ({capacity})")
        if not (isinstance(spike_factor, (int, float)) and spike_factor > 1):
            raise ValueError(f"nanscan.Recorder: spike_factor must be a number above 1, got {spike_factor!r}")
        if not isinstance(spike_min_history, int) or not 1 <= spike_min_history <= spike_window:
            raise ValueError(
                f"nanscan.Recorder: spike_min_history must be an int in [1, spike_window], got {spike_min_history!r}"
            )
        self.sinks: list[Sink] = _sink_list(sinks)
        # Whether a sink has yet to learn this process's rank (one opened at its first record):
        # each append notes the rank while the checks run under torch.distributed (note_rank).
        self._rank_pending = _ranks_pending(self.sinks)
        self.activations = activations
        self.updates = updates
        self.every = every
        self.capacity = capacity
        self.spike_factor = float(spike_factor)
        self.spike_window = spike_window
        self.spike_min_history = spike_min_history
        self.warn = warn
        self.records: deque[StepRecord] = deque(maxlen=history)
        self.first_nonfinite: FirstNonfinite | None = None
        self.spikes: deque[tuple[int, str, float]] = deque(maxlen=1000)  # (step, parameter, ratio), latest
        # Update-ratio spikes, the same way: (step, parameter, ratio over its median), the latest.
        self.update_spikes: deque[tuple[int, str, float]] = deque(maxlen=1000)
        # Every spike read, however many the deques above have let go: their count and the largest.
        self.spike_count = 0
        self.largest_spike: tuple[int, str, float] | None = None
        self.update_spike_count = 0
        self.largest_update_spike: tuple[int, str, float] | None = None
        self.sink_failures = 0  # sink calls that raised (each warned about; the other sinks still ran)
        # The update ratios of the last spike_window measured steps read, oldest first: the window
        # each new one's median is taken over, on the host at the read (measured steps are sampled
        # and few; the device keeps none of this).
        self._ratio_history: deque[np.ndarray[Any, np.dtype[np.float64]]] = deque(maxlen=spike_window)
        self.lost = 0  # records overwritten before they were read (see the module notes)
        self.skipped = 0  # skipped steps among the records read
        self.read = 0  # records handed to the sinks
        self._ring: _Ring | None = None
        # Eagerly the median is refreshed every few records, not every one: it is most of an append's
        # cost, and a median over 32 records moves little in 8.
        self._median_every = max(1, spike_window // 4)
        self._appended = 0  # appends since the last flush, counted on the host
        self._next_step = 0  # the record index the next layout's counter starts from
        self._pending: tuple[_Ring, torch.Tensor, torch.cuda.Event | None] | None = None
        self._closed = False
        self._last_total: float | None = None
        self.flush_on_nonfinite = bool(flush_on_nonfinite)
        # On a GPU: the count of non-finite steps appended, kept on the device and copied to pinned
        # memory after each append. It only grows, so the host reads whatever copy has landed with no
        # event and misses nothing (a copy not yet landed is seen at a later append), and a read it
        # asks for is asynchronous like any other: no sync.
        self._nonfinite_steps: _NonfiniteSteps | None = None
        self._read_soon = False  # a non-finite step was seen: read as soon as no read is pending
        # A SIGTERM handler may run between any two bytecodes of the main thread: one that lands in
        # the middle of this recorder's own work waits for it (_guarded), and another thread's
        # recorder is read out under its lock.
        self._lock = threading.RLock()
        self._busy_in: int | None = None  # the thread in an append/flush/close, if any
        self._pid = os.getpid()  # a forked child's copy is not this recorder: it reads out nothing
        _open_recorders.add(self)
        _sigterm.install()
        # Dropped without close(), the last recorder still puts the handler back when collected.
        weakref.finalize(self, _restore_if_none_open)

    # ------------------------------------------------------------------------------------ appending

    @_guarded
    def append(
        self,
        report: Report,
        *,
        skipped: torch.Tensor | bool = False,
        loss_scale: torch.Tensor | float | None = None,
    ) -> None:
        """Appends one step: ``report``'s statistics, whether the optimizer step was skipped (a device
        bool, e.g. a NaN with ``on_nonfinite="skip"`` or a GradScaler's found_inf) and the loss scale.
        No host sync. ``check(..., recorder=...)`` and ``GradScaler.record`` call it."""
        if self._closed:
            raise ValueError("nanscan.Recorder: append after close()")
        if self._rank_pending:  # a file sink not yet opened: keep the rank the checks ran under
            self._rank_pending = note_rank()
        stats = report.stats
        device = stats.norm.device
        names = report.name_sequence
        attribution = stats.ranks
        world = None if attribution is None else attribution.any_by_rank.numel()
        ring = self._ring
        capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        subject = report.subject
        if (
            ring is None
            or ring.device != device
            or ring.world != world
            or ring.subject != subject
            or not _same_names(ring.names, names)
        ):
            if capturing:
                raise RuntimeError(
                    "nanscan.Recorder: the parameters changed during CUDA graph capture; record one step "
                    "before capturing, so the buffer exists"
                )
            self._start_layout(names, device, world, subject)
            ring = self._ring
            assert ring is not None
        elif not capturing:
            self._drain(wait=False)
        clip_coef = ring.nan if report.clip_coef_tensor is None else report.clip_coef_tensor
        # The row's values in its order (the op flattens each source and casts it to float32): the
        # per-parameter rows, then the per-step columns.
        sources = [
            stats.nan_count,
            stats.inf_count,
            stats.min,
            stats.max,
            stats.norm,
            ring.median,
            report.total_norm_tensor,
            stats.finite,
            clip_coef,
        ]
        if isinstance(skipped, bool) and not isinstance(loss_scale, torch.Tensor):
            sources.append(ring.constant(report.max_norm, skipped, loss_scale))  # the usual case: one tensor
        else:
            sources += [
                ring.constant(report.max_norm),
                ring.constant(skipped) if isinstance(skipped, bool) else _on_ring(skipped, ring),
                _scale_of(loss_scale, ring),
            ]
        if ring.modules is not None:
            if capturing:
                raise RuntimeError(
                    "nanscan.Recorder: a recorder with an activation watch cannot be captured in a CUDA graph "
                    "(the watch's hooks run in Python); record it outside the graph"
                )
            assert self.activations is not None
            taken = self.activations._take_recent(device)
            if taken is None:
                assert ring.no_activations is not None  # made with the ring's modules
                sources.append(ring.no_activations)
            else:
                amax, counts = taken
                sources += [amax, counts[: len(_ACTIVATION_ROWS) - 1]]  # NaN, Inf, overflow: rows as they lie
        if ring.updated is not None:
            if capturing:
                raise RuntimeError(
                    "nanscan.Recorder: a recorder with an update watch cannot be captured in a CUDA graph "
                    "(the watch's step hooks run in Python); record it outside the graph"
                )
            assert self.updates is not None and ring.no_updates is not None
            measured = self.updates._take_recent()
            if measured is None:
                sources.append(ring.no_updates)
            else:
                norms, steps = measured
                sources += [ring.constant(steps), _on_ring(norms, ring)]  # ‖Δw‖ then ‖w‖: rows as they lie
        if capturing or ring.since_median >= self._median_every:
            # Inside a captured graph every replay refreshes the median; eagerly, every few records.
            with torch.no_grad():
                self._refresh_median(ring)
        # One op: the record into the ring at the device counter's slot, the counter advanced.
        record_op(ring.rows, ring.counter, sources, ring.attribution, [] if attribution is None else attribution.rows())
        ring.since_median += 1
        if capturing:
            return
        self._appended += 1
        if self.flush_on_nonfinite and self._saw_nonfinite(stats.finite, ring):
            self._read_soon = True
        # A read asked for by a non-finite step waits for a pending one to land (a second read
        # would wait for the first: a sync); on the CPU a read is never pending.
        if self._appended >= self.every or (self._read_soon and self._pending is None):
            self._read_soon = False
            self.flush(wait=False)

    def _saw_nonfinite(self, finite: torch.Tensor, ring: _Ring) -> bool:
        """Whether a step not yet seen held a NaN/Inf, as far as the host can tell without a sync: on
        the CPU this step's flag; on a GPU the count the earlier appends' copies have landed, after
        enqueuing this step's (other devices: never)."""
        if ring.device.type == "cpu":
            return not bool(finite)
        if ring.device.type != "cuda":
            return False
        if self._nonfinite_steps is None or self._nonfinite_steps.device != ring.device:
            self._nonfinite_steps = _NonfiniteSteps(ring.device)
        return self._nonfinite_steps.count(finite)

    def _refresh_median(self, ring: _Ring) -> None:
        """Each parameter's median norm over the ``spike_window`` records before the next one, NaN
        where fewer than ``spike_min_history`` of them exist (slots never written hold NaN) or the
        median is 0: a ratio against it is then NaN, never a spike."""
        window = ring.norms.index_select(0, (ring.counter - ring.back).remainder(ring.capacity))
        ring.median.copy_(_spike_baseline(window, self.spike_min_history))
        ring.since_median = 0

    def _start_layout(self, names: Sequence[str], device: torch.device, world: int | None, subject: str) -> None:
        """A new buffer for a new list of parameters (or device, attribution or subject): the old one is
        read out first."""
        if self._ring is not None:
            self.flush(wait=True)
            assert self._ring is not None
            self._next_step = self._ring.decoded
        modules = None if self.activations is None else tuple(self.activations.names)
        updated = None if self.updates is None else tuple(self.updates.names)
        self._ring = _Ring(
            names, device, self.capacity, self._next_step, self.spike_window, world, modules, updated, subject
        )

    # ------------------------------------------------------------------------------------- reading

    @_guarded
    def flush(self, wait: bool = True) -> None:
        """Sends every record not yet read to the sinks: one copy of the buffer to the host. With
        ``wait=False`` on a GPU the copy is only enqueued, and read at a later append once landed."""
        ring = self._ring
        if ring is None:
            return
        if self._pending is not None:
            self._drain(wait=True)
        self._appended = 0
        if ring.device.type == "cuda":
            # On the ring's device and its current stream, which must be the appends' stream (the
            # copy is a snapshot in that stream's order); the event on the same stream says when the
            # copy has landed, whichever device is current.
            with torch.cuda.device(ring.device):
                stream = torch.cuda.current_stream(ring.device)
                host = torch.empty(ring.nbytes, dtype=torch.uint8, pin_memory=True)
                host.copy_(ring.storage, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            self._pending = (ring, host, event)
        elif ring.device.type == "cpu":
            self._pending = (ring, ring.storage, None)  # the host's own memory: read it in place
        else:
            # Another device (MPS, XPU, ...): one copy of the buffer to the host, a sync at each read,
            # rather than the many small ones of reading it where it is.
            self._pending = (ring, ring.storage.cpu(), None)
        if wait or ring.device.type != "cuda":
            self._drain(wait=True)

    def _drain(self, wait: bool) -> None:
        """Reads the pending copy if it has landed (or waits for it)."""
        if self._pending is None:
            return
        ring, host, event = self._pending
        if event is not None and not event.query():
            if not wait:
                return
            event.synchronize()
        self._pending = None
        self._decode(ring, host)

    def _decode(self, ring: _Ring, host: torch.Tensor) -> None:
        counter, attribution, rows = ring.views(host)
        end = int(counter.item())
        first = max(ring.decoded, end - ring.capacity)
        # The warnings of this read, given only once every record has reached every sink: a warning
        # turned into an error (python -W error) then costs no sink a record.
        notes: list[str] = []
        if first > ring.decoded:
            lost = first - ring.decoded
            self.lost += lost
            notes.append(
                f"nanscan.Recorder: {lost} records were overwritten before they were read (capacity "
                f"{ring.capacity}); flush more often, or raise capacity"
            )
        if end > first:
            # The block of new records in one copy, its per-step columns as Python values in one
            # conversion; each record's per-parameter lists are converted when first read (StepRecord).
            n = len(ring.names)
            slots = torch.arange(first, end).remainder(ring.capacity)
            block = rows.index_select(0, slots)
            params = block[:, : len(_PARAM_ROWS) * n].view(-1, len(_PARAM_ROWS), n)
            # The spike ratio of each record: its norm over the median the device kept beside it.
            ratios = params[:, _MEDIAN_ROW]
            torch.div(params[:, _NORM_ROW], ratios, out=ratios)
            columns = block[:, len(_PARAM_ROWS) * n : ring.step_columns_end].tolist()
            activations = _Activations(ring, block)
            updates = _Updates(ring, block, self)
            spiked = spike_mask(ratios, self.spike_factor).any(dim=1).tolist()
            ranks = _Ranks(ring, attribution, slots, params)
            for k, step in enumerate(range(first, end)):
                record = _record(
                    step, ring, columns[k], params, k, self.spike_factor, ranks, activations.of(k), updates.of(k)
                )
                # Marked read first: a record is handed on once, never again at the next read (every
                # sink gets it: _emit catches a sink's failure).
                ring.decoded = step + 1
                self._emit(record, spiked[k], ring.world is not None, notes)
        ring.decoded = max(ring.decoded, end)
        if end > first:
            for sink in self.sinks:
                self._call_sink(sink, "flush", None, notes)
            self._rank_pending = self._rank_pending and _ranks_pending(self.sinks)
        for note in notes:
            _warn(note)

    def _emit(self, record: StepRecord, spiked: bool, attributed: bool, notes: list[str]) -> None:
        """One record on the host: the answers kept here, then every sink. ``spiked``: whether any
        ratio reached the spike factor (found for the whole block at once); ``attributed``: whether
        the record's ranks come from a rank attribution. Warnings go to ``notes``, given after the read."""
        self.read += 1
        self.skipped += record.skipped
        self._last_total = record.total_norm
        if not record.finite and self.first_nonfinite is None:
            self.first_nonfinite = self._first_nonfinite(record, attributed)
            if self.warn:
                notes.append(f"nanscan.Recorder: {self.first_nonfinite}")
        spikes = record.spikes if spiked else {}
        for name, ratio in spikes.items():
            self.spikes.append((record.step, name, ratio))
            if self.largest_spike is None or ratio > self.largest_spike[2]:
                self.largest_spike = (record.step, name, ratio)
        self.spike_count += len(spikes)
        if spikes and self.warn:
            what = "gradient" if record.subject == "gradients" else "state"
            notes.append(
                f"nanscan.Recorder: {what} norm spike at step {record.step} (norm over its median of the "
                f"{self.spike_window} steps before): {_worst(spikes)}"
            )
        update_spikes = {} if record.updates is None else record.updates.spikes
        for name, multiple in update_spikes.items():
            self.update_spikes.append((record.step, name, multiple))
            if self.largest_update_spike is None or multiple > self.largest_update_spike[2]:
                self.largest_update_spike = (record.step, name, multiple)
        self.update_spike_count += len(update_spikes)
        if update_spikes and self.warn:
            notes.append(
                f"nanscan.Recorder: update ratio spike at step {record.step} (‖Δw‖/‖w‖ over its median of the "
                f"{self.spike_window} measured steps before): {_worst(update_spikes)}"
            )
        self.records.append(record)
        for sink in self.sinks:
            self._call_sink(sink, "__call__", record, notes)

    def _call_sink(self, sink: Sink, method: str, record: StepRecord | None, notes: list[str]) -> None:
        """Calls ``sink`` with ``record``, or without one its optional ``method`` (flush, close). An exception (a
        logger's network error, a full disk) is counted and noted, naming the sink and the step; the
        other sinks still run, and the training step is not interrupted."""
        try:
            if record is not None:
                sink(record)
            else:
                _call_optional(sink, method)
        except Exception as error:
            self.sink_failures += 1
            at = f"on step {record.step}" if record is not None else f"at {method}()"
            notes.append(f"nanscan.Recorder: sink {_sink_name(sink)} failed {at}: {type(error).__name__}: {error}")

    def _first_nonfinite(self, record: StepRecord, attributed: bool) -> FirstNonfinite:
        bad = record.nonfinite
        before = [r for r in self.records if _same_names(r.names, record.names)]
        index = {name: i for i, name in enumerate(record.names)}
        return FirstNonfinite(
            subject=record.subject,
            step=record.step,
            parameters=bad,
            norm_history={name: [r.norm[index[name]] for r in before] for name in bad},
            total_norm_history=[r.total_norm for r in before],
            steps=[r.step for r in before],
            ranks=record.nonfinite_ranks or {},
            attributed=attributed,
        )

    # ------------------------------------------------------------------------------------- the rest

    def add_sink(self, sink: Sink) -> None:
        """Adds a sink; it receives the records read from now on."""
        _check_sink(sink)
        self.sinks.append(sink)
        self._rank_pending = _ranks_pending(self.sinks)

    @property
    def nbytes(self) -> int:
        """Device memory the buffer holds now (0 before the first append)."""
        return 0 if self._ring is None else self._ring.nbytes

    @_guarded
    def close(self) -> None:
        """Reads out every record, flushes and closes the sinks. Idempotent; runs at interpreter exit.
        The last open recorder's close puts back the SIGTERM handler nanscan replaced."""
        if self._closed:
            return
        try:
            self.flush(wait=True)
        finally:
            self._closed = True
            _open_recorders.discard(self)
            notes: list[str] = []
            for sink in self.sinks:
                self._call_sink(sink, "close", None, notes)
            _restore_if_none_open()
            for note in notes:
                _warn(note)

    @_guarded
    def __getstate__(self) -> dict[str, Any]:
        """A copy for another process: Lightning's ``strategy="ddp_spawn"`` pickles the Trainer, its
        callbacks and their recorder into each process it starts. The records so far are read out
        first, so that the copy starts with none unread (no record reaches a sink twice), and the
        copy gets no device buffer: it makes its own at its first append, its records numbered on
        from this one's (``torch.multiprocessing`` would otherwise share the buffer's memory among the
        copies). Its sinks are copied too (a file sink reopens its file in the new process, which
        decides anew which rank writes it: nanscan.sinks). A recorder with an activation or update
        watch is refused: the watch's hooks hold the model and the optimizer, which belong to the
        process that trains them; watch them in that process."""
        if self.activations is not None or self.updates is not None:
            raise TypeError(
                "nanscan.Recorder: a recorder with an activation or update watch cannot be copied into another "
                "process (Lightning's ddp_spawn pickles its callbacks): make the watch and its recorder in the "
                "process that trains, or use strategy='ddp'"
            )
        self.flush(wait=True)
        state = self.__dict__.copy()
        del state["_lock"]
        ring = state.pop("_ring")
        state.update(_ring=None, _pending=None, _nonfinite_steps=None, _busy_in=None, _read_soon=False, _appended=0)
        if ring is not None:
            state["_next_step"] = ring.decoded
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.RLock()
        self._rank_pending = _ranks_pending(self.sinks)  # its sinks decide anew in this process
        self._pid = os.getpid()  # this process's recorder now: SIGTERM and exit read it out here
        if not self._closed:
            _open_recorders.add(self)
            _sigterm.install()
            weakref.finalize(self, _restore_if_none_open)

    def __enter__(self) -> Recorder:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()  # on an exception too: the steps that led to it reach the sinks

    def __str__(self) -> str:
        parts = [
            f"nanscan.Recorder: {self.read} steps read (+{self._appended} not yet), {self.skipped} skipped, "
            f"{len(self.sinks)} sink{'' if len(self.sinks) == 1 else 's'}, device buffer {self.nbytes / 1e6:.2f} MB"
        ]
        if self._last_total is not None:
            parts.append(f"last total norm {self._last_total:.4g}")
        if self.first_nonfinite is not None:
            parts.append(f"first non-finite at step {self.first_nonfinite.step}: {self.first_nonfinite.summary()}")
        else:
            parts.append("no non-finite step")
        if self.largest_spike is not None:
            step, name, ratio = self.largest_spike
            parts.append(f"{self.spike_count} norm spikes (largest: {name} at step {step}, {ratio:.1f}x its median)")
        if self.largest_update_spike is not None:
            step, name, ratio = self.largest_update_spike
            parts.append(
                f"{self.update_spike_count} update ratio spikes (largest: {name} at step {step}, "
                f"{ratio:.1f}x its median)"
            )
        if self.lost:
            parts.append(f"{self.lost} records lost (overwritten before read)")
        if self.sink_failures:
            parts.append(f"{self.sink_failures} sink calls failed (warned about)")
        return "; ".join(parts)

    def __repr__(self) -> str:
        return f"<nanscan.Recorder every={self.every} capacity={self.capacity}, {self.read} read>"


class _Ranks:
    """The ranks of each non-finite parameter of a block of records, read on the rare path (a record
    with a NaN/Inf): from the attribution rows when the layout has them, as ``Report.nonfinite_ranks``
    reads them; otherwise this process's rank, the rank-local answer a single process gives."""

    def __init__(
        self, ring: _Ring, attribution: torch.Tensor | None, slots: torch.Tensor, params: torch.Tensor
    ) -> None:
        self.ring = ring
        self.attribution = attribution
        self.slots = slots
        self.params = params

    def of(self, k: int) -> dict[str, list[int]]:
        """The ranks of each parameter with a NaN/Inf in the block's ``k``-th record."""
        names = self.ring.names
        nan_count, inf_count = self.params[k, :2].to(torch.int64).tolist()
        bad = [i for i, (nan, inf) in enumerate(zip(nan_count, inf_count, strict=True)) if nan or inf]
        if self.attribution is None:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            return {names[i]: [rank] for i in bad}
        n = len(names)
        row = self.attribution[int(self.slots[k])].tolist()  # float64, exact: the Report's own values
        count, rank_sum, rank_square_sum, any_by_rank = row[:n], row[n : 2 * n], row[2 * n : 3 * n], row[3 * n :]
        return {names[i]: Attribution.ranks(count[i], rank_sum[i], rank_square_sum[i], any_by_rank) for i in bad}


class _Activations:
    """The activation columns of a block of records (a recorder with a watch): per record, the
    module figures as an ActivationRecord, or None where no forward was sampled (its amax NaN)."""

    def __init__(self, ring: _Ring, block: torch.Tensor) -> None:
        self.modules = ring.modules
        if self.modules is None:
            return
        m = len(self.modules)
        self.rows = block[:, ring.step_columns_end : ring.activations_end].view(-1, len(_ACTIVATION_ROWS), m)
        self.sampled = (~self.rows[:, 0, 0].isnan()).tolist()  # m >= 1: the model itself is watched

    def of(self, k: int) -> ActivationRecord | None:
        if self.modules is None or not self.sampled[k]:
            return None
        amax, nan, inf, overflow = self.rows[k].tolist()
        return ActivationRecord(
            modules=self.modules,
            amax=amax,
            nan_count=[int(v) for v in nan],
            inf_count=[int(v) for v in inf],
            overflow=[int(v) for v in overflow],
        )


class _Updates:
    """The update columns of a block of records (a recorder with an update watch): per record an
    UpdateRecord, or None where no optimizer step was measured since the record before. The spike
    ratio of each measured step is worked out here, in record order, against the recorder's window
    of the measured steps read before (``Recorder._ratio_history``)."""

    def __init__(self, ring: _Ring, block: torch.Tensor, recorder: Recorder) -> None:
        self.names = ring.updated
        self.records: dict[int, UpdateRecord] = {}
        if self.names is None:
            return
        n = len(self.names)
        columns = block[:, ring.activations_end :].to(torch.float64).numpy()
        for k in np.flatnonzero(~np.isnan(columns[:, 0])).tolist():
            update_norm, weight_norm = columns[k, 1 : 1 + n], columns[k, 1 + n :]
            with np.errstate(divide="ignore", invalid="ignore"):
                ratio = update_norm / weight_norm
                multiple = ratio / _ratio_baseline(recorder._ratio_history, recorder.spike_min_history, n)
            recorder._ratio_history.append(ratio)
            self.records[k] = UpdateRecord(
                names=self.names,
                steps=int(columns[k, 0]),
                update_norm=update_norm.tolist(),
                weight_norm=weight_norm.tolist(),
                spike_ratio=multiple.tolist(),
                spike_factor=recorder.spike_factor,
            )

    def of(self, k: int) -> UpdateRecord | None:
        return self.records.get(k)


def _spike_baseline(window: torch.Tensor, min_history: int) -> torch.Tensor:
    """The one rule for what a spike is measured against, for gradient norms (on the device) and
    update ratios (on the host): per column of ``window`` (rows are records), the lower median of the
    known (not NaN) values, as nanmedian gives it; NaN where fewer than ``min_history`` are known, or
    where the median is 0 (a ratio against it is then NaN, never a spike). By a sort (NaN sorts last)
    and a gather: plain ops, where nanmedian's indices output may meet torch's determinism checks."""
    known = (~window.isnan()).sum(dim=0)
    middle = ((known - 1).clamp(min=0) // 2).unsqueeze(0)
    median = window.sort(dim=0).values.gather(0, middle).squeeze(0)
    return torch.where((known >= min_history) & (median > 0), median, math.nan)


def _ratio_baseline(
    history: Iterable[np.ndarray[Any, np.dtype[np.float64]]], min_history: int, n: int
) -> np.ndarray[Any, np.dtype[np.float64]]:
    """``_spike_baseline`` of the update ratios of the measured steps before (rows of ``history``)."""
    rows = list(history)
    if len(rows) < min_history or not rows:
        return np.full(n, np.nan)
    return _spike_baseline(torch.from_numpy(np.stack(rows)), min_history).numpy()


class _Column:
    """One per-parameter list of a record, still in the block its read brought to the host (a view
    of the float32 copy): what StepRecord calls on the field's first reading."""

    __slots__ = ("k", "params", "row")

    def __init__(self, params: torch.Tensor, k: int, row: int) -> None:
        self.params, self.k, self.row = params, k, row

    def __call__(self) -> list[Any]:
        values = self.params[self.k, self.row]
        return (values.to(torch.int64) if self.row < 2 else values).tolist()  # the counts as ints


def _record(
    step: int,
    ring: _Ring,
    columns: list[float],
    params: torch.Tensor,
    k: int,
    spike_factor: float,
    ranks: _Ranks,
    activations: ActivationRecord | None,
    updates: UpdateRecord | None,
) -> StepRecord:
    total_norm, finite, clip_coef, max_norm, skipped, loss_scale = columns
    # Callables in place of the lists (StepRecord converts them when first read); typed as the lists.
    lists = [cast("list[Any]", _Column(params, k, row)) for row in range(len(_PARAM_ROWS))]
    return StepRecord(
        step=step,
        names=ring.names,
        nan_count=lists[0],
        inf_count=lists[1],
        min=lists[2],
        max=lists[3],
        norm=lists[4],
        spike_ratio=lists[_MEDIAN_ROW],  # the ratio, once _decode has divided
        total_norm=total_norm,
        finite=bool(finite),
        clip_coef=None if math.isnan(max_norm) else clip_coef,
        max_norm=None if math.isnan(max_norm) else _shortest(max_norm),
        skipped=bool(skipped),
        loss_scale=None if math.isnan(loss_scale) else loss_scale,
        spike_factor=spike_factor,
        nonfinite_ranks={} if finite else ranks.of(k),
        activations=activations,
        updates=updates,
        subject=ring.subject,
        update_names=ring.updated,
    )


def _worst(multiples: dict[str, float]) -> str:
    """The three largest of a record's spikes, ``name 14.2x, ...``, and how many more."""
    worst = sorted(multiples.items(), key=lambda item: -item[1])[:3]
    shown = ", ".join(f"{name} {ratio:.1f}x" for name, ratio in worst)
    return shown + (f" (+{len(multiples) - 3} more)" if len(multiples) > 3 else "")


def _ranks_text(ranks: list[int] | None) -> str:
    if not ranks:
        return "rank unknown"
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


@functools.lru_cache(maxsize=64)  # one max_norm, over and over
def _shortest(value: float) -> float:
    """A float32's value as the shortest decimal that reads back as the same float32 (0.3, not
    0.30000001192092896): a max_norm of 0.3 is recorded as 0.3."""
    if not math.isfinite(value):
        return value
    for digits in range(1, 10):
        candidate = float(f"{value:.{digits}g}")
        if _FLOAT32.unpack(_FLOAT32.pack(candidate))[0] == value:
            return candidate
    return value


_FLOAT32 = struct.Struct("f")


def _scale_of(loss_scale: torch.Tensor | float | None, ring: _Ring) -> torch.Tensor:
    """The loss scale as a 0-dim or [1] tensor on the ring's device (a GradScaler's own scale tensor,
    read by the append's op in stream order, before ``update()`` changes it)."""
    if isinstance(loss_scale, torch.Tensor):
        return _on_ring(loss_scale, ring)
    return ring.constant(loss_scale)


def _on_ring(value: torch.Tensor, ring: _Ring) -> torch.Tensor:
    """A tensor the caller hands the append (a skipped flag, a loss scale) as the record op reads it:
    on the ring's device, and float32 when its dtype is not one the op reads (a float16 scale)."""
    if value.device == ring.device and value.dtype in RECORD_SOURCE_DTYPES:
        return value
    return value.to(ring.device, value.dtype if value.dtype in RECORD_SOURCE_DTYPES else torch.float32)


def _warn(message: str) -> None:
    """A RuntimeWarning attributed to the first caller outside nanscan (records are read deep inside
    a check, a flush or a close)."""
    package = os.path.dirname(os.path.abspath(__file__))
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(package):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, RuntimeWarning, stacklevel=level)


def _same_names(old: Sequence[str], new: Sequence[str]) -> bool:
    return old is new or (len(old) == len(new) and old == new)


def _check_sink(sink: object) -> None:
    if not callable(sink):
        hint = (
            " (a path is not a sink: nanscan.sinks.JSONLSink(path) is)" if isinstance(sink, (str, os.PathLike)) else ""
        )
        raise TypeError(f"nanscan.Recorder: a sink must be callable with a StepRecord, got {type(sink).__name__}{hint}")


def _sink_list(sinks: Iterable[Sink] | Sink) -> list[Sink]:
    """The sinks given: a list (any iterable) of them, or one sink on its own."""
    if callable(sinks):
        sinks = [sinks]
    elif isinstance(sinks, (str, bytes, os.PathLike)) or not isinstance(sinks, Iterable):
        raise TypeError(
            "nanscan.Recorder: sinks must be a list of sinks (callables taking a StepRecord), e.g. "
            f"[nanscan.sinks.JSONLSink('run.jsonl')], got {type(sinks).__name__}"
        )
    result = list(sinks)
    for sink in result:
        _check_sink(sink)
    return result


def _sink_name(sink: object) -> str:
    """How a warning names a sink: a function by its name, an object by its own repr if it has one
    (``JSONLSink('run.jsonl')``), else by its type."""
    name = getattr(sink, "__name__", None)
    if isinstance(name, str):
        return name
    return repr(sink) if type(sink).__repr__ is not object.__repr__ else type(sink).__name__


def _call_optional(sink: object, method: str) -> None:
    fn = getattr(sink, method, None)
    if callable(fn):
        fn()


# Recorders still open (and referenced) at interpreter exit are closed, so their records are not
# lost with the process; one dropped without close() loses its unread records.
_open_recorders: weakref.WeakSet[Recorder] = weakref.WeakSet()


def _ranks_pending(sinks: list[Sink]) -> bool:
    """Whether a sink has yet to decide which file it writes (nanscan.sinks.note_rank)."""
    return any(getattr(sink, "rank_pending", False) for sink in sinks)


def _close_at_exit(recorder: Recorder) -> None:
    try:
        recorder.close()
    except Exception as error:  # at exit, one recorder's failure must not hide the others
        warnings.warn(f"nanscan.Recorder: closing at exit failed: {error}", RuntimeWarning, stacklevel=1)


@atexit.register
def _close_open_recorders() -> None:
    for recorder in list(_open_recorders):
        _close_at_exit(recorder)


class _SigtermReadOut:
    """nanscan's SIGTERM handler while recorders are open: reads out every open recorder of this
    process once, then hands the signal to the handler it replaced (module notes)."""

    # How long the handler waits for a recorder busy in another thread before leaving it unread.
    LOCK_TIMEOUT_S = 5.0

    def __init__(self) -> None:
        self.previous: Any = signal.SIG_DFL  # the handler replaced (kept after a restore: see restore)
        self.installed = False
        self.deferred: tuple[int, FrameType | None] | None = None  # a SIGTERM that waits for a recorder

    def install(self) -> None:
        """Puts the handler in place, from the main thread only (the one Python lets set handlers
        and runs them in); not over an ignored SIGTERM, nor over a handler set outside Python."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        previous = signal.getsignal(signal.SIGTERM)
        if previous is signal.SIG_IGN or previous is None:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
        self.previous, self.installed = previous, True

    def restore(self) -> None:
        """Puts the replaced handler back, if nanscan's is still the one installed. If something
        installed its own over nanscan's since, that one stays; should it hand a SIGTERM on to
        nanscan's, nanscan's hands it on to ``previous`` in turn."""
        if not self.installed or threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is _on_sigterm:
            signal.signal(signal.SIGTERM, self.previous)
        self.installed = False

    def handle(self, signum: int, frame: FrameType | None) -> None:
        """The handler: deferred while a recorder of this thread is in the middle of its own work."""
        me = threading.get_ident()
        if any(recorder._busy_in == me for recorder in _recorders_of_this_process()):
            self.deferred = (signum, frame)
            return
        self.read_out_and_chain(signum, frame)

    def read_out_and_chain(self, signum: int, frame: FrameType | None) -> None:
        """Reads out every open recorder, then hands the signal on. A handler of the job's is called.
        The default (the process ends by the signal, its exit status as without nanscan: 143 in a
        shell, -15 to subprocess) applies only while nanscan's handler is the process's: a handler
        installed over it that calls it in turn (Lightning composes the handlers it finds, to stop
        gracefully) would not have called the default, so the ending stays that handler's."""
        self.deferred = None
        for recorder in _recorders_of_this_process():
            self._read_out(recorder)
        previous = self.previous
        if callable(previous):
            previous(signum, frame)
        elif previous == signal.SIG_DFL and signal.getsignal(signum) is _on_sigterm:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)

    def _read_out(self, recorder: Recorder) -> None:
        if not recorder._lock.acquire(timeout=self.LOCK_TIMEOUT_S):
            warnings.warn(
                f"nanscan.Recorder: SIGTERM: a recorder busy in another thread for {self.LOCK_TIMEOUT_S:g} s "
                "was not read out",
                RuntimeWarning,
                stacklevel=1,
            )
            return
        try:
            if not recorder._closed:
                recorder.flush(wait=True)
        except Exception as error:  # one recorder's failure must not keep the others, or the signal, back
            warnings.warn(f"nanscan.Recorder: reading out on SIGTERM failed: {error}", RuntimeWarning, stacklevel=1)
        finally:
            recorder._lock.release()


def _recorders_of_this_process() -> list[Recorder]:
    """The open recorders, less the copies a forked child inherited (their buffers, and their files'
    buffers, are the parent's)."""
    pid = os.getpid()
    return [recorder for recorder in list(_open_recorders) if recorder._pid == pid]


_sigterm = _SigtermReadOut()


def _restore_if_none_open() -> None:
    """Puts the replaced SIGTERM handler back once no recorder of this process is open (from the main
    thread: elsewhere the next close there does it)."""
    if not _recorders_of_this_process():
        _sigterm.restore()


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    """The function installed (one object, so that ``signal.getsignal`` tells it is nanscan's)."""
    _sigterm.handle(signum, frame)
