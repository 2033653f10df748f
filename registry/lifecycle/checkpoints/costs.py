"""What checkpoints cost the training job (issue 15): a save's costs are written with its
commit (`checkpoint.save_costs`); each restore by the training loop adds a row
(`checkpoint_restore`). `reg show` shows both; the economics commands read them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlmodel import col, select

from registry.catalog import queries
from registry.catalog.models import CheckpointRestore
from registry.timeutil import iso, now

if TYPE_CHECKING:
    from sqlmodel import Session

    from registry.context import Context
    from registry.refs import CheckpointRef

SHOWN_RESTORES = 5  # the newest restores `reg show` lists


def record_restore(
    ctx: Context, ref: CheckpointRef, world_size: int, phases: dict[str, float]
) -> None:
    """One restore of `ref` by the training loop, with its phases (seconds; `bytes` read)."""
    with ctx.catalog.session(write=True) as s:
        _, ckpt = queries.resolve_checkpoint(s, ref)
        s.add(
            CheckpointRestore(
                checkpoint_id=ckpt.id or 0,
                created_at=now(),
                actor=ctx.actor,
                world_size=world_size,
                phases={k: float(v) for k, v in phases.items()},
            )
        )


def costs_json(session: Session, checkpoint_id: int, save_costs: Any) -> dict[str, Any]:
    """`save_costs` (None for a pushed directory) and the newest restores, newest first."""
    rows = session.exec(
        select(CheckpointRestore)
        .where(CheckpointRestore.checkpoint_id == checkpoint_id)
        .order_by(col(CheckpointRestore.id).desc())
        .limit(SHOWN_RESTORES)
    ).all()
    return {
        "save_costs": save_costs,
        "restores": [
            {"at": iso(r.created_at), "by": r.actor, "world_size": r.world_size, **r.phases}
            for r in rows
        ],
    }
