"""Requests to move a protected alias, and the decisions on them: the records.

A request names the exact version; its state is derived, never stored:

    approved   the alias moved: in the transaction of the approval that made enough distinct
               approvers (never the requester) that the rule in force still names, at least
               `approvals_needed` and the rule's own count (`alias_workflow.approve`)
    rejected   an approver, or the requester, turned it down (with a reason)
    cancelled  its version was yanked or deprecated
    expired    none of these before `expires_at`
    open       otherwise

Rows are append-only (migration 0019). Behind `reg server` each carries the server's MAC
(`registry.trust.signed_facts`): a request or decision written around the server is ignored (an
approval forged into the catalog never counts). Every request and decision is audited,
journaled (`alias-request`, `alias-decision`) and an outbox event (`alias.requested`,
`alias.approved`, `alias.rejected`), which webhooks deliver. The commands that open and decide
them are `registry.lifecycle.alias_workflow`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from sqlmodel import Session, col, select

from registry.catalog.models import AliasEvent
from registry.catalog.models import Model as ModelRow
from registry.catalog.workflow_models import (
    APPROVED,
    CANCELLED,
    EXPIRED,
    OPEN,
    REJECTED,
    AliasDecision,
    AliasRequest,
)
from registry.core.timeutil import iso, now
from registry.journal import outbox as events
from registry.journal.event import ALIAS_DECISION, ALIAS_REQUEST
from registry.journal.write import record as journal_record
from registry.trust import signed_facts as facts

if TYPE_CHECKING:
    from policies.loader import ProtectedAlias
    from registry.catalog.models import Model, Release
    from registry.lifecycle.context import Context


@dataclass(frozen=True)
class Request:
    """A request with its (trusted) decisions, as of `at`."""

    row: AliasRequest
    model: str
    decisions: tuple[AliasDecision, ...]
    at: float
    moved: bool = False  # an alias move names it: it was approved

    @property
    def id(self) -> int:
        return self.row.id or 0

    @property
    def approvers(self) -> list[str]:
        """Who approved, in order, once each; the requester never counts."""
        seen: list[str] = []
        for d in self.decisions:
            if d.decision == APPROVED and d.by != self.row.requested_by and d.by not in seen:
                seen.append(d.by)
        return seen

    @property
    def closing(self) -> AliasDecision | None:
        """The rejection or cancellation that closed it, if any."""
        return next((d for d in self.decisions if d.decision in (REJECTED, CANCELLED)), None)

    @property
    def state(self) -> str:
        if self.moved:
            return APPROVED
        closing = self.closing
        if closing is not None:
            return closing.decision
        return EXPIRED if self.at >= self.row.expires_at else OPEN

    def to_json(self) -> dict[str, Any]:
        closing = self.closing
        return {
            "request": self.id,
            "model": self.model,
            "alias": self.row.alias,
            "version": self.row.version,
            "release": f"{self.model}:v{self.row.version}",
            "state": self.state,
            "requested_by": self.row.requested_by,
            "requested_at": iso(self.row.requested_at),
            "expires_at": iso(self.row.expires_at),
            "approvals_needed": self.row.approvals_needed,
            "approved_by": self.approvers,
            "closed_by": closing.by if closing else None,
            "reason": closing.reason if closing else None,
            "rule": self.row.rule,
        }


def load(
    ctx: Context,
    session: Session,
    *,
    request_id: int | None = None,
    model: Model | None = None,
    release_id: int | None = None,
) -> list[Request]:
    """The requests asked for (one by id, a model's, a release's), oldest first. Behind the
    server only requests and decisions with a valid MAC are seen."""
    stmt = select(AliasRequest, ModelRow.name).join(
        ModelRow, col(ModelRow.id) == AliasRequest.model_id
    )
    if request_id is not None:
        stmt = stmt.where(AliasRequest.id == request_id)
    if model is not None:
        stmt = stmt.where(AliasRequest.model_id == model.id)
    if release_id is not None:
        stmt = stmt.where(AliasRequest.release_id == release_id)
    rows = list(session.exec(stmt.order_by(col(AliasRequest.id))))
    if not rows:
        return []
    ids = [r.id for r, _ in rows if r.id is not None]
    decided = list(
        session.exec(
            select(AliasDecision)
            .where(col(AliasDecision.request_id).in_(ids))
            .order_by(col(AliasDecision.id))
        )
    )
    if ctx.server:
        rows, decided = _signed(ctx, session, rows, decided)
    by_request: dict[int, list[AliasDecision]] = {}
    for d in decided:
        by_request.setdefault(d.request_id, []).append(d)
    moved = set(
        session.exec(select(AliasEvent.request_id).where(col(AliasEvent.request_id).in_(ids)))
    )
    at = now()
    return [
        Request(r, name, tuple(by_request.get(r.id or 0, ())), at, r.id in moved)
        for r, name in rows
    ]


def _signed(
    ctx: Context,
    session: Session,
    rows: list[tuple[AliasRequest, str]],
    decided: list[AliasDecision],
) -> tuple[list[tuple[AliasRequest, str]], list[AliasDecision]]:
    key = ctx.audit_key
    if key is None:
        return [], []
    good = facts.signed_ids(
        session,
        key,
        facts.ALIAS_REQUEST,
        {r.id: facts.alias_request_content(r) for r, _ in rows if r.id is not None},
    )
    good_decisions = facts.signed_ids(
        session,
        key,
        facts.ALIAS_DECISION,
        {d.id: facts.alias_decision_content(d) for d in decided if d.id is not None},
    )
    return (
        [(r, n) for r, n in rows if r.id in good],
        [d for d in decided if d.id in good_decisions and d.request_id in good],
    )


def open_request(
    ctx: Context, session: Session, model: Model, alias: str, release: Release, rule: ProtectedAlias
) -> Request:
    """Ask for `alias` of `model` to move to `release` (in the caller's transaction)."""
    at = now()
    row = AliasRequest(
        model_id=model.id or 0,
        alias=alias,
        version=release.version,
        release_id=release.id or 0,
        requested_by=ctx.actor,
        requested_at=at,
        expires_at=at + rule.expires,
        approvals_needed=rule.approvals,
        rule=rule.alias,
    )
    session.add(row)
    session.flush()
    if ctx.audit_key is not None:
        facts.sign(
            session,
            ctx.audit_key,
            facts.ALIAS_REQUEST,
            row.id or 0,
            facts.alias_request_content(row),
            signed_by=ctx.actor,
        )
    request = Request(row, model.name, (), at)
    ctx.audit(
        session,
        "alias-request",
        f"{model.name}@{alias}",
        request=request.id,
        to=f"v{release.version}",
        approvals=rule.approvals,
        expires_at=iso(row.expires_at),
    )
    ctx.events.emit(session, events.ALIAS_REQUESTED, **_payload(request))
    journal_record(
        ctx,
        session,
        ALIAS_REQUEST,
        {"model": model.name, "version": release.version},
        {
            "alias": alias,
            "request": request.id,
            "expires_at": row.expires_at,
            "approvals": rule.approvals,
        },
        ts=at,
    )
    return request


def decide(
    ctx: Context, session: Session, request: Request, decision: str, reason: str | None = None
) -> Request:
    """Record `decision` (approved, rejected, cancelled) by this Context's principal."""
    at = now()
    row = AliasDecision(
        request_id=request.id, decision=decision, by=ctx.actor, at=at, reason=reason
    )
    session.add(row)
    session.flush()
    if ctx.audit_key is not None:
        facts.sign(
            session,
            ctx.audit_key,
            facts.ALIAS_DECISION,
            row.id or 0,
            facts.alias_decision_content(row),
            signed_by=ctx.actor,
        )
    after = Request(request.row, request.model, (*request.decisions, row), at)
    action = {APPROVED: "alias-approve", REJECTED: "alias-reject", CANCELLED: "alias-cancel"}
    ctx.audit(
        session,
        action[decision],
        f"{request.model}@{request.row.alias}",
        request=request.id,
        to=f"v{request.row.version}",
        reason=reason,
        state=after.state,
    )
    kind = events.ALIAS_APPROVED if decision == APPROVED else events.ALIAS_REJECTED
    ctx.events.emit(session, kind, **_payload(after), decision=decision)
    journal_record(
        ctx,
        session,
        ALIAS_DECISION,
        {"model": request.model, "version": request.row.version},
        {
            "alias": request.row.alias,
            "request": request.id,
            "decision": decision,
            "reason": reason,
        },
        ts=at,
    )
    return after


def cancel_for_release(
    ctx: Context, session: Session, model: Model, release: Release, status: str
) -> list[int]:
    """Cancel every open request to move an alias to `release`, which was just yanked or
    deprecated (in that transaction); the ids cancelled."""
    cancelled = []
    for request in load(ctx, session, release_id=release.id):
        if request.state == OPEN:
            decide(ctx, session, request, CANCELLED, f"{model.name}:v{release.version} {status}")
            cancelled.append(request.id)
    return cancelled


def _payload(request: Request) -> dict[str, Any]:
    return {
        "model": request.model,
        "alias": request.row.alias,
        "version": request.row.version,
        "request": request.id,
        "requested_by": request.row.requested_by,
        "approved_by": request.approvers,
        "approvals_needed": request.row.approvals_needed,
        "state": request.state,
        "expires_at": request.row.expires_at,
    }
