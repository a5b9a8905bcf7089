"""nanscan/layouts/collectives.py: a process exits cleanly right after nanscan's collectives.

A gloo worker still holds a collective's tensor a moment after ``wait()`` returns; when its release is
the last reference, it needs the GIL, which a finalizing interpreter no longer gives, and the process
aborts. These tests pin the mechanism that prevents it (an alias kept while a backend holds it, and
an exit hook that waits for the backends). tests/test_distributed.py checks that every process of
the 2- and 4-rank runs exits with status 0; tools/run_examples.py does so for the torchrun examples.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from nanscan.layouts import collectives


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
