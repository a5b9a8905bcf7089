"""DeepSpeed's engines, real ones, in 2 gloo processes (tests/deepspeed_cases.py): refused by every
entry point wherever ZeRO (stages 1-3, the bf16 optimizer) keeps the gradients partitioned, and read
as DDP's layout at stage 0. Skipped where DeepSpeed is not installed (CI installs it: .ci/run); the
wrappers that cannot be built here are planted in tests/test_layouts.py."""

from __future__ import annotations

import importlib.util
import json
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import ROOT

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
WORLD = 2
TIMEOUT_S = 600  # the first run builds DeepSpeed's CPU communication op (minutes on 2 cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_deepspeed_engines() -> None:
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        script = str(ROOT / "tests" / "deepspeed_cases.py")
        procs = [
            subprocess.Popen(
                [sys.executable, script, str(rank), str(WORLD), str(port), out],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(WORLD)
        ]
        logs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
        results = []
        for rank in range(WORLD):
            path = Path(out, f"rank{rank}.json")
            assert path.exists(), f"rank {rank} wrote no results; its output:\n{logs[rank][-4000:]}"
            results.append(json.loads(path.read_text()))
    for rank, by_configuration in enumerate(results):
        for configuration, entry in by_configuration.items():
            calls = {name: outcome for name, outcome in entry.items() if name.endswith(")")}
            if configuration == "stage 0 fp32":
                assert all(outcome == "" for outcome in calls.values()), (rank, calls)
                assert entry["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"], entry["names"]
                # Every rank holds the all-reduced gradient, and the report's total is its norm.
                assert len(set(entry["norm_of_every_rank"])) == 1
                assert entry["total_norm"] == pytest.approx(entry["norm_of_every_rank"][0], rel=1e-6)
                continue
            for name, outcome in calls.items():
                assert outcome.startswith("ValueError: nanscan:") and "DeepSpeed" in outcome, (
                    rank,
                    configuration,
                    name,
                    outcome,
                )
            assert "DeepSpeedEngine is a DeepSpeed engine" in calls["check(engine)"], calls["check(engine)"]
