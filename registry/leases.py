"""Leases shared by every claim in the catalog (a push's step, a promotion's version, the GC,
the MLflow drain, holds): who holds it, until when, and whether the holder is gone."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING

from registry.errors import RegistryError
from registry.timeutil import now

if TYPE_CHECKING:
    from registry.api import Registry
    from registry.catalog.models import Lease


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
    is retried on the next beat (every commit checks its claim token anyway)."""

    def __init__(self, renew: Callable[[], None], interval: float) -> None:
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


# -- named leases in the catalog (one GC at a time, one MLflow drain at a time) ----------------


def try_acquire(reg: Registry, name: str, seconds: float) -> tuple[str | None, Lease | None]:
    """Take the named lease: (token, None), or (None, the live holder's lease)."""
    from registry.catalog.models import Lease

    token = uuid.uuid4().hex
    with reg.catalog.session(write=True) as s:
        lease = s.get(Lease, name)
        if (
            lease is not None
            and lease.expires_at > now()
            and not holder_gone(lease.host, lease.pid)
        ):
            s.expunge(lease)
            return None, lease
        if lease is None:
            lease = Lease(
                name=name, holder="", host="", pid=0, token="", acquired_at=0.0, expires_at=0.0
            )
        lease.holder, lease.host, lease.pid, lease.token = (
            reg.user,
            socket.gethostname(),
            os.getpid(),
            token,
        )
        lease.acquired_at, lease.expires_at = now(), now() + seconds
        s.add(lease)
    return token, None


def renew(reg: Registry, name: str, token: str, seconds: float) -> None:
    from sqlalchemy import update
    from sqlmodel import col

    from registry.catalog.models import Lease

    with reg.catalog.session(write=True) as s:
        s.exec(
            update(Lease)
            .where(col(Lease.name) == name, col(Lease.token) == token)
            .values(expires_at=now() + seconds)
        )


def release(reg: Registry, name: str, token: str) -> None:
    """Give the lease back; if that fails, it runs out by itself."""
    from sqlalchemy import delete
    from sqlmodel import col

    from registry.catalog.models import Lease

    with contextlib.suppress(RegistryError), reg.catalog.session(write=True) as s:
        s.exec(delete(Lease).where(col(Lease.name) == name, col(Lease.token) == token))
