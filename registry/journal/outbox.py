"""Catalog events for the MLflow mirror (DESIGN §2): written into the outbox table in the same
transaction as the change they describe, so a change and its event commit together or not at
all; drained into MLflow after the command, never adding to its latency.
"""

from __future__ import annotations

import uuid
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from registry.core.detached import spawn_deliverer, spawn_drain
from registry.core.timeutil import now
from registry.trust.audit_chain.macs import normalized, outbox_mac

if TYPE_CHECKING:
    from sqlmodel import Session

    from registry.core.config import Settings


class EventKind(StrEnum):
    CHECKPOINT_COMMITTED = "checkpoint.committed"
    CHECKPOINT_VALIDATED = "checkpoint.validated"
    CHECKPOINT_COLLECTED = "checkpoint.collected"
    RELEASE_CREATED = "release.created"
    ALIAS_MOVED = "release.alias"
    RELEASE_STATUS = "release.status"
    CHECKPOINT_RESUME = "checkpoint.resume"  # a policy change changed its resume verdict
    CHECKPOINT_PROTECTION = "checkpoint.protection"  # pinned or unpinned: its expiry changed
    RUN_FINISHED = "run.finished"  # the training job ended (finished, failed or killed)
    CHECKPOINT_VERIFIED = "checkpoint.verified"  # every stored byte re-hashed (verify, a scrub)
    RELEASE_VERIFIED = "release.verified"
    # The run's checkpoint economics changed (a background save's cost measured, a restore)
    RUN_ECONOMICS = "run.economics"
    RELEASE_SIGNED = "release.signed"  # `reg sign-release` added files to a committed release
    # A protected alias's move asked for, approved (once per approver), rejected or cancelled:
    # for webhooks; the mirror shows only the move itself (release.alias).
    ALIAS_REQUESTED = "alias.requested"
    ALIAS_APPROVED = "alias.approved"
    ALIAS_REJECTED = "alias.rejected"


# The kinds by name, as emitters write them (`events.CHECKPOINT_COMMITTED`).
(
    CHECKPOINT_COMMITTED,
    CHECKPOINT_VALIDATED,
    CHECKPOINT_COLLECTED,
    RELEASE_CREATED,
    ALIAS_MOVED,
    RELEASE_STATUS,
    CHECKPOINT_RESUME,
    CHECKPOINT_PROTECTION,
    RUN_FINISHED,
    CHECKPOINT_VERIFIED,
    RELEASE_VERIFIED,
    RUN_ECONOMICS,
    RELEASE_SIGNED,
    ALIAS_REQUESTED,
    ALIAS_APPROVED,
    ALIAS_REJECTED,
) = EventKind


class EventSink(Protocol):
    def emit(self, session: Session, kind: str, **payload: Any) -> None:
        """Record an event in the caller's transaction."""
        ...


class Outbox:
    """The embedded sink: events go to the outbox table; `flush()`, when the command is done,
    starts a detached drain if any were written (`core.detached.spawn_drain`), and where the policy
    has webhooks, a detached deliverer (`webhooks.deliver`; `reg server` delivers from
    its own loop)."""

    def __init__(
        self, settings: Settings, *, webhooks: bool = False, audit_key: bytes | None = None
    ) -> None:
        self._settings = settings
        self._webhooks = webhooks  # embedded: deliver them after the command
        self._key = audit_key  # the server's (or its host's): each event carries its MAC
        self._written = False

    def emit(self, session: Session, kind: str, **payload: Any) -> None:
        from registry.catalog.models import OutboxEvent

        uid, ts, body = uuid.uuid4().hex, now(), normalized(payload)
        mac = outbox_mac(self._key, uid, ts, kind, body) if self._key else None
        session.add(OutboxEvent(ts=ts, kind=kind, payload=body, uid=uid, mac=mac))
        self._written = True

    def flush(self) -> None:
        if self._written:
            self._written = False

            spawn_drain(self._settings)
            if self._webhooks:
                spawn_deliverer(self._settings)
