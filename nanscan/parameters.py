"""The parameters a caller names, as ``check_state`` and ``watch_updates`` take them: a model, an
iterable of parameters, or of ``(name, parameter)`` pairs."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from . import walk
from .layouts import fsdp2_sharded, refused


def named_parameters(
    model_or_params: torch.nn.Module | Iterable[Any], caller: str, walked: walk.Walk | None = None
) -> tuple[list[str], list[torch.Tensor]]:
    """The parameters and their names as the user wrote them (a model's after nanscan's walk:
    ``layers.3.mlp.fc.weight``, without wrappers' prefixes; a bare list's ``param<i>``). Engines that
    nanscan refuses are refused before anything is read (``caller`` names the entry point in errors).
    ``walked``: the model's walk where the caller has made it this call."""
    if isinstance(model_or_params, torch.nn.Module):
        refused.check_module(model_or_params)
        walked = walked if walked is not None else walk.walk(model_or_params)
        names: list[str] = list(walked.names)
        params: list[torch.Tensor] = list(walked.parameters)
    else:
        items = [model_or_params] if isinstance(model_or_params, torch.Tensor) else list(model_or_params)
        if all(issubclass(kind, torch.Tensor) for kind in set(map(type, items))):
            # A list of bare tensors, the usual one, by C-level passes: names from a kept list.
            names, params = _positional_names(len(items)), items
        else:
            names, params = _named_entries(items, caller)
    refused.check_tensors(params)
    # The parameters FSDP2 holds unsharded (not resharded after backward) read as the sharded ones the
    # optimizer steps on and keeps state for: the values of the model, and the keys of its state.
    return names, fsdp2_sharded(params, names, unreduced_refused=False)


# "param0", "param1", ...: as many as the longest list named so far, the same strings each call.
_PARAM_NAMES: list[str] = []


def _positional_names(count: int) -> list[str]:
    """The names of a list of ``count`` bare parameters: ``param<i>``."""
    if len(_PARAM_NAMES) < count:
        _PARAM_NAMES.extend(f"param{i}" for i in range(len(_PARAM_NAMES), count))
    return _PARAM_NAMES[:count]


def _named_entries(items: list[Any], caller: str) -> tuple[list[str], list[torch.Tensor]]:
    """The names and parameters of a list of parameters and ``(name, parameter)`` pairs, each entry
    checked."""
    names: list[str] = []
    params: list[torch.Tensor] = []
    for i, item in enumerate(items):
        name, p = item if isinstance(item, tuple) and len(item) == 2 else (f"param{i}", item)
        if not isinstance(p, torch.Tensor):
            raise TypeError(
                f"nanscan.{caller}: entry {i} is a {type(p).__name__}, not a tensor (a parameter or a "
                "(name, parameter) pair)"
            )
        names.append(str(name))
        params.append(p)
    return names, params
