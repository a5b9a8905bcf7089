"""Drop-in ``clip_grad_norm_`` and ``get_total_norm`` on top of the fused scan.

Same signatures, results and errors as ``torch.nn.utils``. For the L2 and infinity norms the norm
comes from one fused read of the gradients, and when no clipping is needed the gradients are not
written at all (the scale op skips a coefficient of exactly 1 without a host sync on GPUs). Other
norm types are delegated to torch, so they match it exactly.

Deliberate differences, all towards the fp64 reference: squares are accumulated in fp32 or wider
and combined in fp64, so an fp32 norm is within 1e-6 of the fp64 truth (9.5e-7 at worst on constant
tensors on the CPU, 2e-7 in the CUDA kernel's arithmetic; ~3e-9 on random data) where torch's own fp32
norm can be off by about 6e-6 (the two, and so the clipped gradients, can differ in their last
bits); a bf16 total norm is the correctly rounded bf16 of the true norm (torch rounds each
per-tensor norm to bf16 first); and a norm that overflows in torch's arithmetic gets its finite
value where torch returns inf (fp32/bf16 gradients with |g| > 1.8e19, whose fp32 squares overflow;
an fp16 gradient whose norm exceeds 65504, which torch rounds to fp16 before combining).

Version counters: a call that clips bumps every gradient's version, as torch's does. One that
needs no clipping writes nothing, and on the CPU (where the coefficient is known on the host) it
leaves the versions alone; on CUDA the kernel decides on the device, without a sync, so the host
counts every call as a write, as torch's clip (which always multiplies, by 1.0 if need be) does. So a
gradient saved by a ``create_graph=True`` graph (a gradient penalty) makes that graph's backward
raise "modified by an inplace operation" after a clip on CUDA, exactly as after torch's clip; on the
CPU only after a clip that changed values. Clip after the higher-order backward.

Every gradient is validated before any is written: a list with an entry that cannot be scaled (an
expanded view whose elements share memory, a float8 tensor) raises with nothing changed, where
torch's clip raises after scaling the entries before it.
"""

from __future__ import annotations

import math
import types
import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.utils._foreach_utils import _device_has_foreach_support

from . import layouts
from ._ops import scale_
from .dtypes import norm_dtype
from .fused import SUPPORTED_DTYPES, ScanResult, describe, gradients_of, group_by_device, validate
from .layouts import dtensor

TensorOrTensors = torch.Tensor | Iterable[torch.Tensor]

# torch's own get_total_norm, taken when nanscan is imported: the norm types and dtypes the scan does
# not answer are delegated to it. Looked up at call time instead, it would be nanscan's own function
# once a user assigns ``torch.nn.utils.get_total_norm = nanscan.get_total_norm``, and recurse forever.
torch_get_total_norm: Callable[..., torch.Tensor] = torch.nn.utils.get_total_norm

_NONFINITE_MESSAGE = (
    "The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
    "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
    "`error_if_nonfinite=False`"
)


def as_norm_type(norm_type: object) -> float:
    """``float(norm_type)``, as torch takes it: any real number (numpy scalars, ``True``), a
    one-element tensor, or a string such as ``'inf'``. What ``float()`` refuses raises the same
    exception type as in torch, with a message that says what was wrong."""
    try:
        return float(norm_type)  # type: ignore[arg-type]
    except (TypeError, ValueError) as e:
        raise type(e)(f"nanscan: norm_type must be a real number or 'inf', got {norm_type!r}") from e


def as_max_norm(max_norm: object) -> float:
    """``float(max_norm)``, refusing values that would flip or poison every gradient."""
    value = float(max_norm)  # type: ignore[arg-type]
    if math.isnan(value) or value < 0:
        raise ValueError(f"nanscan: max_norm must be a non-negative number, got {max_norm!r}")
    return value


# The dtypes whose norms the drop-ins take from the scan. The scan reads float8 too, but torch has no
# norm of float8 (NotImplementedError), and the drop-ins keep torch's errors: float8 goes to torch.
NORM_DTYPES = frozenset({torch.float32, torch.float64, torch.float16, torch.bfloat16})


def total_norm_from_scan(stats: ScanResult, norm_type: float) -> torch.Tensor:
    """The total norm (float64, on the scanned device) for the norm types the scan answers: 2 and inf."""
    if norm_type == 2.0:
        return stats.total_norm
    absmax = torch.maximum(stats.min.abs(), stats.max.abs())
    per_tensor = torch.where(
        stats.nan_count > 0,
        torch.full_like(absmax, math.nan),
        torch.where(stats.inf_count > 0, torch.full_like(absmax, math.inf), absmax),
    )
    return per_tensor.max()  # max propagates NaN, as vector_norm(stack(norms), inf) does


def scan_answers(layout: layouts.Layout, norm_type: float) -> bool:
    """Whether the fused scan computes this norm of the layout's tensors: 2 and inf, but torch's inf
    norm of an empty tensor is an error we keep (a parameter's empty part on this rank is no such
    tensor)."""
    if norm_type == 2.0:
        return True
    return norm_type == math.inf and (layout.cut or all(t.numel() > 0 for t in layout.tensors))


def total_norm_of(layout: layouts.Layout, stats: ScanResult, norm_type: float) -> torch.Tensor:
    """The total norm of the layout's tensors (scanned into ``stats``, global ones for a distributed
    layout) in torch's result dtype: from the scan when it answers ``norm_type``, else torch's norms
    of the parts, reduced as the layout says; float64 zero for an empty list in one process."""
    if not layout.tensors and not layout.distributed:
        return torch.zeros((), dtype=torch.float64)
    if scan_answers(layout, norm_type):
        # The op's cast of its total, or at least its dtype: reading the dtype of every tensor instead
        # costs ~70 ns a tensor on the CPU (0.7 ms for 10,000 parameters).
        cast = stats.total_norm_cast
        if cast is None:
            dtype = norm_dtype(layout.dtypes() or {torch.float64})
        elif norm_type == 2.0:
            return cast
        else:
            dtype = cast.dtype
        return total_norm_from_scan(stats, norm_type).to(dtype)
    if layout.distributed:
        return layouts.total_norm(layout, norm_type).to(norm_dtype(layout.dtypes() or {torch.float32}))
    return layouts.global_norm(torch_get_total_norm(layout.tensors, norm_type), norm_type)


def check_foreach(tensors: list[torch.Tensor], foreach: bool | None) -> None:
    if foreach:
        for device in group_by_device(tensors):
            if not _device_has_foreach_support(device):
                raise RuntimeError(f"foreach=True was passed, but can't use the foreach API on {device.type} tensors")


def raise_if_nonfinite(total_norm: torch.Tensor, norm_type: float) -> None:
    if torch.logical_or(total_norm.isnan(), total_norm.isinf()):  # a host sync, as in torch
        raise RuntimeError(_NONFINITE_MESSAGE.format(norm_type=norm_type))


def get_total_norm(
    tensors: TensorOrTensors,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: Any = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.utils.get_total_norm``: the norm of all tensors viewed as one vector.

    DTensors give the norm of the whole (global) tensors, as a plain tensor on every rank (torch's
    gives a DTensor). With ``process_group``, the tensors of every rank of the group count (pipeline
    stages: each rank holds different ones); every rank of the group must call it.
    """
    tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    norm_type = as_norm_type(norm_type)
    layout = layouts.of_tensors(tensors, None, process_group, per_tensor=False)
    return _total_norm(layout, norm_type, error_if_nonfinite, foreach)


def _total_norm(
    layout: layouts.Layout, norm_type: float, error_if_nonfinite: bool, foreach: bool | None
) -> torch.Tensor:
    """``get_total_norm`` of the layout's tensors (a clip scales ``layout.scaled`` by it)."""
    tensors = layout.tensors
    if not tensors and not layout.distributed:
        return torch.tensor(0.0)
    # A DTensor's dtype and device are its local shard's, read there: a DTensor's attributes cost
    # 3-4x a plain tensor's (0.2 ms per 1,000), and the dtypes of a list of them are its plan's.
    try:
        dtypes = layout.dtypes()
    except AttributeError:
        validate(tensors)  # raises, naming the entry that is not a tensor
        raise
    check_foreach(layout.parts, foreach)
    if not dtypes <= NORM_DTYPES:
        # Dtypes without a torch norm to match (complex, integer, float8): torch's own code, so results
        # and errors are torch's exactly (then made global).
        if layout.process_group is None and not layout.cut:
            total = torch_get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
            return layouts.global_norm(total, norm_type)
        local = torch_get_total_norm(tensors, norm_type, False, foreach) if tensors else torch.tensor(0.0)
        total = layouts.global_norm(local, norm_type, layout.process_group)
    elif layout.distributed and (
        layout.cut or norm_type not in (math.inf, -math.inf) or all(t.numel() > 0 for t in tensors)
    ):
        with torch.no_grad():
            # Only the total crosses ranks: one number per group, not every tensor's statistics.
            total = layouts.total_norm(layout, norm_type).to(norm_dtype(dtypes or {torch.float32}))
    elif not scan_answers(layout, norm_type):
        # Norms the scan does not compute (and torch's error for the inf norm of an empty tensor):
        # torch's own code, so results and errors are torch's exactly.
        total = torch_get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
        return layouts.global_norm(total, norm_type)
    else:
        with torch.no_grad():
            try:
                stats = layouts.scan(layout)
            except TypeError as refusal:
                # Sparse COO gradients (nn.Embedding(sparse=True)): torch's own code where the torch
                # running takes them (2.14 does; 2.13's norm does not, and then nanscan's error,
                # which names the entry, stands).
                if not any(isinstance(t, torch.Tensor) and t.layout == torch.sparse_coo for t in tensors):
                    raise
                try:
                    return torch_get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
                except NotImplementedError:
                    raise refusal from None
            total = total_norm_of(layout, stats, norm_type)
    if error_if_nonfinite:
        raise_if_nonfinite(total, norm_type)
    return total


def clip_grads_with_norm_(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor) -> torch.Tensor:
    """Scales ``grads`` in place by ``min(max_norm / (total_norm + 1e-6), 1)``; returns the coefficient.

    The coefficient is computed with torch's expression in ``total_norm``'s dtype, so clipped values
    equal torch's; a coefficient of exactly 1 leaves the gradients unwritten.
    """
    clip_coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    if grads and dtensor.is_dtensor(grads[0]):
        grads = dtensor.to_local(grads)  # each rank scales its local shards (see nanscan.layouts)
    # One op call for the usual single-device list: it validates every entry (before writing any) in
    # C++, so Python does no per-tensor work here. A list that spans devices, or holds dtypes the op
    # does not write (complex: torch's norm was used for it), is handled on the op's error.
    try:
        scale_(grads, clip_coef)
    except RuntimeError:
        if dtensor.has_dtensor(grads):  # each rank scales its local shards
            return clip_grads_with_norm_(dtensor.to_local(grads), max_norm, total_norm)
        if any(g.layout != torch.strided or g.dtype not in SUPPORTED_DTYPES for g in grads):
            # Sparse, complex: torch's norm was used for them, and torch's own multiply scales them,
            # as in its clip_grads_with_norm_.
            for g in grads:
                g.mul_(clip_coef.to(g.device))
            return clip_coef
        groups = group_by_device(grads)
        if len(groups) == 1 and next(iter(groups)) == clip_coef.device:
            raise
        for device, indices in groups.items():
            scale_([grads[i] for i in indices], clip_coef.to(device))
    return clip_coef


def gradients(parameters: TensorOrTensors) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(parameters as a list, their non-None gradients), with torch's warning for an empty generator."""
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    else:
        is_generator = isinstance(parameters, types.GeneratorType)
        parameters = list(parameters)
        if is_generator and not parameters:
            warnings.warn("`parameters` is an empty generator, no gradient clipping will occur.", stacklevel=3)
    try:
        # One attribute read per parameter: a list of 10,000 costs ~0.05 us each (an isinstance test
        # against torch.Tensor alone costs as much), and the ops reject anything that is not a tensor.
        grads = gradients_of(parameters)
    except AttributeError:
        for i, p in enumerate(parameters):
            if not isinstance(p, torch.Tensor):
                raise TypeError(
                    f"nanscan: {describe(None, i)} of parameters is a {type(p).__name__}, not a torch.Tensor"
                ) from None
        raise
    return parameters, [g for g in grads if g is not None]


def clip_grad_norm_(
    parameters: TensorOrTensors | torch.nn.Module,
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    foreach: bool | None = None,
    *,
    process_group: Any = None,
) -> torch.Tensor:
    """Drop-in for ``torch.nn.utils.clip_grad_norm_``; returns the total norm of the gradients.

    The gradients are read once (for L2 and inf norms) and written only when clipping is needed.
    Raises ValueError for a negative or NaN ``max_norm`` before any gradient is touched. DTensor
    gradients (FSDP2, tensor parallel) are clipped by their global norm, returned as a plain tensor
    with the global value on every rank; with ``process_group``, by the norm over every rank of the
    group (pipeline stages).

    ``parameters`` may also be a model (an ``nn.Module``, where torch takes only parameters): its
    parameters' gradients, wherever they live, as ``nanscan.check(model, max_norm=...)`` finds them.
    That is how an FSDP1 model is clipped by its global norm, as FSDP's own ``model.clip_grad_norm_``
    does; a list of its parameters works too (nanscan knows the FSDP1 models the process makes).
    """
    max_norm = as_max_norm(max_norm)
    norm_type = as_norm_type(norm_type)
    # A total norm needs no per-parameter part (FSDP1's flat shards are not cut: per_tensor=False).
    if isinstance(parameters, torch.nn.Module):
        layout = layouts.of_module(parameters, process_group, per_tensor=False)
    else:
        params, grads = gradients(parameters)
        layout = layouts.of_parameter_list(params, grads, process_group, per_tensor=False)
    total_norm = _total_norm(layout, norm_type, error_if_nonfinite, foreach)
    if layout.scaled:
        with torch.no_grad():
            clip_grads_with_norm_(layout.scaled, max_norm, total_norm)
    return total_norm
