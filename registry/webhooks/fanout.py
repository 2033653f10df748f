"""The outbox's events, copied into one delivery row per subscriber that wants them.

A subscriber starts with the events from when the policy naming it took effect (applied to
the catalog, or the policy file's last change); none older reach it. Each pass reads the events
past the cursor and, again, those of the last `LOOKBACK_S` (a transaction can commit after one
with a higher id was read: its event is not skipped), skips what a delivery row already holds,
and adds the rest in one transaction with the cursor's move. The mirror's progress (`done_at`)
plays no part: webhooks are delivered whether or not MLflow is on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sqlalchemy import func
from sqlmodel import col, select

from registry.catalog.models import OutboxEvent
from registry.catalog.workflow_models import WebhookCursor, WebhookDelivery
from registry.timeutil import now
from registry.webhooks.events import body, event_id, wanted, webhook_event

if TYPE_CHECKING:
    from policies.loader import Webhook
    from registry.catalog.engine import Catalog

LOOKBACK_S = 120.0
BATCH = 1000


def fan_out(catalog: Catalog, hooks: list[Webhook], since: float | None = None) -> int:
    """Add the delivery rows due; how many were added. A subscriber seen for the first time
    starts with the events from `since` (when the policy naming it took effect; None: now)."""
    if not hooks:
        return 0
    added = 0
    with catalog.session(write=True) as s:
        at = now()
        start = at if since is None else min(at, since)
        cursors = {c.subscriber: c for c in s.exec(select(WebhookCursor))}
        for hook in hooks:
            if hook.name not in cursors:
                before = s.exec(
                    select(func.max(OutboxEvent.id)).where(col(OutboxEvent.ts) < start)
                ).one()
                cursors[hook.name] = WebhookCursor(
                    subscriber=hook.name, outbox_id=before or 0, since=start
                )
                s.add(cursors[hook.name])
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
                .order_by(col(OutboxEvent.id))
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
                ident = event_id(e.id or 0, e.ts, e.kind)
                s.add(
                    WebhookDelivery(
                        subscriber=hook.name,
                        event_id=ident,
                        event=name,
                        outbox_id=e.id or 0,
                        body=body(name, ident, e.ts, e.payload),
                        created_at=at,
                        next_attempt_at=at,
                    )
                )
                added += 1
            if ahead:
                cursor.outbox_id = max(cursor.outbox_id, ahead[-1].id or 0)
                s.add(cursor)
    return added
