"""The demo's training run: it names the injected fault, records every step and draws the record."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from nanscan.demo import main
from nanscan.records import read_jsonl


def test_the_training_demo_names_the_fault_and_draws_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    args = ["--scenario", "train", "--steps", "30", "--fault-step", "12", "--width", "32", "--depth", "2"]
    assert main([*args, "--device", "cpu", "--out", str(tmp_path)]) == 0
    records = read_jsonl(tmp_path / "run.jsonl")
    assert [r.step for r in records] == list(range(30))
    assert [r.step for r in records if not r.finite] == [12] and records[12].skipped
    assert records[12].nonfinite == ["4.weight"] and records[12].inf_count[4] > 0
    png = tmp_path / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert f"drawn: {png}" in out and "first non-finite at step 12: 4.weight" in out


def test_a_second_demo_in_the_same_folder_starts_a_fresh_record(tmp_path: Path) -> None:
    args = ["--scenario", "train", "--steps", "8", "--fault-step", "5", "--width", "16", "--depth", "2"]
    for _ in range(2):
        assert main([*args, "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert [r.step for r in read_jsonl(tmp_path / "run.jsonl")] == list(range(8)), "one run, not two appended"


def test_no_fault_is_claimed_when_none_was_injected(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--scenario", "train", "--steps", "6", "--fault-step", "-1", "--width", "16", "--depth", "2"]
    assert main([*args, "--device", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "no fault will be injected" in out and "found 0 bad step(s), 0 optimizer step(s) skipped: none, as" in out
    assert "injected fault, named" not in out and "will be injected at step" not in out


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (["--depth", "1"], "--depth must be at least 2"),
        (["--width", "0"], "--width must be positive"),
        (["--steps", "0"], "--steps must be positive"),
        (
            ["--steps", "5", "--fault-step", "9"],
            r"--fault-step 9 is not a step of the run: give -1 \(no fault\) or 0 to 4",
        ),
        (["--fault-step", "-2"], "--fault-step -2 is not a step of the run"),
        (["--device", "tpu"], "--device 'tpu' is not a device torch knows"),
        (["--device", "meta:x"], "--device 'meta:x' is not a device torch knows"),
        (["--out", "/proc/nanscan-nope/x"], "--out /proc/nanscan-nope/x: cannot write there"),
    ],
)
def test_bad_options_are_refused_before_anything_runs(
    options: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--scenario", "train", "--steps", "20", "--width", "16", *options])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "python -m nanscan demo: error:" in err
    assert re.search(message, err), err


def test_a_device_this_torch_cannot_use_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("needs a torch without a CUDA device")
    with pytest.raises(SystemExit):
        main(["--scenario", "train", "--steps", "5", "--device", "cuda"])
    assert "--device cuda: this torch cannot use it" in capsys.readouterr().err
