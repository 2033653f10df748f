"""One claim protocol for pending rows (DESIGN §3): a push's step, a promotion's version.

A row is claimed while it is pending: its `ClaimColumns` say which token holds it, on which
host and process, and until when. Only the token's holder writes the row's objects or commits
the row, and every write it makes is guarded by the token (`guarded_update`), so a holder whose
claim was taken over finds out at its next write instead of overwriting the new holder's work.

    claim_columns(new_token())    what a new pending row gets
    take_over(session, row)       a stale claim (lease ran out, or holder gone) changes hands
    with held(catalog, claim):    renewed while the work runs; expired at once if the work fails,
        ...                       so a rerun takes over without waiting for the lease
    guarded_update(session, claim, state=...)   the commit: True only if the claim is still ours
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlalchemy import update
from sqlmodel import Session, col, select

from registry.catalog.leases import Heartbeat, is_stale
from registry.catalog.models import ClaimColumns
from registry.core.timeutil import iso, now
from registry.errors import RegistryError

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog

LEASE_SECONDS = 60.0


@dataclass(frozen=True, slots=True)
class Claim:
    table: type[ClaimColumns]
    row_id: int
    token: str
    fresh: bool = False  # a new row: no earlier attempt at it, so nothing of one to clear


def new_token() -> str:
    return uuid.uuid4().hex


def claim_columns(token: str) -> dict[str, Any]:
    """The claim columns of a row this process is about to hold with `token`."""
    return {
        "claim_token": token,
        "claim_host": socket.gethostname(),
        "claim_pid": os.getpid(),
        "lease_until": now() + LEASE_SECONDS,
    }


def is_live(row: ClaimColumns) -> bool:
    """Someone holds the row and may still be working on it."""
    return not is_stale(row.lease_until, row.claim_host, row.claim_pid)


def holder(row: ClaimColumns) -> str:
    return f"on {row.claim_host} (pid {row.claim_pid}), lease until {iso(row.lease_until)}"


def _where(table: type[ClaimColumns], row_id: int, token: str | None) -> list[Any]:
    return [
        col(table.id) == row_id,  # type: ignore[attr-defined]
        col(table.claim_token) == token,
        table.pending_clause(),  # type: ignore[attr-defined]
    ]


def take_over(session: Session, row: ClaimColumns, **values: Any) -> Claim | None:
    """Take a stale claim on `row` (and set `values` with it); None if another process took it
    first. The caller checked `is_live(row)` is false."""
    token = new_token()
    table = type(row)
    row_id: int = row.id  # type: ignore[attr-defined]
    taken = session.exec(
        update(table)
        .where(*_where(table, row_id, row.claim_token))
        .values(**claim_columns(token), **values)
    )
    return Claim(table, row_id, token) if taken.rowcount == 1 else None


def guarded_update(session: Session, claim: Claim, **values: Any) -> bool:
    """Update the claimed row only while the claim is still ours and the row pending."""
    done = session.exec(
        update(claim.table).where(*_where(claim.table, claim.row_id, claim.token)).values(**values)
    )
    return done.rowcount == 1


def still_held(catalog: Catalog, claim: Claim) -> bool:
    with catalog.session() as s:
        found = s.exec(
            select(claim.table).where(*_where(claim.table, claim.row_id, claim.token))
        ).first()
        return found is not None


def renew(catalog: Catalog, claim: Claim) -> None:
    with catalog.session(write=True) as s:
        guarded_update(s, claim, lease_until=now() + LEASE_SECONDS)


def expire(catalog: Catalog, claim: Claim) -> None:
    """Let the next attempt take over at once (what was written so far gets reused)."""
    with contextlib.suppress(RegistryError), catalog.session(write=True) as s:
        guarded_update(s, claim, lease_until=0.0)


@contextlib.contextmanager
def held(catalog: Catalog, claim: Claim) -> Iterator[None]:
    """Renew the claim while the block runs; expire it if the block fails."""
    try:
        with Heartbeat(lambda: renew(catalog, claim), LEASE_SECONDS / 4):
            yield
    except BaseException:
        expire(catalog, claim)
        raise
