"""Write a decision to the journal before the catalog commits it (write-ahead).

The order is the point. Written first, a decision the catalog committed is always in the
journal: a failed store write raises inside the caller's transaction, which then rolls back, so
the decision is refused rather than kept where a rebuild cannot find it. If the catalog then
fails to commit, an `aborted` event naming it is written (best effort) and the rebuild ignores
both. What is left is a process that dies between the two, after the event and before the
commit: its event stays live and a rebuild replays a decision its author saw fail (the same
decision, made by someone allowed to make it).

The store write happens inside the caller's catalog transaction (SQLite holds its write lock
meanwhile): one small put per decision.
"""

from __future__ import annotations

import hashlib
import time
import uuid
import warnings
from typing import TYPE_CHECKING, Any

from sqlalchemy import event as sa_event

from registry.errors import ObjectExists, RegistryError, UsageError
from registry.journal.event import ABORTED, MAX_BYTES, Event, sign
from registry.trust.audit_chain.keys import key_id

if TYPE_CHECKING:
    from sqlmodel import Session

    from registry.lifecycle.context import Context


def record(
    ctx: Context,
    session: Session,
    kind: str,
    target: dict[str, Any],
    fact: dict[str, Any],
    *,
    ts: float | None = None,
) -> Event:
    """Write the event now; mark it aborted if `session`'s transaction ends uncommitted.
    `ts` is the time the catalog row records (so a replay can recognize the row).

    The abort is armed before the put: a put that fails may still have landed (its reply
    lost), so a failed put is marked aborted too, best effort."""
    made = make(ctx, kind, target, fact, ts)
    done = _abort_unless_committed(ctx, session, made)
    try:
        store(ctx, made)
    except BaseException as exc:
        done["ended"] = True  # marked here, not again when the transaction ends
        abort(ctx, made, f"its store write failed: {type(exc).__name__}")
        raise
    return made


def put(
    ctx: Context,
    kind: str,
    target: dict[str, Any],
    fact: dict[str, Any],
    ts: float | None,
    actor: str | None = None,
) -> Event:
    """Write one event now (`actor`: who decided, if not this Context's principal)."""
    made = make(ctx, kind, target, fact, ts, actor)
    store(ctx, made)
    return made


def make(
    ctx: Context,
    kind: str,
    target: dict[str, Any],
    fact: dict[str, Any],
    ts: float | None,
    actor: str | None = None,
) -> Event:
    """The event, signed where there is a key; its id carries the decision's time (a replay
    requires the two to agree)."""
    ns = time.time_ns() if ts is None else int(ts * 1e9)
    made = Event(
        id=f"{ns:020d}-{uuid.uuid4().hex}",
        kind=kind,
        ts=ns / 1e9 if ts is None else ts,
        actor=actor or ctx.actor,
        target=target,
        fact=fact,
        key_id=key_id(ctx.audit_key) if ctx.audit_key else None,
    )
    if ctx.audit_key:
        made = Event(**{**_fields(made), "mac": sign(made.body(), ctx.audit_key)})
    if len(made.to_bytes()) > MAX_BYTES:
        raise UsageError(
            f"{made.describe()}: {len(made.to_bytes())} bytes to journal, over {MAX_BYTES}; "
            "refused",
            "a policy or validation that large is not one reg writes; make it smaller",
        )
    return made


def store(ctx: Context, made: Event) -> None:
    """Put the event (immutable: read-only on a local store, Object Lock as releases where the
    bucket has it). An object already at its key is ours if it holds our bytes (a retried put
    whose first try landed): that is success; anything else there is a conflict."""
    data = made.to_bytes()
    try:
        ctx.store.put_bytes(made.key, data, immutable=True)
    except ObjectExists:
        try:
            there = ctx.store.get_bytes(made.key)
        except RegistryError:
            there = b""
        if hashlib.sha256(there).digest() != hashlib.sha256(data).digest():
            raise


def _fields(e: Event) -> dict[str, Any]:
    return {name: getattr(e, name) for name in Event.__slots__}


def _abort_unless_committed(ctx: Context, session: Session, written: Event) -> dict[str, bool]:
    session.connection()  # the transaction the decision is in has begun (autobegin)
    tx = session.get_transaction()
    while tx is not None and tx.parent is not None:
        tx = tx.parent
    state = {"committed": False, "ended": False}

    def committed(_: Any) -> None:
        state["committed"] = True

    def ended(_: Any, ended_tx: Any) -> None:
        # (listeners stay: removing one while SQLAlchemy dispatches is an error; the
        # session is short-lived)
        if ended_tx is not tx or state["ended"]:
            return
        state["ended"] = True
        if not state["committed"]:
            abort(ctx, written, "the catalog did not commit it")

    sa_event.listen(session, "after_commit", committed)
    sa_event.listen(session, "after_transaction_end", ended)
    return state


def abort(ctx: Context, written: Event, why: str) -> None:
    """Write the `aborted` event for `written`; a failure is a warning (the event then stays
    live, and a rebuild would replay it: said in the warning)."""
    try:
        put(ctx, ABORTED, {"event": written.id}, {"error": why}, None)
    except (RegistryError, OSError) as exc:
        warnings.warn(
            f"{written.key} ({written.describe()}) was not committed, and marking it aborted "
            f"failed: {exc}; a catalog rebuild would replay it",
            stacklevel=2,
        )
