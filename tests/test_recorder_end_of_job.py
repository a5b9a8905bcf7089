"""What a flight record keeps when a job ends the way jobs end (SIGTERM from a scheduler or torchrun,
SIGKILL, a line cut mid-write), in real processes (tests/recorder_job.py), and how the reader and
the sinks treat what a kill leaves: a last line cut short is dropped with a warning, anything else
malformed is an error that names the file and line."""

from __future__ import annotations

import gc
import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import warnings
from pathlib import Path

import pytest
import torch

import nanscan
from nanscan.recorder import _open_recorders
from nanscan.records import read_jsonl
from nanscan.sinks import CSVSink, JSONLSink

from conftest import ROOT

JOB = ROOT / "tests" / "recorder_job.py"
POSIX_SIGNALS = pytest.mark.skipif(not hasattr(signal, "SIGKILL") or sys.platform == "win32", reason="POSIX signals")


def start_job(out: Path, *options: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, str(JOB), str(out), *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )


def wait_ready(job: subprocess.Popen[str]) -> list[str]:
    """The job's lines up to ``ready`` (it has trained and recorded its steps)."""
    assert job.stdout is not None
    lines = []
    while True:
        line = job.stdout.readline()
        if not line:
            _, err = job.communicate(timeout=60)
            raise AssertionError(f"the job ended before it was ready (rc {job.returncode}): {err[-3000:]}")
        lines.append(line.strip())
        if line.strip() == "ready":
            return lines


def steps_on_disk(path: Path) -> list[int]:
    """The step indices of the complete step lines of a JSONL file (each as often as it is there)."""
    if not path.exists():
        return []
    return [line["step"] for line in _complete_lines(path) if line["kind"] == "step"]


def _complete_lines(path: Path) -> list[dict[str, object]]:
    text = path.read_text()
    lines = text.split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]  # the last piece: "" or a cut line


# ------------------------------------------------------------------------------------------ SIGTERM


@POSIX_SIGNALS
@pytest.mark.parametrize("recorders", [0, 1])
def test_sigterm_reads_out_every_record_and_ends_the_process_as_the_default_would(
    tmp_path: Path, recorders: int
) -> None:
    """50 steps recorded with every=100 (none read yet): a SIGTERM puts all 50 on disk, and the
    process ends by the signal as it does without a recorder."""
    job = start_job(tmp_path, "--steps", "50", "--every", "100", "--recorders", str(recorders))
    wait_ready(job)
    job.send_signal(signal.SIGTERM)
    job.communicate(timeout=60)
    assert job.returncode == -signal.SIGTERM
    assert steps_on_disk(tmp_path / "run.jsonl") == (list(range(50)) if recorders else [])


@POSIX_SIGNALS
def test_sigterm_then_calls_the_jobs_own_handler(tmp_path: Path) -> None:
    """A handler installed before the recorder (a user's, Lightning's) still runs, after the records
    are on disk, and decides how the process ends (here: exit 7)."""
    job = start_job(tmp_path, "--steps", "50", "--user-handler", "exit")
    wait_ready(job)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 7, err
    assert f"user handler {int(signal.SIGTERM)}" in out
    assert steps_on_disk(tmp_path / "run.jsonl") == list(range(50))


@POSIX_SIGNALS
def test_a_handler_that_lets_the_job_go_on_gets_each_record_once(tmp_path: Path) -> None:
    """The read on SIGTERM is a flush, not a close: the job goes on, closes its recorders itself, and
    every record is on disk once."""
    job = start_job(tmp_path, "--steps", "50", "--user-handler", "continue")
    wait_ready(job)
    job.send_signal(signal.SIGTERM)
    out, err = job.communicate(timeout=60)
    assert job.returncode == 0, err
    assert "closed after signal" in out
    assert steps_on_disk(tmp_path / "run.jsonl") == list(range(50))


@POSIX_SIGNALS
def test_lightnings_graceful_stop_is_kept(tmp_path: Path) -> None:
    """Lightning composes the SIGTERM handlers it finds (nanscan's among them, the recorder being
    open before the fit) behind its own, which stops the fit at the next batch. nanscan's reads the
    records out and leaves the ending to Lightning: the job ends as it does without nanscan."""
    pytest.importorskip("lightning")
    codes = []
    for recorders in ("0", "1"):
        job = start_job(tmp_path, "--recorders", recorders, "--steps", "60", "--every", "100", "--lightning", "20")
        _, err = job.communicate(timeout=300)
        assert "Received SIGTERM" in err, err[-3000:]
        codes.append(job.returncode)
    assert codes[1] == codes[0] == 0  # Lightning's SIGTERMException: a SystemExit
    assert steps_on_disk(tmp_path / "run.jsonl") == list(range(20))


@POSIX_SIGNALS
def test_several_recorders_are_each_read_out_once(tmp_path: Path) -> None:
    job = start_job(tmp_path, "--steps", "30", "--recorders", "2")
    wait_ready(job)
    job.send_signal(signal.SIGTERM)
    job.communicate(timeout=60)
    assert job.returncode == -signal.SIGTERM
    assert steps_on_disk(tmp_path / "run.jsonl") == list(range(30))
    assert steps_on_disk(tmp_path / "second.jsonl") == list(range(30))


@POSIX_SIGNALS
def test_a_sigterm_in_the_middle_of_a_read_waits_for_it(tmp_path: Path) -> None:
    """A SIGTERM that lands while the recorder is handing records to its sinks (sent by a sink, at
    the 10th of the 20 of a periodic read) is acted on when the read returns: each record once, none
    handed on twice by a read inside the read. With the default handler the job ends there; with
    one that lets it go on, it records its 50 steps and closes."""
    job = start_job(tmp_path, "--steps", "50", "--every", "20", "--signal-at-record", "10")
    _, err = job.communicate(timeout=120)
    assert job.returncode == -signal.SIGTERM, err
    assert steps_on_disk(tmp_path / "run.jsonl") == list(range(20))
    (tmp_path / "run.jsonl").unlink()
    job = start_job(
        tmp_path, "--steps", "50", "--every", "20", "--signal-at-record", "10", "--user-handler", "continue"
    )
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    assert "closed after" in out
    assert steps_on_disk(tmp_path / "run.jsonl") == list(range(50))


@POSIX_SIGNALS
def test_a_forked_child_reads_out_nothing(tmp_path: Path) -> None:
    """A fork (a DataLoader worker) inherits the handler and copies of the recorders; a SIGTERM to
    it ends it by the signal and writes nothing: the records are the parent's, on disk once."""
    job = start_job(tmp_path, "--steps", "40", "--fork", "--then", "close")
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    assert f"child ended by signal {int(signal.SIGTERM)}" in out
    assert steps_on_disk(tmp_path / "run.jsonl") == list(range(40))


def close_open_recorders() -> None:
    """Closes the recorders other tests left open (those left to the garbage collector put the handler
    back when collected)."""
    gc.collect()
    for recorder in list(_open_recorders):
        recorder.close()


def test_the_previous_handler_is_back_after_the_last_close() -> None:
    close_open_recorders()
    previous = signal.getsignal(signal.SIGTERM)
    first = nanscan.Recorder(warn=False)
    second = nanscan.Recorder(warn=False)
    assert signal.getsignal(signal.SIGTERM) is not previous
    first.close()
    assert signal.getsignal(signal.SIGTERM) is not previous  # the second is still open
    second.close()
    assert signal.getsignal(signal.SIGTERM) is previous
    # A recorder dropped without close(): collected, it puts the handler back too.
    dropped = nanscan.Recorder(warn=False)
    assert signal.getsignal(signal.SIGTERM) is not previous
    del dropped
    gc.collect()
    assert signal.getsignal(signal.SIGTERM) is previous


def test_nothing_is_installed_outside_the_main_thread_nor_over_an_ignored_sigterm() -> None:
    close_open_recorders()
    previous = signal.getsignal(signal.SIGTERM)
    made: list[nanscan.Recorder] = []
    thread = threading.Thread(target=lambda: made.append(nanscan.Recorder(warn=False)))
    thread.start()
    thread.join()
    assert signal.getsignal(signal.SIGTERM) is previous
    made[0].close()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        recorder = nanscan.Recorder(warn=False)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        recorder.close()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, previous)


# --------------------------------------------------------------------------------- flush_on_nonfinite


def test_a_nonfinite_step_is_on_disk_at_once(tmp_path: Path) -> None:
    """flush_on_nonfinite (the default): the append of a step whose gradients held a NaN reads the
    buffer out (on the CPU at that very append), so a kill right after still leaves it on disk;
    finite steps wait for ``every``. Off, nothing is read before ``every``."""
    for flush_on_nonfinite, expected in ((True, list(range(8))), (False, [])):
        path = tmp_path / f"run_{flush_on_nonfinite}.jsonl"
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 4)
        recorder = nanscan.Recorder([JSONLSink(path)], every=100, warn=False, flush_on_nonfinite=flush_on_nonfinite)
        for step in range(8):
            model(torch.randn(2, 4)).sum().backward()
            if step == 7:
                model.weight.grad[0, 0] = math.nan  # type: ignore[index]
            nanscan.check(model, recorder=recorder)
            model.zero_grad()
        assert steps_on_disk(path) == expected
        recorder.close()
        assert steps_on_disk(path) == list(range(8))


# ---------------------------------------------------------------------------------- SIGKILL, cut lines


def kill_in_the_middle_of_a_line(job: subprocess.Popen[str], path: Path, after: int, timeout: float = 120.0) -> bool:
    """SIGKILL to ``job``, once its file holds ``after`` bytes, at a moment the file does not end with
    an end of line: the sink writes a line in one call, so that moment is inside the write of a line
    (Linux ends a write to a regular file short when the process is killed: the line is cut where
    the kill met it). Whether the cut stayed: the write may have ended before the kill arrived."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and job.poll() is None:
        if not path.exists():  # the sink opens its file at its first record
            continue
        with path.open("rb") as f:
            size = f.seek(0, os.SEEK_END)
            if size > after:
                f.seek(size - 1)
                if f.read(1) != b"\n":
                    job.kill()
                    break
    job.kill()
    job.communicate(timeout=60)
    return not path.read_bytes().endswith(b"\n")


@POSIX_SIGNALS
def test_sigkill_in_the_middle_of_a_large_record_leaves_a_file_that_plots(tmp_path: Path) -> None:
    """Records of 40,000 parameters (lines of ~5 MB), read every 2 steps; SIGKILL (no handler can
    run) from outside while a line is being written, after the first records. The file holds the
    complete records and the start of the cut one; the reader drops that line with a warning naming
    it, and ``nanscan plot`` draws every complete record."""
    path = tmp_path / "run.jsonl"
    for _ in range(5):  # a kill that lands just after a write ends leaves no cut: try again
        path.unlink(missing_ok=True)
        job = start_job(tmp_path, "--steps", "1", "--every", "2", "--scalars", "40000", "--then", "train")
        wait_ready(job)
        if kill_in_the_middle_of_a_line(job, path, after=8_000_000):
            break
    else:
        pytest.fail("five kills in the middle of a line all came after its write ended")
    assert job.returncode == -signal.SIGKILL
    complete = steps_on_disk(path)
    assert len(complete) >= 1 and complete == list(range(len(complete)))
    with pytest.warns(RuntimeWarning, match=rf"run.jsonl:{len(complete) + 2} was cut short"):
        assert [r.step for r in read_jsonl(path)] == complete
    pytest.importorskip("matplotlib")
    plot = subprocess.run(
        [sys.executable, "-m", "nanscan", "plot", str(path), "-o", str(tmp_path / "run.png")],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        check=False,
    )
    assert plot.returncode == 0, plot.stderr
    assert "was cut short" in plot.stderr
    assert (tmp_path / "run.png").stat().st_size > 5_000


@POSIX_SIGNALS
def test_sigkill_at_any_moment_of_training_leaves_a_file_that_reads(tmp_path: Path) -> None:
    """A kill from outside at an arbitrary moment of a job that reads its recorder every 5 steps:
    whatever is on disk reads, up to the last complete record."""
    job = start_job(tmp_path, "--steps", "1", "--every", "5", "--width", "12", "--then", "train")
    wait_ready(job)
    path = tmp_path / "run.jsonl"
    deadline = time.monotonic() + 60
    while (not path.exists() or path.stat().st_size < 100_000) and time.monotonic() < deadline:
        time.sleep(0.005)
    job.kill()
    job.communicate(timeout=60)
    complete = steps_on_disk(path)
    assert len(complete) > 10
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a cut last line, if the kill left one
        assert [r.step for r in read_jsonl(path)] == complete


def _two_step_file(tmp_path: Path) -> tuple[Path, list[str]]:
    path = tmp_path / "run.jsonl"
    with nanscan.Recorder([JSONLSink(path)], every=10, warn=False) as recorder:
        model = torch.nn.Linear(3, 2)
        for _ in range(3):
            model(torch.randn(2, 3)).sum().backward()
            nanscan.check(model, recorder=recorder)
            model.zero_grad()
    return path, path.read_text().splitlines(keepends=True)


def test_a_damaged_line_before_others_is_an_error_naming_file_and_line(tmp_path: Path) -> None:
    path, lines = _two_step_file(tmp_path)
    path.write_text(lines[0] + lines[1][:40] + "\n" + lines[2])
    with pytest.raises(ValueError, match=r"run.jsonl:2 is not JSON .*only a last line cut short is skipped"):
        read_jsonl(path)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda line: line | {"total_norm": "abc"}, r"run.jsonl:3: total_norm is 'abc', not a number"),
        (lambda line: line | {"norm": [1.0, "abc"]}, r"run.jsonl:3: norm\[1\] is 'abc', not a number"),
        (lambda line: line | {"finite": "yes"}, r"run.jsonl:3: finite is 'yes', not true or false"),
        (lambda line: line | {"step": 1.5}, r"run.jsonl:3: step is 1.5, not an integer"),
        (
            lambda line: {k: v for k, v in line.items() if k != "min"},
            r"run.jsonl:3: a step line without its field 'min'",
        ),
        (lambda line: line | {"norm": [1.0]}, r"run.jsonl:3: arrays of \[1, 2\] values where its layout has 2 names"),
        (lambda line: line | {"schema": 99}, r"run.jsonl:3: a step line of schema 99: this nanscan reads schemas 1, 2"),
    ],
)
def test_a_malformed_step_line_names_file_line_and_field(tmp_path: Path, edit: object, message: str) -> None:
    path, lines = _two_step_file(tmp_path)
    broken = edit(json.loads(lines[2]))  # type: ignore[operator]
    path.write_text(lines[0] + lines[1] + json.dumps(broken) + "\n" + lines[3])
    with pytest.raises(ValueError, match=message):
        read_jsonl(path)


def test_a_layout_of_a_future_schema_is_refused_as_such(tmp_path: Path) -> None:
    path, lines = _two_step_file(tmp_path)
    layout = json.loads(lines[0]) | {"schema": 99, "names": {"packed": True}}
    path.write_text(json.dumps(layout) + "\n" + "".join(lines[1:]))
    with pytest.raises(ValueError, match=r"run.jsonl:1: a layout line of schema 99: .*upgrade to read it"):
        read_jsonl(path)


def test_a_sink_appending_to_a_cut_file_removes_the_cut_line_first(tmp_path: Path) -> None:
    """A job resumed after a kill appends to the same file: the line the kill cut is removed (with a
    warning naming it), so the file reads whole, with no damaged line in its middle."""
    path, lines = _two_step_file(tmp_path)
    path.write_text("".join(lines[:3]) + lines[3][:25])
    model = torch.nn.Linear(3, 2)

    def one_record(sink: JSONLSink | CSVSink) -> None:
        with nanscan.Recorder([sink], warn=False) as recorder:
            model(torch.randn(2, 3)).sum().backward()
            nanscan.check(model, recorder=recorder)

    sink = JSONLSink(path)
    assert path.read_text().endswith(lines[3][:25]), "a sink opens its file at its first record, not when made"
    with pytest.warns(RuntimeWarning, match=r"JSONLSink: .*run.jsonl:4 was cut short \(25 bytes"):
        one_record(sink)
    assert [r.step for r in read_jsonl(path)] == [0, 1, 0]
    # CSV: a row cut short goes; so does a header cut short (the file is begun again).
    csv_path = tmp_path / "run.csv"
    one_record(CSVSink(csv_path))
    rows = csv_path.read_text().splitlines(keepends=True)
    csv_path.write_text("".join(rows[:2]) + rows[2][:9])
    with pytest.warns(RuntimeWarning, match=r"CSVSink: .*run.csv:3 was cut short \(9 bytes"):
        one_record(CSVSink(csv_path))
    assert csv_path.read_text().splitlines(keepends=True)[:2] == rows[:2]
    assert len(csv_path.read_text().splitlines()) == 2 + 2, "the cut row gone, the new step's two rows after"
    csv_path.write_text(rows[0][:30])
    with pytest.warns(RuntimeWarning, match=r"run.csv:1 was cut short"):
        one_record(CSVSink(csv_path))
    assert csv_path.read_text().splitlines(keepends=True)[0] == rows[0]


def test_the_job_script_runs_to_its_end(tmp_path: Path) -> None:
    """tests/recorder_job.py itself, without a signal: it records and closes (so the tests above
    fail for the reasons they state, not for a broken job)."""
    job = start_job(tmp_path, "--steps", "12", "--every", "5", "--then", "close")
    out, err = job.communicate(timeout=120)
    assert job.returncode == 0, err
    assert "closed after no signal" in out
    assert steps_on_disk(tmp_path / "run.jsonl") == list(range(12))
    assert os.path.getsize(tmp_path / "run.jsonl") > 0
