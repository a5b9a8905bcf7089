"""What both framework callbacks share: the check they run before each optimizer step, and what
they log of a recorder's records, and which records they log.

Which ranks held a NaN/Inf is logged only when the checks' reports carry a rank attribution
(DTensors, DDP with ``nanscan.ddp.attach``): a record names rank 0 for a single process's NaN too
(``StepRecord.nonfinite_ranks``), which is no news, and a rank's own rank for a check that reduced
nothing across ranks (plain DDP, where the all-reduce has spread the NaN to every rank already),
which would blame the wrong rank. Whether a report carries one is a host attribute, read after each
check without a sync; the ranks themselves come with the records, which reach the host anyway."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ..check import check
from ..clip import as_max_norm, as_norm_type
from ..guard import ON_NONFINITE, check_max_consecutive_skips
from ..records import StepRecord

if TYPE_CHECKING:
    from ..recorder import Recorder


class CheckingCallback:
    """The settings of the check a framework callback runs, and the run itself (a mixin: the
    callbacks derive from their framework's own callback class too).

    The settings are validated when the callback is made, as ``check`` would validate them, so a
    typo fails at construction rather than at the first optimizer step of a long run."""

    max_norm: float | None
    norm_type: float
    on_nonfinite: str
    max_consecutive_skips: int | None
    recorder: Recorder | None
    log_every_n_steps: int | None
    attributed: bool
    """Whether a check's report has carried a rank attribution: the records' ranks are then worth
    logging (module notes)."""

    def _set_check(
        self,
        owner: str,
        max_norm: float | None,
        norm_type: float,
        on_nonfinite: str,
        max_consecutive_skips: int | None,
        recorder: Recorder | None,
        log_every_n_steps: int | None,
    ) -> None:
        if on_nonfinite not in ON_NONFINITE:
            raise ValueError(
                f"nanscan.{owner}: on_nonfinite must be one of {', '.join(map(repr, ON_NONFINITE))}, got "
                f"{on_nonfinite!r}"
            )
        check_max_consecutive_skips(max_consecutive_skips)
        check_log_every(owner, log_every_n_steps)
        self.max_norm = None if max_norm is None else as_max_norm(max_norm)
        self.norm_type = as_norm_type(norm_type)
        self.on_nonfinite = on_nonfinite
        self.max_consecutive_skips = max_consecutive_skips
        self.recorder = recorder
        self.log_every_n_steps = log_every_n_steps
        self.attributed = False

    def _run_check(self, target: Any, optimizer: torch.optim.Optimizer | None) -> None:
        """``check`` of ``target`` with these settings; ``optimizer`` is the one whose step a
        ``"skip"`` guards (None otherwise)."""
        report = check(
            target,
            max_norm=self.max_norm,
            norm_type=self.norm_type,
            on_nonfinite=self.on_nonfinite,
            optimizer=optimizer,
            max_consecutive_skips=self.max_consecutive_skips,
            recorder=self.recorder,
        )
        # One setup, one answer, for the whole run (the distribution of a model does not change between
        # steps): kept once seen, so that the records read later, once per N steps, are logged with it.
        self.attributed = self.attributed or report.stats.ranks is not None

    def _metrics(self, records: Sequence[StepRecord]) -> dict[str, float]:
        """``rank_metrics`` of ``records`` when the checks carry a rank attribution, else nothing."""
        return rank_metrics(records) if self.attributed else {}


def check_log_every(owner: str, log_every_n_steps: int | None) -> None:
    if log_every_n_steps is not None and log_every_n_steps < 1:
        raise ValueError(f"nanscan.{owner}: log_every_n_steps must be >= 1 or None, got {log_every_n_steps}")


def worth_logging(record: StepRecord, every: int | None) -> bool:
    """Every ``every``-th record (all of them for None), and every skipped or non-finite one."""
    return every is None or record.step % every == 0 or record.skipped or not record.finite


def record_metrics(record: StepRecord) -> dict[str, float]:
    """One record's totals under the ``nanscan/`` keys the callbacks' docs list."""
    metrics = {
        "nanscan/total_norm": record.total_norm,
        "nanscan/skipped": float(record.skipped),
        "nanscan/nonfinite_params": float(len(record.nonfinite)),
    }
    if record.clip_coef is not None:
        metrics["nanscan/clip_coef"] = record.clip_coef
    if record.loss_scale is not None:
        metrics["nanscan/loss_scale"] = record.loss_scale
    return metrics


def parameters_by_rank(nonfinite_ranks: dict[str, list[int]] | None) -> dict[int, int]:
    """For each rank named in a record's ``nonfinite_ranks``, how many parameters it is named for."""
    counts: dict[int, int] = {}
    for ranks in (nonfinite_ranks or {}).values():
        for rank in ranks:
            counts[rank] = counts.get(rank, 0) + 1
    return dict(sorted(counts.items()))


def rank_metrics(records: Sequence[StepRecord]) -> dict[str, float]:
    """``nanscan/nonfinite_rank/<rank>``: for each rank whose local data held a NaN/Inf in one of
    ``records``, the most parameters it held them in, in one record (as ``nanscan/nonfinite_params``
    counts them): a key per rank that went bad, at the steps it did, not one per rank of the world.
    Empty for finite records, without reading any per-parameter list."""
    metrics: dict[str, float] = {}
    for record in records:
        if record.finite:
            continue
        for rank, count in parameters_by_rank(record.nonfinite_ranks).items():
            key = f"nanscan/nonfinite_rank/{rank}"
            metrics[key] = max(metrics.get(key, 0.0), float(count))
    return metrics
