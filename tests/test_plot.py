"""nanscan.layers (parameters grouped into layers) and nanscan.plot (pictures of a recorded run).

The records are built directly (synthetic, deterministic) and go through JSONLSink, as a Recorder's do.
The grouping and downsampling functions are checked on their own; the pictures are checked for being
PNGs of the expected size and, through the figure ``draw_run`` returns, for what they annotate.
"""

from __future__ import annotations

import importlib.util
import math
import struct
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
from test_recorder import attributed, backward, model, plant

import nanscan
from nanscan.layers import Group, group_layers, group_norms, layer_name
from nanscan.plot import Grid, downsample, group_rows, load_run, ranks_label
from nanscan.records import StepRecord, read_jsonl
from nanscan.sinks import JSONLSink

from conftest import ROOT

PNG_SIZE = (1320, 880)  # 12 x 8 inches at 110 dpi


def _tool(name: str) -> ModuleType:
    """A script of tools/ as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# GPT-2's parameter names, as the docs' example picture has them (one definition, in its script).
_example = _tool("make_plot_example")
BLOCK: list[str] = _example.BLOCK
gpt2_names = _example.gpt2_names


def make_records(
    names: list[str],
    steps: int,
    *,
    nan_at: dict[int, list[str]] | None = None,
    skipped: tuple[int, ...] = (),
    spikes: dict[int, list[str]] | None = None,
) -> list[StepRecord]:
    """Norms drifting down from step 0, a NaN in the named parameters at the given steps (those steps
    not finite), spikes (spike ratio 10 against a factor of 5) where asked."""
    nan_at = nan_at or {}
    spikes = spikes or {}
    records = []
    for step in range(steps):
        norm = [(1 + i % 7) * 0.1 * math.exp(-step / 50) + 0.01 for i in range(len(names))]
        nan_count = [5 if name in nan_at.get(step, ()) else 0 for name in names]
        norm = [math.nan if nan else value for nan, value in zip(nan_count, norm, strict=True)]
        ratio = [10.0 if name in spikes.get(step, ()) else 1.0 for name in names]
        records.append(
            StepRecord(
                step=step,
                names=names,
                nan_count=nan_count,
                inf_count=[0] * len(names),
                min=[-v / 10 for v in norm],
                max=[v / 10 for v in norm],
                norm=norm,
                spike_ratio=ratio,
                total_norm=math.sqrt(sum(v * v for v in norm)),
                finite=not any(nan_count),
                clip_coef=1.0,
                max_norm=1.0,
                skipped=step in skipped,
                loss_scale=None,
                spike_factor=5.0,
            )
        )
    return records


def write_jsonl(path: Path, records: list[StepRecord]) -> Path:
    sink = JSONLSink(path)
    for record in records:
        sink(record)
    sink.close()
    return path


def png_size(path: Path) -> tuple[int, int]:
    """The width and height of a PNG's IHDR chunk, after checking the signature."""
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def figure_texts(figure: object) -> list[str]:
    from matplotlib.text import Text

    return [text.get_text() for text in figure.findobj(Text)]  # type: ignore[attr-defined]


# --- layers ---------------------------------------------------------------------------------------


def test_layer_name_drops_the_last_component() -> None:
    assert layer_name("transformer.h.3.attn.c_attn.weight") == "transformer.h.3.attn.c_attn"
    assert layer_name("bias") == "bias"


def test_gpt2_small_groups_weight_and_bias_of_each_layer() -> None:
    names = gpt2_names(12)
    assert len(names) == 148
    groups = group_layers(names)
    by_name = {group.name: group for group in groups}
    assert len(groups) == 2 + 12 * 6 + 1
    c_attn = by_name["transformer.h.3.attn.c_attn"]
    assert [names[i] for i in c_attn.members] == [
        "transformer.h.3.attn.c_attn.weight",
        "transformer.h.3.attn.c_attn.bias",
    ]


def test_a_1200_parameter_model_collapses_to_blocks() -> None:
    names = gpt2_names(100)
    assert len(names) == 1204
    groups = group_layers(names, max_groups=200)
    # Layers (600) and sub-modules (400) are too many: one group per block, plus the 3 outside them.
    assert [g.name for g in groups[:3]] == ["transformer.wte", "transformer.wpe", "transformer.h.0"]
    assert len(groups) == 103
    assert sorted(i for g in groups for i in g.members) == list(range(len(names)))
    assert [names[i] for i in groups[2].members] == [f"transformer.h.0.{name}" for name in BLOCK]


def test_too_many_numbered_blocks_merge_into_ranges() -> None:
    names = [f"blocks.{i}.{kind}" for i in range(500) for kind in ("weight", "bias")]
    groups = group_layers(names, max_groups=200)
    assert len(groups) == 125
    assert groups[0].name == "blocks.0-3"
    assert groups[-1].name == "blocks.496-499"
    assert [names[i] for i in groups[1].members] == [f"blocks.{i}.{k}" for i in range(4, 8) for k in ("weight", "bias")]


def test_names_without_structure_merge_with_neighbours() -> None:
    names = [f"p{i}" for i in range(1000)]
    groups = group_layers(names, max_groups=200)
    assert len(groups) == 200
    assert groups[0] == Group("p0 … p4", (0, 1, 2, 3, 4))
    assert sorted(i for g in groups for i in g.members) == list(range(1000))


def test_group_norms_are_the_root_of_summed_squares_and_nan_or_inf_if_any_member_is() -> None:
    groups = [Group("a", (0, 3)), Group("b", (1,)), Group("c", (2, 4)), Group("d", (5, 6))]
    norms = [3.0, 2.0, math.nan, 4.0, 1.0, math.inf, 1.0]
    out = group_norms(norms, groups)
    assert out[0] == 5.0
    assert out[1] == 2.0
    assert math.isnan(out[2])
    assert out[3] == math.inf
    # One column per step: every column is grouped the same way.
    steps = group_norms(
        np.array([[3.0, 6.0], [0.0, 0.0], [1.0, 1.0], [4.0, 8.0], [1.0, 1.0], [0.0, 0.0], [2.0, 2.0]]), groups
    )
    np.testing.assert_allclose(steps[0], [5.0, 10.0])
    np.testing.assert_allclose(steps[2], [math.sqrt(2), math.sqrt(2)])


# --- the run as arrays -----------------------------------------------------------------------------


def test_layout_changes_use_the_union_of_names_with_absent_cells_missing() -> None:
    first = make_records(["a.w", "b.w"], 2)
    later = [replace(r, step=r.step + 2) for r in make_records(["b.w", "c.w"], 2)]
    run = load_run([*first, *later])
    assert run.names == ["a.w", "b.w", "c.w"]
    assert run.missing.tolist() == [
        [False, False, True, True],
        [False, False, False, False],
        [True, True, False, False],
    ]
    assert run.steps.tolist() == [0, 1, 2, 3]
    grid = group_rows(run)
    assert np.isnan(grid.value[0, 2]) and not grid.nan[0, 2]  # absent: blank, not NaN
    with pytest.raises(ValueError, match="name no parameters"):
        load_run(
            [replace(r, names=[], norm=[], nan_count=[], inf_count=[], min=[], max=[], spike_ratio=[]) for r in first]
        )


def test_grouped_rows_combine_norms_and_keep_every_flag() -> None:
    names = [f"layer{i}.{kind}" for i in range(6) for kind in ("weight", "bias")]
    records = make_records(names, 3, nan_at={1: ["layer2.bias"]}, spikes={2: ["layer4.weight"]})
    run = load_run(records)
    grid = group_rows(run, max_rows=8)  # 12 parameters > 8 rows: one row per layer
    assert [g.name for g in grid.groups] == [f"layer{i}" for i in range(6)]
    expected = math.hypot(records[0].norm[0], records[0].norm[1])
    assert grid.value[0, 0] == pytest.approx(expected, rel=1e-12)
    assert grid.nan[:, 1].tolist() == [False, False, True, False, False, False]
    assert np.isnan(grid.value[2, 1])
    assert grid.nonfinite.tolist() == [False, True, False]
    assert grid.spike[4].tolist() == [False, False, True]
    assert grid.spiked.tolist() == [False, False, True]


def test_downsampling_keeps_a_single_nan_and_takes_the_largest_norm() -> None:
    rows, columns = 3, 10_000
    value = np.tile(np.linspace(1.0, 2.0, columns), (rows, 1))
    nan = np.zeros((rows, columns), dtype=bool)
    nan[1, 7_777] = True
    value[1, 7_777] = np.nan
    missing = np.zeros((rows, columns), dtype=bool)
    missing[2, :5_000] = True
    missing[2, 4_990] = False  # one present step in an otherwise absent bin: the bin is not blank
    value[2, :5_000] = np.where(missing[2, :5_000], np.nan, value[2, :5_000])
    column = np.zeros(columns, dtype=bool)
    skipped = column.copy()
    skipped[123] = True
    grid = Grid(
        groups=[Group(f"r{i}", (i,)) for i in range(rows)],
        value=value,
        nan=nan,
        inf=np.zeros_like(nan),
        missing=missing,
        spike=np.zeros_like(nan),
        nonfinite=np.asarray(nan.any(axis=0)),
        skipped=skipped,
        spiked=column,
        per_column=1,
    )
    small = downsample(grid, max_columns=500)
    assert small.value.shape == (3, 500)
    assert small.per_column == 20
    assert np.flatnonzero(small.nan[1]).tolist() == [7_777 // 20]
    assert np.flatnonzero(small.nonfinite).tolist() == [7_777 // 20]
    assert np.flatnonzero(small.skipped).tolist() == [123 // 20]
    # The bin of the NaN still holds the largest finite norm of its other 19 steps.
    assert small.value[1, 7_777 // 20] == value[0, 7_779]
    np.testing.assert_array_equal(small.value[0], value[0, 19::20])
    assert small.missing[2].tolist() == [True] * 249 + [False] * 251
    assert downsample(grid, max_columns=columns) is grid


# --- pictures --------------------------------------------------------------------------------------


def test_cli_draws_a_gpt2_small_run_with_a_nan_a_skipped_step_and_a_spike(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    from nanscan.__main__ import main

    names = gpt2_names(12)
    bad = "transformer.h.3.attn.c_attn.weight"
    records = make_records(
        names, 120, nan_at={90: [bad]}, skipped=(90,), spikes={85: ["transformer.h.3.mlp.c_fc.weight"]}
    )
    run = write_jsonl(tmp_path / "run.jsonl", records)
    out = tmp_path / "pictures" / "run.png"
    assert main(["plot", str(run), "-o", str(out), "--title", "gpt2 small"]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    assert png_size(out) == PNG_SIZE
    assert out.stat().st_size < 200_000


def test_cli_default_output_is_next_to_the_input(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from nanscan.__main__ import main

    run = write_jsonl(tmp_path / "one.jsonl", make_records(["w"], 1))
    assert main(["plot", str(run)]) == 0  # one step, one parameter: still a picture
    assert png_size(tmp_path / "one.png") == PNG_SIZE


def test_api_draws_a_1200_parameter_run_by_layer(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from nanscan.plot import draw_run, plot_run

    names = gpt2_names(100)
    bad = [f"transformer.h.{b}.mlp.c_proj.weight" for b in (40, 41, 42, 43, 44)]
    records = make_records(names, 40, nan_at={30: bad})
    run = write_jsonl(tmp_path / "big.jsonl", records)
    out = plot_run(run, tmp_path / "big.png")
    assert out == tmp_path / "big.png"
    assert png_size(out) == PNG_SIZE
    texts = figure_texts(draw_run(run))
    assert "big.jsonl" in texts
    assert any("in 103 layer rows" in text for text in texts)
    note = next(text for text in texts if text.startswith("first non-finite: step 30\n"))
    assert note.endswith(" +2 more\nin row transformer.h.40") and bad[0] in note and bad[3] not in note
    assert any(label.startswith("transformer.h.") and label.endswith("(12)") for label in texts)


def test_edge_cases_draw_and_say_what_they_show(tmp_path: Path) -> None:
    """A layout change, zero norms, an Inf, an all-NaN step and a run long enough to be binned."""
    pytest.importorskip("matplotlib")
    from nanscan.plot import draw_run, plot_run

    records = make_records([f"m.{i}.w" for i in range(20)], 700, nan_at={650: [f"m.{i}.w" for i in range(20)]})
    changed = []
    for record in records:
        norm = list(record.norm)
        norm[3] = 0.0
        inf_count = [0] * 20
        if record.step == 400:
            norm[5], inf_count[5] = math.inf, 2
        # From step 500, m.19 loses its gradient and m.20 gains one.
        names = [*record.names[:19], "m.20.w"] if record.step >= 500 else list(record.names)
        finite = record.finite and record.step != 400
        changed.append(replace(record, names=names, norm=norm, inf_count=inf_count, finite=finite))
    out = plot_run(changed, tmp_path / "edge.png", title="edge cases")
    assert png_size(out) == PNG_SIZE
    texts = figure_texts(draw_run(changed))
    assert any(text.startswith("first non-finite: step 400\nm.5.w") for text in texts)
    assert any("a zero norm is drawn at the floor" in text for text in texts)
    assert any("2 steps per column" in text for text in texts)
    run = load_run(changed)
    assert run.names[-1] == "m.20.w" and run.missing[-1, :500].all() and not run.missing[-1, 500:].any()


def test_ranks_label_stays_short_for_any_set_of_ranks() -> None:
    assert ranks_label([3]) == "rank 3"
    assert ranks_label([2, 0, 2]) == "ranks 0,2"
    assert ranks_label([0, 1]) == "ranks 0,1"  # a pair is two ranks, not a range
    assert ranks_label(range(64)) == "ranks 0-63"
    assert ranks_label([0, 1, 2, 5, 8, 9, 10, 11]) == "ranks 0-2,5,8-11"
    assert ranks_label(range(0, 1024, 8)) == "128 ranks: 0,8,16,24,…"
    assert ranks_label([1, 2, 3, 7, 8, 9, 20, 30, 31, 40]) == "10 ranks: 1-3,7-9,20,30,…"


def recorded_run(path: Path, ranks: dict[str, list[int]] | None, world: int = 4) -> Path:
    """A real Recorder's JSONL of 6 checks of a small model, a NaN in ``0.weight`` and an Inf in
    ``2.bias`` at step 3; with ``ranks``, each report carries the attribution a distributed check
    would have made (held by those ranks), else it is a single process's."""
    m = model()
    recorder = nanscan.Recorder([JSONLSink(path)], every=4, warn=False)
    for step in range(6):
        backward(m, step)
        if step == 3:
            plant(m, "0.weight", math.nan)
            plant(m, "2.bias", math.inf)
        report = nanscan.check(m)
        if ranks is not None:
            held = ranks if step == 3 else {}
            report = attributed(report, world, held, sorted({r for rs in held.values() for r in rs}))
        recorder.append(report)
        m.zero_grad()
    recorder.close()
    return path


def first_notes(texts: list[str]) -> tuple[str, str]:
    """The heatmap's and the total norm panel's annotations of the first non-finite step."""
    heat = next(text for text in texts if text.startswith("first non-finite") and "\n" in text)
    totals = next(text for text in texts if text.startswith("first non-finite") and "\n" not in text)
    return heat, totals


def test_the_first_nonfinite_step_names_the_ranks_a_distributed_run_recorded(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from nanscan.plot import draw_run, plot_run

    path = recorded_run(tmp_path / "dist.jsonl", {"0.weight": [3], "2.bias": [0, 2]})
    assert read_jsonl(path)[3].nonfinite_ranks == {"0.weight": [3], "2.bias": [0, 2]}
    heat, totals = first_notes(figure_texts(draw_run(path)))
    # The ranks of the whole step once, then each name's own where they differ.
    assert heat == "first non-finite: step 3 on ranks 0,2,3\n0.weight (rank 3)\n2.bias (ranks 0,2)"
    assert totals == "first non-finite: step 3 on ranks 0,2,3 (0.weight +1 more)"
    assert png_size(plot_run(path, tmp_path / "dist.png")) == PNG_SIZE

    # One rank's shard held every NaN/Inf (the usual case): the rank is named once, not per name.
    same = recorded_run(tmp_path / "same.jsonl", {"0.weight": [5], "2.bias": [5]}, world=8)
    heat, totals = first_notes(figure_texts(draw_run(same)))
    assert heat == "first non-finite: step 3 on rank 5\n0.weight\n2.bias"
    assert totals == "first non-finite: step 3 on rank 5 (0.weight +1 more)"


def test_a_single_process_run_and_a_schema_1_file_draw_as_before(tmp_path: Path) -> None:
    """A single process records rank 0 for its NaN/Inf, as every rank-0-only record does: no rank is
    drawn, the texts are those of the same records without ranks (what a schema 1 file reads as)."""
    pytest.importorskip("matplotlib")
    from nanscan.plot import draw_run

    path = recorded_run(tmp_path / "single.jsonl", None)
    records = read_jsonl(path)
    assert records[3].nonfinite_ranks == {"0.weight": [0], "2.bias": [0]}, "the premise: rank 0 recorded"
    texts = figure_texts(draw_run(records))
    assert texts == figure_texts(draw_run([replace(r, nonfinite_ranks=None) for r in records]))
    assert first_notes(texts) == (
        "first non-finite: step 3\n0.weight\n2.bias",
        "first non-finite: step 3 (0.weight, 2.bias)",
    )
    # Rank 0 in a run that names another rank elsewhere is a distributed run's rank 0: named.
    later = replace(records[4], finite=False, nan_count=records[3].nan_count, nonfinite_ranks={"0.weight": [1]})
    heat, _ = first_notes(figure_texts(draw_run([*records[:4], later])))
    assert heat.startswith("first non-finite: step 3 on rank 0\n")


def test_runs_appended_to_one_file_are_drawn_side_by_side_not_joined(tmp_path: Path) -> None:
    """A job run twice (or resumed) into one JSONL: its steps restart; the plot marks where and breaks
    the total norm's line there, rather than drawing one run whose steps go 0..39, 0..39."""
    pytest.importorskip("matplotlib")
    from nanscan.plot import draw_run

    first = make_records(["a.w", "b.w"], 40, nan_at={25: ["a.w"]})
    resumed = [replace(r, step=r.step + 10) for r in make_records(["a.w", "b.w"], 30)]  # from a checkpoint
    path = write_jsonl(tmp_path / "run.jsonl", first + first + resumed)
    run = load_run(path)
    assert run.run_starts == (40, 80) and list(run.steps[78:82]) == [38, 39, 10, 11]
    assert load_run(first).run_starts == ()
    figure = draw_run(path)
    texts = figure_texts(figure)
    assert any(t.startswith("110 steps in 3 runs appended to one file (0-39, 0-39, 10-39)") for t in texts), texts
    assert " run 2: steps from 0" in texts and " run 3: steps from 10" in texts
    totals = figure.axes[2]
    curves = [line for line in totals.get_lines() if str(line.get_color()) == "#1f77b4"]
    assert [len(line.get_xdata()) for line in curves] == [40, 40, 30], "one line per run, none joining two"
    boundaries = {float(line.get_xdata()[0]) for line in totals.get_lines() if str(line.get_color()) == "#1a1a1a"}
    assert boundaries == {39.5, 79.5}


def test_an_all_finite_run_has_no_annotation() -> None:
    pytest.importorskip("matplotlib")
    from nanscan.plot import draw_run

    texts = figure_texts(draw_run(make_records(gpt2_names(2), 30), title="fine"))
    assert "fine" in texts
    assert not any("first non-finite" in text for text in texts)


def test_cli_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from nanscan.__main__ import main

    assert main(["plot", str(tmp_path / "absent.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert main(["nope"]) == 2
    capsys.readouterr()
    assert main([]) == 2
    missing = capsys.readouterr()
    assert missing.out == "" and "python -m nanscan plot RUN.jsonl" in missing.err, "no command: usage, on stderr"
    assert "[--device DEV] [--out DIR]" in missing.err
    assert main(["--help"]) == 0
    assert "python -m nanscan plot RUN.jsonl" in capsys.readouterr().out


def test_cli_says_in_one_line_why_an_input_cannot_be_read(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    from nanscan.__main__ import main

    (tmp_path / "adir").mkdir()
    assert main(["plot", str(tmp_path / "adir")]) == 2
    assert capsys.readouterr().err == f"nanscan: {tmp_path / 'adir'} is a directory, not a JSONL file\n"
    binary = tmp_path / "bin.jsonl"
    binary.write_bytes(b'{"kind": "layout", "schema": 4, "names": ["w"]}\n\x7fELF\xd0\x01 no newline')
    assert main(["plot", str(binary)]) == 1
    err = capsys.readouterr().err
    assert err == f"nanscan: {binary}:2 is not UTF-8 text (byte 0xd0 at column 5): not a JSONL file written by " + (
        "nanscan.sinks.JSONLSink\n"
    ), "file, line and column; not taken for a line cut short"


@pytest.mark.parametrize(
    ("output", "message"),
    [
        ("{tmp}/run.jsonl/x.png", "cannot write {tmp}/run.jsonl/x.png: "),  # its folder is a file
        ("{tmp}/adir", "cannot write {tmp}/adir: it is a directory"),
        ("{tmp}/run.jpg", "cannot write {tmp}/run.jpg: the suffix '.jpg' is not a picture format nanscan writes"),
        ("/sys/nanscan-x.png", "cannot write /sys/nanscan-x.png: Permission denied"),  # sysfs: not even root
    ],
)
def test_cli_refuses_an_output_it_cannot_write_before_drawing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, output: str, message: str
) -> None:
    pytest.importorskip("matplotlib")
    import nanscan.plot
    from nanscan.__main__ import main

    if output.startswith("/sys") and not Path("/sys/kernel").is_dir():
        pytest.skip("no sysfs")
    (tmp_path / "adir").mkdir()
    run = write_jsonl(tmp_path / "run.jsonl", make_records(["w"], 3))

    def never(*args: object, **kwargs: object) -> None:
        raise AssertionError("drawn before the output was checked")

    monkeypatch.setattr(nanscan.plot, "draw_run", never)
    assert main(["plot", str(run), "-o", output.format(tmp=tmp_path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("nanscan: " + message.format(tmp=tmp_path)) and captured.err.count("\n") == 1
    assert "Traceback" not in captured.err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adir", "run.jsonl"], "nothing written"


@pytest.mark.parametrize(("suffix", "magic"), [(".svg", b"<?xml"), (".pdf", b"%PDF"), (".PNG", b"\x89PNG")])
def test_the_output_suffix_picks_the_format(tmp_path: Path, suffix: str, magic: bytes) -> None:
    pytest.importorskip("matplotlib")
    from nanscan.plot import plot_run

    out = plot_run(make_records(["w"], 3), tmp_path / f"run{suffix}")
    assert out.read_bytes().startswith(magic), "the bytes of the format asked for, not PNG under any name"


def test_cli_refuses_a_run_without_steps(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")  # the plot asks for matplotlib before it reads the run
    from nanscan.__main__ import main

    layout_only = tmp_path / "layout_only.jsonl"
    layout_only.write_text('{"kind": "layout", "schema": 1, "names": ["w"]}\n')
    assert main(["plot", str(layout_only)]) == 1
    assert "has no step records to plot" in capsys.readouterr().err


def test_missing_matplotlib_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from nanscan.plot import plot_run

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match=r"pip install matplotlib \(or nanscan\[plot\]\)"):
        plot_run(make_records(["w"], 1), tmp_path / "x.png")


def test_importing_nanscan_plot_or_the_tensorboard_sink_imports_neither_package() -> None:
    code = (
        "import sys, nanscan.plot, nanscan.integrations.tensorboard\n"
        "loaded = [m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'tensorboard')]\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- activations ------------------------------------------------------------------------------------


class _Blowup(torch.nn.Module):
    """Passes its input on, times ``factor``; NaN from the step ``bad`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.factor, self.bad = 1.0, False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * self.factor
        return y * math.nan if self.bad else y


def activation_run(path: Path) -> Path:
    """A real Recorder's JSONL of 8 checks with an activation watch sampling every other forward: the
    middle module's outputs pass fp16's 65504 from step 2 and are NaN from step 6."""
    torch.manual_seed(0)
    blowup = _Blowup()
    m = torch.nn.Sequential(torch.nn.Linear(4, 6), blowup, torch.nn.Linear(6, 2))
    watch = nanscan.watch_activations(m, every=2)
    recorder = nanscan.Recorder([JSONLSink(path)], every=4, warn=False, activations=watch)
    for step in range(8):
        blowup.factor = 1e6 if step >= 2 else 1.0
        blowup.bad = step >= 6
        m.zero_grad()
        m(torch.ones(3, 4)).sum().backward()
        nanscan.check(m, recorder=recorder)
    recorder.close()
    return path


def test_activation_figures_load_as_a_module_by_step_grid(tmp_path: Path) -> None:
    run = load_run(activation_run(tmp_path / "acts.jsonl"))
    acts = run.activations
    assert acts is not None and acts.modules == ["0", "1", "2"]  # the model's own output is its last module's
    sampled = np.isfinite(acts.amax).all(axis=0)
    assert sampled.tolist() == [True, False] * 4
    assert acts.amax[1, 2] > 65504 > acts.amax[1, 0]
    assert acts.nonfinite[:, 6].tolist() == [False, True, True] and not acts.nonfinite[:, :6].any()
    assert acts.first_nonfinite == (6, ["1", "2"])
    assert load_run(recorded_run(tmp_path / "plain.jsonl", None)).activations is None


def test_unsampled_steps_hold_the_last_sample() -> None:
    from nanscan.plot import _held

    nan = math.nan
    amax = np.array([[nan, 1.0, nan, nan, 5.0], [nan, 2.0, nan, nan, 6.0]])
    bad = np.array([[False, False, False, False, True], [False, True, False, False, False]])
    held, held_bad = _held(amax, bad)
    assert np.array_equal(held, np.array([[nan, 1, 1, 1, 5], [nan, 2, 2, 2, 6]]), equal_nan=True)
    assert held_bad.tolist() == [[False, False, False, False, True], [False, True, True, True, False]]


def test_the_activation_panel_marks_fp16s_limit_and_names_the_first_nonfinite_module(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from nanscan.plot import draw_run, plot_run

    path = activation_run(tmp_path / "acts.jsonl")
    texts = figure_texts(draw_run(path))
    assert "first non-finite output: step 6\n1, 2" in texts
    assert "log10 activation amax (orange line: fp16's 65504)" in texts
    assert "module outputs\n4 of 8 steps sampled, held between" in texts, texts
    assert png_size(plot_run(path, tmp_path / "acts.png")) == (1320, 1210)  # 12 x 11 inches


def test_more_modules_than_rows_keep_the_nonfinite_and_the_largest() -> None:
    from nanscan.plot import Activations, _worst_modules

    nan = math.nan
    amax = np.array([[1.0, nan], [5.0, nan], [2.0, nan], [0.5, nan], [9.0, nan]])
    bad = np.zeros_like(amax, dtype=bool)
    bad[3, 0] = True  # the smallest amax, but non-finite: kept first
    acts = Activations(["a", "b", "c", "d", "e"], amax, bad, (0, ["d"]))
    assert _worst_modules(acts, 3) == [1, 3, 4]  # d, then e and b by amax; in model order
    assert _worst_modules(acts, 5) == [0, 1, 2, 3, 4]


def test_the_api_reference_lists_the_public_names_users_meet() -> None:
    """The names the docs and the returned objects lead a user to, each in docs/api.md."""
    api = (ROOT / "docs" / "api.md").read_text()
    for name in (
        "nanscan.plot.plot_run",
        "nanscan.plot.draw_run",
        "nanscan.plot.load_run",
        "nanscan.plot.check_output",
        "nanscan.recorder.FirstNonfinite",
        "nanscan.integrations.tensorboard.TensorBoardSink",
        "nanscan.integrations.tensorboard.Writer",
    ):
        assert f":: {name}\n" in api, name
