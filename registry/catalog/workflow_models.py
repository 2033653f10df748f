"""The release workflow's tables (migration 0019), beside `registry.catalog.models`.

alias_request     a move of a protected alias, asked for: append-only
alias_decision    an approval, a rejection, or a cancellation (a yank or deprecation of its
                  version) of a request: append-only; a request's state is derived from
                  them and its expiry (`registry.lifecycle.alias_requests`)
webhook_cursor    how far into the outbox each subscriber's deliveries were made
webhook_delivery  one POST of one event to one subscriber, retried until a 2xx reply
"""

from __future__ import annotations

from sqlalchemy import BigInteger, Index, Text, UniqueConstraint
from sqlmodel import Field, SQLModel

APPROVED, REJECTED, CANCELLED = "approved", "rejected", "cancelled"
OPEN, EXPIRED = "open", "expired"  # derived, never stored
PENDING, DELIVERED, GIVEN_UP = "pending", "delivered", "given-up"


class AliasRequest(SQLModel, table=True):
    """A protected alias's move, waiting for `approvals_needed` distinct approvers."""

    __tablename__ = "alias_request"
    id: int | None = Field(default=None, primary_key=True)
    model_id: int = Field(foreign_key="model.id", index=True)
    alias: str = Field(max_length=128)
    version: int
    release_id: int = Field(foreign_key="release.id")
    requested_by: str
    requested_at: float
    expires_at: float
    approvals_needed: int
    rule: str = Field(max_length=128)  # the protected_aliases entry's alias glob


class AliasDecision(SQLModel, table=True):
    """One principal's decision on a request: approved, rejected or cancelled."""

    __tablename__ = "alias_decision"
    id: int | None = Field(default=None, primary_key=True)
    request_id: int = Field(foreign_key="alias_request.id", index=True)
    decision: str = Field(max_length=16)
    by: str
    at: float
    reason: str | None = None


class WebhookCursor(SQLModel, table=True):
    __tablename__ = "webhook_cursor"
    subscriber: str = Field(primary_key=True, max_length=64)
    outbox_id: int = Field(sa_type=BigInteger)  # fanned out up to here
    since: float  # when the subscriber first got events: none older reach it
    url: str = Field(max_length=2048)  # a name reused for another URL starts afresh


class WebhookDelivery(SQLModel, table=True):
    __tablename__ = "webhook_delivery"
    __table_args__ = (
        UniqueConstraint("subscriber", "event_id"),
        Index("ix_webhook_delivery_due", "status", "next_attempt_at"),
    )
    id: int | None = Field(default=None, primary_key=True)
    subscriber: str = Field(max_length=64)
    event_id: str = Field(max_length=64)
    event: str = Field(max_length=32)
    outbox_id: int = Field(sa_type=BigInteger)
    body: str = Field(sa_type=Text)  # the exact bytes every attempt sends
    body_mac: str | None = Field(default=None, max_length=64)  # `macs.delivery_mac`, with a key
    created_at: float
    status: str = Field(default=PENDING, max_length=16)
    attempts: int = 0
    next_attempt_at: float
    last_error: str | None = None
    last_status: int | None = None
    delivered_at: float | None = None
