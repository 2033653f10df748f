"""Behind the server, the protections GC reads from catalog rows that the server updates in
place (a checkpoint's pin, a run's resume point) are checked against the signed audit log
before anything is deleted (issue 32).

Whoever can write the catalog around the server could unpin a checkpoint or clear a run's resume
point, and the next GC would collect it under the retention rules. The audit log holds every
real pin, unpin, resume and push, each signed with the server's key: a checkpoint the newest
signed pin/unpin event says is pinned, or that the run's newest signed resume event names with
no signed push of a newer step after it, is kept whatever its row says, and GC says so. Forged
events (no valid MAC) count for nothing; a signed event cannot be removed by the runtime role
(no DELETE), and by the owner only as `reg audit verify` would report.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlmodel import Session, col, select

from registry.audit_chain import macs
from registry.catalog.models import AuditEvent
from registry.refs import CheckpointRef, parse_checkpoint_ref

_IN = 500


def protected_by_log(session: Session, key: bytes, refs: Sequence[str]) -> dict[str, str]:
    """ref -> why the signed audit log keeps it, for the refs it keeps."""
    out: dict[str, str] = {}
    for start in range(0, len(refs), _IN):
        chunk = list(refs[start : start + _IN])
        latest: dict[str, str] = {}
        for e in _signed(session, key, ("pin", "unpin"), chunk):
            latest[e.target] = e.action
        out.update(
            {ref: "pinned in the signed audit log" for ref, act in latest.items() if act == "pin"}
        )
        for e in _signed(session, key, ("resume",), chunk):
            ref = parse_checkpoint_ref(e.target)
            if not _newer_push_after(session, key, ref, e.id or 0):
                out.setdefault(e.target, "its run resumed from it (signed audit log)")
    return out


def _signed(
    session: Session, key: bytes, actions: tuple[str, ...], targets: list[str]
) -> list[AuditEvent]:
    rows = session.exec(
        select(AuditEvent)
        .where(
            col(AuditEvent.action).in_(actions),
            AuditEvent.outcome == "allowed",
            col(AuditEvent.target).in_(targets),
        )
        .order_by(col(AuditEvent.id))
    )
    return [e for e in rows if macs.same(e.mac, macs.event_mac(key, macs.event_content(e)))]


def _newer_push_after(session: Session, key: bytes, resumed: CheckpointRef, after: int) -> bool:
    """A signed push of a newer step of the run, after the resume event (which lifts it)."""
    prefix = resumed.run_label + "@step"
    rows = session.exec(
        select(AuditEvent).where(
            AuditEvent.action == "push",
            AuditEvent.outcome == "allowed",
            col(AuditEvent.id) > after,
            col(AuditEvent.target).startswith(prefix, autoescape=True),
        )
    )
    for e in rows:
        step = e.target[len(prefix) :]
        if (
            step.isdigit()
            and int(step) > (resumed.step or 0)
            and macs.same(e.mac, macs.event_mac(key, macs.event_content(e)))
        ):
            return True
    return False
