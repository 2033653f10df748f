"""The outbox: catalog events for the MLflow mirror, written in the catalog transaction that
makes the change (so a change and its event commit together or not at all)."""

from __future__ import annotations

from typing import Any

from sqlmodel import Session

from registry.catalog.models import OutboxEvent
from registry.timeutil import now

CHECKPOINT_COMMITTED = "checkpoint.committed"
CHECKPOINT_VALIDATED = "checkpoint.validated"
CHECKPOINT_COLLECTED = "checkpoint.collected"
RELEASE_CREATED = "release.created"
ALIAS_MOVED = "release.alias"
RELEASE_STATUS = "release.status"


def emit(session: Session, kind: str, **payload: Any) -> None:
    session.add(OutboxEvent(ts=now(), kind=kind, payload=payload))
