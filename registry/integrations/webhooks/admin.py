"""What `reg webhook ls|test|deliveries|deliver` show and do (admin: subscribers and their
secrets are the server's; behind it, secrets never leave it, and only their state is shown)."""

from __future__ import annotations

import json
import time
import uuid
from typing import TYPE_CHECKING, Any

from sqlalchemy import func
from sqlmodel import col, select

from policies.access import Action
from registry.catalog.workflow_models import DELIVERED, GIVEN_UP, PENDING, WebhookDelivery
from registry.core.timeutil import iso
from registry.errors import NotFound, RegistryError, UsageError
from registry.integrations.webhooks import net
from registry.integrations.webhooks.deliver import drain, headers_for
from registry.integrations.webhooks.events import PING, SCHEMA
from registry.trust.webhook_signatures import read_secret

if TYPE_CHECKING:
    from policies.loader import Webhook
    from registry.lifecycle.context import Context

STATUSES = (PENDING, DELIVERED, GIVEN_UP)
SERVER_BUDGET_S = 30.0  # a request that drains through the server waits at most this


def subscribers(ctx: Context) -> list[dict[str, Any]]:
    ctx.authorize(Action.POLICY, target="webhooks")
    hooks = ctx.policy.rules.webhooks
    with ctx.catalog.session() as s:
        counts = {
            (name, status): n
            for name, status, n in s.exec(
                select(WebhookDelivery.subscriber, WebhookDelivery.status, func.count()).group_by(
                    col(WebhookDelivery.subscriber), col(WebhookDelivery.status)
                )
            )
        }
        errors = {}
        for hook in hooks:
            last = s.exec(
                select(WebhookDelivery.last_error)
                .where(
                    WebhookDelivery.subscriber == hook.name,
                    col(WebhookDelivery.last_error).is_not(None),
                )
                .order_by(col(WebhookDelivery.id).desc())
                .limit(1)
            ).first()
            errors[hook.name] = last
    out = []
    for hook in hooks:
        try:
            read_secret(hook.secret_file)
            problem = None
        except RegistryError as exc:
            problem = exc.message
        out.append(
            {
                "name": hook.name,
                "url": hook.url,
                "events": list(hook.events),
                "allow_private": hook.allow_private,
                "secret_file": hook.secret_file,
                "secret_ok": problem is None,
                "secret_problem": problem,
                "pending": counts.get((hook.name, PENDING), 0),
                "delivered": counts.get((hook.name, DELIVERED), 0),
                "given_up": counts.get((hook.name, GIVEN_UP), 0),
                "last_error": errors.get(hook.name),
            }
        )
    return out


def deliveries(
    ctx: Context, name: str | None = None, status: str | None = None, limit: int = 50
) -> list[dict[str, Any]]:
    ctx.authorize(Action.POLICY, target="webhook deliveries")
    if status is not None and status not in STATUSES:
        raise UsageError(f"unknown status {status!r}", f"one of {', '.join(STATUSES)}")
    if not 1 <= limit <= 10_000:
        raise UsageError(f"limit {limit} is not in 1..10000")
    stmt = select(WebhookDelivery).order_by(col(WebhookDelivery.id).desc()).limit(limit)
    if name is not None:
        stmt = stmt.where(WebhookDelivery.subscriber == name)
    if status is not None:
        stmt = stmt.where(WebhookDelivery.status == status)
    with ctx.catalog.session() as s:
        rows = list(s.exec(stmt))
    return [
        {
            "id": d.id,
            "subscriber": d.subscriber,
            "event": d.event,
            "event_id": d.event_id,
            "status": d.status,
            "attempts": d.attempts,
            "last_status": d.last_status,
            "last_error": d.last_error,
            "created_at": iso(d.created_at),
            "next_attempt_at": iso(d.next_attempt_at) if d.status == PENDING else None,
            "delivered_at": iso(d.delivered_at),
        }
        for d in rows
    ]


def test(ctx: Context, name: str) -> dict[str, Any]:
    """POST a signed `ping` to subscriber `name` now (not through the outbox)."""
    ctx.authorize(Action.POLICY, target=f"webhook {name}")
    hook = _named(ctx, name)
    ident = f"evt_ping_{uuid.uuid4().hex[:24]}"

    text = json.dumps(
        {
            "schema": SCHEMA,
            "id": ident,
            "event": PING,
            "occurred_at": iso(time.time()),
            "data": {"subscriber": hook.name, "by": ctx.actor},
        },
        sort_keys=True,
        separators=(",", ":"),
    )
    out: dict[str, Any] = {"name": name, "event_id": ident}
    try:
        secret = read_secret(hook.secret_file)
        reply = net.post(
            hook.url,
            text.encode(),
            headers_for(PING, ident, text, secret),
            allow_private=hook.allow_private,
        )
        out.update(ok=True, status=reply.status, seconds=reply.seconds, error=None)
    except RegistryError as exc:
        out.update(ok=False, status=None, seconds=None, error=exc.message)
    except net.SendError as exc:
        out.update(ok=False, status=exc.status, seconds=None, error=exc.message)
    with ctx.catalog.session(write=True) as s:
        ctx.audit(s, "webhook-test", f"webhook {name}", status=out["status"], error=out["error"])
    return out


def deliver_now(ctx: Context, budget_s: float) -> dict[str, Any]:
    ctx.authorize(Action.POLICY, target="webhook deliveries")
    if not 0 < budget_s <= 3600:
        raise UsageError(f"budget {budget_s} s is not in (0, 3600]")
    if ctx.server:
        budget_s = min(budget_s, SERVER_BUDGET_S)
    hooks, since = ctx.policy.rules.webhooks, ctx.policy.since
    out = drain(ctx.catalog, hooks, budget_s, ctx.actor, since, ctx.audit_key)
    return {k: out.get(k, 0) for k in ("delivered", "failed", "given_up", "pending")} | {
        "busy": bool(out.get("busy")),
        "errors": list(out.get("errors", [])),
    }


def _named(ctx: Context, name: str) -> Webhook:
    for hook in ctx.policy.rules.webhooks:
        if hook.name == name:
            return hook
    names = ", ".join(h.name for h in ctx.policy.rules.webhooks) or "none"
    raise NotFound(f"no webhook named {name!r} in the policy in force", f"webhooks: {names}")
