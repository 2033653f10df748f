"""Which catalog events a webhook subscriber receives, and the body it gets.

The body is JSON with a stable schema (`reg.webhook/1`):

    {"schema": "reg.webhook/1", "id": "evt_…", "event": "alias.moved",
     "occurred_at": "2026-12-03T18:00:00Z", "data": {...}}

`id` is the same for every subscriber and every attempt of one event, so a receiver drops a
repeat by it. `data` holds the fields `FIELDS` names for the event, null where unknown; new
fields may be added, none removed or renamed within a schema.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from registry.core.timeutil import iso
from registry.journal import outbox as events

SCHEMA = "reg.webhook/1"
PING = "ping"  # `reg webhook test`: never from the outbox

_CHECKPOINT = ("project", "run", "step", "ref")
FIELDS: dict[str, tuple[str, ...]] = {
    "checkpoint.committed": (
        *_CHECKPOINT,
        "world_size",
        "bytes",
        "uri",
        "manifest_sha256",
        "resumable",
        "missing_state",
        "pushed_by",
        "expires_at",
    ),
    "checkpoint.deleted": (*_CHECKPOINT, "reason"),
    "validation.recorded": (
        *_CHECKPOINT,
        "passed",
        "device",
        "device_name",
        "mode",
        "validation_id",
        "seconds",
    ),
    "release.promoted": (
        "model",
        "version",
        "release",
        "sha256",
        "uri",
        "source",
        "project",
        "run",
        "step",
        "validation_id",
    ),
    "release.deprecated": ("model", "version", "reason"),
    "release.yanked": ("model", "version", "reason"),
    "alias.moved": (
        "model",
        "alias",
        "version",
        "previous",
        "request",
        "requested_by",
        "approved_by",
    ),
}
_REQUEST = (
    "model",
    "alias",
    "version",
    "request",
    "requested_by",
    "approved_by",
    "approvals_needed",
    "state",
    "expires_at",
)
FIELDS.update({k: _REQUEST for k in ("alias.requested", "alias.approved", "alias.rejected")})
FIELDS["alias.rejected"] = (*_REQUEST, "decision")
_TIMES = ("expires_at",)  # epoch seconds in the outbox, ISO 8601 in the body


def webhook_event(kind: str, payload: dict[str, Any]) -> str | None:
    """The webhook event an outbox event is, or None (not one subscribers receive)."""
    if kind == events.RELEASE_STATUS:
        return {"deprecated": "release.deprecated", "yanked": "release.yanked"}.get(
            str(payload.get("status"))
        )
    names: dict[str, str] = {
        events.CHECKPOINT_COMMITTED: "checkpoint.committed",
        events.CHECKPOINT_COLLECTED: "checkpoint.deleted",
        events.CHECKPOINT_VALIDATED: "validation.recorded",
        events.RELEASE_CREATED: "release.promoted",
        events.ALIAS_MOVED: "alias.moved",
        events.ALIAS_REQUESTED: "alias.requested",
        events.ALIAS_APPROVED: "alias.approved",
        events.ALIAS_REJECTED: "alias.rejected",
    }
    return names.get(kind)


def event_id(outbox_id: int, ts: float, kind: str) -> str:
    """One id per catalog event, the same for every subscriber and attempt."""
    digest = hashlib.sha256(f"{outbox_id}:{ts!r}:{kind}".encode()).hexdigest()
    return f"evt_{digest[:32]}"


def body(event: str, ident: str, occurred_at: float, payload: dict[str, Any]) -> str:
    """The exact text every attempt sends (signed as is)."""
    data = {k: payload.get(k) for k in FIELDS.get(event, ())}
    for k in _TIMES:
        if isinstance(data.get(k), int | float):
            data[k] = iso(data[k])
    document = {
        "schema": SCHEMA,
        "id": ident,
        "event": event,
        "occurred_at": iso(occurred_at),
        "data": data,
    }
    return json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)


def wanted(subscribed: list[str], event: str) -> bool:
    return "*" in subscribed or event in subscribed
