"""The demo's training run: it names the injected fault, records every step and draws the record."""

from __future__ import annotations

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
