"""What checkpoints cost the training job: a save's costs are written with its
commit (`checkpoint.save_costs`); each restore by the training loop adds a row
(`checkpoint_restore`). `reg show` shows both; the economics commands read them."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from sqlmodel import col, select

from registry.catalog import queries
from registry.catalog.models import CheckpointRestore
from registry.core.timeutil import iso, now
from registry.economics.records import classify, emit_economics
from registry.errors import UsageError

if TYPE_CHECKING:
    from sqlmodel import Session

    from registry.core.refs import CheckpointRef
    from registry.lifecycle.context import Context

SHOWN_RESTORES = 5  # the newest restores `reg show` lists


def record_restore(
    ctx: Context, ref: CheckpointRef, world_size: int, phases: dict[str, float]
) -> None:
    """One restore of `ref` by the training loop, with its phases (seconds; `bytes` read)."""
    with ctx.catalog.session(write=True) as s:
        run, ckpt = queries.resolve_checkpoint(s, ref, local=True)  # a tier-0 step too
        restore = CheckpointRestore(
            checkpoint_id=ckpt.id or 0,
            created_at=now(),
            actor=ctx.actor,
            world_size=world_size,
            phases={k: float(v) for k, v in phases.items()},
        )
        classify(s, run, ckpt.step, restore)  # a failure, a planned restart, ...
        s.add(restore)
        emit_economics(ctx, s, ref.project, ref.run, run)  # the RTO changed: MLflow follows


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
            {
                "at": iso(r.created_at),
                "by": r.actor,
                "world_size": r.world_size,
                "phases": r.phases,
                "kind": r.kind,
            }
            for r in rows
        ],
    }


MAX_COST_DEPTH, MAX_COST_ITEMS = 4, 200_000


def check_save_costs(doc: object) -> dict[str, Any] | None:
    """A save's costs as a client reports them (through `reg server`): an object at most
    MAX_COST_DEPTH deep, of finite numbers, booleans, short strings and lists, no more than
    MAX_COST_ITEMS values in all (a 4,096-rank save has ~25,000)."""
    if doc is None:
        return None
    if not isinstance(doc, dict):
        raise UsageError("save_costs must be an object")
    count = 0

    def check(value: object, depth: int) -> None:
        nonlocal count
        count += 1
        if count > MAX_COST_ITEMS or depth > MAX_COST_DEPTH:
            raise UsageError("save_costs is too large or too deep")
        if isinstance(value, dict):
            for k, v in value.items():
                if not isinstance(k, str) or len(k) > 64:
                    raise UsageError("save_costs keys are short strings")
                check(v, depth + 1)
        elif isinstance(value, list):
            for v in value:
                check(v, depth + 1)
        elif isinstance(value, float) and not math.isfinite(value):
            raise UsageError("save_costs holds a non-finite number")
        elif isinstance(value, str):
            if len(value) > 256:
                raise UsageError("save_costs strings are at most 256 characters")
        elif value is not None and not isinstance(value, bool | int | float):
            raise UsageError("save_costs holds numbers, booleans, strings and lists")

    check(doc, 0)
    return doc
