"""nanscan/layouts/collectives.py: a process exits cleanly right after nanscan's collectives.

A gloo worker still holds a collective's tensor a moment after ``wait()`` returns; when its release is
the last reference, it needs the GIL, which a finalizing interpreter no longer gives, and the process
aborts. These tests pin the mechanism that prevents it (an alias kept while a backend holds it, and
an exit hook that waits for the backends). tests/test_distributed.py checks that every process of
the 2- and 4-rank runs exits with status 0; tools/run_examples.py does so for the torchrun examples,
running one again only after torch's own exit abort, which nanscan cannot prevent (tested below).
"""

from __future__ import annotations

import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from nanscan.layouts import collectives

from conftest import ROOT

sys.path.insert(0, str(ROOT / "tools"))  # tools/ is not a package
import run_examples


@pytest.fixture
def handed() -> list[torch.Tensor]:
    """The module's list of aliases, emptied before and after the test."""
    collectives._handed.clear()
    yield collectives._handed
    collectives._handed.clear()


def test_all_reduce_lands_in_the_tensor_and_keeps_only_what_a_backend_still_holds(
    world_of_one: None, handed: list[torch.Tensor]
) -> None:
    rows = torch.tensor([1.0, float("nan"), -2.0], dtype=torch.float64)
    collectives.all_reduce(rows, dist.ReduceOp.SUM, dist.group.WORLD)
    assert rows[0] == 1.0 and rows[1].isnan() and rows[2] == -2.0
    assert len(handed) == 1 and handed[0].data_ptr() == rows.data_ptr() and handed[0] is not rows

    works = [
        collectives.all_reduce(torch.ones(4), dist.ReduceOp.MAX, dist.group.WORLD, async_op=True) for _ in range(3)
    ]
    for work in works:
        work.wait()
    del works, work  # a work holds its tensors as long as it lives
    deadline = time.monotonic() + 5.0  # the worker lets go of a finished work within microseconds
    while any(collectives._held_elsewhere(a) for a in handed) and time.monotonic() < deadline:
        time.sleep(0.001)
    collectives.all_reduce(torch.zeros(2), dist.ReduceOp.SUM, dist.group.WORLD)
    assert len(handed) <= 2, "aliases the backend let go of are dropped at the next call"


def test_the_exit_hook_waits_until_the_backend_lets_go(handed: list[torch.Tensor]) -> None:
    alias = torch.zeros(8).detach()
    held = [alias.view(2, 4)]  # a view holds its base from C++, as a backend's work does
    handed.append(alias)
    assert collectives._held_elsewhere(alias)

    def let_go() -> None:
        time.sleep(0.05)
        held.clear()

    thread = threading.Thread(target=let_go)
    started = time.monotonic()
    thread.start()
    collectives._release_at_exit()
    thread.join()
    assert time.monotonic() - started >= 0.05, "the hook returned while the backend still held the tensor"
    assert handed == []


def test_the_exit_hook_does_not_hang_on_a_collective_that_never_ends(
    handed: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(collectives, "_EXIT_WAIT_S", 0.05)
    alias = torch.zeros(8).detach()
    hung = alias.view(8)  # noqa: F841 (held for the whole test: a collective that never lets go)
    handed.append(alias)
    started = time.monotonic()
    collectives._release_at_exit()
    assert time.monotonic() - started < 1.0
    assert handed == [alias], "one still held is kept, never freed under the backend"


# The end of what torchrun printed when torch's gloo aborted the FSDP2 example's rank 0 at exit in CI
# (2026-11-28), every step done; the rank it aborted, then the one torchrun ended.
_ABORTED = """\
done on 2 ranks (cpu): 1 step(s) skipped
terminate called without an active exception
W1128 01:07:42.062000 9450 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 9456 closing signal SIGTERM
E1128 01:07:42.095000 9450 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 0 (pid: 9455)
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
Failures:
[1]:
  rank      : 1 (local_rank: 1)
  exitcode  : -15 (pid: 9456)  (SIGTERM)
Root Cause (first observed failure):
[0]:
  rank      : 0 (local_rank: 0)
  exitcode  : -6 (pid: 9455)  (SIGABRT)
"""


@pytest.mark.parametrize(
    ("status", "output", "again"),
    [
        (1, _ABORTED, True),
        (1, _ABORTED.replace("terminate called without an active exception\n", ""), False),  # another abort
        (1, _ABORTED.replace("exitcode  : -15", "exitcode  : 1"), False),  # and a rank that failed
        (1, _ABORTED.replace("exitcode  : -6", "exitcode  : 1").replace("exitcode: -6", "exitcode: 1"), False),
        (None, _ABORTED, False),  # a timeout is not an exit
        (0, _ABORTED, False),
    ],
)
def test_the_example_runner_runs_again_only_after_torchs_exit_abort(
    status: int | None, output: str, again: bool
) -> None:
    """tools/run_examples.py runs an example a second time only when its one failure is torch's gloo
    exit abort (pytorch/pytorch#190489), never after a failing assertion, another signal or a hang."""
    assert run_examples.aborted_at_exit(status, output) is again


_DONE = (0, "done on 2 ranks (cpu): 1 step(s) skipped\n")
_FAILED_RANK = (1, _ABORTED.replace("exitcode  : -15", "exitcode  : 1"))


@pytest.mark.parametrize(
    ("outcomes", "verdict", "last"),
    [
        ([(1, _ABORTED), _DONE], "PASS", "second"),
        ([(1, _ABORTED), (1, _ABORTED), _DONE], "PASS", "third"),
        ([(1, _ABORTED), (1, _ABORTED), (1, _ABORTED)], "FAIL", "third"),  # no fourth
        ([_FAILED_RANK], "FAIL", None),
        ([(1, _ABORTED), _FAILED_RANK], "FAIL", "second"),
    ],
)
def test_the_example_runner_reruns_up_to_twice_after_an_exit_abort_alone(
    outcomes: list[tuple[int, str]],
    verdict: str,
    last: str | None,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The first run that is not torch's exit abort decides, among at most three; each aborted run's
    output is shown."""
    commands: list[list[str]] = []

    def run(argv: list[str], timeout: float) -> tuple[int | None, str]:
        commands.append(argv)
        return outcomes[len(commands) - 1]

    monkeypatch.setattr(run_examples, "run", run)
    status = run_examples.main(["--only", "fsdp2"])
    shown = capsys.readouterr().out
    assert len(commands) == len(outcomes) and commands[0] == commands[-1]
    assert status == (0 if verdict == "PASS" else 1)
    assert f"fsdp2                {verdict}" in shown
    assert (f"(the {last} run)" in shown) if last else ("run)" not in shown)
    aborted = sum(outcome[1] is _ABORTED for outcome in outcomes)
    assert shown.count("terminate called without an active exception") >= aborted  # each aborted run's output
