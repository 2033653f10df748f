"""Lost tier-0 steps: committed on their nodes' disks only, every copy gone before the store
had one.

Such a step was never durable: nothing can restore it or copy it to the store. It is marked
`lost` (not collected: a collected step was in the store and retention deleted it, and stays a
tombstone) as soon as the catalog learns that the last node holding it no longer does and
nobody is copying it: a node's eviction, a restore that finds the node's directory gone, a claim
on the step, or GC. Saving the step again is a new attempt: the row becomes pending under the new
claim, and the lost attempt's file, key and tier rows and whatever its copy had put in the store
go (the audit log keeps what was lost: its manifest digest, bytes and nodes).

    held_copies(session, id)          node -> files, for each node still holding a copy
    lose_if_gone(ctx, session, row, ref, why)   local -> lost when no copy is left
    new_attempt(session, row)         lost -> pending under a new claim (the caller's claim)
    hold_lost / release_lost          GC's hold while it clears a lost step's leftovers
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, or_, update
from sqlmodel import col, select

from registry.catalog import claims
from registry.catalog.claims import Claim
from registry.catalog.models import (
    LOCAL,
    LOST,
    PENDING,
    Checkpoint,
    CheckpointFile,
    CheckpointKeys,
    CheckpointTier,
)
from registry.core.timeutil import now

if TYPE_CHECKING:
    from sqlmodel import Session

    from registry.core.refs import CheckpointRef
    from registry.lifecycle.context import Context

LOST_REASON = "saved at tier 0 only, and every node's copy was gone before it reached the store"


def held_copies(session: Session, checkpoint_id: int) -> dict[str, list[str]]:
    """node -> the files its tier-0 copy holds, for each node that still holds one."""
    copies = session.exec(
        select(CheckpointTier).where(
            CheckpointTier.checkpoint_id == checkpoint_id,
            CheckpointTier.tier == 0,
            col(CheckpointTier.evicted_at).is_(None),
        )
    ).all()
    return {c.node: list(c.files) for c in copies}


def lose_if_gone(ctx: Context, session: Session, row: Checkpoint, ref: CheckpointRef) -> bool:
    """`row` (a tier-0 step) is lost if no node holds a copy and nobody holds a claim on its
    copy to the store (a live copy may have read every file before the last one went)."""
    if row.state != LOCAL or held_copies(session, row.id or 0) or claims.is_live(row):
        return False
    nodes = session.exec(
        select(CheckpointTier.node).where(
            CheckpointTier.checkpoint_id == row.id, CheckpointTier.tier == 0
        )
    ).all()
    done = session.exec(
        update(Checkpoint)
        .where(
            col(Checkpoint.id) == row.id,
            col(Checkpoint.state) == LOCAL,
            col(Checkpoint.claim_token) == row.claim_token  # nobody took its copy meanwhile
            if row.claim_token is not None
            else col(Checkpoint.claim_token).is_(None),
        )
        .values(state=LOST, claim_token=None, claim_host=None, claim_pid=None, lease_until=None)
    )
    if not done.rowcount:
        return False
    session.refresh(row)
    ctx.audit(
        session,
        "lost",
        str(ref),
        reason=LOST_REASON,
        manifest_sha256=row.manifest_sha256,
        bytes=row.bytes,
        nodes=sorted(nodes),
    )
    return True


def hold_lost(session: Session, row_id: int) -> str | None:
    """GC's hold on lost step `row_id` while it deletes what the step's copy left in the store:
    no new attempt takes the row (and writes there) meanwhile. Its token, or None if the row
    is taken or held."""
    token = claims.new_token()
    held = session.exec(
        update(Checkpoint)
        .where(
            col(Checkpoint.id) == row_id,
            col(Checkpoint.state) == LOST,
            or_(col(Checkpoint.claim_token).is_(None), col(Checkpoint.lease_until) < now()),
        )
        .values(**claims.claim_columns(token))
    )
    return token if held.rowcount == 1 else None


def release_lost(session: Session, row_id: int, token: str) -> None:
    session.exec(
        update(Checkpoint)
        .where(col(Checkpoint.id) == row_id, col(Checkpoint.claim_token) == token)
        .values(claim_token=None, claim_host=None, claim_pid=None, lease_until=None)
    )


def new_attempt(session: Session, row: Checkpoint, **values: Any) -> Claim | None:
    """A new attempt at lost step `row`: pending again under a new claim, its content empty, the
    lost attempt's content rows deleted. None if another attempt took it first."""
    token = claims.new_token()
    fresh = Checkpoint(run_id=row.run_id, step=row.step, created_at=now(), pushed_by="")
    content = fresh.model_dump(
        exclude={"id", "run_id", "step", "pinned", "pin_reason", "pinned_by"}
    )
    taken = session.exec(
        update(Checkpoint)
        .where(
            col(Checkpoint.id) == row.id,
            col(Checkpoint.state) == LOST,
            # not while GC clears what its copy left in the store (`hold_lost`)
            or_(col(Checkpoint.claim_token).is_(None), col(Checkpoint.lease_until) < now()),
        )
        .values(**(content | claims.claim_columns(token) | {"state": PENDING} | values))
    )
    if taken.rowcount != 1:
        return None
    for table in (CheckpointFile, CheckpointKeys, CheckpointTier):
        session.exec(delete(table).where(col(table.checkpoint_id) == row.id))
    return Claim(Checkpoint, row.id or 0, token)
