"""The per-call host work on lists of DTensors, in one process (a gloo group of one rank): what it
reuses between calls and within one must never change a result.

The reuse, and what could go wrong with it:
* A reduction plan is found again by the identity of the tensors' layouts (DTensorSpecs), the last
  list's first: a list of the same length with other layouts must get a plan of its own.
* The dtypes of a list's DTensors come from its plan, not from each shard: the total norm's dtype
  must still follow the list's dtypes, plain tensors among them included.
* ``.grad`` of a DTensor parameter is read with torch-function subclass dispatch switched off: only
  where every entry's type disables ``__torch_function__``, so a subclass with its own still sees it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard, distribute_tensor

import nanscan
from nanscan import layouts
from nanscan.fused import gradients_of
from nanscan.layouts import dtensor


def dtensor_parameters(dtypes: list[torch.dtype], placement: Any = None) -> list[torch.nn.Parameter]:
    """Parameters that are DTensors on a mesh of one, each with a gradient of 2s."""
    mesh = init_device_mesh("cpu", (1,))
    params = []
    for i, dtype in enumerate(dtypes):
        value = distribute_tensor(torch.ones(4, 3, dtype=dtype) * (i + 1), mesh, [placement or Shard(0)])
        p = torch.nn.Parameter(value)
        p.grad = distribute_tensor(torch.full((4, 3), 2.0, dtype=dtype), mesh, [placement or Shard(0)])
        params.append(p)
    return params


def test_gradients_of_dtensor_parameters_are_their_gradients(world_of_one: None) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    fully_shard(model)
    model(torch.randn(2, 4)).sum().backward()
    params = list(model.parameters())
    assert type(params[0]) is not torch.nn.Parameter  # FSDP2's parameters are DTensors
    grads = gradients_of(params)
    assert len(grads) == len(params) and all(g is p.grad for g, p in zip(grads, params, strict=True))
    params[1].grad = None
    assert gradients_of(params)[1] is None
    with pytest.raises(AttributeError):
        gradients_of([*params, ("name", params[0])])  # as the comprehension raises: no entry is skipped


class _Counting(torch.Tensor):
    """A subclass with a __torch_function__ of its own, which counts what reaches it."""

    calls = 0

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        cls.calls += 1
        return super().__torch_function__(func, types, args, kwargs or {})


def test_gradients_of_keep_a_subclass_torch_function(world_of_one: None) -> None:
    """A list mixing DTensor parameters with a subclass that has its own __torch_function__ is read
    the usual way: the subclass sees its read."""
    params: list[Any] = dtensor_parameters([torch.float32])
    counted = torch.ones(3).as_subclass(_Counting).requires_grad_()
    counted.grad = torch.ones(3)
    _Counting.calls = 0
    grads = gradients_of([*params, counted])
    assert _Counting.calls == 1  # its .grad read, and nothing else
    assert torch.equal(grads[1], torch.ones(3)) and grads[0] is params[0].grad


def test_a_list_of_the_same_length_with_other_layouts_gets_its_own_plan(world_of_one: None) -> None:
    fp32 = dtensor_parameters([torch.float32, torch.float32])
    bf16 = dtensor_parameters([torch.bfloat16, torch.bfloat16])
    replicated = dtensor_parameters([torch.float32, torch.float32], Replicate())
    for params in (fp32, bf16, fp32, replicated, bf16):  # each after another of the same length
        grads = [p.grad for p in params]
        plan = dtensor.plan_of(grads)
        assert plan.specs == [g._spec for g in grads]
        assert dtensor.plan_of(grads) is plan  # found again
        report = nanscan.check(params, max_norm=1e9)
        torch_norm = torch.nn.utils.get_total_norm(grads).full_tensor()
        assert report.total_norm_tensor.dtype == torch_norm.dtype == params[0].dtype
        torch.testing.assert_close(report.total_norm_tensor, torch_norm)
        clipped = nanscan.clip_grad_norm_(params, 1e9)
        assert clipped.dtype == params[0].dtype


def test_dtypes_of_a_list_with_plain_tensors_among_dtensors(world_of_one: None) -> None:
    params: list[Any] = dtensor_parameters([torch.bfloat16])
    plain = torch.nn.Parameter(torch.ones(3, dtype=torch.float32))
    plain.grad = torch.full((3,), 2.0)
    grads = [params[0].grad, plain.grad]
    layout = layouts.of_tensors(grads)
    assert layout.plan is not None and layout.plan.dtypes == {torch.bfloat16}
    assert layout.dtypes() == {torch.bfloat16, torch.float32}
    # A plan whose specs had no tensor metadata reads every shard's dtype instead.
    unknown = dataclasses.replace(layout, plan=dataclasses.replace(layout.plan, dtypes=None))
    assert unknown.dtypes() == {torch.bfloat16, torch.float32}
    total = nanscan.clip_grad_norm_([params[0], plain], 1e9)
    want = torch.nn.utils.get_total_norm([torch.full((4, 3), 2.0, dtype=torch.bfloat16), plain.grad])
    assert total.dtype == want.dtype == torch.float32
    assert total.item() == pytest.approx(60**0.5)  # 12 + 3 squares of 2; torch rounds the bf16 part's norm first
