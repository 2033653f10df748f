"""Delivering what is due: attempts, retries and backoff, one subscriber's queue at a time.

A delivery is attempted when due; a 2xx reply marks it delivered and it is never sent again.
Any other outcome records the attempt (status, a one-line error, never the reply's body) and
schedules the next: 2 s after the first failure, then doubling, at most 30 s apart. A delivery
still failing `GIVE_UP_S` after it was made is given up (`reg webhook deliveries` lists it).
Each subscriber's due deliveries go in order on a thread of their own, and a failure ends that
subscriber's turn in the pass: a receiver that is down or hangs delays only its own.

One deliverer at a time per registry (the `webhooks` lease): `reg server`'s background loop,
or embedded, the process a command starts when it wrote events and the policy has webhooks
(`core.detached.spawn_deliverer`, running `python -m registry.integrations.webhooks`), or
`reg webhook deliver`.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sqlalchemy import func, update
from sqlmodel import col, select

from registry.catalog import leases
from registry.catalog.workflow_models import DELIVERED, GIVEN_UP, PENDING, WebhookDelivery
from registry.core.timeutil import now
from registry.errors import RegistryError
from registry.integrations.webhooks import net
from registry.integrations.webhooks.fanout import fan_out
from registry.trust.audit_chain.macs import delivery_mac, same
from registry.trust.webhook_signatures import HEADER, read_secret, signature

if TYPE_CHECKING:
    from policies.loader import Webhook
    from registry.catalog.engine import Catalog

log = logging.getLogger("reg.webhooks")
LEASE = "webhooks"
FIRST_RETRY_S, MAX_BACKOFF_S = 2.0, 30.0
GIVE_UP_S = 3 * 86400.0
DUE_PER_PASS = 200
USER_AGENT = "reg-webhooks/1"
LEASE_MARGIN_S = net.CONNECT_S + net.DEADLINE_S + 30


@dataclass
class Pass:
    """What one or more passes did."""

    delivered: int = 0
    failed: int = 0
    given_up: int = 0
    added: int = 0
    errors: list[str] = field(default_factory=list)

    def add(self, other: Pass) -> None:
        self.delivered += other.delivered
        self.failed += other.failed
        self.given_up += other.given_up
        self.added += other.added
        self.errors += other.errors[-5:]


def backoff(attempts: int) -> float:
    """Seconds before the next attempt after `attempts` failed ones (1: the first)."""
    return float(min(MAX_BACKOFF_S, FIRST_RETRY_S * 2 ** max(0, attempts - 1)))


def headers_for(delivery_event: str, ident: str, text: str, secret: bytes) -> dict[str, str]:
    return {
        "Content-Type": "application/json",
        "User-Agent": USER_AGENT,
        "X-Reg-Event": delivery_event,
        "X-Reg-Delivery": ident,
        HEADER: signature(secret, int(time.time()), text),
    }


def run_pass(
    catalog: Catalog,
    hooks: list[Webhook],
    since: float | None = None,
    deadline: float | None = None,
    key: bytes | None = None,
) -> Pass:
    """Fan out, then attempt the deliveries due now; none is started after `deadline` (a
    monotonic time), so a pass ends at most one exchange (`net.DEADLINE_S`) after it."""
    out = Pass(added=fan_out(catalog, hooks, since, key))
    by_name = {h.name: h for h in hooks}
    with catalog.session() as s:
        due = list(
            s.exec(
                select(WebhookDelivery)
                .where(
                    WebhookDelivery.status == PENDING,
                    col(WebhookDelivery.next_attempt_at) <= now(),
                    col(WebhookDelivery.subscriber).in_(list(by_name)),
                )
                .order_by(col(WebhookDelivery.id))
                .limit(DUE_PER_PASS)
            )
        )
    queues: dict[str, list[WebhookDelivery]] = {}
    for d in due:
        queues.setdefault(d.subscriber, []).append(d)
    if not queues:
        return out
    with ThreadPoolExecutor(max_workers=min(8, len(queues))) as pool:
        done = pool.map(
            lambda n: _queue(catalog, by_name[n], queues[n], deadline, key), list(queues)
        )
        for result in done:
            out.add(result)
    return out


def _queue(
    catalog: Catalog,
    hook: Webhook,
    due: list[WebhookDelivery],
    deadline: float | None,
    key: bytes | None,
) -> Pass:
    out = Pass()
    secret, problem = None, ""
    try:
        secret = read_secret(hook.secret_file)
    except RegistryError as exc:
        problem = exc.message
    for d in due:
        if deadline is not None and time.monotonic() >= deadline:
            break  # the rest in the next pass: the lease and the caller's budget hold
        started = now()
        status = None
        if key is not None and not (
            d.body_mac and same(d.body_mac, delivery_mac(key, d.subscriber, d.event_id, d.body))
        ):  # written or changed around the server: never signed with the subscriber's secret
            _record(catalog, d, None, "its body is not the server's (MAC): not sent", started, True)
            out.given_up += 1
            continue
        try:
            if secret is None:
                raise net.SendError(problem)
            reply = net.post(
                hook.url,
                d.body.encode(),
                headers_for(d.event, d.event_id, d.body, secret),
                allow_private=hook.allow_private,
            )
            status = reply.status
            error = None
        except net.SendError as exc:
            status, error = exc.status, exc.message
        gave_up = _record(catalog, d, status, error, started)
        if error is None:
            out.delivered += 1
            continue
        out.failed += 1
        out.errors.append(f"{hook.name}: {error}")
        if gave_up:
            out.given_up += 1
        break  # the rest of this subscriber's queue waits for its next turn
    return out


def _record(
    catalog: Catalog,
    d: WebhookDelivery,
    status: int | None,
    error: str | None,
    at: float,
    give_up: bool = False,
) -> bool:
    """Record one attempt; whether the delivery is given up now."""
    attempts = d.attempts + 1
    values: dict[str, Any] = {"attempts": attempts, "last_status": status, "last_error": error}
    if error is None:
        values.update(status=DELIVERED, delivered_at=now(), last_error=None)
    elif give_up or at - d.created_at >= GIVE_UP_S:
        values.update(status=GIVEN_UP)
        give_up = True
    else:
        values.update(next_attempt_at=now() + backoff(attempts))
    with catalog.session(write=True) as s:
        s.exec(
            update(WebhookDelivery)
            .where(col(WebhookDelivery.id) == d.id, col(WebhookDelivery.status) == PENDING)
            .values(**values)
        )
    return give_up


def pending(catalog: Catalog, names: list[str]) -> tuple[int, float | None]:
    """How many deliveries of these subscribers wait, and when the first is due."""
    with catalog.session() as s:
        count, due = s.exec(
            select(func.count(), func.min(WebhookDelivery.next_attempt_at)).where(
                WebhookDelivery.status == PENDING, col(WebhookDelivery.subscriber).in_(names)
            )
        ).one()
    return int(count), due


def drain(
    catalog: Catalog,
    hooks: list[Webhook],
    budget_s: float,
    holder: str,
    since: float | None = None,
    key: bytes | None = None,
) -> dict[str, Any]:
    """Passes until nothing is pending or the budget is spent, holding the lease (another
    deliverer running: nothing is done)."""
    deadline = time.monotonic() + budget_s
    total = Pass()
    # held past the budget by at most one exchange (no send starts after the deadline)
    token, _ = leases.try_acquire(catalog, LEASE, holder, budget_s + LEASE_MARGIN_S)
    if token is None:
        left, _ = pending(catalog, [h.name for h in hooks])
        return {"delivered": 0, "failed": 0, "given_up": 0, "pending": left, "busy": True}
    try:
        while True:
            total.add(run_pass(catalog, hooks, since, deadline, key))
            left, due = pending(catalog, [h.name for h in hooks])
            if not left or due is None:
                break
            wait = max(0.2, due - now())
            if time.monotonic() + wait >= deadline:
                break
            time.sleep(min(wait, 1.0))
    finally:
        leases.release(catalog, LEASE, token)
    return {
        "delivered": total.delivered,
        "failed": total.failed,
        "given_up": total.given_up,
        "pending": left,
        "errors": total.errors[-5:],
    }
