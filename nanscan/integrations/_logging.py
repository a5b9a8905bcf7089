"""What both framework callbacks log of a recorder's records, and which records they log."""

from __future__ import annotations

from ..records import StepRecord


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
