"""Every kind of bad input to nanscan's public entry points, next to what torch does with it.

One table (ROWS) and one test over it. Each row builds an input once; nanscan and its torch
counterpart each get their own faithful deep copy (``twin``). The test asserts, for both sides, the
exact exception type (or success), a regex on the message, and whether any tensor passed in had
changed afterwards (bit for bit). On an error nanscan must never have changed anything; torch's
column records what torch does, asserted too, so the bad-input table (docs/bad-input.md) cannot drift from reality.
Successful rows also compare nanscan's result and gradients with torch's.

Torch counterparts (the closest call for each entry point):

* ``nanscan.scan``: ``torch._foreach_norm(tensors)``, one call over the whole list like the scan
  (the benchmarks' peer); the per-parameter ``isnan``/``vector_norm`` loop raises the same types.
* ``nanscan.check``: ``torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)`` when clipping,
  else ``torch.nn.utils.get_total_norm`` of the non-None gradients; ``on_nonfinite="raise"`` maps to
  ``error_if_nonfinite=True``. A module passes ``model.parameters()``, ``(name, param)`` pairs their
  params.
* ``clip_grad_norm_`` and ``get_total_norm``: torch's functions of the same name.

A row whose ``defect`` is set states the correct outcome and is expected to fail (strictly) until
nanscan is fixed; the reason says what nanscan does instead.
"""

from __future__ import annotations

import copy
import math
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import pytest
import torch

import nanscan

Entry = Literal["scan", "check", "clip_grad_norm_", "get_total_norm"]


# ---- Outcomes -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Outcome:
    """What one side does with a row's input."""

    raises: type[BaseException] | None = None  # the exact exception type; None: returns normally
    match: str = ""  # regex searched for in the exception's message
    writes: bool = False  # some tensor passed in differs afterwards (clipped, or scaled before the error)
    warns: str | None = None  # regex of a warning it must emit; None: it emits no warning at all


def ok(*, writes: bool = False, warns: str | None = None) -> Outcome:
    return Outcome(writes=writes, warns=warns)


def err(kind: type[BaseException], match: str, *, writes: bool = False) -> Outcome:
    return Outcome(raises=kind, match=match, writes=writes)


NO_COUNTERPART = None  # torch has no such argument (names, on_nonfinite, ...)


# ---- Inputs ---------------------------------------------------------------------------------------


@dataclass
class Case:
    """The arguments of one call: ``inputs`` first, the rest by keyword in nanscan's spelling."""

    inputs: Any
    kwargs: dict[str, Any] = field(default_factory=dict)
    generator: bool = False  # hand ``inputs`` (a list) over as a generator


def values(*shape: int, scale: float = 10.0, seed: int = 0) -> torch.Tensor:
    """Fixed random fp32 values; scale 10 makes the total norm exceed max_norm=1, so clipping writes."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


def holder(grad: torch.Tensor) -> torch.Tensor:
    """A leaf tensor whose ``.grad`` is ``grad``. Plain tensors (not Parameters) accept gradients that a
    Parameter would refuse (integer, sparse on a dense holder), which is what bad input is made of."""
    t = torch.zeros(grad.shape, dtype=grad.dtype, device=grad.device)
    t.grad = grad
    return t


def holders(*grads: torch.Tensor | None) -> list[torch.Tensor]:
    """Leaves with these gradients; None gives a leaf without a gradient (skipped by clip and check)."""
    return [torch.zeros(2) if g is None else holder(g) for g in grads]


def nan_at_0(t: torch.Tensor, value: float = math.nan) -> torch.Tensor:
    t.view(-1)[0] = value
    return t


def expanded() -> torch.Tensor:
    """A stride-0 view: its 4 rows share memory, so it can be read but not scaled in place."""
    return values(1, 3, seed=1).expand(4, 3)


def inference_tensor() -> torch.Tensor:
    """Made under inference_mode: torch refuses to update it in place outside that mode."""
    with torch.inference_mode():
        return values(4, seed=1)


def negative_view() -> torch.Tensor:
    """``conj().imag``: a real tensor whose negative bit is set (its memory holds the negated values)."""
    return torch.complex(values(4, seed=1), values(4, seed=2)).conj().imag


def float8(*shape: int, dtype: torch.dtype = torch.float8_e4m3fn) -> torch.Tensor:
    return values(*shape).clamp(-400, 400).to(dtype)


def sparse_embedding_model() -> torch.nn.Module:
    """nn.Embedding(sparse=True) after a backward: the realistic source of sparse COO gradients."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(10, 3, sparse=True), torch.nn.Linear(3, 1))
    model(torch.tensor([1, 2, 2])).sum().backward()
    return model


def model_with_grads() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    for p in model.parameters():
        p.grad = torch.randn_like(p) * 10
    return model


class Deep(torch.nn.Module):
    """A parameter without a gradient, then one with 65 dimensions (torch's and nanscan's limit is 64)."""

    def __init__(self) -> None:
        super().__init__()
        self.frozen = torch.nn.Parameter(torch.ones(2))
        self.bias = torch.nn.Parameter(torch.ones(2))
        self.deep = torch.nn.Parameter(torch.ones([1] * 65))
        self.bias.grad = values(2)
        self.deep.grad = torch.ones([1] * 65)


# ---- Faithful copies ------------------------------------------------------------------------------
# copy.deepcopy alone is not faithful here: it drops a Parameter's .grad, makes inference tensors
# ordinary ones, resolves the negative bit, and fails on CSR, MKL-DNN and strided nested tensors.


def strided_copy(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole storage viewed with ``t``'s strides exactly, overlapping (stride-0) ones too."""
    return torch.empty(0, dtype=t.dtype).set_(t.untyped_storage().clone(), t.storage_offset(), t.size(), t.stride())


def copy_tensor(t: torch.Tensor) -> torch.Tensor:
    """An independent copy with the same values, layout, strides (stride 0 too) and flags, and a
    copy of its gradient."""
    if isinstance(t, torch.nn.Parameter):
        out: torch.Tensor = torch.nn.Parameter(copy_tensor(t.data), requires_grad=t.requires_grad)
    elif t.is_meta:
        out = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")
    elif t.is_inference():
        with torch.inference_mode():
            out = t.clone()
    elif t.is_neg():  # the same memory, strides and bit (_neg_view of a negative view clears the bit)
        out = torch._neg_view(strided_copy(torch._neg_view(t)))
    elif t.layout == torch._mkldnn:  # type: ignore[attr-defined]
        out = t.to_dense().to_mkldnn()
    elif t.layout != torch.strided or t.is_nested or t.is_quantized:
        out = t.clone()
    else:
        out = strided_copy(t).requires_grad_(t.requires_grad)
    if t.grad is not None:
        out.grad = copy_tensor(t.grad)
    return out


def holders_of(obj: Any) -> Iterator[torch.Tensor]:
    """The tensors an input holds directly (list entries, pairs' params, a module's parameters)."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, torch.nn.Module):
        yield from obj.parameters()
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from holders_of(item)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from holders_of(item)


def twin(case: Case) -> Case:
    """A deep copy of ``case`` whose tensors are faithful copies (their gradients come along, and
    modules and optimizers that hold them are copied around the copies)."""
    memo: dict[int, Any] = {id(t): copy_tensor(t) for t in holders_of(case.inputs)}
    return copy.deepcopy(case, memo)


def tensors_of(obj: Any) -> Iterator[torch.Tensor]:
    """Every tensor an input holds, each followed by its gradient: what a call could write."""
    for t in holders_of(obj):
        yield t
        if t.grad is not None:
            yield t.grad


Fingerprint = tuple[Any, ...]


def fingerprint(t: torch.Tensor) -> Fingerprint:
    """Everything a write could change: metadata, flags and the values' bytes (NaN compares equal)."""
    head = (type(t).__name__, t.layout, t.dtype, t.device, t.is_inference(), t.is_neg())
    if t.is_nested:
        return head + tuple(fingerprint(x) for x in t.unbind())
    if t.is_meta:
        return (*head, tuple(t.shape), t.stride())
    if t.layout == torch.strided:
        head += (tuple(t.shape), t.stride(), t.storage_offset())
        dense = t.int_repr() if t.is_quantized else t
    else:
        head += (tuple(t.shape),)
        dense = t.to_dense()
    raw = dense.detach().resolve_neg().clone().reshape(-1).view(torch.uint8)
    return (*head, raw.numpy().tobytes())


def snapshot(case: Case) -> list[tuple[torch.Tensor, Fingerprint]]:
    return [(t, fingerprint(t)) for t in tensors_of(case.inputs)]


def changed(case: Case, before: list[tuple[torch.Tensor, Fingerprint]]) -> bool:
    """Whether any tensor of ``case`` (or its gradient) was replaced or changed since ``before``."""
    after = list(tensors_of(case.inputs))
    if len(after) != len(before):
        return True
    return any(t is not old or fingerprint(t) != fp for t, (old, fp) in zip(after, before, strict=True))


# ---- The calls ------------------------------------------------------------------------------------


def arguments(case: Case) -> Any:
    return (x for x in case.inputs) if case.generator else case.inputs


def call_nanscan(entry: Entry, case: Case) -> Any:
    fn = {
        "scan": nanscan.scan,
        "check": nanscan.check,
        "clip_grad_norm_": nanscan.clip_grad_norm_,
        "get_total_norm": nanscan.get_total_norm,
    }[entry]
    return fn(arguments(case), **case.kwargs)


def torch_parameters(inputs: Any) -> Any:
    """What a torch user passes for check's argument: model.parameters(), or the pairs' params."""
    if isinstance(inputs, torch.nn.Module):
        return inputs.parameters()
    if isinstance(inputs, list) and inputs and all(isinstance(x, tuple) and len(x) == 2 for x in inputs):
        return [p for _, p in inputs]
    return inputs


def call_torch(entry: Entry, case: Case) -> Any:
    args, kw = arguments(case), case.kwargs
    if entry == "scan":
        return torch._foreach_norm(args)
    if entry == "get_total_norm":
        return torch.nn.utils.get_total_norm(args, **kw)
    if entry == "clip_grad_norm_":
        return torch.nn.utils.clip_grad_norm_(args, **kw)
    params = torch_parameters(args)
    norm_type = kw.get("norm_type", 2.0)
    strict = kw.get("on_nonfinite") == "raise"
    if kw.get("max_norm") is not None:
        return torch.nn.utils.clip_grad_norm_(params, kw["max_norm"], norm_type, error_if_nonfinite=strict)
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite=strict)


# ---- The table ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Row:
    id: str
    kind: str  # the bad-input table's row (the "input" cell) this row belongs to
    entry: Entry
    build: Callable[[], Case]
    nanscan: Outcome
    torch: Outcome | None  # None: torch has no counterpart for this argument
    defect: str | None = None  # nanscan misbehaves; ``nanscan`` states the correct outcome (xfail, strict)


# Messages, as regexes. nanscan's name the entry; torch's are quoted where the table cites them.
NOT_A_TENSOR = r"entry 1 is a {}, not a torch\.Tensor"
TORCH_FOREACH_NOT_TENSOR = r"expected Tensor as element 1 in argument 0, but got {}"
NOT_FLOAT_TORCH = r"linalg\.vector_norm: Expected a floating point or complex tensor as input\. Got {}"


def _torch_not_float_error() -> type[BaseException]:
    """The exception type torch's norm raises for an integer tensor: RuntimeError up to 2.14,
    NotImplementedError (a RuntimeError) from 2.15, the message the same. The rows pin the torch
    running, and the drop-ins pass torch's error through."""
    try:
        torch.linalg.vector_norm(torch.ones(2, dtype=torch.int64))
    except RuntimeError as error:
        return type(error)
    raise AssertionError("torch's norm took an integer tensor")


NOT_FLOAT_ERROR = _torch_not_float_error()
EMPTY_INF_NORM = r"cannot compute the inf(inity)? norm on an empty tensor"
OVERLAP = r"more than one element of the written-to tensor refers to a single memory location"
NONFINITE = r"The total norm of order {} for gradients from `parameters` is non-finite"
INFERENCE = r"Inplace update to inference tensor outside InferenceMode is not allowed"
SPARSE_TORCH = r"Could not run 'aten::linalg_vector_norm' with arguments from the 'SparseCPU' backend"


def _torch_takes_sparse_norms() -> bool:
    """Whether the torch running computes norms of sparse COO tensors (its clip_grad_norm_ and
    get_total_norm take nn.Embedding(sparse=True)'s gradients: 2.14 does, 2.13 does not). The rows
    that meet sparse gradients pin this torch's behaviour, and nanscan's drop-ins follow it."""
    try:
        torch.nn.utils.get_total_norm([torch.ones(2).to_sparse()])
    except NotImplementedError:
        return False
    return True


SPARSE_NORMS = _torch_takes_sparse_norms()
META_COPY = r"Cannot copy out of meta tensor; no data!"
FLOAT8_TORCH = r"\"norm_cpu\" not implemented for 'Float8_e4m3fn'"
NEG_LIST = r"fallback doesn't currently support mutable TensorLists with negation inputs"
NOT_ITERABLE = r"'{}' object is not iterable"
NORM_TYPE = r"nanscan: norm_type must be a real number or 'inf', got {}"
MAX_NORM = r"nanscan: max_norm must be a non-negative number, got {}"
DIMS_65 = r"has 65 dimensions; at most 64 are supported"
DIMS_TORCH = r"only tensors with up to 64 dims are supported"
NO_GRAD_ATTR = r"'{}' object has no attribute 'grad'"

# Kinds (the bad-input table's rows), in its order.
K_NON_TENSOR = "non-tensor entry (float, str, None) in a tensor list"
K_NON_PARAM = "non-tensor among parameters (str, None, a module, a dict, a bad pair)"
K_NOT_ITERABLE = "not an iterable (a number, None, a module that is not a container)"
K_NONE_GRAD = "parameter without a gradient"
K_COMPLEX = "complex tensor"
K_INTEGER = "integer, bool or quantized tensor"
K_FLOAT8 = "float8 gradients"
K_OTHER_FLOAT8 = "float8_e4m3fnuz / e5m2fnuz / e8m0fnu"
K_SPARSE = "sparse COO / CSR, MKL-DNN tensor"
K_NESTED = "nested tensor (jagged or strided)"
K_META = "meta tensor, or a list spanning cpu + meta"
K_FOREACH = "foreach=True on a device without foreach support (meta)"
K_EXPANDED = "expanded (stride-0) gradient"
K_INFERENCE = "gradient made under inference_mode"
K_NEG_VIEW = "negative-bit view (conj().imag)"
K_MAX_NORM_BAD = "max_norm negative or NaN"
K_MAX_NORM_ODD = "max_norm inf, 0, numeric string, one-element tensor"
K_MAX_NORM_TYPE = "max_norm not a number ('abc', None, 2-element tensor)"
K_NORM_TYPE_BAD = "norm_type invalid ('fro', None, [2.0], 2-element tensor)"
K_NORM_TYPE_ODD = "norm_type unusual (numpy scalar, True, 'inf', '-inf', 0, -inf, NaN, tensor)"
K_EMPTY_INF = "inf / -inf norm of an empty tensor"
K_NONFINITE = "error_if_nonfinite / on_nonfinite='raise' with NaN/Inf"
K_HUGE = "error_if_nonfinite with huge finite fp32 (1e20)"
K_EMPTY = "empty list / empty generator"
K_NAMES = "names of the wrong length (scan)"
K_ON_NONFINITE = "on_nonfinite unknown / 'skip' without optimizer / max_consecutive_skips < 0 (check)"
K_DIMS = "more than 64 dimensions (26 work)"
KINDS = (
    K_NON_TENSOR,
    K_NON_PARAM,
    K_NOT_ITERABLE,
    K_NONE_GRAD,
    K_COMPLEX,
    K_INTEGER,
    K_FLOAT8,
    K_OTHER_FLOAT8,
    K_SPARSE,
    K_NESTED,
    K_META,
    K_FOREACH,
    K_EXPANDED,
    K_INFERENCE,
    K_NEG_VIEW,
    K_MAX_NORM_BAD,
    K_MAX_NORM_ODD,
    K_MAX_NORM_TYPE,
    K_NORM_TYPE_BAD,
    K_NORM_TYPE_ODD,
    K_EMPTY_INF,
    K_NONFINITE,
    K_HUGE,
    K_EMPTY,
    K_NAMES,
    K_ON_NONFINITE,
    K_DIMS,
)


def _rows() -> list[Row]:
    g = values  # short alias for the builders below
    rows = [
        # -- non-tensor entries --------------------------------------------------------------------
        Row(
            "scan-float-entry",
            K_NON_TENSOR,
            "scan",
            lambda: Case([g(3), 1.5]),
            err(TypeError, NOT_A_TENSOR.format("float")),
            err(TypeError, TORCH_FOREACH_NOT_TENSOR.format("float")),
        ),
        Row(
            "scan-str-entry",
            K_NON_TENSOR,
            "scan",
            lambda: Case([g(3), "x"]),
            err(TypeError, NOT_A_TENSOR.format("str")),
            err(TypeError, TORCH_FOREACH_NOT_TENSOR.format("str")),
        ),
        Row(
            "scan-none-entry",
            K_NON_TENSOR,
            "scan",
            lambda: Case([g(3), None]),
            err(TypeError, NOT_A_TENSOR.format("NoneType")),
            err(TypeError, TORCH_FOREACH_NOT_TENSOR.format("NoneType")),
        ),
        Row(
            "scan-named-float-entry",
            K_NON_TENSOR,
            "scan",
            lambda: Case([g(3), 1.5], {"names": ["w", "b"]}),
            err(TypeError, r"'b' \(entry 1\) is a float"),
            NO_COUNTERPART,
        ),
        Row(
            "get_total_norm-float-entry",
            K_NON_TENSOR,
            "get_total_norm",
            lambda: Case([g(3), 1.5]),
            err(TypeError, NOT_A_TENSOR.format("float")),
            err(TypeError, r"_group_tensors_by_device_and_dtype\(\): incompatible function arguments"),
        ),
        # torch's grouping reports an undefined tensor: a RuntimeError, where nanscan says TypeError.
        Row(
            "get_total_norm-none-entry",
            K_NON_TENSOR,
            "get_total_norm",
            lambda: Case([g(3), None]),
            err(TypeError, NOT_A_TENSOR.format("NoneType")),
            err(RuntimeError, r"supposed to be defined but the 1-th Tensor is not"),
        ),
        # -- non-tensors where parameters are expected ---------------------------------------------
        Row(
            "clip-str-parameter",
            K_NON_PARAM,
            "clip_grad_norm_",
            lambda: Case([holder(g(3)), "x"], {"max_norm": 1.0}),
            err(TypeError, r"entry 1 of parameters is a str, not a torch\.Tensor"),
            err(AttributeError, NO_GRAD_ATTR.format("str")),
        ),
        Row(
            "clip-none-parameter",
            K_NON_PARAM,
            "clip_grad_norm_",
            lambda: Case([holder(g(3)), None], {"max_norm": 1.0}),
            err(TypeError, r"entry 1 of parameters is a NoneType"),
            err(AttributeError, NO_GRAD_ATTR.format("NoneType")),
        ),
        # Iterating a Sequential yields its layers: torch's classic slip of passing the model itself.
        # nanscan takes a model there on purpose (its gradients, wherever they live: an FSDP1 model is
        # clipped that way): it clips the model's gradients (norm 44.97 > 1).
        Row(
            "clip-sequential-instead-of-parameters",
            K_NON_PARAM,
            "clip_grad_norm_",
            lambda: Case(model_with_grads(), {"max_norm": 1.0}),
            ok(writes=True),
            err(AttributeError, NO_GRAD_ATTR.format("Linear")),
        ),
        # Iterating a dict yields its keys, the parameter names.
        Row(
            "clip-dict-of-parameters",
            K_NON_PARAM,
            "clip_grad_norm_",
            lambda: Case(dict(model_with_grads().named_parameters()), {"max_norm": 1.0}),
            err(TypeError, r"entry 0 of parameters is a str"),
            err(AttributeError, NO_GRAD_ATTR.format("str")),
        ),
        Row(
            "check-str-parameter",
            K_NON_PARAM,
            "check",
            lambda: Case([holder(g(3)), "x"], {"max_norm": 1.0}),
            err(TypeError, r"parameter '\[1\]' is a str, not a torch\.Tensor"),
            err(AttributeError, NO_GRAD_ATTR.format("str")),
        ),
        Row(
            "check-pair-with-non-tensor",
            K_NON_PARAM,
            "check",
            lambda: Case([("w", holder(g(3))), ("b", 3.0)], {"max_norm": 1.0}),
            err(TypeError, r"parameter 'b' is a float, not a torch\.Tensor"),
            err(AttributeError, NO_GRAD_ATTR.format("float")),
        ),
        Row(
            "check-dict-of-parameters",
            K_NON_PARAM,
            "check",
            lambda: Case(dict(model_with_grads().named_parameters()), {"max_norm": 1.0}),
            err(TypeError, r"parameter '\[0\]' is a str"),
            err(AttributeError, NO_GRAD_ATTR.format("str")),
        ),
        # -- not iterable at all: Python's own message on both sides --------------------------------
        Row(
            "scan-number",
            K_NOT_ITERABLE,
            "scan",
            lambda: Case(1.5),
            err(TypeError, NOT_ITERABLE.format("float")),
            err(TypeError, r"must be tuple of Tensors, not float"),
        ),
        Row(
            "get_total_norm-number",
            K_NOT_ITERABLE,
            "get_total_norm",
            lambda: Case(1.5),
            err(TypeError, NOT_ITERABLE.format("float")),
            err(TypeError, NOT_ITERABLE.format("float")),
        ),
        Row(
            "clip-none",
            K_NOT_ITERABLE,
            "clip_grad_norm_",
            lambda: Case(None, {"max_norm": 1.0}),
            err(TypeError, NOT_ITERABLE.format("NoneType")),
            err(TypeError, NOT_ITERABLE.format("NoneType")),
        ),
        Row(
            "clip-linear-module",
            K_NOT_ITERABLE,
            "clip_grad_norm_",
            lambda: Case(model_with_grads()[0], {"max_norm": 1.0}),
            ok(writes=True),  # a model, which nanscan's clip takes (clip-sequential-instead-of-parameters)
            err(TypeError, NOT_ITERABLE.format("Linear")),
        ),
        Row(
            "check-number",
            K_NOT_ITERABLE,
            "check",
            lambda: Case(1.5),
            err(TypeError, NOT_ITERABLE.format("float")),
            err(TypeError, NOT_ITERABLE.format("float")),
        ),
        # -- None gradients are not bad: skipped ----------------------------------------------------
        Row(
            "clip-none-grad-skipped",
            K_NONE_GRAD,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), None, g(4)), {"max_norm": 1.0}),
            ok(writes=True),
            ok(writes=True),
        ),
        Row(
            "check-none-grad-skipped",
            K_NONE_GRAD,
            "check",
            lambda: Case(holders(g(3), None, g(4)), {"max_norm": 1.0}),
            ok(writes=True),
            ok(writes=True),
        ),
        # -- complex: scan/check refuse it; the drop-ins hand it to torch's code --------------------
        Row(
            "scan-complex",
            K_COMPLEX,
            "scan",
            lambda: Case([g(3), torch.complex(g(3), g(3, seed=1))]),
            err(TypeError, r"entry 1 has complex dtype torch\.complex64"),
            ok(),
        ),
        Row(
            "get_total_norm-complex",
            K_COMPLEX,
            "get_total_norm",
            lambda: Case([g(3), torch.complex(g(3), g(3, seed=1))]),
            ok(),
            ok(),
        ),
        Row(
            "clip-complex",
            K_COMPLEX,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), torch.complex(g(3), g(3, seed=1))), {"max_norm": 1.0}),
            ok(writes=True),
            ok(writes=True),
        ),
        Row(
            "clip-complex-inf-norm",
            K_COMPLEX,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), torch.complex(g(3), g(3, seed=1))), {"max_norm": 1.0, "norm_type": math.inf}),
            ok(writes=True),
            ok(writes=True),
        ),
        Row(
            "check-complex",
            K_COMPLEX,
            "check",
            lambda: Case(holders(g(3), torch.complex(g(3), g(3, seed=1))), {"max_norm": 1.0}),
            err(TypeError, r"'\[1\]' \(entry 1\) has complex dtype torch\.complex64"),
            ok(writes=True),
        ),
        # -- integer / bool / quantized -------------------------------------------------------------
        Row(
            "scan-int64",
            K_INTEGER,
            "scan",
            lambda: Case([g(3), torch.arange(3)]),
            err(TypeError, r"entry 1 has integer/bool dtype torch\.int64"),
            err(NOT_FLOAT_ERROR, NOT_FLOAT_TORCH.format("Long")),
        ),
        Row(
            "scan-bool",
            K_INTEGER,
            "scan",
            lambda: Case([g(3), torch.tensor([True, False])]),
            err(TypeError, r"entry 1 has integer/bool dtype torch\.bool"),
            err(NOT_FLOAT_ERROR, NOT_FLOAT_TORCH.format("Bool")),
        ),
        Row(
            "scan-qint8",
            K_INTEGER,
            "scan",
            lambda: Case([g(3), torch.quantize_per_tensor(g(4), 0.1, 0, torch.qint8)]),
            err(TypeError, r"entry 1 has integer/bool dtype torch\.qint8"),
            err(NOT_FLOAT_ERROR, NOT_FLOAT_TORCH.format("QInt8")),
        ),
        # The drop-ins hand dtypes the scan does not read to torch's code: torch's error, verbatim.
        Row(
            "get_total_norm-int64",
            K_INTEGER,
            "get_total_norm",
            lambda: Case([g(3), torch.arange(3)]),
            err(NOT_FLOAT_ERROR, NOT_FLOAT_TORCH.format("Long")),
            err(NOT_FLOAT_ERROR, NOT_FLOAT_TORCH.format("Long")),
        ),
        Row(
            "clip-int64-grad",
            K_INTEGER,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), torch.arange(3)), {"max_norm": 1.0}),
            err(NOT_FLOAT_ERROR, NOT_FLOAT_TORCH.format("Long")),
            err(NOT_FLOAT_ERROR, NOT_FLOAT_TORCH.format("Long")),
        ),
        Row(
            "clip-bool-grad",
            K_INTEGER,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), torch.tensor([True, False])), {"max_norm": 1.0}),
            err(NOT_FLOAT_ERROR, NOT_FLOAT_TORCH.format("Bool")),
            err(NOT_FLOAT_ERROR, NOT_FLOAT_TORCH.format("Bool")),
        ),
        Row(
            "check-int64-grad",
            K_INTEGER,
            "check",
            lambda: Case(holders(g(3), torch.arange(3)), {"max_norm": 1.0}),
            err(TypeError, r"'\[1\]' \(entry 1\) has integer/bool dtype torch\.int64"),
            err(NOT_FLOAT_ERROR, NOT_FLOAT_TORCH.format("Long")),
        ),
        # -- float8: the scan reads it; torch computes no norm of it and cannot multiply it ---------
        Row(
            "scan-float8-mixed",
            K_FLOAT8,
            "scan",
            lambda: Case([g(3), float8(4), float8(2, dtype=torch.float8_e5m2)]),
            ok(),
            err(NotImplementedError, FLOAT8_TORCH),
        ),
        # The drop-ins keep torch's errors: torch has no float8 norm, so they hand float8 to torch.
        Row(
            "get_total_norm-float8",
            K_FLOAT8,
            "get_total_norm",
            lambda: Case([float8(4)]),
            err(NotImplementedError, FLOAT8_TORCH),
            err(NotImplementedError, FLOAT8_TORCH),
        ),
        Row(
            "get_total_norm-float8-mixed",
            K_FLOAT8,
            "get_total_norm",
            lambda: Case([g(3), float8(4)]),
            err(NotImplementedError, FLOAT8_TORCH),
            err(NotImplementedError, FLOAT8_TORCH),
        ),
        Row(
            "clip-float8",
            K_FLOAT8,
            "clip_grad_norm_",
            lambda: Case(holders(float8(4)), {"max_norm": 1.0}),
            err(NotImplementedError, FLOAT8_TORCH),
            err(NotImplementedError, FLOAT8_TORCH),
        ),
        Row(
            "clip-float8-mixed",
            K_FLOAT8,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), float8(4)), {"max_norm": 1.0}),
            err(NotImplementedError, FLOAT8_TORCH),
            err(NotImplementedError, FLOAT8_TORCH),
        ),
        # check reads float8 (its total is float32); clipping it is refused before any write.
        Row(
            "check-float8-mixed-no-clip",
            K_FLOAT8,
            "check",
            lambda: Case(holders(g(3), float8(4))),
            ok(),
            err(NotImplementedError, FLOAT8_TORCH),
        ),
        Row(
            "check-float8-mixed-clip",
            K_FLOAT8,
            "check",
            lambda: Case(holders(g(3), float8(4)), {"max_norm": 1.0}),
            err(RuntimeError, r"tensors\[1\] is float8; torch cannot multiply float8 tensors either"),
            err(NotImplementedError, FLOAT8_TORCH),
        ),
        # Float8 formats the scan does not read: the drop-ins hand them to torch's code, which has none.
        Row(
            "scan-float8-e4m3fnuz",
            K_OTHER_FLOAT8,
            "scan",
            lambda: Case([g(3), float8(4, dtype=torch.float8_e4m3fnuz)]),
            err(TypeError, r"entry 1 has unsupported dtype torch\.float8_e4m3fnuz"),
            err(NotImplementedError, r"\"norm_cpu\" not implemented for 'Float8_e4m3fnuz'"),
        ),
        Row(
            "clip-float8-e5m2fnuz",
            K_OTHER_FLOAT8,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), float8(4, dtype=torch.float8_e5m2fnuz)), {"max_norm": 1.0}),
            err(NotImplementedError, r"\"norm_cpu\" not implemented for 'Float8_e5m2fnuz'"),
            err(NotImplementedError, r"\"norm_cpu\" not implemented for 'Float8_e5m2fnuz'"),
        ),
        Row(
            "check-float8-e8m0fnu",
            K_OTHER_FLOAT8,
            "check",
            lambda: Case(holders(g(3), g(4).abs().to(torch.float8_e8m0fnu)), {"max_norm": 1.0}),
            err(TypeError, r"'\[1\]' \(entry 1\) has unsupported dtype torch\.float8_e8m0fnu"),
            err(NotImplementedError, r"\"norm_cpu\" not implemented for 'Float8_e8m0fnu'"),
        ),
        # -- layouts the scan does not read ---------------------------------------------------------
        Row(
            # scan and check read a sparse COO tensor exactly, as its dense values (tests/test_scan.py);
            # the drop-ins leave it to torch's own code where this torch takes it, else name it.
            "scan-sparse-coo",
            K_SPARSE,
            "scan",
            lambda: Case([g(3), g(3, 3).to_sparse()]),
            ok(),
            ok() if SPARSE_NORMS else err(NotImplementedError, SPARSE_TORCH),
        ),
        Row(
            "get_total_norm-sparse-coo",
            K_SPARSE,
            "get_total_norm",
            lambda: Case([g(3), g(3, 3).to_sparse()]),
            ok() if SPARSE_NORMS else err(TypeError, r"entry 1 is a torch\.sparse_coo tensor"),
            ok() if SPARSE_NORMS else err(NotImplementedError, SPARSE_TORCH),
        ),
        Row(
            "clip-sparse-embedding",
            K_SPARSE,
            "clip_grad_norm_",
            lambda: Case(list(sparse_embedding_model().parameters()), {"max_norm": 1.0}),
            ok(writes=True) if SPARSE_NORMS else err(TypeError, r"entry 0 is a torch\.sparse_coo tensor"),
            ok(writes=True) if SPARSE_NORMS else err(NotImplementedError, SPARSE_TORCH),
        ),
        Row(
            "check-sparse-embedding",
            K_SPARSE,
            "check",
            lambda: Case(sparse_embedding_model(), {"max_norm": 1.0}),
            ok(writes=True),  # the norm, 4.99, is clipped to 1 (torch's own multiply of the sparse one)
            ok(writes=True) if SPARSE_NORMS else err(NotImplementedError, SPARSE_TORCH),
        ),
        # CSR cannot be a .grad (torch refuses the assignment): tensor lists only.
        Row(
            "scan-sparse-csr",
            K_SPARSE,
            "scan",
            lambda: Case([g(3), g(3, 3).to_sparse_csr()]),
            err(TypeError, r"entry 1 is a torch\.sparse_csr tensor"),
            err(RuntimeError, r"Only batched sparse compressed \(non-block\) tensors are supported"),
        ),
        Row(
            "get_total_norm-sparse-csr",
            K_SPARSE,
            "get_total_norm",
            lambda: Case([g(3), g(3, 3).to_sparse_csr()]),
            err(TypeError, r"entry 1 is a torch\.sparse_csr tensor"),
            err(RuntimeError, r"Only batched sparse compressed \(non-block\) tensors are supported"),
        ),
        Row(
            "scan-mkldnn",
            K_SPARSE,
            "scan",
            lambda: Case([g(3), g(4).to_mkldnn()]),
            err(TypeError, r"entry 1 is a torch\._mkldnn tensor"),
            err(NotImplementedError, r"with arguments from the 'MkldnnCPU' backend"),
        ),
        # -- nested tensors: either layout (a strided one reports layout torch.strided) ---------------
        Row(
            "scan-jagged-nested",
            K_NESTED,
            "scan",
            lambda: Case([g(3), torch.nested.nested_tensor([g(2), g(3)], layout=torch.jagged)]),
            err(TypeError, r"entry 1 is a nested tensor; only dense tensors can be scanned"),
            err(NotImplementedError, r"aten\._foreach_norm"),
        ),
        Row(
            "scan-strided-nested",
            K_NESTED,
            "scan",
            lambda: Case([g(3), torch.nested.nested_tensor([g(2), g(3)])]),
            err(TypeError, r"entry 1 is a nested tensor; only dense tensors can be scanned"),
            err(
                NotImplementedError,
                r"Could not run 'aten::_foreach_norm\.Scalar' with arguments from the 'NestedTensorCPU'",
            ),
        ),
        # -- meta tensors: no values; torch computes a meta norm or fails copying it -----------------
        Row(
            "scan-cpu-and-meta",
            K_META,
            "scan",
            lambda: Case([g(3), torch.empty(3, device="meta")]),
            err(ValueError, r"entry 1 is a meta tensor; it has no values to scan"),
            ok(),
        ),
        Row(
            "get_total_norm-cpu-and-meta",
            K_META,
            "get_total_norm",
            lambda: Case([g(3), torch.empty(3, device="meta")]),
            err(ValueError, r"entry 1 is a meta tensor"),
            err(NotImplementedError, META_COPY),
        ),
        # Meta first: torch gathers on the meta device and returns a meta norm.
        Row(
            "get_total_norm-meta-first",
            K_META,
            "get_total_norm",
            lambda: Case([torch.empty(3, device="meta"), g(3)]),
            err(ValueError, r"entry 0 is a meta tensor"),
            ok(),
        ),
        Row(
            "clip-cpu-and-meta",
            K_META,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), torch.empty(3, device="meta")), {"max_norm": 1.0}),
            err(ValueError, r"entry 1 is a meta tensor"),
            err(NotImplementedError, META_COPY),
        ),
        Row(
            "check-cpu-and-meta",
            K_META,
            "check",
            lambda: Case(holders(g(3), torch.empty(3, device="meta")), {"max_norm": 1.0}),
            err(ValueError, r"'\[1\]' \(entry 1\) is a meta tensor"),
            err(NotImplementedError, META_COPY),
        ),
        # -- foreach=True: CPU supports it; meta does not, so that is the reachable case ------------
        Row(
            "get_total_norm-foreach-meta",
            K_FOREACH,
            "get_total_norm",
            lambda: Case([g(3), torch.empty(3, device="meta")], {"foreach": True}),
            err(RuntimeError, r"foreach=True was passed, but can't use the foreach API on meta tensors"),
            err(RuntimeError, r"foreach=True was passed, but can't use the foreach API on meta tensors"),
        ),
        Row(
            "clip-foreach-meta",
            K_FOREACH,
            "clip_grad_norm_",
            lambda: Case(holders(torch.empty(3, device="meta")), {"max_norm": 1.0, "foreach": True}),
            err(RuntimeError, r"can't use the foreach API on meta tensors"),
            err(RuntimeError, r"can't use the foreach API on meta tensors"),
        ),
        Row(
            "clip-foreach-cpu",
            K_FOREACH,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": 1.0, "foreach": True}),
            ok(writes=True),
            ok(writes=True),
        ),
        # -- expanded (stride-0) gradients: readable, not writable ----------------------------------
        Row("scan-expanded", K_EXPANDED, "scan", lambda: Case([g(3), expanded()]), ok(), ok()),
        Row("get_total_norm-expanded", K_EXPANDED, "get_total_norm", lambda: Case([g(3), expanded()]), ok(), ok()),
        # torch scales the first gradient, then fails on the second; nanscan checks both first.
        Row(
            "clip-expanded",
            K_EXPANDED,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), expanded()), {"max_norm": 1.0}),
            err(RuntimeError, OVERLAP),
            err(RuntimeError, OVERLAP, writes=True),
        ),
        # Nothing to clip: torch still multiplies by 1 (and fails); nanscan validates before skipping.
        Row(
            "clip-expanded-nothing-to-clip",
            K_EXPANDED,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), expanded()), {"max_norm": 1e6}),
            err(RuntimeError, OVERLAP),
            err(RuntimeError, OVERLAP),
        ),
        Row(
            "check-expanded",
            K_EXPANDED,
            "check",
            lambda: Case(holders(g(3), expanded()), {"max_norm": 1.0}),
            err(RuntimeError, OVERLAP),
            err(RuntimeError, OVERLAP, writes=True),
        ),
        Row("check-expanded-no-clip", K_EXPANDED, "check", lambda: Case(holders(g(3), expanded())), ok(), ok()),
        # -- inference tensors: torch refuses the in-place multiply ---------------------------------
        Row(
            "clip-inference-grad",
            K_INFERENCE,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), inference_tensor()), {"max_norm": 1.0}),
            err(RuntimeError, INFERENCE),
            err(RuntimeError, INFERENCE, writes=True),
        ),
        Row(
            "check-inference-grad",
            K_INFERENCE,
            "check",
            lambda: Case(holders(g(3), inference_tensor()), {"max_norm": 1.0}),
            err(RuntimeError, INFERENCE),
            err(RuntimeError, INFERENCE, writes=True),
        ),
        Row(
            "get_total_norm-inference",
            K_INFERENCE,
            "get_total_norm",
            lambda: Case([g(3), inference_tensor()]),
            ok(),
            ok(),
        ),
        # -- a negative-bit view reads as its values, not its memory --------------------------------
        Row("scan-negative-view", K_NEG_VIEW, "scan", lambda: Case([negative_view()]), ok(), ok()),
        Row(
            "get_total_norm-negative-view-inf",
            K_NEG_VIEW,
            "get_total_norm",
            lambda: Case([negative_view()], {"norm_type": math.inf}),
            ok(),
            ok(),
        ),
        # Writing one through a mutable tensor-list op (torch's _foreach_mul_, nanscan's scale_) meets
        # the dispatcher's negation fallback, which refuses it before anything is written.
        Row(
            "clip-negative-view",
            K_NEG_VIEW,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), negative_view()), {"max_norm": 1.0}),
            err(RuntimeError, NEG_LIST),
            err(RuntimeError, NEG_LIST),
        ),
        Row(
            "check-negative-view",
            K_NEG_VIEW,
            "check",
            lambda: Case(holders(g(3), negative_view()), {"max_norm": 1.0}),
            err(RuntimeError, NEG_LIST),
            err(RuntimeError, NEG_LIST),
        ),
        # torch's per-tensor loop (foreach=False) can write it; nanscan has no such path.
        Row(
            "clip-negative-view-foreach-false",
            K_NEG_VIEW,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), negative_view()), {"max_norm": 1.0, "foreach": False}),
            err(RuntimeError, NEG_LIST),
            ok(writes=True),
        ),
        # -- max_norm -------------------------------------------------------------------------------
        # torch multiplies by the negative coefficient: every gradient flips sign.
        Row(
            "clip-max-norm-negative",
            K_MAX_NORM_BAD,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": -1.0}),
            err(ValueError, MAX_NORM.format(r"-1\.0")),
            ok(writes=True),
        ),
        Row(
            "check-max-norm-negative",
            K_MAX_NORM_BAD,
            "check",
            lambda: Case(holders(g(3), g(4)), {"max_norm": -1.0}),
            err(ValueError, MAX_NORM.format(r"-1\.0")),
            ok(writes=True),
        ),
        # torch multiplies by NaN: every gradient becomes NaN.
        Row(
            "clip-max-norm-nan",
            K_MAX_NORM_BAD,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": math.nan}),
            err(ValueError, MAX_NORM.format("nan")),
            ok(writes=True),
        ),
        Row(
            "clip-max-norm-inf",
            K_MAX_NORM_ODD,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": math.inf}),
            ok(),
            ok(),
        ),
        Row(
            "check-max-norm-inf",
            K_MAX_NORM_ODD,
            "check",
            lambda: Case(holders(g(3), g(4)), {"max_norm": math.inf}),
            ok(),
            ok(),
        ),
        Row(
            "clip-max-norm-zero",
            K_MAX_NORM_ODD,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": 0}),
            ok(writes=True),
            ok(writes=True),
        ),
        Row(
            "clip-max-norm-numeric-string",
            K_MAX_NORM_ODD,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": "1.0"}),
            ok(writes=True),
            ok(writes=True),
        ),
        Row(
            "clip-max-norm-tensor",
            K_MAX_NORM_ODD,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": torch.tensor(0.5)}),
            ok(writes=True),
            ok(writes=True),
        ),
        # torch converts max_norm after computing the norm, but before writing: nothing changes.
        Row(
            "clip-max-norm-word",
            K_MAX_NORM_TYPE,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": "abc"}),
            err(ValueError, r"could not convert string to float: 'abc'"),
            err(ValueError, r"could not convert string to float: 'abc'"),
        ),
        Row(
            "check-max-norm-word",
            K_MAX_NORM_TYPE,
            "check",
            lambda: Case(holders(g(3), g(4)), {"max_norm": "abc"}),
            err(ValueError, r"could not convert string to float: 'abc'"),
            err(ValueError, r"could not convert string to float: 'abc'"),
        ),
        # (check's max_norm=None means "do not clip": valid, and every other row without max_norm.)
        Row(
            "clip-max-norm-none",
            K_MAX_NORM_TYPE,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": None}),
            err(TypeError, r"float\(\) argument must be a string or a real number, not 'NoneType'"),
            err(TypeError, r"float\(\) argument must be a string or a real number, not 'NoneType'"),
        ),
        Row(
            "clip-max-norm-two-elements",
            K_MAX_NORM_TYPE,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": torch.tensor([1.0, 2.0])}),
            err(ValueError, r"only one element tensors can be converted to Python scalars"),
            err(ValueError, r"only one element tensors can be converted to Python scalars"),
        ),
        # -- norm_type: what float() refuses, with float()'s exception type -------------------------
        Row(
            "clip-norm-type-fro",
            K_NORM_TYPE_BAD,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": 1.0, "norm_type": "fro"}),
            err(ValueError, NORM_TYPE.format("'fro'")),
            err(ValueError, r"could not convert string to float: 'fro'"),
        ),
        Row(
            "get_total_norm-norm-type-none",
            K_NORM_TYPE_BAD,
            "get_total_norm",
            lambda: Case([g(3)], {"norm_type": None}),
            err(TypeError, NORM_TYPE.format("None")),
            err(TypeError, r"float\(\) argument must be a string or a real number, not 'NoneType'"),
        ),
        Row(
            "check-norm-type-list",
            K_NORM_TYPE_BAD,
            "check",
            lambda: Case(holders(g(3)), {"norm_type": [2.0]}),
            err(TypeError, NORM_TYPE.format(r"\[2\.0\]")),
            err(TypeError, r"float\(\) argument must be a string or a real number, not 'list'"),
        ),
        Row(
            "clip-norm-type-two-elements",
            K_NORM_TYPE_BAD,
            "clip_grad_norm_",
            lambda: Case(holders(g(3)), {"max_norm": 1.0, "norm_type": torch.tensor([1.0, 2.0])}),
            err(ValueError, NORM_TYPE.format("tensor")),
            err(ValueError, r"only one element tensors can be converted to Python scalars"),
        ),
        Row(
            "clip-norm-type-numpy",
            K_NORM_TYPE_ODD,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": 1.0, "norm_type": np.float64(2.0)}),
            ok(writes=True),
            ok(writes=True),
        ),
        Row(
            "get_total_norm-norm-type-numpy-int",
            K_NORM_TYPE_ODD,
            "get_total_norm",
            lambda: Case([g(3), g(4)], {"norm_type": np.int64(1)}),
            ok(),
            ok(),
        ),
        Row(
            "get_total_norm-norm-type-true",
            K_NORM_TYPE_ODD,
            "get_total_norm",
            lambda: Case([g(3), g(4)], {"norm_type": True}),
            ok(),
            ok(),
        ),
        Row(
            "clip-norm-type-inf-string",
            K_NORM_TYPE_ODD,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(4)), {"max_norm": 1.0, "norm_type": "inf"}),
            ok(writes=True),
            ok(writes=True),
        ),
        Row(
            "get_total_norm-norm-type-minus-inf-string",
            K_NORM_TYPE_ODD,
            "get_total_norm",
            lambda: Case([g(3), g(4)], {"norm_type": "-inf"}),
            ok(),
            ok(),
        ),
        Row(
            "get_total_norm-norm-type-zero",
            K_NORM_TYPE_ODD,
            "get_total_norm",
            lambda: Case([g(3), torch.zeros(4)], {"norm_type": 0}),
            ok(),
            ok(),
        ),
        Row(
            "check-norm-type-minus-inf",
            K_NORM_TYPE_ODD,
            "check",
            lambda: Case(holders(g(3), g(4)), {"max_norm": 1.0, "norm_type": -math.inf}),
            ok(writes=True),
            ok(writes=True),
        ),
        Row(
            "get_total_norm-norm-type-nan",
            K_NORM_TYPE_ODD,
            "get_total_norm",
            lambda: Case([g(3), g(4)], {"norm_type": math.nan}),
            ok(),
            ok(),
        ),
        Row(
            "check-norm-type-tensor",
            K_NORM_TYPE_ODD,
            "check",
            lambda: Case(holders(g(3), g(4)), {"norm_type": torch.tensor(3.0)}),
            ok(),
            ok(),
        ),
        # -- an empty tensor has no infinity norm (max and min have no identity): torch's error, whose
        #    words changed ("inf norm" in 2.10, "infinity norm" later): nanscan raises the running one's
        Row(
            "get_total_norm-inf-norm-empty-tensor",
            K_EMPTY_INF,
            "get_total_norm",
            lambda: Case([g(3), torch.zeros(0)], {"norm_type": math.inf}),
            err(RuntimeError, EMPTY_INF_NORM),
            err(RuntimeError, EMPTY_INF_NORM),
        ),
        Row(
            "get_total_norm-minus-inf-norm-empty-tensor",
            K_EMPTY_INF,
            "get_total_norm",
            lambda: Case([g(3), torch.zeros(0)], {"norm_type": -math.inf}),
            err(RuntimeError, r"cannot compute the -inf norm on an empty tensor"),
            err(RuntimeError, r"cannot compute the -inf norm on an empty tensor"),
        ),
        Row(
            "clip-inf-norm-empty-tensor",
            K_EMPTY_INF,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), torch.zeros(0)), {"max_norm": 1.0, "norm_type": math.inf}),
            err(RuntimeError, EMPTY_INF_NORM),
            err(RuntimeError, EMPTY_INF_NORM),
        ),
        Row(
            "check-inf-norm-empty-tensor",
            K_EMPTY_INF,
            "check",
            lambda: Case(holders(g(3), torch.zeros(0)), {"max_norm": 1.0, "norm_type": math.inf}),
            err(RuntimeError, EMPTY_INF_NORM),
            err(RuntimeError, EMPTY_INF_NORM),
        ),
        Row("scan-empty-tensor", K_EMPTY_INF, "scan", lambda: Case([g(3), torch.zeros(0)]), ok(), ok()),
        # -- non-finite gradients with the error asked for ------------------------------------------
        Row(
            "get_total_norm-nan-error-if-nonfinite",
            K_NONFINITE,
            "get_total_norm",
            lambda: Case([nan_at_0(g(3)), g(4)], {"error_if_nonfinite": True}),
            err(RuntimeError, NONFINITE.format(r"2\.0")),
            err(RuntimeError, NONFINITE.format(r"2\.0")),
        ),
        Row(
            "clip-inf-error-if-nonfinite-inf-norm",
            K_NONFINITE,
            "clip_grad_norm_",
            lambda: Case(
                holders(nan_at_0(g(3), math.inf), g(4)),
                {"max_norm": 1.0, "norm_type": math.inf, "error_if_nonfinite": True},
            ),
            err(RuntimeError, NONFINITE.format("inf")),
            err(RuntimeError, NONFINITE.format("inf")),
        ),
        Row(
            "clip-nan-error-if-nonfinite-1-norm",
            K_NONFINITE,
            "clip_grad_norm_",
            lambda: Case(
                holders(nan_at_0(g(3)), g(4)), {"max_norm": 1.0, "norm_type": 1.0, "error_if_nonfinite": True}
            ),
            err(RuntimeError, NONFINITE.format(r"1\.0")),
            err(RuntimeError, NONFINITE.format(r"1\.0")),
        ),
        Row(
            "check-nan-raise-no-clip",
            K_NONFINITE,
            "check",
            lambda: Case(holders(nan_at_0(g(3)), g(4)), {"on_nonfinite": "raise"}),
            err(nanscan.NonFiniteGradientError, r"non-finite gradients in \[0\]"),
            err(RuntimeError, NONFINITE.format(r"2\.0")),
        ),
        Row(
            "check-nan-raise-with-clip",
            K_NONFINITE,
            "check",
            lambda: Case(holders(nan_at_0(g(3)), g(4)), {"on_nonfinite": "raise", "max_norm": 1.0}),
            err(nanscan.NonFiniteGradientError, r"non-finite gradients in \[0\]"),
            err(RuntimeError, NONFINITE.format(r"2\.0")),
        ),
        Row(
            "check-inf-raise-with-clip",
            K_NONFINITE,
            "check",
            lambda: Case(holders(nan_at_0(g(3), math.inf), g(4)), {"on_nonfinite": "raise", "max_norm": 1.0}),
            err(nanscan.NonFiniteGradientError, r"non-finite gradients in \[0\]"),
            err(RuntimeError, NONFINITE.format(r"2\.0")),
        ),
        # Deliberate: nanscan's fp32 norm of 1e20 is finite (1e20); torch's fp32 squares overflow to inf.
        Row(
            "clip-huge-finite-error-if-nonfinite",
            K_HUGE,
            "clip_grad_norm_",
            lambda: Case(holders(torch.tensor([1e20, 1.0]), g(4)), {"max_norm": 1.0, "error_if_nonfinite": True}),
            ok(writes=True),
            err(RuntimeError, NONFINITE.format(r"2\.0")),
        ),
        Row(
            "get_total_norm-huge-finite-error-if-nonfinite",
            K_HUGE,
            "get_total_norm",
            lambda: Case([torch.tensor([1e20, 1.0])], {"error_if_nonfinite": True}),
            ok(),
            err(RuntimeError, NONFINITE.format(r"2\.0")),
        ),
        # -- empty inputs ---------------------------------------------------------------------------
        Row(
            "scan-empty-list",
            K_EMPTY,
            "scan",
            lambda: Case([]),
            ok(),
            err(RuntimeError, r"Tensor list must have at least one tensor"),
        ),
        Row("get_total_norm-empty-generator", K_EMPTY, "get_total_norm", lambda: Case([], generator=True), ok(), ok()),
        Row(
            "clip-empty-generator",
            K_EMPTY,
            "clip_grad_norm_",
            lambda: Case([], {"max_norm": 1.0}, generator=True),
            ok(warns=r"`parameters` is an empty generator"),
            ok(warns=r"`parameters` is an empty generator"),
        ),
        Row("clip-empty-list", K_EMPTY, "clip_grad_norm_", lambda: Case([], {"max_norm": 1.0}), ok(), ok()),
        # check does not warn on an empty generator (torch's clip does).
        Row(
            "check-empty-generator",
            K_EMPTY,
            "check",
            lambda: Case([], {"max_norm": 1.0}, generator=True),
            ok(),
            ok(warns=r"`parameters` is an empty generator"),
        ),
        # -- scan's names ---------------------------------------------------------------------------
        Row(
            "scan-names-too-few",
            K_NAMES,
            "scan",
            lambda: Case([g(3), g(4)], {"names": ["w"]}),
            err(ValueError, r"got 1 names for 2 tensors; give one name per tensor"),
            NO_COUNTERPART,
        ),
        Row(
            "scan-names-too-many",
            K_NAMES,
            "scan",
            lambda: Case([g(3)], {"names": ["w", "b"]}),
            err(ValueError, r"got 2 names for 1 tensors"),
            NO_COUNTERPART,
        ),
        # -- check's own arguments ------------------------------------------------------------------
        Row(
            "check-on-nonfinite-unknown",
            K_ON_NONFINITE,
            "check",
            lambda: Case(holders(g(3)), {"max_norm": 1.0, "on_nonfinite": "explode"}),
            err(ValueError, r"on_nonfinite must be one of 'ignore', 'warn', 'raise', 'skip', got 'explode'"),
            NO_COUNTERPART,
        ),
        Row(
            "check-skip-without-optimizer",
            K_ON_NONFINITE,
            "check",
            lambda: Case(holders(g(3)), {"on_nonfinite": "skip"}),
            err(ValueError, r"on_nonfinite='skip' needs optimizer="),
            NO_COUNTERPART,
        ),
        Row(
            "check-skip-without-optimizer-with-clip",
            K_ON_NONFINITE,
            "check",
            lambda: Case(holders(g(3), g(4)), {"on_nonfinite": "skip", "max_norm": 1.0}),
            err(ValueError, r"on_nonfinite='skip' needs optimizer="),
            NO_COUNTERPART,
        ),
        Row(
            "check-negative-max-consecutive-skips-with-clip",
            K_ON_NONFINITE,
            "check",
            lambda: Case(
                *_with_optimizer(holders(g(3), g(4)), on_nonfinite="skip", max_norm=1.0, max_consecutive_skips=-1)
            ),
            err(ValueError, r"max_consecutive_skips must be >= 0 or None, got -1"),
            NO_COUNTERPART,
        ),
        # -- dimensions: 64 at most, in torch and in the kernel -------------------------------------
        Row("scan-26-dims", K_DIMS, "scan", lambda: Case([g(3), g(*[1] * 24, 2, 2)]), ok(), ok()),
        Row(
            "clip-26-dims",
            K_DIMS,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), g(*[1] * 24, 2, 2)), {"max_norm": 1.0}),
            ok(writes=True),
            ok(writes=True),
        ),
        Row(
            "scan-65-dims",
            K_DIMS,
            "scan",
            lambda: Case([g(3), torch.ones([1] * 65)]),
            err(RuntimeError, r"entry 1 " + DIMS_65),
            err(RuntimeError, DIMS_TORCH),
        ),
        Row(
            "get_total_norm-65-dims",
            K_DIMS,
            "get_total_norm",
            lambda: Case([g(3), torch.ones([1] * 65)]),
            err(RuntimeError, r"entry 1 " + DIMS_65),
            err(RuntimeError, DIMS_TORCH),
        ),
        Row(
            "clip-65-dims",
            K_DIMS,
            "clip_grad_norm_",
            lambda: Case(holders(g(3), torch.ones([1] * 65)), {"max_norm": 1.0}),
            err(RuntimeError, r"entry 1 " + DIMS_65),
            err(RuntimeError, DIMS_TORCH),
        ),
        Row(
            "check-65-dims-named",
            K_DIMS,
            "check",
            lambda: Case(Deep(), {"max_norm": 1.0}),
            err(RuntimeError, r"'deep'.*" + DIMS_65),
            err(RuntimeError, DIMS_TORCH),
        ),
    ]
    return rows


def _with_optimizer(params: list[torch.Tensor], **kwargs: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """(params, kwargs with an SGD optimizer over them): twin copies the optimizer with its params."""
    return params, {**kwargs, "optimizer": torch.optim.SGD(params, lr=0.1)}


ROWS = _rows()


# ---- The test -------------------------------------------------------------------------------------


def run_side(side: str, call: Callable[[], Any], case: Case, expected: Outcome) -> tuple[Any, bool]:
    """Calls, checks the exception (type, message) or success, the warning, and whether anything
    passed in changed; returns (result or None, wrote)."""
    before = snapshot(case)
    result = None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            result = call()
        except Exception as e:
            wrote = changed(case, before)
            if expected.raises is None:
                raise AssertionError(f"{side} raised {type(e).__name__}: {e}") from e
            assert type(e) is expected.raises, (
                f"{side} raised {type(e).__name__}, expected {expected.raises.__name__}: {e}"
            )
            assert re.search(expected.match, str(e), re.S), (
                f"{side}'s message {str(e)!r} does not match {expected.match!r}"
            )
        else:
            wrote = changed(case, before)
            assert expected.raises is None, f"{side} returned {result!r}, expected {expected.raises.__name__}"
    messages = [str(w.message) for w in caught]
    if expected.warns is None:
        assert not messages, f"{side} warned: {messages}"
    else:
        assert any(re.search(expected.warns, m) for m in messages), (
            f"{side} did not warn {expected.warns!r}: {messages}"
        )
    assert wrote == expected.writes, f"{side} {'changed' if wrote else 'did not change'} the tensors passed in"
    return result, wrote


def assert_same_result(entry: Entry, ours: Any, theirs: Any, ours_case: Case, theirs_case: Case) -> None:
    """nanscan's result and gradients equal torch's within fp tolerance (nanscan's fp32 L2 norm is
    accumulated in fp32/fp64 where torch's is fp32, so the last bits may differ)."""
    if entry == "scan":
        got = ours.norm
        want = torch.stack([n.double() for n in theirs]) if len(theirs) else torch.zeros(0, dtype=torch.float64)
    elif entry == "check":
        got, want = ours.total_norm_tensor.double(), theirs.double()
    else:
        assert ours.dtype == theirs.dtype and ours.device == theirs.device
        got, want = ours, theirs
    if want.is_meta:
        return
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-30, equal_nan=True, check_dtype=False)
    for a, b in zip(tensors_of(ours_case.inputs), tensors_of(theirs_case.inputs), strict=True):
        if a.layout == torch.strided and not a.is_meta and not a.is_nested:
            torch.testing.assert_close(a.resolve_neg(), b.resolve_neg(), rtol=1e-5, atol=1e-30, equal_nan=True)


class NanscanDefect(Exception):
    """nanscan did not do what a defect row says it should. The xfail of a defect row expects only
    this, so a wrong torch column or a broken harness still fails the row."""


def _param(row: Row) -> Any:
    marks = [pytest.mark.xfail(strict=True, raises=NanscanDefect, reason=row.defect)] if row.defect else []
    if "mkldnn" in row.id and not torch.backends.mkldnn.is_available():
        marks.append(pytest.mark.skip(reason="this torch has no MKL-DNN"))
    return pytest.param(row, id=row.id, marks=marks)


def test_table_is_well_formed() -> None:
    """Unique ids; every row (kind) of docs/bad-input.md has test rows, listed in its order."""
    ids = [row.id for row in ROWS]
    assert len(ids) == len(set(ids))
    kinds_in_order = list(dict.fromkeys(row.kind for row in ROWS))
    assert kinds_in_order == list(KINDS)


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor.*deprecated")
@pytest.mark.parametrize("row", [_param(row) for row in ROWS])
def test_bad_input(row: Row) -> None:
    original = row.build()
    ours, theirs = twin(original), twin(original)
    # The copies are faithful (values, strides, flags) and independent of each other.
    assert (
        [fp for _, fp in snapshot(ours)] == [fp for _, fp in snapshot(original)] == [fp for _, fp in snapshot(theirs)]
    )
    assert not any(a is b for a, b in zip(tensors_of(ours.inputs), tensors_of(theirs.inputs), strict=True))

    # torch first: its column is checked on every row, defect rows included.
    torch_result = None
    if row.torch is not None:
        torch_result, _ = run_side("torch", lambda: call_torch(row.entry, theirs), theirs, row.torch)
    try:
        result, wrote = run_side("nanscan", lambda: call_nanscan(row.entry, ours), ours, row.nanscan)
        if row.nanscan.raises is not None:
            assert not wrote, "nanscan changed a tensor before raising"  # whatever the row says
        if row.torch is not None and row.nanscan.raises is None and row.torch.raises is None:
            assert_same_result(row.entry, result, torch_result, ours, theirs)
    except AssertionError as failure:
        if row.defect:
            raise NanscanDefect(str(failure)) from failure
        raise
