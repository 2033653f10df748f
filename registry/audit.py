"""The append-only audit log: every mutating action and every denial (reads are not audited)."""

from __future__ import annotations

from typing import Any

from sqlmodel import Session, col, select

from registry.catalog.models import AuditEvent
from registry.timeutil import iso, now

ALLOWED, DENIED, FAILED = "allowed", "denied", "failed"


def record(
    session: Session,
    actor: str,
    action: str,
    target: str,
    outcome: str = ALLOWED,
    /,
    **details: Any,
) -> None:
    session.add(
        AuditEvent(
            ts=now(),
            actor=actor,
            action=action,
            target=target,
            outcome=outcome,
            details={k: v for k, v in details.items() if v is not None},
        )
    )


def query(
    session: Session,
    *,
    since: float | None = None,
    actor: str | None = None,
    action: str | None = None,
    limit: int | None = None,
) -> list[dict[str, Any]]:
    stmt = select(AuditEvent).order_by(col(AuditEvent.id))
    if since is not None:
        stmt = stmt.where(AuditEvent.ts >= since)
    if actor:
        stmt = stmt.where(AuditEvent.actor == actor)
    if action:
        stmt = stmt.where(AuditEvent.action == action)
    rows = session.exec(stmt).all()
    if limit:
        rows = rows[-limit:]
    return [
        {
            "ts": iso(r.ts),
            "actor": r.actor,
            "action": r.action,
            "target": r.target,
            "outcome": r.outcome,
            "details": r.details,
        }
        for r in rows
    ]
