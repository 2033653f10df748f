"""Checkpoint economics: what a checkpoint costs to save (C) and to restore (RTO), and what that
means for the checkpoint interval and the work lost to a failure.

Inputs are measured, not assumed. C is the median time a checkpoint of the run cost the
training loop: the stall a save from the loop recorded (`save_costs.stall_seconds`; an async
save's is its staging only), else the time the registry took to take it (`upload_seconds`).
RTO is the median restore time of the run's validations plus the time to move the newest
checkpoint's bytes at the run's measured transfer rate. With a mean time between failures M,
the Young/Daly first-order optimum interval is sqrt(2 C M); between checkpoints a failure loses
on average half an interval of work, plus the RTO.
"""

from __future__ import annotations

import itertools
import math
import statistics
from typing import TYPE_CHECKING, Any

from sqlmodel import col, select

from registry.catalog import queries
from registry.catalog.models import COMMITTED, Checkpoint, Validation
from registry.errors import NotFound
from registry.refs import CheckpointRef, check_name

if TYPE_CHECKING:
    from registry.context import Context


def young_daly_interval(cost_s: float, mtbf_s: float) -> float:
    return math.sqrt(2.0 * cost_s * mtbf_s)


def expected_loss(interval_s: float, rto_s: float) -> float:
    """Work lost per failure: half an interval on average, plus the time to get back."""
    return interval_s / 2.0 + rto_s


def economics(
    ctx: Context, run: str, *, project: str = "default", mtbf_s: float = 86400.0
) -> dict[str, Any]:
    check_name(run, "run name")
    check_name(project, "project name")
    ctx.authorize_read(project=project)
    with ctx.catalog.session() as s:
        run_row = queries.find_run(s, project, run)
        if run_row is None:
            raise NotFound(
                f"run {CheckpointRef(project, run, None).run_label} not found",
                "reg ls lists the runs",
            )
        rows = list(
            s.exec(
                select(Checkpoint)
                .where(Checkpoint.run_id == run_row.id, Checkpoint.state == COMMITTED)
                .order_by(col(Checkpoint.step))
            ).all()
        )
        ids = [r.id for r in rows]
        restores = [
            v.seconds
            for v in s.exec(
                select(Validation).where(col(Validation.checkpoint_id).in_(ids), Validation.passed)
            ).all()
            if v.seconds
        ]
    if not rows:
        raise NotFound(f"{run} has no committed checkpoints", "reg push-ckpt registers one")
    uploads = [r.upload_seconds for r in rows if r.upload_seconds]
    costs = [c for c in map(_save_cost, rows) if c is not None]
    cost = statistics.median(costs) if costs else None
    rate = (
        statistics.median(r.bytes / r.upload_seconds for r in rows if r.upload_seconds)
        if uploads
        else None
    )
    newest = rows[-1]
    transfer = newest.bytes / rate if rate else None
    restore = statistics.median(restores) if restores else None
    rto = (restore or 0.0) + (transfer or 0.0) if (restore or transfer) else None
    times = [r.committed_at or r.created_at for r in rows]
    gaps = [b - a for a, b in itertools.pairwise(times) if b > a]
    interval = statistics.median(gaps) if gaps else None
    out: dict[str, Any] = {
        "run": CheckpointRef(project, run, None).run_label,
        "checkpoints": len(rows),
        "bytes": newest.bytes,
        "save_cost_seconds": _r(cost),
        "transfer_rate_bytes_per_second": _r(rate),
        "restore_seconds": _r(restore),
        "rto_seconds": _r(rto),
        "observed_interval_seconds": _r(interval),
        "mtbf_seconds": mtbf_s,
        "advice": [],
    }
    if cost is not None:
        _advise(out, cost, interval, rto or 0.0, mtbf_s)
    if restore is None:
        out["advice"].append(
            "no passing validation yet: the restore time is unmeasured "
            f"(reg validate {CheckpointRef(project, run, newest.step)})"
        )
    return out


def _advise(
    out: dict[str, Any], cost: float, interval: float | None, rto: float, mtbf_s: float
) -> None:
    """The optimum interval, the overheads and the expected losses, and one sentence of advice."""
    best = young_daly_interval(cost, mtbf_s)
    out["optimal_interval_seconds"] = _r(best)
    out["overhead_at_optimal"] = _r(cost / best)
    out["expected_loss_at_optimal_seconds"] = _r(expected_loss(best, rto))
    if interval is None:
        return
    out["overhead_now"] = _r(cost / interval)
    out["expected_loss_now_seconds"] = _r(expected_loss(interval, rto))
    loss_now, loss_best = _human(expected_loss(interval, rto)), _human(expected_loss(best, rto))
    if interval > 1.5 * best:
        out["advice"].append(
            f"checkpoint more often: every {_human(best)} instead of {_human(interval)} "
            f"cuts the expected loss per failure from {loss_now} to {loss_best}"
        )
    elif interval < best / 1.5:
        out["advice"].append(
            f"checkpoint less often: every {_human(best)} instead of {_human(interval)} "
            f"cuts the save overhead from {cost / interval:.1%} to {cost / best:.1%} of "
            f"training time, for an expected loss per failure of {loss_best} instead of "
            f"{loss_now}"
        )
    else:
        out["advice"].append(
            f"the interval ({_human(interval)}) is near the optimum "
            f"({_human(best)}) for an MTBF of {_human(mtbf_s)}"
        )


def _r(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _human(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    return f"{seconds / 3600:.1f}h"


def _save_cost(row: Any) -> float | None:
    """What the checkpoint cost the training loop, in seconds (None: not measured)."""
    stall = (row.save_costs or {}).get("stall_seconds")
    if isinstance(stall, int | float) and not isinstance(stall, bool) and stall >= 0:
        return float(stall)
    return float(row.upload_seconds) if row.upload_seconds else None
