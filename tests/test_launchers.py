"""The framework callbacks under the frameworks' own multi-process launchers: real processes, DDP over gloo.

tests/launched_lightning.py runs ``Trainer(accelerator="cpu", devices=2, strategy="ddp")``; started
here as a user starts it (``python script.py``), Lightning's subprocess launcher runs it again for
rank 1 (``strategy="ddp_spawn"`` too: Lightning pickles the callbacks, and their recorder, into the
processes it spawns). tests/launched_transformers.py runs a ``transformers.Trainer`` with
``TrainingArguments(use_cpu=True)`` (DDP; and DeepSpeed ZeRO-2, whose step accelerate runs inside
the backward: the callback checks inside it), and tests/launched_accelerate.py a user's own loop with
``Accelerator(cpu=True, gradient_accumulation_steps=2)``, under ``python -m torch.distributed.run
--nproc_per_node 2``. In each, one rank alone makes a NaN at one step, before DDP all-reduces the gradients, and every rank
writes what it saw (rank{R}.json) and its recorder's records (run.jsonl, one path for every rank,
and run-{rank}.jsonl). Each launch runs once, for every test of it (their start-up, importing torch
and the framework, is most of the cost).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pytest

from nanscan.records import read_jsonl

from conftest import ROOT, rank_environment

LAUNCH_TIMEOUT_S = 180  # a launch takes about 10 s on 2 shared cores
STEPS = 6  # as the scripts have them
NAN_STEP = 3
WORLD = 2

# A launcher's variables inherited from a process that was itself launched would make the scripts
# join that world instead of forming their own.
LAUNCHER_VARIABLES = (
    *("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"),
    "PL_GLOBAL_SEED",
)


@dataclass(frozen=True)
class Launch:
    """One launched run: its output folder, each rank's rank{R}.json, the launcher's output, wall time."""

    out: Path
    ranks: list[dict[str, Any]]
    log: str
    seconds: float


def end(proc: subprocess.Popen[str]) -> str:
    """Ends a launch that ran out of time (started in a session of its own), and returns its output:
    SIGTERM to the session first (torchrun then ends its workers, which it starts in sessions of their
    own), then SIGKILL (Lightning's rank 1 is in the launcher's session)."""
    for sig, wait_s in ((signal.SIGTERM, 15), (signal.SIGKILL, 5)):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        try:
            return proc.communicate(timeout=wait_s)[0]
        except subprocess.TimeoutExpired:
            continue
    return "(its output could not be read: a process outside the launcher's session holds it)"


def launch(command: list[str], out: Path) -> Launch:
    """Runs ``command`` (a launcher that starts ``WORLD`` ranks), which must exit with status 0 within
    ``LAUNCH_TIMEOUT_S`` and leave every rank's rank{R}.json in ``out``."""
    env = rank_environment(
        {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    )
    start = time.perf_counter()
    proc = subprocess.Popen(
        command, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output = proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:
        output = end(proc)
        pytest.fail(
            f"{' '.join(command)} did not finish in {LAUNCH_TIMEOUT_S} s (a rank waiting forever?):\n{output[-6000:]}"
        )
    seconds = time.perf_counter() - start
    log = output[-6000:]
    assert proc.returncode == 0, f"{' '.join(command)} exited with status {proc.returncode}; its output ends:\n{log}"
    ranks = []
    for rank in range(WORLD):
        path = out / f"rank{rank}.json"
        if not path.exists():
            pytest.fail(f"rank {rank} wrote no {path.name}; the launch's output ends:\n{log}")
        ranks.append(json.loads(path.read_text()))
    return Launch(out, ranks, log, seconds)


def lightning(out: Path, strategy: str, *options: str) -> Launch:
    pytest.importorskip("lightning")
    script = str(ROOT / "tests" / "launched_lightning.py")
    return launch([sys.executable, script, str(out), strategy, *options], out)


def torchrun(script: str, out: Path, *options: str) -> Launch:
    pytest.importorskip("accelerate")  # the Trainer needs it too
    if script == "launched_transformers.py":
        pytest.importorskip("transformers")
    if any(option.startswith("zero") for option in options):
        pytest.importorskip("deepspeed")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}"]
    return launch([*command, str(ROOT / "tests" / script), str(out), *options], out)


@pytest.fixture(
    scope="module",
    params=[
        "lightning-ddp",
        "transformers-torchrun",
        "transformers-zero2",
        "transformers-zero3",
        "accelerate-torchrun",
    ],
)
def launcher(request: pytest.FixtureRequest) -> str:
    """Which framework run the module's tests read: a test that applies to some runs alone says so
    from this name, before the run is launched (a launch takes 10-25 s)."""
    return cast(str, request.param)


@pytest.fixture(scope="module")
def launched(launcher: str, tmp_path_factory: pytest.TempPathFactory) -> Launch:
    out = tmp_path_factory.mktemp(launcher)
    framework, _, how = launcher.partition("-")
    # Lightning's DDP with the callback's DDP hook attached (attach_ddp=True); ddp_spawn, below, without.
    # The Trainer with DeepSpeed ZeRO-2 or ZeRO-3 in place of DDP (the callback checks inside DeepSpeed's step).
    options = [how] if how.startswith("zero") else []
    run = (
        lightning(out, "ddp", "attach")
        if framework == "lightning"
        else torchrun(f"launched_{framework}.py", out, *options)
    )
    print(f"{launcher}: {run.seconds:.1f} s")  # (shown with pytest -s)
    return run


def norms(records: list[tuple[int, str, bool]]) -> list[float]:
    return [float.fromhex(norm) for _, norm, _ in records]


def assert_ranks_agree(run: Launch) -> None:
    """Both ranks in one DDP (or DeepSpeed) world skipped the NaN step, and hold the same weights and
    records."""
    for result in run.ranks:
        rank = result["rank"]
        assert result["world"] == WORLD, f"rank {rank} ran in a world of {result['world']}, not {WORLD}"
        wrapper = "DeepSpeedEngine" if run.out.name.startswith("transformers-zero") else "DistributedDataParallel"
        assert result["wrapper"] == wrapper, f"rank {rank}'s model: {result['wrapper']}"
        assert result["skips"] == 1, f"rank {rank} skipped {result['skips']} steps, not 1"
        assert result["recorder_skipped"] == 1, f"rank {rank}'s recorder counted {result['recorder_skipped']} skips"
        assert result["weights_finite"], f"rank {rank}'s weights hold a NaN/Inf: the NaN step was not skipped"
        steps = [step for step, _, _ in result["records"]]
        assert steps == list(range(STEPS)), f"rank {rank} recorded steps {steps}"
        skipped = [step for step, _, skip in result["records"] if skip]
        assert skipped == [NAN_STEP], f"rank {rank} recorded steps {skipped} as skipped, not [{NAN_STEP}]"
        for step, norm in enumerate(norms(result["records"])):
            assert math.isnan(norm) == (step == NAN_STEP), f"rank {rank}, step {step}: total norm {norm}"
    planted = [result["planted"] for result in run.ranks]
    assert planted == [False, True], f"the ranks that made the NaN: {planted} (rank 1 alone should)"
    zero, one = run.ranks
    # The ranks read different data: what they agree on is the all-reduced gradients' (and the NaN made
    # on rank 1 alone reached rank 0 through the all-reduce, or rank 0 would not have skipped).
    assert zero["first_input"] != one["first_input"], "both ranks trained on the same data"
    assert zero["weights"] == one["weights"], "the ranks' weights differ after the run"
    assert zero["records"] == one["records"], f"the ranks' records differ:\n{zero['records']}\n{one['records']}"


def test_both_ranks_skip_the_step_whose_nan_one_rank_made_and_agree_exactly(launched: Launch) -> None:
    assert_ranks_agree(launched)


def test_a_records_file_that_every_rank_names_holds_each_step_once(launched: Launch) -> None:
    """JSONLSink("run.jsonl") on every rank: rank 0 alone writes it (nanscan.sinks), so each step is
    in it once, with rank 0's figures."""
    records = read_jsonl(launched.out / "run.jsonl")
    steps = [r.step for r in records]
    assert steps == list(range(STEPS)), f"run.jsonl holds the steps {steps}, not each of 0..{STEPS - 1} once"
    assert [r.step for r in records if r.skipped] == [NAN_STEP]
    assert [float(r.total_norm).hex() for r in records] == [norm for _, norm, _ in launched.ranks[0]["records"]]


def test_a_records_file_with_the_rank_field_is_one_file_per_rank(launched: Launch) -> None:
    """JSONLSink("run-{rank}.jsonl"): each rank writes its own file, every step in it once."""
    for rank in range(WORLD):
        path = launched.out / f"run-{rank}.jsonl"
        assert path.exists(), f"no {path.name}: {sorted(p.name for p in launched.out.iterdir())}"
        records = read_jsonl(path)
        assert [r.step for r in records] == list(range(STEPS)), f"{path.name}: steps {[r.step for r in records]}"
        assert [r.step for r in records if r.skipped] == [NAN_STEP], path.name
        want = [norm for _, norm, _ in launched.ranks[rank]["records"]]
        assert [float(r.total_norm).hex() for r in records] == want, path.name
    assert not (launched.out / "run-{rank}.jsonl").exists(), "a file named with the placeholder itself"


def test_a_check_inside_no_sync_is_refused_on_every_rank(launcher: str, request: pytest.FixtureRequest) -> None:
    """The user's loop (Accelerate) checks inside ``no_sync()`` too, where each rank's gradients are
    its own: every such check is refused, on every rank, naming ``no_sync()``, whether it is handed
    the DDP model, its parameters or the module inside it."""
    if launcher != "accelerate-torchrun":
        pytest.skip("only the user's own loop (Accelerate) checks between micro-batches")
    launched = cast(Launch, request.getfixturevalue("launched"))
    for result in launched.ranks:
        assert "refusals" in result, f"rank {result['rank']} reported no refusals"
        refusals = result["refusals"]
        assert len(refusals) == 3 * STEPS, (
            f"rank {result['rank']}: {len(refusals)} refusals, three per micro-batch in no_sync"
        )
        assert all("inside no_sync()" in text for text in refusals), refusals[0]


def test_the_rank_that_made_the_nan_is_named_where_the_ddp_hook_is_attached(
    launcher: str, request: pytest.FixtureRequest
) -> None:
    """Lightning's and the Trainer's callbacks with ``attach_ddp=True`` (the Trainer's found the DDP
    model around the module it is handed): every rank's records name rank 1 alone, for every
    parameter, though the all-reduce left the NaN in every rank's gradients."""
    if launcher not in ("lightning-ddp", "transformers-torchrun"):
        pytest.skip("the Accelerate loop and DeepSpeed hold no DDP hook")
    launched = cast(Launch, request.getfixturevalue("launched"))
    for result in launched.ranks:
        assert "nonfinite_ranks" in result, f"rank {result['rank']} reported no ranks for its non-finite records"
        named = result["nonfinite_ranks"]
        assert list(named) == [str(NAN_STEP)], f"rank {result['rank']}: non-finite records {list(named)}"
        ranks = named[str(NAN_STEP)]
        assert ranks and all(r == [1] for r in ranks.values()), f"rank {result['rank']} named {ranks}"


def test_lightning_ddp_spawn(tmp_path: Path) -> None:
    """strategy="ddp_spawn": Lightning pickles the Trainer, its callbacks and their recorder among them,
    into the processes it spawns (the script's own process trains nothing): each copy records in its
    process, and rank 0's writes the run's file."""
    run = lightning(tmp_path, "ddp_spawn")
    assert_ranks_agree(run)
    records = read_jsonl(tmp_path / "run.jsonl")
    assert [r.step for r in records] == list(range(STEPS)), f"run.jsonl: steps {[r.step for r in records]}"
