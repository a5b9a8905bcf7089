"""The one way nanscan hands a tensor to a torch.distributed collective: through an alias that Python
keeps until the backend's threads have let go of it, so that a process can exit right after a check.

Why: a gloo collective runs on a worker thread, which still holds the work, and with it the tensor, for
a moment after ``wait()`` returns (NCCL's watchdog holds its works longer). If Python has dropped its
last reference by then, torch hands the tensor's Python object over to C++, and the thread's release
must take the GIL to free it. Once the interpreter is finalizing, it cannot: the thread is ended
inside a destructor and the process aborts with "terminate called without an active exception"
(SIGABRT), though every step succeeded (pytorch/pytorch#190489; ``destroy_process_group()`` does not
help while a model still holds the group). A two-rank gloo script whose last act was a check or
``verify_replicas`` aborted that way in 7 runs of 50 on a 2-core machine (0 of 60 with this module).

So each collective gets a fresh alias (``detach()``: the same storage, a tensor no one else holds),
and the alias stays in ``_handed`` while the backend holds it (its use count is above 1). Each call
drops the aliases already let go of, so the list holds only what is in flight. At exit, an ``atexit``
hook, which runs while other threads can still take the GIL, waits (bounded) until the backends have
let go of every alias, and only then lets Python free them.
"""

from __future__ import annotations

import atexit
import time
from typing import Any

import torch

# How long the exit hook waits for a backend to let go of its tensors. A gloo worker lets go within
# microseconds of finishing, NCCL's watchdog within its polling period, but a worker thread starved of
# CPU (a 2-core machine running builds beside two ranks) can take seconds. With a 2 s bound, a CI run
# on such a machine aborted once (whether past the bound, or in one of torch's own collectives, which
# nanscan cannot hold, was not found). The wait ends as soon as the backends let go, so the bound
# costs its seconds only to a process whose collective hangs, which should not hang with it.
_EXIT_WAIT_S = 10.0

_handed: list[torch.Tensor] = []  # aliases handed to collectives that a backend may still hold


def all_reduce(tensor: torch.Tensor, op: Any, group: Any, *, async_op: bool = False) -> Any:
    """``dist.all_reduce(tensor, op, group, async_op)``, in place on ``tensor``'s storage, with the
    alias it hands over kept alive until the backend has let go of it (see the module notes).
    Returns the work when ``async_op``, else None."""
    import torch.distributed as dist

    handed = tensor.detach()
    work = dist.all_reduce(handed, op=op, group=group, async_op=async_op)
    _keep(handed)
    return work


def _held_elsewhere(alias: torch.Tensor) -> bool:
    """Whether something besides ``_handed`` (a backend's work) still holds ``alias``: its count of
    C++ references (``Tensor._use_count``, private, in every torch nanscan supports), which the
    Python object itself counts as one."""
    use_count: int = alias._use_count()  # type: ignore[attr-defined]
    return use_count > 1


def _keep(alias: torch.Tensor) -> None:
    _handed[:] = [a for a in _handed if _held_elsewhere(a)]
    _handed.append(alias)


@atexit.register
def _release_at_exit() -> None:
    deadline = time.monotonic() + _EXIT_WAIT_S
    while any(_held_elsewhere(a) for a in _handed) and time.monotonic() < deadline:
        time.sleep(0.001)
    # Freed here, by Python. One a backend still holds after the wait (a hung collective) is kept.
    _handed[:] = [a for a in _handed if _held_elsewhere(a)]
