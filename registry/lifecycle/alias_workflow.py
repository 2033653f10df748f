"""Moving aliases through their protection: every move of an alias, `reg alias set`,
`reg promote --alias`, the API and the server alike, goes through `change_alias`.

An alias the policy protects (`[[protected_aliases]]`, `policies.workflow`) does not move when
asked: a request is opened (`registry.lifecycle.alias_requests`) and the alias moves in the
transaction of the last approval it needs. Approvers are checked against the policy in force at
approval time; the requester never approves their own request (four eyes), and an approval that
names a version approves only that version.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

from sqlmodel import select

from policies.access import Action, check_grants
from policies.workflow import named_by, protection_for
from registry.catalog.models import ACTIVE, Alias, Model, Release
from registry.catalog.workflow_models import APPROVED, OPEN, REJECTED
from registry.core.refs import ReleaseRef, check_alias, check_name, check_reason
from registry.errors import Conflict, NotFound, PermissionDenied, UsageError
from registry.lifecycle import alias_requests
from registry.lifecycle.releases import (
    _version_number,
    apply_alias_move,
    resolve_release,
)
from registry.lifecycle.views import ReleaseView
from registry.trust.principal import Principal

if TYPE_CHECKING:
    from sqlmodel import Session

    from policies.loader import Grant, ProtectedAlias
    from registry.lifecycle.alias_requests import Request
    from registry.lifecycle.context import Context

STATES = ("open", "approved", "rejected", "cancelled", "expired")
ADVISORY = (
    "embedded mode: names are asserted by each user's environment (REG_USER), not proven; "
    "run reg server for approvals that hold"
)


def check_may_move(ctx: Context, model_name: str, alias: str) -> None:
    """Before any work: where the alias is protected and its rule names requesters, refuse
    (audited) anyone else."""
    rule = _protection(ctx, model_name, alias)
    if (
        rule is not None
        and rule.requesters is not None
        and not _named(ctx, rule.requesters, model_name)
    ):
        raise _refused(ctx, "request", f"{model_name}@{alias}", rule.requesters)


def change_alias(
    ctx: Context, session: Session, model: Model, alias: str, release: Release
) -> dict[str, Any]:
    """Move `alias` to `release`, or open a request where the alias is protected (in the
    caller's transaction, after `check_may_move`): {"previous": vK or None} or
    {"request": ...}."""
    check_alias(alias)
    rule = _protection(ctx, model.name, alias)
    current = session.exec(
        select(Alias.release_id).where(Alias.model_id == model.id, Alias.name == alias)
    ).first()
    if rule is None or current == release.id:  # free, or there already (nothing moves)
        previous = apply_alias_move(ctx, session, model, alias, release)
        return {"previous": f"v{previous}" if previous else None}
    if rule.requesters is not None and not _named(ctx, rule.requesters, model.name):
        raise PermissionDenied(  # check_may_move refused it (audited) before the work
            f"{ctx.actor} may not request moves of {model.name}@{alias}",
            f"the policy's protected_aliases names {', '.join(rule.requesters)}",
        )
    if release.status != ACTIVE:
        raise Conflict(
            f"{model.name}:v{release.version} is {release.status}: a protected alias moves "
            "only to an active release",
            "choose an active version",
        )
    for waiting in alias_requests.load(ctx, session, model=model):
        same = (waiting.row.alias, waiting.row.version) == (alias, release.version)
        if same and waiting.state == OPEN:
            return {"request": _shown(ctx, waiting)}  # asked again: the same request
    request = alias_requests.open_request(ctx, session, model, alias, release, rule)
    return {"request": _shown(ctx, request)}


def set_alias(ctx: Context, model_name: str, alias: str, version: str | int) -> dict[str, Any]:
    """`reg alias set`: the release with `alias` and `previous`, or the request opened."""
    check_name(model_name, "model name")
    check_alias(alias)
    number = _version_number(version)
    ctx.authorize(Action.ALIAS, model=model_name, target=f"{model_name}@{alias}")
    check_may_move(ctx, model_name, alias)
    with ctx.catalog.session(write=True) as s:
        model, release = resolve_release(s, ReleaseRef(model_name, version=number))
        changed = change_alias(ctx, s, model, alias, release)
        if "request" in changed:
            return dict(changed["request"])
        out = ReleaseView.load(s, model, release, ctx.audit_key).to_json()
    out["alias"] = alias
    out["previous"] = changed["previous"]
    return out


def approve(ctx: Context, request_id: int, version: str | int | None = None) -> dict[str, Any]:
    """Approve request `request_id`; with `version`, only if that is the version it moves the
    alias to. The approval that completes it moves the alias."""
    expected = None if version is None else _version_number(version)
    request = _decidable(ctx, request_id)
    target = _target(request)
    if expected is not None and expected != request.row.version:
        raise Conflict(
            f"request {request.id} moves {target} to v{request.row.version}, not "
            f"v{expected}: an approval names the exact version",
            f"reg approve {request.id} --version v{request.row.version}, or ask for "
            f"v{expected} with reg alias set",
        )
    rule = _rule_in_force(ctx, request)
    if not _named(ctx, rule.approvers, request.model):
        raise _refused(ctx, "approve", target, rule.approvers, request=request.id)
    if ctx.actor == request.row.requested_by:
        raise _refused(
            ctx,
            "approve",
            target,
            rule.approvers,
            request=request.id,
            error=PermissionDenied(
                f"{ctx.actor} asked for request {request.id} and may not approve it",
                "four eyes: another approver must approve it",
            ),
        )
    with ctx.catalog.session(write=True) as s:
        # The release's row locked first (PostgreSQL; SQLite's write lock is the catalog's):
        # two approvals of one request, or an approval and a yank, take turns, so the one
        # that completes the request sees the other and moves the alias.
        release = s.get(Release, request.row.release_id, with_for_update=True)
        request = _decidable(ctx, request_id, s)  # again, under the lock
        if ctx.actor in request.approvers:
            raise Conflict(
                f"{ctx.actor} already approved request {request.id}",
                f"it waits for {request.row.approvals_needed - len(request.approvers)} more "
                "approval(s) from others",
            )
        model = s.get(Model, request.row.model_id)
        if release is None or model is None or release.status != ACTIVE:
            raise Conflict(
                f"{request.model}:v{request.row.version} is no longer active: request "
                f"{request.id} cannot move the alias",
                "reject it, and ask for an active version",
            )
        after = alias_requests.decide(ctx, s, request, APPROVED)
        # Counted: approvers the rule in force still names (a policy change since the request
        # applies to it), against the stricter of the request's count and the rule's.
        counted = [
            name
            for name in after.approvers
            if name == ctx.actor or _names(ctx, _recorded(ctx, name), rule.approvers, model.name)
        ]
        if len(counted) < max(request.row.approvals_needed, rule.approvals):
            return _shown(ctx, after)
        approval = {
            "request": request.id,
            "requested_by": request.row.requested_by,
            "approved_by": counted,
        }
        previous = apply_alias_move(ctx, s, model, request.row.alias, release, approval)
        out = _shown(ctx, replace(after, moved=True))
        out.update(moved=True, previous=f"v{previous}" if previous else None)
        return out


def reject(ctx: Context, request_id: int, reason: str) -> dict[str, Any]:
    """Turn request `request_id` down (an approver, or its requester withdrawing it)."""
    text = check_reason(reason, "rejection reason")
    if not (text and text.strip()):
        raise UsageError("a rejection needs a reason", "reg reject ID --reason TEXT")
    request = _decidable(ctx, request_id)
    rule = _rule_in_force(ctx, request)
    requester = ctx.actor == request.row.requested_by
    if not requester and not _named(ctx, rule.approvers, request.model):
        raise _refused(ctx, "reject", _target(request), rule.approvers, request=request.id)
    with ctx.catalog.session(write=True) as s:
        s.get(Release, request.row.release_id, with_for_update=True)  # as approve: in turn
        request = _decidable(ctx, request_id, s)
        return _shown(ctx, alias_requests.decide(ctx, s, request, REJECTED, text))


def list_requests(
    ctx: Context, model_name: str | None = None, *, state: str | None = None
) -> list[dict[str, Any]]:
    """The requests of the models the caller may read (one model's with `model_name`), oldest
    first; `state` keeps one state (open, approved, rejected, cancelled, expired)."""
    if state is not None and state not in STATES:
        raise UsageError(f"unknown state {state!r}", f"one of {', '.join(STATES)}")
    if model_name is not None:
        check_name(model_name, "model name")
        ctx.authorize_read(model=model_name)
    with ctx.catalog.session() as s:
        model = None
        if model_name is not None:
            model = s.exec(select(Model).where(Model.name == model_name)).first()
            if model is None:
                raise NotFound(f"model {model_name} not found", "reg releases lists the models")
        found = alias_requests.load(ctx, s, model=model)
    readable: dict[str, bool] = {}
    out = []
    for request in found:
        if request.model not in readable:
            readable[request.model] = ctx.principal.can_read(
                model=request.model, model_owner=ctx.model_owner(request.model)
            )
        if readable[request.model] and (state is None or request.state == state):
            out.append(_shown(ctx, request))
    return out


# -- helpers -----------------------------------------------------------------------------------


def _protection(ctx: Context, model: str, alias: str) -> ProtectedAlias | None:
    return protection_for(ctx.policy.rules.protected_aliases, model, alias)


def _rule_in_force(ctx: Context, request: Request) -> ProtectedAlias:
    rule = _protection(ctx, request.model, request.row.alias)
    if rule is None:
        raise Conflict(
            f"{request.model}@{request.row.alias} is no longer protected: request "
            f"{request.id} has nothing to decide",
            f"reg alias set {request.model} {request.row.alias} v{request.row.version}",
        )
    return rule


def _decidable(ctx: Context, request_id: int, session: Session | None = None) -> Request:
    """The open request `request_id` the caller may read (NotFound, or Conflict naming its
    state); read in `session` where given (the write transaction that decides it)."""
    if (
        isinstance(request_id, bool)
        or not isinstance(request_id, int)
        or not 0 < request_id < 2**31
    ):
        raise UsageError(f"bad request id {request_id!r}", "reg requests lists them")
    if session is None:
        with ctx.catalog.session() as s:
            found = alias_requests.load(ctx, s, request_id=request_id)
        if found:
            ctx.authorize_read(model=found[0].model)
    else:
        found = alias_requests.load(ctx, session, request_id=request_id)
    if not found:
        raise NotFound(f"request {request_id} not found", "reg requests lists them")
    request = found[0]
    if request.state != OPEN:
        closing = request.closing
        by = f" by {closing.by}" if closing else ""
        raise Conflict(
            f"request {request.id} is {request.state}{by}: nothing to decide",
            "it moved the alias already"
            if request.state == APPROVED
            else f"ask again: reg alias set {request.model} {request.row.alias} "
            f"v{request.row.version}",
        )
    return request


def _named(ctx: Context, entries: list[str], model: str) -> bool:
    """Does the policy name this Context's principal among `entries` for `model`?"""
    return _names(ctx, ctx.principal, entries, model)


def _recorded(ctx: Context, name: str) -> Principal:
    """An approver recorded earlier, with what the policy in force grants that name now."""
    return Principal.under(name, "recorded approval", ctx.policy)


def _names(ctx: Context, principal: Principal, entries: list[str], model: str) -> bool:
    owner = None if principal.single_user else ctx.model_owner(model)

    def covers(grant: Grant) -> bool:
        return check_grants(
            [grant], principal.name, Action.READ, model=model, model_owner=owner
        ).allowed

    return named_by(
        entries, principal.name, principal.grants, single_user=principal.single_user, covers=covers
    )


def _refused(
    ctx: Context,
    what: str,
    target: str,
    entries: list[str],
    *,
    error: PermissionDenied | None = None,
    **details: Any,
) -> PermissionDenied:
    """The refusal, audited in a transaction of its own (the caller holds none open)."""
    error = error or PermissionDenied(
        f"{ctx.actor} may not {what} moves of the protected alias {target}",
        f"the policy's protected_aliases names {', '.join(entries)}",
    )
    with ctx.catalog.session(write=True) as s:
        ctx.audit(s, f"alias-{what}", target, "denied", reason=error.message, **details)
    return error


def _target(request: Request) -> str:
    return f"{request.model}@{request.row.alias}"


def _shown(ctx: Context, request: Request) -> dict[str, Any]:
    out = request.to_json()
    if not ctx.server:
        out["advisory"] = ADVISORY
    return out
