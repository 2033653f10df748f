"""The release workflow's commands: requests to move protected aliases (`reg requests`,
`reg approve`, `reg reject`) and webhooks (`reg webhook ls|test|deliveries|deliver`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from cli.common import JSON_OPTION, open_registry
from cli.render import emit_json, note, table

if TYPE_CHECKING:
    from registry.api.results import AliasRequest

webhook_app = typer.Typer(
    help="Webhook subscribers of the policy and their deliveries (admin).", no_args_is_help=True
)


def register(app: typer.Typer) -> None:
    app.command("requests")(requests)
    app.command("approve")(approve)
    app.command("reject")(reject)
    app.add_typer(webhook_app, name="webhook")
    webhook_app.command("ls")(webhook_ls)
    webhook_app.command("test")(webhook_test)
    webhook_app.command("deliveries")(webhook_deliveries)
    webhook_app.command("deliver")(webhook_deliver)


def show_request(out: AliasRequest) -> None:
    """One request as a person reads it."""
    target = f"{out.model}@{out.alias} -> v{out.version}"
    if out.moved:
        was = f" (was {out.previous})" if out.previous else ""
        print(f"{target}: approved by {', '.join(out.approved_by)}; moved{was}")
    elif out.state == "open":
        waiting = out.approvals_needed - len(out.approved_by)
        print(
            f"request {out.request}: {target} waits for {waiting} approval(s) "
            f"(not {out.requested_by}) until {out.expires_at}"
            + (f"; approved so far by {', '.join(out.approved_by)}" if out.approved_by else "")
        )
        print(f"  approve: reg approve {out.request} --version v{out.version}")
    else:
        by = f" by {out.closed_by}" if out.closed_by else ""
        reason = f": {out.reason}" if out.reason else ""
        print(f"request {out.request}: {target} is {out.state}{by}{reason}")
    if out.advisory:
        note(out.advisory)


def requests(
    name: str | None = typer.Argument(None, help="Model name (default: every model you read)."),
    state: str | None = typer.Option(
        None, "--state", help="open, approved, rejected, cancelled or expired."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Requests to move protected aliases, oldest first: who asked, for which version, who
    approved, and what they wait for."""
    with open_registry() as reg:
        found = reg.alias_requests(name, state)
    if json_output:
        emit_json(found)
        return
    table(
        ("ID", "MOVE", "STATE", "REQUESTED BY", "APPROVED BY", "NEEDS", "EXPIRES"),
        [
            (
                r.request,
                f"{r.model}@{r.alias} -> v{r.version}",
                r.state,
                r.requested_by,
                ", ".join(r.approved_by) or "-",
                r.approvals_needed,
                r.expires_at,
            )
            for r in found
        ],
    )


def approve(
    request: int = typer.Argument(..., help="The request's id (reg requests)."),
    version: str | None = typer.Option(
        None, "--version", help="vK: approve only if the request moves the alias to vK."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Approve a request to move a protected alias (never your own). The last approval it
    needs moves the alias."""
    with open_registry() as reg:
        out = reg.approve(request, version)
    emit_json(out) if json_output else show_request(out)


def reject(
    request: int = typer.Argument(..., help="The request's id (reg requests)."),
    reason: str = typer.Option(..., "--reason", help="Why (recorded and shown)."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Turn a request down (an approver), or withdraw your own."""
    with open_registry() as reg:
        out = reg.reject(request, reason)
    emit_json(out) if json_output else show_request(out)


def webhook_ls(json_output: bool = JSON_OPTION) -> None:
    """The policy's subscribers: URL, events, whether the server can sign for them, and their
    deliveries by state."""
    with open_registry() as reg:
        found = reg.webhooks()
    if json_output:
        emit_json(found)
        return
    table(
        ("NAME", "URL", "EVENTS", "SECRET", "PENDING", "DELIVERED", "GIVEN UP", "LAST ERROR"),
        [
            (
                w.name,
                w.url,
                ",".join(w.events),
                "ok" if w.secret_ok else w.secret_problem,
                w.pending,
                w.delivered,
                w.given_up,
                w.last_error or "-",
            )
            for w in found
        ],
    )


def webhook_test(
    name: str = typer.Argument(..., help="The subscriber's name (reg webhook ls)."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Send a signed `ping` event to one subscriber now and show its reply."""
    with open_registry() as reg:
        out = reg.test_webhook(name)
    if json_output:
        emit_json(out)
    elif out.ok:
        print(f"{name}: HTTP {out.status} in {out.seconds:.2f} s (event {out.event_id})")
    else:
        print(f"{name}: failed: {out.error}")
    if not out.ok:
        raise typer.Exit(1)


def webhook_deliveries(
    name: str | None = typer.Option(None, "--name", help="One subscriber's."),
    status: str | None = typer.Option(None, "--status", help="pending, delivered or given-up."),
    limit: int = typer.Option(50, "--limit", min=1, max=10000, help="The newest N."),
    json_output: bool = JSON_OPTION,
) -> None:
    """Deliveries, newest first: status, attempts and the last error (never a reply's body)."""
    with open_registry() as reg:
        found = reg.webhook_deliveries(name, status, limit)
    if json_output:
        emit_json(found)
        return
    table(
        ("ID", "SUBSCRIBER", "EVENT", "EVENT ID", "STATUS", "ATTEMPTS", "LAST", "LAST ERROR"),
        [
            (
                d.id,
                d.subscriber,
                d.event,
                d.event_id,
                d.status,
                d.attempts,
                d.last_status or "-",
                d.last_error or "-",
            )
            for d in found
        ],
    )


def webhook_deliver(
    budget: float = typer.Option(
        60.0, "--budget", min=1, max=3600, help="Seconds to keep retrying what is due."
    ),
    json_output: bool = JSON_OPTION,
) -> None:
    """Deliver what is pending now (embedded; `reg server` does it on its own): for a cron
    job, or after a receiver came back."""
    with open_registry() as reg:
        out = reg.deliver_webhooks(budget)
    emit_json(out) if json_output else print(
        f"delivered {out.delivered}, failed attempts {out.failed}, pending {out.pending}"
    )
