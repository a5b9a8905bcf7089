"""The training state in the records: ``Recorder(updates=watch)`` keeps each measured optimizer step's
update and weight norms (against a float64 reference), flags ratio spikes, and writes them to JSONL,
CSV, TensorBoard and the plot; ``check_state``'s records say their subject all the way through."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

import nanscan
from nanscan.layers import group_layers
from nanscan.records import SCHEMA, StepRecord, UpdateRecord, read_jsonl
from nanscan.sinks import CSVSink, JSONLSink

from conftest import needs_cuda, syncs_refused

NAMES = ["0.weight", "0.bias", "2.weight", "2.bias"]


def mlp(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(device)


def backward(model: torch.nn.Module, seed: int) -> None:
    torch.manual_seed(1000 + seed)
    device = next(model.parameters()).device
    model(torch.randn(5, 8, device=device)).pow(2).sum().backward()


def weights(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().double().clone() for p in model.parameters()]


def test_records_carry_each_measured_steps_norms_against_float64() -> None:
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    records: list[StepRecord] = []
    updates = nanscan.watch_updates(optimizer, model, every=2)
    recorder = nanscan.Recorder([records.append], every=3, updates=updates, warn=False)
    want: dict[int, tuple[list[float], list[float]]] = {}  # record index -> (‖Δw‖, ‖w‖) it must hold
    for step in range(7):
        optimizer.zero_grad()
        backward(model, step)
        nanscan.check(model, recorder=recorder)
        before = weights(model)
        optimizer.step()
        after = weights(model)
        if step % 2 == 0:  # measured; the next record (the check of the step after) carries it
            want[step + 1] = (
                [(a - b).norm().item() for a, b in zip(after, before, strict=True)],
                [a.norm().item() for a in after],
            )
    recorder.close()
    assert len(records) == 7
    for record in records:
        if record.step not in want:
            assert record.updates is None, record.step
            continue
        figures = record.updates
        assert figures is not None and list(figures.names) == NAMES and figures.steps == 1
        update_norm, weight_norm = want[record.step]
        # float32 in the record: the norms as the watch computed them, rounded once.
        assert figures.update_norm == pytest.approx(update_norm, rel=1e-6)
        assert figures.weight_norm == pytest.approx(weight_norm, rel=1e-6)
        assert figures.ratio == pytest.approx([u / w for u, w in zip(update_norm, weight_norm, strict=True)], rel=1e-6)
    assert records[-1].updates is None  # step 6 was measured after the last record


def test_steps_say_how_many_were_measured_since_the_record_before() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records: list[StepRecord] = []
    with nanscan.watch_updates(optimizer, model) as updates:
        recorder = nanscan.Recorder([records.append], every=1, updates=updates)
        for step in range(6):
            optimizer.zero_grad()
            backward(model, step)
            optimizer.step()
            if step % 3 == 2:
                nanscan.check(model, recorder=recorder)
        recorder.close()
        assert [r.updates.steps if r.updates else None for r in records] == [3, 3]
        last = records[-1].updates
        assert last is not None and last.ratio == pytest.approx(list(updates.ratios().values()), rel=1e-6)


def test_a_learning_rate_jump_is_an_update_ratio_spike(tmp_path: Path) -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    updates = nanscan.watch_updates(optimizer, model)
    recorder = nanscan.Recorder([], every=5, spike_window=8, spike_min_history=4, updates=updates)
    jump = 12
    with pytest.warns(RuntimeWarning, match=rf"update ratio spike at step {jump + 1} \(‖Δw‖/‖w‖ over its median"):
        for step in range(16):
            optimizer.zero_grad()
            backward(model, 0)  # the same batch: steady gradients, so a steady ratio
            nanscan.check(model, recorder=recorder)
            for group in optimizer.param_groups:
                group["lr"] = 0.1 if step == jump else 1e-3
            optimizer.step()
        recorder.close()
    assert {name for step, name, _ in recorder.update_spikes} == set(NAMES)
    assert {step for step, _, _ in recorder.update_spikes} == {jump + 1}
    assert all(multiple > 50 for _, _, multiple in recorder.update_spikes)  # 100x the learning rate
    assert "4 update ratio spikes (largest:" in str(recorder)
    spiked = recorder.records[-3]
    assert spiked.step == jump + 1 and spiked.updates is not None and set(spiked.updates.spikes) == set(NAMES)
    # Until the window holds spike_min_history measured steps, no ratio has a median to be held against.
    first = next(r.updates for r in recorder.records if r.updates is not None)
    assert all(math.isnan(v) for v in first.spike_ratio)


def run_with_updates(path: Path, csv_path: Path | None = None, steps: int = 6) -> nanscan.Recorder:
    """A recorded run whose optimizer also holds a parameter that gets no gradient (``extra``)."""
    model = mlp()
    extra = torch.nn.Parameter(torch.ones(3))
    named = [*model.named_parameters(), ("extra", extra)]
    optimizer = torch.optim.SGD([p for _, p in named], lr=0.1, momentum=0.9)
    sinks: list[nanscan.sinks.Sink] = [JSONLSink(path)] + ([CSVSink(csv_path)] if csv_path else [])
    updates = nanscan.watch_updates(optimizer, named, every=2)
    with nanscan.Recorder(sinks, every=4, updates=updates, warn=False) as recorder:
        for step in range(steps):
            optimizer.zero_grad()
            backward(model, step)
            nanscan.check(model, recorder=recorder)
            optimizer.step()
    return recorder


def test_jsonl_round_trip_and_older_schemas_still_read(tmp_path: Path) -> None:
    path = tmp_path / "run.jsonl"
    recorder = run_with_updates(path)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0] == {
        "kind": "layout",
        "schema": SCHEMA,
        "subject": "gradients",
        "names": NAMES,
        "update_names": [*NAMES, "extra"],
    }
    assert [line["updates"] is None for line in lines[1:]] == [True, False, True, False, True, False]
    assert lines[2]["updates"]["steps"] == 1 and lines[2]["updates"]["update_norm"][-1] == 0.0  # extra: no gradient
    back = read_jsonl(path)
    assert [r.to_json(True, True) for r in back] == [r.to_json(True, True) for r in recorder.records]
    assert back[1].updates is not None and back[1].updates.ratio[-1] == 0.0

    # Schema 3 lines (no subject, no updates) read as gradients without update figures.
    old = tmp_path / "old.jsonl"
    schema_3 = [{k: v for k, v in line.items() if k not in ("subject", "update_names", "updates")} for line in lines]
    old.write_text("".join(json.dumps({**line, "schema": 3}) + "\n" for line in schema_3))
    assert [(r.subject, r.updates) for r in read_jsonl(old)] == [("gradients", None)] * 6

    # Updates under a layout without update names, or of the wrong length, or a subject unknown: errors.
    broken = tmp_path / "broken.jsonl"
    broken.write_text(json.dumps(schema_3[0] | {"schema": SCHEMA}) + "\n" + json.dumps(lines[2]) + "\n")
    with pytest.raises(ValueError, match=r"broken.jsonl:2: updates in a step whose layout line has no update_names"):
        read_jsonl(broken)
    short = lines[2] | {"updates": lines[2]["updates"] | {"weight_norm": [1.0]}}
    broken.write_text(json.dumps(lines[0]) + "\n" + json.dumps(short) + "\n")
    with pytest.raises(ValueError, match=r"updates of \[1, 5\] values where its layout has 5 update names"):
        read_jsonl(broken)
    broken.write_text(json.dumps(lines[0] | {"subject": "weights"}) + "\n")
    with pytest.raises(ValueError, match="subject is 'weights', not one of gradients, state"):
        read_jsonl(broken)


def test_csv_rows_carry_the_ratio_and_a_parameter_without_a_gradient_gets_its_own(tmp_path: Path) -> None:
    recorder = run_with_updates(tmp_path / "run.jsonl", tmp_path / "run.csv")
    with (tmp_path / "run.csv").open(newline="") as f:
        rows = list(csv.DictReader(f))
    measured = [r for r in recorder.records if r.updates is not None]
    for record in measured:
        assert record.updates is not None
        mine = {row["parameter"]: row for row in rows if int(row["step"]) == record.step}
        assert list(mine) == [*NAMES, "extra"]
        for name, ratio in zip(record.updates.names, record.updates.ratio, strict=True):
            assert float(mine[name]["update_ratio"]) == ratio
        assert mine["extra"]["norm"] == "" and mine["extra"]["update_ratio"] == "0.0"
        assert mine["0.weight"]["subject"] == "gradients"
    unmeasured = {row["update_ratio"] for row in rows if int(row["step"]) not in {r.step for r in measured}}
    assert unmeasured == {""}


def test_state_records_say_their_subject_through_jsonl_and_warnings(tmp_path: Path) -> None:
    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    path = tmp_path / "state.jsonl"
    recorder = nanscan.Recorder([JSONLSink(path)], every=2)
    with pytest.warns(RuntimeWarning, match=r"first non-finite weights/optimizer state at step 2: 2.weight:exp_avg_sq"):
        for step in range(4):
            optimizer.zero_grad()
            backward(model, step)
            optimizer.step()
            if step == 2:
                optimizer.state[model[2].weight]["exp_avg_sq"][0, 0] = math.inf
            nanscan.check_state(model, optimizer, recorder=recorder)
        recorder.close()
    layout = json.loads(path.read_text().splitlines()[0])
    assert layout["subject"] == "state" and "2.weight:exp_avg_sq" in layout["names"]
    back = read_jsonl(path)
    assert {r.subject for r in back} == {"state"} and back[2].nonfinite == ["2.weight:exp_avg_sq"]
    assert recorder.first_nonfinite is not None and recorder.first_nonfinite.subject == "state"


def test_a_recorder_given_gradients_then_state_starts_a_layout_for_each() -> None:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    records: list[StepRecord] = []
    recorder = nanscan.Recorder([records.append], every=10)
    backward(model, 0)
    optimizer.step()
    recorder.append(nanscan.check(model))
    recorder.append(nanscan.check_state(model))  # the same names, another subject: not one series
    recorder.close()
    assert [(r.step, r.subject) for r in records] == [(0, "gradients"), (1, "state")]
    assert records[1].norm == pytest.approx([p.detach().norm().item() for p in model.parameters()], rel=1e-6)


def test_tensorboard_groups_update_ratios_by_layer_and_keeps_state_apart(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from nanscan.integrations.tensorboard import TensorBoardSink

    model = mlp()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    records: list[StepRecord] = []
    sink = TensorBoardSink(tmp_path)
    updates = nanscan.watch_updates(optimizer, model)
    grads = nanscan.Recorder([sink, records.append], every=1, updates=updates, warn=False)
    states = nanscan.Recorder([sink], every=1, warn=False)
    for step in range(3):
        optimizer.zero_grad()
        backward(model, step)
        nanscan.check(model, recorder=grads)
        optimizer.step()
        nanscan.check_state(model, optimizer, recorder=states)
    grads.close()
    states.close()
    sink.close()
    events = EventAccumulator(str(tmp_path), size_guidance={"scalars": 0, "histograms": 0})
    events.Reload()
    scalars = set(events.Tags()["scalars"])

    def scalar(tag: str) -> dict[int, float]:
        return {event.step: event.value for event in events.Scalars(tag)}

    figures = records[2].updates
    assert figures is not None
    layer = math.hypot(*figures.update_norm[2:]) / math.hypot(*figures.weight_norm[2:])
    assert scalar("nanscan/update_ratio/2")[2] == pytest.approx(layer, rel=1e-5)
    assert scalar("nanscan/param_update_ratio/0.bias")[1] == pytest.approx(records[1].updates.ratio[1], rel=1e-5)  # type: ignore[union-attr]
    assert scalar("nanscan/update_spikes") == {1: 0, 2: 0}  # record 0 follows no step
    assert {e.step for e in events.Histograms("nanscan/log10_update_ratio")} == {1, 2}
    # The state recorder's tags: under nanscan/state/, grouped by layer and state key.
    assert {"nanscan/state/state_norm/0", "nanscan/state/state_norm/0:exp_avg_sq"} <= scalars
    assert "nanscan/state/param_state_norm/2.weight:exp_avg" in scalars
    assert {e.step for e in events.Histograms("nanscan/state/log10_state_norm")} == {0, 1, 2}
    assert not any(tag.startswith("nanscan/state/grad_norm") for tag in scalars)
    weight = model[0].weight.detach().norm().item()
    bias = model[0].bias.detach().norm().item()
    assert scalar("nanscan/state/state_norm/0")[2] == pytest.approx(math.hypot(weight, bias), rel=1e-5)


def test_the_plot_draws_the_update_panel_and_names_a_state_runs_norms(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    from nanscan.plot import draw_run, load_run, plot_run

    path = tmp_path / "run.jsonl"
    run_with_updates(path, steps=8)
    run = load_run(path)
    assert run.updates is not None and run.updates.names == [*NAMES, "extra"]
    assert run.updates.measured.tolist() == [False, True] * 4
    assert np.isnan(run.updates.update_norm[:, 0]).all() and (run.updates.update_norm[-1, 1::2] == 0).all()
    figure = draw_run(path)
    texts = {axes.get_ylabel() for axes in figure.axes}
    assert "update ratio\n4 of 8 steps measured, held between" in texts, texts
    assert "log10 ‖Δw‖/‖w‖ (green line: 1e-3)" in texts or "log10 ‖Δw‖/‖w‖" in texts, texts
    assert plot_run(path, tmp_path / "run.png").stat().st_size > 10_000

    model = mlp()
    optimizer = torch.optim.Adam(model.parameters())
    state_path = tmp_path / "state.jsonl"
    with nanscan.Recorder([JSONLSink(state_path)], every=2) as recorder:
        for step in range(3):
            backward(model, step)
            optimizer.step()
            nanscan.check_state(model, optimizer, recorder=recorder)
    assert load_run(state_path).subject == "state"
    labels = {axes.get_ylabel() for axes in draw_run(state_path).axes}
    assert "log10 norm of weights / optimizer state" in labels, labels


def test_the_update_panel_holds_between_measured_steps_and_rings_only_measured_spikes() -> None:
    from nanscan.plot import Updates, _hold

    nan = math.nan
    values = np.array([[nan, 1.0, nan, 3.0, nan]])
    held, flags = _hold(
        values, np.array([[False, True, False, False, False]]), np.array([False, True, False, True, False])
    )
    assert np.array_equal(held, np.array([[nan, 1, 1, 3, 3]]), equal_nan=True)
    assert flags.tolist() == [[False, True, True, False, False]]
    assert Updates.__dataclass_fields__.keys() >= {"update_norm", "weight_norm", "spike", "measured"}


def test_layers_of_state_names_group_by_key() -> None:
    names = ["h.0.w", "h.0.b", "h.1.w", "h.0.w:exp_avg", "h.0.b:exp_avg", "h.1.w:exp_avg"]
    groups = group_layers(names)
    assert [(g.name, g.members) for g in groups] == [
        ("h.0", (0, 1)),
        ("h.1", (2,)),
        ("h.0:exp_avg", (3, 4)),
        ("h.1:exp_avg", (5,)),
    ]
    many = [f"h.{i}.w" for i in range(300)] + [f"h.{i}.w:m" for i in range(300)]
    coarse = group_layers(many, 100)
    assert len(coarse) <= 100 and sum(len(g.members) for g in coarse) == 600
    assert all(g.name.endswith(":m") == (g.members[0] >= 300) for g in coarse)


def test_update_record_quotients_and_bad_input() -> None:
    figures = UpdateRecord(
        ["a", "b", "c", "d"], 1, [1.0, 0.0, 2.0, math.nan], [4.0, 0.0, 0.0, 1.0], [nan := math.nan] * 4
    )
    assert figures.ratio[0] == 0.25 and math.isnan(figures.ratio[1]) and figures.ratio[2] == math.inf
    assert figures.nonfinite == ["d"] and figures.spikes == {} and math.isnan(nan)
    with pytest.raises(TypeError, match=r"updates must be a nanscan\.watch_updates"):
        nanscan.Recorder(updates=object())  # type: ignore[arg-type]


@needs_cuda
@pytest.mark.cuda
def test_cuda_update_records_without_a_sync() -> None:
    model = mlp("cuda")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    updates = nanscan.watch_updates(optimizer, model, every=2)
    records: list[StepRecord] = []
    recorder = nanscan.Recorder([records.append], every=100, updates=updates)
    for warm in range(2):  # the copies, the ring and the recorder's constants exist before the check
        optimizer.zero_grad()
        backward(model, warm)
        nanscan.check(model, recorder=recorder)
        optimizer.step()
    torch.cuda.synchronize()
    with syncs_refused():
        for step in range(4):
            optimizer.zero_grad()
            backward(model, step)
            nanscan.check(model, recorder=recorder)
            optimizer.step()
    recorder.close()
    assert [r.updates is not None for r in records] == [False, True, False, True, False, True]
    assert all(0 < v < 1 for r in records if r.updates for v in r.updates.ratio)
