"""Pictures of a recorded run: ``python -m nanscan plot RUN.jsonl -o run.png``, or ``plot_run``.

One figure, three panels sharing the step axis (four with an activation watch's figures):

* a status strip: the steps that were non-finite, skipped by the optimizer, or held a spike;
* a heatmap of log10 gradient norm, parameter (row) by step (column): NaN norms red, Inf norms
  magenta, a parameter absent from a step's layout blank, spikes ringed, and the first non-finite step
  marked with the names of its parameters and, in a distributed run, the ranks whose local data held
  them (``StepRecord.nonfinite_ranks``);
* the total norm over steps, with the clip threshold when the records have one;
* when the records carry an activation watch's figures (``Recorder(activations=watch)``), a heatmap
  of log10 activation amax, module by step: a step with no sampled forward shows the last sampled
  one's (and says so), values over fp16's 65504 in orange, NaN/Inf outputs red, fp16's limit marked
  on its colour bar, the first module whose outputs went non-finite named; above ``MAX_ROWS``
  modules, the ``MAX_ROWS`` with the largest amax (every non-finite one among them), in model order;
* when the records carry an update watch's figures (``Recorder(updates=watch)``), a heatmap of log10
  update ratio ‖Δw‖/‖w‖, parameter by step: a record after no measured optimizer step shows the last
  measured one's (and says so), NaN/Inf ratios red, spikes (a ratio at or above the recorder's spike
  factor times its running median) ringed, 1e-3 (the ratio of healthy training, by rule of thumb)
  marked on its colour bar; above ``MAX_ROWS`` parameters a row is a layer, its ratio that of its
  parameters' update and weight norms each combined as one L2 norm.

A run of ``check_state`` records (subject ``"state"``) is drawn the same way, its norms those of the
weights and the optimizer state (rows ``fc.weight``, ``fc.weight:exp_avg_sq``; grouped, ``fc`` and
``fc:exp_avg_sq``).

A file that holds several runs (a job resumed or run again, its JSONLSink appending to the same
file: the step numbers start over) is drawn whole, its runs side by side in file order, with a solid
line across every panel where each later run begins (``run 2: steps from 0``) and the total norm's
line broken there, so that neither the axis nor the curve passes one run off as the continuation of
another.

Large runs are reduced before drawing, never by averaging. Above ``MAX_ROWS`` parameters a row is a
layer (``nanscan.layers``: a group's norm is its members' norms combined as one L2 norm, NaN or Inf
if any member's is). Above ``MAX_COLUMNS`` records a column is a bin of consecutive records holding
the largest finite norm of the bin and every flag raised in it, so that one NaN in ten thousand steps
still shows.

matplotlib is imported when a picture is drawn, never with this module (``nanscan[plot]``).
"""

from __future__ import annotations

import argparse
import errno
import io
import itertools
import math
import sys
import warnings
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from .layers import Group, group_layers, group_norms, group_reduce, layer_name
from .records import FP16_MAX, StepRecord, UpdateRecord, iter_jsonl, ranks_label, spike_mask

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

MAX_ROWS = 200
"""Most heatmap rows: above this many parameters, rows are layers (a row stays >= 2 pixels tall)."""
MAX_COLUMNS = 500
"""Most heatmap columns: above this many records, a column is a bin of records (>= 2 pixels wide)."""

NAN_COLOR = "#e41a1c"
INF_COLOR = "#ff00ff"
SKIPPED_COLOR = "#555555"
SPIKE_COLOR = "#ff9f1c"
THRESHOLD_COLOR = "#444444"
OVER_FP16_COLOR = "#ff7f00"
UPDATE_SPIKE_COLOR = "#39d353"
DPI = 110
LABEL_FONT = 6.5
MARKED_CELLS = 300
"""Flagged cells up to this many are also ringed: a lone NaN cell two pixels wide is easy to miss."""
SPARSE_COLUMN = 10
SPIKE_MARKS = 2000
FIRST_NAMES = 3
"""Parameter names shown for the first non-finite step before "+N more"."""


@dataclass(frozen=True)
class Run:
    """A run's records as arrays, one column per record in file order.

    ``names`` is the union of every layout's names, in order of first appearance; a parameter absent
    from a record's layout is ``missing`` there (its norm 0, no flag). ``nan`` and ``inf`` say that a
    parameter's gradient held a NaN (or its norm is NaN) and, failing that, an Inf. ``max_norm`` is NaN
    where the step was not clipped. ``first_nonfinite`` is the record index and parameter names of the
    first non-finite record, or None. ``first_ranks`` maps those names to the ranks whose local data
    held their NaN/Inf, when the run is distributed with a rank attribution (``_has_ranks``), else
    None. ``run_starts`` holds the record indices at which a later run of the same file begins: where
    the step numbers go back (a job resumed or run again, appending to the same JSONL).
    """

    names: list[str]
    steps: NDArray[np.int64]
    norm: NDArray[np.float64]
    missing: NDArray[np.bool_]
    nan: NDArray[np.bool_]
    inf: NDArray[np.bool_]
    spike: NDArray[np.bool_]
    total_norm: NDArray[np.float64]
    max_norm: NDArray[np.float64]
    skipped: NDArray[np.bool_]
    finite: NDArray[np.bool_]
    first_nonfinite: tuple[int, list[str]] | None
    first_ranks: dict[str, list[int]] | None = None
    activations: Activations | None = None
    updates: Updates | None = None
    subject: str = "gradients"
    run_starts: tuple[int, ...] = ()


@dataclass(frozen=True)
class Activations:
    """The activation figures of a run's records, module (row) by record (column): ``amax`` NaN where
    the record holds none (no forward sampled), ``nonfinite`` where the module's outputs held a NaN or
    an Inf; ``first_nonfinite`` the record index and module names of the first such record. Only the
    modules with figures at some step (called, or non-finite) are rows."""

    modules: list[str]
    amax: NDArray[np.float64]
    nonfinite: NDArray[np.bool_]
    first_nonfinite: tuple[int, list[str]] | None


@dataclass(frozen=True)
class Updates:
    """The update ratios of a run's records, parameter (row, the union of the update names in order of
    first appearance) by record (column): ``update_norm`` and ``weight_norm`` NaN where the record
    holds none; ``measured`` the records after a measured optimizer step; ``spike`` where a ratio
    reached its spike factor times its running median."""

    names: list[str]
    update_norm: NDArray[np.float64]
    weight_norm: NDArray[np.float64]
    spike: NDArray[np.bool_]
    measured: NDArray[np.bool_]


@dataclass(frozen=True)
class Grid:
    """What the heatmap and the status strip draw: rows (parameters or layers) by columns (records or
    bins of ``per_column`` records). ``value`` is the norm where it is finite, else NaN; a cell's flags
    say why it is not (``nan`` wins over ``inf``, both over ``missing``). ``nonfinite``, ``skipped`` and
    ``spiked`` flag whole columns."""

    groups: list[Group]
    value: NDArray[np.float64]
    nan: NDArray[np.bool_]
    inf: NDArray[np.bool_]
    missing: NDArray[np.bool_]
    spike: NDArray[np.bool_]
    nonfinite: NDArray[np.bool_]
    skipped: NDArray[np.bool_]
    spiked: NDArray[np.bool_]
    per_column: int


def load_run(source: str | Path | Iterable[StepRecord]) -> Run:
    """The records of a JSONL file (``JSONLSink``), or the records themselves, as a ``Run``."""
    records = iter_jsonl(source) if isinstance(source, (str, Path)) else source
    index: dict[str, int] = {}
    layout: Sequence[str] | None = None
    rows = np.empty(0, dtype=np.intp)
    columns: list[tuple[NDArray[np.intp], NDArray[np.float64], NDArray[np.bool_], NDArray[np.bool_], NDArray[np.bool_]]]
    columns = []
    steps: list[int] = []
    totals: list[tuple[float, float, bool, bool]] = []
    first: tuple[int, list[str]] | None = None
    first_ranks: dict[str, list[int]] | None = None
    named_ranks: set[int] = set()  # every rank any record names, for _has_ranks
    activation_columns: list[tuple[int, dict[str, tuple[float, bool]]]] = []  # (record index, module -> figures)
    update_columns: list[tuple[int, UpdateRecord]] = []
    subjects: set[str] = set()
    run_starts: list[int] = []
    for record in records:
        subjects.add(record.subject)
        if steps and record.step <= steps[-1]:  # a recorder's steps only grow: a new run begins here
            run_starts.append(len(steps))
        if record.updates is not None:
            update_columns.append((len(steps), record.updates))
        if record.activations is not None:
            figures = record.activations
            activation_columns.append(
                (
                    len(steps),
                    {
                        m: (amax, nan + inf > 0)
                        for m, amax, nan, inf in zip(
                            figures.modules, figures.amax, figures.nan_count, figures.inf_count, strict=True
                        )
                    },
                )
            )
        if layout is None or (record.names is not layout and list(record.names) != list(layout)):
            rows = np.array([index.setdefault(name, len(index)) for name in record.names], dtype=np.intp)
        layout = record.names
        norm = np.asarray(record.norm, dtype=np.float64)
        nan = (np.asarray(record.nan_count) > 0) | np.isnan(norm)
        inf = ((np.asarray(record.inf_count) > 0) | np.isinf(norm)) & ~nan
        spike = spike_mask(np.asarray(record.spike_ratio, dtype=np.float64), record.spike_factor)
        if first is None and (not record.finite or nan.any() or inf.any()):
            first = (len(steps), record.nonfinite)
            first_ranks = record.nonfinite_ranks
        if record.nonfinite_ranks:  # None (schema 1) or {} (a finite step) on almost every record
            named_ranks.update(rank for ranks in record.nonfinite_ranks.values() for rank in ranks)
        columns.append((rows, norm, nan, inf, spike))
        steps.append(record.step)
        max_norm = math.nan if record.max_norm is None else record.max_norm
        totals.append((record.total_norm, max_norm, record.skipped, record.finite))
    if not steps:
        raise ValueError(
            f"nanscan: {source} has no step records to plot"
            if isinstance(source, (str, Path))
            else "nanscan: no step records to plot"
        )
    if not index:
        raise ValueError("nanscan: the records name no parameters: nothing to plot")
    shape = (len(index), len(steps))
    norm_grid = np.zeros(shape)
    missing = np.ones(shape, dtype=bool)
    flags = [np.zeros(shape, dtype=bool) for _ in range(3)]
    for j, (column_rows, norm, *column_flags) in enumerate(columns):
        norm_grid[column_rows, j] = norm
        missing[column_rows, j] = False
        for target, flag in zip(flags, column_flags, strict=True):
            target[column_rows, j] = flag
    total_norm, max_norms, skipped, finite = (np.array(column) for column in zip(*totals, strict=True))
    return Run(
        names=list(index),
        steps=np.array(steps, dtype=np.int64),
        norm=norm_grid,
        missing=missing,
        nan=flags[0],
        inf=flags[1],
        spike=flags[2],
        total_norm=total_norm.astype(np.float64),
        max_norm=max_norms.astype(np.float64),
        skipped=skipped.astype(bool),
        finite=finite.astype(bool),
        first_nonfinite=first,
        first_ranks=first_ranks if _has_ranks(named_ranks) else None,
        activations=_activations(activation_columns, len(steps)),
        updates=_updates(update_columns, len(steps)),
        subject="state" if subjects == {"state"} else "gradients",
        run_starts=tuple(run_starts),
    )


def _updates(columns: list[tuple[int, UpdateRecord]], records: int) -> Updates | None:
    """The update-ratio grid of a run (None when no record holds update figures)."""
    if not columns:
        return None
    row: dict[str, int] = {}
    for _, figures in columns:
        for name in figures.names:
            row.setdefault(name, len(row))
    shape = (len(row), records)
    update_norm, weight_norm = np.full(shape, np.nan), np.full(shape, np.nan)
    spike = np.zeros(shape, dtype=bool)
    measured = np.zeros(records, dtype=bool)
    for j, figures in columns:
        rows = np.array([row[name] for name in figures.names], dtype=np.intp)
        update_norm[rows, j] = figures.update_norm
        weight_norm[rows, j] = figures.weight_norm
        multiple = np.asarray(figures.spike_ratio, dtype=np.float64)
        spike[rows, j] = spike_mask(multiple, figures.spike_factor)
        measured[j] = True
    return Updates(list(row), update_norm, weight_norm, spike, measured)


def _activations(columns: list[tuple[int, dict[str, tuple[float, bool]]]], records: int) -> Activations | None:
    """The activation grid of a run (None when no record holds figures)."""
    if not columns:
        return None
    seen: dict[str, None] = {}  # modules with figures somewhere, in order of first appearance
    for _, figures in columns:
        for module, (amax, nonfinite) in figures.items():
            if amax > 0 or nonfinite:
                seen.setdefault(module)
    modules = list(seen)
    row = {module: i for i, module in enumerate(modules)}
    amax_grid = np.full((len(modules), records), np.nan)
    nonfinite_grid = np.zeros((len(modules), records), dtype=bool)
    first: tuple[int, list[str]] | None = None
    for j, figures in columns:
        for module, (amax, nonfinite) in figures.items():
            if module in row:
                amax_grid[row[module], j] = amax
                nonfinite_grid[row[module], j] = nonfinite
        bad = [module for module, (_, nonfinite) in figures.items() if nonfinite]
        if first is None and bad:
            first = (j, bad)
    return Activations(modules, amax_grid, nonfinite_grid, first)


def _has_ranks(named_ranks: set[int]) -> bool:
    """Whether the ranks a run's records name are a distributed run's attribution: some record names
    a rank other than 0. A single process records rank 0 for every NaN/Inf (``StepRecord``), and a
    record does not say whether one or rank 0 of a world made it, so a run that only ever names rank
    0 is drawn as a single process's, without ranks: a distributed run whose every NaN/Inf was rank
    0's too (a record that carried its world size would tell the two apart)."""
    return any(rank != 0 for rank in named_ranks)


def group_rows(run: Run, max_rows: int = MAX_ROWS) -> Grid:
    """The heatmap grid of a run, one column per record: a row per parameter, or above ``max_rows``
    parameters a row per layer (``nanscan.layers.group_layers``)."""
    if len(run.names) <= max_rows:
        groups = [Group(name, (i,)) for i, name in enumerate(run.names)]
        norm = run.norm  # as recorded, not the root of its square
    else:
        groups = group_layers(run.names, max_rows)
        norm = group_norms(run.norm, groups)  # missing members hold 0: they add nothing
    nan = group_reduce(run.nan, groups, np.logical_or).astype(bool) | np.isnan(norm)
    inf = (group_reduce(run.inf, groups, np.logical_or).astype(bool) | np.isinf(norm)) & ~nan
    missing = group_reduce(run.missing, groups, np.logical_and).astype(bool)
    return Grid(
        groups=groups,
        value=np.where(np.isfinite(norm) & ~missing, norm, np.nan),
        nan=nan,
        inf=inf,
        missing=missing,
        spike=group_reduce(run.spike, groups, np.logical_or).astype(bool),
        nonfinite=~run.finite | nan.any(axis=0) | inf.any(axis=0),
        skipped=run.skipped.copy(),
        spiked=np.asarray(run.spike.any(axis=0)),
        per_column=1,
    )


def downsample(grid: Grid, max_columns: int = MAX_COLUMNS) -> Grid:
    """The grid with runs of ``per_column`` consecutive columns merged into one, so that at most
    ``max_columns`` are left: the largest finite norm of each bin, any flag raised in it, and missing
    only where every column of the bin was."""
    columns = grid.value.shape[1]
    if columns <= max_columns:
        return grid
    width = math.ceil(columns / max_columns)
    starts = np.arange(0, columns, width)

    def any_(flags: NDArray[np.bool_]) -> NDArray[np.bool_]:
        return np.logical_or.reduceat(flags, starts, axis=-1).astype(bool)

    return Grid(
        groups=grid.groups,
        value=np.fmax.reduceat(grid.value, starts, axis=1),  # fmax skips the NaNs of non-finite cells
        nan=any_(grid.nan),
        inf=any_(grid.inf) & ~any_(grid.nan),
        missing=np.logical_and.reduceat(grid.missing, starts, axis=1).astype(bool),
        spike=any_(grid.spike),
        nonfinite=any_(grid.nonfinite),
        skipped=any_(grid.skipped),
        spiked=any_(grid.spiked),
        per_column=grid.per_column * width,
    )


FORMATS = ("png", "svg", "pdf", "eps", "ps")
"""The picture formats ``plot_run`` writes, by the output's suffix: a 256-colour PNG, or matplotlib's
vector formats (no further dependency)."""


def plot_run(
    records_or_path: str | Path | Iterable[StepRecord], output: str | Path, *, title: str | None = None
) -> Path:
    """Draws a recorded run (a JSONL file of ``JSONLSink``, or its records) into a picture (module
    notes) and returns the path written. The output's suffix picks the format (``FORMATS``: ``.png``,
    or ``.svg``, ``.pdf``, ``.eps``, ``.ps``); any other suffix is a ValueError, and an output that
    cannot be written an OSError, both before anything is read or drawn."""
    path = Path(output)
    file_format = check_output(path)
    figure = draw_run(records_or_path, title=title)
    if file_format == "png":
        _save_png(figure, path)
    else:
        figure.savefig(path, format=file_format, dpi=DPI)
    return path


def check_output(path: Path) -> str:
    """The format of a picture to be written to ``path`` (its suffix), after making its folder and
    proving the file can be written: ValueError for a suffix not in ``FORMATS``, OSError (its
    ``filename`` the path) for a path that cannot be written (a directory, no permission, a folder that
    cannot be made)."""
    if path.is_dir():
        raise IsADirectoryError(errno.EISDIR, "it is a directory", str(path))
    file_format = path.suffix.lower().lstrip(".")
    if file_format not in FORMATS:
        raise ValueError(
            f"nanscan: cannot write {path}: the suffix {path.suffix or '(none)'!r} is not a picture format "
            f"nanscan writes ({', '.join('.' + f for f in FORMATS)})"
        )
    existed = path.exists()
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("ab"):  # appends nothing: only proves the file can be opened for writing
        pass
    if not existed:
        path.unlink()
    return file_format


def draw_run(records_or_path: str | Path | Iterable[StepRecord], *, title: str | None = None) -> Figure:
    """The figure ``plot_run`` saves, for a notebook or another format (``figure.savefig("run.svg")``).

    The title defaults to the file's name."""
    figure_class = _matplotlib_figure()
    run = load_run(records_or_path)
    grid = downsample(group_rows(run))
    if title is None and isinstance(records_or_path, (str, Path)):
        title = Path(records_or_path).name
    return _draw(figure_class, run, grid, title or "nanscan run")


def main(argv: list[str] | None = None) -> int:
    """``python -m nanscan plot RUN.jsonl [-o OUT.png] [--title T]``."""
    parser = argparse.ArgumentParser(
        prog="python -m nanscan plot",
        description="Draw a run recorded by nanscan.Recorder (a JSONL file of JSONLSink) into a picture: "
        "a strip of the non-finite, skipped and spiking steps; a heatmap of log10 gradient norm per "
        "parameter (or layer) and step, NaN/Inf cells coloured, spikes ringed, the first non-finite step "
        "named; with an activation watch's records, log10 activation amax per module; with an update "
        "watch's, log10 update ratio per parameter; and the total norm with the clip threshold. A "
        "check_state recorder's file (weights and optimizer state) is drawn the same way. Runs appended "
        "to one file (steps starting over) are drawn side by side, the boundary marked.",
    )
    parser.add_argument("run", type=Path, help="the JSONL file")
    parser.add_argument(
        "-o",
        "--output",
        type=Path,
        help="the picture to write, its format by its suffix: .png, .svg, .pdf, .eps or .ps "
        "(default: RUN with the suffix .png)",
    )
    parser.add_argument("--title", help="the figure's title (default: the file's name)")
    args = parser.parse_args(argv)
    if args.run.is_dir():
        print(f"nanscan: {args.run} is a directory, not a JSONL file", file=sys.stderr)
        return 2
    if not args.run.is_file():
        print(f"nanscan: no such file: {args.run}", file=sys.stderr)
        return 2
    output = args.output if args.output is not None else args.run.with_suffix(".png")
    try:
        check_output(output)  # before the run is read and drawn
    except ValueError as error:
        print(error, file=sys.stderr)
        return 2
    except OSError as error:
        print(f"nanscan: cannot write {output}: {error.strerror or error}", file=sys.stderr)
        return 2
    caught: list[warnings.WarningMessage] = []
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", RuntimeWarning)  # the reader's (a line cut short): said plainly
            path = plot_run(args.run, output, title=args.title)
    except (ValueError, ImportError) as error:
        _say_warnings(caught)
        print(error, file=sys.stderr)
        return 1
    except OSError as error:  # the file became unwritable since the check, or could not be read
        _say_warnings(caught)
        print(f"nanscan: {error.filename or output}: {error.strerror or error}", file=sys.stderr)
        return 1
    _say_warnings(caught)
    print(f"nanscan: wrote {path}")
    return 0


def _say_warnings(caught: list[warnings.WarningMessage]) -> None:
    for warning in caught:
        print(f"warning: {warning.message}", file=sys.stderr)


def _matplotlib_figure() -> type[Figure]:
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ImportError("nanscan.plot needs matplotlib: pip install matplotlib (or nanscan[plot])") from None
    # A bare Figure draws with Agg without touching pyplot's global backend or figure list.
    return Figure


def _save_png(figure: Figure, path: Path) -> None:
    """The figure as a 256-colour PNG: a heatmap of noisy norms compresses poorly in full colour
    (about 4x larger), and a picture of a few dozen colours loses nothing visible in a palette."""
    from PIL import Image  # a dependency of matplotlib

    full_colour = io.BytesIO()
    figure.savefig(full_colour, format="png", dpi=DPI)
    image = Image.open(full_colour).convert("RGB")
    palette = image.quantize(colors=256, method=Image.Quantize.FASTOCTREE, dither=Image.Dither.NONE)
    palette.save(path, format="PNG", optimize=True)


def _draw(figure_class: type[Figure], run: Run, grid: Grid, title: str) -> Figure:
    acts, updates = run.activations, run.updates
    extra = (acts is not None) + (updates is not None)  # panels below the gradient heatmap
    figure = figure_class(figsize=(12, 8 + 3 * extra))
    labels = [_row_label(group) for group in grid.groups] + (
        [] if acts is None else [_module_label(m) for m in acts.modules]
    )
    if updates is not None:
        labels += [_row_label(group) for group in _update_groups(updates)]
    label_chars = max(len(label) for label in labels)
    left = min(0.32, 0.03 + label_chars * LABEL_FONT * 0.6 / (12 * 72))
    ratios = [0.45, 5] + [3.2] * extra + [2]
    layout = figure.add_gridspec(
        len(ratios),
        2,
        height_ratios=ratios,
        width_ratios=[1, 0.015],
        hspace=0.08,
        wspace=0.015,
        left=left,
        right=0.93,
        top=(0.9, 0.92, 0.935)[extra],
        bottom=(0.07, 0.055, 0.045)[extra],
    )
    strip = figure.add_subplot(layout[0, 0])
    heat = figure.add_subplot(layout[1, 0], sharex=strip)
    totals = figure.add_subplot(layout[len(ratios) - 1, 0], sharex=strip)
    colorbar_axes = figure.add_subplot(layout[1, 1])
    _draw_strip(strip, grid)
    _draw_heatmap(figure, heat, colorbar_axes, grid, run.subject)
    panel = 2
    if acts is not None:
        activation_axes = figure.add_subplot(layout[panel, 0], sharex=strip)
        _draw_activations(figure, activation_axes, figure.add_subplot(layout[panel, 1]), acts, run, grid.per_column)
        panel += 1
    if updates is not None:
        update_axes = figure.add_subplot(layout[panel, 0], sharex=strip)
        _draw_updates(figure, update_axes, figure.add_subplot(layout[panel, 1]), updates, grid.per_column)
    _draw_totals(totals, run)
    _label_steps(totals, run)
    strip.set_xlim(-0.5, len(run.steps) - 0.5)
    _mark_run_starts(figure, strip, run)
    if run.first_nonfinite is not None:
        _annotate_first(heat, totals, run, grid)
    figure.suptitle(title, x=left, ha="left", y=0.985, fontsize=12, fontweight="bold")
    figure.text(left, 0.94, _summary(run, grid), fontsize=8.5, color="#333333")
    _draw_legend(figure, acts is not None, updates is not None)
    return figure


RUN_START_COLOR = "#1a1a1a"


def _mark_run_starts(figure: Figure, strip: Axes, run: Run) -> None:
    """A solid line across every panel where a later run of the file begins, named above the strip
    (``run 2: steps from 0``): a resumed job is drawn whole, its attempts side by side, not as one."""
    for k, start in enumerate(run.run_starts):
        for ax in figure.axes:
            if ax.get_shared_x_axes().joined(ax, strip):
                ax.axvline(start - 0.5, color=RUN_START_COLOR, linewidth=1.4, zorder=5)
        strip.text(
            start - 0.5,
            1.04,
            f" run {k + 2}: steps from {run.steps[start]}",
            transform=strip.get_xaxis_transform(),
            ha="left",
            va="bottom",
            fontsize=7,
            color=RUN_START_COLOR,
        )


def _runs(run: Run) -> list[slice]:
    """The record ranges of the runs of a file, in file order."""
    bounds = [0, *run.run_starts, len(run.steps)]
    return [slice(a, b) for a, b in itertools.pairwise(bounds)]


def _module_label(module: str) -> str:
    name = module or "(model)"
    return name if len(name) <= 48 else "…" + name[-47:]


def _draw_activations(
    figure: Figure, ax: Axes, colorbar_axes: Axes, acts: Activations, run: Run, per_column: int
) -> None:
    """log10 activation amax, module by step, binned as the gradient heatmap's columns are (the
    largest amax and any non-finite output of a bin)."""
    from matplotlib import colormaps
    from matplotlib.colors import to_rgba

    kept = _worst_modules(acts, MAX_ROWS)
    modules = [acts.modules[i] for i in kept]
    amax, nonfinite = _held(acts.amax[kept], acts.nonfinite[kept])
    rows_total = len(modules)
    if per_column > 1:
        starts = np.arange(0, amax.shape[1], per_column)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # bins with no sampled step stay NaN
            amax = np.fmax.reduceat(amax, starts, axis=1)
        nonfinite = np.logical_or.reduceat(nonfinite, starts, axis=1).astype(bool)
    extent = (-0.5, amax.shape[1] * per_column - 0.5, rows_total - 0.5, -0.5)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_amax = np.log10(amax)
    known = log_amax[np.isfinite(log_amax)]
    limit = math.log10(FP16_MAX)
    low = float(np.percentile(known, 0.5)) if known.size else -1.0
    high = max(float(known.max()) if known.size else 0.0, limit + 0.3)
    if high - low < 0.5:
        low = high - 0.5
    log_amax[np.isneginf(log_amax)] = low  # an amax of 0 (all-zero outputs): the floor
    colormap = colormaps["cividis"].with_extremes(bad=(0, 0, 0, 0))  # unsampled: blank
    image = ax.imshow(
        log_amax, cmap=colormap, vmin=low, vmax=high, aspect="auto", interpolation="nearest", extent=extent
    )
    overlay = np.zeros((*amax.shape, 4))
    overlay[np.nan_to_num(amax) > FP16_MAX] = to_rgba(OVER_FP16_COLOR)
    overlay[nonfinite] = to_rgba(NAN_COLOR)
    ax.imshow(overlay, aspect="auto", interpolation="nearest", extent=extent)
    ax.set_ylim(rows_total - 0.5, -0.5)
    bar = figure.colorbar(image, cax=colorbar_axes, extend="min" if known.size and known.min() < low else "neither")
    bar.ax.axhline(limit, color=OVER_FP16_COLOR, linewidth=1.6)
    bar.set_label("log10 activation amax (orange line: fp16's 65504)", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    every = _label_rows_every(figure, ax, [_module_label(m) for m in modules])
    sampled = int(np.isfinite(acts.amax).any(axis=0).sum())
    lines = [
        "module outputs"
        + (f" (top {len(modules)} of {len(acts.modules)} by amax)" if len(modules) < len(acts.modules) else "")
    ]
    if every > 1:
        lines.append(f"1 in {every} labelled")
    lines.append(
        f"{sampled} of {acts.amax.shape[1]} steps sampled" + (", held between" if sampled < acts.amax.shape[1] else "")
    )
    ax.set_ylabel("\n".join(lines), fontsize=8)
    if acts.first_nonfinite is not None:
        index, modules = acts.first_nonfinite
        shown = ", ".join(_module_label(m) for m in modules[:FIRST_NAMES])
        more = f" +{len(modules) - FIRST_NAMES} more" if len(modules) > FIRST_NAMES else ""
        right_half = index > len(run.steps) / 2
        ax.axvline(index, color=NAN_COLOR, linestyle="--", linewidth=0.9, alpha=0.9, zorder=2)
        ax.text(
            index + (-0.03 if right_half else 0.03) * len(run.steps),
            0.85,
            f"first non-finite output: step {run.steps[index]}\n{shown}{more}",
            transform=ax.get_xaxis_transform(),
            ha="right" if right_half else "left",
            va="center",
            fontsize=7.5,
            bbox={"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": NAN_COLOR, "alpha": 0.9},
            zorder=4,
        )


def _update_groups(updates: Updates) -> list[Group]:
    """The update panel's rows: a parameter each, or above ``MAX_ROWS`` a layer each."""
    if len(updates.names) <= MAX_ROWS:
        return [Group(name, (i,)) for i, name in enumerate(updates.names)]
    return group_layers(updates.names, MAX_ROWS)


def _draw_updates(figure: Figure, ax: Axes, colorbar_axes: Axes, updates: Updates, per_column: int) -> None:
    """log10 update ratio, parameter (or layer) by step, held between measured steps and binned as the
    gradient heatmap's columns are (the largest ratio of a bin, any flag raised in it)."""
    from matplotlib import colormaps
    from matplotlib.colors import to_rgba

    groups = _update_groups(updates)
    update_norm, weight_norm = updates.update_norm, updates.weight_norm
    if len(groups) < len(updates.names):
        update_norm, weight_norm = group_norms(update_norm, groups), group_norms(weight_norm, groups)
    spike = group_reduce(updates.spike, groups, np.logical_or).astype(bool)
    with np.errstate(divide="ignore", invalid="ignore"):
        log_ratio = np.log10(update_norm / weight_norm)
    # Red: a NaN or Inf among the norms (the weights went non-finite); a weight of norm 0 (inf or NaN
    # ratio with finite norms) is blank, and a weight that did not move (ratio 0) sits at the floor.
    bad = updates.measured & ~(np.isfinite(update_norm) & np.isfinite(weight_norm))
    zero = np.isneginf(log_ratio)
    log_ratio[~np.isfinite(log_ratio)] = np.nan
    log_ratio, bad = _hold(log_ratio, bad, updates.measured)
    zero = _hold(log_ratio, zero, updates.measured)[1]  # spikes are not held: ringed where measured
    if per_column > 1:
        starts = np.arange(0, log_ratio.shape[1], per_column)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # bins with nothing measured stay NaN
            log_ratio = np.fmax.reduceat(log_ratio, starts, axis=1)
        bad, spike, zero = (np.logical_or.reduceat(f, starts, axis=1).astype(bool) for f in (bad, spike, zero))
    rows_total = len(groups)
    extent = (-0.5, log_ratio.shape[1] * per_column - 0.5, rows_total - 0.5, -0.5)
    known = log_ratio[np.isfinite(log_ratio)]
    low, high = np.percentile(known, [0.5, 99.5]) if known.size else (-4.0, -2.0)
    if high - low < 0.5:
        low, high = (low + high) / 2 - 0.25, (low + high) / 2 + 0.25
    log_ratio[zero & np.isnan(log_ratio)] = low
    colormap = colormaps["magma"].with_extremes(bad=(0, 0, 0, 0))  # nothing measured yet: blank
    image = ax.imshow(
        log_ratio, cmap=colormap, vmin=low, vmax=high, aspect="auto", interpolation="nearest", extent=extent
    )
    overlay = np.zeros((*log_ratio.shape, 4))
    overlay[bad] = to_rgba(NAN_COLOR)
    ax.imshow(overlay, aspect="auto", interpolation="nearest", extent=extent)
    rows, cols = np.nonzero(spike & ~bad)
    if 0 < rows.size <= SPIKE_MARKS:
        centre = (np.arange(log_ratio.shape[1], dtype=np.float64) + 0.5) * per_column - 0.5
        ax.scatter(centre[cols], rows, s=24, facecolors="none", edgecolors=UPDATE_SPIKE_COLOR, linewidths=1.0, zorder=3)
    ax.set_ylim(rows_total - 0.5, -0.5)
    bar = figure.colorbar(image, cax=colorbar_axes)
    if low <= -3 <= high:
        bar.ax.axhline(-3, color=UPDATE_SPIKE_COLOR, linewidth=1.4)
    bar.set_label("log10 ‖Δw‖/‖w‖" + (" (green line: 1e-3)" if low <= -3 <= high else ""), fontsize=8)
    bar.ax.tick_params(labelsize=7)
    every = _label_rows_every(figure, ax, [_row_label(group) for group in groups])
    measured = int(updates.measured.sum())
    lines = ["update ratio" + (" (layers)" if rows_total < len(updates.names) else "")]
    if every > 1:
        lines[0] += f", 1 in {every} labelled"
    total = updates.measured.size
    lines.append(f"{measured} of {total} steps measured" + (", held between" if measured < total else ""))
    ax.set_ylabel("\n".join(lines), fontsize=8)


def _worst_modules(acts: Activations, most: int) -> list[int]:
    """Row indices of at most ``most`` modules, in model order: every one whose outputs went
    non-finite, then those with the largest amax over the run."""
    if len(acts.modules) <= most:
        return list(range(len(acts.modules)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a module never sampled: all NaN
        peak = np.nan_to_num(np.nanmax(acts.amax, axis=1), nan=-1.0)
    rank = np.where(acts.nonfinite.any(axis=1), np.inf, peak)
    return sorted(np.argsort(-rank, kind="stable")[:most].tolist())


def _held(amax: NDArray[np.float64], nonfinite: NDArray[np.bool_]) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
    """The activation grid held between samples (``_hold``): a record holds figures where some
    module's amax is known."""
    return _hold(amax, nonfinite, np.asarray(np.isfinite(amax).any(axis=0)))


def _hold(
    values: NDArray[np.float64], flags: NDArray[np.bool_], sampled: NDArray[np.bool_]
) -> tuple[NDArray[np.float64], NDArray[np.bool_]]:
    """The grid with each record that holds no figures (``sampled`` false: nothing sampled since the
    record before) showing the last sampled record's, as a sampled metric is drawn between its
    samples; records before the first sample stay blank."""
    source = np.where(sampled, np.arange(values.shape[1]), -1)
    np.maximum.accumulate(source, out=source)  # each column's latest sampled column, or -1
    filled = values[:, np.maximum(source, 0)]
    filled[:, source < 0] = np.nan
    return filled, flags[:, np.maximum(source, 0)] & (source >= 0)


def _summary(run: Run, grid: Grid) -> str:
    steps = (
        f"{len(run.steps)} steps ({run.steps[0]}-{run.steps[-1]})" if len(run.steps) > 1 else f"1 step ({run.steps[0]})"
    )
    if run.run_starts:
        ranges = [f"{run.steps[r.start]}-{run.steps[r.stop - 1]}" for r in _runs(run)]
        shown = ", ".join(ranges[:4]) + (f", +{len(ranges) - 4} more" if len(ranges) > 4 else "")
        steps = f"{len(run.steps)} steps in {len(ranges)} runs appended to one file ({shown})"
    rows = f"{len(run.names)} parameters"
    if len(grid.groups) < len(run.names):
        rows += f" in {len(grid.groups)} layer rows"
    nonfinite = int((~run.finite | run.nan.any(axis=0) | run.inf.any(axis=0)).sum())
    parts = [
        steps,
        rows,
        f"{nonfinite} non-finite",
        f"{int(run.skipped.sum())} skipped",
        f"{int(run.spike.sum())} spikes",
    ]
    if grid.per_column > 1:
        parts.append(f"{grid.per_column} steps per column (max norm, any flag)")
    return ",  ".join(parts)


def _draw_strip(ax: Axes, grid: Grid) -> None:
    """Three rows of column flags. A flag is drawn as a line at least 2 points wide, not as its
    column alone: a column of a 5000-step run is a pixel or two, too thin to see by itself."""
    ax.imshow(np.full((3, 1), 0.95), cmap="gray", vmin=0, vmax=1, aspect="auto", extent=_extent(grid, 3))
    centre = _column_centres(grid)
    for row, (flags, color) in enumerate(
        [(grid.nonfinite, NAN_COLOR), (grid.skipped, SKIPPED_COLOR), (grid.spiked, SPIKE_COLOR)]
    ):
        if flags.any():
            ax.vlines(centre[flags], row - 0.42, row + 0.42, colors=color, linewidths=2)
    ax.set_ylim(2.5, -0.5)
    ax.set_yticks(range(3), ["non-finite", "skipped", "spike"], fontsize=7)
    ax.tick_params(axis="x", labelbottom=False, length=0)
    ax.tick_params(axis="y", length=0)
    for spine in ax.spines.values():
        spine.set_visible(False)


def _draw_heatmap(figure: Figure, ax: Axes, colorbar_axes: Axes, grid: Grid, subject: str = "gradients") -> None:
    from matplotlib import colormaps
    from matplotlib.colors import to_rgba

    with np.errstate(divide="ignore"):
        log_norm = np.log10(grid.value)  # 0 -> -inf, drawn at the floor below
    positive = log_norm[np.isfinite(log_norm)]
    # Percentiles, not the extremes: one exploding step before a NaN must not squash every other row
    # into one colour. Beyond them cells take the end colours (the colour bar's arrows say so).
    low, high = np.percentile(positive, [0.5, 99.5]) if positive.size else (-1.0, 1.0)
    if high - low < 0.5:
        low, high = (low + high) / 2 - 0.25, (low + high) / 2 + 0.25
    has_zero = bool(np.isneginf(log_norm).any())
    log_norm[np.isneginf(log_norm)] = low
    colormap = colormaps["viridis"].with_extremes(bad=(0, 0, 0, 0))  # NaN cells: the overlay's or blank
    extent = _extent(grid, len(grid.groups))
    image = ax.imshow(
        log_norm, cmap=colormap, vmin=low, vmax=high, aspect="auto", interpolation="nearest", extent=extent
    )
    overlay = np.zeros((*grid.value.shape, 4))
    overlay[grid.inf] = to_rgba(INF_COLOR)
    overlay[grid.nan] = to_rgba(NAN_COLOR)
    ax.imshow(overlay, aspect="auto", interpolation="nearest", extent=extent)
    ax.set_ylim(len(grid.groups) - 0.5, -0.5)
    extend = {(False, False): "neither", (True, False): "min", (False, True): "max", (True, True): "both"}[
        (bool(positive.size and positive.min() < low), bool(positive.size and positive.max() > high))
    ]
    bar = figure.colorbar(image, cax=colorbar_axes, extend=extend)
    floor = f"; a zero norm is drawn at the floor ({low:.1f})" if has_zero else ""
    what = "gradient norm" if subject == "gradients" else "norm of weights / optimizer state"
    bar.set_label(f"log10 {what}{floor}", fontsize=8)
    bar.ax.tick_params(labelsize=7)
    _mark_cells(ax, grid)
    _separate_blocks(ax, grid)
    _label_rows(figure, ax, grid)


def _mark_cells(ax: Axes, grid: Grid) -> None:
    """Rings around sparse NaN/Inf cells and light ones around spikes."""
    centre = _column_centres(grid)
    # Only cells of columns with few flags: an all-NaN step is a solid red column already.
    sparse_columns = (grid.nan | grid.inf).sum(axis=0) <= SPARSE_COLUMN
    for flags, color in [(grid.nan, NAN_COLOR), (grid.inf & ~grid.nan, INF_COLOR)]:
        rows, cols = np.nonzero(flags & sparse_columns)
        if 0 < rows.size <= MARKED_CELLS:
            ax.scatter(centre[cols], rows, s=55, facecolors="none", edgecolors=color, linewidths=1.3, zorder=3)
    rows, cols = np.nonzero(grid.spike & ~grid.nan & ~grid.inf)
    if 0 < rows.size <= SPIKE_MARKS:
        ax.scatter(centre[cols], rows, s=24, facecolors="none", edgecolors="white", linewidths=0.8, alpha=0.8, zorder=3)


def _separate_blocks(ax: Axes, grid: Grid) -> None:
    """Thin lines between numbered blocks (``transformer.h.3`` | ``transformer.h.4``), so that a row
    can be placed in its block where only every k-th row is labelled."""
    keys = [_block_key(group.name) for group in grid.groups]
    edges = [row + 0.5 for row in range(len(keys) - 1) if keys[row] != keys[row + 1]]
    if 2 <= len(edges) <= 80:
        ax.hlines(edges, *ax.get_xlim(), colors="white", linewidths=0.5, alpha=0.6, zorder=2)


def _block_key(name: str) -> str:
    """A name up to its first numbered component (``transformer.h.3``), or its layer if none."""
    parts = name.split(".")
    numbered = next((i for i, part in enumerate(parts) if part.split("-")[0].isdigit()), None)
    return ".".join(parts[: numbered + 1]) if numbered is not None else layer_name(name)


def _label_rows_every(figure: Figure, ax: Axes, labels: Sequence[str]) -> int:
    """A heatmap's row labels, every k-th one where all would overlap (k returned); no step labels
    (the panels share the totals' step axis)."""
    height_points = ax.get_position().height * figure.get_figheight() * 72
    every = max(1, math.ceil(len(labels) * LABEL_FONT * 1.3 / height_points))
    rows = range(0, len(labels), every)
    ax.set_yticks(list(rows), [labels[row] for row in rows], fontsize=LABEL_FONT)
    ax.tick_params(axis="x", labelbottom=False)
    return every


def _label_rows(figure: Figure, ax: Axes, grid: Grid) -> None:
    """The gradient heatmap's row labels, and what a row is."""
    every = _label_rows_every(figure, ax, [_row_label(group) for group in grid.groups])
    grouped = any(len(group.members) > 1 for group in grid.groups)
    noun = "layer (norm of its parameters together)" if grouped else "parameter"
    ax.set_ylabel(noun + (f", 1 in {every} labelled" if every > 1 else ""), fontsize=8)


def _row_label(group: Group) -> str:
    label = group.name if len(group.name) <= 48 else "…" + group.name[-47:]
    return label if len(group.members) == 1 else f"{label} ({len(group.members)})"


def _draw_totals(ax: Axes, run: Run) -> None:
    x = np.arange(len(run.steps))
    finite = np.isfinite(run.total_norm)
    positive = run.total_norm[finite & (run.total_norm > 0)]
    log_scale = positive.size > 0 and positive.max() / positive.min() > 100
    y = np.where(finite & (run.total_norm > 0 if log_scale else True), run.total_norm, np.nan)
    for k, part in enumerate(_runs(run)):  # one line per run: none joins a run's end to the next one's start
        ax.plot(
            x[part],
            y[part],
            color="#1f77b4",
            linewidth=1,
            marker="o" if len(x) <= 50 else None,
            markersize=3,
            label="total norm" if k == 0 else None,
        )
    if log_scale:
        ax.set_yscale("log")
    if np.isfinite(run.max_norm).any():
        values = np.unique(run.max_norm[np.isfinite(run.max_norm)])
        if values.size == 1:  # one threshold throughout: a line across, which a single step also shows
            ax.axhline(
                values[0],
                color=THRESHOLD_COLOR,
                linestyle="--",
                linewidth=1,
                label=f"clip threshold (max_norm={values[0]:g})",
            )
        else:
            ax.plot(
                x,
                run.max_norm,
                color=THRESHOLD_COLOR,
                linestyle="--",
                linewidth=1,
                drawstyle="steps-mid",
                label="clip threshold (max_norm)",
            )
    # Bands across the panel, not markers on the curve: a non-finite step has no point on it, and a
    # band at least 2 points wide shows one step in ten thousand.
    across = ax.get_xaxis_transform()
    bad = np.nonzero(~run.finite)[0]
    if bad.size:
        ax.vlines(
            bad, 0, 1, transform=across, colors=NAN_COLOR, linewidths=2, alpha=0.3, zorder=0, label="non-finite step"
        )
    skipped = np.nonzero(run.skipped)[0]
    if skipped.size:
        ax.vlines(
            skipped,
            0,
            1,
            transform=across,
            colors=SKIPPED_COLOR,
            linewidths=1,
            linestyles=":",
            zorder=0,
            label="skipped step",
        )
    if not positive.size:
        ax.text(0.5, 0.5, "no finite total norm", transform=ax.transAxes, ha="center", va="center", color="#666666")
    ax.set_ylabel("total norm", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, which="major", alpha=0.3)
    _headroom(ax, log_scale)
    ax.legend(fontsize=7, loc="upper right", ncols=4, framealpha=0.8)


def _headroom(ax: Axes, log_scale: bool) -> None:
    """Room above the curve for the legend and the annotation, so that neither covers it."""
    low, high = ax.get_ylim()
    if log_scale:
        ax.set_ylim(low, 10 ** (math.log10(low) + (math.log10(high) - math.log10(low)) / 0.7))
    else:
        ax.set_ylim(low, low + (high - low) / 0.7)


def _label_steps(ax: Axes, run: Run) -> None:
    """The x axis counts records; its labels are their step numbers (a resumed run may repeat steps)."""
    from matplotlib.ticker import FuncFormatter, MaxNLocator

    steps = run.steps

    def step_of(x: float, _: int | None) -> str:
        i = round(x)
        return str(steps[i]) if 0 <= i < len(steps) and abs(x - i) < 1e-6 else ""

    ax.xaxis.set_major_locator(MaxNLocator(nbins=12, integer=True))
    ax.xaxis.set_major_formatter(FuncFormatter(step_of))
    ax.set_xlabel("step", fontsize=8)


def _annotate_first(heat: Axes, totals: Axes, run: Run, grid: Grid) -> None:
    assert run.first_nonfinite is not None
    index, names = run.first_nonfinite
    shown = ", ".join(names[:FIRST_NAMES]) if names else "no parameter flagged"
    more = f" +{len(names) - FIRST_NAMES} more" if len(names) > FIRST_NAMES else ""
    step = run.steps[index]
    on_ranks, name_ranks = _first_ranks_text(run.first_ranks, names)
    right_half = index > len(run.steps) / 2
    for ax in (heat, totals):
        ax.axvline(index, color=NAN_COLOR, linestyle="--", linewidth=0.9, alpha=0.9, zorder=2)
    box = {"boxstyle": "round,pad=0.3", "facecolor": "white", "edgecolor": NAN_COLOR, "alpha": 0.9}
    side = "right" if right_half else "left"
    heat_names = "\n".join(name + name_ranks.get(name, "") for name in names[:FIRST_NAMES]) if names else shown
    member_row = {i: row for row, group in enumerate(grid.groups) for i in group.members}
    row = member_row[run.names.index(names[0])] if names else 0
    # The box sits beside the step's line in the half of the panel away from the flagged row: the cells
    # just before the first NaN (often a spike) are what a reader looks at next, so they stay uncovered.
    x_text = index + (-0.03 if right_half else 0.03) * len(run.steps)
    # In a grouped heatmap the names are parameters, the rows layers: say which row holds the first.
    in_row = f"\nin row {grid.groups[row].name}" if names and len(grid.groups[row].members) > 1 else ""
    heat.text(
        x_text,
        0.15 if row < len(grid.groups) / 2 else 0.85,
        f"first non-finite: step {step}{on_ranks}\n{heat_names}{more}{in_row}",
        transform=heat.get_xaxis_transform(),
        ha=side,
        va="center",
        fontsize=7.5,
        bbox=box,
        zorder=4,
    )
    if on_ranks and len(names) > 1:
        # One line across the panel: the ranks take the room of all but the first name, which the
        # heatmap's box lists just above (a longer line runs off the figure at a step mid-run).
        shown, more = names[0], f" +{len(names) - 1} more"
    totals.annotate(
        f"first non-finite: step {step}{on_ranks} ({shown}{more})",
        xy=(index, 0.76),
        xycoords=totals.get_xaxis_transform(),
        xytext=(-12 if right_half else 12, 0),
        textcoords="offset points",
        ha=side,
        va="center",
        fontsize=7.5,
        bbox=box,
        zorder=4,
    )


def _first_ranks_text(ranks: dict[str, list[int]] | None, names: list[str]) -> tuple[str, dict[str, str]]:
    """The first non-finite step's ranks as the annotation shows them: ``" on rank 3"`` after the step,
    covering every parameter of the step (shown or not), and a suffix per shown name (``" (ranks
    0,2)"``) only where the names' ranks differ: one NaN on one rank's shard, the usual case, reads
    once, not once per parameter. Empty without ranks (a single process, a schema 1 file)."""
    if not ranks:
        return "", {}
    every = sorted({rank for name in names for rank in ranks.get(name, ())})
    if not every:
        return "", {}
    heading = f" on {ranks_label(every)}"
    if all(sorted(ranks.get(name, ())) == every for name in names):
        return heading, {}
    return heading, {name: f" ({ranks_label(ranks[name])})" for name in names[:FIRST_NAMES] if ranks.get(name)}


def _draw_legend(figure: Figure, activations: bool = False, updates: bool = False) -> None:
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    handles = [
        Patch(facecolor=NAN_COLOR, label="NaN norm"),
        Patch(facecolor=INF_COLOR, label="Inf norm"),
        Patch(facecolor="white", edgecolor="#999999", label="absent from layout"),
        Line2D(
            [],
            [],
            marker="o",
            linestyle="none",
            markerfacecolor="none",
            markeredgecolor="#888888",
            markersize=5,
            label="spike",
        ),
        Patch(facecolor=SKIPPED_COLOR, label="skipped step"),
    ]
    if activations:
        handles.append(Patch(facecolor=OVER_FP16_COLOR, label="output over fp16's 65504"))
    if updates:
        handles.append(
            Line2D(
                [],
                [],
                marker="o",
                linestyle="none",
                markerfacecolor="none",
                markeredgecolor=UPDATE_SPIKE_COLOR,
                markersize=5,
                label="update ratio spike",
            )
        )
    figure.legend(
        handles=handles,
        loc="upper right",
        bbox_to_anchor=(0.99, 0.995),
        ncols=len(handles),
        fontsize=7.5,
        frameon=False,
    )


def _column_centres(grid: Grid) -> NDArray[np.float64]:
    return (np.arange(grid.value.shape[1], dtype=np.float64) + 0.5) * grid.per_column - 0.5


def _extent(grid: Grid, rows: int) -> tuple[float, float, float, float]:
    """Column c spans records [c * per_column, (c + 1) * per_column): x counts records on every panel."""
    return (-0.5, grid.value.shape[1] * grid.per_column - 0.5, rows - 0.5, -0.5)
