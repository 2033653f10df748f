"""Holds: a checkpoint in use by a validation or a promotion is protected from retention.

A hold is a lease row (`use:<checkpoint id>:<token>`) renewed while the work runs; GC treats a
checkpoint with an unexpired hold as protected. A crashed holder's lease simply runs out.
"""

from __future__ import annotations

import contextlib
import os
import socket
import uuid
from collections.abc import Iterator
from typing import TYPE_CHECKING

from sqlalchemy import delete, update
from sqlmodel import col, select

from registry.catalog.models import Lease
from registry.errors import RegistryError
from registry.leases import Heartbeat
from registry.timeutil import now

if TYPE_CHECKING:
    from registry.api import Registry

HOLD_SECONDS = 120.0


def hold_name(checkpoint_id: int) -> str:
    return f"use:{checkpoint_id}:"


@contextlib.contextmanager
def hold(reg: Registry, checkpoint_id: int, purpose: str) -> Iterator[None]:
    name = f"{hold_name(checkpoint_id)}{uuid.uuid4().hex[:12]}"
    with reg.catalog.session(write=True) as s:
        s.add(
            Lease(
                name=name,
                holder=f"{reg.user} ({purpose})",
                host=socket.gethostname(),
                pid=os.getpid(),
                token=name,
                acquired_at=now(),
                expires_at=now() + HOLD_SECONDS,
            )
        )

    def renew() -> None:
        with reg.catalog.session(write=True) as s:
            s.exec(
                update(Lease).where(col(Lease.name) == name).values(expires_at=now() + HOLD_SECONDS)
            )

    try:
        with Heartbeat(renew, HOLD_SECONDS / 4):
            yield
    finally:
        with contextlib.suppress(RegistryError), reg.catalog.session(write=True) as s:
            s.exec(delete(Lease).where(col(Lease.name) == name))


def held_checkpoint_ids(reg: Registry) -> set[int]:
    with reg.catalog.session() as s:
        names = s.exec(
            select(Lease.name).where(col(Lease.name).startswith("use:"), Lease.expires_at > now())
        ).all()
    return {int(n.split(":")[1]) for n in names}
