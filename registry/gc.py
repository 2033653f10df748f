"""Garbage collection of checkpoints under the retention policy (DESIGN §6).

This module explains protection for `reg show`; the retention planner lives in
`policies/retention.py`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlmodel import col, func, select

from registry.catalog.models import COMMITTED, Checkpoint, Run

if TYPE_CHECKING:
    from registry.api import Registry


def explain(reg: Registry, project: str, run: Run, ckpt: Checkpoint) -> dict[str, Any]:
    """Why `ckpt` is protected from retention, if it is."""
    reasons: list[str] = []
    if ckpt.state != COMMITTED:
        return {"protected": False, "reasons": []}
    if ckpt.pinned:
        reasons.append(
            f"pinned by {ckpt.pinned_by}" + (f": {ckpt.pin_reason}" if ckpt.pin_reason else "")
        )
    with reg.catalog.session() as s:
        newest = s.exec(
            select(func.max(col(Checkpoint.step))).where(
                Checkpoint.run_id == run.id, Checkpoint.state == COMMITTED
            )
        ).one()
    if newest == ckpt.step:
        reasons.append(f"newest committed checkpoint of {run.name}")
    if run.resumed_from_step == ckpt.step:
        reasons.append(f"{run.name} last resumed from it")
    return {"protected": bool(reasons), "reasons": reasons}
