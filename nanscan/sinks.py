"""Where a Recorder's records go. A sink is any callable taking one ``StepRecord``; if it also has
``flush()`` or ``close()``, the recorder calls them after each batch of records and at its close.

``JSONLSink`` and ``CSVSink`` are here (the standard library only); TensorBoard is
``nanscan.integrations.tensorboard.TensorBoardSink``. For W&B, MLflow or anything else, pass a
function::

    recorder = nanscan.Recorder(sinks=[lambda r: wandb.log({"grad_norm": r.total_norm}, step=r.step)])
"""

from __future__ import annotations

import csv
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Protocol

from .records import StepRecord, layout_line


class Sink(Protocol):
    """What a Recorder calls with each record (``flush``/``close`` are optional, looked up by name)."""

    def __call__(self, record: StepRecord, /) -> None: ...


def _cut_incomplete_last_line(path: Path, sink: str) -> None:
    """Before appending to ``path``: a last line without its end of line (a process killed while
    writing it) is cut off, with a RuntimeWarning naming it, so that the records appended next do
    not run on from it into a damaged line in the middle of the file."""
    if not path.is_file():
        return
    with path.open("r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(size - 1)
        if f.read(1) == b"\n":
            return
        keep, end, block = 0, size, 1 << 16
        while end > 0:  # back to the last end of line
            start = max(0, end - block)
            f.seek(start)
            found = f.read(end - start).rfind(b"\n")
            if found >= 0:
                keep = start + found + 1
                break
            end = start
        f.seek(0)
        line, left = 1, keep
        while left > 0:
            chunk = f.read(min(left, 1 << 20))
            line, left = line + chunk.count(b"\n"), left - len(chunk)
        f.truncate(keep)
    warnings.warn(
        f"nanscan.{sink}: {path}:{line} was cut short ({size - keep} bytes, no end of line: a process killed "
        "while writing it?); removed it before appending",
        RuntimeWarning,
        stacklevel=3,
    )


class _FileSink:
    """A sink that appends to a file it owns: opened at construction, flushed after each batch of
    records, closed with the recorder. An incomplete last line left by a killed process is cut off
    first (with a warning)."""

    def __init__(self, path: str | Path, newline: str | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        _cut_incomplete_last_line(self.path, type(self).__name__)
        self._file: IO[str] | None = self.path.open("a", newline=newline)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({str(self.path)!r})"

    def _open_file(self) -> IO[str]:
        if self._file is None:
            raise ValueError(f"nanscan.{type(self).__name__}: {self.path} is closed")
        return self._file

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class JSONLSink(_FileSink):
    """Writes the JSONL schema of nanscan.records: a layout line whenever the parameters change, then
    one line per step. Appends to an existing file (a new Recorder counts its steps from 0 again)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(path)
        self._names: object = None
        self._modules: Sequence[str] | None = None
        self._update_names: Sequence[str] | None = None
        self._subject = "gradients"
        self._layout_written = False

    def __call__(self, record: StepRecord) -> None:
        file = self._open_file()
        # The watched modules: a record with activations names them; one without (no forward sampled
        # since the record before) is of the same recorder's layout, so its step line goes under the
        # modules last written, with "activations": null. Every record of a recorder with an update
        # watch names the watch's parameters.
        modules = record.activations.modules if record.activations is not None else self._modules
        updated = record.updates.names if record.updates is not None else record.update_names
        if (
            not self._layout_written
            or _changed(record.names, self._names)
            or (modules is not None and _changed(modules, self._modules))
            or (updated is not None and _changed(updated, self._update_names))
            or record.subject != self._subject
        ):
            line = layout_line(record.names, modules, updated, record.subject)
            file.write(json.dumps(line, allow_nan=False) + "\n")
            self._layout_written = True
        self._names = record.names
        self._modules = modules
        self._update_names = updated
        self._subject = record.subject
        line = record.to_json(with_activations=modules is not None, with_updates=updated is not None)
        file.write(json.dumps(line, allow_nan=False) + "\n")


def _changed(names: Sequence[str], before: object) -> bool:
    """Whether a list of names differs from the one written before (the same object, as a recorder
    hands every record of a layout, at the cost of one identity test)."""
    return names is not before and (before is None or list(names) != list(before))  # type: ignore[call-overload]


class CSVSink(_FileSink):
    """Writes one row per (step, parameter), long format (a pandas ``read_csv`` away from a pivot):
    ``step, parameter`` and the per-parameter statistics, then the step's totals repeated on each of
    its rows, then ``nonfinite_ranks``: on the row of a parameter whose gradient held a NaN/Inf, the
    ranks whose local data held it, space-separated (``"1 3"``; empty on every other row, and where
    the record has no ranks); ``subject`` (``gradients``, or ``state`` for ``check_state``'s records);
    then, from a recorder with an update watch, the parameter's update ratio ‖Δw‖/‖w‖ and its spike
    ratio at the records after a measured optimizer step (empty elsewhere; a parameter the optimizer
    updates that has no gradient this step gets a row of its own with only these). Non-finite values
    are written as Python writes them (``nan``, ``inf``).

    Appends to an existing file only if its header is this one: a file begun by a nanscan with other
    columns is refused, rather than given rows that do not match its header. A step's rows are
    written together; a process killed while writing them leaves the rows before the cut (the last
    one cut short, which the next CSVSink on the file removes), so a step of a file that ends
    abruptly may lack some of its parameters."""

    COLUMNS = (
        "step",
        "parameter",
        "nan_count",
        "inf_count",
        "min",
        "max",
        "norm",
        "spike_ratio",
        "total_norm",
        "finite",
        "clip_coef",
        "max_norm",
        "skipped",
        "loss_scale",
        "nonfinite_ranks",
        "subject",
        "update_ratio",
        "update_spike_ratio",
    )

    def __init__(self, path: str | Path) -> None:
        _cut_incomplete_last_line(Path(path), type(self).__name__)  # a header cut short goes too
        new = not Path(path).exists() or Path(path).stat().st_size == 0
        if not new:
            with Path(path).open(newline="") as existing:
                header = next(csv.reader(existing), [])
            if tuple(header) != self.COLUMNS:
                raise ValueError(
                    f"nanscan.CSVSink: {path} has the columns {header}, not {list(self.COLUMNS)} (written by "
                    "another nanscan version?); write to a new file"
                )
        super().__init__(path, newline="")
        self._writer = csv.writer(self._open_file())
        if new:
            self._writer.writerow(self.COLUMNS)

    def __call__(self, record: StepRecord) -> None:
        self._open_file()
        totals = (
            record.total_norm,
            int(record.finite),
            "" if record.clip_coef is None else record.clip_coef,
            "" if record.max_norm is None else record.max_norm,
            int(record.skipped),
            "" if record.loss_scale is None else record.loss_scale,
        )
        ranks = record.nonfinite_ranks or {}
        updates: dict[str, tuple[float, float]] = {}
        if record.updates is not None:
            figures = record.updates
            updates = dict(zip(figures.names, zip(figures.ratio, figures.spike_ratio, strict=True), strict=True))
        no_update = ("", "")
        self._writer.writerows(
            (
                record.step,
                name,
                nan,
                inf,
                lo,
                hi,
                norm,
                ratio,
                *totals,
                " ".join(map(str, ranks.get(name, ()))),
                record.subject,
                *updates.pop(name, no_update),
            )
            for name, nan, inf, lo, hi, norm, ratio in zip(
                record.names,
                record.nan_count,
                record.inf_count,
                record.min,
                record.max,
                record.norm,
                record.spike_ratio,
                strict=True,
            )
        )
        # What is left: parameters the optimizer updated that have no gradient row this step.
        self._writer.writerows(
            (record.step, name, *[""] * 6, *totals, "", record.subject, *figures) for name, figures in updates.items()
        )
