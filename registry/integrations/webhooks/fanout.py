"""The outbox's events, copied into one delivery row per subscriber that wants them.

A subscriber starts with the events from when the policy naming it took effect (applied to
the catalog, or the policy file's last change); none older reach it. Each pass reads the events
past the cursor and, again, those of the last `LOOKBACK_S` (a transaction can commit after one
with a higher id was read: its event is not skipped), skips what a delivery row already holds,
and adds the rest in one transaction with the cursor's move. The mirror's progress (`done_at`)
plays no part: webhooks are delivered whether or not MLflow is on.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from sqlalchemy import func
from sqlmodel import col, select

from registry.catalog.models import OutboxEvent
from registry.catalog.workflow_models import WebhookCursor, WebhookDelivery
from registry.core.timeutil import now
from registry.integrations.webhooks.events import body, event_id, wanted, webhook_event
from registry.trust.audit_chain.macs import delivery_mac, outbox_mac, same

if TYPE_CHECKING:
    from policies.loader import Webhook
    from registry.catalog.engine import Catalog

log = logging.getLogger("reg.webhooks")
LOOKBACK_S = 120.0
BATCH = 1000


def fan_out(
    catalog: Catalog,
    hooks: list[Webhook],
    since: float | None = None,
    key: bytes | None = None,
) -> int:
    """Add the delivery rows due; how many were added. A subscriber seen for the first time
    starts with the events from `since` (when the policy naming it took effect; None: now).
    With the server's `key`, only events whose MAC verifies are delivered (one written around
    the server is logged and skipped), and each body gets a MAC of its own."""
    if not hooks:
        return 0
    added = 0
    with catalog.session(write=True) as s:
        at = now()
        start = at if since is None else min(at, since)
        cursors = {c.subscriber: c for c in s.exec(select(WebhookCursor))}
        for hook in hooks:
            known = cursors.get(hook.name)
            if known is None or known.url != hook.url:  # new, or the name sends elsewhere now
                begin = start if known is None else at
                before = s.exec(
                    select(func.max(OutboxEvent.id)).where(col(OutboxEvent.ts) < begin)
                ).one()
                cursor = known or WebhookCursor(
                    subscriber=hook.name, outbox_id=0, since=begin, url=hook.url
                )
                cursor.outbox_id, cursor.since, cursor.url = before or 0, begin, hook.url
                cursors[hook.name] = cursor
                s.add(cursor)
        live = list(hooks)
        low = min(cursors[h.name].outbox_id for h in live)
        ahead = list(
            s.exec(
                select(OutboxEvent)
                .where(col(OutboxEvent.id) > low)
                .order_by(col(OutboxEvent.id))
                .limit(BATCH)
            )
        )
        late = list(  # committed after a higher id was read: within the lookback
            s.exec(
                select(OutboxEvent)
                .where(col(OutboxEvent.id) <= low, col(OutboxEvent.ts) >= at - LOOKBACK_S)
                .order_by(col(OutboxEvent.id).desc())  # the newest: the likeliest late ones
                .limit(BATCH)
            )
        )
        found = late + ahead
        for hook in live:
            cursor = cursors[hook.name]
            mine = [e for e in found if e.ts >= cursor.since]
            have = set(
                s.exec(
                    select(WebhookDelivery.outbox_id).where(
                        WebhookDelivery.subscriber == hook.name,
                        col(WebhookDelivery.outbox_id).in_([e.id for e in mine]),
                    )
                )
            )
            for e in mine:
                name = webhook_event(e.kind, e.payload)
                if e.id in have or name is None or not wanted(hook.events, name):
                    continue
                if key is not None and not _signed(key, e):
                    continue
                ident = f"evt_{e.uid}" if e.uid else event_id(e.id or 0, e.ts, e.kind)
                text = body(name, ident, e.ts, e.payload)
                s.add(
                    WebhookDelivery(
                        subscriber=hook.name,
                        event_id=ident,
                        event=name,
                        outbox_id=e.id or 0,
                        body=text,
                        body_mac=delivery_mac(key, hook.name, ident, text) if key else None,
                        created_at=at,
                        next_attempt_at=at,
                    )
                )
                added += 1
            if ahead:
                cursor.outbox_id = max(cursor.outbox_id, ahead[-1].id or 0)
                s.add(cursor)
    return added


_SKIPPED: set[int] = set()


def _signed(key: bytes, e: OutboxEvent) -> bool:
    """Whether the event is one the server emitted (its MAC verifies); logged once if not."""
    if e.uid and e.mac and same(e.mac, outbox_mac(key, e.uid, e.ts, e.kind, e.payload)):
        return True
    if e.id not in _SKIPPED:
        _SKIPPED.add(e.id or 0)
        log.warning(
            json.dumps(
                {
                    "outbox_event": e.id,
                    "kind": e.kind,
                    "webhooks": "not delivered: unsigned or its MAC does not verify "
                    "(written around the server, or altered)",
                }
            )
        )
    return False
