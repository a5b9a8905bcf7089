"""Parameters grouped into layers, so that a model with a thousand parameters reads as a hundred rows
(``nanscan.plot``) or a hundred TensorBoard tags (``nanscan.integrations.tensorboard``).

A layer is a parameter's name less its last component: ``transformer.h.3.attn.c_attn.weight`` and
``...c_attn.bias`` are the layer ``transformer.h.3.attn.c_attn``. When that still leaves more groups
than asked for, the deepest names lose one more component at a time (``transformer.h.3.attn``, then
``transformer.h.3``). A cut that would merge numbered blocks into one (``transformer.h``) merges
neighbouring numbers into ranges instead (``transformer.h.0-3``), and names that cannot be cut any
further are merged with their neighbours in order.

``check_state``'s names of optimizer state, ``<parameter>:<key>`` (``fc.weight:exp_avg_sq``), are
grouped among the names of their key, and their groups say it (``fc:exp_avg_sq``): a layer's weights
and its Adam moments are different quantities, not one vector. Each key gets its share of the groups.

A group's norm is the L2 norm of its members' gradients taken together: the square root of the sum of
their squared norms, NaN if any member's is NaN, else Inf if any member's is Inf.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike, NDArray

MAX_GROUPS = 200
"""Default most groups: about what a 1000-pixel heatmap or a TensorBoard tag list shows legibly."""


@dataclass(frozen=True)
class Group:
    """One layer (or range of layers): its label and the indices of its members in the names."""

    name: str
    members: tuple[int, ...]


def layer_name(name: str) -> str:
    """The layer of a parameter: its name less the last component (a name without dots is its own)."""
    head, dot, _ = name.rpartition(".")
    return head if dot else name


def group_layers(names: Sequence[str], max_groups: int = MAX_GROUPS) -> list[Group]:
    """The parameters grouped by layer, coarsened until there are at most ``max_groups`` groups (module
    notes), in the order of each group's first member."""
    if max_groups < 1:
        raise ValueError(f"nanscan: max_groups must be at least 1, got {max_groups}")
    by_key: dict[str, list[int]] = {}  # "" for parameters, else the state key after ":"
    for i, name in enumerate(names):
        by_key.setdefault(name.partition(":")[2], []).append(i)
    if len(by_key) == 1 and "" in by_key:
        return _group_parameters(names, max_groups)
    share = max(1, max_groups // len(by_key))
    groups: list[Group] = []
    for key, members in by_key.items():
        suffix = f":{key}" if key else ""
        groups += [
            Group(group.name + suffix, tuple(members[j] for j in group.members))
            for group in _group_parameters([names[i].partition(":")[0] for i in members], share)
        ]
    return groups


def _group_parameters(names: Sequence[str], max_groups: int) -> list[Group]:
    """``group_layers`` for names of parameters alone."""
    keys = [tuple(layer_name(name).split(".")) for name in names]
    while len(set(keys)) > max_groups:
        depth = max(map(len, keys))
        if depth == 1:
            break
        if any(len(key) == depth and key[-1].isdigit() for key in keys):
            ranged = _number_ranges(keys, depth, max_groups)
            if ranged is not None:
                keys = ranged
                break
        keys = [key[:-1] if len(key) == depth else key for key in keys]
    groups = _collect(keys)
    return groups if len(groups) <= max_groups else _merge_neighbours(groups, max_groups)


def group_reduce(values: ArrayLike, groups: Sequence[Group], ufunc: np.ufunc) -> NDArray[np.generic]:
    """``values`` (one row per name, any trailing shape) reduced over each group's members with a
    binary ufunc (``np.add``, ``np.logical_or``, ...): one row per group, in the groups' order."""
    array = np.asarray(values)
    order = np.fromiter((i for group in groups for i in group.members), dtype=np.intp)
    starts = np.cumsum([0] + [len(group.members) for group in groups[:-1]], dtype=np.intp)
    if order.size == 0:
        return np.empty((0, *array.shape[1:]), dtype=array.dtype)
    # Sorting the rows by group makes every group a contiguous run: one reduceat, not a loop of gathers.
    reduced: NDArray[np.generic] = ufunc.reduceat(array[order], starts, axis=0)
    return reduced


def group_norms(norms: ArrayLike, groups: Sequence[Group]) -> NDArray[np.float64]:
    """Each group's norm: sqrt of the sum of its members' squared norms (NaN/Inf as module notes).

    Squares are summed in float64: gradient norms stay far below 1e154, where a square would overflow.
    """
    squares = np.square(np.asarray(norms, dtype=np.float64))
    norms_out: NDArray[np.float64] = np.sqrt(group_reduce(squares, groups, np.add), dtype=np.float64)
    return norms_out


def _collect(keys: Sequence[tuple[str, ...]]) -> list[Group]:
    members: dict[tuple[str, ...], list[int]] = {}
    for i, key in enumerate(keys):
        members.setdefault(key, []).append(i)
    return [Group(".".join(key), tuple(rows)) for key, rows in members.items()]


def _number_ranges(keys: Sequence[tuple[str, ...]], depth: int, max_groups: int) -> list[tuple[str, ...]] | None:
    """The keys with the numbered last component of the deepest keys merged into ranges of the
    narrowest power-of-two width that leaves at most ``max_groups`` groups; None if no width does."""
    numbered = [len(key) == depth and key[-1].isdigit() for key in keys]
    largest = max(int(key[-1]) for key, is_numbered in zip(keys, numbered, strict=True) if is_numbered)
    width = 2
    while True:
        # The label of a range is the numbers present in it, so a gap in the numbering shows.
        present: dict[tuple[tuple[str, ...], int], list[int]] = {}
        for key, is_numbered in zip(keys, numbered, strict=True):
            if is_numbered:
                present.setdefault((key[:-1], int(key[-1]) // width), []).append(int(key[-1]))
        ranged = [
            (*key[:-1], _range_label(present[(key[:-1], int(key[-1]) // width)])) if is_numbered else key
            for key, is_numbered in zip(keys, numbered, strict=True)
        ]
        if len(set(ranged)) <= max_groups:
            return ranged
        if width > largest:  # one range per block list already: only a cut can do better
            return None
        width *= 2


def _range_label(numbers: Sequence[int]) -> str:
    low, high = min(numbers), max(numbers)
    return str(low) if low == high else f"{low}-{high}"


def _merge_neighbours(groups: Sequence[Group], max_groups: int) -> list[Group]:
    """The last resort for names with no structure left to cut: runs of neighbouring groups."""
    size = math.ceil(len(groups) / max_groups)
    merged = []
    for start in range(0, len(groups), size):
        run = groups[start : start + size]
        name = run[0].name if len(run) == 1 else f"{run[0].name} … {run[-1].name}"
        merged.append(Group(name, tuple(i for group in run for i in group.members)))
    return merged
