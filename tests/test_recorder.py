"""nanscan.Recorder: what it keeps matches the fp64 reference step for step, reaches the sinks once
per ``every`` records and at close/exit/exception, and its answers (first non-finite step, spikes)
point at the planted fault. The CUDA side (no sync, graph replays) is in tests/test_cuda.py."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import nanscan
from nanscan.layouts.reduce import Attribution
from nanscan.records import PER_PARAMETER, SCHEMA, StepRecord, read_jsonl
from nanscan.sinks import CSVSink, JSONLSink

from conftest import ROOT, reference_stats


def model(seed: int = 0) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def backward(m: torch.nn.Module, step: int, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(6, 8, generator=gen)
    (m(x).pow(2).sum() * scale).backward()


class Collect:
    """A sink that keeps what it is given, and counts flushes and closes."""

    def __init__(self) -> None:
        self.records: list[StepRecord] = []
        self.flushes = 0
        self.closed = False

    def __call__(self, record: StepRecord) -> None:
        self.records.append(record)

    def flush(self) -> None:
        self.flushes += 1

    def close(self) -> None:
        self.closed = True


def plant(m: torch.nn.Module, name: str, value: float, index: int = 0) -> None:
    grad = dict(m.named_parameters())[name].grad
    assert grad is not None
    grad.view(-1)[index] = value


def test_records_match_the_fp64_reference_step_for_step() -> None:
    m = model()
    sink = Collect()
    recorder = nanscan.Recorder([sink], every=4)
    expected: list[dict[str, Any]] = []
    for step in range(10):
        backward(m, step)
        if step == 6:
            plant(m, "0.weight", math.nan, 3)
            plant(m, "2.bias", math.inf, 1)
        grads = {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}
        nanscan.check(m, max_norm=0.5, recorder=recorder)
        expected.append({name: reference_stats(g) for name, g in grads.items()})
        m.zero_grad()
    # A read of 4 records at step 3, one at the NaN of step 6 (flush_on_nonfinite: steps 4-6), and
    # the last 3 wait for close.
    assert len(sink.records) == 7
    recorder.close()
    assert [r.step for r in sink.records] == list(range(10))
    for record, want in zip(sink.records, expected, strict=True):
        assert list(record.names) == list(want)
        for i, name in enumerate(record.names):
            ref = want[name]
            assert record.nan_count[i] == ref["nan_count"] and record.inf_count[i] == ref["inf_count"]
            for key in ("min", "max", "norm"):
                got, exp = getattr(record, key)[i], ref[key]
                assert got == pytest.approx(exp, rel=1e-6) or (math.isnan(got) and math.isnan(exp)), (key, name)
        total = math.sqrt(sum(ref["norm"] ** 2 for ref in want.values()))
        # In the gradients' dtype (float32), as torch's clip_grad_norm_ returns it.
        assert record.total_norm == pytest.approx(total, rel=1e-6) or math.isnan(record.total_norm)
        assert record.max_norm == 0.5 and record.clip_coef is not None
        assert record.finite == (record.step != 6) and not record.skipped and record.loss_scale is None
    assert sink.records[6].nonfinite == ["0.weight", "2.bias"]
    assert sink.closed


def test_reaches_the_sinks_once_per_every_records_and_at_close() -> None:
    m = model()
    sink = Collect()
    recorder = nanscan.Recorder([sink], every=5, capacity=40)
    backward(m, 0)
    counts = []
    for _ in range(12):
        nanscan.check(m, recorder=recorder)
        counts.append(len(sink.records))
    assert counts == [0, 0, 0, 0, 5, 5, 5, 5, 5, 10, 10, 10]
    assert sink.flushes == 2
    recorder.flush()
    assert len(sink.records) == 12
    recorder.close()
    recorder.close()  # idempotent
    with pytest.raises(ValueError, match="after close"):
        recorder.append(nanscan.check(m))


def test_jsonl_and_csv_sinks_round_trip(tmp_path: Path) -> None:
    m = model()
    path = tmp_path / "run.jsonl"
    with nanscan.Recorder([JSONLSink(path), CSVSink(tmp_path / "run.csv")], every=3) as recorder:
        for step in range(7):
            backward(m, step)
            if step == 4:
                plant(m, "2.weight", math.nan)
            nanscan.check(m, max_norm=1.0, recorder=recorder)
            m.zero_grad()
    kept = list(recorder.records)
    lines = path.read_text().splitlines()
    # Strict JSON: NaN and Inf are strings, so any JSON reader parses every line.
    for line in lines:
        json.loads(line, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert [json.loads(line)["kind"] for line in lines] == ["layout"] + ["step"] * 7
    back = read_jsonl(path)
    assert len(back) == 7
    for a, b in zip(back, kept, strict=True):
        assert a.to_json() == b.to_json()
    assert back[4].nonfinite == ["2.weight"] and math.isnan(back[4].norm[2]) and not back[4].finite
    rows = (tmp_path / "run.csv").read_text().splitlines()
    assert rows[0].startswith("step,parameter,nan_count")
    assert len(rows) == 1 + 7 * 4
    assert any(row.startswith("4,2.weight,1,") for row in rows)


def test_a_parameter_losing_its_gradient_starts_a_new_layout(tmp_path: Path) -> None:
    m = model()
    path = tmp_path / "run.jsonl"
    recorder = nanscan.Recorder([JSONLSink(path)], every=50)
    for step in range(6):
        backward(m, step)
        if step >= 3:
            m[2].bias.grad = None
        nanscan.check(m, recorder=recorder)
        m.zero_grad()
    recorder.close()
    kinds = [json.loads(line)["kind"] for line in path.read_text().splitlines()]
    assert kinds == ["layout", "step", "step", "step", "layout", "step", "step", "step"]
    back = read_jsonl(path)
    assert [r.step for r in back] == list(range(6)), "the record index runs on across layouts"
    assert "2.bias" in back[2].names and "2.bias" not in back[3].names


def test_a_spike_is_found_on_the_device_and_warned_about() -> None:
    m = model()
    recorder = nanscan.Recorder(every=40, spike_factor=8.0, spike_window=16, spike_min_history=4, warn=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(30):
            backward(m, step, scale=50.0 if step == 20 else 1.0)
            if step == 2:  # before spike_min_history records: never a spike
                backward(m, step, scale=100.0)
            nanscan.check(m, recorder=recorder)
            m.zero_grad()
        recorder.close()
    records = list(recorder.records)
    assert all(not r.spikes for r in records[:20] + records[21:])
    assert set(records[20].spikes) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert all(ratio == pytest.approx(50.0, rel=0.3) for ratio in records[20].spikes.values())
    assert all(math.isnan(v) for r in records[:4] for v in r.spike_ratio), "no history, no ratio"
    assert {(20, name) for name in records[20].spikes} == {(s, n) for s, n, _ in recorder.spikes}
    messages = [str(w.message) for w in caught if "spike" in str(w.message)]
    assert len(messages) == 1 and "step 20" in messages[0]
    assert caught[0].filename == __file__, "the warning points at the caller, not into nanscan"


def test_the_first_nonfinite_step_keeps_the_norms_that_led_to_it() -> None:
    m = model()
    recorder = nanscan.Recorder(every=4, history=5, warn=False)
    norms: list[float] = []
    for step in range(12):
        backward(m, step, scale=2.0**step)  # a climb to overflow
        if step >= 9:
            plant(m, "0.bias", math.inf)
        bias_grad = dict(m.named_parameters())["0.bias"].grad
        assert bias_grad is not None
        norms.append(float(bias_grad.norm()))
        nanscan.check(m, recorder=recorder)
        m.zero_grad()
    recorder.close()
    first = recorder.first_nonfinite
    assert first is not None and first.step == 9 and first.parameters == ["0.bias"]
    assert first.steps == [4, 5, 6, 7, 8]
    assert first.norm_history["0.bias"] == pytest.approx(norms[4:9], rel=1e-6)
    assert "step 9" in str(first) and "step 9: 0.bias" in str(recorder)


def test_skips_and_the_loss_scale_are_recorded() -> None:
    m = model()
    optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
    sink = Collect()
    recorder = nanscan.Recorder([sink], every=100)
    for step in range(3):
        backward(m, step)
        if step == 1:
            plant(m, "2.weight", math.nan)
        nanscan.check(m, on_nonfinite="skip", optimizer=optimizer, recorder=recorder)
        optimizer.step()
        optimizer.zero_grad()
    scaler = nanscan.amp.GradScaler("cpu", init_scale=256.0).record(recorder)
    for step in range(3):
        scaler.scale(m(torch.randn(2, 8)).sum()).backward()
        if step == 1:
            plant(m, "0.weight", math.inf)
        scaler.clip_grad_norm_(optimizer, 1.0) if step else scaler.unscale_(optimizer)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    recorder.close()
    r = sink.records
    assert [x.skipped for x in r] == [False, True, False, False, True, False]
    assert [x.loss_scale for x in r] == [None, None, None, 256.0, 256.0, 128.0]
    assert r[3].max_norm is None and r[4].max_norm == 1.0 and r[5].clip_coef is not None


def test_a_flag_and_a_scale_in_any_dtype_are_recorded() -> None:
    # The record op reads no float16/bfloat16 (csrc/cpu/record_cpu.cpp): the recorder casts those, and
    # passes the dtypes it reads (int32, bool, float64) as they are.
    m = model()
    sink = Collect()
    with nanscan.Recorder([sink], every=100) as recorder:
        flags_and_scales = [
            (torch.tensor(1, dtype=torch.int32), torch.tensor(1024.0, dtype=torch.float16)),
            (torch.tensor([False]), torch.tensor([0.5], dtype=torch.bfloat16)),
            (torch.tensor(True), torch.tensor(3.0, dtype=torch.float64)),
        ]
        for step, (skipped, loss_scale) in enumerate(flags_and_scales):
            backward(m, step)
            recorder.append(nanscan.check(m), skipped=skipped, loss_scale=loss_scale)
            m.zero_grad()
    assert [(r.skipped, r.loss_scale) for r in sink.records] == [(True, 1024.0), (False, 0.5), (True, 3.0)]


def test_records_overwritten_before_a_read_are_counted_and_warned() -> None:
    m = model()
    recorder = nanscan.Recorder(every=10, capacity=40, spike_window=8)
    backward(m, 0)
    for _ in range(3):
        nanscan.check(m, recorder=recorder)
    # What graph replays do: appends that the host does not count (so it does not flush).
    recorder.every = 10**9
    for _ in range(50):
        nanscan.check(m, recorder=recorder)
    with pytest.warns(RuntimeWarning, match="13 records were overwritten"):
        recorder.flush()
    assert recorder.lost == 13 and recorder.read == 40


def test_an_exception_in_the_with_block_still_reaches_the_sinks() -> None:
    sink = Collect()
    m = model()
    with pytest.raises(nanscan.NonFiniteGradientError), nanscan.Recorder([sink], every=100) as recorder:
        for step in range(5):
            backward(m, step)
            if step == 3:
                plant(m, "0.weight", math.nan)
            nanscan.check(m, max_norm=1.0, on_nonfinite="raise", recorder=recorder)
            m.zero_grad()
    assert [r.step for r in sink.records] == [0, 1, 2, 3], "the step that raised is recorded too"
    assert not sink.records[3].finite and sink.closed


def test_records_reach_the_file_at_interpreter_exit(tmp_path: Path) -> None:
    path = tmp_path / "exit.jsonl"
    script = f"""
import torch, nanscan
m = torch.nn.Linear(3, 2)
recorder = nanscan.Recorder([nanscan.sinks.JSONLSink({str(path)!r})], every=100)
for _ in range(3):
    m(torch.randn(4, 3)).sum().backward()
    nanscan.check(m, recorder=recorder)
"""
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT, timeout=120)
    assert len(read_jsonl(path)) == 3


def test_memory_is_bounded_and_stated() -> None:
    m = model()
    recorder = nanscan.Recorder(every=10, capacity=50)
    assert recorder.nbytes == 0
    backward(m, 0)
    nanscan.check(m, recorder=recorder)
    assert recorder.nbytes == 50 * (24 * 4 + 24) + 8
    for _ in range(200):
        nanscan.check(m, recorder=recorder)
    assert recorder.nbytes == 50 * (24 * 4 + 24) + 8 and len(recorder.records) == 64
    assert "201 steps read" in str(recorder) or "200 steps read" in str(recorder)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"every": 0}, "every must be a positive int"),
        ({"every": 2.5}, "every must be a positive int"),
        ({"capacity": 10, "spike_window": 10}, "capacity must be an int above spike_window"),
        ({"every": 100, "capacity": 50}, "every .100. must be at most capacity"),
        ({"spike_factor": 1.0}, "spike_factor must be a number above 1"),
        ({"spike_min_history": 0}, "spike_min_history"),
        ({"history": -1}, "history must be a positive int"),
    ],
)
def test_bad_arguments_are_refused(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        nanscan.Recorder(**kwargs)


def test_a_sink_must_be_callable() -> None:
    with pytest.raises(TypeError, match="must be callable"):
        nanscan.Recorder(["run.jsonl"])  # type: ignore[list-item]


def record_two_steps(sinks: list[Any]) -> None:
    m = model()
    with nanscan.Recorder(sinks, every=1, warn=False) as recorder:
        for step in range(2):
            m.zero_grad()
            backward(m, step)
            nanscan.check(m, recorder=recorder)


def test_a_file_sink_opens_its_file_at_its_first_record(tmp_path: Path) -> None:
    """Made, a sink writes nothing (which rank writes is known only once the checks run: Lightning
    starts torch.distributed after the script has made its sinks); its first record opens the file."""
    jsonl, table = JSONLSink(tmp_path / "a" / "run.jsonl"), CSVSink(tmp_path / "run.csv")
    assert not (tmp_path / "a").exists() and not (tmp_path / "run.csv").exists() and jsonl.path is None
    record_two_steps([jsonl, table])
    assert [r.step for r in read_jsonl(tmp_path / "a" / "run.jsonl")] == [0, 1]
    assert len((tmp_path / "run.csv").read_text().splitlines()) == 1 + 2 * 4
    assert jsonl.path == tmp_path / "a" / "run.jsonl"


@pytest.mark.parametrize("rank", [0, 1])
def test_a_launched_rank_without_torch_distributed_writes_only_its_own_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rank: int
) -> None:
    """A process that torchrun started as one of 2 but that never initialized torch.distributed (its
    checks are its own): a shared path is rank 0's alone, and rank 1 is told its records are not
    written there; ``{rank}`` gives it a file of its own. The rank is known from the start here, so
    the files are opened when the sinks are made."""
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        shared, own = JSONLSink(tmp_path / "run.jsonl"), JSONLSink(tmp_path / "run-{rank}.jsonl")
        table = CSVSink(tmp_path / "run.csv")
        assert own.path == tmp_path / f"run-{rank}.jsonl" and own.path.exists(), "opened when made"
        record_two_steps([shared, own, table])
    told = [str(w.message) for w in caught if "RANK and WORLD_SIZE" in str(w.message)]
    assert len(told) == 2 * rank, told  # each shared-path sink, once
    if rank:
        assert "rank 1 of 2" in told[0] and "{rank}" in told[0]
    assert (tmp_path / "run.jsonl").exists() == (rank == 0) == (tmp_path / "run.csv").exists()
    if rank == 0:  # a sink opened when made writes what a sink opened at its first record does
        assert [r.step for r in read_jsonl(tmp_path / "run.jsonl")] == [0, 1]
        assert len((tmp_path / "run.csv").read_text().splitlines()) == 1 + 2 * 4
    assert [r.step for r in read_jsonl(tmp_path / f"run-{rank}.jsonl")] == [0, 1]
    assert own.path == tmp_path / f"run-{rank}.jsonl"


def test_a_launched_rank_that_initializes_torch_distributed_after_making_its_sinks_is_not_warned(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torchrun names the process rank 1 of 2 before the script initializes torch.distributed (the
    usual order: sinks made, then the group): its shared-path sink writes nothing, and says nothing,
    since by its first record the checks are the model's."""
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    shared = JSONLSink(tmp_path / "run.jsonl")
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # the group, initialized since
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        shared(StepRecord(**dataclasses.asdict(first_record())))
    assert shared.path is None and not (tmp_path / "run.jsonl").exists()


def first_record() -> StepRecord:
    records: list[StepRecord] = []
    record_two_steps([records.append])
    return records[0]


def test_a_rank_read_out_after_its_group_is_destroyed_still_writes_as_its_rank(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The rank torch.distributed gave last is kept: a recorder read out for the first time after
    ``destroy_process_group()`` (at the job's end) on rank 1 does not take itself for a process of
    its own and write rank 0's file."""
    import torch.distributed as dist

    from nanscan import sinks

    monkeypatch.setattr(sinks, "_noted", [])
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    assert sinks.process_rank() == (1, 2, True)  # what a check under the group sees
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # destroyed
    shared, own = JSONLSink(tmp_path / "run.jsonl"), JSONLSink(tmp_path / "run-{rank}.jsonl")
    record = first_record()
    shared(record)
    own(record)
    assert shared.path is None and own.path == tmp_path / "run-1.jsonl"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-1.jsonl"]


def test_a_recorder_notes_the_rank_its_checks_ran_under_for_a_first_read_after_the_group_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """mp.spawn's way: the sinks made before the group (no launcher variables), every step checked as
    rank 1 of 2, the group destroyed, and only then the first read (close): the recorder noted the
    rank at its appends, so the shared path stays rank 0's."""
    import torch.distributed as dist

    shared, own = JSONLSink(tmp_path / "run.jsonl"), JSONLSink(tmp_path / "run-{rank}.jsonl")
    recorder = nanscan.Recorder([shared, own], every=100, warn=False)
    m = model()
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    for step in range(3):
        m.zero_grad()
        backward(m, step)
        nanscan.check(m, recorder=recorder)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)  # destroy_process_group()
    recorder.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run-1.jsonl"]
    assert [r.step for r in read_jsonl(tmp_path / "run-1.jsonl")] == [0, 1, 2]


def test_a_relative_path_is_written_where_it_pointed_when_the_sink_was_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    monkeypatch.chdir(tmp_path / "a")
    sink = JSONLSink("run.jsonl")  # opened at its first record (no rank known yet)
    monkeypatch.chdir(tmp_path / "b")
    sink(first_record())
    sink.close()
    assert (tmp_path / "a" / "run.jsonl").exists() and not (tmp_path / "b" / "run.jsonl").exists()


def test_a_csv_of_other_columns_named_through_the_rank_field_is_refused_untouched(tmp_path: Path) -> None:
    """With ``{rank}`` the file is known only when opened: one of other columns is refused then, before
    anything (a cut last line included) is changed."""
    foreign = tmp_path / "foreign-0.csv"
    foreign.write_text("a,b\n1,2\n3,")
    sink = CSVSink(tmp_path / "foreign-{rank}.csv")
    with pytest.raises(ValueError, match=r"has the columns \['a', 'b'\]"):
        sink(first_record())
    assert foreign.read_text() == "a,b\n1,2\n3,"


def test_a_sink_path_that_cannot_be_a_file_is_refused_when_the_sink_is_made(tmp_path: Path) -> None:
    (tmp_path / "a_file").write_text("")
    with pytest.raises(IsADirectoryError, match=r"JSONLSink: .* is a directory, not a file"):
        JSONLSink(tmp_path)
    with pytest.raises(NotADirectoryError, match=r"CSVSink: .*run.csv lies under .*a_file, a file"):
        CSVSink(tmp_path / "a_file" / "run.csv")
    assert (tmp_path / "a_file").read_text() == ""


def test_a_pickled_recorder_records_on_from_its_original_into_the_same_files(tmp_path: Path) -> None:
    """Lightning's ddp_spawn pickles the callbacks, and their recorder, into the processes it starts:
    the copy starts with no record unread (the original's were read out first, once), its own
    device buffer (none shared with the original's: torch.multiprocessing would share tensors'
    memory), its records numbered on, and its sinks reopening their files in its process."""
    import pickle

    m = model()
    jsonl, table = JSONLSink(tmp_path / "run.jsonl"), CSVSink(tmp_path / "run.csv")
    original = nanscan.Recorder([jsonl, table], every=10, warn=False)
    for step in range(3):
        m.zero_grad()
        backward(m, step)
        nanscan.check(m, recorder=original)
    copy = pickle.loads(pickle.dumps(original))
    assert original.read == 3 and copy.read == 3, "read out before the copy, so no record reaches a sink twice"
    assert copy._ring is None and copy.sinks[0] is not jsonl
    for step in range(3, 5):
        m.zero_grad()
        backward(m, step)
        nanscan.check(m, recorder=copy)
    copy.close()
    original.close()
    assert [r.step for r in read_jsonl(tmp_path / "run.jsonl")] == [0, 1, 2, 3, 4]
    rows = (tmp_path / "run.csv").read_text().splitlines()
    assert rows[0].startswith("step,") and [row.split(",")[0] for row in rows[1:]] == [
        str(k) for k in range(5) for _ in range(4)
    ]


def test_a_recorder_with_a_watch_is_not_pickled() -> None:
    import pickle

    m = model()
    refused = pytest.raises(
        TypeError, match=r"with an activation or update watch cannot be copied into another process"
    )
    with nanscan.watch_activations(m) as watch, nanscan.Recorder(activations=watch, warn=False) as recorder, refused:
        pickle.dumps(recorder)


def test_a_sink_that_raises_does_not_get_a_record_twice() -> None:
    m = model()
    seen: list[int] = []

    def flaky(record: StepRecord) -> None:
        if record.step == 2 and 2 not in seen:
            seen.append(2)
            raise OSError("disk full")
        seen.append(record.step)

    recorder = nanscan.Recorder([flaky], every=4, warn=False)
    backward(m, 0)
    with pytest.warns(RuntimeWarning, match=r"sink .*flaky failed on step 2: OSError: disk full"):
        for _ in range(4):
            nanscan.check(m, recorder=recorder)
    for _ in range(4):
        nanscan.check(m, recorder=recorder)
    recorder.close()
    assert seen == [0, 1, 2, 3, 4, 5, 6, 7], "record 2 failed once and was not handed on again; none twice"
    assert recorder.sink_failures == 1 and "1 sink calls failed" in str(recorder)


def test_a_failing_sink_costs_the_other_sinks_nothing(tmp_path: Path) -> None:
    m = model()

    def bad(record: StepRecord) -> None:
        if record.step == 2:
            raise OSError("disk full")

    class BadClose(Collect):
        def close(self) -> None:
            raise OSError("cannot close")

    first, last = BadClose(), Collect()
    recorder = nanscan.Recorder([first, bad, JSONLSink(tmp_path / "run.jsonl"), last], every=4, warn=False)
    backward(m, 0)
    with pytest.warns(RuntimeWarning) as caught:
        for _ in range(6):
            nanscan.check(m, recorder=recorder)
        recorder.close()
    messages = [str(w.message) for w in caught]
    assert any(m.endswith("sink bad failed on step 2: OSError: disk full") for m in messages), messages
    assert any("sink BadClose failed at close(): OSError: cannot close" in m for m in messages), messages
    assert [r.step for r in read_jsonl(tmp_path / "run.jsonl")] == list(range(6))
    assert [r.step for r in last.records] == list(range(6)) and last.closed
    assert recorder.sink_failures == 2


def _nan_step_run(tmp_path: Path, sinks: list[Any]) -> tuple[torch.nn.Module, list[str]]:
    """Ten SGD steps, a NaN at step 5, check(..., on_nonfinite="skip"); the errors out of check()."""
    torch.manual_seed(0)
    m = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    recorder = nanscan.Recorder([*sinks, JSONLSink(tmp_path / "run.jsonl")], every=10)
    errors = []
    for step in range(10):
        x = torch.randn(8, 4)
        if step == 5:
            x[0, 0] = math.nan
        m(x).pow(2).mean().backward()
        try:
            nanscan.check(m, on_nonfinite="skip", optimizer=opt, recorder=recorder)
        except Exception as error:  # the loop survives, as a job that logs and goes on would
            errors.append(f"{step}: {type(error).__name__}")
        opt.step()
        opt.zero_grad()
    recorder.close()
    return m, errors


def test_a_sink_failing_at_the_nan_step_loses_neither_the_record_nor_the_skip(tmp_path: Path) -> None:
    def logger(record: StepRecord) -> None:
        if not record.finite:
            raise ConnectionError("logger unreachable")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m, errors = _nan_step_run(tmp_path, [logger])
    assert errors == [], "a sink's failure is warned about, not raised out of check()"
    assert any(
        "sink" in str(w.message) and "logger failed on step 5: ConnectionError" in str(w.message) for w in caught
    )
    assert [r.step for r in read_jsonl(tmp_path / "run.jsonl")] == list(range(10))
    assert all(bool(torch.isfinite(p).all()) for p in m.parameters()), "the NaN step was skipped"


def test_warnings_as_errors_at_the_nan_step_lose_neither_the_record_nor_the_skip(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # python -W error, pytest -W error
        m, errors = _nan_step_run(tmp_path, [])
    assert errors == ["5: RuntimeWarning"], "the first non-finite step's warning, raised as an error"
    assert [r.step for r in read_jsonl(tmp_path / "run.jsonl")] == list(range(10)), "step 5 reached the file"
    assert all(bool(torch.isfinite(p).all()) for p in m.parameters()), "the skip was armed before the warning"


def test_a_recorder_takes_one_sink_or_a_list_and_says_so_for_anything_else(tmp_path: Path) -> None:
    sink = Collect()
    recorder = nanscan.Recorder(sink, warn=False)  # type: ignore[arg-type]
    assert recorder.sinks == [sink]
    recorder.close()
    with pytest.raises(TypeError, match=r"must be a list of sinks.*JSONLSink\('run.jsonl'\)\], got str"):
        nanscan.Recorder("run.jsonl")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="must be a list of sinks"):
        nanscan.Recorder(3)  # type: ignore[arg-type]


def test_the_spike_count_and_the_largest_spike_cover_every_spike_read() -> None:
    params = [torch.nn.Parameter(torch.zeros(4)) for _ in range(100)]
    recorder = nanscan.Recorder(every=10, warn=False)
    gen = torch.Generator().manual_seed(0)
    for step in range(40):
        for i, p in enumerate(params):
            scale = 1e3 * (100 if i == 3 and step == 21 else 1) if 20 <= step < 35 else 1.0
            p.grad = torch.randn(4, generator=gen) * scale
        nanscan.check(params, recorder=recorder)
    recorder.close()
    spikes = [(r.step, name, ratio) for r in recorder.records for name, ratio in r.spikes.items()]
    assert len(spikes) > 1000 and len(recorder.spikes) == 1000, "more spikes than the deque keeps"
    largest = max(spikes, key=lambda s: s[2])
    assert largest[:2] == (21, "[3]")
    assert recorder.spike_count == len(spikes) and recorder.largest_spike == largest
    assert f"{len(spikes)} norm spikes (largest: [3] at step 21, {largest[2]:.1f}x" in str(recorder)


def test_unscale_then_clip_is_recorded_once_per_step() -> None:
    m = model()
    optimizer = torch.optim.SGD(m.parameters(), lr=0.1)
    sink = Collect()
    recorder = nanscan.Recorder([sink], every=100)
    scaler = nanscan.amp.GradScaler("cpu", init_scale=64.0).record(recorder)
    for _ in range(3):
        scaler.scale(m(torch.randn(2, 8)).sum()).backward()
        scaler.unscale_(optimizer)
        scaler.clip_grad_norm_(optimizer, 1.0)  # scans again (nothing proves the gradients unchanged)
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    recorder.close()
    assert [r.step for r in sink.records] == [0, 1, 2]


# ------------------------------------------------------------------------------- rank attribution


def attributed(report: nanscan.Report, world: int, ranks: dict[str, list[int]], flagged: list[int]) -> nanscan.Report:
    """``report`` as a distributed check would have made it: the same statistics, with an attribution
    saying that ``ranks[name]`` held each name's NaN/Inf and ``flagged`` held any (what the cross-rank
    reduction computes, nanscan.layouts.reduce; the real processes are in tests/distributed_cases.py)."""
    n = len(report.names)
    rows = torch.zeros(3, n, dtype=torch.float64)
    for name, held in ranks.items():
        i = report.names.index(name)
        rows[:, i] = torch.tensor([len(held), sum(held), sum(r * r for r in held)], dtype=torch.float64)
    any_by_rank = torch.zeros(world, dtype=torch.float64)
    any_by_rank[flagged] = 1.0
    stats = dataclasses.replace(report.stats, ranks=Attribution(rows[0], rows[1], rows[2], any_by_rank))
    return nanscan.Report(report.names, stats, report.total_norm_tensor, report.norm_type)


def test_records_name_the_ranks_a_report_names_exactly_for_a_large_world() -> None:
    world = 20_000
    # Two neighbouring high ranks: their sum of squares (8e8) is no float32 (its step there is 64),
    # and rounded it would name other ranks. Three ranks, found among the four flagged ones.
    held = {"0.weight": [19_997, 19_998], "2.bias": [5, 19_000, 19_998]}
    flagged = [5, 19_000, 19_997, 19_998]
    s1, s2 = sum(held["0.weight"]), sum(r * r for r in held["0.weight"])
    rounded = float(torch.tensor(s2, dtype=torch.float32))
    assert Attribution.ranks(2, s1, rounded, [0.0] * world) != held["0.weight"], "float32 must not suffice here"
    m = model()
    sink = Collect()
    recorder = nanscan.Recorder([sink], every=4, warn=False)
    reports = []
    for step in range(6):
        backward(m, step)
        if step == 4:
            plant(m, "0.weight", math.nan)
            plant(m, "2.bias", math.inf)
        report = nanscan.check(m)
        report = attributed(report, world, held if step == 4 else {}, flagged if step == 4 else [])
        recorder.append(report)
        reports.append(report)
        m.zero_grad()
    recorder.close()
    n = len(reports[0].names)
    assert recorder.nbytes == 33 * (24 * n + 24) + 8 + 33 * 8 * (3 * n + world), "the stated formula"
    assert [r.nonfinite_ranks for r in sink.records] == [report.nonfinite_ranks for report in reports]
    assert sink.records[4].nonfinite_ranks == held and sink.records[3].nonfinite_ranks == {}
    first = recorder.first_nonfinite
    assert first is not None and first.step == 4 and first.ranks == held
    assert "0.weight (ranks 19997, 19998), 2.bias (ranks 5, 19000, 19998)" in str(first)
    assert "step 4: 0.weight (ranks 19997, 19998)" in str(recorder)


def test_a_single_process_names_its_own_rank_and_pays_nothing_for_attribution() -> None:
    m = model()
    recorder = nanscan.Recorder(every=40, capacity=40, warn=False)
    for step in range(3):
        backward(m, step)
        if step == 1:
            plant(m, "2.weight", math.nan)
        nanscan.check(m, recorder=recorder)
        m.zero_grad()
    assert recorder.nbytes == 40 * (24 * 4 + 24) + 8, "no attribution rows without an attribution"
    recorder.close()
    assert [r.nonfinite_ranks for r in recorder.records] == [{}, {"2.weight": [0]}, {}]
    assert recorder.first_nonfinite is not None and recorder.first_nonfinite.ranks == {"2.weight": [0]}
    assert str(recorder).endswith("step 1: 2.weight"), "a single process's rank 0 is no news: not printed"
    assert "rank" not in str(recorder.first_nonfinite)


def test_gaining_an_attribution_starts_a_layout_and_keeps_every_record() -> None:
    m = model()
    sink = Collect()
    recorder = nanscan.Recorder([sink], every=40, capacity=40, warn=False)
    backward(m, 0)
    plant(m, "0.bias", math.inf)
    plain = nanscan.check(m)
    recorder.append(plain)
    recorder.append(attributed(plain, 4, {"0.bias": [2]}, [2]))
    recorder.append(plain)
    recorder.close()
    assert [r.step for r in sink.records] == [0, 1, 2]
    assert [r.nonfinite_ranks for r in sink.records] == [{"0.bias": [0]}, {"0.bias": [2]}, {"0.bias": [0]}]


def test_ranks_round_trip_through_jsonl_and_csv_and_schema_1_still_reads(tmp_path: Path) -> None:
    m = model()
    path, csv_path = tmp_path / "run.jsonl", tmp_path / "run.csv"
    with nanscan.Recorder([JSONLSink(path), CSVSink(csv_path)], every=2, warn=False) as recorder:
        for step in range(3):
            backward(m, step)
            if step == 1:
                plant(m, "2.weight", math.nan)
                plant(m, "0.bias", math.inf)
            report = nanscan.check(m)
            recorder.append(attributed(report, 8, {"2.weight": [3, 6], "0.bias": [0]} if step == 1 else {}, [0, 3, 6]))
            m.zero_grad()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[2]["schema"] == SCHEMA and lines[2]["nonfinite_ranks"] == {"0.bias": [0], "2.weight": [3, 6]}
    assert lines[1]["nonfinite_ranks"] == {}
    back = read_jsonl(path)
    assert [r.nonfinite_ranks for r in back] == [r.nonfinite_ranks for r in recorder.records]
    assert [r.to_json() for r in back] == [r.to_json() for r in recorder.records]
    rows = csv_path.read_text().splitlines()
    header = rows[0].split(",")
    assert header[-4:] == ["nonfinite_ranks", "subject", "update_ratio", "update_spike_ratio"]
    ranks = header.index("nonfinite_ranks")
    assert [row.split(",")[ranks] for row in rows if row.startswith("1,")] == ["", "0", "3 6", ""]
    # A file of schema 1 (no nonfinite_ranks) reads, its records' ranks unknown (None).
    old = tmp_path / "old.jsonl"
    old.write_text(
        "\n".join(
            json.dumps({**line, "schema": 1} if line["kind"] == "layout" else _schema_1(line)) for line in lines[:3]
        )
    )
    assert [r.nonfinite_ranks for r in read_jsonl(old)] == [None, None]
    with pytest.raises(ValueError, match="reads schemas 1, 2, 3"):
        old.write_text(json.dumps({**lines[0], "schema": 1}) + "\n" + json.dumps({**lines[1], "schema": SCHEMA + 1}))
        read_jsonl(old)
    with pytest.raises(ValueError, match="nonfinite_ranks names a parameter outside its layout"):
        old.write_text(json.dumps(lines[0]) + "\n" + json.dumps({**lines[2], "nonfinite_ranks": {"x": [1]}}))
        read_jsonl(old)
    # A CSV file begun with other columns is refused, not given rows that do not match its header.
    (tmp_path / "old.csv").write_text("step,parameter,nan_count\n")
    with pytest.raises(ValueError, match="another nanscan version"):
        CSVSink(tmp_path / "old.csv")


def _schema_1(line: dict[str, Any]) -> dict[str, Any]:
    """A step line as schema 1 wrote it: no nonfinite_ranks."""
    return {key: value for key, value in line.items() if key != "nonfinite_ranks"} | {"schema": 1}


def test_per_parameter_lists_are_made_on_first_reading_and_equal_given_ones() -> None:
    m = model()
    sink = Collect()
    recorder = nanscan.Recorder([sink], every=3, warn=False)
    for step in range(3):
        backward(m, step)
        nanscan.check(m, recorder=recorder)
        m.zero_grad()
    record = sink.records[1]
    assert not isinstance(vars(record)["norm"], list), "a sink that reads no list pays for none"
    norm = record.norm
    assert isinstance(norm, list) and record.norm is norm and vars(record)["norm"] is norm
    given = dataclasses.replace(record, **{key: list(getattr(record, key)) for key in PER_PARAMETER})
    assert given == record and isinstance(record.nan_count[0], int)
    with pytest.raises(dataclasses.FrozenInstanceError):
        record.norm = []  # type: ignore[misc]
