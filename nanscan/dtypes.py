"""The dtype rules the Python side shares with the kernels (csrc/ops.h states the C++ side)."""

from __future__ import annotations

from collections.abc import Iterable
from functools import reduce

import torch

FLOAT8_DTYPES = frozenset({torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz})


def norm_dtype(dtypes: Iterable[torch.dtype]) -> torch.dtype:
    """The dtype of torch's total norm of tensors of these dtypes (at least one): per-tensor norms keep
    each dtype and are then stacked, so the dtypes promoted. float8, which has no torch norm and
    promotes with nothing, counts as float32. The op computes the same in C++ (norm_dtype_of,
    csrc/op_args.cpp) for its total_norm_cast output."""
    return reduce(torch.promote_types, {torch.float32 if d in FLOAT8_DTYPES else d for d in dtypes})
