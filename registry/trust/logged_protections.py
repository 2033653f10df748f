"""Behind the server, the protections GC reads from catalog rows that the server updates in
place (a checkpoint's pin, a run's resume point, a release's yank) are checked against the
signed audit log before anything is deleted.

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

from registry.catalog.models import AuditEvent
from registry.core.refs import CheckpointRef, parse_checkpoint_ref
from registry.trust.audit_chain import macs

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
            if not _newer_push_after(session, key, ref, e.ts):
                out.setdefault(e.target, "its run resumed from it (signed audit log)")
    return out


def signed_targets(
    session: Session, key: bytes, actions: tuple[str, ...], targets: Sequence[str]
) -> set[str]:
    """The targets among `targets` that a signed event of one of `actions` names."""
    out: set[str] = set()
    for start in range(0, len(targets), _IN):
        out.update(
            e.target for e in _signed(session, key, actions, list(targets[start : start + _IN]))
        )
    return out


def _signed(
    session: Session, key: bytes, actions: tuple[str, ...], targets: list[str]
) -> list[AuditEvent]:
    """The signed events, in the order of their signed times (an event's row id is not signed:
    a copy of an old event under a new id must not count as newer); a uid seen twice (a copy)
    counts once."""
    rows = session.exec(
        select(AuditEvent).where(
            col(AuditEvent.action).in_(actions),
            AuditEvent.outcome == "allowed",
            col(AuditEvent.target).in_(targets),
        )
    )
    seen: set[str] = set()
    out = []
    for e in sorted(rows, key=lambda e: (e.ts, e.id or 0)):
        if e.uid in seen or not macs.event_signed(key, e):
            continue
        seen.add(e.uid or "")
        out.append(e)
    return out


def _newer_push_after(session: Session, key: bytes, resumed: CheckpointRef, after: float) -> bool:
    """A signed push of a newer step of the run, signed as later than the resume (which lifts
    the protection)."""
    prefix = resumed.run_label + "@step"
    rows = session.exec(
        select(AuditEvent).where(
            AuditEvent.action == "push",
            AuditEvent.outcome == "allowed",
            col(AuditEvent.ts) > after,
            col(AuditEvent.target).startswith(prefix, autoescape=True),
        )
    )
    for e in rows:
        step = e.target[len(prefix) :]
        if step.isdigit() and int(step) > (resumed.step or 0) and macs.event_signed(key, e):
            return True
    return False
