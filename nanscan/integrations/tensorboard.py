"""A Recorder sink that writes each step's gradient statistics to TensorBoard.

    from nanscan.integrations.tensorboard import TensorBoardSink
    recorder = nanscan.Recorder(sinks=[TensorBoardSink("runs/exp1")])

Tags, under ``prefix`` (default ``nanscan``), at ``global_step = record.step``:

* ``total_norm``, ``clip_coef`` and ``loss_scale`` (when the step has them), ``skipped`` (0/1),
  ``nonfinite_parameters`` (parameters whose gradient held a NaN or an Inf), ``nan_count`` and
  ``inf_count`` (summed over parameters), ``spikes`` (parameters at or above the spike factor);
* ``nonfinite_rank/<rank>``: at a step with a NaN/Inf, for each rank whose local data held one, how
  many parameters it held them in (``StepRecord.nonfinite_ranks``), so the ranks that went bad show
  over the run as points at the bad steps (a tag per such rank, not per rank of the world). Not in a
  single process, whose records name rank 0 for every NaN (as the plot and the callbacks leave it
  out): only in a process of a distributed world of more than one rank, or for a record that names
  another rank;
* ``grad_norm/<layer>``: the norm of each layer's gradients together (``nanscan.layers``: a few
  hundred tags at most, however many parameters);
* ``param_grad_norm/<name>``: each parameter's norm, when ``per_parameter`` (by default, for models
  of at most ``nanscan.layers.MAX_GROUPS`` parameters);
* ``log10_grad_norm``: a histogram of log10 of the step's finite, non-zero per-parameter norms, and
  beside it ``nonfinite_norms``, the count of the NaN/Inf norms the histogram cannot hold. Both are
  built from the recorded statistics, not from a copy of the gradients.

From a recorder with an update watch (``Recorder(updates=watch)``), at the records after a measured
optimizer step:

* ``update_ratio/<layer>``: each layer's ‖Δw‖/‖w‖, its parameters' update and weight norms each
  combined as one L2 norm (the layers of the gradient norms), and ``param_update_ratio/<name>`` per
  parameter when ``per_parameter``;
* ``log10_update_ratio``: a histogram of log10 of the finite, non-zero per-parameter ratios;
* ``update_spikes``: parameters whose ratio reached the spike factor times its running median.

The records of ``check_state`` (subject ``"state"``: the weights' and the optimizer state's values)
go under ``<prefix>/state/``, with ``state_norm/<layer>``, ``param_state_norm/<name>`` and
``log10_state_norm`` in place of the gradient tags, so that a sink shared by a gradient recorder and
a state recorder keeps the two apart.

TensorBoard is imported when a sink is made, not with nanscan (``pip install tensorboard``).
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from ..layers import MAX_GROUPS, Group, group_layers, group_norms
from ..records import StepRecord
from ..sinks import check_writable, process_rank, rank_known_now, ranked_path, warn_if_unwritten, writes_shared
from ._logging import parameters_by_rank


class Writer(Protocol):
    """What the sink uses of ``torch.utils.tensorboard.SummaryWriter``."""

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> None: ...

    def add_histogram(self, tag: str, values: Any, global_step: int | None = None) -> None: ...

    def flush(self) -> None: ...

    def close(self) -> None: ...


class TensorBoardSink:
    """Writes each ``StepRecord`` to TensorBoard (module notes for the tags).

    Args:
        log_dir_or_writer: a log directory (the sink opens a ``SummaryWriter`` there and closes it), an
            open ``SummaryWriter`` (the sink writes to it and leaves it open for its owner), or None
            (``SummaryWriter``'s default, ``runs/<date>_<host>``).
        prefix: the first component of every tag.
        per_parameter: write one norm per parameter too; None: only for models of at most
            ``nanscan.layers.MAX_GROUPS`` parameters, where the tag list stays readable.
        histograms: write the histogram of log10 norms and the count of non-finite norms.
        global_step: the TensorBoard step of a record (default ``record.step``), e.g. to line the
            records up with a trainer's own step count.
    """

    def __init__(
        self,
        log_dir_or_writer: str | Path | Writer | None = None,
        *,
        prefix: str = "nanscan",
        per_parameter: bool | None = None,
        histograms: bool = True,
        global_step: Callable[[StepRecord], int] | None = None,
    ) -> None:
        self._writer: Writer | None = None
        self._unwritten_check = False  # at the first record: nanscan.sinks.warn_if_unwritten
        self._summary_writer: Callable[[str | None], Writer] | None = None
        self._log_dir: str | None = None
        if log_dir_or_writer is None or isinstance(log_dir_or_writer, (str, Path)):
            # Opened on the rank that writes (nanscan.sinks' notes): rank 0 of a world, or each rank
            # with {rank} in the directory; now if the rank is known, else at the first record.
            self._summary_writer = _summary_writer_class()  # a missing TensorBoard said now, not then
            if log_dir_or_writer is not None:  # absolute: opened where it pointed when the sink was made
                self._log_dir = os.path.abspath(str(log_dir_or_writer))
                check_writable(Path(self._log_dir), "TensorBoardSink", directory=True)
        else:
            self._writer = log_dir_or_writer
        self._owns_writer = self._writer is None
        self.prefix = prefix
        self.per_parameter = per_parameter
        self.histograms = histograms
        self._global_step = global_step
        self._closed = False
        self._layer_cache: dict[str, tuple[Sequence[str], list[Group]]] = {}
        if self._owns_writer and rank_known_now():
            self._open()

    @property
    def rank_pending(self) -> bool:
        """Whether this sink has yet to decide whether it writes (nanscan.sinks.note_rank)."""
        return self._summary_writer is not None and not self._closed

    @property
    def writer(self) -> Writer | None:
        """Where the records go, the writer given or the one the sink opened; None before it opens one
        (at its first record where the rank was not known when it was made), and on a rank that
        writes none."""
        return self._writer

    def _open(self) -> Writer | None:
        if self._writer is None and self._summary_writer is not None:
            make, self._summary_writer = self._summary_writer, None  # decided once
            if self._log_dir is None:  # SummaryWriter's default directory, alike on every rank
                written, self._unwritten_check = writes_shared()
                self._writer = make(None) if written else None
            else:
                log_dir, self._unwritten_check = ranked_path(self._log_dir)
                self._writer = None if log_dir is None else make(log_dir)
        return self._writer

    def __call__(self, record: StepRecord) -> None:
        if self._closed:
            raise ValueError("nanscan.TensorBoardSink: the sink is closed")
        writer = self._open()
        if self._unwritten_check:
            self._unwritten_check = False
            warn_if_unwritten("TensorBoardSink", self._log_dir or "the default log directory")
        if writer is None:  # a rank that writes none
            return
        step = record.step if self._global_step is None else self._global_step(record)
        gradients = record.subject == "gradients"
        prefix = self.prefix if gradients else f"{self.prefix}/state"
        what = "grad" if gradients else "state"
        norm = np.asarray(record.norm, dtype=np.float64)
        nan_count = sum(record.nan_count)
        inf_count = sum(record.inf_count)
        scalars: dict[str, float] = {
            "total_norm": record.total_norm,
            "skipped": float(record.skipped),
            "nonfinite_parameters": float(len(record.nonfinite)),
            "nan_count": float(nan_count),
            "inf_count": float(inf_count),
            "spikes": float(len(record.spikes)),
        }
        if record.clip_coef is not None:
            scalars["clip_coef"] = record.clip_coef
        if record.loss_scale is not None:
            scalars["loss_scale"] = record.loss_scale
        by_rank = parameters_by_rank(record.nonfinite_ranks)
        if set(by_rank) - {0} or _in_a_world():  # a single process's rank 0 is no news (module notes)
            scalars.update((f"nonfinite_rank/{rank}", float(count)) for rank, count in by_rank.items())
        layers = self._layers_of("norms", record.names)
        for layer, layer_norm in zip(layers, group_norms(norm, layers), strict=True):
            scalars[f"{what}_norm/{layer.name}"] = float(layer_norm)
        if self._per_parameter(record.names):
            scalars.update(
                (f"param_{what}_norm/{name}", value) for name, value in zip(record.names, record.norm, strict=True)
            )
        ratio = None if record.updates is None else self._update_scalars(record, scalars)
        for tag, value in scalars.items():
            writer.add_scalar(f"{prefix}/{tag}", value, step)
        if self.histograms:
            _write_histogram(writer, f"{prefix}/log10_{what}_norm", norm, step)
            writer.add_scalar(f"{prefix}/nonfinite_norms", float(np.count_nonzero(~np.isfinite(norm))), step)
            if ratio is not None:
                _write_histogram(writer, f"{prefix}/log10_update_ratio", ratio, step)

    def _update_scalars(self, record: StepRecord, scalars: dict[str, float]) -> np.ndarray[Any, np.dtype[np.float64]]:
        """Adds a record's update-ratio tags to ``scalars``; returns the per-parameter ratios."""
        updates = record.updates
        assert updates is not None
        update_norm = np.asarray(updates.update_norm, dtype=np.float64)
        weight_norm = np.asarray(updates.weight_norm, dtype=np.float64)
        layers = self._layers_of("updates", updates.names)
        with np.errstate(divide="ignore", invalid="ignore"):
            ratio = update_norm / weight_norm
            layer_ratio = group_norms(update_norm, layers) / group_norms(weight_norm, layers)
        for layer, value in zip(layers, layer_ratio, strict=True):
            scalars[f"update_ratio/{layer.name}"] = float(value)
        if self._per_parameter(updates.names):
            scalars.update(
                (f"param_update_ratio/{name}", float(r)) for name, r in zip(updates.names, ratio, strict=True)
            )
        scalars["update_spikes"] = float(len(updates.spikes))
        return ratio

    def _per_parameter(self, names: Sequence[str]) -> bool:
        return self.per_parameter if self.per_parameter is not None else len(names) <= MAX_GROUPS

    def __getstate__(self) -> dict[str, Any]:
        """A copy for another process (Lightning's ddp_spawn pickles the callbacks, and a recorder's
        sinks with them): a writer the sink opened is flushed and left behind, and the copy opens its
        own in the new process, on the rank that writes; a writer given to the sink is copied as pickle
        copies it (a ``SummaryWriter`` cannot be)."""
        state = self.__dict__.copy()
        if self._owns_writer:
            self.flush()
            state.update(_writer=None, _summary_writer=_summary_writer_class())
        return state

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        """Closes the writer the sink opened; flushes one it was given (its owner closes that)."""
        if self._closed:
            return
        self._closed = True
        self._summary_writer = None
        if self._writer is None:
            return
        if self._owns_writer:
            self._writer.close()
        else:
            self._writer.flush()

    def _layers_of(self, key: str, names: Sequence[str]) -> list[Group]:
        """The layers of a list of names (``key``: which list: the norms' or the updates'). A recorder
        hands every record of one layout the same names object: grouped once per layout."""
        cached = self._layer_cache.get(key)
        if cached is None or (names is not cached[0] and list(names) != list(cached[0])):
            cached = (names, group_layers(names, MAX_GROUPS))
        self._layer_cache[key] = (names, cached[1])
        return cached[1]


def _write_histogram(writer: Writer, tag: str, values: np.ndarray[Any, np.dtype[np.float64]], step: int) -> None:
    # log10 of 0 has no bin: a zero (a parameter whose gradient is all zeros, a weight that did not
    # move) is left out, as are NaN and Inf.
    positive = values[np.isfinite(values) & (values > 0)]
    if positive.size:
        writer.add_histogram(tag, np.log10(positive), step)


def _summary_writer_class() -> Callable[[str | None], Writer]:
    try:  # torch.utils.tensorboard needs the tensorboard package, and says so less helpfully
        importlib.import_module("tensorboard")
    except ImportError:
        raise ImportError(
            "nanscan.integrations.tensorboard needs TensorBoard: pip install tensorboard (or nanscan[tensorboard])"
        ) from None
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


__all__ = ["TensorBoardSink", "Writer"]


def _in_a_world() -> bool:
    """Whether this process is one rank of a distributed world of more than one."""
    _, world, initialized = process_rank()
    return initialized and world > 1
