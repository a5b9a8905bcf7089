"""What a Recorder hands to its sinks: one ``StepRecord`` per recorded step, and the JSONL schema.

A record holds one step's gradient statistics as Python values (they reached the host in the
recorder's one copy per flush): per parameter the NaN and Inf counts, the min and max of the finite
values, the L2 norm and the spike ratio (the norm over its running median); per step the total norm,
the finite flag, the clip coefficient, whether the optimizer step was skipped and the loss scale;
and for a step with a NaN/Inf, the ranks whose local data held it, per parameter.

The JSONL file (``JSONLSink``, read back by ``read_jsonl``) is one JSON object per line, strict JSON
(non-finite floats are the strings ``"nan"``, ``"inf"`` and ``"-inf"``), of two kinds:

* ``{"kind": "layout", "schema": 4, "subject": "gradients", "names": [...]}``: the parameter names, in the order of the
  per-parameter arrays of the step lines after it. Written before the first step and again whenever
  the parameters change (a parameter that gains or loses its gradient).
* ``{"kind": "step", "schema": 4, "step": 12, "total_norm": "nan", "finite": false, "clip_coef": null,
  "max_norm": null, "skipped": true, "loss_scale": null, "spike_factor": 10.0,
  "nonfinite": ["h.3.attn.weight"], "spikes": {"h.2.mlp.weight": 14.2},
  "nonfinite_ranks": {"h.3.attn.weight": [5]}, "nan_count": [...], "inf_count": [...], "min": [...],
  "max": [...], "norm": [...], "spike_ratio": [...]}``: one step. ``step`` counts the recorder's
  records from 0; ``clip_coef`` and ``max_norm`` are null when the step was not clipped,
  ``loss_scale`` when no GradScaler recorded it; ``nonfinite`` and ``spikes`` (ratio per parameter
  at or above the recorder's spike factor) are derived from the arrays, for readers that stop there.
  ``nonfinite_ranks`` maps each name in ``nonfinite`` to the sorted ranks whose local data held its
  NaN/Inf (``{}`` for a finite step; null for a record made without it).

Schema 3 (a recorder with an activation watch, ``Recorder(activations=watch)``) adds
``"modules": [...]`` to the layout line, the watched modules' names (``""`` is the model itself),
and to each step line ``"activations"``: null when no forward was sampled since the record before,
else ``{"amax": [...], "nan_count": [...], "inf_count": [...], "overflow": [...]}``, per module in
the layout's order: the largest finite ``|value|`` of its outputs and its counts of NaN, Inf and values
over fp16's 65504 over those forwards. A layout line without ``modules`` has steps without
``activations``.

Schema 4 adds two things:

* ``"subject"`` on the layout line: ``"gradients"`` (``check``, the GradScaler) or ``"state"``
  (``check_state``: the per-parameter arrays are then of the weights' and the optimizer state's
  values, named ``fc.weight`` and ``fc.weight:exp_avg_sq``). Absent in older schemas: gradients.
* With an update watch (``Recorder(updates=watch)``, ``nanscan.watch_updates``), ``"update_names"``
  on the layout line (the optimizer's parameters, in its order; not always the parameters of the
  per-parameter arrays, which are those with a gradient) and ``"updates"`` on each step line: null
  when no optimizer step was measured since the record before, else ``{"steps": 1, "update_norm":
  [...], "weight_norm": [...], "spike_ratio": [...]}``: per parameter ‖Δw‖ and ‖w‖ of the last
  measured step (``steps``: how many were measured since the record before; the figures are the
  last one's), and the update ratio ‖Δw‖/‖w‖ over its running median (NaN until enough history).
  The ratio itself is their quotient, not stored.

A field may be added in a later schema version; none is renamed or removed within one. Schema 2 added
``nonfinite_ranks``, schema 3 ``modules`` and ``activations``, schema 4 ``subject``,
``update_names`` and ``updates``; ``read_jsonl`` reads schemas 1 to 3 too (their records'
``nonfinite_ranks``, ``activations`` and ``updates`` are None where they have none). A file may hold
lines of several, appended by several nanscan versions.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SCHEMA = 4
# Schema 1: no nonfinite_ranks (read as None); 1 and 2: no activations; 1 to 3: no subject, no updates.
READABLE_SCHEMAS = (1, 2, 3, 4)
PER_PARAMETER = ("nan_count", "inf_count", "min", "max", "norm", "spike_ratio")
PER_MODULE = ("amax", "nan_count", "inf_count", "overflow")
PER_UPDATE = ("update_norm", "weight_norm", "spike_ratio")
SUBJECTS = ("gradients", "state")
FP16_MAX = 65504.0


@dataclass(frozen=True)
class ActivationRecord:
    """One record's activation figures (``Recorder(activations=watch)``), per watched module: those
    of the forwards the watch sampled since the record before.

    Attributes:
        modules: the module names, in the order of the lists (``""`` is the model itself).
        amax: the largest finite ``|value|`` among the module's outputs (0 when it was not called).
        nan_count, inf_count: its outputs' NaN and Inf counts.
        overflow: its outputs' finite values over fp16's 65504.
    """

    modules: Sequence[str]
    amax: list[float]
    nan_count: list[int]
    inf_count: list[int]
    overflow: list[int]

    @property
    def headroom(self) -> list[float]:
        """The fp16 headroom of each module, 65504 over its amax (inf when 0). Below 1 the module
        overflows fp16; 0 where a NaN or an Inf was seen, as the watch's table gives it."""
        return [
            0.0 if nan or inf else (FP16_MAX / amax if amax > 0 else math.inf)
            for amax, nan, inf in zip(self.amax, self.nan_count, self.inf_count, strict=True)
        ]

    @property
    def nonfinite(self) -> list[str]:
        """Names of the modules whose outputs held a NaN or an Inf."""
        return [m for m, nan, inf in zip(self.modules, self.nan_count, self.inf_count, strict=True) if nan or inf]

    def to_json(self) -> dict[str, list[Any]]:
        return {key: [_encode(v) for v in getattr(self, key)] for key in PER_MODULE}

    @classmethod
    def from_json(cls, value: object, modules: Sequence[str]) -> ActivationRecord:
        columns = _decode_columns(value, "activations", PER_MODULE, len(modules), "modules")
        return cls(
            modules=modules,
            amax=[float(v) for v in columns["amax"]],
            nan_count=[int(v) for v in columns["nan_count"]],
            inf_count=[int(v) for v in columns["inf_count"]],
            overflow=[int(v) for v in columns["overflow"]],
        )


@dataclass(frozen=True)
class UpdateRecord:
    """One record's update ratios (``Recorder(updates=watch)``): per parameter the optimizer holds,
    the norms of the last optimizer step measured since the record before.

    Attributes:
        names: the parameter names, in the optimizer's order.
        steps: optimizer steps measured since the record before (the figures are the last one's).
        update_norm: per parameter ‖Δw‖ of that step.
        weight_norm: per parameter ‖w‖ after it.
        spike_ratio: per parameter the ratio over its median over the recorder's window of earlier
            measured steps (NaN until the window holds enough of them, or when the median is 0).
        spike_factor: the spike ratio at or above which a ratio counts as a spike.
    """

    names: Sequence[str]
    steps: int
    update_norm: list[float]
    weight_norm: list[float]
    spike_ratio: list[float]
    spike_factor: float = math.inf

    @property
    def ratio(self) -> list[float]:
        """Per parameter ‖Δw‖/‖w‖ (inf for weights of norm 0 that moved, NaN for 0/0 and NaN norms)."""
        return [_quotient(u, w) for u, w in zip(self.update_norm, self.weight_norm, strict=True)]

    @property
    def spikes(self) -> dict[str, float]:
        """Parameters whose ratio reached ``spike_factor`` times its running median: name -> that multiple."""
        return spikes_of(self.names, self.spike_ratio, self.spike_factor)

    @property
    def nonfinite(self) -> list[str]:
        """Parameters whose update or weight norm is NaN or Inf (a NaN/Inf in the weights after the step)."""
        return [
            name
            for name, u, w in zip(self.names, self.update_norm, self.weight_norm, strict=True)
            if not (math.isfinite(u) and math.isfinite(w))
        ]

    def to_json(self) -> dict[str, Any]:
        line: dict[str, Any] = {"steps": self.steps}
        for key in PER_UPDATE:
            line[key] = [_encode(v) for v in getattr(self, key)]
        return line

    @classmethod
    def from_json(cls, value: object, names: Sequence[str], spike_factor: float) -> UpdateRecord:
        columns = _decode_columns(value, "updates", ("steps", *PER_UPDATE), len(names), "update names")
        steps = columns.pop("steps")
        return cls(names=names, steps=steps, spike_factor=spike_factor, **columns)


def spike_mask(multiples: Any, spike_factor: float) -> Any:
    """The spike rule (see ``spikes_of``) on a multiple, or on a whole array (numpy or torch) of them at
    once: a bool, or a bool array."""
    return (multiples >= spike_factor) & (multiples != math.inf)


def spikes_of(names: Sequence[str], multiples: Sequence[float], spike_factor: float) -> dict[str, float]:
    """The spike rule, of gradient norms and of update ratios alike: each name whose value reached
    ``spike_factor`` times its running median (``multiples``), with that multiple. NaN (no history)
    compares False; an infinite multiple is a non-finite value, which the counts report, not a spike."""
    return {
        name: multiple for name, multiple in zip(names, multiples, strict=True) if spike_mask(multiple, spike_factor)
    }


def _decode_columns(value: object, field: str, keys: Sequence[str], count: int, counted: str) -> dict[str, Any]:
    """A step line's object of per-name arrays (``activations``, ``updates``): each of ``keys``
    decoded (``steps``: an integer; the others arrays of ``count`` numbers), or a ValueError that
    says what is wrong."""
    if type(value) is not dict:
        raise ValueError(f"{field} is {value!r:.60}, not an object")
    try:
        columns: dict[str, Any] = {
            key: _decode_int(value[key], f"{field}.{key}")
            if key == "steps"
            else _decode_list(value[key], f"{field}.{key}")
            for key in keys
        }
    except KeyError as missing:
        raise ValueError(f"{field} without its field {missing}") from None
    arrays = [values for key, values in columns.items() if key != "steps"]
    if any(len(values) != count for values in arrays):
        lengths = sorted({len(values) for values in arrays})
        raise ValueError(f"{field} of {lengths} values where its layout has {count} {counted}")
    return columns


def _quotient(numerator: float, denominator: float) -> float:
    """``numerator / denominator`` as the device divides: x/0 is inf (NaN for 0/0), not an error."""
    if denominator == 0:
        return math.nan if numerator == 0 or math.isnan(numerator) else math.inf
    return numerator / denominator


@dataclass(frozen=True)
class StepRecord:
    """One recorded step, on the host.

    Attributes:
        step: the record's index, counted from 0 by the recorder (one per recorded check or unscale).
        names: the parameter names, in the order of the per-parameter lists.
        nan_count, inf_count, min, max, norm: per parameter, as ``Report`` has them (min and max of the
            finite values: +inf and -inf when there are none).
        spike_ratio: per parameter, the norm over its median over the recorder's window of earlier
            steps (NaN until the window holds enough steps, or when the median is 0).
        total_norm, finite, clip_coef, max_norm: the step's totals (``clip_coef``/``max_norm`` None when
            the step was not clipped).
        skipped: whether the optimizer step was skipped (``on_nonfinite="skip"``, or a GradScaler that
            found an Inf/NaN).
        loss_scale: the GradScaler's scale when a scaler recorded the step, else None.
        spike_factor: the ratio at or above which a norm counts as a spike.
        nonfinite_ranks: for each parameter in ``nonfinite``, the ranks whose local data held its
            NaN/Inf, as ``Report.nonfinite_ranks`` gives them (a DTensor's shards, pipeline stages'
            parameters, DDP ranks' own gradients with ``nanscan.ddp.attach``; a single process: its
            own rank); empty for a finite step. None when not recorded (a schema 1 file, a record
            made by hand).
        activations: the activation figures of the forwards sampled since the record before, from a
            recorder with an activation watch; None when no forward was sampled, or without a watch.
        updates: the update ratios of the last optimizer step measured since the record before, from
            a recorder with an update watch; None when none was measured, or without a watch.
        subject: what the per-parameter lists are of: ``"gradients"`` (``check``, the GradScaler), or
            ``"state"`` (``check_state``: the weights' and the optimizer state's values).
        update_names: the parameters of the recorder's update watch, at every record of a recorder
            with one (``updates`` or not); None without.

    A per-parameter field may be given as a callable that returns its list: it is called on the
    field's first reading, and its list kept. The recorder's records are made so, from the block of
    records one read brought to the host: a sink that reads only a step's totals (most loggers) does
    not pay for 6 x N Python numbers per step, most of a read's cost otherwise.
    """

    step: int
    names: Sequence[str]
    nan_count: list[int]
    inf_count: list[int]
    min: list[float]
    max: list[float]
    norm: list[float]
    spike_ratio: list[float]
    total_norm: float
    finite: bool
    clip_coef: float | None
    max_norm: float | None
    skipped: bool
    loss_scale: float | None
    spike_factor: float
    nonfinite_ranks: dict[str, list[int]] | None = None
    activations: ActivationRecord | None = None
    updates: UpdateRecord | None = None
    subject: str = "gradients"
    update_names: Sequence[str] | None = None

    @property
    def nonfinite(self) -> list[str]:
        """Names of the parameters whose gradient (or, for a ``"state"`` record, whose values) held a NaN
        or an Inf this step."""
        return [name for name, nan, inf in zip(self.names, self.nan_count, self.inf_count, strict=True) if nan or inf]

    @property
    def spikes(self) -> dict[str, float]:
        """Parameters whose norm reached ``spike_factor`` times its running median: name -> ratio."""
        return spikes_of(self.names, self.spike_ratio, self.spike_factor)

    def to_json(self, with_activations: bool = False, with_updates: bool = False) -> dict[str, Any]:
        """The step line of the JSONL schema (module notes), without the layout's names; with
        ``activations`` when its layout line names modules (``with_activations``), ``updates`` when it
        has update names (``with_updates``)."""
        line: dict[str, Any] = {
            "kind": "step",
            "schema": SCHEMA,
            "step": self.step,
            "total_norm": _encode(self.total_norm),
            "finite": self.finite,
            "clip_coef": _encode(self.clip_coef),
            "max_norm": _encode(self.max_norm),
            "skipped": self.skipped,
            "loss_scale": _encode(self.loss_scale),
            "spike_factor": self.spike_factor,
            "nonfinite": self.nonfinite,
            "spikes": {name: _encode(ratio) for name, ratio in self.spikes.items()},
            "nonfinite_ranks": self.nonfinite_ranks,
        }
        for key in PER_PARAMETER:
            line[key] = [_encode(v) for v in getattr(self, key)]
        if with_activations:
            line["activations"] = None if self.activations is None else self.activations.to_json()
        if with_updates:
            line["updates"] = None if self.updates is None else self.updates.to_json()
        return line

    @classmethod
    def from_json(
        cls,
        line: dict[str, Any],
        names: Sequence[str],
        modules: Sequence[str] | None = None,
        update_names: Sequence[str] | None = None,
        subject: str = "gradients",
    ) -> StepRecord:
        """A step line of the JSONL schema, with the names (the watched modules, the update names and
        the subject, if any) of the layout line before it. A line this version cannot read (another schema, a field missing or of
        the wrong type, arrays of another length than the layout's) raises ValueError saying what is
        wrong (``iter_jsonl`` adds where)."""
        _check_schema(line, "step")
        try:
            columns = {key: _decode_list(line[key], key) for key in PER_PARAMETER}
            if any(len(values) != len(names) for values in columns.values()):
                lengths = sorted({len(values) for values in columns.values()})
                raise ValueError(f"arrays of {lengths} values where its layout has {len(names)} names")
            spike_factor = _decode(line.get("spike_factor", math.inf), "spike_factor")
            return cls(
                step=_decode_int(line["step"], "step"),
                names=names,
                nan_count=[int(v) for v in columns["nan_count"]],
                inf_count=[int(v) for v in columns["inf_count"]],
                min=columns["min"],
                max=columns["max"],
                norm=columns["norm"],
                spike_ratio=columns["spike_ratio"],
                total_norm=_decode(line["total_norm"], "total_norm"),
                finite=_decode_bool(line["finite"], "finite"),
                clip_coef=_decode_optional(line["clip_coef"], "clip_coef"),
                max_norm=_decode_optional(line["max_norm"], "max_norm"),
                skipped=_decode_bool(line["skipped"], "skipped"),
                loss_scale=_decode_optional(line["loss_scale"], "loss_scale"),
                spike_factor=spike_factor,
                nonfinite_ranks=_decode_ranks(line.get("nonfinite_ranks"), names),
                activations=_decode_activations(line.get("activations"), modules),
                updates=_decode_updates(line.get("updates"), update_names, spike_factor),
                subject=subject,
                update_names=update_names,
            )
        except KeyError as missing:
            raise ValueError(f"a step line without its field {missing}") from None


class _PerParameterField:
    """A StepRecord per-parameter field (installed on the class below): holds the list it was given,
    or the callable given in its place until the first reading makes the list (StepRecord notes).
    A data descriptor, so the frozen dataclass's ``__init__`` sets it and its ``__setattr__`` still
    refuses assignment; equality, ``repr`` and ``dataclasses.replace`` read lists through it."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __get__(self, record: StepRecord | None, owner: type | None = None) -> Any:
        if record is None:
            raise AttributeError(self.name)  # a field without a class-level default
        value = record.__dict__[self.name]
        if not isinstance(value, list):
            value = record.__dict__[self.name] = value()
        return value

    def __set__(self, record: StepRecord, value: list[Any] | Callable[[], list[Any]]) -> None:
        record.__dict__[self.name] = value


# After the dataclass is made (its fields stay plain annotated lists for it and for type checkers).
for _name in PER_PARAMETER:
    setattr(StepRecord, _name, _PerParameterField(_name))
del _name


def _encode(value: float | None) -> float | str | None:
    """Strict JSON has no NaN or Inf: those become strings (module notes)."""
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"


_NUMBER_TYPES = frozenset((int, float))  # exact types: a bool is not a number here
_NONFINITE_STRINGS = frozenset(("nan", "inf", "-inf"))


def _decode(value: object, field: str) -> float:
    """A number of a step line: a JSON number, or one of the strings strict JSON writes for NaN and
    Inf (module notes); anything else is an error that names the field."""
    if type(value) in _NUMBER_TYPES:
        return float(value)  # type: ignore[arg-type]
    if type(value) is str and value in _NONFINITE_STRINGS:
        return float(value)
    raise ValueError(f"{field} is {value!r}, not a number")


def _decode_int(value: object, field: str) -> int:
    if type(value) is not int:
        raise ValueError(f"{field} is {value!r}, not an integer")
    return value


def _decode_bool(value: object, field: str) -> bool:
    if type(value) is not bool:
        raise ValueError(f"{field} is {value!r}, not true or false")
    return value


def _decode_list(values: object, field: str) -> list[float]:
    """A per-parameter array: numbers as they are (the common case: one type test per value, no
    call), the non-finite strings converted; anything else an error naming the field and index."""
    array = _as_list(values, field)
    if all(type(v) in _NUMBER_TYPES for v in array):
        return array  # ints (the counts) are read as numbers either way
    return [_decode(v, f"{field}[{i}]") for i, v in enumerate(array)]


def _decode_ranks(value: object, names: Sequence[str]) -> dict[str, list[int]] | None:
    """A step line's ``nonfinite_ranks`` (absent in schema 1, null when not recorded)."""
    if value is None:  # not recorded
        return None
    if type(value) is not dict:
        raise ValueError(f"nonfinite_ranks is {value!r:.60}, not an object")
    if not value:  # a finite step (most lines): no names to check
        return {}
    known = set(names)
    if not all(name in known for name in value):
        raise ValueError(f"nonfinite_ranks names a parameter outside its layout: {sorted(set(value) - known)}")
    return {
        name: [_decode_int(r, f"nonfinite_ranks[{name!r}]") for r in _as_list(ranks, f"nonfinite_ranks[{name!r}]")]
        for name, ranks in value.items()
    }


def _decode_activations(value: object, modules: Sequence[str] | None) -> ActivationRecord | None:
    """A step line's ``activations`` (schema 3; null or absent: none)."""
    if value is None:
        return None
    if modules is None:
        raise ValueError("activations in a step whose layout line names no modules")
    return ActivationRecord.from_json(value, modules)


def _decode_updates(value: object, names: Sequence[str] | None, spike_factor: float) -> UpdateRecord | None:
    """A step line's ``updates`` (schema 4; null or absent: none)."""
    if value is None:
        return None
    if names is None:
        raise ValueError("updates in a step whose layout line has no update_names")
    return UpdateRecord.from_json(value, names, spike_factor)


def _as_list(value: object, field: str) -> list[Any]:
    """A JSON array of a line, or an error naming its field."""
    if type(value) is not list:
        raise ValueError(f"{field} is {value!r:.60}, not an array")
    return value


def _decode_optional(value: object, field: str) -> float | None:
    return None if value is None else _decode(value, field)


def _check_schema(line: dict[str, Any], kind: str) -> None:
    schema = line.get("schema")
    if schema not in READABLE_SCHEMAS:
        raise ValueError(
            f"a {kind} line of schema {schema!r}: this nanscan reads schemas "
            f"{', '.join(map(str, READABLE_SCHEMAS))} (a file written by a newer nanscan: upgrade to read it)"
        )


def layout_line(
    names: Sequence[str],
    modules: Sequence[str] | None = None,
    update_names: Sequence[str] | None = None,
    subject: str = "gradients",
) -> dict[str, Any]:
    """The layout line of the JSONL schema (``modules``: the watched modules' names, ``update_names``:
    an update watch's parameters, if any; ``subject``: what the per-parameter arrays are of)."""
    line: dict[str, Any] = {"kind": "layout", "schema": SCHEMA, "subject": subject, "names": list(names)}
    if modules is not None:
        line["modules"] = list(modules)
    if update_names is not None:
        line["update_names"] = list(update_names)
    return line


def iter_jsonl(path: str | Path) -> Iterator[StepRecord]:
    """The step records of a JSONL file written by ``JSONLSink``, in file order.

    A last line cut short (no newline after it, not JSON: a process killed while writing) is
    dropped with a RuntimeWarning that names it; every complete record before it is read. Anything
    else that is not a line of the schema, anywhere, raises ValueError naming the file and line."""
    names: Sequence[str] | None = None
    modules: Sequence[str] | None = None
    update_names: Sequence[str] | None = None
    subject = "gradients"
    with Path(path).open("rb") as f:
        for number, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")  # (JSONLSink writes ASCII: json.dumps escapes the rest)
                line = json.loads(text) if text.strip() else None
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                # The last line, cut mid-write (never one that is not UTF-8: JSONLSink writes ASCII).
                cut = not isinstance(error, UnicodeDecodeError) and not raw.endswith(b"\n") and not f.read(1)
                if cut:
                    warnings.warn(
                        f"nanscan: {path}:{number} was cut short ({len(raw)} bytes, no end of line: a "
                        "process killed while writing it?); dropped it, read the records before it",
                        RuntimeWarning,
                        stacklevel=2,
                    )
                    return
                if isinstance(error, UnicodeDecodeError):
                    raise ValueError(
                        f"nanscan: {path}:{number} is not UTF-8 text (byte {raw[error.start]:#04x} at column "
                        f"{error.start + 1}): not a JSONL file written by nanscan.sinks.JSONLSink"
                    ) from None
                raise ValueError(
                    f"nanscan: {path}:{number} is not JSON ({error.msg}, column {error.colno}); only a last line "
                    "cut short is skipped, a damaged line before other lines is an error"
                ) from None
            if line is None:
                continue
            try:
                if type(line) is not dict:
                    raise ValueError(f"a JSON {type(line).__name__}, not an object")
                kind = line.get("kind")
                if kind == "layout":
                    _check_schema(line, "layout")
                    names = tuple(str(name) for name in _as_list(line.get("names"), "names"))
                    listed = line.get("modules")
                    modules = None if listed is None else tuple(str(m) for m in _as_list(listed, "modules"))
                    listed = line.get("update_names")
                    update_names = None if listed is None else tuple(str(n) for n in _as_list(listed, "update_names"))
                    subject = line.get("subject", "gradients")
                    if subject not in SUBJECTS:
                        raise ValueError(f"subject is {subject!r}, not one of {', '.join(SUBJECTS)}")
                elif kind == "step":
                    if names is None:
                        raise ValueError("a step before any layout line")
                    record = StepRecord.from_json(line, names, modules, update_names, subject)
                else:
                    raise ValueError(f"unknown line kind {kind!r}")
            except ValueError as error:
                raise ValueError(f"nanscan: {path}:{number}: {error}") from None
            if kind == "step":
                yield record


def read_jsonl(path: str | Path) -> list[StepRecord]:
    """Every step record of a JSONL file written by ``JSONLSink``."""
    return list(iter_jsonl(path))


RANK_PIECES = 4
"""Ranks (or runs of consecutive ranks, ``8-15``) shown in a label before the count takes over."""


def ranks_label(ranks: Iterable[int]) -> str:
    """Ranks in a few characters, for a label: ``rank 3``, ``ranks 0,2``, ``ranks 0-63`` (runs of three
    or more consecutive ranks as a range), and beyond ``RANK_PIECES`` pieces the count with the first
    ones, ``40 ranks: 0,4,8,12,…``, so a NaN on many ranks of a large world stays one short line."""
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    pieces: list[str] = []
    start = 0
    for end in range(1, len(ordered) + 1):
        if end == len(ordered) or ordered[end] != ordered[end - 1] + 1:
            run = ordered[start:end]
            pieces += [f"{run[0]}-{run[-1]}"] if len(run) >= 3 else [str(rank) for rank in run]
            start = end
    if len(pieces) > RANK_PIECES:
        return f"{len(ordered)} ranks: {','.join(pieces[:RANK_PIECES])},…"
    return f"ranks {','.join(pieces)}"
