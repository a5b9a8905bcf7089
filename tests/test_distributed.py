"""nanscan across real processes: torch.distributed with gloo on the CPU, 2 and 4 ranks.

Every case of tests/distributed_cases.py (FSDP2, tensor parallel, FSDP2 + TP on a 2x2 mesh, HSDP,
DTensors of every placement, pipeline stages with process_group, DDP, replicas) and of
tests/distributed_norm_cases.py (the total norm of clip_grad_norm_ and get_total_norm) runs on every
rank, all cases of a world size in one launch of that many processes (their start-up, importing
torch, is most of the cost); each case is then one test here. NCCL takes the same code path; no
multi-GPU machine runs it.
"""

from __future__ import annotations

import functools
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from distributed_norm_cases import CASES

from conftest import ROOT, needs_cuda, rank_environment

WORLDS = [2, 4]
LAUNCH_TIMEOUT_S = 400  # every case of a world size, on 2 shared cores


@functools.cache
def results(world: int) -> tuple[dict[str, list[str]], list[tuple[int, str]]]:
    """Runs every case on ``world`` processes once. Returns, per case, each rank's error ('' when it
    passed), and each rank's exit status with the end of its output."""
    with tempfile.TemporaryDirectory() as out:
        init = f"file://{Path(out, 'store')}"
        script = str(ROOT / "tests" / "distributed_norm_cases.py")  # registers distributed_cases' cases too
        procs = [
            subprocess.Popen(
                [sys.executable, script, str(rank), str(world), init, out],
                env=rank_environment(),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
            for rank in range(world)
        ]
        try:
            logs = [proc.communicate(timeout=LAUNCH_TIMEOUT_S)[0] for proc in procs]
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            pytest.fail(f"{world} processes did not finish in {LAUNCH_TIMEOUT_S} s (a collective waiting forever?)")
        by_case: dict[str, list[str]] = {name: [] for name in CASES}
        for rank in range(world):
            path = Path(out, f"rank{rank}.tsv")
            if not path.exists():
                pytest.fail(f"rank {rank} of {world} wrote no results; its output:\n{logs[rank][-4000:]}")
            for line in path.read_text().splitlines():
                name, _, error = line.partition("\t")
                by_case[name].append(error.replace("\\n", "\n"))
        return by_case, [(proc.returncode, log[-4000:]) for proc, log in zip(procs, logs, strict=True)]


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", list(CASES))
def test_distributed(case: str, world: int) -> None:
    errors = results(world)[0][case]
    assert len(errors) == world, f"{len(errors)} of {world} ranks reported"
    failed = {rank: error for rank, error in enumerate(errors) if error}
    assert not failed, "\n".join(f"rank {rank}:\n{error}" for rank, error in failed.items())


@pytest.mark.parametrize("world", WORLDS)
def test_every_process_exits_cleanly_after_its_last_collective(world: int) -> None:
    """A process that exits right after collectives must exit with status 0: a gloo worker that still
    held a collective's tensor when the interpreter finalized aborted the process ("terminate called
    without an active exception", see nanscan/layouts/collectives.py) after every case had passed."""
    for rank, (status, log) in enumerate(results(world)[1]):
        assert status == 0, f"rank {rank} of {world} exited with status {status}; its output ends:\n{log}"


NCCL = pytest.mark.skipif(
    not (torch.distributed.is_available() and torch.distributed.is_nccl_available()), reason="torch without NCCL"
)


@pytest.mark.parametrize(
    ("backend", "device"), [("gloo", "cpu"), pytest.param("nccl", "cuda", marks=[pytest.mark.cuda, needs_cuda, NCCL])]
)
def test_a_one_rank_group_gives_what_no_group_gives_on_every_stack(backend: str, device: str) -> None:
    """tools/nccl_one_rank.py: check, clip, the recorder, verify_replicas and the GradScaler on FSDP2,
    DDP with nanscan's hook and FSDP1 under a one-rank group equal the plain model's; on CUDA (NCCL,
    the collectives on a stream) inside set_sync_debug_mode("error"), so a host sync fails it."""
    script = str(ROOT / "tools" / "nccl_one_rank.py")
    done = subprocess.run(
        [sys.executable, script, "--backend", backend, "--device", device],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert "8 of 8 passed" in done.stdout, done.stdout
