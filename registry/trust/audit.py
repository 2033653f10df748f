"""The append-only audit log: every mutating action and every denial (reads are not audited)."""

from __future__ import annotations

import uuid
from typing import Any

from sqlmodel import Session, col, select

from registry.catalog.models import AuditEvent
from registry.core.timeutil import iso, now
from registry.trust.audit_chain.macs import event_mac, normalized

ALLOWED, DENIED, FAILED = "allowed", "denied", "failed"


def record(
    session: Session,
    actor: str,
    action: str,
    target: str,
    outcome: str = ALLOWED,
    /,
    *,
    audit_key: bytes | None = None,
    **details: Any,
) -> None:
    """Add the event to the caller's transaction. With the audit key it is signed here (a MAC
    of its own content and a random uid: no shared row, so concurrent writers never wait on
    each other); the sealer chains it later (`registry.trust.audit_chain`)."""
    content: dict[str, Any] = {
        "uid": uuid.uuid4().hex if audit_key else None,
        "ts": now(),
        "actor": actor,
        "action": action,
        "target": target,
        "outcome": outcome,
        "details": normalized({k: v for k, v in details.items() if v is not None}),
    }
    mac = event_mac(audit_key, content) if audit_key else None
    session.add(AuditEvent(**content, mac=mac))


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
