"""Where the gradients of what a caller passes are, in this process: a module's (named after its
kept walk, nanscan.walk), a list of parameters' (named by position), a list of ``(name, parameter)``
pairs'. Every function here runs on every check, so the usual cases are comprehensions and C-level
maps, each ``.grad`` read once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..fused import gradients_of
from ..names import PositionalNames


def module_gradients(names: Sequence[str], params: list[Any]) -> tuple[Sequence[str], list[torch.Tensor], list[Any]]:
    """(names, gradients, parameters) of the parameters (named ``names``) that have a gradient."""
    all_grads = gradients_of(params)
    grads = [g for g in all_grads if g is not None]
    if len(grads) == len(names):
        return names, grads, params
    kept = [i for i, g in enumerate(all_grads) if g is not None]
    return [names[i] for i in kept], grads, [params[i] for i in kept]


def listed_gradients(
    model_or_params: torch.Tensor | Iterable[Any],
) -> tuple[Sequence[str], list[torch.Tensor], list[Any]]:
    """(names, gradients, parameters) of the parameters in a list (named by position, ``"[3]"``) or in
    a list of ``(name, parameter)`` pairs, that have a gradient."""
    if isinstance(model_or_params, torch.Tensor):
        items: Sequence[Any] = [model_or_params]
    else:
        items = model_or_params if isinstance(model_or_params, (list, tuple)) else list(model_or_params)
    # Plain comprehensions, each .grad read once: an assignment expression inside one would make a
    # closure cell, which torch.compile(fullgraph=True) cannot trace.
    try:
        # The common case, a list of parameters: comprehensions, names left to PositionalNames.
        all_grads = gradients_of(items)
    except AttributeError:
        pass  # (name, parameter) pairs, or an entry that is no tensor: named one by one below
    else:
        grads = [g for g in all_grads if g is not None]
        if len(grads) == len(items):
            return PositionalNames(range(len(items))), grads, list(items)
        kept = [i for i, g in enumerate(all_grads) if g is not None]
        return PositionalNames(kept), grads, [items[i] for i in kept]
    if set(map(type, items)) == {tuple} and set(map(len, items)) == {2}:
        # A list of (name, parameter) pairs made once (list(model.named_parameters())): names
        # without the module tree. C-level maps and comprehensions, no per-pair Python branch.
        params = [p for _, p in items]
        try:
            all_grads = gradients_of(params)
        except AttributeError:
            pass  # an entry that is no tensor: named one by one below
        else:
            grads = [g for g in all_grads if g is not None]
            if len(grads) == len(items):
                return [str(name) for name, _ in items], grads, params
            kept = [i for i, g in enumerate(all_grads) if g is not None]
            return [str(items[i][0]) for i in kept], grads, [params[i] for i in kept]
    pairs = (item if isinstance(item, tuple) and len(item) == 2 else (f"[{i}]", item) for i, item in enumerate(items))
    names: list[str] = []
    grads = []
    kept_params = []
    for name, p in pairs:
        try:
            grad = p.grad  # one attribute read: cheaper than an isinstance test against torch.Tensor
        except AttributeError:
            raise TypeError(f"nanscan.check: parameter {name!r} is a {type(p).__name__}, not a torch.Tensor") from None
        if grad is not None:
            names.append(str(name))
            grads.append(grad)
            kept_params.append(p)
    return names, grads, kept_params
