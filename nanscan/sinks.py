"""Where a Recorder's records go. A sink is any callable taking one ``StepRecord``; if it also has
``flush()`` or ``close()``, the recorder calls them after each batch of records and at its close.

``JSONLSink`` and ``CSVSink`` are here (the standard library only); TensorBoard is
``nanscan.integrations.tensorboard.TensorBoardSink``. For W&B, MLflow or anything else, pass a
function::

    recorder = nanscan.Recorder(sinks=[lambda r: wandb.log({"grad_norm": r.total_norm}, step=r.step)])

In a distributed run every rank runs the same script, so every rank makes the same sinks. A file
sink (``JSONLSink``, ``CSVSink``, ``TensorBoardSink``'s log directory) then writes on rank 0 alone,
as the frameworks' loggers do: where the checks reduce across ranks (DTensors, FSDP1,
``process_group``) or DDP has all-reduced the gradients, every rank's records hold the model's
figures, and one file of them is the run's record. A path holding ``{rank}`` (``"run-{rank}.jsonl"``)
gives each rank a file of its own instead, for checks that each rank makes of its own gradients
(pipeline stages checked without ``process_group``). A sink opens its file (and cuts off a damaged
last line) when it is made if the process's rank is known then (torch.distributed initialized, or
torchrun's ``RANK`` and ``WORLD_SIZE``); otherwise at its first record, by when the checks have
initialized torch.distributed (Lightning's DDP starts its ranks, and a script makes its sinks,
before Lightning initializes it). The rank torch.distributed gave last is kept (``process_rank``),
for a recorder read out after ``destroy_process_group()``.
"""

from __future__ import annotations

import csv
import json
import os
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any, Protocol

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


RANK_FIELD = "{rank}"
"""In a sink's path, this process's rank: one file per rank (module notes)."""


_noted: list[tuple[int, int]] = []  # the rank and world torch.distributed last gave (one entry)


def process_rank() -> tuple[int, int, bool]:
    """This process's rank and world size, and whether torch.distributed says so: while it is
    initialized, its own; after ``destroy_process_group()``, what it said last (a recorder read out
    at the job's end, after the group is gone, still writes as its rank); before it, the launcher's
    (``RANK`` and ``WORLD_SIZE``, which torchrun and most launchers set); else a process of its own,
    rank 0 of 1."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        noted = (dist.get_rank(), dist.get_world_size())
        _noted[:] = [noted]
        return (*noted, True)
    if _noted:
        return (*_noted[0], True)
    rank, world = os.environ.get("RANK"), os.environ.get("WORLD_SIZE")
    if rank is not None and world is not None and rank.isdigit() and world.isdigit():
        return int(rank), int(world), False
    return 0, 1, False


def note_rank() -> bool:
    """Notes the rank torch.distributed gives, if it is initialized (``process_rank`` keeps it), for a
    sink that decides its file later, perhaps after the group is gone; returns whether the rank is
    still to be noted. A recorder calls it at each append while a sink is undecided."""
    if _noted:
        return False
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        process_rank()
        return False
    return True


def rank_known_now() -> bool:
    """Whether this process's rank is known already: from torch.distributed, or a launcher's
    ``RANK`` and ``WORLD_SIZE`` (torchrun)."""
    return process_rank()[2] or ("RANK" in os.environ and "WORLD_SIZE" in os.environ)


def writes_shared() -> tuple[bool, bool]:
    """Whether this process writes a target every rank names alike (rank 0 alone does, in a world
    of more than one rank: module notes); and, where it does not, whether its rank came from the
    launcher alone (torch.distributed not initialized yet): see ``warn_if_unwritten``."""
    rank, world, initialized = process_rank()
    written = world == 1 or rank == 0
    return written, not (written or initialized)


def ranked_path(template: str) -> tuple[str | None, bool]:
    """The path that this process writes for a sink given ``template``: ``{rank}`` replaced by its
    rank; a template without ``{rank}``, where ``writes_shared`` says (None on the ranks that write
    nothing). And whether the rank came from the launcher alone (``writes_shared``)."""
    if RANK_FIELD in template:
        return template.replace(RANK_FIELD, str(process_rank()[0])), False
    written, launcher_only = writes_shared()
    return (template if written else None), launcher_only


def warn_if_unwritten(owner: str, template: str) -> None:
    """At the first record of a sink that writes nothing because the launcher named this process a
    rank other than 0: if torch.distributed is still not initialized, the process checks its own
    gradients, and its records, which rank 0's file does not hold, are lost; say so (once)."""
    rank, world, initialized = process_rank()
    if not initialized:
        warnings.warn(
            f"nanscan.{owner}: this process is rank {rank} of {world} by its launcher's RANK and WORLD_SIZE, but "
            f"torch.distributed is not initialized, so its checks are its own; rank 0 alone writes {template}, "
            f"and this rank's records are not written. Put {RANK_FIELD} in the path for a file per rank",
            RuntimeWarning,
            stacklevel=2,
        )


def check_writable(path: Path, owner: str, *, directory: bool = False) -> None:
    """Refuses, when a sink is made, a path it could not write when it opens it: a file where a
    directory is wanted or the reverse, or one (or the nearest existing folder above it) it may not
    write. Nothing is created (each rank's path is its own: ``{rank}`` is tried as 0)."""
    path = Path(str(path).replace(RANK_FIELD, "0"))
    if path.exists() and path.is_dir() != directory:
        raise (NotADirectoryError if directory else IsADirectoryError)(
            f"nanscan.{owner}: {path} is {'a file, not a directory' if directory else 'a directory, not a file'}"
        )
    existing = path
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing != path and not existing.is_dir():
        raise NotADirectoryError(f"nanscan.{owner}: {path} lies under {existing}, a file")
    if not os.access(existing, os.W_OK):
        raise PermissionError(f"nanscan.{owner}: {path} cannot be written ({existing} is not writable)")


class _FileSink:
    """A sink that appends to a file it owns, on the rank that writes it (every rank, with ``{rank}``
    in the path; else rank 0): opened when made where the rank is known then, else at its first
    record (module notes), flushed after each batch of records, closed with the recorder. An
    incomplete last line left by a killed process is cut off when the file is opened (with a
    warning)."""

    def __init__(self, path: str | Path, newline: str | None = None) -> None:
        self.template = str(path)
        # Absolute now: a sink opened at its first record opens where the path pointed when it was made.
        self._where = os.path.abspath(self.template)
        check_writable(Path(path), type(self).__name__)
        self._newline = newline
        self._file: IO[str] | None = None
        self._decided = False  # whether this process's path is known
        self._unwritten_check = False  # at the first record: warn_if_unwritten
        self._closed = False
        self.path: Path | None = None
        """The file this process writes: None before it is opened, and on a rank that writes none."""
        # Opened now where the rank is known, as every sink was before ranks mattered. A file opened
        # later is also what torch's gloo tolerated worst at exit: a process that leaves its group to
        # the interpreter's end (as the Hugging Face Trainer does) aborted there in about half of the
        # runs with the files opened at the first record, one in ten as now (pytorch/pytorch#190489).
        if rank_known_now():
            self._open_file()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.template!r})"

    def _open_file(self) -> IO[str] | None:
        """The file to append to, opened at the first call; None on a rank that writes none. A file
        the sink refuses (``_opened`` raises) is closed again, and tried again at the next record, so
        that each record's failure is said (the recorder warns of a failing sink), never skipped."""
        if self._closed:
            raise ValueError(f"nanscan.{type(self).__name__}: {self.template} is closed")
        if self._file is None:
            if not self._decided:
                chosen, self._unwritten_check = ranked_path(self._where)
                self.path, self._decided = (None if chosen is None else Path(chosen)), True
            if self.path is None:
                return None
            self._check_existing(self.path)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            _cut_incomplete_last_line(self.path, type(self).__name__)
            file = self.path.open("a", newline=self._newline)
            try:
                self._opened(file)
            except BaseException:
                file.close()
                raise
            self._file = file
        return self._file

    @property
    def rank_pending(self) -> bool:
        """Whether this sink has yet to decide which file it writes (``note_rank``)."""
        return not self._decided and not self._closed

    def _record_file(self) -> IO[str] | None:
        """``_open_file`` for a record: also, at the first record of a rank that writes no file, the
        warning ``warn_if_unwritten`` gives."""
        file = self._open_file()
        if self._unwritten_check:
            self._unwritten_check = False
            warn_if_unwritten(type(self).__name__, self.template)
        return file

    def _check_existing(self, path: Path) -> None:
        """What a sink checks of an existing file before it touches it (nothing, by default); raising
        refuses the file, unchanged."""

    def _opened(self, file: IO[str]) -> None:
        """What a sink writes first into a file it has just opened (nothing, by default)."""

    def __getstate__(self) -> dict[str, Any]:
        """A copy for another process (Lightning's ddp_spawn pickles the callbacks, and a recorder's
        sinks with them): flushed, then copied unopened, so that the new process decides which rank
        writes and opens the file itself."""
        self.flush()
        state = self.__dict__.copy()
        state.update(_file=None, _decided=False, path=None)
        return state

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        self._closed = True
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

    def __getstate__(self) -> dict[str, Any]:
        return super().__getstate__() | {"_layout_written": False}  # a new process's lines begin with one

    def __call__(self, record: StepRecord) -> None:
        file = self._record_file()
        if file is None:  # a rank that writes no file (module notes)
            return
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
        self._writer: Any = None  # set when the file is opened (perhaps by the base's constructor)
        if RANK_FIELD not in str(path):  # else each rank's file is looked at when it opens it
            self._check_header(Path(path))
        super().__init__(path, newline="")

    def _check_header(self, path: Path) -> bool:
        """Whether ``path`` is new (absent or empty); a file with other columns is refused. A header
        cut short does not count: the file is begun again (``_cut_incomplete_last_line``)."""
        if not path.exists() or path.stat().st_size == 0:
            return True
        with path.open(newline="") as existing:
            first = existing.readline()
        if not first.endswith("\n"):
            return True
        header = next(csv.reader([first]), [])
        if tuple(header) != self.COLUMNS:
            raise ValueError(
                f"nanscan.CSVSink: {path} has the columns {header}, not {list(self.COLUMNS)} (written by "
                "another nanscan version?); write to a new file"
            )
        return False

    def __getstate__(self) -> dict[str, Any]:
        return super().__getstate__() | {"_writer": None}

    def _check_existing(self, path: Path) -> None:
        self._check_header(path)  # before a cut line is removed: a file of other columns is left whole

    def _opened(self, file: IO[str]) -> None:
        assert self.path is not None
        self._writer = csv.writer(file)
        if self._check_header(self.path):
            self._writer.writerow(self.COLUMNS)

    def __call__(self, record: StepRecord) -> None:
        if self._record_file() is None:  # a rank that writes no file (module notes)
            return
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
