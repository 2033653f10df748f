"""The results of the webhook methods; a protected alias's request is
`registry.api.results.releases.AliasRequest`."""

from __future__ import annotations

from registry.api.results.base import Result
from registry.api.results.checkpoints import RESULT


@RESULT
class WebhookInfo(Result):
    """A subscriber of the policy in force: where it is sent, whether the server can sign
    for it (its secret file's state, never the secret), and its deliveries by state."""

    name: str
    url: str
    events: list[str]
    allow_private: bool
    secret_file: str
    secret_ok: bool
    secret_problem: str | None
    pending: int
    delivered: int
    given_up: int
    last_error: str | None


@RESULT
class WebhookDeliveryInfo(Result):
    """One event's delivery to one subscriber: pending (retried), delivered or given-up."""

    id: int
    subscriber: str
    event: str
    event_id: str
    status: str
    attempts: int
    last_status: int | None
    last_error: str | None
    created_at: str
    next_attempt_at: str | None
    delivered_at: str | None


@RESULT
class WebhookTested(Result):
    """A signed `ping` sent to one subscriber now, and its reply."""

    name: str
    event_id: str
    ok: bool
    status: int | None
    seconds: float | None
    error: str | None


@RESULT
class WebhooksDelivered(Result):
    """A delivery run: what it delivered, failed attempts, what still waits."""

    delivered: int
    failed: int
    given_up: int
    pending: int
    busy: bool = False  # another deliverer held the lease: this one did nothing
    errors: list[str] | None = None
