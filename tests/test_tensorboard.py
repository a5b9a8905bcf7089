"""nanscan.integrations.tensorboard.TensorBoardSink, with the real tensorboard package: records are
written, then the event files are read back with TensorBoard's own EventAccumulator."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
from pathlib import Path
from typing import Any

import pytest

from nanscan.integrations.tensorboard import TensorBoardSink
from nanscan.records import StepRecord

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

BLOCK = [f"{module}.{kind}" for module in ("ln_1", "attn.c_attn", "mlp.c_fc") for kind in ("weight", "bias")]


def names_of(blocks: int) -> list[str]:
    return ["wte.weight", *(f"h.{b}.{name}" for b in range(blocks) for name in BLOCK)]


def record(step: int, names: list[str], *, nan: str | None = None, zero: str | None = None) -> StepRecord:
    """Norms 0.1, 0.2, ... by position (a NaN in ``nan``, 0 in ``zero``); spikes on every fifth."""
    norm = [math.nan if name == nan else 0.0 if name == zero else 0.1 * (i + 1) for i, name in enumerate(names)]
    return StepRecord(
        step=step,
        names=names,
        nan_count=[3 if name == nan else 0 for name in names],
        inf_count=[0] * len(names),
        min=[-1.0] * len(names),
        max=[1.0] * len(names),
        norm=norm,
        spike_ratio=[6.0 if i % 5 == 0 else 1.0 for i in range(len(names))],
        total_norm=math.sqrt(sum(v * v for v in norm)),
        finite=nan is None,
        clip_coef=0.5 if nan is None else None,
        max_norm=1.0 if nan is None else None,
        skipped=nan is not None,
        loss_scale=1024.0,
        spike_factor=5.0,
    )


def read_back(log_dir: Path) -> EventAccumulator:
    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    return events


def values(events: EventAccumulator, tag: str) -> dict[int, float]:
    return {event.step: event.value for event in events.Scalars(tag)}


def test_scalars_layers_parameters_and_histograms_read_back(tmp_path: Path) -> None:
    names = names_of(4)  # 25 parameters: per-parameter tags by default
    bad = "h.2.attn.c_attn.bias"
    sink = TensorBoardSink(tmp_path)
    for step in range(4):
        sink(record(step, names, nan=bad if step == 2 else None, zero="wte.weight" if step == 3 else None))
    sink.close()
    events = read_back(tmp_path)
    scalars = set(events.Tags()["scalars"])

    assert values(events, "nanscan/nonfinite_parameters") == {0: 0, 1: 0, 2: 1, 3: 0}
    assert values(events, "nanscan/nan_count") == {0: 0, 1: 0, 2: 3, 3: 0}
    assert values(events, "nanscan/inf_count") == {0: 0, 1: 0, 2: 0, 3: 0}
    assert values(events, "nanscan/skipped") == {0: 0, 1: 0, 2: 1, 3: 0}
    assert values(events, "nanscan/spikes") == dict.fromkeys(range(4), 5)  # positions 0, 5, 10, 15, 20
    assert values(events, "nanscan/loss_scale") == dict.fromkeys(range(4), 1024)
    assert values(events, "nanscan/clip_coef") == {0: 0.5, 1: 0.5, 3: 0.5}  # step 2 was not clipped
    total = values(events, "nanscan/total_norm")
    assert math.isnan(total[2]) and total[0] == pytest.approx(math.sqrt(sum((0.1 * (i + 1)) ** 2 for i in range(25))))

    # One tag per layer (weight and bias together), and one per parameter for a model this small.
    layers = {tag.removeprefix("nanscan/grad_norm/") for tag in scalars if tag.startswith("nanscan/grad_norm/")}
    assert layers == {"wte", *(f"h.{b}.{m}" for b in range(4) for m in ("ln_1", "attn.c_attn", "mlp.c_fc"))}
    c_attn = names.index("h.0.attn.c_attn.weight")
    expected = math.hypot(0.1 * (c_attn + 1), 0.1 * (c_attn + 2))
    assert values(events, "nanscan/grad_norm/h.0.attn.c_attn")[0] == pytest.approx(expected, rel=1e-6)
    assert math.isnan(values(events, "nanscan/grad_norm/h.2.attn.c_attn")[2])
    assert values(events, "nanscan/grad_norm/h.2.attn.c_attn")[1] > 0
    assert {f"nanscan/param_grad_norm/{name}" for name in names} <= scalars
    assert math.isnan(values(events, f"nanscan/param_grad_norm/{bad}")[2])

    # The histogram holds the finite, non-zero norms; the NaN one is counted beside it.
    histograms = {event.step: event.histogram_value for event in events.Histograms("nanscan/log10_grad_norm")}
    assert sorted(histograms) == [0, 1, 2, 3]
    assert histograms[0].num == 25 and histograms[2].num == 24 and histograms[3].num == 24
    assert histograms[0].min == pytest.approx(math.log10(0.1)) and histograms[0].max == pytest.approx(math.log10(2.5))
    assert values(events, "nanscan/nonfinite_norms") == {0: 0, 1: 0, 2: 1, 3: 0}


def test_a_large_model_gets_layer_tags_only(tmp_path: Path) -> None:
    names = names_of(180)  # 1,081 parameters in 541 layers
    sink = TensorBoardSink(str(tmp_path), prefix="grads", histograms=False)
    sink(record(0, names))
    sink.close()
    scalars = read_back(tmp_path).Tags()["scalars"]
    layer_tags = [tag for tag in scalars if tag.startswith("grads/grad_norm/")]
    assert len(layer_tags) == 181  # a block per tag (541 layers are too many), and wte
    assert "grads/grad_norm/h.137" in layer_tags
    assert not any(tag.startswith("grads/param_grad_norm/") for tag in scalars)
    assert "grads/nonfinite_norms" not in scalars
    assert not read_back(tmp_path).Tags()["histograms"]


class RecordingWriter:
    """A writer that remembers what it was given, to see what the sink does with one it does not own."""

    def __init__(self) -> None:
        self.scalars: list[tuple[str, float, int | None]] = []
        self.histograms: list[str] = []
        self.calls: list[str] = []

    def add_scalar(self, tag: str, scalar_value: float, global_step: int | None = None) -> None:
        self.scalars.append((tag, scalar_value, global_step))

    def add_histogram(self, tag: str, values: Any, global_step: int | None = None) -> None:
        self.histograms.append(tag)

    def flush(self) -> None:
        self.calls.append("flush")

    def close(self) -> None:
        self.calls.append("close")


def test_a_given_writer_is_flushed_not_closed_and_global_step_is_mapped() -> None:
    writer = RecordingWriter()
    names = names_of(1)
    sink = TensorBoardSink(writer, per_parameter=False, global_step=lambda r: 1000 + 10 * r.step)
    sink(record(0, names))
    sink(record(1, names))
    sink.flush()
    sink.close()
    sink.close()
    assert writer.calls == ["flush", "flush"]
    assert {step for _, _, step in writer.scalars} == {1000, 1010}
    assert not any("param_grad_norm" in tag for tag, _, _ in writer.scalars)
    assert writer.histograms == ["nanscan/log10_grad_norm"] * 2
    with pytest.raises(ValueError, match="closed"):
        sink(record(2, names))


def test_a_layout_change_regroups_the_layers() -> None:
    writer = RecordingWriter()
    sink = TensorBoardSink(writer)
    sink(record(0, names_of(1)))
    sink(record(1, names_of(2)))
    layers = {tag for tag, _, step in writer.scalars if step == 1 and tag.startswith("nanscan/grad_norm/")}
    assert "nanscan/grad_norm/h.1.mlp.c_fc" in layers


def test_a_summary_writer_given_to_the_sink_stays_open_for_its_owner(tmp_path: Path) -> None:
    from torch.utils.tensorboard import SummaryWriter

    writer = SummaryWriter(str(tmp_path))
    sink = TensorBoardSink(writer)
    sink(record(0, names_of(1)))
    sink.close()
    writer.add_scalar("after", 1.0, 0)  # the owner's writer still works after the sink's close
    writer.close()
    scalars = read_back(tmp_path).Tags()["scalars"]
    assert "after" in scalars and "nanscan/total_norm" in scalars


def test_missing_tensorboard_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tensorboard", None)
    with pytest.raises(ImportError, match=r"pip install tensorboard \(or nanscan\[tensorboard\]\)"):
        TensorBoardSink(tmp_path)


def test_ranks_of_a_nonfinite_step_are_counted_per_rank() -> None:
    writer = RecordingWriter()
    sink = TensorBoardSink(writer, per_parameter=False, histograms=False)
    names = names_of(1)
    bad = record(1, names, nan="h.0.ln_1.weight")
    sink(record(0, names))
    sink(dataclasses.replace(bad, nonfinite_ranks={"h.0.ln_1.weight": [1, 3], "wte.weight": [3]}))
    sink(record(2, names))  # a record made without ranks (None): no rank tags
    by_rank = [(tag, value, step) for tag, value, step in writer.scalars if "nonfinite_rank/" in tag]
    assert by_rank == [("nanscan/nonfinite_rank/1", 1.0, 1), ("nanscan/nonfinite_rank/3", 2.0, 1)]


def test_a_single_process_rank_0_is_not_logged_as_a_rank() -> None:
    writer = RecordingWriter()
    sink = TensorBoardSink(writer, per_parameter=False, histograms=False)
    names = names_of(1)
    bad = record(1, names, nan="h.0.ln_1.weight")
    sink(dataclasses.replace(bad, nonfinite_ranks={"h.0.ln_1.weight": [0]}))  # what a single process records
    assert [tag for tag, _, _ in writer.scalars if "nonfinite_rank/" in tag] == []
    assert ("nanscan/nonfinite_parameters", 1.0, 1) in writer.scalars


def test_a_log_directory_is_opened_at_the_first_record_where_the_rank_is_not_known_before(tmp_path: Path) -> None:
    """Made in a process that does not know yet whether it is one rank of several (Lightning's DDP
    starts torch.distributed after the script has made its sinks), the sink creates nothing; its
    first record opens the writer."""
    sink = TensorBoardSink(tmp_path / "tb")
    assert not list(tmp_path.iterdir()) and sink.writer is None
    sink(record(0, names_of(1)))
    sink.close()
    assert sink.writer is not None and "nanscan/total_norm" in read_back(tmp_path / "tb").Tags()["scalars"]


@pytest.mark.parametrize("rank", [0, 1])
def test_a_log_directory_is_written_by_rank_0_or_by_every_rank_with_the_rank_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """A rank of a launched world (here torchrun's RANK/WORLD_SIZE without torch.distributed, so its
    rank is known when the sink is made, and the writer opened then): a shared directory is rank
    0's alone (rank 1 is told), and ``{rank}`` gives each rank one of its own."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    shared, own = TensorBoardSink(tmp_path / "tb"), TensorBoardSink(tmp_path / "tb-{rank}")
    assert (shared.writer is None) == (rank == 1) and own.writer is not None
    # Told at the first record, if torch.distributed is not initialized by then (the usual script
    # makes its sinks, then initializes it, and its checks are the model's: nothing to say then).
    with pytest.warns(RuntimeWarning, match="rank 1 of 2") if rank else contextlib.nullcontext():
        for sink in (shared, own):
            sink(record(0, names_of(1)))
            sink.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ([f"tb-{rank}"] if rank else ["tb", "tb-0"])
    assert "nanscan/total_norm" in read_back(tmp_path / f"tb-{rank}").Tags()["scalars"]


def test_a_log_directory_that_is_a_file_is_refused_when_the_sink_is_made(tmp_path: Path) -> None:
    (tmp_path / "tb").write_text("")
    with pytest.raises(NotADirectoryError, match=r"TensorBoardSink: .*tb is a file, not a directory"):
        TensorBoardSink(tmp_path / "tb")
