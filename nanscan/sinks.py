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
from pathlib import Path
from typing import IO, Protocol

from .records import StepRecord, layout_line


class Sink(Protocol):
    """What a Recorder calls with each record (``flush``/``close`` are optional, looked up by name)."""

    def __call__(self, record: StepRecord) -> None: ...


class JSONLSink:
    """Writes the JSONL schema of nanscan.records: a layout line whenever the parameters change, then
    one line per step. Appends to an existing file (a new Recorder counts its steps from 0 again)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file: IO[str] | None = self.path.open("a")
        self._names: object = None

    def __call__(self, record: StepRecord) -> None:
        if self._file is None:
            raise ValueError(f"nanscan.JSONLSink: {self.path} is closed")
        if record.names is not self._names and list(record.names) != list(self._names or ()):  # type: ignore[call-overload]
            self._file.write(json.dumps(layout_line(record.names), allow_nan=False) + "\n")
        self._names = record.names
        self._file.write(json.dumps(record.to_json(), allow_nan=False) + "\n")

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class CSVSink:
    """Writes one row per (step, parameter), long format (a pandas ``read_csv`` away from a pivot):
    ``step, parameter`` and the per-parameter statistics, then the step's totals repeated on each of
    its rows. Non-finite values are written as Python writes them (``nan``, ``inf``)."""

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
    )

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        new = not self.path.exists() or self.path.stat().st_size == 0
        self._file: IO[str] | None = self.path.open("a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(self.COLUMNS)

    def __call__(self, record: StepRecord) -> None:
        if self._file is None:
            raise ValueError(f"nanscan.CSVSink: {self.path} is closed")
        totals = (
            record.total_norm,
            int(record.finite),
            "" if record.clip_coef is None else record.clip_coef,
            "" if record.max_norm is None else record.max_norm,
            int(record.skipped),
            "" if record.loss_scale is None else record.loss_scale,
        )
        self._writer.writerows(
            (record.step, name, nan, inf, lo, hi, norm, ratio, *totals)
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

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
