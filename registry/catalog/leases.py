"""Leases in the catalog: how long a holder may keep something without renewing it, and
whether the holder is gone (DESIGN §3).

Two users share this module:
- claims on pending rows (a push's step, a promotion's version): `registry.catalog.claims`;
- named leases, rows of the `lease` table: one GC at a time (`gc`), one MLflow drain at a time
  (`mlflow-drain`), and holds on checkpoints in use by a validation or a promotion
  (`use:<checkpoint id>:<token>`), which retention treats as protected.

A lease is taken over once it ran out, or at once when its holder ran on this host and its
process no longer exists. Every take-over is a guarded write (the old token in the WHERE), so
two processes racing for one lease never both win, on SQLite or PostgreSQL.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from sqlalchemy import delete, update
from sqlalchemy.exc import IntegrityError as DBIntegrityError
from sqlmodel import Session, col, select

from registry.catalog.models import Lease
from registry.core.timeutil import now
from registry.errors import CatalogLocked, RegistryError

if TYPE_CHECKING:
    from registry.catalog.engine import Catalog

HOLD_PREFIX = "use:"
HOLD_SECONDS = 120.0


def holder_gone(host: str | None, pid: int | None) -> bool:
    """True when the holder ran on this host and its process no longer exists."""
    if host != socket.gethostname() or not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def is_stale(lease_until: float | None, host: str | None, pid: int | None) -> bool:
    """A lease may be taken over once it ran out or its holder died."""
    return lease_until is None or lease_until < now() or holder_gone(host, pid)


class Heartbeat:
    """Calls `renew` every `interval` seconds on a thread while the block runs. A failed renewal
    is retried on the next beat (every commit checks its token anyway)."""

    def __init__(self, renew: Callable[[], object], interval: float) -> None:
        self._renew, self._interval = renew, interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reg-lease", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            with contextlib.suppress(RegistryError):
                self._renew()


# -- named leases -------------------------------------------------------------------------------


def try_acquire(
    catalog: Catalog, name: str, holder: str, seconds: float
) -> tuple[str | None, Lease | None]:
    """Take the named lease: (token, None), or (None, the live holder's lease)."""
    token = uuid.uuid4().hex
    values: dict[str, Any] = {
        "holder": holder,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "token": token,
        "acquired_at": now(),
        "expires_at": now() + seconds,
    }
    for _ in range(3):  # a lease given back mid-race is simply taken on the next try
        with catalog.session(write=True) as s:
            lease = s.get(Lease, name)
            if lease is None:
                try:
                    with s.begin_nested():
                        s.add(Lease(name=name, **values))
                    return token, None
                except DBIntegrityError:
                    lease = _reread(s, name)
                    if lease is None:
                        continue
            if not is_stale(lease.expires_at, lease.host, lease.pid):
                s.expunge(lease)
                return None, lease
            taken = s.exec(
                update(Lease)
                .where(col(Lease.name) == name, col(Lease.token) == lease.token)
                .values(**values)
            )
            if taken.rowcount == 1:
                return token, None
            lease = _reread(s, name)
            if lease is not None:
                s.expunge(lease)
                return None, lease
    raise CatalogLocked(f"lease {name} kept changing hands", "retry")


def _reread(session: Session, name: str) -> Lease | None:
    return session.exec(
        select(Lease).where(Lease.name == name).execution_options(populate_existing=True)
    ).first()


def renew(catalog: Catalog, name: str, token: str, seconds: float) -> bool:
    """Extend the lease; False when it is no longer ours."""
    with catalog.session(write=True) as s:
        done = s.exec(
            update(Lease)
            .where(col(Lease.name) == name, col(Lease.token) == token)
            .values(expires_at=now() + seconds)
        )
        return done.rowcount == 1


def release(catalog: Catalog, name: str, token: str) -> None:
    """Give the lease back; if that fails, it runs out by itself."""
    with contextlib.suppress(RegistryError), catalog.session(write=True) as s:
        s.exec(delete(Lease).where(col(Lease.name) == name, col(Lease.token) == token))


@contextlib.contextmanager
def renewed(catalog: Catalog, name: str, token: str, seconds: float) -> Iterator[None]:
    """Keep a taken lease alive while the block runs, and give it back after."""
    try:
        with Heartbeat(lambda: renew(catalog, name, token, seconds), seconds / 4):
            yield
    finally:
        release(catalog, name, token)


# -- holds on checkpoints in use ----------------------------------------------------------------


@contextlib.contextmanager
def hold(catalog: Catalog, holder: str, checkpoint_id: int, purpose: str) -> Iterator[None]:
    """Protect a checkpoint from retention while the block runs (a validation, a promotion).
    A crashed holder's hold simply runs out."""
    name, token = take_hold(catalog, holder, checkpoint_id, purpose, HOLD_SECONDS)
    with renewed(catalog, name, token, HOLD_SECONDS):
        yield


def take_hold(
    catalog: Catalog, holder: str, checkpoint_id: int, purpose: str, seconds: float
) -> tuple[str, str]:
    """A hold for `seconds` that nobody renews (a remote validator's run): (name, token) to
    give it back with `release`."""
    name = f"{HOLD_PREFIX}{checkpoint_id}:{uuid.uuid4().hex[:12]}"
    token, _ = try_acquire(catalog, name, f"{holder} ({purpose})", seconds)
    assert token is not None  # the name is new
    return name, token


def held_checkpoint_ids(session: Session) -> set[int]:
    """Checkpoints with a live hold, read in the caller's transaction."""
    names = session.exec(
        select(Lease.name).where(
            col(Lease.name).startswith(HOLD_PREFIX), col(Lease.expires_at) > now()
        )
    ).all()
    return {int(n.split(":")[1]) for n in names}
