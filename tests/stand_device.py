"""A device without hardware: torch's PrivateUse1 key, renamed "stand", set up as a Python backend
(torch.utils.backend_registration), whose tensors keep their values in CPU tensors. Every ATen op on
it runs on those CPU tensors; nanscan's ops are left to the dispatcher, which sends them, as for any
device without a kernel of nanscan's (MPS, XPU, an accelerator's PrivateUse1 backend), to their
CompositeExplicitAutograd implementation: nanscan.composite (record_'s, in C++).

Run as a script by tests/test_composite.py (renaming PrivateUse1 is for the life of a process): it
checks each op's answer on "stand" tensors against the CPU kernel's on the same values, and exits
non-zero with the reason on the first difference."""

from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch.utils._pytree import tree_map
from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

import nanscan
from nanscan.fused import ScanResult

DEVICE = "stand"


class Stand(torch.Tensor):
    """A "stand" tensor: a wrapper of a CPU tensor, whose ATen ops run on the CPU tensor."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> Stand:
        return torch.Tensor._make_wrapper_subclass(  # type: ignore[no-any-return]
            cls,
            inner.shape,
            strides=inner.stride(),
            storage_offset=inner.storage_offset(),
            dtype=inner.dtype,
            device=DEVICE,
        )

    def __init__(self, inner: torch.Tensor) -> None:
        self.inner = inner

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Stand({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func.namespace == "nanscan":
            # What the dispatcher does for a backend without a kernel: its CompositeExplicitAutograd one.
            keys = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
            return func.redispatch(keys, *args, **kwargs)

        def unwrap(value: Any) -> Any:
            if isinstance(value, Stand):
                return value.inner
            if isinstance(value, torch.device) and value.type == DEVICE:
                return torch.device("cpu")
            return value

        out = func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))
        if not func._schema.returns:
            return None
        for i, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                # An in-place or out= op: the stand tensor it wrote through its CPU tensor.
                return kwargs[argument.name] if argument.name in kwargs else args[i]
        return tree_map(lambda t: Stand(t) if type(t) is torch.Tensor else t, out)


def stand(t: torch.Tensor) -> Stand:
    return Stand(t.clone())


def cpu(value: Any) -> Any:
    return tree_map(lambda t: t.inner if isinstance(t, Stand) else t, value)


def same(got: Any, want: Any, what: str) -> None:
    got, want = cpu(got), cpu(want)
    for g, w in zip(got, want, strict=True):
        ok = g.shape == w.shape and g.dtype == w.dtype
        ok = ok and (
            torch.equal(g, w)
            if not g.is_floating_point()
            else torch.allclose(g.double(), w.double(), rtol=1e-6, atol=0, equal_nan=True)
        )
        if not ok:
            sys.exit(f"stand device: {what}: {g} != {w}")
    print(f"ok {what}")


def register_factories() -> torch.library.Library:
    """The ATen factories that make tensors from nothing (no stand tensor among their arguments, so no
    __torch_dispatch__ sees them): a stand tensor over a new CPU tensor."""
    library = torch.library.Library("aten", "IMPL")

    def empty(
        size: Any,
        dtype: Any = None,
        layout: Any = None,
        device: Any = None,
        pin_memory: Any = None,
        memory_format: Any = None,
    ) -> Stand:
        return Stand(torch.empty(size, dtype=dtype))

    def empty_strided(
        size: Any, stride: Any, dtype: Any = None, layout: Any = None, device: Any = None, pin_memory: Any = None
    ) -> Stand:
        return Stand(torch.empty_strided(size, stride, dtype=dtype))

    library.impl("empty.memory_format", empty, "PrivateUse1")
    library.impl("empty_strided", empty_strided, "PrivateUse1")
    return library


def main() -> None:
    _setup_privateuseone_for_python_backend(DEVICE)
    factories = register_factories()  # kept alive: its registrations go with it
    torch.manual_seed(0)
    values = [torch.randn(5000), torch.randn(64, 33).t(), torch.randn(300).to(torch.bfloat16), torch.full((9,), 1e20)]
    values += [torch.randn(2000) * 1e-20, torch.randn(100).to(torch.float8_e5m2), torch.empty(0)]
    values[0][7] = math.nan
    values[1][3, 3] = -math.inf
    on_stand = [stand(v) for v in values]
    assert on_stand[0].device.type == DEVICE
    scan = torch.ops.nanscan.scan.default
    for fp16_range, checksum in ((False, False), (True, False), (False, True)):
        same(
            scan(on_stand, fp16_range, checksum), scan(values, fp16_range, checksum), f"scan {fp16_range=} {checksum=}"
        )

    # The activation watch's scan: into columns of buffers on the device.
    for fp16_range in (False, True):
        buffers = [
            torch.full((4 if fp16_range else 2, 10), -1, dtype=torch.int64),
            torch.full((3, 10), -1.0, dtype=torch.float64),
        ]
        on_stand_buffers = [stand(b) for b in buffers]
        torch.ops.nanscan.scan_into_.default(on_stand, fp16_range, *on_stand_buffers, 2)
        torch.ops.nanscan.scan_into_.default(values, fp16_range, *buffers, 2)
        same(on_stand_buffers, buffers, f"scan_into_ {fp16_range=}")

    writable = [v.clone() for v in values[:5]]
    on_stand = [stand(v) for v in writable]
    torch.ops.nanscan.scale_.default(on_stand, Stand(torch.tensor(0.25)))
    torch.ops.nanscan.scale_.default(writable, torch.tensor(0.25))
    same(on_stand, writable, "scale_")
    inv = torch.tensor(0.5, dtype=torch.float32)
    same(
        torch.ops.nanscan.unscale_scan_.default(on_stand, Stand(inv.clone())),
        torch.ops.nanscan.unscale_scan_.default(writable, inv),
        "unscale_scan_ (statistics)",
    )
    same(on_stand, writable, "unscale_scan_ (values)")

    before = [torch.randn(700), torch.randn(30, 3)]
    after = [b + 1e-3 * torch.randn_like(b) for b in before]
    after[1] = after[1].to(torch.bfloat16)
    same(
        torch.ops.nanscan.scan_difference.default([stand(b) for b in before], [stand(a) for a in after]),
        torch.ops.nanscan.scan_difference.default(before, after),
        "scan_difference",
    )

    # The recorder's append: record_'s composite, in C++ ATen calls, on the stand device too.
    rows, counter = torch.full((3, 4), math.nan), torch.zeros(1, dtype=torch.int64)
    on_stand_rows, on_stand_counter = stand(rows), stand(counter)
    sources = [torch.tensor([1.0, 2.0]), torch.tensor([3, 4], dtype=torch.int64)]
    for _ in range(4):
        torch.ops.nanscan.record_.default(on_stand_rows, on_stand_counter, [stand(s) for s in sources], None, [])
        torch.ops.nanscan.record_.default(rows, counter, sources, None, [])
    same([on_stand_rows, on_stand_counter], [rows, counter], "record_")

    # nanscan's Python entry point over stand tensors: what a model's gradients there would get.
    result = nanscan.scan([stand(v) for v in values])
    want = ScanResult.from_op(*scan(values))
    same(
        [result.nan_count, result.norm, result.total_norm], [want.nan_count, want.norm, want.total_norm], "nanscan.scan"
    )
    print("stand device: every op answered as the CPU kernel")
    del factories


if __name__ == "__main__":
    main()
