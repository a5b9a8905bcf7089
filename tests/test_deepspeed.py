"""DeepSpeed's engines, real ones, in 2 gloo processes (tests/deepspeed_cases.py): ZeRO stages 1, 2 and
3 read from each rank's partition of the averaged gradients (nanscan.layouts.zero), refused by every
entry point where the bf16 optimizer keeps them, and read as DDP's layout at stage 0.
Skipped where DeepSpeed is not installed (CI installs it: .ci/run); the wrappers that cannot be built
here are planted in tests/test_layouts.py."""

from __future__ import annotations

import importlib.util
import json
import math
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from conftest import ROOT, rank_environment

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")
WORLD = 2
TIMEOUT_S = 600  # the first run builds DeepSpeed's CPU communication op (minutes on 2 cores)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


NAMES = ["0.weight", "0.bias", "2.weight", "2.bias", "3.weight"]  # 3.bias is frozen: nothing trains it
READ = [
    "stage 1 fp32",
    "stage 2 fp32",
    "stage 2 bf16",
    "stage 2 fp32, 2 micro-batches",
    "stage 1 fp32, 2 micro-batches",
    "stage 3 fp32",
    "stage 3 bf16",
    "stage 3 fp32, 2 micro-batches",
]
FIGURES = ("norms", "min", "max", "nan", "inf")


@pytest.fixture(scope="module")
def results() -> list[dict[str, Any]]:
    """Each rank's results (tests/deepspeed_cases.py), from one run of 2 processes."""
    with tempfile.TemporaryDirectory() as out:
        port = free_port()
        script = str(ROOT / "tests" / "deepspeed_cases.py")
        procs = [
            subprocess.Popen(
                [sys.executable, script, str(rank), str(WORLD), str(port), out],
                env=rank_environment(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(WORLD)
        ]
        logs = [proc.communicate(timeout=TIMEOUT_S)[0] for proc in procs]
        found = []
        for rank in range(WORLD):
            path = Path(out, f"rank{rank}.json")
            assert path.exists(), f"rank {rank} wrote no results; its output:\n{logs[rank][-4000:]}"
            found.append(json.loads(path.read_text()))
    return found


def test_stage_0_is_read_as_ddp(results: list[dict[str, Any]]) -> None:
    for entry in (by_configuration["stage 0 fp32"] for by_configuration in results):
        assert entry["names"] == ["0.weight", "0.bias", "2.weight", "2.bias"], entry["names"]
        # Every rank holds the all-reduced gradient, and the report's total is its norm.
        assert len(set(entry["norm_of_every_rank"])) == 1
        assert entry["total_norm"] == pytest.approx(entry["norm_of_every_rank"][0], rel=1e-6)


@pytest.mark.parametrize("configuration", READ)
def test_zero_gradients_are_the_models(results: list[dict[str, Any]], configuration: str) -> None:
    """Every way of passing the model gives each parameter's statistics as DeepSpeed assembles its
    gradient, on every rank; fp32 within float rounding of an independent fp64 reference (a plain
    model run on every rank's inputs and micro-batches, averaged)."""
    entries = [by_configuration[configuration] for by_configuration in results]
    for rank, entry in enumerate(entries):
        report = entry["check(engine)"]
        assert report["names"] == NAMES, (rank, report["names"])
        assert report["finite"] and report["nan"] == [0] * 5 and report["inf"] == [0] * 5
        full = entry["full"]
        assert full["names"] == NAMES
        assert report["min"] == full["min"] and report["max"] == full["max"], rank  # the same elements
        assert report["norms"] == pytest.approx(full["norms"], rel=1e-6)
        # The total in torch's dtype for these gradients, as torch's clip gives it (bf16: 8 bits).
        within = 1e-2 if "bf16" in configuration else 1e-6
        assert report["total_norm"] == pytest.approx(math.sqrt(sum(n * n for n in full["norms"])), rel=within)
        if "fp32" in configuration:
            reference = entry["reference"]
            assert report["norms"] == pytest.approx([reference[name][0] for name in NAMES], rel=1e-5)
            assert report["min"] == pytest.approx([reference[name][1] for name in NAMES], rel=1e-5)
            assert report["max"] == pytest.approx([reference[name][2] for name in NAMES], rel=1e-5)
        for way in ("check(engine.module)", "check(named)", "check(params)"):
            same = entry[way]
            assert {key: same[key] for key in FIGURES} == {key: report[key] for key in FIGURES}, (rank, way)
            assert same["total_norm"] == report["total_norm"], (rank, way)
        assert entry["check(params)"]["names"] == [f"[{i}]" for i in range(5)]  # by position, as any list
        assert entry["check(named)"]["names"] == NAMES
        assert entry["Advisor.observe"] == ""
        # Refused still: the values (scan), the replicas (none: the pieces are disjoint), process_group=.
        mark = (
            "partitioned by DeepSpeed ZeRO stage 3"
            if configuration.startswith("stage 3")
            else "of DeepSpeed's ZeRO-1/2"
        )
        for refused in ("scan(params)", "verify_replicas"):
            assert entry[refused].startswith(f"ValueError: nanscan: entry 0 is a parameter {mark}"), entry[refused]
        assert "leave process_group out" in entry["process_group="]
    assert entries[0]["check(engine)"] == entries[1]["check(engine)"]  # the same figures on both ranks
    window = "not the model's now"
    if "micro-batches" in configuration:
        assert all(window in entry["between micro-batches"] for entry in entries)
    for entry in entries:
        if "fp32" in configuration:
            # The clip scaled what DeepSpeed's step applies: weights as SGD on the clipped reference.
            assert entry["clip total"] == pytest.approx(entry["check(engine)"]["total_norm"], rel=1e-6)
            assert entry["step error"] < 1e-6
            assert window in entry["after step"]


@pytest.mark.parametrize("configuration", ["stage 1 fp32", "stage 2 fp32", "stage 3 fp32"])
def test_a_nan_one_rank_made_is_named_on_every_rank(results: list[dict[str, Any]], configuration: str) -> None:
    """Rank 1 alone put a NaN and an Inf in its gradient of 2.weight before DeepSpeed's reduction: the
    average carries them into the partitions; every rank's report names 2.weight alone, once each,
    and which ranks' partitions hold them."""
    planted = [by_configuration[configuration]["planted"] for by_configuration in results]
    for report in planted:
        assert not report["finite"] and math.isnan(report["total_norm"])
        assert report["nan"] == [0, 0, 1, 0, 0] and report["inf"] == [0, 0, 1, 0, 0]
        assert set(report["nonfinite_ranks"]) == {"2.weight"}
    # The same report on both ranks (compared as JSON text: the NaN total is not equal to itself).
    assert json.dumps(planted[0]) == json.dumps(planted[1])


@pytest.mark.parametrize("configuration", ["stage 1 bf16, fp32 accumulation"])
def test_what_zero_keeps_otherwise_is_refused(results: list[dict[str, Any]], configuration: str) -> None:
    """DeepSpeed's BF16_Optimizer (each rank's own sums until the boundary): refused by every entry
    point, on every rank."""
    for rank, by_configuration in enumerate(results):
        calls = by_configuration[configuration]
        for name, outcome in calls.items():
            assert outcome.startswith("ValueError: nanscan:") and "DeepSpeed" in outcome, (rank, name, outcome)
        assert "BF16_Optimizer" in calls["check(engine)"]
