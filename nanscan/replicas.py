"""Replica consistency: do data-parallel replicas hold bit-identical tensors?

After DDP's all-reduce every rank must hold the same gradients, bit for bit, and after the step the
same weights. A flipped bit in one GPU's memory or a miscomputed kernel (silent data corruption)
breaks that without any NaN. nanscan checks it every step, on the device and without a host sync:

1. The scan that computes the statistics also computes each tensor's replica checksum
   (``scan(..., checksum=True)``; the definition is in csrc/common/scan_rules.h).
2. One all-reduce (MAX) of ``[checksum, ~checksum]`` per tensor, 16 bytes per tensor, gives every
   rank the largest and the smallest checksum: the replicas agree exactly where the two are equal.
3. One all-reduce (SUM) of per-rank bits, 16 bytes per tensor and per 62 ranks, says which ranks
   differ from the largest and which from the smallest; the ranks outside the majority are the
   divergent ones. With two replicas, or any tie, no majority exists and both sides are named.

The second collective is issued unconditionally: deciding on the host whether it is needed would be
a sync. Its result is read only when ``divergent`` is.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .report import named_gradients

RANKS_PER_WORD = 62  # bits per int64 word of a rank mask: sums of distinct powers below 2^62 are exact


class ReplicaCheck:
    """The outcome of comparing tensors across the replicas of a process group.

    Attributes:
        names: the tensors compared, one name each.
        consistent_tensor: bool [] on the tensors' device: every replica holds every tensor bit for bit
            (but for a 2^-32 chance per changed tensor of a checksum collision). No sync to get it.
    """

    def __init__(
        self,
        names: Sequence[str],
        checksum_range: torch.Tensor,
        rank_masks: torch.Tensor,
        group_ranks: list[int],
    ) -> None:
        self.names = names
        self._range = checksum_range  # int64 [2, N]: largest checksum, ~smallest checksum
        self._masks = rank_masks  # int64 [2, words, N]: ranks that differ from the largest / the smallest
        self._group_ranks = group_ranks
        self.consistent_tensor = (checksum_range[0] == ~checksum_range[1]).all()
        self._divergent: dict[str, list[int]] | None = None

    @property
    def consistent(self) -> bool:
        """Whether every replica holds every tensor bit for bit (one sync)."""
        return bool(self.consistent_tensor)

    @property
    def divergent(self) -> dict[str, list[int]]:
        """Each tensor whose replicas differ, with the (global) ranks outside the majority; both sides
        where there is no majority (two replicas). Empty when consistent. One sync, on first reading."""
        if self._divergent is None:
            self._divergent = self._decode()
        return self._divergent

    def _decode(self) -> dict[str, list[int]]:
        high, inverted_low = self._range.cpu().tolist()
        masks = self._masks.cpu().tolist()
        world = len(self._group_ranks)
        found: dict[str, list[int]] = {}
        for i, name in enumerate(self.names):
            if high[i] == ~inverted_low[i]:
                continue
            off_high = self._ranks_in([words[i] for words in masks[0]])
            off_low = self._ranks_in([words[i] for words in masks[1]])
            on_high, on_low = world - len(off_high), world - len(off_low)
            if on_high > on_low:
                group_ranks = off_high
            elif on_low > on_high:
                group_ranks = off_low
            else:
                group_ranks = off_high | off_low
            found[name] = sorted(self._group_ranks[r] for r in group_ranks)
        return found

    @staticmethod
    def _ranks_in(words: list[int]) -> set[int]:
        return {w * RANKS_PER_WORD + b for w, word in enumerate(words) for b in range(RANKS_PER_WORD) if word >> b & 1}

    def __repr__(self) -> str:
        return f"<nanscan.ReplicaCheck of {len(self.names)} tensors over {len(self._group_ranks)} ranks>"


def compare(names: Sequence[str], checksums: torch.Tensor, process_group: Any = None) -> ReplicaCheck:
    """Compares each rank's ``checksums`` (int64 [N], from ``scan(..., checksum=True)``) across the
    group, in two all-reduces and with no host sync. Every rank of the group must call it, with the
    same number of tensors."""
    import torch.distributed as dist

    rank, world = dist.get_rank(process_group), dist.get_world_size(process_group)
    n = checksums.shape[0]
    checksum_range = torch.cat([checksums, ~checksums]).view(2, n)
    dist.all_reduce(checksum_range, op=dist.ReduceOp.MAX, group=process_group)
    words = -(-world // RANKS_PER_WORD)
    word, bit = divmod(rank, RANKS_PER_WORD)
    masks = torch.zeros((2, words, n), dtype=torch.int64, device=checksums.device)
    masks[0, word] = (checksums != checksum_range[0]).to(torch.int64) << bit
    masks[1, word] = (checksums != ~checksum_range[1]).to(torch.int64) << bit
    dist.all_reduce(masks, op=dist.ReduceOp.SUM, group=process_group)
    group_ranks = (
        [dist.get_global_rank(process_group, r) for r in range(world)] if process_group else list(range(world))
    )
    return ReplicaCheck(names, checksum_range, masks, group_ranks)


def replica_group(model_or_params: object, process_group: Any) -> Any:
    """The group whose ranks hold the replicas: ``process_group`` if given, else a DDP model's own."""
    if process_group is not None:
        return process_group
    return (
        getattr(model_or_params, "process_group", None)
        if isinstance(model_or_params, torch.nn.parallel.DistributedDataParallel)
        else None
    )


def verify_replicas(
    model_or_params: torch.nn.Module | Iterable[Any],
    process_group: Any = None,
    *,
    gradients: bool = False,
) -> ReplicaCheck:
    """Whether every rank of the group holds bit-identical parameters (after ``optimizer.step()``:
    weights that drift), or their gradients with ``gradients=True``. One fused scan computes the
    checksums; two all-reduces compare them; nothing syncs until ``consistent`` or ``divergent`` is
    read. ``check(..., verify_replicas=True)`` does the same for gradients within the check's own scan.

    Args:
        model_or_params: an ``nn.Module`` (a DDP model too), an iterable of parameters, or of
            ``(name, parameter)`` pairs; every rank must pass the same tensors.
        process_group: the replicas' group; default: a DDP model's, else the default group.
        gradients: compare the ``.grad`` of each parameter instead of the parameter.

    Plain (replicated) tensors only: DTensors are refused (their shards are not replicas).
    """
    from .scan import scan

    names: Sequence[str]
    tensors: list[torch.Tensor]
    if gradients:
        names, tensors = named_gradients(model_or_params)
    elif isinstance(model_or_params, torch.nn.Module):
        pairs = list(model_or_params.named_parameters())
        names, tensors = [name for name, _ in pairs], [p.detach() for _, p in pairs]
    else:
        items = [model_or_params] if isinstance(model_or_params, torch.Tensor) else list(model_or_params)
        named: list[tuple[Any, Any]] = [
            item if isinstance(item, tuple) and len(item) == 2 else (f"[{i}]", item) for i, item in enumerate(items)
        ]
        names, tensors = [str(name) for name, _ in named], [t.detach() for _, t in named]
    with torch.no_grad():
        result = scan(tensors, names, checksum=True)
    assert result.checksum is not None
    return compare(names, result.checksum, replica_group(model_or_params, process_group))
